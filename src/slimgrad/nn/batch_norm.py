"""BatchNorm1d/2d/3d that keep one full-size tensor per BN → activation block, and the activation
modules that cooperate with them.

``BatchNorm2d`` has torch's name, arguments, defaults, buffers and state_dict keys (it subclasses
``torch.nn.BatchNorm2d``); its output is registered as a *source*. ``ReLUAfterNorm`` (and the
GELU/SiLU/LeakyReLU/ELU variants) are drop-in ``nn.ReLU``/``nn.GELU``/``nn.SiLU``/
``nn.LeakyReLU``/``nn.ELU``: on an ordinary input they do
exactly what torch does; on the pristine output of a slimgrad BatchNorm they make the BatchNorm keep
its output instead of its input, and tag their own output so that a following slimgrad conv keeps
that same tensor instead (NOTE [Derived saved inputs] in ``slimgrad/ops/_derived.py``). Model code
(``self.bn1(x)``; ``self.relu(x)``; ``self.conv2(x)``) does not change.

Each module keeps computing its own function (the BatchNorm returns the normalised tensor, the
activation applies the activation), so slicing a ``Sequential``, hooks and replacing a module all
behave as in eager.

Memory: BN → ReLU → Conv keeps the BN output only (4 B/elt fp32); eager keeps the BN input and the
ReLU output (8 B/elt). A BN whose input comes from a slimgrad 1x1 conv that does not reduce the
channels and whose output is not followed by an activation (ResNet's bn3 and downsample BN) keeps
no input: it re-runs the conv in backward (``recompute_input``: "pointwise" by default, "always",
"never"; NOTE [Recomputable inputs]). Eval with frozen γ, β keeps nothing full-size (eager: the
input).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from slimgrad import ownership
from slimgrad._autograd import FxTraceError
from slimgrad.nn._script import NoScript
from slimgrad.ops import _derived
from slimgrad.ops.batch_norm import _batch_norm

__all__ = [
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "ELUAfterNorm",
    "GELUAfterNorm",
    "LeakyReLUAfterNorm",
    "ReLUAfterNorm",
    "SiLUAfterNorm",
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


def _owned(x: torch.Tensor, module: nn.Module) -> bool:
    # ownership.owns_input(x, module, writes=False), asked only where its answer is read: the
    # derived path needs x to be a pristine slimgrad norm output (_is_source first; anything else
    # runs eager's in-place op whatever the answer; an empty registry of sources, the common case,
    # asks nothing: NOTE [A source only where it can be claimed] in ops/batch_norm.py)
    return ownership.owns_input(x, module, writes=False)


def _is_source(x: torch.Tensor) -> bool:
    # _derived.is_source(x), inline: a pristine registered source output (most inputs are not
    # registered: one id() and a dict test)
    k = id(x)
    if k not in _SOURCES_D:
        return False
    e = _SOURCES_D[k]
    return e[0]() is x and x._version == e[1][1]


_SOURCES_D = _derived._SOURCES_D


class _BatchNormMixin:
    #: Keep how to recompute the input (re-running the slimgrad conv that produced it) instead of
    #: the input itself: "pointwise" (1x1 convs with C_in <= C_out, not reading a squeeze-excite
    #: output, where a training call sees more than 32 values per channel), "always" or "never";
    #: set per instance.
    recompute_input: str = "pointwise"

    _ndims: tuple = ()  # the input ranks _check_input_dim accepts (it runs for any other)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # torch.nn.modules.batchnorm._BatchNorm.forward, calling slimgrad's batch_norm; parameters
        # and buffers read from their dicts (Module.__getattr__'s first two places, in its order;
        # a name in neither, e.g. a parametrization's property, by attribute)
        try:
            if input.ndim not in self._ndims:
                self._check_input_dim(input)
        except FxTraceError:  # NOTE [fx symbolic tracing of a converted model]: a leaf, as
            t = input.tracer  # torch's BatchNorm is in fx's trace
            return t.create_proxy("call_module", t.path_of_module(self), (input,), {})
        params, bufs = self._parameters, self._buffers
        mean = bufs["running_mean"] if "running_mean" in bufs else self.running_mean
        var = bufs["running_var"] if "running_var" in bufs else self.running_var
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            n = "num_batches_tracked"
            nbt = bufs[n] if n in bufs else self.num_batches_tracked
            if nbt is not None:
                nbt.add_(1)
                if self.momentum is None:
                    factor = 1.0 / float(nbt)
        bn_training = self.training or (mean is None and var is None)
        track = not self.training or self.track_running_stats
        # ops.batch_norm(..., recompute_input=self.recompute_input), with this module's dict for
        # NOTE [Arguments known to be plain] in slimgrad/ops/batch_norm.py
        return _batch_norm(
            input,
            mean if track else None,
            var if track else None,
            params["weight"] if "weight" in params else self.weight,
            params["bias"] if "bias" in params else self.bias,
            bn_training,
            factor,
            self.eps,
            self.recompute_input,
            self.__dict__,
        )


class BatchNorm1d(NoScript, _BatchNormMixin, nn.BatchNorm1d):
    """``torch.nn.BatchNorm1d``; keeps its output instead of its input when a slimgrad activation
    follows, nothing full-size in eval with frozen affine (``slimgrad.ops.batch_norm``)."""

    _ndims = (2, 3)

    @classmethod
    def from_torch(cls, module: nn.BatchNorm1d) -> BatchNorm1d:
        """A slimgrad BatchNorm1d sharing ``module``'s Parameters, buffers and hooks."""
        return _from_torch(cls, module, nn.BatchNorm1d)


