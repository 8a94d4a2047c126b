"""``slimgrad.nn.LayerNorm``: ``torch.nn.LayerNorm`` keeping its output (``ops/layer_norm.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules import module as _module

from slimgrad._autograd import compiling, unwrap_if_dead
from slimgrad._library import straight, under_checkpoint
from slimgrad.kernels import _backend
from slimgrad.nn._hooks import forward_hooked
from slimgrad.nn._output_act import requested
from slimgrad.nn._script import NoScript
from slimgrad.ops.layer_norm import (
    _LN_APPLY,
    _NO_TRITON,
    _TORCH,
    HALF_DTYPES,
    layer_norm_gated,
)

__all__ = ["LayerNorm"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PLAIN_OR_NONE = (torch.Tensor, torch.nn.Parameter, type(None))
_any_autocast = torch._C._is_any_autocast_enabled
_Parameter = torch.nn.Parameter


class LayerNorm(NoScript, torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` (same args, defaults, parameters, state_dict keys) saving y + 8 B/row.

    Memory: saves the output (shared with the next layer), mean and rstd, and the input columns of
    fallback channels (weight ~ 0) where ``convert_`` found a consumer that keeps the output
    (``y_kept_after``; elsewhere a fallback channel makes it save the input, as eager); eager
    saves the input too. A non-finite weight entry (inf or
    NaN) makes it save the input instead of the output (eager's bytes), and bfloat16/float16
    inputs run eager's ``F.layer_norm`` (keeping the input, as eager): see
    ``slimgrad.ops.layer_norm``.

    Example:
        >>> ln = LayerNorm(8)
        >>> y = ln(torch.randn(4, 8, requires_grad=True))
    """

    #: False where the output may be the model's output: eager's op (it keeps the input) runs
    #: instead (NOTE [Modules whose output is the model's output] in
    #: slimgrad/convert_handlers/inplace_guard.py; set by ``convert_``)
    keep_y = True
    #: True where ``convert_`` found that the module's output goes to a layer that keeps it (a
    #: Linear or convolution whose weight requires grad): only there does a fallback channel keep
    #: y and the channel's input columns; elsewhere x, as eager (NOTE [LayerNorm's fallback
    #: columns only where y is kept after it] in slimgrad/ops/layer_norm.py)
    y_kept_after = False
    #: True where ``convert_`` found that the output may be a layer's output below the root of an
    #: HF model, which transformers hands to the caller when a call asks for hidden states: such a
    #: call runs eager's op (NOTE [Hidden states handed out per call] in slimgrad/nn/_output_act.py)
    handed_out = False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # NOTE [Forward hooks on an output-saving module]; forward_hooked only when a hook exists
        if (
            not self.keep_y
            or (
                (
                    self._forward_hooks
                    or _module._global_forward_hooks
                    or self.near_hooks != self.near_free
                )
                and forward_hooked(self)
            )
            # NOTE [Hidden states handed out per call]: under a checkpoint's hooks whatever the
            # request, so that its recompute (no request there) keeps what the forward kept
            # (read outside a compiled trace: Dynamo traces checkpoint's regions as its own)
            or (self.handed_out and (requested() or (not compiling() and under_checkpoint())))
        ):
            return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)
        p = self._parameters  # the Parameters without Module.__getattr__ (a parametrized weight
        # is a property of the parametrized class, not in _parameters: read as an attribute)
        w = p["weight"] if "weight" in p else self.weight
        b = p["bias"] if "bias" in p else self.bias
        ns = self.normalized_shape
        if (  # layer_norm's straight path: NOTE [One gate per call] in slimgrad/_library.py
            type(input) in _PLAIN
            and type(w) in _PLAIN_OR_NONE
            and type(b) in _PLAIN_OR_NONE
            and input.dtype not in HALF_DTYPES
            and not input.is_meta
            and not _any_autocast()
            and straight()
        ):
            # normalized_shape as a list of ints, once per tuple (layer_norm's conversion)
            d = self.__dict__
            c = d["_slimgrad_ns"] if "_slimgrad_ns" in d else None
            if c is None or c[0] is not ns:
                c = d["_slimgrad_ns"] = (ns, [int(s) for s in ns])
            # TWIN: ops/layer_norm.py's _layer_norm_straight, copied here without its frame to
            # keep LayerNorm's call budget (43 calls per fwd + bwd, tests/ops/test_layer_norm.py);
            # change both (tests/nn/test_layer_norm.py checks that they agree)
            # no anchor: NOTE [LayerNorm's second derivatives through its own node]
            x = unwrap_if_dead(input)
            if type(w) is not _Parameter and w is not None:
                w = unwrap_if_dead(w)
            if type(b) is not _Parameter and b is not None:
                b = unwrap_if_dead(b)
            # the PyTorch forward where use_triton cannot answer True (NOTE [Kernel backend
            # choice])
            backend = _backend._resolved[0] or _backend.get_backend()
            direct = _TORCH if not x.is_cuda and backend in _NO_TRITON else True
            y = _LN_APPLY(x, c[1], w, b, float(self.eps), direct, self.y_kept_after)
            # NOTE [LayerNorm's straight forward returns y alone] in slimgrad/ops/layer_norm.py
            return y if direct is _TORCH else y[0]
        return layer_norm_gated(input, ns, w, b, self.eps, self.y_kept_after)

    @classmethod
    def from_torch(cls, module: torch.nn.LayerNorm) -> LayerNorm:
        """A slimgrad LayerNorm sharing ``module``'s Parameters (no copy)."""
        if not isinstance(module, torch.nn.LayerNorm):
            raise TypeError(
                f"slimgrad.nn.LayerNorm.from_torch: expected a torch.nn.LayerNorm, got "
                f"{type(module).__name__}. Pass an nn.LayerNorm instance."
            )
        new = cls(
            module.normalized_shape,
            module.eps,
            module.elementwise_affine,
            bias=module.bias is not None,
            device="meta",
        )
        new.weight, new.bias = module.weight, module.bias
        new.train(module.training)
        return new
