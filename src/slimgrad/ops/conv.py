"""Convolutions (1d/2d/3d, transposed) that keep only what the requested gradients need.

Math: y = conv(x, W) + bias. dx = conv_transpose(dy, W) needs W only; dW = corr(x, dy) needs x only;
dbias = Σ dy needs nothing. So: a frozen W (no grad) → x is not kept; an x that needs no grad → W is
not needed (and since W is a Parameter, keeping it costs nothing anyway). When x is the output of a
slimgrad activation applied to a slimgrad norm output b (NOTE [Derived saved inputs] in
``ops/_derived.py``), the conv keeps b (kept by the norm already) and recomputes x = act(b) in
backward, bit for bit.

Memory: keeps x (4 B/elt fp32) only if W needs grad, and then b instead of x when x is derived (0
extra bytes: b is kept by the norm), or under saved-tensor hooks (as eager: NOTE [A stand-in for
x]); eager keeps x and W always (pytorch/pytorch#133566).
"""

from __future__ import annotations

from functools import partial as _partial
from weakref import ref as _weakref

import torch

from slimgrad import _dtensor, _library
from slimgrad._autograd import (
    FxProxy,
    direct_apply,
    refuse_jit,
    unwrap_if_dead,
)
from slimgrad._autograd import (
    compiling as _compiling,
)
from slimgrad.ops import _derived
from slimgrad.ops.layer_norm import _ANCHOR_APPLY, bridged
from slimgrad.ops.linear import _FakeTensor

__all__ = [
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
]


# aten::convolution through its torch binding, and convolution_backward through its overload: the
# same aten ops as ``torch.ops.aten.<op>(...)``, without the packet's Python overload resolution
# (a tenth of a small conv's time on CPU: docs/measurements.md).
_CONV_BWD = torch.ops.aten.convolution_backward.default


