"""``slimgrad.nn.SoftmaxDropoutMatmul``: attention's ``dropout(softmax(S)) @ V`` as one module.

See ``slimgrad/ops/softmax_dropout.py``.
"""

from __future__ import annotations

import torch

from slimgrad.nn._script import NoScript
from slimgrad.ops.dropout import _check_p
from slimgrad.ops.softmax_dropout import softmax_dropout_matmul

__all__ = ["SoftmaxDropoutMatmul"]


class SoftmaxDropoutMatmul(NoScript, torch.nn.Module):
    """``dropout(softmax(scores, dim), p) @ value``; dropout follows the module's training flag.

    Memory: saves softmax(scores) + 1/8 B/elt mask bits + value; eager also keeps the dropped matrix
    and a 4 B/elt mask (CPU).

    Args:
        p: dropout probability in [0, 1].
        dim: softmax dimension.
        causal: mask ``scores[..., i, j]`` (``j > i``) with ``-inf`` inside the op (last dim only).

    Raises:
        ValueError: ``p`` outside [0, 1], or ``causal`` with ``dim`` other than the last.

    Example:
        >>> o = SoftmaxDropoutMatmul(0.1)(torch.randn(2, 4, 7, 7), torch.randn(2, 4, 7, 8))
    """

    def __init__(self, p: float = 0.1, dim: int = -1, causal: bool = False) -> None:
        super().__init__()
        _check_p("nn.SoftmaxDropoutMatmul", p)
        if causal and dim != -1:
            raise ValueError(
                "slimgrad.nn.SoftmaxDropoutMatmul: causal masks the last two dims; expected "
                f"dim=-1, got dim={dim}. Pass dim=-1, or mask the scores yourself."
            )
        self.p, self.dim, self.causal = float(p), dim, bool(causal)

    def forward(self, scores: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return softmax_dropout_matmul(
            scores, value, self.p, self.training, self.dim, causal=self.causal
        )

    def extra_repr(self) -> str:
        return f"p={self.p}, dim={self.dim}" + (", causal=True" if self.causal else "")
