"""Host floor (issue 32): the step time any library with one Python autograd Function per op pays,
next to slimgrad's and to per-block activation checkpointing, on the host-overhead proxy's models.

# NOTE [Host floor]
How low the host-overhead proxy's converted / eager step time (NOTE [Host overhead proxy] in
``cases/host_overhead.py``: tiny models, where a step's time is the host's Python and dispatch) can
go for any design that puts a Python ``torch.autograd.Function`` per op (slimgrad, Liger, Apex's
Python-level ops), next to what per-block checkpointing costs and keeps. Each model (the proxy's
``build_model``, same sizes) runs as these variants of one set of weights:

- ``eager``: the model as built;
- ``slimgrad``: ``slimgrad.convert_`` of a copy (today's conversion);
- ``floor``: the *pass-through floor*: every module ``convert_`` replaces (found by converting a
  copy and comparing module classes by qualified name, plus HF attention and the HF loss when the
  report says they converted) instead runs one minimal autograd Function: forward calls the ATen
  op eager's kernel runs (``native_layer_norm``, ``_fused_rms_norm``, ``addmm``/``linear``,
  ``gelu(approximate='tanh')``, ``silu``, ``native_dropout``, ``convolution``,
  ``native_batch_norm``, ``relu_``, ``_scaled_dot_product_flash_attention_for_cpu`` or the math
  attention with dropout, ``_log_softmax`` + ``nll_loss_forward``), saves what eager saves, and
  backward calls the matching ATen backward ops; no other logic. A container slimgrad replaces
  whole (Llama's MLP) keeps eager's forward, with its converted children at the floor;
- ``floor_direct``: ``floor`` with each Function applied through the C ``_FunctionBase.apply``
  instead of the Python classmethod ``Function.apply`` around it (what slimgrad's ops do in
  eager, NOTE [Applying a Function without its Python wrapper]): the lowest a Python Function
  per op goes;
- ``floor_ckpt``: ``floor`` plus non-reentrant ``torch.utils.checkpoint`` on every transformer
  block (HF's ``activation_checkpointing_enable()``) or ResNet bottleneck;
- ``eager_ckpt``: eager with the same checkpointing: the peer a user takes instead of slimgrad;
- ``slimgrad, <kind> at floor_direct`` (the attribution): ``convert_`` leaving one kind of
  module out (``filter_fn``; ``attention``: the slimgrad attention swapped for the floor's;
  ``loss``: ``fused_loss=False`` with the LM head left out), every module the full conversion
  replaces and this one did not running at ``floor_direct``. ``slimgrad``'s ratio (or calls)
  minus this one's is that kind's logic above the floor (``above_floor.by_kind``; neighbour
  patterns such as BatchNorm + ReLU go with the kind, and a container kind such as Llama's MLP
  takes its children with it); ``above_floor`` itself is ``slimgrad`` minus ``floor_direct``.

Per variant: ``time_ratio`` (median over rounds of variant / eager step time; each round runs
every variant once, in a seeded shuffled order, each step timed by ``time.thread_time`` under
``torch.set_num_threads(1)``, forward + backward + ``grad = None``) with quartiles; ``step_ms``;
``python_calls`` (cProfile, deterministic); ``aten_ops``. ``load`` holds ``os.getloadavg()``
before and after the timing.

Memory (``memory_tiny``, ``memory_at_scale``): ``peak_bytes``, ``saved_bytes``,
``retained_bytes`` (live bytes at the end of forward: what checkpointing keeps, its block inputs
included, shows here, not in ``saved_bytes``) of each of ``MAIN_VARIANTS`` from
``slimgrad.memory``:
``measure`` at the tiny sizes (after one step), ``estimate`` (fake tensors, the same figures
without computing) at a realistic size: HF GPT-2 small at 4x256 tokens, HF Llama 4 layers x 256
wide at 4x128, ResNet-50 at 8x3x224x224. ``floor_grad_err``: the largest
``|floor grad - eager grad| / max|eager grad|`` over parameters, dropout off (a sanity check of
the pass-through Functions).

Run it with ``slimgrad bench host_floor`` (records: ``benchmarks/results/host_floor.jsonl``).
``small=True`` (the tests) runs 2-layer models, 2 rounds and the tiny sizes only.
"""

