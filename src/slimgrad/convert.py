"""``convert_``: make an existing model keep less for backward, in place, with the same gradients.

``convert_(model)`` walks the model's module tree and swaps module *instances* for slimgrad modules
that compute the same function and keep less for backward. Parameters and buffers are shared, not
copied, so ``state_dict`` keys and values are unchanged and checkpoints load both ways. Classes and
functions of torch and of other libraries (HF transformers) are never rebound.

Two tables drive it:

- ``_TABLE``: ``{qualified class name: (technique, handler)}``. A handler takes the module and
  returns its slimgrad replacement (usually ``slimgrad.nn.<Cls>.from_torch``), or raises
  ``NotImplementedError`` with the reason it cannot convert that instance (the reason goes into the
  report). Keys are class names so that HF and timm classes need no import of their library. A
  module whose class is not a key but subclasses one converts only when it computes what that
  class computes (NOTE [Subclasses convert by what they compute]).
- ``_PATTERNS``: patterns that need neighbours (BatchNorm followed by an activation; an LM head
  followed by the loss). They decide first, on the whole model; nothing is swapped until
  every decision is made.

``ConvertConfig`` selects techniques by name: exact ones are on by default; ones that change the
model's function (e.g. BatchNorm + ReLU -> InPlaceABN with leaky_relu) only when asked.

Every technique also passes the device rule (``convert_handlers/device_rule.py``, NOTE [Never more
than eager, per device and dtype]): a replacement is chosen only on the devices and dtypes where
it keeps no more than eager's kernel keeps there (HF SDPA attention stays SDPA on CUDA, where
eager's fused kernels keep O(T) per row). ``convert_(model, device="cuda")`` decides for a model
that will be moved to CUDA later; by default it decides for the devices of the model's tensors.

Stages (``convert_`` runs them in this order; each fact is computed once, where named):

1. ``analyse`` -> ``ModelFacts``: the device rule's targets, whether the model is an HF one (and
   the transformers version check), the features this installation lacks. (The opt-in
   Sequential BN + act fusion, ``ConvertConfig.inplace_abn``, swaps as it decides and runs here,
   before the model is read: ``slimgrad/nn/inplace_abn.py``.)
2. ``ModelFacts.read_modules``: the in-place guard's reading of the structure (which modules an
   in-place write follows), then per module its table entry, the subclass rule's reason, a
   parametrized weight and the guard's reason (``ModuleFacts``). It reads the model before
   anything is swapped: what the guard sees is the model the user wrote. Its torch.fx traces,
   one per forward and mode, are kept (``Structure.traces``) for the later readings (NOTE [One
   reading of the structure per convert_] in ``convert_handlers/inplace_guard.py``).
3. ``decide_patterns`` -> ``Decision``s (``convert_handlers/decision.py``): the neighbour
   patterns (``_PATTERNS``): BatchNorm's neighbours (``abn``, ``cnn``), HF attention's config and
   forward templates (``hf_attention``, analysed once per model), the LM head and loss template
   (``hf_loss``). Each reads the structure once (``Structure``: names, places) and sees what the
   earlier ones decided (``Structure.claimed``); a replacement is built now, a change where a
   module stands (an HF model's configs and forward) is a ``patch``.
4. ``decide`` -> ``Decision``s: per place that holds a module, its replacement (the handler
   builds it, sharing state, changing nothing) or why it stays, from the facts, the config,
   ``filter_fn`` and the device rule; a module a pattern claimed takes that replacement at every
   place. ``plan=`` enters here as a filter: its eager blocks are skipped like ``filter_fn``'s,
   and ``slimgrad.plan.apply_choices`` then wraps the recomputed blocks' forwards.
5. ``apply`` swaps the replacements in (the table's take over the hooks), then runs the patches;
   ``record`` writes the report's rows from the decisions, the patterns' first.
6. What needs the converted structure: ownership's statements of fresh inputs
   (``ownership.state_inputs_``), which outputs are kept or are the model's output
   (``nn._output_act.state_consumers_``: the in-place guard's code asked about the converted
   model, from stage 2's traces mapped through the swaps; a module the swaps made is read from
   the structure its class states, and a kept one is traced again only where its forward reads
   a child other than by calling it and a module below it was swapped), then the modules left
   alone (``_left_alone``, from the report's rows and the module facts).
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

import slimgrad.nn as snn
from slimgrad import _compat, ownership
from slimgrad import revert as _revert
from slimgrad._dtensor import fully_sharded
from slimgrad.convert_handlers import accelerate_hooks as _accelerate_hooks
from slimgrad.convert_handlers import cnn as _cnn
from slimgrad.convert_handlers import device_rule as _device_rule
from slimgrad.convert_handlers import hf as _hf
from slimgrad.convert_handlers import hf_attention as _hf_attention
from slimgrad.convert_handlers import hf_loss as _hf_loss
from slimgrad.convert_handlers import hf_mlp as _hf_mlp
from slimgrad.convert_handlers import hf_moe as _hf_moe
from slimgrad.convert_handlers import inplace_guard as _inplace_guard
from slimgrad.convert_handlers import linear as _linear
from slimgrad.convert_handlers import parametrized as _parametrized
from slimgrad.convert_handlers import timm as _timm
from slimgrad.convert_handlers import timm_blocks as _timm_blocks
from slimgrad.convert_handlers.decision import Decision, Structure
from slimgrad.kernels import _backend
from slimgrad.nn import _output_act as _nn_output_act
from slimgrad.nn.conv import mark_bias_before_batch_norm_ as _mark_bias_before_batch_norm_
from slimgrad.nn.hardsigmoid import Hardsigmoid as _Hardsigmoid
from slimgrad.nn.hardswish import Hardswish as _Hardswish
from slimgrad.nn.inplace_abn import convert_sequential_bn_act_

__all__ = ["ConvertConfig", "ConvertReport", "convert_", "report"]


@dataclass(frozen=True)
class ConvertConfig:
    """Which techniques ``convert_`` applies. Exact ones default to on.

    Attributes:
        activations: activations whose backward works from their output (+ 1 bit/elt for GELU/SiLU).
        norms: LayerNorm/RMSNorm/GroupNorm that keep their output and per-row statistics.
        dropout: dropout that keeps a 1-bit mask.
        selective_saving: convolutions keep only what the requested gradients need (a frozen
            weight keeps no input), or the BatchNorm output they are derived from.
        batch_norm: BatchNorm followed by an activation keeps one tensor per block (exact).
        fused_loss: LM head + cross-entropy fused and chunked (HF causal and masked LMs whose
            forward is a known transformers template; others are reported skipped).
        fast_loss: the fused loss computes its gradients in forward: 3 matmuls like eager instead
            of 4, but keeps a parameter-sized dW from forward to backward (speed over memory).
        keep_logits: with the fused loss, a training forward with labels also returns the logits
            (computed without autograd history, so nothing extra is kept for backward; costs the
            B x T x V logits' memory and one more head matmul; a loss that differentiates them
            raises in backward). Off: ``logits`` is None in training with labels. Eval and
            no_grad forwards always return logits, as HF does.
        inplace_abn: BatchNorm + ReLU becomes InPlaceABN with leaky_relu, and in an
            ``nn.Sequential`` BatchNorm + LeakyReLU/ELU/Identity fuse into one InPlaceABN (the BN
            slot then returns BN + activation). Changes the model's function: off by default.
        leaky_relu_slope: the slope ``inplace_abn`` uses.
    """

    activations: bool = True
    norms: bool = True
    dropout: bool = True
    selective_saving: bool = True
    batch_norm: bool = True
    fused_loss: bool = True
    fast_loss: bool = False
    keep_logits: bool = False
    inplace_abn: bool = False
    leaky_relu_slope: float = 0.01

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type in ("bool", bool) and not isinstance(v, bool):
                raise TypeError(
                    f"slimgrad.ConvertConfig: {f.name} must be a bool; expected True or False, got "
                    f"{v!r}. Pass {f.name}=True or {f.name}=False."
                )
        if not self.leaky_relu_slope > 0:
            raise ValueError(
                "slimgrad.ConvertConfig: leaky_relu_slope must be positive (InPlaceABN inverts the "
                f"activation); expected > 0, got {self.leaky_relu_slope}. Use e.g. 0.01."
            )


@dataclass
class ConvertReport:
    """What ``convert_`` changed and what it left, with reasons.

    ``str(report)`` groups each list by type and reason, one line per group with its count and
    the first few module names (the lists themselves keep every module).
    """

    converted: list[tuple[str, str, str]] = field(default_factory=list)  # (name, from, to)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)  # (name, type, reason)
    # (device type, dtype or None) pairs the device rule decided for
    targets: tuple[tuple[str, object], ...] = (("cpu", None),)
    # (model class, technique, reason): refusals of a family slimgrad claims, for its code
    # (NOTE [A refused known family is loud] in convert_handlers/hf.py); convert_ warns once
    refused_known: list[tuple[str, str, str]] = field(default_factory=list)
    # (name, type, reason): every module with parameters (or state_dict float buffers) that
    # stays as it was, outside converted modules (NOTE [Coverage in the report])
    left_alone: list[tuple[str, str, str]] = field(default_factory=list)
    # (feature, why): capabilities this installation lacks (slimgrad._compat.features_off), e.g.
    # buffer reuse without a compiler for the ownership extension; ``slimgrad env`` lists all
    features_off: list[tuple[str, str]] = field(default_factory=list)
    # (name, type, reason): converted modules that run eager's op because their output may be the
    # model's output (NOTE [Modules whose output is the model's output] in
    # convert_handlers/inplace_guard.py)
    eager_op: list[tuple[str, str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        where = ", ".join(
            f"{d} {str(t).removeprefix('torch.')}" if t is not None else d for d, t in self.targets
        )
        lines = [
            f"converted {len(self.converted)} modules, skipped {len(self.skipped)} "
            f"(decided for {where})"
        ]
        lines += [f"  + {a}{names} -> {b}" for (a, b), names in _grouped(self.converted)]
        lines += [f"  ~ {t}{names}: {r}" for (t, r), names in _grouped(self.eager_op)]
        # a skipped module with parameters is told once, under "left alone"
        left = set(self.left_alone)
        rest = [s for s in self.skipped if s not in left]
        lines += [f"  - {t}{names}: {r}" for (t, r), names in _grouped(rest)]
        if self.left_alone:
            types = {t for _, t, _ in self.left_alone}
            n, k = len(self.left_alone), len(types)
            lines.append(
                f"left alone (they run as before): {n} module{'s' * (n != 1)} with parameters or "
                f"buffers, of {k} type{'s' * (k != 1)}"
            )
            lines += [f"  = {t}{names}: {r}" for (t, r), names in _grouped(self.left_alone)]
        if self.features_off:
            lines.append("off in this installation (see `slimgrad env`):")
            lines += [f"  ! {name}: {why}" for name, why in self.features_off]
        return "\n".join(lines)


_NAMES_SHOWN = 3


def _grouped(rows: list[tuple[str, str, str]]) -> list[tuple[tuple[str, str], str]]:
    # rows (name, a, b) -> [((a, b), " x<count> (first names, +k more)")], in first-seen order
    groups: dict[tuple[str, str], list[str]] = {}
    for name, a, b in rows:
        groups.setdefault((a, b), []).append(name or "<root>")
    out = []
    for key, names in groups.items():
        shown = ", ".join(names[:_NAMES_SHOWN])
        more = f", +{len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
        out.append((key, f" x{len(names)} ({shown}{more})"))
    return out


Handler = Callable[[nn.Module], nn.Module]
# a neighbour pattern: (model, config, filter_fn, the structure as the earlier patterns leave it)
# -> its decisions; it changes nothing (``apply`` does)
Pattern = Callable[[nn.Module, ConvertConfig, Callable, Structure], list[Decision]]


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# {qualified class name: (ConvertConfig field, handler)}. One line per op; see the module docstring.
_TABLE: dict[str, tuple[str, Handler]] = {
    # activations that keep their output (+ 1 bit/elt for the smooth ones)
    "torch.nn.modules.activation.ReLU": ("activations", snn.ReLU.from_torch),
    "torch.nn.modules.activation.Sigmoid": ("activations", snn.Sigmoid.from_torch),
    "torch.nn.modules.activation.Tanh": ("activations", snn.Tanh.from_torch),
    "torch.nn.modules.activation.Hardtanh": ("activations", snn.Hardtanh.from_torch),
    "torch.nn.modules.activation.ReLU6": ("activations", snn.ReLU6.from_torch),
    "torch.nn.modules.activation.LeakyReLU": ("activations", snn.LeakyReLU.from_torch),
    "torch.nn.modules.activation.ELU": ("activations", snn.ELU.from_torch),
    "torch.nn.modules.activation.GELU": ("activations", snn.GELU.from_torch),
    "torch.nn.modules.activation.SiLU": ("activations", snn.SiLU.from_torch),
    "torch.nn.modules.activation.Mish": ("activations", snn.Mish.from_torch),
    "torch.nn.modules.activation.Hardswish": ("activations", _Hardswish.from_torch),
    "torch.nn.modules.activation.Hardsigmoid": ("activations", _Hardsigmoid.from_torch),
    "transformers.activations.GELUActivation": ("activations", snn.GELU.from_torch),
    "transformers.activations.NewGELUActivation": ("activations", snn.GELU.from_torch),
    "transformers.activations.FastGELUActivation": ("activations", snn.GELU.from_torch),
    "transformers.activations.GELUTanh": ("activations", snn.GELU.from_torch),
    "transformers.activations.PytorchGELUTanh": ("activations", snn.GELU.from_torch),
    "transformers.activations.SiLUActivation": ("activations", snn.SiLU.from_torch),
    "transformers.activations.MishActivation": ("activations", snn.Mish.from_torch),
    # norms that keep their output and per-row statistics
    "torch.nn.modules.normalization.LayerNorm": ("norms", snn.LayerNorm.from_torch),
    "torch.nn.modules.normalization.RMSNorm": ("norms", snn.RMSNorm.from_torch),
    "torch.nn.modules.normalization.GroupNorm": ("norms", snn.GroupNorm.from_torch),
    # HF modules by class name: RMSNorms (``convert_handlers.hf``), gated MLPs (``hf_mlp``)
    **_hf.TABLE,
    **_hf_mlp.TABLE,
    **_hf_moe.TABLE,  # MoE blocks with 3-D expert banks
    # timm's layers by class name: its LayerNorm/LayerNorm2d, GELU forms (``convert_handlers.timm``)
    **_timm.TABLE,
    **_timm_blocks.TABLE,  # timm blocks: ViT attention, ConvNeXt
    # dropout with a 1-bit mask
    "torch.nn.modules.dropout.Dropout": ("dropout", snn.Dropout.from_torch),
    # HF GPT-2's x @ W + b: keeps only what the requested gradients need, and hands the op before
    # it a plain (not view) gradient that it may reuse (NOTE [Gradient-buffer ownership])
    "transformers.pytorch_utils.Conv1D": ("selective_saving", snn.Conv1D.from_torch),
    # convolutions that keep only what the requested gradients need, BatchNorm from its output
    **{k: ("selective_saving" if t == "linear" else t, h) for k, (t, h) in _cnn.TABLE.items()},
    # plain nn.Linear (``convert_handlers.linear``)
    **_linear.TABLE,
}
# Patterns that need neighbours, in order: each decides from the model's structure as the earlier
# ones leave it (``Structure.claimed``); ``apply`` then makes every change.
_PATTERNS: list[tuple[str | None, Pattern]] = [
    ("inplace_abn", _cnn.inplace_abn_pattern),  # BN -> ReLU anywhere (fx): InPlaceABN(leaky_relu)
    ("batch_norm", _cnn.bn_act_pattern),  # BN next to ReLU/GELU/SiLU: keep the BN output only
    ("dropout", _hf_attention.attention_pattern),  # HF attention: keeps P + bits
    ("fused_loss", _hf_loss.lm_loss_pattern),  # HF LM head + loss: chunked, no logits kept
    *_hf_moe.PATTERNS,
    *_timm_blocks.PATTERNS,
]
# Opt-in (``inplace_abn``): Sequential BN + act slots fused into InPlaceABN + Identity. It swaps as
# it decides (``slimgrad/nn/inplace_abn.py``), so it runs before the model is read.
_SWAPPING_PASSES: list[tuple[str, Callable]] = [("inplace_abn", convert_sequential_bn_act_)]
# (the in-place guard is a reading of the model, not a technique: ``ModelFacts.read_modules`` runs
# it before the patterns decide, NOTE [In-place writers after output-saving modules])

_REPORTS: weakref.WeakKeyDictionary[nn.Module, ConvertReport] = weakref.WeakKeyDictionary()
_REPORT_ATTR = "_slimgrad_report"


def _report_of(model: nn.Module) -> ConvertReport | None:
    rep = _REPORTS.get(model)
    return rep if rep is not None else model.__dict__.get(_REPORT_ATTR)


def _is_slimgrad(module: nn.Module) -> bool:
    return type(module).__module__.startswith("slimgrad.")


# NOTE [Subclasses convert by what they compute]
# The table is keyed by exact class names, but models subclass torch's modules (timm's LayerNorm,
# a user's ``class MyGELU(nn.GELU): pass``). A module whose class is not a key converts with the
# handler of its nearest base class that is (its *parent*) only when the instance provably
# computes what the parent computes and holds what the parent holds:
#   - no class between it and the parent defines a method or property the parent also has
#     (``forward``, or a helper the parent's forward calls: ``_conv_forward``,
#     ``_check_input_dim``, ``__call__``, ...), nor a class attribute the parent has with another
#     value; and it adds no methods (the replacement is the parent's slimgrad class, so they would
#     be lost). Only construction and printing (``__init__``, ``extra_repr``, ``reset_parameters``,
#     class bookkeeping) may differ;
#   - the instance has no ``forward`` (or ``__call__``) of its own in its ``__dict__`` (a patched
#     or hook-like forward), which also holds for exact table classes;
#   - the replacement has the same parameters, buffers and children by name as the instance
#     (nothing extra that the parent's forward would not read and state_dict would lose).
# Otherwise the module stays as it is (its children are still visited) and the report says why.
# A known variant with its own forward (timm's LayerNorm, LayerNorm2d) is a key of its own, with a
# handler that checks the instance's options; its subclasses then follow the same rule with it as
# the parent. Classes are never rebound: the parent's handler sees the instance through
# ``_as_parent``, a shallow copy typed as the parent (the same Parameters, buffers and hooks).
_SAME_IN_SUBCLASS = frozenset(
    {
        "__init__",
        "__module__",
        "__qualname__",
        "__doc__",
        "__dict__",
        "__weakref__",
        "__annotations__",
        "__annotate__",
        "__firstlineno__",
        "__static_attributes__",
        "__orig_bases__",
        "__parameters__",
        "__slotnames__",
        "_is_protocol",
        "extra_repr",
        "reset_parameters",
    }
)


def _own_forward(module: nn.Module) -> str | None:
    # an accelerate hook's wrapper is carried to the replacement (NOTE [A replacement carries
    # accelerate's hook] in convert_handlers/accelerate_hooks.py), or refused with its reason
    if _accelerate_hooks.hook_wrapper(module.__dict__.get("forward"), module) is not None:
        return _accelerate_hooks.carried_reason(module)
    for name in ("forward", "__call__"):
        if name in module.__dict__:
            return (
                f"its {name} is replaced on the instance (a patched or hook-like {name}); expected "
                f"the class's {name}, got an instance attribute. Register a forward hook instead"
            )
    return None


def _subclass_reason(cls: type, parent: type) -> str | None:
    # Why instances of ``cls`` (a subclass of table class ``parent``) may not compute what
    # ``parent`` computes, or None (NOTE [Subclasses convert by what they compute]).
    pname = _qualname(parent)
    for klass in cls.__mro__[: cls.__mro__.index(parent)]:
        for name, val in vars(klass).items():
            if name in _SAME_IN_SUBCLASS:
                continue
            fn = getattr(val, "__func__", val)
            is_code = callable(fn) or isinstance(val, property)
            if hasattr(parent, name):
                if name == "forward":
                    return (
                        f"{_qualname(klass)} overrides forward; expected {pname}.forward (a "
                        "subclass converts only when its forward is its parent's), got its own"
                    )
                if is_code:
                    return (
                        f"{_qualname(klass)} overrides {name}, which {pname}'s forward may call; "
                        f"expected {pname}.{name}, got its own"
                    )
                if val is not getattr(parent, name) and val != getattr(parent, name):
                    return (
                        f"{_qualname(klass)} sets class attribute {name}; expected {pname}'s "
                        f"value, got {val!r}"
                    )
            elif is_code:
                return (
                    f"{_qualname(klass)} adds method {name}, which the converted module (a "
                    f"{pname} replacement) would not have; expected only {pname}'s methods"
                )
    return None


def _state_names(m: nn.Module) -> tuple[set[str], set[str], set[str]]:
    return set(m._parameters), set(m._buffers), set(m._modules)


def _state_reason(old: nn.Module, new: nn.Module, parent: type) -> str | None:
    kinds = ("parameter", "buffer", "submodule")
    for what, a, b in zip(kinds, _state_names(old), _state_names(new), strict=True):
        if a != b:
            return (
                f"has {what}s {sorted(a)} and its {_qualname(parent)} replacement {sorted(b)}; "
                "expected the parent's state (state_dict keys would change)"
            )
    return None


def _as_parent(module: nn.Module, parent: type) -> nn.Module:
    # The instance seen as its table parent: same attributes (Parameters, buffers, hook dicts
    # shared), so the parent's handler and its exact-type checks apply; ``module`` is unchanged.
    view = parent.__new__(parent)
    view.__dict__.update(module.__dict__)
    return view


def _lookup(module: nn.Module) -> tuple[tuple[str, Handler] | None, type | None, str | None]:
    # (table entry, parent class if found through a base class, reason not to convert)
    cls = type(module)
    entry = _TABLE.get(_qualname(cls))
    if entry is not None:
        return entry, None, _own_forward(module)
    for base in cls.__mro__[1:]:
        entry = _TABLE.get(_qualname(base))
        if entry is not None:
            return entry, base, _own_forward(module) or _subclass_reason(cls, base)
    return None, None, None


def table_handler(module: nn.Module) -> tuple[str, Handler] | tuple[None, str | None]:
    """``(technique, handler)`` that converts ``module`` by what it computes, or ``(None, reason)``
    (reason None: no table class is among its bases). A subclass's handler checks the
    replacement's state too (NOTE [Subclasses convert by what they compute])."""
    entry, parent, reason = _lookup(module)
    if entry is None:
        return None, None
    if reason is not None:
        return None, reason
    technique, handler = entry
    if _accelerate_hooks.carries(module):  # the hook finds tensors by name in the replacement
        handler = _checked_names(handler)
    if parent is None:
        return technique, handler

    def convert(m: nn.Module) -> nn.Module:
        new = handler(_as_parent(m, parent))
        if (bad := _state_reason(m, new, parent)) is not None:
            raise NotImplementedError(bad)
        for k, v in m.__dict__.items():  # the subclass's own settings (read by user code only)
            if not k.startswith("_") and k not in new.__dict__:
                new.__dict__[k] = v
        return new

    return technique, convert


