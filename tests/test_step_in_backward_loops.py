"""slimgrad.step_in_backward (issue 30, class 5): the loops users write, against the plain loop.

Each exact row runs one loop shape on two copies of a model, one with ``torch.optim.<Opt>`` and
one with the handle, and compares the parameters and the optimizer state bit for bit after every
step. A loop the handle cannot follow (no ``zero_grad()`` after ``step()``: the plain loop sums
the steps' gradients; a second backward with no ``step()``: the plain loop sums them and steps
once) is refused at the first hook of the backward that would differ, before it changes anything
(parameters, optimizer state, ``.grad``). NOTE [What the loop did since the last update] in
``slimgrad/step_in_backward.py``.
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref

import pytest
import torch
from torch import nn
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint

import slimgrad
from tests._bitwise import Boom as _Boom
from tests._bitwise import assert_same_parameters, assert_same_state
from tests._gc_frozen import older_objects_frozen  # noqa: F401  (autouse)

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
    assert_same_parameters(a, b)
    if oa is not None:
        assert_same_state(oa.state_dict()["state"], ob.state_dict()["state"])


def _snap(m: nn.Module, opt) -> tuple:
    return (
        [p.detach().clone() for p in m.parameters()],
        [None if p.grad is None else p.grad.clone() for p in m.parameters()],
        copy.deepcopy(opt.state_dict()),
    )


def _unchanged(before: tuple, m: nn.Module, opt) -> None:
    params, grads, state = before
    for p, q in zip(params, m.parameters(), strict=True):
        assert_close(q, p, rtol=0, atol=0)
    for g, q in zip(grads, m.parameters(), strict=True):
        assert (g is None) == (q.grad is None)
        if g is not None:
            assert_close(q.grad, g, rtol=0, atol=0)
    now = opt.state_dict()
    assert now["param_groups"] == state["param_groups"]
    assert_same_state(state["state"], now["state"])


_OPTS = {
    "sgd-momentum-wd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adam-foreach": (torch.optim.Adam, dict(lr=1e-2, foreach=True)),
}


# --- the loop shapes the handle follows: where the gradients are zeroed, and by whom ----------
def _zero_end_opt(m, opt, i, set_to_none=True):
    m(_batch(i), use=i % 2 == 0).backward()
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)


def _zero_start_opt(m, opt, i, set_to_none=True):
    opt.zero_grad(set_to_none=set_to_none)
    m(_batch(i), use=i % 2 == 0).backward()
    opt.step()


def _zero_model_end(m, opt, i, set_to_none=True):
    # HF Trainer's loop: optimizer.step(), lr_scheduler.step(), model.zero_grad()
    m(_batch(i), use=i % 2 == 0).backward()
    opt.step()
    m.zero_grad(set_to_none=set_to_none)


def _zero_model_start(m, opt, i, set_to_none=True):
    m.zero_grad(set_to_none=set_to_none)
    m(_batch(i), use=i % 2 == 0).backward()
    opt.step()


def _in_place(loop):
    # zero_grad(set_to_none=False): .grad keeps a zero tensor, the plain step() updates a
    # parameter that got no gradient (``sometimes`` on odd steps: momentum, weight decay, Adam's
    # moments), and its next gradient is 0 + g (NOTE [Gradients zeroed in place])
    def run(m, opt, i):
        loop(m, opt, i, set_to_none=False)

    return run


def _zero_both(m, opt, i):
    # zeroed twice (opt at the start, model at the end): still one zeroing between steps
    opt.zero_grad()
    m(_batch(i), use=i % 2 == 0).backward()
    opt.step()
    m.zero_grad(set_to_none=True)


class _Wrapped:
    """accelerate's AcceleratedOptimizer / Lightning's LightningOptimizer, reduced to what they do
    with the optimizer they wrap: forward step() and zero_grad()."""

    def __init__(self, opt) -> None:
        self.optimizer = opt

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True):
        return self.optimizer.zero_grad(set_to_none=set_to_none)


def _wrapped(m, opt, i):
    w = _Wrapped(opt)
    w.zero_grad()
    m(_batch(i), use=i % 2 == 0).backward()
    w.step()


_LOOPS = {
    "opt.zero_grad-end": _zero_end_opt,
    "opt.zero_grad-start": _zero_start_opt,
    "model.zero_grad-end": _zero_model_end,
    "model.zero_grad-start": _zero_model_start,
    "opt-and-model": _zero_both,
    "wrapped-optimizer": _wrapped,
    "opt.zero_grad-end-in-place": _in_place(_zero_end_opt),
    "opt.zero_grad-start-in-place": _in_place(_zero_start_opt),
    "model.zero_grad-end-in-place": _in_place(_zero_model_end),
    "model.zero_grad-start-in-place": _in_place(_zero_model_start),
}


@pytest.mark.parametrize("opt_name", list(_OPTS))
@pytest.mark.parametrize("loop_name", list(_LOOPS))
def test_loop_is_the_plain_loop_bit_for_bit(loop_name, opt_name):
    cls, kw = _OPTS[opt_name]
    loop = _LOOPS[loop_name]
    a, b = _net(), _net()
    opt = cls(a.parameters(), **kw)
    handle = step_in_backward(b, cls, **kw)
    for i in range(5):
        loop(a, opt, i)
        loop(b, handle, i)
        _same(a, b, opt, handle)
    assert all(p.grad is None for p in b.parameters())


def test_a_trainer_like_loop_with_a_scheduler_is_the_plain_loop():
    # model.zero_grad() before the loop and after each step; the scheduler between
    cls, kw = torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)
    a, b = _net(), _net()
    opt = cls(a.parameters(), **kw)
    handle = step_in_backward(b, cls, **kw)
    for m, o in ((a, opt), (b, handle)):
        sched = torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
        m.zero_grad()
        for i in range(5):
            m(_batch(i), use=i % 2 == 0).backward()
            o.step()
            sched.step()
            m.zero_grad()
    _same(a, b, opt, handle)


@pytest.mark.parametrize("zero", ["by-hand", "no-step-calls"])
def test_check_loop_off_follows_a_loop_whose_every_backward_is_a_step(zero):
    """What the handle cannot see (``p.grad = None``; a loop without step()): declared with
    check_loop=False, every backward is one whole step."""
    cls, kw = torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)
    a, b = _net(), _net()
    opt = cls(a.parameters(), **kw)
    handle = step_in_backward(b, cls, check_loop=False, **kw)
    assert "zero_grad" not in b.__dict__  # nothing watched
    for i in range(5):
        _zero_end_opt(a, opt, i)
        b(_batch(i), use=i % 2 == 0).backward()
        if zero == "by-hand":
            handle.step()
            for p in b.parameters():
                p.grad = None
        _same(a, b, opt, handle)


def test_accumulate_cycles_are_the_plain_accumulation_loop():
    cls, kw = torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)
    a, b = _net(), _net()
    opt = cls(a.parameters(), **kw)
    handle = step_in_backward(b, cls, accumulate=3, **kw)
    for step in range(3):
        for m, o in ((a, opt), (b, handle)):
            if step % 2:
                m.zero_grad()  # zeroing at the start of a cycle too (the model's)
            for k in range(3):
                (m(_batch(3 * step + k), use=(step + k) % 2 == 0) / 3).backward()
            o.step()
            o.zero_grad()
        _same(a, b, opt, handle)


@pytest.mark.parametrize("first_in_checkpoint", [True, False])
def test_a_reentrant_checkpoint_is_one_backward(first_in_checkpoint):
    """A reentrant checkpoint's backward is a nested backward: when the handle's first hook runs
    inside it, the enclosing backward going on after it is the same step (it was refused as a
    second backward, after the checkpointed layers had updated)."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3))
    b = copy.deepcopy(a)
    opt = torch.optim.AdamW(a.parameters(), lr=1e-2)
    handle = step_in_backward(b, torch.optim.AdamW, lr=1e-2, bucket_bytes=0)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(3))
    for i in range(3):
        for m, o in ((a, opt), (b, handle)):
            if first_in_checkpoint:  # the last layers in the checkpoint: reached first
                y = checkpoint(m[2:], m[:2](x + i), use_reentrant=True)
            else:  # the first layers in the checkpoint: reached last
                y = m[2:](checkpoint(m[:2], (x + i).requires_grad_(), use_reentrant=True))
            y.square().mean().backward()
            o.step()
            o.zero_grad()
        _same(a, b, opt, handle)