from __future__ import annotations

import copy
import os
import random
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch
import torch.nn.functional as F

from slimgrad.bench import harness
from slimgrad.bench.cases import host_overhead as _ho

MODELS = _ho.MODELS
FLOOR_ATTENTION = "slimgrad_host_floor"
MAIN_VARIANTS = ("eager", "slimgrad", "floor", "floor_direct", "floor_ckpt", "eager_ckpt")
_aten = torch.ops.aten  # backward ops: their ``.default`` overloads (not in ``torch.``)


# ------------------------------------------------------------------------- the floor's Functions
class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_b = b is not None
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = gw = gb = None
        g2 = g.reshape(-1, g.shape[-1])
        if ctx.needs_input_grad[0]:
            gx = g.matmul(w)
        if ctx.needs_input_grad[1]:
            gw = g2.t().mm(x.reshape(-1, x.shape[-1]))
        if ctx.has_b and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb


class _Conv1D(torch.autograd.Function):  # transformers' Conv1D: addmm(bias, x, weight)
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return torch.addmm(b, x.view(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[1])

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = g2.mm(w.t()).view(x.shape)
        if ctx.needs_input_grad[1]:
            gw = x.reshape(-1, x.shape[-1]).t().mm(g2)
        if ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, shape, eps):
        y, mean, rstd = torch.native_layer_norm(x, shape, w, b, eps)
        ctx.save_for_backward(x, mean, rstd, w, b)
        ctx.shape = shape
        return y

    @staticmethod
    def backward(ctx, g):
        x, mean, rstd, w, b = ctx.saved_tensors
        n = ctx.needs_input_grad
        gx, gw, gb = _aten.native_layer_norm_backward.default(
            g, x, ctx.shape, mean, rstd, w, b, [n[0], n[1], n[2]]
        )
        return gx, gw, gb, None, None


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        y, rstd = torch._fused_rms_norm(x, [x.shape[-1]], w, eps)
        ctx.save_for_backward(x, rstd, w)
        return y

    @staticmethod
    def backward(ctx, g):
        # torch 2.13 has no CPU kernel for _fused_rms_norm_backward: its formula in five ops
        x, rstd, w = ctx.saved_tensors
        xhat = x * rstd
        gw = (g * xhat).reshape(-1, x.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        gxhat = g * w
        gx = (gxhat - xhat * (gxhat * xhat).mean(-1, keepdim=True)).mul_(rstd)
        return gx, gw, None


class _GELUTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.gelu(x, approximate="tanh")

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return _aten.gelu_backward.default(g, x, approximate="tanh")


class _SiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.silu(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return _aten.silu_backward.default(g, x)


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p):
        y, mask = torch.native_dropout(x, p, True)
        ctx.save_for_backward(mask)
        ctx.scale = 1.0 / (1.0 - p)
        return y

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return _aten.native_dropout_backward.default(g, mask, ctx.scale), None


class _Conv2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, stride, padding, dilation, groups):
        ctx.save_for_backward(x, w)
        ctx.args = (stride, padding, dilation, groups, None if b is None else [b.shape[0]])
        return torch.convolution(x, w, b, stride, padding, dilation, False, [0, 0], groups)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        stride, padding, dilation, groups, bias_sizes = ctx.args
        n = ctx.needs_input_grad
        gx, gw, gb = _aten.convolution_backward.default(
            g, x, w, bias_sizes, stride, padding, dilation, False, [0, 0], groups,
            [n[0], n[1], bias_sizes is not None and n[2]],
        )  # fmt: skip
        return gx, gw, gb, None, None, None, None


class _BatchNorm(torch.autograd.Function):  # training mode only
    @staticmethod
    def forward(ctx, x, w, b, running_mean, running_var, momentum, eps):
        y, mean, invstd = torch.native_batch_norm(
            x, w, b, running_mean, running_var, True, momentum, eps
        )
        ctx.save_for_backward(x, w, mean, invstd)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, mean, invstd = ctx.saved_tensors
        n = ctx.needs_input_grad
        gx, gw, gb = _aten.native_batch_norm_backward.default(
            g, x, w, None, None, mean, invstd, True, ctx.eps, [n[0], n[1], n[2]]
        )
        return gx, gw, gb, None, None, None, None


