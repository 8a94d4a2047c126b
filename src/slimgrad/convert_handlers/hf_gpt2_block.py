"""HF GPT-2 blocks whose LayerNorms fold into the nodes after them (issue 32: host overhead).

# NOTE [GPT-2's block with its LayerNorms folded]
Where ``convert_`` gave a GPT-2 attention its :class:`~slimgrad.convert_handlers.hf_attention.
GPT2AttentionForward` (NOTE [GPT-2's attention output as one node]), the ``GPT2Block`` holding it
(HF's own forward, no patched forward, no cross-attention) gets a :class:`GPT2BlockForward` as
its instance ``forward`` (the instance stays HF's class; its own hooks fire around it as before).
Each call runs HF's block forward step for step (residual adds in HF's order), except that

- ``ln_1`` and ``c_attn`` run as one node (``slimgrad.ops.gpt2_attention.ln_conv1d``) where the
  attention takes its straight path (``GPT2AttentionForward.straight``) and ``ln_1`` and
  ``c_attn`` are the modules ``convert_`` made (slimgrad's ``LayerNorm`` keeping its output, a
  ``Conv1D`` with slimgrad's forward) with no hook or patched forward; the attention then runs
  from ``c_attn``'s output (``GPT2AttentionForward.after_c_attn``);
- ``ln_2`` and the MLP run as one node (``slimgrad.nn.GPT2MLP.forward_after_norm``) where the
  MLP's node applies and ``ln_2`` is slimgrad's, unhooked.

Each node runs the per-op path's steps (NOTE [A LayerNorm folded into its consumer's node] in
``slimgrad/ops/gpt2_mlp.py``): the same values, gradients, saved tensors and dropout masks. Any
other call (cross-attention inputs, hooks on the attention, the MLP or a LayerNorm that are not
slimgrad's observers, a global module hook, compiling, extra positional arguments) runs HF's
forward, module by module; so does a training call with HF's gradient checkpointing on
(``gradient_checkpointing_enable``: transformers wraps the class's ``forward``, which checkpoints
the block), so the block is checkpointed as before. The checks that read only the block's
structure are the module's own children and hook dicts, read per call (a child replaced or hooked
after ``convert_`` is seen at its next call). Which releases' blocks get it: NOTE [GPT-2's block,
recognised by structure and signature].
"""

from __future__ import annotations

import inspect
import sys
from functools import cache
from inspect import Parameter as P

import torch.nn as nn
from torch.nn.modules import module as _module

from slimgrad._autograd import compiling
from slimgrad.convert_handlers.decision import InstanceForward
from slimgrad.nn._hooks import foreign, global_hooks_act

__all__ = ["GPT2BlockForward", "gpt2_block_forwards_"]


def _watched(m) -> bool:
    # a backward hook, or a forward hook that is not slimgrad's own
    return (
        bool(m._backward_hooks or m._backward_pre_hooks)
        or foreign(m._forward_hooks)
        or foreign(m._forward_pre_hooks)
    )


