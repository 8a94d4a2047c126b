"""``slimgrad.nn.Linear`` and ``Conv1D`` (HF GPT-2's ``x @ W + b``) with selective saving.

See ``slimgrad/ops/linear.py``: the input is kept only if the weight needs a gradient.
"""

from __future__ import annotations

import torch

from slimgrad.ops.linear import conv1d_addmm, linear

__all__ = ["Conv1D", "Linear"]


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` (same args, parameters, state_dict keys) keeping only what grads need.

    Memory: saves the input only if the weight needs grad (frozen weight: nothing of the input).

    Example:
        >>> y = Linear(8, 3)(torch.randn(4, 8))
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)

    @classmethod
    def from_torch(cls, module: torch.nn.Linear) -> Linear:
        """A slimgrad Linear sharing ``module``'s Parameters (no copy)."""
        if not isinstance(module, torch.nn.Linear):
            raise TypeError(
                f"slimgrad.nn.Linear.from_torch: expected a torch.nn.Linear, got "
                f"{type(module).__name__}. Pass an nn.Linear instance."
            )
        new = cls(module.in_features, module.out_features, module.bias is not None, device="meta")
        new.weight, new.bias = module.weight, module.bias
        new.train(module.training)
        return new


class Conv1D(torch.nn.Module):
    """HF GPT-2 ``Conv1D(nf, nx)``: ``y = x @ weight + bias``, weight ``(nx, nf)``, bias ``(nf,)``.

    Same args, parameters and state_dict keys as ``transformers.pytorch_utils.Conv1D``.

    Memory: saves the input only if the weight needs grad (as eager's addmm).

    Example:
        >>> y = Conv1D(3, 8)(torch.randn(4, 8))
    """

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = torch.nn.Parameter(torch.empty(nx, nf))
        self.bias = torch.nn.Parameter(torch.zeros(nf))
        torch.nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return conv1d_addmm(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}"

    @classmethod
    def from_torch(cls, module: torch.nn.Module) -> Conv1D:
        """A slimgrad Conv1D sharing the Parameters of a ``transformers`` ``Conv1D`` (no copy)."""
        w = getattr(module, "weight", None)
        if type(module).__name__ != "Conv1D" or w is None or w.dim() != 2:
            raise TypeError(
                f"slimgrad.nn.Conv1D.from_torch: expected a transformers Conv1D, got "
                f"{type(module).__name__}. Pass a transformers.pytorch_utils.Conv1D instance."
            )
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.nf, new.nx = module.nf, module.nx
        new.weight, new.bias = module.weight, module.bias
        new.train(module.training)
        return new
