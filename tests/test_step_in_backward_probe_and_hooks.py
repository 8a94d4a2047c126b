"""slimgrad.step_in_backward (review28a): two things a loop does around a backward that the plain
loop survives unchanged.

- ``torch.autograd.grad`` over the parameters (a gradient-norm probe) after a backward that raised
  (accumulate=1): the plain loop's parameters, ``.grad`` and optimizer state are as they were. The
  handle's guard hooks on the held gradients fire under it too; before, they took it for the next
  step's backward and applied the held gradients at its end (the head changed, its ``.grad`` went
  None, then ``zero_grad()`` was refused) (NOTE [A graph task that accumulates nothing]).
  With accumulate=N the same probe mid-cycle counted as a micro-batch (and could end the cycle).
- an optimizer step pre-hook that raises (a NaN guard, a failing logger) before anything was
  applied: the plain ``step()`` changes nothing and ``zero_grad()`` drops the gradients. Before,
  the handle recorded an update before calling the optimizer, so ``zero_grad()`` was refused with
  "they were applied in backward", which was false; and where the hook raised in the last bucket
  (at the end of backward) the gradients stayed in ``.grad`` unseen, so ``zero_grad()`` kept them
  and the next step applied them twice.
"""

from __future__ import annotations

import pytest
import torch

from tests._bitwise import assert_same_parameters, assert_same_state
from tests._gc_frozen import older_objects_frozen  # noqa: F401  (autouse)
from tests.test_step_in_backward_raised import _Boom, _pair, _snap, _unchanged, _x


def _raise_then_probe(m, inputs: str) -> None:
    _Boom.armed = RuntimeError
    with pytest.raises(RuntimeError, match="simulated"):
        m(_x(0)).backward()
    params = list(m.parameters())
    if inputs == "non-held":
        # the raised backward left the head's gradients (reached before the error)
        params = [p for p in params if p.grad is None]
    torch.autograd.grad(m(_x(1)), params)


@pytest.mark.parametrize("inputs", ["all", "non-held"])
@pytest.mark.parametrize("bucket_bytes", [1 << 20, 64], ids=["bucketed", "small-bucket"])
def test_autograd_grad_after_a_raised_backward_changes_nothing(bucket_bytes, inputs):
    _, _, b, handle = _pair(False, bucket_bytes=bucket_bytes)
    _Boom.armed = RuntimeError
    with pytest.raises(RuntimeError, match="simulated"):
        b(_x(0)).backward()
    before = _snap(b, handle)
    assert any(p.grad is not None for p in b.parameters())  # held, as the plain loop's
    params = list(b.parameters())
    if inputs == "non-held":
        params = [p for p in params if p.grad is None]
    torch.autograd.grad(b(_x(1)), params)
    _unchanged(before, b, handle)


@pytest.mark.parametrize("recover", ["zero_grad", "step", "skip"])
@pytest.mark.parametrize("inputs", ["all", "non-held"])
@pytest.mark.parametrize("bucket_bytes", [1 << 20, 64], ids=["bucketed", "small-bucket"])
def test_the_loop_with_a_probe_after_a_raised_backward_is_the_plain_loop(
    bucket_bytes, inputs, recover
):
    """raise, probe with autograd.grad, then recover (zero_grad, step, or skip: the next backward
    adds to what ``.grad`` holds) and go on; bit for bit the plain loop's."""
    a, opt, b, handle = _pair(False, bucket_bytes=bucket_bytes)
    for m, o in ((a, opt), (b, handle)):
        _raise_then_probe(m, inputs)
        if recover == "zero_grad":
            o.zero_grad()
        elif recover == "step":
            o.step()
            o.zero_grad()
        for i in range(2, 5):
            m(_x(i)).backward()
            o.step()
            o.zero_grad()
    assert_same_parameters(a, b)
    assert_same_state(opt.state_dict()["state"], handle.state_dict()["state"])
    assert all(p.grad is None for p in b.parameters())


class _HookError(Exception):
    pass


