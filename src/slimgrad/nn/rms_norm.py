"""``slimgrad.nn.RMSNorm``: ``torch.nn.RMSNorm`` keeping its output (``ops/rms_norm.py``)."""

from __future__ import annotations

import torch

from slimgrad.ops.rms_norm import rms_norm

__all__ = ["HFRMSNorm", "RMSNorm"]


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (same args, defaults, parameters, state_dict keys), memory-lean.

    Memory: fp32: saves the output (shared with the next layer), rstd (4 B/row), and the input
    columns of channels with weight 0; bf16/fp16: saves the input (2 B/elt) + 4 B/row; eager
    saves the input and x * rstd in fp32 (8 B/elt) + 4 B/row in every dtype.

    Example:
        >>> y = RMSNorm(8)(torch.randn(4, 8, requires_grad=True))
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)

    @classmethod
    def from_torch(cls, module: torch.nn.RMSNorm) -> RMSNorm:
        """A slimgrad RMSNorm sharing ``module``'s Parameters (no copy)."""
        if not isinstance(module, torch.nn.RMSNorm):
            raise TypeError(
                f"slimgrad.nn.RMSNorm.from_torch: expected a torch.nn.RMSNorm, got "
                f"{type(module).__name__}. Pass an nn.RMSNorm instance."
            )
        new = cls(module.normalized_shape, module.eps, module.elementwise_affine, device="meta")
        new.weight = module.weight
        new.train(module.training)
        return new


class HFRMSNorm(torch.nn.Module):
    """HF's ``LlamaRMSNorm`` (parameter ``weight``, attribute ``variance_epsilon``, same state_dict
    keys), memory-lean where it is exactly the same function.

    HF computes ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``: float32
    statistics whatever the input dtype, then the cast back, then the scale (which promotes, e.g.
    a bf16 input with float32 weights gives a float32 output). With a float32 input and float32
    weights that is :func:`slimgrad.ops.rms_norm.rms_norm`; every other dtype combination runs
    HF's formula as written (eager's memory).

    Memory: float32: as :class:`RMSNorm` (the output + 4 B/row); other dtypes: as eager.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if hidden_states.dtype == torch.float32 and w.dtype == torch.float32:
            return rms_norm(hidden_states, (w.shape[0],), w, self.variance_epsilon)
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return w * x.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"

    @classmethod
    def from_hf(cls, module: torch.nn.Module) -> HFRMSNorm:
        """An HFRMSNorm sharing ``module``'s ``weight`` (a ``LlamaRMSNorm``-style module)."""
        weight = getattr(module, "weight", None)
        eps = getattr(module, "variance_epsilon", None)
        if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1 or eps is None:
            raise NotImplementedError("not a LlamaRMSNorm-style module (weight, variance_epsilon)")
        new = cls(weight.shape[0], eps=eps, device="meta")
        new.weight = weight
        new.train(module.training)
        return new
