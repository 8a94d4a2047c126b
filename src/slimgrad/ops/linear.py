"""Linear layers that keep only what the requested gradients need.

Math: ``y = x W^T + b`` (``F.linear``, W is ``(out, in)``) or ``y = x W + b`` (HF GPT-2 ``Conv1D``,
W is ``(in, out)``, an ``addmm``). Backward: ``dx = dy W`` (needs W only), ``dW = dy^T x`` (needs x
only), ``db = sum(dy)``.

Memory: saves x only if W needs a gradient and W only if x needs one (frozen W: x is not kept; x
without grad: W is not referenced); eager (torch 2.13) ``linear``/``mm``/``addmm`` have the same
guard (measured), so this matches eager byte for byte and makes the contract explicit and tested.
x is a matmul input: it counts in the tracker's floor (``_slimgrad_floor``).

Under autocast, a weight that is a leaf (a Parameter, frozen or not) is kept as itself, not as its
low-precision cast: forward casts it, uses the cast and frees it; backward casts it again (NOTE
[Autocast weight casts]). Eager keeps the cast (2 B/param in bf16/fp16 per weight) for the whole
backward, and autocast's cache holds it until the autocast region exits.

# NOTE [Autocast weight casts]
Eager ``F.linear`` under autocast casts x, W and b to the autocast dtype. The cast of an fp32 leaf
that requires grad comes from autocast's cache: one cast, one ``ToCopyBackward`` node, per weight
per outermost autocast region, held by the cache until that region exits (so at the end of a
forward under autocast every weight's cast is resident), and ``mm``'s backward keeps it for
dx = dy W16. W itself is resident anyway and fp32 -> bf16/fp16 rounding is deterministic, so
slimgrad casts W itself (``W.to(dtype)``: the bits autocast's cast has; not through the cache),
runs eager's matmul on that cast in the autocast dtype, drops it, and computes ``W.to(dtype)``
again in backward. At most one weight cast is alive at a time, in forward and in backward.
The graph keeps eager's shape: the gradient of W leaves the op in the autocast dtype through a
cast node of slimgrad's (``_CastNode``: backward ``grad.to(W.dtype)``, ToCopyBackward's), whose
output (a 1-element zero-stride tensor of W16's shape, ``cast token``) is the op's input in
place of W16 and holds no cast. Like autocast's cache, slimgrad keeps one token per weight per
outermost autocast region (``_region_tokens``: the region is told by a 0-element leaf whose
cast autocast caches; when the cache is cleared at the region's exit that cast is freed and a
weakref callback drops the region's tokens), so a weight used twice in one region sums its two
gradients in the autocast dtype before the cast to fp32, exactly as eager; nested regions,
``autocast(enabled=False)``, ``cache_enabled=False`` (a token per use, as eager casts per use) and
``torch.clear_autocast_cache()`` behave as eager's cache does. Frozen weights (no gradient) need
no token: eager keeps their cast per use, slimgrad nothing new. A weight that is not a leaf
(computed, e.g. a merged adapter) keeps eager's behaviour (autocast's cast, kept). Under
torch.compile and torch.func the eager path runs (dynamo cannot read saved tensors).
Caveats: W is a saved tensor, so changing W in place between forward and backward raises
autograd's "modified by an inplace operation" error (eager would silently use the old cast). A
weight that one region uses both through slimgrad and through an eager autocast op (an
unconverted ``F.linear``/``matmul`` on the same Parameter) reaches W through two cast nodes, so
its two gradients are summed in fp32 instead of in the autocast dtype (the values differ in the
last bits); convert_ converts every plain Linear, so within a converted model this needs a
weight shared by a converted and an unconverted module.

# NOTE [Probes bypass saved-tensor hooks]
``_probe`` reads autocast's cached cast back from a throwaway matmul node (``_saved_mat2``). Under
someone else's ``saved_tensors_hooks`` that read is an unpack of *their* packed object: inside a
non-reentrant ``torch.utils.checkpoint`` region (HF ``gradient_checkpointing_enable``), unpacking
during forward runs the region's recompute there and then, and the frame keeps every recomputed
tensor until backward; under autocast every converted Linear probes (the region's token sentinel,
its bias), so slimgrad + checkpointing kept the whole block's activations and more (more than
eager without checkpointing: ``docs/measurements.md``); offloading hooks would hand back a copy (a
different tensor, not the cache's). So the probe runs under identity hooks of its own (the
innermost hooks win): the outer hooks never see the probe's node, nothing is packed, recomputed
or copied, and the region saves the same tensors in forward and in recompute.

# NOTE [A saved leaf comes back as an alias]
A non-reentrant ``torch.utils.checkpoint`` keeps its inputs as saved tensors and recomputes on
what they unpack to. Under a user's ``saved_tensors_hooks`` (an offload, a bf16 pack, a clone) a
leaf input comes back as another tensor object (the hook's tensor) that shares the leaf's
AccumulateGrad, where without hooks it is the leaf itself. Autocast casts that alias as it casts any
leaf (a cache entry of its own), so the cast the probe reads is eager's cast of it; a check that
the cast's AccumulateGrad holds ``t`` itself failed there, the recompute cast x a second time
(``t.to``), and selective checkpointing, which matches the recompute's ops to the forward's, raised
"aten._to_copy.default invocation index ... not found in storage" (issue 30). The check accepts
the AccumulateGrad ``t``'s gradient edge reaches (``get_gradient_edge``, asked only when the
variable is not ``t``; its ``view_as`` runs with the dispatch modes set aside, as NOTE [The region
probe no mode sees] says why), so forward and recompute issue the same ops.

# NOTE [Inference tensors take eager's cast]
A tensor made under ``torch.inference_mode()`` (a model built there, with ``requires_grad=True``
Parameters) has no version counter: reading ``_version`` raises "Inference tensors do not track
version counter", where eager's autocast just casts it. Such a weight is not kept as the master
(:func:`keeps_master` is False): the op takes it as autocast hands it over, a cast of it, as eager
does (the same bits); no gradient of it can be recorded anyway. Caches keyed by a parameter's
version (``slimgrad._math.steps.pinned``) decide per call for an inference tensor, whose in-place
writes inside inference mode leave no version behind (``tests/conformance/
test_inference_mode_converted.py``).

# NOTE [Function outputs are not views]
A tensor an autograd Function returns must not be a view of a tensor made inside its forward
(``F.linear`` on a 3-D input returns its 2-D product reshaped by ``view``): autograd marks such an
output so that any in-place write on it (``ReLU(inplace=True)``, ``h += x``, ``resize_``) raises
"Output 0 of ... is a view and is being modified inplace", where eager's output takes the write.
:func:`fresh` returns such a view as ``view.detach()``: the same storage, strides and version
counter (no copy; a later in-place write still bumps what the op saved, so autograd raises its
usual version error), but a base of its own, whose writes autograd records on the Function's node.
Every op's forward returns its outputs through it where they may be views (linear and
conv1d_addmm on inputs of at most 2 dims, linear_scale, linear_cross_entropy ``reduction='none'``,
the smooth activations' flat product); linear of a larger input returns its 2-D product, viewed by
its caller outside the Function (NOTE [Linear's 2-D product]).
"""

