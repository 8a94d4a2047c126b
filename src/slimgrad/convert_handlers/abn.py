"""convert_ pattern (``ConvertConfig.inplace_abn``, opt-in): BatchNorm -> ReLU becomes InPlaceABN
with leaky_relu in any module, not only in ``nn.Sequential`` (torchvision's ResNet blocks).

Which BatchNorm is followed by which ReLU is read from the parent's ``forward`` with
``torch.fx`` (every child a leaf; the parent is traced, never changed). A BatchNorm child ``bn`` is
converted when, at every call site:

- its output goes to one place only: a call of an ``nn.ReLU`` module (``relu(bn(...))``);
- its input is the fresh output of a convolution or linear module used by nothing else;
- neither it nor that ReLU has hooks (a hook on the BatchNorm would see act(BN(x)) as its output),
  no global module hooks are registered, and every parent that holds it passes these checks (a
  module held by several parents stays one module: converted everywhere or nowhere).

Whether the InPlaceABN then writes over its input is decided at each call by
``slimgrad.ownership.owns_input`` (NOTE [Gradient-buffer ownership]): in place only when nobody else
can see the conv output (``out = self.bn(out)`` on a fresh ``out``, no hook keeping it), else into a
new tensor. The graph check above is what makes the *function* the same (the BN output reaches the
ReLU only); fx traces the branch the module's current attributes select, so a ``forward`` whose
Python control flow reads a BN output twice on another branch is outside what this check sees.

Such a ``bn`` becomes ``InPlaceABN(leaky_relu, slope)`` (``RecomputeABN`` where the ReLU feeds
an ``nn.MaxPool2d``, which becomes ``MaxPool2dRecompute``: ResNet's stem keeps nothing beyond the
floor, NOTE [Recomputed stem]) and the ReLU instance a
``LeakyReLUAfterABN`` paired with it: the identity on its ABNs' outputs, leaky_relu everywhere else
(the call after ``out += identity``); NOTE [ABN-activation pairs] in ``slimgrad/nn/inplace_abn.py``.
Every other BatchNorm (ResNet's bn3, whose output is changed by ``+=`` before the ReLU, and the
downsample BN) is left to the exact BatchNorm handler, which keeps no input there (it re-runs the
1x1 conv: NOTE [Recomputable inputs] in ``slimgrad/ops/_derived.py``); an InPlaceABN(identity)
there would keep a full-size output, and for bn3 autograd would reject the ``+=`` on it.

Result on torchvision's Bottleneck: per block the kept tensors are the conv inputs (the
matmul-input floor) and nothing else. Parameters and buffers are shared; state_dict keys are
unchanged; running it twice changes nothing (no ``nn.BatchNorm``/``nn.ReLU`` pair is left).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    import torch.fx

from slimgrad.convert_handlers.decision import Decision, Structure
from slimgrad.nn.inplace_abn import (
    InPlaceABN,
    LeakyReLUAfterABN,
    MaxPool2dRecompute,
    RecomputeABN,
    global_hooks,
    has_hooks,
    share_hooks,
)

__all__ = ["inplace_abn_pattern"]

_BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_FRESH_PRODUCERS = (nn.modules.conv._ConvNd, nn.Linear)


_NOT_A_PAIR = "its output does not go only to an nn.ReLU"


def _trace(parent: nn.Module) -> torch.fx.Graph:
    # torch.fx is imported here, not at import time: it pulls in torch._dynamo (and triton)
    import torch.fx

    class _LeafTracer(torch.fx.Tracer):
        proxy_buffer_attributes = True  # the root's own buffer updates are recorded, not run

        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return True

    from slimgrad.convert_handlers.inplace_guard import untouched

    # NOTE [A trace leaves the model as it was] (inplace_guard.py)
    with untouched(parent), warnings.catch_warnings():  # the trace calls forward on Proxies
        warnings.simplefilter("ignore")  # (torch warns, e.g. reentrant checkpoint)
        return _LeafTracer().trace(parent)


def _runs_class_forward(parent: nn.Module) -> bool:
    # parent(x) runs type(parent).forward (NOTE [A forward set on the instance], inplace_guard.py)
    from slimgrad.convert_handlers.inplace_guard import _instance_kind

    own = parent.__dict__.get("forward")
    return own is None or _instance_kind(own, parent) == "class"


def _module_of(parent: nn.Module, node: torch.fx.Node) -> nn.Module | None:
    if node.op != "call_module":
        return None
    return parent.get_submodule(node.target)


def _pool_after(parent: nn.Module, relu_node: torch.fx.Node) -> nn.Module | None:
    # the nn.MaxPool2d that alone consumes the ReLU's output, if any (ResNet's stem)
    users = list(relu_node.users)
    pool = _module_of(parent, users[0]) if len(users) == 1 else None
    if type(pool) in (nn.MaxPool2d, MaxPool2dRecompute) and users[0].args == (relu_node,):
        return pool
    return None


def _why_not(parent: nn.Module, node: torch.fx.Node) -> tuple[str | None, nn.Module | None]:
    # (reason it cannot become InPlaceABN at this call site, the ReLU that follows it)
    if len(node.args) != 1 or node.kwargs:
        return "called with extra arguments", None
    users = list(node.users)
    relu = _module_of(parent, users[0]) if len(users) == 1 else None
    if type(relu) is not nn.ReLU or users[0].args != (node,) or users[0].kwargs:
        return _NOT_A_PAIR, None
    src = node.args[0]
    producer = _module_of(parent, src) if hasattr(src, "op") and hasattr(src, "target") else None
    if not isinstance(producer, _FRESH_PRODUCERS) or len(src.users) != 1:
        return "its input is not a conv/linear output used only by it", None
    if has_hooks(parent.get_submodule(node.target)) or has_hooks(relu):
        return "it or the ReLU after it has hooks (they would see act(BN(x)) as BN's output)", None
    if "forward" in parent.get_submodule(node.target).__dict__ or "forward" in relu.__dict__:
        # NOTE [Instance forward on a fused leaf] (nn/inplace_abn.py)
        return "it or the ReLU after it has a forward set on the instance", None
    if isinstance(producer, nn.modules.conv._ConvNd) and all(k == 1 for k in producer.kernel_size):
        return None, (relu, "pointwise")
    return None, (relu, None)


def inplace_abn_pattern(model: nn.Module, config, allowed, found: Structure) -> list[Decision]:
    """Decide BatchNorm{1,2,3}d -> ReLU pairs as InPlaceABN(leaky_relu) + LeakyReLUAfterABN.

    Args:
        model: the model (read, not changed: ``convert_`` applies the decisions).
        config: a ``slimgrad.ConvertConfig`` (reads ``leaky_relu_slope``).
        allowed: ``allowed(module, qualified_name) -> bool`` (``convert_``'s filter_fn).
        found: the model's structure as the earlier patterns leave it.

    Returns:
        The decisions: each replacement (built now, sharing the original's state and hooks) at
        every place that holds the original, or why a BatchNorm or parent stays.
    """
    out: list[Decision] = []
    slope = float(config.leaky_relu_slope)
    names = found.names()
    occ = found.places()
    # id(bn) -> [(parent name, parent, [call nodes])] over every traced parent that holds it
    places: dict[int, list] = {}
    untraced: set[int] = set()
    for parent in found.modules():
        pname = names[id(parent)]
        kids: dict[str, nn.Module] = {}  # named_children()'s: a module held twice, once
        seen: set[int] = set()
        for n, c in parent._modules.items():
            if c is not None and id(c) not in seen:
                seen.add(id(c))
                kids[n] = found.now(c)
        if not any(type(c) in _BN_TYPES for c in kids.values()):
            continue
        if not any(type(m) is nn.ReLU for m in parent.modules()):
            untraced.update(id(c) for c in kids.values() if type(c) in _BN_TYPES)
            continue
        graph = found.traces.as_called(parent)  # the guard's trace where it has the one as called
        if graph is None and not _runs_class_forward(parent):
            # NOTE [A traced parent runs its class forward]: torch.fx traces type(parent).forward;
            # a forward set on the instance (that may read the BN output twice: off by 2.23
            # before) is what parent(x) runs, so without the guard's trace of it, no pairing
            out.append(Decision(pname, None, None, parent, reason=(
                "inplace_abn: its forward is set on the instance and was not read as called; "
                "its BatchNorms take the exact path"
            )))  # fmt: skip
            untraced.update(id(c) for c in kids.values() if type(c) in _BN_TYPES)
            continue
        try:
            graph = graph or _trace(parent)
        except Exception as e:  # fx raises many types on untraceable Python
            out.append(Decision(pname, None, None, parent, reason=(
                f"inplace_abn: forward not traceable by torch.fx ({type(e).__name__}); its "
                "BatchNorms take the exact path"
            )))  # fmt: skip
            untraced.update(id(c) for c in kids.values() if type(c) in _BN_TYPES)
            continue
        sites: dict[str, list[torch.fx.Node]] = {}
        for node in graph.nodes:
            if node.op == "call_module" and type(kids.get(node.target)) in _BN_TYPES:
                sites.setdefault(node.target, []).append(node)
        for bn_name, bn in kids.items():
            if type(bn) in _BN_TYPES:
                places.setdefault(id(bn), []).append((bn, parent, sites.get(bn_name, [])))
    new_relu: dict[int, LeakyReLUAfterABN] = {}
    for key, where in places.items():
        bn = where[0][0]
        fqn = names.get(key, "?")
        checks = [_why_not(p, n) for _, p, nodes in where for n in nodes]
        reasons = {r for r, _ in checks if r is not None}
        if not checks or _NOT_A_PAIR in reasons:
            continue  # e.g. bn3 (``out += identity`` follows): not a BN -> ReLU pair
        relus = {id(m[0]): m[0] for _, m in checks if m is not None}
        if not reasons and len(relus) != 1:
            reasons.add("it is followed by different ReLU modules")
        if key in untraced or len(where) != len(occ.get(key, [])):
            reasons.add("a parent that holds it was not traced")
        elif any(not nodes for _, _, nodes in where):
            reasons.add("a parent that holds it does not call it")
        if not reasons and global_hooks():
            reasons.add("global module hooks are registered (they would see act(BN(x)))")
        if reasons:
            why = "inplace_abn: " + "; ".join(sorted(reasons))
            out.append(Decision(fqn, None, None, bn, reason=why))
            continue
        (relu,) = relus.values()
        pools = {_pool_after(p, next(iter(n.users))) for _, p, nodes in where for n in nodes}
        pool = pools.pop() if len(pools) == 1 else None
        pointwise = all(m[1] == "pointwise" for _, m in checks)
        relu_fqn = names.get(id(relu), "?")
        if not (allowed(bn, fqn) and allowed(relu, relu_fqn)):
            out.append(Decision(fqn, None, None, bn, reason="filter_fn returned False"))
            continue
        if id(relu) not in new_relu:
            new_relu[id(relu)] = LeakyReLUAfterABN.from_torch(relu, slope)
            out += found.swap(relu_fqn, relu, new_relu[id(relu)], kind="ReLU")
        cls = RecomputeABN if pool is not None or pointwise else InPlaceABN
        abn = cls.from_torch(bn, activation="leaky_relu", activation_param=slope)
        paired = new_relu[id(relu)].pair(abn)
        out += found.swap(fqn, bn, paired, kind=f"{type(bn).__name__}+ReLU", to=cls.__name__)
        if type(pool) is nn.MaxPool2d and id(pool) not in found.claimed:
            mp = MaxPool2dRecompute.from_torch(pool)
            share_hooks(pool, mp)  # a handle taken before convert_ still removes it
            out += found.swap(names.get(id(pool), "?"), pool, mp, kind="MaxPool2d")
    return out