# --- loops the handle cannot follow: refused before any change ------------------------------
@pytest.mark.parametrize("opt_name", list(_OPTS))
def test_step_without_zero_grad_is_refused_at_the_next_backward(opt_name):
    """The plain loop without zero_grad() sums every step's gradients into the next step; the
    handle freed them. The first step is the plain loop's; the second backward is refused, and
    the loop, mended, goes on as the plain loop."""
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
        match=r"^slimgrad\.step_in_backward: the gradients of the last step were not zeroed: no "
        r"zero_grad\(\) since step\(\); .*; expected handle\.zero_grad\(\), or zero_grad\(\) of "
        r"the module given to step_in_backward, between step\(\) and the next backward, got a "
        r"backward after step\(\) with no zero_grad\(\) seen\. Call handle\.zero_grad\(\) "
        r"after step\(\) .*check_loop=False\)\.$",
    ):
        b(_batch(1)).backward()
    _unchanged(before, b, handle)
    for m, o in ((a, opt), (b, handle)):
        o.zero_grad()
        for i in (1, 2):
            _zero_end_opt(m, o, i)
    _same(a, b, opt, handle)


def _by_hand(m, handle):
    for p in m.parameters():
        p.grad = None


def _by_submodule(m, handle):
    for c in m.children():
        c.zero_grad()


