"""Modules that carry accelerate's hooks (``device_map`` models, ``cpu_offload``) convert with them.

# NOTE [A replacement carries accelerate's hook]
accelerate's ``add_hook_to_module(m, hook)`` (``dispatch_model``, ``from_pretrained(...,
device_map=...)``, ``cpu_offload``, ``attach_align_device_hook``) sets ``m.forward`` to
``partial(new_forward, m)`` over the forward it replaces (``m._old_forward``) and ``m._hf_hook =
hook`` (NOTE [accelerate's hook wrapper] in ``inplace_guard.py`` says what ``new_forward`` runs). A
table replacement of such a module computes what the class's forward computes; the hook's
``pre_forward``/``post_forward`` must run around it as they ran around the original. ``apply``
gives the replacement the same structure accelerate gives a module: the same hook object as
``_hf_hook``, its own class forward as ``_old_forward`` and ``partial(new_forward, replacement)``
(accelerate's own ``new_forward``, the function the original's partial holds) as ``forward``. The
hook's ``init_hook`` is not run again: the weights are already where it placed them, and running it
on a module whose weights it offloaded would record them as on ``meta``. accelerate's
``remove_hook_from_module`` then removes it from the replacement as from the original.

The hook then runs on the replacement instead of the original, so the table carries it only where
what it does is stated by public facts about the module that the replacement shares:
  - the wrapper is accelerate's ``new_forward`` bound to the module alone, ``_old_forward`` is the
    module's class forward bound to it (not a forward patched before the hook), and the instance
    sets no ``__call__``;
  - the hook is an ``AlignDevicesHook`` or a ``ModelHook`` whose ``pre_forward``/``post_forward``
    are those classes' own (or a ``SequentialHook`` of such hooks): ``ModelHook``'s return their
    arguments; ``AlignDevicesHook``'s move the arguments and the output with ``send_to_device``
    and load and unload the module's tensors *by name* (``named_module_tensors``,
    ``set_module_tensor_to_device`` on ``module._parameters``/``_buffers``);
  - the replacement holds the original's parameters and buffers under the same names, persistent
    or not as they were (``convert.table_handler`` checks the built replacement).
Other hooks (``CpuOffload`` and ``LayerwiseCastingHook`` move or cast the whole module, whose
dtype and device the replacement decided for at ``convert_``; a user's hook may read anything of
the module's class) keep the module as it is, with the reason in the report.

A block that computes with its children's weights without calling them would skip the children's
hooks: the blocks the table converts under such hooks (HF gated MLPs, GPT-2's MLP) call their
children whenever a child's forward is set on the instance (their eager path), and their children
convert by this note one by one (``CONVERT_CHILDREN``). The fused loss, which reads the LM head's
weight, goes under the LM's hook only where the head's hooks move nothing (NOTE [The fused loss
under accelerate's hooks] in hf_loss.py). GPT-2's attention as one node (a forward set on
the attention module, which reads ``c_proj``'s weight) is not set on an attention module whose
forward accelerate wraps: it stays HF's, its children converted by the table.
"""

from __future__ import annotations

import functools
import sys
import types

import torch
from torch import nn

__all__ = [
    "carried_reason",
    "carries",
    "carry",
    "hook_wrapper",
    "moves_only",
    "on_meta",
    "one_device_reason",
    "passes_arguments",
    "patched",
    "run_devices",
    "set_forward",
    "state_reason",
]

_NEW_FORWARD = "add_hook_to_module.<locals>.new_forward"


def hook_wrapper(fn: object, m: nn.Module) -> functools.partial | None:
    """``fn`` (``m``'s instance forward) if it is accelerate's ``partial(new_forward, m)`` with
    ``m._old_forward`` set, else None (NOTE [accelerate's hook wrapper] in inplace_guard.py)."""
    if sys.modules.get("accelerate.hooks") is None or not isinstance(fn, functools.partial):
        return None
    inner = fn.func
    if (
        getattr(inner, "__module__", None) != "accelerate.hooks"
        or getattr(inner, "__qualname__", None) != _NEW_FORWARD
        or len(fn.args) != 1
        or fn.args[0] is not m
        or fn.keywords
        or "_old_forward" not in m.__dict__
    ):
        return None
    return fn