from __future__ import annotations

import math
import threading
import weakref

import torch

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
from slimgrad._dtensor import any_dtensor

# private torch facts, guarded there (without them the product stays in forward: `slimgrad env`)
from slimgrad._library import _mode_stack, _top_hooks, under_checkpoint
from slimgrad._math.bits import _table
from slimgrad._math.norms import unseen

__all__ = ["conv1d_addmm", "linear"]

_grad_on = torch._C.is_grad_enabled
_Tensor = torch.Tensor
try:  # the estimate's tensors (NOTE [Converted Linear outside autocast] in nn/linear.py)
    from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
except ImportError:  # pragma: no cover - a torch without it: a type the callers' tuples hold anyway
    _FakeTensor = torch.nn.Parameter


def fresh(y: torch.Tensor) -> torch.Tensor:
    """``y`` as a Function output that is not a view (NOTE [Function outputs are not views])."""
    if compiling():
        return y.detach()
    return y.detach() if y._is_view() else y


def _fwd_torch(x, weight, bias, w_in_out: bool):
    if w_in_out:  # view, as HF's Conv1D: raises where it raises (NOTE [Conv1D views its input])
        y2 = x.view(-1, x.shape[-1])
        y2 = torch.addmm(bias, y2, weight) if bias is not None else y2 @ weight
        return y2.view(*x.shape[:-1], weight.shape[-1])
    return torch.nn.functional.linear(x, weight, bias)


def _bwd_torch(dy, x, weight, has_bias: bool, w_in_out: bool, output_mask, differentiable=None):
    # ``differentiable``: whether grad mode is on (None: ask torch); output_mask: the first three
    # of needs_input_grad (x, weight, bias). Rows given, not -1: a reshape of 0 elements cannot
    # infer them (out_features or in_features 0)
    rows = math.prod(dy.shape[:-1])
    dy2 = dy.reshape(rows, dy.shape[-1])
    dx = dw = db = None
    if output_mask[0]:
        # dx allocated in its final shape (a base, not a view of the 2-D product), so the next
        # backward may reuse its buffer (NOTE [Gradient-buffer ownership] refuses views)
        w = weight.t() if w_in_out else weight
        if differentiable is None:
            differentiable = torch.is_grad_enabled()
        if differentiable:  # gradcheck of this path, double backward: no out=
            dx2 = dy2 @ w
            dx = dx2.view(*dy.shape[:-1], dx2.shape[-1])
        else:
            dx = dy2.new_empty((*dy.shape[:-1], w.shape[1]))
            torch.mm(dy2, w, out=dx.view(rows, w.shape[1]))
    if output_mask[1]:
        x2 = x.reshape(rows, x.shape[-1])
        dw = x2.t() @ dy2 if w_in_out else dy2.t() @ x2
    if has_bias and output_mask[2]:
        db = dy2.sum(0)
    return dx, dw, db


def _linear_double(ctx, dy):
    # the same with differentiable ops, under create_graph=True
    x, weight = ctx.saved_tensors
    mask = ctx.needs_input_grad
    dx, dw, db = _bwd_torch(dy, x, weight, ctx.has_bias, ctx.w_in_out, mask, True)
    if dx is not None and ctx.lead is not None:  # dy is the 2-D product's (NOTE [Linear's 2-D
        dx = dx.view(*ctx.lead, dx.shape[-1])  # product])
    return dx, dw, db, None