class GPT2BlockForward(InstanceForward):
    """The ``forward`` ``convert_`` puts on an HF ``GPT2Block`` instance (NOTE [GPT-2's block
    with its LayerNorms folded])."""

    # class defaults: an instance pickled before these were stored (transformers 5.23's names)
    args = (
        "hidden_states",
        "past_key_values",
        "attention_mask",
        "encoder_hidden_states",
        "encoder_attention_mask",
        "use_cache",
    )
    cache_name = "past_key_values"
    other_cache_names = ("cache",)

    def __init__(self, module: nn.Module, args: tuple[str, ...], other_cache_names) -> None:
        super().__init__(module)
        # NOTE [GPT-2's block, recognised by structure and signature]: decided at convert_
        self.args = args
        self.cache_name = args[1]
        self.other_cache_names = tuple(other_cache_names)

    def __call__(self, *args, **kwargs):
        m = self.module
        # compiling() before anything else: Dynamo folds it and traces HF's forward alone, with
        # no guard on what the checks below would read
        if compiling():
            return type(m).forward(m, *args, **kwargs)
        mods = m._modules
        ln_1, attn = mods.get("ln_1"), mods.get("attn")
        ln_2, mlp = mods.get("ln_2"), mods.get("mlp")
        LayerNorm, GPT2MLP, AttnForward, conv1d_forward, ga, mo, norm_shape = (
            _DEPS if _DEPS else _deps()
        )
        if not (
            1 <= len(args) <= 6
            # HF's gradient checkpointing wraps the class's forward (transformers'
            # GradientCheckpointingLayer): that forward checkpoints the per-op block
            and not (m.training and getattr(m, "gradient_checkpointing", False))
            and type(ln_1) is LayerNorm
            and type(ln_2) is LayerNorm
            and type(mlp) is GPT2MLP
            and attn is not None
            and type(attn.__dict__.get("forward")) is AttnForward
            and ln_1.keep_y
            and ln_2.keep_y
            and ln_1._compiled_call_impl is None  # Module.compile(): its own call
            and attn._compiled_call_impl is None
            and ln_2._compiled_call_impl is None
            and mlp._compiled_call_impl is None
            and "forward" not in ln_1.__dict__
            and "forward" not in ln_2.__dict__
            and "forward" not in mlp.__dict__
            # a hook of their own or a global module hook (slimgrad's observers, such as
            # slimgrad.memory's, do not count: NOTE [Forward hooks on an output-saving module])
            and not (
                (
                    ln_1._forward_hooks
                    or ln_1._forward_pre_hooks
                    or ln_1._backward_hooks
                    or ln_1._backward_pre_hooks
                    or attn._forward_hooks
                    or attn._forward_pre_hooks
                    or attn._backward_hooks
                    or attn._backward_pre_hooks
                    or ln_2._forward_hooks
                    or ln_2._forward_pre_hooks
                    or ln_2._backward_hooks
                    or ln_2._backward_pre_hooks
                    or mlp._forward_hooks
                    or mlp._forward_pre_hooks
                    or mlp._backward_hooks
                    or mlp._backward_pre_hooks
                )
                and (_watched(ln_1) or _watched(attn) or _watched(ln_2) or _watched(mlp))
            )
            and not (
                (
                    _module._global_forward_hooks
                    or _module._global_forward_pre_hooks
                    or _module._global_backward_hooks
                    or _module._global_backward_pre_hooks
                )
                and global_hooks_act()
            )
        ):
            return type(m).forward(m, *args, **kwargs)
        # HF's signature: (hidden_states, <cache>=None, attention_mask=None,
        # encoder_hidden_states=None, encoder_attention_mask=None, use_cache=False, **kwargs),
        # the cache's name and the order read at convert_ (NOTE [GPT-2's block, recognised by
        # structure and signature])
        names = self.args
        named = dict(zip(names, args, strict=False))
        rest = kwargs
        if kwargs:
            for k in self.other_cache_names:  # a deprecated spelling: HF's decorator renames it
                if k in kwargs:
                    return type(m).forward(m, *args, **kwargs)
            rest = dict(kwargs)
            for k in names:
                if k in rest:
                    if k in named:  # given twice: HF's forward raises its TypeError
                        return type(m).forward(m, *args, **kwargs)
                    named[k] = rest.pop(k)
        if named.get("encoder_hidden_states") is not None:  # cross-attention: HF's forward
            return type(m).forward(m, *args, **kwargs)
        hidden_states = named["hidden_states"]
        af = attn.__dict__["forward"]
        # HF's call of the attention: encoder_attention_mask is the cross-attention's only; the
        # cache under the attention's own name (NOTE [GPT-2's cache keyword] in hf_attention.py)
        attn_kwargs = {
            af.cache_name: named.get(self.cache_name),
            "attention_mask": named.get("attention_mask"),
            "use_cache": named.get("use_cache", False),
            **rest,
        }
        residual = hidden_states
        if af.straight((hidden_states,), attn_kwargs, hidden_states):
            c_attn = attn._modules["c_attn"]
            lp, cp = ln_1._parameters, c_attn._parameters
            lw, lb, w, b = lp.get("weight"), lp.get("bias"), cp.get("weight"), cp.get("bias")
            if (
                type(c_attn).forward is conv1d_forward
                and "forward" not in c_attn.__dict__
                and c_attn._compiled_call_impl is None
                and not (
                    (
                        c_attn._forward_hooks
                        or c_attn._forward_pre_hooks
                        or c_attn._backward_hooks
                        or c_attn._backward_pre_hooks
                    )
                    and _watched(c_attn)
                )
                and ga.ln_conv1d_ok(hidden_states, w, b)
                and mo.ln_ok(hidden_states, lw, lb)
            ):
                # c_attn's output is not named here: HF's forward drops it after the head split
                eps, kept = float(ln_1.eps), ln_1.y_kept_after
                attn_output = af.after_c_attn(
                    ga.ln_conv1d(hidden_states, lw, lb, norm_shape(ln_1), eps, kept, w, b),
                    attn_kwargs,
                )[0]
            else:
                attn_output = af.after_c_attn(c_attn(ln_1(hidden_states)), attn_kwargs)[0]
        else:
            attn_output, _ = attn(ln_1(hidden_states), **attn_kwargs)
        # residual connection
        hidden_states = attn_output + residual
        residual = hidden_states
        ff = mlp.forward_after_norm(ln_2, hidden_states)
        if ff is None:
            ff = mlp(ln_2(hidden_states))
        # residual connection
        return residual + ff


