"""``slimgrad.nn.LayerNorm``: ``torch.nn.LayerNorm`` keeping its output (``ops/layer_norm.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slimgrad.nn._hooks import forward_hooked
from slimgrad.nn._script import NoScript
from slimgrad.ops.layer_norm import layer_norm

__all__ = ["LayerNorm"]


class LayerNorm(NoScript, torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` (same args, defaults, parameters, state_dict keys) saving y + 8 B/row.

    Memory: saves the output (shared with the next layer), mean and rstd, and the input columns of
    fallback channels (weight ~ 0); eager saves the input too. bfloat16/float16 inputs run eager's
    ``F.layer_norm`` (keeping the input, as eager): see ``slimgrad.ops.layer_norm``.

    Example:
        >>> ln = LayerNorm(8)
        >>> y = ln(torch.randn(4, 8, requires_grad=True))
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if forward_hooked(self):  # NOTE [Forward hooks on an output-saving module]
            return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    @classmethod
    def from_torch(cls, module: torch.nn.LayerNorm) -> LayerNorm:
        """A slimgrad LayerNorm sharing ``module``'s Parameters (no copy)."""
        if not isinstance(module, torch.nn.LayerNorm):
            raise TypeError(
                f"slimgrad.nn.LayerNorm.from_torch: expected a torch.nn.LayerNorm, got "
                f"{type(module).__name__}. Pass an nn.LayerNorm instance."
            )
        new = cls(
            module.normalized_shape,
            module.eps,
            module.elementwise_affine,
            bias=module.bias is not None,
            device="meta",
        )
        new.weight, new.bias = module.weight, module.bias
        new.train(module.training)
        return new
