"""``slimgrad.nn.Dropout``: ``torch.nn.Dropout`` keeping a 1-bit mask (``ops/dropout.py``)."""

from __future__ import annotations

import torch

from slimgrad._autograd import unwrap_if_dead
from slimgrad._library import straight
from slimgrad.nn._script import NoScript
from slimgrad.ops.dropout import _DROPOUT_APPLY, _PLAIN, _check_p, dropout

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
        p = self.p
        if (  # ops.dropout's straight path, without its frame (NOTE [One gate per call])
            type(p) is float
            and 0.0 < p < 1.0
            and self.training
            and not self.inplace
            and type(input) in _PLAIN
            and not input.is_meta
            and straight()
            and 0 not in input.shape
        ):
            return _DROPOUT_APPLY(unwrap_if_dead(input), p, True)
        return dropout(input, p, self.training, self.inplace)

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