def _by_another_optimizer(m, handle):
    torch.optim.SGD(m.parameters(), lr=0.1).zero_grad()


def _by_the_model_of_a_param_list(m, handle):
    m.zero_grad()


_UNSEEN = {
    "p.grad=None": _by_hand,
    "submodules": _by_submodule,
    "another-optimizer": _by_another_optimizer,
    "model-of-a-param-list": _by_the_model_of_a_param_list,
}


@pytest.mark.parametrize("how", list(_UNSEEN))
def test_zeroing_the_handle_cannot_see_is_refused_before_any_change(how):
    """Once ``.grad`` is None, ``p.grad = None`` (or a zero_grad the handle does not watch)
    changes nothing it could observe: such a loop looks like one that never zeroes. Refused,
    the message names the fixes (handle.zero_grad(), or check_loop=False)."""
    b = _net()
    given = list(b.parameters()) if how == "model-of-a-param-list" else b
    handle = step_in_backward(given, torch.optim.SGD, lr=0.1, momentum=0.9)
    b(_batch(0)).backward()
    handle.step()
    _UNSEEN[how](b, handle)
    before = _snap(b, handle)
    with pytest.raises(RuntimeError, match=r"not zeroed.*check_loop=False"):
        b(_batch(1)).backward()
    _unchanged(before, b, handle)
    handle.zero_grad()
    _zero_end_opt(b, handle, 1)


@pytest.mark.parametrize("zero_first", [False, True])
def test_a_second_backward_without_step_is_refused_at_its_first_hook(zero_first):
    """Accumulation without accumulate=N, two losses backward'ed one by one, a loop without
    step(): refused at the second backward's first hook, before its first update, whether or not
    the loop called zero_grad()/step() before (the refusal came at step() when it had not, after
    the second backward had updated every parameter)."""
    b = _net()
    handle = step_in_backward(b, torch.optim.SGD, lr=0.1, momentum=0.9)
    if zero_first:
        handle.zero_grad()
    b(_batch(0)).backward()
    for second in (lambda: b(_batch(1)), lambda: b.l1.weight.sum() + b.sometimes.bias.sum()):
        before = _snap(b, handle)
        with pytest.raises(
            RuntimeError,
            match=r"^slimgrad\.step_in_backward: a second backward in one step: no step\(\) "
            r"since the last backward.*; expected step\(\) and zero_grad\(\) between two "
            r"backward calls, got a second backward after 6 parameters were updated\. ",
        ):
            second().backward()
        _unchanged(before, b, handle)
    handle.step()
    handle.zero_grad()
    _zero_end_opt(b, handle, 2)


def test_accumulate_n_refuses_a_backward_past_the_cycle_and_a_missing_zero_grad():
    b = _net()
    handle = step_in_backward(b, torch.optim.SGD, lr=0.1, accumulate=2)
    for i in range(2):
        b(_batch(i)).backward()
    before = _snap(b, handle)
    with pytest.raises(RuntimeError, match=r"a second backward in one step"):
        b(_batch(2)).backward()  # a third micro-batch: the plain loop adds it to the cycle's sum
    _unchanged(before, b, handle)
    handle.step()
    # no zero_grad(): the plain loop's next cycle would add to the last one's gradients
    before = _snap(b, handle)
    with pytest.raises(RuntimeError, match=r"not zeroed"):
        b(_batch(2)).backward()
    _unchanged(before, b, handle)
    handle.zero_grad()
    for i in (2, 3):
        b(_batch(i)).backward()
    handle.step()