def _hook_reason(hook: object, hooks: types.ModuleType) -> str | None:
    seq = getattr(hooks, "SequentialHook", None)
    cls = type(hook)
    if isinstance(seq, type) and isinstance(hook, seq):
        subs = getattr(hook, "hooks", None)
        if (cls.pre_forward, cls.post_forward) != (seq.pre_forward, seq.post_forward):
            return f"{cls.__qualname__} has its own pre_forward/post_forward"
        if not isinstance(subs, tuple):
            return f"its {cls.__qualname__}.hooks is not a tuple"
        for h in subs:
            if (why := _hook_reason(h, hooks)) is not None:
                return why
        return None
    for name in ("AlignDevicesHook", "ModelHook"):
        k = getattr(hooks, name, None)
        if isinstance(k, type) and isinstance(hook, k):
            if cls.pre_forward is k.pre_forward and cls.post_forward is k.post_forward:
                return None
            return f"{cls.__qualname__} overrides {name}'s pre_forward/post_forward"
    return f"{cls.__module__}.{cls.__qualname__} may read or move anything of the module's class"


def _wraps_class_forward(m: nn.Module) -> bool:
    # the forward under m's hook wrapper is its class's, bound to m
    old = m.__dict__["_old_forward"]
    return (
        isinstance(old, types.MethodType)
        and old.__self__ is m
        and old.__func__ is getattr(type(m), "forward", None)
    )


def carried_reason(m: nn.Module) -> str | None:
    """Why the table cannot carry ``m``'s accelerate hook to its replacement, or None when it can
    or ``m`` has no accelerate hook wrapper (NOTE [A replacement carries accelerate's hook])."""
    fn = hook_wrapper(m.__dict__.get("forward"), m)
    if fn is None:
        return None
    if not _wraps_class_forward(m):
        return (
            "its forward is accelerate's hook wrapper over a forward set on the instance before "
            "the hook; expected the class's forward under the hook, got another. Set the hook on "
            "the module with its class's forward"
        )
    if "__call__" in m.__dict__:
        return (
            "its __call__ is replaced on the instance; expected the class's __call__, got an "
            "instance attribute. Register a forward hook instead"
        )
    why = _hook_reason(m.__dict__.get("_hf_hook"), sys.modules["accelerate.hooks"])
    if why is not None:
        return (
            f"it carries an accelerate hook that convert_ cannot run around a replacement ({why}); "
            "expected an AlignDevicesHook or ModelHook (or a SequentialHook of them), got another. "
            "Convert before adding the hook, or leave the module as it is"
        )
    return None


def carries(m: nn.Module) -> bool:
    """``m``'s instance forward is an accelerate hook wrapper the table carries."""
    return hook_wrapper(m.__dict__.get("forward"), m) is not None and carried_reason(m) is None


def passes_arguments(m: nn.Module) -> bool:
    """``m``'s instance forward is accelerate's hook wrapper over its class's forward, and each of
    its hooks hands the arguments on as they came or moved to a device (``ModelHook``,
    ``AlignDevicesHook``, offloading or not, with their own pre/post_forward;
    ``LayerwiseCastingHook``, which casts the module's weights and returns the arguments as
    given): a consumer behind it receives the very tensor its caller passed where that is on
    the hook's device already (NOTE [Keep y only where its consumer keeps it] in
    nn/_output_act.py)."""
    hooks = sys.modules.get("accelerate.hooks")
    fwd = m.__dict__.get("forward")
    if hooks is None or hook_wrapper(fwd, m) is None or "__call__" in m.__dict__:
        return False
    if not _wraps_class_forward(m):
        return False
    casting = getattr(hooks, "LayerwiseCastingHook", None)
    for h in _parts(m.__dict__.get("_hf_hook"), hooks):
        if casting is not None and type(h) is casting:
            continue
        if _hook_reason(h, hooks) is not None:
            return False
    return True


def _parts(hook: object, hooks: types.ModuleType) -> list:
    seq = getattr(hooks, "SequentialHook", None)
    if isinstance(seq, type) and isinstance(hook, seq):
        return [p for h in hook.hooks for p in _parts(h, hooks)]
    return [hook]