_DEPS: list = []


def _deps():
    # imported at the first call (slimgrad.nn imports convert_handlers), then read from the list
    from slimgrad.convert_handlers.hf_attention import GPT2AttentionForward
    from slimgrad.nn import gpt2_mlp, layer_norm, linear
    from slimgrad.ops import gpt2_attention
    from slimgrad.ops import gpt2_mlp as gpt2_mlp_ops

    _DEPS[:] = [
        layer_norm.LayerNorm,
        gpt2_mlp.GPT2MLP,
        GPT2AttentionForward,
        linear.Conv1D.forward,
        gpt2_attention,
        gpt2_mlp_ops,
        gpt2_mlp.norm_shape,
    ]
    return _DEPS


# NOTE [GPT-2's block, recognised by structure and signature]
# :class:`GPT2BlockForward` runs HF's ``GPT2Block.forward`` for a pre-LN self-attention block:
# ``x + attn(ln_1(x))``, then ``h + mlp(ln_2(h))``, with a cross-attention step between them only
# when ``encoder_hidden_states`` is given. Whether a release's block is that one is decided once,
# when :func:`gpt2_block_forwards_` puts the forward on, from facts that survive cosmetic
# releases, never from source text, bytecode or frames:
#
# - the signature of the forward under its decorators (``inspect.unwrap``): ``self``, then
#   ``hidden_states``, the KV cache under one of the known cache names (NOTE [GPT-2's cache
#   keyword] in hf_attention.py; the attention's own, as the block passes it on by keyword),
#   ``attention_mask``, ``encoder_hidden_states``, ``encoder_attention_mask`` and ``use_cache``,
#   positional-or-keyword in that order with the defaults ``None`` (four) and ``False``, then
#   ``**kwargs``. The positional order is stored on the forward (``args``) and binds each call;
# - the forward's wrapper layers at run time (``functools.wraps``' ``__wrapped__`` chain), each
#   recognised by its code object: the checkpointing wrapper transformers'
#   ``GradientCheckpointingLayer`` puts around its subclasses' forwards (it checkpoints only with
#   HF's gradient checkpointing on, when the call runs HF's forward, see above) and
#   ``@deprecate_kwarg``'s (NOTE [Decorators that do not change the computation] in hf.py), which
#   only renames a deprecated keyword before HF's body runs: a call that passes another of the
#   known cache names (a deprecated spelling) runs HF's forward, whose decorator renames it. Any
#   other layer keeps HF's forward;
# - the block's structure: its children are exactly ``ln_1``, ``attn``, ``ln_2`` and ``mlp`` (no
#   ``crossattention``, no child a release added), the class's forward is HF's (no subclass
#   override, no patched instance forward), and the attention has its GPT2AttentionForward.
#
# transformers 5.23 (``past_key_values``, undecorated) and 5.24 (``cache`` behind
# ``@deprecate_kwarg("past_key_values", ..., new_name="cache")``) both match. A release that adds
# or drops a parameter, moves one, changes a default or adds a child keeps HF's forward (the
# results are HF's; only the two folds are off). tests/ops/test_gpt2_block.py compares the folded
# blocks with the per-op ones bit for bit (values, gradients, dropout masks, bytes) under each
# declared transformers release (``make test-hf-newest`` runs it under the newest).
_CHILDREN = frozenset({"ln_1", "attn", "ln_2", "mlp"})
_AFTER_CACHE = (
    ("attention_mask", None),
    ("encoder_hidden_states", None),
    ("encoder_attention_mask", None),
    ("use_cache", False),
)


