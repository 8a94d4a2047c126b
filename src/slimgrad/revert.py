"""``revert_``: undo what ``convert_`` did to a model, in place.

Type-keyed tools (``torch.ao.quantization.quantize_dynamic``/``fuse_modules``, ONNX and other
exporters, ``torch.jit.script``, pruners) dispatch on ``type(module) is nn.X``; a converted model's
modules are slimgrad classes, so those tools skip them or fail. ``revert_(model)`` gives the model
back its own modules, with the same Parameters and buffers (NOTE [What convert_ records for
revert_]).
"""

from __future__ import annotations

import functools
import threading
import types
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

__all__ = ["note_swaps", "recording", "revert_"]

# NOTE [What convert_ records for revert_]
# ``convert_`` runs inside ``recording(model)``, which reads every module of the model once before
# anything changes (a shallow copy of its ``__dict__`` and of its ``_parameters``, ``_buffers``,
# ``_modules`` and hook dicts) and compares at the end:
#
# - a module replaced by another one (``convert.apply``'s swaps, noted by ``note_swaps``, and any
#   other child that changed at a place that held a module, e.g. the opt-in InPlaceABN pass's
#   ``nn.Identity``) gets the recipe of its original (``_Original``, on the replacement as
#   ``_slimgrad_original``): the original's class and ``__dict__`` as they were (no tensors), and
#   for each of its Parameters, buffers and children where the replacement holds it now (a path in
#   the replacement, found by identity). No tensor is held twice: ``revert_`` takes the tensors the
#   replacement holds then, so a Parameter the user reassigned and the buffers ``.to()`` made come
#   back as they are; a child without a place in the replacement gets a recipe of its own, and a
#   method or ``functools.partial`` bound to the original (accelerate's hook wrapper) is bound to
#   the rebuilt module (``_Bound``);
# - a module kept (a container, an HF model whose forward or configs a pattern changed) gets the
#   changes of its ``__dict__`` and containers (``_Undo``, on it as ``_slimgrad_undo``): each
#   attribute's value before and after, and the hook ids convert_ registered.
#
# ``revert_`` walks the model: a replacement becomes a new instance of the original class holding
# what the replacement holds now (its training mode, the user's hooks and attributes set after
# convert_; the hooks convert_ registered are removed); a kept module gets back each value convert_
# changed, where it still holds the value convert_ set (a value the user set since stays). What
# convert_ changed outside the model (transformers' attention registry, global caches) stays; it
# names slimgrad's own functions and no model uses them after ``revert_``. The records are plain
# data on the modules, so a deep copy or a pickled model reverts too.

_ORIGINAL = "_slimgrad_original"
_UNDO = "_slimgrad_undo"
_OWN = frozenset({_ORIGINAL, _UNDO})
_TENSORS = ("_parameters", "_buffers")


class _Missing:
    # an attribute that was not there; pickles and deep-copies as itself
    def __repr__(self) -> str:
        return "MISSING"

    def __reduce__(self) -> str:
        return "MISSING"


MISSING = _Missing()


_ITEMS = frozenset({"_parameters", "_buffers", "_modules"})


def _containers(d: dict) -> list[str]:
    return [k for k, v in d.items() if isinstance(v, dict) and (k in _ITEMS or "hooks" in k)]


