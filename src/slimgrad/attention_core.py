"""Recompute only an HF attention module's core in backward (``slimgrad.plan``'s
``lean+recompute:attention-core`` choice).

# NOTE [The attention core, recomputed]
HF attention modules (Llama, GPT-2, Qwen, Mistral, ...) compute their q/k/v projections, RoPE and
the KV-cache update in their own forward, then hand ``(module, query, key, value, mask, **kw)``
to the function ``ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
eager_attention_forward)`` returns: the *core* (``QK^T``, mask, softmax, dropout, ``PV``; SDPA or
the family's eager function), then the output projection. Megatron's selective recompute keeps
the core's inputs and recomputes the core in backward: what it keeps beyond q, k and v (the
probabilities or the fused kernel's output and log-sum-exp, dropout's mask) is not kept.

:func:`wrap` does that for one module, from HF's documented extension point and nothing global:
it gives the module its own copy of its config whose ``_attn_implementation`` is
``"slimgrad_core"``, a name registered in ``AttentionInterface`` (no other model or module sees
it), and stores on the module the function its old name resolved to (decided once, at apply
time). :func:`_core` runs that function under ``torch.utils.checkpoint`` (non-reentrant, RNG state
kept and restored, autocast state restored by checkpoint; ``recompute_in_backward`` in
``slimgrad/_compile.py``), so the recompute gives the bits of the first forward: the same dropout
mask, the same outputs and gradients as the module without recompute. Without grad, and while
``torch.export`` traces (NOTE [Recompute tags under torch.export]), it calls the function
directly. The module wraps only when the switch
changes nothing but the function: its class dispatches through ``ALL_ATTENTION_FUNCTIONS`` and
every other read of ``_attn_implementation`` in its file gives the same answer for the new name as
for the old one (the analysis of NOTE [HF attention: exact or untouched]); otherwise
:func:`wrap` raises ``NotImplementedError`` with the reason.

The recompute FLOPs are the core's matmul FLOPs as ``FlopCounterMode`` counts them: the attention
module's less its children's (the projections).
"""

from __future__ import annotations

import ast
import copy

import torch
import torch.nn as nn

from slimgrad._compile import recompute_in_backward

CORE_NAME = "slimgrad_core"
_registered = False


def _core(module, query, key, value, attention_mask, *args, **kwargs):
    inner = module._slimgrad_core_inner
    if not torch.is_grad_enabled():
        return inner(module, query, key, value, attention_mask, *args, **kwargs)
    if module.__dict__.get("_slimgrad_core_sdpa") and kwargs.get("position_bias") is None:
        # NOTE [SDPA's autocast casts, before the checkpoint]
        device = query.device.type
        if torch.is_autocast_enabled(device):
            low = torch.get_autocast_dtype(device)
            query, key, value = (_autocast_cast(t, device, low) for t in (query, key, value))
    # while exporting, the core itself (NOTE [Recompute tags under torch.export])
    return recompute_in_backward(
        inner, module, query, key, value, attention_mask, *args, preserve_rng_state=True, **kwargs
    )


# NOTE [SDPA's autocast casts, before the checkpoint]
# Under autocast, SDPA (a lower-precision op in CPU's and CUDA's autocast lists) casts each
# floating argument other than float64 to autocast's dtype before it runs; HF Llama's q and k
# arrive in float32 (RoPE's float32 cos/sin promote them), v in autocast's dtype. The checkpoint
# keeps its inputs, so it would keep the float32 q and k, twice the bytes of the casts the SDPA
# op keeps without recompute. Where the core is SDPA's (HF's ``sdpa_attention_forward``, or
# slimgrad's attention, which computes what it computes), :func:`_core` makes those casts itself,
# before the checkpoint, with autocast's rule: the same ``.to`` of the same tensors, so SDPA sees
# the tensors it would have made and casts nothing, and every op between the function's entry and
# SDPA (``repeat_kv``, GQA packing, ``is_causal``) moves data without reading the dtype. Not with
# a ``position_bias`` (HF's bias mask reads the key's dtype) nor for eager functions (Llama's casts
# the probabilities to the query's dtype).


def _autocast_cast(t, device: str, low: torch.dtype):
    # autocast's eligibility for a lower-precision op's argument: a floating tensor on the
    # autocast device, not float64
    if (
        isinstance(t, torch.Tensor)
        and t.is_floating_point()
        and t.dtype not in (torch.float64, low)
        and t.device.type == device
    ):
        return t.to(low)
    return t


