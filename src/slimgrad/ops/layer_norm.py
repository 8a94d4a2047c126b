"""LayerNorm that keeps its output, not its input.

Math: over the last ``len(normalized_shape)`` dims (D elements per row), ``mu = mean(x)``, ``rstd =
1 / sqrt(var(x) + eps)``, ``xhat = (x - mu) * rstd``, ``y = xhat * gamma + beta``. Backward with ``g
= dy * gamma``: ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))``, ``dgamma = sum_rows(dy *
xhat)``, ``dbeta = sum_rows(dy)``, where ``xhat = (y - beta) / gamma`` is rebuilt from the output.

Memory: float32/float64 saves y (the output, shared with the next layer: 0 extra B/elt when that
layer keeps it) + mean and rstd (8 B/row, fp32) + the input's columns of fallback channels (k *
itemsize B/row, k = 0 for usual weights); eager saves x, mean, rstd (x: 4 B/elt fp32 extra).
With a fallback channel, on shapes (few rows) where the PyTorch backward would hold more than
eager's, where every channel falls back, and (``slimgrad.nn.LayerNorm``) where y's consumer is not
known to keep y, it saves x, mean and rstd and runs eager's backward (NOTE [LayerNorm fallback
backward peak] in ``slimgrad/_math/norms.py``; NOTE [LayerNorm's fallback columns only where y is
kept after it]). bfloat16/float16
runs eager's ``F.layer_norm`` (x + mean, rstd per row: what eager keeps; see Limits below).
Backward writes dx into the incoming gradient's buffer when ``slimgrad.ownership.take`` proves it
dead (NOTE [Gradient-buffer ownership]); otherwise, and under torch.compile, out of place.
On float32 CPU tensors without fallback channels the backward runs the compiled
``kernels/cpu/layer_norm.c`` (one sweep per row for xhat, the row sums, dgamma and dbeta, one
for dx; NOTE [CPU C kernels] in ``kernels/_cpu.py``), the same bits for any thread count, about
eager's native kernel's time and a fifth of the PyTorch path's (``docs/measurements.md``); it
allocates nothing beyond dx, dgamma and dbeta except over a granted dy with several row blocks
(NOTE [The LayerNorm C backward's buffers]).

# NOTE [Normalization from its output: the fallback channels]
Rebuilding ``xhat = (y - beta) / gamma`` from the rounded output has absolute error about
``eps_dtype * (|xhat| + |beta / gamma|)``, so it is exact to the dtype's rounding (the error
rule) only where ``|beta| <= BETA_OVER_GAMMA_MAX * |gamma|`` and ``|gamma| >= finfo(dtype).tiny``
(no subnormal output, no division by 0). Every other channel -- gamma = 0, gamma ~ 0 with a sizeable
beta, a NaN/inf weight -- is a *fallback* channel: the forward keeps that channel's input column (as
eager keeps all of x) and the backward rebuilds its ``xhat = (x - mu) * rstd`` exactly as eager
does. The fallback follows the current weights (found once per version of weight and bias, no
host sync per forward: NOTE [Fallback channels, once per weight version] in
``slimgrad/_math/norms.py``), costs nothing when there is none, and in the worst case (all
channels, as with any non-finite gamma) saves x itself and runs eager's backward (NOTE
[LayerNorm with a non-finite gamma] in ``slimgrad/_math/norms.py``): never inf/NaN. RMSNorm and
GroupNorm use the same rule (RMSNorm: beta = 0).

Limits, measured (seed sweeps against float64 with the tests' shapes and weights, 25-40 seeds): in
fp32 every gradient of LayerNorm, RMSNorm and GroupNorm stayed within the rule. A bf16/fp16 output
carries only 8/11 bits of xhat, and dgamma (a sum of rebuilt xhat over rows) then rounds twice: on
the RMSNorm grid of NOTE [RMSNorm and GroupNorm in half precision] (``ops/rms_norm.py``; 1,050
bf16/fp16 LayerNorm cases with a bias) it exceeded the bound in 4, by up to 1.78x ((1, 64) fp16).
The excess is spread over every element, so no per-row or per-channel fallback catches it: in
bf16/fp16 ``layer_norm`` runs eager's ``F.layer_norm`` (it keeps x, 2 B/elt, + mean, rstd per
row: exactly what eager keeps). Under FakeTensorMode (``slimgrad.memory.estimate``) weights have
no values: no fallback is assumed."""

from __future__ import annotations

import math
import struct
import threading
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from slimgrad import _dtensor, _ext, ownership
from slimgrad._autograd import (
    CTX_FIELDS,
    compiling,
    direct_apply,
    first_order,
    refuse_jit,
    refuse_second_order,
    transforms_active,
    unwrap_if_dead,
)
from slimgrad._errors import hooks_top, seen
from slimgrad._library import custom_op, straight

# The plain-PyTorch math lives below ops and kernels (NOTE [Kernels are leaves] in slimgrad._math);
# its names stay importable from here (ops/group_norm.py, the tests), hence the F401s.
from slimgrad._math.norms import (  # noqa: F401
    BETA_OVER_GAMMA_MAX,
    CHUNK_ELEMS,
    fallback_channels,
    fallback_or_none,
    rebuild_xhat,
    side_columns,
)
from slimgrad._math.norms import acc_dtype as _acc_dtype
from slimgrad._math.norms import layer_norm_bwd_torch as _bwd_torch
from slimgrad._math.norms import layer_norm_bwd_torch_fits as bwd_torch_fits
from slimgrad._math.norms import layer_norm_fwd_torch as _fwd_torch
from slimgrad._math.norms import layer_norm_gamma as _LN_GAMMA
from slimgrad._math.norms import rowdot as _rowdot  # noqa: F401
from slimgrad._math.tables import dynamic_size
from slimgrad.kernels import _backend
from slimgrad.ops import _derived
from slimgrad.ops._output_act import check_output_seen, raise_output_written

__all__ = ["BETA_OVER_GAMMA_MAX", "layer_norm"]

#: Half-precision input dtypes: layer_norm and group_norm run eager's kernels for them, rms_norm
#: keeps x (module docstring, Limits; NOTE [RMSNorm and GroupNorm in half precision]).
HALF_DTYPES = (torch.bfloat16, torch.float16)
#: The C backward's row blocks: at least C_MIN_BLOCK_ROWS rows each, at most C_MAX_BLOCKS blocks
#: (``rows_per_block``); also its parallel grain (one block per OpenMP iteration).
C_MIN_BLOCK_ROWS = 32
C_MAX_BLOCKS = 16


# NOTE [The LayerNorm C backward's buffers]
# Eager's backward allocates dx, dgamma and dbeta (its kernel's own scratch, 2 * threads * d floats,
# is freed inside the kernel). The C kernel's row blocks (rows_per_block) each sum dgamma and
# dbeta into a float64 slice of a parts buffer, with float32 scratch rows per thread: (k * nblk +
# threads) * d * 8 bytes for k of dgamma, dbeta. Those are paid for only where dx is written over
# a granted dy (the n * d * 4 bytes of dx that eager allocates and this backward does not) and
# there are several blocks (n > C_MIN_BLOCK_ROWS rows; at most one thread per block, so the
# buffers stay below dx's bytes). Everywhere else -- a fresh dx, a single block, no dx -- the
# kernel takes no buffer beyond its outputs: the same sums in another loop order (column tiles,
# then rows; kernels/cpu/layer_norm.c), the same bits, one more read of dy and y. A dy that is not
# contiguous (e.g. the gradient of a channels_last product) is copied into dx's buffer, as eager's
# kernel copies it, and dx is written over the copy: no PyTorch path with its row-sized
# temporaries.


# NOTE [Fake tensors model the LayerNorm C backward]
# use_cpu never picks the C kernel for a fake tensor, so under slimgrad.memory.estimate a backward
# that writes dx over a granted dy (bwd_into: the implementation, past the custom op's fake) ran
# _bwd_torch, whose float32 row temporaries (xhat, dy * weight, their products and row sums) the
# real CPU step never allocates. A fake y the C kernel would take (kernels/_backend.
# cpu_kernel_would_run) goes through _bwd_cpu's own allocations instead (dx, dgamma, dbeta and the
# row-block buffers of NOTE [The LayerNorm C backward's buffers]) and skips only the call; a real
# tensor under a FakeTensorMode keeps the PyTorch path (real memory is written only by real math).
# Linear(16, 32)-LayerNorm-Linear(32, 16) on 2x8x16: estimated 10,952 B, the real step 7,368 B;
# now 7,368 B (tests/test_estimate_small_models.py).


