"""HF attention for ``convert_``: reached through the instance's config, never by rebinding HF code.

# NOTE [HF attention: exact or untouched]
HF models pick their attention function by name, ``ALL_ATTENTION_FUNCTIONS.get_interface(
config._attn_implementation, eager_attention_forward)``, and their mask builder by the same name
(``ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation]`` in ``masking_utils``). ``convert_``
gives the converted model its own copy of every config object in it (re-pointed in every module
that holds one; the caller's config objects are untouched) and sets the copies' implementation to
a slimgrad name registered in both registries (HF's documented extension points; other models keep
theirs). A model that used ``"sdpa"`` gets ``"slimgrad"``: the mask builder is HF's
``sdpa_mask`` itself, so HF builds exactly the masks it builds for SDPA, and the attention function
(:func:`_attention`) computes what HF's ``sdpa_attention_forward`` computes, bit for bit on CPU. A
model that used ``"eager"`` gets ``"slimgrad_eager"``: HF's ``eager_mask`` and
:func:`_attention_eager`, which computes the family's own ``eager_attention_forward`` (the default
its forward passes to ``get_interface``) in slimgrad's ``ops.eager_attention`` (NOTE [HF eager
attention in every dtype]); whenever HF's output capture asks for the attention weights
(``output_attentions``), the family's function runs.

A model converts only when that switch changes nothing but the attention function, decided by
capability from the model's own code (its modeling files, parsed with ``ast``), never by class name:

- at least one module's ``forward`` dispatches through ``ALL_ATTENTION_FUNCTIONS``;
- no module computes attention in its own code instead (softmax + matmul or SDPA in a class that
  does not dispatch: Bloom's ALiBi, Falcon, DeBERTa);
- every other read of ``_attn_implementation`` in those classes (and the module-level functions of
  their files) is a comparison with constants that gives the same answer for ``"slimgrad"`` as for
  the original name (GPT-2's ``== "eager"``), or HF's lookups above; anything else (Falcon's
  ``== "sdpa"`` branch, a value passed on) keeps the model as it is;
- every config in the model uses the same one of ``"sdpa"`` and ``"eager"``; with ``"eager"``, no
  routed class passes its eager function a keyword slimgrad does not implement (T5's
  ``position_bias``), ``config.output_attentions`` is off, the function's cast order around
  softmax is one slimgrad knows (read from its source) and a probe in the model's dtype passes;
- no class outside transformers overrides an HF class's ``forward``.

The device rule (NOTE [Never more than eager, per device and dtype] in ``device_rule.py``) comes
first: for an ``"sdpa"`` model ``convert_`` decides for the devices and dtypes it will run on and
keeps SDPA where eager's fused kernels keep O(T) per row (CUDA: float16/bfloat16/float32); the
report says why. :func:`_attention` asks the same rule again with the query's device and dtype, so
a model converted on CPU and moved to CUDA runs SDPA there.

At call time :func:`_attention` (:func:`_attention_eager` likewise, to the family's function)
hands every call it does not reproduce exactly to HF's own ``sdpa_attention_forward`` with the
same arguments: no dropout (eval, ``dropout=0``), no grad, a device where the device rule keeps
SDPA, a device other than CPU (other devices draw dropout differently),
q/k/v that SDPA would not compute in one dtype, a keyword argument that SDPA's function reads and
slimgrad does not implement (``softcap``, ``output_attentions``, a paged ``cache``: found by
reading that function's source), the single-query GQA packing, a mask that does not broadcast to
the scores. Everything else (causal and bidirectional, 2-D/4-D padding masks made 4-D by HF, bool
and additive float masks, sliding windows, which arrive in the mask HF builds, cross-attention
with ``q_len != k_len``, GQA, T5's ``position_bias``, also float32 under CPU autocast with a query
in autocast's dtype: HF's position-bias mask is then float32 and SDPA's autocast casts it like any
float32 argument, which ``_attention`` does too; float32, float64, bfloat16, float16 and CPU
autocast) runs SDPA's math path in slimgrad's ops: ``S = (q sqrt(s)) (k sqrt(s))^T``, mask inside
the op, safe softmax, dropout kept as bits, ``@ V``. With no mask or a bool one (HF's ``sdpa_mask``)
P is recomputed in backward from q and k (NOTE [Attention probabilities recomputed in backward]
in ``ops/softmax_dropout.py``): nothing T x T is kept but the bits; a float mask (position bias)
keeps P + bits.

# NOTE [HF eager attention in every dtype]
HF's ``eager_attention_forward`` (Llama, Mistral, Qwen2/3, Gemma, Gemma2 with its softcap, Phi-3,
BERT, ...) is ``repeat_kv``, ``S = (q @ k^T) * scaling``, softcap ``tanh(S / cap) * cap``, ``+
mask``, then the family's cast order around softmax, which :func:`_eager_variant` reads from the
function's source: ``softmax(S, dim=-1, dtype=torch.float32).to(query.dtype)`` (Llama & co.: a
float32 P from half-precision scores, cast back), ``softmax(S, dim=-1)`` (BERT: in S's dtype) or
``softmax`` then ``.type(value.dtype)`` (GPT-2); anything else (two softmaxes, two casts, another
softmax dtype) keeps the model as it is, with the reason in the report. Then dropout (CPU:
``P * noise``, the noise in P's dtype) and ``@ V``. :func:`_eager_compute` runs ``repeat_kv``
itself (HF's, in the input dtype), makes CPU autocast's matmul casts of q, k and v itself (the
same ``.to``, so that the op keeps the cast tensors as eager's matmuls do) and hands the rest to
``ops.eager_attention`` with HF's dtypes: every op runs under the caller's autocast state, so
under autocast (q, k float32 after RoPE's float32 cos/sin, v bf16, HF's float32 mask) S is bf16,
``+ mask`` promotes it to float32, softmax and the ``.to(query.dtype)`` stay float32, and the
second matmul casts the dropped P back, all as in eager. The op keeps q, k, v (what eager's
matmuls keep), the mask by reference (one tensor for every layer) and 1 bit per score, and
recomputes the rest in backward with eager's own ops (NOTE [HF eager attention, recomputed in
backward] in ``ops/softmax_dropout.py``), so eager's float32 P, noise and dropped P (8 B/elt in
bf16, 12 in float32, 10 under autocast; 6, 4 and 6 without dropout) are never kept. Dropout 0
(``attention_dropout=0``, Llama's default, or eval with grad enabled) converts too: eager keeps P
there as well.

Proof, per call site: a probe (once per function, q/k/v/mask dtypes, autocast state, softcap and
GQA setting, outside any dispatch mode) compares outputs and gradients with the family's function
bit for bit on a padded GQA case with a row that sees nothing, with dropout (same seed: same
mask) and without; rows that are NaN in eager (float64 masks overflow to -inf in HF's float32
softmax) must be NaN here. ``convert_`` runs it in the model's parameter dtype and reports a
failure; at call time a failed probe (e.g. an autocast setting it was not proven for) makes the
family's function run. Calls slimgrad does not reproduce also run the family's function: no grad,
torch.compile tracing, a device other than CPU, float64 under autocast, mixed dtypes without
autocast, a bool mask, a mask that does not broadcast, ``scaling=None``, keywords the function
reads that slimgrad does not implement, and HF's output capture of the weights.

# NOTE [SDPA's math path in half precision and under autocast]
What eager computes on CPU (read from the dispatched ops of ``F.scaled_dot_product_attention`` in
torch 2.13; the tests compare bit for bit): under CPU autocast SDPA is a lower-precision op, so
q, k, v and a float mask that are floating and not float64 are first cast to autocast's dtype
(HF's q and k are float32 there, after RoPE's float32 cos/sin; v is the projection's bf16). The
math path then copies float16/bfloat16 q, k and v to float32, repeats the kv heads (enable_gqa,
HF's choice without a mask) after those copies, adds a half-precision mask promoted, and runs
softmax, dropout (a float32 noise tensor) and ``@ V`` in float32, casting the output back. HF's
own ``repeat_kv`` (with a mask) runs before SDPA, in the input dtype. :func:`_attention` does the
same casts in the same order, with autocast off inside; value stays in its dtype and is cast to
float32 for each product (``matmul_dtype``). Eager keeps the float32 scaled q and k, P, the noise,
the dropped P and a float32 v; slimgrad keeps the same q and k, v in its own dtype and the bits.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib
import inspect
import math
import sys
import textwrap
from functools import cache
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.nn.modules import module as _module

from slimgrad._autograd import compiling, unwrap_if_dead
from slimgrad._library import straight
from slimgrad.convert_handlers import device_rule
from slimgrad.convert_handlers.decision import Decision, InstanceForward
from slimgrad.convert_handlers.hf import CodeReason, hf_models

ATTN_NAME = "slimgrad"  # reproduces "sdpa"
EAGER_NAME = "slimgrad_eager"  # reproduces "eager" (the family's eager_attention_forward)
_NAMES = {"sdpa": ATTN_NAME, "eager": EAGER_NAME}
_registered = False

# the op's module (the package attribute slimgrad.ops.softmax_dropout may be a function)
_sdm = importlib.import_module("slimgrad.ops.softmax_dropout")

# sdpa_attention_forward's positional parameters and the keyword arguments _attention implements
_STANDARD = ("module", "query", "key", "value", "attention_mask", "dropout", "scaling", "is_causal")
_IMPLEMENTED = frozenset({"position_bias"})
_EAGER_IMPLEMENTED = frozenset({"dropout", "scaling", "softcap"})


# ----------------------------------------------------------------------------- call time


@cache
def _reads(fn) -> frozenset[str]:
    # the keyword arguments an attention function reads: its extra parameters and the names it
    # gets from **kwargs. Any of them set (other than the implemented ones) -> the original.
    names = {
        n
        for n, p in inspect.signature(fn).parameters.items()
        if p.kind is not p.VAR_KEYWORD and n not in _STANDARD
    }
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "kwargs"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.add(node.args[0].value)
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id == "kwargs"
            and isinstance(node.slice, ast.Constant)
        ):
            names.add(node.slice.value)
    return frozenset(names)


def _sdpa_reads() -> frozenset[str]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return _reads(sdpa_attention_forward)


_UNIMPLEMENTED: list = [None, frozenset()]  # (sdpa_attention_forward, its reads - _IMPLEMENTED)


_HF_SDPA: list = []  # transformers.integrations.sdpa_attention, imported at the first call


def _hf_sdpa():
    # the module, imported once (a `from ... import` per call costs frames); its attributes are
    # read at each call, so a patched function is seen
    if not _HF_SDPA:
        from transformers.integrations import sdpa_attention

        _HF_SDPA.append(sdpa_attention)
    return _HF_SDPA[0]


def _groups(module) -> object:
    # getattr(module, "num_key_value_groups", 1), from the instance dict where it lives (HF sets
    # it in __init__) without Module.__getattr__
    d = module.__dict__
    return (
        d["num_key_value_groups"]
        if "num_key_value_groups" in d
        else getattr(module, "num_key_value_groups", 1)
    )


def _sdpa_unimplemented() -> frozenset[str]:
    # the keywords HF's SDPA function reads that _attention does not implement: worked out once
    # per function object (a patched sdpa_attention_forward is read again), not per call
    hf_sdpa = _HF_SDPA[0] if _HF_SDPA else _hf_sdpa()

    fn = hf_sdpa.sdpa_attention_forward
    if _UNIMPLEMENTED[0] is not fn:
        _UNIMPLEMENTED[:] = [fn, _reads(fn) - _IMPLEMENTED]
    return _UNIMPLEMENTED[1]


def _is_set(v) -> bool:
    return v is not None and v is not False


_HALF = (torch.float16, torch.bfloat16)


def _sdpa_cast(t: torch.Tensor) -> torch.Tensor:
    # what F.scaled_dot_product_attention's CPU autocast wrapper makes of a tensor argument:
    # floating tensors other than float64 become autocast's dtype (lower_precision_fp op)
    if t.is_floating_point() and t.dtype != torch.float64 and torch.is_autocast_enabled("cpu"):
        return t.to(torch.get_autocast_dtype("cpu"))
    return t


def _sdpa_dtype(t: torch.Tensor) -> torch.dtype:
    if t.is_floating_point() and t.dtype != torch.float64 and torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return t.dtype


def _autocast_bias_ok(bias: torch.Tensor, dtype: torch.dtype) -> bool:
    # T5 under CPU autocast: a float32 position bias (the bias embedding's output) with a query
    # in autocast's dtype. HF's position-bias mask is then float32 (with finfo(key.dtype).min,
    # exact in float32), and SDPA's autocast casts it to autocast's dtype like any float32
    # argument: _attention makes the same mask with HF's function and the same cast (autograd's
    # ToCopy: the bias gradient is rounded where eager's engine rounds it, after the sum to its
    # shape). NOTE [SDPA's math path in half precision and under autocast]
    return (
        torch.is_autocast_enabled("cpu")
        and bias.dtype in (*_HALF, torch.float32)
        and _sdpa_dtype(bias) == dtype
    )


def _fast_path_ok(module, query, key, value, attention_mask, dropout, scaling, kwargs) -> bool:
    if not (
        (type(dropout) is float or isinstance(dropout, float | int))
        and dropout > 0.0
        and torch.is_grad_enabled()
    ):
        return False
    if query.device.type != "cpu":
        return False  # exactness: other devices draw dropout their own way
    if not (query.ndim == key.ndim == value.ndim == 4):
        return False
    floats = (*_HALF, torch.float32, torch.float64)
    if not (query.dtype in floats and key.dtype in floats and value.dtype in floats):
        return False
    if torch.is_autocast_enabled("cpu"):  # what SDPA computes with: autocast's dtype
        dtype = _sdpa_dtype(query)
        if not (_sdpa_dtype(key) == _sdpa_dtype(value) == dtype):
            return False  # SDPA raises its own error
    else:  # _sdpa_dtype(t) is t.dtype without autocast
        dtype = query.dtype
        if not (key.dtype == value.dtype == dtype):
            return False
    if device_rule.check("attention", device_rule.tensor_device(query.device), dtype) is not None:
        return False  # eager's SDPA keeps less there (fused CUDA kernels)
    if scaling is not None and scaling < 0:
        return False
    for name in _sdpa_unimplemented() if kwargs else ():
        v = kwargs.get(name)
        if v is not None and v is not False:  # _is_set
            return False
    groups = _groups(module)
    if not isinstance(groups, int) or query.shape[1] != key.shape[1] * max(groups, 1):
        return False
    if groups > 1 and query.shape[2] == 1:
        from transformers.integrations.sdpa_attention import use_gqa_in_sdpa

        if not use_gqa_in_sdpa(attention_mask, key, value):
            return False  # SDPA packs the heads into the query length: another dropout layout
    scores = (*query.shape[:3], key.shape[2])
    for name, extra in (("mask", attention_mask), ("bias", kwargs.get("position_bias"))):
        if extra is None:
            continue
        if not isinstance(extra, torch.Tensor) or extra.device != query.device:
            return False
        if name == "bias" and extra.dtype != query.dtype and not _autocast_bias_ok(extra, dtype):
            return False  # HF's position-bias mask then has another dtype than the query's
        if extra.dtype != torch.bool and _sdpa_dtype(extra) != dtype:
            return False  # SDPA raises its own error
        try:
            if torch.broadcast_shapes(extra.shape, scores) != scores:
                return False
        except RuntimeError:
            return False
    return True


def _math_path(query, key, value, attention_mask, dropout, is_causal, root, out_dtype, gqa, hf):
    # SDPA's math path (CPU, autocast off) with softmax -> dropout -> @V in slimgrad's op
    groups = gqa
    acc = torch.float32 if out_dtype in _HALF else out_dtype
    query, key = query.to(acc), key.to(acc)
    if groups:  # the math path repeats after its float32 copies
        key, value = hf.repeat_kv(key, groups), hf.repeat_kv(value.to(acc), groups)
    if attention_mask is not None and attention_mask.dtype not in (torch.bool, acc):
        attention_mask = attention_mask.to(acc)  # exact; the math path adds it promoted
    query, key_t = query * root, key.transpose(-2, -1) * root
    b, h = query.shape[:2]
    if (
        attention_mask is None
        and query.dim() == 4
        and key_t.shape[:2] == (b, h)
        and value.shape[:2] == (b, h)
    ):
        # folded to (B·H, T, d) as the straight path folds them (NOTE [HF attention's straight
        # path]): the op keeps the same tensors on either path, so a non-reentrant checkpoint
        # whose forward and recompute take different paths (a dispatch mode on one side only)
        # finds what it saved (NOTE [A FLOP count on one side of a checkpoint] in
        # slimgrad/_library.py); torch.matmul folds 4-D operands so too: the same products
        qf = query.reshape(b * h, *query.shape[2:])
        kf = key_t.reshape(b * h, *key_t.shape[2:])
        # the 4-D products die here where a fold copied them (ViT's q and k), as the straight
        # path's do: not held through the op beside their copies
        del query, key_t
        out = _sdm.scores_softmax_dropout_matmul(
            qf,
            kf,
            value.contiguous().view(b * h, *value.shape[2:]),
            float(dropout),
            causal=is_causal,
            matmul_dtype=acc,
        )
        return out.view(b, h, *out.shape[1:]).to(out_dtype)
    if attention_mask is None or attention_mask.dtype == torch.bool:
        # P recomputed in backward from q and k (kept for S's gradient anyway)
        out = _sdm.scores_softmax_dropout_matmul(
            query,
            key_t,
            value,
            float(dropout),
            causal=is_causal,
            mask=attention_mask,
            matmul_dtype=acc,
        )
    else:  # a float mask (position bias): P kept, the mask is not
        out = _sdm.softmax_dropout_matmul(
            torch.matmul(query, key_t),
            value,
            float(dropout),
            True,
            causal=is_causal,
            mask=attention_mask,
            matmul_dtype=acc,
        )
    return out.to(out_dtype)


# NOTE [HF attention's straight path]
# The common training call (GPT-2 & co.: dropout on, no mask tensor because HF's ``sdpa_mask``
# leaves a causal unpadded batch to ``is_causal``, no position bias, one kv head per query head,
# plain float32/float64 CPU tensors, no autocast) is told by attribute reads, two C reads (grad
# mode, autocast) and the gate (NOTE [One gate per call] in slimgrad/_library.py), and runs
# :func:`_attention`'s steps for that case, which are then the identity (no casts, no
# ``repeat_kv``, no mask) but for the crop, the scaling and the op: the scores op's Function is
# applied directly (its own straight path, which the same facts pass). The facts
# :func:`_fast_path_ok` derives from calls are read instead: the device rule keeps slimgrad's
# attention on CPU for every dtype (its rule is the one this module was written against, and no
# ``stands_for`` makes CPU tensors stand for another device), the keywords HF's SDPA function
# reads and slimgrad does not implement are looked up in the keywords, the kv-group count
# is the instance's attribute or the class's (one C ``getattr``), and ``sqrt`` of a scaling is
# kept per (scaling, head size). Every other call takes the general path below, unchanged.
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_LEAN_DTYPES = (torch.float32, torch.float64)
_grad_on = torch._C.is_grad_enabled
_any_autocast = torch._C._is_any_autocast_enabled
_SDPA_RULE = device_rule.RULES["attention"]
_ROOTS: dict[tuple, tuple[float, float]] = {}  # (scaling, head size) -> (scale, sqrt(scale))


def _roots(scaling, head: int) -> tuple[float, float]:
    scale = scaling if scaling is not None else 1.0 / math.sqrt(head)
    if len(_ROOTS) > 256:
        _ROOTS.clear()
    r = _ROOTS[(scaling, head)] = (scale, math.sqrt(scale))
    return r


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    if (  # NOTE [HF attention's straight path]
        attention_mask is None
        and type(dropout) is float
        and 0.0 < dropout < 1.0
        and _HF_SDPA
        and type(query) in _PLAIN
        and type(key) in _PLAIN
        and type(value) in _PLAIN
        and query.is_cpu
        and query.ndim == 4
        and key.ndim == 4
        and value.ndim == 4
        and query.dtype in _LEAN_DTYPES
        and key.dtype == query.dtype
        and value.dtype == query.dtype
        and (scaling is None or scaling >= 0)
        and 0 not in query.shape
        and 0 not in key.shape
        and device_rule.RULES["attention"] is _SDPA_RULE
        and _grad_on()
        and not _any_autocast()
        and straight()
        and device_rule._STANDS_FOR.get() is None
    ):
        # the straight path's steps in this frame: the output, or on to the general path
        d = module.__dict__
        if "num_key_value_groups" in d:
            groups = d["num_key_value_groups"]
        elif (
            "num_key_value_groups" in d["_parameters"]
            or "num_key_value_groups" in d["_buffers"]
            or "num_key_value_groups" in d["_modules"]
        ):
            groups = None
        else:
            groups = getattr(type(module), "num_key_value_groups", 1)
        b, h, q_len, head = query.shape
        ok = (
            groups == 1
            and type(groups) is int
            and key.shape[:2] == (b, h)
            and value.shape[:2] == (b, h)
        )
        if ok and kwargs:  # a keyword the straight path does not implement refuses it
            if "position_bias" in kwargs and kwargs["position_bias"] is not None:
                ok = False
            else:
                fn = _HF_SDPA[0].sdpa_attention_forward
                unimplemented = (
                    _UNIMPLEMENTED[1] if _UNIMPLEMENTED[0] is fn else _sdpa_unimplemented()
                )
                for name in unimplemented:
                    if name in kwargs:
                        v = kwargs[name]
                        if v is not None and v is not False:  # _is_set
                            ok = False
                            break
        if ok:
            if is_causal is None:
                is_causal = (
                    d["is_causal"] if "is_causal" in d else getattr(module, "is_causal", True)
                )
            is_causal = bool(q_len > 1 and is_causal)
            if is_causal and key.shape[2] > q_len:  # as sdpa_attention_forward: upper-left causal
                key, value = key[:, :, :q_len, :], value[:, :, :q_len, :]
            rk = (scaling, head)
            _, root = _ROOTS[rk] if rk in _ROOTS else _roots(scaling, head)
            # q * root and k^T * root are fresh products (a dead functorch wrapper's product is
            # plain), folded to (B·H, T, d) as torch.matmul folds them: the same operands for the
            # op's bmm calls (NOTE [Attention matmuls as bmm] in ops/softmax_dropout.py)
            bh, kv_len = b * h, key.shape[2]
            vc = value.contiguous()  # a copy is plain too; value itself may be a dead wrapper
            if vc is value:
                vc = unwrap_if_dead(vc)
            out = _sdm._SSDM_APPLY(
                (query * root).reshape(bh, q_len, head),
                (key.mT * root).reshape(bh, head, kv_len),  # mT: transpose(-2, -1), no call
                vc.view(bh, kv_len, value.shape[3]),
                dropout,
                query.dtype,
                is_causal,
                None,
                True,
                True,
            )
            return out.view(b, h, q_len, out.shape[2]).transpose(1, 2).contiguous(), None
    hf_sdpa = _HF_SDPA[0] if _HF_SDPA else _hf_sdpa()
    # _fast_path_ok's first test inline: without dropout (Llama's default, every eval call) HF's
    # function computes it, without a frame to say so
    if (
        not ((type(dropout) is float or isinstance(dropout, float | int)) and dropout > 0.0)
    ) or not _fast_path_ok(module, query, key, value, attention_mask, dropout, scaling, kwargs):
        return hf_sdpa.sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    # From here on: sdpa_attention_forward's steps, then SDPA's math path (the CPU kernel used
    # with dropout), with softmax -> dropout -> @V in slimgrad's op. NOTE [SDPA's math path in
    # half precision and under autocast]
    position_bias = kwargs.get("position_bias")
    groups = _groups(module)
    # HF lets SDPA repeat the kv heads (enable_gqa: after its casts) or repeats them itself
    gqa_in_sdpa = groups > 1 and hf_sdpa.use_gqa_in_sdpa(attention_mask, key, value)
    if groups > 1 and not gqa_in_sdpa:
        key, value = hf_sdpa.repeat_kv(key, groups), hf_sdpa.repeat_kv(value, groups)
    q_len, kv_len = query.shape[2], key.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(q_len > 1 and attention_mask is None and is_causal)
    if is_causal and kv_len > q_len:  # as sdpa_attention_forward: upper-left causal on a crop
        key, value = key[:, :, :q_len, :], value[:, :, :q_len, :]
        if position_bias is not None:
            position_bias = position_bias[:, :, :, :q_len]
    if position_bias is not None:
        attention_mask = hf_sdpa.create_position_bias_mask(
            position_bias, attention_mask, is_causal, query, key
        )
        is_causal = False
    # F.scaled_dot_product_attention: autocast's casts, then the math path with autocast off
    if torch.is_autocast_enabled("cpu"):  # _sdpa_cast is the identity without autocast
        query, key, value = _sdpa_cast(query), _sdpa_cast(key), _sdpa_cast(value)
        if attention_mask is not None:
            attention_mask = _sdpa_cast(attention_mask)
    out_dtype = query.dtype
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    root = math.sqrt(scale)  # SDPA's math path scales q and k by sqrt(scale) each
    args = (query, key, value, attention_mask, dropout, is_causal, root, out_dtype)
    gqa = groups if gqa_in_sdpa else 0
    if torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            out = _math_path(*args, gqa, hf_sdpa)
    else:  # autocast off already: the same ops without entering and leaving the context
        out = _math_path(*args, gqa, hf_sdpa)
    return out.transpose(1, 2).contiguous(), None


# eager origin: the family's own eager_attention_forward, reproduced where a probe proves it


@cache
def _interface_keywords(cls: type) -> frozenset[str]:
    # the keyword arguments the class's forward passes to the attention function it looked up
    _, fwd = _method_node(cls, "forward")
    names: set[str] = set()
    targets: set[str] = set()
    for node in ast.walk(fwd) if fwd is not None else ():
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Call):
            if _dotted(node.value.func).endswith("get_interface"):
                tgts = node.targets if isinstance(node, ast.Assign) else [node.target]
                targets.update(t.id for t in tgts if isinstance(t, ast.Name))
    for node in ast.walk(fwd) if fwd is not None else ():
        if isinstance(node, ast.Call) and _dotted(node.func) in targets:
            names.update(k.arg for k in node.keywords if k.arg is not None)
    return frozenset(names)


@cache
def _eager_default(cls: type):
    # the function the class's forward passes to get_interface as the default ("eager")
    owner, fwd = _method_node(cls, "forward")
    if fwd is None:
        return None
    for node in ast.walk(fwd):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get_interface"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Name)
        ):
            return getattr(sys.modules[owner.__module__], node.args[1].id, None)
    return None


def _capture_wants_attentions() -> bool:
    # HF's output capture (output_attentions=True) keeps the weights eager returns: then the
    # original runs. Unknown state (another transformers): assume it does.
    try:
        from transformers.utils.output_capturing import _active_collector

        collected = _active_collector.get()
    except Exception:  # noqa: BLE001 - any failure means we cannot tell
        return True
    return bool(collected) and any("attention" in k for k in collected)


@cache
def _eager_variant(fn) -> tuple[tuple[bool, str | None] | None, str]:
    # HF's cast order around softmax in the family's eager function, read from its source:
    # (softmax's dtype is float32, the dtype P is cast to: "query" / "value" / None), or None and
    # why. Llama & co.: softmax(S, dim=-1, dtype=torch.float32).to(query.dtype); BERT/T5:
    # softmax(S, dim=-1); GPT-2: softmax(S, dim=-1) then .type(value.dtype).
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None, f"the source of {getattr(fn, '__name__', fn)!r} is not available to read"
    softmaxes, casts = [], []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        if name == "softmax":
            softmaxes.append(node)
        elif (
            name in ("to", "type")
            and isinstance(f, ast.Attribute)
            and len(node.args) == 1
            and not node.keywords
            and isinstance(node.args[0], ast.Attribute)
            and node.args[0].attr == "dtype"
            and isinstance(node.args[0].value, ast.Name)
            and node.args[0].value.id in ("query", "value")
        ):
            casts.append(node.args[0].value.id)
    where = fn.__name__
    if len(softmaxes) != 1:
        return None, f"{where} calls softmax {len(softmaxes)} times, not once"
    dtypes = [k for k in softmaxes[0].keywords if k.arg == "dtype"]
    if dtypes and _dotted(dtypes[0].value) not in ("torch.float32", "torch.float"):
        return None, f"{where} runs softmax in {_dotted(dtypes[0].value)}, not float32"
    if len(casts) > 1:
        return None, f"{where} casts the probabilities {len(casts)} times"
    return (bool(dtypes), casts[0] if casts else None), ""


def _autocast_cast(t: torch.Tensor) -> torch.Tensor:
    # what CPU autocast makes of a matmul argument (a lower_precision_fp op): floating tensors
    # other than float64 become autocast's dtype; done before the op (autograd's ToCopy, as
    # autocast's own cast) so that the op keeps the cast tensor, as eager's matmul does
    if t.is_floating_point() and t.dtype != torch.float64 and torch.is_autocast_enabled("cpu"):
        return t.to(torch.get_autocast_dtype("cpu"))
    return t


def _eager_compute(module, query, key, value, mask, dropout, scaling, softcap, variant):
    # the family's eager_attention_forward: repeat_kv (in the input dtype), then slimgrad's
    # ops.eager_attention with HF's own cast order (NOTE [HF eager attention in every dtype])
    from transformers.integrations.sdpa_attention import repeat_kv

    upcast, cast_to = variant
    probs_dtype = {"query": query.dtype, "value": value.dtype, None: None}[cast_to]
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    query, key, value = _autocast_cast(query), _autocast_cast(key), _autocast_cast(value)
    out = _sdm.eager_attention(
        query,
        key,
        value,
        float(dropout),
        bool(module.training),
        scaling=float(scaling),
        softcap=None if softcap is None else float(softcap),
        biases=(mask,),
        softmax_dtype=torch.float32 if upcast else None,
        probs_dtype=probs_dtype,
    )
    return out.transpose(1, 2).contiguous()


_PROBES: dict[tuple, bool] = {}


def _same_t(t):
    return t


def _probe(
    original, module, dtype, softcap: bool, *, k_dtype=None, v_dtype=None, mask_dtype=None
) -> bool:
    # Does _eager_compute give the family's eager function's outputs and gradients bit for bit
    # (same seed: same dropout mask) on a small padded GQA/softcap case, in these dtypes and the
    # current autocast state, with dropout and without? Once per setting. Runs outside any
    # dispatch mode (slimgrad.memory's tracker, fake tensors): real tensors, not counted; and
    # under saved-tensor hooks of its own: inside a checkpointed region (its first forward calls
    # this, its recompute finds the setting cached) the probe's saved tensors reached the
    # checkpoint's hooks, which then found fewer in the recompute (CheckpointError)
    from torch.utils._python_dispatch import _disable_current_modes

    groups = getattr(module, "num_key_value_groups", 1)
    k_dtype, v_dtype, mask_dtype = k_dtype or dtype, v_dtype or dtype, mask_dtype or dtype
    variant, _ = _eager_variant(original)
    autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    key = (original, dtype, k_dtype, v_dtype, mask_dtype, softcap, groups, autocast)
    if key in _PROBES:
        return _PROBES[key]
    if variant is None:
        _PROBES[key] = False
        return False
    was = module.training
    try:
        with _disable_current_modes(), contextlib.ExitStack() as stack:
            try:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_same_t, _same_t))
            except RuntimeError:
                # saved-tensor hooks are disabled here (torch.autograd.graph.
                # disable_saved_tensors_hooks: vmap, aot_autograd): no checkpoint's hooks can see
                # the probe either
                pass
            dtypes = (dtype, k_dtype, v_dtype, mask_dtype)
            ok = _probe_run(original, module, variant, dtypes, softcap)
    except Exception:  # noqa: BLE001 - any failure: the original keeps running
        ok = False
    finally:
        module.training = was
    _PROBES[key] = ok
    return ok


def _probe_run(original, module, variant, dtypes, softcap) -> bool:
    dtype, k_dtype, v_dtype, mask_dtype = dtypes
    groups = getattr(module, "num_key_value_groups", 1)
    gen = torch.Generator().manual_seed(0)
    heads = 2 * groups
    q = torch.randn(2, heads, 4, 8, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(2, 2, 6, 8, generator=gen, dtype=torch.float64).to(k_dtype)
    v = torch.randn(2, 2, 6, 8, generator=gen, dtype=torch.float64).to(v_dtype)
    mask = torch.zeros(2, 1, 4, 6, dtype=mask_dtype)
    mask[0, :, :, :2] = torch.finfo(mask_dtype).min  # padding
    mask[1, :, 0, :] = torch.finfo(mask_dtype).min  # a row that sees nothing
    ok = True
    for training in (True, False):  # dropout on; off (eval, or attention_dropout = 0)
        module.training = training
        kw = {"dropout": 0.3 if training else 0.0, "scaling": 0.3}
        if softcap:
            kw["softcap"] = 2.0

        def ours(*a, kw=kw):
            return _eager_compute(module, *a, kw["dropout"], 0.3, kw.get("softcap"), variant), None

        results = []
        with torch.random.fork_rng(devices=[]):
            for fn in (ours, lambda *a, kw=kw: original(module, *a, **kw)):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                torch.manual_seed(0)
                out = fn(*leaves, mask)[0]
                g = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
                results.append([out.detach(), *torch.autograd.grad(out, leaves, g)])
        ok = ok and all(_same(a, b) for a, b in zip(*results))
    return ok


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # bit for bit, NaN where the other has NaN (float64 masks overflow to -inf in HF's float32
    # softmax: a row that sees nothing is NaN in eager, and must be NaN here)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _eager_fast_path_ok(module, plan, query, key, value, mask, args) -> bool:
    original = plan.original
    if not plan.has_dropout_and_scaling:
        return False
    dropout, scaling, softcap = args.get("dropout"), args.get("scaling"), args.get("softcap")
    if not (isinstance(dropout, float | int) and 0.0 <= dropout < 1.0):
        return False
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False  # nothing kept for backward; compiled: the compiler's memory
    if not any(t.requires_grad for t in (query, key, value)):
        return False
    if not isinstance(scaling, float | int) or (softcap is not None and not softcap > 0):
        return False
    if (
        device_rule.check("attention_eager", device_rule.tensor_device(query.device), query.dtype)
        is not None
    ):
        return False
    if query.device.type != "cpu":
        return False  # exactness: other devices draw dropout their own way
    if not (query.dim() == key.dim() == value.dim() == 4):
        return False
    if not all(t.dtype in _FLOATS for t in (query, key, value)):
        return False
    dtypes = {query.dtype, key.dtype, value.dtype}
    if torch.is_autocast_enabled("cpu") and torch.float64 in dtypes:
        return False  # autocast leaves float64 alone: eager's own mixed-dtype error
    if not torch.is_autocast_enabled("cpu") and len(dtypes) > 1:
        return False  # eager's own dtype error
    if query.device != key.device or key.device != value.device:
        return False
    extra = dict(args.get("kwargs", {}))
    for name in plan.unimplemented:
        if _is_set(args.get(name, extra.get(name))):
            return False
    if mask is not None:
        scores = (*query.shape[:3], key.shape[2])
        if not isinstance(mask, torch.Tensor) or mask.dtype not in _FLOATS:
            return False
        if mask.shape[-1] != key.shape[2] or mask.device != query.device:
            return False
        try:
            if torch.broadcast_shapes(mask.shape, scores) != scores:
                return False
        except RuntimeError:
            return False
    if _capture_wants_attentions():
        return False
    return _probe(
        original,
        module,
        query.dtype,
        softcap is not None,
        k_dtype=key.dtype,
        v_dtype=value.dtype,
        mask_dtype=None if mask is None else mask.dtype,
    )


# NOTE [The eager default, decided at convert_]
# What :func:`_attention_eager` needs to know about a class's eager attention depends only on the
# class's code: the function its forward passes to ``get_interface`` as the default (read from
# the modeling file with ``ast``), that function's signature, HF's cast order around softmax
# (read from its source) and the keywords it reads that slimgrad does not implement. ``convert_``
# works all four out once, when :func:`_analyse` checks the class, and stores them here by class
# (an :class:`_EagerPlan`); each call is one dict read. Reading them per call meant
# ``inspect.getsource`` and ``inspect.signature`` on every eager-attention call: host time in
# eager mode, and under ``torch.compile`` a graph break at each call (Dynamo cannot trace
# ``inspect``), each leaving the partitioner to keep the break's outputs
# (tests/test_compile_hf_eager_attention.py). While Dynamo traces, the family's function runs as
# it does in the compiled eager model (the compiler decides what is kept): the plan is read,
# nothing else. A class that reaches the slimgrad eager attention without a plan (a converted
# model unpickled in a fresh process) gets one at its first call, the same way (under Dynamo that
# one call breaks the graph).
class _EagerPlan(NamedTuple):
    original: object  # the family's eager_attention_forward
    signature: inspect.Signature
    has_dropout_and_scaling: bool
    variant: tuple[bool, str | None] | None  # _eager_variant's cast order
    unimplemented: frozenset[str]  # keywords it reads that slimgrad does not implement


_EAGER_PLANS: dict[type, _EagerPlan] = {}


def _eager_plan(cls: type) -> _EagerPlan | None:
    # once per class (convert_, NOTE [The eager default, decided at convert_])
    plan = _EAGER_PLANS.get(cls)
    if plan is None:
        fn = _eager_default(cls)
        if fn is None:
            return None
        sig = inspect.signature(fn)
        plan = _EAGER_PLANS[cls] = _EagerPlan(
            fn,
            sig,
            "dropout" in sig.parameters and "scaling" in sig.parameters,
            _eager_variant(fn)[0],
            _reads(fn) - _EAGER_IMPLEMENTED,
        )
    return plan


def _attention_eager(module, query, key, value, attention_mask, *args, **kwargs):
    plan = _EAGER_PLANS.get(type(module))
    if plan is None:  # not checked by this process's convert_ (unpickled): worked out now
        plan = _eager_plan(type(module))
    if plan is None:
        raise RuntimeError(
            f"slimgrad attention: {type(module).__name__} reached the slimgrad eager attention "
            "without an eager default to reproduce; expected a class checked by convert_, got "
            "one that was not. This is a slimgrad bug; please report it."
        )
    original = plan.original
    if compiling():  # the compiled eager model's function (NOTE [The eager default, ...])
        return original(module, query, key, value, attention_mask, *args, **kwargs)
    try:
        bound = plan.signature.bind(module, query, key, value, attention_mask, *args, **kwargs)
        bound.apply_defaults()
    except TypeError:
        bound = None  # the original raises its own error
    if bound is None or not _eager_fast_path_ok(
        module, plan, query, key, value, attention_mask, bound.arguments
    ):
        return original(module, query, key, value, attention_mask, *args, **kwargs)
    a = bound.arguments
    out = _eager_compute(
        module,
        query,
        key,
        value,
        attention_mask,
        a["dropout"],
        a["scaling"],
        a.get("softcap"),
        plan.variant,
    )
    return out, None


def register_attention() -> None:
    """Add ``"slimgrad"`` to HF's attention and attention-mask registries (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    AttentionInterface.register(ATTN_NAME, _attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    AttentionInterface.register(EAGER_NAME, _attention_eager)
    AttentionMaskInterface.register(EAGER_NAME, eager_mask)
    _sdpa_unimplemented()  # read HF's source now: Dynamo cannot trace inspect (a graph break)
    _registered = True