class _ReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, inplace):
        if inplace:
            y = torch.relu_(x)
            ctx.mark_dirty(x)
        else:
            y = torch.relu(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return _aten.threshold_backward.default(g, y, 0), None


class _FlashAttention(torch.autograd.Function):  # eager SDPA's CPU kernel: no mask, no dropout
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        out, lse = torch._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse = ctx.saved_tensors
        gq, gk, gv = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            g, q, k, v, out, lse, 0.0, ctx.causal, scale=ctx.scale
        )
        return gq, gk, gv, None, None


class _MathAttention(torch.autograd.Function):  # eager SDPA's math path (dropout or a mask)
    @staticmethod
    def forward(ctx, q, k, v, mask, p, causal, scale):
        s = q.matmul(k.transpose(-2, -1)).mul_(scale)
        if causal:
            t, u = s.shape[-2:]
            s.masked_fill_(torch.ones(t, u, dtype=torch.bool).triu_(u - t + 1), float("-inf"))
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
        a = torch.softmax(s, -1)
        keep = None
        ad = a
        if p > 0:
            ad, keep = torch.native_dropout(a, p, True)
        ctx.save_for_backward(q, k, v, a, ad, keep)
        ctx.p, ctx.scale = p, scale
        return ad.matmul(v)

    @staticmethod
    def backward(ctx, g):
        q, k, v, a, ad, keep = ctx.saved_tensors
        gv = ad.transpose(-2, -1).matmul(g)
        ga = g.matmul(v.transpose(-2, -1))
        if keep is not None:
            ga = _aten.native_dropout_backward.default(ga, keep, 1.0 / (1.0 - ctx.p))
        gs = torch._softmax_backward_data(ga, a, -1, a.dtype).mul_(ctx.scale)
        return gs.matmul(k), gs.transpose(-2, -1).matmul(q), gv, None, None, None, None


class _CrossEntropy(torch.autograd.Function):  # F.cross_entropy's two ATen ops, mean or sum
    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction):
        lsm = torch._log_softmax(logits, 1, False)
        loss, total = _aten.nll_loss_forward.default(lsm, target, None, reduction, ignore_index)
        ctx.save_for_backward(lsm, target, total)
        ctx.args = (reduction, ignore_index)
        return loss

    @staticmethod
    def backward(ctx, g):
        lsm, target, total = ctx.saved_tensors
        reduction, ignore_index = ctx.args
        gl = _aten.nll_loss_backward.default(g, lsm, target, None, reduction, ignore_index, total)
        return torch._log_softmax_backward_data(gl, lsm, 1, lsm.dtype), None, None, None


# ------------------------------------------------------------------ installing the floor on a model
_FUNCTIONS = (
    _Linear, _Conv1D, _LayerNorm, _RMSNorm, _GELUTanh, _SiLU, _Dropout, _Conv2d, _BatchNorm, _ReLU,
    _FlashAttention, _MathAttention, _CrossEntropy,
)  # fmt: skip
#: each Function's ``apply``: the Python classmethod ``torch.autograd.Function.apply``
_APPLY = {f: f.apply for f in _FUNCTIONS}
#: the C ``_FunctionBase.apply`` bound to each Function, without that Python wrapper (what
#: ``slimgrad._autograd.direct_apply`` gives slimgrad's ops in eager)
_DIRECT = {f: torch._C._FunctionBase.__dict__["apply"].__get__(None, f) for f in _FUNCTIONS}