# NOTE [The LayerNorm C backward, chosen in forward]
# A forward on the straight path (NOTE [One gate per call] in slimgrad/_library.py) with the
# PyTorch forward (_TORCH) on a float32 CPU input keeps in ``ctx.lib`` the C kernels that
# kernels/_backend.use_cpu would give its backward: read from the tables use_cpu fills (backend
# "auto" or "cpu", kernels/cpu/layer_norm.c built once: NOTE [Kernel backend choice]), with no
# call; not built yet: None, and the backward asks use_cpu, which builds them. A backward that
# was granted dy (so nothing is compiling) runs them without asking use_cpu again, where y is a
# plain tensor (not fake: use_cpu's own test) and the backend is still "auto" or "cpu"; every
# other backward decides as before. _bwd_cpu keeps all its other tests (dtypes, layouts,
# fallback channels), so the same kernel runs on the same tensors: the same bits.
C_STEM = "layer_norm"
_F32 = torch.float32
_Tensor = torch.Tensor


# NOTE [One argument per C call]
# ctypes converts every argument of a call by its declared type, about a quarter of a microsecond
# each: the C backward's 18 arguments were most of its call's host cost at small sizes (tiny
# GPT-2: 16 rows of 64). The kernel file also exports ``layer_norm_bwd_f32_packed``, which takes
# the same 18 values as one array of int64 (pointers as addresses, 0 for NULL): Python packs them
# with ``struct`` into a bytes object (passed as ``c_char_p``: a pointer to its buffer, no copy)
# and makes a one-argument call. The same kernel on the same pointers: the same bits.
_PACK18 = struct.Struct("=18q").pack


_empty_like = torch.empty_like


def _c_signatures(C):
    p, i64, i = C.c_void_p, C.c_int64, C.c_int
    return {
        "bwd": ("layer_norm_bwd_f32", [p] * 11 + [i64, i64, i64, i, i, i, i], None),
        "bwd_packed": ("layer_norm_bwd_f32_packed", [C.c_char_p], None),
    }


def _c_fns(lib):
    from slimgrad.kernels._cpu import functions

    return functions(lib, _c_signatures)


