"""``slimgrad.nn.GroupNorm``: ``torch.nn.GroupNorm`` keeping its output (``ops/group_norm.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules import module as _module

from slimgrad.nn._hooks import forward_hooked
from slimgrad.nn._script import NoScript
from slimgrad.ops.group_norm import group_norm_kept

__all__ = ["GroupNorm"]


class GroupNorm(NoScript, torch.nn.GroupNorm):
    """``torch.nn.GroupNorm`` (same args, defaults, parameters, state_dict keys) saving its output.

    Memory: fp32: saves the output (shared with the next layer), mean and rstd per (sample, group),
    and the input of fallback channels (weight ~ 0) where a consumer keeps the output
    (``y_kept_after``; elsewhere a fallback channel makes it save the input, as eager); eager
    saves the input too. Shapes with few values per channel (where the backward would not fit in
    eager's bytes) and bf16/fp16 run eager's group_norm (saves the input, as eager:
    ``ops/group_norm.py``).

    Example:
        >>> y = GroupNorm(2, 6)(torch.randn(3, 6, 5, requires_grad=True))
    """

    #: False where the output may be the model's output: eager's op (it keeps the input) runs
    #: instead (NOTE [Modules whose output is the model's output] in
    #: slimgrad/convert_handlers/inplace_guard.py; set by ``convert_``)
    keep_y = True
    #: True where ``convert_`` found that the module's output goes to a layer that keeps it (a
    #: Linear or convolution whose weight requires grad, a BatchNorm, or an activation that keeps
    #: its input): only there does a fallback channel keep y and the channel's input; elsewhere
    #: x, as eager (NOTE [GroupNorm's fallback channels only where y is kept after it] in
    #: slimgrad/ops/group_norm.py)
    y_kept_after = False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # NOTE [Forward hooks on an output-saving module]; forward_hooked only when a hook exists
        if not self.keep_y or (
            (
                self._forward_hooks
                or _module._global_forward_hooks
                or self.near_hooks != self.near_free
            )
            and forward_hooked(self)
        ):
            return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)
        p = self._parameters  # the Parameters without Module.__getattr__ (a parametrized weight
        # is a property of the parametrized class, not in _parameters: read as an attribute)
        w = p["weight"] if "weight" in p else self.weight
        b = p["bias"] if "bias" in p else self.bias
        return group_norm_kept(input, self.num_groups, w, b, self.eps, self.y_kept_after)

    @classmethod
    def from_torch(cls, module: torch.nn.GroupNorm) -> GroupNorm:
        """A slimgrad GroupNorm sharing ``module``'s Parameters (no copy)."""
        if not isinstance(module, torch.nn.GroupNorm):
            raise TypeError(
                f"slimgrad.nn.GroupNorm.from_torch: expected a torch.nn.GroupNorm, got "
                f"{type(module).__name__}. Pass an nn.GroupNorm instance."
            )
        new = cls(module.num_groups, module.num_channels, module.eps, module.affine, device="meta")
        new.weight, new.bias = module.weight, module.bias
        new.train(module.training)
        return new
