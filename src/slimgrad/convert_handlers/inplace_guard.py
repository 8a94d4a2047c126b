"""convert_ pass: keep output-saving modules unconverted where an in-place write follows them.

Several slimgrad modules keep their *output* for backward where eager keeps its input (the norms,
the smooth activations, LeakyReLU/ELU/Hardtanh/ReLU6: ``SAVES_OUTPUT``). If the model then writes
that output in place (``ReLU(inplace=True)``, ``Dropout(inplace=True)``, ``h.relu_()``,
``F.relu(h, inplace=True)``, ``h += r``, also through views, slices and transposes of it), eager
trains but the converted backward raises autograd's "modified by an inplace operation".

This pass finds such modules before the table pass and marks them, so ``convert_`` leaves them as
they are and names the reason in its report (NOTE [In-place writers after output-saving modules]).
It also keeps torch's ReLU where a BatchNorm output it reads is written after it (NOTE [A write
after a BatchNorm output was claimed]), and reads a module by the forward it runs, one set on the
instance included (NOTE [A forward set on the instance]).
"""

from __future__ import annotations

import array
import ast
import builtins
import collections
import copy
import dataclasses
import functools
import gc
import inspect
import linecache
import operator
import random
import re
import sys
import textwrap
import threading
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _torch_module
from torch.overrides import TorchFunctionMode

from slimgrad.convert_handlers import hf as _hf

__all__ = ["SAVES_OUTPUT", "Traces", "inplace_guard_pattern", "kept_reason", "output_modules"]

# NOTE [In-place writers after output-saving modules]
# A module is "output-saving" when its slimgrad replacement keeps its output for backward but
# eager's keeps its input (ReLU, Sigmoid and Tanh are not listed: eager keeps their output too, so
# an in-place write after them fails in eager as well). Its output reaches an in-place writer when,
# following the tensor from the module's output through ops that may return it or a view of it
# (views, slices, transposes, reshape, contiguous, Flatten/Identity, dropout, which returns its
# input in eval, and ``.data``, whose writes autograd does not even see), we meet an op that
# writes its first argument in place. Where the tensor flows is
# found from nn.Sequential order (nested Sequentials in line) and, for other plain-torch modules,
# from a torch.fx trace in which every child module is a leaf; a child's own summary (which
# output-saving modules can reach its output, whether it writes its input) comes from the same
# analysis, recursively; a trace counts only where it is the same with ``training`` flipped and
# drew no random number (a write in a branch on the mode or on a draw: ``_trace_every_call``), else
# the source is read, every branch followed, and a loop over a ModuleList one pass per child. HF
# transformers modules are not traced (torch.fx fails on most of them):
# their forward's source is read instead (NOTE [In-place writes in HF forwards]), and so is the
# source of any other module torch.fx cannot trace; a module whose forward can neither be traced
# nor read keeps its output-saving children unconverted when any of its descendants has
# ``inplace=True``.
SAVES_OUTPUT = frozenset(
    {
        "torch.nn.modules.activation.Hardtanh",
        "torch.nn.modules.activation.ReLU6",
        "torch.nn.modules.activation.LeakyReLU",
        "torch.nn.modules.activation.ELU",
        "torch.nn.modules.activation.GELU",
        "torch.nn.modules.activation.SiLU",
        "torch.nn.modules.activation.Mish",
        "transformers.activations.GELUActivation",
        "transformers.activations.NewGELUActivation",
        "transformers.activations.FastGELUActivation",
        "transformers.activations.GELUTanh",
        "transformers.activations.PytorchGELUTanh",
        "transformers.activations.SiLUActivation",
        "transformers.activations.MishActivation",
        "torch.nn.modules.normalization.LayerNorm",
        "torch.nn.modules.normalization.RMSNorm",
        "torch.nn.modules.normalization.GroupNorm",
        "torch.nn.modules.activation.Hardswish",
        "timm.layers.activations.GELU",
        "timm.layers.activations.GELUTanh",
        *_hf.RMS_NORM_CLASSES,  # every HF RMSNorm convert_ reaches (fp32: keeps y)
    }
)

# Modules whose output may be their input or a view of it.
_PASS_MODULES = (
    nn.Identity,
    nn.Flatten,
    nn.Unflatten,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)
# Tensor methods and torch functions that may return their first argument or a view of it.
_VIEW_NAMES = frozenset(
    {
        "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "transpose", "t",
        "permute", "movedim", "moveaxis", "swapaxes", "swapdims", "squeeze", "unsqueeze",
        "expand", "expand_as", "narrow", "select", "chunk", "split", "tensor_split", "unbind",
        "split_with_sizes", "contiguous", "detach", "as_strided", "diagonal", "unfold", "to",
        "type_as", "float", "double", "half", "bfloat16", "type", "real", "imag", "view_as_real",
        "view_as_complex", "dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d",
        "dropout2d", "dropout3d", "requires_grad_", "__getitem__", "getitem", "identity",
        "align_as", "rename", "refine_names", "mT", "T", "H", "mH", "data",
    }
)  # fmt: skip
# NOTE [Which calls may return their input: read from the op's schema]
# Between an output-saving module and an in-place write, the guard follows the tensor through
# every call that may return it or a view of it. ``_VIEW_NAMES`` holds what no ATen schema states
# (Python-level spellings: ``.data``, ``h[i]``, ``.float()``, dropout in eval returning its input,
# ``requires_grad_``); every other name is decided by ``_may_alias`` from facts: the name (a
# Tensor method, a torch function, a Python attribute read through ``getattr`` node, an
# ``operator`` function) resolves to an ATen operator packet (``torch.ops.aten.<name>``; the
# attributes ``.T``/``.H`` and the ``operator`` functions whose ATen name differs through
# ``_ATEN_NAME``); it may alias when one of its overloads' schema gives a return an alias
# annotation (``Tensor(a)``: views, ``hsplit``, ``ravel``, ``broadcast_to``, ``adjoint``,
# ``mT``, ``real``, ``contiguous``, ``to``), or has a CompositeImplicitAutograd kernel (its
# schema states nothing: ``atleast_2d`` and ``type_as`` return their input as it is); a name
# that resolves to no ATen operator (a user function, a builtin) may alias. Only an op with a
# kernel of its own and no alias annotation (``add``, ``gelu``, ``cat``, ``mul``) returns a
# fresh tensor, as ATen requires of such kernels.
_ATEN_NAME = {
    "T": "numpy_T", "H": "matrix_H", "truediv": "div", "floordiv": "floor_divide",
    "mod": "remainder", "and_": "bitwise_and", "or_": "bitwise_or", "xor": "bitwise_xor",
    "invert": "bitwise_not", "inv": "bitwise_not", "lshift": "bitwise_left_shift",
    "rshift": "bitwise_right_shift", "pos": "positive", "lt": "lt", "le": "le", "eq": "eq",
    "ne": "ne", "ge": "ge", "gt": "gt",
}  # fmt: skip
_ALIAS_MEMO: dict[str, bool] = {}


def _may_alias(name: str) -> bool:
    """Whether a call named ``name`` may return its first argument or a view of it (NOTE [Which
    calls may return their input: read from the op's schema])."""
    if name in _VIEW_NAMES:
        return True
    got = _ALIAS_MEMO.get(name)
    if got is None:
        got = _ALIAS_MEMO[name] = _schema_may_alias(_ATEN_NAME.get(name, name))
    return got


def _schema_may_alias(name: str) -> bool:
    if not name.isidentifier():
        return True
    try:
        packet = getattr(torch.ops.aten, name)
        overloads = [getattr(packet, o) for o in packet.overloads()]
    except (AttributeError, RuntimeError):  # no such ATen operator: not known to be fresh
        return True
    if not overloads:
        return True
    for op in overloads:
        if any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns):
            return True
        try:
            composite = op.has_kernel_for_dispatch_key(
                torch._C.DispatchKey.CompositeImplicitAutograd
            )
        except RuntimeError:  # a TorchScript builtin overload (``add.t``: lists): no kernels
            continue
        if composite:
            return True
    return False


_INPLACE_OPERATORS = frozenset(
    {
        operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
        operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
        operator.ilshift, operator.irshift, operator.imatmul, operator.setitem,
    }
)  # fmt: skip
# F functions whose 'inplace' argument is at this position (0-based), when passed positionally.
_INPLACE_ARG_POS = {
    F.relu: 1, F.relu6: 1, F.elu: 2, F.selu: 1, F.celu: 2, F.leaky_relu: 2, F.hardtanh: 3,
    F.silu: 1, F.mish: 1, F.hardswish: 1, F.hardsigmoid: 1, F.threshold: 3, F.rrelu: 4,
    F.dropout: 3, F.alpha_dropout: 3, F.feature_alpha_dropout: 3, F.dropout1d: 3,
    F.dropout2d: 3, F.dropout3d: 3,
}  # fmt: skip

_KEPT: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()

_REASON = (
    "an in-place write follows it ({}): slimgrad's {} keeps its output for backward, which that "
    "write would overwrite; eager keeps its input (NOTE [In-place writers after output-saving "
    "modules] in convert_handlers/inplace_guard.py)"
)


# NOTE [A write after a BatchNorm output was claimed]
# slimgrad's BatchNorm keeps its output b instead of its input x when a slimgrad activation
# claims b (NOTE [Derived saved inputs] in ops/_derived.py); the activation and the next conv
# then keep b too. The claim is made only on a pristine b (its version unchanged since the norm
# made it), so a write before it (ResNet's ``out += identity``) costs nothing; a write after it
# (``y = self.relu(b); b.add_(1)``) bumps b's version and the backward raises autograd's "modified
# by an inplace operation". For every claimant but ReLU eager raises there too: it keeps b, the
# activation's input. Eager's ReLU keeps its own output, and the BatchNorm its input, so eager
# trains: there the ReLU stays torch's (no claim is made: the BatchNorm keeps x, or its recipe,
# and the ReLU its output, as eager). The guard reads it from the structure it reads anyway: in
# its own run a BatchNorm is an end like an output-saving module, and a write that reaches its
# output keeps the ReLUs that b was handed to before that write (directly, or as the input of a
# module that hands its input on: ``_Info.takes``), the writing module itself excepted (an
# in-place ReLU over b is ``ownership``'s question: NOTE [Derived saved inputs]). A write the
# structure does not show (user code after the model returns b, a hook registered after
# ``convert_``) is caught by the version counters at backward, with slimgrad's error
# (``ops._derived.check_version``) naming the fix.
_REASON_CLAIM = (
    "an in-place write follows the {1} output it reads ({0}): slimgrad's ReLU after a BatchNorm "
    "lets the BatchNorm keep that output for backward instead of its input, and that write would "
    "overwrite it; eager's ReLU keeps its own output (NOTE [A write after a BatchNorm output was "
    "claimed] in convert_handlers/inplace_guard.py)"
)


_Lazy = nn.modules.lazy.LazyModuleMixin


def _is_source(m: nn.Module) -> bool:
    # a BatchNorm convert_ makes slimgrad's, whose output a following activation may claim
    # NOTE [A source by capability]: any BatchNorm whose forward is _BatchNorm's (subclasses
    # without their own forward are converted too), not only the three exact classes
    bn = nn.modules.batchnorm._BatchNorm
    return isinstance(m, bn) and type(m).forward is bn.forward and not isinstance(m, _Lazy)


# NOTE [A forward set on the instance]
# ``m.forward = ...`` on an instance (``types.MethodType(f, m)``, ``functools.partial``, a plain
# function, accelerate's ``convert_outputs_to_fp32(model.forward)``) is what ``m(x)`` runs;
# torch.fx and the source reading read ``type(m).forward``. So the guard reads a module whose
# instance forward is set by what that forward is:
#   - the class's forward itself, bound to the module (``MethodType(type(m).forward, m)``,
#     ``partial(type(m).forward, m)``, ``getattr`` of the bound method): as the class's;
#   - a wrapper of it (``functools.wraps``/``update_wrapper`` state it: ``__wrapped__`` leads to
#     the class's forward, through bound methods and partials that bind only the module): the
#     class's forward as read, plus a wrapper that may write the module's input and output in
#     place (its code is not read), so its ends are kept and it counts as a writer of its input;
#   - anything else: unknown; it may call any child in any order, skip one and write any
#     tensor: every output-saving module below it is kept, and every ReLU below it where a
#     BatchNorm is below it too (NOTE [A write after a BatchNorm output was claimed]), with the
#     reason in the report. A leaf module with an instance forward is left alone by the table
#     pass (``convert.py``'s subclass rule).
# The forwards ``convert_`` itself sets (HF attention's, the fused loss's: functions and callables
# of ``slimgrad.``) are read as the class's, as before: they run it, or what the module's
# replacement states.
def _is_class_forward(fn, m: nn.Module) -> bool:
    cls_fwd = getattr(type(m), "forward", None)
    if isinstance(fn, types.MethodType):
        return fn.__self__ is m and fn.__func__ is cls_fwd
    if isinstance(fn, functools.partial):
        return fn.func is cls_fwd and len(fn.args) == 1 and fn.args[0] is m and not fn.keywords
    return False


def _instance_kind(fn, m: nn.Module) -> str:
    # "class", "wrapper" or "unknown" (NOTE [A forward set on the instance])
    if _slimgrad_patch(fn):
        return "class"
    if _accelerate_passes(fn, m):  # NOTE [accelerate's hook wrapper]
        fn = m.__dict__.get("_old_forward")
        if _slimgrad_patch(fn):  # the fused loss under the hook (hf_loss.py's NOTE on it)
            return "class"
    cls_fwd = getattr(type(m), "forward", None)
    seen: set[int] = set()
    wrapped = False
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        if fn is cls_fwd or _is_class_forward(fn, m):
            return "wrapper" if wrapped else "class"
        inner = getattr(fn, "__wrapped__", None)  # what functools.wraps/update_wrapper state
        if inner is not None:
            fn, wrapped = inner, True
        elif isinstance(fn, types.MethodType):
            fn = fn.__func__ if fn.__self__ is m else None
        elif isinstance(fn, functools.partial):
            ok = len(fn.args) <= 1 and all(a is m for a in fn.args) and not fn.keywords
            fn = fn.func if ok else None
        else:
            fn = None
    return "unknown"


# NOTE [accelerate's hook wrapper]
# accelerate's ``add_hook_to_module(m, hook)`` (``cpu_offload``, ``dispatch_model``,
# ``attach_align_device_hook``) sets ``m.forward`` to ``partial(new_forward, m)``, wrapped over the
# forward it replaces (``m._old_forward``), and ``m._hf_hook = hook``; ``new_forward`` runs
# ``hook.pre_forward(m, *args, **kwargs)``, then ``m._old_forward`` on what that returns (under
# ``no_grad`` where the hook asks), then ``hook.post_forward(m, output)``. Read as any wrapper, it
# may write what the module is given and what it returns, and a hook on every module with
# parameters (``cpu_offload`` style) kept GPT-2's GELUs eager (saved 122,500 -> 252,548 B). What
# it runs is stated by facts of the instance: the wrapper is accelerate's ``new_forward`` bound to
# the module alone, and the hook's class. ``ModelHook.pre_forward``/``post_forward`` return their
# arguments; ``AlignDevicesHook``'s move tensors with ``send_to_device`` (``.to``: a new tensor or
# the same one, never a write of the caller's tensor) and load or unload the module's own weights;
# ``CpuOffload``'s (``cpu_offload_with_hook``) moves the module to its execution device
# (``module.to``: parameters and buffers rebound or given new data, never a write of an
# activation), sends the arguments there (``send_to_device``) and returns the output as it is,
# after offloading the model of ``prev_module_hook`` when that is a ``UserCpuOffloadHook`` (its
# ``offload`` runs its hook's ``init_hook``: read as known only where that hook is a
# ``CpuOffload`` whose ``init_hook`` is the class's, ``.to("cpu")``; ``_offloads_only``);
# ``LayerwiseCastingHook``'s (``attach_layerwise_casting_hooks``) cast the module's own weights
# to the compute dtype before the forward and back to the storage dtype after it (``module.to``)
# and return the arguments and the output as they are; a ``SequentialHook`` runs its hooks' in
# turn. Where the hook is one of those classes (or a
# subclass that overrides neither method) over such hooks, the module is read as the forward it
# wraps (``m._old_forward``: the class's, or what that one is, as for any instance forward). Any
# other hook class, or a subclass with its own ``pre_forward``/``post_forward``, is a wrapper that
# may write, as before. The hook is read at ``convert_``; replacing it after is not covered (as
# any forward set on the instance after ``convert_``).
def _accelerate_passes(fn, m: nn.Module) -> bool:
    hooks = sys.modules.get("accelerate.hooks")
    if hooks is None or not isinstance(fn, functools.partial):
        return False
    inner = fn.func
    if (
        getattr(inner, "__module__", None) != "accelerate.hooks"
        or getattr(inner, "__qualname__", None) != "add_hook_to_module.<locals>.new_forward"
        or fn.args != (m,)
        or fn.keywords
        or "_old_forward" not in m.__dict__
    ):
        return False
    return _accelerate_hook_passes(m.__dict__.get("_hf_hook"), hooks)


def _accelerate_hook_passes(hook, hooks: types.ModuleType) -> bool:
    base = getattr(hooks, "ModelHook", None)
    seq = getattr(hooks, "SequentialHook", None)
    if base is None or not isinstance(hook, base):
        return False
    cls = type(hook)
    if seq is not None and isinstance(hook, seq):
        own = (cls.pre_forward, cls.post_forward) == (seq.pre_forward, seq.post_forward)
        subs = getattr(hook, "hooks", None)
        return (
            own and isinstance(subs, tuple) and all(_accelerate_hook_passes(h, hooks) for h in subs)
        )
    for name in ("ModelHook", "AlignDevicesHook", "CpuOffload", "LayerwiseCastingHook"):
        k = getattr(hooks, name, None)
        if (
            isinstance(k, type)
            and isinstance(hook, k)
            and cls.pre_forward is k.pre_forward
            and cls.post_forward is k.post_forward
        ):
            return name != "CpuOffload" or _offloads_only(hook, hooks)
    return False


def _offloads_only(hook, hooks: types.ModuleType) -> bool:
    # NOTE [accelerate's hook wrapper]: a CpuOffload's ``pre_forward`` first calls
    # ``prev_module_hook.offload()``, which runs that hook's ``init_hook`` on its model: known
    # where there is none, or it is ``cpu_offload_with_hook``'s (a UserCpuOffloadHook over a
    # CpuOffload, whose ``init_hook`` moves the model to the CPU)
    prev = getattr(hook, "prev_module_hook", None)
    user = getattr(hooks, "UserCpuOffloadHook", None)
    if prev is None:
        return True
    if not isinstance(user, type):
        return False
    if not isinstance(prev, user):  # (not called: ``pre_forward`` offloads a UserCpuOffloadHook)
        return True
    inner, off = getattr(prev, "hook", None), getattr(hooks, "CpuOffload", None)
    return (
        type(prev).offload is user.offload
        and isinstance(off, type)
        and isinstance(inner, off)
        and type(inner).init_hook is off.init_hook
    )


def _slimgrad_patch(fn) -> bool:
    # a forward convert_ itself set (HF attention, the fused loss): it runs the module's class
    # forward, or what the replacement states (NOTE [A replacement states its structure])
    inner = getattr(fn, "__func__", fn)
    mod = getattr(inner, "__module__", None) or type(inner).__module__
    return isinstance(mod, str) and mod.startswith("slimgrad.")


def _fn_name(fn) -> str:
    inner = getattr(fn, "func", None) or getattr(fn, "__func__", None) or fn
    return getattr(inner, "__qualname__", None) or type(inner).__name__


def kept_reason(module: nn.Module) -> str | None:
    """Why the last guard pass keeps ``module`` unconverted, or None."""
    return _KEPT.get(module)


@dataclass
class _Info:
    ends: list[nn.Module] = field(default_factory=list)  # savers whose output may be our output
    writes: bool = False  # writes its (first) input, or a view of it, in place
    passes: bool = False  # its output may be its input or a view of it
    # where every return of a read forward is a tuple literal of one length: per item, what it
    # may hold (modules, and _IN for the input), else None (NOTE [Modules whose output is the
    # model's output]: tuple items); ``ends``/``passes`` stay the union over the items
    items: tuple[frozenset, ...] | None = None
    # the children its input (or a view of it) may be given to (NOTE [Hooks on the modules around
    # an output-saving one]: their hooks may write it)
    takes: list[nn.Module] = field(default_factory=list)
    # its input may be written after its forward ran (a forward hook: NOTE [What a hook registered
    # before convert_ may write]), so the module itself has read it before that write
    after: bool = False
    # its input (or a view of it) may be kept on a module past its forward (NOTE [An output kept
    # on the module escapes])
    keeps_input: bool = False
    # where ``writes``: why, as a clause after the module's name (NOTE [Why a module writes its
    # input, in the report])
    cause: str = ""


def _hooked(m: nn.Module) -> bool:
    return bool(
        m._forward_hooks
        or m._forward_pre_hooks
        or getattr(_torch_module, "_global_forward_hooks", None)
        or getattr(_torch_module, "_global_forward_pre_hooks", None)
    )


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _saves_output(m: nn.Module) -> bool:
    # the class or a base: subclasses of table classes convert too (convert.py's subclass rule)
    return any(_qualname(c) in SAVES_OUTPUT for c in type(m).__mro__)


def _is_hf(m: nn.Module) -> bool:
    return type(m).__module__.startswith("transformers.")


class _InplaceProxy(torch.fx.Proxy):
    # torch.fx's Proxy has no __iadd__ or __setitem__: Python would trace ``h += r`` as
    # ``h = h + r`` (losing the write) and ``h[i] = v`` would fail; record them as they are.
    def __setitem__(self, key, value):
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


def _inplace_method(op):
    def method(self, other):
        return self.tracer.create_proxy("call_function", op, (self, other), {})

    return method


for _op in _INPLACE_OPERATORS - {operator.setitem}:
    setattr(_InplaceProxy, f"__{_op.__name__}__", _inplace_method(_op))


class _LeafTracer(torch.fx.Tracer):
    # Buffers become graph nodes: a traced forward that updates one (timm's BatchNormAct2d bumps
    # num_batches_tracked) then records the update instead of running it on the real buffer.
    proxy_buffer_attributes = True

    def __init__(self, root: nn.Module):
        super().__init__()
        self._root = root
        self.made: list[weakref.ref] = []  # every Proxy made (NOTE [An output kept on the module
        # escapes]: one still alive after the trace is kept somewhere)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return m is not self._root

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        p = _InplaceProxy(node, self)
        self.made.append(weakref.ref(p))
        return p


def _trace(
    m: nn.Module, state: _State | None = None
) -> tuple[torch.fx.Graph, bool, frozenset[str]]:
    # the graph, whether the forward drew from a random number generator (the generators'
    # states, and every module's state, are restored: NOTE [A trace leaves the model as it was]),
    # and the names of the nodes whose Proxies the forward kept past the trace (NOTE [An output
    # kept on the module escapes]): on a module (read before the state is put back) or anywhere
    # else (a global, a class attribute: the Proxies still alive once it is put back);
    # ``state``: a snapshot of ``m`` taken by the caller's ``untouched(m)`` for several traces
    if state is None:
        with untouched(m) as state:
            graph, made = _fx(m)
            drew, kept = state.drew(), _kept_on_modules(m)
        return graph, drew, kept | _still_alive(made)
    state.refusal()
    made: list = []
    try:
        if not state.copies_in:
            state.swap_in_copies()
        with _HeldWrites(state):
            graph, made = _fx(m)
        drew = state.drew()
        kept = _kept_on_modules(m)
    finally:
        state.restore()
    state.check()
    state.check_touched()
    return graph, drew, kept | _still_alive(made)


def _still_alive(made: list) -> frozenset[str]:
    # NOTE [An output kept on the module escapes]: the Proxies of a trace someone still holds once
    # the module tree is put back (``made``: weak references to every Proxy the trace made); one
    # held only by a reference cycle (a forward's recursive local helper closing over ``h``, a
    # frame kept in a local) is garbage, not kept: where any is alive, a collection settles it.
    # A Proxy of a parameter or buffer (a ``get_attr`` node: torch.fx's tracer caches those in a
    # closure's dict, a cycle left after every trace that reads one) holds no activation and ends
    # no converted module's output, so it never counts: a collection runs only where an
    # activation's Proxy may be kept
    def alive() -> frozenset[str]:
        return frozenset(
            p.node.name
            for r in made
            if (p := r()) is not None and p.node.op != "get_attr" and not _metadata_node(p.node)
        )

    names = alive()
    for generation in (1, 2) if names else ():
        # the cycles a trace leaves (torch.fx's Proxy.__iter__ keeps its own frame, and through it
        # the forward's, for a tuple unpacked from a Proxy) are young: the young generations
        # first, a full collection (its cost grows with the process's heap) only where one
        # survived them
        gc.collect(generation)
        names = alive()
        if not names:
            break
    return names


# a tensor's metadata read through a Proxy (``h.shape``, ``h.size(0)``, ``h.shape[-1]``,
# ``h.dtype``): kept on a module, it holds no tensor (NOTE [An output kept on the module escapes])
_META_ATTRS = frozenset(
    {"shape", "dtype", "device", "ndim", "layout", "is_cuda", "is_sparse", "is_meta", "names"}
)
_META_METHODS = frozenset(
    {"size", "dim", "ndimension", "numel", "nelement", "stride", "element_size", "is_contiguous",
     "get_device", "storage_offset", "is_floating_point", "is_complex"}
)  # fmt: skip
# objects whose attributes are not walked for kept Proxies
_NOT_WALKED = (type, types.ModuleType, types.FunctionType, types.MethodType, torch.Tensor)


def _metadata_node(node) -> bool:
    while node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]
        if not isinstance(node, torch.fx.Node):
            return False
    if node.op == "call_function" and node.target is builtins.getattr:
        return len(node.args) > 1 and node.args[1] in _META_ATTRS
    return node.op == "call_method" and node.target in _META_METHODS


def _kept_on_modules(root: nn.Module) -> frozenset[str]:
    # NOTE [An output kept on the module escapes]: the nodes of the Proxies a trace left in the
    # attribute dicts of ``root``'s modules, or in the containers (dicts, lists, sets, tuples,
    # deques and their subclasses) and objects' attribute dicts reachable from them (read before
    # the trace's changes are put back); a Proxy of a tensor's metadata holds no tensor
    found: set[str] = set()
    seen: set[int] = set()
    todo: list = [d.__dict__ for d in root.modules()]
    while todo:
        c = todo.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        if isinstance(c, dict):
            items = dict.values(c)
        elif isinstance(c, (list, tuple, set, frozenset, collections.deque)):
            items = c
        else:  # an object's own attributes (a SimpleNamespace, a dataclass, a plain object)
            items = vars(c).values()
        for v in items:
            if type(v) is _Unrestorable:  # (a stand-in: reading it would count as a use)
                continue
            if isinstance(v, torch.fx.Proxy):
                if not _metadata_node(v.node):
                    found.add(v.node.name)
            elif isinstance(v, (dict, list, tuple, set, frozenset, collections.deque)):
                todo.append(v)
            elif isinstance(v, types.FunctionType):  # a closure: its cells and defaults
                cells = (c.cell_contents for c in v.__closure__ or () if _full(c))
                kw = (v.__kwdefaults__ or {}).values()
                todo.append((*cells, *(v.__defaults__ or ()), *kw))
            elif isinstance(v, functools.partial):
                todo.append((v.func, v.args, v.keywords))
            elif isinstance(v, _HOLDERS):  # iterators, generators, frames: what they refer to
                todo.append(tuple(gc.get_referents(v)))
            elif hasattr(v, "__dict__") and not isinstance(v, _NOT_WALKED):
                todo.append(v)
    return frozenset(found)