def test_a_second_step_without_backward_is_refused_before_any_change():
    """The plain loop's second step() with the gradients not zeroed applies them again; the
    handle freed them. After zero_grad() a step() is the plain loop's no-op."""
    b = _net()
    handle = step_in_backward(b, torch.optim.SGD, lr=0.1, momentum=0.9)
    b(_batch(0)).backward()
    handle.step()
    before = _snap(b, handle)
    with pytest.raises(RuntimeError, match=r"a second step\(\) with no backward"):
        handle.step()
    _unchanged(before, b, handle)
    handle.zero_grad()
    handle.step()  # nothing held: the plain step() changes nothing either
    _unchanged(before, b, handle)


@pytest.mark.parametrize("by", ["handle", "model"])
def test_zero_grad_between_backward_and_step_is_refused(by):
    # the plain loop discards these gradients and its step() does nothing; here they were
    # applied in backward (late: NOTE [Every refusal changes nothing] lists it)
    b = _net()
    handle = step_in_backward(b, torch.optim.SGD, lr=0.1)
    b(_batch(0)).backward()
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) after a backward that updated"):
        (handle if by == "handle" else b).zero_grad()
    _zero_end_opt(b, handle, 1)  # the loop goes on


# --- the watch on the module's zero_grad ----------------------------------------------------
def test_the_module_watch_is_per_instance_and_remove_takes_it_off():
    b, other = _net(), _net()
    calls = []
    b.zero_grad = lambda set_to_none=True: calls.append(set_to_none)  # an earlier instance one
    handle = step_in_backward(b, torch.optim.SGD, lr=0.1)
    assert "zero_grad" not in other.__dict__  # the class is not patched
    b(_batch(0)).backward()
    handle.step()
    b.zero_grad(set_to_none=True)
    assert calls == [True]  # the earlier one still runs
    handle.remove()
    assert b.__dict__["zero_grad"] is not None and b.zero_grad.__class__.__name__ == "function"
    c = _net()
    handle = step_in_backward(c, torch.optim.SGD, lr=0.1)
    assert "zero_grad" in c.__dict__
    handle.remove()
    assert "zero_grad" not in c.__dict__  # as it was


def test_a_watched_model_saves_loads_and_copies():
    b = _net()
    step_in_backward(b, torch.optim.SGD, lr=0.1)
    buf = io.BytesIO()
    torch.save(b, buf)
    buf.seek(0)
    for m in (torch.load(buf, weights_only=False), copy.deepcopy(b)):
        m(_batch(0)).backward()
        assert m.emb.weight.grad is not None  # no handle: a plain model
        m.zero_grad()  # the class's zero_grad, bound to the copy
        assert all(p.grad is None for p in m.parameters())
        step_in_backward(m, torch.optim.SGD, lr=0.1)


# --- zero_grad(set_to_none=False) (NOTE [Gradients zeroed in place]) --------------------------
def test_in_place_zeroing_keeps_the_plain_sign_of_zero():
    """After zero_grad(set_to_none=False) the plain gradient is 0 + g: a -0.0 in g becomes +0.0,
    and SGD's p - lr * g keeps a -0.0 parameter element -0.0 only then (-0.0 - lr * -0.0 is
    +0.0). The first step's gradient is +0.0 there (p stays -0.0), the next ones' -0.0."""
    for zero in ("opt", "model"):
        ps = []
        for use_handle in (False, True):
            lin = nn.Module()
            lin.weight = nn.Parameter(torch.tensor([-0.0, 1.0, -0.0]))
            if use_handle:
                o = step_in_backward(lin, torch.optim.SGD, lr=0.5)
            else:
                o = torch.optim.SGD(lin.parameters(), lr=0.5)
            x = torch.tensor([0.0, 1.0, 0.0])
            for i in range(3):
                y = lin.weight * (x if i == 0 else -x)  # elementwise: g is x's sign of zero
                y.sum().backward()
                o.step()
                (o if zero == "opt" else lin).zero_grad(set_to_none=False)
            ps.append(lin.weight.detach().clone())
        assert torch.equal(torch.signbit(ps[1]), torch.signbit(ps[0])), (zero, ps)
        assert_close(ps[1], ps[0], rtol=0, atol=0)