def _checked_names(handler: Handler) -> Handler:
    def convert(m: nn.Module) -> nn.Module:
        new = handler(m)
        if (bad := _accelerate_hooks.state_reason(m, new)) is not None:
            raise NotImplementedError(bad)
        return new

    return convert


def convert_(
    model: nn.Module,
    config: ConvertConfig | None = None,
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    plan: Any = None,
) -> nn.Module:
    """Swap the modules of ``model`` for slimgrad modules that keep less for backward, in place.

    Args:
        model: the model to convert (changed in place; Parameters and buffers are shared).
        config: which techniques to apply; ``ConvertConfig()`` (exact techniques only) by default.
        filter_fn: ``filter_fn(module, qualified_name) -> bool``; modules for which it returns False
            are left unchanged (reported as skipped).
        device: the device the model will train on, for the device rule (NOTE [Never more than
            eager, per device and dtype]); by default the devices of its parameters and buffers.
            Pass ``device="cuda"`` when converting on CPU a model that will then move to CUDA, so
            the report says what runs there (the attention checks the device again at call time).
        dtype: the floating dtype it will train in (e.g. the autocast dtype); by default those of
            its floating parameters and buffers.
        plan: a :class:`slimgrad.plan.Plan` (from :func:`slimgrad.plan`): its blocks are left
            eager, converted, or recomputed in backward as it says (by module name, so a plan
            made for a config applies to any model built from it); the rest converts as usual.

    Returns:
        ``model`` itself. ``slimgrad.report(model)`` tells what was converted and what was skipped,
        and why, and names every module with parameters it left alone (NOTE [Coverage in the
        report]).

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``config`` is not a ``ConvertConfig``.
        RuntimeError: FSDP2's ``fully_shard`` was applied to ``model`` or a module in it already
            (convert first, then shard: NOTE [Convert before fully_shard] in slimgrad/_dtensor.py).
        RuntimeError: an accelerate hook would run a module on ``meta`` (its execution device is
            meta: NOTE [The device a module runs on] in convert_handlers/accelerate_hooks.py).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        >>> slimgrad.convert_(model)  # doctest: +SKIP
        >>> print(slimgrad.report(model))  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"slimgrad.convert_: model must be a torch.nn.Module; expected nn.Module, got "
            f"{type(model).__name__}. Pass the model instance."
        )
    if config is None:
        config = ConvertConfig()
    if not isinstance(config, ConvertConfig):
        raise TypeError(
            "slimgrad.convert_: config must be a slimgrad.ConvertConfig; expected "
            f"ConvertConfig, got {type(config).__name__}. Build one with "
            "slimgrad.ConvertConfig(...)."
        )
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(
            "slimgrad.convert_: dtype must be a floating torch.dtype; expected e.g. "
            f"torch.bfloat16, got {dtype!r}. Pass dtype=torch.float32 or leave it out."
        )
    if (sharded := fully_sharded(model)) is not None:  # NOTE [Convert before fully_shard]
        what = f"module {sharded!r}" if sharded else "the model itself"
        raise RuntimeError(
            "slimgrad.convert_: the model is already sharded by FSDP2's fully_shard "
            f"({what}); expected a model before fully_shard, got one after. Call "
            "slimgrad.convert_(model) first, then fully_shard its blocks and the root."
        )
    if on_meta := _accelerate_hooks.on_meta(model):  # NOTE [The device a module runs on]
        name, m, by = on_meta[0]
        rest = [repr(n) for n, _, _ in on_meta[1:4]] + ["..."] * (len(on_meta) > 4)
        more = f" (and {', '.join(rest)})" if rest else ""
        how = (
            "its accelerate hook's execution device is meta"
            if by == name
            else f"the accelerate hook of {by or '(the model)'!r} places its submodules on meta"
        )
        raise RuntimeError(
            f"slimgrad.convert_: module {name or '(the model)'!r} ({type(m).__name__}){more} "
            f"would run on meta: {how}, which holds no data; expected an execution device that "
            "holds data (cpu, cuda, ...), got meta. Map it to 'cpu', 'disk' or an accelerator in "
            "the device_map (not 'meta'), before convert_."
        )
    try:
        where = _device_rule.targets(model, device, dtype)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"slimgrad.convert_: device must name a torch device; expected e.g. 'cuda' or 'cpu', "
            f"got {device!r} ({e}). Pass device='cuda' or leave it out."
        ) from None
    # NOTE [What convert_ records for revert_] in slimgrad/revert.py
    with _revert.recording(model):
        if plan is not None:
            return _apply_plan(model, plan, config, filter_fn, device, dtype)
        allowed = filter_fn if filter_fn is not None else (lambda m, n: True)
        facts = analyse(model, where)
        rep = ConvertReport(targets=facts.targets, features_off=list(facts.features_off))
        for technique, swapping in _SWAPPING_PASSES:
            if getattr(config, technique):
                if (why := _device_rule.refuse(technique, where)) is not None:
                    rep.skipped.append(("", f"{technique} pass", why))
                else:
                    swapping(model, config, allowed, rep)
        facts.read_modules()  # the structure every decision reads, before anything is swapped
        decisions = decide_patterns(model, config, allowed, facts)
        decisions += decide(model, config, allowed, facts)
        apply(decisions)
        record(decisions, rep)
        # NOTE [A conv bias gradient after dx from the output] in ops/batch_norm.py
        _mark_bias_before_batch_norm_(model)
        ownership.state_inputs_(model)  # NOTE [Forward ownership from stated structure]
        # NOTE [Keep y only where its consumer keeps it]; the traces read before the swaps
        _nn_output_act.state_consumers_(model, rep, traces=facts.structure.traces)
        rep.left_alone = _left_alone(model, rep, facts)
        _REPORTS[model] = rep
        # a copy of the model (deepcopy, pickle, torch.save/load) carries its report along
        model.__dict__[_REPORT_ATTR] = rep
        if rep.refused_known:
            _warn_refused_known(rep.refused_known)
    _backend.resolve_now()  # traced code reads the name set (NOTE [Kernel backend choice])
    # NOTE [The attention ops' FLOPs for FlopCounterMode] in ops/softmax_dropout.py
    from slimgrad.ops.softmax_dropout import register_flop_formulas

    register_flop_formulas()
    return model


def _apply_plan(model, plan, config, filter_fn, device, dtype) -> nn.Module:
    from slimgrad.plan import Plan, apply_choices

    if not isinstance(plan, Plan):
        raise TypeError(
            "slimgrad.convert_: plan must be a slimgrad.plan.Plan; expected the result of "
            f"slimgrad.plan(...), got {type(plan).__name__}. Make one with slimgrad.plan."
        )
    if getattr(model, "_slimgrad_plan", None) is not None:
        raise RuntimeError(
            "slimgrad.convert_: this model already has a plan applied; expected a model built "
            "afresh, got one converted with plan= before. Build a new model and apply the plan."
        )
    return apply_choices(
        model, plan.choices, config=config, filter_fn=filter_fn, device=device, dtype=dtype
    )


def _is_hf_model(model: nn.Module) -> bool:
    # without importing transformers: a model built with it has it loaded already
    hf = sys.modules.get("transformers")
    base = getattr(hf, "PreTrainedModel", None) if hf is not None else None
    return isinstance(base, type) and any(isinstance(m, base) for m in model.modules())


_TECHNIQUE_NAMES = {
    "fused_loss": "the fused LM-head loss (ConvertConfig.fused_loss)",
    "attention": "the slimgrad attention for 'sdpa' (ConvertConfig.dropout)",
    "attention_eager": "the slimgrad attention for 'eager' (ConvertConfig.dropout)",
}


def _warn_refused_known(refused: list[tuple[str, str, str]]) -> None:
    # one warning for the whole convert_ call (NOTE [A refused known family is loud])
    import warnings

    what = "; ".join(
        f"{_TECHNIQUE_NAMES.get(t, t)} on {cls}: {why}" for cls, t, why in dict.fromkeys(refused)
    )
    warnings.warn(
        "slimgrad.convert_: a model family slimgrad supports was left unconverted; expected "
        f"it to convert, got {what}. The model trains as before, without that saving (see "
        "slimgrad.report(model)); this is likely a transformers release slimgrad does not follow "
        "yet: please run `slimgrad env` and file an issue with its output and this message.",
        UserWarning,
        stacklevel=3,
    )


def _carry_hooks(old: nn.Module, new: nn.Module) -> None:
    # The replacement takes over the original's hook dicts themselves (not copies): every hook
    # registered before conversion fires on the new module, and its RemovableHandle still removes
    # it. Forward hooks see the same inputs and outputs (the replacement computes the same
    # function); state_dict hooks see the same keys.
    for k, v in old.__dict__.items():
        if k.startswith("_") and "hooks" in k and isinstance(v, dict):
            new.__dict__[k] = v
    new._is_full_backward_hook = old._is_full_backward_hook
    _accelerate_hooks.carry(old, new)  # NOTE [A replacement carries accelerate's hook]


# --- analyse -> decide -> apply -> record (the module docstring's "Stages") -------------------


@dataclass(eq=False)
class ModuleFacts:
    """What the table pass needs to know about one module, read once from the module alone.

    Attributes:
        entry: a table class is among its classes (its own or a base).
        technique: the ``ConvertConfig`` field of the entry that converts it, or None.
        handler: that entry's handler (for a subclass, one that checks the replacement's state).
        reason: why its entry does not apply to it (a patched forward, a subclass that may compute
            otherwise; NOTE [Subclasses convert by what they compute]), or None.
        parametrized: why it stays eager because a weight is computed (NOTE [Parametrized
            weights stay eager]); read only for modules with an entry.
        kept: why the in-place guard keeps it (NOTE [In-place writers after output-saving
            modules]); read only for modules with a technique.
    """

    entry: bool
    technique: str | None
    handler: Handler | None
    reason: str | None
    parametrized: str | None
    kept: str | None


def _module_facts(m: nn.Module) -> ModuleFacts:
    technique, handler = table_handler(m)
    if technique is None:  # ``handler`` is the reason its entry does not apply, or None
        entry = handler is not None
        why = _parametrized.parametrized_reason(m) if entry else None
        return ModuleFacts(entry, None, None, handler, why, None)
    why = _parametrized.parametrized_reason(m)
    return ModuleFacts(True, technique, handler, None, why, _inplace_guard.kept_reason(m))


@dataclass(eq=False)
class ModelFacts:
    """What ``convert_`` reads about a model, each fact computed once (``analyse``).

    Attributes:
        model: the model.
        targets: the (device type, dtype or None) pairs the device rule decides for.
        hf: the model holds an HF ``PreTrainedModel``.
        features_off: (feature, why) for capabilities this installation lacks.
    """

    model: nn.Module
    targets: tuple[tuple[str, object], ...]
    hf: bool
    features_off: tuple[tuple[str, str], ...]
    # the neighbour patterns' reading of the tree; ``claimed`` holds what they decided
    structure: Structure = field(init=False, repr=False)
    # {id(module): (module, facts)}: holding the module keeps its id unique for the call
    _modules: dict[int, tuple[nn.Module, ModuleFacts]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.structure = Structure(self.model, self.targets)

    def read_modules(self) -> None:
        """Read the model as the patterns and the table pass decide from it, before anything is
        swapped: the in-place guard's reading of its structure, then each module's facts (once
        per module, wherever it is held)."""
        _inplace_guard.inplace_guard_pattern(self.model, None, None, None, self.structure.traces)
        found = self._modules
        found.clear()
        stack = [self.model]
        while stack:  # each module once (a plain walk: modules()' generators cost more calls)
            m = stack.pop()
            if id(m) not in found:
                found[id(m)] = (m, _module_facts(m))
                for c in m._modules.values():
                    if c is not None:
                        stack.append(c)

    def of(self, m: nn.Module) -> ModuleFacts:
        """The facts of ``m``: read by ``read_modules``, or now (a module a replacement holds
        that the model did not, e.g. under ``CONVERT_CHILDREN``) and kept."""
        got = self._modules.get(id(m))
        if got is None or got[0] is not m:
            got = self._modules[id(m)] = (m, _module_facts(m))
        return got[1]


def analyse(model: nn.Module, targets: tuple[tuple[str, object], ...]) -> ModelFacts:
    """The model-wide facts ``convert_`` decides from (``ModelFacts``); ``read_modules`` adds the
    in-place guard's reading and the per-module ones."""
    hf = _is_hf_model(model)
    if hf:
        # once per process, outside the tested range only; the warning points at convert_'s caller
        _compat.check_transformers(stacklevel=4)
    off = tuple((f.name, f.detail) for f in _compat.features_off())
    return ModelFacts(model, targets, hf, off)


