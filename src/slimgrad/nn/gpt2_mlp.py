"""``slimgrad.nn.GPT2MLP``: HF GPT-2's MLP (``dropout(c_proj(act(c_fc(x))))``) as one autograd node.

The module holds HF's own ``c_fc``, ``act``, ``c_proj`` and ``dropout`` under their names (so
``state_dict`` keys and values are unchanged and code that reaches ``mlp.c_fc`` still finds it);
``convert_`` converts those children as usual. Each call decides from what they are *now*
(NOTE [GPT-2 MLP: which path]).

# NOTE [GPT-2 MLP: which path]
:func:`slimgrad.ops.gpt2_mlp` (one node, NOTE [One node for GPT-2's MLP]) runs when every child
is the slimgrad module ``convert_`` made of it (``Conv1D``, ``GELU`` keeping y, ``Dropout`` not in
place, p < 1) with no patched forward and no hook of its own (slimgrad's measuring hooks do not
count, NOTE [Forward hooks on an output-saving module] in ``nn/_hooks.py``), no global module hook,
plain Parameters, and :func:`slimgrad.ops.gpt2_mlp.block_ok` holds for the call (eager, grad
mode, float32, more than 512 elements of h); under bf16/fp16 autocast the autocast node where
:func:`slimgrad.ops.gpt2_mlp.autocast_ok` holds (NOTE [GPT-2's MLP under autocast]). Anything
else calls the children one by one, HF's forward op for op: exactly the per-op converted model
(under ``torch.compile``, ``no_grad``, a LoRA-wrapped or frozen-by-convert_ projection, a hooked
child).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.modules import module as _module

from slimgrad._autograd import unwrap_if_dead
from slimgrad._library import straight
from slimgrad.nn import dropout as _snd
from slimgrad.nn import gelu as _sng
from slimgrad.nn import linear as _snl
from slimgrad.nn._hooks import foreign, global_hooks_act
from slimgrad.nn._output_act import _DECLARED
from slimgrad.nn._script import NoScript
from slimgrad.ops.gpt2_mlp import (
    _GPT2_LN_MLP_APPLY,
    _GPT2_MLP_APPLY,
    autocast_apply,
    autocast_ok,
    block_ok,
    later_list,
    ln_ok,
)
from slimgrad.ops.linear import _FakeTensor, _product_after, _top_hooks

__all__ = ["GPT2MLP"]

# a fake Parameter (slimgrad.memory.estimate) is a FakeTensor: it takes the node as a real one
_WEIGHT = (torch.nn.Parameter, _FakeTensor)
_BIAS = (torch.nn.Parameter, _FakeTensor, type(None))
_APPROX = ("none", "tanh")


_CONV1D_FORWARD = _snl.Conv1D.forward


def _hooked(m) -> bool:
    # a patched forward, a backward hook, or a forward hook that is not slimgrad's own
    return (
        "forward" in m.__dict__
        or bool(m._backward_hooks or m._backward_pre_hooks)
        or foreign(m._forward_hooks)
        or foreign(m._forward_pre_hooks)
    )


_global_hooks = global_hooks_act  # (hf_attention asks it as mlp._global_hooks)


class GPT2MLP(NoScript, nn.Module):
    """HF ``GPT2MLP`` (``c_fc`` -> ``act`` -> ``c_proj`` -> ``dropout``) run as one autograd node
    where its children are slimgrad's (NOTE [GPT-2 MLP: which path]).

    Memory: what the converted children keep, byte for byte (x, GELU's output + 1/8 B/elt and its
    sparse table, the dropout mask as 1/8 B/elt); see :mod:`slimgrad.ops.gpt2_mlp`.

    Args:
        intermediate_size: the hidden width (``c_fc``'s outputs).
        hidden_size: the model width.
        approximate: the GELU's form, ``'none'`` or ``'tanh'`` (HF ``gelu_new``).
        p: the dropout probability.

    Example:
        >>> mlp = GPT2MLP(32, 8)
        >>> y = mlp(torch.randn(2, 100, 8))
    """

    # convert_ converts the children it holds (Conv1D, GELU, Dropout) in the same pass
    CONVERT_CHILDREN = True

    def __init__(
        self, intermediate_size: int, hidden_size: int, approximate: str = "tanh", p: float = 0.1
    ) -> None:
        super().__init__()
        self.c_fc = _snl.Conv1D(intermediate_size, hidden_size)
        self.c_proj = _snl.Conv1D(hidden_size, intermediate_size)
        self.act = _sng.GELU(approximate)
        self.dropout = _snd.Dropout(p)

    @classmethod
    def from_hf(cls, module: nn.Module) -> GPT2MLP:
        """A GPT2MLP holding ``module``'s own submodules, parameters and buffers (no copy, the
        same ``state_dict``), its plain attributes and training mode."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for k, v in vars(module).items():
            if not k.startswith("_") and k != "training":
                setattr(new, k, v)
        for k, p in module._parameters.items():
            new.register_parameter(k, p)
        for k, b in module._buffers.items():
            new.register_buffer(k, b, persistent=k not in module._non_persistent_buffers_set)
        for k, m in module._modules.items():
            new.add_module(k, m)
        new.train(module.training)
        return new

    def _node_parts(self):
        # (c_fc's, c_proj's Parameters, act, dropout) where the children are the ones the node
        # runs (NOTE [GPT-2 MLP: which path]); None: call them one by one
        mods = self._modules
        c_fc, act, c_proj, drop = mods["c_fc"], mods["act"], mods["c_proj"], mods["dropout"]
        if (
            type(act) is _sng.GELU
            and act.keep_y
            and not act.inplace
            and act.approximate in _APPROX
            and type(drop) is _snd.Dropout
            and not drop.inplace
            and type(drop.p) is float
            and (drop.p < 1.0 or not drop.training)
            # slimgrad's Conv1D (or its transformers-compatible subclass): its forward
            and type(c_fc).forward is _CONV1D_FORWARD
            and type(c_proj).forward is _CONV1D_FORWARD
            and "weight" in (fp := c_fc._parameters)
            and "weight" in (pp := c_proj._parameters)
            and type(fp["weight"]) in _WEIGHT
            and type(pp["weight"]) in _WEIGHT
            and type(fp.get("bias")) in _BIAS
            and type(pp.get("bias")) in _BIAS
            # _hooked(child) and _global_hooks() only when some hook dict is not empty
            and not (
                (
                    "forward" in c_fc.__dict__
                    or c_fc._forward_hooks
                    or c_fc._forward_pre_hooks
                    or c_fc._backward_hooks
                    or c_fc._backward_pre_hooks
                    or act._forward_hooks
                    or act._forward_pre_hooks
                    or act._backward_hooks
                    or act._backward_pre_hooks
                    or c_proj._forward_hooks
                    or c_proj._forward_pre_hooks
                    or c_proj._backward_hooks
                    or c_proj._backward_pre_hooks
                    or drop._forward_hooks
                    or drop._forward_pre_hooks
                    or drop._backward_hooks
                    or drop._backward_pre_hooks
                    or "forward" in act.__dict__
                    or "forward" in c_proj.__dict__
                    or "forward" in drop.__dict__
                )
                and (_hooked(c_fc) or _hooked(act) or _hooked(c_proj) or _hooked(drop))
            )
            and not (
                (
                    _module._global_forward_hooks
                    or _module._global_forward_pre_hooks
                    or _module._global_backward_hooks
                    or _module._global_backward_pre_hooks
                )
                and _global_hooks()
            )
        ):
            return fp, pp, act, drop
        return None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        parts = self._node_parts()
        if parts is not None:
            fp, pp, act, drop = parts
            if block_ok(hidden_states, fp["weight"], fp.get("bias"), pp["weight"], pp.get("bias")):
                p = drop.p if drop.training and drop.p > 0.0 else None
                # NOTE [c_proj's product after the saves] in ops/gpt2_mlp.py (no call with a
                # dropout step, one C call without hooks)
                later = None if p is not None or _top_hooks(False) is None else later_list(p)
                z = _GPT2_MLP_APPLY(  # ops.gpt2_mlp.apply, inline
                    unwrap_if_dead(hidden_states),
                    fp["weight"],
                    fp.get("bias"),
                    pp["weight"],
                    pp.get("bias"),
                    act.approximate,
                    p,
                    straight(),
                    later,
                )
                return z if not later else _product_after(z, later)
            if autocast_ok(
                hidden_states, fp["weight"], fp.get("bias"), pp["weight"], pp.get("bias")
            ):
                p = drop.p if drop.training and drop.p > 0.0 else None
                return autocast_apply(
                    hidden_states,
                    fp["weight"],
                    fp.get("bias"),
                    pp["weight"],
                    pp.get("bias"),
                    act.approximate,
                    p,
                )
        mods = self._modules
        return mods["dropout"](mods["c_proj"](mods["act"](mods["c_fc"](hidden_states))))

    # the children in this order, or the node's fresh result (NOTE [A replacement states its
    # structure] in slimgrad/convert_handlers/inplace_guard.py)
    _slimgrad_output_statement = (forward, ("c_fc", "act", "c_proj", "dropout"))

    def forward_after_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """``self(norm(x))`` as one node with the LayerNorm folded in (NOTE [A LayerNorm folded
        into its consumer's node] in ``slimgrad/ops/gpt2_mlp.py``), or None where that node does
        not apply (the caller then calls ``norm`` and ``self`` as modules). ``norm`` is a
        ``slimgrad.nn.LayerNorm`` over the last dim that its caller found without hooks."""
        parts = self._node_parts()
        if parts is None:
            return None
        fp, pp, act, drop = parts
        np_ = norm._parameters
        lw, lb = np_.get("weight"), np_.get("bias")
        if not (
            ln_ok(x, lw, lb)
            and block_ok(x, fp["weight"], fp.get("bias"), pp["weight"], pp.get("bias"))
        ):
            return None
        p = drop.p if drop.training and drop.p > 0.0 else None
        later = None if p is not None or _top_hooks(False) is None else later_list(p)
        z = _GPT2_LN_MLP_APPLY(
            unwrap_if_dead(x),
            lw,
            lb,
            norm_shape(norm),
            float(norm.eps),
            norm.y_kept_after,
            fp["weight"],
            fp.get("bias"),
            pp["weight"],
            pp.get("bias"),
            act.approximate,
            p,
            straight(),
            later,
        )
        return z if not later else _product_after(z, later)


def norm_shape(norm: nn.Module) -> list[int]:
    # normalized_shape as a list of ints, once per tuple (slimgrad.nn.LayerNorm's own cache)
    d = norm.__dict__
    ns = norm.normalized_shape
    c = d["_slimgrad_ns"] if "_slimgrad_ns" in d else None
    if c is None or c[0] is not ns:
        c = d["_slimgrad_ns"] = (ns, [int(s) for s in ns])
    return c[1]


# NOTE [Keep y only where its consumer keeps it] in nn/_output_act.py: this forward hands act's
# output to c_proj, as HF's GPT2MLP.forward does
_DECLARED[(f"{__name__}.GPT2MLP", "forward")] = {"act": ("c_proj",)}
