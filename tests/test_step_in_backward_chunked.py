"""slimgrad.step_in_backward by pieces (issue 17): chunked optimizer updates and the untied LM
head updated by vocabulary blocks inside the fused loss's backward.

NOTE [Chunked updates] in ``slimgrad/step_in_backward.py`` and NOTE [Head gradient by vocabulary
blocks] in ``slimgrad/_math/linear_cross_entropy.py``. Every exactness test compares against the
plain loop ``loss.backward(); opt.step(); opt.zero_grad()`` bit for bit, over 5 steps.
"""

from __future__ import annotations

import copy
import importlib
import sys

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import slimgrad
from slimgrad import memory
from slimgrad.ops.linear_cross_entropy import linear_cross_entropy
from tests._gc_frozen import older_objects_frozen  # noqa: F401  (autouse)

lce_ops = importlib.import_module("slimgrad.ops.linear_cross_entropy")
step_in_backward = slimgrad.step_in_backward
_sib = sys.modules["slimgrad.step_in_backward"]

# the optimizers and options the chunked update is proven for (NOTE [Chunked updates])
PROVEN = [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01)),
    (torch.optim.SGD, dict(lr=0.1, weight_decay=0.01)),  # no momentum: no state
    (torch.optim.Adam, dict(lr=1e-2)),
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, maximize=True)),
]
_IDS = [f"{c.__name__}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for c, kw in PROVEN]


def _same(a: nn.Module, b: nn.Module) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert_close(q, p, rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")


# ---------------------------------------------------------------- the elementwise update by pieces
class _Big(nn.Module):
    # one large parameter whose gradient is c (a new random tensor with elements of very
    # different magnitudes each step), and a small one
    def __init__(self, n: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(n))
        self.b = nn.Parameter(torch.randn(3))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w * c).sum() + self.b.square().sum()


def _coef(n: int, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + i)
    scale = torch.pow(10.0, torch.randint(-6, 4, (n,), generator=g).float())
    return torch.randn(n, generator=g) * scale


def _side_by_side(a, opt, b, handle, n: int, steps: int) -> None:
    # the plain loop on a, step_in_backward on b: step by step, on the same coefficients
    for i in range(steps):
        for model, o in ((a, opt), (b, handle)):
            model(_coef(n, i)).backward()
            o.step()
            o.zero_grad()


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize(("cls", "kw"), PROVEN, ids=_IDS)
@pytest.mark.parametrize(
    ("n", "chunk"),
    [
        # pieces unaligned to any vector width, a last partial piece; two threads split the
        # whole tensor (and the larger pieces) elsewhere
        (70_001, 33_331),
        (4_100, 64),  # many aligned pieces, a 4-element last one
    ],
)
def test_chunked_update_is_the_whole_update(monkeypatch, cls, kw, foreach, n, chunk):
    """The optimizer's update of a large parameter applied piece by piece (views of parameter,
    gradient and state; the step counter advanced once) gives the bits of the whole-tensor
    update, over 5 steps, at pieces aligned and unaligned to the vector width."""
    monkeypatch.setattr(_sib, "CHUNK_ELEMS", chunk)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        kw = {**kw, "foreach": foreach}
        a, b = _Big(n), _Big(n)
        opt = cls(a.parameters(), **kw)
        handle = step_in_backward(b, cls, **kw)
        pieces = []
        real = handle._update_range
        monkeypatch.setattr(
            handle, "_update_range", lambda *args: (pieces.append(args[2:4]), real(*args))
        )
        _side_by_side(a, opt, b, handle, n, 5)
        _same(a, b)
        assert_close(handle.state_dict()["state"], opt.state_dict()["state"], rtol=0, atol=0)
    finally:
        torch.set_num_threads(threads)
    # steps 2..5 went by pieces (the first creates the state from the whole gradient), except
    # SGD without momentum, which has no state and goes by pieces from the first step
    per_step = -(-n // chunk)
    stateless = cls is torch.optim.SGD and not kw.get("momentum")
    assert len(pieces) == per_step * (5 if stateless else 4)
    assert pieces[per_step - 1] == ((per_step - 1) * chunk, n)


@pytest.mark.parametrize("recover", ["step", "step-after-a-drop"])
@pytest.mark.parametrize(("cls", "kw"), [PROVEN[0], PROVEN[6]], ids=[_IDS[0], _IDS[6]])
def test_an_update_by_pieces_that_raised_midway_is_finished_once(monkeypatch, cls, kw, recover):
    """An optimizer step pre-hook raises at the second of three pieces (bucket_bytes=0): the
    first piece was applied. A retried ``step()`` applies the other two, from the same gradient,
    and the step counter once: the plain loop's one update. Before, it applied the whole update
    again, the first piece twice. A gradient dropped since (``zero_grad()``, refused after the
    fact, then a new backward) is whole again."""
    monkeypatch.setattr(_sib, "CHUNK_ELEMS", 8)
    n = 20  # pieces of 8, 8 and 4 elements
    a, b = _Big(n), _Big(n)
    opt = cls(a.parameters(), **kw)
    handle = step_in_backward(b, cls, bucket_bytes=0, **kw)
    _side_by_side(a, opt, b, handle, n, 1)  # the first step creates the state: whole
    calls = [0]

    def pre(*args) -> None:
        calls[0] += 1
        if calls[0] == 3:  # (the small parameter's update, then the first piece)
            raise RuntimeError("simulated error in a step pre-hook")

    hook = handle.optimizer.register_step_pre_hook(pre)
    with pytest.raises(RuntimeError, match="simulated error in a step pre-hook"):
        b(_coef(n, 1)).backward()
    assert b.w.grad is not None
    if recover == "step-after-a-drop":
        with pytest.raises(RuntimeError, match=r"zero_grad\(\) after a backward that updated"):
            handle.zero_grad()  # the first piece stays applied: the plain loop goes on from b
        a.load_state_dict(b.state_dict())
        opt.load_state_dict(copy.deepcopy(handle.state_dict()))
        b(_coef(n, 2)).backward()
        a(_coef(n, 2)).backward()
    else:
        a(_coef(n, 1)).backward()
    hook.remove()
    for o in (opt, handle):
        o.step()
        o.zero_grad()
    _side_by_side(a, opt, b, handle, n, 2)
    _same(a, b)
    assert_close(handle.state_dict()["state"], opt.state_dict()["state"], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("cls", "kw", "why"),
    [
        (torch.optim.RMSprop, dict(lr=1e-2), "not proven"),
        (torch.optim.Adagrad, dict(lr=1e-2), "not proven"),
    ],
)
def test_unproven_cases_update_whole(monkeypatch, cls, kw, why):
    monkeypatch.setattr(_sib, "CHUNK_ELEMS", 997)
    n = 5_000
    a, b = _Big(n), _Big(n)
    opt = cls(a.parameters(), **kw)
    handle = step_in_backward(b, cls, **kw)
    called = []
    monkeypatch.setattr(handle, "_update_range", lambda *args: called.append(args))
    _side_by_side(a, opt, b, handle, n, 3)
    _same(a, b)
    assert not called, why


def test_fused_adam_is_not_chunked(monkeypatch):
    handle = step_in_backward(_Big(10), torch.optim.Adam, lr=1e-2, fused=True)
    p = handle.param_groups[0]["params"][0]
    handle.state[p] = {
        "step": torch.tensor(1.0),
        "exp_avg": torch.zeros_like(p),
        "exp_avg_sq": torch.zeros_like(p),
    }
    assert not handle._chunkable(p)
    handle.param_groups[0]["fused"] = False
    assert handle._chunkable(p)


# ------------------------------------------------------------------- the head by vocabulary blocks
VOCAB, HID = 300, 24


class _LM(nn.Module):
    # an untied LM head through the fused loss; ``tied`` uses the embedding as the head
    def __init__(self, tied: bool = False, bias: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, HID)
        self.l1 = nn.Linear(HID, HID)
        self.head = nn.Linear(HID, VOCAB, bias=bias)
        if tied:
            self.head.weight = self.emb.weight
        self.beside = 0.0

    def forward(self, x: torch.Tensor, t: torch.Tensor, **kw) -> torch.Tensor:
        h = torch.tanh(self.l1(self.emb(x)))
        loss = linear_cross_entropy(h, self.head.weight, t, self.head.bias, **kw)
        if self.beside:
            loss = loss + self.beside * self.head.weight.square().sum()
        return loss


def _tokens(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + i)
    x = torch.randint(0, VOCAB, (3, 7), generator=g)
    t = torch.randint(0, VOCAB, (3, 7), generator=g)
    t[0, :2] = -100
    return x, t


def _run(model, opt, steps=5, **kw):
    for i in range(steps):
        model(*_tokens(i), **kw).backward()
        opt.step()
        opt.zero_grad()


def _spy_rows(monkeypatch, handle) -> list:
    taken = []
    real = handle._take_rows

    def spy(p, node):
        r = real(p, node)
        taken.append(r is not None)
        return r

    monkeypatch.setattr(handle, "_take_rows", spy)
    return taken


@pytest.fixture
def rows97(monkeypatch):
    # blocks of 97 rows: 97 x 24 elements, unaligned to any vector width; a last block of 9 rows
    monkeypatch.setattr(lce_ops, "vocab_block_rows", lambda hidden_size: 97)


@pytest.mark.parametrize(
    ("cls", "kw", "foreach"),
    # foreach alternates (both are covered for every optimizer by the test above)
    [(c, k, i % 2 == 1) for i, (c, k) in enumerate(PROVEN)],
    ids=[f"{n}-foreach={i % 2 == 1}" for i, n in enumerate(_IDS)],
)
def test_head_by_blocks_bit_identical(monkeypatch, rows97, cls, kw, foreach):
    kw = {**kw, "foreach": foreach}
    a, b = _LM(bias=True), _LM(bias=True)
    opt = cls(a.parameters(), **kw)
    handle = step_in_backward(b, cls, **kw)
    taken = _spy_rows(monkeypatch, handle)
    _run(a, opt, chunk_size=8)  # several token chunks per block too
    _run(b, handle, chunk_size=8)
    _same(a, b)
    # the first step creates the state from the whole gradient (SGD without momentum has none)
    stateless = cls is torch.optim.SGD and not kw.get("momentum")
    assert taken == [True] * 5 if stateless else taken == [False] + [True] * 4


@pytest.mark.parametrize(
    "kw",
    [
        dict(label_smoothing=0.1),
        dict(logit_scale=0.5, logit_softcap=3.0),
        dict(reduction="sum"),
    ],
)
def test_head_by_blocks_options(monkeypatch, rows97, kw):
    a, b = _LM(bias=True), _LM(bias=True)
    opt = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1)
    handle = step_in_backward(b, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    taken = _spy_rows(monkeypatch, handle)
    _run(a, opt, **kw)
    _run(b, handle, **kw)
    _same(a, b)
    assert taken == [False] + [True] * 4


def test_head_by_blocks_clip_grad_value(monkeypatch, rows97):
    a, b = _LM(), _LM()
    opt = torch.optim.SGD(a.parameters(), lr=0.5, momentum=0.9)
    handle = step_in_backward(b, torch.optim.SGD, lr=0.5, momentum=0.9, clip_grad_value=1e-3)
    taken = _spy_rows(monkeypatch, handle)
    for i in range(5):
        a(*_tokens(i)).backward()
        torch.nn.utils.clip_grad_value_(a.parameters(), 1e-3)
        opt.step()
        opt.zero_grad()
    _run(b, handle)
    _same(a, b)
    assert taken[1:] == [True] * 4


@pytest.mark.parametrize(
    "how",
    ["tied", "clip_norm", "unproven"],
)
def test_head_comes_back_whole_where_blocks_do_not_apply(monkeypatch, rows97, how):
    """A tied head (its gradient also comes from the embedding), per-parameter norm clipping
    (needs the whole gradient), accumulation, an unproven optimizer: the op returns dW whole and
    the usual hook updates it; the bits are the plain loop's."""
    tied = how == "tied"
    a, b = _LM(tied=tied), _LM(tied=tied)
    extra = {}
    cls, kw = torch.optim.AdamW, dict(lr=1e-2)
    if how == "clip_norm":
        extra = dict(clip_grad_norm_per_param=0.5)
    elif how == "unproven":
        cls = torch.optim.RMSprop
    opt = cls(a.parameters(), **kw)
    handle = step_in_backward(b, cls, **kw, **extra)
    taken = _spy_rows(monkeypatch, handle)
    for i in range(5):
        a(*_tokens(i)).backward()
        if how == "clip_norm":
            for p in a.parameters():
                torch.nn.utils.clip_grad_norm_([p], 0.5)
        opt.step()
        opt.zero_grad()
    _run(b, handle)
    _same(a, b)
    if tied:
        assert taken == []  # the op sees the embedding's path: no row path at all
    else:
        assert taken and not any(taken)


@pytest.mark.parametrize("hook", ["tensor", "post_accumulate"])
def test_a_head_another_hook_watches_comes_back_whole(monkeypatch, rows97, hook):
    """NOTE [A head weight another hook watches] in slimgrad/step_in_backward.py: a user's hook on
    the head weight sees its whole gradient, as in the plain loop (it got None, and a hook's
    scaling was lost: the head moved twice as far)."""
    a, b = _LM(), _LM()
    seen: tuple[list, list] = ([], [])

    def halve(got: list):
        return lambda g: (got.append(g is not None), g * 0.5)[1]

    def look(got: list):
        return lambda t: got.append(t.grad is not None)

    for m, got in zip((a, b), seen, strict=True):
        if hook == "tensor":
            m.head.weight.register_hook(halve(got))
        else:
            m.head.weight.register_post_accumulate_grad_hook(look(got))
    opt = torch.optim.SGD(a.parameters(), lr=0.5)
    handle = step_in_backward(b, torch.optim.SGD, lr=0.5)
    taken = _spy_rows(monkeypatch, handle)
    _run(a, opt)
    _run(b, handle)
    _same(a, b)
    assert seen[0] == seen[1] == [True] * 5
    assert taken and not any(taken)


def test_head_accumulate_two_comes_back_whole(monkeypatch, rows97):
    a, b = _LM(), _LM()
    opt = torch.optim.AdamW(a.parameters(), lr=1e-2)
    handle = step_in_backward(b, torch.optim.AdamW, lr=1e-2, accumulate=2)
    taken = _spy_rows(monkeypatch, handle)
    for m, o in ((a, opt), (b, handle)):
        for i in range(6):
            m(*_tokens(i)).backward()
            if i % 2:
                o.step()
                o.zero_grad()
    _same(a, b)
    assert taken and not any(taken)


def test_a_use_beside_the_loss_is_refused(monkeypatch, rows97):
    """loss + f(W): the op cannot see that use (it is beside it, not below it); its gradient
    arrives after the rows were updated, and the handle raises."""
    b = _LM()
    handle = step_in_backward(b, torch.optim.SGD, lr=0.1, momentum=0.9)
    _run(b, handle, steps=1)  # first step: state created, head whole
    b.beside = 1e-3
    with pytest.raises(RuntimeError, match=r"slimgrad.step_in_backward: a weight updated row by"):
        b(*_tokens(1)).backward()


class _LMBeside(_LM):
    # a small parameter beside the loss: its AccumulateGrad runs before the loss's node
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor, t: torch.Tensor, **kw) -> torch.Tensor:
        return super().forward(x, t, **kw) + 1e-3 * self.s.square().sum()


def test_an_optimizer_pre_hook_that_raises_in_a_block_is_a_raised_backward(monkeypatch, rows97):
    """An optimizer step pre-hook raises in the update of the head's first block of rows: a
    backward that raised inside the loss's node, after the small parameter beside the loss had
    its gradient (waiting in the bucket). The retried ``step()`` applies that gradient, as the
    plain loop's ``step()`` after that backward (``s`` holds its gradient, the others none).
    Before, the error was taken for one of the handle's refusals and dropped ``s``'s gradient."""
    a, b = _LMBeside(), _LMBeside()
    kw = dict(lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(a.parameters(), **kw)
    handle = step_in_backward(b, torch.optim.SGD, **kw)
    taken = _spy_rows(monkeypatch, handle)
    _run(a, opt, steps=1)
    _run(b, handle, steps=1)  # the first step creates the momentum buffers: the head whole
    armed = [True]

    def pre(*args) -> None:
        if armed[0]:
            armed[0] = False
            raise RuntimeError("simulated error in a step pre-hook")

    handle.optimizer.register_step_pre_hook(pre)
    x, t = _tokens(7)
    with pytest.raises(RuntimeError, match="simulated error in a step pre-hook"):
        b(x, t).backward()
    assert taken == [False, True]
    assert [n for n, p in b.named_parameters() if p.grad is not None] == ["s"]
    (a.s.grad,) = torch.autograd.grad(a(x, t), [a.s])  # the plain loop's .grad there
    for o in (opt, handle):
        o.step()  # the retry
        o.zero_grad()
    _run(a, opt, steps=2)
    _run(b, handle, steps=2)
    _same(a, b)
    assert all(p.grad is None for p in b.parameters())


def test_autograd_grad_and_backward_inputs_leave_the_head_alone(rows97):
    b = _LM()
    handle = step_in_backward(b, torch.optim.SGD, lr=0.1, momentum=0.9)
    _run(b, handle, steps=1)
    w0 = b.head.weight.detach().clone()
    ref = _LM()
    ref.load_state_dict(b.state_dict())
    x, t = _tokens(3)
    (gw,) = torch.autograd.grad(b(x, t), [b.head.weight])
    (want,) = torch.autograd.grad(ref(x, t), [ref.head.weight])
    assert_close(gw, want, rtol=0, atol=0)
    assert torch.equal(b.head.weight, w0)
    b(x, t).backward(inputs=[b.l1.weight])
    assert torch.equal(b.head.weight, w0) and b.head.weight.grad is None
    handle.step()
    handle.zero_grad()


def test_second_backward_over_a_retained_graph_is_stopped(rows97):
    b = _LM()
    handle = step_in_backward(b, torch.optim.SGD, lr=0.1, momentum=0.9)
    _run(b, handle, steps=1)
    loss = b(*_tokens(1))
    w0 = b.head.weight.clone()
    with pytest.raises(NotImplementedError, match=r"slimgrad.step_in_backward: backward\(retain"):
        loss.backward(retain_graph=True)
    assert torch.equal(b.head.weight, w0) and b.head.weight.grad is None
    del handle


# ----------------------------------------------------------------------- the op's row-wise backward
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(label_smoothing=0.2, reduction="sum"),
        dict(reduction="none"),
        dict(logit_softcap=2.0, logit_scale=1.5),
    ],
)
def test_row_path_gradients_match_eager(rows97, dtype, kw):
    torch.manual_seed(1)
    h = torch.randn(5, 11, HID, dtype=dtype, requires_grad=True)
    w = torch.randn(VOCAB, HID, dtype=dtype, requires_grad=True)
    b = torch.randn(VOCAB, dtype=dtype, requires_grad=True)
    t = torch.randint(0, VOCAB, (5, 11))
    t[1, 3:] = -100
    out = linear_cross_entropy(h, w, t, b, chunk_size=16, **kw)
    g = torch.randn_like(out) if out.dim() else None
    got = torch.autograd.grad(out, (h, w, b), g)

    def eager(h, w, b):
        z = torch.nn.functional.linear(h, w, b) * kw.get("logit_scale", 1.0)
        if kw.get("logit_softcap"):
            z = torch.tanh(z / kw["logit_softcap"]) * kw["logit_softcap"]
        return torch.nn.functional.cross_entropy(
            z.reshape(-1, VOCAB),
            t.reshape(-1),
            label_smoothing=kw.get("label_smoothing", 0.0),
            reduction=kw.get("reduction", "mean"),
        ).reshape(out.shape)

    want = torch.autograd.grad(eager(h, w, b), (h, w, b), g)
    for x, y in zip(got, want, strict=True):
        assert_close(x, y)