def test_steps_with_nothing_new_after_in_place_zeroing_are_the_plain_loop():
    """The plain step() after zero_grad(set_to_none=False) and no backward applies the zero
    gradients (momentum, weight decay); after set_to_none=True it changes nothing."""
    cls, kw = torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)
    for set_to_none in (False, True):
        a, b = _net(), _net()
        opt = cls(a.parameters(), **kw)
        handle = step_in_backward(b, cls, **kw)
        for m, o in ((a, opt), (b, handle)):
            for i in range(2):
                _zero_end_opt(m, o, i, set_to_none=set_to_none)
            o.step()
            o.zero_grad(set_to_none=set_to_none)
            o.step()
            _zero_start_opt(m, o, 2, set_to_none=set_to_none)
        _same(a, b, opt, handle)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_sparse_embedding_in_an_in_place_zeroing_loop(momentum):
    # the plain loop keeps an empty sparse gradient; a dense parameter next to it a zero tensor
    def make():
        torch.manual_seed(0)
        return nn.ModuleDict({"emb": nn.Embedding(V, H, sparse=True), "lin": nn.Linear(H, 1)})

    def loss(m, i):
        return m["lin"](m["emb"](_batch(i))).square().mean()

    a, b = make(), make()
    opt = torch.optim.SGD(a.parameters(), lr=0.1, momentum=momentum)
    handle = step_in_backward(b, torch.optim.SGD, lr=0.1, momentum=momentum)
    for i in range(4):
        for m, o in ((a, opt), (b, handle)):
            if i == 2:
                o.step()  # a step with nothing new: the zero (and empty sparse) gradients
            loss(m, i).backward()
            o.step()
            o.zero_grad(set_to_none=False)
        _same(a, b, opt, handle)


def test_accumulate_n_with_in_place_zeroing_is_the_plain_loop():
    cls, kw = torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)
    a, b = _net(), _net()
    opt = cls(a.parameters(), **kw)
    handle = step_in_backward(b, cls, accumulate=2, **kw)
    for step in range(4):
        for m, o in ((a, opt), (b, handle)):
            for k in range(2):
                (m(_batch(2 * step + k), use=step % 2 == 0) / 2).backward()
            o.step()
            o.zero_grad(set_to_none=False)
        _same(a, b, opt, handle)


def test_a_module_without_every_handle_parameter_does_not_count_as_zeroing():
    # a group added beside the model: model.zero_grad() leaves its gradient to the plain loop
    b = _net()
    extra = nn.Parameter(torch.ones(3))
    handle = step_in_backward(b, torch.optim.SGD, lr=0.1)
    handle.add_param_group({"params": [extra]})
    (b(_batch(0)) + extra.sum()).backward()
    handle.step()
    b.zero_grad()
    before = _snap(b, handle)
    with pytest.raises(RuntimeError, match=r"not zeroed"):
        (b(_batch(1)) + extra.sum()).backward()
    _unchanged(before, b, handle)
    handle.zero_grad()


def test_check_loop_must_be_a_bool():
    b = _net()
    with pytest.raises(TypeError, match=r"^slimgrad\.step_in_backward: check_loop must be a "):
        step_in_backward(b, torch.optim.SGD, lr=0.1, check_loop="False")
    assert "zero_grad" not in b.__dict__
    assert not any(hasattr(p, "_slimgrad_step_in_backward") for p in b.parameters())
    step_in_backward(b, torch.optim.SGD, lr=0.1)  # nothing was attached