# A converted model unpickled in a fresh process imports slimgrad (its slimgrad modules) after
# transformers: register then, so its configs' "slimgrad" resolves.
if "transformers" in sys.modules:
    try:
        register_attention()
    except ImportError:  # a transformers without these registries: nothing converts anyway
        pass


# ----------------------------------------------------------------------------- convert time


def _hf_class(cls: type) -> bool:
    return cls.__module__.startswith("transformers.models.")


@cache
def _file_tree(modname: str):
    mod = sys.modules.get(modname)
    try:
        src = inspect.getsource(mod)
    except (OSError, TypeError):
        return None
    tree = ast.parse(src)
    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    return classes, funcs, parents


def _dotted(node) -> str:
    try:
        return ast.unparse(node)
    except Exception:  # noqa: BLE001 - only used for names in messages
        return "?"


def _is_dispatch(node, parents) -> bool:
    # node: the `X._attn_implementation` read; OK inside ALL_ATTENTION_FUNCTIONS.get_interface(
    # X._attn_implementation, ...) or ALL_ATTENTION_FUNCTIONS[X._attn_implementation]
    parent = parents.get(node)
    if isinstance(parent, ast.Call) and parent.args and parent.args[0] is node:
        f = parent.func
        return (
            isinstance(f, ast.Attribute)
            and f.attr in ("get_interface", "get")
            and (_dotted(f.value).endswith("ALL_ATTENTION_FUNCTIONS"))
        )
    if isinstance(parent, ast.Subscript) and parent.slice is node:
        return _dotted(parent.value).endswith("ALL_ATTENTION_FUNCTIONS")
    return False