# NOTE [Conv1D views its input]
# HF's Conv1D runs ``addmm(bias, x.view(-1, x.size(-1)), weight)``: an input whose leading dims do
# not fold into rows without a copy (a transposed, permuted, expanded or channels_last input of 3+
# dims) raises view's RuntimeError there. A converted Conv1D accepts exactly what the original
# accepts, so conv1d_addmm takes the same view where HF takes it (its forward, every path) and
# raises the same error with the same message; every input the view takes gives the same rows as
# the reshape it replaces (no copy either way), so the result keeps its bits. F.linear reshapes
# any input, and linear keeps the reshape. A 0-dim input raises HF's IndexError (x.size(-1)).

# NOTE [Linear's 2-D product]
# For an input of 3 or more dims, _LinearFn returns the 2-D product (rows x out) and its caller
# views it in the input's leading shape, outside the Function, as eager's linear does (a view of
# addmm's or mm's 2-D result). So the gradient reaches the Function through a view node, which
# reshapes it to 2-D (a copy where it is not viewable, e.g. channels_last) and drops it, as eager's
# view node does; a Function that took the N-D gradient and reshaped it itself held both until it
# returned (a 4-D channels_last gradient at a converted Linear: one gradient's bytes above eager's
# peak, issue 30). The product is F.linear of the input viewed as 2-D: the addmm (bias) or mm (no
# bias) eager's linear runs on a contiguous input of any rank. Backward writes dx in the input's
# shape (a base, not a view: the next backward may reuse its buffer). On a real tensor that is
# torch.matmul of dy viewed in x's leading shape: a view that splits a 2-D tensor's rows always
# folds, so matmul runs mm on dy itself and returns the product through _unsafe_view, a base
# (the same bits as mm; two calls). On a fake tensor (slimgrad.memory.estimate) dx is allocated
# (new_empty) and written by mm with out=: a fake tensor made by an op that misses FakeTensorMode's
# dispatch cache (that _unsafe_view) is also held by the fake converter's memo, a weak reference
# ownership counts as a holder, so the next backward's take refused there where the real step
# grants (tiny GPT-2 estimated 1.8% above its real step); an allocation is never memoized. The
# same bytes either way. Callers view the output with ``y.view(x.shape[:-1] + y.shape[-1:])``
# where ``x.ndim > 2``, through ``_unview`` without a bias (NOTE [Linear's N-D output without
# bias]).

# NOTE [Linear's N-D output without bias]
# Eager's linear of an input of 3+ dims without a bias runs matmul: mm on the 2-D view, then
# _unsafe_view to the N-D shape, a tensor that is not a view (UnsafeViewBackward reshapes the
# gradient, as view's node does). With a bias it runs addmm and returns a view. An in-place write on
# a view (``relu_``, ``mul_``) makes autograd rebase the view's history onto its base (CopySlices:
# in backward a zeros buffer of the base's size, a copy of the gradient into it and a clone of the
# slice, live together), so viewing the bias-free 2-D product cost an in-place consumer up to two
# gradients' bytes above eager's peak ((4, 10, 64) -> 48, relu_: 48,648 B against 40,968, issue
# 30). So callers give the bias-free product eager's _unsafe_view (``_unview``: aten's op, resolved
# once here; where a release lacks it, Tensor.view: the same bits, eager's bytes with a bias), and
# keep the view where eager views (a bias, HF's Conv1D). The same storage and bits either way.
try:
    _unview = torch.ops.aten._unsafe_view.default
except (AttributeError, RuntimeError):  # a torch without the op: a view (the same bits)
    _unview = torch.Tensor.view