class BatchNorm2d(NoScript, _BatchNormMixin, nn.BatchNorm2d):
    """``torch.nn.BatchNorm2d``; keeps its output instead of its input when a slimgrad activation
    follows, nothing full-size in eval with frozen affine (``slimgrad.ops.batch_norm``).

    Example:
        >>> bn = BatchNorm2d.from_torch(model.bn1)   # shares weight, bias, running stats
    """

    _ndims = (4,)

    @classmethod
    def from_torch(cls, module: nn.BatchNorm2d) -> BatchNorm2d:
        """A slimgrad BatchNorm2d sharing ``module``'s Parameters, buffers and hooks."""
        return _from_torch(cls, module, nn.BatchNorm2d)


class BatchNorm3d(NoScript, _BatchNormMixin, nn.BatchNorm3d):
    """``torch.nn.BatchNorm3d``; see :class:`BatchNorm2d`."""

    _ndims = (5,)

    @classmethod
    def from_torch(cls, module: nn.BatchNorm3d) -> BatchNorm3d:
        """A slimgrad BatchNorm3d sharing ``module``'s Parameters, buffers and hooks."""
        return _from_torch(cls, module, nn.BatchNorm3d)


class ReLUAfterNorm(NoScript, nn.ReLU):
    """``torch.nn.ReLU`` (same ``inplace`` argument) that, after a slimgrad BatchNorm, lets the
    block keep only the BN output.

    On that path the result is a new tensor (the BN output is what is kept, so it is not
    overwritten). With ``inplace=True`` that path is taken only when
    ``slimgrad.ownership.owns_input`` proves that nobody else can see the BN output (the parent
    runs ``out = self.relu(out)`` on a fresh ``out``, no hooks; NOTE [Gradient-buffer
    ownership]), so a new tensor is indistinguishable from eager's in-place write. Anywhere else
    (``self.relu(out)`` for its side effect, ``a = self.relu(b)`` with ``b`` read later, hooks)
    this is exactly torch's ReLU: it writes over its input, and the BatchNorm keeps its input, as
    eager does.
    """

    _slimgrad_owns_input = True  # NOTE [Forward ownership from stated structure]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # first use of input: NOTE [Gradient-buffer ownership]
        k = id(input)
        if self.inplace:
            # _is_source(input) and _owned(input, self), inline: most inputs are no source
            if k in _SOURCES_D:
                e = _SOURCES_D[k]
                if (
                    e[0]() is input
                    and input._version == e[1][1]
                    and ownership.owns_input(input, self, writes=False)
                ):
                    return _derived.activation(input, "relu", True, owned=True)
            return torch.relu_(input)  # what activation() runs in place without ownership
        if k not in _SOURCES_D:  # no source: activation() would run eager's op
            return torch.relu(input)
        return _derived.activation(input, "relu", False)

    @classmethod
    def from_torch(cls, module: nn.ReLU) -> ReLUAfterNorm:
        """A ReLUAfterNorm with ``module``'s ``inplace`` flag and hooks."""
        return _from_torch(cls, module, nn.ReLU)


class GELUAfterNorm(NoScript, nn.GELU):
    """``torch.nn.GELU`` (same ``approximate`` argument); see :class:`ReLUAfterNorm`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _derived.activation(input, "gelu" if self.approximate == "none" else "gelu_tanh")

    @classmethod
    def from_torch(cls, module: nn.GELU) -> GELUAfterNorm:
        """A GELUAfterNorm with ``module``'s ``approximate`` setting and hooks."""
        return _from_torch(cls, module, nn.GELU)


class SiLUAfterNorm(NoScript, nn.SiLU):
    """``torch.nn.SiLU`` (same ``inplace`` argument, same rule); see :class:`ReLUAfterNorm`."""

    _slimgrad_owns_input = True  # NOTE [Forward ownership from stated structure]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # first use of input: NOTE [Gradient-buffer ownership]
        owned = self.inplace and _is_source(input) and _owned(input, self)
        return _derived.activation(input, "silu", self.inplace, owned=owned)

    @classmethod
    def from_torch(cls, module: nn.SiLU) -> SiLUAfterNorm:
        """A SiLUAfterNorm with ``module``'s ``inplace`` flag and hooks."""
        return _from_torch(cls, module, nn.SiLU)


class LeakyReLUAfterNorm(NoScript, nn.LeakyReLU):
    """``torch.nn.LeakyReLU`` (same ``negative_slope`` and ``inplace``, same rule); see
    :class:`ReLUAfterNorm`. Any slope; in place with a negative slope it is eager's op."""

    _slimgrad_owns_input = True  # NOTE [Forward ownership from stated structure]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # first use of input: NOTE [Gradient-buffer ownership]
        owned = self.inplace and _is_source(input) and _owned(input, self)
        return _derived.activation(
            input, "leaky_relu", self.inplace, owned=owned, param=self.negative_slope
        )

    @classmethod
    def from_torch(cls, module: nn.LeakyReLU) -> LeakyReLUAfterNorm:
        """A LeakyReLUAfterNorm with ``module``'s settings and hooks."""
        return _from_torch(cls, module, nn.LeakyReLU)


class ELUAfterNorm(NoScript, nn.ELU):
    """``torch.nn.ELU`` (same ``alpha`` and ``inplace``, same rule); see :class:`ReLUAfterNorm`."""

    _slimgrad_owns_input = True  # NOTE [Forward ownership from stated structure]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # first use of input: NOTE [Gradient-buffer ownership]
        owned = self.inplace and _is_source(input) and _owned(input, self)
        return _derived.activation(input, "elu", self.inplace, owned=owned, param=self.alpha)

    @classmethod
    def from_torch(cls, module: nn.ELU) -> ELUAfterNorm:
        """An ELUAfterNorm with ``module``'s settings and hooks."""
        return _from_torch(cls, module, nn.ELU)
