"""slimgrad.step_in_backward (issue 30): the loops users write, against the same plain loop.

Each exact row runs one loop shape on two copies of a model, one with ``torch.optim.<Opt>`` and
one with the handle, and compares the parameters and the optimizer state bit for bit after every
step. Loops the handle cannot follow (a gradient the plain loop would still hold: no zero_grad(),
no step(), accumulation without ``accumulate=``) are refused at the first hook of the backward
that would differ, before any change. NOTE [The gradients the plain loop still holds] and NOTE
[What a step is, and what is refused] in ``slimgrad/step_in_backward.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import slimgrad

step_in_backward = slimgrad.step_in_backward
V, H = 11, 6


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)  # tied: input table and output head
        self.l1 = nn.Linear(H, H)
        self.sometimes = nn.Linear(H, H)  # in forward on even steps only
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-dim

    def forward(self, x: torch.Tensor, use: bool = True) -> torch.Tensor:
        h = torch.tanh(self.l1(self.emb(x))) * self.scale
        if use:
            h = h + self.sometimes(h)
        return torch.logsumexp(h @ self.emb.weight.T, -1).mean()


def _net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _batch(i: int) -> torch.Tensor:
    return torch.randint(0, V, (3, 4), generator=torch.Generator().manual_seed(50 + i))


def _same(a: nn.Module, b: nn.Module, oa=None, ob=None) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert_close(q, p, rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")
    if oa is not None:
        sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
        assert sa.keys() == sb.keys()
        for k in sa:
            for name, v in sa[k].items():
                if torch.is_tensor(v):
                    assert_close(sb[k][name], v, rtol=0, atol=0)
                else:
                    assert sb[k][name] == v


def _snap(m: nn.Module, opt) -> tuple:
    return (
        [p.detach().clone() for p in m.parameters()],
        copy.deepcopy(opt.state_dict()["state"]),
    )


def _unchanged(before: tuple, m: nn.Module, opt) -> None:
    params, state = before
    for p, q in zip(params, m.parameters(), strict=True):
        assert_close(q, p, rtol=0, atol=0)
    now = opt.state_dict()["state"]
    assert now.keys() == state.keys()
    for k in state:
        for name, v in state[k].items():
            assert_close(now[k][name], v, rtol=0, atol=0)


_OPTS = {
    "sgd-momentum-wd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adam-foreach": (torch.optim.Adam, dict(lr=1e-2, foreach=True)),
}


# the loop shapes: where the gradients are zeroed, and by whom
def _zero_end_opt(set_to_none):
    def loop(m, opt, i):
        m(_batch(i), use=i % 2 == 0).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)

    return loop


def _zero_start_opt(set_to_none):
    def loop(m, opt, i):
        opt.zero_grad(set_to_none=set_to_none)
        m(_batch(i), use=i % 2 == 0).backward()
        opt.step()

    return loop


def _zero_model(set_to_none, at_start):
    # HF Trainer's loop: optimizer.step(), then model.zero_grad()
    def loop(m, opt, i):
        if at_start:
            m.zero_grad(set_to_none=set_to_none)
        m(_batch(i), use=i % 2 == 0).backward()
        opt.step()
        if not at_start:
            m.zero_grad(set_to_none=set_to_none)

    return loop


def _zero_by_hand(m, opt, i):
    m(_batch(i), use=i % 2 == 0).backward()
    opt.step()
    for p in m.parameters():
        p.grad = None


_LOOPS = {
    "opt.zero_grad-end": _zero_end_opt(True),
    "opt.zero_grad-end-in-place": _zero_end_opt(False),
    "opt.zero_grad-start": _zero_start_opt(True),
    "opt.zero_grad-start-in-place": _zero_start_opt(False),
    "model.zero_grad-end": _zero_model(True, False),
    "model.zero_grad-end-in-place": _zero_model(False, False),
    "model.zero_grad-start": _zero_model(True, True),
    "model.zero_grad-start-in-place": _zero_model(False, True),
    "grad=None-by-hand": _zero_by_hand,
}


@pytest.mark.parametrize("opt_name", list(_OPTS))
@pytest.mark.parametrize("loop_name", list(_LOOPS))
def test_loop_is_the_plain_loop_bit_for_bit(loop_name, opt_name):
    """In-place zeroing keeps a zero tensor in ``.grad``: the plain step() then updates a
    parameter that got no gradient (``sometimes`` on odd steps: momentum, weight decay, Adam's
    moments); the handle does the same at the end of that backward."""
    cls, kw = _OPTS[opt_name]
    loop = _LOOPS[loop_name]
    a, b = _net(), _net()
    opt = cls(a.parameters(), **kw)
    handle = step_in_backward(b, cls, **kw)
    for i in range(5):
        loop(a, opt, i)
        loop(b, handle, i)
        _same(a, b, opt, handle)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_accumulation_over_k_micro_batches(set_to_none):
    cls, kw = torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)
    a, b = _net(), _net()
    opt = cls(a.parameters(), **kw)
    handle = step_in_backward(b, cls, accumulate=3, **kw)
    for step in range(3):
        for m, o in ((a, opt), (b, handle)):
            for k in range(3):
                (m(_batch(3 * step + k), use=(step + k) % 2 == 0) / 3).backward()
            o.step()
            o.zero_grad(set_to_none=set_to_none)
        _same(a, b, opt, handle)


def test_a_disabled_grad_scaler_loop_is_the_plain_loop():
    cls, kw = torch.optim.AdamW, dict(lr=1e-2)
    a, b = _net(), _net()
    opt = cls(a.parameters(), **kw)
    handle = step_in_backward(b, cls, **kw)
    sa, sb = torch.amp.GradScaler("cpu", enabled=False), torch.amp.GradScaler("cpu", enabled=False)
    for i in range(4):
        for m, o, s in ((a, opt, sa), (b, handle, sb)):
            s.scale(m(_batch(i), use=i % 2 == 0)).backward()
            s.step(o)
            s.update()
            o.zero_grad()
        _same(a, b, opt, handle)


def test_an_enabled_grad_scaler_loop_is_refused_before_any_change():
    b = _net()
    handle = step_in_backward(b, torch.optim.SGD, lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    before = _snap(b, handle)
    with pytest.raises(NotImplementedError, match=r"a live enabled torch.amp.GradScaler"):
        scaler.scale(b(_batch(0))).backward()
    _unchanged(before, b, handle)
    assert all(p.grad is None for p in b.parameters())
    del scaler


# --- loops the handle cannot follow: refused before any change ------------------------------
@pytest.mark.parametrize("opt_name", list(_OPTS))
def test_step_without_zero_grad_is_refused_at_the_next_backward(opt_name):
    """The plain loop without zero_grad() sums every step's gradients into the next step; the
    handle freed them. The first step is the plain loop's; the second backward is refused."""
    cls, kw = _OPTS[opt_name]
    a, b = _net(), _net()
    opt = cls(a.parameters(), **kw)
    handle = step_in_backward(b, cls, **kw)
    for m, o in ((a, opt), (b, handle)):
        m(_batch(0)).backward()
        o.step()
    _same(a, b, opt, handle)
    before = _snap(b, handle)
    with pytest.raises(
        RuntimeError,
        match=r"^slimgrad\.step_in_backward: the gradients of the last step were not zeroed "
        r"\(no zero_grad\(\) since step\(\)\).*; expected opt\.zero_grad\(\) or "
        r"model\.zero_grad\(\) .*, got \d+ parameters still holding the last step's gradient\. ",
    ):
        b(_batch(1)).backward()
    _unchanged(before, b, handle)
    # the loop, mended, goes on as the plain loop
    for m, o in ((a, opt), (b, handle)):
        o.zero_grad()
        m(_batch(1)).backward()
        o.step()
        o.zero_grad()
    _same(a, b, opt, handle)


