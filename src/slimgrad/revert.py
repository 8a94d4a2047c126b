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

__all__ = ["recording", "revert_"]

# NOTE [What convert_ records for revert_]
# ``convert_`` runs inside ``recording(model)``, which reads every module of the model once before
# anything changes (a shallow copy of its ``__dict__`` and of its ``_parameters``, ``_buffers``,
# ``_modules`` and hook dicts) and compares at the end:
#
# - a module replaced by another one (a child that changed at a place that held a module:
#   ``convert.apply``'s swaps, the opt-in InPlaceABN pass's ``nn.Identity``) gets the recipe of its
#   original (``_Original``, on the replacement as ``_slimgrad_original``): the original's class
#   and ``__dict__`` as they were (no tensors), and for each of its Parameters, buffers and
#   children where the replacement holds it now (a path in the replacement, found by identity).
#   No tensor is held twice: ``revert_`` takes the tensors the replacement holds then, so a
#   Parameter the user reassigned and the buffers ``.to()`` made come back as they are. A child
#   of the original whose slot in the replacement holds a new module with all the child's tensors
#   (GatedMLP's own ``gate_proj`` for Llama's) is that child's replacement, with a recipe of its
#   own: the rebuilt original takes what the slot holds then (a LoRA wrapper of it, whose base
#   layer reverts in turn). Another child without a place in the replacement gets a recipe
#   inside; a method or ``functools.partial`` bound to the original (accelerate's hook wrapper)
#   is bound to the rebuilt module (``_Bound``). The recipe also keeps the replacement's
#   attributes and the names of its children, Parameters and buffers when convert_ returned:
#   what the user set, added or deleted since is on the rebuilt module, a method or partial
#   bound to the replacement bound to it, slimgrad's forward that a wrapper added since holds
#   (accelerate's ``_old_forward``) the original's forward. A change revert_ cannot express on
#   the original (a tensor it is rebuilt from removed; a forward set since that revert_ cannot
#   see into) is an error before anything changes;
# - a module kept (a container, an HF model whose forward or configs a pattern changed) gets the
#   changes of its ``__dict__`` and containers (``_Undo``, on it as ``_slimgrad_undo``): each
#   attribute's value before and after, and the hook ids convert_ registered. A forward convert_
#   set that a wrapper added since holds in one of the module's attributes (accelerate's
#   ``_old_forward``) gets the module's own forward there; one held where revert_ cannot see
#   (a closure) is an error.
#
# ``revert_`` walks the model: a replacement becomes a new instance of the original class holding
# what the replacement holds now (its training mode, the user's hooks and attributes set after
# convert_; the hooks convert_ registered are removed); a kept module gets back each value convert_
# changed, where it still holds the value convert_ set (a value the user set since stays). What
# convert_ changed outside the model (transformers' attention registry, global caches) stays; it
# names slimgrad's own functions and no model uses them after ``revert_``. The records are plain
# data on the modules, so a deep copy or a pickled model reverts too. Attributes named
# ``_slimgrad*`` and instance values of a slimgrad class's data defaults are slimgrad's per-call
# caches, never carried.

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
    on the replacement's hook dicts; ``end_hooks`` the ids they held when convert_ returned,
    ``end`` the replacement's other attributes then and ``end_items`` the names its
    ``_parameters``, ``_buffers`` and ``_modules`` held then (what the user changed since is
    carried back; ``None`` in a child's recipe, which has no replacement of its own).
    """

    cls: type
    attrs: dict[str, Any]
    tensors: dict[str, dict[str, tuple]]
    modules: dict[str, tuple]
    hooks: dict[str, list[int]]
    end_hooks: dict[str, list[int]] | None = None
    end: dict[str, Any] | None = None
    end_items: dict[str, tuple[str, ...]] | None = None


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
        todo = list(self.swaps.values())
        while todo:  # a child of an original held at its slot by a new module: its own recipe
            o, n = todo.pop()
            if _ORIGINAL not in n.__dict__:
                n.__dict__[_ORIGINAL] = self._recipe(o, n, by_original, todo)

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

    def _recipe(self, o: nn.Module, n: nn.Module, by_original: dict, todo: list) -> _Original:
        s = self._snap_of(o)
        where = _where(n)
        modules = {}
        new = {id(x) for x in by_original.values()}
        for k, v in s.items.get("_modules", {}).items():
            c = n._modules.get(k)
            if (
                isinstance(v, nn.Module)
                and id(v) not in by_original
                and isinstance(c, nn.Module)
                and c is not v
                and id(c) not in new
                and _ORIGINAL not in c.__dict__
                and _holds_all(c, self._snap_of(v))
            ):
                # a new module at the original child's slot holding all its tensors (GatedMLP's
                # ``gate_proj`` for Llama's): it is that child's replacement, so the rebuilt
                # original takes whatever the slot holds then (a LoRA wrapper of it)
                todo.append((v, c))
                by_original[id(v)] = c
                modules[k] = ("module", k)
        r = self._recipe_in(o, s, n, where, by_original)
        r.modules.update(modules)
        nd = n.__dict__
        r.end_hooks = {}
        for c in _containers(nd):
            if c in _ITEMS:
                continue
            ids = list(nd[c])
            if ids:
                r.end_hooks[c] = ids
            start = s.items.get(c, {}) if nd[c] is s.top.get(c) else {}
            if added := [i for i in ids if i not in start]:
                r.hooks[c] = added
        r.end = {k: v for k, v in nd.items() if k not in _OWN and not _container(k, v)}
        r.end_items = {c: tuple(nd[c]) for c in _ITEMS}
        return r

    def _snap_of(self, m: nn.Module) -> _Snap:
        return self.snaps[id(m)][1] if id(m) in self.snaps else _snap(m)

    def _recipe_in(self, o, s: _Snap, n, where: dict, by_original: dict) -> _Original:
        def place(v):
            if v is None:
                return ("none",)
            if isinstance(v, nn.Module):
                new = by_original.get(id(v), v)
                if id(new) in where:
                    return where[id(new)]
                return ("recipe", self._recipe_in(v, self._snap_of(v), n, where, by_original))
            return where.get(id(v), ("held", v))

        return _Original(
            cls=type(o),
            attrs={k: _unbind(v, o) for k, v in s.top.items() if k not in _ITEMS and k not in _OWN},
            tensors={t: {k: place(v) for k, v in s.items.get(t, {}).items()} for t in _TENSORS},
            modules={k: place(v) for k, v in s.items.get("_modules", {}).items()},
            hooks={},
        )


def _where(n: nn.Module) -> dict[int, tuple]:
    # {id: (kind, path)} of every module, buffer and Parameter ``n`` holds below itself
    where: dict[int, tuple] = {}
    for kind, pairs in (
        ("module", n.named_modules(remove_duplicate=False)),
        ("buffer", n.named_buffers(remove_duplicate=False)),
        ("parameter", n.named_parameters(remove_duplicate=False)),
    ):
        for path, v in pairs:
            if path:
                where.setdefault(id(v), (kind, path))
    return where


def _holds_all(c: nn.Module, s: _Snap) -> bool:
    # ``c`` holds every tensor the snapshot's module held (somewhere below itself)
    held = {id(t) for t in (*c.parameters(), *c.buffers())}
    return all(v is None or id(v) in held for t in _TENSORS for v in s.items.get(t, {}).values())


def _container(k: str, v: Any) -> bool:
    return isinstance(v, dict) and (k in _ITEMS or "hooks" in k)


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


def _same(x: Any, y: Any) -> bool:
    return x is y or (type(x) is type(y) and type(x) in (bool, int, float, str) and x == y)


class _Reverter:
    def __init__(self) -> None:
        self.memo: dict[int, tuple[nn.Module, nn.Module]] = {}
        self.later: list = []  # changes to modules that stay, made once every read is done
        self.kept: list[nn.Module] = []

    def module(self, m: nn.Module, path: str = "") -> nn.Module:
        got = self.memo.get(id(m))
        if got is not None:
            return got[1]
        new = m
        while _ORIGINAL in new.__dict__:
            new = self._rebuild(new.__dict__[_ORIGINAL], new, path)
        self.memo[id(m)] = (m, new)
        if new is m:
            self.kept.append(m)
        self._undo(new, later=new is m, path=path)
        for k, c in list(new._modules.items()):
            if c is None:
                continue
            r = self.module(c, f"{path}.{k}" if path else k)
            if r is not c:
                if new is m:
                    self.later.append(lambda d=new._modules, k=k, r=r: d.__setitem__(k, r))
                else:
                    new._modules[k] = r
        return new

    def _undo(self, m: nn.Module, later: bool, path: str) -> None:
        recs = m.__dict__.get(_UNDO)
        if not recs:
            return
        d = m.__dict__
        fixes = []  # (dict, key, value): slimgrad's callable held by a wrapper added since
        for u in recs:
            for k, (b, a) in u.attrs.items():
                if not _callable_value(a) or b is a:
                    continue
                held = False
                for j, v in d.items():
                    if j != k and v is a:  # accelerate's ``_old_forward``
                        fixes.append((d, j, b if b is not MISSING else _class_attr(m, k, path)))
                        held = True
                    elif isinstance(v, functools.partial) and vars(v).get("__wrapped__") is a:
                        fixes.append(
                            (
                                vars(v),
                                "__wrapped__",
                                b if b is not MISSING else _class_attr(m, k, path),
                            )
                        )
                cur = d.get(k, MISSING)
                if cur is a or cur is MISSING or held or _bound_to(cur, m):
                    continue
                if not isinstance(getattr(type(m), k, None), types.FunctionType):
                    continue  # not a method of the class (a value the user set in its place)
                raise RuntimeError(
                    f"slimgrad.revert_: module {path or '(the model)'!r} ({type(m).__name__}) "
                    f"has a {k} set since convert_ ({type(cur).__name__}) in place of slimgrad's; "
                    "expected slimgrad's in a place revert_ can restore (the module's own "
                    f"attribute, as accelerate's ``_old_forward``), got a wrapper it cannot see "
                    f"into. Remove the wrapper (``del module.{k}``) before slimgrad.revert_ and "
                    "add it again after."
                )

        def run(m=m, recs=recs, fixes=fixes):
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
            for t, k, v in fixes:
                t[k] = v
            d.pop(_UNDO, None)

        if later:
            self.later.append(run)
        else:
            run()

    def _rebuild(self, rec: _Original, n: nn.Module, path: str, child: bool = False) -> nn.Module:
        # ``rec``'s module, holding what the replacement ``n`` holds now; ``child``: a child of
        # the original that ``n`` does not hold (its paths are in ``n`` too)
        o = rec.cls.__new__(rec.cls)
        o.__dict__.update({k: _bind(v, o) for k, v in rec.attrs.items()})
        nd = n.__dict__
        gone = set()  # the names the replacement held when convert_ returned and does not now
        if not child:
            gone = {k for c in _ITEMS for k in rec.end_items[c] if k not in nd[c]}
        for t, names in rec.tensors.items():
            o.__dict__[t] = {
                k: _fetch(n, w, path) for k, w in names.items() if not _dropped(w, t, gone)
            }
        o.__dict__["_modules"] = {
            k: (
                self._rebuild(w[1], n, path, child=True) if w[0] == "recipe" else _fetch(n, w, path)
            )
            for k, w in rec.modules.items()
            if not _dropped(w, "_modules", gone)
        }
        o.training = n.training
        if child:
            return o
        for c in _ITEMS:  # children, Parameters and buffers added since convert_
            for k, v in nd[c].items():
                if k not in rec.end_items[c]:
                    o.__dict__[c][k] = v
                    if c == "_buffers" and k in nd.get("_non_persistent_buffers_set", ()):
                        o.__dict__["_non_persistent_buffers_set"] = {
                            *o.__dict__.get("_non_persistent_buffers_set", ()),
                            k,
                        }
            if (
                tuple(nd[c]) != rec.end_items[c]
            ):  # the user's order since (a slot emptied, set again)
                o.__dict__[c] = _reorder(o.__dict__[c], list(nd[c]))
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
        end = rec.end
        for k, v in nd.items():  # the user's attributes set since convert_
            if (
                k == "training"
                or k in _OWN
                or _container(k, v)
                or k == "_non_persistent_buffers_set"
            ):
                continue
            if k in end:
                if _same(v, end[k]) or k not in rec.attrs:
                    continue  # slimgrad's, or slimgrad's own attribute the user changed
            elif k.startswith("_slimgrad") or _slimgrad_default(type(n), k):
                continue  # slimgrad's per-call cache (its own prefix, or a class default's name)
            o.__dict__[k] = _rebind(k, v, n, o, rec, path)
        for k in end:  # deleted since convert_
            if k not in nd and k in rec.attrs:
                o.__dict__.pop(k, None)
        return o


def _reorder(d: dict, now: list) -> dict:
    # ``d``'s names that the replacement holds, in the replacement's order; the others in place
    pos = {k: i for i, k in enumerate(now)}
    ours = iter(sorted((k for k in d if k in pos), key=pos.__getitem__))
    keys = [next(ours) if k in pos else k for k in d]
    return {k: d[k] for k in keys}


def _dropped(w: tuple, c: str, gone: set) -> bool:
    # ``w`` names a slot of the replacement the user emptied since convert_
    kind = {"_parameters": "parameter", "_buffers": "buffer", "_modules": "module"}[c]
    return w[0] == kind and w[1] in gone


def _callable_value(v: Any) -> bool:
    return v is not MISSING and callable(v) and not isinstance(v, (nn.Module, type))


def _class_attr(m: nn.Module, k: str, path: str) -> Any:
    # the class's ``k`` bound to ``m`` (what ``m.k`` gives with no instance attribute)
    f = getattr(type(m), k, MISSING)
    if f is MISSING:
        raise RuntimeError(
            f"slimgrad.revert_: module {path or '(the model)'!r} ({type(m).__name__}) has no "
            f"{k} of its own class to give back to a wrapper holding slimgrad's; expected the "
            f"class to define {k}, got none. Remove the wrapper before slimgrad.revert_."
        )
    return f.__get__(m, type(m)) if hasattr(f, "__get__") else f


def _bound_to(v: Any, m: nn.Module) -> bool:
    # a method of ``m`` or a ``functools.partial`` over it (accelerate's hook wrapper): it calls
    # what ``m`` holds at call time
    if isinstance(v, types.MethodType):
        return v.__self__ is m
    return isinstance(v, functools.partial) and bool(v.args) and v.args[0] is m


def _slimgrad_default(cls: type, k: str) -> bool:
    for c in cls.__mro__:
        if k in vars(c):
            return c.__module__.startswith("slimgrad.") and not callable(vars(c)[k])
    return False


def _rebind(k: str, v: Any, n: nn.Module, o: nn.Module, rec: _Original, path: str) -> Any:
    # a value the user set on the replacement ``n`` since convert_, for the rebuilt ``o``: what
    # is bound to ``n`` is bound to ``o``; slimgrad's forward (accelerate's ``_old_forward``, a
    # ``__wrapped__``) becomes the original's
    if isinstance(v, types.MethodType) and v.__self__ is n:
        name = v.__func__.__name__
        if getattr(type(n), name, None) is v.__func__ and rec.cls is not type(n):
            if name in rec.attrs:
                return _bind(rec.attrs[name], o)
            return _class_attr(o, name, path)
        return types.MethodType(v.__func__, o)
    for j, e in rec.end.items():  # an instance forward slimgrad set on the replacement
        if e is v and _callable_value(v) and (j in rec.attrs or hasattr(rec.cls, j)):
            return _bind(rec.attrs[j], o) if j in rec.attrs else _class_attr(o, j, path)
    if isinstance(v, functools.partial) and v.args and v.args[0] is n:
        p = functools.partial(v.func, o, *v.args[1:], **v.keywords)
        for j, x in vars(v).items():
            setattr(p, j, _rebind(j, x, n, o, rec, path))
        return p
    if k == "forward" and _callable_value(v):
        raise RuntimeError(
            f"slimgrad.revert_: module {path or '(the model)'!r} (a {type(n).__name__} that "
            f"replaced a {rec.cls.__name__}) has a forward set since convert_ "
            f"({type(v).__name__}); expected a method of the module or a functools.partial over "
            "it (accelerate's hooks), which revert_ binds to the original, got a callable it "
            "cannot see into. Remove it (``del module.forward``) before slimgrad.revert_ and set "
            "it again after."
        )
    return v


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


def _fetch(n: nn.Module, w: tuple, path: str) -> Any:
    kind = w[0]
    if kind == "none":
        return None
    if kind == "held":
        return w[1]
    try:
        if kind == "module":
            return n.get_submodule(w[1])
        if kind == "buffer":
            return n.get_buffer(w[1])
        return n.get_parameter(w[1])
    except AttributeError as e:
        raise RuntimeError(
            f"slimgrad.revert_: module {path or '(the model)'!r} (a {type(n).__name__} that "
            f"replaced a {n.__dict__[_ORIGINAL].cls.__name__}) "
            f"no longer holds the {kind} {w[1]!r} its original is rebuilt from ({e}); expected "
            "the replacement's children, Parameters and buffers as convert_ left them or "
            "changed at their own slots, got one removed or replaced inside. Make the change "
            "after slimgrad.revert_ instead."
        ) from None


def revert_(model: nn.Module) -> nn.Module:
    """Undo everything ``convert_`` did to ``model``, in place; return ``model``.

    Every module ``convert_`` replaced comes back as an instance of the class it had (recorded at
    ``convert_`` time) holding the same Parameter and buffer objects the converted model holds
    (an optimizer built before keeps working), with the training mode, the user's hooks and the
    attributes, children, Parameters and buffers set, added or deleted since (a LoRA wrapper put
    at a child's slot stays, around the child reverted); a forward wrapper added since
    (accelerate's hooks, ``cpu_offload``, ``dispatch_model``) calls the original's forward. What
    ``convert_`` put on the modules it kept (an HF model's fused-loss forward and its configs
    naming the slimgrad attention, GPT-2's one-node forwards, ownership hooks, a plan's recompute
    wrappers, the report) is removed. Forward outputs and gradients are
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
        RuntimeError: FSDP2's ``fully_shard`` was applied to the model (revert before sharding);
            a change since ``convert_`` cannot be expressed on the original modules (a tensor a
            replaced module's original is rebuilt from was removed from inside it; a forward set
            since holds slimgrad's where revert_ cannot see). Nothing is changed then.

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
