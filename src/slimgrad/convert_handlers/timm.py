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
- ``GroupNorm`` / ``GroupNorm1`` (PoolFormer, ...): ``F.group_norm(x, num_groups, weight, bias,
  eps)``, the forward of ``nn.GroupNorm`` (``GroupNorm1``: one group), unless fast norm is on.
- ``GELU`` / ``GELUTanh``: ``F.gelu(x)`` / ``F.gelu(x, approximate='tanh')`` (timm's ``inplace``
  argument is ignored by timm too).
- ``Sigmoid``: ``x.sigmoid()``; with ``inplace=True`` (``x.sigmoid_()``) it stays timm's.
- the fused norm + activation layers ``BatchNormAct2d``, ``GroupNormAct``, ``LayerNormAct`` and
  ``LayerNormAct2d``: ``act(drop(norm(x)))`` with their own ``drop`` and ``act`` children. The
  replacement (:class:`BatchNormAct2d`, ...) runs slimgrad's norm, then the same children; the
  ``batch_norm`` pattern (``convert_handlers.cnn.bn_act_pattern``) has already swapped an ``act``
  of ReLU/GELU/SiLU/LeakyReLU/ELU for its ``*AfterNorm`` form, so BatchNorm + act keeps one tensor
  (NOTE [Derived saved inputs]); ``convert_`` then converts the other children (``drop``, a
  Hardswish ``act``) by the table (``CONVERT_CHILDREN``). State_dict keys are timm's.

- the squeeze-excite blocks ``SEModule`` (alias ``SqueezeExcite``), ``EffectiveSEModule`` and the
  EfficientNet/MobileNet blocks' ``SqueezeExcite``: their forward with the last ``x * gate(s)`` as
  ``slimgrad.ops.squeeze_excite`` (``slimgrad.nn.squeeze_excite``); their children (convs, act,
  gate) are then converted by the table.
- ``DropPath``: ``slimgrad.nn.DropPath`` (the same draw, the mask kept as 1 bit per sample).
- the weight-standardised convs ``StdConv2d``, ``ScaledStdConv2d`` (and ``...Same``): refused with
  the reason (they convolve with a weight computed in forward), so the report names them.

Subclasses of these follow NOTE [Subclasses convert by what they compute] in ``slimgrad.convert``.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from slimgrad.nn import squeeze_excite as _se
from slimgrad.nn._hooks import forward_hooked
from slimgrad.nn.batch_norm import BatchNorm2d
from slimgrad.nn.drop_path import DropPath
from slimgrad.nn.gelu import GELU
from slimgrad.nn.group_norm import GroupNorm
from slimgrad.nn.layer_norm import LayerNorm
from slimgrad.nn.sigmoid import Sigmoid
from slimgrad.ops.layer_norm import layer_norm

__all__ = [
    "TABLE",
    "BatchNormAct2d",
    "GroupNormAct",
    "LayerNorm2d",
    "LayerNormAct",
    "LayerNormAct2d",
]