def decide_patterns(
    model: nn.Module, config: ConvertConfig, allowed: Callable, facts: ModelFacts
) -> list[Decision]:
    """The neighbour patterns' decisions (``_PATTERNS``, in order, each seeing what the earlier
    ones claimed in ``facts.structure``); a technique the config turns off is not asked, one the
    device rule refuses is one skipped row. Nothing is changed."""
    out: list[Decision] = []
    for technique, pattern in _PATTERNS:
        if technique is not None and not getattr(config, technique):
            continue
        if technique is not None and (why := _device_rule.refuse(technique, facts.targets)):
            out.append(Decision("", None, None, model, reason=why, kind=f"{technique} pass"))
            continue
        out += pattern(model, config, allowed, facts.structure)
    return out


def _decide_one(
    m: nn.Module, name: str, f: ModuleFacts, config: ConvertConfig, allowed: Callable, targets
) -> tuple[nn.Module | None, str | None, bool]:
    # (replacement or None, reason or None, visit its children); the checks in the order whose
    # first failure the report names
    if f.technique is None and f.reason is None:
        return None, None, True  # no table class among its bases: a container, visited
    if f.parametrized is not None:
        return None, f.parametrized, False  # NOTE [Parametrized weights stay eager]
    if f.technique is None:  # a table subclass that may compute otherwise: its children may not
        return None, f.reason, True
    if f.kept is not None:
        return None, f.kept, False
    if not getattr(config, f.technique):
        return None, f"ConvertConfig.{f.technique} is False", False
    if not allowed(m, name):
        return None, "filter_fn returned False", False
    if (why := _device_rule.refuse(f.technique, targets)) is not None:
        return None, why, False
    try:
        return f.handler(m), None, False
    except NotImplementedError as e:
        return None, str(e), True


