"""What a step's backward recomputes, counted op by op (issue 33, "lower recompute than SAC").

The planner's recompute is matmul FLOPs (``Plan.recompute_flops``); SAC recomputes none of those
and every other op of its blocks. To compare the two where matmul FLOPs are equal, this counts,
for the ops one backward runs (checkpoint recomputes included: they run inside it), the elements
the non-matmul, non-view ops compute (each tensor output's numel; an in-place op's too; not an
output that shares an input's storage without writing it, e.g. ``_unsafe_view``, nor the
uninitialised memory of ``empty`` and its kin) and the matmul FLOPs (``torch.utils.flop_counter``'s
formulas, and CPU's fused SDPA counted as the planner counts it). A slimgrad custom op is counted
as the ATen ops its Python implementation runs, as the memory tracker runs it. The *elementwise
recompute* of a choice vector is its backward's elements less those of the same model without
recompute: a plan against every block ``lean``; SAC (every block ``eager+sac``) against every
block ``eager``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from slimgrad._library import python_impl
from slimgrad.plan import _flop_formulas, apply_choices

_UNINITIALISED = frozenset(
    (
        "aten.empty",
        "aten.empty_like",
        "aten.new_empty",
        "aten.empty_strided",
        "aten.new_empty_strided",
    )
)


def _key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):
        return None


def _outputs(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, list | tuple):
        return [t for o in out for t in _outputs(o)]
    return []


class BackwardCounts(TorchDispatchMode):
    """``with BackwardCounts() as c: loss.backward()``: ``c.elements`` (non-matmul, non-view ops'
    computed elements) and ``c.matmul_flops``, over the ops run inside."""

    # computes every op it sees as asked, storing no result it could hand back in place of a
    # later call's: NOTE [The down product after the saves] in slimgrad/ops/gated_mlp.py
    _slimgrad_reads_ops = True

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0
        self.matmul_flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = python_impl(func.name()) if func.namespace == "slimgrad" else None
        if impl is not None:  # its ATen ops come back through this mode
            with self:
                return impl(*args, **kwargs)
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        formula = _flop_formulas().get(packet)  # the planner's: CPU's fused SDPA included
        if formula is not None:
            self.matmul_flops += formula(*args, **kwargs, out_val=out)
        elif not func.is_view and str(packet) not in _UNINITIALISED:
            outs = _outputs(out)
            if not func._schema.is_mutable:  # an alias of an input computes nothing
                ins = {_key(t) for t in _outputs([*args, *kwargs.values()])} - {None}
                outs = [t for t in outs if _key(t) not in ins]
            self.elements += sum(t.numel() for t in outs)
        return out


def backward_counts(
    make: Callable[[], Any], choices: dict, *, fake: str | None = None, **convert_kwargs: Any
) -> tuple[int, int]:
    """(elements, matmul FLOPs) of the backward of one step of ``make()``'s model with ``choices``
    applied (:func:`slimgrad.plan.apply_choices`); a real step, or with ``fake="cuda"`` (or
    ``"cpu"``) a fake-tensor step as :func:`slimgrad.memory.estimate` runs it for that device."""
    with contextlib.ExitStack() as stack:
        if fake is not None:
            from slimgrad import memory
            from slimgrad.convert_handlers.device_rule import stands_for

            stack.enter_context(memory.fake_tensors(fake))
            if fake == "cuda":
                stack.enter_context(stands_for("cuda"))
                stack.enter_context(memory._CudaFunctions())
        fwd, model = make()
        apply_choices(model, choices, **convert_kwargs)
        torch.manual_seed(0)
        loss = fwd()
        with BackwardCounts() as c:
            loss.backward()
    return c.elements, c.matmul_flops