def test_a_gradient_scaled_instead_of_zeroed_is_refused():
    # ``p.grad.mul_(0.9)`` after step(): the plain loop carries 0.9 x the last gradient
    b = _net()
    handle = step_in_backward(b, torch.optim.SGD, lr=0.1, momentum=0.9)
    b(_batch(0)).backward()
    handle.step()
    with torch.no_grad():
        for p in b.parameters():
            p.grad.mul_(0.9)
    before = _snap(b, handle)
    with pytest.raises(RuntimeError, match=r"the gradients of the last step were not zeroed"):
        b(_batch(1)).backward()
    _unchanged(before, b, handle)


def test_a_loop_without_step_or_zero_grad_is_refused_at_the_second_backward():
    b = _net()
    handle = step_in_backward(b, torch.optim.AdamW, lr=1e-2)
    b(_batch(0)).backward()
    before = _snap(b, handle)
    with pytest.raises(RuntimeError, match=r"a second backward in one step \(no step\(\) since"):
        b(_batch(1)).backward()
    _unchanged(before, b, handle)
    assert all(p.grad is None for p in b.parameters())


def test_accumulation_without_accumulate_is_refused_at_the_second_micro_batch():
    b = _net()
    handle = step_in_backward(b, torch.optim.SGD, lr=0.1)
    handle.zero_grad()
    b(_batch(0)).backward()
    before = _snap(b, handle)
    with pytest.raises(RuntimeError, match=r"a second backward in one step"):
        b(_batch(1)).backward()
    _unchanged(before, b, handle)


