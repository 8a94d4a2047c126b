"""``slimgrad.nn.DropPath``: timm's ``DropPath`` whose mask is kept as 1 bit per sample.

Memory: see ``slimgrad.ops.drop_path`` (same attributes and state_dict as timm's, none).
"""

from __future__ import annotations

from collections import OrderedDict

from torch import Tensor, nn

from slimgrad.nn._script import NoScript
from slimgrad.ops.drop_path import drop_path

__all__ = ["DropPath"]

_TIMM = "timm.layers.drop.DropPath"


class DropPath(NoScript, nn.Module):
    """timm's ``DropPath(drop_prob, scale_by_keep)`` using :func:`slimgrad.ops.drop_path.drop_path`.

    Args:
        drop_prob: probability of dropping a sample in training.
        scale_by_keep: divide the kept samples by ``1 - drop_prob``.
    """

    def __init__(self, drop_prob: float = 0.0, scale_by_keep: bool = True) -> None:
        super().__init__()
        self.drop_prob = drop_prob
        self.scale_by_keep = scale_by_keep

    def forward(self, x: Tensor) -> Tensor:
        return drop_path(x, self.drop_prob, self.training, self.scale_by_keep)

    def extra_repr(self) -> str:
        return f"drop_prob={round(self.drop_prob, 3):0.3f}"

    @classmethod
    def from_torch(cls, module: nn.Module) -> DropPath:
        """The slimgrad module with ``module``'s settings and hooks (timm's ``DropPath``, whose
        forward is timm's)."""
        name = f"{type(module).__module__}.{type(module).__qualname__}"
        if name != _TIMM:
            raise TypeError(
                "slimgrad.nn.DropPath.from_torch: unsupported module; expected "
                f"{_TIMM}, got {type(module).__name__}. Convert only timm's DropPath."
            )
        new = cls.__new__(cls)
        for k, v in module.__dict__.items():
            new.__dict__[k] = type(v)(v) if type(v) in (dict, OrderedDict, list, set) else v
        return new
