"""convert_ handlers for timm's blocks (ConvNeXt blocks, ViT attention), by class name.

``TABLE`` ({qualified class name: (ConvertConfig field, handler)}) is merged into
``slimgrad.convert._TABLE``; ``PATTERNS`` (``(ConvertConfig field or None, pattern)``) run after
convert's own passes. timm is never imported: the handlers check the instance against timm 1.0's
forwards (class and attribute names), and the replacements keep timm's children, parameters,
buffers and state_dict keys (``CONVERT_CHILDREN``: ``convert_`` then converts those children by
the table, e.g. the norms and GELUs).

# NOTE [timm blocks: each piece of data kept once]
Measured per block after the layer conversions (CPU fp32, exact tracker), everything a block still
keeps is one tensor per piece of data, shared by the nodes that need it (the norm's output with the
next Linear, GELU's output with fc2, SDPA's output with proj: the CPU flash kernel returns it in
(B, N, H, D) memory, so ``transpose(1, 2).reshape`` is a view; q, k, v are views of qkv's output)
except two tensors that the block's own arithmetic makes redundant:

- ConvNeXt's layer scale ``mul(gamma)`` keeps the second Linear's output z for gamma's gradient.
  ``dgamma = sum_rows dy * z`` is also ``sum_j W M + b sum_rows dy`` with ``M = dy^T x``, the
  product the weight gradient is made from (``slimgrad.ops.linear_scale``): z is not kept, and the
  block keeps its input (the depthwise conv's), the norm's output and GELU's output + 1 bit.
- ViT attention keeps q, k and v (SDPA's backward needs all three) and, for the qkv weight's
  gradient, qkv's input x. v is ``x W_v^T + b_v``: ``slimgrad.ops.qkv_attention`` computes qk and v
  with two GEMMs (bit for bit the fused one on CPU at timm's shapes; within the error rule in
  any case), keeps q, k, x and SDPA's output, and recomputes v in backward with the same call (one
  C x C GEMM per token, about 2.6% of a ViT-S step's FLOPs).

Anything the fast path does not cover runs timm's own forward, copied verbatim (same children,
same calls): attention masks, causal, qk_norm, scale_norm, gated attention, attention dropout in
training, timm's non-fused path, hooks on the children the fast path does not call, autocast,
no_grad, torch.compile (the ops run eager's ops while Dynamo traces), non-CPU devices.
torch.jit.script of a converted model raises slimgrad's clear error (``NoScript``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from slimgrad.nn._hooks import global_hooks_act
from slimgrad.nn._script import NoScript
from slimgrad.nn.dropout import Dropout as _SlimDropout
from slimgrad.nn.linear import Linear as _SlimLinear
from slimgrad.ops.linear_scale import linear_scale
from slimgrad.ops.qkv_attention import qkv_attention

__all__ = ["PATTERNS", "TABLE", "Attention", "ConvNeXtBlock"]

_LINEARS = (nn.Linear, _SlimLinear)


def _qual(obj) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def _hooked(*modules: nn.Module) -> bool:
    # a module the fast path does not call would miss its hooks (or patched forward); torch's
    # module tracker's global hooks do not count (NOTE [torch's module tracker is an observer] in
    # slimgrad/nn/_hooks.py)
    g = nn.modules.module
    if (
        g._global_forward_hooks
        or g._global_forward_pre_hooks
        or g._global_backward_hooks
        or g._global_backward_pre_hooks
    ) and global_hooks_act():
        return True
    return any(
        m._forward_hooks
        or m._forward_pre_hooks
        or m._backward_hooks
        or m._backward_pre_hooks
        or "forward" in m.__dict__
        or "__call__" in m.__dict__
        for m in modules
    )


def _is_identity(m: object) -> bool:
    return type(m) is nn.Identity


def _no_op_dropout(m: object) -> bool:
    # identity in value and gradient: nn.Identity, or a dropout with p == 0 / in eval
    if _is_identity(m):
        return True
    return type(m) in (nn.Dropout, _SlimDropout) and (m.p == 0 or not m.training)


def _rebuild(cls: type, module: nn.Module) -> nn.Module:
    # the instance's attributes in the slimgrad class: own containers, the same Parameters,
    # buffers, children and hook functions (as convert_handlers.timm); ``_timm_fn`` is timm's
    # forward function itself (the handler checked its name), which the replacement calls off
    # its fast path: nothing of timm is copied or rebound
    new = cls.__new__(cls)
    for k, v in module.__dict__.items():
        new.__dict__[k] = type(v)(v) if type(v) in (dict, OrderedDict, list, set) else v
    new.__dict__["_timm_fn"] = type(module).forward
    return new


def _check_forward(module: nn.Module, timm_forward: str) -> None:
    fwd = type(module).forward
    if _qual(fwd) != timm_forward:
        raise NotImplementedError(f"forward is {_qual(fwd)}; expected {timm_forward}")


# ----------------------------------------------------------------------------------- ConvNeXt
_CONVNEXT_FORWARD = "timm.models.convnext.ConvNeXtBlock.forward"
_MLP = "timm.layers.mlp.Mlp"


class ConvNeXtBlock(NoScript, nn.Module):
    """timm's ``ConvNeXtBlock`` whose layer scale keeps nothing (``slimgrad.ops.linear_scale``).

    dwconv -> permute -> LayerNorm -> Mlp(fc1, act, drop1, norm, fc2, drop2) -> permute ->
    ``mul(gamma)`` -> drop_path -> + shortcut, with fc2 and the gamma multiply as one op. The other
    children are timm's (converted by the table). Outside the fast path (NOTE [timm blocks: each
    piece of data kept once]) it runs timm's forward.

    Memory: the block keeps its input, the norm's output and the act's output (eager with the
    layer conversions: also fc2's output, for gamma's gradient).
    """

    #: ``slimgrad.convert_`` converts this module's children too after replacing it
    CONVERT_CHILDREN = True

    def _fast(self) -> bool:
        mlp = self.mlp
        return (
            not self.use_conv_mlp
            and isinstance(self.gamma, torch.Tensor)
            and _qual(type(mlp)) == _MLP
            and type(mlp.fc2) in _LINEARS
            and _is_identity(mlp.norm)
            and _no_op_dropout(mlp.drop2)
            and not _hooked(mlp, mlp.norm, mlp.fc2, mlp.drop2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._fast():
            return self._timm_forward(x)
        shortcut = x
        x = self.conv_dw(x)
        x = x.permute(0, 2, 3, 1)
        x = self.norm(x)
        mlp = self.mlp
        x = mlp.fc1(x)
        x = mlp.act(x)
        x = mlp.drop1(x)
        x = linear_scale(x, mlp.fc2.weight, mlp.fc2.bias, self.gamma)
        x = x.permute(0, 3, 1, 2)
        x = self.drop_path(x) + self.shortcut(shortcut)
        return x

    def _timm_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._timm_fn(self, x)  # timm's own ConvNeXtBlock.forward (the handler's check)

    # its output is ``drop_path(...) + shortcut(...)``, a fresh sum on both paths (NOTE [A
    # replacement states its structure] in convert_handlers/inplace_guard.py)
    _slimgrad_output_statement = (forward, (None,))


def convnext_block_from_timm(module: nn.Module) -> nn.Module:
    """timm ``ConvNeXtBlock`` -> :class:`ConvNeXtBlock` (shared state), when it has a layer scale
    after a channels-last Mlp; else ``NotImplementedError`` (its children still convert)."""
    _check_forward(module, _CONVNEXT_FORWARD)
    if getattr(module, "use_conv_mlp", True):
        raise NotImplementedError(
            "conv_mlp=True (1x1 convolutions, no layer scale over a Linear); expected "
            "conv_mlp=False, got True"
        )
    if not isinstance(getattr(module, "gamma", None), torch.Tensor):
        raise NotImplementedError(
            "no layer scale (ls_init_value=None): nothing kept twice; expected a gamma Parameter, "
            "got None"
        )
    mlp = module._modules.get("mlp")
    if mlp is None or _qual(type(mlp)) != _MLP or type(mlp.fc2) not in _LINEARS:
        raise NotImplementedError(
            f"its mlp is {type(mlp).__name__}; expected timm's Mlp with a Linear fc2 (e.g. not "
            "GlobalResponseNormMlp)"
        )
    return _rebuild(ConvNeXtBlock, module)


# ---------------------------------------------------------------------------------- ViT attention
_ATTENTION_FORWARD = "timm.layers.attention.Attention.forward"


class Attention(NoScript, nn.Module):
    """timm's ``Attention`` whose qkv + SDPA keep q and k and recompute v
    (``slimgrad.ops.qkv_attention``); then timm's norm, proj and proj_drop.

    Off the fast path (NOTE [timm blocks: each piece of data kept once]: masks, qk_norm, gating,
    attention dropout in training, timm's non-fused path, hooks on qkv/q_norm/k_norm/attn_drop)
    it runs timm's forward.

    Memory: keeps qkv's input, q, k, SDPA's output (shared with proj) and 4 B per row and head;
    eager keeps q, k and v.
    """

    #: ``slimgrad.convert_`` converts this module's children too after replacing it
    CONVERT_CHILDREN = True

    def _fast(self, attn_mask) -> bool:
        return (
            attn_mask is None
            and self.fused_attn
            and getattr(self, "gate", None) is None
            and type(self.qkv) in _LINEARS
            and _is_identity(self.q_norm)
            and _is_identity(self.k_norm)
            and (not self.training or self.attn_drop.p == 0)
            and not _hooked(self.qkv, self.q_norm, self.k_norm, self.attn_drop)
        )

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        if not self._fast(attn_mask) or x.dim() != 3:
            return self._timm_fn(self, x, attn_mask=attn_mask, is_causal=is_causal)
        B, N, C = x.shape
        o = qkv_attention(
            x, self.qkv.weight, self.qkv.bias, self.num_heads, self.head_dim, is_causal
        )
        x = o.transpose(1, 2).reshape(B, N, self.attn_dim)
        x = self.norm(x)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x

    # SDPA's output (fresh) through norm, proj, proj_drop on both paths (timm's: ``x * gate``
    # after the norm is fresh too) (NOTE [A replacement states its structure] in
    # convert_handlers/inplace_guard.py)
    _slimgrad_output_statement = (forward, (None, "norm", "proj", "proj_drop"))


def attention_from_timm(module: nn.Module) -> nn.Module:
    """timm ``Attention`` -> :class:`Attention` (shared state)."""
    _check_forward(module, _ATTENTION_FORWARD)
    qkv = module._modules.get("qkv")
    h, d = getattr(module, "num_heads", None), getattr(module, "head_dim", None)
    if type(qkv) not in _LINEARS or not isinstance(h, int) or not isinstance(d, int):
        raise NotImplementedError(
            f"its qkv is {type(qkv).__name__} (heads {h!r} of {d!r}); expected a Linear and "
            "integer num_heads, head_dim"
        )
    if qkv.out_features != 3 * h * d or getattr(module, "attn_dim", None) != h * d:
        raise NotImplementedError(
            f"qkv has {qkv.out_features} outputs; expected 3 * num_heads * head_dim = {3 * h * d}"
        )
    return _rebuild(Attention, module)


# {qualified timm class name: (ConvertConfig field, handler)}; merged into slimgrad.convert._TABLE.
TABLE: dict = {
    "timm.models.convnext.ConvNeXtBlock": ("selective_saving", convnext_block_from_timm),
    "timm.layers.attention.Attention": ("selective_saving", attention_from_timm),
}
PATTERNS: list = []