def rows_per_block(n: int) -> int:
    # The C kernel's row blocks (each sums dgamma/dbeta into its own float64 slice, then the slices
    # are added in block order): a function of n alone, so the bits do not depend on the thread
    # count; at most C_MAX_BLOCKS slices (<= 16 * d * 8 B each for dgamma and dbeta).
    return max(C_MIN_BLOCK_ROWS, -(-n // C_MAX_BLOCKS))


def _bwd_cpu(
    dy, y, mean, rstd, idx, xside, weight, bias, normalized_shape, output_mask, out=None, lib=None
):
    # The compiled kernel (kernels/cpu/layer_norm.c: xhat built once per row into a cache-resident
    # scratch row, dx, dgamma and dbeta in one sweep over the rows) for contiguous float32 without
    # fallback channels; else the PyTorch path. Same formulas; the precision of each sum (float row
    # sums and dbeta blocks, double dgamma) is what the seed sweeps allowed: 40 seeds x 9 shapes x 5
    # weight kinds (4,320 gradients) against float64 stayed within the error rule, worst dx 0.33,
    # dgamma 0.76, dbeta 0.49 of the bound (float dgamma reached 0.97: kept in double).
    # NOTE [The LayerNorm C backward's buffers]; lib: the forward's choice (NOTE [The LayerNorm C
    # backward, chosen in forward]), else asked here
    if lib is None:
        lib = _backend.use_cpu(y, C_STEM)
    f32 = torch.float32
    granted = out is dy  # dx written over a granted dy: the buffers are paid for
    # NOTE [Fake tensors model the LayerNorm C backward]
    fake = (  # FakeTensors only: a real tensor under a FakeTensorMode keeps the PyTorch path
        lib is None
        and type(y) is not torch.Tensor
        and (out is None or type(out) is not torch.Tensor)
        and _backend._is_fake(y)
        and _backend.cpu_kernel_would_run(y, "layer_norm")
    )
    if (
        (lib is None and not fake)
        or (idx is not None and idx.shape[0])
        or dy.dtype != f32
        or (weight is not None and weight.dtype != f32)
        or (bias is not None and bias.dtype != f32)
        or not y.is_contiguous()
        # out is dy: the caller checked its layout (owns_layout)
        or (
            out is not dy
            and not dy.is_contiguous()
            and (out is not None or not output_mask[0] or dy.shape != y.shape)
        )
        or (out is not None and out is not dy and not out.is_contiguous())
    ):
        return _bwd_torch(
            dy, y, mean, rstd, idx, xside, weight, bias, normalized_shape, output_mask, out
        )
    if out is not dy and not dy.is_contiguous():
        # copied into dx's buffer (eager's kernel copies it too), then dx written over the copy
        out = torch.empty_like(y)
        out.copy_(dy)
        dy = out
    # d = math.prod(normalized_shape), n = y.numel() // d: a few ints, multiplied without a call
    d = 1
    for s in normalized_shape:
        d *= s
    n = 1
    for s in y.shape:
        n *= s
    n //= d if d > 1 else 1
    need_dx, need_dw = bool(output_mask[0]), weight is not None and bool(output_mask[1])
    need_db = bias is not None and bool(output_mask[2])
    nt = torch.get_num_threads()  # kernels/_cpu.threads(): torch's count, never below 1
    rpb = -(-n // C_MAX_BLOCKS)  # rows_per_block(n), without max()'s call
    if rpb < C_MIN_BLOCK_ROWS:
        rpb = C_MIN_BLOCK_ROWS
    nblk = -(-n // rpb)
    dx = (out if out is not None else torch.empty_like(y)) if need_dx else None
    # the row-block buffers only where dx is written over dy and there are several blocks (NOTE
    # [The LayerNorm C backward's buffers]); one thread per block at most
    parts = granted and nblk > 1
    if parts and nt > nblk:
        nt = nblk
    # hold every buffer in a variable until the call returns (NOTE [CPU C kernels]); rstd has one
    # element per row; a 1-D weight/bias is its own (d,) view
    r = rstd if rstd.is_contiguous() else rstd.contiguous()
    w = b = None
    if weight is not None:
        w = (weight if weight.ndim == 1 else weight.reshape(d)).contiguous()
    if bias is not None:
        b = (bias if bias.ndim == 1 else bias.reshape(d)).contiguous()
    # dgamma, dbeta: empty_like of the contiguous float32 (d,) w and b (checked above), the same
    # shape, dtype, device and bytes as torch.empty(d, dtype=float32), with one positional
    # argument for Python's argument parser instead of a size and a keyword (a cheaper call)
    dw = _empty_like(w) if need_dw else None
    db = _empty_like(b) if need_db else None
    k = int(need_dw) + int(need_db)
    tmp = None
    if parts:
        # one buffer for the float64 row-block parts of dgamma and dbeta (nblk * d each), then the
        # threads' float32 scratch rows (nt * 2 * d floats: nt * d doubles)
        tmp = torch.empty((k * nblk + nt) * d, dtype=torch.float64)
        base = 0 if fake else tmp.data_ptr()  # a FakeTensor has no data pointer
        part = nblk * d * 8  # bytes of one parts buffer

    if fake:  # the buffers above, no call: NOTE [Fake tensors model the LayerNorm C backward]
        del tmp
        return (
            dx,
            None if dw is None else (dw if weight.ndim == 1 else dw.reshape(weight.shape)),
            None if db is None else (db if bias.ndim == 1 else db.reshape(bias.shape)),
        )
    try:  # bound once per library (kernels/_cpu.functions), then an attribute
        fns = lib._slimgrad_fns
    except AttributeError:
        fns = _c_fns(lib)
    dy_ptr = dy.data_ptr()
    # layer_norm_bwd_f32's arguments in one array (NOTE [One argument per C call]; 0: NULL)
    fns["bwd_packed"](
        _PACK18(
            dy_ptr,
            y.data_ptr(),
            r.data_ptr(),
            0 if w is None else w.data_ptr(),
            0 if b is None else b.data_ptr(),
            0 if dx is None else (dy_ptr if dx is dy else dx.data_ptr()),
            0 if dw is None else dw.data_ptr(),
            0 if db is None else db.data_ptr(),
            base + k * part if parts else 0,  # scratch
            base if parts and need_dw else 0,
            base + int(need_dw) * part if parts and need_db else 0,
            n,
            d,
            rpb,
            int(need_dx),
            int(need_dw),
            int(need_db),
            nt,
        )
    )
    del tmp
    return (
        dx,  # y's shape: empty_like(y), or out (the granted dy: y's shape, owns_layout)
        None if dw is None else (dw if weight.ndim == 1 else dw.reshape(weight.shape)),
        None if db is None else (db if bias.ndim == 1 else db.reshape(bias.shape)),
    )


# NOTE [LayerNorm's backward from C++]
# Where a first-order backward was granted dy and runs the C kernel the forward chose (NOTE [The
# LayerNorm C backward, chosen in forward]) with no fallback channel -- every converted LayerNorm
# step of a float32 CPU model, the ones folded into GPT-2's block nodes included -- the
# extension's ``layer_norm_bwd`` (``_ext/backward.cpp``, NOTE [Backward bodies from C++] in
# slimgrad/_ext) runs :func:`_bwd_cpu`'s body for ``out is dy`` from C++: the same row blocks and
# thread count, the same buffers allocated in the same order (dgamma, dbeta, the float64 parts and
# scratch where there are several blocks, freed after the call), the same kernel (its address read
# once from the ctypes function) on the same pointers: the same bits, bytes and peak, without the
# Python body's calls (seven ``data_ptr``, the layout checks, the struct packing and the ctypes
# conversion; 15 calls of slimgrad's per LayerNorm backward, 25 LayerNorms per tiny GPT-2 step).
# A tensor subclass (a fake), a dispatch or function mode, or operands outside the kernel's case
# get None back, with nothing run, and the Python body. tests/ops/test_layer_norm_ext.py compares
# the two.
_EXT_LN_BWD = None  # the extension's layer_norm_bwd, once it is loaded
_LN_BWD_ADDR: dict = {}  # the C library -> the address of its layer_norm_bwd_f32


def _use_extension(mod) -> None:
    global _EXT_LN_BWD
    _EXT_LN_BWD = getattr(mod, "layer_norm_bwd", None)


_ext.when_loaded(_use_extension)


def _ln_bwd_addr(lib) -> int:
    from slimgrad.kernels._cpu import address

    try:
        fns = lib._slimgrad_fns
    except AttributeError:
        fns = _c_fns(lib)
    a = _LN_BWD_ADDR[lib] = address(fns["bwd"])
    return a


def _bwd_impl(t: torch.Tensor):
    # NOTE [Kernel backend choice] in slimgrad/kernels/_backend.py; use_triton(t) only where it
    # may answer True
    if (t.is_cuda or _backend._resolved[0] not in _NO_TRITON) and _backend.use_triton(t):
        return _backend.kernels("layer_norm")._bwd_triton
    return _bwd_cpu if t.device.type == "cpu" else _bwd_torch


@custom_op("layer_norm_fwd", mutates_args=())
def _layer_norm_fwd(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # use_triton(x) only where it may answer True (NOTE [Kernel backend choice])
    if (x.is_cuda or _backend._resolved[0] not in _NO_TRITON) and _backend.use_triton(x):
        k = _backend.kernels("layer_norm")
        return k._fwd_triton(x, list(normalized_shape), weight, bias, eps)
    return _fwd_torch(x, list(normalized_shape), weight, bias, eps)


_NO_TRITON = _backend.NO_TRITON_OFF_CUDA


@_layer_norm_fwd.register_fake
def _(x, normalized_shape, weight, bias, eps):
    # NOTE [Side tables under FakeTensorMode and torch.compile] in slimgrad/_math/tables.py
    k = dynamic_size(max=math.prod(normalized_shape))
    nd = len(normalized_shape)
    stat_shape = tuple(x.shape[: x.dim() - nd]) + (1,) * nd
    n = math.prod(x.shape[: x.dim() - nd])
    acc = _acc_dtype(x.dtype)
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        x.new_empty(stat_shape, dtype=acc),
        x.new_empty(stat_shape, dtype=acc),
        x.new_empty((k,), dtype=torch.int64),
        x.new_empty((n, k)),
    )


@custom_op("layer_norm_bwd", mutates_args=())
def _layer_norm_bwd(
    dy: torch.Tensor,
    y: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    idx: torch.Tensor,
    xside: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    normalized_shape: Sequence[int],
    output_mask: Sequence[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = _bwd_impl(y)(
        dy, y, mean, rstd, idx, xside, weight, bias, list(normalized_shape), output_mask
    )
    return grads_or_empty(y, dx, dw, db)


def grads_or_empty(like: torch.Tensor, *grads: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """A norm backward op's outputs: each gradient, or its own empty tensor where it was not
    computed (a custom op's outputs may not alias each other)."""
    return tuple(g if g is not None else like.new_empty(0) for g in grads)


def fake_norm_grads(y, weight, bias, output_mask) -> tuple[torch.Tensor, ...]:
    """Fake (dx, dweight, dbias) of a norm backward op that computes those in ``output_mask``."""
    return grads_or_empty(
        y,
        torch.empty_like(y) if output_mask[0] else None,
        torch.empty_like(weight) if weight is not None and output_mask[1] else None,
        torch.empty_like(bias) if bias is not None and output_mask[2] else None,
    )


@_layer_norm_bwd.register_fake
def _(dy, y, mean, rstd, idx, xside, weight, bias, normalized_shape, output_mask):
    return fake_norm_grads(y, weight, bias, output_mask)


# NOTE [A second-order pass's gradient handed to its node]
# A bridge (:class:`_OutputBridge`, :class:`_Bridge`, ``_monotone._ZeroTie``) and the node that
# returns its gradient to x (the norm's own node, or the input's anchor) run in the same backward
# pass, one graph task, but autograd gives them no channel: the bridge's gradient goes through a
# :class:`GradBox` that node owns (``ctx.box`` of a Python Function; the C++ RMSNorm node's saved
# ``box`` slot; an anchor's list, :func:`list_box`) and the bridge holds. One graph may be
# differentiated by several passes at once (threads, each with its own graph task) and a pass may
# end before the node runs (``inputs=`` naming y, an exception in between), so the box holds one
# entry per graph task: ``put`` adds to the entry of the task it runs in, ``take`` pops that
# task's entry, and nothing is keyed by an address. The box refers to its entries weakly: each is
# owned by a callback queued on its graph task (``queue_callback``), which the engine runs and
# drops when the task completes, or drops with the task when it fails, so an entry lives no
# longer than its pass and its gradient (and any graph it carries) goes with it. A box is made by
# the first bridge or double that needs it (under :data:`_BOX_LOCK`: two passes may race to make
# it), never in forward; first order reads one attribute (None, or an empty box) and the C++ node
# one atomic pointer.
class _Held:
    # a task's entry in a GradBox; the task's callback holds it (calling it drops the gradient)
    __slots__ = ("g", "__weakref__")

    def __call__(self) -> None:
        self.g = None


class GradBox(weakref.WeakValueDictionary):
    """The gradients bridges hand to their node, one entry per graph task (NOTE [A second-order
    pass's gradient handed to its node])."""

    def put(self, g: torch.Tensor) -> None:
        task = _derived._task_id()
        held = self.get(task)
        if held is None:
            held = _Held()
            held.g = g
            self[task] = held
            _queue_callback(held)
        else:
            held.g = held.g + g

    def take(self) -> torch.Tensor | None:
        held = self.pop(_derived._task_id(), None)
        if held is None:
            return None
        g, held.g = held.g, None
        return g


_BOX_LOCK = threading.Lock()
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


def list_box(holder: list) -> GradBox:
    """The GradBox an anchor's list holds, made on first use (NOTE [A second-order pass's
    gradient handed to its node]); the list is made in forward, the box only by a bridge."""
    if not holder:
        with _BOX_LOCK:
            if not holder:
                holder.append(GradBox())
    return holder[0]


def ctx_box(ctx) -> GradBox:
    """``ctx.box``, made on first use (NOTE [A second-order pass's gradient handed to its
    node])."""
    box = ctx.box
    if box is None:
        with _BOX_LOCK:
            box = ctx.box
            if box is None:
                box = ctx.box = GradBox()
    return box


# NOTE [Second derivatives of an op that keeps its output]
# A norm that keeps its output y instead of its input x has no x to differentiate again under
# ``create_graph=True`` (NOTE [Second derivatives] in ``slimgrad/_autograd.py``). Its ``double``
# rebuilds x's *values* from what it kept (``x = xhat / rstd + mean`` with ``xhat = (y - beta) /
# gamma``; fallback channels from their kept input columns), recomputes eager's forward on them
# under ``enable_grad`` and differentiates it with ``create_graph=True``: eager's second
# derivatives, at x's values up to the rounding of the rebuild. The rebuilt values carry no graph
# back to x, so the forward leaves an *anchor* on x: :func:`make_anchor` applies
# :class:`_InputAnchor` to x, a node with an edge to x that returns an empty tensor (0 bytes, keeps
# nothing of x). In ``double``, :func:`bridged` wraps the rebuilt values in :class:`_Bridge`, whose
# backward hands the gradient it receives to the anchor's node through a box in a shared list
# (NOTE [A second-order pass's gradient handed to its node]), and the anchor's backward returns it
# to x: the rebuilt values then act as x itself for every later
# differentiation. Costs: one small node per forward call whose input requires grad; none in first-
# order backward (the anchor is not on the loss's graph, so autograd never runs it).
# LayerNorm needs no anchor: NOTE [LayerNorm's second derivatives through its own node].


class _InputAnchor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, box: list) -> torch.Tensor:
        ctx.box = box
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _unused):
        # NOTE [A second-order pass's gradient handed to its node]
        box = ctx.box
        return (box[0].take() if box else None), None


_ANCHOR_APPLY = direct_apply(_InputAnchor)


class _Bridge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: torch.Tensor, anchor: torch.Tensor, box: list) -> torch.Tensor:
        ctx.box = box
        return values.view_as(values)

    @staticmethod
    def backward(ctx, g):
        list_box(ctx.box).put(g)  # NOTE [A second-order pass's gradient handed to its node]
        return None, g.new_empty(0), None


def make_anchor(x: torch.Tensor) -> tuple | None:
    """NOTE [Second derivatives of an op that keeps its output]: the anchor a forward leaves on
    ``x`` (None when nothing will differentiate through x)."""
    if not (torch.is_grad_enabled() and x.requires_grad) or torch.compiler.is_compiling():
        return None
    box: list = []
    if transforms_active():
        return _InputAnchor.apply(x, box), box
    # NOTE [Applying a Function without its Python wrapper] in slimgrad/_autograd.py
    return _ANCHOR_APPLY(unwrap_if_dead(x), box), box


def attach_anchor(out: torch.Tensor, anchor: tuple | None) -> None:
    """Hand ``anchor`` to the node that produced ``out`` (read by its ``double``)."""
    if anchor is not None and out.grad_fn is not None:
        out.grad_fn._slimgrad_anchor = anchor


def bridged(ctx, api: str, values: torch.Tensor) -> torch.Tensor:
    """Rebuilt input values that differentiate as the forward's input (NOTE [Second derivatives
    of an op that keeps its output])."""
    anchor = getattr(ctx, "_slimgrad_anchor", None)
    if anchor is None:
        raise RuntimeError(
            f"slimgrad.{api}: a second derivative through this op was requested, but its forward "
            "ran without grad mode on its input (or under torch.compile); expected a forward whose "
            "input required grad, got none recorded. Run the forward eagerly with grad enabled, or "
            "call the torch op for double backward."
        )
    return _Bridge.apply(values, *anchor)


# NOTE [A norm's output written after forward]
# LayerNorm, RMSNorm and GroupNorm keep their output y for backward where eager keeps the input
# x. A write over y that the model's own forward shows is handled by convert_ (the in-place guard
# keeps such a norm eager; a norm whose y is the model's output runs eager's op, ``keep_y``). A
# write the structure cannot show (user code calling the module and writing ``y.add_(1)``, a hook
# added after convert_) leaves backward without the values x-hat came from, so nothing exact is
# left to compute: autograd's error from ``ctx.saved_tensors`` is re-raised as slimgrad's, naming
# the op and the fixes (the activations' helper, NOTE [An output written after forward] in
# ops/_output_act.py; its first sentence is autograd's). Only where autograd names this node's
# own output 0, which is y: a write over what eager keeps too (x where a norm kept it, the
# weight, the bias) raises in eager as well and keeps autograd's error. The check runs in the
# ``except`` clause only: nothing is added where nothing raises. Inside a saved-tensor-hooks region
# autograd does not check: NOTE [A kept output written under saved-tensor hooks] in
# slimgrad/_errors.py (one hooks question per forward, a comparison in backward).
def y_written(e: RuntimeError, ctx, api: str) -> None:
    """Raise slimgrad's error for autograd's in-place error ``e`` from ``ctx.saved_tensors`` of
    a norm node when the tensor written is the node's output y (NOTE [A norm's output written
    after forward]); return otherwise (the caller re-raises ``e``)."""
    if f"output 0 of {type(ctx).__name__.removesuffix('Backward')}," in str(e):
        raise_output_written(e, api, fix=_NORM_FIX)


_NORM_FIX = "ConvertConfig(norms=False)"


def norm_double(api: str, eager_fn, rebuild_input):
    """The ``double`` of an output-keeping norm (NOTE [Second derivatives of an op that keeps its
    output]): ``rebuild_input(y, mean, rstd, idx, xside, weight, bias, arg) -> x`` values;
    ``eager_fn(x, arg, weight, bias, eps)`` eager's forward."""

    def double(ctx, dy, *_):
        if dy is None:  # NOTE [Norm backward without materialized gradients]
            return None, None, None, None, None, None
        try:
            y, mean, rstd, idx, xside, weight, bias = ctx.saved_tensors
        except RuntimeError as e:  # NOTE [A norm's output written after forward]
            y_written(e, ctx, api)
            raise
        # NOTE [A kept output written under saved-tensor hooks] in slimgrad/_errors.py
        if y is not None and getattr(ctx, "y_seen", None) is not None:
            check_output_seen(ctx, y, api, _NORM_FIX)
        need = ctx.needs_input_grad
        with torch.no_grad():
            y = y.detach() if y is not None else None  # None: LayerNorm kept x (_keep_x)
            x = rebuild_input(y, mean, rstd, idx, xside, weight, bias, ctx.arg)
        if need[0]:
            x = bridged(ctx, api, x)
        pairs = [(x, need[0]), (weight, need[2]), (bias, need[3])]
        inputs = [t for t, n in pairs if n and t is not None]
        with torch.enable_grad():
            y2 = eager_fn(x, ctx.arg, weight, bias, ctx.eps)
            grads = list(torch.autograd.grad(y2, inputs, dy, create_graph=True, allow_unused=True))
        out = [grads.pop(0) if n and t is not None else None for t, n in pairs]
        return out[0], None, out[1], out[2], None, None  # the last: forward's ``direct``

    return double


def _rebuild_ln_input(y, mean, rstd, idx, xside, weight, bias, normalized_shape):
    if y is None:  # x itself was kept (_keep_x)
        return xside.detach()
    acc = _acc_dtype(y.dtype)
    d = math.prod(normalized_shape)
    n = y.numel() // max(d, 1)
    w = weight.detach().reshape(d).to(acc) if weight is not None else None
    b = bias.detach().reshape(d).to(acc) if bias is not None else None
    xh = rebuild_xhat(y.reshape(n, d), w, b, acc)
    x = xh.div_(rstd.reshape(n, 1).to(acc)).add_(mean.reshape(n, 1).to(acc))
    if idx is not None and idx.numel():
        x.index_copy_(1, idx, xside.to(acc))
    return x.to(y.dtype).reshape(y.shape)


def affine_norm_function(name: str, api: str, fwd_op, bwd_op, bwd_into, double=None) -> type:
    """The autograd Function of a norm ``fn(x, arg, weight, bias, eps)`` that keeps its output.

    ``fwd_op(x, arg, weight, bias, eps) -> (y, mean, rstd, idx, xside)`` and ``bwd_op(dy, y, mean,
    rstd, idx, xside, weight, bias, arg, mask) -> (dx, dweight, dbias)`` are its custom ops;
    ``bwd_into`` is the same backward taking ``out=``: it writes dx into a dead incoming gradient
    that slimgrad.ownership granted (eager only). ``name`` names the autograd node; ``double``
    its backward under ``create_graph=True`` (:func:`norm_double`).
    """

    fwd_impl, bwd_impl = fwd_op.impl, bwd_op.impl

    def forward(ctx, x, arg, weight, bias, eps, direct=False):
        # direct: the caller passed the gate (NOTE [One gate per call] in slimgrad/_library.py)
        y, mean, rstd, idx, xside = (fwd_impl if direct else fwd_op)(x, arg, weight, bias, eps)
        ctx.arg, ctx.eps = arg, eps
        ctx.save_for_backward(y, mean, rstd, idx, xside, weight, bias)
        ctx.mark_non_differentiable(mean, rstd, idx, xside)
        return y, mean, rstd, idx, xside

    def backward(ctx, dy, *_):
        buf = ownership.take(dy)  # first use of dy: NOTE [Gradient-buffer ownership]
        try:
            y, mean, rstd, idx, xside, weight, bias = ctx.saved_tensors
        except RuntimeError as e:  # NOTE [A norm's output written after forward]
            y_written(e, ctx, api)
            raise
        need = ctx.needs_input_grad
        mask = [need[0], need[2], need[3]]
        if (  # owns_layout(buf, y), inline; eager only (take refuses under torch.compile)
            mask[0]
            and buf is not None
            and buf.shape == y.shape
            and buf.dtype == y.dtype
            and buf.is_contiguous()
        ):
            dx, dw, db = bwd_into(
                buf, y, mean, rstd, idx, xside, weight, bias, ctx.arg, mask, out=buf
            )
        else:  # the custom op, or its implementation past the gate (NOTE [One gate per call])
            dx, dw, db = (bwd_impl if straight() else bwd_op)(
                dy, y, mean, rstd, idx, xside, weight, bias, ctx.arg, mask
            )
        return (
            dx if mask[0] else None,
            None,
            dw if weight is not None and mask[1] else None,
            db if bias is not None and mask[2] else None,
            None,
            None,
        )

    backward = first_order(f"ops.{api}", double=double)(backward)
    return type(
        name,
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )


# NOTE [Norm backward without materialized gradients]
# LayerNorm's and RMSNorm's Functions return side outputs that carry no gradient (mean, rstd, the
# fallback tables: marked non-differentiable). By default autograd hands a backward a zero tensor
# for every output that received no gradient: two ``aten.zeros`` of a row statistic's size per
# LayerNorm per step (50 per GPT-2 step), which the backward never reads. The Functions set
# ``ctx.materialize_grads = False`` (``set_materialize_grads(False)`` without its Python frame):
# the side outputs' gradients arrive as None and are ignored. y's own gradient can be None too (a
# loss that does not depend on y, gradcheck's undefined-gradient check): then no input gets a
# gradient, and backward and its ``double`` return None for every input before anything else
# (``ownership.take`` included). The gradients that exist, and their bits, are unchanged.


# NOTE [An empty side table is saved as None]
# Without fallback channels (the common case) LayerNorm's and RMSNorm's Functions save None for the
# index table and the input columns, and return neither: the straight path (NOTE [One gate per
# call] in slimgrad/_library.py) then allocates nothing for them (``fallback_or_none``). Every
# eager path does the same, so a forward saves the same tensors whichever path it takes: non-
# reentrant checkpointing counts and compares the tensors a recomputation saves with the
# forward's, and the recomputation may run under a mode (a profiler, a tracker) that the forward
# did not see. A traced forward, whose table length is a symbolic size, saves the tables.
# NOTE [LayerNorm's second derivatives through its own node]
# LayerNorm's double (NOTE [Second derivatives of an op that keeps its output]) leaves no anchor on
# x in forward (the anchor, an extra autograd Function per call, was a third of LayerNorm's host
# time above the pass-through floor on tiny GPT-2). Its own node already has the edge to x: the
# double bridges the rebuilt values to y as the node saved it (a saved output unpacks with this
# node as its grad_fn) through :class:`_OutputBridge`, whose backward puts the gradient of the
# rebuilt values in the node's :class:`GradBox` (``ctx.box``) and returns none for y. The engine
# runs the bridge's node before this node (its edge leads here), then this node's backward, with
# y's gradient None unless y has other consumers in that graph: it takes its pass's gradient from
# the box and adds it to dx (``_bridged``: dy None gives dx = that gradient and nothing else),
# exactly what the anchor's node returned to x. A forward whose y is None (``_keep_x``: x itself
# saved) differentiates the saved x, which carries its own graph: no bridge.


class _OutputBridge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: torch.Tensor, y: torch.Tensor, box: GradBox) -> torch.Tensor:
        ctx.box = box
        return values.view_as(values)

    @staticmethod
    def backward(ctx, g):
        ctx.box.put(g)
        return None, None, None


def bridged_backward(ctx, dy, backward):
    """``backward(ctx, dy, boxed=True)`` + this pass's gradient from ``ctx.box`` for x (NOTE [A
    second-order pass's gradient handed to its node])."""
    extra = ctx.box.take()
    out = backward(ctx, dy, boxed=True)
    if extra is None or not ctx.needs_input_grad[0]:
        return out
    out = list(out)
    out[0] = extra if out[0] is None else out[0] + extra
    return tuple(out)


def _ln_double(ctx, dy):
    # norm_double's steps for LayerNorm, bridged through this node (NOTE [LayerNorm's second
    # derivatives through its own node]) instead of an anchor
    if dy is None:  # NOTE [Norm backward without materialized gradients]
        return None, None, None, None, None, None, None
    try:
        y, mean, rstd, idx, xside, weight, bias = ctx.saved_tensors
    except RuntimeError as e:  # NOTE [A norm's output written after forward]
        y_written(e, ctx, "ops.layer_norm")
        raise
    # NOTE [A kept output written under saved-tensor hooks] in slimgrad/_errors.py
    if y is not None and ctx.y_seen is not None:
        check_output_seen(ctx, y, "ops.layer_norm", _NORM_FIX)
    need = ctx.needs_input_grad
    if y is None:  # x itself was kept (_keep_x): it carries its graph
        x = xside
    else:
        with torch.no_grad():
            x = _rebuild_ln_input(y.detach(), mean, rstd, idx, xside, weight, bias, ctx.arg)
        if need[0]:
            x = _OutputBridge.apply(x, y, ctx_box(ctx))
    pairs = [(x, need[0]), (weight, need[2]), (bias, need[3])]
    inputs = [t for t, n in pairs if n and t is not None]
    with torch.enable_grad():
        y2 = F.layer_norm(x, ctx.arg, weight, bias, ctx.eps)
        grads = list(torch.autograd.grad(y2, inputs, dy, create_graph=True, allow_unused=True))
    out = [grads.pop(0) if n and t is not None else None for t, n in pairs]
    return out[0], None, out[1], out[2], None, None, None  # forward's ``direct``, y_kept_after


# NOTE [LayerNorm's straight forward returns y alone]
# On the straight path's PyTorch forward (direct=_TORCH) the Function returns y only: mean, rstd
# (and the fallback tables) are saved as the forward's own intermediates, not returned as outputs
# marked non-differentiable, which cost the C apply a wrapping and a flag per extra output on
# every call. The same tensors are saved in the same slots (non-reentrant checkpointing compares
# them with a recomputation's, which may take another path: NOTE [An empty side table is saved
# as None]); the other paths return the custom op's outputs as before. Callers of the _TORCH path
# take the tensor, the others index [0].
class _LayerNormFn(torch.autograd.Function):
    # affine_norm_function's Function for LayerNorm, with the straight path's PyTorch forward
    # (direct=_TORCH) and NOTE [An empty side table is saved as None]; backward reads the kernel
    # choice from attributes (NOTE [Kernel backend choice] in slimgrad/kernels/_backend.py)
    @staticmethod
    def forward(ctx, x, arg, weight, bias, eps, direct=False, y_kept_after=True):
        # direct: the caller passed the gate (NOTE [One gate per call] in slimgrad/_library.py);
        # _TORCH: and the PyTorch forward is the kernel choice (not CUDA, no Triton backend)
        # y_kept_after: NOTE [LayerNorm's fallback columns only where y is kept after it]
        # box: NOTE [LayerNorm's second derivatives through its own node]
        # y_seen: NOTE [A kept output written under saved-tensor hooks] in slimgrad/_errors.py
        ctx.arg, ctx.eps, ctx.lib, ctx.box, ctx.y_seen = arg, eps, None, None, None
        # NOTE [Norm backward without materialized gradients]
        ctx.materialize_grads = False
        if direct is _TORCH:
            comp = False  # past the gate
            y, mean, rstd = _native_layer_norm(x, arg, weight, bias, eps)
            # NOTE [The LayerNorm C backward, chosen in forward]
            b, cpu = _backend._resolved[0], _backend._cpu_module[0]
            if (
                (b == "auto" or b == "cpu")
                and x.dtype is _F32
                and x.is_cpu
                and cpu is not None
                and C_STEM in cpu._libs
            ):
                ctx.lib = cpu._libs[C_STEM]
            idx = fallback_or_none(weight, bias, y.dtype, _LN_GAMMA)
            if idx is not None:
                # all fallback, y not kept after, or a shape where eager's backward fits better
                if not y_kept_after or _keeps_x(idx, arg, x, False):
                    return _keep_x(ctx, x, y, mean, rstd, weight, bias, True)
                if idx.device != x.device:
                    idx = idx.to(x.device)
                xside = side_columns(x, math.prod(arg), idx)
            elif not x.requires_grad or (ctx.lib is None and _torch_bwd_over(x, arg)):
                # NOTE [A weight-only LayerNorm keeps x]; NOTE [LayerNorm fallback backward
                # peak] in slimgrad/_math/norms.py, without a fallback channel
                return _keep_x(ctx, x, y, mean, rstd, weight, bias, True)
        else:
            # every channel keeps x: eager's forward (_keep_x), no gather; plain weights only
            # (never fake), no allocation where there is no fallback channel
            comp = compiling()
            if (
                not comp
                and type(weight) in _PLAIN_OR_NONE
                and type(bias) in _PLAIN_OR_NONE
                and _keeps_x(
                    fallback_or_none(weight, bias, x.dtype, _LN_GAMMA), arg, x, True, y_kept_after
                )
            ):
                y, mean, rstd = _native_layer_norm(x, arg, weight, bias, eps)
                return _keep_x(ctx, x, y, mean, rstd, weight, bias)
            fwd = _layer_norm_fwd.impl if direct else _layer_norm_fwd
            y, mean, rstd, idx, xside = fwd(x, arg, weight, bias, eps)
            k = idx.shape[0]
            # NOTE [An empty side table is saved as None]; eager only (a traced table has a
            # symbolic length)
            if not comp and type(k) is int and k == 0:
                idx = None
        # NOTE [A kept output written under saved-tensor hooks] (eager only)
        if not comp and hooks_top(False) is not None:
            ctx.y_seen = seen(y)
        if idx is None:
            if direct is _TORCH:  # NOTE [LayerNorm's straight forward returns y alone]
                if CTX_FIELDS:  # NOTE [Saving through ctx's fields]
                    ctx.to_save = (y, mean, rstd, None, None, weight, bias)
                else:
                    ctx.save_for_backward(y, mean, rstd, None, None, weight, bias)
                return y
            ctx.save_for_backward(y, mean, rstd, None, None, weight, bias)
            ctx.mark_non_differentiable(mean, rstd)
            return y, mean, rstd
        ctx.save_for_backward(y, mean, rstd, idx, xside, weight, bias)
        if direct is _TORCH:  # NOTE [LayerNorm's straight forward returns y alone]
            return y
        ctx.mark_non_differentiable(mean, rstd, idx, xside)
        return y, mean, rstd, idx, xside

    @staticmethod
    def backward(ctx, dy, *_, boxed=False):
        # first_order's check inline, one frame fewer (NOTE [Second derivatives] in
        # slimgrad/_autograd.py): under create_graph=True the differentiable backward runs
        if ctx.box and not boxed:  # NOTE [A second-order pass's gradient handed to its node]
            return bridged_backward(ctx, dy, _LayerNormFn.backward)
        if _grad_on():
            return _ln_double(ctx, dy)
        if dy is None:  # NOTE [Norm backward without materialized gradients]
            return None, None, None, None, None, None, None
        try:
            y, mean, rstd, idx, xside, weight, bias = ctx.saved_tensors
        except RuntimeError as e:  # NOTE [A norm's output written after forward]
            y_written(e, ctx, "ops.layer_norm")
            raise
        if y is None:  # x kept (_keep_x): eager's backward, which never reuses dy
            return _eager_bwd(ctx, dy, xside, mean, rstd, weight, bias)
        if ctx.y_seen is not None:  # NOTE [A kept output written under saved-tensor hooks]
            check_output_seen(ctx, y, "ops.layer_norm", _NORM_FIX)
        # first use of dy (after the y is None branch, so that no reuse is counted that never
        # happens): NOTE [Gradient-buffer ownership] (ownership.take in one frame, after
        # take's compile check)
        buf = dy if not compiling() and ownership.grant(dy, ownership.PROBE) else None
        dx, dw, db, mask = first_order_bwd(ctx, dy, buf, y, mean, rstd, idx, xside, weight, bias)
        return (
            dx if mask[0] else None,
            None,
            dw if weight is not None and mask[1] else None,
            db if bias is not None and mask[2] else None,
            None,
            None,
            None,
        )


def first_order_bwd(ctx, dy, buf, y, mean, rstd, idx, xside, weight, bias) -> tuple:
    """_LayerNormFn's first-order backward from y, shared with the GPT-2 MLP node's folded
    LayerNorm (ops/gpt2_mlp.py): ``buf`` is dy where it was granted (dx may be written into it),
    else None; returns (dx, dweight, dbias, mask)."""
    need = ctx.needs_input_grad
    mask = [need[0], need[2], need[3]]
    if (  # owns_layout(buf, y), inline; eager only (take refuses under torch.compile)
        mask[0]
        and buf is not None
        and buf.shape == y.shape
        and buf.dtype == y.dtype
        and buf.is_contiguous()
    ):
        lib = ctx.lib  # NOTE [The LayerNorm C backward, chosen in forward]
        b = _backend._resolved[0]
        if lib is None or type(y) is not _Tensor or (b != "auto" and b != "cpu"):
            lib = None
            # _bwd_impl(y), inline where it cannot pick Triton
            if not y.is_cuda and b in _NO_TRITON:
                impl = _bwd_cpu if y.is_cpu else _bwd_torch
            else:
                impl = _bwd_impl(y)
                if idx is None:
                    idx, xside = _no_side(y, arg=ctx.arg)
        if lib is not None:
            r = None
            if idx is None and _EXT_LN_BWD is not None:  # NOTE [LayerNorm's backward from C++]
                a = _LN_BWD_ADDR[lib] if lib in _LN_BWD_ADDR else _ln_bwd_addr(lib)
                r = _EXT_LN_BWD(
                    buf, y, rstd, weight, bias, ctx.arg, mask[0], mask[1], mask[2], a,
                    C_MIN_BLOCK_ROWS, C_MAX_BLOCKS,
                )  # fmt: skip
            if r is None:
                r = _bwd_cpu(buf, y, mean, rstd, idx, xside, weight, bias, ctx.arg, mask, buf, lib)
            dx, dw, db = r
        else:
            dx, dw, db = impl(buf, y, mean, rstd, idx, xside, weight, bias, ctx.arg, mask, out=buf)
    else:  # the custom op, or its implementation past the gate (NOTE [One gate per call])
        if idx is None:  # the op's schema takes tensors
            idx, xside = _no_side(y, arg=ctx.arg)
        dx, dw, db = (_layer_norm_bwd.impl if straight() else _layer_norm_bwd)(
            dy, y, mean, rstd, idx, xside, weight, bias, ctx.arg, mask
        )
    return dx, dw, db, mask


class _LayerNormCompiledFn(_LayerNormFn):
    # NOTE [LayerNorm's backward traced under torch.compile]
    # _LayerNormFn while compiling: the same forward (the layer_norm_fwd custom op; under
    # compile it always saves y, mean, rstd, the fallback table and input columns, the weight and
    # bias) and so the same saved set, with its backward written as plain torch ops instead of
    # the opaque layer_norm_bwd custom op, so inductor fuses it (compiled eager's LayerNorm
    # backward is fused too). Nothing is recomputed from the forward's inputs: xhat = (y - beta) /
    # gamma is rebuilt from the saved output and the fallback columns from the saved side table,
    # each patch inside a product with dy (as NOTE [RMSNorm's backward traced under
    # torch.compile] in ops/rms_norm.py: a tensor made from saved tensors alone and of fixed size
    # would be kept by the partitioner, N x D, instead of the table). The math is
    # layer_norm_bwd_torch's (dgamma and dbeta summed over rows in float64; dx = rstd * (g -
    # mean(g) - xhat * mean(g * xhat)), g = dy * gamma); inductor's fused order rounds
    # differently, within the error rule (tests/test_compile_layer_norm.py).
    @staticmethod
    def backward(ctx, dy, *_):
        if _grad_on():
            return refuse_second_order("ops.layer_norm", _LayerNormCompiledFn.backward, ctx, (dy,))
        if dy is None:  # NOTE [Norm backward without materialized gradients]
            return None, None, None, None, None, None, None
        try:
            y, mean, rstd, idx, xside, weight, bias = ctx.saved_tensors
        except RuntimeError as e:  # NOTE [A norm's output written after forward]
            y_written(e, ctx, "ops.layer_norm")
            raise
        if y is None:  # x kept (_keep_x; not taken while compiling): eager's backward
            return _eager_bwd(ctx, dy, xside, mean, rstd, weight, bias)
        need = ctx.needs_input_grad
        need_dx = need[0]
        need_dw = weight is not None and need[2]
        need_db = bias is not None and need[3]
        d = math.prod(ctx.arg)
        y2, dy2 = y.reshape(-1, d), dy.reshape(-1, d)
        mu, r = mean.reshape(-1, 1), rstd.reshape(-1, 1)
        w = None if weight is None else weight.reshape(d)
        xh = y2 if bias is None else y2 - bias.reshape(d)
        if w is not None:
            xh = xh / w
        # the fallback columns' xhat, as eager builds it (traced: always a table, symbolic length)
        xf = (xside - mu) * r if idx is not None else None
        dw = db = dx = None
        if need_db:
            db = dy2.sum(0, dtype=torch.float64).to(bias.dtype).reshape(bias.shape)
        if need_dw:
            a = dy2 * xh
            if xf is not None:
                a = a.index_copy(1, idx, dy2.index_select(1, idx) * xf)
            dw = a.sum(0, dtype=torch.float64).to(weight.dtype).reshape(weight.shape)
        if need_dx:
            g = dy2 if w is None else dy2 * w
            gx = g * xh
            if xf is not None:
                gf = g.index_select(1, idx)
                gx = gx.index_copy(1, idx, gf * xf)
            c1 = g.sum(-1, keepdim=True) / d
            c2 = gx.sum(-1, keepdim=True) / d
            t = g - c1 - xh * c2
            if xf is not None:
                t = t.index_copy(1, idx, gf - c1 - xf * c2)
            dx = (t * r).view(y.shape)
        return dx, None, dw, db, None, None, None


# NOTE [All-fallback LayerNorm under torch.compile]
# Where every channel is a fallback channel eager saves x and the uncompiled op does too
# (``_keep_x``). Traced, the forward's fallback table has a symbolic length (NOTE [Side tables
# under FakeTensorMode and torch.compile] in slimgrad/_math/tables.py), so the compiled graph kept
# y and a gathered copy of every column of x: LayerNorm(16) with every gamma 1e-9 on (13, 16), its
# output times 2, kept 1,896 B beside its inputs against eager's 104. So while compiling, the
# weights are asked once at trace time, with real values: Dynamo evaluates a function marked as
# having a constant result (as torch.compiler.assume_constant_result does, the mark of
# ``compiling`` in slimgrad/_autograd.py) on the real parameters and installs no guard on its
# answer. All fallback: the graph traces ``F.layer_norm`` (eager's op, its saved tensors and
# bits). The answer holds for that graph: weights that change later keep the traced choice, which
# is exact either way (eager's op, or the output-keeping op with its fallback table); only the
# bytes differ. Fake, functional or subclass weights (export, an estimate) carry no values: the
# output-keeping op, as before.
def _all_fallback_when_traced(weight, bias, dtype, normalized_shape) -> bool:
    if weight is None and bias is None:
        return False
    if type(weight) not in _PLAIN_OR_NONE or type(bias) not in _PLAIN_OR_NONE:
        return False
    try:
        idx = fallback_or_none(weight, bias, dtype, _LN_GAMMA)
    except RuntimeError:  # values not readable here (a fake or meta tensor behind a plain type)
        return False
    return idx is not None and idx.shape[0] == math.prod(normalized_shape)


_all_fallback_when_traced._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _any_fallback_when_traced(weight, bias, dtype) -> bool:
    # a fallback channel at trace time, asked as _all_fallback_when_traced asks (NOTE [LayerNorm's
    # fallback columns only where y is kept after it])
    if weight is None and bias is None:
        return False
    if type(weight) not in _PLAIN_OR_NONE or type(bias) not in _PLAIN_OR_NONE:
        return False
    try:
        return fallback_or_none(weight, bias, dtype, _LN_GAMMA) is not None
    except RuntimeError:  # values not readable here (a fake or meta tensor behind a plain type)
        return False


_any_fallback_when_traced._dynamo_marked_constant = True  # type: ignore[attr-defined]


# NOTE [A weight-only LayerNorm keeps x]
# Where x needs no gradient (a norm on the model's input, a batch of data; or a frozen layer's
# output) the backward makes dgamma and dbeta only. Eager saves x, mean and rstd; keeping y in x's
# place saves x's bytes only where x dies after the forward, which no fact at the call states (the
# caller's batch outlives the step), and it holds y past its consumer's backward, which frees it
# in eager: a LayerNorm on the model's input then a Linear peaked one y above eager's (8 x 64
# fp32: 24,848 B against 22,800), or dgamma + dbeta above it where the consumer's backward is the
# step's peak (LayerNorm(64) -> Linear on 64 rows: 50,440 B against 49,928). So such a LayerNorm
# runs eager's forward, saved set and backward (``_keep_x``): eager's bits and bytes, decided per
# call from ``x.requires_grad``. RMSNorm keeps y there: eager's RMSNorm saves an n x D tensor of
# its own (xhat; NOTE [A weight-only backward keeps no rstd] in ops/rms_norm.py).


# NOTE [LayerNorm's fallback columns only where y is kept after it]
# With a fallback channel the output-keeping forward saves y, mean, rstd, the channels' input
# columns and their index table, where eager saves x, mean and rstd. That wins only where y's
# consumer keeps y itself (a Linear or convolution saving its input for its weight's gradient: y
# is then kept once, for both, and the columns cost k/D of x). Where nothing keeps y (a residual
# add, a Tanh or Sigmoid keeping its own output, a Dropout, the loss) the columns and the table
# are above eager's: LN(16) with one fallback channel -> Tanh on 64 rows saved 13,064 B against
# eager's 12,800 and peaked 17,168 against 17,032. Which holds is a fact of the model's
# structure, read at ``convert_`` time (``_kept_after`` in slimgrad/nn/_output_act.py, NOTE [Keep
# y only where its consumer keeps it]) and stored as ``slimgrad.nn.LayerNorm.y_kept_after``:
# True only where y goes to such a layer; a module built directly, an unknown consumer and a
# "not kept" all keep x where a fallback channel exists (eager's forward, saved set, backward and
# bits: ``_keep_x``). Without a fallback channel nothing changes (y, mean, rstd: eager's bytes
# where y is not kept, fewer where it is). The functional ``layer_norm`` takes its y as kept (its
# documented contract: y shared with the next layer). Under torch.compile the choice is made at
# trace time on the real weights (``_any_fallback_when_traced``, as NOTE [All-fallback LayerNorm
# under torch.compile]).
def _keeps_x(idx, arg, x, triton_possible: bool, y_kept_after: bool = True) -> bool:
    # x kept and eager's backward run (_keep_x): where x needs no gradient (NOTE [A weight-only
    # LayerNorm keeps x]), where every channel is a fallback channel (NOTE [LayerNorm with a
    # non-finite gamma]), where y's consumer is not known to keep y (NOTE [LayerNorm's fallback
    # columns only where y is kept after it]), and where the PyTorch backward would hold more
    # than eager's on this shape (``_torch_bwd_over``; without a fallback channel only where the
    # C kernel does not run); integers of the shape after the first checks.
    if not x.requires_grad:  # NOTE [A weight-only LayerNorm keeps x]
        return True
    if idx is None:  # the PyTorch backward's temporaries, without a fallback channel
        return (not x.is_cpu or x.dtype is not _F32 or _backend.use_cpu(x, C_STEM) is None) and (
            _torch_bwd_over(x, arg, 0, triton_possible)
        )
    if not y_kept_after:
        return True
    k = idx.shape[0]
    if k == math.prod(arg):
        return True
    return _torch_bwd_over(x, arg, k, triton_possible)


def _torch_bwd_over(x, arg, k: int = 0, triton_possible: bool = False) -> bool:
    # whether layer_norm_bwd_torch with ``k`` fallback channels would hold more than eager's
    # backward on x's shape (NOTE [LayerNorm fallback backward peak]); the Triton backward, which
    # takes the fallback channels itself (kernels/layer_norm.py), holds no more
    if (
        triton_possible
        and (x.is_cuda or _backend._resolved[0] not in _NO_TRITON)
        and _backend.use_triton(x)
    ):
        return False
    d = math.prod(arg)
    size = x.element_size()  # float32/float64: half precision runs eager's op before this
    if size < 4 or d == 0:
        return False
    if k == 0 and x.is_leaf:  # the graph's AccumulateGrad node holds x: keeping y saves none
        return True
    return not bwd_torch_fits(x.numel() // d, d, k, size)


# NOTE [LayerNorm under checkpoint keeps y]
# Keeping y instead of x saves x's bytes only where x dies after the forward. Inside a
# non-reentrant checkpoint region the recompute in backward decides what lives, and there two
# cases keep more than eager under the same checkpoint: (1) a norm that is the region's first op
# gets the region's input as x, which the checkpoint holds until the region's backward anyway;
# eager keeps it at no cost and lets y go inside its consumer's backward, y kept here lives on to
# the norm's backward (Linear -> [LayerNorm -> Linear] x 2 at 2x5x16, fp32: 4,376 B peak against
# eager's 4,312, the consumer's 64 B bias gradient made while y is still kept; 1.0014x at
# 4x33x64); (2) a selective-checkpoint policy that caches the forward's y (here through the next
# Linear's aten.view) hands the consumer that y while the recompute makes another, which the norm
# keeps: a second y (6,232 B against 5,592). Where x is made inside the region (a norm after a
# Linear, the second norm of a transformer block) keeping y frees x in the recompute: 4,376 B
# against 4,952. Neither case is told by a public fact at the call: whether x outlives the call
# (the region's input or a policy's cached tensor) and whether the policy caches y are the
# checkpoint's state. Keeping x under every checkpoint hook was measured and given up: on a
# 3-layer GPT-2 (64 wide, 4 x 64 tokens) under HF's non-reentrant checkpointing it peaked at
# 1,474,320 B against 1,408,784 keeping y (eager 2,578,952: 0.572x against 0.546x), one hidden
# state more from every block's second norm. So y is kept under checkpoint as elsewhere, and the
# bound is pinned: at most one y above eager (tests/ops/test_layer_norm_checkpoint.py).
def _keep_x(ctx, x, y, mean, rstd, weight, bias, alone=False):
    # Every channel is a fallback channel (a non-finite gamma anywhere, or every gamma ~ 0): what
    # eager saves, x itself, instead of y and a copy of x; the backward is eager's (NOTE [LayerNorm
    # with a non-finite gamma] in slimgrad/_math/norms.py). y's slot holds None: the mark.
    # alone: y is the only output (NOTE [LayerNorm's straight forward returns y alone])
    ctx.save_for_backward(None, mean, rstd, None, x, weight, bias)
    if alone:
        return y
    ctx.mark_non_differentiable(mean, rstd)
    return y, mean, rstd


def _eager_bwd(ctx, dy, x, mean, rstd, weight, bias):
    need = ctx.needs_input_grad
    mask = [need[0], weight is not None and need[2], bias is not None and need[3]]
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        dy, x, ctx.arg, mean, rstd, weight, bias, mask
    )
    dw, db = dw if mask[1] else None, db if mask[2] else None
    return dx if mask[0] else None, None, dw, db, None, None, None


def _no_side(y: torch.Tensor, arg) -> tuple[torch.Tensor, torch.Tensor]:
    # the empty index table and input columns of a forward without fallback channels
    d = math.prod(arg)
    return y.new_empty(0, dtype=torch.int64), y.new_empty((y.numel() // d if d else 0, 0))


_TORCH = object()  # _LayerNormFn's ``direct`` for the straight path's PyTorch forward
_native_layer_norm = torch.native_layer_norm


_LN_APPLY = direct_apply(_LayerNormFn)


def owns_layout(buf: torch.Tensor | None, y: torch.Tensor) -> bool:
    # dx may be written into the granted buffer: a contiguous (n, d) view of it, in y's dtype
    return buf is not None and buf.shape == y.shape and buf.dtype == y.dtype and buf.is_contiguous()


def autocast_inputs(reference_out_dtype: torch.dtype | None, *tensors):
    """Cast floating tensors to the dtype eager autocast computes in (None: leave them)."""
    if reference_out_dtype is None:
        return tensors
    return tuple(
        t.to(reference_out_dtype) if t is not None and t.is_floating_point() else t for t in tensors
    )


def layer_norm(
    input: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Layer normalization (as ``F.layer_norm``) that keeps its output instead of its input.

    ``y = (x - mean) / sqrt(var + eps) * weight + bias`` over the trailing ``normalized_shape``
    dims. See NOTE [Normalization from its output: the fallback channels].

    Memory: saves y (shared with the next layer) + 8 B/row (mean, rstd) + fallback input columns;
    eager saves x + 8 B/row. bfloat16/float16 inputs run eager's ``F.layer_norm`` (keeping x):
    their output cannot pin xhat closely enough for an exact weight gradient (module docstring).

    Args:
        input: ``(*, *normalized_shape)``.
        normalized_shape: trailing shape to normalize over.
        weight, bias: optional ``normalized_shape`` affine parameters.
        eps: added to the variance.

    Returns:
        Tensor like ``input``.

    Example:
        >>> y = layer_norm(torch.randn(4, 8, requires_grad=True), (8,))
    """
    if type(normalized_shape) is not tuple and isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    if (  # the straight path: NOTE [One gate per call] in slimgrad/_library.py
        type(input) in _PLAIN
        and type(weight) in _PLAIN_OR_NONE
        and type(bias) in _PLAIN_OR_NONE
        and input.dtype not in HALF_DTYPES
        and not input.is_meta
        and not _any_autocast()
        and straight()
    ):
        return _layer_norm_straight(input, [int(s) for s in normalized_shape], weight, bias, eps)
    return layer_norm_gated(input, normalized_shape, weight, bias, eps)


def layer_norm_gated(
    input, normalized_shape, weight, bias, eps, y_kept_after: bool = True
) -> torch.Tensor:
    # layer_norm past its straight gate (DTensor, transforms, autocast, subclasses, meta, half
    # precision, compile); y_kept_after: NOTE [LayerNorm's fallback columns only where y is kept
    # after it] (slimgrad.nn.LayerNorm passes its own; the functional's y is taken as kept)
    # NOTE [DTensor at a slimgrad op] in slimgrad/_dtensor.py
    if _dtensor.any_dtensor(input, weight, bias):
        return _dtensor.rowwise(
            "slimgrad.ops.layer_norm",
            layer_norm_gated,
            input,
            {"weight": weight, "bias": bias},
            len(normalized_shape),
            normalized_shape=normalized_shape,
            eps=eps,
            y_kept_after=y_kept_after,
        )
    normalized_shape = [int(s) for s in normalized_shape]
    # NOTE [torch.func transforms], NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py
    if transforms_active() or input.is_meta:
        return F.layer_norm(input, normalized_shape, weight, bias, eps)
    dev = input.device.type
    if torch.is_autocast_enabled(dev):
        probe = F.layer_norm(input.new_empty((0, *normalized_shape)), normalized_shape)
        if probe.dtype != input.dtype:
            input, weight, bias = autocast_inputs(probe.dtype, input, weight, bias)
        with torch.autocast(dev, enabled=False):
            return _layer_norm(input, normalized_shape, weight, bias, float(eps), y_kept_after)
    return _layer_norm(input, normalized_shape, weight, bias, float(eps), y_kept_after)


def _layer_norm(input, normalized_shape, weight, bias, eps: float, y_kept_after=True):
    # the caller has taken eager's op under torch.func transforms (transforms_active())
    if input.dtype in HALF_DTYPES:  # eager's: exact dgamma needs x (module docstring, Limits)
        return F.layer_norm(input, normalized_shape, weight, bias, eps)
    if torch.compiler.is_compiling():  # Dynamo traces Function.apply; no anchor (make_anchor)
        refuse_jit("ops.layer_norm")
        if _all_fallback_when_traced(weight, bias, input.dtype, normalized_shape) or (
            not y_kept_after and _any_fallback_when_traced(weight, bias, input.dtype)
        ):
            return F.layer_norm(input, normalized_shape, weight, bias, eps)
        # NOTE [LayerNorm's backward traced under torch.compile]
        return _LayerNormCompiledFn.apply(input, normalized_shape, weight, bias, eps)[0]
    if _is_tracing():  # torch.jit.is_tracing() in eager Python (Dynamo cannot trace this one)
        refuse_jit("ops.layer_norm")
    # NOTE [Applying a Function without its Python wrapper] in slimgrad/_autograd.py; no anchor
    # (NOTE [LayerNorm's second derivatives through its own node])
    return _LN_APPLY(
        unwrap_if_dead(input),
        normalized_shape,
        None if weight is None else unwrap_if_dead(weight),
        None if bias is None else unwrap_if_dead(bias),
        eps,
        False,
        y_kept_after,
    )[0]


_is_tracing = torch._C._is_tracing
_any_autocast = torch._C._is_any_autocast_enabled
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PLAIN_OR_NONE = (torch.Tensor, torch.nn.Parameter, type(None))


def _layer_norm_straight(input, normalized_shape, weight, bias, eps) -> torch.Tensor:
    # _layer_norm past the gate: no transform, trace, compile, mode or autocast, plain tensors.
    # TWIN: slimgrad/nn/layer_norm.py's LayerNorm.forward has these steps inline (one frame
    # fewer, for LayerNorm's call budget of 43); change both (tests/nn/test_layer_norm.py)
    # no anchor: NOTE [LayerNorm's second derivatives through its own node]
    x = unwrap_if_dead(input)
    if type(weight) is not torch.nn.Parameter and weight is not None:
        weight = unwrap_if_dead(weight)
    if type(bias) is not torch.nn.Parameter and bias is not None:
        bias = unwrap_if_dead(bias)
    # the PyTorch forward where use_triton cannot answer True (NOTE [Kernel backend choice])
    backend = _backend._resolved[0] or _backend.get_backend()
    direct = _TORCH if not x.is_cuda and backend in _NO_TRITON else True
    y = _LN_APPLY(x, normalized_shape, weight, bias, float(eps), direct)
    # NOTE [LayerNorm's straight forward returns y alone]
    return y if direct is _TORCH else y[0]


_grad_on = torch._C.is_grad_enabled