class _LinearFn(torch.autograd.Function):
    _slimgrad_floor = True

    @staticmethod
    def forward(ctx, x, weight, bias, w_in_out, direct=False):
        # direct: a straight path's call (NOTE [Linear's straight path]: eager, not traced), which
        # saves through ctx's field (NOTE [Saving through ctx's fields] in slimgrad/_autograd.py)
        ctx.w_in_out, ctx.has_bias = w_in_out, bias is not None
        need = ctx.needs_input_grad
        if direct and CTX_FIELDS:
            ctx.to_save = (x if need[1] else None, weight if need[0] else None)
        else:
            ctx.save_for_backward(x if need[1] else None, weight if need[0] else None)
        if x.ndim > 2:  # NOTE [Linear's 2-D product]
            ctx.lead = x.shape[:-1]
            if w_in_out:  # NOTE [Conv1D views its input]
                x2 = x.view(-1, x.shape[-1])
                return torch.addmm(bias, x2, weight) if bias is not None else x2 @ weight
            return torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), weight, bias)
        ctx.lead = None
        # fresh() without its checks: detaching a product that is not a view is harmless (an
        # alias of it, as fresh() returns while compiling); _fwd_torch inline
        if w_in_out:  # NOTE [Conv1D views its input]
            y2 = x.view(-1, x.shape[-1])
            y2 = torch.addmm(bias, y2, weight) if bias is not None else y2 @ weight
            return y2.view(*x.shape[:-1], weight.shape[-1]).detach()
        return torch.nn.functional.linear(x, weight, bias).detach()

    @staticmethod
    def backward(ctx, dy):
        # first_order("ops.linear", _linear_double) inline (NOTE [Second derivatives]): autograd
        # turns grad mode on only for create_graph=True, then eager's 2nd derivatives
        if _grad_on():
            return (*_linear_double(ctx, dy), None)
        # first derivatives: _bwd_torch's math, inline for a contiguous gradient
        x, weight = ctx.saved_tensors
        mask = ctx.needs_input_grad  # (x, weight, bias, w_in_out): the first three are read
        lead = ctx.lead
        if lead is not None:  # dy: the 2-D product's gradient (NOTE [Linear's 2-D product])
            dx = dw = db = None
            if mask[0]:
                # eager's mm on dy, its product in x's shape and a base, not a view (NOTE
                # [Linear's 2-D product]); .mT: t() without a call; dy.__class__: an attribute
                # read, not a call
                w = weight.mT if ctx.w_in_out else weight
                if dy.__class__ is _Tensor:
                    dx = torch.matmul(dy.view(lead + dy.shape[1:]), w)
                else:  # a fake (or other subclass) tensor: allocated, then written by mm
                    dx = dy.new_empty(lead + w.shape[1:])
                    torch.mm(dy, w, out=dx.view(dy.shape[0], w.shape[1]))
            if mask[1]:
                x2 = x.reshape(-1, x.shape[-1])
                dw = x2.mT @ dy if ctx.w_in_out else dy.mT @ x2
            if mask[2] and ctx.has_bias:
                db = dy.sum(0)
            return dx, dw, db, None, None
        if not dy.is_contiguous():
            dx, dw, db = _bwd_torch(dy, x, weight, ctx.has_bias, ctx.w_in_out, mask, False)
            return dx, dw, db, None, None
        # rows given where out_features is 0 (a reshape of 0 elements cannot infer them)
        dy2 = dy.reshape(-1, dy.shape[-1]) if dy.shape[-1] else dy.reshape(dy.shape[:-1].numel(), 0)
        dx = dw = db = None
        if mask[0]:
            # torch.matmul of a contiguous (..., out) gradient and a 2-D weight folds to mm on
            # the 2-D view and returns the product as an _unsafe_view: _bwd_torch's mm, bit for
            # bit, in its final shape and not a view (the next backward may reuse its buffer)
            dx = torch.matmul(dy, weight.t() if ctx.w_in_out else weight)
        if mask[1]:
            x2 = x.reshape(-1, x.shape[-1])
            dw = x2.t() @ dy2 if ctx.w_in_out else dy2.t() @ x2
        if mask[2] and ctx.has_bias:
            db = dy2.sum(0)
        return dx, dw, db, None, None


_LINEAR_APPLY = direct_apply(_LinearFn)


def _autocast_linear_backward(ctx, dy):
    x, master = ctx.saved_tensors  # master: saved by a caller of forward (ops/gpt2_mlp.py)
    if master is None and ctx.master is not None:  # NOTE [The master weight is no saved tensor]
        master = ctx.master
        if master._version != ctx.master_version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: the weight of a converted Linear ({_describe(master)}) is "
                f"at version {master._version}; expected version {ctx.master_version} instead. "
                "Hint: change the weight after backward (optimizer.step()), or under no_grad "
                "before the forward."
            )
    w = master.to(ctx.cast_dtype) if master is not None else None  # eager's cast, same bits
    mask = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3])
    dx, dw, db = _bwd_torch(dy, x, w, ctx.has_bias, ctx.w_in_out, mask)
    return dx, dw, None, db, None, None, None


def _describe(t):
    return f"[{t.__class__.__name__}] {tuple(t.shape)} {t.dtype}"


_mode_depth = getattr(torch._C, "_len_torch_dispatch_stack", None)


def _readers_only() -> bool:
    # every dispatch mode on the stack only reads ops (NOTE [The down product after the saves] in
    # ops/gated_mlp.py):
    # none, or slimgrad's own (``_slimgrad_reads_ops``), fake tensors, torch's FLOP counter
    if _mode_depth is not None and not _mode_depth():
        return True
    if _mode_stack is None:
        return False
    from torch._subclasses.fake_tensor import FakeTensorMode

    for m in _mode_stack():
        if not (
            getattr(m, "_slimgrad_reads_ops", False)
            or isinstance(m, FakeTensorMode)
            or type(m).__module__ == "torch.utils.flop_counter"
        ):
            return False
    return True


# NOTE [The master weight is no saved tensor]
# Under autocast the converted Linear needs in backward only the leaf fp32 weight (the master)
# and recasts it there (NOTE [Autocast weight casts]). The master is a parameter: alive without
# this op, never an activation. Handed to save_for_backward it went through every
# saved_tensors_hooks region's pack hook, which moved or copied 4 B per weight element per use
# where eager's hooks see autocast's cast (2 B in bf16): 1.26x eager's offloaded bytes on four
# d=256 blocks (tests/conformance/test_compositions_28.py). So ctx holds the master as an
# attribute, with its version at forward; backward raises autograd's "modified by an inplace
# operation" error when it changed, as a saved tensor would. Hooks see x only: what slimgrad
# keeps of a step is what they see, and the master is no part of it.
def autocast_linear_setup(ctx, x, master, bias, cast_dtype, w_in_out) -> None:
    """What :class:`_AutocastLinearFn`'s forward records on ``ctx`` before its product (also for
    a block node that runs the product later: NOTE [c_proj's product after the saves] in
    ops/gpt2_mlp.py)."""
    ctx.w_in_out, ctx.has_bias, ctx.cast_dtype = w_in_out, bias is not None, cast_dtype
    ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, None)
    # NOTE [The master weight is no saved tensor]
    ctx.master = master if ctx.needs_input_grad[0] else None
    ctx.master_version = master._version