@cache
def _wrapper_codes() -> frozenset:
    # the code objects of the wrapper layers a GPT-2 block forward may have: @deprecate_kwarg's
    # (hf.py's probe) and the one transformers' GradientCheckpointingLayer puts around every
    # subclass's forward, learnt from a subclass of its own
    from slimgrad.convert_handlers.hf import _known_decorators

    codes = {c for _, kind, c in _known_decorators().values() if kind == "rename_kwarg"}
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return frozenset(codes)

    class _Probe(GradientCheckpointingLayer):
        def forward(self, x):
            return x

    if hasattr(_Probe.forward, "__wrapped__"):  # the class's forward, wrapped (transformers 5.x)
        codes.add(_Probe.forward.__code__)
    return frozenset(codes)


def _block_args(fn, cache_name: str) -> tuple[str, ...] | None:
    # NOTE [GPT-2's block, recognised by structure and signature]: the positional names of HF's
    # block forward ``fn`` after self, or None where it is not the block GPT2BlockForward runs
    known = _wrapper_codes()
    f = fn
    while hasattr(f, "__wrapped__"):
        if getattr(f, "__code__", None) not in known:
            return None
        f = f.__wrapped__
    try:
        params = list(inspect.signature(f).parameters.values())
    except (TypeError, ValueError):
        return None
    want = (("self", P.empty), ("hidden_states", P.empty), (cache_name, None), *_AFTER_CACHE)
    if len(params) != len(want) + 1 or params[-1].kind is not P.VAR_KEYWORD:
        return None
    for p, (name, default) in zip(params, want, strict=False):
        if p.kind is not P.POSITIONAL_OR_KEYWORD or p.name != name or p.default is not default:
            return None
    return tuple(p.name for p in params[1:-1])


def gpt2_block_forwards_(model: nn.Module, skip: frozenset | set = frozenset()) -> list[str]:
    """Put :class:`GPT2BlockForward` on ``model``'s HF ``GPT2Block``s whose attention has a
    ``GPT2AttentionForward`` (NOTE [GPT-2's block with its LayerNorms folded]), except those named
    in ``skip`` (left alone by ``convert_``'s filter); returns their names."""
    from slimgrad.convert_handlers.hf_attention import GPT2AttentionForward

    hf = sys.modules.get("transformers.models.gpt2.modeling_gpt2")
    stock = getattr(getattr(hf, "GPT2Block", None), "forward", None)
    if stock is None:
        return []
    names = []
    for name, m in model.named_modules():
        attn = getattr(m, "_modules", {}).get("attn")
        af = attn.__dict__.get("forward") if attn is not None else None
        if (
            name not in skip
            and isinstance(m, hf.GPT2Block)
            and type(m).forward is stock
            and "forward" not in m.__dict__
            and m._modules.keys() == _CHILDREN
            and type(af) is GPT2AttentionForward
            and (args := _block_args(stock, af.cache_name)) is not None
        ):
            m.forward = GPT2BlockForward(m, args, af.other_cache_names)
            names.append(name)
    return names