def test_row_path_in_full_precision_rows_offered_only_for_an_untied_head(monkeypatch):
    """The op walks the head by blocks in full precision, tied or not (the bits of the plain loop
    and of step_in_backward are the same code's); it offers the rows to the handle only for a
    weight that gets no other gradient below it (not a tied embedding)."""
    calls = []
    # the row path's two forms: by blocks, or one block of one chunk (NOTE [One block, one chunk])
    for name in ("_bwd_rows_torch", "_bwd_one_torch"):
        real = getattr(lce_ops, name)
        monkeypatch.setattr(
            lce_ops,
            name,
            lambda *a, real=real, **k: (calls.append(k["take_rows"]), real(*a, **k))[1],
        )
    x, t = _tokens(0)
    for tied in (False, True):
        m = _LM(tied=tied)
        handle = step_in_backward(m, torch.optim.SGD, lr=0.1)  # stateless: rows from step 1
        m(x, t).backward()
        handle.step()
        assert (calls[-1] is not None) == (not tied)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _LM()(x, t)
    loss.backward()
    assert len(calls) == 2  # low precision: the token-chunk backward


# ------------------------------------------------------------------------------- memory (exact)
def test_memory_no_full_head_gradient_alive(monkeypatch):
    """Exact tracker, after a warm-up step (optimizer state counts on neither side). Backward:
    with the head updated by blocks no allocation is as large as the head's gradient (a block's
    gradient is 1/8 of it); the plain loop allocates it whole. Whole step: the peak is below the
    plain loop's by at least the head gradient minus one block (the plain loop's peak holds every
    gradient; AdamW's also its two temporaries of the head's size)."""
    vocab, hid, rows = 4096, 32, 512
    monkeypatch.setattr(lce_ops, "vocab_block_rows", lambda hidden_size: rows)

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.l1 = nn.Linear(hid, hid)
            self.head = nn.Parameter(torch.randn(vocab, hid) * 0.1)

        def forward(self, h, t):
            # chunks of 4 tokens: the forward's logits (4096 x 4) are 1/8 of the head too
            return linear_cross_entropy(torch.tanh(self.l1(h)), self.head, t, chunk_size=4)

    h = torch.randn(16, hid)
    t = torch.randint(0, vocab, (16,))
    head_bytes = vocab * hid * 4
    block_bytes = rows * hid * 4

    def biggest_alloc(m):
        tl = m.timeline
        start = next(i for i, r in enumerate(tl) if r[0] >= m.backward_start)
        return max(b - a for (_, _, a), (_, _, b) in zip(tl[start - 1 :], tl[start:]))

    def build(make_opt):
        model = LM()
        opt = make_opt(model)

        def step():
            loss = model(h, t)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        step()
        return model, opt, step

    for cls, kw in ((torch.optim.SGD, dict(lr=0.1, momentum=0.9)), (torch.optim.AdamW, {})):
        model, opt, step = build(lambda m, c=cls, k=kw: step_in_backward(m, c, bucket_bytes=0, **k))
        sib_bwd = memory.measure(lambda m=model: m(h, t), module=model)
        opt.step()
        opt.zero_grad()
        sib = memory.measure(step, backward=False, module=model)
        model, opt, step = build(lambda m, c=cls, k=kw: c(m.parameters(), **k))
        plain_bwd = memory.measure(lambda m=model: m(h, t), module=model)
        opt.step()
        opt.zero_grad()
        plain = memory.measure(step, backward=False, module=model)
        assert biggest_alloc(sib_bwd) == block_bytes
        assert biggest_alloc(plain_bwd) == head_bytes
        assert sib.end_bytes == 0 and sib_bwd.end_bytes == 0
        assert sib.peak_bytes <= plain.peak_bytes - head_bytes + block_bytes


# ---------------------------------------------------------------------- converted HF Llama, untied
def test_converted_untied_llama_head_by_blocks_bit_identical(monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(lce_ops, "vocab_block_rows", lambda hidden_size: 37)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        vocab_size=211,
        tie_word_embeddings=False,
        attention_dropout=0.1,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).train()
    a = slimgrad.convert_(copy.deepcopy(base))
    b = slimgrad.convert_(copy.deepcopy(base))
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    opt = torch.optim.AdamW(a.parameters(), lr=1e-3, weight_decay=0.1)
    handle = step_in_backward(b, torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    taken = _spy_rows(monkeypatch, handle)
    for i in range(5):
        for m, o in ((a, opt), (b, handle)):
            torch.manual_seed(i)  # the same dropout masks on both sides
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()
    _same(a, b)
    assert taken == [False] + [True] * 4
    assert not torch.equal(b.lm_head.weight, base.lm_head.weight)
