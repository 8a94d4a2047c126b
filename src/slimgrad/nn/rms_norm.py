"""``slimgrad.nn.RMSNorm``: ``torch.nn.RMSNorm`` keeping its output (``ops/rms_norm.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules import module as _module

from slimgrad._autograd import unwrap_if_dead
from slimgrad._library import straight
from slimgrad.nn._hooks import forward_hooked
from slimgrad.nn._script import NoScript
from slimgrad.ops.rms_norm import (
    _HF_RMS_APPLY,
    HALF_DTYPES,
    HF_VARIANTS,
    _hf_node,
    _rms_norm_straight,
    hf_rms_norm,
    rms_norm,
)

__all__ = ["HFRMSNorm", "RMSNorm"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PLAIN_OR_NONE = (torch.Tensor, torch.nn.Parameter, type(None))
_any_autocast = torch._C._is_any_autocast_enabled
_grad_on = torch._C.is_grad_enabled
_Parameter = torch.nn.Parameter
_f32, _f64 = torch.float32, torch.float64


class RMSNorm(NoScript, torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (same args, defaults, parameters, state_dict keys), memory-lean.

    Memory: fp32: saves the output (shared with the next layer), rstd (4 B/row), and the input
    columns of channels with weight 0; bf16/fp16: saves the input (2 B/elt) + 4 B/row; eager
    saves the input and x * rstd in fp32 (8 B/elt) + 4 B/row in every dtype.

    Example:
        >>> y = RMSNorm(8)(torch.randn(4, 8, requires_grad=True))
    """

    #: False where the output may be the model's output: eager's op (it keeps the input) runs
    #: instead (NOTE [Modules whose output is the model's output] in
    #: slimgrad/convert_handlers/inplace_guard.py; set by ``convert_``)
    keep_y = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE [Forward hooks on an output-saving module]; forward_hooked only when a hook exists
        if not self.keep_y or (
            (
                self._forward_hooks
                or _module._global_forward_hooks
                or self.near_hooks != self.near_free
            )
            and forward_hooked(self)
        ):
            return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        p = self._parameters  # without Module.__getattr__ (a parametrized weight is a property)
        w = p["weight"] if "weight" in p else self.weight
        ns, eps = self.normalized_shape, self.eps
        if (  # rms_norm's straight path: NOTE [One gate per call] in slimgrad/_library.py
            type(x) in _PLAIN
            and type(w) in _PLAIN_OR_NONE
            and x.dtype not in HALF_DTYPES
            and not x.is_meta
            and not _any_autocast()
            and straight()
        ):
            # normalized_shape as ints and a Size, once per tuple (rms_norm's conversion)
            d = self.__dict__
            c = d["_slimgrad_ns"] if "_slimgrad_ns" in d else None
            if c is None or c[0] is not ns:
                ints = [int(s) for s in ns]
                c = d["_slimgrad_ns"] = (ns, ints, torch.Size(ints), len(ints))
            k = c[3]
            # eager's shape checks, as attribute compares (rms_norm raises eager's errors)
            if (
                k
                and x.ndim >= k
                and x.shape[x.ndim - k :] == c[2]
                and (w is None or w.shape == c[2])
            ):
                return _rms_norm_straight(x, c[1], w, None if eps is None else float(eps))
        return rms_norm(x, ns, w, eps)

    @classmethod
    def from_torch(cls, module: torch.nn.RMSNorm) -> RMSNorm:
        """A slimgrad RMSNorm sharing ``module``'s Parameters (no copy)."""
        if not isinstance(module, torch.nn.RMSNorm):
            raise TypeError(
                f"slimgrad.nn.RMSNorm.from_torch: expected a torch.nn.RMSNorm, got "
                f"{type(module).__name__}. Pass an nn.RMSNorm instance."
            )
        new = cls(module.normalized_shape, module.eps, module.elementwise_affine, device="meta")
        new.weight = module.weight
        new.train(module.training)
        return new


