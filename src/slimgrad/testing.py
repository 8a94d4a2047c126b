"""The tolerance rule and helpers shared by slimgrad's tests and benchmarks.

The rule (CONTRIBUTING.md): a result ``out`` computed at some dtype is correct when

    max|out - ref64| <= 2 * max|eager - ref64| + atol

where ``ref64`` is the same computation in float64 and ``eager`` is plain PyTorch at the same dtype
as ``out``. A fused or memory-lean op may be as wrong as eager PyTorch is at that dtype (times two),
never more.

A gradient that is 0 in exact arithmetic (a cancellation) gets a second look where it fails that
rule: eager's error is pooled over a few ulp-nudged re-runs (NOTE [Gradients that cancel]).
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
    "REDRAWS",
    "OpObserver",
    "assert_within_rule",
    "count_host_syncs",
    "gradcheck_inplace",
    "grads_of",
    "max_abs_err",
    "nudge_ulp_",
    "redrawn_err",
    "rule_ok",
    "ulp_nudged",
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


# NOTE [Gradients that cancel]
# A gradient that is 0 in exact arithmetic (a bias before a BatchNorm, timm's LearnableAffineBlock
# bias; an attention's key bias, by softmax's shift invariance) is, at float32, the rounding noise
# of a sum whose terms cancel: eager's value and the converted one are two draws of that noise,
# and the float64 reference is ~1e-15. The rule compares one draw with one draw, so where eager's
# lands on (or near) the reference, its error and the bound collapse and a correct conversion
# fails: timm HGNetV2-B0 at batch 2 (eager exactly 0.0 against float64's -1.8e-15), HF CLIP's
# text key bias (3.29e-6 against a bound of 2.23e-6 in one process, within it in another). The
# size of that noise is the size of the terms that cancel times the rounding unit; nothing in the
# three results shows that size when eager's draw is lucky, and a float64 pass over |terms| would
# need every backward rewritten. Eager itself can show it: moved by one ulp, a parameter gives
# the same function to within rounding, and every product and sum downstream rounds afresh: a
# new, independent draw of eager's noise. So a gradient that fails the rule gets a second look:
# eager runs again ``REDRAWS`` times, each with every nonzero floating parameter (and input) moved
# one ulp up or down at random (``nudge_ulp_``), next to a float64 reference run on those same
# nudged values widened exactly (``ulp_nudged``), so each draw's error is pure rounding, not the
# nudge's effect; eager's error is the largest over its draws, the first included, and the rule
# is otherwise unchanged (``rule_ok(..., redraws=)``). Exact zeros stay 0 (a zero gamma, a dead
# unit stays structure), the dropout masks are the same (same seed).
# A draw counts only where it is a rounding redraw of the SAME computation. Where the start sits on
# a discontinuity (two equal branches into torch.maximum; a constant, padding-like row through a
# LayerNorm with bias 0 into a ReLU, exactly 0), a nudge takes one branch, float32 eager and
# float64 may take different ones, and the draw's "error" is the size of the gradient: a 1.3x, 2x
# or zeroed gradient passed (review 29: pooled 4.8e-2 against 8.2e-9 from the plain draw). A
# smooth computation answers a nudge linearly; a branch taken differently does not shrink with the
# nudge. So the float64 reference runs again at the nudge shrunk 2**-10 toward the start
# (``ulp_nudged(..., shrunk=True)``), and J = (g64(shrunk) - g64) - 2**-10 * (g64(nudged) - g64)
# is the part of the nudge's effect on the float64 gradient that is not linear in it: the
# reference's own rounding where nothing branches (max|J| measured below 1e-8 of eager's error in
# the draw, max|e_k - g64(nudged)|, for a float64 pass; up to 4.2e-3 in HF Doge, whose float64
# copy rounds to float32 inside its norms), the jump itself or its 1/n share (an n-way tie float64
# splits) where a branch flips (measured 0.8-5e4 of eager's error). A tensor whose max|J| exceeds
# 1/16 of eager's error in any draw sits at a branch point, and none of its draws counts (tested
# over the whole tensor and every draw, because float64 and float32 flip at different elements
# and in different draws: an element where only float32 flipped shows no J of its own). A draw
# whose eager value lands on the reference (exactly 0 in a cancelling gradient: the lucky draw
# this look exists for) has an error as small as float64's own rounding, which J carries too
# (timm HGNetV2-B0 at batch 2, seeds 4 and 6: J 1.2e-14 against an error of 8.9e-16 voided draws
# of 4.3e-6 to 8.1e-6); its J is judged against 1/16 of the pooled error instead. The check
# only takes draws away: where the reference is as noisy as eager or a tie splits more than 16
# ways evenly, the plain rule stands. A float32 flip at a start that is near a branch point but
# not on one (within eager's rounding, beyond float64's) shows no J and is pooled: eager's own
# error within an ulp of the start is then that large. Within these limits it cannot pass a wrong
# gradient: the pooled error is still rounding noise (the largest of a few draws, measured 1-2x
# one draw), while a real mistake in a cancelling gradient (one term scaled 1.01x, an offset of
# 1e-4 of the terms' size) leaves a residual of the terms' size, orders above it; gradients that
# pass the plain rule are not re-run, so the cost (two float64 steps and one eager step per draw)
# is paid only where it is needed. The exact-zero check (NOTE [Exact zeros are structure] in
# slimgrad.verify) keeps eager's error from the plain draw.
REDRAWS = 4  # ulp-nudged eager draws of a second look (NOTE [Gradients that cancel])
_SHRUNK = 2.0**-10  # the shrunk nudge of the reference's linearity check
_JUMP_SHARE = 1.0 / 16  # max|J| at most this share of eager's error in every draw


def rule_ok(
    out,
    ref64,
    eager,
    atol: float | None = None,
    redraws: Sequence[tuple[torch.Tensor | None, ...]] = (),
) -> tuple[bool, float, float]:
    """Return (ok, err, bound) of the error rule for one tensor.

    ``redraws`` are ``(eager_k, ref64_k, shrunk64_k)`` triples from ulp-nudged re-runs
    (``ulp_nudged``): eager's error is then the largest over its draws, where they are rounding
    redraws of the same computation (``redrawn_err``; NOTE [Gradients that cancel]).
    """
    if atol is None:
        atol = DEFAULT_ATOL.get(out.dtype, 1e-6) if out is not None else 0.0
    err = max_abs_err(out, ref64)
    for d in redraws:
        if len(d) != 3:
            raise ValueError(
                "slimgrad.testing.rule_ok: a redraw is (eager_k, ref64_k, shrunk64_k); expected 3 "
                f"tensors, got {len(d)}. Run the reference again within ulp_nudged(..., "
                "shrunk=True) and pass its result as the third."
            )
    eager_err = max(max_abs_err(eager, ref64), redrawn_err((*d, ref64) for d in redraws))
    bound = 2.0 * eager_err + atol
    return err <= bound, err, bound


def redrawn_err(
    draws: Iterable[
        tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
    ],
) -> float:
    """Eager's error pooled over ulp-nudged draws of one tensor (NOTE [Gradients that cancel]).

    Each draw is ``(eager_k, ref64_k, shrunk64_k, ref64)``: eager and the float64 reference at
    the nudge, the reference at the nudge shrunk 2**-10 toward the start (``ulp_nudged(...,
    shrunk=True)``) and un-nudged. Returns the largest ``max|eager_k - ref64_k|``, or 0.0 where
    any draw shows the float64 value jumping: ``max|J| > max|eager_k - ref64_k| / 16`` (or
    ``> pooled / 256`` where that is larger: a draw where eager landed on the reference) with
    ``J = (shrunk64_k - ref64) - 2**-10 * (ref64_k - ref64)``, the part of the nudge's effect that
    is not linear in it (a branch taken differently). A draw with a missing (None) or non-finite
    tensor, or with shapes that differ, explains nothing.

    Example:
        >>> r = torch.tensor([0.5], dtype=torch.float64)  # a tie float64 splits evenly
        >>> redrawn_err([(torch.tensor([0.0]), r + 0.5, r + 0.5, r)])  # a branch flip
        0.0
        >>> redrawn_err([(torch.tensor([0.5]), r + 1e-9, r + 1e-12, r)])  # rounding
        1e-09
    """
    errs, jumps = [], []
    for ts in draws:
        if any(t is None for t in ts) or len({tuple(t.shape) for t in ts}) > 1:
            continue
        if ts[0].numel() == 0:
            continue
        e, r, s, r0 = (t.detach() for t in ts)
        if any(t.is_complex() for t in (e, r, s, r0)):
            e, r, s, r0 = (
                torch.view_as_real(t.to(torch.complex128).resolve_conj()) for t in (e, r, s, r0)
            )
        else:
            e, r, s, r0 = (t.to(torch.float64) for t in (e, r, s, r0))
        err = float((e - r).abs().max())
        jump = float(((s - r0) - _SHRUNK * (r - r0)).abs().max())
        if not (math.isfinite(err) and math.isfinite(jump)):
            continue
        errs.append(err)
        jumps.append(jump)
    pooled = max(errs, default=0.0)
    # a branch point: no draw of this tensor counts. A draw's J is judged against its own error,
    # or 1/16 of the pooled one where that is larger (a draw where eager lands on the reference:
    # NOTE [Gradients that cancel])
    floor = _JUMP_SHARE * pooled
    if any(j > _JUMP_SHARE * max(e, floor) for e, j in zip(errs, jumps)):
        return 0.0
    return pooled


def assert_within_rule(
    out: torch.Tensor | Sequence[torch.Tensor | None] | None,
    ref64: torch.Tensor | Sequence[torch.Tensor | None] | None,
    eager: torch.Tensor | Sequence[torch.Tensor | None] | None,
    atol: float | None = None,
    names: Iterable[str] | None = None,
    redraws: Sequence | None = None,
) -> None:
    """Assert the error rule for one tensor or a sequence of them (e.g. all gradients).

    ``redraws`` (optional): per tensor, its ``(eager_k, ref64_k, shrunk64_k)`` triples from
    ulp-nudged re-runs (NOTE [Gradients that cancel]).
    """
    if isinstance(out, torch.Tensor) or out is None:
        out, ref64, eager = [out], [ref64], [eager]
        redraws = [redraws or ()]
    names = list(names) if names is not None else [str(i) for i in range(len(out))]
    redraws = list(redraws) if redraws is not None else [()] * len(out)
    bad = []
    for name, o, r, e, d in zip(names, out, ref64, eager, redraws, strict=True):
        if o is None and r is None:
            continue
        ok, err, bound = rule_ok(o, r, e, atol, d)
        if not ok:
            more = f" (eager pooled over {1 + len(d)} draws)" if d else ""
            bad.append(
                f"{name}: max|out-ref64|={err:.3e} > 2*max|eager-ref64|+atol={bound:.3e}{more}"
            )
    if bad:
        raise AssertionError("error rule violated:\n  " + "\n  ".join(bad))


def nudge_ulp_(tensors: Iterable[torch.Tensor], generator: torch.Generator) -> None:
    """Move every nonzero element of each floating tensor one ulp up or down at random, in place.

    Zeros and non-finite values stay as they are (NOTE [Gradients that cancel]).
    """
    with torch.no_grad():
        for t in tensors:
            if not t.is_floating_point() or t.numel() == 0:
                continue
            up = torch.randint(0, 2, t.shape, generator=generator, dtype=torch.bool)
            inf = torch.tensor(math.inf, dtype=t.dtype, device=t.device)
            moved = torch.nextafter(t, torch.where(up.to(t.device), inf, -inf))
            t.copy_(torch.where((t == 0) | ~torch.isfinite(t), t, moved))


def _toward(start: torch.Tensor, nudged: torch.Tensor, shrunk: bool) -> torch.Tensor:
    # the nudged values widened, or (shrunk) the start plus 2**-10 of each one-ulp step: exact in
    # float64 (a float32 or narrower value and 2**-10 of its ulp fit in 53 bits)
    if not shrunk:
        return nudged.to(torch.float64)
    s64 = start.to(torch.float64)
    return s64 + _SHRUNK * (nudged.to(torch.float64) - s64)


@contextlib.contextmanager
def ulp_nudged(
    eager: torch.nn.Module,
    ref64: torch.nn.Module,
    draw: int,
    inputs: Iterable[torch.Tensor] = (),
    *,
    shrunk: bool = False,
    wide_inputs: Iterable[torch.Tensor | None] = (),
) -> Iterator[None]:
    """Within: ``eager``'s floating parameters (and ``inputs``) moved by one ulp, ``ref64``'s set
    to the same values widened (NOTE [Gradients that cancel]); all put back on exit.

    ``draw`` seeds the directions; ``ref64`` is the float64 copy of ``eager`` (same parameter
    names). The caller steps both models within and keeps their buffers as it needs.
    ``shrunk=True``: ``ref64``'s parameters, and ``wide_inputs`` (float64 tensors, one per
    tensor of ``inputs``, None where it has none), go to the start plus 2**-10 of the same one-ulp
    steps instead: the reference at the shrunk nudge ``redrawn_err`` takes.
    """
    gen = torch.Generator().manual_seed(0x5EED + draw)
    params = dict(eager.named_parameters())
    wide = dict(ref64.named_parameters())
    if set(params) != set(wide):
        raise ValueError(
            "slimgrad.testing.ulp_nudged: the models' parameters differ; expected ref64 to be a "
            f"float64 copy of eager, got {len(params)} and {len(wide)} parameters. Pass the "
            "float64 copy of the same model."
        )
    inputs = list(inputs)
    wide_inputs = list(wide_inputs) if shrunk else []
    if shrunk and len(wide_inputs) != len(inputs):
        raise ValueError(
            "slimgrad.testing.ulp_nudged: shrunk=True takes the reference's float64 copy of each "
            f"input; expected {len(inputs)} wide_inputs (None where an input has none), got "
            f"{len(wide_inputs)}. Pass one per tensor of inputs, in the same order."
        )
    pairs = list(zip(inputs, wide_inputs))
    inputs = [t for t in inputs if t.is_floating_point()]
    held = [(t, t.detach().clone()) for t in [*params.values(), *wide.values(), *inputs]]
    held += [(w, w.detach().clone()) for _, w in pairs if w is not None]
    start = {id(t): v for t, v in held[: len(params)] + held[len(params) + len(wide) :]}
    try:
        nudge_ulp_([*params.values(), *inputs], gen)
        with torch.no_grad():
            for n, p in params.items():
                if p.is_floating_point() and wide[n].is_floating_point():
                    wide[n].copy_(_toward(start[id(p)], p, shrunk))
            for t, w in pairs:
                if w is not None and t.is_floating_point():
                    w.copy_(_toward(start[id(t)], t, shrunk))
        yield
    finally:
        with torch.no_grad():
            for t, v in held:
                t.copy_(v)


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

    # computes every op it sees as asked, storing no result it could hand back in place of a
    # later call's: NOTE [The down product after the saves] in slimgrad/ops/gated_mlp.py
    _slimgrad_reads_ops = True

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
