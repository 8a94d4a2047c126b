"""slimgrad.step_in_backward (issue 30, sib28): a backward that raises in its middle, and the loop
that goes on after it.

A backward can raise anywhere: a module's backward (an out-of-memory, a NaN check), a user's
tensor hook, a ``KeyboardInterrupt``. The plain loop then holds, in ``.grad``, the gradients of the
parameters whose ``AccumulateGrad`` ran (added to the earlier micro-batches') and the earlier
micro-batches' sums for the others. The handle learns of the error while it leaves backward (the
engine frees the end callback it never ran) and is left where the plain loop is (NOTE [A backward
that raised] in ``slimgrad/step_in_backward.py``):

- ``step()``: the plain step() on what ``.grad`` holds, bit for bit, at every micro-batch position;
- ``zero_grad()``: drops them, mid-cycle too; refused once, after the fact, where an update ran in
  the raised backward (bucket_bytes=0, the cycle's last micro-batch): the plain one discards
  gradients the handle applied;
- the next backward with neither: the plain loop adds to what ``.grad`` holds: followed where no
  update ran, refused before any change where one did;
- the raised backward counts as a micro-batch or not, as the loop counts it.

Before, with ``accumulate=N`` the cycle count stayed at N after the last micro-batch raised, and
every later ``step()``/``zero_grad()``/backward was refused or counted wrong; a raise in an earlier
micro-batch left the count one ahead; with ``accumulate=1`` the next backward was taken for a nested
one of the raised backward.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import slimgrad
from tests._bitwise import Boom as _Boom
from tests._bitwise import assert_same_parameters, assert_same_state
from tests._gc_frozen import older_objects_frozen  # noqa: F401  (autouse)

step_in_backward = slimgrad.step_in_backward

# the loops here recover with step() after a backward that raised in its middle on purpose; the
# warning that step() then gives is tested in test_step_in_backward_ddp.py
pytestmark = pytest.mark.filterwarnings(
    r"ignore:slimgrad\.step_in_backward. step\(\) after a backward that raised in its middle"
)


class _Interrupt(KeyboardInterrupt):
    pass


class _Net(nn.Module):
    """l0, then l1 and the error point (through a reentrant checkpoint or not), then the head:
    backward reaches the head first (updated there with bucket_bytes=0), then the error, before
    l1 and l0."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l0 = nn.Linear(4, 5)
        self.l1 = nn.Linear(5, 5)
        self.head = nn.Linear(5, 2)
        self.reentrant = reentrant

    def _mid(self, h: torch.Tensor) -> torch.Tensor:
        return _Boom.apply(torch.tanh(self.l1(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l0(x))
        h = checkpoint(self._mid, h, use_reentrant=True) if self.reentrant else self._mid(h)
        return self.head(h).square().mean()


def _x(i: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 + i))


_KW = dict(lr=1e-2, weight_decay=0.1)  # AdamW: state (moments, step count) at every parameter


def _pair(reentrant: bool, **handle_kw):
    a = _Net(reentrant)
    b = copy.deepcopy(a)
    return (
        a,
        torch.optim.AdamW(a.parameters(), **_KW),
        b,
        step_in_backward(b, torch.optim.AdamW, **_KW, **handle_kw),
    )


def _backward(m, i: int, scaler) -> None:
    loss = m(_x(i))
    (scaler.scale(loss) if scaler is not None else loss).backward()


def _step(o, scaler) -> None:
    if scaler is not None:
        scaler.step(o)
        scaler.update()
    else:
        o.step()
    o.zero_grad()


def _loop(m, o, *, accumulate, raise_at, recover, scaler, error=RuntimeError, start=0, n=None):
    """The same loop for the plain optimizer and the handle: ``step()`` every ``accumulate``
    micro-batches and at the end; the error at micro-batch ``raise_at``, caught around backward,
    then ``recover``: zero_grad (drop the batch), step (apply what is held), count (the failed
    micro-batch counts), skip (it does not: the next backward goes on)."""
    k = 0
    for i in range(start, start + (n if n is not None else 3 * accumulate)):
        _Boom.armed = error if i == raise_at else None
        try:
            _backward(m, i, scaler)
        except (RuntimeError, KeyboardInterrupt) as e:
            assert "simulated" in str(e)
            if recover == "zero_grad":
                o.zero_grad()
                k = 0
            elif recover == "step":
                _step(o, scaler)
                k = 0
            elif recover == "count":
                k += 1
                if k == accumulate:
                    _step(o, scaler)
                    k = 0
            continue
        k += 1
        if k == accumulate:
            _step(o, scaler)
            k = 0
    if k:
        _step(o, scaler)
    _Boom.armed = None


# the head's weight (40 bytes) updates alone, its bias (8 bytes) waits in the bucket
_HEAD_ALONE = 16

_POSITIONS = [(1, 0), (2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)]


_RECOVERS = ["step", "zero_grad", "count", "skip"]


def _sweep() -> list:
    # every (position, recover) pair, with bucket_bytes, reentrant and the disabled scaler
    # rotated so that every pair of values of any two of the five factors appears in some row
    # (the full cross-product, 224 rows, took most of this file's time and found nothing the
    # pairs do not); where the head would update before the error (bucket_bytes=0 in the cycle's
    # last micro-batch) zero_grad and skip are refused, tested below: bucketed there
    rows = []
    for i, (accumulate, pos) in enumerate(_POSITIONS):
        for j, recover in enumerate(_RECOVERS):
            alone = (i + j) % 2 == 0 and not (
                recover in ("zero_grad", "skip") and pos == accumulate - 1
            )
            reentrant = (i // 2 + j // 2 + i) % 2 == 1
            scaler = (j + (i * 3) // 2) % 2 == 1
            rows.append(
                pytest.param(
                    accumulate,
                    pos,
                    recover,
                    0 if alone else 1 << 20,
                    reentrant,
                    scaler,
                    id=f"{accumulate}-{pos}-{recover}-{'alone' if alone else 'bucketed'}-"
                    f"{'reentrant' if reentrant else 'plain'}-"
                    f"{'disabled-scaler' if scaler else 'no-scaler'}",
                )
            )
    return rows


def _ids(v):
    return {True: "reentrant", False: "plain"}.get(v) if isinstance(v, bool) else None


@pytest.mark.parametrize("accumulate, pos, recover, bucket_bytes, reentrant, scaler", _sweep())
def test_the_loop_after_a_raised_backward_is_the_plain_loop(
    accumulate, pos, recover, bucket_bytes, reentrant, scaler
):
    """The error in the second cycle's micro-batch ``pos``; parameters and AdamW state after
    three cycles equal the plain loop's bit for bit, every ``.grad`` None. (Where an update ran
    before the error, zero_grad and skip are refused: the tests below.)"""
    a, opt, b, handle = _pair(reentrant, accumulate=accumulate, bucket_bytes=bucket_bytes)
    sa = torch.amp.GradScaler("cpu", enabled=False) if scaler else None
    kw = dict(accumulate=accumulate, raise_at=accumulate + pos, recover=recover)
    _loop(a, opt, scaler=sa, **kw)
    _loop(b, handle, scaler=sa, **kw)
    assert_same_parameters(a, b)
    assert_same_state(opt.state_dict()["state"], handle.state_dict()["state"])
    assert all(p.grad is None for p in b.parameters())


def _snap(m, o) -> tuple:
    return (
        [p.detach().clone() for p in m.parameters()],
        [None if p.grad is None else p.grad.clone() for p in m.parameters()],
        copy.deepcopy(o.state_dict()),
    )


def _unchanged(before: tuple, m, o) -> None:
    params, grads, state = before
    for p, q in zip(params, m.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
    for g, q in zip(grads, m.parameters(), strict=True):
        assert (g is None) == (q.grad is None)
        if g is not None:
            torch.testing.assert_close(q.grad, g, rtol=0, atol=0)
    assert_same_state(state["state"], o.state_dict()["state"])


def _raise_in_the_updating_micro_batch(m, accumulate: int, error=RuntimeError) -> None:
    for i in range(accumulate - 1):
        m(_x(i)).backward()
    _Boom.armed = error
    with pytest.raises(error, match="simulated"):
        m(_x(accumulate - 1)).backward()


@pytest.mark.parametrize("reentrant", [False, True], ids=_ids)
@pytest.mark.parametrize("accumulate", [1, 2, 4])
def test_a_backward_after_one_that_raised_once_it_updated_is_refused_unchanged(
    accumulate, reentrant
):
    """The head updated (bucket_bytes=0), then the error: the plain loop's next backward would
    add to what the raised one left, part of which the handle applied. Refused at its first hook,
    before AccumulateGrad adds anything (a tensor hook on each held gradient with accumulate=1),
    twice; then ``step()`` is the plain loop's step() after the error, and the loop goes on bit
    for bit."""
    a, opt, b, handle = _pair(reentrant, accumulate=accumulate, bucket_bytes=_HEAD_ALONE)
    for m, o in ((a, opt), (b, handle)):  # one whole cycle: AdamW's state exists
        _loop(m, o, accumulate=accumulate, raise_at=-1, recover="step", scaler=None, n=accumulate)
    for m in (a, b):
        _raise_in_the_updating_micro_batch(m, accumulate)
    # the head's weight applied, its bias held (and with accumulate=N every earlier sum)
    assert b.head.weight.grad is None and b.head.bias.grad is not None
    before = _snap(b, handle)
    for _ in range(2):
        with pytest.raises(
            RuntimeError,
            match=r"^slimgrad\.step_in_backward: a backward after one that raised once it had "
            r"updated some parameters; .* expected step\(\) \(applies what the raised backward "
            r"left, as the plain step\(\)\) or zero_grad\(\) before the next backward, got ",
        ):
            b(_x(50)).backward()
        _unchanged(before, b, handle)
    for o in (opt, handle):
        o.step()
        o.zero_grad()
    for m, o in ((a, opt), (b, handle)):
        _loop(m, o, accumulate=accumulate, raise_at=-1, recover="step", scaler=None, start=60)
    assert_same_parameters(a, b)
    assert_same_state(opt.state_dict()["state"], handle.state_dict()["state"])


@pytest.mark.parametrize("reentrant", [False, True], ids=_ids)
@pytest.mark.parametrize("accumulate", [1, 2, 4])
def test_zero_grad_after_a_backward_that_raised_once_it_updated_recovers(accumulate, reentrant):
    """fairseq's skip of a batch that ran out of memory: ``zero_grad()`` after the error. The
    handle applied the head's gradient before the error, the plain zero_grad() discards it:
    refused once, after the fact (the update cannot be undone exactly: NOTE [Every refusal changes
    nothing]), with every held gradient dropped and the cycle ended; the loop then goes on as the
    plain loop from the handle's parameters and state, bit for bit."""
    _, _, b, handle = _pair(reentrant, accumulate=accumulate, bucket_bytes=0)
    _loop(b, handle, accumulate=accumulate, raise_at=-1, recover="step", scaler=None)
    _raise_in_the_updating_micro_batch(b, accumulate, error=_Interrupt)
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) after a backward that updated"):
        handle.zero_grad()
    assert all(p.grad is None for p in b.parameters())
    a = copy.deepcopy(b)
    handle.remove()
    opt = torch.optim.AdamW(a.parameters(), **_KW)
    opt.load_state_dict(copy.deepcopy(handle.state_dict()))
    handle = step_in_backward(b, torch.optim.AdamW, accumulate=accumulate, bucket_bytes=0, **_KW)
    handle.load_state_dict(copy.deepcopy(opt.state_dict()))
    # (a new handle on the same state: the old one's history cannot matter; the old one going on
    # is checked too, below)
    for m, o in ((a, opt), (b, handle)):
        _loop(m, o, accumulate=accumulate, raise_at=-1, recover="step", scaler=None, start=70)
    assert_same_parameters(a, b)
    assert_same_state(opt.state_dict()["state"], handle.state_dict()["state"])


@pytest.mark.parametrize("accumulate", [1, 2, 4])
def test_the_same_handle_goes_on_after_a_refused_zero_grad(accumulate):
    _, _, b, handle = _pair(False, accumulate=accumulate, bucket_bytes=0)
    _raise_in_the_updating_micro_batch(b, accumulate)
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) after a backward that updated"):
        handle.zero_grad()
    a = copy.deepcopy(b)
    opt = torch.optim.AdamW(a.parameters(), **_KW)
    opt.load_state_dict(copy.deepcopy(handle.state_dict()))
    for m, o in ((a, opt), (b, handle)):
        _loop(m, o, accumulate=accumulate, raise_at=-1, recover="step", scaler=None, start=80)
    assert_same_parameters(a, b)
    assert_same_state(opt.state_dict()["state"], handle.state_dict()["state"])


class _HookNet(_Net):
    # the error from a user's tensor hook (a NaN check) between the head and l1
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(torch.tanh(self.l0(x))))
        if _Boom.armed is not None:
            exc, _Boom.armed = _Boom.armed, None

            def check(g, exc=exc):
                raise exc("simulated error in a tensor hook")

            h.register_hook(check)
        return self.head(h).square().mean()


@pytest.mark.parametrize(
    "accumulate, pos, recover, error",
    [
        pytest.param(
            *ap, r, (RuntimeError, _Interrupt)[(i + j) % 2], id=f"{ap[0]}-{ap[1]}-{r}-{(i + j) % 2}"
        )
        for i, ap in enumerate(_POSITIONS)
        for j, r in enumerate(_RECOVERS)
    ],
)
def test_an_error_from_a_tensor_hook_or_an_interrupt(accumulate, pos, recover, error):
    """The same loops with the error raised by a user's tensor hook (armed in forward) or a
    KeyboardInterrupt, bucketed (no update before the error): the plain loop's bits."""
    a = _HookNet(False)
    b = copy.deepcopy(a)
    opt = torch.optim.AdamW(a.parameters(), **_KW)
    handle = step_in_backward(b, torch.optim.AdamW, accumulate=accumulate, **_KW)
    kw = dict(accumulate=accumulate, raise_at=accumulate + pos, recover=recover, error=error)
    _loop(a, opt, scaler=None, **kw)
    _loop(b, handle, scaler=None, **kw)
    assert_same_parameters(a, b)
    assert_same_state(opt.state_dict()["state"], handle.state_dict()["state"])


@pytest.mark.parametrize("accumulate, pos", _POSITIONS)
def test_an_enabled_grad_scaler_refusal_at_any_micro_batch_changes_nothing(accumulate, pos):
    """An enabled GradScaler made before micro-batch ``pos`` refuses that backward at its first
    hook (NOTE [GradScaler]): parameters, ``.grad`` (the earlier micro-batches' sums) and state as
    before, the cycle count too; without the scaler the cycle goes on as the plain loop's that
    never ran the refused backward."""
    a, opt, b, handle = _pair(False, accumulate=accumulate)
    for m, o in ((a, opt), (b, handle)):
        _loop(m, o, accumulate=accumulate, raise_at=-1, recover="step", scaler=None)
    for i in range(pos):
        a(_x(20 + i)).backward()
        b(_x(20 + i)).backward()
    scaler = torch.amp.GradScaler("cpu")
    before = _snap(b, handle)
    with pytest.raises(NotImplementedError, match=r"a live enabled torch\.amp\.GradScaler"):
        scaler.scale(b(_x(99))).backward()
    _unchanged(before, b, handle)
    del scaler
    for i in range(pos, accumulate):
        a(_x(20 + i)).backward()
        b(_x(20 + i)).backward()
    for o in (opt, handle):
        o.step()
        o.zero_grad()
    assert_same_parameters(a, b)
    assert_same_state(opt.state_dict()["state"], handle.state_dict()["state"])
    assert all(p.grad is None for p in b.parameters())


@pytest.mark.parametrize("accumulate", [1, 2])
def test_check_loop_off_starts_the_step_after_a_raised_backward_from_no_gradient(accumulate):
    """``check_loop=False``: every ``accumulate`` backward calls are one whole step from no
    gradient, with no call the handle follows. A backward that raised at the start of a cycle
    does not count, and the next step starts from no gradient: what it left is dropped before
    the next backward adds to it (a tensor hook with accumulate=1). The plain loop: each cycle
    ``zero_grad(); backward x N; step()``, the failed cycle started again."""
    a, opt, b, handle = _pair(False, accumulate=accumulate, check_loop=False)
    fail = 2 * accumulate  # the first micro-batch of the third cycle
    for i in range(5 * accumulate + 1):
        _Boom.armed = RuntimeError if i == fail else None
        try:
            b(_x(i)).backward()
        except RuntimeError as e:
            assert "simulated" in str(e)
            assert b.head.weight.grad is not None  # held, the plain loop's
    ok = [i for i in range(5 * accumulate + 1) if i != fail]
    for c in range(len(ok) // accumulate):
        opt.zero_grad()
        for i in ok[c * accumulate : (c + 1) * accumulate]:
            a(_x(i)).backward()
        opt.step()
    assert_same_parameters(a, b)
    assert_same_state(opt.state_dict()["state"], handle.state_dict()["state"])
    assert all(p.grad is None for p in b.parameters())


def test_remove_after_a_raised_backward_leaves_no_hook():
    """The tensor hooks put on the held gradients (accumulate=1) go with ``remove()``; the plain
    optimizer then steps on what the raised backward left, as the plain loop's step()."""
    a, opt, b, handle = _pair(False, bucket_bytes=_HEAD_ALONE)
    _raise_in_the_updating_micro_batch(a, 1)
    _raise_in_the_updating_micro_batch(b, 1)
    assert b.head.bias._backward_hooks  # the guard on the held bias
    handle.remove()
    assert not any(p._backward_hooks for p in b.parameters())
    assert not any(p._post_accumulate_grad_hooks for p in b.parameters())
    opt.step()
    handle.optimizer.step()
    assert_same_parameters(a, b)
    assert_same_state(opt.state_dict()["state"], handle.state_dict()["state"])


class _RaiseOnce:
    # an optimizer step pre-hook (or a post-accumulate-grad hook) that raises once when armed
    def __init__(self) -> None:
        self.armed = False

    def __call__(self, *args) -> None:
        if self.armed:
            self.armed = False
            raise RuntimeError("simulated error in a hook")


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize(
    "bucket_bytes", [0, 48, 1 << 20], ids=["alone", "flushed-in-backward", "default"]
)
def test_an_optimizer_pre_hook_that_raises_in_backward_leaves_the_gradient(
    bucket_bytes, accumulate
):
    """An optimizer step pre-hook raises in the cycle's updating backward, in the update of the
    parameter the handle reached first (bucket_bytes=0), of the head's bucket flushed while
    backward goes on (48: the head's 40 + 8 bytes) or of the last bucket at the end of backward
    (the default). That is a backward that raised after that parameter's ``AccumulateGrad``,
    nothing applied: the retried ``step()`` applies what ``.grad`` holds, as the plain loop's
    ``step()`` after a backward that raised at the same point (a post-accumulate-grad hook that
    raises once, on the same parameter). Before, with accumulate=1 the error was taken for one of
    the handle's refusals: the gradients it had were dropped and the retried step() applied
    nothing."""
    a, opt, b, handle = _pair(False, accumulate=accumulate, bucket_bytes=bucket_bytes)
    pre = _RaiseOnce()
    handle.optimizer.register_step_pre_hook(pre)
    for m, o in ((a, opt), (b, handle)):  # one whole cycle: AdamW's state exists
        _loop(m, o, accumulate=accumulate, raise_at=-1, recover="step", scaler=None, n=accumulate)
    for i in range(accumulate - 1):
        a(_x(30 + i)).backward()
        b(_x(30 + i)).backward()
    # the parameters in the order backward reaches their AccumulateGrad (a tensor hook runs
    # before it): the last one is where the error came
    order: list[int] = []
    for i, p in enumerate(b.parameters()):
        p.register_hook(lambda g, i=i: order.append(i))
    pre.armed = True
    with pytest.raises(RuntimeError, match="simulated error in a hook"):
        b(_x(40)).backward()
    held = [p.grad is not None for p in b.parameters()]
    plain = _RaiseOnce()
    plain.armed = True
    if bucket_bytes == 1 << 20:
        assert all(held)  # every AccumulateGrad ran: the plain backward, then its step() raises
        a(_x(40)).backward()
        opt.register_step_pre_hook(plain)
        with pytest.raises(RuntimeError, match="simulated error in a hook"):
            opt.step()
    else:
        # the plain loop's backward raises right after the same parameter's AccumulateGrad
        list(a.parameters())[order[-1]].register_post_accumulate_grad_hook(plain)
        with pytest.raises(RuntimeError, match="simulated error in a hook"):
            a(_x(40)).backward()
        assert [p.grad is not None for p in a.parameters()] == held
        assert held[order[-1]]
    for o in (opt, handle):
        o.step()  # the retry
        o.zero_grad()
    for m, o in ((a, opt), (b, handle)):
        _loop(m, o, accumulate=accumulate, raise_at=-1, recover="step", scaler=None, start=90)
    assert_same_parameters(a, b)
    assert_same_state(opt.state_dict()["state"], handle.state_dict()["state"])
    assert all(p.grad is None for p in b.parameters())