def _const(node):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise LookupError from None


def _same_comparison(node, parents, before: str, after: str) -> bool:
    cmp = parents.get(node)
    if not isinstance(cmp, ast.Compare):
        return False
    operands = [cmp.left, *cmp.comparators]
    try:
        consts = [None if o is node else _const(o) for o in operands]
    except LookupError:
        return False

    def evaluate(v):
        vals = [v if o is node else c for o, c in zip(operands, consts)]
        ops = {
            ast.Eq: lambda a, b: a == b,
            ast.NotEq: lambda a, b: a != b,
            ast.In: lambda a, b: a in b,
            ast.NotIn: lambda a, b: a not in b,
            ast.Is: lambda a, b: a is b,
            ast.IsNot: lambda a, b: a is not b,
        }
        result = True
        for op, a, b in zip(cmp.ops, vals, vals[1:]):
            fn = ops.get(type(op))
            if fn is None:
                raise LookupError
            result = result and fn(a, b)
        return result

    try:
        return evaluate(before) == evaluate(after)
    except (LookupError, TypeError):
        return False


def _harmless_write(node, parents) -> bool:
    # `self._attn_implementation = config._attn_implementation`: a copy taken at __init__ keeps
    # the original name, so whatever reads it behaves as before the switch.
    # `config._attn_implementation = "eager"` (Whisper's generate with timestamps): a constant
    # written makes the converted model run what the original then runs.
    parent = parents.get(node)
    if isinstance(parent, ast.Assign) and parent.value is node:
        return all(
            isinstance(t, ast.Attribute) and _dotted(t) == "self._attn_implementation"
            for t in parent.targets
        )
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
        if _dotted(node) == "self._attn_implementation":
            return True
        return isinstance(parent, ast.Assign) and isinstance(parent.value, ast.Constant)
    return False