class HFRMSNorm(NoScript, torch.nn.Module):
    """An HF RMSNorm (``LlamaRMSNorm``, ``GemmaRMSNorm``, ``T5LayerNorm``, ... : ``variant``) with
    the original's parameters, attributes and state_dict keys, computing HF's forward bit for bit
    (:func:`slimgrad.ops.rms_norm.hf_rms_norm`, NOTE [HF RMSNorm cast orders]).

    Memory: float32 input: saves the output (shared with the next layer), rstd (4 B/row), and the
    input columns of channels whose scale is 0; other dtypes: saves the input (2 B/elt in
    bf16/fp16); eager saves a float32 copy of the input and the normalized tensor.

    Example:
        >>> y = HFRMSNorm(8)(torch.randn(4, 8, requires_grad=True))
    """

    #: False where the output may be the model's output: HF's ops (eager's: they keep the input)
    #: run instead (NOTE [Modules whose output is the model's output] in
    #: slimgrad/convert_handlers/inplace_guard.py; set by ``convert_``)
    keep_y = True

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        variant: str = "llama",
        eps_attr: str = "variance_epsilon",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if variant not in HF_VARIANTS:
            raise ValueError(
                f"slimgrad.nn.HFRMSNorm: unknown variant; expected one of {sorted(HF_VARIANTS)}, "
                f"got {variant!r}. Pass a key of slimgrad.ops.rms_norm.HF_VARIANTS."
            )
        self.variant, self.eps_attr = variant, eps_attr
        if HF_VARIANTS[variant][1] is not None:
            init = 0.0 if variant in ("gemma", "centered") else 1.0
            w = torch.full((hidden_size,), init, device=device, dtype=dtype)
            self.weight = torch.nn.Parameter(w)
        setattr(self, eps_attr, eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = None
        d = self.__dict__  # attribute reads without Module.__getattr__ / getattr calls
        # with_scale: a plain attribute when the HF module had one (from_hf copies it)
        if HF_VARIANTS[self.variant][1] is not None and ("with_scale" not in d or d["with_scale"]):
            p = self._parameters  # a parametrized weight is a property: read as an attribute
            w = p["weight"] if "weight" in p else self.weight
        ea = self.eps_attr
        eps = d[ea] if ea in d else getattr(self, ea)
        # NOTE [Forward hooks on an output-saving module]: HF's ops; forward_hooked only when a
        # hook exists
        if not self.keep_y or (
            (
                self._forward_hooks
                or _module._global_forward_hooks
                or self.near_hooks != self.near_free
            )
            and forward_hooked(self)
        ):
            return HF_VARIANTS[self.variant][0](hidden_states, w, eps)[0]
        x, v = hidden_states, self.variant
        if (  # hf_rms_norm's straight path, its gate inline: NOTE [One gate per call]
            type(x) in _PLAIN
            and type(w) in _PLAIN_OR_NONE
            and x.dtype == _f32
            and x.shape
            and 0 not in x.shape
            and v in HF_VARIANTS
            and (
                w is None
                or (
                    w.shape == x.shape[-1:]
                    and w.dtype != _f64
                    and not (v == "t5" and w.dtype in HALF_DTYPES)
                )
            )
            and (x.requires_grad or (w is not None and w.requires_grad))
            and not x.is_meta
            and _grad_on()
            and straight()
        ):
            if type(w) is not _Parameter and w is not None:
                w = unwrap_if_dead(w)
            x = unwrap_if_dead(x)
            if v == "llama":  # NOTE [The RMSNorm node in C++] in slimgrad/ops/rms_norm.py
                y = _hf_node(x, w, float(eps))
                if y is not None:
                    return y
            return _HF_RMS_APPLY(x, w, float(eps), v, True)[0]
        return hf_rms_norm(hidden_states, w, eps, v)

    def extra_repr(self) -> str:
        w = getattr(self, "weight", None)
        shape = tuple(w.shape) if w is not None else None
        return f"{shape}, eps={getattr(self, self.eps_attr)}, variant={self.variant!r}"

    @classmethod
    def from_hf(
        cls, module: torch.nn.Module, variant: str = "llama", eps_attr: str = "variance_epsilon"
    ) -> HFRMSNorm:
        """An HFRMSNorm sharing ``module``'s parameters and buffers, with its public attributes
        (``variance_epsilon``/``eps``, ``with_scale``, ...). The caller vouches that ``module``'s
        forward is ``variant``'s (``slimgrad.convert_handlers.hf`` checks it from the source)."""
        weight = getattr(module, "weight", None)
        eps = getattr(module, eps_attr, None)
        if HF_VARIANTS.get(variant, (None, None))[1] is not None and getattr(
            module, "with_scale", True
        ):
            if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1:
                raise NotImplementedError("its weight is not a 1-D Parameter")
        if not isinstance(eps, float | int):
            raise NotImplementedError(f"its {eps_attr} is not a number")
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.variant, new.eps_attr = variant, eps_attr
        for name, p in module._parameters.items():
            new.register_parameter(name, p)
        for name, b in module._buffers.items():
            new.register_buffer(name, b, persistent=name not in module._non_persistent_buffers_set)
        for k, v in vars(module).items():
            if not k.startswith("_") and k != "training":
                setattr(new, k, v)
        new.train(module.training)
        return new