def register() -> None:
    """Add ``"slimgrad_core"`` to HF's attention registry (idempotent)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(CORE_NAME, _core)
        _registered = True


def _dispatches(cls: type) -> bool:
    from slimgrad.convert_handlers.hf_attention import _method_node

    _, fwd = _method_node(cls, "forward")
    return fwd is not None and any(
        isinstance(n, ast.Name | ast.Attribute)
        and (getattr(n, "id", None) or getattr(n, "attr", None)) == "ALL_ATTENTION_FUNCTIONS"
        for n in ast.walk(fwd)
    )


def attention_modules(block: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules in ``block`` (relative names) whose forward dispatches through HF's
    ``ALL_ATTENTION_FUNCTIONS`` and that hold a config with an attention implementation."""
    try:
        from slimgrad.convert_handlers.hf_attention import _hf_class
    except ImportError:  # no transformers
        return []
    out = []
    for name, m in block.named_modules():
        cfg = getattr(m, "config", None)
        if not hasattr(cfg, "_attn_implementation"):
            continue
        if any(_hf_class(c) for c in type(m).__mro__) and _dispatches(type(m)):
            out.append((name, m))
    return out


def _why_not(module: nn.Module, origin: str) -> str | None:
    from slimgrad.convert_handlers.hf_attention import _file_tree, _impl_reads, _method_node

    cls = type(module)
    owner, fwd = _method_node(cls, "forward")
    if fwd is None:
        return f"{cls.__name__}: its forward's source is not available to check"
    parsed = _file_tree(owner.__module__)
    if parsed is None:
        return f"the source of {owner.__module__} is not available to check"
    classes, funcs, parents = parsed
    for c in cls.__mro__:
        if c.__module__ == owner.__module__ and c.__name__ in classes:
            for scope in [classes[c.__name__], *funcs]:
                bad = _impl_reads(scope, parents, origin, CORE_NAME)
                if bad:
                    return (
                        f"{cls.__name__} reads config._attn_implementation beyond the attention "
                        f"lookup ({bad[0]})"
                    )
    return None


def _inner(module: nn.Module, origin: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from slimgrad.convert_handlers.hf_attention import _eager_default

    default = _eager_default(type(module))
    if origin == "eager":
        return default
    return ALL_ATTENTION_FUNCTIONS.get_interface(origin, default)


def _is_sdpa(fn) -> bool:
    # HF's SDPA function, or slimgrad's, which computes what it computes (NOTE [HF attention:
    # exact or untouched])
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from slimgrad.convert_handlers.hf_attention import _attention

    return fn is sdpa_attention_forward or fn is _attention


def wrap(block: nn.Module, api: str = "slimgrad.convert_") -> list[str]:
    """Recompute the attention core of every HF attention module in ``block`` in backward
    (NOTE [The attention core, recomputed]); returns their names in ``block``.

    Raises:
        NotImplementedError: ``block`` has no such module, or one whose switch would change more
            than the attention function (the reason says which).
    """
    found = attention_modules(block)
    if not found:
        raise NotImplementedError(
            f"{api}: recomputing the attention core needs an HF attention module that dispatches "
            f"through ALL_ATTENTION_FUNCTIONS; expected one in {type(block).__name__}, got none. "
            "Use lean+recompute or lean+recompute:<child> for this block."
        )
    register()
    for _, m in found:
        cfg = m.config
        origin = cfg._attn_implementation
        if origin == CORE_NAME:
            continue
        why = _why_not(m, origin)
        inner = _inner(m, origin) if why is None else None
        if why is None and inner is None:
            why = f"{type(m).__name__}: no attention function for {origin!r}"
        if why is not None:
            raise NotImplementedError(
                f"{api}: the attention core of {type(m).__name__} cannot be recomputed alone; "
                f"expected a module whose only use of its attention implementation is the "
                f"lookup, got {why}. Use lean+recompute for this block."
            )
        own = copy.deepcopy(cfg)
        own._attn_implementation = {"": CORE_NAME}
        for k, v in list(vars(m).items()):
            if v is cfg:
                setattr(m, k, own)
        m._slimgrad_core_inner = inner
        m._slimgrad_core_sdpa = _is_sdpa(inner)
    return [n for n, _ in found]