def decide(
    model: nn.Module, config: ConvertConfig, allowed: Callable, facts: ModelFacts
) -> list[Decision]:
    """Decide, for each place that holds a module, its replacement or why it stays, in the
    order of ``model``'s module tree; no module of ``model`` is swapped (``apply`` swaps).

    A handler builds the replacement (sharing the original's Parameters, buffers and children)
    without changing the original. A module held at several places is decided once and gets one
    replacement everywhere. The children of a module that stays are decided too; those of a
    replacement only where it asks (``CONVERT_CHILDREN``, e.g. timm's norm + act). A module a
    neighbour pattern replaced (``facts.structure.claimed``) takes that replacement at each place
    met here too, a replacement's own copy of its children included.
    """
    out: list[Decision] = []
    # {id(original): (original, replacement or original)}; it keeps the originals alive
    done: dict[int, tuple[nn.Module, nn.Module]] = {}
    claimed = facts.structure.claimed

    def visit(parent: nn.Module, prefix: str) -> None:
        for attr, child in list(parent._modules.items()):  # named_children() skips repeats
            if child is None:
                continue
            name = f"{prefix}.{attr}" if prefix else attr
            if id(child) in claimed:  # the pattern's decision has the report row
                new = claimed[id(child)]
                out.append(Decision(name, parent, attr, child, new=new, repeat=True))
                continue
            if id(child) in done:
                if (new := done[id(child)][1]) is not child:
                    out.append(Decision(name, parent, attr, child, new=new, repeat=True))
                continue
            done[id(child)] = (child, child)
            if _is_slimgrad(child):
                visit(child, name)
                continue
            new, reason, children = _decide_one(
                child, name, facts.of(child), config, allowed, facts.targets
            )
            if new is not None:
                done[id(child)] = (child, new)
                out.append(Decision(name, parent, attr, child, new=new))
                if getattr(new, "CONVERT_CHILDREN", False):
                    visit(new, name)
                elif claimed and new._modules is not child._modules:
                    for a, c in new._modules.items():  # its own copy of a claimed child's place
                        if c is not None and id(c) in claimed:
                            n = f"{name}.{a}"
                            out.append(Decision(n, new, a, c, new=claimed[id(c)], repeat=True))
                continue
            if reason is not None:
                out.append(Decision(name, parent, attr, child, reason=reason))
            if children:
                visit(child, name)

    visit(model, "")
    return out