# The readings of a modeling file's nodes below depend only on the node: the file is parsed once
# per process (``_file_tree``, cached by module name) and its nodes are never changed, so each
# reading is kept by node (``_NODE_READS``: the node itself as key, so it stays alive) and an
# HF ``convert_`` walks each class and function of the file once per process, not once per module
# and call. What depends on the instance (its class's MRO, which class defines ``forward``, the
# configs) is read at every call.
_NODE_READS: dict[tuple, object] = {}


def _impl_reads(scope, parents, before: str, after: str) -> list[str]:
    # (``parents``: the parent map of the parsed file ``scope`` belongs to, ``_file_tree``'s)
    key = ("impl", scope, before, after)
    got = _NODE_READS.get(key)
    if got is None:
        got = _NODE_READS[key] = tuple(_impl_reads_walk(scope, parents, before, after))
    return list(got)


def _impl_reads_walk(scope, parents, before: str, after: str) -> list[str]:
    bad = []
    for node in ast.walk(scope):
        hit = (isinstance(node, ast.Attribute) and node.attr == "_attn_implementation") or (
            isinstance(node, ast.Constant) and node.value == "_attn_implementation"
        )
        if not hit:
            continue
        if _is_dispatch(node, parents) or _harmless_write(node, parents):
            continue
        if _same_comparison(node, parents, before, after):
            continue
        stmt = node
        while parents.get(stmt) is not None and not isinstance(stmt, ast.stmt):
            stmt = parents[stmt]
        bad.append(f"line {getattr(node, 'lineno', '?')}: {_dotted(stmt).splitlines()[0]}")
    return bad