@dataclass
class _Undo:
    """What one ``convert_`` changed on a module it kept: ``attrs`` ``{name: (before, after)}``
    (MISSING: absent), ``items`` ``{container: {key: (before, after)}}`` for ``_parameters``,
    ``_buffers`` and ``_modules`` entries other than swaps, ``hooks`` ``{hook dict: [ids]}``
    convert_ registered, ``states`` what a copied object held at the end."""

    attrs: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    items: dict[str, dict[str, tuple[Any, Any]]] = field(default_factory=dict)
    hooks: dict[str, list[int]] = field(default_factory=dict)
    # {name: the after value's attributes when convert_ returned} for a plain object convert_
    # replaced by a copy (an HF config): what the user set on the copy since is carried back
    states: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class _Original:
    """The recipe of a module ``convert_`` replaced, kept on its replacement.

    ``attrs``: the original's ``__dict__`` without its tensors and children; ``tensors``
    ``{"_parameters"|"_buffers": {name: where}}`` and ``modules`` ``{name: where}``, each ``where``
    one of ``("none",)``, ``("parameter"|"buffer"|"module", path in the replacement)``,
    ``("recipe", _Original)`` (a child the replacement does not hold) or ``("held", object)``
    (found nowhere in the replacement: held here). ``hooks``: the hook ids convert_ registered
    on the replacement's hook dicts; ``end_hooks`` every id they held when convert_ returned and
    ``end_public`` the replacement's public attributes then (what the user changed since is
    carried back).
    """

    cls: type
    attrs: dict[str, Any]
    tensors: dict[str, dict[str, tuple]]
    modules: dict[str, tuple]
    hooks: dict[str, list[int]]
    end_hooks: dict[str, list[int]]
    end_public: dict[str, Any]


@dataclass
class _Snap:
    top: dict[str, Any]
    items: dict[str, dict]


def _snap(m: nn.Module) -> _Snap:
    d = m.__dict__
    return _Snap(dict(d), {k: dict(d[k]) for k in _containers(d)})


class _Recorder:
    def __init__(self, model: nn.Module) -> None:
        self.snaps: dict[int, tuple[nn.Module, _Snap]] = {}
        self.swaps: dict[int, tuple[nn.Module, nn.Module]] = {}  # id(new): (original, new)
        stack = [model]
        while stack:
            m = stack.pop()
            if id(m) not in self.snaps:
                self.snaps[id(m)] = (m, _snap(m))
                stack.extend(c for c in m._modules.values() if c is not None)

    def finish(self) -> None:
        pending: list[tuple[nn.Module, _Undo]] = []
        for m, s in self.snaps.values():
            u = self._diff(m, s)
            if u is not None:
                pending.append((m, u))
        replaced = {id(o) for o, _ in self.swaps.values()}
        by_original = {id(o): n for o, n in self.swaps.values()}
        for m, u in pending:
            if id(m) not in replaced:  # an original's own changes are in its recipe
                m.__dict__.setdefault(_UNDO, []).append(u)
        for o, n in self.swaps.values():
            if _ORIGINAL not in n.__dict__:
                n.__dict__[_ORIGINAL] = self._recipe(o, n, by_original)

    def _diff(self, m: nn.Module, s: _Snap) -> _Undo | None:
        now = m.__dict__
        u = _Undo()
        for k in s.top.keys() | now.keys():
            b, a = s.top.get(k, MISSING), now.get(k, MISSING)
            if k not in _OWN and b is not a:
                u.attrs[k] = (b, a)
                if _copied(b, a):
                    u.states[k] = dict(vars(a))
        for c, before in s.items.items():
            cur = now.get(c)
            if cur is not s.top[c]:
                continue  # the container itself changed: an attribute above
            if c not in _ITEMS:
                if added := [i for i in cur if i not in before]:
                    u.hooks[c] = added
                continue
            for k in before.keys() | cur.keys():
                b, a = before.get(k, MISSING), cur.get(k, MISSING)
                if b is a:
                    continue
                if c == "_modules" and isinstance(b, nn.Module) and isinstance(a, nn.Module):
                    self.swaps.setdefault(id(a), (b, a))  # a swap: a recipe on the new module
                else:
                    u.items.setdefault(c, {})[k] = (b, a)
        return u if (u.attrs or u.items or u.hooks) else None

    def _recipe(self, o: nn.Module, n: nn.Module, by_original: dict) -> _Original:
        s = self.snaps[id(o)][1] if id(o) in self.snaps else _snap(o)
        where: dict[int, tuple] = {}
        for kind, pairs in (
            ("module", n.named_modules(remove_duplicate=False)),
            ("buffer", n.named_buffers(remove_duplicate=False)),
            ("parameter", n.named_parameters(remove_duplicate=False)),
        ):
            for path, v in pairs:
                if path:
                    where.setdefault(id(v), (kind, path))
        return self._recipe_in(o, s, n, where, by_original)

    def _recipe_in(self, o, s: _Snap, n, where: dict, by_original: dict) -> _Original:
        def place(v):
            if v is None:
                return ("none",)
            if isinstance(v, nn.Module):
                new = by_original.get(id(v), v)
                if id(new) in where:
                    return where[id(new)]
                sub = self.snaps[id(v)][1] if id(v) in self.snaps else _snap(v)
                return ("recipe", self._recipe_in(v, sub, n, where, by_original))
            return where.get(id(v), ("held", v))

        hooks, end_hooks = {}, {}
        for c in _containers(n.__dict__):
            if c in _ITEMS:
                continue
            ids = list(n.__dict__[c])
            end_hooks[c] = ids
            start = s.items.get(c, {}) if n.__dict__[c] is s.top.get(c) else {}
            if added := [i for i in ids if i not in start]:
                hooks[c] = added
        return _Original(
            cls=type(o),
            attrs={k: _unbind(v, o) for k, v in s.top.items() if k not in _ITEMS and k not in _OWN},
            tensors={t: {k: place(v) for k, v in s.items.get(t, {}).items()} for t in _TENSORS},
            modules={k: place(v) for k, v in s.items.get("_modules", {}).items()},
            hooks=hooks,
            end_hooks=end_hooks,
            end_public={k: v for k, v in n.__dict__.items() if not k.startswith("_")},
        )