def _floor_forward(m: torch.nn.Module, direct: bool = False) -> Callable:
    A = _DIRECT if direct else _APPLY
    kind = type(m).__name__
    if kind == "Linear":
        return lambda x: A[_Linear](x, m.weight, m.bias)
    if kind == "Conv1D":
        return lambda x: A[_Conv1D](x, m.weight, m.bias)
    if kind == "LayerNorm":
        shape, eps = list(m.normalized_shape), m.eps
        return lambda x: A[_LayerNorm](x, m.weight, m.bias, shape, eps)
    if kind == "LlamaRMSNorm":
        eps = m.variance_epsilon
        return lambda x: A[_RMSNorm](x, m.weight, eps)
    if kind == "NewGELUActivation":
        return A[_GELUTanh]
    if kind == "SiLUActivation":
        return A[_SiLU]
    if kind == "ReLU":
        inplace = m.inplace
        return lambda x: A[_ReLU](x, inplace)
    if kind == "Dropout":
        orig = m.forward

        def dropout(x):
            if not m.training or m.p == 0:
                return orig(x)
            return A[_Dropout](x, m.p)

        return dropout
    if kind == "Conv2d":
        if m.padding_mode != "zeros" or isinstance(m.padding, str):
            raise NotImplementedError(f"host_floor: no floor for {m}")
        args = (list(m.stride), list(m.padding), list(m.dilation), m.groups)
        return lambda x: A[_Conv2d](x, m.weight, m.bias, *args)
    if kind == "BatchNorm2d":
        orig = m.forward

        def batch_norm(x):
            if not (m.training and m.track_running_stats):
                return orig(x)
            m.num_batches_tracked.add_(1)
            mom = 1.0 / float(m.num_batches_tracked) if m.momentum is None else m.momentum
            return A[_BatchNorm](x, m.weight, m.bias, m.running_mean, m.running_var, mom, m.eps)

        return batch_norm
    raise NotImplementedError(
        f"slimgrad.bench host_floor: slimgrad converts {kind}, which has no pass-through floor "
        "here; expected one of the floor's module kinds. Add its Function to host_floor.py."
    )


def _floor_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, A=None,
    **kw,
):  # fmt: skip
    A = A or _APPLY
    # transformers' sdpa_attention_forward without its branches for caches, NPUs and tracing
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    if attention_mask is None and dropout == 0.0:
        out = A[_FlashAttention](query, key, value, is_causal, scaling)
    else:
        groups = getattr(module, "num_key_value_groups", 1)
        if groups > 1:
            key = key.repeat_interleave(groups, 1)
            value = value.repeat_interleave(groups, 1)
        out = A[_MathAttention](query, key, value, attention_mask, dropout, is_causal, scaling)
    return out.transpose(1, 2).contiguous(), None


def _floor_loss(
    logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
    A=None, **kw,
):  # fmt: skip
    A = A or _APPLY
    # transformers' ForCausalLMLoss with the cross-entropy as one Function
    logits = logits.float()
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    logits = logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1).to(logits.device)
    reduction = 1 if num_items_in_batch is None else 2
    loss = A[_CrossEntropy](logits, shift_labels, ignore_index, reduction)
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def _floor_attention_direct(*args, **kwargs):
    return _floor_attention(*args, A=_DIRECT, **kwargs)


def _floor_loss_direct(*args, **kwargs):
    return _floor_loss(*args, A=_DIRECT, **kwargs)


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(FLOOR_ATTENTION, _floor_attention)
    AttentionInterface.register(FLOOR_ATTENTION + "_direct", _floor_attention_direct)


def _lm_head_name(model: torch.nn.Module) -> str | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    return next((n for n, m in model.named_modules() if m is head), None) if head else None


def converted(model: torch.nn.Module) -> dict[str, Any]:
    """What ``slimgrad.convert_`` replaces in ``model`` (converting a copy): ``modules`` (qualified
    name -> eager class name), ``attention`` and ``loss`` (bools)."""
    import slimgrad

    conv = slimgrad.convert_(copy.deepcopy(model))
    eager = dict(model.named_modules())
    mods = {}
    for name, m in conv.named_modules():
        o = eager.get(name)
        if o is not None and type(o) is not type(m) and type(m).__module__.startswith("slimgrad."):
            mods[name] = type(o).__name__
    rows = slimgrad.report(conv).converted
    return {
        "modules": mods,
        "attention": any(" attention (" in kind for _, kind, _ in rows),
        "loss": any("loss" in what for _, _, what in rows),
    }


def floor_(
    model: torch.nn.Module, plan: dict[str, Any], names=None, attention=None, loss=None,
    direct: bool = False,
):  # fmt: skip
    """Put the modules of ``plan["modules"]`` (or those of ``names``) of ``model`` at the floor, and
    its attention and loss when asked (by default: when ``plan`` says slimgrad converts them);
    modules that are slimgrad's already and containers are left as they are."""
    leaves = {k for k in plan["modules"].values() if k not in ("LlamaMLP", "GPT2MLP")}
    names = plan["modules"] if names is None else names
    for name, m in model.named_modules():
        if (
            name in names
            and type(m).__name__ in leaves
            and not type(m).__module__.startswith("slimgrad.")
        ):
            m.forward = _floor_forward(m, direct)
    if plan["attention"] if attention is None else attention:
        _register_attention()
        model.config._attn_implementation = FLOOR_ATTENTION + ("_direct" if direct else "")
    if plan["loss"] if loss is None else loss:
        model.loss_function = _floor_loss_direct if direct else _floor_loss
    return model


