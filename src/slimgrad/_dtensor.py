"""DTensor (tensor parallel, sequence parallel) arguments at a slimgrad op's entry.

slimgrad's Functions and custom ops are written for plain tensors. A ``DTensor`` reaching one either
works through DTensor's own dispatch of the aten ops inside (relu, tanh, sigmoid, leaky_relu,
linear, matmul, ``gated_mlp``, ``glu``, ``glu_linear``: measured, same values, gradients and
placements as eager on DTensors) or fails deep inside with an error that names neither the op nor
a fix (a ``slimgrad::*`` custom op has no sharding strategy; ``nonzero`` cannot propagate). For the
latter, each op's public function calls ONE of the helpers below at entry; the exact lines are in
the project notes (dtensor_callsites.md). See NOTE [DTensor at a slimgrad op].

# NOTE [DTensor at a slimgrad op]
An op may run on the local shards, wrapped back into a DTensor, only when that is exactly what
eager computes on the DTensor:

- ``pointwise`` (silu, gelu, elu, mish, hard* ...): every tensor argument a DTensor on the same
  mesh with the same placements and shape, none ``Partial`` (a nonlinear function of a partial
  sum is not the sum of the functions). The output gets the input's placements, as DTensor's own
  pointwise strategy gives. ``inplace=True`` is refused (the local shard aliases the DTensor; the
  out-of-place call is the fix).
- ``rowwise`` (layer_norm, rms_norm, hf_rms_norm over the trailing ``normalized_ndim`` dims): the
  input sharded only on leading dims (sequence parallel's ``Shard(1)``) or replicated, not
  ``Partial``; weight and bias replicated DTensors on the same mesh. Each rank normalizes whole
  rows, so the output keeps the input's placements; a parameter's local gradient is this rank's
  rows' share, so it leaves as ``Partial`` (``to_local(grad_placements=...)``) and DTensor sums it
  across ranks, as eager's sharding strategy for the norm does.
- everything else (``refuse``): dropout (the local generator would draw other masks than DTensor's
  RNG tracker: not exact), fused attention and the cross-entropy ops (sharded softmax dims), any
  mix of DTensor and plain tensors. The error names the op, what it got and the fix: keep the
  op's input local (``use_local_output=True`` on the parallel style before it), or leave the
  module unconverted (``convert_(model, filter_fn=...)``).

Nothing here imports ``torch.distributed.tensor``: ``is_dtensor`` answers False for plain tensors
at once and, for subclasses (a Parameter), looks the DTensor class up in ``sys.modules`` (none can
exist before that module is imported), so ``import slimgrad`` and the plain path stay as cheap as
before.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

__all__ = ["any_dtensor", "fully_sharded", "is_dtensor", "pointwise", "refuse", "rowwise"]

_FIX_LOCAL = (
    "Keep this op's input local (use_local_output=True on the parallel style before it, or "
    "x.to_local()), or leave the module unconverted (convert_(model, filter_fn=...))"
)


def fully_sharded(model: torch.nn.Module) -> str | None:
    """The qualified name of the first module of ``model`` that FSDP2's ``fully_shard`` already
    wrapped (``""`` for ``model`` itself), or None; imports nothing (NOTE [Convert before
    fully_shard])."""
    # NOTE [Convert before fully_shard]
    # fully_shard keeps, per parameter, the module that owns it and the name it has there, and
    # sets the all-gathered parameter on that module before each forward (the sharded DTensor
    # after). A module convert_ swaps in afterwards shares the Parameter objects but is not that
    # module: it keeps the sharded DTensors, and its first forward failed inside torch ("addmm got
    # mixed torch.Tensor and DTensor"). Re-pointing FSDP's records would take its private state,
    # so convert_ refuses a model holding an FSDPModule (public ``torch.distributed.fsdp``; none
    # can exist before that module is imported, so nothing is imported here).
    mod = sys.modules.get("torch.distributed.fsdp")
    cls = getattr(mod, "FSDPModule", None) if mod is not None else None
    if not isinstance(cls, type):
        return None
    for name, m in model.named_modules():
        if isinstance(m, cls):
            return name
    return None


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (cheap for plain tensors)."""
    if t is None or type(t) is torch.Tensor or not isinstance(t, torch.Tensor):
        return False
    # no DTensor can exist before its module is imported: never import it here (a Parameter
    # weight reaches this line on every call)
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def _dtensor_class() -> type | None:
    # None while no DTensor can exist: its module not imported, or its class not defined yet
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