def _hooked_loop(m, o, inner, raise_at: int) -> None:
    armed = [False]

    def hook(opt, args, kwargs):
        if armed[0]:
            armed[0] = False
            raise _HookError("step pre-hook")

    inner.register_step_pre_hook(hook)
    for i in range(4):
        armed[0] = i == raise_at
        try:
            m(_x(i)).backward()
            o.step()
        except _HookError:
            pass
        o.zero_grad()


@pytest.mark.parametrize("raise_at", [0, 1])
@pytest.mark.parametrize("bucket_bytes", [0, 16, 1 << 20], ids=["alone", "small", "bucketed"])
def test_a_step_pre_hook_that_raises_before_any_update_is_the_plain_loop(bucket_bytes, raise_at):
    """The hook raises at the first update of one step (inside backward for the handle, at
    ``step()`` for the plain loop): nothing was applied, ``zero_grad()`` drops the gradients, the
    loop goes on; bit for bit the plain loop's."""
    a, opt, b, handle = _pair(False, bucket_bytes=bucket_bytes)
    _hooked_loop(a, opt, opt, raise_at)
    _hooked_loop(b, handle, handle.optimizer, raise_at)
    assert_same_parameters(a, b)
    assert_same_state(opt.state_dict()["state"], handle.state_dict()["state"])
    assert all(p.grad is None for p in b.parameters())


def _hook_raises_once(handle) -> None:
    armed = [True]

    def hook(opt, args, kwargs):
        if armed[0]:
            armed[0] = False
            raise _HookError("step pre-hook")

    handle.optimizer.register_step_pre_hook(hook)


@pytest.mark.parametrize("bucket_bytes", [0, 1 << 20], ids=["alone", "bucketed"])
def test_a_step_pre_hook_error_leaves_the_state_of_no_update(bucket_bytes):
    """After the hook's error nothing changed (parameters, state) and ``zero_grad()`` drops what
    is held, not refused as after an update."""
    _, _, b, handle = _pair(False, bucket_bytes=bucket_bytes)
    before = _snap(b, handle)
    _hook_raises_once(handle)
    with pytest.raises(_HookError):
        b(_x(0)).backward()
    params, _, state = before
    for p, q in zip(params, b.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
    assert_same_state(state["state"], handle.state_dict()["state"])
    handle.zero_grad()
    assert all(p.grad is None for p in b.parameters())


def test_step_after_a_step_pre_hook_error_at_the_end_of_backward_is_the_plain_step():
    """The hook raises in the last bucket's update, once backward made every gradient (as the
    plain loop's ``step()``): they stay in ``.grad``, and ``step()`` applies them as the plain
    one retried would."""
    a, opt, b, handle = _pair(False, bucket_bytes=1 << 20)
    _hook_raises_once(handle)
    with pytest.raises(_HookError):
        b(_x(0)).backward()
    assert all(p.grad is not None for p in b.parameters())
    a(_x(0)).backward()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
    opt.step()
    opt.zero_grad()
    handle.step()
    handle.zero_grad()
    assert_same_parameters(a, b)
    assert_same_state(opt.state_dict()["state"], handle.state_dict()["state"])


@pytest.mark.parametrize("raised", [False, True], ids=["clean", "after-raised"])
@pytest.mark.parametrize("accumulate", [2, 3])
def test_autograd_grad_mid_cycle_is_no_micro_batch(accumulate, raised):
    """accumulate=N: an autograd.grad probe after the cycle's first micro-batch (which raised or
    not) adds nothing and counts for nothing. Before, the parameters' pre-hooks took it for the
    next micro-batch: it counted, and where it closed the cycle its end applied the gradients."""
    a, opt, b, handle = _pair(False, accumulate=accumulate)
    for m, o in ((a, opt), (b, handle)):
        _Boom.armed = RuntimeError if raised else None
        try:
            m(_x(0)).backward()
        except RuntimeError as e:
            assert "simulated" in str(e)
        torch.autograd.grad(m(_x(9)), list(m.parameters()))
        for i in range(1, accumulate + int(raised)):
            m(_x(i)).backward()
        o.step()
        o.zero_grad()
    assert_same_parameters(a, b)
    assert_same_state(opt.state_dict()["state"], handle.state_dict()["state"])
    assert all(p.grad is None for p in b.parameters())