# expressions whose value holds what they name: a closure, a comprehension's items, a generator
_CAPTURING = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _full(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


# objects without an attribute dict that hold values a forward may keep past its call
# (``self.it = iter([h])``, ``self.gen = (t for t in [h])``, a frame kept in an attribute)
_HOLDERS = (
    types.GeneratorType, types.FrameType, types.CellType, type(iter([])), type(iter(())),
    type(iter({})), type(iter({}.values())), type(iter({}.items())), type(iter(set())),
    type(iter(collections.deque())), type(reversed([])), type(zip()), type(map(int, ())),
    type(filter(None, ())), type(enumerate(())),
)  # fmt: skip


def _fx(m: nn.Module) -> tuple[torch.fx.Graph, list]:
    # the graph, and weak references to the Proxies the trace made
    tracer = _LeafTracer(m)
    with warnings.catch_warnings():  # the trace calls forward on Proxies (torch
        warnings.simplefilter("ignore")  # warns, e.g. under reentrant checkpoint)
        return tracer.trace(m), tracer.made


# NOTE [A trace leaves the model as it was]
# A torch.fx trace runs the module's forward as Python, on Proxies, against the real module: what
# that Python does to objects fx does not record lands in the user's model at convert_ time. A
# cache filled in eval (timm levit/efficientvit/efficientformer/tiny_vit's
# ``attention_bias_cache``, ``self._cache[k] = ...``) would hold a Proxy (the converted forward
# then returns it; ``torch.save(model)`` fails), ``self.steps += 1`` on a buffer would rebind the
# buffer to a Proxy (state_dict, torch.save and load_state_dict fail), ``self.calls += 1`` and
# ``self.seen.append(...)`` would count the traces. Every fx trace ``convert_`` runs on the
# user's modules (the in-place guard's, shared by the later readings; abn's own; ownership's
# stand-in's) runs inside ``untouched(root)`` (the guard's two traces of a module, train and eval,
# share one snapshot, put back after each): before it, every module below ``root`` (``root``
# included) has its attribute dict copied, and so has every container reachable from those
# attributes: dicts, lists, sets and deques, their subclasses (OrderedDict, defaultdict, Counter,
# a user's) included, reached through containers, tuples and objects (``_parameters``,
# ``_buffers``, ``_modules`` and the hook dicts among them), and the attribute dict of every
# object reached that way (a SimpleNamespace, a dataclass, a plain object, a user's container
# subclass, a module outside ``root``). A plain tensor in a module's attributes or a container
# reached from them (not a Parameter, not a buffer) is replaced by a copy for the trace, as
# ``ownership._trace_stand_in`` does, so a real in-place write of the forward (``self.t += 1``:
# fx runs it, there is no Proxy in it) lands on the copy; one reached through an object or a
# tuple is compared instead, as a parameter is (an object may hold many: accelerate's hooks hold
# the offloaded weights), and a write the trace would run on any of those compared tensors (an
# in-place verb, ``__setitem__``, a property's ``__set__``, ``inplace=True``, ``out=``, a
# ``torch.ops`` operator whose schema writes; also through a view: by storage) is refused
# before it runs (``_HeldWrites``, a ``TorchFunctionMode`` active during the trace). The walk
# goes on through what else holds state: functions (their closure cells, defaults and
# attributes), bound methods (their ``__self__``), ``functools.partial`` (its function, arguments
# and keywords). An object that is not a container is put back in place where its state can be
# read and written (``_inplace_io``: a NumPy array's values, an ``array.array``, a
# ``bytearray``, an object's ``__slots__``, a closure cell's contents; a random number generator,
# NumPy's ``RandomState`` among them, as below); one whose state nothing here reads (an
# ``itertools.count``, an iterator, a C extension's object) is replaced by a deep copy for the
# trace (sharing the tree's modules and tensors) where it sits in a dict or a list, and the
# original is put back. One that can be swapped but not copied (a generator, a
# ``SimpleQueue``, a ``memoryview``) is replaced for the trace by a stand-in
# (``_Unrestorable``) that raises on any attribute access, call or iteration from the tracing
# thread (``__class__`` aside: ``isinstance`` reads it) and records the touch: a forward that
# uses it refuses the trace (``_State.check_touched``, also where the forward caught the
# exception), one that does not keeps it (another thread is served by the original); where it
# can be neither copied nor swapped (anything in a tuple, a set, a deque, a cell, an object's C
# fields), the trace is refused before it runs (``_State.refusal``). A refused trace
# is one fx could not make: the in-place guard reads the forward's source instead, abn and
# ownership skip their pattern. Objects that cannot change (classes, modules, code, dtypes,
# devices, locks, weak references: ``_SNAP_IMMUTABLE``) are not walked. After the trace,
# whatever happened, each of those containers gets its own items back, in place (the same
# objects, the same identities: a reference the user holds stays valid), read and put back with
# its base class's methods (``_snapshot``, ``_put_back``: a subclass's ``__setitem__`` or
# ``append`` does not run, an OrderedDict keeps its order, a deque its ``maxlen``), and so do the
# random number generators (``_rng_states``: those held by the module tree are found in that
# same walk). Parameters and buffers are read through fx as graph
# nodes (``proxy_buffer_attributes``), so a write to one is recorded, not run; their version
# counters are compared all the same, and a trace that bumped one raises (the model changed and
# could not be put back: convert_ names it rather than go on). Not covered: state outside what
# the module tree's attributes reach (a module-level cache or tensor, a class attribute, an
# ``lru_cache``, a function's globals). A Proxy left there is still seen as kept (NOTE [An
# output kept on the module escapes]).
_SNAP_CONTAINERS = (dict, list, set, tuple, collections.deque)  # walked (tuples: items only)
_SNAP_ATOMS = frozenset({bool, int, float, complex, str, bytes, type(None)})
# objects whose attribute dict is not walked: code, classes, modules, tensors (NOTE [A trace
# leaves the model as it was]: an object's own attributes)
_SNAP_NOT_OBJECTS = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    torch.Tensor,
    torch.fx.Proxy,
)


# how a container's items are read and put back (``_snapshot``, ``_put_back``): by its base
# class's own methods, so a subclass's ``__iter__``, ``items`` or ``__setitem__`` is not run
_DICT, _ODICT, _LIST, _SET, _DEQUE = range(5)


_STDLIB = frozenset({"builtins", "collections"})


def _kind(c: object) -> int:
    if isinstance(c, collections.OrderedDict):
        return _ODICT
    if isinstance(c, dict):
        return _DICT
    if isinstance(c, list):
        return _LIST
    return _SET if isinstance(c, set) else _DEQUE


def _snapshot(c: object, kind: int) -> object:
    if kind == _DICT:
        return dict.copy(c)
    if kind == _LIST:
        return list.copy(c)
    if kind == _ODICT:
        return list(collections.OrderedDict.items(c))  # (its order, not the dict's)
    if kind == _SET:
        return set.copy(c)
    return list(collections.deque.__iter__(c))


def _put_back(c: object, kind: int, items) -> None:
    if kind == _DICT:
        dict.clear(c)
        dict.update(c, items)
    elif kind == _LIST:
        list.__setitem__(c, slice(None), items)
    elif kind == _ODICT:
        collections.OrderedDict.clear(c)
        for k, v in items:
            collections.OrderedDict.__setitem__(c, k, v)
    elif kind == _SET:
        set.clear(c)
        set.update(c, items)
    else:  # a deque (its ``maxlen`` is the object's own: unchanged)
        collections.deque.clear(c)
        collections.deque.extend(c, items)


def _set_item(c: object, k: object, v: object) -> None:
    # an item of a dict or a list set as its base class sets it
    if isinstance(c, collections.OrderedDict):
        collections.OrderedDict.__setitem__(c, k, v)
    elif isinstance(c, dict):
        dict.__setitem__(c, k, v)
    else:
        list.__setitem__(c, k, v)


def _object_dict(v: object) -> dict | None:
    # an object's own attribute dict, where it is one (not code, a class, a module, a tensor)
    if isinstance(v, _SNAP_NOT_OBJECTS):
        return None
    try:
        d = object.__getattribute__(v, "__dict__")
    except (AttributeError, TypeError):  # __slots__, a C type
        return None
    return d if type(d) is dict else None