def checkpoint_blocks_(model: torch.nn.Module) -> torch.nn.Module:
    """Per-block non-reentrant checkpointing: HF's ``activation_checkpointing_enable()``, or every
    ResNet ``Bottleneck`` through ``torch.utils.checkpoint``."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable()
        return model
    from torch.utils.checkpoint import checkpoint

    n = 0
    for m in model.modules():
        if type(m).__name__ == "Bottleneck":
            m.forward = lambda x, _f=m.forward: checkpoint(_f, x, use_reentrant=False)
            n += 1
    if not n:
        raise NotImplementedError("slimgrad.bench host_floor: no block to checkpoint")
    return model


def kinds(plan: dict[str, Any], lm_head: str | None) -> list[str]:
    """The attribution's kinds: ``attention``, ``loss`` and each converted module class (the LM head
    goes with ``loss`` when the loss is fused)."""
    out = [k for k in ("attention", "loss") if plan[k]]
    for name, k in plan["modules"].items():
        if not (plan["loss"] and name == lm_head) and k not in out:
            out.append(k)
    return out


def _leave_out(kind: str, head: str | None) -> Callable[[torch.nn.Module, str], bool]:
    # convert_'s filter_fn: every module but those of class ``kind`` (the fused loss's head stays)
    return lambda m, name: type(m).__name__ != kind or name == head


def main_variant(eager: torch.nn.Module, v: str, plan: dict[str, Any]) -> torch.nn.Module:
    """One of ``MAIN_VARIANTS`` of ``eager`` (a copy; ``eager`` itself for ``"eager"``)."""
    import slimgrad

    if v == "eager":
        return eager
    m = copy.deepcopy(eager)
    if v == "slimgrad":
        return slimgrad.convert_(m)
    if v.startswith("floor"):
        floor_(m, plan, direct=v == "floor_direct")
    return checkpoint_blocks_(m) if v.endswith("_ckpt") else m


def variants(eager: torch.nn.Module, attribution: bool = True) -> dict[str, torch.nn.Module]:
    """The NOTE's variants of ``eager`` (copies; ``eager`` itself is the first)."""
    import slimgrad

    plan = converted(eager)
    head = _lm_head_name(eager)
    out = {v: main_variant(eager, v, plan) for v in MAIN_VARIANTS}
    if not attribution:
        return out
    for kind in kinds(plan, head):
        m = copy.deepcopy(eager)
        if kind == "attention":
            slimgrad.convert_(m)
            floor_(m, plan, names=(), attention=True, loss=False, direct=True)
        else:
            if kind == "loss":
                cfg = slimgrad.ConvertConfig(fused_loss=False)
                slimgrad.convert_(m, cfg, filter_fn=lambda mod, n: n != head)
            else:
                slimgrad.convert_(m, filter_fn=_leave_out(kind, head if plan["loss"] else None))
            floor_(m, plan, attention=False, loss=kind == "loss", direct=True)
        out[f"slimgrad, {kind} at floor_direct"] = m
    return out


# --------------------------------------------------------------------------------- measurements
def _timed(models: dict[str, torch.nn.Module], loss_fn, rounds: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    names = list(models)
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds):
        order = names[:]
        rng.shuffle(order)
        for n in order:
            t0 = time.thread_time()
            _ho._step(models[n], loss_fn)
            times[n].append((time.thread_time() - t0) * 1e3)
    out = {}
    for n in names:
        ratios = [t / max(e, 1e-9) for t, e in zip(times[n], times["eager"], strict=True)]
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
        out[n] = {
            "step_ms": statistics.median(times[n]),
            "time_ratio": statistics.median(ratios),
            "time_ratio_q1": q[0],
            "time_ratio_q3": q[2],
            "time_ratio_min": min(ratios),
            "time_ratio_max": max(ratios),
        }
    return out