_CLS: list[type] = []  # the DTensor class, kept once its module has defined it


def any_dtensor(*tensors: object) -> bool:
    """Whether any of ``tensors`` is a DTensor: the guard of every call site."""
    # is_dtensor's answer for each; the class is looked up until it exists, then kept (this runs
    # on every op call)
    if _CLS:
        cls = _CLS[0]
    else:
        cls = _dtensor_class()
        if cls is None:
            return False
        # kept by an eager call only: a trace that kept it would guard on the list being empty,
        # and the compiled model's second call would trace and compile again
        if not torch.compiler.is_compiling():
            _CLS.append(cls)
    for t in tensors:
        if isinstance(t, cls):
            return True
    return False


def _describe(name: str, t: object) -> str:
    if is_dtensor(t):
        return f"{name} a DTensor with placements {tuple(t.placements)}"
    return f"{name} a {type(t).__name__}"


def refuse(api: str, **tensors: object) -> None:
    """Raise a clear ``NotImplementedError`` if any of ``tensors`` (by argument name) is a DTensor.

    Args:
        api: the public name, e.g. ``"slimgrad.ops.dropout"``.
        **tensors: the op's tensor arguments by name (None allowed).

    Raises:
        NotImplementedError: a DTensor among them.
    """
    if not any_dtensor(*tensors.values()):  # the common case, in one module lookup
        return
    got = [_describe(k, t) for k, t in tensors.items() if is_dtensor(t)]
    if got:
        raise NotImplementedError(
            f"{api}: DTensor arguments are not supported by this op; expected plain "
            f"torch.Tensor arguments (local shards), got {', '.join(got)}. {_FIX_LOCAL}."
        )


def _check_all_dtensor(api: str, tensors: dict) -> None:
    plain = [k for k, t in tensors.items() if t is not None and not is_dtensor(t)]
    if plain:
        got = ", ".join(_describe(k, tensors[k]) for k in plain)
        raise NotImplementedError(
            f"{api}: DTensor and plain tensor arguments mixed; expected every tensor argument a "
            f"DTensor on the same mesh, got {got}. Distribute them all (distribute_tensor / "
            f"DTensor.from_local) or pass local shards only."
        )


def _partial(t) -> bool:
    return any(p.is_partial() for p in t.placements)