def apply(decisions: list[Decision]) -> None:
    """Swap each decided replacement into its place (a table replacement takes over the
    original's hooks), then make the changes decided where a module stands (``patch``: an HF
    model's configs and forward), which read the swapped model."""
    for d in decisions:
        if d.new is None or d.parent is None:
            continue
        if d.carry_hooks and not d.repeat and d.new is not d.module:
            _carry_hooks(d.module, d.new)
        setattr(d.parent, d.attr, d.new)
    for d in decisions:
        if d.patch is not None:
            d.added = d.patch()


def record(decisions: list[Decision], rep: ConvertReport) -> None:
    """The report's rows for the decisions: one per module, converted or skipped with why, in
    the order decided (the patterns' first), and the refusals ``convert_`` warns about."""
    for d in decisions:
        if d.repeat:
            continue
        kind = d.kind if d.kind is not None else type(d.module).__name__
        if d.new is not None or d.patch is not None:
            to = d.to if d.to is not None else type(d.new).__name__
            rep.converted.append((d.name, kind, to))
            rep.converted += d.added
        elif d.reason is not None:
            rep.skipped.append((d.name, kind, d.reason))
        if d.refusal is not None:
            _hf.note_refusal(rep, d.module, *d.refusal)


# NOTE [Coverage in the report]
# ``convert_`` ends by listing what it left on the table (``ConvertReport.left_alone``): every
# module that holds parameters, or floating buffers that state_dict saves (a frozen BatchNorm's
# statistics and affine), and is still the module it was. Its reason is the one ``skipped`` has for
# it (a handler's refusal, the subclass rule, the filter, the config, the in-place guard), else the
# one of a skipped module it sits in, else a known reason below for a type no handler converts,
# else "no handler for <class>". A converted module covers its subtree (its forward computes with
# those children's weights), except one that has convert_ convert its children
# (``CONVERT_CHILDREN``): those run as modules and are accounted for one by one. A module converted
# where it stands (a pattern that swaps its forward, e.g. the fused loss) is not listed; one whose
# attention function a pattern changed (a row "<Class> attention (...)") still runs its own forward,
# so its own parameters are listed (CLIPModel's logit_scale, SigLIP's logit_bias).
_NO_HANDLER: dict[str, str] = {
    # looked up along the MRO: a subclass carries its base's reason
    "torch.nn.modules.batchnorm.SyncBatchNorm": (
        "statistics synced across processes whenever a process group is initialised at call "
        "time (DDP); slimgrad's BatchNorm does not sync, so a swap would be exact in one process "
        "only: kept (slimgrad.nn.InPlaceABNSync syncs, for a manual swap)"
    ),
    "torch.nn.modules.rnn.RNNBase": (
        "a fused recurrent op (aten's RNN/GRU/LSTM, cuDNN's on CUDA); slimgrad has no RNN op: kept"
    ),
    "torch.nn.modules.rnn.RNNCellBase": (
        "a fused recurrent cell (aten's rnn/gru/lstm cell kernels); slimgrad has no RNN op: kept"
    ),
    "torch.nn.utils.parametrize.ParametrizationList": (
        "holds the original tensor of a parametrized weight (torch.nn.utils.parametrize); the "
        "module whose weight it is is listed with its reason"
    ),
    "torch.nn.modules.sparse.Embedding": (
        "eager's embedding keeps only the integer indices for backward: nothing to save: kept"
    ),
    "torch.nn.modules.sparse.EmbeddingBag": (
        "eager's embedding bag keeps the integer indices and offsets (and per-bag max indices) "
        "for backward: nothing to save: kept"
    ),
}


