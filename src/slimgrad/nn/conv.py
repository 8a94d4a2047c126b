"""Conv1d/2d/3d and ConvTranspose1d/2d/3d that keep only what the requested gradients need.

Same names, arguments, defaults, parameters and state_dict keys as ``torch.nn``; the classes
subclass torch's, so ``isinstance(m, torch.nn.Conv2d)`` still holds. See ``slimgrad.ops.conv`` for
the math and the memory contract.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from slimgrad._autograd import compiling as _compiling
from slimgrad.nn._script import NoScript
from slimgrad.ops import conv as _ops

__all__ = [
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "mark_bias_before_batch_norm_",
]


def _from_torch(cls, module: nn.Module, base: type) -> nn.Module:
    if type(module) is not base:
        raise TypeError(
            f"slimgrad.nn.{cls.__name__}.from_torch: module type; expected "
            f"torch.nn.{base.__name__}, "
            f"got {type(module).__name__}. Convert a plain torch.nn.{base.__name__}."
        )
    new = cls.__new__(cls)
    # Own containers (parameter/buffer/hook dicts are copied, so registering on one module does not
    # touch the other); the Parameters, buffers and hook functions themselves are shared.
    for k, v in module.__dict__.items():
        new.__dict__[k] = type(v)(v) if type(v) in (dict, OrderedDict, list, set) else v
    return new


def _slot(module: nn.Module) -> list | None:
    # this module's store for its normalised conv arguments (NOTE [Conv arguments, normalised
    # once per module] in slimgrad/ops/conv.py); a plain attribute, not state. None while Dynamo
    # traces (no module state is written there; the arguments are normalised as functionals do).
    if _compiling():
        return None
    d = module.__dict__
    if "_slimgrad_conv_args" in d:
        return d["_slimgrad_conv_args"]
    slot = d["_slimgrad_conv_args"] = [None]
    return slot


class _ConvMixin:
    _api = ""  # set per class: the ops.conv functional's name and its spatial dims
    _nd = 0
    _slimgrad_conv_args = None  # an instance's own slot once _slot made it
    # the BatchNorm that takes this conv's output (mark_bias_before_batch_norm_); None: none known
    _slimgrad_bias_f64 = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # torch's ``self._conv_forward(input, self.weight, self.bias)``, the Parameters read from
        # their dict (Module.__getattr__'s first place; a name not there, e.g. a parametrization's
        # property, by attribute)
        p = self._parameters
        weight = p["weight"] if "weight" in p else self.weight
        bias = p["bias"] if "bias" in p else self.bias
        if (
            self.padding_mode != "zeros"
            or "_conv_forward" in self.__dict__
            or type(self)._conv_forward is not _ConvMixin._conv_forward
        ):
            return self._conv_forward(input, weight, bias)
        # _conv_forward's zero-padding call, without its frame; the argument slot read as an
        # attribute (the class's None until _slot makes it), in one compile check
        slot = None if _compiling() else self._slimgrad_conv_args or _slot(self)
        return _ops._conv(
            self._api,
            self._nd,
            input,
            weight,
            bias,
            self.stride,
            self.padding,
            self.dilation,
            self.groups,
            False,
            0,
            slot,
            # only where that BatchNorm trains (in eval it never keeps its output)
            (bn := self._slimgrad_bias_f64) is not None and bn.training,
        )

    def _conv_forward(self, input, weight, bias):
        # ops.conv{n}d(input, weight, bias, stride, padding, dilation, groups), with this module's
        # argument slot
        if self.padding_mode != "zeros":
            input = torch.nn.functional.pad(
                input, self._reversed_padding_repeated_twice, mode=self.padding_mode
            )
            padding = 0
        else:
            padding = self.padding
        return _ops._conv(
            self._api,
            self._nd,
            input,
            weight,
            bias,
            self.stride,
            padding,
            self.dilation,
            self.groups,
            False,
            0,
            _slot(self),
            # only where that BatchNorm trains (in eval it never keeps its output)
            (bn := self._slimgrad_bias_f64) is not None and bn.training,
        )


class Conv1d(NoScript, _ConvMixin, nn.Conv1d):
    """``torch.nn.Conv1d`` that keeps x only if the weight needs grad (see ``slimgrad.ops.conv``).

    Memory: x only if ``weight`` requires grad (or the norm output it derives from); eager: x and W.
    """

    _api = "conv1d"
    _nd = 1

    @classmethod
    def from_torch(cls, module: nn.Conv1d) -> Conv1d:
        """A slimgrad Conv1d sharing ``module``'s Parameters and hooks."""
        return _from_torch(cls, module, nn.Conv1d)


class Conv2d(NoScript, _ConvMixin, nn.Conv2d):
    """``torch.nn.Conv2d`` that keeps x only if the weight needs grad (see ``slimgrad.ops.conv``).

    Memory: x only if ``weight`` requires grad (or the norm output it derives from); eager: x and W.
    """

    _api = "conv2d"
    _nd = 2

    @classmethod
    def from_torch(cls, module: nn.Conv2d) -> Conv2d:
        """A slimgrad Conv2d sharing ``module``'s Parameters and hooks."""
        return _from_torch(cls, module, nn.Conv2d)