def _fwd_torch(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    return torch.convolution(
        x, weight, bias, stride, padding, dilation, transposed, output_padding, groups
    )


def _bwd_torch(
    grad, x, weight, bias_sizes, stride, padding, dilation, transposed, opad, groups, mask
):
    return _CONV_BWD(
        grad, x, weight, bias_sizes, stride, padding, dilation, transposed, opad, groups, mask
    )


class _ConvFn(torch.autograd.Function):
    _slimgrad_floor = True  # keeps conv inputs (NOTE [The matmul-input floor] in memory.py)

    @staticmethod
    def forward(
        ctx, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups, holder
    ):
        # _fwd_torch, without its frame
        y = torch.convolution(
            x, weight, bias, stride, padding, dilation, transposed, output_padding, groups
        )
        need_x, need_w, _ = ctx.needs_input_grad[:3]
        ctx.conf = (stride, padding, dilation, transposed, output_padding, groups)
        # x's strides only where no x is kept (NOTE [A stand-in for x])
        ctx.x_meta = (x.shape, x.dtype, x.device, None if need_w else x.stride())
        # (W's strides only for a batch of 0, the one backward that reads them)
        ctx.w_meta = (weight.shape, weight.dtype, weight.stride() if 0 in x.shape else None)
        ctx.bias_sizes = None if bias is None else list(bias.shape)
        ctx.act = ctx.rebuild = ctx.pack = ctx.x_storage = ctx.recipe_key = None
        # set by a BatchNorm that keeps its output (NOTE [A conv bias gradient after dx from the
        # output] in ops/batch_norm.py): the bias gradient summed in float64 here
        ctx.bias_f64 = False
        ctx.base_stands_in = False
        kept_x = hooked_x = None
        if need_w:
            d = holder[0]  # _derived.lookup(x), made by _conv (need_w: W requires grad)
            if d is not None:
                ctx.act, kept_x = d.act, d.base
                ctx.rebuild = d.consumer()  # NOTE [Rebuilt once per backward]
                ctx.base_stands_in = _stands_in(kept_x, x)  # NOTE [A stand-in for x]
                # b's one pack under saved-tensor hooks, read in backward (NOTE [One pack per
                # shared tensor] in ops/_derived.py)
                ctx.pack = None if d.pack is None else _derived.shared(d.pack)
            else:
                kept_x = x
        elif need_x:
            # NOTE [A stand-in for x]: a weak reference to x's storage, or x itself as eager
            # keeps it (under saved-tensor hooks), as _conv decided
            weak = holder[-1]
            if weak is True:
                ctx.x_storage = (_weakref(x.untyped_storage()), x.storage_offset())
            elif weak is False:
                hooked_x = x
        if ctx.pack is None:
            ctx.save_for_backward(
                kept_x if hooked_x is None else hooked_x, weight if need_x else None
            )
        else:
            ctx.pack[1].users += 1
            ctx.save_for_backward(None, weight if need_x else None)
        # holder[0] becomes what this call keeps (the caller registers y's recipe from it), or None
        holder[0] = None if kept_x is None else (kept_x, ctx.act, ctx.rebuild, ctx.pack)
        return y

    @staticmethod
    def _double(ctx, grad):
        # aten.convolution_backward is differentiable (eager's double backward formula); the kept
        # tensors come back with their graphs. A derived x = act(b) (b kept as a detached alias)
        # is recomputed and bridged to x's anchor (NOTE [Second derivatives of an op that keeps
        # its output] in ops/layer_norm.py), so second derivatives are eager's.
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        try:
            kept_x, weight = ctx.saved_tensors
        except RuntimeError as e:  # NOTE [A kept tensor written after forward] in ops/_derived.py
            if ctx.act is not None:
                _derived.raise_written(e, "ops.conv")
            raise
        if ctx.pack is not None:  # NOTE [One pack per shared tensor] in ops/_derived.py
            kept_x = _derived.read_pack(ctx.pack, "batch_norm output")
            ctx.pack = _derived.release_pack(ctx.pack)
        shape, dtype, device, _ = ctx.x_meta
        x = _blank(shape, dtype, device)
        if weight is None:
            wshape, wdtype, _ = ctx.w_meta
            weight = _blank(wshape, wdtype, device)
        with torch.enable_grad():
            if kept_x is not None and ctx.act is not None:
                with torch.no_grad():
                    x = _derived.apply_act(ctx.act, kept_x)
                if getattr(ctx, "_slimgrad_anchor", None) is not None:
                    x = bridged(ctx, "ops.conv", x)
            elif kept_x is not None:
                x = kept_x
            gx, gw, gb = _bwd_torch(
                grad, x, weight, ctx.bias_sizes, *ctx.conf, [need_x, need_w, need_b]
            )
        return gx, gw, gb, None, None, None, None, None, None, None

    @staticmethod
    def backward(ctx, grad):
        # first_order's test, inline (NOTE [First order, tested inline])
        if torch.is_grad_enabled():
            return _ConvFn._double(ctx, grad)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        try:
            kept_x, weight = ctx.saved_tensors
        except RuntimeError as e:  # NOTE [A kept tensor written after forward] in ops/_derived.py
            if ctx.act is not None:
                _derived.raise_written(e, "ops.conv")
            raise
        if ctx.pack is not None:  # NOTE [One pack per shared tensor] in ops/_derived.py
            kept_x = _derived.read_pack(ctx.pack, "batch_norm output")
            ctx.pack = _derived.release_pack(ctx.pack)
        if ctx.recipe_key is not None:  # NOTE [A recipe dropped at its conv's backward]
            k, ref = ctx.recipe_key  # deleted only where it is still y's own
            if k in _RECIPES_D and _RECIPES_D[k][0] is ref:
                del _RECIPES_D[k]
            ctx.recipe_key = None
        shape, dtype, device, xstride = ctx.x_meta
        if (
            weight is None
            and not need_x
            and 0 in shape
            and not torch.compiler.is_compiling()  # (Dynamo cannot trace the storage's size)
        ):
            # a batch of 0: the sums over no element are zeros, as convolution_backward's, made
            # here in W's layout as eager's are (through a fresh empty gradient, a ReLU's or a
            # BatchNorm's, W's stand-in has no element to view: 4 fresh bytes above eager's peak;
            # and the backend, asked with a stand-in W and an x of no element, gave a contiguous
            # dW for a channels_last W, copied into W's layout when accumulated: one more W at
            # the peak)
            wshape, wdtype, wstride = ctx.w_meta
            gw = None
            if need_w:
                gw = torch.empty_strided(
                    wshape, _dense_strides(wshape, wstride), dtype=wdtype, device=device
                ).zero_()
            gb = torch.zeros(ctx.bias_sizes, dtype=wdtype, device=device) if need_b else None
            return None, gw, gb, None, None, None, None, None, None, None
        gb64 = None
        if need_b and ctx.bias_f64:
            # NOTE [A conv bias gradient after dx from the output] in ops/batch_norm.py: summed
            # in float64 and rounded once, before dW and dx exist (its float64 temporary then
            # lies below this backward's peak), and not asked of convolution_backward: the
            # bias's bytes at the peak, as eager's one call
            red = [d for d in range(grad.dim()) if d != 1]
            gb64 = grad.sum(red, dtype=torch.float64).to(grad.dtype)
            need_b = False
        # Only the shape of x is read when dW is not requested, and only W's shape when dx is not:
        # stand-ins that allocate nothing (a 0-d view of grad, expanded) where the dtype allows.
        if weight is None:
            wshape, wdtype, _ = ctx.w_meta
            weight = _shape_only(grad, wshape, wdtype, device)
        if ctx.act is not None and need_w:
            # x = act(b) is rebuilt for dW only (or taken from this backward's store: NOTE [Rebuilt
            # once per backward]) and let go before dx is allocated, so the recompute adds no
            # full-size buffer to the backward peak.
            # The bias gradient is asked of this call, not of the dx call (NOTE [The bias gradient
            # with dW]).
            x = ctx.rebuild(kept_x)[0]
            if type(ctx.act) is tuple and ctx.act[0] == "gate" and _no_second_backward():
                # NOTE [A gate let go at its conv's backward]
                ctx.act = ctx.rebuild = None
            _, gw, gb = _bwd_torch(
                grad, x, weight, ctx.bias_sizes, *ctx.conf, [False, True, need_b]
            )
            del x
            gx = None
            if need_x:
                # NOTE [A stand-in for x]
                fake_x = kept_x if ctx.base_stands_in else _shape_only(grad, shape, dtype, device)
                gx, _, _ = _bwd_torch(grad, fake_x, weight, None, *ctx.conf, [True, False, False])
        else:
            if kept_x is not None:
                x = kept_x
            elif grad.shape == shape and grad.dtype == dtype and grad.stride() == xstride:
                x = grad  # NOTE [A stand-in for x]: x's own layout, so dx gets eager's
            elif need_x:  # NOTE [A stand-in for x]: x's live storage, or an empty buffer
                x = _in_layout(ctx.x_storage, shape, dtype, device, xstride)
            else:
                x = _shape_only(grad, shape, dtype, device)
            gx, gw, gb = _bwd_torch(
                grad, x, weight, ctx.bias_sizes, *ctx.conf, [need_x, need_w, need_b]
            )
        if gb64 is not None:
            gb = gb64
        return gx, gw, gb, None, None, None, None, None, None, None


# NOTE [A gate let go at its conv's backward]
# A conv whose x is a squeeze-excite output y = act(b) * g (NOTE [Gated derived tensors] in
# ops/_derived.py) holds g through its activation spec, a ctx attribute that autograd does not
# release with the saved tensors: g (N*C elements) lived until the graph was freed, where eager's
# g dies at the gate's backward (the next ops' dW and dx were allocated beside it: timm SEModule
# between two 64-channel convs at 2x64x8x8 float32, peak +512 B). Once x is rebuilt for dW and no
# second backward can come (the graph task does not keep the graph: torch's private
# ``_get_current_graph_task_keep_graph``; without it the spec is kept, as before), the conv lets
# the spec go.


def _no_second_backward() -> bool:
    return _keep_graph is not None and not _keep_graph()


# NOTE [A conv that keeps what eager keeps]
# When x and W both need grad and x is not a derived tensor (NOTE [Derived saved inputs]), the
# Function would keep x and W (W only for dx) and run one convolution_backward with eager's mask:
# exactly eager's node (``ConvolutionBackward0`` keeps x and W; a Parameter W costs no bytes). So
# that call records eager's own node (``torch.convolution`` under grad mode, as F.conv{n}d and
# F.conv_transpose{n}d do), with eager's double backward and its per-backward output mask, and
# only the recipe of y (NOTE [Recomputable inputs]) is added: the same values, the same saved
# bytes, without the Python Function's cost per call (most of a small conv's time on CPU:
# docs/measurements.md). Under autocast (the cast is slimgrad's; eager keeps
# the cast copies) and while Dynamo traces, the Function runs as before.


# NOTE [The bias gradient with dW]
# Where x = act(b) is rebuilt, the backward makes two convolution_backward calls where eager makes
# one: dW (with the rebuilt x) and dx (with a stand-in for x). The bias gradient is asked of the dW
# call. CPU's oneDNN backward computes the weight and bias gradients in one primitive, so a call
# that asks the bias gradient returns a weight gradient too, asked for or not (NOTE [Fake tensors
# model the CPU conv backward's outputs] in memory.py). Asked of the dx call, it made a second
# weight-sized tensor, alive with dW and dx at that call: a peak one weight above eager's where a
# conv's weight is large against its activations (Conv-BN-ReLU x3, 3x3 convs of 128 channels at
# 2x3x8x8: 1,975,344 B against eager's 1,451,056, 1.36x; timm vgg11_bn at 2x3x64x64 1.005x). Asked
# of the dW call it costs the bias's bytes, as in eager's one call, and it is computed as eager's
# is: by the same primitive from the same x, dy and weight (before, from the stand-in for x). The
# dx call asks dx alone, and is not made where dx is not wanted.


# NOTE [A stand-in for x]
# convolution_backward reads only the shape (and the memory format) of an input whose gradient it
# does not compute, but it first makes that input contiguous in the backend's memory format: an
# expanded 0-d stand-in (``_shape_only``) is copied into a full-size buffer there (a write of
# x's size and a transient of x's bytes at the conv's dx). Where x = act(b) was rebuilt for dW,
# the kept b has x's shape, dtype and strides: it stands in for x in the dx call (nothing is
# allocated or copied, and the backend picks the memory format eager picks for x). So does the
# incoming gradient where it has x's shape, dtype and strides (a stride-1 conv with as many
# output as input channels): the expanded stand-in has no layout, so the backend gave dx the
# contiguous format where eager's dx of a channels_last x is channels_last, and the next op's
# backward copied it into x's layout (GroupNorm(1, 4) before a frozen 1x1 conv, channels_last
# (1, 4, 2, 2): peak 304 B against eager's 272). The values are never read, so dx has the same
# bits either way. Where neither can stand in (the conv changes channels or size) and dx is
# wanted, an empty buffer with x's strides does (``torch.empty_strided``, where those strides are
# dense): the backend copies nothing and picks eager's memory format, so dx comes back in eager's
# layout with eager's bits. Before, a channels_last x got a contiguous dx, and a 3x3 conv from 4
# to 8 channels on (2, 4, 5, 7) channels_last float32 gave other bits than eager's (the backend's
# contiguous algorithm). The buffer costs x's bytes during that call, which the expanded stand-in
# cost too, as a copy inside convolution_backward that the tracker does not see: the profiler's
# allocations in that call, 3x3 conv 8 -> 16 channels on (4, 8, 32, 32) channels_last, were
# 393,216 B of copies (stand-in and grad) and are now 4,608 B (the weight in channels_last) + the
# 131,072 B buffer; on a contiguous x the 131,072 B copy became the 131,072 B buffer. A non-dense
# x (a slice) gets a dense buffer in the memory format eager's backend copies x into
# (``_dense_strides``).
# Where x's storage is still alive at backward, though, the buffer is x's bytes above eager's
# (eager keeps x, and the storage is x's): a leaf x (its AccumulateGrad node holds it), the
# output of an op that keeps its output (a ReLU's, a sigmoid's), a tensor the caller holds. A
# frozen Conv2d(3, 5, 3) on a leaf (2, 3, 6, 6) peaked 2,296 B against eager's 1,432. So the
# Function keeps a weak reference to x's storage (``untyped_storage()``: a ReLU keeps its output
# as a new tensor on x's storage, so a reference to the tensor x dies with x while the storage
# lives), with x's offset, and at backward a view with x's offset, shape and strides on that
# storage stands in (``_in_layout``): x itself as the backend sees it (eager's memory format,
# eager's copy for a non-dense x), allocating nothing. Its values are never read, so neither x's
# version nor what was written over the storage since forward matters; only its size does (a
# storage resized since holds fewer bytes: the buffer). Where the storage is gone, nobody kept x:
# the buffer is x's bytes where eager still held x, never above eager's peak. Under saved-tensor
# hooks x is kept through save_for_backward instead, as eager keeps it, so the hooks treat it as
# eager's: checkpoint lets the forward's storage go and its recompute makes a new x, held until
# the conv's backward by whatever else kept it (relu(a) before a frozen Conv2d(16, 2, 3,
# stride=2), a (2, 16, 9, 9), inside the region: a buffer beside it peaked 42,896 B against
# eager's 41,488; the kept x, 41,488). Except where x is this call's own autocast copy, which
# nobody else sees: then the weak reference (eager keeps that copy from forward, or from the
# recompute, to its backward). While Dynamo traces, the buffer, as before.


def _dense_strides(shape, stride):
    # x's strides where they are those of a non-overlapping, dense tensor (contiguous,
    # channels_last, any order of dims: a buffer of them holds numel elements); else the dense
    # strides of the memory format PyTorch suggests for x (empty_like's preserve rule, asked of a
    # meta tensor: no bytes), the format convolution_backward would copy x into
    expected = 1
    for st, sz in sorted((st, sz) for st, sz in zip(stride, shape) if sz != 1):
        if st != expected:
            return torch.empty_like(torch.empty_strided(shape, stride, device="meta")).stride()
        expected *= sz
    return stride


def _in_layout(kept, shape, dtype, device, stride):
    # a tensor of ``shape`` whose values are never read (NOTE [A stand-in for x]): x itself (a view
    # of x's storage with x's offset and strides) where that storage is still alive and still
    # holds x's elements, else an empty buffer in x's dense layout
    s = None if kept is None else kept[0]()
    if s is not None:
        offset = kept[1]
        end = 0 if 0 in shape else offset + 1 + sum((n - 1) * st for n, st in zip(shape, stride))
        if s.nbytes() >= end * dtype.itemsize:
            return torch.empty((0,), dtype=dtype, device=device).set_(s, offset, shape, stride)
    return torch.empty_strided(shape, _dense_strides(shape, stride), dtype=dtype, device=device)


def _stands_in(b: torch.Tensor, x: torch.Tensor) -> bool:
    # b (x = act(b), or act(b) * g) may stand in for x in a dx-only convolution_backward
    return b.shape == x.shape and b.dtype == x.dtype and b.stride() == x.stride()


def _shape_only(grad: torch.Tensor, shape, dtype: torch.dtype, device) -> torch.Tensor:
    # A tensor of ``shape`` whose values are never read (convolution_backward reads only the shape
    # of an input whose gradient it does not compute): a 0-d view of grad's first element,
    # expanded, so no byte is allocated here (but see NOTE [A stand-in for x]: the conv's dx copies
    # it); a fresh 0-d tensor when grad's dtype or device differs.
    if (
        grad.dtype == dtype
        and grad.device == torch.device(device)
        and not torch.compiler.is_compiling()  # Dynamo cannot trace storage_offset()
        # an empty grad (a batch of 0) may still view a stored element: the loss's expanded 1
        and (grad.numel() > 0 or _holds_an_element(grad))
    ):
        return grad.as_strided((), (), grad.storage_offset()).expand(shape)
    return _blank(shape, dtype, device)


def _holds_an_element(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() >= (t.storage_offset() + 1) * t.element_size()


def _blank(shape, dtype: torch.dtype, device) -> torch.Tensor:
    # values never read: a fresh 0-d tensor, expanded (4 bytes for any shape), or for an empty
    # shape an empty tensor (0 bytes, as eager's own empty x: a batch of 0 peaks as eager does)
    if 0 in shape:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.empty((), dtype=dtype, device=device).expand(shape)


def _tuple(v, n: int, name: str, api: str) -> list[int]:
    if isinstance(v, int):
        return [v] * n
    v = list(v)
    if len(v) == 1:
        return v * n
    if len(v) != n or not all(isinstance(i, int) for i in v):
        raise RuntimeError(
            f"slimgrad.ops.{api}: {name} must be an int or {n} ints; expected length {n}, got "
            f"{v!r}. Pass {name}=k or a tuple of {n} ints."
        )
    return v


def _autocast_cast(t, dt):
    # autocast's rule for a lower-precision op: floating tensors other than float64 go to dt.
    if t is None or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(dt)


# NOTE [Conv arguments, normalised once per module]
# stride, padding, dilation and output_padding are normalised to lists of n ints (``_tuple``,
# 'valid'/'same') on every functional call, as torch does. A slimgrad nn module passes a ``slot``
# (a one-element list it owns): the first call stores its argument objects and their normalised
# lists there, and later calls that pass the *same objects* (``is``; a module's tuples are
# immutable, and reassigning ``m.stride`` gives a new object) reuse the lists. Checks run in the
# same order with the same messages (the weight checks come first on every call, and a call that
# raises stores nothing); string padding is never stored ('same' depends on the weight's shape
# and pads x). The stored lists are read only (aten, ctx.conf, the recipe), never written.


def _args(api, n, x, weight, stride, padding, dilation, transposed, output_padding, slot):
    # -> (x, stride, padding, dilation, output_padding), normalised (NOTE [Conv arguments,
    # normalised once per module])
    c = slot[0] if slot is not None else None
    if (
        c is not None
        and c[0] is stride
        and c[1] is padding
        and c[2] is dilation
        and c[3] is output_padding
    ):
        return (x, *c[4])
    key = (stride, padding, dilation, output_padding)
    stride = _tuple(stride, n, "stride", api)
    dilation = _tuple(dilation, n, "dilation", api)
    output_padding = _tuple(output_padding, n, "output_padding", api)
    if isinstance(padding, str):
        if transposed:
            raise TypeError(
                f"slimgrad.ops.{api}: string padding is not supported for transposed convolutions; "
                f"expected ints, got {padding!r}. Pass padding as ints."
            )
        if padding == "valid":
            padding = [0] * n
        elif padding == "same":
            if any(s != 1 for s in stride):
                raise RuntimeError(
                    f"slimgrad.ops.{api}: padding='same' needs stride 1; expected stride 1, got "
                    f"{stride}. Use explicit padding."
                )
            pads = []
            extra = []
            for d, k in zip(dilation, weight.shape[2:]):
                total = d * (k - 1)
                pads.append(total // 2)
                extra.append(total - 2 * (total // 2))
            if any(extra):
                # As torch: pad the input's right side by the odd remainder.
                pad_arg = []
                for e in reversed(extra):
                    pad_arg += [0, e]
                x = torch.nn.functional.pad(x, pad_arg)
            padding = pads
        else:
            raise RuntimeError(
                f"slimgrad.ops.{api}: unknown padding string; expected 'valid' or 'same', got "
                f"{padding!r}. Use one of those or ints."
            )
        return x, stride, padding, dilation, output_padding
    padding = _tuple(padding, n, "padding", api)
    if slot is not None:
        slot[0] = (*key, (stride, padding, dilation, output_padding))
    return x, stride, padding, dilation, output_padding


# per api: its public name in errors (``slimgrad.ops.<api>``) and refuse_jit's (``ops.<api>``)
_NAMES = {
    f"conv{t}{n}d": (f"slimgrad.ops.conv{t}{n}d", f"ops.conv{t}{n}d")
    for t in ("", "_transpose")
    for n in (1, 2, 3)
}
# NOTE [Applying a Function without its Python wrapper] in slimgrad/_autograd.py
_CONV_APPLY = direct_apply(_ConvFn)
_CONV_NODE = _ConvFn._backward_cls  # the Function's node (its ctx)
# Types whose instances are plain tensors (no DTensor, no subclass): checked without a call
_PLAIN = (torch.Tensor, torch.nn.Parameter)
# whose storage a weak reference can follow (NOTE [A stand-in for x]): the estimate's fake tensors
# too, so the estimate keeps what the real step keeps
_STORAGE_FOLLOWED = (torch.Tensor, torch.nn.Parameter, _FakeTensor)
# The C tests of transforms_active, refuse_jit and torch.compiler.is_compiling (the latter itself:
# Dynamo folds it by identity): one call each on the hot path, not two or three
_transforms_active = torch._C._are_functorch_transforms_active
_jit_tracing = torch._C._is_tracing
_DERIVED_D = _derived._DERIVED_D
_RECIPES_D = _derived._RECIPES_D
_top_hooks = _derived._top_hooks
# private, guarded (_compat's keep_graph feature): None turns NOTE [A gate let go at its conv's
# backward] off
_keep_graph = _derived._keep_graph
_CLOCK = _derived._CLOCK
_Recipe = _derived.Recipe
_NodeRecipe = _derived.NodeRecipe
# eager's convolution node, by the name PyTorch's derivatives give it (its saved input is
# ``_saved_input``: NOTE [A recipe that reads x from eager's conv node] in ops/_derived.py)
_EAGER_CONV_NODE = "ConvolutionBackward0"


# NOTE [A conv bias gradient after dx from the output] in ops/batch_norm.py: the biases whose
# conv's output a float32 BatchNorm kept its output for at the conv's last call, as id(bias) ->
# a weak reference to it, where convert_ did not mark the conv module from the model's structure
# (``slimgrad.nn.conv.mark_bias_before_batch_norm_``: a functional call, a parent's own forward).
# Eager's node computes the float32 bias gradient with dW and dx, and the BatchNorm's post hook
# then summed it again in float64: its temporaries (C values in float64 and their rounded copy)
# live with dW and dx, 3 x 4 B per channel above eager's peak. Such a conv's next calls take the
# Function, which sums the bias gradient in float64 before convolution_backward and asks it
# nothing more: the same bits, and the bias's bytes at the peak as in eager's call. A marked
# module's calls take it from the first step (``bias_f64``).
_BIAS_F64: dict = {}
_REAL_OF: dict | None = None  # slimgrad.memory's stand-in -> real map (read under estimate)


def sum_bias_in_f64(bias: torch.Tensor) -> None:
    # batch_norm's claim on an eager conv node whose bias needs a gradient (its AccumulateGrad's
    # variable); a stand-in of the estimate marks the real Parameter behind it too
    global _REAL_OF
    if _REAL_OF is None:
        from slimgrad.memory import _REAL_OF as real

        _REAL_OF = real
    for t in (bias, _real_of(bias)):
        if t is not None and not _bias_f64(t):
            k = id(t)
            _BIAS_F64[k] = _weakref(t, lambda r, k=k: _BIAS_F64.pop(k, None))


def _real_of(t: torch.Tensor) -> torch.Tensor | None:
    e = _REAL_OF.get(id(t)) if _REAL_OF else None
    return e[1] if e is not None and e[0] is t else None


def _bias_f64(bias: torch.Tensor) -> bool:
    e = _BIAS_F64.get(id(bias))
    if e is not None and e() is bias:
        return True
    r = _real_of(bias)  # an estimate's stand-in: its real Parameter's mark
    return r is not None and _bias_f64(r)


# NOTE [Two watchers in one call]
# A call that needs a graph asks whether a torch.func transform is active
# (``torch._C._are_functorch_transforms_active``) and whether TorchScript traces
# (``torch._C._is_tracing``). Once slimgrad's C++ extension is loaded, its ``watchers()`` (NOTE
# [One-call gate] in slimgrad/_library.py) returns both facts, bits 4 and 8 of one mask, from the
# same C++ calls those bindings make: one call instead of two. Asked only where nothing compiles
# (a module's call with its argument slot; a BatchNorm call after its compile test): Dynamo would
# not fold the extension's function. Without the extension the two bindings are asked.


def _apply_fn(compiling: bool, args: tuple, holder: list, x=None) -> torch.Tensor:
    # x: args[0] passed through unwrap_if_dead already (the caller's anchor), or None
    if compiling:  # Dynamo traces Function.apply
        return _ConvFn.apply(*args, holder)
    weight, bias = args[1], args[2]
    # the C apply (NOTE [Applying a Function without its Python wrapper]): not compiling, and no
    # transform is active (the caller took eager's op then)
    return _CONV_APPLY(
        unwrap_if_dead(args[0]) if x is None else x,
        unwrap_if_dead(weight),
        None if bias is None else unwrap_if_dead(bias),
        *args[3:],
        holder,
    )


def _conv(
    api,
    n,
    x,
    weight,
    bias,
    stride,
    padding,
    dilation,
    groups,
    transposed,
    output_padding,
    slot=None,
    bias_f64=False,
):
    # bias_f64: the module's structure mark (NOTE [A conv bias gradient after dx from the output]
    # in ops/batch_norm.py): a BatchNorm takes this conv's output
    public, jit_name = _NAMES[api]
    # plain tensors (the common case, read by type alone: no call) are neither DTensors nor
    # anything but tensors; anything else takes the full checks
    if not (
        type(x) in _PLAIN and type(weight) in _PLAIN and (bias is None or type(bias) in _PLAIN)
    ):
        _dtensor.refuse(public, input=x, weight=weight, bias=bias)
        if isinstance(x, FxProxy):  # NOTE [fx symbolic tracing of a converted model]
            f = getattr(torch.nn.functional, api)
            if transposed:
                return f(x, weight, bias, stride, padding, output_padding, groups, dilation)
            return f(x, weight, bias, stride, padding, dilation, groups)
        if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
            raise TypeError(
                f"slimgrad.ops.{api}: input and weight must be tensors; expected torch.Tensor, "
                f"got {type(x).__name__} and {type(weight).__name__}. Pass tensors."
            )
    if weight.ndim != n + 2:  # eager's check (the 'same' padding below reads weight's dims)
        raise RuntimeError(
            f"slimgrad.ops.{api}: Expected {n + 2}-dimensional weight for {api}; expected "
            f"(C_out, C_in / groups, {n} kernel dims), got weight of size {list(weight.shape)}. "
            "Pass a weight with the kernel's spatial dims."
        )
    c = slot[0] if slot is not None else None
    if (
        c is not None
        and c[0] is stride
        and c[1] is padding
        and c[2] is dilation
        and c[3] is output_padding
    ):  # _args' first test, inline (NOTE [Conv arguments, normalised once per module])
        stride, padding, dilation, output_padding = c[4]
    else:
        x, stride, padding, dilation, output_padding = _args(
            api, n, x, weight, stride, padding, dilation, transposed, output_padding, slot
        )
    xdim = x.ndim
    if xdim == n + 1:
        # Unbatched input, as torch: add and remove a batch dim.
        return _conv(
            api,
            n,
            x.unsqueeze(0),
            weight,
            bias,
            stride,
            padding,
            dilation,
            groups,
            transposed,
            output_padding,
        ).squeeze(0)
    if xdim != n + 2:
        raise RuntimeError(
            f"slimgrad.ops.{api}: input must be {n + 1}-D (unbatched) or {n + 2}-D (batched); "
            f"expected {n + 2} dims, got shape {tuple(x.shape)}. Reshape the input."
        )
    # torch._C._is_any_autocast_enabled(): False means autocast is off for every device type,
    # so the per-device query (and x.device) is read only under some autocast. Meta has no
    # autocast: eager's ops on meta are not cast (NOTE [Meta tensors take eager's op] in
    # slimgrad/_autograd.py)
    any_autocast = torch._C._is_any_autocast_enabled() and not x.is_meta
    if (
        bias is not None
        and bias.dtype != x.dtype
        and not (any_autocast and torch.is_autocast_enabled(x.device.type))
    ):
        # aten.convolution does not check this (it dropped a float bias on an integer input).
        raise RuntimeError(
            f"slimgrad.ops.{api}: input and bias types differ; expected the same dtype, got "
            f"input {x.dtype} and bias {bias.dtype}. Cast the bias (or the input) to one dtype."
        )
    needs_graph = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    dev = x.device.type if any_autocast else None
    autocast = any_autocast and torch.is_autocast_enabled(dev)
    w0, b0, x0, dt = weight, bias, x, None
    if autocast:
        # autocast casts eager's aten::conv{n}d / conv_transpose{n}d, not the aten::convolution
        # that both paths below call, so its cast is applied here, for the graph and the no-graph
        # path alike.
        dt = torch.get_autocast_dtype(dev)
        # NOTE [Autocast casts in eager's order]: eager's autocast casts bias, then weight, then
        # input (their ToCopyBackward nodes get rising sequence numbers, so backward runs the
        # input's cast first and the bias's last). Casting in another order changes which grad is
        # cast back to float32 first: the bias's fp32 grad, made before the weight's, sat on
        # timm's ViT-RoPE bf16 patch-embedding peak, 768 B above eager's
        # (tests/test_fx_jit_refusals.py::test_autocast_conv_casts_in_eagers_order).
        bias = _autocast_cast(bias, dt)
        weight = _autocast_cast(weight, dt)
        x = _autocast_cast(x, dt)
    # NOTE [Two watchers in one call]: a module's call (its slot: not compiling) with a graph
    w = _library._watchers if slot is not None and needs_graph else None
    mask = w() if w is not None else None
    # NOTE [torch.func transforms] in _autograd.py
    if not needs_graph or (_transforms_active() if mask is None else mask & 4):
        if not autocast:
            return _fwd_torch(
                x, weight, bias, stride, padding, dilation, transposed, output_padding, groups
            )
        with torch.autocast(dev, enabled=False):
            return _fwd_torch(
                x, weight, bias, stride, padding, dilation, transposed, output_padding, groups
            )
    # a module's argument slot is None while Dynamo traces (nn/conv.py's _slot): no second test
    compiling = False if slot is not None else _compiling()
    if not compiling and (_jit_tracing() if mask is None else mask & 8):
        refuse_jit(jit_name)
    # a derived input is kept as its norm's output: anchor x for a second derivative
    d = None
    if weight.requires_grad and not compiling and _DERIVED_D:
        k = id(x)
        if k in _DERIVED_D:  # _derived._lookup(x), inline (most inputs miss)
            e = _DERIVED_D[k]
            d = e[1]
            act = d.act
            if not (
                e[0]() is x
                and x._version == d.version
                and d.base._version == d.base_version
                and (type(act) is not tuple or act[0] != "gate" or act[2]._version == act[3])
                # _derived.in_region(d), inline: NOTE [A lookup across a checkpoint boundary]
                and (
                    (h := _derived._top_hooks(False)) is None
                    or h[0] is d.region
                    or not _derived._checkpoints(h)
                )
            ):
                d = None
    anchor = xu = None
    if (
        d is None
        and x.requires_grad
        and weight.requires_grad
        and not autocast
        and not compiling
        and (bias is None or not (bias_f64 or (_BIAS_F64 and _bias_f64(bias))))
    ):
        # NOTE [A conv that keeps what eager keeps] (_fwd_torch, without its frame)
        y = torch.convolution(
            x, weight, bias, stride, padding, dilation, transposed, output_padding, groups
        )
        holder: list = [(x, None, None, None)]
    else:
        if d is not None and x.requires_grad:
            # make_anchor(x): grad mode is on, nothing compiles (d) or transforms (checked above)
            box: list = []
            xu = unwrap_if_dead(x)
            anchor = (_ANCHOR_APPLY(xu, box), box)
        # forward takes d (when W needs grad) and puts there what it keeps; and how it stands in
        # for x when W is frozen (NOTE [A stand-in for x]): True, a weak reference to x's storage
        # (x is autocast's fresh copy, or no saved-tensor hooks are active); False, x itself
        # (under hooks); None, neither (W needs grad; Dynamo traces; x is a tensor subclass other
        # than the estimate's fakes, whose storage may hold no elements)
        holder = [
            d,
            None
            if compiling
            or weight.requires_grad
            or not x.requires_grad
            or type(x) not in _STORAGE_FOLLOWED
            else x is not x0 or _top_hooks(False) is None,
        ]
        args = (x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
        if autocast:
            with torch.autocast(dev, enabled=False):
                y = _apply_fn(compiling, args, holder, xu)
        else:
            y = _apply_fn(compiling, args, holder, xu)
    if anchor is not None and y.grad_fn is not None:  # attach_anchor(y, anchor)
        y.grad_fn._slimgrad_anchor = anchor
    if holder[0] is not None and not compiling:
        # y can be recomputed from what this conv keeps (NOTE [Recomputable inputs] in _derived).
        kept, act, handle, pack = holder[0]
        conf = (stride, padding, dilation, transposed, output_padding, groups)
        # the recipe's own handle on the rebuilt input, counted when a norm adopts the recipe
        rebuild = _derived.Rebuild(act, handle.store, user=False) if handle is not None else None

        if rebuild is None and dt is None:
            # recompute(k, w, b) below, as torch.convolution itself (no Python frame per replay)
            recompute = _partial(
                torch.convolution,
                stride=stride,
                padding=padding,
                dilation=dilation,
                transposed=transposed,
                output_padding=output_padding,
                groups=groups,
            )
        else:

            def recompute(k, w, b, rebuild=rebuild, conf=conf, dt=dt):
                # The same ops as forward (autocast's cast included), so the result is bit for bit
                # y; a derived input comes from this backward's store (NOTE [Rebuilt once per
                # backward]).
                inp = rebuild(k)[0] if rebuild is not None else k
                if dt is not None:
                    w, b = _autocast_cast(w, dt), _autocast_cast(b, dt)
                return torch.convolution(inp, w, b, *conf)  # _fwd_torch, without its frame

        # "cheap" (the norm's default policy replays it): a 1x1 conv that does not reduce the
        # channels, except one whose input is a squeeze-excite output (RegNetY's width-keeping
        # conv3): those norms keep their input (NOTE [Which convs the default replays] in
        # _derived). Read from the weight's shape and groups alone: (C_out, C_in / groups, 1...),
        # a transposed one's (C_in, C_out / groups, 1...).
        ws = w0.shape
        pointwise = ws[2:] == (1,) * n and (
            ws[0] <= ws[1] * groups if transposed else ws[1] * groups <= ws[0]
        )
        gated = type(act) is tuple and act[0] == "gate"
        # register_recipe(y, recompute, (kept, w0, b0), ...): a detached alias of the kept input;
        # the weight and bias themselves (Parameters, as eager's conv node keeps them: read under
        # no_grad only, their versions checked at every replay)
        # NOTE [A recipe made in a checkpoint's forward]: a stand-in for x there, no hold on x
        h = _top_hooks(False)
        region = None if h is None else _derived.forward_region(h)
        fake = None if region is None else _derived.stand_in(y, kept)
        node = y.grad_fn
        if (
            h is None
            and fake is None
            and kept is x
            and type(node).__name__ == _EAGER_CONV_NODE
            and hasattr(node, "_saved_input")
        ):
            # NOTE [A recipe that reads x from eager's conv node] in ops/_derived.py
            recipe = _NodeRecipe(
                node=node,
                params=(w0, b0),
                fn=recompute,
                versions=(x._version, w0._version, 0 if b0 is None else b0._version),
                version=y._version,
                cheap=pointwise and not gated,
                rebuild=rebuild,
                pack=pack,
                region=None,
            )
        else:
            kept = kept.detach() if fake is None else fake
            versions = (kept._version, w0._version, 0 if b0 is None else b0._version)
            recipe = _Recipe(
                fn=recompute,
                tensors=(kept, w0, b0),
                versions=versions,
                version=y._version,
                cheap=pointwise and not gated,
                rebuild=rebuild,
                pack=pack,
                region=None if fake is None else region,
            )
        # _derived.put_recipe(y, recipe), inline (NOTE [A registry entry dropped in C]); y is
        # this call's fresh output, so an entry at its id is a live y's only if y were registered
        _CLOCK[0] += 1  # _derived._tick()
        k = id(y)
        e = _RECIPES_D[k] if k in _RECIPES_D else None
        if e is not None and e[0]() is y:
            _RECIPES_D[k] = (e[0], recipe)
        else:
            _RECIPES_D[k] = (_weakref(y, _partial(_RECIPES_D.pop, k)), recipe)
        if type(y.grad_fn) is _CONV_NODE:  # NOTE [A recipe dropped at its conv's backward]
            y.grad_fn.recipe_key = (k, _RECIPES_D[k][0])
    return y


_DOC = """``torch.nn.functional.{api}`` keeping only what the requested gradients need.

    ``y = {math}``; dx needs W only, dW needs x only.

    Memory: keeps x (4 B/elt fp32) only if ``weight`` requires grad, and then the slimgrad norm
    output b instead of x when x = act(b) (NOTE [Derived saved inputs]), or under saved-tensor
    hooks (as eager: NOTE [A stand-in for x]); eager keeps x and W always.

    Args:
        input: ``(N, C_in, {spatial})`` or ``(C_in, {spatial})``.
        weight: ``{w_shape}``.
        bias: ``(C_out,)`` or None.
        {args}: as torch{pad_note}.

    Returns:
        The {kind} output.

    Raises:
        RuntimeError: bad padding/stride specification, input rank or bias dtype (as torch).
        TypeError: non-tensor input or weight{pad_type}.

    Example:
        >>> y = {api}(x, m.weight, m.bias{example})
    """


def _conv_fn(n: int, transposed: bool):
    # One public functional per (dimensionality, transposed) row of the table below, with
    # torch.nn.functional's name, argument order and defaults.
    api = f"conv_transpose{n}d" if transposed else f"conv{n}d"
    dims = ("D", "H", "W")[3 - n :]
    if transposed:

        def fn(
            input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1
        ) -> torch.Tensor:
            return _conv(
                api, n, input, weight, bias, stride, padding, dilation, groups, True, output_padding
            )

    else:

        def fn(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1) -> torch.Tensor:
            return _conv(api, n, input, weight, bias, stride, padding, dilation, groups, False, 0)

    fn.__name__ = fn.__qualname__ = api
    fn.__doc__ = _DOC.format(
        api=api,
        math="conv_transpose(x, W) + bias" if transposed else "x ⋆ W + bias",
        spatial=", ".join(dims),
        w_shape=(
            ("(C_in, C_out / groups, " if transposed else "(C_out, C_in / groups, ")
            + ", ".join("k" + d for d in dims)
            + ")"
        ),
        args=(
            "stride, padding, output_padding, groups, dilation"
            if transposed
            else "stride, padding, dilation, groups"
        ),
        pad_note="" if transposed else "; padding may be 'valid' or 'same'",
        pad_type="; string padding (as torch)" if transposed else "",
        kind="transposed convolution" if transposed else "convolution",
        example=", stride=2" if transposed else ", padding=1",
    )
    return fn


conv1d, conv2d, conv3d = (_conv_fn(n, False) for n in (1, 2, 3))
conv_transpose1d, conv_transpose2d, conv_transpose3d = (_conv_fn(n, True) for n in (1, 2, 3))
