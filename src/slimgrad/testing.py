"""The tolerance rule and helpers shared by slimgrad's tests and benchmarks.

The rule (CONTRIBUTING.md): a result ``out`` computed at some dtype is correct when

    max|out - ref64| <= 2 * max|eager - ref64| + atol

where ``ref64`` is the same computation in float64 and ``eager`` is plain PyTorch at the same dtype
as ``out``. A fused or memory-lean op may be as wrong as eager PyTorch is at that dtype (times two),
never more.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "DEFAULT_ATOL",
    "HOST_SYNC_OPS",
    "OpObserver",
    "assert_within_rule",
    "count_host_syncs",
    "gradcheck_inplace",
    "grads_of",
    "max_abs_err",
    "rule_ok",
]

DEFAULT_ATOL = {
    torch.float64: 1e-12,
    torch.float32: 1e-6,
    torch.bfloat16: 1e-2,
    torch.float16: 1e-3,
}


def max_abs_err(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """Largest absolute difference, in float64; NaN/inf where they agree count as equal.

    Complex tensors are compared on their real and imaginary parts (the largest difference of
    either part); a real tensor against a complex one counts as imaginary part 0.
    """
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        return float("inf")
    if a.shape != b.shape:
        raise ValueError(
            f"slimgrad.testing.max_abs_err: shapes differ; expected equal shapes, got "
            f"{tuple(a.shape)} and {tuple(b.shape)}. Compare the same tensors."
        )
    if a.numel() == 0:
        return 0.0
    a, b = a.detach(), b.detach()
    if a.is_complex() or b.is_complex():
        a = torch.view_as_real(a.to(torch.complex128).resolve_conj())
        b = torch.view_as_real(b.to(torch.complex128).resolve_conj())
    if a.is_floating_point() and b.is_floating_point():
        # The fast path: one subtraction (the other side is promoted to float64 element by
        # element, exactly), no float64 copies, masks or ``where``. If every difference is finite,
        # equal elements differ by exactly 0 and this maximum is the masked one below; a NaN/inf
        # anywhere (max propagates it) takes the masked path. verify compares every gradient
        # twice: on a model with millions of parameters this was half its time.
        a64 = a if torch.float64 in (a.dtype, b.dtype) else a.to(torch.float64)
        d = float((a64 - b).abs_().max())
        if math.isfinite(d):
            return d
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    same = (a64 == b64) | (torch.isnan(a64) & torch.isnan(b64))
    diff = torch.where(same, torch.zeros_like(a64), (a64 - b64).abs())
    return float(diff.max().nan_to_num(nan=float("inf")))


def rule_ok(out, ref64, eager, atol: float | None = None) -> tuple[bool, float, float]:
    """Return (ok, err, bound) of the error rule for one tensor."""
    if atol is None:
        atol = DEFAULT_ATOL.get(out.dtype, 1e-6) if out is not None else 0.0
    err = max_abs_err(out, ref64)
    bound = 2.0 * max_abs_err(eager, ref64) + atol
    return err <= bound, err, bound


def assert_within_rule(
    out: torch.Tensor | Sequence[torch.Tensor | None] | None,
    ref64: torch.Tensor | Sequence[torch.Tensor | None] | None,
    eager: torch.Tensor | Sequence[torch.Tensor | None] | None,
    atol: float | None = None,
    names: Iterable[str] | None = None,
) -> None:
    """Assert the error rule for one tensor or a sequence of them (e.g. all gradients)."""
    if isinstance(out, torch.Tensor) or out is None:
        out, ref64, eager = [out], [ref64], [eager]
    names = list(names) if names is not None else [str(i) for i in range(len(out))]
    bad = []
    for name, o, r, e in zip(names, out, ref64, eager, strict=True):
        if o is None and r is None:
            continue
        ok, err, bound = rule_ok(o, r, e, atol)
        if not ok:
            bad.append(f"{name}: max|out-ref64|={err:.3e} > 2*max|eager-ref64|+atol={bound:.3e}")
    if bad:
        raise AssertionError("error rule violated:\n  " + "\n  ".join(bad))


def grads_of(
    loss: torch.Tensor, tensors: Sequence[torch.Tensor], **kwargs
) -> list[torch.Tensor | None]:
    """``torch.autograd.grad`` that returns None for tensors the loss does not depend on."""
    return list(torch.autograd.grad(loss, list(tensors), allow_unused=True, **kwargs))


def gradcheck_inplace(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor, **kwargs) -> bool:
    """gradcheck for an op that writes over its first input: each call runs on clones."""

    def wrapped(*xs):
        return fn(*(x.clone() for x in xs))

    return torch.autograd.gradcheck(wrapped, inputs, **kwargs)


# NOTE [Host syncs]
# On CUDA these aten ops make the CPU wait for the GPU: their result's size or value is needed on
# the host (``.item()``, ``bool(t)``, ``t.tolist()`` and ``int(t)`` all dispatch
# ``_local_scalar_dense``; ``nonzero`` / ``masked_select`` / ``unique`` size their output from the
# data; ``equal`` / ``is_nonzero`` return a Python bool). A training step that calls them cannot run
# ahead of the GPU: every Python overhead is then paid on the GPU's time as well. Counted at the
# dispatcher, so a CPU run shows what a CUDA run would sync on, without a GPU. Indexing with a
# boolean mask calls ``nonzero`` below the dispatcher and is counted through ``index.Tensor``
# with a bool index. A slimgrad custom op is counted through its Python implementation. Not seen on
# a CPU run: ``.tolist()`` and ``.cpu()`` (no dispatch on CPU tensors), which on CUDA copy to the
# host and wait.
HOST_SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense.default",
        "aten.item.default",
        "aten.nonzero.default",
        "aten.nonzero_static.default",
        "aten.masked_select.default",
        "aten.is_nonzero.default",
        "aten.equal.default",
        "aten.allclose.default",
        "aten._unique2.default",
        "aten.unique_dim.default",
        "aten.unique_consecutive.default",
        "aten.repeat_interleave.Tensor",
    }
)


class OpObserver(TorchDispatchMode):
    """A dispatch mode that sees every aten op of a step and keeps no tensor: subclasses define
    ``see(func, args, kwargs)``. ``ownership.owns_input`` grants under it what it grants unwatched,
    so the observed step is the real one (NOTE [Forward ownership from stated structure]); a
    slimgrad custom op is one call at the dispatcher, so its Python implementation runs under this
    mode and the ops inside it are seen (as slimgrad.memory does for bytes)."""

    _slimgrad_keeps_no_tensor = True

    def see(self, func, args, kwargs) -> None:
        raise NotImplementedError

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "slimgrad":
            from slimgrad._library import python_impl

            impl = python_impl(func.name())
            if impl is not None:
                with self:
                    return impl(*args, **kwargs)
        self.see(func, args, kwargs)
        return func(*args, **kwargs)


class _SyncCounter(OpObserver):
    # counts op names (NOTE [Host syncs])
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def see(self, func, args, kwargs) -> None:
        name = str(func)
        if name in HOST_SYNC_OPS:
            if name != "aten.nonzero_static.default":  # static size: no sync
                self.counts[name] += 1
        elif name.startswith("aten.index.Tensor") or name.startswith("aten.index_put"):
            idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx or ()):
                self.counts[name + " (bool mask)"] += 1


@contextlib.contextmanager
def count_host_syncs() -> Iterator[Counter]:
    """Count, by op, the calls that would make the host wait for a CUDA device (NOTE [Host syncs]).

    Works on any device (the ops are counted at the dispatcher, not timed)::

        with count_host_syncs() as syncs:
            model(x).sum().backward()
        assert sum(syncs.values()) == 0, syncs

    Backward ops are counted too: the autograd engine runs them on this thread for CPU tensors
    (a CUDA backward runs on the engine's device thread, where a mode entered here is not seen).
    """
    counts: Counter = Counter()
    with _SyncCounter(counts):
        yield counts