_ATTN_MATH = {"matmul", "bmm", "baddbmm", "einsum"}


def _computes_attention(cls_node) -> bool:
    key = ("computes", cls_node)
    got = _NODE_READS.get(key)
    if got is None:
        got = _NODE_READS[key] = _computes_attention_walk(cls_node)
    return got


def _routes(fwd) -> bool:
    # the forward's code names ALL_ATTENTION_FUNCTIONS (it dispatches through the interface)
    key = ("routes", fwd)
    got = _NODE_READS.get(key)
    if got is None:
        got = _NODE_READS[key] = any(
            isinstance(n, ast.Name | ast.Attribute)
            and (getattr(n, "id", None) or getattr(n, "attr", None)) == "ALL_ATTENTION_FUNCTIONS"
            for n in ast.walk(fwd)
        )
    return got


def _computes_attention_walk(cls_node) -> bool:
    calls = set()
    matmul_op = False
    for node in ast.walk(cls_node):
        if isinstance(node, ast.Call):
            f = node.func
            calls.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            matmul_op = True
    if "scaled_dot_product_attention" in calls:
        return True
    return "softmax" in calls and (matmul_op or bool(calls & _ATTN_MATH))


def _method_node(cls: type, name: str):
    # the FunctionDef of cls.<name> in the class that defines it, if that class is HF's
    for owner in cls.__mro__:
        if name in vars(owner):
            if not _hf_class(owner):
                return owner, None
            parsed = _file_tree(owner.__module__)
            if parsed is None or owner.__name__ not in parsed[0]:
                return owner, None
            for item in parsed[0][owner.__name__].body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return owner, item
            return owner, None
    return None, None