class _State:
    # the attribute dicts of ``root``'s modules, the containers and objects reachable from them,
    # and the random number generators, copied before a trace (NOTE [A trace leaves the model as
    # it was])
    def __init__(self, root: nn.Module) -> None:
        self.root = root
        # (restore, read) of every generator (``_rng_states``); the module tree's are found by
        # the walk below, which reads every module attribute anyway
        self.rng_io: list[tuple[Callable, Callable]] = _global_rngs()
        self.cuda, self.numpy = torch.cuda.is_initialized(), "numpy" in sys.modules
        # (container, its ``_kind``, its items before the trace, as ``_snapshot`` reads them):
        # dicts (an object's attribute dict among them), lists, sets, deques; put back by
        # ``_put_back``
        self.saved: list[tuple[object, object]] = []
        # (put back, what it puts back): objects restored in place that are not containers
        # (``_inplace_io``: arrays, closure cells, ``__slots__``)
        self.inplace: list[tuple[Callable, object]] = []
        self.versions: dict[int, tuple[torch.Tensor, int]] = {}  # parameters and buffers
        # (container, key, original, its copy's maker): a plain tensor, or an object that can be
        # neither walked nor put back in place, swapped for a copy during a trace
        self.swapped: list[tuple[object, object, object, Callable]] = []
        self.copies_in = False  # the copies of ``swapped`` are in (until ``restore``)
        self.refused: list[str] = []  # what a trace could change and nothing could put back
        # (container, key, original): an object that can be swapped but not copied, replaced by
        # an ``_Unrestorable`` during a trace; ``touched``: the type names of those the trace used
        self.stood_in: list[tuple[object, object, object]] = []
        self.touched: list[str] = []
        seen: set[int] = set()
        mods = list(root.modules())
        owned = set()
        for d in mods:
            owned.update(id(t) for t in d._parameters.values() if t is not None)
            owned.update(id(t) for t in d._buffers.values() if t is not None)
        self.owned = owned
        self.memo: dict[int, object] | None = None  # ``_copy``'s deepcopy memo (made once)
        seen.update(id(d) for d in mods)  # (each is walked here, not as an object)
        for d in mods:
            self._walk(d.__dict__, seen, False)
        self.rngs = [(restore, read()) for restore, read in self.rng_io]

    def _walk(self, c: object, seen: set[int], held: bool) -> None:
        # ``held``: ``c`` is reached through an object's attributes (a tensor there is compared,
        # not copied: such an object may hold many, accelerate's offloaded weights among them)
        if id(c) in seen:
            return
        seen.add(id(c))
        if isinstance(c, tuple):
            items = [(None, v) for v in c]
        else:
            kind = _DICT if type(c) is dict else _kind(c)
            snap = dict.copy(c) if kind == _DICT else _snapshot(c, kind)
            self.saved.append((c, kind, snap))
            if kind == _DICT:
                items = snap.items()
            elif kind == _LIST:
                items = enumerate(snap)
            elif kind == _ODICT:
                items = snap
            else:  # a set, a deque: their items are not replaced one by one
                items = [(None, v) for v in snap]
            if type(c).__module__ not in _STDLIB and (d := _object_dict(c)) is not None:
                self._walk(d, seen, True)  # a user's container subclass: its own attributes
        for k, v in items:
            t = type(v)
            if t in _SNAP_ATOMS:
                continue
            if issubclass(t, torch.Tensor):
                if t is torch.Tensor and k is not None and not held and id(v) not in self.owned:
                    self.swapped.append((c, k, v, _tensor_copy))
                else:  # a parameter, a buffer, a tensor in a tuple or an object, a subclass
                    self.versions[id(v)] = (v, v._version)
            elif issubclass(t, _SNAP_CONTAINERS):
                self._walk(v, seen, held)
            elif id(v) in seen:
                continue
            else:
                seen.add(id(v))
                self._object(c, k, v, seen)

    def _object(self, c: object, k: object, v: object, seen: set[int]) -> None:
        # ``v`` (not a container, a tensor or an atom), held by ``c`` at ``k`` (None: in a tuple,
        # a set, a deque, a cell or an object's C fields, where no copy can be swapped in)
        if isinstance(v, (types.MethodType, types.MethodWrapperType)):  # ``count().__next__``
            self._walk((v.__self__, getattr(v, "__func__", None)), seen, True)
            return
        if isinstance(v, types.BuiltinMethodType):  # ``[].append``, ``np.zeros(3).fill``
            # (bound to a C object that holds nothing a trace could change, e.g. a pybind11
            # function's record: not refused for it)
            s = v.__self__
            if (
                isinstance(s, _SNAP_CONTAINERS)
                or _object_dict(s) is not None
                or (s is not None and (_inplace_io(s) is not None or _generator(s) is not None))
            ):
                self._walk((s,), seen, True)
            return
        if isinstance(v, _SNAP_IMMUTABLE):
            return
        if (io := _generator(v)) is not None:
            self.rng_io.append(io)
            return
        if isinstance(v, types.FunctionType):  # its defaults, closure cells and attributes
            for cell in v.__closure__ or ():
                self._inplace(_cell_io(cell), seen)
            self._walk((v.__defaults__ or (), v.__kwdefaults__ or {}, v.__dict__), seen, True)
            return
        if isinstance(v, functools.partial):
            self._walk((v.func, v.args, v.keywords), seen, True)
        if (io := _inplace_io(v)) is not None:
            self._inplace(io, seen)
            walked = True
        else:
            walked = False
        if (d := _object_dict(v)) is not None:
            # an object's own attributes (a SimpleNamespace, a dataclass, a plain object, a
            # module outside ``root``): its attribute dict is put back as a dict is
            self._walk(d, seen, True)
            walked = True
        if walked or isinstance(v, functools.partial) or _stateless(v):
            return
        # an object with state of its own that nothing here reads (``itertools.count``, an
        # iterator, a C extension's object): the trace gets a copy of it where one can be
        # swapped in, else it is refused
        if k is None:
            self.refused.append(type(v).__qualname__)
        elif (made := self._copy(v)) is not None:
            self.swapped.append((c, k, v, made))
        else:  # (a generator, a ``SimpleQueue``): only a forward that uses it is refused
            self.stood_in.append((c, k, v))

    def _inplace(self, io: tuple[Callable, Callable, Callable], seen: set[int]) -> None:
        restore, read, values = io
        self.inplace.append((restore, read()))
        self._walk(tuple(values()), seen, True)  # what it holds

    def _copy(self, v: object) -> Callable | None:
        # a maker of deep copies of ``v`` that share the module tree's modules and tensors (None
        # where ``v`` cannot be copied)
        if self.memo is None:
            self.memo = {}
            for d in self.root.modules():
                self.memo[id(d)] = d
                for t in (*d._parameters.values(), *d._buffers.values()):
                    self.memo[id(t)] = t

        def made() -> object:
            return copy.deepcopy(v, dict(self.memo))

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (itertools' pickling support is deprecated)
                made()
        except Exception:  # an object that refuses to be copied (a generator, a lock, a frame)
            return None
        return made

    def refusal(self) -> None:
        # raises before a trace where it could change what nothing can put back
        if self.refused:
            self._refuse(
                "every object its module tree holds to be one a trace can copy or put back",
                self.refused,
            )

    def check_touched(self) -> None:
        # raises where the trace used an object a stand-in replaced (after ``restore``)
        if self.touched:
            names = ", ".join(sorted(set(self.touched)))
            self._refuse(
                "a forward that uses only objects a trace can copy or put back",
                [f"one that uses {names}"],
            )

    def _refuse(self, expected: str, got) -> None:
        raise RuntimeError(
            f"slimgrad.convert_: {type(self.root).__name__}'s forward was not run by torch.fx; "
            f"expected {expected}, got {', '.join(sorted(set(got)))}. Nothing to fix: its source "
            "is read instead (NOTE [A trace leaves the model as it was] in "
            "convert_handlers/inplace_guard.py)"
        )

    def swap_in_copies(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for c, k, v, made in self.swapped:
                _set_item(c, k, made(v) if made is _tensor_copy else made())
        me = threading.get_ident()
        for c, k, v in self.stood_in:
            _set_item(c, k, _Unrestorable(v, self.touched, me))
        self.copies_in = True

    def restore(self) -> None:
        # (no comparison first: an item the trace left may be a Proxy, whose ``==`` records)
        clear, update = dict.clear, dict.update
        for c, kind, items in self.saved:
            if kind == _DICT:  # (``_put_back`` in line for the common kind)
                clear(c)
                update(c, items)
            else:
                _put_back(c, kind, items)
        for restore, st in self.inplace:
            restore(st)
        for restore, st in self.rngs:
            restore(st)
        self.copies_in = False

    def drew(self) -> bool:
        # whether the trace drew from a random number generator (read before ``restore``); one
        # that CUDA or NumPy brought up during the trace counts as a draw
        if (torch.cuda.is_initialized(), "numpy" in sys.modules) != (self.cuda, self.numpy):
            return True
        return not _same([st for _, st in self.rngs], [read() for _, read in self.rng_io])

    def bumped(self) -> list[torch.Tensor]:
        return [t for t, v in self.versions.values() if t._version != v]

    def check(self) -> None:
        # raises where a trace bumped a parameter's or buffer's version (after ``restore``)
        bumped = self.bumped()
        if bumped:
            raise RuntimeError(
                f"slimgrad.convert_: reading {type(self.root).__name__}'s forward with torch.fx "
                f"wrote {len(bumped)} of its parameters or buffers in place (a write fx ran "
                "instead of recording it); expected a forward whose writes to parameters and "
                "buffers go through the module's attributes (fx records those), and the values "
                "could not be put back. Fix: write them as self.<name> in forward (not through "
                "a list or dict that holds them), and load the model's weights again "
                "(NOTE [A trace leaves the model as it was] in convert_handlers/inplace_guard.py)"
            )


class _Touched(Exception):
    # raised by an ``_Unrestorable`` the trace used (NOTE [A trace leaves the model as it was])
    pass


class _Unrestorable:
    # stands in, during a trace, for an object that can be neither copied nor put back (NOTE [A
    # trace leaves the model as it was]): from the tracing thread, any use records the touch and
    # raises ``_Touched``; from another thread, the original serves it
    __slots__ = ("_sg_original", "_sg_touched", "_sg_thread")

    def __init__(self, original: object, touched: list, thread: int) -> None:
        object.__setattr__(self, "_sg_original", original)
        object.__setattr__(self, "_sg_touched", touched)
        object.__setattr__(self, "_sg_thread", thread)

    def __getattribute__(self, name: str):
        if name == "__class__":  # (``isinstance`` reads it)
            return _Unrestorable
        return _use(self, "__getattribute__", name)


def _use(s: _Unrestorable, name: str, *args, **kwargs):
    get = object.__getattribute__
    original = get(s, "_sg_original")
    if threading.get_ident() != get(s, "_sg_thread"):
        if name == "__getattribute__":
            return getattr(original, *args)
        return getattr(original, name)(*args, **kwargs)
    get(s, "_sg_touched").append(type(original).__qualname__)
    raise _Touched(f"a trace used a {type(original).__qualname__} it cannot put back")


def _use_method(name: str) -> Callable:
    def method(self, *args, **kwargs):
        return _use(self, name, *args, **kwargs)

    method.__name__ = name
    return method


for _name in (
    "__setattr__ __delattr__ __call__ __iter__ __next__ __aiter__ __anext__ __await__ __len__ "
    "__length_hint__ __bool__ __getitem__ __setitem__ __delitem__ __contains__ __enter__ "
    "__exit__ __aenter__ __aexit__ __repr__ __str__ __format__ __bytes__ __hash__ __eq__ __ne__ "
    "__lt__ __le__ __gt__ __ge__ __index__ __int__ __float__ __complex__ __buffer__ "
    "__release_buffer__ __reduce__ __reduce_ex__ __copy__ __deepcopy__ __dir__ __sizeof__ "
    "__add__ __sub__ __mul__ __matmul__ __truediv__ __floordiv__ __mod__ __pow__ __neg__ __pos__ "
    "__abs__ __invert__ __and__ __or__ __xor__ __lshift__ __rshift__ __radd__ __rsub__ __rmul__ "
    "__iadd__ __isub__ __imul__ __iand__ __ior__ __torch_function__ __array__ __fspath__"
).split():
    setattr(_Unrestorable, _name, _use_method(_name))
del _name


def _tensor_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(t.requires_grad) if t.is_leaf else t.clone()


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # no storage (sparse, nested)
        return 0


# objects a trace cannot change, or whose state is outside what a trace puts back (a class's or
# a module's attributes: NOTE [A trace leaves the model as it was]); not walked
_SNAP_IMMUTABLE = (
    type, types.ModuleType, types.CodeType, types.WrapperDescriptorType,
    types.MethodDescriptorType, types.GetSetDescriptorType, types.MemberDescriptorType,
    types.MappingProxyType, property, staticmethod, classmethod, frozenset, range, slice,
    re.Pattern, weakref.ref, type(threading.Lock()), type(threading.RLock()), torch.dtype,
    torch.device, torch.layout, torch.memory_format, torch.finfo, torch.iinfo, torch.fx.Proxy,
)  # fmt: skip


def _stateless(v: object) -> bool:
    if type(v) is object:  # a sentinel
        return True
    np = sys.modules.get("numpy")
    return np is not None and isinstance(v, (np.dtype, np.generic, np.ufunc))


def _inplace_io(v: object) -> tuple[Callable, Callable, Callable] | None:
    # (put back, read, what it holds) for an object whose state is put back in place: a NumPy
    # array, an ``array.array``, a ``bytearray``, an object's ``__slots__``
    np = sys.modules.get("numpy")
    if np is not None and isinstance(v, np.ndarray):
        if not v.flags.writeable:
            return (lambda st: None), (lambda: None), tuple
        return (lambda st: np.copyto(v, st)), v.copy, tuple
    if isinstance(v, (array.array, bytearray)):

        def put(st) -> None:
            v[:] = st

        return put, (lambda: copy.copy(v)), tuple
    names = _slot_names(type(v))
    if not names:
        return None

    def read() -> dict:
        got = {}
        for n in names:
            try:
                got[n] = object.__getattribute__(v, n)
            except AttributeError:  # an unset slot
                pass
        return got

    def put_slots(st: dict) -> None:
        for n in names:
            if n in st:
                object.__setattr__(v, n, st[n])
            else:
                try:
                    object.__delattr__(v, n)
                except AttributeError:
                    pass

    return put_slots, read, (lambda: read().values())


@functools.cache
def _slot_names(cls: type) -> tuple[str, ...]:
    # the ``__slots__`` a class and its bases declare (names mangled as Python stores them)
    out = []
    for k in cls.__mro__:
        slots = k.__dict__.get("__slots__", ())
        for n in (slots,) if isinstance(slots, str) else slots:
            if n in ("__dict__", "__weakref__"):
                continue
            if n.startswith("__") and not n.endswith("__"):
                n = f"_{k.__name__.lstrip('_')}{n}"
            out.append(n)
    return tuple(out)


def _cell_io(cell: types.CellType) -> tuple[Callable, Callable, Callable]:
    # a closure's cell (``nonlocal n; n += 1`` rebinds it): its contents put back
    def read() -> object:
        return cell.cell_contents if _full(cell) else _MISSING

    def put(st: object) -> None:
        if st is _MISSING:
            if _full(cell):
                del cell.cell_contents
        else:
            cell.cell_contents = st

    return put, read, (lambda: () if (c := read()) is _MISSING else (c,))


def _written(func, args: tuple, kwargs: dict) -> list:
    # the tensors a torch function call writes in place: its first argument for an in-place verb
    # (``add_``, ``__iadd__``, ``__setitem__``, a property's ``__set__``, ``inplace=True``),
    # and its ``out=``
    out: list = []
    schema = getattr(func, "_schema", None)
    if isinstance(func, torch._ops.OpOverload):  # a torch.ops operator: its schema says
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                out.append(args[i] if i < len(args) else kwargs.get(a.name))
        return out
    name = getattr(func, "__name__", "")
    if args and (
        _writes_name(name)
        or name == "requires_grad_"
        or name == "__set__"
        or _inplace_arg(func, args, kwargs)
    ):
        out.append(args[0])
    o = kwargs.get("out")
    if o is not None:
        out.extend(o if isinstance(o, (tuple, list)) else (o,))
    return out


def _inplace_arg(func, args: tuple, kwargs: dict) -> bool:
    if kwargs.get("inplace") is True:
        return True
    try:
        pos = _INPLACE_ARG_POS.get(func)
    except TypeError:  # unhashable
        return False
    return pos is not None and len(args) > pos and args[pos] is True


class _HeldWrites(TorchFunctionMode):
    # NOTE [A trace leaves the model as it was]: a write the trace would run on a tensor the walk
    # compares instead of copying (a parameter or buffer reached other than as an attribute, a
    # tensor in a tuple or held by an object) is refused before it runs
    def __init__(self, state: _State) -> None:
        super().__init__()
        self.state = state
        self.storages: set[int] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in _written(func, args, kwargs):
            if isinstance(t, torch.Tensor) and self._held(t):
                raise RuntimeError(
                    f"slimgrad.convert_: reading {type(self.state.root).__name__}'s forward "
                    f"with torch.fx would run {getattr(func, '__name__', func)!r} on a tensor "
                    "the model holds (not one of its parameters or buffers as an attribute, "
                    "which fx records); expected a forward whose in-place writes a trace can "
                    "put back, got a write to a tensor reached through a container or an object. "
                    "Nothing to "
                    "fix: the forward is not run and its source is read instead (NOTE [A trace "
                    "leaves the model as it was] in convert_handlers/inplace_guard.py)"
                )
        return func(*args, **kwargs)

    def _held(self, t: torch.Tensor) -> bool:
        if id(t) in self.state.versions:
            return True
        if self.storages is None:  # (read once, at the first write to a real tensor)
            self.storages = {p for v, _ in self.state.versions.values() if (p := _storage(v))}
        p = _storage(t)
        return p != 0 and p in self.storages


class untouched:  # noqa: N801 (a context manager read as a phrase: ``with untouched(m)``)
    """Run a torch.fx trace of ``root``'s forward (or any Python that runs it on Proxies) and
    leave every module below ``root``, and the random number generators, as they were
    (NOTE [A trace leaves the model as it was]). Yields the saved state (``drew()``: whether the
    Python drew a random number)."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root

    def __enter__(self) -> _State:
        self.state = _State(self.root)
        self.state.refusal()
        try:
            self.state.swap_in_copies()
        except BaseException:
            self.state.restore()
            raise
        self.mode = _HeldWrites(self.state)
        self.mode.__enter__()
        return self.state

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)
        self.state.restore()
        if exc[0] is None:
            self.state.check()
        self.state.check_touched()  # (also where the forward's use of a stand-in raised)


# ``_rng_states``: every random number generator a forward may draw from in Python at trace
# time, as (restore, read its state): Python's, torch's (CPU, and CUDA's once initialised),
# NumPy's global one (``_global_rngs``), and the generators the module tree holds as attributes
# (``_generator``, for each attribute value ``_State``'s walk meets)
def _global_rngs() -> list[tuple[Callable, Callable]]:
    found: list[tuple[Callable, Callable]] = [
        (random.setstate, random.getstate),
        (torch.random.set_rng_state, torch.random.get_rng_state),
    ]
    if torch.cuda.is_initialized():
        found.append((torch.cuda.set_rng_state_all, torch.cuda.get_rng_state_all))
    if (np := sys.modules.get("numpy")) is not None:
        found.append((np.random.set_state, np.random.get_state))
    return found


def _generator(v: object) -> tuple[Callable, Callable] | None:
    if isinstance(v, random.Random):
        return v.setstate, v.getstate
    if isinstance(v, torch.Generator):
        return v.set_state, v.get_state
    np = sys.modules.get("numpy")
    if np is not None and isinstance(v, np.random.RandomState):
        return v.set_state, v.get_state
    if np is not None and isinstance(v, np.random.Generator):
        bits = v.bit_generator
        return (lambda st, bits=bits: setattr(bits, "state", st)), (lambda bits=bits: bits.state)
    return None


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except ValueError:  # NumPy's state holds an array: ``==`` is elementwise
        if isinstance(a, tuple):
            return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
        return bool((a == b).all())


def _trace_every_call(m: nn.Module) -> torch.fx.Graph:
    # NOTE [Modules whose output is the model's output]: a torch.fx trace runs forward once, so a
    # branch on a value that is not a Proxy is taken as it fell at trace time. Settings of the
    # module stay as they are (change one: run convert_ again), but the mode changes after
    # convert_ and a random draw changes every call (a plain-torch LayerDrop: ``if self.training
    # and random.random() < p: continue``; ``self.layers[random.randrange(n)]``). The trace is
    # used only when it is the same in train and in eval mode and drew from no generator;
    # otherwise (raised here) the forward's source is read, as an untraceable forward's is, which
    # follows every branch. The modes and the generators' states are restored after the traces.
    return _Read.of(m).every_call()


# NOTE [One reading of the structure per convert_]
# ``convert_`` reads a model's structure where several passes need it: the in-place guard (which
# outputs an in-place write follows), the BatchNorm + ReLU pattern (``abn.py``: which BN feeds
# which ReLU) and, after the swaps, the reading of the converted model (``state_consumers_``:
# which outputs may be the model's, NOTE [Modules whose output is the model's output]). Reading a
# plain-torch forward means tracing it with torch.fx, every child a leaf, which is most of what
# ``convert_`` costs on a CNN or a ViT. Each forward is traced once per call, before anything is
# swapped (``_Read``: train mode and eval mode, one trace for both where the forward cannot read
# a mode flag: NOTE [One trace serves both modes]; the generators' states restored; a module whose
# facts equal an earlier one's takes its reading: NOTE [Modules that read alike share a reading]),
# and kept in ``Traces`` (``Structure.traces``); the later readings take it from there:
#   - the converted model: a module the swaps left where it was (a parent whose children were
#     replaced, a module kept eager) has the trace it had: the trace names a leaf child by its
#     attribute, and a swap puts the replacement at that same attribute. Where the forward may
#     read a child other than by calling it (its type, an attribute, a helper handed it) and a
#     module below it was swapped, it is traced again (NOTE [A forward that reads its
#     children]). A module the swaps made is read from the structure its class states (NOTE [A
#     replacement states its structure]); one that states none is traced then. The reading
#     follows the class's forward (fx traces ``type(m).forward``; the source read is the
#     class's), so an instance ``forward`` changed since the reading changes nothing read;
#   - the BatchNorm + ReLU pattern: the trace in the mode the modules are in, where it is the one a
#     plain ``torch.fx.Tracer`` would make (``Traces.as_called``): no draw from a generator (its own
#     trace would advance it), no ``h[...] = v`` (a plain Proxy raises there); else its own trace.
# The forward sources (``_forward_ast``) are parsed once per function for the process. A call of
# ``state_consumers_`` after changing the model reads it afresh (no traces given). ownership's
# ``_trace_stand_in`` keeps its own trace: it asks another question, after the swaps (which
# children's inputs are fresh, from the replacements' own statements), of a stand-in (so the
# trace cannot change the model), and it needs what a fx graph does not hold: the attribute names
# the forward reads and the Proxies it keeps alive (S2, S3 of NOTE [Forward ownership from stated
# structure] in slimgrad/ownership.py).
@dataclass(eq=False)
class _Read:
    # one module's fx traces (NOTE [One reading of the structure per convert_]): every child a
    # leaf, all flags ``training`` set to True, then to False; None where that trace raised
    module: nn.Module
    forward: object  # the instance's own forward at the reading, or None
    train: torch.fx.Graph | None
    eval: torch.fx.Graph | None
    drew: bool  # a trace drew from a random number generator
    same: bool  # both traced, and to the same graph
    # the names of the nodes whose tensors either trace left on a module (NOTE [An output kept on
    # the module escapes]); the graphs are the same where they are read, and so are the names
    kept: frozenset[str] = frozenset()

    @classmethod
    def of(cls, m: nn.Module) -> _Read:
        modes = {d: d.training for d in m.modules()}
        graphs: list = [None, None]
        drew = False
        kept: frozenset[str] = frozenset()
        state = _State(m)  # one snapshot for both traces; each puts it back and checks it
        blind = _mode_blind(m)  # NOTE [One trace serves both modes]
        try:
            for i, mode in enumerate((True, False)):
                if i and blind:
                    graphs[1] = graphs[0]
                    break
                for d in modes:  # the flag alone: a module's own train() may do more (freeze, ...)
                    d.training = mode
                try:
                    graphs[i], d_i, k_i = _trace(m, state)
                except Exception:  # fx raises many types on Python it cannot trace
                    break
                drew = drew or d_i
                kept = kept | k_i
        finally:
            state.restore()
            for d, mode in modes.items():
                d.training = mode
        train, ev = graphs
        same = train is not None and ev is not None and (train is ev or _text(train) == _text(ev))
        return cls(m, m.__dict__.get("forward"), train, ev, drew, same, kept)

    def every_call(self) -> torch.fx.Graph:
        if self.drew or not self.same:
            raise _TraceDependsOnCall
        return self.train


# NOTE [Modules that read alike share a reading]
# A model repeats its blocks (a ResNet stage's bottlenecks after the first, a ViT's blocks): one
# class, one configuration, the same children. Their traces are the same graph, and each costs a
# torch.fx trace in train and in eval mode (a timm resnet50 read 16 blocks for 8 configurations).
# So before ``convert_`` swaps anything (the guard's first reading, ``every_call`` without
# ``after_swaps``: nothing changes the model between two readings there), a module whose facts
# (``_alike_key``) equal those of a module read before takes that reading, with itself as the
# module. The facts are everything a trace of the module can read of it: its class (so its class
# forward) and, over the module and every module below it, each attribute: numbers, strings,
# None, dtypes and devices by value; tuples, lists and dicts (``OrderedDict`` and ``_modules``
# among them) item by item, in order; a parameter or buffer by its class, shape, dtype, device,
# layout and ``requires_grad`` (the trace reads them as Proxies: ``proxy_buffer_attributes``,
# and a parameter handed to an op as its name, never its values); anything else (a plain tensor,
# a function, a forward set on the instance, a config object, a hook) by identity, kept alive
# for the reading so its id is not reused. Objects met twice are numbered in the order first met,
# so aliasing inside the tree (a child held under two names, a tied weight) is a fact too. Two
# modules with equal facts run the same Python on the same values, so the trace, whether it drew
# from a generator and the names of what it left on a module are the same. After the swaps a
# module is read on its own (patches have changed configs and forwards by then). A float is keyed
# by its bits (``0.0`` and ``-0.0`` compare equal but ``copysign`` tells them apart). What the
# facts cannot see is how a forward reaches its module: a parameter's or buffer's values through
# ``buffers()``, ``_buffers[...]`` or a list that holds it (real tensors, not Proxies), a
# setting in ``__slots__``, the module's own identity (``self is self.owner.last``, a global
# registry of modules): a user's forward may branch on any of these (review33a built one pair of
# each whose writer then got the plain block's reading). So readings are shared only where every
# class in the module's tree is defined by a library whose forwards read their modules through
# attributes (``_ALIKE_LIBRARIES``: torch, torchvision, timm, transformers; the class's
# ``__module__``, a fact the class states); a tree with any other class is read on its own, as
# every module was before. Not covered, as for the traces themselves (NOTE [A trace leaves the
# model as it was]): state outside what the module tree reaches (a global counter a forward
# branches on).
_ALIKE_ATOMS = frozenset({bool, int, complex, str, bytes, type(None), torch.dtype,
                          torch.device, torch.Size})  # fmt: skip
_ALIKE_LIBRARIES = frozenset({"torch", "torchvision", "timm", "transformers"})


def _library_tree(m: nn.Module) -> bool:
    # NOTE [Modules that read alike share a reading]: every class in the tree from a library
    libs = _ALIKE_LIBRARIES
    return all(type(d).__module__.partition(".")[0] in libs for d in m.modules())


def _alike_key(m: nn.Module, keep: list) -> tuple:
    # NOTE [Modules that read alike share a reading]: ``keep`` holds what is keyed by identity
    order: dict[int, int] = {}

    def tensor(t: torch.Tensor | None) -> tuple:
        if t is None:
            return (None,)
        if id(t) in order:
            return ("seen", order[id(t)])
        order[id(t)] = len(order)
        keep.append(t)
        return (type(t), tuple(t.shape), t.dtype, t.device, t.layout, t.requires_grad)

    def fact(v: object) -> object:
        tv = type(v)
        if tv in _ALIKE_ATOMS:
            return (tv, v)
        if tv is float:
            return (tv, v.hex())
        if id(v) in order:
            return ("seen", order[id(v)])
        order[id(v)] = len(order)
        keep.append(v)
        if tv is tuple or tv is list:
            return (tv, tuple(fact(x) for x in v))
        if tv is dict or tv is collections.OrderedDict:
            return (tv, tuple((fact(k), fact(x)) for k, x in v.items()))
        if (tv is set or tv is frozenset) and all(type(x) in _ALIKE_ATOMS for x in v):
            return (tv, frozenset((type(x), x) for x in v))  # (``_non_persistent_buffers_set``)
        if isinstance(v, nn.Module) and id(v) in below:
            return module(v)
        return ("is", id(v))

    def module(d: nn.Module) -> tuple:
        out = [type(d)]
        for k, v in d.__dict__.items():
            if k == "_parameters" or k == "_buffers":
                out.append((k, tuple((n, tensor(t)) for n, t in v.items())))
            else:
                out.append((k, fact(v)))
        return tuple(out)

    below = {id(d) for d in m.modules()}
    order[id(m)] = 0
    return module(m)


class Traces:
    """The fx traces of a model's module forwards, each module traced once (NOTE [One reading of
    the structure per convert_]): the in-place guard's reading fills it before anything is
    swapped; the patterns and the reading of the converted model read it."""

    def __init__(self) -> None:
        # {id(module): its reading}; the reading holds the module, so ids stay unique
        self._got: dict[int, _Read] = {}
        # {id(module): (module, its children)} as the first reading found them (``note_tree``)
        self._tree: dict[int, tuple[nn.Module, tuple]] = {}
        # {id(module): whether a module below it is not the one the first reading found}
        self._changed: dict[int, bool] = {}
        self._read_after: set[int] = set()  # modules read again after the swaps
        # NOTE [Modules that read alike share a reading]: {facts: a reading before the swaps},
        # and what the facts name by identity
        self._alike: dict[tuple, _Read] = {}
        self._alike_kept: list = []

    def note_tree(self, model: nn.Module) -> None:
        """Keep each module's children as they are now (the first reading's model), so a later
        reading knows what the swaps changed below a module."""
        tree = self._tree
        for m in model.modules():
            tree[id(m)] = (m, tuple(m._modules.values()))
        self._changed.clear()

    def read_before_swaps(self, m: nn.Module) -> bool:
        """Whether ``m`` was in the model ``note_tree`` kept (not a module the swaps made)."""
        snap = self._tree.get(id(m))
        return snap is not None and snap[0] is m

    def every_call(self, m: nn.Module, after_swaps: bool = False) -> torch.fx.Graph:
        """``m``'s trace where it is the same in train and eval mode and drew nothing (read now
        if ``m`` was not read; ``after_swaps``: also where the swaps changed a module below ``m``
        and its forward may read a child other than by calling it), else raises."""
        got = self._got.get(id(m))
        if got is None or got.module is not m:
            got = self._got[id(m)] = self._read(m, after_swaps)
        elif (
            after_swaps
            and id(m) not in self._read_after
            and self.changed_below(m)
            and _reads_children(m)
        ):  # NOTE [A forward that reads its children]
            self._read_after.add(id(m))
            got = self._got[id(m)] = _Read.of(m)
        return got.every_call()

    def _read(self, m: nn.Module, after_swaps: bool) -> _Read:
        if after_swaps or not _library_tree(m):
            return _Read.of(m)
        try:  # NOTE [Modules that read alike share a reading]
            key = _alike_key(m, self._alike_kept)
            hash(key)
        except Exception:  # a fact that cannot be read (a lazy parameter's shape): read it alone
            return _Read.of(m)
        got = self._alike.get(key)
        if got is None:
            got = self._alike[key] = _Read.of(m)
            return got
        return dataclasses.replace(got, module=m, forward=m.__dict__.get("forward"))

    def kept(self, m: nn.Module) -> frozenset[str]:
        """The names of the nodes of ``m``'s trace whose tensors its forward left on a module
        (NOTE [An output kept on the module escapes]); read after :meth:`every_call`."""
        got = self._got.get(id(m))
        return got.kept if got is not None and got.module is m else frozenset()

    def changed_below(self, m: nn.Module) -> bool:
        """Whether a module below ``m`` is not the one ``note_tree`` found there (a module it
        did not see counts as changed)."""
        got = self._changed.get(id(m))
        if got is None:
            snap = self._tree.get(id(m))
            kids = tuple(m._modules.values())
            if snap is None or snap[0] is not m or len(kids) != len(snap[1]):
                got = True
            else:
                got = any(a is not b for a, b in zip(kids, snap[1], strict=True)) or any(
                    self.changed_below(c) for c in kids if c is not None
                )
            self._changed[id(m)] = got
        return got

    def as_called(self, m: nn.Module) -> torch.fx.Graph | None:
        """The trace a plain ``torch.fx.Tracer`` (every child a leaf) would make of ``m`` now,
        where the reading has it: the modules below ``m`` all in the mode of a trace that
        succeeded, no draw from a generator (a trace of its own would advance that generator),
        no item assignment (a plain Proxy raises there), the same instance ``forward``; else
        None. ``h += r`` is an ``operator.iadd`` node where a plain tracer records ``add``: the
        same nodes and users."""
        got = self._got.get(id(m))
        if got is None or got.module is not m or got.drew:
            return None
        if got.forward is not m.__dict__.get("forward"):
            return None
        modes = {d.training for d in m.modules()}
        graph = got.train if modes == {True} else got.eval if modes == {False} else None
        if graph is None or any(
            n.op == "call_function" and n.target is operator.setitem for n in graph.nodes
        ):
            return None
        return graph


# NOTE [A replacement states its structure]
# A module the swaps made has no reading from before them, and tracing it then would read again
# what its original's reading already knew (24 of 100 traces of a timm ViT-Tiny's convert_). Its
# class states, for the question the reading of the converted model asks (which modules' outputs
# may be its output), how its output is made: ``_slimgrad_output_statement = (forward, chain)``,
# ``chain`` a tuple (or a function of the instance returning one) of child names through which the
# forward's output passes, in order, as through an nn.Sequential's children, starting from the
# forward's first argument, ``None`` standing for a value the forward makes afresh (an op that
# allocates its result: ``qkv_attention``, ``squeeze_excite``, ``a + b``). So timm's Attention
# states ``(None, "norm", "proj", "proj_drop")``, GPT-2's MLP ``("c_fc", "act", "c_proj",
# "dropout")``, timm's norm + act blocks ``("drop", "act")`` (the norm read as the guard reads
# ``F.batch_norm``, which ATen does not state to be fresh: as if it returned its input). It covers
# every path of the forward, its fast path and the original's forward it falls back to (the same
# children in the same order, or a fresh value where the fast path computes a child's work
# itself), and it holds while ``type(m).forward`` is the stated function and every named child is
# there (else the module is traced). Each chain is checked against the guard's reading of the
# original module it replaces (tests/test_convert_stated_structure.py): it names at least the
# modules that reading finds, and passes the input on where that reading does, so the converted
# model is read as conservatively as the model was; a fresh reading of the converted model
# (``state_consumers_`` without traces) takes the same statements.


# NOTE [A forward that reads its children]
# A kept module's trace from before the swaps is the trace of the converted module only where its
# forward's Python ran the same way: a forward that looks at a child other than by calling it
# (``type(self.act) is nn.GELU``, ``isinstance``, ``self.act.__class__``, an attribute of it, the
# child handed to a function or kept in a name, ``self.children()``, ``getattr(self, ...)``,
# ``super()``) may take another path once that child is slimgrad's. ``_reads_children`` reads the
# class's forward source (parsed once per function), following the methods of the module it calls
# (properties included), and answers True unless every use of the module's name in it is an
# attribute that is not a child (a parameter, buffer or setting), a child called
# (``self.fc(x)``, ``self.layers[i](x)``), a child's presence (``self.norm is None``), the length
# of a child container, or a loop over a container whose items are only called; a branch whose
# test reads number, None and bool settings of the module (``if self.grad_checkpointing``) is
# followed only where those settings lead now, as the trace followed them (the mode is not
# known: both traces ran). A source it cannot read, or a decorated function (the decorator's code
# runs too), counts as a read. After the swaps (``Traces.every_call(..., after_swaps=True)``), a
# module with such a forward below which a module was swapped (``Traces.changed_below``, against
# the children ``note_tree`` kept before them) is traced again, once; every other kept module
# keeps its trace. Not followed: a child
# reached through state outside the module tree (a global, a closure, a callable stored on the
# module that holds a child).
def _reads_children(m: nn.Module) -> bool:
    return _ChildReads(m).function(getattr(type(m), "forward", None))


class _ChildReads:
    # NOTE [A forward that reads its children]
    def __init__(self, m: nn.Module) -> None:
        self.m, self.cls, self.kids = m, type(m), m._modules
        self.done: set = set()

    def function(self, fn) -> bool:
        if fn in self.done:
            return False
        self.done.add(fn)
        if fn is None or _unwrap(fn) is not fn:  # a decorator's code runs too
            return True
        fdef = _forward_ast(fn)
        params = fdef.args.posonlyargs + fdef.args.args if fdef is not None else []
        if not params:
            return True
        me = params[0].arg
        return any(self.node(st, fdef, me, frozenset()) for st in fdef.body)

    def kid(self, e, me: str) -> bool:
        return (
            isinstance(e, ast.Attribute)
            and isinstance(e.value, ast.Name)
            and e.value.id == me
            and e.attr in self.kids
        )

    def loop_names(self, s: ast.For, me: str) -> frozenset | None:
        # ``for v in self.<kids>`` / ``enumerate(self.<kids>)`` / ``self.<kids>[a:b]``: v
        it, target = s.iter, s.target
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate":
            if len(it.args) != 1 or it.keywords or not isinstance(target, ast.Tuple):
                return None
            it, target = it.args[0], target.elts[-1] if len(target.elts) == 2 else None
        if isinstance(it, ast.Subscript) and isinstance(it.slice, ast.Slice):
            it = it.value
        if self.kid(it, me) and isinstance(target, ast.Name):
            return frozenset({target.id})
        return None

    def node(self, n, parent, me: str, loops: frozenset) -> bool:
        if isinstance(n, ast.If):
            if self.node(n.test, n, me, loops):
                return True
            known = _static(n.test, self.m, me, switches=True)
            bodies = (n.body, n.orelse) if known is None else ((n.body if known else n.orelse),)
            return any(self.node(st, n, me, loops) for body in bodies for st in body)
        if isinstance(n, ast.For) and (names := self.loop_names(n, me)) is not None:
            bounds = [s for s in ast.walk(n.iter) if isinstance(s, ast.Slice)]
            if any(self.node(b, None, me, loops) for b in bounds):
                return True
            return any(self.node(st, n, me, loops | names) for st in n.body + n.orelse)
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Name) and f.id == "super":
                return True
            if isinstance(f, ast.Subscript) and self.kid(f.value, me):  # self.layers[i](x)
                rest = [f.slice, *n.args, *n.keywords]
                return any(self.node(c, n, me, loops) for c in rest)
            if (
                isinstance(f, ast.Name)
                and f.id == "len"
                and len(n.args) == 1
                and self.kid(n.args[0], me)
            ):  # a swap keeps a container's length
                return False
        if isinstance(n, ast.Name):
            if n.id == me:  # the module itself handed to other code
                return not isinstance(parent, ast.Attribute)
            if n.id in loops:  # an item of a child container: called, or read
                return not (isinstance(parent, ast.Call) and parent.func is n)
            return False
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == me:
            return self.attribute(n, parent)
        return any(self.node(c, n, me, loops) for c in ast.iter_child_nodes(n))

    def attribute(self, n: ast.Attribute, parent) -> bool:
        a = n.attr
        called = isinstance(parent, ast.Call) and parent.func is n
        if a in self.kids:
            if called:
                return False
            if (
                isinstance(parent, ast.Compare)
                and len(parent.ops) == 1
                and isinstance(parent.ops[0], (ast.Is, ast.IsNot))
                and any(isinstance(c, ast.Constant) and c.value is None for c in parent.comparators)
            ):  # a child's presence: a swap puts a module where a module was
                return False
            return True
        if a in ("_modules", "__dict__", "__class__"):
            return True
        try:
            found = inspect.getattr_static(self.cls, a)
        except AttributeError:  # an instance attribute: a parameter, buffer or setting
            return False
        if isinstance(found, property):
            return self.function(found.fget)
        if isinstance(found, (staticmethod, classmethod)):
            return False  # it reaches the module only through the arguments read at the call
        if inspect.isfunction(found):
            if getattr(nn.Module, a, None) is found or not called:
                return True  # children(), modules(), ...; a bound method handed on
            return self.function(found)
        return hasattr(type(found), "__get__")  # a descriptor runs code; a class value does not


# NOTE [One trace serves both modes]
# ``_Read`` traces a forward in train mode and in eval mode because the Python a trace runs may
# branch on a ``training`` flag (the module's own, a child's); the flags are all that differs
# between the two traces. Where that Python cannot read a flag, both traces run the same code on
# the same values, so they make the same graph, draw the same numbers and leave the same Proxies:
# the train trace is taken for eval too. (A torch.fx trace patches ``nn.Module.__call__`` and
# ``__getattr__`` and puts them back, and CPython updates every subclass of ``nn.Module`` on each
# of those four writes: with timm imported, most of what a trace costs.) ``_mode_blind`` says so
# only where the class's forward passes ``_ChildReads`` (NOTE [A forward that reads its
# children]: the module reaches its children only by calling them, testing their presence,
# counting them or calling the items of a loop over them; the module itself is never handed on,
# ``super()`` is not called, no function is decorated) and, in the forward and in each method
# and property of the class it reaches (every branch, taken or not):
#   - ``training`` is not written anywhere (a name, an attribute, a string, a keyword);
#   - each ``self.<name>`` that is not a child, a method or a property is a value that runs no
#     code: a number, a string, None, a dtype, a device, a plain tensor or ``nn.Parameter`` (a
#     buffer, a parameter; not a subclass, whose methods run its class's code), or a tuple or
#     list of those;
#   - each call is of a child, of the items of a loop over a child container, of a method of the
#     class, of a method of a value the forward holds (a Proxy's, a number's), or of a name or
#     dotted name that the function's globals, closure or builtins resolve to a torch function,
#     a builtin (``eval``, ``exec``, ``globals``, ``locals``, ``vars`` aside), an ATen operator,
#     or a class of ``builtins`` or torch;
#   - every other name read from the globals, closure or builtins is a module, one of those
#     callables, or a value that runs no code; no ``global`` or ``nonlocal`` statement.
# A callable stored on the module, a lambda held in a container, a function of the user's, an
# object reached through a global: any may read a flag, and both modes are traced, as before.
# Not covered, as for the traces themselves (NOTE [A trace leaves the model as it was]): state
# outside the module tree that a forward changes and branches on (a global counter).
_BLIND_ATOMS = frozenset({bool, int, float, complex, str, bytes, type(None), torch.dtype,
                          torch.device, torch.Size})  # fmt: skip
_BLIND_UNSAFE = frozenset(
    id(f) for f in (eval, exec, globals, locals, vars, compile, __import__, breakpoint)
)


def _mode_blind(m: nn.Module) -> bool:
    # NOTE [One trace serves both modes]; a source this cannot read: both modes are traced
    reads = _ChildReads(m)
    try:
        if reads.function(getattr(type(m), "forward", None)):
            return False
        return all(_blind_function(fn, m, reads) for fn in reads.done)
    except Exception:
        return False


def _runs_no_code(v: object, depth: int = 0) -> bool:
    # a plain tensor or parameter only: a subclass's methods and properties run its class's code,
    # which may read a flag (``self.flag.on()`` returning its owner's ``training``)
    if type(v) in _BLIND_ATOMS or type(v) is torch.Tensor or type(v) is nn.Parameter:
        return True
    if type(v) in (tuple, list) and depth < 4:
        return all(_runs_no_code(x, depth + 1) for x in v)
    return False


def _blind_callable(v: object) -> bool:
    if isinstance(v, type):
        mod = v.__module__ or ""
        return mod == "builtins" or mod == "torch" or mod.startswith("torch.")
    return id(v) not in _BLIND_UNSAFE and _known_function(v)


def _blind_value(v: object) -> bool:
    return isinstance(v, types.ModuleType) or _runs_no_code(v) or _blind_callable(v)


def _blind_function(fn, m: nn.Module, reads: _ChildReads) -> bool:
    # NOTE [One trace serves both modes]: ``fn`` (read by ``_ChildReads``) reads no flag
    fdef = _forward_ast(fn)
    params = fdef.args.posonlyargs + fdef.args.args if fdef is not None else []
    if not params or "training" in ast.dump(fdef):
        return False
    me, kids, cls = params[0].arg, m._modules, type(m)
    # annotations are not run at a call (nor at all, under ``from __future__ import annotations``)
    notes = [a.annotation for a in ast.walk(fdef.args) if isinstance(a, ast.arg)]
    notes += [fdef.returns] + [n.annotation for n in ast.walk(fdef) if isinstance(n, ast.AnnAssign)]
    skip = {id(x) for t in notes if t is not None for x in ast.walk(t)}
    nodes = [n for n in ast.walk(fdef) if id(n) not in skip]
    if any(isinstance(n, (ast.Global, ast.Nonlocal)) for n in nodes):
        return False
    local = {a.arg for a in nodes if isinstance(a, ast.arg)}
    local |= {n.id for n in nodes if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    local |= {
        (a.asname or a.name).partition(".")[0]
        for n in nodes
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in n.names
    }
    reads_done = reads.done
    looped = set()  # the items of a loop over a child container: called
    for n in nodes:
        if isinstance(n, ast.For) and (names := reads.loop_names(n, me)) is not None:
            looped |= names
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True))

    def outer(name: str) -> object:
        if name in cells:
            return cells[name].cell_contents if _full(cells[name]) else _MISSING
        if name in fn.__globals__:
            return fn.__globals__[name]
        return getattr(builtins, name, _MISSING)

    def dotted(e) -> object:  # the value a global (dotted) name resolves to, or _MISSING
        if isinstance(e, ast.Name):
            return _MISSING if e.id in local else outer(e.id)
        if isinstance(e, ast.Attribute):
            base = dotted(e.value)
            if isinstance(base, types.ModuleType) or isinstance(base, type):
                return getattr(base, e.attr, _MISSING)
        return _MISSING

    def root(e):
        while isinstance(e, ast.Attribute):
            e = e.value
        return e

    for n in nodes:
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == me:
                if f.attr in kids or _runs_no_code(m.__dict__.get(f.attr, _MISSING)):
                    continue  # a child, or a setting (None: ``self.conv_exp(x)`` raises)
                found = inspect.getattr_static(cls, f.attr, None)
                if not (inspect.isfunction(found) and found in reads_done):
                    return False
            elif isinstance(f, ast.Subscript) and reads.kid(f.value, me):
                continue  # self.layers[i](x)
            elif isinstance(f, ast.Name) and f.id in local:
                if f.id not in looped:
                    return False
            elif isinstance(f, ast.Attribute) and not (
                isinstance(r := root(f), ast.Name) and r.id not in local
            ):
                continue  # a method of a value the forward holds (``h.relu_()``)
            elif not _blind_callable(dotted(f)):
                return False
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            if n.id != me and n.id not in local and not _blind_value(outer(n.id)):
                return False
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == me:
            a = n.attr
            if a in kids:
                continue
            found = inspect.getattr_static(cls, a, _MISSING)
            if isinstance(found, property):
                if found.fget not in reads_done:
                    return False
            elif inspect.isfunction(found):
                if found not in reads_done:
                    return False
            elif found is not _MISSING and a not in m.__dict__:
                if not _runs_no_code(found):  # a class attribute
                    return False
            else:  # an instance attribute: a setting, a parameter or buffer
                v = m.__dict__.get(a, _MISSING)
                if v is _MISSING:
                    v = m._parameters.get(a, m._buffers.get(a, _MISSING))
                if not _runs_no_code(v):
                    return False
    return True


def _text(graph: torch.fx.Graph) -> str:
    # each trace names the tensor constants it stores on the root afresh (_tensor_constant0, 1..)
    return re.sub(r"_tensor_constant\d+", "_tensor_constant", str(graph))


class _TraceDependsOnCall(Exception):
    pass


class _Guard:
    def __init__(
        self, outputs: tuple[type, ...] | None = None, traces: Traces | None = None
    ) -> None:
        self.memo: dict[int, _Info] = {}
        self.traces = traces if traces is not None else Traces()
        self.keep: dict[nn.Module, str] = {}
        # NOTE [Modules whose output is the model's output]: the kinds asked about, or None (the
        # in-place guard's own run, unchanged)
        self.outputs = outputs
        self.methods: dict[tuple[int, object], set] = {}
        # {(id(module), method): what its source writes and returns} (``_Flow.helper``)
        self.helpers: dict[tuple[int, object], tuple] = {}
        # {id(module): the modules its output may be given to} (NOTE [Hooks on the modules around
        # an output-saving one])
        self.fed: dict[int, list[nn.Module]] = {}
        # the modules whose output may be kept on a module past its forward (NOTE [An output
        # kept on the module escapes])
        self.escaped: dict[int, nn.Module] = {}

    def escape(self, held) -> None:
        for e in held:
            if isinstance(e, nn.Module):
                self.escaped.setdefault(id(e), e)

    def feeds(self, child: nn.Module, held) -> None:
        # ``child`` is called with what ``held`` holds: the modules there feed it
        for e in held:
            if isinstance(e, nn.Module):
                self.fed.setdefault(id(e), []).append(child)

    def flag(self, ends: list[nn.Module], writer: str, by: nn.Module | None = None) -> None:
        # ``by``: the child that writes (its own in-place op is not a write after it)
        for m in ends:
            if _is_source(m):  # NOTE [A write after a BatchNorm output was claimed]
                for c in self.claimants(m, by):
                    self.keep.setdefault(c, _REASON_CLAIM.format(writer, type(m).__name__))
                continue
            self.keep.setdefault(m, _REASON.format(writer, type(m).__name__))

    def claimants(self, bn: nn.Module, by: nn.Module | None) -> list[nn.Module]:
        # the ReLUs the BatchNorm's output was given to so far (directly, or as the input of a
        # module that hands its input to one: ``_Info.takes``), the writer itself excepted
        out, todo, done = [], list(self.fed.get(id(bn), ())), set()
        while todo:
            c = todo.pop()
            if c is by or id(c) in done:
                continue
            done.add(id(c))
            if isinstance(c, nn.ReLU):
                out.append(c)
            info = self.memo.get(id(c))
            todo.extend(info.takes if info is not None else ())
        return out

    def info(self, m: nn.Module) -> _Info:
        key = id(m)
        if key not in self.memo:
            self.memo[key] = _Info()  # placeholder; the module tree has no cycles
            info = self._analyse(m)
            if info.writes:  # NOTE [Why a module writes its input, in the report]
                info.cause = _analysed_cause(m)
            if self.outputs is None and _hooked(m):
                # NOTE [What a hook registered before convert_ may write]
                if (why := _hook_writes(m)) is not None:
                    self.flag(info.ends, why)
                    if info.passes and not info.writes:
                        info.writes = True
                        info.cause = f"which may return its input, and has {_unhedged(why)}"
                if (pre := _pre_hook_writes(m)) is not None:
                    info.writes = True
                    info.cause = info.cause or f"which {pre} that may write its input"
                if (after := _hook_writes_input(m)) is not None:
                    info.writes = info.after = True
                    info.cause = info.cause or (
                        f"which {after} that may write its input after its forward"
                    )
            self.memo[key] = info
        return self.memo[key]

    def _analyse(self, m: nn.Module) -> _Info:
        inplace = getattr(m, "inplace", False) is True
        own = m.__dict__.get("forward")
        if own is not None and (kind := _instance_kind(own, m)) != "class":
            return self._instance(m, own, kind)  # NOTE [A forward set on the instance]
        if self.outputs is not None and isinstance(m, self.outputs):
            return _Info(ends=[m], writes=inplace)
        if _saves_output(m):
            return _Info(ends=[m], writes=inplace)
        if self.outputs is None and _is_source(m):
            return _Info(ends=[m])  # NOTE [A write after a BatchNorm output was claimed]
        if isinstance(m, _PASS_MODULES):
            return _Info(writes=inplace, passes=True)
        if isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward:
            return self._sequential(m)
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            return _Info(writes=inplace)
        if _is_hf(m):
            return _source_info(self, m, inplace)
        if not m._modules and type(m).__module__.startswith("torch."):
            return _Info(writes=inplace)  # a torch leaf: its 'inplace' says whether it writes
        if type(m).__module__.startswith("slimgrad."):
            if self.outputs is None or not m._modules:
                return _Info()  # (a slimgrad module with children is read as any other module)
            if (stated := self._stated(m)) is not None:
                return stated
        return self._traced(m)

    def _instance(self, m: nn.Module, own, kind: str) -> _Info:
        # NOTE [A forward set on the instance]
        if kind == "wrapper":
            inner = self._class_info(m)
            writer = f"maybe: the forward set on its parent {type(m).__name__}'s instance wraps it"
            self.flag(inner.ends, writer)
            return dataclasses.replace(inner, writes=True, passes=True)
        below = [d for d in m.modules() if d is not m]
        ends = [
            d
            for d in below
            if _saves_output(d) or (self.outputs is not None and isinstance(d, self.outputs))
        ]
        if self.outputs is None:
            writer = (
                f"maybe: its parent {type(m).__name__} runs a forward set on the instance "
                f"({_fn_name(own)}), which slimgrad cannot read"
            )
            self.flag(ends, writer)
            relus = [d for d in below if isinstance(d, nn.ReLU)]
            if any(_is_source(d) for d in below):
                for c in relus:
                    self.keep.setdefault(c, _REASON_CLAIM.format(writer, "BatchNorm"))
        return _Info(ends=ends, writes=True, passes=True, takes=below)

    def _class_info(self, m: nn.Module) -> _Info:
        # what the class's own forward does (as _analyse reads a module without an instance one)
        inplace = getattr(m, "inplace", False) is True
        if _saves_output(m) or (self.outputs is not None and isinstance(m, self.outputs)):
            return _Info(ends=[m], writes=inplace)
        if self.outputs is None and _is_source(m):
            return _Info(ends=[m])
        if isinstance(m, _PASS_MODULES):
            return _Info(writes=inplace, passes=True)
        if isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward:
            return self._sequential(m)
        if not m._modules:
            return _Info(writes=inplace)
        return self._traced(m)

    def _stated(self, m: nn.Module) -> _Info | None:
        # NOTE [A replacement states its structure]: its output from the children it names, in
        # order, as an nn.Sequential's (None: a value its forward makes afresh); None where the
        # class states nothing for this forward
        stated = getattr(type(m), "_slimgrad_output_statement", None)
        if stated is None or getattr(type(m), "forward", None) is not stated[0]:
            return None
        chain = stated[1](m) if callable(stated[1]) else stated[1]
        ends: list[nn.Module] = []
        passes, writes = True, False
        for name in chain:
            if name is None:
                ends, passes = [], False
                continue
            child = m._modules.get(name)
            if child is None:  # not the structure stated: read it
                return None
            ci = self.info(child)
            writes = writes or (ci.writes and passes)
            if ci.passes:
                ends = ends + ci.ends
            else:
                ends, passes = list(ci.ends), False
        return _Info(ends=ends, writes=writes, passes=passes)

    def _sequential(self, seq: nn.Sequential) -> _Info:
        ends: list[nn.Module] = []
        passes, writes = True, False
        takes: list[nn.Module] = []
        keeps_input = False
        for child in seq:
            ci = self.info(child)
            self.feeds(child, ends)
            if passes:
                takes.append(child)
            if ci.keeps_input:  # NOTE [An output kept on the module escapes]
                self.escape(ends)
                keeps_input = keeps_input or passes
            if ci.writes:  # NOTE [Why a module writes its input, in the report]
                self.flag(ends, _writer(type(child).__name__, ci), None if ci.after else child)
                writes = writes or passes
            if ci.passes:
                ends = ends + ci.ends
            else:
                ends, passes = list(ci.ends), False
        return _Info(ends=ends, writes=writes, passes=passes, takes=takes, keeps_input=keeps_input)

    # NOTE [An in-place module's input is its output]
    # An in-place module (``ReLU6(inplace=True)``, ``Hardtanh``, ``LeakyReLU``, ``ELU``,
    # ``SiLU``, ``Mish``, ``Hardswish``, ``Hardsigmoid``, ``Dropout``, timm's activations with
    # ``inplace=True``) returns the tensor it was given: after ``h = self.act(t)``, ``t`` and
    # ``h`` are one tensor, so a write through ``t`` (or a view of it, taken before or after)
    # writes the module's output. Where the module keeps its output for backward (its ``ends``
    # hold itself), the reading gives that output to every name of the tensor it was given: in a
    # traced forward, every node whose tensor may be the argument's or a view of it (``root``:
    # the nodes made from one tensor by calls that may return their input, before the call too);
    # in a read source, the name or ``self.<attr>`` passed and every name holding what that one
    # holds (``_Made``: the result of a child's call is known by its call). A write through any
    # of them then keeps the module torch's, as a write through ``h`` does. Not followed: an
    # alias kept in a container, or one made by a helper the source reading does not follow.
    def _traced(self, m: nn.Module) -> _Info:
        try:
            graph = self.traces.every_call(m, after_swaps=self.outputs is not None)
        except Exception:
            # Untraceable forward (data-dependent control flow, ...): its source is read as an HF
            # forward's is (NOTE [In-place writes in HF forwards]), so ``h += r`` in its own code
            # is seen too; a forward whose source cannot be read falls back there to keeping the
            # output-saving children when anything below has inplace=True.
            return _source_info(self, m, getattr(m, "inplace", False) is True)
        state: dict[torch.fx.Node, _Info] = {}
        # NOTE [An in-place module's input is its output]: {node: the node whose tensor it may
        # be, or a view of}
        root: dict[torch.fx.Node, torch.fx.Node] = {}
        out = _Info()
        for node in graph.nodes:
            first = node.args[0] if node.args else None
            a0 = state.get(first, _Info()) if isinstance(first, torch.fx.Node) else _Info()
            if node.op == "placeholder":
                state[node] = _Info(passes=True)
            elif node.op == "call_module":
                ci = self.info(m.get_submodule(node.target))
                for n in _nodes_in((node.args, node.kwargs)):  # every argument (hooks: NOTE
                    if n in state:  # [Hooks on the modules around an output-saving one])
                        self.feeds(m.get_submodule(node.target), state[n].ends)
                        if state[n].passes:
                            out.takes.append(m.get_submodule(node.target))
                        if ci.keeps_input:  # NOTE [An output kept on the module escapes]
                            self.escape(state[n].ends)
                            out.keeps_input = out.keeps_input or state[n].passes
                if ci.writes:  # NOTE [Why a module writes its input, in the report]
                    sub = type(m.get_submodule(node.target)).__name__
                    self.flag(
                        a0.ends,
                        _writer(f"{node.target}: {sub}", ci),
                        None if ci.after else m.get_submodule(node.target),
                    )
                    out.writes = out.writes or a0.passes
                if ci.passes:
                    state[node] = _Info(ends=a0.ends + ci.ends, passes=a0.passes)
                    if isinstance(first, torch.fx.Node):
                        root[node] = root.get(first, first)
                else:
                    state[node] = _Info(ends=list(ci.ends))
                child = m.get_submodule(node.target)
                if ci.writes and child in ci.ends and isinstance(first, torch.fx.Node):
                    # NOTE [An in-place module's input is its output]
                    r = root.get(first, first)
                    for n in [first, *(n for n in root if root[n] is r)]:
                        if n in state:
                            s_n = state[n]
                            state[n] = dataclasses.replace(s_n, ends=s_n.ends + list(ci.ends))
            elif node.op in ("call_method", "call_function"):
                name = node.target if isinstance(node.target, str) else node.target.__name__
                if (schema := getattr(node.target, "_schema", None)) is not None:
                    name = schema.name.split("::")[-1]  # aten.view.default -> view
                if node.target is getattr and len(node.args) > 1:
                    name = str(node.args[1])  # h.T, h.mT, ...
                if node.op == "call_function" and (fa := _function_apply(node.target)):
                    # NOTE [A custom autograd Function that writes its input]
                    cls, written, ret = fa
                    given = list(node.args)
                    if node.kwargs:
                        written = ret = None
                    for i in range(len(given)) if written is None else sorted(written):
                        a = given[i] if i < len(given) else None
                        if isinstance(a, torch.fx.Node) and a in state:
                            self.flag(state[a].ends, f"{cls.__name__}.apply")
                            out.writes = out.writes or state[a].passes
                    back = [
                        state[a]
                        for i, a in enumerate(given)
                        if (ret is None or i in ret) and isinstance(a, torch.fx.Node) and a in state
                    ]
                    if back:
                        state[node] = _Info(
                            ends=[x for b in back for x in b.ends],
                            passes=any(b.passes for b in back),
                        )
                    continue
                writes = _writes_first_arg(node, name)
                if (
                    node.op == "call_method"
                    and name in _SCALAR_METHODS
                    and _tensor_node(first, m, self.outputs)
                ):
                    continue  # NOTE [A number read from a tensor holds no tensor]
                if writes or _may_alias(name):
                    if writes:
                        self.flag(a0.ends, _describe(node, name))
                        out.writes = out.writes or a0.passes
                    state[node] = a0
                    if isinstance(first, torch.fx.Node):
                        root[node] = root.get(first, first)
            elif node.op == "output":
                for n in _nodes_in(node.args):
                    s = state.get(n, _Info())
                    out.ends = out.ends + s.ends
                    out.passes = out.passes or s.passes
        kept = self.traces.kept(m)  # NOTE [An output kept on the module escapes]
        for node in graph.nodes if kept else ():
            if node.name in kept and node in state:
                self.escape(state[node].ends)
                out.keeps_input = out.keeps_input or state[node].passes
        return out


# NOTE [In-place writes in HF forwards]
# HF modules write tensors in place in their own forwards (Chameleon's and Emu3's VQ-VAE blocks:
# ``h = self.norm1(x); h *= torch.sigmoid(h)`` over a GroupNorm's output). torch.fx cannot trace
# most HF forwards, so the guard reads the class's ``forward`` source (decorators unwrapped) and
# follows, statement by statement, which output-saving children a local name may hold: the result
# of ``self.<child>(...)`` holds the child's own ends (its ``_Info``), a view-like method or a plain
# name or subscript holds what its base holds, a branch or loop holds the union of its paths, any
# other expression holds nothing new. A write through a name (``h *= s``, ``h += r`` unless the
# right side is a tuple literal, ``h[i] = v``, ``h.mul_(s)``, ``torch.relu_(h)``, ``f(h,
# inplace=True)``, a child that writes its input, a method of the module whose source writes in
# place) flags what it holds; a write to the forward's first parameter marks the module as a writer
# of its input. A branch whose condition reads only number/None settings of the module (``if
# self.config.clip_qkv is not None``; ``self.training and self.jitter_noise > 0`` with no jitter) is
# followed only where those settings lead, as they are at convert time (changing such a setting
# after convert_ is not covered; the mode and bool switches are never taken as known); so is one
# on a child's presence (``self.conv is not None``) or on a local name last assigned a literal
# (``to_drop = False``; ``_Const``: a name given any other value, or ``+=``, is no longer known;
# where two paths join with different literals, neither). ``continue``/``break`` carry what names
# hold there to the loop's next pass and its exit. A write is found by what the call calls,
# however it is spelled: a method named as an in-place verb (``h.mul_``, ``h.__iadd__``, also
# ``getattr(h, "mul_")(...)``; a computed name counts as a write), and a dotted global name
# resolved through the function's globals, modules, classes and torch.ops namespaces only
# (``torch.ops.aten.mul_.Tensor(h)``, ``aten.relu_(h)`` with ``aten = torch.ops.aten``,
# ``torch.Tensor.__iadd__(h, r)``, ``F.leaky_relu(h, 0.1, True)``): an aten operator whose schema
# writes its first argument (any overload of a packet), an in-place operator, an F function given
# ``inplace=True`` positionally. A helper method of the module (``self.helper(h)``, whatever the
# forward names the module) is read with the module, once: its writes hit the arguments it writes
# and the children's outputs it writes, and what it returns (a child's output) is followed. The
# forward's returned names give its ends, as for traced modules. The same reading serves every
# module torch.fx cannot trace. A forward whose
# source cannot be read, or that does not parse as one function, keeps its output-saving children
# unconverted when it or a descendant has ``inplace=True``.
_IN = "<input>"  # the forward's first parameter, among the aliases a name may hold
# a value the module or a global holds (a container, an object): what is stored in it, or handed
# to one of its methods, may be kept past the forward (NOTE [An output kept on the module escapes])
_SHARED = "<held by the module or a global>"
_ARG = "<argument>"  # any argument of a helper method (what its call passes in)
_NOT_VALUES = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "size"})
_HF_AST: dict = {}


# the methods of a held container that return one of its items (``self.cache.get(k)``): held too
_HELD_ITEM = frozenset({"get", "setdefault", "pop", "popitem", "popleft", "__getitem__"})


def _shared_value(obj) -> bool:
    # a value that may keep what it is given: not an atom, a tensor, a module, code or a class
    return obj is not _MISSING and not (
        type(obj) in _SNAP_ATOMS
        or isinstance(obj, (torch.Tensor, nn.Module, property, *_SNAP_NOT_OBJECTS))
        or callable(obj)
        and not isinstance(obj, _SNAP_CONTAINERS)
        and _object_dict(obj) is None
    )


def _forward_ast(fn) -> ast.FunctionDef | None:
    if fn not in _HF_AST:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(_unwrap(fn))))
            fdef = tree.body[0]
            # a lambda's source is its line: a ``def`` there is another function's
            lam = getattr(_unwrap(fn), "__name__", None) == "<lambda>"
            _HF_AST[fn] = fdef if isinstance(fdef, ast.FunctionDef) and not lam else None
        except (OSError, TypeError, SyntaxError, IndexError):
            _HF_AST[fn] = None
    return _HF_AST[fn]


def _written_params(fn) -> set[str] | None:
    # the parameters a helper method's (or hook's, lambda's) source writes in place (None: its
    # source is unknown)
    fdef = _forward_ast(fn)
    if fdef is not None:
        bodies = [(fdef.args, fdef.body)]
    else:  # a lambda: every lambda of its source line with its arity (all are assumed to run)
        bodies = _lambdas(fn)
        if not bodies:
            return None
    out: set[str] = set()
    for args, body in bodies:
        flow = _Flow(None, None, fn=fn)
        params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
        flow.block(body, {a: {a} for a in params})
        out |= {a for a in params[1:] if a in flow.written}
    return out


# NOTE [A function the forward calls by name]
# A forward read from its source (one torch.fx cannot trace, an HF forward) may hand a tensor to a
# plain Python function it reaches by name (``edit(h)``, ``utils.edit(h)``, a static method
# through its class): a user's or a library's helper, not torch's. Such a call was judged by the
# function's name alone, so a helper that writes its argument (``def edit(h): h.mul_(2)``) over a
# LayerNorm's output left the norm converted, and its backward raised autograd's in-place error
# where eager trains; a helper returning its argument (HF's ``repeat_kv`` with ``n_rep == 1``)
# was read as returning a new tensor, so a write through the result went unseen. Now the
# function's source is read once per function (its code; a lambda: every lambda of its line;
# through ``functools.wraps``, the wrapper's own code and each function it wraps, each mapped
# through its own parameters), as
# a helper method's is, its parameters standing for what the call passes: the parameters it
# writes in place, keeps past the call (stores in a global or an object: NOTE [An output kept on
# the module escapes]) and may return (or a view of) are mapped back to the call's arguments (any
# argument, where the call spreads ``*args`` or the function writes, keeps or returns its own
# ``*args``/``**kwargs``). Its own calls are read the same way; a recursive call may write, keep
# and return anything it is given.
# A function whose source cannot be read may write, keep and return anything it is given.
# torch's functions keep their rules (schemas, in-place names, ``inplace=True``). This applies to
# the writes question; the outputs question (NOTE [Modules whose output is the model's output])
# keeps its own reading of calls. A hook's reading is stricter and unchanged: any function of the
# user's it calls with a tensor it was given may write (NOTE [What a hook registered before
# convert_ may write]).
_FN_MEMO: dict = {}
_FN_RETURNS: dict = {}  # a function's code -> the plain functions it returns by name (_Callee)


def _unwrap(fn):
    # inspect.unwrap, or ``fn`` itself where its ``__wrapped__`` chain loops
    try:
        return inspect.unwrap(fn)
    except ValueError:
        return fn


def _own_fdef(fn) -> ast.FunctionDef | None:
    # the ``def`` of ``fn``'s own code (not what ``__wrapped__`` names: inspect.getsource unwraps)
    code = getattr(fn, "__code__", None)
    if code is None or code.co_name == "<lambda>":
        return None
    lines = linecache.getlines(code.co_filename)
    if not lines or code.co_firstlineno < 1:
        return None
    try:
        block = inspect.getblock(lines[code.co_firstlineno - 1 :])
        fdef = ast.parse(textwrap.dedent("".join(block))).body[0]
    except (SyntaxError, IndexError, ValueError, TypeError):
        return None
    ok = isinstance(fdef, (ast.FunctionDef, ast.AsyncFunctionDef)) and fdef.name == code.co_name
    return fdef if ok else None


_ANY = (None, None, None, ())


def _code_reading(fn) -> tuple:
    # one plain function's own code: (the parameters it writes in place, keeps past the call, may
    # return; None: any; its positional parameters) (NOTE [A function the forward calls by name])
    code = fn.__code__
    got = _FN_MEMO.get(code)
    if got is not None:
        return got
    _FN_MEMO[code] = _ANY  # a recursive call: anything
    fdef = _own_fdef(fn)
    bodies = [(fdef.args, fdef.body)] if fdef is not None else _lambdas(fn)
    pos = tuple(code.co_varnames[: code.co_argcount])
    if not bodies:
        got = _ANY
    else:
        sets: list[set] = [set(), set(), set()]
        spilled = [False, False, False]
        for a, body in bodies:
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
            rest = {x.arg for x in (a.vararg, a.kwarg) if x is not None}
            flow = _Flow(None, None, "", fn)
            flow.block(body, {n: {_Param(n)} for n in [*names, *rest]})
            made = {x for x in flow.ret if isinstance(x, _Callee)}
            for r in ast.walk(ast.Module(body=list(body), type_ignores=[])):
                # a global function it returns by name: the caller may call it
                if isinstance(r, ast.Return) and isinstance(r.value, (ast.Name, ast.Attribute)):
                    obj = flow.default_callee(r.value)
                    if obj is not None and not (
                        isinstance(r.value, ast.Name) and r.value.id in flow.local_names
                    ):
                        made.add(_Callee(obj))
            if made:
                _FN_RETURNS[code] = _FN_RETURNS.get(code, set()) | made
            for i, held in enumerate((flow.written, flow.kept, flow.ret)):
                params = {x.name for x in held if isinstance(x, _Param)}
                sets[i] |= params
                spilled[i] = spilled[i] or bool(params & rest)
        got = (*(None if spilled[i] else frozenset(sets[i]) for i in range(3)), pos)
    _FN_MEMO[code] = got
    return got


def _function_readings(fn) -> list[tuple]:
    # the readings of what a call of ``fn`` runs: its own code and, through ``__wrapped__``
    # (functools.wraps), every function it wraps (a wrapper may write, and its wrapped function
    # may: both are read, each mapped through its own parameters); a callable in that chain that
    # is not a plain function, nor torch's, may do anything
    out, f, seen = [], fn, set()
    while f is not None and id(f) not in seen and len(seen) < 16:
        seen.add(id(f))
        if isinstance(f, types.FunctionType):
            out.append(_code_reading(f))
        elif not _known_function(f):
            out.append(_ANY)
        f = getattr(f, "__wrapped__", None)
    return out


# NOTE [A custom autograd Function that writes its input]
# ``MyFn.apply(h)`` runs ``MyFn.forward``, which may write what it is given in place (an in-place
# activation written as a Function: ``x.mul_(s); ctx.mark_dirty(x); return x``). torch.fx records
# the call as one node (it does not trace into the Function) and the source reading judged it by
# its name, so a LayerNorm whose output such a Function wrote stayed converted, and backward raised
# autograd's in-place error where eager trains. Now the Function's ``forward`` is read from its
# source once (NOTE [A function the forward calls by name]), ``ctx.mark_dirty(t)`` counting as a
# write of ``t`` (the Function declares it: its own kernel may write where the source shows no
# in-place call), and the parameters it writes and returns map to ``apply``'s arguments (after
# ``ctx``, unless the Function sets its context in ``setup_context``): in a traced forward the nodes
# given there, in a read source the names. A forward whose source cannot be read may write, and
# return, any argument.
def _function_apply(target) -> tuple[type, frozenset | None, frozenset | None] | None:
    # (the Function, the positions of apply's arguments its forward writes, those it may
    # return; None: any) where ``target`` is a custom autograd Function's ``apply``, else None
    cls = getattr(target, "__self__", None)
    if (
        not isinstance(target, types.MethodType)
        or getattr(target, "__name__", None) != "apply"
        or not isinstance(cls, type)
        or not issubclass(cls, torch.autograd.Function)
    ):
        return None
    fwd = inspect.getattr_static(cls, "forward", None)
    fwd = fwd.__func__ if isinstance(fwd, staticmethod) else None
    if not inspect.isfunction(fwd):
        return cls, None, None
    readings = _function_readings(fwd)
    if any(r[3] != readings[0][3] for r in readings):
        return cls, None, None
    written, ret = set(), set()
    for w, _, r, _ in readings:
        written = None if w is None or written is None else written | w
        ret = None if r is None or ret is None else ret | r
    code = fwd.__code__
    pos = list(readings[0][3])
    if cls.setup_context is torch.autograd.Function.setup_context:
        pos = pos[1:]  # forward(ctx, *args)

    def at(params):
        if params is None or code.co_flags & inspect.CO_VARARGS and params - set(pos):
            return None
        return frozenset(i for i, n in enumerate(pos) if n in params)

    return cls, at(written), at(ret)


def _lambdas(fn) -> list:
    code = getattr(fn, "__code__", None)
    if code is None or getattr(fn, "__name__", "") != "<lambda>":
        return []
    try:
        src = textwrap.dedent(inspect.getsource(fn)).strip()
    except (OSError, TypeError, IndexError):
        return []
    for text in (src, src + "\n    pass"):  # a lambda in a block's header line
        try:
            tree = ast.parse(text)
            break
        except SyntaxError:
            continue
    else:
        return []
    n = code.co_argcount
    found = [
        (node.args, [ast.Return(node.body)])
        for node in ast.walk(tree)
        if isinstance(node, ast.Lambda) and len(node.args.posonlyargs + node.args.args) == n
    ]
    return found


_MISSING = object()


def _static(
    test, module: nn.Module | None, me: str = "self", env: dict | None = None, switches=False
):
    # True/False when ``test`` reads only number/None attributes of the module (``self.config.
    # clip_qkv is not None``, ``self.training and self.jitter_noise > 0``), else None;
    # ``switches``: bool settings too, as they are now (NOTE [A forward that reads its children])
    if module is None:
        return None
    if isinstance(test, ast.BoolOp):
        vals = [_static(v, module, me, env, switches) for v in test.values]
        if isinstance(test.op, ast.And):
            return False if False in vals else (True if all(v is True for v in vals) else None)
        return True if True in vals else (False if all(v is False for v in vals) else None)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        v = _static(test.operand, module, me, env, switches)
        return None if v is None else not v
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        op = test.ops[0]
        held = isinstance(op, (ast.Is, ast.IsNot))  # ``self.conv is not None``: a child's presence
        a = _value(test.left, module, me, held, env, switches)
        b = _value(test.comparators[0], module, me, held, env, switches)
        if a is _MISSING or b is _MISSING:
            return None
        if held:  # (two children: the same one or not, unknown here)
            return None if a is b is _CHILD else (a is b) == isinstance(op, ast.Is)
        fns = {ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Lt: operator.lt,
               ast.LtE: operator.le, ast.Eq: operator.eq, ast.NotEq: operator.ne}  # fmt: skip
        try:
            return bool(fns[type(op)](a, b)) if type(op) in fns else None
        except TypeError:
            return None
    v = _value(test, module, me, env=env, switches=switches)
    return None if v is _MISSING else bool(v)


_CHILD = object()  # stands for a child module in ``is`` / ``is not`` tests


@dataclass(frozen=True)
class _Const:
    # a local name assigned a literal number, bool or None (``to_drop = False``), read by a
    # branch's test; (type, value): True and 1 differ
    kind: type
    value: object


def _value(
    e,
    module: nn.Module,
    me: str = "self",
    child: bool = False,
    env: dict | None = None,
    switches: bool = False,
):
    if isinstance(e, ast.Constant) and (e.value is None or isinstance(e.value, (int, float))):
        return e.value
    if isinstance(e, ast.Name) and env is not None and e.id != me:  # to_drop = False; ...
        held = env.get(e.id, ())
        one = next(iter(held)) if len(held) == 1 else None
        return one.value if isinstance(one, _Const) else _MISSING
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):  # self.layers[:-1]
        v = _value(e.operand, module, me, env=env)
        return v if v is _MISSING or v is None else -v
    path = []
    while isinstance(e, ast.Attribute):
        path.append(e.attr)
        e = e.value
    if not (isinstance(e, ast.Name) and e.id == me and path) or path[-1] == "training":
        return _MISSING  # the mode changes after conversion
    v = module
    for a in reversed(path):
        try:
            v = getattr(v, a, _MISSING)
        except Exception:  # noqa: BLE001 - a property that raises: the branch is not known
            return _MISSING
        if v is _MISSING:
            return _MISSING
    if child and isinstance(v, nn.Module):  # a child (swapping it for None after convert_
        return _CHILD  # changes the model's structure: run convert_ again)
    # numbers and None only: a bool is a switch users flip after conversion
    # (``gradient_checkpointing``, ``config.output_attentions``), unless asked how it is now
    if v is None or (isinstance(v, (int, float)) and (switches or not isinstance(v, bool))):
        return v
    return _MISSING


_NAMESPACES = frozenset({"torch", "F", "nn", "functional"})


def _namespace(e) -> bool:
    # torch.relu_, F.relu, nn.functional.dropout: a function, not a method of a tensor
    while isinstance(e, ast.Attribute):
        e = e.value
    return isinstance(e, ast.Name) and e.id in _NAMESPACES


class _Flow:
    # NOTE [In-place writes in HF forwards]: an abstract run of one forward over alias sets
    def __init__(
        self, guard: _Guard | None, module: nn.Module | None, me: str = "self", fn=None
    ) -> None:
        self.guard, self.module = guard, module
        self.me = me  # the name the forward gives its module (its first parameter)
        # the global names of the function read (NOTE [In-place writes in HF forwards]: what a
        # call such as ``aten.mul_.Tensor(h)`` calls); {} when unknown
        fn = _unwrap(fn) if fn is not None else None
        self.fn = fn
        self.globals = getattr(fn, "__globals__", {})
        code = getattr(fn, "__code__", None)  # its local and closure names are not globals
        names = code.co_varnames + code.co_cellvars + code.co_freevars if code else ()
        self.local_names = frozenset(names)
        self.ret: set = set()
        self.written: set = set()
        # per return statement: its tuple literal's items' holdings, or None (not such a tuple)
        self.ret_items: list[tuple[frozenset, ...] | None] = []
        # per enclosing loop: the envs at its ``continue`` and ``break`` statements
        self.loops: list[tuple[list, list]] = []
        self.takes: list[nn.Module] = []  # the children given the forward's input (``_Info``)
        self.keeps_input = False  # NOTE [An output kept on the module escapes]
        self.kept: set = set()  # all it kept (a helper's: which of its parameters)
        self.active: set = set()  # the local functions being read (NOTE [Calls the source ...])
        self.me_aliases: set[str] = set()  # local names bound to the module (``a = self``)

    def escape(self, held: set) -> None:
        # NOTE [An output kept on the module escapes]: ``held`` is kept on a module
        if self.guard is not None:
            self.guard.escape(held)
        self.keeps_input = self.keeps_input or _IN in held
        self.kept |= held

    def shared(self, e, env: dict) -> bool:
        # NOTE [An output kept on the module escapes]: ``e`` (an attribute of the module that is
        # not a child, a global name, an attribute of a module or class reached from a global,
        # ``type(self)``, ``self.__class__``) is a value the module or a global holds
        if isinstance(e, ast.Name):
            if e.id in env or e.id == self.me or e.id in self.local_names:
                return False
            return _shared_value(self.globals.get(e.id, _MISSING))
        if not isinstance(e, ast.Attribute):
            return False
        if isinstance(e.value, ast.Name) and e.value.id == self.me:
            if e.attr in ("__class__", "__dict__"):
                return True
            if self.module is None or e.attr in self.module._modules:
                return False
            try:
                return _shared_value(inspect.getattr_static(self.module, e.attr))
            except AttributeError:
                return False
        return _shared_value(self.callee(e, env))

    def feeds(self, child: nn.Module, every: set) -> None:
        # NOTE [Hooks on the modules around an output-saving one]: ``child`` is given ``every``
        if self.guard is not None:
            self.guard.feeds(child, every)
        if _IN in every:
            self.takes.append(child)

    def rebind(self, call: ast.Call, env: dict, child: nn.Module, ci: _Info) -> None:
        # NOTE [An in-place module's input is its output]: the name (or ``self.<attr>``) given to
        # an in-place module holds its output afterwards, as does every name holding the same
        # tensor's aliases (a name holding what the given one holds, where that is not nothing)
        if child not in ci.ends or not call.args:
            return
        key = self.key(call.args[0])
        if key is None:
            return
        given = {x for x in env.get(key, ()) if not isinstance(x, _Const)}
        for k, held in list(env.items()):
            if k == key or (given and given <= held):
                env[k] = set(held) | set(ci.ends)

    # NOTE [A tensor kept on the module]
    # A forward the source reading reads (one torch.fx cannot trace) may keep a tensor on the
    # module and write it later in the same forward (``self.saved = b; ...; self.saved.add_(1)``;
    # ``self.cache[k] = b``; ``self.feats.append(b)``). The attribute path (``self.saved``) is a
    # name like any local: it holds what was assigned to it, and what an item assignment or a
    # keeping method put in it (``self.cache[]``: an item assignment writes the attribute's own
    # tensor, not the values of the container it may be); a read of it gives both, so a write
    # through it flags what it holds. A traced forward needs nothing: torch.fx records the
    # attribute as the Proxy it was given. Not followed here: a tensor kept in one call and
    # written in a later one before it is reassigned, one kept by a helper method, or through
    # ``setattr``/``__dict__`` (a write after forward: NOTE [An output kept on the module
    # escapes]).
    def key(self, e) -> str | None:
        # the env key of a local name or of an attribute path of the module (``self.saved``)
        if isinstance(e, ast.Name):
            return e.id if e.id != self.me else None
        path = []
        while isinstance(e, ast.Attribute):
            path.append(e.attr)
            e = e.value
        if path and isinstance(e, ast.Name) and e.id == self.me:
            return ".".join([self.me, *reversed(path)])
        return None

    def flag(self, held: set, why: str) -> None:
        self.written |= held
        if self.guard is not None:
            self.guard.flag([m for m in held if isinstance(m, nn.Module)], why)

    def block(self, stmts, env: dict) -> dict:
        for s in stmts:
            env = self.stmt(s, env)
        return env

    def stmt(self, s, env: dict) -> dict:
        if isinstance(s, (ast.Assign, ast.AnnAssign)):
            held = self.expr(s.value, env) if s.value is not None else set()
            v = s.value
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            if isinstance(v, ast.Name) and v.id == self.me:  # a = self: a names the module
                self.me_aliases |= {t.id for t in targets if isinstance(t, ast.Name)}
            if (
                isinstance(v, ast.Attribute)
                and isinstance(v.value, ast.Name)
                and v.value.id == self.me
                and self.module is not None
                and not self._outputs()
            ):  # act = self.act / fn = self.scale: the name calls the child, or the method
                child = self.module._modules.get(v.attr)
                method = getattr(type(self.module), v.attr, None)
                if isinstance(child, nn.Module):
                    held = held | {_Each((child,))}
                elif (
                    child is None
                    and v.attr not in self.module._modules
                    and inspect.isfunction(method)
                ):
                    held = held | {_Bound(method, frozenset())}
            if (spelled := self.literal_getattr(v, env)) is not None:
                v = spelled  # f = getattr(torch.Tensor, "mul_") is f = torch.Tensor.mul_
            if isinstance(v, ast.Attribute) or (isinstance(v, ast.Name) and v.id not in env):
                # f = torch.Tensor.mul_, f = edit: the name calls it (NOTE [Calls the source
                # reading spells out])
                callee = self.callee(v, env)
                if callee is not _MISSING and callable(callee) and not isinstance(callee, type):
                    held = held | {_Callee(callee)}
            if isinstance(v, ast.Constant) and (
                v.value is None or isinstance(v.value, (int, float))
            ):
                held = {_Const(type(v.value), v.value)}  # a literal a later test may read
            for t in s.targets if isinstance(s, ast.Assign) else [s.target]:
                if (items := self.unpacked(t, v, env)) is not None:
                    for name, got in zip(t.elts, items, strict=True):
                        env[name.id] = set(got)
                    continue
                self.assign(t, held, env)
        elif isinstance(s, ast.AugAssign):
            held = self.expr(s.value, env)
            if isinstance(s.target, ast.Name):  # i += 1: no longer the literal it was
                env[s.target.id] = _no_consts(env.get(s.target.id, ()))
            if not isinstance(s.value, (ast.Tuple, ast.List)):  # x += (h,) extends a tuple
                self.flag(self.expr(s.target, env), f"{_op_name(s.op)}= in its HF forward")
            elif self._outputs() and isinstance(s.target, ast.Name):  # it now holds h too
                env[s.target.id] = env.get(s.target.id, set()) | held
        elif isinstance(s, ast.Expr):
            self.expr(s.value, env)
            v = s.value
            if (
                self._outputs()
                and isinstance(v, ast.Call)
                and isinstance(v.func, ast.Attribute)
                and isinstance(v.func.value, ast.Name)
                and v.func.attr in ("append", "extend", "insert")
            ):  # hs.append(h): hs now holds h too (outputs question)
                name = v.func.value.id
                env[name] = env.get(name, set()).union(*(self.expr(a, env) for a in v.args))
            if (
                isinstance(v, ast.Call)
                and isinstance(v.func, ast.Attribute)
                and v.func.attr in _KEEPING
                and (key := self.key(v.func.value)) is not None
                and "." in key
            ):  # self.feats.append(h): NOTE [A tensor kept on the module]
                got = [self.expr(a, env) for a in [*v.args, *(k.value for k in v.keywords)]]
                env[key + "[]"] = _no_consts(env.get(key + "[]", set()).union(*got))
                self.escape(set().union(*got))
            elif (
                not self._outputs()
                and isinstance(v, ast.Call)
                and isinstance(v.func, ast.Attribute)
                and v.func.attr in _KEEPING
                and isinstance(v.func.value, ast.Name)
                and v.func.value.id in env
            ):  # hs.append(h) with hs a local list: hs now holds h too
                got = [self.expr(a, env) for a in [*v.args, *(k.value for k in v.keywords)]]
                name = v.func.value.id
                env[name] = _no_consts(env[name].union(*got))
        elif isinstance(s, ast.Return):
            if s.value is not None:
                self.ret |= self.expr(s.value, env)
            v = s.value
            if isinstance(v, ast.Tuple) and not any(isinstance(x, ast.Starred) for x in v.elts):
                self.ret_items.append(tuple(frozenset(self.expr(x, env)) for x in v.elts))
            else:
                self.ret_items.append(None)
        elif isinstance(s, ast.If):
            self.expr(s.test, env)
            # a branch the module's settings (or a local literal) never take
            known = _static(s.test, self.module, self.me, env)
            if known is None:
                env = _union(self.block(s.body, dict(env)), self.block(s.orelse, dict(env)))
            else:
                env = self.block(s.body if known else s.orelse, env)
        elif isinstance(s, ast.For) and (loop := self.each(s)) is not None:
            # NOTE [Modules whose output is the model's output]: a loop over a module container,
            # read one pass per child, in order, where the children it visits are known
            kids, unrolled = loop
            self.expr(s.iter, env)
            breaks: list = []
            if unrolled:
                for kid in kids:
                    self.assign(s.target, {_Each((kid,))}, env)
                    env = self.loop_pass(s.body, env, breaks)
            else:  # any child in any pass: two passes, as for any loop
                self.assign(s.target, {_Each(kids)}, env)
                for _ in range(2):
                    env = _union(env, self.loop_pass(s.body, dict(env), breaks))
            env = self.block(s.orelse, env)
            for b in breaks:
                env = _union(env, b)
        elif isinstance(s, (ast.For, ast.While)):
            if isinstance(s, ast.For):
                self.assign(s.target, self.expr(s.iter, env), env)
            else:
                self.expr(s.test, env)
            breaks = []
            for _ in range(2):  # two passes: what one iteration leaves reaches the next
                env = _union(env, self.loop_pass(s.body, dict(env), breaks))
            env = _union(env, self.block(s.orelse, dict(env)))
            for b in breaks:
                env = _union(env, b)
        elif isinstance(s, (ast.Continue, ast.Break)) and self.loops:
            # where it jumps, the names hold what they hold here (the statements after it in its
            # block are still read: more than is run, never less)
            self.loops[-1][isinstance(s, ast.Break)].append(dict(env))
        elif isinstance(s, ast.With):
            for item in s.items:
                held = self.expr(item.context_expr, env)
                if item.optional_vars is not None:
                    self.assign(item.optional_vars, held, env)
            env = self.block(s.body, env)
        elif isinstance(s, ast.Try):
            # a handler may start after any statement of the body: it starts from the join of
            # the env before the body and after each of its statements (a name the body sets to a
            # literal and resets later is not known in the handler)
            entry = dict(env)
            for st in s.body:
                env = self.stmt(st, dict(env))
                entry = _union(entry, env)
            for h in s.handlers:
                env = _union(env, self.block(h.body, dict(entry)))
            env = self.block(s.finalbody, self.block(s.orelse, env))
        elif isinstance(s, ast.Delete):
            for t in s.targets:
                if isinstance(t, ast.Name):
                    env.pop(t.id, None)
        elif isinstance(s, ast.Match):  # each case may run: the join of their paths
            self.expr(s.subject, env)
            joined = dict(env)
            for case in s.cases:
                inner = dict(env)
                if case.guard is not None:
                    self.expr(case.guard, inner)
                joined = _union(joined, self.block(case.body, inner))
            env = joined
        elif isinstance(s, ast.ClassDef) and not self._outputs():
            # a class defined in the forward: its objects' methods may write what they are
            # given (NOTE [Calls the source reading spells out]); its bases and decorators run
            for node in [*s.decorator_list, *s.bases, *(k.value for k in s.keywords)]:
                self.expr(node, env)
            env[s.name] = {_LOCAL_CLASS}
        elif isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
            # a function defined in the forward: read where it is called (NOTE [Calls the source
            # reading spells out]); its decorators and defaults run here
            for node in [*s.decorator_list, *s.args.defaults, *s.args.kw_defaults]:
                if node is not None:
                    self.expr(node, env)
            env[s.name] = {_LocalFn(s)}
        else:  # raise, assert, pass, class bodies, ...: only the writes their expressions make
            for node in ast.iter_child_nodes(s):
                if isinstance(node, ast.expr):
                    self.expr(node, env)
        return env

    def unpacked(self, target, value, env: dict) -> list[set] | None:
        # ``a, b = self.child(...)`` where every return of the child's forward is a tuple literal
        # of that length: each name holds its item (the child's input standing for what the call
        # is given); anything else (a starred name, another length, a traced child): None
        if not (
            isinstance(target, (ast.Tuple, ast.List))
            and all(isinstance(t, ast.Name) for t in target.elts)
            and isinstance(value, ast.Call)
            and isinstance(value.func, ast.Attribute)
            and isinstance(value.func.value, ast.Name)
            and value.func.value.id == self.me
            and self.guard is not None
            and self.module is not None
        ):
            return None
        child = self.module._modules.get(value.func.attr)
        if not isinstance(child, nn.Module) or (
            "forward" in child.__dict__ or child._forward_hooks or child._forward_pre_hooks
        ):  # (a hook or an instance's own forward may return other items)
            return None
        items = self.guard.info(child).items
        if items is None or len(items) != len(target.elts):
            return None
        every = set().union(
            *(self.expr(a, env) for a in value.args),
            *(self.expr(k.value, env) for k in value.keywords),
        )
        return [(set(i) - {_IN}) | (every if _IN in i else set()) for i in items]

    def loop_pass(self, body, env: dict, breaks: list) -> dict:
        # one pass of a loop's body: what it leaves at its end and at each ``continue``
        self.loops.append(([], breaks))
        env = self.block(body, env)
        for c in self.loops.pop()[0]:
            env = _union(env, c)
        return env

    def _outputs(self) -> bool:
        return self.guard is not None and self.guard.outputs is not None

    def each(self, s: ast.For) -> tuple[tuple, bool] | None:
        # ``for m in self.layers`` / ``enumerate(self.layers)`` / ``self.layers[a:b]`` over a
        # ModuleList or Sequential child (None for any other loop): its children, and whether the
        # ones it visits, in order, are known (an index of the slice not a number setting of the
        # module: any child in any pass). Both questions: the guard's (a child that writes its
        # input flags what it is given) and the outputs one
        if self.guard is None or self.module is None:
            return None
        it, part = s.iter, slice(None)
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate":
            it = it.args[0] if len(it.args) == 1 and not it.keywords else None
        if isinstance(it, ast.Subscript):
            ends = it.slice
            it, part = it.value, None
            if isinstance(ends, ast.Slice):
                bounds = [
                    None if x is None else _value(x, self.module, self.me)
                    for x in (ends.lower, ends.upper, ends.step)
                ]
                if all(b is None or isinstance(b, int) for b in bounds) and bounds[2] != 0:
                    part = slice(*bounds)
        if (
            isinstance(it, (ast.Tuple, ast.List))
            and it.elts
            and len(it.elts) <= _UNROLL
            and all(
                isinstance(x, ast.Attribute)
                and isinstance(x.value, ast.Name)
                and x.value.id == self.me
                and isinstance(self.module._modules.get(x.attr), nn.Module)
                for x in it.elts
            )
        ):  # for layer in (self.act, self.drop): those children, in order (NOTE [Calls the
            # source reading spells out])
            return tuple(self.module._modules[x.attr] for x in it.elts), True
        if not (
            isinstance(it, ast.Attribute)
            and isinstance(it.value, ast.Name)
            and it.value.id == self.me
            and isinstance(self.module._modules.get(it.attr), (nn.ModuleList, nn.Sequential))
        ):
            return None
        kids = tuple(c for c in self.module._modules[it.attr]._modules.values() if c is not None)
        if part is None or len(kids) > _UNROLL:
            return kids, False
        return kids[part], True

    def method_ends(self, name: str, held: set) -> set:
        # what ``self.<name>(...)`` (a method, not a child) may return, its arguments holding
        # ``held`` (outputs question only)
        if self.guard is None or self.guard.outputs is None or self.module is None:
            return set()
        fn = getattr(type(self.module), name, None)
        key = (id(self.module), fn)
        if key not in self.guard.methods:
            self.guard.methods[key] = {_ARG}  # recursion: its arguments
            fdef = _forward_ast(fn) if callable(fn) else None
            if not (callable(fn) and inspect.isfunction(_unwrap(fn))):
                got = {_ARG}  # a property (HF's loss_function), a stored callable: its arguments
            elif fdef is None or not fdef.args.posonlyargs + fdef.args.args:
                # its source unknown, or no name for the module in it: any child's output
                got = {_ARG, *_any_end(self.guard, self.module)}
            else:
                args = fdef.args
                names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
                flow = _Flow(self.guard, self.module, names[0], fn)
                flow.block(fdef.body, {a: {_ARG} for a in names[1:]})
                got = flow.ret
            self.guard.methods[key] = got
        got = self.guard.methods[key]
        return (got - {_ARG}) | (held if _ARG in got else set())

    def helper(
        self, fn, at: int = 0, module: nn.Module | None = None, owner: type | None = None
    ) -> tuple[set[str] | None, set | None, set[str] | None]:
        # a method of the module called from its forward: (the parameters it writes in place,
        # None: any; what it returns, ``_Param`` standing for an argument, None: its arguments;
        # the parameters it keeps past the call, None: any: NOTE [An output kept on the module
        # escapes]), read with the module, so its own calls of children and their outputs are
        # followed (a write there flags the child), whatever it names the module. ``at``: the
        # position of the module among its parameters (1: a callable object's ``__call__``, its
        # object first: NOTE [A callable object given its module]); ``module``: the module it is
        # a method of, where not this one (a child's: NOTE [Calls the source reading spells out]);
        # ``owner``: the object's class (``at`` 1)
        mod = module if module is not None else self.module
        if self.guard is None or mod is None:
            return _written_params(fn), None, None
        key = (id(mod), fn)
        got = self.guard.helpers.get(key)
        if got is None:
            self.guard.helpers[key] = (set(), None, set())  # recursion: as read so far
            fdef = _forward_ast(fn) if inspect.isfunction(_unwrap(fn)) else None
            if fdef is None or len(fdef.args.posonlyargs + fdef.args.args) <= at:
                got = (_written_params(fn), None, None)  # a lambda, a property: as before
            else:
                a = fdef.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                rest = [x.arg for x in (a.vararg, a.kwarg) if x is not None]
                env = {n: {_Param(n)} for n in names[at + 1 :] + rest}
                if at:  # the object: what it holds, or is handed, may be kept past the call
                    flow = _ObjectFlow(self.guard, mod, names[at], fn, names[0], owner)
                    env[names[0]] = {_SHARED}
                else:
                    flow = _Flow(self.guard, mod, names[0], fn)
                flow.block(fdef.body, env)
                written = {x.name for x in flow.written if isinstance(x, _Param)}
                kept = {x.name for x in flow.kept if isinstance(x, _Param)}
                got = (
                    None if written & set(rest) else written,
                    flow.ret,
                    None if kept & set(rest) else kept,
                )
            self.guard.helpers[key] = got
        return got

    def default_callee(self, d):
        # the function a parameter's default names (evaluated where the ``def`` is, so the
        # forward's own names do not shadow it: ``callee`` from the globals alone), or None
        root = d
        while isinstance(root, ast.Attribute):
            root = root.value
        if not isinstance(root, ast.Name) or root.id not in self.globals:
            return None
        obj = self.callee(d, {}, outer=True)
        if obj is _MISSING or isinstance(obj, type) or not callable(obj):
            return None
        return obj

    def handed_writes(self, node, env: dict) -> bool:
        # whether a function (or a child module) given to a call as an argument may write what
        # it is called with: the call may call it with anything it is given (NOTE [Calls the
        # source reading spells out])
        if isinstance(node, ast.Starred):
            node = node.value
        if isinstance(node, ast.Name) and node.id in env:
            for x in env[node.id]:
                if isinstance(x, (_Callee, _Bound)) and _handed_fn_writes(x.fn):
                    return True
                if isinstance(x, _Each) and self.guard is not None:
                    if any(self.guard.info(c).writes for c in x.kids):
                        return True
            return False
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == self.me
            and self.module is not None
        ):  # self.child / self.method
            child = self.module._modules.get(node.attr)
            if isinstance(child, nn.Module):
                return self.guard is not None and self.guard.info(child).writes
            method = getattr(type(self.module), node.attr, None)
            if node.attr not in self.module._modules and inspect.isfunction(method):
                written = self.helper(method)[0]
                return written is None or bool(written)
            return False
        if isinstance(node, (ast.Name, ast.Attribute)):
            obj = self.callee(node, env)
            if obj is not _MISSING and callable(obj) and not isinstance(obj, type):
                return _handed_fn_writes(obj)
        return False

    def callee(self, f, env: dict, outer: bool = False):
        # the object a dotted global name calls (``torch.ops.aten.mul_.Tensor``, ``aten.relu_``
        # with ``aten = torch.ops.aten`` at module level, ``torch.Tensor.mul_``), found through
        # modules, classes and torch.ops namespaces only; _MISSING for anything else (a local
        # name, an attribute of a value). ``outer``: the name as the function's enclosing scope
        # sees it (a default argument's), its own local names not hiding it
        path = []
        while isinstance(f, ast.Attribute):
            path.append(f.attr)
            f = f.value
        if not isinstance(f, ast.Name) or (not outer and (f.id in env or f.id in self.local_names)):
            return _MISSING
        obj = self.globals.get(f.id, _MISSING)
        if obj is _MISSING:
            obj = getattr(builtins, f.id, _MISSING)
        for name in reversed(path):
            if not isinstance(obj, (types.ModuleType, type, *_OP_HOLDERS)):
                return _MISSING
            try:
                obj = getattr(obj, name)
            except Exception:  # noqa: BLE001 - an op that does not exist, a lazy import
                return _MISSING
        return obj

    def getattr_call(self, f, env: dict) -> tuple[set, str | None] | None:
        # ``getattr(h, "name")(...)`` spells ``h.name(...)``: (what h holds, the name or None
        # where it is computed); None for any other call
        if not (
            isinstance(f, ast.Call)
            and len(f.args) >= 2
            and self.callee(f.func, env) is builtins.getattr
        ):
            return None
        base = self.expr(f.args[0], env)
        n = f.args[1]
        return base, n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else None

    def assign(self, target, held: set, env: dict) -> None:
        if isinstance(target, ast.Name):
            env[target.id] = set(held)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:  # a, b = h.chunk(2): each may hold what h holds
                self.assign(t.value if isinstance(t, ast.Starred) else t, held, env)
        elif isinstance(target, ast.Subscript):
            self.expr(target.slice, env)
            base = self.expr(target.value, env)
            if (key := self.key(target.value)) is not None and "." in key:
                # self.cache[k] = h: the container now holds h (an item assignment writes the
                # attribute's own tensor, not what its container holds)
                base = (base - env.get(key + "[]", set())) | env.get(key, set())
                env[key + "[]"] = env.get(key + "[]", set()) | _no_consts(held)
                self.escape(held)
            elif key is not None and not self._outputs():
                # d[k] = h with d a local name: d now holds h too, for writes through d[k]
                # (NOTE [Calls the source reading spells out])
                env[key] = env.get(key, set()) | _no_consts(held)
            elif _SHARED in base:  # CACHE[k] = h, self.box.items[0] = h: NOTE [An output kept
                self.escape(held)  # on the module escapes]
            self.flag(base, "an item assignment in its HF forward")
        elif isinstance(target, ast.Attribute):
            base = self.expr(target.value, env)
            if (key := self.key(target)) is not None:  # NOTE [A tensor kept on the module]
                env[key] = _no_consts(held)
                self.escape(held)
            elif (
                isinstance(target.value, ast.Name)
                and target.value.id in env
                and not self._outputs()
            ):  # b.h = h with b a local object: b now holds h too
                name = target.value.id
                env[name] = env[name] | _no_consts(held)
            elif _SHARED in base:  # type(self).last = h, box.h = h: NOTE [An output kept on
                self.escape(held)  # the module escapes]

    def expr(self, e, env: dict) -> set:
        # a name's literal (_Const) is what that name holds; no other expression's value is one
        held = self._expr(e, env)
        return held if isinstance(e, ast.Name) else _no_consts(held)

    def _expr(self, e, env: dict) -> set:
        if e is None:
            return set()
        if isinstance(e, ast.Name):
            got = set(env.get(e.id, ()))
            return got | {_SHARED} if self.shared(e, env) else got
        if isinstance(e, ast.NamedExpr):
            held = self.expr(e.value, env)
            self.assign(e.target, held, env)
            return held
        if isinstance(e, (ast.Yield, ast.YieldFrom)):
            # a generator hands out what it yields, as a return does: its caller iterates it
            # (NOTE [A function the forward calls by name])
            self.ret |= self.expr(e.value, env)
            return set()
        if isinstance(e, ast.Call):
            got = self.call(e, env)
            f = e.func
            if _SHARED in got and not (
                isinstance(f, ast.Attribute)
                and f.attr in _HELD_ITEM
                or isinstance(f, ast.Name)
                and f.id == "type"
            ):  # a call's result is not a held value (NOTE [An output kept on the module escapes])
                got = got - {_SHARED}
            return got
        if isinstance(e, ast.Attribute):
            base = self.expr(e.value, env)
            bound = {
                _Bound(found[0], frozenset(base))
                for x in base
                if isinstance(x, _Obj) and (found := _method_of(x.cls, e.attr)) and found[1]
            }
            if bound:  # m = Tool().edit: a method taken to be called later
                return bound
            if (key := self.key(e)) is not None:  # NOTE [A tensor kept on the module]
                base = base | env.get(key, set()) | env.get(key + "[]", set())
            if self.guard is not None and self.guard.outputs is not None:
                if e.attr in _EXTRA_FIELDS:  # NOTE [Modules whose output is the model's output]
                    return set()
            if e.attr in _NOT_VALUES:
                return set()
            # h.T, out.last_hidden_state; self.box, CACHES.last: NOTE [An output kept on the
            # module escapes]
            return base | {_SHARED} if self.shared(e, env) else base
        if isinstance(e, ast.Subscript):
            self.expr(e.slice, env)
            return self.expr(e.value, env)
        if isinstance(e, ast.Starred):
            return self.expr(e.value, env)
        if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
            return set().union(*(self.expr(x, env) for x in e.elts))
        if isinstance(e, ast.IfExp):
            self.expr(e.test, env)
            return self.expr(e.body, env) | self.expr(e.orelse, env)
        if isinstance(e, ast.BoolOp):
            return set().union(*(self.expr(x, env) for x in e.values))
        if isinstance(e, ast.Dict):
            return set().union(*(self.expr(x, env) for x in [*e.keys, *e.values]))
        if (
            self._outputs()
            and isinstance(e, ast.BinOp)
            and isinstance(e.op, ast.Add)
            and isinstance(e.right, (ast.Tuple, ast.List))
        ):  # hs + (h,) joins sequences (outputs question)
            return self.expr(e.left, env) | self.expr(e.right, env)
        if isinstance(e, _COMPREHENSIONS):
            # each target holds what its iterable holds, for the writes in the element and the
            # conditions (``[t.mul_(2) for t in (h,)]`` writes h); the names stay the
            # comprehension's own
            inner = dict(env)
            for gen in e.generators:
                self.assign(gen.target, self.expr(gen.iter, inner), inner)
                for cond in gen.ifs:
                    self.expr(cond, inner)
            for part in (e.key, e.value) if isinstance(e, ast.DictComp) else (e.elt,):
                self.expr(part, inner)
        for node in ast.iter_child_nodes(e):  # a new value; only nested writes matter
            if isinstance(node, ast.expr):
                self.expr(node, env)
        if isinstance(e, _CAPTURING):  # ``lambda: h``, ``[t for t in (h,)]``, ``(t for t in hs)``
            # hold what they name (NOTE [An output kept on the module escapes])
            got = set().union(*(env.get(n.id, ()) for n in ast.walk(e) if isinstance(n, ast.Name)))
            # a lambda is also a function read where it is called (NOTE [Calls the source reading
            # spells out])
            return got | {_LocalFn(e)} if isinstance(e, ast.Lambda) else got
        return set()

    def call(self, e: ast.Call, env: dict) -> set:
        f = e.func
        root = f
        while isinstance(root, ast.Attribute):
            root = root.value
        if f is not root and isinstance(root, ast.Name) and root.id in self.me_aliases:
            # a.child(h) with a = self: the module's own call (NOTE [Calls the source reading
            # spells out])
            return self.call(_spelled(e, _renamed(f, self.me)), env)
        if (spelled := self.literal_getattr(f, env)) is not None:
            # getattr(x, "name")(...) is x.name(...): NOTE [Calls the source reading spells out]
            return self.call(_spelled(e, spelled), env)
        args = [self.expr(a, env) for a in e.args]
        kws = {k.arg: self.expr(k.value, env) for k in e.keywords}
        every = set().union(*args, *kws.values())
        first = args[0] if args else set()
        inplace_kw = any(
            k.arg == "inplace" and isinstance(k.value, ast.Constant) and k.value.value is True
            for k in e.keywords
        )
        for fn in [x for x in every if isinstance(x, _LocalFn)]:
            # a function defined in the forward, handed to a call (checkpoint(inner, h), map):
            # it may be called with anything that call is given
            self.local_call(fn, None, every, env)
        if not self._outputs():
            for a in [*e.args, *(k.value for k in e.keywords)]:
                # a global function, a method, a child handed to a call (apply(edit, h),
                # map(edit, [h]), sorted(hs, key=edit)): it may be called with anything the
                # call is given (NOTE [Calls the source reading spells out])
                if self.handed_writes(a, env):
                    self.flag(every, f"{_dotted(a)} handed to {_dotted(f)}(...), which may call it")
                    break
        if isinstance(f, ast.Name) and (
            local := [x for x in env.get(f.id, ()) if isinstance(x, (_LocalFn, _Callee, _Bound))]
        ):  # NOTE [Calls the source reading spells out]: a name the forward bound to a function
            got = set()
            for x in local:
                if isinstance(x, _LocalFn):
                    got |= self.local_call(x, e, every, env, args, kws)
                elif isinstance(x, _Bound):
                    given = [set(x.receiver), *args]
                    got |= self.function_call(x.fn, f, e, given, kws) or set()
                elif _writes_first(x.fn, e):
                    self.flag(first, f"{f.id} ({_fn_name(x.fn)}) in its HF forward")
                    got |= first
                elif (
                    not self._outputs()
                    and (read := self.function_call(x.fn, f, e, args, kws)) is not None
                ):
                    got |= read
                else:
                    got |= first if _may_alias(getattr(x.fn, "__name__", "")) else set()
            others = [
                x for x in env.get(f.id, ()) if not isinstance(x, (_LocalFn, _Callee, _Bound))
            ]
            if not others:
                return got
        for k in e.keywords:  # torch.mul(h, 2, out=h) writes what ``out`` holds
            if k.arg == "out":
                self.flag(kws.get("out", set()), "an out= argument")
        if isinstance(f, ast.Attribute) and f.attr == "mark_dirty":
            # ctx.mark_dirty(x): the Function declares x written in place (NOTE [A custom
            # autograd Function that writes its input])
            self.flag(every, "ctx.mark_dirty in a custom autograd Function")
        if isinstance(f, ast.Name) and f.id in _DYNAMIC and self.callee(f, env) is not _MISSING:
            # exec/eval/locals/vars: code the source does not show may write any tensor the
            # forward holds (NOTE [Calls the source reading spells out])
            held = set().union(*(_no_consts(v) for v in env.values())) | {_IN} | every
            self.flag(held, f"{f.id}(...), which slimgrad cannot read")
            return held
        if (
            isinstance(f, ast.Attribute)
            and isinstance(f.value, ast.Call)
            and isinstance(f.value.func, ast.Name)
            and f.value.func.id == "super"
            and self.callee(f.value.func, env) is builtins.super
            and self.module is not None
        ):  # super().method(...): the parent class's method (NOTE [Calls the source reading
            # spells out]); one slimgrad cannot find may write anything it is given
            read = self.super_call(f, e, args, kws)
            if read is None:
                self.flag(every, f"super().{f.attr}(...), which slimgrad cannot read")
                return every
            return read
        if (
            isinstance(f, ast.Attribute)
            and isinstance(f.value, ast.Attribute)
            and isinstance(f.value.value, ast.Name)
            and f.value.value.id == self.me
            and self.guard is not None
            and self.module is not None
            and isinstance(child := self.module._modules.get(f.value.attr), nn.Module)
        ):  # self.child.method(...): NOTE [Calls the source reading spells out]
            if f.attr == "forward":  # the child's forward, called directly: the child's call
                return self.call(_spelled(e, f.value), env)
            method = getattr(type(child), f.attr, None)
            if (
                callable(method)
                and inspect.isfunction(_unwrap(method))
                and not (getattr(method, "__module__", None) or "").startswith("torch.")
            ):
                what = f"self.{f.value.attr}.{f.attr}"
                return self.method_call(method, child, what, e, args, kws)
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == self.me:
            child = self.module._modules.get(f.attr) if self.module is not None else None
            if isinstance(child, nn.Module):
                ci = self.guard.info(child)
                self.feeds(child, every)
                if ci.keeps_input:  # NOTE [An output kept on the module escapes]
                    self.escape(every)
                if ci.writes:  # NOTE [Why a module writes its input, in the report]
                    self.flag(every, _writer(f"{f.attr}: {type(child).__name__}", ci))
                    self.rebind(e, env, child, ci)
                # (_Made: which names hold this call's tensor, NOTE [An in-place module's input
                # is its output])
                return set(ci.ends) | (every if ci.passes else set()) | {_Made(id(e))}
            method = getattr(type(self.module), f.attr, None) if self.module is not None else None
            got: set = set()
            held = vars(self.module).get(f.attr, _MISSING) if self.module is not None else _MISSING
            if held is not _MISSING and callable(held):  # a callable stored on the module
                if (read := self.object_call(held, f.attr, e, args, kws)) is not None:
                    return read  # NOTE [A callable object given its module]
                if self._stored_writes([held], e):
                    self.flag(every, f"self.{f.attr}(...), a stored callable that may write")
                return every
            if callable(method):
                written, ret, kept = self.helper(method)
                fdef = _forward_ast(method)
                names = [a.arg for a in fdef.args.posonlyargs + fdef.args.args][1:] if fdef else []
                bound = {n: a for n, a in zip(names, args, strict=False)} | kws

                def of(params):
                    if params is None or len(args) > len(names):  # (*args: any argument)
                        return every
                    return set().union(*(a for n, a in bound.items() if n in params))

                self.flag(of(written), f"self.{f.attr}(...), which writes its argument in place")
                self.escape(of(kept))  # NOTE [An output kept on the module escapes]
                if ret is not None and not self._outputs():  # what its own source returns
                    got = {x for x in ret if not isinstance(x, _Param)}
                    got |= of({x.name for x in ret if isinstance(x, _Param)})
            # a helper may return (a view of) what it was given, and, asked about outputs, what
            # its own source returns
            return every | got | self.method_ends(f.attr, every)
        if (spelled := self.getattr_call(f, env)) is not None:  # getattr(h, "mul_")(...)
            base, name = spelled
            if name is None or _writes_name(name) or inplace_kw:
                what = "getattr(..., <a computed name>)" if name is None else name
                self.flag(base, f"{what} in its HF forward")
                return base
            return base if _may_alias(name) else set()
        if (
            isinstance(f, ast.Name)
            and f.id == "setattr"
            and len(e.args) == 3
            and self.callee(f, env) is builtins.setattr
        ):  # setattr(self, "last", h): NOTE [An output kept on the module escapes]
            self.escape(args[2])
            return set()
        if (callee := self.callee(f, env)) is not _MISSING and _writes_first(callee, e):
            # what the name calls writes its first argument: torch.ops.aten.mul_.Tensor(h),
            # aten.relu_(h) (an alias), torch.Tensor.mul_(h), F.leaky_relu(h, 0.1, True)
            self.flag(first, f"{_dotted(f)} in its HF forward")
            return first
        if (
            callee is not _MISSING
            and not self._outputs()
            and (read := self.function_call(callee, f, e, args, kws)) is not None
        ):
            return read  # NOTE [A function the forward calls by name]
        if (
            callee is not _MISSING
            and not self._outputs()
            and (fa := _function_apply(callee)) is not None
        ):  # NOTE [A custom autograd Function that writes its input]
            return self.apply_call(fa, e, args, kws)
        if callee is not _MISSING and not self._outputs() and _user_class(callee):
            # an object the forward makes: its methods are read where called; it may hold what
            # its constructor is given (NOTE [Calls the source reading spells out])
            return every | {_Obj(callee)}
        if isinstance(f, ast.Attribute) and _namespace(f.value):  # torch.fn(h), F.fn(h)
            if _inplace_name(f.attr) or inplace_kw:
                self.flag(first, f"{f.attr} in its HF forward")
                return first
            return first if _may_alias(f.attr) else set()
        if isinstance(f, ast.Attribute) and f.attr == "apply" and not self._outputs():
            # X.apply(...) where X is not a global name: a custom autograd Function the module
            # holds (self.fn.apply(h)), or one a parameter names; no tensor method is called
            # ``apply`` (NOTE [A custom autograd Function that writes its input])
            held = self.held_value(f.value)
            fa = _function_apply(getattr(held, "apply", None)) if held is not _MISSING else None
            if fa is not None:
                self.expr(f.value, env)
                return self.apply_call(fa, e, args, kws)
            if held is _MISSING or not isinstance(held, nn.Module):
                self.expr(f.value, env)
                self.flag(every, f"{_dotted(f)}(...), which slimgrad cannot read")
                return every
        if isinstance(f, ast.Attribute):  # h.method(...)
            base = self.expr(f.value, env)
            if base & _LOCAL_MARKS and not self._outputs():  # Tool().edit(h), Tool.edit(t, h)
                self.flag(every, f"{_dotted(f)}(...), a method of a class of its forward")
                return every | (base - _LOCAL_MARKS)
            objs = [x for x in base if isinstance(x, _Obj)]
            if objs and not self._outputs():  # NOTE [Calls the source reading spells out]
                got = set()
                for x in objs:
                    found = _method_of(x.cls, f.attr)
                    if found is None:  # not a plain function: it may write what it is given
                        self.flag(every, f"{_dotted(f)}(...), which slimgrad cannot read")
                        got |= every
                        continue
                    fn, receiver = found
                    given = [base, *args] if receiver else args
                    got |= self.function_call(fn, f, e, given, kws) or set()
                if not base - set(objs):
                    return got
            if _SHARED in base:  # self.box.put(h), CACHE.append(h): NOTE [An output kept on the
                self.escape(every)  # module escapes]
            if f.attr in _METADATA_METHODS:  # h.size(1), h.dim(): a number, no tensor
                return set()
            if _writes_name(f.attr):
                self.flag(base, f"{f.attr} in its HF forward")
                return base
            if inplace_kw:
                self.flag(base, f"{f.attr}(..., inplace=True) in its HF forward")
            return base if _may_alias(f.attr) or inplace_kw else set()
        if (
            isinstance(f, ast.Name)
            and len(e.args) == 1
            and isinstance(e.args[0], ast.Name)
            and e.args[0].id == self.me
            and self.callee(f, env) is type
        ):  # type(self): the class, whose attributes outlive the call
            return {_SHARED}
        if isinstance(f, ast.Name) and self.callee(f, env) in _SCALAR_BUILTINS:
            return set()  # NOTE [A number read from a tensor holds no tensor]
        if isinstance(f, ast.Name):
            if _inplace_name(f.id) or inplace_kw:
                self.flag(first, f"{f.id} in its HF forward")
                return first
            held = env.get(f.id, ())
            if _LOCAL_CLASS in held and not self._outputs():  # Tool(h): it may hold what it is
                return every | {_LOCAL_OBJ}  # given (NOTE [Calls the source reading spells out])
            if _LOCAL_OBJ in held and not self._outputs():  # t(h), t an object of such a class
                self.flag(every, f"{f.id}(...), an object of a class of its forward")
                return every
            each = [x for x in env.get(f.id, ()) if isinstance(x, _Each)]
            if self._outputs() or each:
                # a layer held in a name (a loop over a container) returns its ends, and flags
                # what it is given when it writes its input (both questions); asked about
                # outputs, an unknown function given a method of the module applies it
                # (apply_chunking_to_forward(self.chunk, ...)): what that method returns; else
                # (a ModelOutput) its arguments
                methods = [
                    a.attr
                    for a in [*e.args, *(k.value for k in e.keywords)]
                    if self._outputs()
                    and isinstance(a, ast.Attribute)
                    and isinstance(a.value, ast.Name)
                    and a.value.id == self.me
                    and a.attr not in self.module._modules
                    and callable(getattr(type(self.module), a.attr, None))
                ]
                got = set().union(*(self.method_ends(a, every) for a in methods))
                if not methods and not each:
                    got |= every
                for x in each:
                    for c in x.kids:
                        ci = self.guard.info(c)
                        self.feeds(c, every)
                        if ci.writes:
                            self.flag(every, f"{f.id}: {type(c).__name__}, which writes its input")
                        got |= set(ci.ends) | (every if ci.passes else set())
                return got
            if getattr(self.callee(f, env), "__module__", None) == "builtins":
                # dict(a=h), sorted([h]), zip(hs): a builtin's result may hold any argument
                return every
            return first if _may_alias(f.id) else set()
        if (
            self.guard is not None
            and self.module is not None
            and isinstance(f, ast.Subscript)
            and isinstance(f.value, ast.Attribute)
            and isinstance(f.value.value, ast.Name)
            and f.value.value.id == self.me
            and isinstance(self.module._modules.get(f.value.attr), (nn.ModuleList, nn.ModuleDict))
        ):  # self.layers[i](h): any child's output; any child that writes flags what it is given
            self.expr(f.slice, env)
            got = set()
            for c in self.module._modules[f.value.attr]._modules.values():
                if c is not None:
                    ci = self.guard.info(c)
                    self.feeds(c, every)
                    if ci.writes:
                        self.flag(
                            every,
                            f"{f.value.attr}[...]: {type(c).__name__}, which writes its input",
                        )
                    got |= set(ci.ends) | (every if ci.passes else set())
            return got
        if isinstance(f, ast.Subscript):  # BODIES[k](h), self.acts[k](h): a stored callable
            self.expr(f.slice, env)
            held = self.stored(f.value, env)
            if held is None or self._stored_writes(held, e):
                self.flag(every, f"{_dotted(f)}(...), a stored callable that may write")
            for fn in held or ():
                if isinstance(fn, nn.Module):
                    self.feeds(fn, every)
            return every
        if isinstance(f, ast.Call) and not self._outputs():
            made = self.callee(f.func, env)
            if made is type and len(f.args) == 1 and not f.keywords:
                # type(x)(...): x's own type (a tuple, a tensor class) built anew: it writes
                # nothing it is given
                self.expr(f, env)
                return every
            if isinstance(made, type) and issubclass(made, nn.Module) and _known_module(made):
                # nn.Softmax(dim=-1)(h): a torch module made on the spot writes its input only
                # where made in place (inplace=True, by keyword or as a positional True)
                self.expr(f, env)
                inplace = _inplace_kw(f) or any(
                    isinstance(a, ast.Constant) and a.value is True for a in f.args
                )
                if inplace:
                    self.flag(first, f"{_dotted(f)}(...) in its HF forward")
                    return first
                return set()
        held = self.expr(f, env)
        if self._outputs():
            return set()
        # a callable an expression computes (``make()(h)``, ``partial(fn)(h)``, ``(lambda t:
        # ...)(h)``): a local function or a method taken from an object is read; anything else may
        # write what it is given (NOTE [Calls the source reading spells out])
        got = set()
        for x in held:
            if isinstance(x, _LocalFn):
                got |= self.local_call(x, e, every, env, args, kws)
            elif isinstance(x, _Bound):
                got |= self.function_call(x.fn, f, e, [set(x.receiver), *args], kws) or set()
        if not any(isinstance(x, (_LocalFn, _Bound)) for x in held):
            self.flag(every, f"{_dotted(f)}(...), which slimgrad cannot read")
            got |= every
        return got

    def held_value(self, e):
        # the object ``self.<attr>`` (not a child module) or a global dotted name denotes at
        # convert time, or _MISSING
        if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == self.me:
            if self.module is None:
                return _MISSING
            if e.attr in self.module._modules:
                return self.module._modules[e.attr]
            try:
                return inspect.getattr_static(self.module, e.attr)
            except AttributeError:
                return _MISSING
        return self.callee(e, {}) if isinstance(e, (ast.Name, ast.Attribute)) else _MISSING

    def super_call(self, f, e: ast.Call, args: list, kws: dict) -> set | None:
        # ``super().<name>(...)`` read as the module's helper the class above the forward's
        # defines, or None where there is no such plain function (``super`` given arguments)
        if f.value.args or self.fn is None or self.module is None:
            return None
        method = _parent_function(type(self.module), self.fn, f.attr)
        if method is None:
            return None
        return self.method_call(method, self.module, f"super().{f.attr}", e, args, kws)

    def apply_call(self, fa: tuple, e: ast.Call, args: list, kws: dict) -> set:
        # ``Fn.apply(...)`` given ``args``/``kws``, ``fa`` its ``_function_apply``: flags what its
        # forward writes, returns what it may return (NOTE [A custom autograd Function that
        # writes its input])
        cls, written, ret = fa
        starred = any(isinstance(a, ast.Starred) for a in e.args) or bool(kws)
        every = set().union(*args, *kws.values())

        def of(positions) -> set:
            if positions is None or (positions and starred):
                return every
            return set().union(*(args[i] for i in positions if i < len(args)))

        self.flag(of(written), f"{cls.__name__}.apply, whose forward writes its input")
        return of(ret)

    def literal_getattr(self, v, env: dict) -> ast.Attribute | None:
        # ``getattr(x, "name")`` with a literal name, spelled ``x.name``; None for anything else
        if (
            isinstance(v, ast.Call)
            and len(v.args) == 2
            and not v.keywords
            and isinstance(v.args[1], ast.Constant)
            and isinstance(v.args[1].value, str)
            and v.args[1].value.isidentifier()
            and self.callee(v.func, env) is builtins.getattr
        ):
            return ast.Attribute(v.args[0], v.args[1].value, ast.Load())
        return None

    def method_call(self, method, module, what: str, e: ast.Call, args: list, kws: dict) -> set:
        # ``module.<method>(...)`` (a child's method: NOTE [Calls the source reading spells
        # out]), read as the module's own helpers are
        every = set().union(*args, *kws.values())
        written, ret, kept = self.helper(method, module=module)
        fdef = _forward_ast(method)
        names = [a.arg for a in fdef.args.posonlyargs + fdef.args.args][1:] if fdef else []
        bound = {n: a for n, a in zip(names, args, strict=False)} | kws

        def of(params):
            if params is None or len(args) > len(names) or None in kws:  # (*args, **kwargs)
                return every
            return set().union(*(a for n, a in bound.items() if n in params))

        self.flag(of(written), f"{what}(...), which writes its argument in place")
        self.escape(of(kept))  # NOTE [An output kept on the module escapes]
        got = set()
        if ret is not None:
            got = {x for x in ret if not isinstance(x, _Param)}
            got |= of({x.name for x in ret if isinstance(x, _Param)})
        return every | got

    def local_call(self, fn: _LocalFn, e, every: set, env: dict, args=None, kws=None) -> set:
        # NOTE [Calls the source reading spells out]: a function defined in the forward (``def``
        # or a lambda), read where it is called (``e``), its parameters holding what the call
        # gives them, its free names what they hold now; ``e`` None: handed to another call,
        # every parameter holding anything that call is given. What it returns.
        node = fn.node
        if node in self.active:  # a recursive call: it may write and return anything given
            self.flag(every, "a recursive function of its HF forward")
            return every
        a = node.args
        pos = [x.arg for x in a.posonlyargs + a.args]
        inner = dict(env)  # its free names: what they hold where it is called (late binding)
        names = [*pos, *(x.arg for x in a.kwonlyargs), *(x.arg for x in (a.vararg, a.kwarg) if x)]
        if e is None or any(isinstance(x, ast.Starred) for x in e.args) or None in (kws or {}):
            for n in names:
                inner[n] = set(every)
        else:
            for n in names:
                inner[n] = set()
            for n, held in zip(pos, args, strict=False):
                inner[n] = set(held)
            if a.vararg is not None and len(args) > len(pos):
                inner[a.vararg.arg] = set().union(*args[len(pos) :])
            for k, held in kws.items():
                if k in inner and k not in (a.vararg.arg if a.vararg else None,):
                    inner[k] = set(held)
                elif a.kwarg is not None:
                    inner[a.kwarg.arg] = inner[a.kwarg.arg] | held
        saved = self.ret, self.ret_items, self.loops
        self.ret, self.ret_items, self.loops = set(), [], []
        self.active.add(node)
        try:
            if isinstance(node, ast.Lambda):
                self.ret |= self.expr(node.body, inner)
            else:
                self.block(node.body, inner)
            got = self.ret
        finally:
            self.active.discard(node)
            self.ret, self.ret_items, self.loops = saved
        return got

    def function_call(self, fn, f, e: ast.Call, args: list, kws: dict) -> set | None:
        # NOTE [A function the forward calls by name]: what the call of ``fn``, a plain Python
        # function that is not torch's, writes, keeps and returns of its arguments, from its
        # source; None for any other callee
        every = set().union(*args, *kws.values())
        if isinstance(fn, functools.partial):  # a partial's own arguments come first
            if isinstance(fn.func, types.FunctionType) and not _known_function(fn.func):
                given = [set() for _ in fn.args] + list(args)
                return self.function_call(
                    fn.func, f, e, given, {**dict.fromkeys(fn.keywords, set()), **kws}
                )
            if _callable_may_write(fn, e):
                self.flag(every, f"{_dotted(f)}(...), a partial that may write")
            return every
        if isinstance(fn, types.MethodType):  # a bound method: a class's classmethod, an object's
            return self.function_call(fn.__func__, f, e, [set(), *args], kws)
        if (call := _object_call(fn)) is not None:  # a callable object a global name holds
            return self.function_call(call, f, e, [set(), *args], kws)
        if not isinstance(fn, types.FunctionType) or _known_function(fn):
            return None
        if (getattr(fn, "__module__", None) or "").startswith("slimgrad."):
            return None
        starred = any(isinstance(a, ast.Starred) for a in e.args)
        if (
            not starred
            and e.args
            and isinstance(e.args[0], ast.Name)
            and (e.args[0].id == self.me or e.args[0].id in self.me_aliases)
            and self.guard is not None
            and self.module is not None
            and len(args) == len(e.args)
        ):  # run(self, h): read as the module's helper, its first parameter the module, so its
            # calls of the module's children are followed (NOTE [Calls the source reading
            # spells out])
            fdef = _forward_ast(fn)
            if fdef is not None and fdef.args.posonlyargs + fdef.args.args:
                names = [x.arg for x in fdef.args.posonlyargs + fdef.args.args][1:]
                why = f"{_dotted(f)}(...), which writes its argument in place"
                return self.helper_mapped(self.helper(fn), names, args[1:], kws, why)
        spread = kws.get(None, set())  # **kwargs: any parameter not bound otherwise
        returned: set = set()
        for written, kept, ret, pos in _function_readings(fn):
            bound = {} if starred else dict(zip(pos, args, strict=False))
            bound |= {k: v for k, v in kws.items() if k is not None}

            def of(params, bound=bound) -> set:
                # what the call passes to ``params`` (arguments past ``pos`` go to its
                # ``*args``, which ``params`` names only as None)
                if params is None or (params and starred):
                    return every
                got = set().union(*(x for n, x in bound.items() if n in params))
                return got | (spread if any(n not in bound for n in params) else set())

            self.flag(of(written), f"{_dotted(f)}(...), which writes its argument in place")
            self.escape(of(kept))  # NOTE [An output kept on the module escapes]
            returned |= of(ret)
        # the functions it may return (``g = make(); g(h)``): NOTE [Calls the source reading
        # spells out]
        returned |= _FN_RETURNS.get(fn.__code__, set())
        return returned

    def object_call(self, obj, attr: str, e: ast.Call, args: list, kws: dict) -> set | None:
        # NOTE [A callable object given its module]: ``self.<attr>(self, ...)`` where the module
        # holds ``obj``, a plain object whose class defines ``__call__`` in Python, read as a
        # helper of the module; None where that does not apply (then: a stored callable)
        fn = _object_call(obj)
        return (
            None if fn is None else self.object_method(fn, type(obj), f"self.{attr}", e, args, kws)
        )

    def object_method(self, fn, owner: type, what: str, e: ast.Call, args: list, kws: dict):
        # (``object_call``, its ``__call__`` or a parent's, ``fn``, found: None where the call
        # does not fit)
        if (
            self.guard is None
            or self.module is None
            or not e.args
            or not (isinstance(e.args[0], ast.Name) and e.args[0].id == self.me)
            or any(isinstance(a, ast.Starred) for a in e.args)
        ):
            return None
        fdef = _forward_ast(fn)
        if fdef is None or fdef.decorator_list:
            return None
        a = fdef.args
        if len(a.posonlyargs + a.args) < 2:  # no parameter for the module
            return None
        names = [x.arg for x in a.posonlyargs + a.args][2:]
        why = f"{what}(...), whose __call__ writes its argument in place"
        return self.helper_mapped(self.helper(fn, at=1, owner=owner), names, args[1:], kws, why)

    def helper_mapped(self, read: tuple, names: list, args: list, kws: dict, why: str) -> set:
        # a helper's reading (``helper``: written, returned, kept) mapped onto a call's
        # arguments, ``names`` its parameters after the module's and ``args`` what the call
        # passes them: flags what it writes (``why``), escapes what it keeps, returns what it
        # may return (its arguments where its returns are not known)
        written, ret, kept = read
        bound = {n: x for n, x in zip(names, args, strict=False)}
        bound |= {k: v for k, v in kws.items() if k is not None}
        spread = kws.get(None, set())  # **kwargs: any parameter not bound otherwise
        every = set().union(*args, *kws.values())

        def of(params) -> set:
            # (as in ``function_call``: arguments past ``names`` go to its ``*args``, any of them)
            if params is None or len(args) > len(names):
                return every
            got = set().union(*(x for n, x in bound.items() if n in params))
            return got | (spread if any(n not in bound for n in params) else set())

        self.flag(of(written), why)
        self.escape(of(kept))  # NOTE [An output kept on the module escapes]
        if ret is None:
            return every
        got = {x for x in ret if not isinstance(x, _Param)} - {_SHARED}
        return got | of({x.name for x in ret if isinstance(x, _Param)})

    def stored(self, v, env: dict) -> list | None:
        # the callables a container named ``self.<attr>`` or a global name holds, or None
        if isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.value.id == self.me:
            obj = vars(self.module).get(v.attr, _MISSING) if self.module is not None else _MISSING
        elif isinstance(v, ast.Name) and v.id not in env and v.id != self.me:
            obj = self.globals.get(v.id, _MISSING)
        else:
            return None
        if isinstance(obj, dict):
            return list(obj.values())
        if isinstance(obj, (list, tuple)):
            return list(obj)
        return None

    def _stored_writes(self, fns: list, call: ast.Call) -> bool:
        # NOTE [Callables stored on the module]: whether any of ``fns`` may write its first
        # argument, or any argument, in place
        for fn in fns:
            if isinstance(fn, nn.Module):
                if self.guard is None or self.guard.info(fn).writes:
                    return True
            elif _callable_may_write(fn, call):
                return True
        return False


# NOTE [Callables stored on the module]
# A forward may call what it holds in an attribute or a container rather than a child module
# (``self.act_fn = functools.partial(F.relu, inplace=True)``, ``self.fn = lambda h: h.clamp_()``,
# a global dict of functions ``BODIES[self.how](h)``). The source reader reads the object the
# module (or the forward's globals) holds at convert time and counts the call as a write to its
# arguments unless it can tell it is not: a module that does not write its input (its own
# reading), a ``functools.partial`` of a known function with no ``inplace=True`` (by keyword, or
# at the function's position for it) and a name that is not an in-place verb, a known function
# (a torch function, an ATen operator, a builtin) that does not write (``_writes_first``). A lambda,
# a Python function, a callable object, or a container the reader cannot resolve (a local dict, a
# value computed at run time) may write. Changing the stored callable after convert_ is not
# covered (as for the settings the reader takes as known).
def _known_function(fn) -> bool:
    if isinstance(
        fn,
        (
            types.BuiltinFunctionType,
            types.BuiltinMethodType,
            types.MethodDescriptorType,
            types.WrapperDescriptorType,
            *_OP_HOLDERS,
        ),
    ):
        return True
    if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return True
    mod = getattr(fn, "__module__", None) or ""
    # (a wrapper functools.wraps made over a torch function takes its __module__: not torch's)
    return (
        isinstance(fn, types.FunctionType)
        and (mod == "torch" or mod.startswith("torch."))
        and not hasattr(fn, "__wrapped__")
    )


def _callable_may_write(fn, call: ast.Call, given: int = 0) -> bool:
    # ``given``: positional arguments a partial supplies before the call's own
    if isinstance(fn, functools.partial):
        if fn.keywords.get("inplace") is True:
            return True
        try:
            pos = _INPLACE_ARG_POS.get(fn.func)
        except TypeError:  # unhashable
            pos = None
        if pos is not None and given + len(fn.args) > pos:
            if (fn.args[pos - given] if pos >= given else None) is True:
                return True
        return _callable_may_write(fn.func, call, given + len(fn.args))
    if not _known_function(fn):
        return True
    if given:  # the call's own arguments sit after the partial's
        name = getattr(fn, "__name__", None)
        try:
            pos = _INPLACE_ARG_POS.get(fn)
        except TypeError:
            pos = None
        if pos is not None and pos >= given:
            arg = call.args[pos - given] if len(call.args) > pos - given else None
            if isinstance(arg, ast.Constant) and arg.value is True:
                return True
        if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return _writes_first(fn, ast.Call(func=call.func, args=[], keywords=[]))
        return isinstance(name, str) and _writes_name(name) or _inplace_kw(call)
    return _writes_first(fn, call) or _inplace_kw(call)


def _handed_fn_writes(fn) -> bool:
    # whether ``fn``, handed to a call that may call it, may write what it is called with: a plain
    # function (or a partial, a bound method, a callable object over one) that writes one of its
    # parameters, one slimgrad cannot read, or a torch function that writes its first argument
    if isinstance(fn, functools.partial):
        inner = fn.func
        if isinstance(inner, types.FunctionType) and not _known_function(inner):
            return _handed_fn_writes(inner) or fn.keywords.get("inplace") is True
        return _callable_may_write(fn, ast.Call(func=ast.Name("f"), args=[], keywords=[]))
    if isinstance(fn, types.MethodType):
        return _handed_fn_writes(fn.__func__)
    if isinstance(fn, nn.Module):
        return True  # a module a global name holds: not read here
    if _known_function(fn):
        return _writes_name(getattr(fn, "__name__", "") or "")
    if (call := _object_call(fn)) is not None:
        fn = call
    if not isinstance(fn, types.FunctionType):
        return True
    if (getattr(fn, "__module__", None) or "").startswith("slimgrad."):
        return False
    return any(w is None or bool(w) for w, _, _, _ in _function_readings(fn))


def _inplace_kw(call: ast.Call) -> bool:
    return any(
        k.arg == "inplace" and isinstance(k.value, ast.Constant) and k.value.value is True
        for k in call.keywords
    )


@dataclass(frozen=True, eq=False)
class _Each:
    # a name bound by a loop over a module container (NOTE [Modules whose output is the model's
    # output]): the children it may hold in this pass
    kids: tuple


# the most children a loop over a container is read pass by pass for (beyond: any child per pass)
_UNROLL = 256


# ModelOutput fields a call returns only when asked per call (output_hidden_states=True, ...):
# not followed by the outputs question (NOTE [Modules whose output is the model's output])
_EXTRA_FIELDS = frozenset(
    {
        "hidden_states", "attentions", "cross_attentions", "past_key_values",
        "encoder_hidden_states", "encoder_attentions", "decoder_hidden_states",
        "decoder_attentions", "router_logits", "all_hidden_states",
    }
)  # fmt: skip


def _inplace_name(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__") and name != "requires_grad_"


# in-place operator methods: ``h.__iadd__(r)`` writes h
_INPLACE_DUNDERS = frozenset(f"__{op.__name__}__" for op in _INPLACE_OPERATORS)


def _writes_name(name: str) -> bool:
    return _inplace_name(name) or name in _INPLACE_DUNDERS


# what holds torch.ops' operators: ``torch.ops``, ``torch.ops.aten``, ``torch.ops.aten.mul_``
_OP_HOLDERS = tuple(
    c
    for c in (
        getattr(torch._ops, "_Ops", None),
        getattr(torch._ops, "_OpNamespace", None),
        getattr(torch._ops, "OpOverloadPacket", None),
    )
    if isinstance(c, type)
)


def _schema_writes_first(schema) -> bool:
    first = schema.arguments[0].alias_info if schema.arguments else None
    return first is not None and first.is_write


def _writes_first(fn, call: ast.Call) -> bool:
    # whether calling ``fn`` (a resolved callee) writes its first argument in place: an aten
    # operator whose schema says so (any overload of a packet), an in-place operator, a function
    # or method named as an in-place verb, an F function given inplace=True positionally
    if isinstance(fn, torch._ops.OpOverload):
        return _schema_writes_first(fn._schema)
    if isinstance(fn, torch._ops.OpOverloadPacket):
        return any(_schema_writes_first(getattr(fn, o)._schema) for o in fn.overloads())
    try:
        if fn in _INPLACE_OPERATORS:
            return True
        pos = _INPLACE_ARG_POS.get(fn)
    except TypeError:  # unhashable
        return False
    if pos is not None:
        arg = call.args[pos] if len(call.args) > pos else None
        if isinstance(arg, ast.Constant) and arg.value is True:
            return True
    name = getattr(fn, "__name__", None)
    return isinstance(name, str) and _writes_name(name) and callable(fn)


def _dotted(f) -> str:
    try:
        return ast.unparse(f)
    except Exception:  # noqa: BLE001
        return "a call"


# NOTE [Calls the source reading spells out]
# A forward read from its source can reach a write through a call that does not name it: a method
# of a child module (``self.editor.edit(h)``, or the child's ``forward`` called directly), a name
# bound to a function (``f = torch.Tensor.mul_; f(h, 2)``), ``getattr(self, "scale")(h)``, or a
# function defined in the forward (``def inner(): h.mul_(2)`` then ``inner()``; ``g = lambda t:
# t.add_(1)`` then ``g(h)``). Each was read as a call that writes nothing, so a LayerNorm's
# output written that way left the norm converted and backward raised autograd's in-place error
# where eager trains. Now: a child's method (a Python function that is not torch's own, such as
# ``Module.to``) is read as the module's own helpers are, with the child as its module, and its
# ``forward`` is the child's call; ``getattr(x, "name")(...)`` with a literal name is read as
# ``x.name(...)``; a name bound to what ``callee`` resolves (a torch function, an ATen operator,
# a global function) is that callee where it is called; a nested ``def`` or a lambda is read
# where it is called, its parameters holding what the call gives them and its free names what
# they hold there (Python binds them late), or, handed to another call (``checkpoint(inner,
# h)``, ``map``), with every parameter holding anything that call is given; a recursive one may
# write anything it is given. An object of a Python class the forward makes (``t = Tool()``, not
# torch's, not a module) has its methods read where they are called (``t.edit(h)``,
# ``Tool().edit(h)``, ``m = t.edit; m(h)``; a method that is not a plain function may write what it
# is given), and the object may hold what its constructor is given (the constructor itself, often
# generated (a dataclass's), is taken to write nothing, as before); and a callable an expression
# computes (``make()(h)``, ``functools.partial(fn)(h)``) may write what it is given. A global
# name may also hold a partial (its function read with the partial's arguments first), a bound
# method (a class method, an object's method) or a callable object (its ``__call__``). A local
# container or object holds what is put in it (``d[k] = h``, ``hs.append(h)``, ``b.h = h``), so a
# write through it is one through h. A function handed to a call as an argument (``apply(edit,
# h)``, ``map(edit, [h])``, ``sorted(hs, key=edit)``; a global function, a method of the module, a
# child module, a name bound to one) may be called with anything that call is given: where it may
# write (its reading writes a parameter; one slimgrad cannot read), what the call is given is
# written. A parameter whose default is a function (``def forward(self, x, fn=edit)``) calls that
# function; a plain function returning a global function by name (``g = make(); g(h)``) hands it
# to the caller; a plain function given the module first (``run(self, h)``) is read as the
# module's helper, so its calls of children are followed; a class defined in the forward has
# objects whose methods may write what they are given; and a loop over a literal tuple or list of
# children (``for layer in (self.act, self.drop)``) runs those children, in order.
# ``super().name(...)`` is the plain function the method resolution
# order reaches after the class that defines the function read (read as a helper; anything else,
# or ``super`` given arguments, may write what it is given), and exec/eval/locals/vars may write
# any tensor the forward holds. A function stored and called after the forward is not followed.
@dataclass(frozen=True, eq=False)
class _LocalFn:
    # a function defined in the forward read (a ``def`` or a lambda), among what a name may hold
    # (NOTE [Calls the source reading spells out])
    node: ast.AST


_LOCAL_CLASS = object()  # a name bound to a class the forward defines
_LOCAL_OBJ = object()  # an object of such a class (NOTE [Calls the source reading spells out])
_LOCAL_MARKS = frozenset((_LOCAL_CLASS, _LOCAL_OBJ))


@dataclass(frozen=True, eq=False)
class _Callee:
    # a function a name of the forward was bound to (``f = torch.Tensor.mul_``)
    fn: object


@dataclass(frozen=True, eq=False)
class _Obj:
    # an object of a Python class the forward made (``t = Tool()``), among what a name may hold:
    # its methods' sources are read where they are called (NOTE [Calls the source reading spells
    # out])
    cls: type


@dataclass(frozen=True, eq=False)
class _Bound:
    # a method of such an object, taken without calling it (``m = Tool().edit``): the function and
    # what its receiver holds
    fn: object
    receiver: frozenset


def _known_module(c: type) -> bool:
    # a module class torch defines (torch.nn's activations, norms, ...)
    mod = getattr(c, "__module__", None) or ""
    return mod.startswith("torch.nn.")


def _user_class(c) -> bool:
    # a class of the user's or a library's (not torch's, not a builtin, not a module)
    if not isinstance(c, type) or issubclass(c, nn.Module):
        return False
    mod = getattr(c, "__module__", None) or ""
    return not (mod == "builtins" or mod == "torch" or mod.startswith("torch."))


def _method_of(cls: type, name: str):
    # (the plain function ``cls.<name>`` calls, whether it takes the receiver) or None
    try:
        v = inspect.getattr_static(cls, name)
    except AttributeError:
        return None
    if isinstance(v, staticmethod):
        v, receiver = v.__func__, False
    elif isinstance(v, classmethod):
        return None
    else:
        receiver = True
    return (v, receiver) if inspect.isfunction(v) else None


def _renamed(f, me: str):
    # ``a.x.y`` with its root name replaced by ``me``
    if isinstance(f, ast.Attribute):
        return ast.Attribute(_renamed(f.value, me), f.attr, ast.Load())
    return ast.Name(me, ast.Load())


_SPELLED: dict[int, tuple[ast.Call, ast.Call]] = {}


def _spelled(e: ast.Call, func) -> ast.Call:
    # ``e`` calling ``func`` instead (one spelling per call node), made once per node, so that its
    # id names its tensor (``_Made``); both nodes are kept alive here
    got = _SPELLED.get(id(e))
    if got is None or got[0] is not e:
        got = (e, ast.Call(func=func, args=e.args, keywords=e.keywords))
        _SPELLED[id(e)] = got
    return got[1]


@dataclass(frozen=True)
class _Made:
    # the tensor a call of a child made (its ast node's id), among what a name may hold: names that
    # hold it may be one tensor (NOTE [An in-place module's input is its output])
    call: int


@dataclass(frozen=True)
class _Param:
    # a helper method's parameter, among what a name may hold while its source is read
    name: str


def _op_name(op) -> str:
    return {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}.get(type(op), "op")


def _no_consts(held) -> set:
    return {x for x in held if not isinstance(x, _Const)}


def _union(a: dict, b: dict) -> dict:
    # a name holds a literal after the join only where both sides hold that same literal (a side
    # that never assigned it, e.g. a parameter, may hold anything)
    out = {}
    for k in a.keys() | b.keys():
        x, y = a.get(k), b.get(k)
        if x is None or y is None or x - _no_consts(x) != y - _no_consts(y):
            out[k] = _no_consts((x or set()) | (y or set()))
        else:
            out[k] = set(x) | set(y)
    return out


def _any_end(guard: _Guard, m: nn.Module) -> list:
    # what any module below ``m`` may return (through ModuleLists and ModuleDicts too)
    return [e for d in m.modules() if d is not m for e in guard.info(d).ends]


def _source_info(guard: _Guard, m: nn.Module, inplace: bool) -> _Info:
    fdef = _forward_ast(getattr(type(m), "forward", None))
    if fdef is not None and not fdef.args.posonlyargs + fdef.args.args:
        fdef = None  # forward(*args): no name for the module to follow
    if fdef is None and guard.outputs is not None:  # unknown: any child's output may be returned
        ends = _any_end(guard, m)
        return _Info(ends=ends, writes=inplace, passes=True)
    if fdef is None:  # where tensors flow is unknown (NOTE [In-place writes in HF forwards])
        if any(getattr(d, "inplace", False) is True for d in m.modules()):
            for child in m.children():
                guard.flag(
                    guard.info(child).ends,
                    f"maybe: its parent {type(m).__name__} cannot be traced by torch.fx, its "
                    "forward source cannot be read, and it holds a module with inplace=True",
                )
        return _Info(writes=inplace)
    me, *params = [a.arg for a in fdef.args.posonlyargs + fdef.args.args]
    env = {params[0]: {_IN}} if params else {}
    # the module's own name in its forward: ``self`` or any other
    flow = _Flow(guard, m, me, getattr(type(m), "forward", None))
    # a parameter whose default is a function calls it where the caller passes nothing (NOTE
    # [Calls the source reading spells out])
    a = fdef.args
    pairs = (
        [
            *zip((x.arg for x in (a.posonlyargs + a.args)[-len(a.defaults) :]), a.defaults),
            *((x.arg, d) for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None),
        ]
        if a.defaults or a.kw_defaults
        else []
    )
    for name, d in pairs:
        if name in env or not isinstance(d, (ast.Name, ast.Attribute)):
            continue
        if (obj := flow.default_callee(d)) is not None:
            env[name] = {_Callee(obj)}
    flow.block(fdef.body, env)
    ends = [x for x in flow.ret if isinstance(x, nn.Module)]
    items = None
    rets = flow.ret_items
    fn = getattr(type(m), "forward", None)
    # the tuple's items only where the read source is what runs: a decorator (the source read is
    # the unwrapped function's) may return other items or reorder them
    if (
        rets
        and not fdef.decorator_list
        and _unwrap(fn) is fn
        and all(r is not None and len(r) == len(rets[0]) for r in rets)
    ):
        items = tuple(
            frozenset(x for r in rets for x in r[i] if isinstance(x, nn.Module) or x == _IN)
            for i in range(len(rets[0]))
        )
    return _Info(
        ends=ends,
        writes=inplace or _IN in flow.written,
        passes=_IN in flow.ret,
        items=items,
        takes=flow.takes,
        keeps_input=flow.keeps_input,
    )


# NOTE [What a hook registered before convert_ may write]
# A forward hook receives ``(module, args[, kwargs], output)`` and a forward pre-hook ``(module,
# args[, kwargs])`` (``with_kwargs=True``: the module's ``_forward_hooks_with_kwargs``); the global
# ones (``register_module_forward_hook``/``_pre_hook``, torch's ``_global_forward_*`` dicts of
# ``torch.nn.modules.module``) run on every module, before its own. Each hook is read once per
# function (``hook_roles``: its source, as ``_HookFlow`` reads it: an in-place write through any
# name it binds to what it is given, the value handed to a callable slimgrad cannot read, an
# attribute assigned on it), giving the positions it may write (a ``functools.partial`` without
# keywords: its function's, shifted by the arguments it binds: timm's FeatureHooks); a hook with
# no readable source (a callable object, a partial with keywords, ``*args`` that is written) may
# write every one. slimgrad's own observers and transformers' output-capturing hook write
# nothing. What it may write decides:
#   - the output (a forward hook): the module's ``ends`` are flagged, as a write after them;
#   - what the module is given, before it runs (a pre-hook): the module is a writer of its input,
#     which flags whatever produced it (the module itself reads the written value);
#   - what the module was given, after it ran (a forward hook writing ``args``/``kwargs``;
#     ``always_call`` changes nothing here): the module is a writer of its input *after* reading
#     it (``_Info.after``), so the producer's ends are flagged with the module itself among the
#     readers: a ReLU that claimed a BatchNorm output and whose own forward hook writes that
#     output stays torch's (NOTE [A write after a BatchNorm output was claimed]).
# Hooks registered after ``convert_`` are checked per call (NOTE [Forward hooks on an
# output-saving module], NOTE [Hooks registered after convert_ on the modules around] in
# slimgrad/nn/_hooks.py), or caught at backward by the version counters with slimgrad's error
# (NOTE [A kept tensor written after forward] in ops/_derived.py).
def _hook_writes(m: nn.Module) -> str | None:
    # a forward hook on ``m`` (or a global one) that may write its output in place (NOTE [What a
    # hook registered before convert_ may write]), or None. Hooks added after convert_: NOTE
    # [Forward hooks on an output-saving module] in slimgrad/nn/_hooks.py.
    for hook, kw in _forward_hooks(m):
        roles = hook_roles(hook)
        if roles is None:
            return "maybe: a forward hook whose source cannot be read (it may edit the output)"
        if (3 if kw else 2) in roles:
            return f"a forward hook ({_fn_name(hook)}) that writes the output in place"
    return None


def _hook_writes_input(m: nn.Module) -> str | None:
    # a forward hook on ``m`` (or a global one) that may write what ``m`` was given, after ``m``'s
    # forward ran (NOTE [What a hook registered before convert_ may write]): which, or None
    glob = getattr(_torch_module, "_global_forward_hooks", {})
    for hook, kw in _forward_hooks(m):
        roles = hook_roles(hook)
        if roles is None or roles & ({1, 2} if kw else {1}):
            where = "runs a global" if any(h is hook for h in glob.values()) else "has a"
            return f"{where} forward hook ({_fn_name(hook)})"
    return None


def _forward_hooks(m: nn.Module) -> list[tuple[Callable, bool]]:
    # (hook, with_kwargs) for the forward hooks ``m(...)`` runs: the global ones, then its own
    glob = getattr(_torch_module, "_global_forward_hooks", {})
    glob_kw = getattr(_torch_module, "_global_forward_hooks_with_kwargs", {})
    return [(h, k in glob_kw) for k, h in glob.items()] + [
        (h, k in getattr(m, "_forward_hooks_with_kwargs", {})) for k, h in m._forward_hooks.items()
    ]


# NOTE [Why a module writes its input, in the report]
# A module counts as a writer of its input (``_Info.writes``) for one of these reasons, and the
# report names the one found first, after the module's name: its forward, as read (an
# ``inplace=True`` flag of a module whose forward is torch's or has no children: "which writes its
# input in place (inplace=True)"; a forward set on the instance: "which runs a forward set on the
# instance ..."; any other forward, traced or read, a nested Sequential's included: "whose forward
# may write its input in place"), then its hooks (NOTE [What a hook registered before convert_
# may write]): a forward hook that may write its output where that output may be its input, a
# forward pre-hook (its own or a global one, named) that may write what it is given, a forward
# hook that may write what it was given. A lazy module's initializer hook writes nothing where
# torch defines ``initialize_parameters`` (NOTE [A lazy module's initializer hook]); where it may
# write, the report names the ``initialize_parameters`` it hands the input to.
def _analysed_cause(m: nn.Module) -> str:
    own = m.__dict__.get("forward")
    if own is not None and (kind := _instance_kind(own, m)) != "class":
        what = "wraps its class's forward" if kind == "wrapper" else "slimgrad cannot read"
        return f"which runs a forward set on the instance ({_fn_name(own)}) that {what}"
    plain = type(m).__module__.startswith("torch.") or not m._modules
    if plain and getattr(m, "inplace", False) is True:
        return "which writes its input in place (inplace=True)"
    return "whose forward may write its input in place"


def _unhedged(why: str) -> str:
    return why.removeprefix("maybe: ")


def _writer(name: str, ci: _Info) -> str:
    return f"{name}, {ci.cause or 'whose forward may write its input in place'}"


# NOTE [Hooks on the modules around an output-saving one]
# A hook on another module may write an output-saving module's output: a forward hook on a
# parent whose output may be that output (``ends``), a forward pre-hook on the module its output
# goes to (which then writes its input). Which modules those are is the structure the guard reads
# anyway, so a hook registered before ``convert_`` is read with its module, once: a forward hook
# whose source writes its output (or cannot be read) flags the module's ``ends``, as one on the
# output-saving module itself does (``_hook_writes``); a forward pre-hook whose source writes any
# argument (or cannot be read) makes its module a writer of its input, which flags whatever feeds
# it where its parent's forward is read. Such hooks registered after ``convert_``, and global
# forward pre-hooks, are checked per call from the same structure (``output_modules``' ``near``:
# the parents' forward hook dicts, and the forward pre-hook and forward hook dicts of the modules
# its output is given to, ``_Info.takes`` following what a module hands its input to; read by
# ``hook_may_write``, stricter than the reading here: NOTE [Hooks registered after convert_ on the
# modules around] in slimgrad/nn/_hooks.py). Not followed there: a module a helper method of the
# parent (not its forward) hands the output to.
def _pre_hook_writes(m: nn.Module) -> str | None:
    # a forward pre-hook on ``m`` (or a global one) that may write what ``m`` is given: which, or
    # None (NOTE [Why a module writes its input, in the report])
    glob = getattr(_torch_module, "_global_forward_pre_hooks", {})
    for hook in (*glob.values(), *m._forward_pre_hooks.values()):
        roles = hook_roles(hook)
        if roles is None or roles:
            where = "runs a global" if any(h is hook for h in glob.values()) else "has a"
            name = _fn_name(hook)
            if (lazy := _lazy_initializer(hook)) is not None:  # NOTE [A lazy module's ...]
                name += f", which hands it to {_fn_name(type(lazy).initialize_parameters)}"
            return f"{where} forward pre-hook ({name})"
    return None


# builtins that run code the source does not show, on the hook's own locals
_DYNAMIC = frozenset({"exec", "eval", "locals", "vars"})
# the methods of a container that take a value without writing it (``seen.append(out)``)
_KEEPING = frozenset({"append", "extend", "insert", "add", "update", "setdefault", "appendleft"})


# NOTE [A callable object given its module]
# A forward may hand its work to an object it holds, called with the module itself: diffusers'
# ``Attention.forward`` ends in ``self.processor(self, hidden_states, ...)``, the attention
# processor being a plain object whose class defines ``__call__(self, attn, hidden_states, ...)``
# and calls the module's children (``attn.to_q(hidden_states)``). Where the forward is read from
# its source (one torch.fx cannot trace; a traced forward follows the call anyway), such a call
# counted as a stored callable that may write everything it is given, so the LayerNorm before
# every such attention stayed eager (its savings lost) though the processor writes nothing. Now,
# where the object's class defines ``__call__`` as a plain Python function (no decorator) taking
# the object and then the module, and the call passes the module first (no ``*args``), that
# ``__call__`` is read as a helper method of the module (NOTE [In-place writes in HF forwards]),
# the module under its own name there: its children's calls, their writes and outputs are
# followed, and what it writes, keeps or returns of its arguments is mapped back to the call's
# (an argument spread with ``**kwargs`` may reach any parameter not named otherwise). The object
# itself holds ``_SHARED``: what is stored on it, or handed to anything it holds, may be kept past
# the call, and a tensor handed to one of its own methods (``self.rotate(h)``) or to a callable
# it holds counts as written (its source is not read). Anything else the call does not fit (a
# function, a partial, a lambda, a decorated or C ``__call__``) is a stored callable (NOTE
# [Callables stored on the module]). Changing the object after convert_ is not covered, as for
# any stored callable.
def _parent_function(cls: type, fn, name: str):
    # the plain function ``super().<name>`` reaches from the class of ``cls``'s method resolution
    # order that defines ``fn``, or None (not found, or not a plain function: a static or class
    # method, a C one) (NOTE [Calls the source reading spells out])
    mro = cls.__mro__
    code = getattr(fn, "__code__", None)
    cell = None
    if code is not None and "__class__" in code.co_freevars and fn.__closure__:
        cell = fn.__closure__[code.co_freevars.index("__class__")].cell_contents
    if cell is not None:  # zero-argument super() binds the class whose body defines fn
        owner = mro.index(cell) if cell in mro else None
    else:
        owner = next(
            (
                i
                for i, c in enumerate(mro)
                if any(inspect.isfunction(v) and _unwrap(v) is fn for v in vars(c).values())
            ),
            None,
        )
    if owner is None:
        return None
    for c in mro[owner + 1 :]:
        if name in vars(c):
            v = vars(c)[name]
            return v if inspect.isfunction(v) else None
    return None


def _object_call(obj):
    # the Python ``__call__`` of a plain callable object, or None
    if isinstance(obj, (nn.Module, type, functools.partial, torch.Tensor)) or inspect.isroutine(
        obj
    ):
        return None
    try:
        fn = inspect.getattr_static(type(obj), "__call__")
    except AttributeError:
        return None
    return fn if inspect.isfunction(fn) else None


class _ObjectFlow(_Flow):
    # a callable object's ``__call__`` read with the module (NOTE [A callable object given its
    # module]); ``own``: the name it gives its object
    def __init__(self, guard, module, me: str, fn, own: str, owner: type | None) -> None:
        super().__init__(guard, module, me, fn)
        self.own, self.owner = own, owner

    def super_call(self, f, e: ast.Call, args: list, kws: dict) -> set | None:
        # super().__call__(attn, h): the object's parent class's, read as its own __call__ is
        # (NOTE [Calls the source reading spells out])
        if f.value.args or self.owner is None or self.fn is None:
            return None
        fn = _parent_function(self.owner, self.fn, f.attr)
        if fn is None:
            return None
        return self.object_method(fn, self.owner, f"super().{f.attr}", e, args, kws)

    def call(self, e: ast.Call, env: dict) -> set:
        f = e.func
        root = f
        while isinstance(root, ast.Attribute):
            root = root.value
        if f is not root and isinstance(root, ast.Name) and root.id == self.own:
            given = {
                x
                for a in [*e.args, *(k.value for k in e.keywords)]
                for x in self.expr(a, env)
                if not isinstance(x, _Const) and x != _SHARED
            }
            if given:
                self.flag(given, f"{_dotted(f)}(...), which slimgrad does not read")
        return super().call(e, env)


class _HookFlow(_Flow):
    # a hook's source read for NOTE [Hooks on the modules around an output-saving one]: besides
    # the writes ``_Flow`` sees, a value the hook was given that reaches a callable slimgrad does
    # not know (a function of the user's, a closure, a method of another object) or an attribute
    # assignment (``out.data = ...``) counts as written
    def __init__(self, hook, tensors: frozenset[str]) -> None:
        super().__init__(None, None, fn=hook)
        self.tensors = tensors  # the names of what it is given (not the module, not ``self``)

    def call(self, e: ast.Call, env: dict) -> set:
        got = super().call(e, env)
        f = e.func
        if isinstance(f, ast.Name) and f.id in _DYNAMIC:  # code slimgrad cannot read
            self.flag(set(self.tensors), f"{f.id}(...), which slimgrad cannot read")
        given = {
            x
            for a in [*e.args, *(k.value for k in e.keywords)]
            for x in self.expr(a, env)
            if x in self.tensors
        }
        if not given:
            return got
        f = e.func
        if isinstance(f, ast.Attribute) and self.expr(f.value, env) & self.tensors:
            return got  # a method of a value it was given (a tensor's): by its name (``_Flow``)
        callee = self.callee(f, env)
        known = callee is not _MISSING and (
            _known_function(callee)
            or (isinstance(callee, type) and callee.__module__ == "builtins")
        )
        if known and callee not in (setattr, delattr) and not _inplace_kw(e):
            return got
        if isinstance(f, ast.Attribute) and callee is _MISSING and f.attr in _KEEPING:
            return got
        self.flag(given, f"{_dotted(f)}(...), which slimgrad cannot read")
        return got

    def assign(self, target, held: set, env: dict) -> None:
        if isinstance(target, ast.Attribute):
            self.flag(self.expr(target.value, env), "an attribute assignment")
        super().assign(target, held, env)


_HOOK_MEMO: dict = {}
_FILE_AST: dict[str, ast.Module | None] = {}


def _file_lambdas(fn) -> list:
    # a lambda whose lines do not parse alone (one inside a dict literal over several lines): every
    # lambda of its file that starts on its line with its arity (all assumed to run)
    code = getattr(fn, "__code__", None)
    if code is None or getattr(fn, "__name__", "") != "<lambda>":
        return []
    path = code.co_filename
    if path not in _FILE_AST:
        try:
            _FILE_AST[path] = ast.parse("".join(linecache.getlines(path)) or "None")
        except (SyntaxError, ValueError):
            _FILE_AST[path] = None
    tree = _FILE_AST[path]
    return [
        (node.args, [ast.Return(node.body)])
        for node in (ast.walk(tree) if tree is not None else ())
        if isinstance(node, ast.Lambda)
        and node.lineno == code.co_firstlineno
        and len(node.args.posonlyargs + node.args.args) == code.co_argcount
    ]


def hook_may_write(hook) -> bool:
    """Whether a forward hook or forward pre-hook may write a tensor it is given in place (NOTE
    [What a hook registered before convert_ may write]): its source read once per function (an
    unreadable one may); slimgrad's own observers and transformers' output-capturing hook do not.
    """
    roles = hook_roles(hook)
    return roles is None or bool(roles)


def hook_roles(hook) -> frozenset[int] | None:
    """The positions of the arguments a forward hook or forward pre-hook may write in place (1: the
    args tuple; 2: the kwargs dict or the output; 3: the output after kwargs), None for any (NOTE
    [What a hook registered before convert_ may write])."""
    mod = getattr(hook, "__module__", None) or ""
    if mod.startswith("slimgrad.") or (
        mod == "transformers.utils.output_capturing"
        and getattr(hook, "__name__", None) == "output_capturing_hook"
    ):
        return frozenset()
    if isinstance(hook, functools.partial):  # (timm's FeatureHooks: a partial of a method)
        if hook.keywords:
            return None
        inner = hook_roles(hook.func)
        n = len(hook.args)
        return None if inner is None else frozenset(i - n for i in inner if i >= n)
    if (lazy := _lazy_initializer(hook)) is not None:  # NOTE [A lazy module's initializer hook]
        return frozenset() if _initializer_reads_only(lazy) else frozenset({1, 2})
    code = getattr(hook, "__code__", None)
    if code is None:  # a callable object: its source is not read
        return None
    key = (code, inspect.ismethod(hook))
    if key not in _HOOK_MEMO:
        _HOOK_MEMO[key] = _hook_source_roles(hook)
    return _HOOK_MEMO[key]


# NOTE [A lazy module's initializer hook]
# Every lazy module (``LazyModuleMixin``, public API: ``LazyLinear``, ``LazyConv*d``,
# ``LazyBatchNorm*d``, ...) registers ``self._infer_parameters`` as a forward pre-hook with kwargs;
# at its first call it hands what the module is given to ``module.initialize_parameters(*args,
# **kwargs)``, then removes itself (and turns the module into its ``cls_to_become``). Read as any
# hook, that call is one slimgrad cannot follow, so the module counted as a writer of its input
# and kept the activation before it eager, even after it had materialized. What the hook writes
# is what ``initialize_parameters`` writes: the ones torch defines (``torch.nn.modules``) read the
# input's shape alone and materialize the module's own parameters, so the hook writes nothing; a
# user's own ``initialize_parameters`` is read as a hook is (its source: a write of any argument,
# or an unreadable source, may write what the module is given); one set on the instance, or a
# subclass's own ``_infer_parameters``, is read as any hook. ``_infer_parameters`` is a private
# name: where a torch release lacks it, the hook is read as any other (the activation stays eager,
# the report naming the hook).
def _lazy_initializer(hook) -> nn.Module | None:
    # the lazy module whose own initializer hook ``hook`` is, or None
    infer = getattr(_Lazy, "_infer_parameters", None)
    if infer is None or not isinstance(hook, types.MethodType) or hook.__func__ is not infer:
        return None
    m = hook.__self__
    return m if isinstance(m, _Lazy) and "initialize_parameters" not in m.__dict__ else None


def _initializer_reads_only(m: nn.Module) -> bool:
    init = getattr(type(m), "initialize_parameters", None)
    if init is None:
        return False
    if (getattr(init, "__module__", None) or "").startswith("torch.nn.modules."):
        return True
    code = getattr(init, "__code__", None)
    if code is None:
        return False
    key = (code, "initialize_parameters")
    if key not in _HOOK_MEMO:  # (self, input, ...): every parameter but self is given
        _HOOK_MEMO[key] = _hook_source_roles(init)
    return _HOOK_MEMO[key] == frozenset()


def _hook_source_roles(hook) -> frozenset[int] | None:
    fdef = _forward_ast(hook)
    if fdef is not None:
        bodies = [(fdef.args, fdef.body)]
    else:
        bodies = _lambdas(hook) or _file_lambdas(hook)
        if not bodies:
            return None
    out: set[int] = set()
    for args, body in bodies:
        params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
        rest = [a.arg for a in (args.vararg, args.kwarg) if a is not None]
        if inspect.ismethod(hook) and params:  # (its object is none of what it is given)
            params = params[1:]
        # (module, args[, kwargs][, output]); ``*a`` and ``**kw`` may hold any of them
        tensors = frozenset(params[1:] + rest)
        flow = _HookFlow(hook, tensors)
        flow.block(body, {a: {a} for a in params + rest})
        written = flow.written & tensors
        if written & set(rest):
            return None
        out |= {i for i, a in enumerate(params) if a in written}
    return frozenset(out)


# NOTE [A number read from a tensor holds no tensor]
# ``self.stats.append(float(h.max()))``, ``h[0, 0].item()``, ``h.tolist()`` keep Python numbers,
# not ``h``: no write through them reaches ``h``, so they are no escape (NOTE [An output kept on
# the module escapes]) and no alias of ``h``. It is a fact only where what is read is a tensor,
# so the guard takes it from what it knows: ``float``, ``int``, ``bool`` and ``complex`` (the
# builtins, whatever they are given: each returns its own type) in a read source; in a traced
# forward, ``.item()`` and ``.tolist()`` of a value the trace shows is a tensor (``_tensor_node``:
# the output of an output-saving module or a BatchNorm whose forward is its class's, without
# forward hooks, or an ATen operator or an index applied to such a value). ``.item()`` of any
# other value (a name in a read source, a child's output of unknown type) may be a user's method
# that returns what it holds, and stays an alias.
_SCALAR_METHODS = frozenset({"item", "tolist"})
# tensor methods that return a number, a shape or a flag, never a tensor (the source reading)
_METADATA_METHODS = frozenset(
    {
        "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset",
        "element_size", "data_ptr", "get_device", "is_contiguous", "is_floating_point",
        "is_complex", "item", "tolist",
    }
)  # fmt: skip
_SCALAR_BUILTINS = (float, int, bool, complex)


def _tensor_node(node, m: nn.Module, outputs: tuple | None, depth: int = 0) -> bool:
    # NOTE [A number read from a tensor holds no tensor]: whether ``node``'s value is a tensor;
    # ``outputs``: the slimgrad classes the outputs question asks about (their forwards return a
    # tensor)
    if not isinstance(node, torch.fx.Node) or depth > 64:
        return False
    if node.op == "call_module":
        sub = m.get_submodule(node.target)
        if "forward" in sub.__dict__ or _hooked(sub):  # (a forward hook may return anything)
            return False
        if outputs is not None and isinstance(sub, outputs):
            return type(sub).__module__.startswith("slimgrad.")
        return _is_source(sub) or any(
            _qualname(c) in SAVES_OUTPUT and type(sub).forward is c.forward
            for c in type(sub).__mro__
        )
    if node.op not in ("call_method", "call_function") or not node.args:
        return False
    if node.target is operator.getitem:
        return _tensor_node(node.args[0], m, outputs, depth + 1)
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if node.op == "call_function" and not (
        getattr(node.target, "__module__", None) or ""
    ).startswith("torch"):
        return False
    try:
        getattr(torch.ops.aten, _ATEN_NAME.get(name, name))
    except (AttributeError, RuntimeError):
        return False
    return _tensor_node(node.args[0], m, outputs, depth + 1)


def _writes_first_arg(node: torch.fx.Node, name: str) -> bool:
    if node.op == "call_function" and node.target in _INPLACE_OPERATORS:
        return True
    schema = getattr(node.target, "_schema", None)  # torch.ops.aten.add_.Tensor(h, ...)
    if node.op == "call_function" and schema is not None:
        first = schema.arguments[0].alias_info if schema.arguments else None
        return first is not None and first.is_write
    if _writes_name(name):
        return True  # Tensor.relu_(), torch.relu_, F.relu_, x.add_(...), Tensor.__iadd__(x, r)
    if node.op == "call_function" and node.target in _INPLACE_ARG_POS:
        pos = _INPLACE_ARG_POS[node.target]
        if node.kwargs.get("inplace") is True:
            return True
        return len(node.args) > pos and node.args[pos] is True
    return node.kwargs.get("inplace") is True


def _describe(node: torch.fx.Node, name: str) -> str:
    return f"{name}(..., inplace=True)" if node.kwargs.get("inplace") is True else name


def _nodes_in(args) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(args, found.append)
    return found


def inplace_guard_pattern(
    model: nn.Module,
    config: object,
    allowed: Callable,
    rep: object,
    traces: Traces | None = None,
) -> None:
    """Mark output-saving modules followed by an in-place write; ``convert_`` leaves them as is.

    Args:
        model: the model ``convert_`` is converting.
        config, allowed, rep: as for every ``convert_`` pattern pass (unused: the table pass
            reports the kept modules, with the reason from :func:`kept_reason`).
        traces: where the fx traces it makes are kept for the later readings (NOTE [One reading
            of the structure per convert_]); None: its own.
    """
    for m in model.modules():
        _KEPT.pop(m, None)
    if traces is not None:
        traces.note_tree(model)
    guard = _Guard(traces=traces)
    for m in model.modules():
        guard.info(m)
        if _saves_output(m) and (why := _hook_writes(m)) is not None:
            guard.flag([m], why)
    for m, reason in guard.keep.items():
        _KEPT[m] = reason


# NOTE [Modules whose output is the model's output]
# A converted module that keeps its output for backward where eager keeps its input (the norms,
# LeakyReLU/Hardtanh/ReLU6, the smooth activations) is wrong where that output is what the model
# returns: the caller may write it in place (``out += r``, ``out[mask == 0] = 0``: autograd's error
# where eager trains) or through ``.data`` (wrong gradients, silently). Which modules' outputs may
# be the model's output is read once at ``convert_`` time, with the same reading of the model's
# structure the in-place guard uses (nn.Sequential order, torch.fx traces of plain-torch forwards,
# the source of HF forwards and of untraceable ones: the ``ends`` of the root), widened for this
# question: a loop over a ModuleList/Sequential (``for layer in self.layers: h = layer(h)``, also
# ``enumerate(...)`` and ``self.layers[:n]`` with number bounds) is read one pass per child, in
# order, the loop's name holding that child alone (up to ``_UNROLL`` children; beyond, or over a
# slice with other bounds, any child in any pass): so ``h`` leaves the loop holding the last
# child's output, ``hs = hs + (h,)`` every child's, and a pass a branch may skip (LayerDrop's
# ``continue``, ``if not to_drop: h = layer(h)``) leaves what the previous pass left (the loop's
# input, if every pass may skip). ``continue`` and ``break`` join what the names hold there at the
# loop's head and exit (in every loop). A branch whose test reads only number/None settings of the
# module, a child's presence (``self.final_layer_norm is not None``: swapping a child for None is a
# change of structure, run ``convert_`` again) or a local name assigned a literal (``to_drop =
# False``) is followed where it leads at ``convert_`` time: BART's and OPT's LayerDrop, off by
# default, costs nothing; set ``layerdrop > 0`` before ``convert_`` and every layer's norm runs
# eager's op. ``self.layers[i](h)`` may return any child's output; ``hs + (h,)``, ``hs += (h,)`` and
# ``hs.append(h)`` make ``hs`` hold what ``h`` holds; a function slimgrad does not know (a
# ModelOutput, ``apply_chunking_to_forward(self.chunk, ...)``) may return its arguments and what a
# method of the module handed to it returns; ``self.m(...)`` may return what method m's source
# returns (its arguments, for a property or stored callable); a forward or method whose source
# cannot be read as one function (a lambda) may return any descendant's output. Tuple items: where
# every return of a read forward is a tuple literal of one length (DeBERTa-v2's ``return
# (attention_output, att_matrix)``), what each item holds is kept too (``_Info.items``), and ``a, b
# = self.child(...)`` gives each name its item; anything else (a starred item, another length, a
# return that is not a literal, a traced child, a child with forward hooks or its own instance
# forward) gives every name every item. The module is the
# forward's first parameter, whatever its name (``def forward(mod, x)``). Not followed: the
# ModelOutput fields a call fills only when asked per call (``output_hidden_states=True``,
# ``output_attentions=True``: ``_EXTRA_FIELDS``), which transformers collects with hooks and a
# per-call request (NOTE [Hidden states handed out per call] in slimgrad/nn/_output_act.py: the
# norms those can hand out decide per call); a module held at several places counts once, where it
# is read.
# ``slimgrad.nn._output_act.state_consumers_`` turns such modules to eager's op (``keep_y``).


# NOTE [An output kept on the module escapes]
# A forward may keep a tensor on a module past its call (``self.last = h`` for probing,
# ``self.feats.append(h)``, ``self.cache[k] = h``, ``setattr(self, "last", h)``, also on a child:
# ``self.child.last = h``) while only a residual add reads it. That tensor leaves the model as a
# returned one does: the user may write it after forward, through ``.data`` (no version bump: a
# converted op that keeps its output computes wrong gradients, silently) or under ``no_grad``
# (autograd's error, where eager, which keeps the op's input, trains). So a kept value counts as
# the model's output for NOTE [Modules whose output is the model's output]: every output-saving
# module whose output it may hold runs eager's op (or, InPlaceABN/ReversibleSequential, returns a
# copy), and the report says why (``KEPT_ON_MODULE``). Found in the same reading, from the
# structure at ``convert_`` time:
#   - in a traced forward, the Proxies the trace left in the attribute dicts of the module and its
#     descendants (and in the containers, subclasses included, and objects reachable from them: an
#     OrderedDict, a deque, a SimpleNamespace, a plain object; a closure's cells, a partial's
#     arguments, what an iterator, a generator or a frame refers to), read before the trace is
#     undone (NOTE [A trace leaves the model as it was]; ``_kept_on_modules``), and every Proxy of
#     the trace still alive once it is undone and garbage is collected (``_still_alive``, from weak
#     references the tracer takes to each Proxy it makes: one in a global, a class attribute, an
#     object's slots, or anything else the undoing does not reach; one held only by a reference
#     cycle is garbage), name the nodes kept (train and eval traces both;
#     a helper method the forward calls runs in the trace, so what it keeps is among them);
#   - in a read source, an assignment to ``self.<path>`` or an item of it, a keeping method of it
#     (``_KEEPING``) and ``setattr(self, ...)`` keep what they are given (a lambda or a
#     comprehension gives every name it reads: ``_CAPTURING``); so does, for a value the
#     module or a global holds (``_SHARED``: ``self.<name>`` that is not a child, a parameter or
#     buffer, a code object or a class; a global name bound to a container or an object; an
#     attribute of a module or class reached from a global; ``type(self)``; ``self.__class__``;
#     a local name assigned one), an attribute or item assignment on it and any call of one of its
#     methods (``self.box.put(h)``, ``CACHE.append(h)``, ``b = self.box; b.items.append(h)``,
#     ``type(self).last = h``; what such a call returns is not held, but for a container's
#     accessors, ``_HELD_ITEM``: ``self.cache.get(k).append(h)``), and a helper method of the
#     module for the arguments its own source keeps (``_Flow.helper``; one whose source cannot be
#     read keeps all of them).
# A Proxy of a tensor's metadata (``h.shape``, ``h.size(0)``, ``h.dtype``, ``h.numel()``) holds no
# tensor and is no escape, nor is a number read from a tensor (NOTE [A number read from a tensor
# holds no tensor]). A forward that keeps its input (or a view of it) makes its callers' reading
# keep what they give it (``_Info.keeps_input``), so a child storing what its parent hands it
# counts as well. Every module is read for this (not only those the root's forward reaches). Not
# followed: what a forward hands to an argument it was given (``store.append(h)`` with ``store``
# a parameter of the forward: the caller's object), a global function slimgrad does not read that
# keeps its argument (in a read source), a tensor kept in one call and read back in a later one
# (tests/conformance/test_output_kept_on_module_more.py: containers and metadata;
# tests/conformance/test_output_kept_on_module_round3.py: globals, class attributes, objects,
# helpers, numbers).


def output_modules(
    model: nn.Module,
    kinds: tuple[type, ...],
    owners: dict[int, list] | None = None,
    traces: Traces | None = None,
    near: dict[int, list] | None = None,
    kept: set[int] | None = None,
) -> list[nn.Module]:
    """The modules of ``kinds`` in ``model`` whose output may be what ``model`` returns (NOTE
    [Modules whose output is the model's output]).

    Args:
        model: the (converted) model.
        kinds: the module classes asked about.
        owners: if given, filled with ``{id(m): [modules below the root whose output may be m's
            output]}`` for every other module of ``kinds`` (NOTE [Hidden states handed out per
            call] in slimgrad/nn/_output_act.py), from the same reading.
        traces: the fx traces read before the swaps (NOTE [One reading of the structure per
            convert_]): a module read then is not traced again; None: every module traced now.
        near: if given, filled with ``{id(m): [hook dicts]}`` for every module of ``kinds``: the
            hook dicts of the modules around it that may write its output (NOTE [Hooks on the
            modules around an output-saving one]), from the same reading.
        kept: if given, filled with the ids of the returned modules whose output may be kept on
            a module past its forward and is not otherwise the model's output (NOTE [An output
            kept on the module escapes]).

    Returns:
        Those modules, each once.
    """
    guard = _Guard(outputs=kinds, traces=traces)
    seen: dict[int, nn.Module] = {}
    for m in guard.info(model).ends:
        if isinstance(m, kinds):
            seen.setdefault(id(m), m)
    for m in model.modules():  # NOTE [An output kept on the module escapes]
        guard.info(m)
    for m in guard.escaped.values():
        if isinstance(m, kinds) and id(m) not in seen:
            seen[id(m)] = m
            if kept is not None:
                kept.add(id(m))
    if owners is not None:
        parents: dict[int, list] = {}
        for p in model.modules():
            for c in p._modules.values():
                if c is not None:
                    parents.setdefault(id(c), []).append(p)
        for m in model.modules():
            if not isinstance(m, kinds) or id(m) in seen:
                continue
            # up from m while its output may be the ancestor's (an ancestor's ends come from its
            # children's: one whose ends lack m has no ancestor above it that holds m)
            found, todo, done = [], list(parents.get(id(m), ())), set()
            while todo:
                a = todo.pop()
                if a is model or id(a) in done:
                    continue
                done.add(id(a))
                if any(e is m for e in guard.info(a).ends):
                    found.append(a)
                    todo.extend(parents.get(id(a), ()))
            if found:
                owners[id(m)] = found
    if near is not None:
        near.update(_neighbour_dicts(guard, model, kinds))
    return list(seen.values())


def _neighbour_dicts(guard: _Guard, model: nn.Module, kinds: tuple[type, ...]) -> dict[int, list]:
    # NOTE [Hooks on the modules around an output-saving one]: per module of ``kinds``, the
    # forward hooks of the modules whose output may be its output, and the forward pre-hooks and
    # forward hooks of the modules its output may be given to (and of their children given it)
    up: dict[int, list[nn.Module]] = {}
    for a in model.modules():
        info = guard.memo.get(id(a))
        for e in info.ends if info is not None else ():
            if e is not a:
                up.setdefault(id(e), []).append(a)
    out: dict[int, list] = {}
    for m in model.modules():
        if not isinstance(m, kinds):
            continue
        dicts = {id(a._forward_hooks): a._forward_hooks for a in up.get(id(m), ())}
        todo, done = list(guard.fed.get(id(m), ())), set()
        while todo:
            c = todo.pop()
            if id(c) in done:
                continue
            done.add(id(c))
            dicts.update({id(d): d for d in (c._forward_pre_hooks, c._forward_hooks)})
            info = guard.memo.get(id(c))
            todo.extend(info.takes if info is not None else ())
        if dicts:
            out[id(m)] = list(dicts.values())
    return out