def pointwise(api: str, fn: Callable, *tensors: torch.Tensor, **kwargs) -> torch.Tensor:
    """Run the pointwise op ``fn(*local_shards, **kwargs)`` on DTensor arguments, or raise.

    NOTE [DTensor at a slimgrad op]: same mesh, placements and shape for every tensor argument,
    none Partial, no ``inplace=True``; the output carries the input's placements.

    Args:
        api: the public name for errors, e.g. ``"slimgrad.ops.silu"``.
        fn: the op itself (called on plain local tensors, so it takes its own slimgrad path).
        *tensors: its tensor arguments, in order.
        **kwargs: its other arguments.

    Returns:
        A DTensor, the result on each rank's shard.

    Raises:
        NotImplementedError: the combination is not exact on local shards (see the NOTE).
    """
    named = {f"argument {i}": t for i, t in enumerate(tensors)}
    _check_all_dtensor(api, named)
    if kwargs.get("inplace"):
        raise NotImplementedError(
            f"{api}: inplace=True on a DTensor; expected inplace=False, got inplace=True. Call it "
            "out of place (inplace=False) on DTensors."
        )
    first = tensors[0]
    for k, t in named.items():
        if _partial(t):
            raise NotImplementedError(
                f"{api}: a Partial DTensor (a pending sum) cannot go through a nonlinear op "
                f"shard by shard; expected Shard or Replicate placements, got {k} with "
                f"{tuple(t.placements)}. Redistribute it first (t.redistribute(placements="
                "[Replicate()])), or use RowwiseParallel's default output (Replicate)."
            )
        if (
            t.device_mesh != first.device_mesh
            or tuple(t.placements) != tuple(first.placements)
            or t.shape != first.shape
        ):
            raise NotImplementedError(
                f"{api}: DTensor arguments laid out differently; expected one mesh, placements "
                f"and shape for all, got {tuple(first.placements)} {tuple(first.shape)} and "
                f"{tuple(t.placements)} {tuple(t.shape)}. Redistribute them to one layout first."
            )
    out = fn(*(t.to_local() for t in tensors), **kwargs)
    return _wrap(out, first)


def rowwise(
    api: str,
    fn: Callable,
    input: torch.Tensor,
    params: dict[str, torch.Tensor | None],
    normalized_ndim: int,
    **kwargs,
) -> torch.Tensor:
    """Run a norm over the trailing ``normalized_ndim`` dims on a DTensor input, or raise.

    ``fn(local_input, **local_params, **kwargs)``. NOTE [DTensor at a slimgrad op]: the input
    sharded on leading dims only (or replicated), not Partial; ``params`` (weight, bias; None
    allowed) replicated DTensors on the input's mesh; their gradients leave as Partial sums.

    Args:
        api: the public name for errors, e.g. ``"slimgrad.ops.rms_norm"``.
        fn: the op (called on plain local tensors).
        input: the DTensor to normalize.
        params: the op's parameter arguments by keyword name.
        normalized_ndim: how many trailing dims each row spans.
        **kwargs: the op's other keyword arguments.

    Returns:
        A DTensor with ``input``'s placements.

    Raises:
        NotImplementedError: the combination is not exact on local shards (see the NOTE).
    """
    from torch.distributed.tensor import Partial, Replicate

    _check_all_dtensor(api, {"input": input, **params})
    first_normalized = input.ndim - normalized_ndim
    for p in input.placements:
        if p.is_partial() or (p.is_shard() and p.dim % max(input.ndim, 1) >= first_normalized):
            raise NotImplementedError(
                f"{api}: each rank must hold whole rows (the last {normalized_ndim} dim(s)); "
                f"expected the input sharded on dims < {first_normalized} or replicated, got "
                f"placements {tuple(input.placements)}. Use SequenceParallel (Shard(1)) or "
                "redistribute the input to Replicate() first."
            )
    local = {}
    for k, t in params.items():
        if t is None:
            local[k] = None
            continue
        if t.device_mesh != input.device_mesh or not all(p.is_replicate() for p in t.placements):
            raise NotImplementedError(
                f"{api}: the norm's {k} must be replicated on the input's mesh; expected "
                f"placements (Replicate(),), got {tuple(t.placements)}. Distribute it with "
                "Replicate() (SequenceParallel does)."
            )
        grad_pl = [Partial() if ip.is_shard() else Replicate() for ip in input.placements]
        local[k] = t.to_local(grad_placements=grad_pl)
    out = fn(input.to_local(), **local, **kwargs)
    return _wrap(out, input)


def _wrap(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if out.stride() == like.to_local().stride():  # the global shape (uneven shards too)
        return DTensor.from_local(
            out,
            like.device_mesh,
            like.placements,
            run_check=False,
            shape=like.shape,
            stride=like.stride(),
        )
    return DTensor.from_local(out, like.device_mesh, like.placements, run_check=False)
