"""Dropout that keeps its mask as 1 bit per element.

Math (as ``torch.nn.functional.dropout``): ``y = x * m / (1 - p)`` with ``m ~ Bernoulli(1 - p)``
drawn per element; ``dx = dy * m / (1 - p)``. ``p == 0`` or ``training=False`` returns ``x`` itself;
``p == 1`` returns ``x * 0`` (NaN where x is inf/NaN, as eager).

Memory: saves the mask bit-packed, 1/8 B/elt (uint8, ``ceil(n / 8)`` bytes); eager saves a float
mask of the input's dtype on CPU (4 B/elt fp32) and a bool mask (1 B/elt) on CUDA. A CPU tensor
too small for the packed mask to save bytes (at most 4 half-precision elements outside the C
kernel: NOTE [Dropout's mask temporaries]) keeps eager's float mask.
Backward writes dx into the incoming gradient's buffer when ``slimgrad.ownership.take`` proves it
dead (NOTE [Gradient-buffer ownership]); otherwise, and under torch.compile, out of place.
While Dynamo traces, a CPU dropout is plain torch ops that inductor fuses, with the same mask and
the same packed bits kept (NOTE [Dropout traced under torch.compile]); elsewhere the custom ops.
``inplace=True`` then computes out of place and writes the result back with ``copy_`` (the same
mask and gradients; the copy is the compiler's memory): the in-place Function traced as is,
torch 2.13+ dropped its backward on a graph input and torch 2.11 when the caller keeps using the
written tensor instead of the returned one (NOTE [In-place Functions under torch.compile]).

# NOTE [Dropout masks: drawn like eager, kept as bits]
The mask is drawn exactly as eager PyTorch draws it, from the global generator of the input's
device, so it follows ``torch.manual_seed`` and is *the same mask eager would draw* at the same RNG
state: on CUDA out-of-place, the forward calls ``torch.native_dropout`` (what ``F.dropout`` uses
there); on CPU, and in-place everywhere, it runs eager's own ``noise = empty_like(x).bernoulli_(1 -
p).div_(1 - p); x * noise``. The mask is then packed into bits and the backward unpacks those bits,
so the backward mask is the forward mask by construction (no RNG replay, which is what broke
memsave_torch's dropout for p != 0.5), on any device, under autocast and torch.compile (the draw
is eager's op there too: NOTE [Dropout traced under torch.compile]), and successive calls draw
independent masks because the generator advances. The backward multiplies as eager's backward
does (CPU and in-place: ``dy * noise`` with ``noise = m / (1 - p)`` rounded to the dtype; CUDA
out-of-place: ``native_dropout_backward``), so gradients match eager bit for bit. On contiguous
float32 CPU tensors the packing and both multiplies run as one C pass each
(``kernels/cpu/dropout.c``, NOTE [CPU C kernels]): ``m ? x * s : x * 0`` is exactly eager's
``x * noise``, and no bool or unpacked mask is materialized; the draw itself stays eager's
``bernoulli_``."""

from __future__ import annotations

import torch

from slimgrad import _dtensor, ownership
from slimgrad._autograd import (
    CTX_FIELDS,
    FxTraceError,
    compiling,
    direct_apply,
    first_order,
    refuse_jit,
    transforms_active,
    unwrap_if_dead,
)
from slimgrad._library import custom_op, straight
from slimgrad._math.dropout import _SCALES, noise_scale, noise_scale_value
from slimgrad.kernels import _backend
from slimgrad.ops import _bits
from slimgrad.ops._bits import pack_bits, pack_nonzero, packed_numel

__all__ = ["dropout", "dropout_", "pack_bits", "unpack_bits"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)

# Bit packing: slimgrad.ops._bits (NOTE [Bit packing with one multiply] there); re-exported here.
C_STEM = "dropout"  # kernels/cpu/dropout.c: pack + apply in one pass on float32 CPU tensors


def _packed_numel(n: int) -> int:
    return packed_numel(n)


