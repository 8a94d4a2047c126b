"""Squeeze-excite blocks whose gating keeps no copy of their input where one is kept.

The blocks of timm (``SEModule``/``SqueezeExcite`` in ``timm.layers``, ``SqueezeExcite`` of its
EfficientNet/MobileNet blocks, ``EffectiveSEModule``) and torchvision (``SqueezeExcitation``), each
with its own forward, op for op, except that the last multiply ``x * gate(s)`` is
:func:`slimgrad.ops.squeeze_excite.squeeze_excite`. Their children (the squeeze convs, the
activation, the gate) stay theirs, so ``convert_`` converts them by its table (a Sigmoid gate keeps
its output, N*C elements; a Hardsigmoid gate 1 bit per element of the gate). Built from an instance
with :meth:`from_torch`, which shares its ``__dict__`` entries (Parameters, children, hooks) and
accepts only the exact forward it reproduces.

Memory: see ``slimgrad.ops.squeeze_excite``: no copy of x when it follows a slimgrad BatchNorm +
activation, and the next slimgrad conv keeps that BatchNorm's output instead of the block's output;
eager keeps x, the gate and the block's output.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import Tensor, nn

from slimgrad.nn._script import NoScript
from slimgrad.ops.squeeze_excite import squeeze_excite

__all__ = ["EffectiveSEModule", "SEModule", "SqueezeExcitation", "SqueezeExciteBlock"]


class _FromTorch:
    #: ``slimgrad.convert_`` converts this block's children too (squeeze convs, activation, gate)
    CONVERT_CHILDREN = True
    #: the qualified forward this class reproduces
    FORWARD = ""
    #: other methods the forward calls, which must be the original class's too
    CALLS: tuple[str, ...] = ()

    @classmethod
    def from_torch(cls, module: nn.Module):
        """The slimgrad block sharing ``module``'s Parameters, children and hooks."""
        owner = cls.FORWARD.rsplit(".", 1)[0]
        for meth in ("forward", *cls.CALLS):
            f = getattr(type(module), meth, None)
            name = f"{f.__module__}.{f.__qualname__}" if callable(f) else repr(f)
            if name != f"{owner}.{meth}":
                raise TypeError(
                    f"slimgrad.nn.{cls.__name__}.from_torch: unsupported module; expected "
                    f"{meth} {owner}.{meth}, got {type(module).__name__} ({meth} {name}). "
                    "Convert only the listed squeeze-excite blocks."
                )
            if meth in module.__dict__:
                raise TypeError(
                    f"slimgrad.nn.{cls.__name__}.from_torch: unsupported module; expected the "
                    f"class's {meth}, got an instance attribute {meth!r} on "
                    f"{type(module).__name__}. Leave it unconverted."
                )
        new = cls.__new__(cls)
        for k, v in module.__dict__.items():
            new.__dict__[k] = type(v)(v) if type(v) in (dict, OrderedDict, list, set) else v
        return new


class SEModule(_FromTorch, NoScript, nn.Module):
    """timm's ``SEModule`` (alias ``SqueezeExcite`` in ``timm.layers``): ``x * gate(fc2(act(bn(
    fc1(mean(x))))))``, optionally with max pooling in the squeeze."""

    FORWARD = "timm.layers.squeeze_excite.SEModule.forward"

    def forward(self, x: Tensor) -> Tensor:
        x_se = x.mean((2, 3), keepdim=True)
        if self.add_maxpool:
            x_se = 0.5 * x_se + 0.5 * x.amax((2, 3), keepdim=True)
        x_se = self.fc1(x_se)
        x_se = self.act(self.bn(x_se))
        x_se = self.fc2(x_se)
        return squeeze_excite(x, self.gate(x_se))

    _slimgrad_output_statement = (forward, (None,))  # squeeze_excite's fresh result


class SqueezeExciteBlock(_FromTorch, NoScript, nn.Module):
    """timm's EfficientNet/MobileNet ``SqueezeExcite`` (``timm.models._efficientnet_blocks``):
    ``x * gate(conv_expand(act1(conv_reduce(mean(x)))))``."""

    FORWARD = "timm.models._efficientnet_blocks.SqueezeExcite.forward"

    def forward(self, x: Tensor) -> Tensor:
        x_se = x.mean((2, 3), keepdim=True)
        x_se = self.conv_reduce(x_se)
        x_se = self.act1(x_se)
        x_se = self.conv_expand(x_se)
        return squeeze_excite(x, self.gate(x_se))

    _slimgrad_output_statement = (forward, (None,))  # squeeze_excite's fresh result


class EffectiveSEModule(_FromTorch, NoScript, nn.Module):
    """timm's ``EffectiveSEModule``: ``x * gate(fc(mean(x)))``, optionally with max pooling."""

    FORWARD = "timm.layers.squeeze_excite.EffectiveSEModule.forward"

    def forward(self, x: Tensor) -> Tensor:
        x_se = x.mean((2, 3), keepdim=True)
        if self.add_maxpool:
            x_se = 0.5 * x_se + 0.5 * x.amax((2, 3), keepdim=True)
        x_se = self.fc(x_se)
        return squeeze_excite(x, self.gate(x_se))

    _slimgrad_output_statement = (forward, (None,))  # squeeze_excite's fresh result


class SqueezeExcitation(_FromTorch, NoScript, nn.Module):
    """torchvision's ``SqueezeExcitation``: ``scale * input`` with ``scale = self._scale(input)``
    (its own ``_scale``: avgpool, fc1, activation, fc2, scale_activation)."""

    FORWARD = "torchvision.ops.misc.SqueezeExcitation.forward"
    CALLS = ("_scale",)

    def _scale(self, input: Tensor) -> Tensor:
        scale = self.avgpool(input)
        scale = self.fc1(scale)
        scale = self.activation(scale)
        scale = self.fc2(scale)
        return self.scale_activation(scale)

    def forward(self, input: Tensor) -> Tensor:
        scale = self._scale(input)
        return squeeze_excite(input, scale, gate_first=True)

    _slimgrad_output_statement = (forward, (None,))  # squeeze_excite's fresh result