def test_zero_grad_between_backward_and_step_is_refused():
    # the plain loop discards these gradients and its step() does nothing; here they were
    # applied in backward (late: stated in NOTE [What a step is, and what is refused])
    b = _net()
    handle = step_in_backward(b, torch.optim.SGD, lr=0.1)
    b(_batch(0)).backward()
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) after a backward that updated"):
        handle.zero_grad()


def test_a_second_step_without_backward():
    """The plain loop's second step() applies what ``.grad`` holds again: nothing after
    set_to_none, a zero gradient after in-place zeroing (momentum, weight decay), the same
    gradient when nothing zeroed it (refused: it was freed)."""
    cls, kw = torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)
    for set_to_none in (True, False):
        a, b = _net(), _net()
        opt = cls(a.parameters(), **kw)
        handle = step_in_backward(b, cls, **kw)
        for m, o in ((a, opt), (b, handle)):
            m(_batch(0)).backward()
            o.step()
            o.zero_grad(set_to_none=set_to_none)
            o.step()
            o.step()
        _same(a, b, opt, handle)
    b = _net()
    handle = step_in_backward(b, cls, **kw)
    b(_batch(0)).backward()
    handle.step()
    before = _snap(b, handle)
    with pytest.raises(RuntimeError, match=r"second step\(\) would apply them again"):
        handle.step()
    _unchanged(before, b, handle)


def test_in_place_zeroing_keeps_the_plain_sign_of_zero():
    """After ``zero_grad(set_to_none=False)`` the plain gradient is ``0 + g``: a -0.0 in g
    becomes +0.0, and SGD's ``p - lr * g`` keeps a -0.0 parameter element -0.0 only then."""
    for zero in ("opt", "model"):
        ps = []
        for use_handle in (False, True):
            p = nn.Parameter(torch.tensor([-0.0, 1.0, -0.0]))
            if use_handle:
                o = step_in_backward([p], torch.optim.SGD, lr=0.5)
            else:
                o = torch.optim.SGD([p], lr=0.5)
            for _ in range(2):
                (p * torch.tensor([0.0, 1.0, 0.0])).sum().neg().backward()  # g: -0.0, -1, -0.0
                o.step()
                if zero == "opt":
                    o.zero_grad(set_to_none=False)
                else:
                    with torch.no_grad():
                        p.grad.zero_()
            ps.append(p.detach().clone())
        assert torch.equal(torch.signbit(ps[1]), torch.signbit(ps[0])), (zero, ps)
        assert_close(ps[1], ps[0], rtol=0, atol=0)


def test_the_marker_after_step_costs_no_gradient_bytes():
    """Between step() and zero_grad() a marked ``.grad`` holds no gradient's bytes: every marker
    of a dtype and device shares one stored zero and one index column."""
    b = _net()
    handle = step_in_backward(b, torch.optim.SGD, lr=0.1)
    b(_batch(0)).backward()
    handle.step()
    grads = [p.grad for p in b.parameters()]
    assert all(g is not None and g.is_sparse and g._nnz() == 1 for g in grads)
    assert len({g._values().data_ptr() for g in grads}) == 1
    assert all(g.to_dense().count_nonzero() == 0 for g in grads)
    handle.zero_grad()
    assert all(p.grad is None for p in b.parameters())
    handle.remove()


def test_remove_clears_the_markers():
    b = _net()
    handle = step_in_backward(b, torch.optim.SGD, lr=0.1)
    b(_batch(0)).backward()
    handle.step()
    handle.remove()
    assert all(p.grad is None for p in b.parameters())


def test_autograd_grad_between_step_and_zero_grad_is_not_a_step():
    # torch.autograd.grad leaves .grad alone: the markers stay, nothing is refused
    b = _net()
    handle = step_in_backward(b, torch.optim.SGD, lr=0.1)
    b(_batch(0)).backward()
    handle.step()
    marks = [p.grad for p in b.parameters()]
    torch.autograd.grad(b(_batch(1)), list(b.parameters()))
    assert all(p.grad is g for p, g in zip(b.parameters(), marks, strict=True))
    handle.zero_grad()
    b(_batch(1)).backward()
    handle.step()
    handle.zero_grad()