def _configs_in(model: nn.Module) -> list:
    from transformers import PretrainedConfig

    found: dict[int, object] = {}

    def add(cfg):
        if id(cfg) in found:
            return
        found[id(cfg)] = cfg
        for key in getattr(cfg, "sub_configs", {}) or {}:
            sub = getattr(cfg, key, None)
            if isinstance(sub, PretrainedConfig):
                add(sub)

    for m in model.modules():
        for v in vars(m).values():
            if isinstance(v, PretrainedConfig):
                add(v)
    return list(found.values())


def _analyse(model: nn.Module) -> tuple[list[str], str | None]:
    """(the classes that dispatch, the reason the model keeps its attention or None).

    No dispatching and no attention of its own (e.g. HF ResNet): ``([], None)``.
    """
    routed: dict[str, int] = {}
    own: set[str] = set()
    classes: set[type] = set()
    for m in model.modules():
        t = type(m)
        hf = [c for c in t.__mro__ if _hf_class(c)]
        if not hf:
            continue
        owner, fwd = _method_node(t, "forward")
        # a forward defined below HF's classes (a user's subclass) overrides HF's; one above
        # them (an HF subclass of torch's Conv2d or GroupNorm with no forward of its own) is
        # torch's, read below like any class's code
        if (
            owner is not None
            and not _hf_class(owner)
            and t.__mro__.index(owner) < t.__mro__.index(hf[0])
        ):
            return [], (
                f"{t.__name__} overrides the forward of {hf[0].__name__}: its attention "
                "cannot be checked"
            )
        classes.update(hf)
        if fwd is not None and _routes(fwd):
            routed[t.__name__] = routed.get(t.__name__, 0) + 1
        else:
            parsed = _file_tree(owner.__module__) if owner is not None else None
            cls_node = parsed[0].get(owner.__name__) if parsed is not None else None
            if cls_node is not None and _computes_attention(cls_node):
                own.add(t.__name__)
    if own:
        return [], CodeReason(
            f"{', '.join(sorted(own))} computes attention in its own code, not through HF's "
            "AttentionInterface (attention kept as is)"
        )
    if not routed:
        return [], None
    configs = _configs_in(model)
    impls = {getattr(c, "_attn_implementation", None) for c in configs}
    if len(impls) != 1 or not impls <= set(_NAMES):
        other = sorted(str(i) for i in impls)
        return [], (
            f"attention implementation {', '.join(map(repr, other))} kept: the slimgrad attention "
            "reproduces 'sdpa' or 'eager' used by every config of the model"
        )
    (origin,) = impls
    if origin == "eager" and any(getattr(c, "output_attentions", False) for c in configs):
        return [], "config.output_attentions is set: eager returns the weights on every call"
    if origin == "eager":
        for n in sorted(routed):
            cls = _class_named(model, n)
            plan = _eager_plan(cls)  # NOTE [The eager default, decided at convert_]
            fn = plan.original if plan is not None else None
            if fn is None:
                return [], CodeReason(
                    f"{n}: no eager default function to reproduce (attention kept as is)"
                )
            unsupported = sorted(_interface_keywords(cls) & (_reads(fn) - _EAGER_IMPLEMENTED))
            if unsupported:
                return [], CodeReason(
                    f"{n} passes {', '.join(unsupported)} to {fn.__name__}, which the slimgrad "
                    "eager attention does not implement (attention kept as is)"
                )
            variant, why = _eager_variant(fn)
            if variant is None:
                return [], CodeReason(
                    f"{n}: {why}: HF's cast order is not known (attention kept as is)"
                )
            module = next(m for m in model.modules() if type(m).__name__ == n)
            dtype = _param_dtype(module) or _param_dtype(model) or torch.float32
            softcap = "softcap" in _interface_keywords(cls)
            if not _probe(fn, module, dtype, softcap):
                where = str(dtype).removeprefix("torch.")
                return [], CodeReason(
                    f"{n}: slimgrad's eager attention is not bit for bit equal to "
                    f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__} in {where} (probe: "
                    "padded GQA case, dropout on and off, outputs and gradients): attention "
                    "kept as is"
                )
    bad: list[str] = []
    files: dict[str, set[str]] = {}
    for c in classes:
        files.setdefault(c.__module__, set()).add(c.__name__)
    for modname, names in sorted(files.items()):
        parsed = _file_tree(modname)
        if parsed is None:
            return [], CodeReason(f"the source of {modname} is not available to check")
        cls_nodes, funcs, parents = parsed
        scopes = [cls_nodes[n] for n in sorted(names) if n in cls_nodes] + funcs
        for scope in scopes:
            where = f"{modname.rsplit('.', 1)[-1]}.{getattr(scope, 'name', '?')}"
            bad += [f"{where} {b}" for b in _impl_reads(scope, parents, origin, _NAMES[origin])]
    if bad:
        return [], CodeReason(
            "the model's code reads config._attn_implementation beyond the attention lookup "
            f"({bad[0]}): attention kept as is"
        )
    return [f"{n} x{k}" for n, k in sorted(routed.items())], None


def _param_dtype(module: nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), None)


def _class_named(model: nn.Module, name: str) -> type:
    return next(type(m) for m in model.modules() if type(m).__name__ == name)


def _own_configs(model: nn.Module) -> list:
    # a private copy of every config object in the model (identity between them kept: a
    # sub-config shared by two modules stays shared), re-pointed in every module holding one
    configs = _configs_in(model)
    copies = copy.deepcopy(configs)
    new = {id(old): c for old, c in zip(configs, copies)}
    for m in model.modules():  # `configs` keeps the originals alive: their ids stay unique
        for k, v in list(vars(m).items()):
            if id(v) in new:
                setattr(m, k, new[id(v)])
    return copies


def _use_now(model: nn.Module) -> None:
    # the change the analysis found exact: the model's own configs name the slimgrad attention
    register_attention()
    for cfg in _own_configs(model):
        # the dict form sets this config only; each sub-config is in the list itself
        cfg._attn_implementation = {"": _NAMES[cfg._attn_implementation]}