@dataclass
class _Bound:
    # a method or ``functools.partial`` bound to the original (accelerate's hook wrapper:
    # ``partial(new_forward, module)`` over ``module.forward``), bound again to the rebuilt module
    # so that the recipe does not hold the original
    func: Any
    rest: tuple = ()
    keywords: dict = field(default_factory=dict)
    attrs: dict | None = None  # a partial's ``__dict__`` (``functools.update_wrapper``'s)


def _unbind(v: Any, o: nn.Module) -> Any:
    if isinstance(v, types.MethodType) and v.__self__ is o:
        return _Bound(v.__func__)
    if isinstance(v, functools.partial) and v.args and v.args[0] is o:
        attrs = {k: _unbind(x, o) for k, x in vars(v).items()}
        return _Bound(v.func, v.args[1:], dict(v.keywords), attrs)
    return v


def _bind(v: Any, o: nn.Module) -> Any:
    if not isinstance(v, _Bound):
        return v
    if v.attrs is None:
        return types.MethodType(v.func, o)
    p = functools.partial(v.func, o, *v.rest, **v.keywords)
    for k, x in v.attrs.items():
        setattr(p, k, _bind(x, o))
    return p


_active = threading.local()


@contextmanager
def recording(model: nn.Module) -> Iterator[None]:
    """Record what the ``convert_`` call inside changes on ``model`` for ``revert_`` (NOTE [What
    convert_ records for revert_]); a ``convert_`` nested in another one (``plan=``) records in
    the outer one's."""
    if getattr(_active, "rec", None) is not None:
        yield
        return
    rec = _active.rec = _Recorder(model)
    try:
        yield
    finally:
        _active.rec = None
        rec.finish()


def note_swaps(decisions) -> None:
    """Note ``convert.apply``'s swaps (original -> replacement) for the running recording."""
    rec = getattr(_active, "rec", None)
    if rec is None:
        return
    for d in decisions:
        if d.new is not None and d.parent is not None and d.new is not d.module:
            rec.swaps.setdefault(id(d.new), (d.module, d.new))


def _same(x: Any, y: Any) -> bool:
    return x is y or (type(x) is type(y) and type(x) in (bool, int, float, str) and x == y)