class _AutocastLinearFn(torch.autograd.Function):
    # NOTE [Autocast weight casts]: ``token`` stands for W's cast (its gradient goes there, in the
    # autocast dtype); the cast itself is made here from the leaf ``master``, used and dropped
    _slimgrad_floor = True

    @staticmethod
    def forward(ctx, x, token, master, bias, cast_dtype, w_in_out, later=None):
        # ``later``: a list where the product is left to run after the saves (NOTE [A product
        # after the saves under autocast]), or None
        autocast_linear_setup(ctx, x, master, bias, cast_dtype, w_in_out)
        if later is None:
            return fresh(_fwd_torch(x, master.to(cast_dtype), bias, w_in_out))
        # the cast is made at the product, not held through the saves (a hook that copies x)
        later.append((x, master, cast_dtype, bias, w_in_out))
        return x.new_empty((*x.shape[:-1], master.shape[-1] if w_in_out else master.shape[0]))

    @staticmethod
    @first_order("ops.linear", double=_autocast_linear_backward)
    def backward(ctx, dy):
        return _autocast_linear_backward(ctx, dy)


# NOTE [A product after the saves under autocast]
# The converted Linear under autocast is a custom Function (_AutocastLinearFn): its x reaches the
# pack hooks when its forward returns, after its product, where eager's linear saves x before
# it. Last in a checkpointed block (a GPT-NeoX or small Phi-3 MLP's down projection), a
# non-reentrant checkpoint's recompute then ran that product, which eager's never does: 1.44x
# eager's recomputed matmul FLOPs on a 2-layer GPT-NeoX under bf16 autocast. Under
# torch.utils.checkpoint's own hooks and only reading dispatch modes, as the gated MLP (NOTE [The
# down product after the saves] in ops/gated_mlp.py, which says why those hooks only), the
# Function returns its output's buffer unfilled and :func:`_product_after` casts the weight and
# fills the buffer once ``apply`` returned, with the kernel ``_fwd_torch`` runs (``mm``, ``addmm``
# on the 2-D fold of a contiguous x: F.linear's and Conv1D's product) into its 2-D view
# (``out=``, under no_grad): the same bits. Only for a contiguous x and a bias of one dimension
# (F.linear broadcasts others its own way).
def later_ok() -> bool:
    """Whether a product may be left until after its node's saves, asked once ``_top_hooks(False)``
    saw hooks: the innermost are torch.utils.checkpoint's own (a non-reentrant checkpoint's
    forward or recompute, which pack without copying), nothing is compiling and every dispatch
    mode only reads ops (NOTE [The down product after the saves] in ops/gated_mlp.py)."""
    return under_checkpoint() and not compiling() and _readers_only()


def _later_ok(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        _top_hooks(False) is not None
        and x.is_contiguous()
        and (bias is None or bias.ndim == 1)  # F.linear broadcasts others its own way
        and later_ok()
    )


def _product_after(y: torch.Tensor, later: list) -> torch.Tensor:
    # fills y with x's product (NOTE [A product after the saves under autocast]); ``later`` holds
    # (x, weight, its cast dtype or None, bias, w_in_out): the weight cast here, for the product
    x, w, dt, b, w_in_out = later.pop()
    if dt is not None:
        w = w.to(dt)
    wt = w if w_in_out else w.t()
    with torch.no_grad():
        # rows given: a view of 0 elements cannot infer them
        x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # a view: x is contiguous
        y2 = y.view(x2.shape[0], y.shape[-1])
        if b is None:
            torch.mm(x2, wt, out=y2)
        else:
            torch.addmm(b, x2, wt, out=y2)
    return y


# NOTE [A cast token holds no bytes]
# The cast token has W16's shape and dtype and is never read, so it is an expand of one scalar per
# (device, dtype), made once outside every step (as the bit tables: NOTE [Bit tables outside every
# step] in slimgrad/_math/bits.py), not an allocation of its own; the expand runs where no
# dispatch mode sees it (0 bytes, no op for a selective checkpoint to match). Allocated per token (a
# 1-element zero-stride tensor), it was 2 B (bf16) a Linear more than eager under a selective
# checkpoint whose policy saves every op: the policy keeps each op's output to the backward, the
# token's allocation too (Linear -> SiLU -> Linear: +4 B over eager's peak).
_TOKEN_BASES: dict[torch.dtype, dict] = {}


