"""``slimgrad.nn.Dropout``: ``torch.nn.Dropout`` keeping a 1-bit mask (``ops/dropout.py``)."""

from __future__ import annotations

import torch

from slimgrad.nn._script import NoScript
from slimgrad.ops.dropout import _check_p, dropout

__all__ = ["Dropout"]


class Dropout(NoScript, torch.nn.Dropout):
    """``torch.nn.Dropout(p=0.5, inplace=False)`` with the mask kept as 1 bit per element.

    Same values and gradients as ``torch.nn.Dropout`` at the same RNG state.

    Memory: saves 1/8 B/elt; eager saves 4 B/elt (fp32, CPU) or 1 B/elt (CUDA).

    Raises:
        ValueError: ``p`` outside [0, 1] (at construction).

    Example:
        >>> y = Dropout(0.1)(torch.randn(4, 8, requires_grad=True))
    """

    def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
        _check_p("nn.Dropout", p)
        super().__init__(p, inplace)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return dropout(input, self.p, self.training, self.inplace)

    @classmethod
    def from_torch(cls, module: torch.nn.Dropout) -> Dropout:
        """A slimgrad Dropout with ``module``'s p, inplace and training flag."""
        if not isinstance(module, torch.nn.Dropout):
            raise TypeError(
                f"slimgrad.nn.Dropout.from_torch: expected a torch.nn.Dropout, got "
                f"{type(module).__name__}. Pass an nn.Dropout instance."
            )
        new = cls(module.p, module.inplace)
        new.train(module.training)
        return new