class _Reverter:
    def __init__(self) -> None:
        self.memo: dict[int, tuple[nn.Module, nn.Module]] = {}
        self.later: list = []  # changes to modules that stay, made once every read is done
        self.kept: list[nn.Module] = []

    def module(self, m: nn.Module) -> nn.Module:
        got = self.memo.get(id(m))
        if got is not None:
            return got[1]
        new = m
        while _ORIGINAL in new.__dict__:
            new = self._rebuild(new.__dict__[_ORIGINAL], new)
        self.memo[id(m)] = (m, new)
        if new is m:
            self.kept.append(m)
        self._undo(new, later=new is m)
        for k, c in list(new._modules.items()):
            if c is None:
                continue
            r = self.module(c)
            if r is not c:
                if new is m:
                    self.later.append(lambda d=new._modules, k=k, r=r: d.__setitem__(k, r))
                else:
                    new._modules[k] = r
        return new

    def _undo(self, m: nn.Module, later: bool) -> None:
        recs = m.__dict__.get(_UNDO)
        if not recs:
            return

        def run(m=m, recs=recs):
            d = m.__dict__
            for u in reversed(recs):
                for k, (b, a) in u.attrs.items():
                    if k in u.states and _same(d.get(k, MISSING), a):
                        _carry_back(u.states[k], a, b)
                    _restore(d, k, b, a)
                for c, items in u.items.items():
                    for k, (b, a) in items.items():
                        _restore(d[c], k, b, a)
                for c, ids in u.hooks.items():
                    for i in ids:
                        _drop_hook(d, c, i)
            d.pop(_UNDO, None)

        if later:
            self.later.append(run)
        else:
            run()

    def _rebuild(self, rec: _Original, n: nn.Module, child: bool = False) -> nn.Module:
        # ``rec``'s module, holding what the replacement ``n`` holds now; ``child``: a child of
        # the original that ``n`` does not hold (its paths are in ``n`` too)
        o = rec.cls.__new__(rec.cls)
        o.__dict__.update({k: _bind(v, o) for k, v in rec.attrs.items()})
        for t, names in rec.tensors.items():
            o.__dict__[t] = {k: _fetch(n, w) for k, w in names.items()}
        o.__dict__["_modules"] = {
            k: (self._rebuild(w[1], n, child=True) if w[0] == "recipe" else _fetch(n, w))
            for k, w in rec.modules.items()
        }
        o.training = n.training
        if child:
            return o
        nd = n.__dict__
        for c in _containers(o.__dict__):
            if c in _ITEMS:
                continue
            od, cur = o.__dict__[c], nd.get(c)
            if isinstance(cur, dict) and cur is not od:  # hooks registered on it since
                end = set(rec.end_hooks.get(c, ()))
                for i, f in cur.items():
                    if i not in end and i not in od:
                        self.later.append(lambda od=od, i=i, f=f: od.__setitem__(i, f))
            for i in rec.hooks.get(c, ()):
                self.later.append(lambda o=o, c=c, i=i: _drop_hook(o.__dict__, c, i))
        if "_is_full_backward_hook" in nd:
            o._is_full_backward_hook = nd["_is_full_backward_hook"]
        for k, v in nd.items():  # the user's attributes set since convert_
            if k.startswith("_") or k == "training":
                continue
            if k in rec.end_public:
                if _same(v, rec.end_public[k]) or k not in rec.attrs:
                    continue
            elif hasattr(type(n), k):
                continue  # a slimgrad class default set on the instance (a per-call cache)
            o.__dict__[k] = v
        return o


def _copied(before: Any, after: Any) -> bool:
    return (
        type(before) is type(after)
        and not isinstance(after, (nn.Module, torch.Tensor, type))
        and not callable(after)
        and isinstance(getattr(after, "__dict__", None), dict)
    )


def _carry_back(state: dict, copy: Any, original: Any) -> None:
    # what the user set on ``copy`` after convert_ made it: the same on ``original``
    for k, v in vars(copy).items():
        if k not in state or not _same(state[k], v):
            setattr(original, k, v)


def _restore(d: dict, k: str, before: Any, after: Any) -> None:
    if not _same(d.get(k, MISSING), after):
        return  # changed again since convert_: the user's value stays
    if before is MISSING:
        d.pop(k, None)
    else:
        d[k] = before