def _holds_state(m: nn.Module) -> bool:
    if any(p is not None for p in m._parameters.values()):
        return True
    return any(
        b is not None and b.is_floating_point() and k not in m._non_persistent_buffers_set
        for k, b in m._buffers.items()
    )


def _no_entry_reason(
    m: nn.Module, entry: bool, is_root: bool, inside: tuple[str, str] | None
) -> str:
    if entry:
        if is_root:
            return (
                "the model itself: convert_ replaces submodules in place, not the module it is "
                "given; wrap it (e.g. nn.Sequential(model)) to convert it"
            )
        if inside is not None:
            return f"inside {inside[0] or '<root>'}, which convert_ left as is: {inside[1]}"
    for klass in type(m).__mro__:
        if (why := _NO_HANDLER.get(_qualname(klass))) is not None:
            return why
    if entry:  # not expected: every table module convert_ reaches is reported
        return f"a handler for {_qualname(type(m))} exists, but convert_ did not apply it here"
    return f"no handler for {_qualname(type(m))}"


def _own_state_reason(m: nn.Module, row: str) -> str:
    own = [k for k, p in m._parameters.items() if p is not None]
    own += [k for k, b in m._buffers.items() if b is not None and b.is_floating_point()]
    return (
        f"its own parameters/buffers ({', '.join(own)}) are used by its own forward, which runs "
        f"as before: convert_ changed only what it calls ({row}, converted)"
    )


