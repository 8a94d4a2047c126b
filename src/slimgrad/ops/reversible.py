"""Reversible chains: keep no activations, rebuild every block's input from its output in backward.

Math. A coupling block splits its input along ``split_dim`` into ``(x1, x2)`` (first half
``ceil(n/2)``):

    additive:  y1 = x1 + F(x2)             inverse:  x2 = y2 - G(y1)
               y2 = x2 + G(y1)                       x1 = y1 - F(x2)
    affine:    (r, t) = F(x2),  s = exp(c * tanh(r / c)),  y1 = x1 * s + t,   x1 = (y1 - t) / s

so ``s`` lies in ``[e^-c, e^c]`` and can never reach 0. Backward of one block, given ``(y1, y2)``
and ``(dy1, dy2)``, evaluates G and F exactly once each and uses each evaluation both to invert and
for the vector-Jacobian product (the RevNet algorithm):

    g = G(y1) (with grad): x2 = y2 - g, dy1 += (dg/dy1)^T dy2, dθ_G = (dg/dθ_G)^T dy2
    f = F(x2) (with grad): x1 = y1 - f, dx2 = dy2 + (df/dx2)^T dy1, dθ_F = (df/dθ_F)^T dy1,
        dx1 = dy1

Exact mode (additive couplings): the residual stream is held in fixed point, values on the grid
``2^-grid_bits`` carried in float64 (every sum of grid values below ``2^(53-grid_bits)`` is exact),
F and G run in the input's dtype, and their outputs are rounded onto the grid (straight-through in
backward: ``round(f) = f`` for the gradient). Then ``x1 = (x1 + round(F(x2))) - round(F(x2))`` holds
bit for bit, every block input is rebuilt exactly, and the gradients equal plain autograd's on the
same network to the bit. The rounding itself runs in float32 (NOTE [Exact-mode arithmetic without
float64 passes]); its result is the float64 one.

Cost: backward evaluates every F and G once more than plain autograd: the recompute RevNet cannot
avoid (its inversion and its vector-Jacobian product share that one evaluation; nothing else is
recomputed, copied or zeroed). Measured on a shared 2-core CPU, one thread, chains of conv3x3+ReLU
couplings on 8x64x32x32 (``benchmarks/results/reversible.jsonl``): one no-grad forward of every F
and G costs 0.27-0.28 of a plain step (``fg_over_plain``), so about 1.2-1.3x plain is the floor
there; step ratios (medians of 5 interleaved pairs, N = 4..64) were 1.16-1.35 in float mode,
1.11-1.40 in exact mode (against plain autograd of the same fixed-point network) and 1.37-1.56 for
torch.utils.checkpoint. Side by side at N = 64 (CPU time, 5 interleaved
steps): revlib 1.7.2 1.28, a minimal hand-written RevNet backward 1.25, this 1.31.

Memory: saves the chain output y (float mode: 1x the input, often shared with the next layer; exact
mode: the float64 stream, 8 B/elt) + per block 2 CPU RNG states (5056 B each) + 64 sampled elements;
eager saves every activation of every F and G (and every block output), growing linearly with depth.

# NOTE [Reversible chains: nothing is freed, nothing is kept]
memcnn saves memory by emptying the input's storage (``storage().resize_(0)``) and refilling it in
backward. That storage belongs to the user: views, hooks, residuals and ops that saved it still read
it (segfaults, wrong gradients, "modified by an inplace operation"). Here no storage is ever freed,
resized or swapped. The whole chain is one autograd Function whose forward runs the blocks under
no_grad and saves only its own output; every block input is dropped simply because nothing
references it anymore. Tensors the user still holds (the chain input, a view of it, a tensor
captured by a hook) stay intact because we never write to them. Backward walks the blocks in
reverse, rebuilding inputs from outputs and returning gradients through autograd (parameters are
inputs of the Function, so each gets exactly one AccumulateGrad: DDP hooks and ``autograd.grad``
work, and ``.grad`` is never assigned by hand). State for backward is kept in a plain object on ctx
that references no output tensor, so a graph that is dropped without backward is freed by reference
counting, with no cycle. The one write backward does: a block input it rebuilt itself becomes the
next block's output and is overwritten by that block's rebuild, but only when no other tensor
aliases its storage (a hook inside F or G may hold one); the saved output, the incoming gradient
and every gradient are never written.

Recompute fidelity: per block, the CPU (and device) RNG state is captured right before F and right
before G, and restored for each one's recompute inside ``fork_rng`` (dropout masks repeat bit for
bit, the caller's RNG is untouched); BatchNorm layers in training mode run the recompute with
``track_running_stats`` off (batch statistics as in forward, running statistics updated once per
step, by forward); the forward's autocast state is re-entered for the recompute, and left before the
vector-Jacobian product so backward kernels run as in eager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from slimgrad._compile import eager_only
from slimgrad._errors import internal_error

__all__ = ["reversible_sequential"]

_API = "slimgrad.nn.ReversibleSequential"
DIAG_SAMPLES = 32  # elements sampled per half-stream and block for the reconstruction diagnostic


# --------------------------------------------------------------------------------------------- math
def split_halves(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = t.shape[dim]
    n1 = (n + 1) // 2
    return t.narrow(dim, 0, n1), t.narrow(dim, n1, n - n1)


def affine_scale(raw: torch.Tensor, clamp: float) -> torch.Tensor:
    return torch.exp(torch.tanh(raw / clamp) * clamp)


class _GridRoundFn(torch.autograd.Function):
    # Round onto the grid 2^-bits in float64; straight-through gradient (cast back to the input
    # dtype).
    @staticmethod
    def forward(ctx, t: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.in_dtype = t.dtype
        t64 = t.to(torch.float64)
        t64 = t64 * scale if t64 is t else t64.mul_(scale)  # never write into the caller's t
        return t64.round_().div_(scale)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g.to(ctx.in_dtype), None


def grid_round(t: torch.Tensor, grid_bits: int) -> torch.Tensor:
    """Round ``t`` onto the grid ``2^-grid_bits`` in float64, with a straight-through gradient."""
    return _GridRoundFn.apply(t, float(2**grid_bits))


# NOTE [Exact-mode arithmetic without float64 passes]
# ``round(f * 2^b) * 2^-b`` is the same number whether computed in float32 or float64 when f is a
# float32 (or bf16/fp16) value: scaling by a power of two is exact, and rounding a float to an
# integer is exact in its own format (overflow, |f| >= 2^(128-b), gives inf and fails the range
# check either way). So F's output is rounded in float32 (half the bytes of float64), kept as
# integer-valued "grid units" u, and added to the float64 stream with ``alpha = 2^-b``:
# ``xa + 2^-b * u`` (the product is exact, so the one rounding is the sum's, as in ``xa + h``).
# In place (``xa.add_(u, alpha=...)``, u float32) the cast happens inside the sum's loop at the
# speed of a float64 add; out of place, a mixed-dtype add is ~40x slower on CPU (measured, torch
# 2.13), so there u is cast to float64 first. Gradients: the straight-through rounding passes
# ``g.to(f.dtype)`` to F, and F's input gradient is cast back to float64 before it is added to
# the stream's: the same values and the same two-term sums as plain autograd of
# ``xa + grid_round(f)``.
def _grid_units(f: torch.Tensor, scale: float) -> torch.Tensor:
    # round(f * scale), integer-valued, in float32 (float64 for float64 f)
    rd = torch.float64 if f.dtype == torch.float64 else torch.float32
    return torch.mul(f.to(rd), scale).round_()


def _add_units(xa: torch.Tensor, u: torch.Tensor, alpha: float, inplace: bool) -> torch.Tensor:
    # xa + alpha * u with xa float64 on the grid (NOTE [Exact-mode arithmetic without float64
    # passes])
    if inplace:
        return xa.add_(u, alpha=alpha)
    return torch.add(xa, u.to(xa.dtype), alpha=alpha)


class _AddOnGridFn(torch.autograd.Function):
    # xa + grid_round(f) for autograd (reversible=False, and the first-order recompute is not
    # needed here): same values and gradients, fewer float64 passes (NOTE [Exact-mode arithmetic
    # without float64 passes]).
    @staticmethod
    def forward(ctx, xa: torch.Tensor, f: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.f_dtype = f.dtype
        return _add_units(xa, _grid_units(f, scale), 1.0 / scale, inplace=False)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, g.to(ctx.f_dtype), None


# --------------------------------------------------------------------------------------------- plan
@dataclass
class _Plan:
    # What backward needs besides the saved output. Holds no tensor that references an output: no
    # cycle.
    blocks: list[nn.Module]
    split_dim: int
    exact: bool
    grid_bits: int
    compute_dtype: torch.dtype | None
    preserve_rng_state: bool
    sink: Any  # ``_record_reconstruction(first, errors, scales)`` receives the diagnostic
    flat_params: list[torch.Tensor] = field(default_factory=list)  # Function inputs after x
    block_params: list[list[list[int]]] = field(default_factory=list)  # per block: [F, G] indices
    rng: list[tuple] = field(default_factory=list)  # per block (state before F, state before G)
    samples: list[tuple] = field(default_factory=list)  # per block input: sampled elements
    autocast: tuple = ()
    device: torch.device | None = None
    stream_max: torch.Tensor | None = None
    # id(F, G or block) -> [(submodule, name, parameter)] as seen in forward
    forward_params: dict[int, list] = field(default_factory=dict)
    bn_layers: dict[int, list] = field(default_factory=dict)  # id(module) -> BatchNorms inside

    @property
    def scale(self) -> float:
        return float(2**self.grid_bits)


def _is_coupling(blk: nn.Module) -> bool:
    return getattr(blk, "_slimgrad_coupling", None) in ("additive", "affine")


def _call(plan: _Plan, fn: nn.Module, xb: torch.Tensor) -> torch.Tensor:
    # F or G on a stream half; exact mode runs it in the compute dtype and leaves the rounding to
    # the caller (NOTE [Exact-mode arithmetic without float64 passes]).
    if not plan.exact:
        return fn(xb)
    t = xb.to(plan.compute_dtype)
    # float64 F gets the stream itself: without grad, hand it an alias, so that a hook keeping it
    # shows in the storage's use count and the in-place sums (_private) leave it alone
    return fn(t.detach() if t is xb and not torch.is_grad_enabled() else t)


def _coupled(
    plan: _Plan, blk: nn.Module, xa: torch.Tensor, h: torch.Tensor, inplace: bool = False
) -> torch.Tensor:
    # ya = c(xa, h), h = F(xb) as returned by _call. ``inplace`` (exact mode, no grad): xa is a
    # stream tensor of ours that no one else sees.
    if not plan.exact:
        return _half_fwd(blk, xa, h)
    if torch.is_grad_enabled() and (xa.requires_grad or h.requires_grad):
        return _AddOnGridFn.apply(xa, h, plan.scale)
    return _add_units(xa, _grid_units(h, plan.scale), 1.0 / plan.scale, inplace)


def _uncoupled(
    plan: _Plan, blk: nn.Module, ya: torch.Tensor, h: torch.Tensor, inplace: bool = False
) -> torch.Tensor:
    # xa = c^-1(ya, h), no grad; ``inplace`` writes into ya (a rebuilt tensor of ours).
    if not plan.exact:
        return _half_inv(blk, ya, h, inplace=inplace)
    return _add_units(ya, _grid_units(h, plan.scale), -1.0 / plan.scale, inplace)


def _as_in_forward(plan: _Plan, fn: nn.Module):
    # The recompute must use the tensors forward used. Under torch.func.functional_call the module's
    # parameters are swapped only during forward; replay the swap so gradients reach them.
    entries = plan.forward_params.get(id(fn))
    if entries is None or all(sub._parameters.get(n) is p for sub, n, p in entries):
        return fn
    named: list[tuple] = []
    _walk(fn, named, [], "")  # the same walk, now with qualified names
    rec = {e[3]: p for e, (_, _, p) in zip(named, entries, strict=True)}
    return lambda x: torch.func.functional_call(fn, rec, (x,), strict=False)


def _half_fwd(blk: nn.Module, xa: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    if blk._slimgrad_coupling == "additive":
        return xa + h
    r, t = h.chunk(2, dim=blk.split_dim)
    return torch.addcmul(t, xa, affine_scale(r, blk.clamp))


def _half_inv(
    blk: nn.Module, ya: torch.Tensor, h: torch.Tensor, inplace: bool = False
) -> torch.Tensor:
    if blk._slimgrad_coupling == "additive":
        return ya.sub_(h) if inplace else ya - h
    r, t = h.chunk(2, dim=blk.split_dim)
    if inplace:
        return ya.sub_(t).div_(affine_scale(r, blk.clamp))
    return (ya - t) / affine_scale(r, blk.clamp)


# ------------------------------------------------------------------------------ recompute contexts
def _rng_get(device: torch.device | None) -> tuple:
    dev_state = None
    if device is not None and device.type not in ("cpu", "meta"):
        dev_state = torch.get_device_module(device.type).get_rng_state(device)
    return torch.get_rng_state(), dev_state


def _rng_set(state: tuple, device: torch.device | None) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.get_device_module(device.type).set_rng_state(state[1], device)


def _autocast_state(device: torch.device) -> tuple:
    types = ["cpu"] if device.type == "cpu" else ["cpu", device.type]
    return tuple(
        (dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt)) for dt in types
    ) + (torch.is_autocast_cache_enabled(),)


@contextlib.contextmanager
def _autocast(state: tuple) -> Iterator[None]:
    *per_type, cache = state
    with contextlib.ExitStack() as stack:
        for dt, enabled, dtype in per_type:
            stack.enter_context(
                torch.autocast(device_type=dt, dtype=dtype, enabled=enabled, cache_enabled=cache)
            )
        yield


def _bn_layers(plan: _Plan | None, module: nn.Module) -> list:
    key = id(module)
    found = plan.bn_layers.get(key) if plan is not None else None
    if found is None:
        found = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if plan is not None:
            plan.bn_layers[key] = found
    return found


@contextlib.contextmanager
def _stats_frozen(module: nn.Module, plan: _Plan | None = None) -> Iterator[None]:
    # Recompute uses batch statistics (as forward did) without updating running stats a second time.
    flipped = [m for m in _bn_layers(plan, module) if m.training and m.track_running_stats]
    for m in flipped:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in flipped:
            m.track_running_stats = True


def _recompute(plan: _Plan, module: nn.Module, rng_state: tuple | None):
    # Context for one recompute: the RNG state as before the forward evaluation, batch statistics
    # without a second running-stat update, the forward's autocast state. Entering torch.autocast
    # and generator-based contexts costs more than a small F, so the common case (no BatchNorm in
    # training mode, autocast as in forward) gets a null context.
    if rng_state is not None:
        _rng_set(rng_state, plan.device)
    has_bn = any(m.training and m.track_running_stats for m in _bn_layers(plan, module))
    same = _autocast_state(plan.device) == plan.autocast
    if not has_bn and same:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(_stats_frozen(module, plan))
    if not same:
        stack.enter_context(_autocast(plan.autocast))
    return stack


# ------------------------------------------------------------------------------------ diagnostics
# NOTE [Reconstruction diagnostic]: forward keeps DIAG_SAMPLES elements of every block input half
# (spread over the tensor, gathered with one ``take`` each: views need no copy); backward gathers
# the same elements of each rebuilt input, and one vectorised pass at the end compares them all.
_SAMPLE_IDX: dict[tuple, torch.Tensor] = {}


def _sample(t: torch.Tensor) -> torch.Tensor:
    key = (tuple(t.shape), t.device)
    idx = _SAMPLE_IDX.get(key)
    if idx is None:
        n, k = t.numel(), min(DIAG_SAMPLES, t.numel())
        idx = torch.arange(k, device=t.device) * (n - 1) // max(k - 1, 1)  # spread, in bounds
        if len(_SAMPLE_IDX) > 64:
            _SAMPLE_IDX.clear()
        _SAMPLE_IDX[key] = idx
    return torch.take(t.detach(), idx)


def _samples(stream: tuple) -> tuple:
    return tuple(_sample(s) for s in stream)


def _sample_diffs(refs: tuple, rebuilt: tuple) -> tuple:
    # rebuilt samples minus forward samples, per stream part (no extra memory beyond the refs')
    return tuple(_sample(t) - r for t, r in zip(rebuilt, refs, strict=True))


def _sample_errors(refs: list[tuple], diffs: list[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
    # Per block: max |rebuilt - ref| and max |ref| over its samples, as float64 vectors.
    inf = float("inf")
    err = torch.stack([e.double() for e in torch._foreach_norm([t for d in diffs for t in d], inf)])
    scale = torch.stack(
        [s.double() for s in torch._foreach_norm([t for r in refs for t in r], inf)]
    )
    parts = {len(r) for r in refs}
    if len(parts) == 1:
        k = parts.pop()
        return err.view(-1, k).amax(1), scale.view(-1, k).amax(1)
    ends = torch.tensor([len(r) for r in refs]).cumsum(0).tolist()
    starts = [0, *ends[:-1]]
    return (
        torch.stack([err[i:j].amax() for i, j in zip(starts, ends)]),
        torch.stack([scale[i:j].amax() for i, j in zip(starts, ends)]),
    )


def _track_max(plan: _Plan, *ts: torch.Tensor) -> None:
    for t in ts:
        lo, hi = torch.aminmax(t.detach())
        m = torch.maximum(-lo, hi)
        plan.stream_max = m if plan.stream_max is None else torch.maximum(plan.stream_max, m)


def check_exact_range(plan: _Plan) -> None:
    if not plan.exact or plan.stream_max is None:
        return
    limit = 2.0 ** (53 - plan.grid_bits)
    got = float(plan.stream_max)
    if not got < limit:  # NaN fails too
        raise RuntimeError(
            f"{_API}: exact mode's fixed-point stream left its exact range; expected |values| < "
            f"2^{53 - plan.grid_bits} with grid_bits={plan.grid_bits}, got {got:.3g}. Use a "
            "smaller grid_bits (range doubles per bit removed) or keep activations smaller."
        )


# ---------------------------------------------------------------------------------- forward steps
def _to_halves(stream: tuple, dim: int) -> tuple:
    return stream if len(stream) == 2 else split_halves(stream[0], dim)


def _to_full(stream: tuple, dim: int) -> tuple:
    return stream if len(stream) == 1 else (torch.cat(stream, dim=dim),)


def _block_fwd(
    plan: _Plan, blk: nn.Module, stream: tuple, record: bool, inplace: bool = False
) -> tuple:
    # One block forward; with ``record``, capture what its backward needs (RNG states, samples).
    # ``inplace``: the stream halves are fresh tensors of ours that nothing else sees (exact mode
    # under no_grad, after the first block), so the sums may overwrite them.
    if _is_coupling(blk):
        a, b = _to_halves(stream, plan.split_dim)
        if len(stream) != 2:
            inplace = False  # halves of the chain input (a view of a tensor we may not own)
        if record:
            plan.samples.append(_samples((a, b)))
            rng_f = _rng_get(plan.device) if plan.preserve_rng_state else None
        a = _coupled(plan, blk, a, _call(plan, blk.F, b), inplace and _private(plan, a))
        if record:
            rng_g = _rng_get(plan.device) if plan.preserve_rng_state else None
            plan.rng.append((rng_f, rng_g))
        b = _coupled(plan, blk, b, _call(plan, blk.G, a), inplace and _private(plan, b))
        if plan.exact:
            _track_max(plan, a, b)
        return a, b
    (x,) = _to_full(stream, plan.split_dim)
    if record:
        plan.samples.append(_samples((x,)))
        plan.rng.append((_rng_get(plan.device) if plan.preserve_rng_state else None, None))
    return (blk(x),)


def _private(plan: _Plan, t: torch.Tensor) -> bool:
    # F and G saw t only through a dtype cast (a copy) unless they run in float64 themselves.
    return plan.compute_dtype != torch.float64 or _sole(t)


def _finish(plan: _Plan, stream: tuple) -> torch.Tensor:
    (y,) = _to_full(stream, plan.split_dim)
    return y


# --------------------------------------------------------------------------------- backward steps
def _grad(outs, inputs: list, grads) -> list:
    # autograd.grad that tolerates inputs outside the graph and an empty input list.
    live = [i for i, t in enumerate(inputs) if t is not None]
    res: list = [None] * len(inputs)
    if not live:
        return res
    got = torch.autograd.grad(outs, [inputs[i] for i in live], grads, allow_unused=True)
    for i, g in zip(live, got):
        res[i] = g
    return res


def _sole(t: torch.Tensor) -> bool:
    # No other tensor (view, detached alias kept by a hook or a graph) shares t's storage. The
    # Python storage object holds one reference of its own.
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= 2


def _add(
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    dtype: torch.dtype | None = None,
    a_own: bool = False,
) -> tuple[torch.Tensor | None, bool]:
    # a + b (b cast to ``dtype`` first) and whether the result is a tensor of ours that nothing
    # else references. Gradients are summed out of place (a hook may hold either operand), except
    # into ``a`` when the caller owns it (a_own) and into b's cast (a fresh copy). Two-term sums:
    # the order is irrelevant.
    if b is None:
        return a, a_own
    if a is not None and a_own and (dtype is None or a.dtype == dtype):
        return a.add_(b), True
    if dtype is not None and b.dtype != dtype:
        b = b.to(dtype)
        return (b if a is None else b.add_(a)), True
    if a is None:
        return b, False
    return a + b, True


def _half_bwd(
    plan: _Plan,
    blk: nn.Module,
    fn: nn.Module,
    ya: torch.Tensor,
    ya_own: bool,
    xb: torch.Tensor,
    dya: torch.Tensor,
    rng_state: tuple | None,
    params: list[torch.Tensor | None],
    need_xb: bool,
    need_xa: bool,
) -> tuple:
    # ya = c(xa, fn(xb)): rebuild xa from ya and xb with ONE evaluation of fn, and return
    # (xa, dxa, dxb_part, dparams) where dxb_part is the gradient reaching xb through fn (in fn's
    # input dtype; the caller adds it to the stream's). ya is overwritten with xa when we own it
    # (a tensor we rebuilt ourselves).
    additive = blk._slimgrad_coupling == "additive"
    with torch.enable_grad():
        xin = xb.to(plan.compute_dtype) if plan.exact else xb
        xb_l = xin.detach().requires_grad_(need_xb)
        del xin
        with _recompute(plan, fn, rng_state):
            h = _as_in_forward(plan, fn)(xb_l)  # xb_l is in the compute dtype already
        with torch.no_grad():
            xa = _uncoupled(plan, blk, ya, h.detach(), inplace=ya_own and _sole(ya))
        del ya
        if additive:
            # straight-through rounding in exact mode: fn's output gradient is dya in its dtype
            outs, dxa, gout = h, dya, dya.to(h.dtype)
            inputs = [xb_l if need_xb else None, *params]
        else:
            xa_l = xa.detach().requires_grad_(need_xa)
            outs, dxa, gout = _half_fwd(blk, xa_l, h), None, dya
            inputs = [xb_l if need_xb else None, xa_l if need_xa else None, *params]
        del h
        if outs.requires_grad:
            got = _grad(outs, inputs, gout)
        else:
            got = [None] * len(inputs)
        del outs, inputs, gout
    dxb = got[0]
    if not additive:
        dxa = got[1]
        got = got[1:]
    return xa, (dxa if need_xa else None), dxb, got[1:]


def _block_bwd(
    plan: _Plan,
    i: int,
    blk: nn.Module,
    state: list,
    flat_params: Sequence[torch.Tensor],
    need_upstream: bool,
    pgrads: dict[int, torch.Tensor],
) -> None:
    # Rebuild block i's input from its output. ``state`` = [stream, stream_owned, dstream,
    # dstream_owned] is replaced in place, so no caller reference keeps the old tensors alive. Only
    # a stream we rebuilt ourselves (owned) and that nothing else aliases is overwritten by its
    # rebuild. Gradient halves are summed in place only when they are ours and never reached user
    # code: exact mode with F, G below float64 hands them float32 copies of the stream gradient.
    groups = plan.block_params[i]
    rng_f, rng_g = plan.rng[i]
    ystream, y_own, dstream, d_own = state
    state[:] = [None, False, None, (False, False)]
    sdt = torch.float64 if plan.exact else None  # exact: the stream's gradient is float64
    private = plan.exact and plan.compute_dtype != torch.float64
    if _is_coupling(blk):
        y1, y2 = _to_halves(ystream, plan.split_dim)
        dy1, dy2 = _to_halves(dstream, plan.split_dim)
        y_own = y_own and len(ystream) == 2
        own1, own2 = d_own if private and len(dstream) == 2 else (False, False)
        del ystream, dstream
        f_idx, g_idx = groups
        # G half: y2 = c(x2, G(y1)). y1's gradient is needed upstream and for F's parameters.
        need_y1 = need_upstream or bool(f_idx)
        gp = [flat_params[j] for j in g_idx]
        x2, dx2, dz, dg = _half_bwd(plan, blk, blk.G, y2, y_own, y1, dy2, rng_g, gp, need_y1, True)
        del y2, dy2
        _accumulate(pgrads, g_idx, dg)
        del dg
        dy1, own1 = _add(dy1, dz, sdt, own1)
        del dz
        # F half: y1 = c(x1, F(x2)).
        fp = [flat_params[j] for j in f_idx]
        x1, dx1, df2, df = _half_bwd(
            plan, blk, blk.F, y1, y_own, x2, dy1, rng_f, fp, need_upstream, need_upstream
        )
        del y1, dy1
        _accumulate(pgrads, f_idx, df)
        del df
        dx2, own2 = _add(dx2, df2, sdt, own2) if need_upstream else (None, False)
        state[:] = [(x1, x2), True, (dx1, dx2), (own1, own2)]
        return
    (idx,) = groups
    (y,) = _to_full(ystream, plan.split_dim)
    (dy,) = _to_full(dstream, plan.split_dim)
    del ystream, dstream
    with torch.no_grad(), _stats_frozen(blk, plan), _autocast(plan.autocast):
        x = blk.inverse(y)
    del y
    with torch.enable_grad():
        x_l = x.detach().requires_grad_(need_upstream)
        with _recompute(plan, blk, rng_f):
            y_re = _as_in_forward(plan, blk)(x_l)
        inputs = [x_l if need_upstream else None] + [flat_params[j] for j in idx]
        got = _grad(y_re, inputs, dy) if y_re.requires_grad else [None] * len(inputs)
        del y_re, inputs, dy
    _accumulate(pgrads, idx, got[1:])
    state[:] = [(x,), False, (got[0],), (False, False)]


def _accumulate(pgrads: dict[int, torch.Tensor], idx: list[int], grads: Sequence) -> None:
    for j, g in zip(idx, grads, strict=True):
        if g is not None:
            pgrads[j] = g if j not in pgrads else pgrads[j] + g


def _walk(m: nn.Module, entries: list, bns: list, path: str | None = None) -> None:
    # named_parameters(remove_duplicate=False) as (module, name, parameter[, qualified name]) and
    # the BatchNorms, in one plain recursion (the generator-based walkers cost ~5x more).
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        bns.append(m)
    for n, p in m._parameters.items():
        if p is not None:
            entries.append((m, n, p) if path is None else (m, n, p, path + n))
    for name, sub in m._modules.items():
        if sub is not None:
            _walk(sub, entries, bns, None if path is None else f"{path}{name}.")


def _param_table(plan: _Plan) -> list[torch.Tensor]:
    # One walk over every F and G (or non-coupling block): the Function's parameter inputs (those
    # requiring grad, each once), per block the indices of F's and G's, and the parameters as seen
    # now (for _as_in_forward). Walking the modules is the dominant Python cost of a small block,
    # so it happens once per forward.
    flat: list[torch.Tensor] = []
    index: dict[int, int] = {}
    plan.block_params = []
    for blk in plan.blocks:
        groups = []
        for m in (blk.F, blk.G) if _is_coupling(blk) else (blk,):
            entries: list[tuple] = []
            bns: list[nn.Module] = []
            _walk(m, entries, bns)
            plan.forward_params[id(m)] = entries
            plan.bn_layers[id(m)] = bns
            ids: list[int] = []
            for *_, p in entries:
                if not p.requires_grad:
                    continue
                j = index.get(id(p))
                if j is None:
                    j = index[id(p)] = len(flat)
                    flat.append(p)
                if j not in ids:
                    ids.append(j)
            groups.append(ids)
        plan.block_params.append(groups)
    return flat


# ------------------------------------------------------------------------ forward and backward
def _fwd_torch(plan: _Plan, x: torch.Tensor, record: bool) -> torch.Tensor:
    # The chain forward; with ``record`` (no grad), keep per block what the rebuild needs. In exact
    # mode without grad the stream is ours after the first block: sums go in place.
    inplace = plan.exact and not torch.is_grad_enabled()
    stream: tuple = (x,)
    for blk in plan.blocks:
        stream = _block_fwd(plan, blk, stream, record=record, inplace=inplace)
    return _finish(plan, stream)


def _bwd_torch(
    plan: _Plan, y: torch.Tensor, dy: torch.Tensor, need_x: bool, need_params: Sequence[bool]
) -> tuple:
    # Walk the blocks in reverse from the output: returns (dx or None, {param index: grad}).
    first_needed = _first_block_needing(plan, need_params)
    pgrads: dict[int, torch.Tensor] = {}
    diffs: list[tuple] = []  # per rebuilt block input: sampled rebuilt - forward values
    state = [(y,), False, (dy,), (False, False)]
    del y, dy
    devices = [plan.device] if plan.device.type not in ("cpu", "meta") else []
    with torch.random.fork_rng(devices=devices, device_type=plan.device.type):
        for i in range(len(plan.blocks) - 1, -1, -1):
            need_upstream = need_x or i > first_needed
            _block_bwd(plan, i, plan.blocks[i], state, plan.flat_params, need_upstream, pgrads)
            diffs.append(_sample_diffs(plan.samples[i], _rebuilt_for(plan, i, state[0])))
            if not need_upstream and i <= first_needed:
                break
    dstream = state[2]
    state.clear()
    if plan.sink is not None and diffs:
        first = len(plan.blocks) - len(diffs)
        errors, scales = _sample_errors(plan.samples[first:], diffs[::-1])
        plan.sink._record_reconstruction(first, errors, scales)
    return (_finish(plan, dstream) if need_x else None), pgrads


class _ReversibleChainFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        plan.autocast = _autocast_state(x.device)
        plan.device = x.device
        y = _fwd_torch(plan, x, record=True)
        if y is x or y._base is not None:
            y = y.clone()  # a Function output must be a fresh tensor to be saved as an output
        ctx.plan = plan
        ctx.save_for_backward(y)
        # Exact mode returns the stream in the caller's dtype and keeps the float64 one: the
        # incoming gradient is then the caller's dtype too (half the bytes of a float64 one); it
        # enters the float64 gradient stream by exact casts (NOTE [Exact-mode arithmetic without
        # float64 passes]).
        return y.to(plan.compute_dtype) if plan.exact else y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        plan: _Plan = ctx.plan
        if torch.is_grad_enabled():
            raise NotImplementedError(
                f"{_API}: higher-order gradients are not supported by the reversible backward; "
                "expected create_graph=False, got create_graph=True. Build the chain with "
                "reversible=False to differentiate twice."
            )
        (y,) = ctx.saved_tensors
        dx, pgrads = _bwd_torch(plan, y, dy, ctx.needs_input_grad[1], ctx.needs_input_grad[2:])
        return (None, dx, *[pgrads.get(j) for j in range(len(plan.flat_params))])


def _rebuilt_for(plan: _Plan, i: int, stream: tuple) -> tuple:
    blk = plan.blocks[i]
    if _is_coupling(blk):
        return _to_halves(stream, plan.split_dim)
    return _to_full(stream, plan.split_dim)


def _first_block_needing(plan: _Plan, needs: Sequence[bool]) -> int:
    # Index of the first block with a parameter that needs a gradient (len(blocks) if none).
    for i, groups in enumerate(plan.block_params):
        if any(needs[j] for g in groups for j in g):
            return i
    return len(plan.blocks)


# ----------------------------------------------------------------------------------- functional
def reversible_sequential(
    x: torch.Tensor,
    blocks: Sequence[nn.Module],
    *,
    split_dim: int = 1,
    exact: bool = False,
    grid_bits: int = 20,
    preserve_rng_state: bool = True,
    reversible: bool = True,
    sink: Any = None,
) -> torch.Tensor:
    """Run invertible ``blocks`` in sequence, keeping no activation for backward.

    ``y = blocks[-1](...blocks[0](x))``; backward rebuilds each block's input from its output (see
    the module docstring for the math). Blocks are validated by
    :class:`slimgrad.nn.ReversibleSequential`, which is the public entry point; this functional form
    skips validation.

    Args:
        x: input of the first block.
        blocks: couplings (``_slimgrad_coupling`` set) or modules with ``inverse``.
        split_dim: dimension the couplings split along.
        exact: hold the stream in fixed point (grid ``2^-grid_bits``, float64): bit-exact rebuild.
        grid_bits: fixed-point fraction bits in exact mode.
        preserve_rng_state: replay each F/G's RNG state in the recompute (dropout).
        reversible: False runs the same maths with ordinary autograd (keeps activations).
        sink: receives the reconstruction diagnostic after each backward.

    Returns:
        The chain output, same dtype as ``x``.

    Memory: saves y (plus 10 KiB of RNG state per block); eager saves every activation of every
    block.
    """
    plan = _Plan(
        blocks=list(blocks),
        split_dim=split_dim,
        exact=exact,
        grid_bits=grid_bits,
        compute_dtype=x.dtype if exact else None,
        preserve_rng_state=preserve_rng_state,
        sink=sink,
    )
    x_in = grid_round(x, grid_bits) if exact else x
    flat = _param_table(plan) if torch.is_grad_enabled() and reversible else []
    needs_graph = torch.is_grad_enabled() and (x.requires_grad or bool(flat))
    if reversible and needs_graph and len(plan.blocks) > 0:
        plan.flat_params = flat
        y = _apply(plan, x_in, flat)
    else:
        y = _fwd_torch(plan, x_in, record=False)
    check_exact_range(plan)
    plan.stream_max = None
    return y.to(x.dtype) if exact else y


def _apply(plan: _Plan, x: torch.Tensor, flat: list[torch.Tensor]) -> torch.Tensor:
    # torch.compile runs the chain eagerly (one graph break per chain, code around it compiles):
    # the backward calls autograd.grad on module recomputes, which Dynamo cannot trace
    # (NOTE [Eager-only code under torch.compile] in slimgrad/_compile.py).
    return _apply_eager(plan, x, flat)


@eager_only
def _apply_eager(plan: _Plan, x: torch.Tensor, flat: list[torch.Tensor]) -> torch.Tensor:
    return _ReversibleChainFn.apply(plan, x, *flat)


def reconstruction_error(
    blocks: Sequence[nn.Module],
    x: torch.Tensor,
    *,
    split_dim: int = 1,
    exact: bool = False,
    grid_bits: int = 20,
) -> torch.Tensor:
    """Largest |x_rebuilt - x| over the block inputs of one forward and its inverse (no grad, no
    stat update).

    Runs ``blocks`` forward from ``x`` with each F/G's RNG state recorded, then inverts block by
    block with the same states, comparing every rebuilt block input with the one seen in forward.
    """
    plan = _Plan(
        blocks=list(blocks),
        split_dim=split_dim,
        exact=exact,
        grid_bits=grid_bits,
        compute_dtype=x.dtype if exact else None,
        preserve_rng_state=True,
        sink=None,
    )
    plan.device = x.device
    plan.autocast = _autocast_state(x.device)
    worst = torch.zeros((), dtype=torch.float64, device=x.device)
    with (
        torch.no_grad(),
        torch.random.fork_rng(
            devices=[x.device] if x.device.type not in ("cpu", "meta") else [],
            device_type=x.device.type,
        ),
    ):
        stream: tuple = (grid_round(x, grid_bits) if exact else x,)
        inputs = []
        for blk in plan.blocks:
            inputs.append(stream)
            with _stats_frozen(blk):
                stream = _block_fwd(plan, blk, stream, record=True)
        for i in range(len(plan.blocks) - 1, -1, -1):
            blk = plan.blocks[i]
            rng_f, rng_g = plan.rng[i]
            if _is_coupling(blk):
                y1, y2 = _to_halves(stream, split_dim)
                with _recompute(plan, blk.G, rng_g):
                    x2 = _uncoupled(plan, blk, y2, _call(plan, blk.G, y1))
                with _recompute(plan, blk.F, rng_f):
                    x1 = _uncoupled(plan, blk, y1, _call(plan, blk.F, x2))
                stream = (x1, x2)
                ref = _to_halves(inputs[i], split_dim)
            else:
                with _recompute(plan, blk, rng_f):
                    stream = (blk.inverse(_to_full(stream, split_dim)[0]),)
                ref = _to_full(inputs[i], split_dim)
            for r, s in zip(ref, stream, strict=True):
                if r.shape != s.shape:
                    raise internal_error("rebuilt block input has a different shape")
                err = (s.to(torch.float64) - r.to(torch.float64)).abs()
                worst = torch.maximum(worst, err.max() if err.numel() else worst)
    return worst