class LayerNorm2d(LayerNorm):
    """timm's ``LayerNorm2d``: ``slimgrad.nn.LayerNorm`` over dim 1 of an NCHW tensor.

    Memory: that of :class:`slimgrad.nn.LayerNorm` on the permuted view (its output, shared with
    the next layer, and 8 B per row); eager saves the input too.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = input.permute(0, 2, 3, 1)
        # NOTE [Forward hooks on an output-saving module]: eager's op; so at the model's output
        # (``keep_y``: NOTE [Modules whose output is the model's output] in inplace_guard.py)
        if not self.keep_y or forward_hooked(self):
            x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        else:
            x = layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class _NormAct:
    # ``act(drop(norm(x)))`` as timm's forward; ``x = self.act(x)`` on a fresh x lets an in-place
    # act prove it owns x (slimgrad.ownership.owns_input)
    #: ``slimgrad.convert_`` converts this module's children too (drop, act) after replacing it
    CONVERT_CHILDREN = True

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._norm(x)
        x = self.drop(x)
        x = self.act(x)
        return x

    # the norm's output through drop and act, the norm taken as the guard reads timm's
    # ``F.batch_norm`` (which may return its input: ATen's schema does not say it is fresh)
    # (NOTE [A replacement states its structure] in convert_handlers/inplace_guard.py)
    _slimgrad_output_statement = (forward, ("drop", "act"))


class BatchNormAct2d(_NormAct, BatchNorm2d):
    """timm's ``BatchNormAct2d``: :class:`slimgrad.nn.BatchNorm2d`, then ``drop`` and ``act``.

    Memory: with an ``*AfterNorm`` act right after the BatchNorm (drop an Identity), the block keeps
    the BatchNorm output only (eager: its input and the act's input/output).
    """

    # act's input is the BatchNorm's new output passed through drop, read by act alone; fx cannot
    # trace _norm's shape checks, so the class states it (NOTE [Forward ownership from stated
    # structure])
    _slimgrad_forward_statement = (_NormAct.forward, {"act": ("drop",)})

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 4:  # timm's _assert
            raise AssertionError(f"expected 4D input (got {x.ndim}D input)")
        return BatchNorm2d.forward(self, x)


class GroupNormAct(_NormAct, GroupNorm):
    """timm's ``GroupNormAct``: :class:`slimgrad.nn.GroupNorm`, then ``drop`` and ``act``."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return GroupNorm.forward(self, x)


class LayerNormAct(_NormAct, LayerNorm):
    """timm's ``LayerNormAct``: :class:`slimgrad.nn.LayerNorm`, then ``drop`` and ``act``."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return LayerNorm.forward(self, x)


class LayerNormAct2d(_NormAct, LayerNorm):
    """timm's ``LayerNormAct2d``: :class:`LayerNorm2d`'s norm, then ``drop`` and ``act``."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return LayerNorm2d.forward(self, x)


def _rebuild(cls: type, module: nn.Module) -> nn.Module:
    # the instance's attributes in the slimgrad class: own containers (registering on one module
    # does not touch the other), the same Parameters, buffers, children and hook functions
    new = cls.__new__(cls)
    for k, v in module.__dict__.items():
        new.__dict__[k] = type(v)(v) if type(v) in (dict, OrderedDict, list, set) else v
    return new


def _norm_act(cls: type, timm_forward: str):
    def convert(module: nn.Module) -> nn.Module:
        fwd = type(module).forward
        if f"{fwd.__module__}.{fwd.__qualname__}" != timm_forward:  # a subclass's own forward
            raise NotImplementedError(
                f"forward is {fwd.__module__}.{fwd.__qualname__}; expected {timm_forward}"
            )
        _no_fast_norm(module)
        for child in ("drop", "act"):
            c = module._modules.get(child)
            if not isinstance(c, nn.Module):
                raise NotImplementedError(
                    f"no {child} module; expected timm's drop and act children, got "
                    f"{type(c).__name__}"
                )
            if cls is not BatchNormAct2d and getattr(c, "inplace", False):
                # slimgrad's GroupNorm/LayerNorm keep their output (NOTE [In-place writers after
                # output-saving modules]); BatchNorm keeps it only when an *AfterNorm act claims
                # it out of place, and its input otherwise
                raise NotImplementedError(
                    f"its {child} ({type(c).__name__}) writes in place over the norm's output, "
                    f"which slimgrad's {cls.__mro__[2].__name__} keeps for backward; expected "
                    "inplace=False, got True"
                )
        return _rebuild(cls, module)

    convert.__name__ = f"{cls.__name__.lower()}_from_timm"
    convert.__doc__ = f"timm ``{cls.__name__}`` -> :class:`{cls.__name__}` (shared state)."
    return convert


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


def group_norm_from_timm(module: nn.Module) -> nn.Module:
    """timm ``GroupNorm`` / ``GroupNorm1`` -> :class:`slimgrad.nn.GroupNorm` (shared Parameters):
    their forward is ``F.group_norm(x, num_groups, weight, bias, eps)`` unless fast norm is on."""
    _no_fast_norm(module)
    return GroupNorm.from_torch(module)


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


def _from_torch(cls: type):
    def convert(module: nn.Module) -> nn.Module:
        try:
            return cls.from_torch(module)
        except TypeError as e:  # another forward: the report names it
            raise NotImplementedError(str(e)) from None

    convert.__name__ = f"{cls.__name__.lower()}_from_timm"
    convert.__doc__ = f"timm ``{cls.__name__}`` -> :class:`{cls.__module__}.{cls.__name__}`."
    return convert


def std_conv_from_timm(module: nn.Module) -> nn.Module:
    """timm's weight-standardised convs (``StdConv2d``, ``ScaledStdConv2d`` and their ``Same``
    forms, NF-Nets, BiT): left as they are, with the reason in the report."""
    # forward standardises the weight (F.batch_norm over self.weight's rows, times gain * scale for
    # the Scaled ones) and convolves with the result: autograd keeps that weight and x, as a
    # slimgrad conv with a trainable weight would; the Same forms pad x first
    raise NotImplementedError(
        f"{type(module).__name__} standardises its weight in forward (F.batch_norm over "
        "self.weight) and convolves with the result; expected a conv that computes with its "
        "weight Parameter, got a computed weight (slimgrad's conv would keep what eager keeps: x "
        "and that weight): kept"
    )


# {qualified timm class name: (ConvertConfig field, handler)}; merged into slimgrad.convert._TABLE.
TABLE = {
    "timm.layers.norm.LayerNorm": ("norms", layer_norm_from_timm),
    "timm.layers.norm.LayerNorm2d": ("norms", layer_norm2d_from_timm),
    "timm.layers.norm.GroupNorm": ("norms", group_norm_from_timm),
    "timm.layers.norm.GroupNorm1": ("norms", group_norm_from_timm),
    "timm.layers.activations.GELU": ("activations", _gelu("none")),
    "timm.layers.activations.GELUTanh": ("activations", _gelu("tanh")),
    "timm.layers.activations.Sigmoid": ("activations", sigmoid_from_timm),
    "timm.layers.norm_act.BatchNormAct2d": (
        "batch_norm",
        _norm_act(BatchNormAct2d, "timm.layers.norm_act.BatchNormAct2d.forward"),
    ),
    "timm.layers.norm_act.GroupNormAct": (
        "norms",
        _norm_act(GroupNormAct, "timm.layers.norm_act.GroupNormAct.forward"),
    ),
    "timm.layers.norm_act.LayerNormAct": (
        "norms",
        _norm_act(LayerNormAct, "timm.layers.norm_act.LayerNormAct.forward"),
    ),
    "timm.layers.norm_act.LayerNormAct2d": (
        "norms",
        _norm_act(LayerNormAct2d, "timm.layers.norm_act.LayerNormAct2d.forward"),
    ),
    "timm.layers.squeeze_excite.SEModule": ("activations", _from_torch(_se.SEModule)),
    "timm.layers.squeeze_excite.EffectiveSEModule": (
        "activations",
        _from_torch(_se.EffectiveSEModule),
    ),
    "timm.models._efficientnet_blocks.SqueezeExcite": (
        "activations",
        _from_torch(_se.SqueezeExciteBlock),
    ),
    "timm.layers.drop.DropPath": ("dropout", _from_torch(DropPath)),
    **{
        f"timm.layers.std_conv.{c}": ("selective_saving", std_conv_from_timm)
        for c in ("StdConv2d", "StdConv2dSame", "ScaledStdConv2d", "ScaledStdConv2dSame")
    },
}

#: qualified names of timm's norm + act classes (``cnn.bn_act_pattern`` swaps their BatchNorm's act)
NORM_ACT = frozenset(k for k in TABLE if k.startswith("timm.layers.norm_act."))