# --- module=: the model whose zero_grad() counts for a handle built from groups (review25a 1) ---
def _decay_groups(m: nn.Module) -> list:
    # HF Trainer's usual groups: weight decay on matrices, none on biases, norms and scalars
    decay = [p for p in m.parameters() if p.dim() >= 2]
    rest = [p for p in m.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("opt_name", list(_OPTS))
def test_groups_with_module_follow_a_trainer_loop_bit_for_bit(opt_name, set_to_none):
    """HF Trainer builds the optimizer from weight-decay groups and zeroes with
    model.zero_grad(): module=model makes that zeroing count (without it the second step was
    refused as a loop that never zeroes)."""
    cls, kw = _OPTS[opt_name]
    kw = {k: v for k, v in kw.items() if k != "weight_decay"}
    a, b = _net(), _net()
    opt = cls(_decay_groups(a), **kw)
    handle = step_in_backward(_decay_groups(b), cls, module=b, **kw)
    assert isinstance(b.__dict__["zero_grad"], type(b.zero_grad))  # watched
    for m, o in ((a, opt), (b, handle)):
        sched = torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
        m.zero_grad(set_to_none=set_to_none)
        for i in range(5):
            m(_batch(i), use=i % 2 == 0).backward()
            o.step()
            sched.step()
            m.zero_grad(set_to_none=set_to_none)
    _same(a, b, opt, handle)
    handle.remove()
    assert "zero_grad" not in b.__dict__ and "__getstate__" not in b.__dict__


def test_groups_without_module_name_module_first_in_the_refusal():
    b = _net()
    handle = step_in_backward(_decay_groups(b), torch.optim.AdamW, lr=1e-2)
    b(_batch(0)).backward()
    handle.step()
    b.zero_grad()  # not seen: the handle was given no module
    before = _snap(b, handle)
    with pytest.raises(
        RuntimeError,
        match=r"not zeroed.*\. The handle was built from parameters, so it sees no "
        r"model\.zero_grad\(\): pass module=model to step_in_backward .*check_loop=False\)\.$",
    ):
        b(_batch(1)).backward()
    _unchanged(before, b, handle)


@pytest.mark.parametrize(
    "given, module, err, match",
    [
        ("groups", "list", TypeError, r"module must be a torch\.nn\.Module"),
        ("groups", "other", ValueError, r"module= must hold every parameter .*got 6 of 6 "),
        ("groups", "child", ValueError, r"module= must hold every parameter .*got 4 of 6 "),
        ("model", "other", ValueError, r"module= names another module"),
    ],
)
def test_module_is_checked_before_anything_is_attached(given, module, err, match):
    b, other = _net(), _net()
    mod = {"list": [b], "other": other, "child": b.l1}[module]
    first = _decay_groups(b) if given == "groups" else b
    with pytest.raises(err, match=r"^slimgrad\.step_in_backward: " + match):
        step_in_backward(first, torch.optim.SGD, lr=0.1, module=mod)
    for m in (b, other, b.l1):
        assert "zero_grad" not in m.__dict__ and "__getstate__" not in m.__dict__
    assert not any(hasattr(p, "_slimgrad_step_in_backward") for p in b.parameters())
    step_in_backward(b, torch.optim.SGD, lr=0.1)  # nothing was attached


def test_two_handles_on_one_model_both_with_module_follow_model_zero_grad():
    # a split optimizer (matrices / the rest), each handle watching the same model
    a, b = _net(), _net()
    ga, gb = _decay_groups(a), _decay_groups(b)
    oa = [torch.optim.SGD([ga[0]], lr=0.1, momentum=0.9), torch.optim.AdamW([ga[1]], lr=1e-2)]
    ob = [
        step_in_backward([gb[0]], torch.optim.SGD, lr=0.1, momentum=0.9, module=b),
        step_in_backward([gb[1]], torch.optim.AdamW, lr=1e-2, module=b),
    ]
    for m, os_ in ((a, oa), (b, ob)):
        for i in range(4):
            m(_batch(i), use=i % 2 == 0).backward()
            for o in os_:
                o.step()
            m.zero_grad()
    for o, h in zip(oa, ob):
        _same(a, b, o, h)
    ob[0].remove()  # the other watch stays and still counts
    b(_batch(4)).backward()
    ob[1].step()
    b.zero_grad()
    ob[1].remove()
    assert "zero_grad" not in b.__dict__ and "__getstate__" not in b.__dict__


# --- a backward that raises in its middle (fairseq's OOM skip; review25a 2) ---------------------
class _BoomNet(nn.Module):
    # the error comes between the head (gradients done) and l1 (none yet)
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(_Boom.apply(torch.tanh(self.l1(x)))).square().sum()


def _x(i: int) -> torch.Tensor:
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(i))