def _cast_token_of(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    base = _table(  # ``.data``: a Parameter is no plain tensor to _table, w's data is
        _TOKEN_BASES.setdefault(dtype, {}),
        w.data,
        lambda device: torch.zeros((), dtype=dtype, device=device),
    )
    # the view made where no mode sees it: a fake step's mode would hand the real base over as
    # a fake copy of its own, and a tracker count that as new
    return unseen(torch.Tensor.expand, base, w.shape)


class _CastNode(torch.autograd.Function):
    # autocast's cast node (ToCopyBackward) without the cast: the output has W16's shape and
    # dtype and no storage of its own (NOTE [A cast token holds no bytes]); ops take it in place
    # of W16 and never read it
    @staticmethod
    def forward(ctx, w, dtype):
        ctx.w_dtype = w.dtype
        return _cast_token_of(w, dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.w_dtype), None


class _Regions(threading.local):
    # autocast's cache is per thread: {device type: (weakref to the sentinel's cached cast,
    # {(id(W), dtype): (weakref to W, token)}, sentinel)}
    def __init__(self) -> None:
        self.by_device: dict = {}


_REGIONS = _Regions()


def _region_tokens(w: torch.Tensor, dt: torch.dtype) -> dict | None:
    # The token table of the current outermost autocast region (NOTE [Autocast weight casts]), or
    # None when autocast would not cache W's cast (a token per use then)
    if not (torch.is_autocast_cache_enabled() and w.dtype == torch.float32 and not w._is_view()):
        return None
    dev, table = w.device.type, _REGIONS.by_device
    entry = table.get(dev)
    if entry is not None:  # dropped by the callback when the region's cache was cleared
        return entry[1]
    sentinel, cast = unseen(_region_probe, w.device, dt)  # NOTE [The region probe no mode sees]
    if cast is None or cast.grad_fn is None:  # autocast did not cache it: behave as cache off
        return None
    tokens: dict = {}

    def region_exit(_ref, table=table, dev=dev, tokens=tokens) -> None:
        tokens.clear()
        if table.get(dev, (None, None))[1] is tokens:
            del table[dev]

    table[dev] = (weakref.ref(cast, region_exit), tokens, sentinel)
    return tokens


# NOTE [The region probe no mode sees]
# The first converted Linear of an outermost autocast region makes a 0-element sentinel and probes
# its cast (NOTE [Autocast weight casts]); later ones read the table. That is a reading of
# autocast's cache state, part of no step and 0 bytes, so it runs with the dispatch modes set
# aside (as the norms' per-version searches: NOTE [A search the modes never see] in
# slimgrad/_math/norms.py). Seen by the modes, it broke selective checkpointing: a block
# checkpointed after a converted Linear of the same region found the table in its forward but
# issued the sentinel's zeros in its recompute (a new region at backward time), and SAC, which
# matches every op of the recompute to the forward's, raised "aten.zeros.default encountered
# during backward but not found in storage". Without ``_disable_current_modes`` it runs under the
# modes as before.
def _region_probe(device: torch.device, dt: torch.dtype):
    sentinel = torch.zeros((0, 1), device=device, requires_grad=True)
    with torch.enable_grad():
        return sentinel, _probe(sentinel, dt)


def _cast_token(w: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    # the stand-in for autocast's cast of the leaf ``w`` that requires grad: one per region (as
    # autocast's cache) or one per use
    tokens = _region_tokens(w, dt)
    if tokens is None:
        return _CastNode.apply(w, dt)
    key = (id(w), dt)
    hit = tokens.get(key)
    if hit is not None and hit[0]() is w:
        return hit[1]
    token = _CastNode.apply(w, dt)
    tokens[key] = (weakref.ref(w), token)
    return token


def keeps_master(w: torch.Tensor | None, dt: torch.dtype) -> bool:
    """True when an op under autocast (to ``dt``) keeps the leaf ``w`` and casts it itself
    (NOTE [Autocast weight casts]); False: ``w`` is taken as autocast hands it over."""
    return (
        w is not None
        and w.grad_fn is None
        and w.is_floating_point()
        and w.dtype not in (dt, torch.float64)
        and not w.is_inference()  # NOTE [Inference tensors take eager's cast]
        and not torch.compiler.is_compiling()
    )


def autocast_weight(w: torch.Tensor, dt: torch.dtype) -> torch.Tensor | None:
    """For a weight that :func:`keeps_master`: its cast token (None when no gradient of ``w`` is
    recorded); the op passes it where eager passes ``w``'s cast and casts ``w`` itself."""
    if not (w.requires_grad and torch.is_grad_enabled()):
        return None
    return _cast_token(w, dt)


def autocast_matmul_inputs(*tensors):
    """Cast tensors as eager autocast casts the inputs of a lower-precision op (linear, mm, bmm)."""
    t0 = next(t for t in tensors if t is not None)
    dev = t0.device.type
    if not torch.is_autocast_enabled(dev):
        return tensors
    dt = torch.get_autocast_dtype(dev)
    return tuple(
        t.to(dt) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
        for t in tensors
    )


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _probe(t: torch.Tensor, dt: torch.dtype) -> torch.Tensor | None:
    # A zero-row matmul under autocast: autocast casts ``t`` through its cache and the matmul's
    # node saves that very cast; read it back (NOTE [Autocast weight casts]). The probe's node
    # saves through identity hooks of its own (NOTE [Probes bypass saved-tensor hooks]).
    # no outer hooks: read the node's own saved cast (the very tensor autocast's cache holds; a
    # hook's unpack hands back another tensor object sharing its storage)
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is None:
        return _probe_saved(t, dt)
    with torch.autograd.graph.saved_tensors_hooks(_same, _same):
        return _probe_saved(t, dt)


def _probe_saved(t: torch.Tensor, dt: torch.dtype) -> torch.Tensor | None:
    z = torch.empty(
        (0, t.shape[0]) if t.dim() < 3 else (t.shape[0], 0, t.shape[1]),
        dtype=dt,
        device=t.device,
        requires_grad=True,
    )
    if t.dim() == 1:  # vecdot = sum(z * t): its mul keeps the cast as ``other``
        node = torch.linalg.vecdot(z, t).grad_fn
        mul = node.next_functions[0][0] if node is not None and node.next_functions else None
        return getattr(mul, "_saved_other", None)
    if t.dim() == 2:
        return getattr(torch.mm(z, t).grad_fn, "_saved_mat2", None)
    if t.dim() == 3:
        return getattr(torch.bmm(z, t).grad_fn, "_saved_mat2", None)
    return None


def _autocast_cast(t: torch.Tensor | None, dev: str, dt: torch.dtype) -> torch.Tensor | None:
    """``t`` as eager autocast hands it to a lower-precision op: the cached cast of an fp32 leaf
    that requires grad (the same tensor and node for every use in the region), else ``t.to(dt)``
    for floating tensors other than float64."""
    if t is None or not t.is_floating_point() or t.dtype in (torch.float64, dt):
        return t
    cacheable = (
        t.dtype == torch.float32
        and t.requires_grad
        and t.is_leaf
        and not t._is_view()
        and torch.is_autocast_cache_enabled()
        and t.dim() <= 3
    )
    if cacheable:
        with torch.enable_grad():
            cast = _probe(t, dt)
        if (
            cast is not None
            and cast.dtype == dt
            and cast.shape == t.shape
            and cast.grad_fn is not None
        ):
            # the cast feeds t's AccumulateGrad: its variable is t or, for a saved leaf unpacked
            # by someone's hooks (a checkpoint's recompute), the leaf t aliases (NOTE [A saved
            # leaf comes back as an alias])
            node = cast.grad_fn.next_functions[0][0]
            v = getattr(node, "variable", None)
            if v is t or (v is not None and unseen(_grad_node, t) is node):
                return cast
    return t.to(dt)


def _grad_node(t: torch.Tensor):
    return torch.autograd.graph.get_gradient_edge(t).node


def _cast_input(x, dev, dt, w_in_out):
    # HF's Conv1D reshapes x before its addmm: autocast casts that view, never a cached leaf
    return (
        x.to(dt)
        if w_in_out and x.is_floating_point() and x.dtype != torch.float64
        else (_autocast_cast(x, dev, dt))
    )


def _apply(x, weight, bias, w_in_out):
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        x = _cast_input(x, dev, dt, w_in_out)
        bias = _autocast_cast(bias, dev, dt)
        if keeps_master(weight, dt):  # NOTE [Autocast weight casts]
            token = autocast_weight(weight, dt)
            # NOTE [A product after the saves under autocast]
            later = [] if _later_ok(x, bias) else None
            with torch.autocast(dev, enabled=False):
                y = _AutocastLinearFn.apply(x, token, weight, bias, dt, w_in_out, later)
                return y if later is None else _product_after(y, later)
        weight = _autocast_cast(weight, dev, dt)
        with torch.autocast(dev, enabled=False):
            y = _LinearFn.apply(x, weight, bias, w_in_out)
    else:
        y = _LinearFn.apply(x, weight, bias, w_in_out)
    if x.ndim < 3:  # NOTE [Linear's 2-D product]
        return y
    if bias is None and not w_in_out:  # NOTE [Linear's N-D output without bias]
        return _unview(y, x.shape[:-1] + y.shape[-1:])
    return y.view(x.shape[:-1] + y.shape[-1:])


def _plain_layout(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # The layouts whose gradients _bwd_torch computes as eager's mm/addmm backward does, bit for
    # bit: a contiguous 2-D weight (its transpose column-major) and a contiguous input whose rows
    # eager's mm sees row-major (eager's mm_mat1_backward switches the product's layout for a
    # column-major input, e.g. x.t(), and in_features == 1 can look column-major). Other layouts
    # (rare) run eager's F.linear: exact, and eager's linear keeps what this op keeps.
    return (
        weight.ndim == 2
        and x.ndim > 0
        and x.shape[-1] > 1
        and weight.is_contiguous()
        and x.is_contiguous()
    )


def _refuse_jit_if_recorded(api, *tensors) -> None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        refuse_jit(api)


def _check(api: str, x: torch.Tensor, weight: torch.Tensor, in_dim: int) -> None:
    # RuntimeError: the type eager's linear/addmm raise for mismatched shapes
    if x.dim() == 0 or x.shape[-1] != weight.shape[in_dim]:
        raise RuntimeError(
            f"slimgrad.ops.{api}: input features do not match the weight; expected "
            f"input.shape[-1] == weight.shape[{in_dim}], got input of shape "
            f"{tuple(x.shape)} and weight of shape {tuple(weight.shape)}. "
            "Pass an input whose last dimension is the layer's in_features."
        )


# NOTE [Linear's straight path]
# A converted model calls linear/conv1d_addmm several times per block, so the common case is told
# by a few C-level reads and goes straight to the Function's C apply (NOTE [Applying a Function
# without its Python wrapper] in slimgrad/_autograd.py): not compiling (read first: Dynamo folds
# it to True and never traces the other reads), no torch.func transform, no TorchScript trace, no
# autocast, and (linear) every tensor a plain Tensor or Parameter, so no DTensor. Anything else
# takes the general path (``_linear_general``/``_conv1d_general``), unchanged. Backward runs the
# first-order body directly; ``double`` (create_graph=True) the same math with differentiable ops.
_C = torch._C
_functorch_on = _C._are_functorch_transforms_active
_is_tracing = _C._is_tracing
_any_autocast = _C._is_any_autocast_enabled
_is_compiling = compiling  # NOTE [One-frame compile check] in slimgrad/_autograd.py
_PLAIN = (torch.Tensor, torch.nn.Parameter, type(None))
_Parameter = torch.nn.Parameter


def _straight(x, weight, bias, w_in_out: bool) -> torch.Tensor:
    # the C apply, each tensor through unwrap_if_dead (a Parameter is never a functorch wrapper)
    if type(weight) is not _Parameter:
        weight = unwrap_if_dead(weight)
    if bias is not None and type(bias) is not _Parameter:
        bias = unwrap_if_dead(bias)
    y = _LINEAR_APPLY(unwrap_if_dead(x), weight, bias, w_in_out, True)
    if x.ndim < 3:  # NOTE [Linear's 2-D product]
        return y
    if bias is None and not w_in_out:  # NOTE [Linear's N-D output without bias]
        return _unview(y, x.shape[:-1] + y.shape[-1:])
    return y.view(x.shape[:-1] + y.shape[-1:])


def linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``y = input @ weight.T + bias`` (as ``F.linear``) keeping only what requested grads need.

    Memory: saves input only if weight needs grad, weight only if input needs grad (eager: same).

    Args:
        input: ``(*, in_features)``.
        weight: ``(out_features, in_features)``.
        bias: optional ``(out_features,)``.

    Returns:
        ``(*, out_features)``.

    Raises:
        RuntimeError: ``input.shape[-1] != in_features`` (eager raises RuntimeError too).

    Example:
        >>> y = linear(torch.randn(4, 8), torch.randn(3, 8, requires_grad=True))
    """
    if (  # NOTE [Linear's straight path]
        _is_compiling()
        or _functorch_on()
        or _is_tracing()
        or _any_autocast()
        or not (type(input) in _PLAIN and type(weight) in _PLAIN and type(bias) in _PLAIN)
    ):
        return _linear_general(input, weight, bias)
    if not _plain_layout(input, weight) or (bias is not None and bias.ndim != 1):
        return torch.nn.functional.linear(input, weight, bias)
    if not input.shape or input.shape[-1] != weight.shape[1]:
        _check("linear", input, weight, 1)
    return _straight(input, weight, bias, False)


def _linear_general(input, weight, bias):
    try:
        eager = (  # torch.func (NOTE [torch.func transforms]), other layouts, DTensors (tensor
            transforms_active()  # parallel: DTensor's own linear; eager's keeps what this keeps)
            or not _plain_layout(input, weight)
            # a bias of other than one dim, which F.linear broadcasts (and whose gradient it
            # sums back to that shape): eager's op, as an unusual layout
            or (bias is not None and bias.ndim != 1)
            or any_dtensor(input, weight, bias)
            or input.is_meta  # NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py
        )
    except FxTraceError:  # NOTE [fx symbolic tracing of a converted model]
        eager = True
    if eager:
        return torch.nn.functional.linear(input, weight, bias)
    _check("linear", input, weight, 1)
    _refuse_jit_if_recorded("ops.linear", input, weight, bias)
    return _apply(input, weight, bias, False)


def conv1d_addmm(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """HF GPT-2 ``Conv1D``: ``y = input @ weight + bias`` with weight ``(in, out)`` (an ``addmm``).

    Memory: saves input only if weight needs grad, weight only if input needs grad (eager: same).

    Args:
        input: ``(*, in_features)``.
        weight: ``(in_features, out_features)``.
        bias: optional ``(out_features,)``.

    Returns:
        ``(*, out_features)``.

    Raises:
        RuntimeError: ``input.shape[-1] != in_features`` (eager raises RuntimeError too), or
            ``input.view(-1, in_features)`` fails (as HF's ``Conv1D``: NOTE [Conv1D views its
            input]).
        IndexError: a 0-dim input (as HF's ``Conv1D``).
    """
    if not input.shape:  # HF's x.size(-1): IndexError (NOTE [Conv1D views its input])
        input.size(-1)
    if _is_compiling() or _functorch_on() or _is_tracing() or _any_autocast():
        return _conv1d_general(input, weight, bias)  # NOTE [Linear's straight path]
    if input.shape[-1] != weight.shape[0]:
        _check("conv1d_addmm", input, weight, 0)
    return _straight(input, weight, bias, True)


def _conv1d_general(input, weight, bias):
    if not input.is_contiguous():  # raises where HF's view raises, before autocast's cast (a
        input.view(-1, input.shape[-1])  # copy) (NOTE [Conv1D views its input])
    # NOTE [torch.func transforms], NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py
    if transforms_active() or input.is_meta:
        return _fwd_torch(input, weight, bias, True)
    _check("conv1d_addmm", input, weight, 0)
    _refuse_jit_if_recorded("ops.conv1d_addmm", input, weight, bias)
    return _apply(input, weight, bias, True)