def _no_config(model: nn.Module) -> str | None:
    if not hasattr(getattr(model, "config", None), "_attn_implementation"):
        return "no HF config with an attention implementation"
    return None


def use_slimgrad_attention(model: nn.Module) -> tuple[bool, str]:
    """Give ``model`` its own configs using the slimgrad attention, when that is exact.

    Returns:
        ``(True, what converted)`` or ``(False, the reason the model keeps its attention)``.
        See NOTE [HF attention: exact or untouched].
    """
    if (why := _no_config(model)) is not None:
        return False, why
    routed, reason = _analyse(model)
    if reason is not None or not routed:
        return False, reason or CodeReason("no attention module")
    _use_now(model)
    return True, ", ".join(routed)


def _gpt2_rows(m: nn.Module, name: str, allowed=None) -> list[tuple[str, str, str]]:
    # the slimgrad attention in place, then GPT-2's one-node forwards; their report rows
    _use_now(m)
    rows = []
    # NOTE [GPT-2's attention output as one node]
    for sub in gpt2_attention_forwards_(m, allowed=allowed, prefix=name):
        full = f"{name}.{sub}" if name and sub else name or sub
        rows.append((full, "GPT2Attention.forward", "scores op + c_proj + resid_dropout: one node"))
    return rows


def attention_pattern(model: nn.Module, config, allowed, found) -> list[Decision]:
    """``convert_`` pattern (technique ``dropout``): HF models use the slimgrad attention.

    Returns the decisions, one per outermost HF model: a ``patch`` that gives it its own configs
    naming the slimgrad attention (and GPT-2's one-node forwards) where the analysis, run once per
    model, finds that exact; else why not. ``found.targets`` are the device rule's.
    """
    out: list[Decision] = []
    for name, m in hf_models(model):
        kind = type(m).__name__
        impls = {getattr(c, "_attn_implementation", None) for c in _configs_in(m)}
        if impls and impls <= set(_NAMES.values()):
            continue  # converted before
        if not allowed(m, name):
            out.append(Decision(name, None, None, m, reason="filter_fn returned False"))
            continue
        routed, reason = _analyse(m)
        origin = next(iter(impls), None)
        technique = "attention_eager" if origin == "eager" else "attention"
        if not routed and reason is None:
            # no attention at all (e.g. HF ResNet); in a family known to dispatch, a release that
            # stopped dispatching through the AttentionInterface
            why = CodeReason("no module dispatches through HF's AttentionInterface")
            out.append(Decision(name, None, None, m, refusal=(technique, why)))
            continue
        why = device_rule.refuse(technique, found.targets)
        if why is not None:
            kind = f"{kind} attention ({origin})"
            out.append(Decision(name, None, None, m, kind=kind, reason=why))
            continue
        reason = _no_config(m) or reason
        if reason is None:
            out.append(Decision(
                name, None, None, m, kind=f"{kind} attention ({origin})",
                to=f"slimgrad attention: {', '.join(routed)}",
                patch=lambda m=m, name=name: _gpt2_rows(m, name, allowed),
            ))  # fmt: skip
        else:
            out.append(Decision(
                name, None, None, m, kind=f"{kind} attention", reason=reason,
                refusal=(technique, reason),
            ))  # fmt: skip
    return out


# NOTE [GPT-2's attention output as one node]
# Where ``convert_`` gave an HF model the slimgrad attention for ``"sdpa"`` (:func:`
# attention_pattern`), each HF ``GPT2Attention`` self-attention whose forward is transformers'
# own (no subclass override, no patched forward) gets a :class:`GPT2AttentionForward` as its
# instance ``forward`` (the instance stays HF's class: ``isinstance``, HF's output capture and
# weight init, ``state_dict`` and hooks are unchanged). Each call runs HF's forward op for op,
# except the common training call (the case of NOTE [HF attention's straight path]: training with
# both dropouts in (0, 1), no mask tensor, no cross-attention, no earlier keys in the cache (HF
# passes an empty DynamicCache in training: updated as HF updates it), the config still naming
# the slimgrad attention, float32 CPU not standing for another device, grad on, no autocast;
# eager: not compiling, no ``torch.func`` transform or trace, while a dispatch mode such as the
# memory tracker or the estimate's fake tensors does not refuse it, NOTE [GPT-2's attention node
# under dispatch modes] in ``slimgrad/ops/gpt2_attention.py``): there ``c_attn``, the head split
# and the cache update run as HF runs them, then
# :func:`slimgrad.ops.gpt2_attention.apply` runs the scores op, the head merge, ``c_proj`` and
# ``resid_dropout`` as one autograd node (NOTE [One node for
# GPT-2's attention output] in ``slimgrad/ops/gpt2_attention.py``): the per-op path's values,
# gradients and masks bit for bit. It takes the node only where ``c_proj`` and ``resid_dropout``
# are the modules ``convert_`` made (slimgrad's ``Conv1D`` forward, slimgrad's ``Dropout``, not
# in place) with no hook or patched forward of their own and no global module hook; ``c_attn``
# runs as a module call (its hooks fire). Anything else runs HF's forward.
#
# NOTE [GPT-2's attention after a second cache update]
# A GPT-2 block recomputed in backward (``slimgrad.plan``'s ``lean+recompute``, plain
# ``torch.utils.checkpoint``) gets its cache positionally (GPT2Model passes ``past_key_values`` as
# the block's second argument, which NOTE [A recomputed block does not write the KV cache] in
# slimgrad/plan.py cannot drop), so the recompute appends its keys a second time and reads 2T of
# them. The per-op path crops them to the first T (upper-left causal, as HF's
# ``sdpa_attention_forward`` and :func:`_attention`): the forward's keys, bit for bit. Without the
# same crop here the node ran in forward and the per-op path in the recompute, whose saved tensors
# had other shapes: a real step raised torch's CheckpointError (the node's (B·H, T, d) operands
# saved, (B, H, T, d) recomputed), and once the estimate took the node it raised there too
# (tests/test_plan.py). Cropped, the recompute takes the node again, with the forward's values.
#
# NOTE [GPT-2's cache keyword]
# HF's ``GPT2Attention.forward`` takes the KV cache as a named parameter, ``past_key_values`` in
# transformers 5.23 and ``cache`` in 5.24 (behind ``@deprecate_kwarg`` renaming the old name).
# The name is read once, from the signature of the forward the instance runs (the function
# under its decorators), when :func:`gpt2_attention_forwards_` puts the forward on: exactly one
# of the known cache names must be a parameter, else the attention keeps HF's forward. A call
# that passes another of those names (a deprecated spelling) runs HF's forward, whose decorators
# rename it. The straight path updates the cache under the parameter's name as HF's forward
# does (``cache.update(key, value, layer_idx)``, the layers of ``transformers.cache_utils``
# ignore any further keyword HF passes) and takes only caches of that module (a paged
# continuous-batching cache runs HF's forward). tests/conformance/test_hf_families.py compares
# the returned caches with eager's.
_CACHE_NAMES = ("past_key_values", "cache")
_GPT2_NAMED = frozenset(
    {
        "attention_mask",
        "encoder_hidden_states",
        "encoder_attention_mask",
        "output_attentions",
    }
)


def _cache_parameter(fn) -> str | None:
    # NOTE [GPT-2's cache keyword]: the one known cache name that is a parameter of fn
    try:
        params = inspect.signature(inspect.unwrap(fn)).parameters
    except (TypeError, ValueError):
        return None
    found = [n for n in _CACHE_NAMES if n in params]
    return found[0] if len(found) == 1 else None


