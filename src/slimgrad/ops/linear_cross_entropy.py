"""Fused linear + cross-entropy for LM heads: the B·T×V logits are never kept.

Math, per token i with hidden h_i, target t_i, logits z_i = W h_i + b (V classes), smoothing ε:

    lse_i  = log Σ_j exp(z_ij)
    loss_i = lse_i − (1 − ε)·z_{i,t_i} − (ε / V)·Σ_j z_ij          (0 where t_i == ignore_index)
    reduction: 'none' (loss_i), 'sum' (Σ loss_i), 'mean' (Σ loss_i / #non-ignored; NaN if none)

which is ``F.cross_entropy(F.linear(h, W, b), t, ignore_index=, label_smoothing=, reduction=)``.
Backward, with s_i the incoming gradient's weight of token i (0 for ignored tokens):

    dz_ij = s_i · (softmax(z_i)_j − (1 − ε)·[j == t_i] − ε / V)
    dh = dz W,   dW = dzᵀ h,   db = Σ_i dz_i

The tokens are walked in chunks of ``chunk_size`` rows; each chunk's logits are computed and
dropped. 'mean'/'sum' (the loss is a scalar, so s_i = g·w_i with w_i = 1 or 1/#non-ignored known in
forward and g = grad_output a scalar): forward computes each chunk's logits once, reduces them to
the loss, turns them into dz for g = 1 in place and feeds the two gradient matmuls right away (dh
rows, dW += dzᵀ h, db += Σ dz): 3 big matmuls in all, like eager; backward only multiplies the
saved dh, dW, db by g. This runs when dW is no larger than eager's log-probs (N >= H), or when W
needs no gradient. 'none' (per-token g, unknown in forward) and N < H: forward keeps lse, backward
recomputes the chunk logits (one extra matmul of 2·N·V·H flops). Exact up to summation order.
Optional elementwise logit transforms (``logit_scale`` s, ``logit_softcap`` c: the loss of
``c·tanh(s·z / c)``, HF's Cohere/Granite scaling and Gemma2/3 soft-capping) are applied to each
chunk's logits in forward and backward (NOTE [Logit transforms] in slimgrad/_math/); they change
nothing that is saved. The Triton kernels implement the plain logits; with a transform the
PyTorch chunk path runs.
Low precision (bf16/fp16 inputs, or autocast): the matmuls run in that dtype, like eager; softmax
statistics and the dW/db accumulators are float32.
Full precision, recompute path (CPU PyTorch path): backward walks the vocabulary in blocks of
:func:`vocab_block_rows` rows (about 2^20 elements of dW), each block's dW rows complete over all
tokens in turn (NOTE [Head gradient by vocabulary blocks] in slimgrad/_math/): one block of logits
alive instead of chunk×V; dh then takes its own N×H buffer (it cannot overwrite hidden, which
every block reads) unless one block covers the vocabulary. slimgrad.step_in_backward takes the
blocks of an untied head (``ROW_SINK``) and the full dW is never allocated.

Memory: 'mean'/'sum' with N >= H saves dh (N×H in the compute dtype, like the hidden it replaces)
+ dW (V×H, float32 or float64: parameter-sized, kept from forward to backward; only when W needs
a gradient)
+ db (V); 'none' or N < H saves hidden (as given, or its autocast copy) + lse (4 B/token) + target.
Eager saves hidden + the N×V log-probabilities (4 B per logit in fp32) + target. Transient peak:
one chunk of logits (chunk_size×V) instead of two to three N×V buffers. Backward writes its result
into the saved dh / dW (or dh into the saved hidden) when ownership allows (NOTE [Gradient-buffer
ownership] in ``slimgrad/ownership.py``); under retain_graph=True it scales out of place.
Under torch.compile (outside autocast and precompute_grads) the loss is plain ops in a
checkpoint, which keeps hidden + target (NOTE [The fused loss traced under torch.compile] in
slimgrad/_math/).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from slimgrad import _dtensor, ownership
from slimgrad._autograd import (
    compiling,
    direct_apply,
    first_order,
    refuse_jit,
    tie_refusal,
    unwrap_if_dead,
)
from slimgrad._compile import recompute_in_backward
from slimgrad._errors import internal_error
from slimgrad._library import custom_op
from slimgrad._math.linear_cross_entropy import (
    _acc_dtype,
    _bwd_one_torch,
    _bwd_rows_torch,
    _bwd_torch,
    _fwd_grad_torch,
    _fwd_torch,
    _loss_traced,
)
from slimgrad.kernels import _backend
from slimgrad.ops.layer_norm import _ANCHOR_APPLY
from slimgrad.ops.linear import _readers_only, fresh

__all__ = [
    "ROW_SINK",
    "causal_lm_loss",
    "default_chunk_size",
    "linear_cross_entropy",
    "vocab_block_rows",
]

_REDUCTIONS = ("none", "mean", "sum")
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_API = "slimgrad.ops.linear_cross_entropy"

# Attribute of a head weight naming a callable ``sink(weight, accumulate_grad_node)`` that, inside
# backward, returns ``take_rows(v0, v1, dW_rows)`` (it then takes every block of dW rows, and the
# op returns no gradient for the weight) or None (the op returns dW as usual). Set by
# slimgrad.step_in_backward (NOTE [Head gradient by vocabulary blocks] in slimgrad/_math/).
ROW_SINK = "_slimgrad_row_sink"


def vocab_block_rows(hidden_size: int) -> int:
    """Vocabulary rows per block of the row-wise backward: about 2^20 elements of dW (4 MiB in
    float32) per block, at least 1 (NOTE [Head gradient by vocabulary blocks])."""
    if 0 < hidden_size <= 1 << 20:  # the usual case, without the calls of the bounds below
        return (1 << 20) // hidden_size
    return max(1, (1 << 20) // max(hidden_size, 1))


def _weight_grad_only_here(ctx) -> bool:
    # True when the weight (input 1) is a leaf whose AccumulateGrad no other path of this graph
    # below the op reaches (an untied head; a tied embedding's lookup reaches it through hidden).
    # A use beside the op (loss + f(W)) is not below it: step_in_backward refuses it when its
    # gradient arrives.
    acc = ctx.next_functions[1][0]
    if acc is None or acc.name() != "torch::autograd::AccumulateGrad":
        return False
    seen = set()
    stack = [f for i, (f, _) in enumerate(ctx.next_functions) if i != 1 and f is not None]
    while stack:
        f = stack.pop()
        if f is acc:
            return False
        if f in seen:
            continue
        seen.add(f)
        stack.extend(g for g, _ in f.next_functions if g is not None)
    return True


def default_chunk_size(n_tokens: int, hidden_size: int, vocab_size: int) -> int:
    """Rows per chunk: the larger of Liger-Kernel's rule and a chunk of about 2^23 logits.

    Liger's ``next_pow2(ceil(N / ceil(V / H)))`` makes the chunk's logits about as large as the
    hidden states; on CPU such skinny matmuls (16 rows at GPT-2 sizes) and 64 read-modify-writes of
    the V×H weight-gradient accumulator cost more than the memory they save, so chunks hold at
    least ~2^23 logits (32 MiB in float32; 256 rows at V = 50257). At least 1, at most N.
    """
    ratio = max(1, math.ceil(vocab_size / max(hidden_size, 1)))
    liger = max(1, math.ceil(n_tokens / ratio))
    floor = max(1, math.ceil((1 << 23) / max(vocab_size, 1)))
    rows = max(liger, floor)
    return min(max(1, n_tokens), 1 << (rows - 1).bit_length())


def _to_save(hidden, h):
    # The hidden as given, or its compute-dtype copy. If it is a full, contiguous view of its base
    # (HF's ``last_hidden_state`` is ``ln_f(x).view(shape)``), the base itself: same storage and
    # bytes, but not a view, so backward may reuse it when ownership proves it dead.
    if h.dtype != hidden.dtype or compiling():  # compile: no _base, no reuse
        return h
    base = hidden._base
    if (
        base is not None
        and base.dtype == hidden.dtype
        and base.numel() == hidden.numel()
        and base.is_contiguous()
        and hidden.is_contiguous()
        and hidden.storage_offset() == base.storage_offset() == 0
    ):
        return base
    return hidden


def _cast(t, dtype):
    # a no-op .to() (the same tensor object) as the Function's output: torch 2.11's Dynamo then
    # traced backward with a zero incoming gradient (all gradients 0 under torch.compile)
    return t if t.dtype == dtype else t.to(dtype)


class _LinearCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, bias, target, ignore_index, eps, reduction, chunk, cdt, odt, need, tf
    ):
        # hidden (..., H), target (...) int64; cdt: compute dtype of the matmuls; odt: loss dtype;
        # need: (dh, dW, db) to compute now ('mean'/'sum' under grad mode), or None (recompute);
        # tf: (scale, cap), the logit transform (NOTE [Logit transforms])
        h = hidden.reshape(-1, hidden.shape[-1])
        if h.dtype != cdt:
            h = h.to(cdt)
        w = weight if weight.dtype == cdt else weight.to(cdt)
        b = bias if bias is None or bias.dtype == cdt else bias.to(cdt)
        t = target.reshape(-1)
        ctx.cfg = (ignore_index, eps, reduction, chunk, cdt, hidden.dtype, tuple(hidden.shape))
        ctx.tf = tf
        # the Triton kernels implement the plain logits only: a transform takes the PyTorch path
        # _backend.use_triton(h), read without the call off CUDA (NO_TRITON_OFF_CUDA)
        triton = (
            (h.is_cuda or _backend._resolved[0] not in _backend.NO_TRITON_OFF_CUDA)
            and _backend.use_triton(h)
            and tf == (1.0, None)
        )
        ctx.pre = need is not None
        ctx.wdt, ctx.bdt = weight.dtype, None if bias is None else bias.dtype
        if need is not None:
            # the gradients of the reduced loss (grad_output = 1) now; backward only scales them
            acc = _acc_dtype(cdt)
            valid = t != ignore_index
            zero = torch.zeros((), dtype=acc, device=h.device)
            if reduction == "mean":
                count = valid.sum()
                tok = torch.where(valid, 1.0 / count.to(acc), zero)
            else:
                tok = torch.where(valid, torch.ones((), dtype=acc, device=h.device), zero)
            if triton:
                fwd_grad = _backend.kernels("linear_cross_entropy")._fwd_grad_triton
                loss, dh, dw, db = fwd_grad(h, w, b, t, tok, ignore_index, eps, chunk, need)
            else:
                # dh in hidden's own shape (a base, not a view of an (N, H) buffer), so that the
                # gradient backward returns is a plain tensor the op before may reuse
                dh = torch.empty(hidden.shape, dtype=cdt, device=h.device) if need[0] else None
                flat = dh.view(h.shape) if dh is not None else None
                loss, _, dw, db = _fwd_grad_torch(
                    h, w, b, t, tok, ignore_index, eps, chunk, need, flat, *tf
                )
                del flat
            del w, b, h
            ctx.tie_hidden = False
            out = loss.sum() / count if reduction == "mean" else loss.sum()
            ctx.save_for_backward(dh, dw, db)
            return _cast(out, odt)
        if triton:
            fwd = _backend.kernels("linear_cross_entropy")._fwd_triton
            loss, lse = fwd(h, w, b, t, ignore_index, eps, chunk)
        else:
            loss, lse = _fwd_torch(h, w, b, t, ignore_index, eps, chunk, *tf)
        del w, b
        if reduction == "none":
            out = fresh(loss.to(odt).reshape(target.shape))  # NOTE [Function outputs are not views]
        elif reduction == "sum":
            out = _cast(loss.sum(), odt)
        else:
            out = _cast(loss.sum() / (t != ignore_index).sum(), odt)
        keep = _to_save(hidden, h)
        ctx.tie_hidden = keep is hidden  # NOTE [Anchors only where backward reads no input]
        ctx.save_for_backward(keep, weight, bias, target, lse)
        return out

    # NOTE [Anchors only where backward reads no input]
    # A refused second derivative must stay tied to the inputs (NOTE [Second derivatives] in
    # _autograd.py): differentiating a first derivative with respect to hidden or weight raises
    # slimgrad's error, never a silent None. The precompute path's backward reads only gradients
    # made in forward, so its forward leaves an anchor on each input (make_anchor's node, a few
    # Python calls and an empty tensor each). The recompute path saves weight and bias as given
    # and hidden as given unless _to_save keeps its base (a whole view's) or an autocast copy:
    # _double ties to those saved inputs directly, and an anchor is made only for a hidden that
    # was not saved as itself (``ctx.tie_hidden`` False; a tie to its base would not reach
    # hidden's own node). A plain step (hidden saved as is, no autocast) makes no anchor.

    @staticmethod
    def _double(ctx, grad_out):
        # refused (first derivatives right, differentiating them raises), tied to the inputs'
        # anchors: the gradients precomputed in forward carry no graph of their own
        ctx._no_row_sink = True  # differentiable gradients: every dW row is returned
        with torch.no_grad():
            out = _LinearCrossEntropyFn._first(ctx, grad_out)
        deps = list(getattr(ctx, "_slimgrad_deps", []))
        if not ctx.pre:  # the inputs it saved as given (NOTE [Anchors only where ...])
            hidden, weight, bias = ctx.saved_tensors[:3]
            keep = (hidden if ctx.tie_hidden else None, weight, bias)
            deps += [x for x in keep if x is not None and x.requires_grad]
        if grad_out.requires_grad:
            deps.append(grad_out)
        if not deps:
            return out
        return tuple(
            tie_refusal("ops.linear_cross_entropy", g, *deps) if isinstance(g, torch.Tensor) else g
            for g in out
        )

    @staticmethod
    def backward(ctx, grad_out):
        ownership.check_not_consumed(ctx, _API)
        if ctx.pre:
            # 'mean'/'sum': forward saved the gradients for grad_output = 1; scale them by the
            # incoming scalar, out of place unless ownership grants the saved buffer (never under
            # retain_graph=True, so a second backward reads them intact). take_saved is called
            # here, in backward itself (NOTE [Gradient-buffer ownership]: no helper frames).
            dh, dw, db = ctx.saved_tensors
            hdt, hshape = ctx.cfg[5], ctx.cfg[6]
            need = tuple(ctx.needs_input_grad[:3])
            if (need[0] and dh is None) or (need[1] and dw is None) or (need[2] and db is None):
                raise internal_error(f"{_API}: a gradient needed in backward was not computed")
            gh = gw = gb = None
            # dh comes back as a plain tensor of hidden's shape (not a view), so that the op before
            # may reuse its buffer: the saved dh itself (already in that shape, except from the
            # Triton forward) when ownership grants it, else a fresh one
            if need[0] and dh.dtype == hdt:
                buf = ownership.take_saved(ctx, dh)
                if buf is not None:
                    gh = buf.mul_(grad_out.to(hdt)).detach()
                    gh = gh if gh.shape == hshape else gh.view(hshape)
                else:
                    gh = torch.empty(hshape, dtype=hdt, device=dh.device)
                    torch.mul(dh, grad_out.to(hdt), out=gh.view(dh.shape))
            elif need[0]:
                gh = torch.empty(hshape, dtype=hdt, device=dh.device)
                gh.view(dh.shape).copy_(dh).mul_(grad_out.to(hdt))
            del dh
            if need[1] and dw.dtype == ctx.wdt:
                buf = ownership.take_saved(ctx, dw)
                gw = (
                    buf.mul_(grad_out.to(dw.dtype))
                    if buf is not None
                    else dw * grad_out.to(dw.dtype)
                )
                gw = gw.detach()
            elif need[1]:
                gw = (dw * grad_out.to(dw.dtype)).to(ctx.wdt)
            del dw
            if need[2]:
                gb = (db * grad_out.to(db.dtype)).to(ctx.bdt)
            return gh, gw, gb, None, None, None, None, None, None, None, None, None
        # the per-token gradient ('none') may be overwritten; a scalar's is not worth asking for
        gbuf = ownership.take(grad_out) if ctx.cfg[2] == "none" else None
        hidden, weight, bias, target, lse = ctx.saved_tensors
        ignore_index, eps, reduction, chunk, cdt, hdt, hshape = ctx.cfg
        need = tuple(ctx.needs_input_grad[:3])
        if not (need[0] or need[1] or need[2]):
            return (None,) * 12
        triton = (
            (hidden.is_cuda or _backend._resolved[0] not in _backend.NO_TRITON_OFF_CUDA)
            and _backend.use_triton(hidden)
            and ctx.tf == (1.0, None)
        )
        # NOTE [Head gradient by vocabulary blocks]: in full precision dW by blocks of rows, each
        # complete in turn (one block of logits alive, not chunk x V)
        rows = None
        if (
            need[1]
            and not triton
            and cdt == hdt == weight.dtype
            and (cdt == torch.float32 or cdt == torch.float64)  # == _acc_dtype(cdt)
            and not compiling()
        ):
            rows = vocab_block_rows(hidden.shape[-1])
        # dh may overwrite the saved hidden when nobody else reads it (NOTE [Gradient-buffer
        # ownership]); only when no dtype conversion sits between them, and with one vocabulary
        # block at most (each block reads all of hidden)
        dh_out = (
            ownership.take_saved(ctx, hidden)
            if need[0] and cdt == hdt and (rows is None or rows >= weight.shape[0])
            else None
        )
        h = hidden.reshape(-1, hidden.shape[-1])
        t = target.reshape(-1)
        acc = _acc_dtype(cdt)
        valid = t != ignore_index
        if reduction == "none":
            if gbuf is not None and gbuf.dtype == acc:
                scale = gbuf.reshape(-1).masked_fill_(~valid, 0)
            else:
                scale = grad_out.reshape(-1).to(acc).masked_fill(~valid, 0)
        else:
            g = grad_out if grad_out.dtype == acc else grad_out.to(acc)
            if reduction == "mean":
                g = g / valid.sum()
            scale = torch.where(valid, g, 0.0)
        w = weight if weight.dtype == cdt else weight.to(cdt)
        b = bias if bias is None or bias.dtype == cdt else bias.to(cdt)
        dh_full = None
        if dh_out is None and need[0] and cdt == hdt:
            # dh in hidden's own shape (a base, not a view of an (N, H) result), so the backward
            # before this one may reuse its buffer (ownership refuses views)
            dh_full = torch.empty(hshape, dtype=hdt, device=h.device)
        dh_flat = (
            dh_out.reshape(-1, h.shape[1])
            if dh_out is not None
            else (dh_full.view(-1, h.shape[1]) if dh_full is not None else None)
        )
        if rows is not None:
            take_rows = None
            sink = getattr(weight, ROW_SINK, None)
            if (
                sink is not None
                and not getattr(ctx, "_no_row_sink", False)
                and _weight_grad_only_here(ctx)
            ):
                # a leaf weight that gets no other gradient below this op (an untied head)
                take_rows = sink(weight, ctx.next_functions[1][0])
            if rows >= weight.shape[0] and h.shape[0] <= chunk:  # NOTE [One block, one chunk]
                safe_t = torch.where(valid, t, 0)
                dh, dw, db = _bwd_one_torch(
                    h, w, b, safe_t, lse, scale, eps, need, dh_flat, *ctx.tf, take_rows=take_rows
                )
            else:
                dh, dw, db = _bwd_rows_torch(
                    h,
                    w,
                    b,
                    t,
                    lse,
                    scale,
                    ignore_index,
                    eps,
                    chunk,
                    rows,
                    need,
                    dh_flat,
                    *ctx.tf,
                    take_rows=take_rows,
                )
            del take_rows, sink
        elif triton:
            bwd = _backend.kernels("linear_cross_entropy")._bwd_triton
            dh, dw, db = bwd(h, w, b, t, lse, scale, ignore_index, eps, chunk, need, dh_flat)
        elif compiling():  # NOTE [slimgrad ops under torch.compile]
            # opaque: the joint graph's CSE would keep forward's chunk x V logits
            grads = _bwd_compiled(
                h, w, b, t, lse, scale, ignore_index, float(eps), chunk, list(need), *ctx.tf
            )
            dh, dw, db = (g if n else None for g, n in zip(grads, need, strict=True))
            dh_full = None
        else:
            dh, dw, db = _bwd_torch(
                h, w, b, t, lse, scale, ignore_index, eps, chunk, need, dh_flat, *ctx.tf
            )
        del w, b, h
        if dh is not None:
            # a detached alias when dh is the saved hidden: its storage, not its autograd identity
            if dh_out is not None:
                dh = dh_out.detach()
                dh = dh if dh.shape == hshape else dh.view(hshape)
            elif dh_full is not None:
                dh = dh_full
            else:
                dh = dh.to(hdt).reshape(hshape)
        if dw is not None and dw.dtype != weight.dtype:
            dw = dw.to(weight.dtype)
        if db is not None and db.dtype != bias.dtype:
            db = db.to(bias.dtype)
        return dh, dw, db, None, None, None, None, None, None, None, None, None


@custom_op("linear_cross_entropy_bwd", mutates_args=())
def _bwd_compiled(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    t: torch.Tensor,
    lse: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
    eps: float,
    chunk: int,
    need: list[bool],
    lscale: float,
    cap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # _bwd_torch under torch.compile (NOTE [slimgrad ops under torch.compile]): its recompute of
    # the logits stays inside this op
    grads = _bwd_torch(h, w, b, t, lse, scale, ignore_index, eps, chunk, tuple(need), None,
                       lscale, cap)  # fmt: skip
    return tuple(g if g is not None else h.new_empty(0) for g in grads)


@_bwd_compiled.register_fake
def _(h, w, b, t, lse, scale, ignore_index, eps, chunk, need, lscale, cap):
    acc = _acc_dtype(h.dtype)
    return (
        torch.empty_like(h) if need[0] else h.new_empty(0),
        w.new_empty(w.shape, dtype=acc) if need[1] else h.new_empty(0),
        w.new_empty((w.shape[0],), dtype=acc) if need[2] else h.new_empty(0),
    )


_LinearCrossEntropyFn._first = staticmethod(_LinearCrossEntropyFn.backward)
_LinearCrossEntropyFn.backward = staticmethod(
    first_order("ops.linear_cross_entropy", double=_LinearCrossEntropyFn._double)(
        _LinearCrossEntropyFn._first
    )
)


# NOTE [The fused loss under a mode that stores results]
# The fused loss writes in place into its chunks' logits, fresh products of its own. A dispatch
# mode that stores op results to hand them back later sees those products too: torch's selective
# checkpointing with a policy that saves matmul outputs stored a chunk's logits, the loss then
# overwrote them, and the recompute raised "Tensor cached during selective activation checkpoint
# has been mutated" (which the op read as a bad label: "aten.lt.Scalar encountered during backward
# but not found in storage"), or with ``allow_cache_entry_mutation=True`` got the overwritten
# logits back: every gradient of a converted GPT-2 checkpointed whole under such a policy was
# wrong (up to 0.37 relative; a review). Under any mode that is not known to only read ops
# (``_readers_only`` in ops/linear.py: slimgrad's trackers, fake tensors, the FLOP counter), the
# loss is eager's ops (F.linear, F.cross_entropy: eager's values and bytes).
def _eager_loss(hidden, weight, bias, t, ignore_index, label_smoothing, reduction, tf, odt):
    # The same function with eager ops (torch.func transforms, meta tensors, storing modes):
    # cross_entropy(c tanh(s z / c)), on z in the output dtype (HF's logits.float() where upcast)
    z = F.linear(hidden, weight, bias) * tf[0] if tf[0] != 1.0 else F.linear(hidden, weight, bias)
    if tf[1] is not None:
        z = torch.tanh(z / tf[1]) * tf[1]
    if z.dtype != odt:
        z = z.to(odt)
    loss = F.cross_entropy(
        z.reshape(-1, z.shape[-1]),
        t.reshape(-1),
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction=reduction,
    )
    return loss.reshape(t.shape) if reduction == "none" else loss


def _check(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, chunk_size):
    if not (type(hidden) in _PLAIN or isinstance(hidden, torch.Tensor)) or not (
        type(weight) in _PLAIN or isinstance(weight, torch.Tensor)
    ):
        raise TypeError(
            f"{_API}: hidden and weight must be tensors; expected torch.Tensor, got "
            f"{type(hidden).__name__} and {type(weight).__name__}. Pass tensors."
        )
    if weight.ndim != 2 or hidden.ndim < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{_API}: shapes do not match; expected hidden (..., H) and weight (V, H), got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}. Pass the LM head's weight (V, H)."
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"{_API}: bias has the wrong shape; expected ({weight.shape[0]},), got "
            f"{tuple(bias.shape)}. Pass the head's bias or None."
        )
    if not (type(target) in _PLAIN or isinstance(target, torch.Tensor)) or target.dtype not in (
        torch.int64,
        torch.int32,
    ):
        raise TypeError(
            f"{_API}: target must be class indices; expected an int64 tensor, got "
            f"{getattr(target, 'dtype', type(target).__name__)}. Pass token ids (probabilities "
            "as targets are not supported)."
        )
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"{_API}: target shape must be hidden's without the last dim; expected "
            f"{tuple(hidden.shape[:-1])}, got {tuple(target.shape)}. Flatten both or neither."
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"{_API}: unknown reduction; expected one of {_REDUCTIONS}, got {reduction!r}. "
            "Use 'mean', 'sum' or 'none'."
        )
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(
            f"{_API}: label_smoothing out of range; expected 0 <= label_smoothing <= 1, got "
            f"{label_smoothing}. Pass a value in [0, 1]."
        )
    if chunk_size is not None and (
        (type(chunk_size) is not int and not isinstance(chunk_size, int)) or chunk_size < 1
    ):
        raise ValueError(
            f"{_API}: chunk_size must be a positive int or None; expected >= 1, got "
            f"{chunk_size!r}. Pass None for the default."
        )


def _linear_cross_entropy(
    hidden,
    weight,
    target,
    bias,
    ignore_index,
    label_smoothing,
    reduction,
    chunk_size,
    upcast,
    precompute_grads=False,
    logit_scale=1.0,
    logit_softcap=None,
):
    _check(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, chunk_size)
    ts = type(logit_scale)
    if (ts is not float and ts is not int) and (
        isinstance(logit_scale, bool) or not isinstance(logit_scale, (int, float))
    ):
        raise TypeError(
            f"{_API}: logit_scale must be a number; expected a float, got "
            f"{type(logit_scale).__name__}. Pass a Python float (e.g. config.logit_scale)."
        )
    if logit_scale != 1.0 and not math.isfinite(logit_scale):
        raise ValueError(
            f"{_API}: logit_scale must be finite; expected a finite float, got {logit_scale}. "
            "Pass a finite scale."
        )
    if logit_softcap is not None and (
        isinstance(logit_softcap, bool)
        or not isinstance(logit_softcap, (int, float))
        or not (math.isfinite(logit_softcap) and logit_softcap > 0)
    ):
        raise ValueError(
            f"{_API}: logit_softcap must be a positive finite float or None; expected > 0, got "
            f"{logit_softcap!r}. Pass e.g. config.final_logit_softcapping, or None."
        )
    tf = (float(logit_scale), None if logit_softcap is None else float(logit_softcap))
    dev = hidden.device.type
    # autocast casts only eligible tensors: floating and not float64 (a float64 F.linear runs in
    # float64 under autocast)
    # no autocast state on meta (NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py)
    autocast = (
        not hidden.is_meta
        and torch.is_autocast_enabled(dev)
        and all(
            x.is_floating_point() and x.dtype != torch.float64
            for x in (hidden, weight, bias)
            if x is not None
        )
    )
    if autocast:
        cdt, odt = torch.get_autocast_dtype(dev), torch.float32
    else:
        if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
            raise TypeError(
                f"{_API}: dtypes differ; expected hidden, weight and bias of one dtype, got "
                f"{hidden.dtype}, {weight.dtype}, {None if bias is None else bias.dtype}. Cast "
                "them, or run under torch.autocast."
            )
        cdt = hidden.dtype
        low = cdt in (torch.float16, torch.bfloat16)
        odt = torch.float32 if upcast and low else cdt
    t = target if target.dtype == torch.int64 else target.long()
    # NOTE [torch.func transforms], NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py
    if _functorch_on() or hidden.is_meta:
        return _eager_loss(
            hidden, weight, bias, t, ignore_index, label_smoothing, reduction, tf, odt
        )
    comp = compiling()  # NOTE [One-frame compile check] in slimgrad/_autograd.py
    if not comp and not _readers_only():  # NOTE [The fused loss under a mode that stores results]
        return _eager_loss(
            hidden, weight, bias, t, ignore_index, label_smoothing, reduction, tf, odt
        )
    n, v = t.numel(), weight.shape[0]
    if (
        not comp
        and (_backend._resolved[0] or _backend.get_backend()) not in _backend.NO_TRITON_OFF_CUDA
        and t.device.type == "cpu"
    ):
        # the Triton kernels may run off CUDA (TRITON_INTERPRET) and do not bound-check: the
        # labels are checked up front there (NOTE [Label range without a host sync])
        bad = _bad_labels(t, ignore_index, v)
        if bad is not None:
            raise bad
    if chunk_size is not None:
        chunk = chunk_size
    elif comp:
        chunk = default_chunk_size(n, hidden.shape[-1], v)
    else:
        chunk = _chunk_rows(n, hidden.shape[-1], v)
    grad = torch.is_grad_enabled()
    # 'mean'/'sum' under grad mode: forward computes the gradients too (grad_output is a scalar,
    # applied in backward), so the chunk logits are computed once. Decided here, outside the
    # Function: its forward runs with grad mode off.
    # dW is kept from forward to backward: only when asked (precompute_grads: speed over memory)
    # and no larger than the N×V log-probs eager would keep (V·H <= N·V, i.e. N >= H); else the
    # recompute path (4 matmuls, keeps only hidden + lse).
    need = None
    if precompute_grads and reduction != "none" and grad:
        need = (
            hidden.requires_grad,
            weight.requires_grad,
            bias is not None and bias.requires_grad,
        )
        if not (need[0] or need[1] or need[2]) or (need[1] and n < hidden.shape[-1]):
            need = None
    args = (int(ignore_index), float(label_smoothing), reduction, chunk, cdt, odt, need, tf)
    tracked = grad and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if comp:
        if tracked:
            refuse_jit("ops.linear_cross_entropy")
        if need is None and not autocast:  # NOTE [The fused loss traced under torch.compile]
            loss = (recompute_in_backward if tracked else _call)(
                _loss_traced,
                hidden.reshape(-1, hidden.shape[-1]),
                weight,
                bias,
                t.reshape(-1),
                int(ignore_index),
                float(label_smoothing),
                chunk,
                reduction,
                *tf,
            )
            if reduction == "none":
                loss = loss.reshape(t.shape)
            return loss if loss.dtype == odt else loss.to(odt)
        # Dynamo traces Function.apply (NOTE [slimgrad ops under torch.compile])
        return _LinearCrossEntropyFn.apply(hidden, weight, bias, t, *args)
    if tracked and _jit_tracing():
        refuse_jit("ops.linear_cross_entropy")
    # the inputs' anchors (make_anchor's, grad mode on and nothing compiling or transforming): a
    # refused second derivative stays tied to them even where backward reads only gradients
    # computed in forward (NOTE [Second derivatives] in _autograd.py)
    # NOTE [Anchors only where backward reads no input]: the recompute path saves weight and
    # (usually) hidden themselves, and _double ties to those; an anchor is made only for what it
    # does not save as given (below, after the apply)
    anchors = None
    if (need is not None or autocast) and grad and (hidden.requires_grad or weight.requires_grad):
        anchors = [
            _ANCHOR_APPLY(unwrap_if_dead(x), []) for x in (hidden, weight) if x.requires_grad
        ]
    # the C apply (NOTE [Applying a Function without its Python wrapper] in _autograd.py): not
    # compiling and no transform is active here
    tensors = (
        unwrap_if_dead(hidden),
        unwrap_if_dead(weight),
        None if bias is None else unwrap_if_dead(bias),
        unwrap_if_dead(t),
    )
    try:
        if autocast:
            with torch.autocast(dev, enabled=False):
                loss = _LCE_APPLY(*tensors, *args)
        else:
            loss = _LCE_APPLY(*tensors, *args)
    except RuntimeError as e:
        # NOTE [Label range without a host sync]: a CPU gather refused a label; name it
        bad = _bad_labels(t, ignore_index, v) if t.device.type == "cpu" else None
        if bad is not None:
            raise bad from e
        raise
    node = loss.grad_fn
    if node is not None:
        if anchors is None and hidden.requires_grad and not node.tie_hidden:
            # the saved hidden is its base or a copy: an anchor on hidden itself
            anchors = [_ANCHOR_APPLY(unwrap_if_dead(hidden), [])]
        if anchors:
            node._slimgrad_deps = anchors
    return loss


# NOTE [Label range without a host sync]
# Eager's cross_entropy checks the labels where it reads them: on CPU nll_loss raises "Target 7
# is out of bounds", on CUDA a device-side assert fires, and nothing waits for the device. The
# fused loss reads them the same way: each chunk's forward gathers z[t_i] with the labels as
# indices (ignored tokens mapped to class 0), and torch's CPU gather raises on an index outside
# [0, V), a CUDA gather asserts on the device. So the step asks nothing of the labels up front
# (the old check, ``bool(bad.any())``, was a host sync and 7 ops per call): when the apply raises
# a RuntimeError on CPU, the labels are checked then, and an out-of-range one becomes slimgrad's
# ValueError naming it (any other error is re-raised as it was). The Triton kernels do not bound-
# check their loads: off CUDA (TRITON_INTERPRET, tests) the labels are checked before the apply,
# as before; on CUDA they are the kernels' to check (eager's device assert). Under torch.compile
# and on fake tensors there is nothing to check (no values).


def _call(fn, *args):
    return fn(*args)


def _bad_labels(t, ignore_index, v):
    # the ValueError naming the first label outside [0, v) that is not ignore_index, or None
    if not t.numel() or _fake(t):
        return None
    bad = (t != ignore_index) & ((t < 0) | (t >= v))
    if not bool(bad.any()):
        return None
    return ValueError(
        f"{_API}: target out of range; expected class indices in [0, {v}) or "
        f"ignore_index={ignore_index}, got {int(t[bad][0])}. Check the labels and the "
        "vocabulary size."
    )


_LCE_APPLY = direct_apply(_LinearCrossEntropyFn)
_functorch_on = torch._C._are_functorch_transforms_active
_jit_tracing = torch._C._is_tracing
_is_functional = torch._is_functional_tensor
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _fake(t: torch.Tensor) -> bool:
    # is_fake(t), a plain tensor's answer in two C checks (a functional or functorch wrapper is
    # asked in full)
    if type(t) is not torch.Tensor or _is_functional(t) or _functorch_wrapped(t):
        return is_fake(t)
    return False


_CHUNKS: dict[tuple[int, int, int], int] = {}


def _chunk_rows(n: int, hidden_size: int, vocab_size: int) -> int:
    # default_chunk_size, computed once per shape (a training loop sees a handful); a traced
    # size (torch.jit.trace's numel) is not kept
    if type(n) is not int:
        return default_chunk_size(n, hidden_size, vocab_size)
    key = (n, hidden_size, vocab_size)
    try:
        return _CHUNKS[key]
    except KeyError:
        pass
    if len(_CHUNKS) >= 256:
        _CHUNKS.clear()
    rows = _CHUNKS[key] = default_chunk_size(n, hidden_size, vocab_size)
    return rows


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
    precompute_grads: bool = False,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), target, ...)`` without keeping the logits.

    loss_i = lse_i − (1 − ε)·y_{i,t_i} − (ε/V)·Σ_j y_ij with y = z·s (``logit_scale``), then
    y = c·tanh(y / c) if ``logit_softcap`` c is given, and z = hidden Wᵀ + b: the loss of
    ``cross_entropy(c * tanh(s * linear(hidden, W, b) / c), target)``, HF's Cohere/Granite logit
    scaling and Gemma2/3 final-logit soft-capping (NOTE [Logit transforms]). Ignored tokens
    contribute 0 and are not counted by 'mean' (all ignored: NaN, like torch).

    Memory: by default saves hidden + lse (4 B/token) + target and recomputes each chunk's logits
    in backward (4 matmuls where eager does 3); with ``precompute_grads=True`` ('mean'/'sum',
    N >= H) saves dh + dW (V×H float32, parameter-sized) + db computed in forward (3 matmuls, as
    fast as eager, but dW lives from forward to backward); eager saves hidden + the N×V log-probs.

    Args:
        hidden: (..., H) hidden states (the LM head's input).
        weight: (V, H) head weight (may be tied to the embedding; its grad accumulates there).
        target: (...) int64 class indices.
        bias: optional (V,) head bias.
        ignore_index: target value that contributes no loss and no gradient.
        label_smoothing: ε in [0, 1], as torch's cross_entropy.
        reduction: 'mean', 'sum' or 'none' (then the result has target's shape).
        chunk_size: tokens per chunk; None picks :func:`default_chunk_size`.
        precompute_grads: compute the gradients in forward (speed over memory; see Memory).
        logit_scale: s, multiplies the logits (1: none). Granite's ``logits / logits_scaling``
            is ``logit_scale=1 / logits_scaling``.
        logit_softcap: c > 0, soft-caps the scaled logits to (-c, c); None: none.

    Returns:
        The loss: a scalar, or per-token losses for reduction='none' (float32 under autocast).

    Raises:
        ValueError: shapes, reduction, label_smoothing, chunk_size, logit_softcap or a target
            out of range.
        TypeError: non-integer target, non-number logit_scale, or dtypes that differ outside
            autocast.

    Example:
        >>> h = torch.randn(4, 16, 32, requires_grad=True)
        >>> w = torch.randn(101, 32, requires_grad=True)
        >>> t = torch.randint(0, 101, (4, 16))
        >>> linear_cross_entropy(h, w, t).backward()
    """
    if not (
        type(hidden) in _PLAIN
        and type(weight) in _PLAIN
        and type(target) in _PLAIN
        and (bias is None or type(bias) in _PLAIN)
    ):  # a plain tensor is no DTensor: refuse() only for the others
        _dtensor.refuse(
            "slimgrad.ops.linear_cross_entropy",
            hidden=hidden,
            weight=weight,
            target=target,
            bias=bias,
        )
    return _linear_cross_entropy(
        hidden,
        weight,
        target,
        bias,
        ignore_index,
        label_smoothing,
        reduction,
        chunk_size,
        False,
        precompute_grads,
        logit_scale,
        logit_softcap,
    )


def causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,
    chunk_size: int | None = None,
    precompute_grads: bool = False,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """The HF causal-LM loss (``transformers.loss.loss_utils.ForCausalLMLoss``) from hidden states.

    Same result as ``ForCausalLMLoss(lm_head(hidden), labels, V)``: tokens < n predict token n, so
    the labels are shifted left by one and padded with ``ignore_index`` (the hidden states are not
    sliced: the last position is simply ignored); the loss is float32 ('mean' over non-ignored
    tokens, or 'sum' / ``num_items_in_batch`` when that is given). This is the helper convert_ uses
    for HF ``*ForCausalLM`` models (with ``weight = lm_head.weight``, tied to the embedding in
    GPT-2).

    Memory: as :func:`linear_cross_entropy` (the B·T×V logits are never materialized; the model
    must not be asked to return logits).

    Args:
        hidden: (B, T, H) last hidden states (after the final norm).
        weight: (V, H) LM head weight.
        labels: (B, T) token ids, ``ignore_index`` where no loss is wanted (unshifted, as HF takes).
        bias: optional LM head bias.
        ignore_index: as HF (-100).
        num_items_in_batch: HF's gradient-accumulation normaliser; None for the mean.
        shift_labels: already shifted labels (HF's ``shift_labels`` kwarg); then ``labels`` is
            ignored.
        chunk_size, precompute_grads, logit_scale, logit_softcap: see
            :func:`linear_cross_entropy`.

    Returns:
        Scalar float32 loss.
    """
    if not (
        type(hidden) in _PLAIN
        and type(weight) in _PLAIN
        and type(labels) in _PLAIN
        and (bias is None or type(bias) in _PLAIN)
    ):  # a plain tensor is no DTensor: refuse() only for the others
        _dtensor.refuse(
            "slimgrad.ops.causal_lm_loss", hidden=hidden, weight=weight, labels=labels, bias=bias
        )
    if shift_labels is None:
        if labels.ndim and labels.shape[-1]:
            # HF's pad (0, 1) then [..., 1:].contiguous() in one op: a negative pad crops
            shift_labels = torch.constant_pad_nd(labels, (-1, 1), ignore_index)
        else:
            padded = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = padded[..., 1:].contiguous()
    if shift_labels.device != hidden.device:
        shift_labels = shift_labels.to(hidden.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = _linear_cross_entropy(
        hidden,
        weight,
        shift_labels,
        bias,
        ignore_index,
        0.0,
        reduction,
        chunk_size,
        True,
        precompute_grads,
        logit_scale,
        logit_softcap,
    )
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss
