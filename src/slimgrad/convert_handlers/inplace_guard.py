"""convert_ pass: keep output-saving modules unconverted where an in-place write follows them.

Several slimgrad modules keep their *output* for backward where eager keeps its input (the norms,
the smooth activations, LeakyReLU/ELU/Hardtanh/ReLU6: ``SAVES_OUTPUT``). If the model then writes
that output in place (``ReLU(inplace=True)``, ``Dropout(inplace=True)``, ``h.relu_()``,
``F.relu(h, inplace=True)``, ``h += r``, also through views, slices and transposes of it), eager
trains but the converted backward raises autograd's "modified by an inplace operation".

This pass finds such modules before the table pass and marks them, so ``convert_`` leaves them as
they are and names the reason in its report (NOTE [In-place writers after output-saving modules]).
"""

from __future__ import annotations

import operator
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from slimgrad.convert_handlers import hf as _hf

__all__ = ["SAVES_OUTPUT", "inplace_guard_pattern", "kept_reason"]

# NOTE [In-place writers after output-saving modules]
# A module is "output-saving" when its slimgrad replacement keeps its output for backward but
# eager's keeps its input (ReLU, Sigmoid and Tanh are not listed: eager keeps their output too, so
# an in-place write after them fails in eager as well). Its output reaches an in-place writer when,
# following the tensor from the module's output through ops that may return it or a view of it
# (views, slices, transposes, reshape, contiguous, Flatten/Identity, dropout, which returns its
# input in eval), we meet an op that writes its first argument in place. Where the tensor flows is
# found from nn.Sequential order (nested Sequentials in line) and, for other plain-torch modules,
# from a torch.fx trace in which every child module is a leaf; a child's own summary (which
# output-saving modules can reach its output, whether it writes its input) comes from the same
# analysis, recursively. HF transformers modules are not traced (their families are covered by the
# HF conformance suite); a module that cannot be traced keeps its output-saving children
# unconverted when any of its descendants has ``inplace=True``.
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
        "align_as", "rename", "refine_names", "mT", "T", "H", "mH",
    }
)  # fmt: skip
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


def kept_reason(module: nn.Module) -> str | None:
    """Why the last guard pass keeps ``module`` unconverted, or None."""
    return _KEPT.get(module)


@dataclass
class _Info:
    ends: list[nn.Module] = field(default_factory=list)  # savers whose output may be our output
    writes: bool = False  # writes its (first) input, or a view of it, in place
    passes: bool = False  # its output may be its input or a view of it


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

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return m is not self._root

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return _InplaceProxy(node, self)


class _Guard:
    def __init__(self) -> None:
        self.memo: dict[int, _Info] = {}
        self.keep: dict[nn.Module, str] = {}

    def flag(self, ends: list[nn.Module], writer: str) -> None:
        for m in ends:
            self.keep.setdefault(m, _REASON.format(writer, type(m).__name__))

    def info(self, m: nn.Module) -> _Info:
        key = id(m)
        if key not in self.memo:
            self.memo[key] = _Info()  # placeholder; the module tree has no cycles
            self.memo[key] = self._analyse(m)
        return self.memo[key]

    def _analyse(self, m: nn.Module) -> _Info:
        inplace = getattr(m, "inplace", False) is True
        if _saves_output(m):
            return _Info(ends=[m], writes=inplace)
        if isinstance(m, _PASS_MODULES):
            return _Info(writes=inplace, passes=True)
        if isinstance(m, nn.Sequential):
            return self._sequential(m)
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) or _is_hf(m):
            return _Info(writes=inplace)
        if not m._modules and type(m).__module__.startswith("torch."):
            return _Info(writes=inplace)  # a torch leaf: its 'inplace' says whether it writes
        if type(m).__module__.startswith("slimgrad."):
            return _Info()
        return self._traced(m)

    def _sequential(self, seq: nn.Sequential) -> _Info:
        ends: list[nn.Module] = []
        passes, writes = True, False
        for child in seq:
            ci = self.info(child)
            if ci.writes:
                self.flag(ends, f"{type(child).__name__}(inplace=True)")
                writes = writes or passes
            if ci.passes:
                ends = ends + ci.ends
            else:
                ends, passes = list(ci.ends), False
        return _Info(ends=ends, writes=writes, passes=passes)

    def _traced(self, m: nn.Module) -> _Info:
        try:
            with warnings.catch_warnings():  # the trace calls forward on Proxies (torch
                warnings.simplefilter("ignore")  # warns, e.g. under reentrant checkpoint)
                graph = _LeafTracer(m).trace(m)
        except Exception:
            # Untraceable forward: where tensors flow is unknown. Keep the output-saving children
            # (and those at the end of child Sequentials) when anything below has inplace=True.
            if any(getattr(d, "inplace", False) is True for d in m.modules()):
                for child in m.children():
                    self.flag(
                        self.info(child).ends,
                        f"maybe: its parent {type(m).__name__} cannot be traced by torch.fx and "
                        "holds a module with inplace=True",
                    )
            return _Info()
        state: dict[torch.fx.Node, _Info] = {}
        out = _Info()
        for node in graph.nodes:
            first = node.args[0] if node.args else None
            a0 = state.get(first, _Info()) if isinstance(first, torch.fx.Node) else _Info()
            if node.op == "placeholder":
                state[node] = _Info(passes=True)
            elif node.op == "call_module":
                ci = self.info(m.get_submodule(node.target))
                if ci.writes:
                    sub = type(m.get_submodule(node.target)).__name__
                    self.flag(a0.ends, f"{node.target}: {sub}, which writes its input in place")
                    out.writes = out.writes or a0.passes
                if ci.passes:
                    state[node] = _Info(ends=a0.ends + ci.ends, passes=a0.passes)
                else:
                    state[node] = _Info(ends=list(ci.ends))
            elif node.op in ("call_method", "call_function"):
                name = node.target if isinstance(node.target, str) else node.target.__name__
                if node.target is getattr and len(node.args) > 1:
                    name = str(node.args[1])  # h.T, h.mT, ...
                if _writes_first_arg(node, name):
                    self.flag(a0.ends, _describe(node, name))
                    out.writes = out.writes or a0.passes
                    state[node] = a0
                elif name in _VIEW_NAMES:
                    state[node] = a0
            elif node.op == "output":
                for n in _nodes_in(node.args):
                    s = state.get(n, _Info())
                    out.ends = out.ends + s.ends
                    out.passes = out.passes or s.passes
        return out


def _writes_first_arg(node: torch.fx.Node, name: str) -> bool:
    if node.op == "call_function" and node.target in _INPLACE_OPERATORS:
        return True
    if name.endswith("_") and not name.endswith("__") and name != "requires_grad_":
        return True  # Tensor.relu_(), torch.relu_, F.relu_, x.add_(...)
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


def inplace_guard_pattern(model: nn.Module, config: object, allowed: Callable, rep: object) -> None:
    """Mark output-saving modules followed by an in-place write; ``convert_`` leaves them as is.

    Args:
        model: the model ``convert_`` is converting.
        config, allowed, rep: as for every ``convert_`` pattern pass (unused: the table pass
            reports the kept modules, with the reason from :func:`kept_reason`).
    """
    for m in model.modules():
        _KEPT.pop(m, None)
    guard = _Guard()
    for m in model.modules():
        guard.info(m)
    for m, reason in guard.keep.items():
        _KEPT[m] = reason