@pytest.mark.parametrize(
    "recover", ["zero_grad", "zero_grad-in-place", "model.zero_grad", "step-then-zero_grad"]
)
def test_a_backward_that_raised_before_any_update_recovers_as_the_plain_loop(recover):
    """Bucketed small parameters wait for the end of backward: a backward that raises in its
    middle updated nothing. The plain loop holds the head's gradients; zero_grad() drops them
    (the handle drops the waiting ones), step() applies them (the handle updates them then).
    It was refused at zero_grad() as a backward that had updated."""
    a, b = _BoomNet(), _BoomNet()
    kw = dict(lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(a.parameters(), **kw)
    handle = step_in_backward(b, torch.optim.SGD, **kw)
    for m, o in ((a, opt), (b, handle)):
        for i in range(4):
            _Boom.armed = RuntimeError if i == 1 else None
            try:
                m(_x(i)).backward()
            except RuntimeError as e:
                assert "simulated" in str(e)
                if recover == "step-then-zero_grad":
                    o.step()
                    o.zero_grad()
                elif recover == "model.zero_grad":
                    m.zero_grad()
                else:
                    o.zero_grad(set_to_none=recover == "zero_grad")
                continue
            o.step()
            o.zero_grad()
    _same(a, b, opt, handle)


def test_a_backward_that_raised_after_an_update_is_refused_at_zero_grad():
    # bucket_bytes=0: the head updated before the error; the plain loop's zero_grad() discards
    # what the handle already applied (the late refusal NOTE [Every refusal changes nothing] lists)
    b = _BoomNet()
    handle = step_in_backward(b, torch.optim.SGD, lr=0.1, bucket_bytes=0)
    _Boom.armed = RuntimeError
    with pytest.raises(RuntimeError, match="simulated"):
        b(_x(0)).backward()
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) after a backward that updated"):
        handle.zero_grad()
    b(_x(1)).backward()  # the loop goes on
    handle.step()
    handle.zero_grad()


# --- two handles on one model: a refusal of one after the other updated (review25a 3) --------
def test_a_second_handles_refusal_comes_after_the_first_handle_updated():
    """Documented late refusal (NOTE [Every refusal changes nothing]): each handle checks at its
    own first hook; the head's handle (hooks first) updates before the other refuses. The first
    handle is then "updated": its zero_grad() raises once, after which the loop goes on."""
    m = _BoomNet()
    head = step_in_backward(list(m.head.parameters()), torch.optim.SGD, lr=0.1, bucket_bytes=0)
    low = step_in_backward(list(m.l1.parameters()), torch.optim.SGD, lr=0.1)
    m(_x(0)).backward()
    for h in (head, low):
        h.step()
    head.zero_grad()  # low.zero_grad() forgotten
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(RuntimeError, match=r"not zeroed"):
        m(_x(1)).backward()
    changed = [not torch.equal(p, q) for p, q in zip(before, m.parameters(), strict=True)]
    assert changed == [False, False, True, True]  # l1 untouched, the head updated
    assert all(p.grad is None for p in m.parameters())
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) after a backward that updated"):
        head.zero_grad()
    head.step()  # (nothing held: a no-op)
    head.zero_grad()
    low.zero_grad()
    m(_x(2)).backward()
    for h in (head, low):
        h.step()
        h.zero_grad()


# --- copies of a watched model carry no watch (review25a 4) ----------------------------------
def _pickled(m):
    return pickle.loads(pickle.dumps(m))