class Conv3d(NoScript, _ConvMixin, nn.Conv3d):
    """``torch.nn.Conv3d`` that keeps x only if the weight needs grad (see ``slimgrad.ops.conv``).

    Memory: x only if ``weight`` requires grad (or the norm output it derives from); eager: x and W.
    """

    _api = "conv3d"
    _nd = 3

    @classmethod
    def from_torch(cls, module: nn.Conv3d) -> Conv3d:
        """A slimgrad Conv3d sharing ``module``'s Parameters and hooks."""
        return _from_torch(cls, module, nn.Conv3d)


class _ConvTransposeMixin:
    _api = ""  # set per class: the ops.conv_transpose functional's name and its spatial dims
    _nd = 0
    _slimgrad_bias_f64 = None  # mark_bias_before_batch_norm_

    def forward(self, input: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        if self.padding_mode != "zeros":
            raise ValueError(
                f"slimgrad.nn.{type(self).__name__}: padding_mode; expected 'zeros', got "
                f"{self.padding_mode!r}. Only zero padding is supported for transposed "
                f"convolutions."
            )
        output_padding = self._output_padding(
            input,
            output_size,
            self.stride,
            self.padding,
            self.kernel_size,
            self._nd,
            self.dilation,
        )
        # ops.conv_transpose{n}d(input, weight, bias, stride, padding, output_padding, groups,
        # dilation), with this module's argument slot
        return _ops._conv(
            self._api,
            self._nd,
            input,
            self.weight,
            self.bias,
            self.stride,
            self.padding,
            self.dilation,
            self.groups,
            True,
            output_padding,
            _slot(self),
            # only where that BatchNorm trains (in eval it never keeps its output)
            (bn := self._slimgrad_bias_f64) is not None and bn.training,
        )


class ConvTranspose1d(NoScript, _ConvTransposeMixin, nn.ConvTranspose1d):
    """``torch.nn.ConvTranspose1d`` keeping only what the gradients need (``slimgrad.ops.conv``)."""

    _api = "conv_transpose1d"
    _nd = 1

    @classmethod
    def from_torch(cls, module: nn.ConvTranspose1d) -> ConvTranspose1d:
        """A slimgrad ConvTranspose1d sharing ``module``'s Parameters and hooks."""
        return _from_torch(cls, module, nn.ConvTranspose1d)


class ConvTranspose2d(NoScript, _ConvTransposeMixin, nn.ConvTranspose2d):
    """``torch.nn.ConvTranspose2d`` keeping only what the gradients need (``slimgrad.ops.conv``)."""

    _api = "conv_transpose2d"
    _nd = 2

    @classmethod
    def from_torch(cls, module: nn.ConvTranspose2d) -> ConvTranspose2d:
        """A slimgrad ConvTranspose2d sharing ``module``'s Parameters and hooks."""
        return _from_torch(cls, module, nn.ConvTranspose2d)


class ConvTranspose3d(NoScript, _ConvTransposeMixin, nn.ConvTranspose3d):
    """``torch.nn.ConvTranspose3d`` keeping only what the gradients need (``slimgrad.ops.conv``)."""

    _api = "conv_transpose3d"
    _nd = 3

    @classmethod
    def from_torch(cls, module: nn.ConvTranspose3d) -> ConvTranspose3d:
        """A slimgrad ConvTranspose3d sharing ``module``'s Parameters and hooks."""
        return _from_torch(cls, module, nn.ConvTranspose3d)


def mark_bias_before_batch_norm_(model: nn.Module) -> int:
    """Mark each slimgrad conv with a bias whose output an ``nn.Sequential`` hands to a slimgrad
    BatchNorm next (NOTE [A conv bias gradient after dx from the output] in
    ``slimgrad/ops/batch_norm.py``): its calls that need a graph take slimgrad's Function from the
    first step, so a BatchNorm that keeps its output has it sum the bias gradient before its
    convolution_backward. The mark is that BatchNorm, read at each call: only a training
    BatchNorm keeps its output, so in eval the conv records eager's node as before (a double
    backward's ``.grad`` left None where eager leaves it). ``convert_`` runs it; the mark changes
    no bits and no saved bytes (the Function keeps what eager's node keeps and asks eager's
    gradients).

    Returns:
        The number of convs marked.
    """
    from slimgrad.nn.batch_norm import _BatchNormMixin

    n = 0
    for parent in model.modules():
        if type(parent).forward is not nn.Sequential.forward or "forward" in parent.__dict__:
            continue
        kids = [c for c in parent._modules.values() if c is not None]
        for conv, nxt in zip(kids, kids[1:]):
            if (
                isinstance(conv, (_ConvMixin, _ConvTransposeMixin))
                and conv._parameters.get("bias") is not None
                and isinstance(nxt, _BatchNormMixin)
                and "forward" not in conv.__dict__
            ):
                conv.__dict__["_slimgrad_bias_f64"] = nxt
                n += 1
    return n
