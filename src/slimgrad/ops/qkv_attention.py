"""Self-attention from one qkv projection that keeps q and k, and recomputes v in backward.

Math: ``qkv = x W^T + b`` split into heads (timm's ``Attention``: ``reshape(B, N, 3, H, D)``,
``permute(2, 0, 3, 1, 4)``), ``o = softmax(q k^T * scale [+ causal]) v`` by torch's CPU flash
kernel (what ``F.scaled_dot_product_attention`` runs there), returned as ``(B, H, N, D)``.
qk and v are two GEMMs over the row blocks of W (on CPU bit for bit the fused one at timm's
shapes, and within the error rule in any case). Backward recomputes ``v = x W_v^T + b_v`` with
the same call (the same bits), runs the kernel's backward, and forms the projection's gradients
from the kernel's dq, dk, dv blocks without assembling eager's ``(B*N, 3*H*D)`` gradient (dW and
db as eager's; dx as three accumulated GEMMs, within the rule).

Memory: saves x (qkv's input: the norm output before it keeps it too), q and k (2/3 of qkv's
output), SDPA's output (shared with the next projection) and its log-sum-exp (4 B per row and
head); eager keeps x (when W needs a gradient) and all of qkv's output. The recompute costs one
``N x C x C`` GEMM per sequence in backward. Its backward holds q and k until it returns (eager
frees qkv's output before the projection's GEMMs), so one op alone can peak up to 2C per row above
eager in backward; in a model the peak falls where more is alive (timm ViT-S: in forward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from slimgrad._autograd import first_order, refuse_jit, transforms_active

__all__ = ["flash_eligible", "qkv_attention"]

_FLASH = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _qk(x: Tensor, weight: Tensor, bias: Tensor | None, a: int) -> Tensor:
    return F.linear(x, weight[: 2 * a], None if bias is None else bias[: 2 * a])


def _v(x: Tensor, weight: Tensor, bias: Tensor | None, a: int) -> Tensor:
    # the same call in forward and in backward's recompute: the same bits
    return F.linear(x, weight[2 * a :], None if bias is None else bias[2 * a :])


def _heads(qk: Tensor, v: Tensor, h: int, d: int) -> tuple[Tensor, Tensor, Tensor]:
    b, n = qk.shape[:2]
    q, k = qk.reshape(b, n, 2, h, d).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v.reshape(b, n, h, d).transpose(1, 2)


def _fwd_torch(x, weight, bias, num_heads, head_dim, is_causal=False):
    # eager: timm's Attention up to SDPA
    b, n, _ = x.shape
    qkv = F.linear(x, weight, bias).reshape(b, n, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


class _QKVAttentionFn(torch.autograd.Function):
    _slimgrad_floor = True  # SDPA's and qkv's inputs: matmul inputs

    @staticmethod
    def forward(ctx, x, weight, bias, num_heads, head_dim, is_causal):
        a = num_heads * head_dim
        q, k, v = _heads(_qk(x, weight, bias, a), _v(x, weight, bias, a), num_heads, head_dim)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal
        )
        ctx.meta = (num_heads, head_dim, is_causal, bias is not None)
        ctx.save_for_backward(x, weight, bias, q, k, out, lse)
        return out

    @staticmethod
    @first_order("ops.qkv_attention")
    def backward(ctx, dout):
        x, weight, bias, q, k, out, lse = ctx.saved_tensors
        num_heads, head_dim, is_causal, has_bias = ctx.meta
        a = num_heads * head_dim
        b, n, c = x.shape
        v = _v(x, weight, bias, a).view(b, n, num_heads, head_dim).transpose(1, 2)
        grads = list(
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse, 0.0, is_causal
            )
        )
        del v
        # dq, dk, dv come in (B, N, H, D) memory: each is a (B*N, A) row block of eager's
        # (B*N, 3A) gradient without a copy. dW and db are that block's rows of eager's GEMM and
        # sum; dx sums the three blocks' products (eager: one GEMM over 3A), so no (B*N, 3A)
        # gradient is assembled (eager's stack and reshape make two).
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        x2 = x.reshape(b * n, c)
        dx = dw = db = None
        if need_w:
            dw = torch.empty_like(weight)
        if need_b and has_bias:
            db = torch.empty_like(bias)
        for i in range(3):
            gi = grads[i].transpose(1, 2).reshape(b * n, a)
            grads[i] = None
            rows = slice(i * a, (i + 1) * a)
            if need_x:
                wi = weight[rows]
                dx = gi.mm(wi) if dx is None else dx.addmm_(gi, wi)
            if dw is not None:
                torch.mm(gi.t(), x2, out=dw[rows])
            if db is not None:
                torch.sum(gi, 0, out=db[rows])
            del gi
        if dx is not None:
            dx = dx.view(b, n, c)
        return dx, dw, db, None, None, None


def flash_eligible(x: Tensor, num_heads: int, head_dim: int, is_causal: bool = False) -> bool:
    """Whether ``F.scaled_dot_product_attention`` would run the CPU flash kernel on the heads of
    ``x``'s qkv (asked of torch's own backend choice, so ``sdpa_kernel`` contexts are obeyed)."""
    if x.device.type != "cpu" or x.dim() != 3 or x.dtype not in _DTYPES:
        return False
    b, n, _ = x.shape
    probe = x.new_empty(head_dim).expand(b, num_heads, n, head_dim)
    return torch._fused_sdp_choice(probe, probe, probe, None, 0.0, is_causal) == _FLASH


def qkv_attention(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    num_heads: int,
    head_dim: int,
    is_causal: bool = False,
) -> Tensor:
    """timm's ``Attention`` from its qkv Linear through SDPA, keeping q and k but not v.

    Math: ``q, k, v = heads(x W^T + b)``, ``o = softmax(q k^T / sqrt(D) [+ causal]) v``.

    Memory: saves x, q, k, the output and its log-sum-exp; eager keeps x and q, k, v (module
    docstring). Off the CPU flash kernel (other devices, ``sdpa_kernel`` choices, autocast,
    torch.func, torch.compile, no gradient needed) it runs eager's ops.

    Args:
        x: ``(B, N, C)``.
        weight: ``(3 * num_heads * head_dim, C)``; bias: ``(3 * num_heads * head_dim,)`` or None.
        num_heads, head_dim: the head split.
        is_causal: causal attention (as ``F.scaled_dot_product_attention``).

    Returns:
        ``(B, num_heads, N, head_dim)``, as ``F.scaled_dot_product_attention`` returns it.

    Raises:
        ValueError: weight's rows are not ``3 * num_heads * head_dim``.

    Example:
        >>> o = qkv_attention(torch.randn(2, 5, 8), torch.randn(24, 8), None, 2, 4)
    """
    if weight.dim() != 2 or weight.shape[0] != 3 * num_heads * head_dim:
        raise ValueError(
            "slimgrad.ops.qkv_attention: weight must hold q, k and v; expected "
            f"({3 * num_heads * head_dim}, C) for {num_heads} heads of {head_dim}, got "
            f"{tuple(weight.shape)}. Pass the qkv Linear's weight."
        )
    needs_graph = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias)
    )
    if (
        not needs_graph
        or transforms_active()  # NOTE [torch.func transforms] in slimgrad/_autograd.py
        or torch.compiler.is_compiling()  # the compiler's memory plan: eager's ops
        or x.is_meta  # NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py
        or torch.is_autocast_enabled(x.device.type)
        or not (x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype))
        or x.shape[-1] != weight.shape[1]
        or not flash_eligible(x, num_heads, head_dim, is_causal)
    ):
        return _fwd_torch(x, weight, bias, num_heads, head_dim, is_causal)
    refuse_jit("ops.qkv_attention")
    return _QKVAttentionFn.apply(x, weight, bias, num_heads, head_dim, is_causal)