def _left_alone(
    model: nn.Module, rep: ConvertReport, facts: ModelFacts
) -> list[tuple[str, str, str]]:
    # NOTE [Coverage in the report]; the walk and names are named_modules()' (each module once)
    why: dict[tuple[str, str], str] = {}
    for n, kind, r in rep.skipped:
        why.setdefault((n, kind), r)
        for sep in (" ", "."):  # a pattern's row: "<Class> attention (sdpa)", "<Class>.forward"
            if sep in kind:
                why.setdefault((n, kind.split(sep, 1)[0]), r)
    # a row "<Class> attention (...)" changes a function the module's forward calls, not how its
    # own parameters are used (CLIPModel's logit_scale): such a module is not covered by it
    converted = {n for n, k, _ in rep.converted if " " not in k}
    patterned = {n: k for n, k, _ in rep.converted if " " in k}
    out: list[tuple[str, str, str]] = []
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module, tuple[str, str] | None]] = [("", model, None)]
    while stack:
        name, m, inside = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        kind = type(m).__name__
        if _is_slimgrad(m):
            if m is not model and not getattr(m, "CONVERT_CHILDREN", False):
                continue  # a converted module computes with its children's weights
        else:
            own = why.get((name, kind))
            if own is not None:
                inside = (name, own)
            if name not in converted and _holds_state(m):
                if own is None and name in patterned:
                    own = _own_state_reason(m, patterned[name])
                out.append(
                    (name, kind, own or _no_entry_reason(m, facts.of(m).entry, m is model, inside))
                )
        kids = [(f"{name}.{k}" if name else k, c) for k, c in m._modules.items() if c is not None]
        stack.extend((n, c, inside) for n, c in reversed(kids))
    return out