def unpack_bits(bits: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: a bool tensor of ``shape`` (one temporary byte per element)."""
    n = 1
    for s in shape:
        n *= s
    return _bits.unpack_bits(bits, n).view(shape)


def _c_signatures(C):
    p, i64, f, i = C.c_void_p, C.c_int64, C.c_float, C.c_int
    return {
        "fwd": ("dropout_fwd_f32", [p, p, p, p, i64, f, i], None),
        "bwd": ("dropout_bwd_f32", [p, p, p, i64, f, i], None),
    }


def _c_fns(lib):
    fns = getattr(lib, "_slimgrad_fns", None)  # bound once per library (kernels/_cpu.functions)
    if fns is None:
        from slimgrad.kernels._cpu import functions

        fns = functions(lib, _c_signatures)
    return fns


#: dropout.c's function addresses by library, filled by :func:`c_addr`: a C++ body's caller reads
#: ``FWD_ADDR[lib] if lib in FWD_ADDR else c_addr(lib, "fwd")`` (no call once known)
FWD_ADDR: dict = {}
BWD_ADDR: dict = {}


def c_addr(lib, which: str) -> int:
    """The address of dropout.c's ``which`` function (``"fwd"``: dropout_fwd_f32, ``"bwd"``:
    dropout_bwd_f32) as the ctypes function the Python bodies call binds it, for the C++ bodies
    that call the same function (NOTE [Backward bodies from C++] in slimgrad/_ext); kept in
    :data:`FWD_ADDR` or :data:`BWD_ADDR` by library, read once per library."""
    table = FWD_ADDR if which == "fwd" else BWD_ADDR
    addr = table.get(lib)
    if addr is None:
        from slimgrad.kernels._cpu import address

        addr = table[lib] = address(_c_fns(lib)[which])
    return addr


# kernels/_cpu.threads() without its frame: torch's thread count (never below 1)
_nthreads = torch.get_num_threads


def _c_lib(t: torch.Tensor):
    # the C kernels for a contiguous float32 CPU tensor (NOTE [Kernel backend choice]), else None
    if not t.is_contiguous() or t.numel() == 0:
        return None
    return _backend.use_cpu(t, C_STEM)


# NOTE [Fake tensors model the C kernel]
# use_cpu never picks the C kernels for a fake tensor (there is no memory to run them on), so under
# slimgrad.memory.estimate this op would run its PyTorch path, whose mask temporaries (the mask
# bytes pack_nonzero packs in place and the mask unpack_mask rebuilds in backward, ceil(n / 8) * 8
# B each: NOTE [Dropout's mask temporaries]) the real CPU step never allocates, and would estimate
# a peak above the real one. A fake tensor the real C kernel would take
# (kernels/_backend.cpu_kernel_would_run) allocates the kernel's outputs only, the same tensors
# with the same shapes; values are never read under fake tensors.
def _fake_c(t: torch.Tensor) -> bool:
    return (
        t.is_contiguous()
        and t.numel() > 0
        and _backend._is_fake(t)
        and _backend.cpu_kernel_would_run(t, C_STEM)
    )


def _scale(p: float, t: torch.Tensor) -> float:
    # noise_scale_value(p, t.dtype, t.device); the callers read its table first, without a frame
    return noise_scale_value(p, t.dtype, t.device)


def _c_fwd(lib, noise: torch.Tensor, x: torch.Tensor, out: torch.Tensor, p: float) -> torch.Tensor:
    n = x.numel()
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8)  # packed_numel(n)
    key = (p, x.dtype, x.device)
    scale = _SCALES[key] if key in _SCALES else _scale(p, x)
    try:  # the bound C functions (_c_fns), an attribute once bound
        fns = lib._slimgrad_fns
    except AttributeError:
        fns = _c_fns(lib)
    # the thread count as kernels/_cpu.threads() gives it (torch's own, at least 1)
    fns["fwd"](
        noise.data_ptr(), x.data_ptr(), out.data_ptr(), bits.data_ptr(), n, scale, _nthreads()
    )
    return bits


def _fused(x: torch.Tensor) -> bool:
    return x.device.type != "cpu"


# NOTE [Dropout's mask temporaries]
# Outside the C kernel (every dtype but contiguous float32 on CPU, or no compiler) the mask is
# packed from eager's noise with one temporary, the mask bytes packed in place (_bits.pack_nonzero,
# ceil(n / 8) * 8 B), and unpacked in backward into one (_bits.unpack_mask, the same size): at most
# 9 B per 8 elements beside the tensors eager holds too, against eager's noise (the output's
# bytes in forward, the saved noise in backward). Where those 9 * ceil(n / 8) B exceed the
# noise's n * itemsize B (at most 4 half-precision elements, 2 float32, 1 float64) the packed
# mask cannot save anything: there the op keeps eager's noise itself (``_keeps_noise``, from
# numel, dtype and device) and its backward is eager's ``dy * noise`` (softmax-dropout's ops,
# whose bits are not eager's saved noise, always pack: ``_fwd_torch(..., keep_noise=False)``).
def _keeps_noise(x: torch.Tensor) -> bool:
    n = x.numel()
    return x.device.type == "cpu" and 9 * ((n + 7) // 8) > n * x.element_size()


def _fwd_torch(
    x: torch.Tensor, p: float, keep_noise: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    # keep_noise=False: always packed bits, never eager's noise (softmax-dropout's ops declare
    # uint8[ceil(n / 8)] for their bits; NOTE [Dropout's mask temporaries])
    if x.device.type != "cpu":  # _fused(x): eager's CUDA path
        out, mask = torch.native_dropout(x, p, True)
        return out, pack_bits(mask)
    # eager's CPU path, op for op (native_dropout's x * m * scale differs in the last bit for
    # some p, e.g. 1e-6)
    noise = torch.empty_like(x).bernoulli_(1 - p)
    # _c_lib(x), inline
    lib = _backend.use_cpu(x, C_STEM) if 0 not in x.shape and x.is_contiguous() else None
    if lib is not None:  # the same draw; pack + x * noise in one C pass, into noise
        return noise, _c_fwd(lib, noise, x, noise, p)
    if _fake_c(x):  # NOTE [Fake tensors model the C kernel]
        return noise, x.new_empty((packed_numel(x.numel()),), dtype=torch.uint8)
    if keep_noise and _keeps_noise(x):  # NOTE [Dropout's mask temporaries]: eager's op
        return x * noise.div_(1 - p), noise
    bits = pack_nonzero(noise)  # NOTE [Dropout's mask temporaries]
    # noise * x == x * noise bit for bit; writing it into noise spares eager's extra buffer
    return noise.div_(1 - p).mul_(x), bits


def _fwd_inplace_torch(x: torch.Tensor, p: float) -> torch.Tensor:
    noise = torch.empty_like(x).bernoulli_(1 - p)
    lib = _c_lib(x)
    if lib is not None:
        return _c_fwd(lib, noise, x, x, p)
    if _fake_c(x):  # NOTE [Fake tensors model the C kernel]
        return x.new_empty((packed_numel(x.numel()),), dtype=torch.uint8)
    if _keeps_noise(x):  # NOTE [Dropout's mask temporaries]: eager's op, its noise kept
        x.mul_(noise.div_(1 - p))
        return noise
    bits = pack_nonzero(noise)  # NOTE [Dropout's mask temporaries]
    noise.div_(1 - p)
    x.mul_(noise)
    return bits


def _apply_mask_torch(
    g: torch.Tensor,
    bits: torch.Tensor,
    p: float,
    fused: bool,
    inplace: bool = False,
    graph: bool = False,
) -> torch.Tensor:
    # dy * m / (1 - p), rounded exactly as eager's backward; also rebuilds the forward output from
    # its input. CPU and in-place: (g * m) * s equals eager's g * noise bit for bit (noise = m * s
    # in dtype; g * 1 = g exactly, g * 0 = +-0 or NaN as in eager); the mask is the only
    # temporary (1 B/elt). inplace=True overwrites g (a caller-owned temporary). graph=True
    # (create_graph): torch ops only, so the result carries g's history (NOTE [Dropout's double
    # backward]).
    # _c_lib(g), inline
    lib = (
        None
        if graph or fused or 0 in g.shape or not g.is_contiguous()
        else _backend.use_cpu(g, C_STEM)
    )
    if lib is not None:  # (g * m) * s == m ? g * s : g * 0, the same rounding, one pass
        out = g if inplace else torch.empty_like(g)
        key = (p, g.dtype, g.device)
        scale = _SCALES[key] if key in _SCALES else _scale(p, g)
        try:  # the bound C functions (_c_fns), an attribute once bound
            fns = lib._slimgrad_fns
        except AttributeError:
            fns = _c_fns(lib)
        fns["bwd"](g.data_ptr(), bits.data_ptr(), out.data_ptr(), g.numel(), scale, _nthreads())
        return out
    if not (graph or fused) and _fake_c(g):  # NOTE [Fake tensors model the C kernel]
        return g if inplace else torch.empty_like(g)
    if bits.dtype is not _U8:  # eager's noise (NOTE [Dropout's mask temporaries]): dy * noise
        return g.mul_(bits) if inplace else g * bits
    mask = _bits.unpack_mask(bits, g.numel()).view(g.shape)  # NOTE [Dropout's mask temporaries]
    if fused:
        if inplace:  # the same kernel, its result written into g
            return torch.ops.aten.native_dropout_backward.out(g, mask, 1.0 / (1 - p), out=g)
        return torch.ops.aten.native_dropout_backward(g, mask, 1.0 / (1 - p))
    scale = noise_scale(p, g.dtype, g.device)
    if 1.0 / (1 - p) >= torch.finfo(g.dtype).max:  # scale is inf in dtype: 0 * inf would be NaN
        noise = torch.where(mask, scale, torch.zeros((), dtype=g.dtype, device=g.device))
        return g.mul_(noise) if inplace else g * noise
    out = g.mul_(mask) if inplace else g.mul(mask)
    return out.mul_(scale)


_bwd_torch = _apply_mask_torch


def _kernels(t: torch.Tensor):
    # the Triton kernels when chosen (NOTE [Kernel backend choice]) and they take t, else None.
    # auto=False: only a forced "triton" picks them, so any other process-wide name answers at once
    if (_backend._resolved[0] or _backend.get_backend()) != "triton":  # get_backend(), no frame
        return None
    if not _backend.use_triton(t, auto=False):
        return None
    k = _backend.kernels("dropout")
    return k if k.supports(t) else None


@custom_op("dropout_fwd", mutates_args=())
def _dropout_fwd(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    k = _kernels(x)
    return k._fwd_triton(x, p) if k is not None else _fwd_torch(x, p)


@_dropout_fwd.register_fake
def _(x, p):
    if _kernels(x) is None and not _fake_c(x) and _keeps_noise(x):  # _fwd_torch's choice
        return torch.empty_like(x), torch.empty_like(x)
    return torch.empty_like(x), x.new_empty((_packed_numel(x.numel()),), dtype=torch.uint8)


@custom_op("dropout_fwd_", mutates_args=("x",))
def _dropout_fwd_(x: torch.Tensor, p: float) -> torch.Tensor:
    k = _kernels(x)
    return k._fwd_inplace_triton(x, p) if k is not None else _fwd_inplace_torch(x, p)


@_dropout_fwd_.register_fake
def _(x, p):
    if _kernels(x) is None and not _fake_c(x) and _keeps_noise(x):  # _fwd_inplace_torch's
        return torch.empty_like(x)
    return x.new_empty((_packed_numel(x.numel()),), dtype=torch.uint8)


@custom_op("dropout_apply_mask", mutates_args=())
def _dropout_apply_mask(g: torch.Tensor, bits: torch.Tensor, p: float, fused: bool) -> torch.Tensor:
    g = g.contiguous()
    k = _kernels(g)
    return (
        k._bwd_triton(g, bits, p, fused) if k is not None else _apply_mask_torch(g, bits, p, fused)
    )


@_dropout_apply_mask.register_fake
def _(g, bits, p, fused):
    return torch.empty_like(g, memory_format=torch.contiguous_format)


def _backward(grad, bits, p, fused, owned):
    # owned: grad's buffer is dead (slimgrad.ownership.take granted it; never under torch.compile,
    # where take refuses): dx is written into it, eagerly, outside the custom op.
    if owned:
        k = _kernels(grad)
        if k is not None:
            return k._bwd_triton(grad, bits, p, fused, inplace=True)
        return _apply_mask_torch(grad, bits, p, fused, inplace=True)
    return _dropout_apply_mask(grad, bits, p, fused)


# NOTE [Dropout's double backward]
# Under create_graph=True dx = dy * m / (1 - p) must carry dy's history: it is linear in dy, so
# its derivative is the same product and eager's second derivatives follow exactly. The C pass
# (and its fake-tensor stand-in) write through data pointers, which autograd cannot see: a
# converted Dropout gave a first derivative with no history and second derivatives along it
# were silently zero (review26b item 6). graph=True takes the torch ops instead: the same
# values (g * m) * s, bit for bit.
def _double(ctx, grad, *_):
    # create_graph=True: dx = dy * m / (1 - p) with differentiable torch ops (linear in dy, no x:
    # eager's second derivatives); no buffer reuse.
    (bits,) = ctx.saved_tensors
    return _apply_mask_torch(grad, bits, ctx.p, ctx.fused, graph=True), None


def _double3(ctx, grad, *_):
    # _double of _DropoutFn, whose forward takes a third argument (direct)
    return (*_double(ctx, grad), None)


_UNDECIDED = object()  # ctx.k of a forward that ran the custom op: backward decides itself

# NOTE [Dropout's straight path]
# Past the gate (NOTE [One gate per call] in slimgrad/_library.py: not compiling, no dispatch or
# function mode, no transform, trace or profiler), a forward on a contiguous float32 CPU tensor
# whose backend takes the C kernels ("auto"/"cpu", kernels/cpu/dropout.c built once: a table
# read, NOTE [Kernel backend choice]) draws eager's noise and runs the C pass itself, with no
# custom-op or kernel-choice frame; the library is kept in ``ctx.lib`` and the element count in
# ``ctx.n``. Backward reuses that choice when the incoming gradient is a plain tensor, nothing is
# compiling and no dispatch mode is active (FakeTensorMode, the memory tracker: they take the
# general path, as before): the C pass on the gradient, written into its buffer when
# ``ownership.take`` granted it, or (not granted and not contiguous) on a contiguous copy, as the
# custom op does. Every other forward and backward runs the general path.
_Tensor = torch.Tensor
_F32 = torch.float32
_U8 = torch.uint8
_dispatch_stack_len = torch._C._len_torch_dispatch_stack
_grad_on = torch._C.is_grad_enabled


def _straight_c(x: torch.Tensor, p: float):
    # NOTE [Dropout's straight path] (TWIN: _DropoutFn.forward has these steps inline, one frame
    # fewer for dropout's call budget, 29/28 calls; change both: tests/ops/test_dropout.py
    # checks that they agree; the scores op calls this): on a gated path, the C kernels for x
    # read from the tables use_cpu fills (not chosen, or not built yet: None, and the general
    # path then builds them); where they take x, eager's draw, then pack + x * noise in one C
    # pass into the noise: (out, bits, numel, the library)
    b, cpu = _backend._resolved[0], _backend._cpu_module[0]
    if not (
        (b == "auto" or b == "cpu")
        and x.is_cpu
        and x.dtype is _F32
        and cpu is not None
        and C_STEM in cpu._libs
        and x.is_contiguous()
    ):
        return None
    lib = cpu._libs[C_STEM]
    if lib is None:
        return None
    out = torch.empty_like(x).bernoulli_(1 - p)
    n = 1
    for s in x.shape:  # x.numel(), a few ints multiplied without a call
        n *= s
    bits = torch.empty((n + 7) // 8, dtype=_U8)  # packed_numel(n)
    key = (p, _F32, x.device)
    scale = _SCALES[key] if key in _SCALES else _scale(p, x)
    try:  # the bound C functions (_c_fns), an attribute once bound
        fns = lib._slimgrad_fns
    except AttributeError:
        fns = _c_fns(lib)
    ptr = out.data_ptr()
    fns["fwd"](ptr, x.data_ptr(), ptr, bits.data_ptr(), n, scale, _nthreads())
    return out, bits, n, lib


def _c_bwd(lib, g: torch.Tensor, bits: torch.Tensor, p: float, n: int, out: torch.Tensor):
    # the C pass (g * m) * s (eager's g * noise) into out: g itself or a fresh tensor
    key = (p, _F32, g.device)
    scale = _SCALES[key] if key in _SCALES else _scale(p, g)
    try:  # the bound C functions (_c_fns), an attribute once bound
        fns = lib._slimgrad_fns
    except AttributeError:
        fns = _c_fns(lib)
    fns["bwd"](g.data_ptr(), bits.data_ptr(), out.data_ptr(), n, scale, _nthreads())
    return out


class _DropoutFn(torch.autograd.Function):
    # direct: the caller passed the gate (NOTE [One gate per call] in slimgrad/_library.py): the
    # custom op's implementation runs here, and the kernels it picks (NOTE [Kernel backend
    # choice]) are kept in ctx.k for backward (None: the PyTorch/C path). The bits are saved as
    # an intermediate (never an output: nothing to mark non-differentiable).
    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float, direct: bool = False):
        ctx.p, ctx.lib = p, None
        if direct:
            # NOTE [Dropout's straight path]: TWIN of _straight_c, inline (one frame fewer, for
            # dropout's call budget of 29/28 calls); change both (tests/ops/test_dropout.py)
            b, cpu = _backend._resolved[0], _backend._cpu_module[0]
            lib = (
                cpu._libs[C_STEM]
                if (b == "auto" or b == "cpu")
                and x.is_cpu
                and x.dtype is _F32
                and cpu is not None
                and C_STEM in cpu._libs
                and x.is_contiguous()
                else None
            )
            if lib is not None:
                out = torch.empty_like(x).bernoulli_(1 - p)
                n = 1
                for s in x.shape:  # x.numel(), a few ints multiplied without a call
                    n *= s
                bits = torch.empty((n + 7) // 8, dtype=_U8)  # packed_numel(n)
                key = (p, _F32, x.device)
                scale = _SCALES[key] if key in _SCALES else _scale(p, x)
                try:  # the bound C functions (_c_fns), an attribute once bound
                    fns = lib._slimgrad_fns
                except AttributeError:
                    fns = _c_fns(lib)
                ptr = out.data_ptr()
                fns["fwd"](ptr, x.data_ptr(), ptr, bits.data_ptr(), n, scale, _nthreads())
                ctx.n, ctx.lib, ctx.k, ctx.fused = n, lib, None, False
                if CTX_FIELDS:  # NOTE [Saving through ctx's fields] in slimgrad/_autograd.py
                    ctx.to_save = (bits,)
                else:
                    ctx.save_for_backward(bits)
                return out
            # _kernels(x): only a forced 'triton' picks the kernels (auto=False)
            k = None if _backend._resolved[0] == "auto" else _kernels(x)
            out, bits = k._fwd_triton(x, p) if k is not None else _fwd_torch(x, p)
            ctx.k = k
        else:
            out, bits = _dropout_fwd(x, p)
            ctx.k = _UNDECIDED
        ctx.fused = x.device.type != "cpu"  # _fused(x)
        ctx.save_for_backward(bits)
        return out

    @staticmethod
    def backward(ctx, grad):
        # first_order's check inline, one frame fewer (NOTE [Second derivatives] in
        # slimgrad/_autograd.py): under create_graph=True the differentiable backward runs
        if _grad_on():
            return _double3(ctx, grad)
        traced = compiling()  # asked once: take's question, then the straight path's
        # first use of grad: NOTE [Gradient-buffer ownership] (ownership.take in one frame)
        owned = not traced and ownership.grant(grad, ownership.PROBE)
        (bits,) = ctx.saved_tensors
        lib = ctx.lib
        if (  # NOTE [Dropout's straight path]: the forward's C kernels
            lib is not None and type(grad) is _Tensor and not traced and not _dispatch_stack_len()
        ):
            g = grad
            if g.is_contiguous():
                out = g if owned else torch.empty_like(g)
            elif not owned:  # as the custom op _dropout_apply_mask: on a contiguous copy
                g = g.contiguous()
                out = torch.empty_like(g)
            else:
                g = None
            if g is not None:  # _c_bwd's C pass (g * m) * s into out, inline
                p = ctx.p
                key = (p, _F32, g.device)
                scale = _SCALES[key] if key in _SCALES else _scale(p, g)
                try:  # the bound C functions (_c_fns), an attribute once bound
                    fns = lib._slimgrad_fns
                except AttributeError:
                    fns = _c_fns(lib)
                fns["bwd"](g.data_ptr(), bits.data_ptr(), out.data_ptr(), ctx.n, scale, _nthreads())
                return out, None, None
        k = ctx.k
        if k is not _UNDECIDED and not owned and straight():  # the forward's choice (ctx.k)
            g = grad.contiguous()  # what the custom op _dropout_apply_mask runs on
            if k is not None and k.supports(g):
                return k._bwd_triton(g, bits, ctx.p, ctx.fused), None, None
            return _apply_mask_torch(g, bits, ctx.p, ctx.fused), None, None
        return _backward(grad, bits, ctx.p, ctx.fused, owned), None, None


_DROPOUT_APPLY = direct_apply(_DropoutFn)


class _DropoutInplaceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float):
        # One output only: autograd refuses a Function that modifies a view in place and returns
        # more than one tensor (torch.flatten(pool(x), 1) -> Dropout(inplace=True), adversarial
        # F6). bits is an intermediate saved for backward.
        bits = _dropout_fwd_(x, p)
        ctx.p, ctx.fused = p, False
        ctx.mark_dirty(x)
        ctx.save_for_backward(bits)
        return x

    @staticmethod
    @first_order("ops.dropout_", double=_double)
    def backward(ctx, grad):
        owned = ownership.take(grad) is not None  # first use: NOTE [Gradient-buffer ownership]
        (bits,) = ctx.saved_tensors
        return _backward(grad, bits, ctx.p, False, owned), None


# NOTE [Dropout traced under torch.compile]
# While Dynamo traces a CPU dropout, it is :class:`_DropoutTracedFn`: eager's CPU draw in a custom
# op of x (``slimgrad::dropout_noise``: ``empty_like(x).bernoulli_(1 - p)``), then eager's product
# and the bit packing written as torch ops, which AOTAutograd and inductor see through, and a
# backward of torch ops only: the unpacking and the product fuse into one inductor kernel, the
# packing into the forward's, with fewer Python calls and no opaque kernel for inductor to work
# around. The draw stays an op of x because a traced ``empty_like(x).bernoulli_`` depends on no
# value: inductor ran all of GPT-2's dropout draws first, before the attention's, so the masks were
# no longer the ones the uncompiled model draws at the same seed (first loss 6.259768 against
# 6.258730). As an op of x it runs where x is ready, as the former custom op did. What backward
# reads is what the custom ops' backward read: the packed mask, ceil(n / 8) bytes (eager's noise for
# a tensor too small to pack: NOTE [Dropout's mask temporaries]); the partitioner never recomputes a
# custom op's output and the packed bytes are the smallest forward value backward's unpacking reads,
# so that is what it keeps (``kept_bytes`` of benchmarks/compile_step.py,
# tests/test_compile_saved.py). Values: ``x * (noise / (1 - p))`` and ``where(m, dy * s, dy * 0)``
# are eager's forward and backward bit for bit (``s`` the noise's value, rounded as eager rounds
# it). The packing is eight shifted columns or-ed together (a uint8 multiply-sum, as ``pack_bits``
# traces, compiled to a scalar reduction that cost ~7x eager's whole dropout). CUDA keeps the custom
# ops under compile (its draw is ``native_dropout``'s, with its own mask).
def _pack_traced(keep: torch.Tensor) -> torch.Tensor:
    # pack_bits's layout (bit i % 8 of byte i // 8, padding 0), as eight shifted columns or-ed
    # together: one vectorized pass in inductor (NOTE [Dropout traced under torch.compile])
    flat = keep.reshape(-1).to(_U8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    cols = flat.view(-1, 8)
    out = cols[:, 0]
    for i in range(1, 8):
        out = out | (cols[:, i] << i)
    return out


def _unpack_traced(bits: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    sh = torch.arange(8, dtype=_U8, device=bits.device)
    m = torch.bitwise_right_shift(bits.unsqueeze(1), sh).bitwise_and(1)
    return m.reshape(-1)[:n].view(shape) != 0


@custom_op("dropout_noise", mutates_args=())
def _dropout_noise(x: torch.Tensor, p: float) -> torch.Tensor:
    # eager's CPU draw, as an op of x: NOTE [Dropout traced under torch.compile]
    return torch.empty_like(x).bernoulli_(1 - p)


@_dropout_noise.register_fake
def _(x, p):
    return torch.empty_like(x)


class _DropoutTracedFn(torch.autograd.Function):
    # only while Dynamo traces a CPU dropout (NOTE [Dropout traced under torch.compile])
    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float):
        # eager's CPU ops (_fwd_torch): the draw, then x * noise
        noise = _dropout_noise(x, p)
        ctx.p, ctx.packed = p, not _keeps_noise(x)
        if not ctx.packed:  # NOTE [Dropout's mask temporaries]: eager's noise kept
            noise = noise.div(1 - p)
            ctx.save_for_backward(noise)
            return x * noise
        ctx.save_for_backward(_pack_traced(noise != 0))
        return x * noise.div(1 - p)

    @staticmethod
    def backward(ctx, grad):
        (saved,) = ctx.saved_tensors
        if not ctx.packed:
            return grad * saved, None
        keep = _unpack_traced(saved, grad.shape)
        s = noise_scale(ctx.p, grad.dtype, grad.device)  # noise's kept value, rounded as eager
        return torch.where(keep, grad * s, grad * 0), None


def _check_p(api: str, p: float) -> None:
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(
            f"slimgrad.{api}: p must be a float; expected a number in [0, 1], got "
            f"{type(p).__name__}. Pass e.g. p=0.1."
        )
    if not 0.0 <= p <= 1.0:
        raise ValueError(
            f"slimgrad.{api}: dropout probability out of range; expected 0 <= p <= 1, "
            f"got {p}. Pass a probability such as p=0.1."
        )


def _dropout_train(input: torch.Tensor, p: float, inplace: bool = False) -> torch.Tensor:
    # Training-mode dropout for 0 < p < 1 on a non-empty tensor.
    if torch.is_grad_enabled() and input.requires_grad:
        refuse_jit("ops.dropout")
    if compiling():
        if input.device.type == "cpu":  # NOTE [Dropout traced under torch.compile]
            out = _DropoutTracedFn.apply(input, float(p))
            # NOTE [In-place Functions under torch.compile] in slimgrad/_autograd.py: in place,
            # the out-of-place result written back with copy_ (eager's in-place draw is the same)
            return input.copy_(out) if inplace else out
        if inplace:  # the in-place Function on a copy, written back with copy_ (same NOTE)
            return input.copy_(_DropoutInplaceFn.apply(input.clone(), float(p)))
        return _DropoutFn.apply(input, float(p))  # Dynamo traces Function.apply
    if inplace:
        return _DropoutInplaceFn.apply(input, float(p))
    # NOTE [Applying a Function without its Python wrapper] in slimgrad/_autograd.py (the caller,
    # dropout(), has already taken eager's op under torch.func transforms)
    return _DROPOUT_APPLY(unwrap_if_dead(input), float(p))


def dropout(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    """Dropout with a 1-bit mask kept for backward; same values and gradients as ``F.dropout``.

    ``y = x * m / (1 - p)``, ``m ~ Bernoulli(1 - p)`` from the device's global generator (see
    NOTE [Dropout masks: drawn like eager, kept as bits]).

    Memory: saves 1/8 B/elt (the packed mask); eager saves 4 B/elt (fp32, CPU) or 1 B/elt (CUDA).

    Args:
        input: any tensor.
        p: probability of an element being zeroed, in [0, 1].
        training: apply dropout if True; otherwise return ``input``.
        inplace: write the result into ``input``.

    Returns:
        The dropped tensor (``input`` itself when ``p == 0``, ``training`` is False or it is empty).

    Raises:
        ValueError: ``p`` outside [0, 1].
        TypeError: ``p`` not a number.

    Example:
        >>> y = dropout(torch.randn(4, 8, requires_grad=True), p=0.1)
    """
    if (  # the straight path: NOTE [One gate per call] in slimgrad/_library.py
        type(p) is float
        and 0.0 < p < 1.0
        and training
        and not inplace
        and type(input) in _PLAIN
        and not input.is_meta
        and straight()
        and 0 not in input.shape
    ):
        return _DROPOUT_APPLY(unwrap_if_dead(input), p, True)
    _dtensor.refuse("slimgrad.ops.dropout", input=input)
    if type(p) is not float or not 0.0 <= p <= 1.0:  # a float in range passes _check_p
        _check_p("ops.dropout", p)
    if transforms_active():  # NOTE [torch.func transforms] in slimgrad/_autograd.py
        return torch.nn.functional.dropout(input, p, training, inplace)
    try:
        if p == 0 or not training or input.numel() == 0:
            return input
    except FxTraceError:  # NOTE [fx symbolic tracing of a converted model]
        return torch.nn.functional.dropout(input, p, training, inplace)
    if p == 1:
        zero = input.new_zeros(())
        return input.mul_(zero) if inplace else input * zero
    return _dropout_train(input, p, inplace)


def dropout_(input: torch.Tensor, p: float = 0.5, training: bool = True) -> torch.Tensor:
    """In-place :func:`dropout` (``F.dropout(..., inplace=True)``). Memory: 1/8 B/elt."""
    return dropout(input, p, training, inplace=True)