def _grad_err(eager: torch.nn.Module, floor: torch.nn.Module, loss_fn) -> float:
    # dropout off on both sides (same modules, same weights), one step each
    def grads(m):
        saved = [(d, d.p) for d in m.modules() if isinstance(d, torch.nn.Dropout)]
        cfg = getattr(m, "config", None)
        attn = getattr(cfg, "attn_pdrop", None)
        for d, _ in saved:
            d.p = 0.0
        if attn is not None:
            cfg.attn_pdrop = 0.0
        try:
            loss_fn(m).backward()
        finally:
            for d, p in saved:
                d.p = p
            if attn is not None:
                cfg.attn_pdrop = attn
        g = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        for p in m.parameters():
            p.grad = None
        return g

    ge, gf = grads(eager), grads(floor)
    err = 0.0
    for n, g in ge.items():
        f = gf.get(n)
        if f is None:  # a parameter without a gradient on one side only
            return float("inf")
        err = max(err, float((f - g).abs().max() / g.abs().max().clamp_min(1e-30)))
    return err


def _memory_row(m: torch.nn.Module, loss_fn) -> dict[str, int]:
    from slimgrad import memory

    _ho._step(m, loss_fn)  # caches out of the measured step
    r = memory.measure(lambda: loss_fn(m), module=m, timeline=False)
    return {"peak_bytes": r.peak_bytes, "saved_bytes": r.saved_bytes,
            "retained_bytes": r.retained_bytes}  # fmt: skip


def _realistic(name: str) -> tuple[torch.nn.Module, Callable, str]:
    if name == "hf_gpt2":
        m, lf = _ho._hf("hf_gpt2", layers=12, width=768, seq=256, batch=4, full=True)
        return m, lf, "HF GPT-2 small (default config), 4x256 tokens"
    if name == "hf_llama":
        m, lf = _ho._hf("hf_llama", layers=4, width=256, seq=128, batch=4)
        return m, lf, "HF Llama 4 layers x 256 wide (GQA 4/2 heads), 4x128 tokens"
    from slimgrad.bench import models

    net = models.resnet50(num_classes=1000)
    x = torch.randn(8, 3, 224, 224)
    y = torch.randint(0, 1000, (8,))
    return net, lambda mm: F.cross_entropy(mm(x), y), "ResNet-50, 8x3x224x224"


def memory_at_scale(name: str) -> dict[str, Any]:
    """Peak, saved and retained bytes of the main variants at the realistic size, by
    ``slimgrad.memory.estimate`` (fake tensors)."""
    from slimgrad import memory

    out: dict[str, Any] = {}
    for v in MAIN_VARIANTS:

        def make(v=v):
            torch.manual_seed(0)
            m, lf, what = _realistic(name)
            m.train()
            out["size"] = what
            if v != "eager":
                m = main_variant(m, v, converted(m))
            return (lambda: lf(m)), m

        r = memory.estimate(make, timeline=False)
        out[v] = {"peak_bytes": r.peak_bytes, "saved_bytes": r.saved_bytes,
                  "retained_bytes": r.retained_bytes}  # fmt: skip
    return out


def measure(name: str, *, rounds: int = 40, small: bool = False) -> dict[str, Any]:
    """One model's figures (NOTE [Host floor])."""
    torch.manual_seed(0)
    eager, loss_fn = _ho.build_model(name, small)
    eager.train()
    models = variants(eager)
    for m in models.values():  # lazy set-up out of the timed steps
        for _ in range(2):
            _ho._step(m, loss_fn)
    load0 = os.getloadavg()
    timed = _timed(models, loss_fn, rounds)
    load1 = os.getloadavg()
    rec: dict[str, Any] = {"model": name, "rounds": rounds, "load": [load0[0], load1[0]]}
    ecalls, eops = _ho._calls(eager, loss_fn), _ho._ops(eager, loss_fn)
    out = {}
    for v, m in models.items():
        calls, ops = _ho._calls(m, loss_fn), _ho._ops(m, loss_fn)
        out[v] = {**timed[v], "python_calls": calls, "python_calls_ratio": calls / ecalls,
                  "aten_ops": ops, "aten_ops_ratio": ops / eops}  # fmt: skip
    rec["variants"] = out
    a, b = out["slimgrad"], out["floor_direct"]
    rec["above_floor"] = {  # slimgrad's ops run without Function.apply's wrapper: floor_direct
        "time_ratio": a["time_ratio"] - b["time_ratio"],
        "python_calls": a["python_calls"] - b["python_calls"],
        "by_kind": {
            v.split(", ", 1)[1].removesuffix(" at floor_direct"): {
                "time_ratio": a["time_ratio"] - r["time_ratio"],
                "python_calls": a["python_calls"] - r["python_calls"],
            }
            for v, r in out.items()
            if v.startswith("slimgrad, ")
        },
    }
    rec["floor_grad_err"] = _grad_err(eager, models["floor"], loss_fn)
    rec["memory_tiny"] = {v: _memory_row(models[v], loss_fn) for v in MAIN_VARIANTS}
    return rec