def _wrapped(model: nn.Module) -> nn.Module | None:
    # the module a known wrapper holds, else None
    inner = None
    if type(model).__name__ == "OptimizedModule":  # torch.compile(model)
        inner = getattr(model, "_orig_mod", None)
    elif isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        inner = model.module
    elif type(model).__module__.startswith("peft.") and callable(
        getattr(model, "get_base_model", None)
    ):
        inner = model.get_base_model()
    return inner if isinstance(inner, nn.Module) else None


def report(model: nn.Module) -> ConvertReport:
    """The report of the last ``convert_`` on ``model``: what was converted, what was skipped,
    and every module with parameters (or state_dict float buffers) left alone, each with a reason;
    ``print`` it for one line per type and reason.

    A copy of a converted model (``copy.deepcopy``, pickle, ``torch.save``/``torch.load``) has
    the original's report. Wrappers made after ``convert_`` are followed to the converted model
    inside: ``torch.compile``'s ``OptimizedModule``, ``DistributedDataParallel``/``DataParallel``
    and PEFT's ``PeftModel`` (FSDP2's ``fully_shard`` keeps the module itself).

    Raises:
        RuntimeError: ``model`` was never converted.
    """
    rep = _report_of(model)
    seen = {id(model)}
    while rep is None and (inner := _wrapped(model)) is not None and id(inner) not in seen:
        seen.add(id(inner))
        model, rep = inner, _report_of(inner)
    if rep is None:
        raise RuntimeError(
            "slimgrad.report: this model was not converted; expected a model passed to "
            "slimgrad.convert_, got one that was not. Call slimgrad.convert_(model) first."
        )
    return rep