class GPT2AttentionForward(InstanceForward):
    """The ``forward`` ``convert_`` puts on an HF ``GPT2Attention`` instance (NOTE [GPT-2's
    attention output as one node])."""

    # class defaults: an instance pickled before these were stored (transformers 5.23's name)
    cache_name = "past_key_values"
    other_cache_names = ("cache",)
    named = _GPT2_NAMED | {"past_key_values"}

    def __init__(self, module: nn.Module, cache_name: str = "past_key_values") -> None:
        super().__init__(module)
        # NOTE [GPT-2's cache keyword]: decided at convert_, read per call
        self.cache_name = cache_name
        self.other_cache_names = tuple(n for n in _CACHE_NAMES if n != cache_name)
        self.named = _GPT2_NAMED | {cache_name}

    def __call__(self, *args, **kwargs):
        m = self.module
        # compiling() before anything else: Dynamo folds it and traces HF's forward alone, with
        # no guard on what the checks below would read
        if compiling():
            return type(m).forward(m, *args, **kwargs)
        hidden = args[0] if len(args) == 1 else kwargs.get("hidden_states")
        if not self.straight(args, kwargs, hidden):
            return type(m).forward(m, *args, **kwargs)
        return self.after_c_attn(m._modules["c_attn"](hidden), kwargs)

    def straight(self, args, kwargs, hidden) -> bool:
        """Whether this call of the attention (``hidden`` its hidden states) runs the straight
        path of NOTE [GPT-2's attention output as one node] (``c_attn``, then
        :meth:`after_c_attn`); else HF's forward."""
        snd, mlp, ga = _GPT2_DEPS if _GPT2_DEPS else _gpt2_deps()
        m = self.module
        d = m.__dict__
        mods = d["_modules"]
        c_attn, c_proj, drop = mods.get("c_attn"), mods.get("c_proj"), mods.get("resid_dropout")
        attn_drop = mods.get("attn_dropout")
        if not (
            not compiling()  # first: Dynamo folds it (HF's forward, traced as before)
            and (len(args) == 1 or (not args and "hidden_states" in kwargs))
            and d["training"]
            and type(hidden) in ga._PLAIN  # the estimate's fakes too (NOTE in ops/gpt2_attention)
            and hidden.is_cpu
            and hidden.dtype is torch.float32
            and hidden.ndim == 3
            and kwargs.get("attention_mask") is None
            and kwargs.get("encoder_hidden_states") is None
            and not d.get("is_cross_attention", True)
            and d.get("is_causal") is True
            and isinstance(attn_drop, nn.Dropout)
            and type(attn_drop.p) is float
            and 0.0 < attn_drop.p < 1.0
            and type(drop) is snd.Dropout
            and not drop.inplace
            and drop.training
            and type(drop.p) is float
            and 0.0 < drop.p < 1.0
            and c_attn is not None
            and type(c_proj).forward is mlp._CONV1D_FORWARD
            and "weight" in (pp := c_proj._parameters)
            and type(pp["weight"]) in ga._WEIGHT
            and type(pp.get("bias")) in ga._WEIGHT
            # mlp._hooked(child) and mlp._global_hooks() only when some hook dict is not empty
            and not (
                (
                    c_proj._forward_hooks
                    or c_proj._forward_pre_hooks
                    or c_proj._backward_hooks
                    or c_proj._backward_pre_hooks
                    or drop._forward_hooks
                    or drop._forward_pre_hooks
                    or drop._backward_hooks
                    or drop._backward_pre_hooks
                    or "forward" in c_proj.__dict__
                    or "forward" in drop.__dict__
                )
                and (mlp._hooked(c_proj) or mlp._hooked(drop))
            )
            and not (
                (
                    _module._global_forward_hooks
                    or _module._global_forward_pre_hooks
                    or _module._global_backward_hooks
                    or _module._global_backward_pre_hooks
                )
                and mlp._global_hooks()
            )
            and device_rule.RULES["attention"] is _SDPA_RULE
            and device_rule._STANDS_FOR.get() is None
            and _grad_on()
            and not _any_autocast()
            and not ga._functorch_on()
            and not ga._is_tracing()
            and getattr(d.get("config"), "_attn_implementation", None) == ATTN_NAME
        ):
            return False
        if kwargs:  # HF passes all but its named ones to the attention function: its keyword rule
            if kwargs.get("is_causal") is not None:  # the node is causal exactly where T > 1
                return False
            for name in self.other_cache_names:  # NOTE [GPT-2's cache keyword]
                if name in kwargs:
                    return False
            cache = kwargs.get(self.cache_name)
            if cache is not None and not isinstance(cache, _hf_cache_class()):
                return False
            fn = _HF_SDPA[0].sdpa_attention_forward if _HF_SDPA else None
            unimplemented = _UNIMPLEMENTED[1] if _UNIMPLEMENTED[0] is fn else _sdpa_unimplemented()
            named = self.named
            for name in ("position_bias", *unimplemented):
                if name in kwargs and name not in named:
                    v = kwargs[name]
                    if v is not None and v is not False:  # _is_set
                        return False
        return True

    def after_c_attn(self, qkv, kwargs):
        """HF's forward from ``c_attn``'s output ``qkv`` on, for a call :meth:`straight` took."""
        snd, mlp, ga = _GPT2_DEPS
        m = self.module
        d = m.__dict__
        mods = d["_modules"]
        c_proj, drop, attn_drop = mods["c_proj"], mods["resid_dropout"], mods["attn_dropout"]
        pp = c_proj._parameters
        # HF's forward for a self-attention, step for step up to the attention
        query, key, value = qkv.split(d["split_size"], dim=2)
        shape_kv = (*key.shape[:-1], -1, d["head_dim"])
        key = key.view(shape_kv).transpose(1, 2)
        value = value.view(shape_kv).transpose(1, 2)
        shape_q = (*query.shape[:-1], -1, d["head_dim"])
        query = query.view(shape_q).transpose(1, 2)
        cache = kwargs.get(self.cache_name)  # NOTE [GPT-2's cache keyword]
        if cache is not None:  # HF's update of the self-attention cache (training: an empty one)
            if isinstance(cache, sys.modules[type(m).__module__].EncoderDecoderCache):
                cache = cache.self_attention_cache
            key, value = cache.update(key, value, d["layer_idx"])
        q_len = query.shape[2]
        if q_len > 1 and key.shape[2] > q_len:  # as _attention: upper-left causal on a crop
            # NOTE [GPT-2's attention after a second cache update]
            key, value = key[:, :, :q_len, :], value[:, :, :q_len, :]
        scaling = d["scaling"]
        w, b = pp["weight"], pp["bias"]
        if (scaling is None or (type(scaling) is float and scaling >= 0)) and ga.block_ok(
            query, key, value, w, b, attn_drop.p, drop.p
        ):
            rk = (scaling, query.shape[-1])
            _, root = _ROOTS[rk] if rk in _ROOTS else _roots(scaling, query.shape[-1])
            return ga.apply(query, key, value, w, b, root, attn_drop.p, drop.p), None
        # the rest of HF's forward (the attention function its config names: _attention)
        named = self.named
        rest = {k: v for k, v in kwargs.items() if k not in named and k != "hidden_states"}
        out, weights = _attention(
            m, query, key, value, None, dropout=attn_drop.p, scaling=scaling, **rest
        )
        out = out.reshape(*out.shape[:-2], -1).contiguous()
        return drop(c_proj(out)), weights


_GPT2_DEPS: list = []  # (slimgrad.nn.dropout, slimgrad.nn.gpt2_mlp, slimgrad.ops.gpt2_attention)
_HF_CACHE: list = []  # transformers.cache_utils.Cache, imported at convert_


def _hf_cache_class() -> type:
    if not _HF_CACHE:
        from transformers.cache_utils import Cache

        _HF_CACHE.append(Cache)
    return _HF_CACHE[0]


def _gpt2_deps():
    # imported at the first call (slimgrad.nn imports convert_handlers), then read from the list
    from slimgrad.nn import dropout, gpt2_mlp
    from slimgrad.ops import gpt2_attention

    _GPT2_DEPS[:] = [dropout, gpt2_mlp, gpt2_attention]
    return _GPT2_DEPS


def left_alone(model: nn.Module, allowed=None, prefix: str = "") -> set[str]:
    """The names (in ``model``) of the modules ``convert_``'s filter leaves alone, with everything
    inside them: ``allowed(module, qualified name)`` is False there or above (``filter_fn``, a
    plan's eager blocks)."""
    if allowed is None:
        return set()
    out: set[str] = set()
    for name, m in model.named_modules():
        parent = name.rpartition(".")[0]
        full = f"{prefix}.{name}" if prefix and name else prefix or name
        if (name and parent in out) or not allowed(m, full):
            out.add(name)
    return out


def gpt2_attention_forwards_(model: nn.Module, allowed=None, prefix: str = "") -> list[str]:
    """Put :class:`GPT2AttentionForward` on ``model``'s HF GPT-2 self-attentions (NOTE [GPT-2's
    attention output as one node]) that ``allowed`` (``convert_``'s filter; ``prefix``: the
    model's name) does not leave alone; returns their names."""
    hf = sys.modules.get("transformers.models.gpt2.modeling_gpt2")
    stock = getattr(getattr(hf, "GPT2Attention", None), "forward", None)
    cache_name = _cache_parameter(stock) if stock is not None else None
    if cache_name is None:  # NOTE [GPT-2's cache keyword]
        return []
    _hf_cache_class()
    skip = left_alone(model, allowed, prefix)
    names = []
    for name, m in model.named_modules():
        if (
            name not in skip
            and isinstance(m, hf.GPT2Attention)
            and type(m).forward is stock
            and "forward" not in m.__dict__
            and m.__dict__.get("is_cross_attention") is False
            and getattr(m.__dict__.get("config"), "_attn_implementation", None) == ATTN_NAME
        ):
            m.forward = GPT2AttentionForward(m, cache_name)
            names.append(name)
    if names:  # NOTE [GPT-2's block with its LayerNorms folded]
        from slimgrad.convert_handlers.hf_gpt2_block import gpt2_block_forwards_

        gpt2_block_forwards_(model, skip)
    return names
