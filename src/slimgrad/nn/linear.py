"""``slimgrad.nn.Linear`` and ``Conv1D`` (HF GPT-2's ``x @ W + b``) with selective saving.

See ``slimgrad/ops/linear.py``: the input is kept only if the weight needs a gradient.

# NOTE [Converted Linear outside autocast]
Outside autocast (and outside torch.compile, torch.func and TorchScript tracing), with Parameters
and a plain input whose last dimension fits, a converted ``Linear`` calls eager's
``F.linear(input, weight, bias)`` and a converted ``Conv1D`` HF's own
``addmm(bias, x.view(-1, nx), weight).view(..., nf)``: eager's ops, no slimgrad Function. There
slimgrad's ``_LinearFn`` (``slimgrad/ops/linear.py``) bought nothing: it computed eager's output
and gradients and kept what eager's ``linear``/``addmm`` keep (x only if W needs a gradient;
eager's ``AddmmBackward``/``MmBackward`` count in the tracker's floor as its node did); its dx
was a fresh tensor where eager's is a whole-storage view of a fresh base, which NOTE
[Gradient-buffer ownership] term 2b grants alike, so the neighbours' grants are the same
(tests/test_ownership_grants.py); no ``_derived`` registry or ownership rule reads a Linear's
node. It cost its Python frames in forward and backward (tests/nn/test_linear.py counts them),
and where it differed from eager it was worse: on a 2-D input HF's Conv1D returns a view of its
product, the Function a tensor of its own, so an in-place consumer (``mul_`` then ``relu_``)
saved one output more than eager, and on a column-major 2-D input (``x.t()``) its dx was one ulp
from eager's (eager's addmm backward switches layout). Now the bits, saved and peak bytes are
eager's (tests/nn/test_linear_eager_path.py). Under autocast the Function stays: it keeps the
fp32 weight instead of its cast (NOTE [Autocast weight casts]). The fake tensors of
``slimgrad.memory.estimate`` (a fake Parameter is a FakeTensor) take eager's op as real ones do,
and so does GPT-2's MLP node (``ops/gpt2_mlp.py``), or the estimate would keep the Function's
saved tensors where the real step keeps eager's (a planned step measured 65,408 B above its
plan); the ownership grants on eager's dx views hold under fake tensors as for real ones (NOTE
[Ownership under fake tensors] in slimgrad/ownership.py). Everything else (another tensor
subclass, a mismatched shape, whose error is slimgrad's, a non-Parameter weight, a Conv1D without
bias) takes ``ops.linear``/``ops.conv1d_addmm`` as before.
"""

from __future__ import annotations

import torch

from slimgrad._autograd import compiling
from slimgrad.nn._script import NoScript
from slimgrad.ops.linear import _FakeTensor as _Fake
from slimgrad.ops.linear import conv1d_addmm, linear

_C = torch._C
_functorch_on = _C._are_functorch_transforms_active
_is_tracing = _C._is_tracing
_any_autocast = _C._is_any_autocast_enabled
_INPUT = (torch.Tensor, torch.nn.Parameter, _Fake)
_WEIGHT = (torch.nn.Parameter, _Fake)  # a fake Parameter is a FakeTensor marked _is_param
_BIAS = (torch.nn.Parameter, _Fake, type(None))
_F_linear = torch.nn.functional.linear
_addmm = torch.addmm

__all__ = ["Conv1D", "Linear"]


class Linear(NoScript, torch.nn.Linear):
    """``torch.nn.Linear`` (same args, parameters, state_dict keys) keeping only what grads need.

    Memory: saves the input only if the weight needs grad (frozen weight: nothing of the input),
    as eager's ``linear``, by running eager's ``F.linear`` (NOTE [Converted Linear outside
    autocast]); under ``torch.autocast`` the weight is kept as itself and cast per use, not as a
    cast kept for backward (NOTE [Autocast weight casts] in ``slimgrad/ops/linear.py``).
    ``convert_`` converts plain ``nn.Linear`` to this (NOTE [Which Linears convert]).

    Example:
        >>> y = Linear(8, 3)(torch.randn(4, 8))
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        p = self._parameters  # _params(self), inline
        weight = p["weight"] if "weight" in p else self.weight
        bias = p["bias"] if "bias" in p else self.bias
        if (  # eager's F.linear (NOTE [Converted Linear outside autocast])
            type(weight) in _WEIGHT
            and type(bias) in _BIAS
            and type(input) in _INPUT
            and input.ndim > 0
            and input.shape[-1] == weight.shape[1]
            and not compiling()
            and not _functorch_on()
            and not _is_tracing()
            and not _any_autocast()
        ):
            return _F_linear(input, weight, bias)
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

    Memory: saves the input only if the weight needs grad: outside autocast it runs HF's own
    ``addmm`` (NOTE [Converted Linear outside autocast]); under autocast it keeps the fp32 weight
    instead of its cast (NOTE [Autocast weight casts] in ``slimgrad/ops/linear.py``).

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
        if (  # HF's own addmm (NOTE [Converted Linear outside autocast])
            type(weight) in _WEIGHT
            and type(bias) in _WEIGHT
            and type(x) in _INPUT
            and x.ndim > 0
            and x.shape[-1] == weight.shape[0]
            and not compiling()
            and not _functorch_on()
            and not _is_tracing()
            and not _any_autocast()
        ):  # HF's Conv1D.forward, verbatim in its ops
            return _addmm(bias, x.view(-1, x.shape[-1]), weight).view(x.shape[:-1] + (self.nf,))
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