def moves_only(m: nn.Module) -> bool:
    """``m``'s forward is an accelerate hook wrapper whose hooks (``ModelHook``,
    ``AlignDevicesHook`` without offloading, NOTE [A replacement carries accelerate's hook]) do no
    more than move the arguments and the output to a device: where those are on that device
    already, calling ``m`` and running its class's forward are one thing (a known head's weight
    may then be read without the call: NOTE [The fused loss under accelerate's hooks] in
    hf_loss.py)."""
    fwd = m.__dict__.get("forward")
    hooks = sys.modules.get("accelerate.hooks")
    if hooks is None or hook_wrapper(fwd, m) is None or carried_reason(m) is not None:
        return False
    align = hooks.AlignDevicesHook
    return not any(
        isinstance(h, align) and h.offload for h in _parts(m.__dict__["_hf_hook"], hooks)
    )


def one_device_reason(model: nn.Module) -> str | None:
    """Why the accelerate hooks in ``model`` may run its modules on several devices, or hold a
    hook convert_ cannot state, or None: every hooked module's hooks are ones the table carries
    and their execution devices are one and the same (an ``AlignDevicesHook`` that offloads
    loads its module's weights onto that device for the module's own call)."""
    hooks = sys.modules.get("accelerate.hooks")
    if hooks is None:
        return None
    devices = set()
    for m in model.modules():
        if "forward" not in m.__dict__ or "_hf_hook" not in m.__dict__:
            continue
        if not carries(m):
            return (
                "an accelerate hook in the model is one convert_ cannot state "
                f"({type(m).__name__}); expected AlignDevicesHook or ModelHook (or a "
                "SequentialHook of them)"
            )
        for h in _parts(m.__dict__["_hf_hook"], hooks):
            if isinstance(h, hooks.AlignDevicesHook) and h.execution_device is not None:
                devices.add(_as_device(h.execution_device))
    if len(devices) > 1:
        return (
            "the model's accelerate hooks place it on several devices; expected one execution "
            f"device, got {sorted(map(str, devices))}"
        )
    return None


def _as_device(d: object) -> torch.device:
    # the device a hook's tensors go to (.to(d)): an accelerator without an index is that type's
    # current device, 0 until its runtime is initialised (asking would initialise it)
    dev = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
    if dev.type in ("cpu", "meta"):
        return torch.device(dev.type)
    if dev.index is None:
        mod = getattr(torch, dev.type, None)
        ready, current = (getattr(mod, k, None) for k in ("is_initialized", "current_device"))
        asked = callable(ready) and callable(current) and ready()
        return torch.device(dev.type, current() if asked else 0)
    return dev


def _placing(m: nn.Module, hooks: types.ModuleType) -> tuple[torch.device | None, bool]:
    # (the execution device m's accelerate hook runs it on, whether its submodules run there
    # too), from AlignDevicesHook (place_submodules) and CpuOffload (moves the whole module).
    # Read from the hook object whatever wraps m's forward: a forward wrapped again over the
    # hook's wrapper (functools.wraps, torch.compile) still runs the hook, which loads m's
    # weights each call; accelerate's remove_hook_from_module deletes _hf_hook
    if "_hf_hook" not in m.__dict__:
        return None, False
    align, offload = hooks.AlignDevicesHook, getattr(hooks, "CpuOffload", None)
    for h in _parts(m.__dict__["_hf_hook"], hooks):
        if isinstance(h, align) and h.execution_device is not None:
            return _as_device(h.execution_device), bool(h.place_submodules)
        if isinstance(offload, type) and isinstance(h, offload) and h.execution_device is not None:
            return _as_device(h.execution_device), True
    return None, False


def run_devices(model: nn.Module) -> list[tuple[str, torch.Tensor, torch.device]]:
    """``(name of the module holding it, tensor, device)`` for each parameter and buffer of
    ``model`` (each once): the device the module computes with it on (NOTE [The device a module
    runs on]).

    # NOTE [The device a module runs on]
    What ``convert_`` decides from the device (the device rule's targets, NOTE [Never more than
    eager, per device and dtype]) is the device the module's forward runs on. Without accelerate
    hooks that is where its tensors are. accelerate's ``AlignDevicesHook`` states it as
    ``execution_device``: it moves the arguments there, and one that offloads keeps the module's
    weights on ``meta`` outside its call (``disk`` or ``cpu`` in a ``device_map``, ``cpu_offload``)
    and loads them there for the call; ``place_submodules`` extends it to the module's
    submodules, and ``CpuOffload`` moves the whole module to its ``execution_device``. So a
    tensor's device is the execution device of the hook that governs it (its module's own, else
    the nearest ancestor's that places submodules), else the tensor's own. The hook is read from
    the module (``_hf_hook``) whatever wraps its forward: a forward wrapped again over the hook's
    wrapper still runs the hook. A hook whose execution device is ``meta`` (``"meta"`` in a
    ``device_map``) runs its modules on meta, never loading their weights: convert_ refuses the
    model (:func:`on_meta`). Tensors on meta that no hook places (a model built on meta, or under
    ``init_empty_weights``, to plan or estimate) are decided for as without hooks.
    """
    return [(n, t, d) for n, t, d, _ in _runs(model)]