def _table(records: list[dict]) -> str:
    lines = []
    for r in records:
        lines.append(
            f"{r['model']} ({r['rounds']} rounds, load {r['load'][0]:.1f}..{r['load'][1]:.1f}; "
            f"floor grad err {r['floor_grad_err']:.1e})"
        )
        lines.append(f"  {'variant':<34} {'time ratio':>10} {'middle half':>15} {'calls':>8}")
        e = r["variants"]["eager"]["python_calls"]
        for v, x in r["variants"].items():
            lines.append(
                f"  {v:<34} {x['time_ratio']:>10.3f} "
                f"{x['time_ratio_q1']:>7.3f}..{x['time_ratio_q3']:<6.3f} "
                f"{x['python_calls']:>8,} ({x['python_calls'] / e:.2f}x)"
            )
        for where in ("memory_tiny", "memory_at_scale"):
            mem = r.get(where)
            if mem:
                lines.append(f"  {where}" + (f": {mem['size']}" if "size" in mem else ""))
                for v in MAIN_VARIANTS:
                    lines.append(
                        f"    {v:<12} peak {mem[v]['peak_bytes']:>14,}  saved "
                        f"{mem[v]['saved_bytes']:>14,}  retained {mem[v]['retained_bytes']:>14,}"
                    )
    return "\n".join(lines)


def run(
    *, device="cpu", dtype=torch.float32, small=False, repeat=40, warmup=2, grad_check=False,
    out_dir=None, seed=0, progress=None,
) -> dict[str, Any]:  # fmt: skip
    """The case's runner: every model of ``MODELS``; one record (appended to
    ``out_dir/host_floor.jsonl`` when given)."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        raise ValueError(
            "slimgrad.bench host_floor: the host-floor proxy runs on CPU in float32; "
            f"expected device='cpu', dtype=float32, got device={device!r}, dtype={dtype}. Run it "
            "without --device/--dtype."
        )
    say = progress or (lambda msg: None)
    commit = harness.git_commit()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        records = []
        for name in MODELS:
            say(name)
            rec = measure(name, rounds=2 if small else max(repeat, 5), small=small)
            if not small:
                say(f"{name}: memory at a realistic size")
                rec["memory_at_scale"] = memory_at_scale(name)
            records.append(rec)
    finally:
        torch.set_num_threads(threads)
    rec = {
        "case": "host_floor",
        "small": small,
        "device": "cpu",
        "device_name": harness.device_name("cpu"),
        "threads": 1,
        "models": records,
        "table": _table(records),
        "versions": {k: v for k, v in harness.environment().items() if k != "gpus"},
        "commit": commit,
        "time_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if out_dir is not None:
        kept = {k: v for k, v in rec.items() if k != "table"}
        rec["record_path"] = harness.append_record(out_dir, "host_floor", kept)
    return rec


def _no_pair(device, dtype, small=False):
    raise ValueError(
        "slimgrad.bench host_floor: this case has no single eager/slimgrad pair; expected it "
        "run through its runner, got a call to build. Use `slimgrad bench host_floor`."
    )


CASES = [
    harness.Case(
        name="host_floor",
        build=_no_pair,
        description="host time per step of one pass-through autograd Function per op (the floor) "
        "vs slimgrad, eager and per-block checkpointing, on the host_overhead models",
        requires=("transformers",),
        grad_check=False,
        repeat=40,
        warmup=2,
        run=run,
    )
]