def _drop_hook(d: dict, c: str, i: int) -> None:
    for k in (c, f"{c}_with_kwargs", f"{c}_always_called"):
        if isinstance(d.get(k), dict):
            d[k].pop(i, None)


def _fetch(n: nn.Module, w: tuple) -> Any:
    kind = w[0]
    if kind == "none":
        return None
    if kind == "held":
        return w[1]
    if kind == "module":
        return n.get_submodule(w[1])
    if kind == "buffer":
        return n.get_buffer(w[1])
    return n.get_parameter(w[1])


def revert_(model: nn.Module) -> nn.Module:
    """Undo everything ``convert_`` did to ``model``, in place; return ``model``.

    Every module ``convert_`` replaced comes back as an instance of the class it had (recorded at
    ``convert_`` time) holding the same Parameter and buffer objects the converted model holds
    (an optimizer built before keeps working), with the training mode, the user's hooks and the
    attributes set since; what ``convert_`` put on the modules it kept (an HF model's fused-loss
    forward and its configs naming the slimgrad attention, GPT-2's one-node forwards, ownership
    hooks, a plan's recompute wrappers, the report) is removed. Forward outputs and gradients are
    then those of the model before ``convert_``, and type-keyed tools (``torch.ao.quantization``,
    ``fuse_modules``, ONNX export, ``torch.jit.script``) see its own modules. ``convert_`` again
    gives the converted model again. A model ``convert_`` never touched is left as it is; after
    ``convert_`` of a submodule alone, ``revert_`` of the model reverts that submodule. NOTE
    [What convert_ records for revert_] in ``slimgrad/revert.py``.

    The model gets back the HF config objects it had, with the attributes set on the model's
    configs since ``convert_`` (one level: not inside a sub-config). What ``convert_`` changed
    outside the model stays (transformers' attention registry names a slimgrad function that no
    reverted model uses).
    ``step_in_backward``'s Parameter hooks are not ``convert_``'s: its handle's ``remove()`` takes
    them off.

    Args:
        model: a model passed to ``convert_`` (or one holding such a model); changed in place.

    Returns:
        ``model`` itself.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``model`` is itself a module ``convert_`` made (its parent holds it).
        RuntimeError: FSDP2's ``fully_shard`` was applied to the model (revert before sharding).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        >>> slimgrad.convert_(model)  # doctest: +SKIP
        >>> slimgrad.revert_(model)  # doctest: +SKIP
        >>> type(model[1]) is torch.nn.GELU  # doctest: +SKIP
        True
    """
    from slimgrad._dtensor import fully_sharded
    from slimgrad.convert import _REPORT_ATTR, _REPORTS

    if not isinstance(model, nn.Module):
        raise TypeError(
            f"slimgrad.revert_: model must be a torch.nn.Module; expected nn.Module, got "
            f"{type(model).__name__}. Pass the converted model instance."
        )
    if _ORIGINAL in model.__dict__:
        name = model.__dict__[_ORIGINAL].cls.__name__
        raise ValueError(
            f"slimgrad.revert_: model is a module convert_ made (the replacement of a {name}); "
            "expected a model convert_ was given or one holding it, got the replacement. Call "
            "slimgrad.revert_ on the module that holds it (its parent, or the whole model)."
        )
    if (sharded := fully_sharded(model)) is not None:
        what = f"module {sharded!r}" if sharded else "the model itself"
        raise RuntimeError(
            f"slimgrad.revert_: the model is sharded by FSDP2's fully_shard ({what}); expected "
            "a model before fully_shard, got one after. Call slimgrad.revert_(model) before "
            "fully_shard."
        )
    r = _Reverter()
    r.module(model)  # reads and builds only: a failure leaves the model as it was
    for change in r.later:
        change()
    for m in r.kept:
        rep = m.__dict__.get(_REPORT_ATTR)
        if rep is None:
            _REPORTS.pop(m, None)
        elif isinstance(_REPORTS, weakref.WeakKeyDictionary):
            _REPORTS[m] = rep
    return model
