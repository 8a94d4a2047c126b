"""``slimgrad.nn.Linear`` and ``Conv1D`` (HF GPT-2's ``x @ W + b``) with selective saving.

See ``slimgrad/ops/linear.py``: the input is kept only if the weight needs a gradient.
"""

from __future__ import annotations

import torch

from slimgrad._autograd import compiling, unwrap_if_dead
from slimgrad.nn._script import NoScript
from slimgrad.ops.linear import _LINEAR_APPLY, _unview, conv1d_addmm, linear

_C = torch._C
_functorch_on = _C._are_functorch_transforms_active
_is_tracing = _C._is_tracing
_any_autocast = _C._is_any_autocast_enabled
_INPUT = (torch.Tensor, torch.nn.Parameter)
_Parameter = torch.nn.Parameter

__all__ = ["Conv1D", "Linear"]


class Linear(NoScript, torch.nn.Linear):
    """``torch.nn.Linear`` (same args, parameters, state_dict keys) keeping only what grads need.

    Memory: saves the input only if the weight needs grad (frozen weight: nothing of the input),
    as eager's ``linear``; under ``torch.autocast`` the weight is kept as itself and cast per use,
    not as a cast kept for backward (NOTE [Autocast weight casts] in ``slimgrad/ops/linear.py``).
    ``convert_`` converts plain ``nn.Linear`` to this (NOTE [Which Linears convert]).

    Example:
        >>> y = Linear(8, 3)(torch.randn(4, 8))
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        p = self._parameters  # _params(self), inline
        weight = p["weight"] if "weight" in p else self.weight
        bias = p["bias"] if "bias" in p else self.bias
        if (  # ops.linear's straight path without its frames (NOTE [Linear's straight path])
            type(weight) is _Parameter
            and (bias is None or type(bias) is _Parameter)
            and type(input) in _INPUT
            and input.ndim > 0
            and weight.ndim == 2
            and input.shape[-1] > 1
            and input.shape[-1] == weight.shape[1]
            and not compiling()
            and not _functorch_on()
            and not _is_tracing()
            and not _any_autocast()
            and weight.is_contiguous()  # _plain_layout
            and input.is_contiguous()
        ):
            y = _LINEAR_APPLY(unwrap_if_dead(input), weight, bias, False, True)
            # NOTE [Linear's 2-D product] in slimgrad/ops/linear.py
            if input.ndim < 3:
                return y
            if bias is None:  # NOTE [Linear's N-D output without bias] in slimgrad/ops/linear.py
                return _unview(y, input.shape[:-1] + y.shape[-1:])
            return y.view(input.shape[:-1] + y.shape[-1:])
        return linear(input, weight, bias)

    @classmethod
    def from_torch(cls, module: torch.nn.Linear) -> Linear:
        """A slimgrad Linear sharing ``module``'s Parameters (no copy)."""
        if not isinstance(module, torch.nn.Linear):
            raise TypeError(
                f"slimgrad.nn.Linear.from_torch: expected a torch.nn.Linear, got "
                f"{type(module).__name__}. Pass an nn.Linear instance."
            )
        new = cls(module.in_features, module.out_features, module.bias is not None, device="meta")
        new.weight, new.bias = module.weight, module.bias
        new.train(module.training)
        return new


class Conv1D(NoScript, torch.nn.Module):
    """HF GPT-2 ``Conv1D(nf, nx)``: ``y = x @ weight + bias``, weight ``(nx, nf)``, bias ``(nf,)``.

    Same args, parameters and state_dict keys as ``transformers.pytorch_utils.Conv1D``.
    ``from_torch`` of a transformers ``Conv1D`` returns a :class:`TransformersConv1D`, which is
    also an instance of ``transformers.pytorch_utils.Conv1D``, so code that dispatches on that
    class (PEFT's LoRA: ``isinstance(layer, Conv1D)``, ``fan_in_fan_out``) treats it as HF's.

    Memory: saves the input only if the weight needs grad (as eager's addmm).

    Example:
        >>> y = Conv1D(3, 8)(torch.randn(4, 8))
    """

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = torch.nn.Parameter(torch.empty(nx, nf))
        self.bias = torch.nn.Parameter(torch.zeros(nf))
        torch.nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the Parameters without Module.__getattr__; a parametrized weight is a property of the
        # parametrized class, not in _parameters: read as an attribute
        p = self._parameters
        weight = p["weight"] if "weight" in p else self.weight
        bias = p["bias"] if "bias" in p else self.bias
        if (  # ops.conv1d_addmm's straight path without its frames (NOTE [Linear's straight path])
            type(weight) is _Parameter
            and (bias is None or type(bias) is _Parameter)
            and x.ndim > 0
            and x.shape[-1] == weight.shape[0]
            and not compiling()
            and not _functorch_on()
            and not _is_tracing()
            and not _any_autocast()
        ):
            y = _LINEAR_APPLY(unwrap_if_dead(x), weight, bias, True, True)
            # NOTE [Linear's 2-D product] in slimgrad/ops/linear.py
            return y if x.ndim < 3 else y.view(x.shape[:-1] + y.shape[-1:])
        return conv1d_addmm(x, weight, bias)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}"

    @classmethod
    def from_torch(cls, module: torch.nn.Module) -> Conv1D:
        """A slimgrad Conv1D sharing the Parameters of a ``transformers`` ``Conv1D`` (no copy).

        For a ``transformers.pytorch_utils.Conv1D`` instance the result is a
        :class:`TransformersConv1D` (a subclass of both classes).
        """
        w = getattr(module, "weight", None)
        if type(module).__name__ != "Conv1D" or w is None or w.dim() != 2:
            raise TypeError(
                f"slimgrad.nn.Conv1D.from_torch: expected a transformers Conv1D, got "
                f"{type(module).__name__}. Pass a transformers.pytorch_utils.Conv1D instance."
            )
        hf = _transformers_conv1d()
        if cls is Conv1D and hf is not None and isinstance(module, hf):
            cls = _transformers_subclass()
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.nf, new.nx = module.nf, module.nx
        new.weight, new.bias = module.weight, module.bias
        new.train(module.training)
        return new


def _transformers_conv1d():
    # transformers' Conv1D if transformers is already imported (a module holding one was built by
    # it); never imports transformers itself
    import sys

    mod = sys.modules.get("transformers.pytorch_utils")
    return getattr(mod, "Conv1D", None) if mod is not None else None


_SUBCLASS: list[type] = []


def _transformers_subclass() -> type:
    # created once, on first use, when transformers is importable; reachable as
    # ``slimgrad.nn.linear.TransformersConv1D`` (module __getattr__), so pickle finds it
    if not _SUBCLASS:
        from transformers.pytorch_utils import Conv1D as HFConv1D

        _SUBCLASS.append(
            type(
                "TransformersConv1D",
                (Conv1D, HFConv1D),
                {
                    "__module__": __name__,
                    "__qualname__": "TransformersConv1D",
                    "__doc__": (
                        "slimgrad's :class:`Conv1D` that is also a "
                        "``transformers.pytorch_utils.Conv1D`` (created when transformers is "
                        "importable). Forward, memory and state_dict are slimgrad Conv1D's."
                    ),
                    "__repr__": torch.nn.Module.__repr__,
                },
            )
        )
    return _SUBCLASS[0]


def __getattr__(name: str):
    if name == "TransformersConv1D":
        return _transformers_subclass()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
