"""``LinearCrossEntropyLoss``: an LM head's linear layer and cross-entropy, fused and chunked.

Memory: saves hidden + lse (4 B/token) + target; eager ``CrossEntropyLoss(lm_head(h))`` saves
hidden + the N×V log-probabilities. See ``slimgrad.ops.linear_cross_entropy``.
"""

from __future__ import annotations

import torch
from torch import nn

from slimgrad.nn._script import NoScript
from slimgrad.ops.linear_cross_entropy import _REDUCTIONS, linear_cross_entropy

__all__ = ["LinearCrossEntropyLoss"]


class LinearCrossEntropyLoss(NoScript, nn.Module):
    """``nn.CrossEntropyLoss()(F.linear(input, weight, bias), target)`` without keeping the logits.

    The head's weight is passed to ``forward`` (it usually belongs to the model's ``lm_head``, and
    may be tied to the embedding); this module holds no Parameters, like ``nn.CrossEntropyLoss``.

    Memory: saves input + lse (4 B/token) + target; eager saves input + the N×V log-probabilities.

    Args:
        ignore_index: target value that contributes no loss and no gradient.
        reduction: 'mean', 'sum' or 'none'.
        label_smoothing: ε in [0, 1].
        chunk_size: tokens per chunk; None for ``default_chunk_size``.

    Raises:
        ValueError: bad reduction, label_smoothing or chunk_size.

    Example:
        >>> head = torch.nn.Linear(32, 101, bias=False)
        >>> loss_fn = LinearCrossEntropyLoss()
        >>> loss = loss_fn(torch.randn(8, 32), head.weight, torch.randint(0, 101, (8,)))
    """

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(
                "slimgrad.nn.LinearCrossEntropyLoss: unknown reduction; expected one of "
                f"{_REDUCTIONS}, got {reduction!r}. Use 'mean', 'sum' or 'none'."
            )
        if not 0.0 <= float(label_smoothing) <= 1.0:
            raise ValueError(
                "slimgrad.nn.LinearCrossEntropyLoss: label_smoothing out of range; expected "
                f"0 <= label_smoothing <= 1, got {label_smoothing}. Pass a value in [0, 1]."
            )
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(
                "slimgrad.nn.LinearCrossEntropyLoss: chunk_size must be a positive int or None; "
                f"expected >= 1, got {chunk_size!r}. Pass None for the default."
            )
        self.ignore_index = int(ignore_index)
        self.reduction = reduction
        self.label_smoothing = float(label_smoothing)
        self.chunk_size = chunk_size

    def forward(
        self,
        input: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return linear_cross_entropy(
            input,
            weight,
            target,
            bias,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            reduction=self.reduction,
            chunk_size=self.chunk_size,
        )

    @classmethod
    def from_torch(
        cls, module: nn.CrossEntropyLoss, chunk_size: int | None = None
    ) -> LinearCrossEntropyLoss:
        """The fused loss with ``module``'s ignore_index, reduction and label_smoothing.

        Raises:
            TypeError: ``module`` is not an ``nn.CrossEntropyLoss``.
            NotImplementedError: ``module`` has class weights.
        """
        if not isinstance(module, nn.CrossEntropyLoss):
            raise TypeError(
                "slimgrad.nn.LinearCrossEntropyLoss.from_torch: expected nn.CrossEntropyLoss, got "
                f"{type(module).__name__}. Pass the model's CrossEntropyLoss."
            )
        if module.weight is not None:
            raise NotImplementedError(
                "slimgrad.nn.LinearCrossEntropyLoss.from_torch: class weights are not supported; "
                "expected weight=None, got a tensor. Keep the eager loss for weighted classes."
            )
        return cls(
            ignore_index=module.ignore_index,
            reduction=module.reduction,
            label_smoothing=module.label_smoothing,
            chunk_size=chunk_size,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
            f"label_smoothing={self.label_smoothing}, chunk_size={self.chunk_size}"
        )
