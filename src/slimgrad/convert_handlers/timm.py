"""convert_ handlers for timm's layers (``timm.layers``), by class name: timm is never imported.

timm builds its vision models from torch modules and a few of its own: ``LayerNorm`` and
``LayerNorm2d`` (subclasses of ``nn.LayerNorm`` with their own forward), ``GELU``/``GELUTanh`` and
``Sigmoid`` (plain ``nn.Module``s). Each handler checks that the instance computes what its
slimgrad replacement computes (checked against timm 1.0's forwards), else raises
``NotImplementedError`` with the reason, which the report shows:

- ``LayerNorm``: ``F.layer_norm(x, normalized_shape, weight, bias, eps)``, the forward of
  ``nn.LayerNorm``, unless timm's fast norm is on (``timm.layers.set_fast_norm``: another kernel,
  in float32 under autocast).
- ``LayerNorm2d``: the same over the channels of an NCHW tensor: ``permute(0, 2, 3, 1)``, layer
  norm, ``permute(0, 3, 1, 2)`` (:class:`LayerNorm2d`, the same views around slimgrad's op).
- ``GELU`` / ``GELUTanh``: ``F.gelu(x)`` / ``F.gelu(x, approximate='tanh')`` (timm's ``inplace``
  argument is ignored by timm too).
- ``Sigmoid``: ``x.sigmoid()``; with ``inplace=True`` (``x.sigmoid_()``) it stays timm's.

Subclasses of these follow NOTE [Subclasses convert by what they compute] in ``slimgrad.convert``.
"""

from __future__ import annotations

import torch
from torch import nn

from slimgrad.nn.gelu import GELU
from slimgrad.nn.layer_norm import LayerNorm
from slimgrad.nn.sigmoid import Sigmoid
from slimgrad.ops.layer_norm import layer_norm

__all__ = ["TABLE", "LayerNorm2d"]


class LayerNorm2d(LayerNorm):
    """timm's ``LayerNorm2d``: ``slimgrad.nn.LayerNorm`` over dim 1 of an NCHW tensor.

    Memory: that of :class:`slimgrad.nn.LayerNorm` on the permuted view (its output, shared with
    the next layer, and 8 B per row); eager saves the input too.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = input.permute(0, 2, 3, 1)
        x = layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


def _no_fast_norm(module: nn.Module) -> None:
    if getattr(module, "_fast_norm", False):
        raise NotImplementedError(
            "timm's fast norm is on (timm.layers.set_fast_norm(True)): it runs another kernel; "
            "expected _fast_norm False, got True"
        )


def layer_norm_from_timm(module: nn.Module) -> nn.Module:
    """timm ``LayerNorm`` -> :class:`slimgrad.nn.LayerNorm` (shared Parameters)."""
    _no_fast_norm(module)
    return LayerNorm.from_torch(module)


def layer_norm2d_from_timm(module: nn.Module) -> nn.Module:
    """timm ``LayerNorm2d`` -> :class:`LayerNorm2d` (shared Parameters)."""
    _no_fast_norm(module)
    return LayerNorm2d.from_torch(module)


def _gelu(approximate: str):
    def convert(module: nn.Module) -> nn.Module:
        new = GELU(approximate)
        new.train(module.training)
        return new

    convert.__name__ = f"gelu_{approximate}_from_timm"
    convert.__doc__ = f"timm GELU -> slimgrad.nn.GELU(approximate={approximate!r})."
    return convert


def sigmoid_from_timm(module: nn.Module) -> nn.Module:
    """timm ``Sigmoid`` (out of place) -> :class:`slimgrad.nn.Sigmoid`."""
    if getattr(module, "inplace", False):
        raise NotImplementedError(
            "timm Sigmoid(inplace=True) writes x.sigmoid_() over its input; expected "
            "inplace=False, got True"
        )
    new = Sigmoid()
    new.train(module.training)
    return new


# {qualified timm class name: (ConvertConfig field, handler)}; merged into slimgrad.convert._TABLE.
TABLE = {
    "timm.layers.norm.LayerNorm": ("norms", layer_norm_from_timm),
    "timm.layers.norm.LayerNorm2d": ("norms", layer_norm2d_from_timm),
    "timm.layers.activations.GELU": ("activations", _gelu("none")),
    "timm.layers.activations.GELUTanh": ("activations", _gelu("tanh")),
    "timm.layers.activations.Sigmoid": ("activations", sigmoid_from_timm),
}