def _runs(model: nn.Module) -> list[tuple[str, torch.Tensor, torch.device, str | None]]:
    # run_devices' rows, each with the name of the module whose hook placed it (None: its own)
    hooks = sys.modules.get("accelerate.hooks")
    out: list[tuple[str, torch.Tensor, torch.device, str | None]] = []
    seen_t: set[int] = set()
    seen_m: set[int] = set()
    stack: list[tuple[nn.Module, str, tuple[torch.device, str] | None]] = [(model, "", None)]
    while stack:
        m, name, above = stack.pop()
        if id(m) in seen_m:
            continue
        seen_m.add(id(m))
        own, sub = _placing(m, hooks) if hooks is not None else (None, False)
        here = (own, name) if own is not None else above
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None and id(t) not in seen_t:
                seen_t.add(id(t))
                out.append((name, t, *(here if here is not None else (t.device, None))))
        below = here if sub else above
        dot = f"{name}." if name else ""
        for k, c in reversed(m._modules.items()):
            if c is not None:
                stack.append((c, dot + k, below))
    return out


def on_meta(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(name, module, name of the module whose accelerate hook places it)`` of each module
    holding a tensor that an accelerate hook runs on ``meta`` (its execution device is meta:
    NOTE [The device a module runs on]); ``[]`` where no hook names meta."""
    out = {}
    for n, _, d, by in _runs(model):
        if by is not None and d.type == "meta" and n not in out:
            out[n] = (n, model.get_submodule(n), by)
    return list(out.values())


def set_forward(m: nn.Module, fn: object) -> None:
    """Make ``fn`` what ``m(...)`` runs: under an accelerate hook the table carries, the forward
    its wrapper calls (``_old_forward``, so the hook still runs around it), else ``m.forward``."""
    if carries(m):
        m._old_forward = fn
    else:
        m.forward = fn


def patched(m: nn.Module) -> bool:
    """``m``'s forward is set on the instance, other than by an accelerate hook the table
    carries (a handler's check for a patched forward)."""
    return "forward" in m.__dict__ and not carries(m)


def _tensors(m: nn.Module) -> dict[str, tuple[str, bool]]:
    out = {}
    for prefix, mod in m.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for k, p in mod._parameters.items():
            out[dot + k] = ("parameter", p is not None)
        for k, b in mod._buffers.items():
            persistent = k not in mod._non_persistent_buffers_set
            out[dot + k] = ("buffer" if persistent else "non-persistent buffer", b is not None)
    return out


def state_reason(old: nn.Module, new: nn.Module) -> str | None:
    """Why ``new`` cannot run ``old``'s accelerate hook, which finds tensors by name (NOTE [A
    replacement carries accelerate's hook]), or None."""
    a, b = _tensors(old), _tensors(new)
    if a != b:
        diff = sorted(set(a.items()) ^ set(b.items()))
        return (
            "its accelerate hook finds the module's tensors by name, and the replacement holds "
            f"others; expected the same parameters and buffers, got a difference in {diff[:3]}"
        )
    return None


def carry(old: nn.Module, new: nn.Module) -> None:
    """Give ``new`` ``old``'s accelerate hook as ``add_hook_to_module`` gives one, without running
    its ``init_hook`` again (NOTE [A replacement carries accelerate's hook]); nothing if ``old``
    has no accelerate hook wrapper."""
    fn = hook_wrapper(old.__dict__.get("forward"), old)
    if fn is None:
        return
    own = type(new).forward.__get__(new)
    new._old_forward = own
    new._hf_hook = old.__dict__["_hf_hook"]
    new.forward = functools.update_wrapper(functools.partial(fn.func, new), own)