def _saved(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle", "torch.save"])
def test_copies_of_a_watched_model_carry_no_watch_and_free_by_refcount(how):
    make = {"deepcopy": copy.deepcopy, "copy": copy.copy, "pickle": _pickled, "torch.save": _saved}
    b = _net()
    handle = step_in_backward(b, torch.optim.SGD, lr=0.1)
    c = make[how](b)
    assert "zero_grad" not in c.__dict__ and "__getstate__" not in c.__dict__
    assert "zero_grad" in b.__dict__  # the original is still watched
    h2 = None
    if how != "copy":  # (a shallow copy shares the parameters: held by the handle)
        h2 = step_in_backward(c, torch.optim.SGD, lr=0.1)
        h2.remove()
        assert "zero_grad" not in c.__dict__ and "__getstate__" not in c.__dict__
    c.zero_grad()
    enabled = gc.isenabled()
    gc.disable()
    try:
        r = weakref.ref(c)
        del c, h2
        assert r() is None  # no reference cycle through the copy's __dict__
    finally:
        if enabled:
            gc.enable()
    b(_batch(0)).backward()
    handle.step()
    b.zero_grad()  # still seen
    b(_batch(1)).backward()


def test_a_copy_keeps_an_instance_zero_grad_the_model_had_before_the_watch():
    b = _net()
    calls = []
    b.zero_grad = lambda set_to_none=True: calls.append(set_to_none)
    step_in_backward(b, torch.optim.SGD, lr=0.1)
    c = copy.deepcopy(b)
    assert "__getstate__" not in c.__dict__
    c.zero_grad(set_to_none=False)
    assert calls == [False]  # (a deep copy of the lambda: the same closure cell)


# --- a cycle cut short: accelerate's end of the dataloader (issue 30, mlp26) ------------------
def _epochs(m, o, n_batches: int, accumulate: int, epochs: int = 2) -> None:
    # accelerate's accumulate() loop, reduced: the loss divided by N, step() and zero_grad() at
    # every N-th batch and at the last batch of the epoch (its count restarts there)
    for e in range(epochs):
        k = 0
        for i in range(n_batches):
            (m(_batch(10 * e + i), use=i % 2 == 0) / accumulate).backward()
            k += 1
            if k == accumulate or i == n_batches - 1:
                o.step()
                o.zero_grad()
                k = 0


@pytest.mark.parametrize("opt_name", list(_OPTS))
@pytest.mark.parametrize("accumulate, n_batches", [(2, 5), (3, 7), (3, 8), (2, 1)])
def test_a_step_that_ends_a_cycle_early_is_the_plain_step(opt_name, accumulate, n_batches):
    # NOTE [A step that ends a cycle early]: was refused ("in the middle of an accumulation
    # cycle") where the plain loop steps on the partial sum
    cls, kw = _OPTS[opt_name]
    a, b = _net(), _net()
    opt = cls(a.parameters(), **kw)
    handle = step_in_backward(b, cls, accumulate=accumulate, **kw)
    _epochs(a, opt, n_batches, accumulate)
    _epochs(b, handle, n_batches, accumulate)
    _same(a, b, opt, handle)
    assert all(p.grad is None for p in b.parameters())


def test_a_step_after_a_raised_last_backward_of_a_cycle_is_the_plain_step():
    # the cycle's last backward updated the head, then raised before l1: step() applies what
    # .grad holds (l1's gradient of the first micro-batch, as the plain loop's), bit for bit; it
    # was refused, and the handle stayed in the cycle (NOTE [A backward that raised])
    a, b = _BoomNet(), _BoomNet()
    opt = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    handle = step_in_backward(
        b, torch.optim.SGD, lr=0.1, momentum=0.9, accumulate=2, bucket_bytes=0
    )
    for m, o in ((a, opt), (b, handle)):
        m(_x(0)).backward()
        _Boom.armed = RuntimeError
        with pytest.raises(RuntimeError, match="simulated"):
            m(_x(1)).backward()
        o.step()
        o.zero_grad()
        m(_x(2)).backward()
        m(_x(3)).backward()
        o.step()
        o.zero_grad()
    _same(a, b, opt, handle)


@pytest.mark.parametrize("n_batches", [5, 4])
def test_accelerate_gradient_accumulation_with_an_odd_epoch(n_batches):
    """accelerate's own loop (Accelerator(gradient_accumulation_steps=2), accumulate(), its
    backward's loss scaling, its prepared optimizer and dataloader): bit for bit the plain one."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    def run(use_handle: bool) -> tuple:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        m = _net()
        kw = dict(lr=1e-2, weight_decay=0.1)
        if use_handle:
            opt = step_in_backward(m, torch.optim.AdamW, accumulate=2, **kw)
        else:
            opt = torch.optim.AdamW(m.parameters(), **kw)
        data = [_batch(i) for i in range(n_batches)]
        dl = torch.utils.data.DataLoader(data, batch_size=None)
        acc = accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True)
        m, popt, dl = acc.prepare(m, opt, dl)
        for _ in range(2):
            for i, x in enumerate(dl):
                with acc.accumulate(m):
                    acc.backward(m(x, use=i % 2 == 0))
                    popt.step()
                    popt.zero_grad()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        return m, opt

    (a, opt), (b, handle) = run(False), run(True)
    _same(a, b, opt, handle)
    assert all(p.grad is None for p in b.parameters())
