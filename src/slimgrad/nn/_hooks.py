"""Which forward hooks a converted module must step aside for (NOTE [Forward hooks on an
output-saving module])."""

from __future__ import annotations

import torch
from torch.nn.modules import module as _module

# NOTE [Forward hooks on an output-saving module]
# A forward hook may edit the module's output in place (activation steering: ``out.mul_(s)`` in a
# hook that returns None). Eager tolerates that wherever eager keeps the input for backward; a
# converted module that keeps its output instead (or y plus bits from which backward rebuilds x)
# would see the edit: the kept output fails autograd's version check ("modified by an inplace
# operation" in backward), or, for the smooth activations whose output is an alias made inside the
# custom Function, the hook's write itself raises. No value is silently wrong (every kept output
# goes through ``save_for_backward``), but eager trains and the converted module does not. So while
# the module, or every module (a global hook), has a forward hook that may write what it is given
# (its source read once per function, as for the hooks around a module below:
# ``inplace_guard.hook_may_write``; an unreadable hook, a callable object, may), the module runs
# eager's op and keeps what eager keeps (exact: eager's values, gradients and memory). A hook that
# writes nothing it is given (a feature collector, a statistics logger, a hook that returns a new
# tensor) changes nothing: the savings are kept, and the path is the same with or without it, so one
# registered between a non-reentrant checkpoint's forward and its backward no longer makes the
# recompute save other tensors than the forward (torch's CheckpointError before). Any hook on a
# child of a fused block (the gated MLP, GPT-2's MLP) still makes the block call its children, since
# the hook must run: registered between such a checkpoint's forward and backward, it still changes
# the recompute's path. Observers of slimgrad's own (``slimgrad.memory``'s attribution hooks,
# defined in ``slimgrad.*`` modules) change no value and do not count, so measuring a converted
# model still shows its savings; nor do the two of torch's module tracker, which FlopCounterMode
# enters (NOTE [torch's module tracker is an observer]). A hook registered before ``convert_`` that
# may write the output, or what a module was given, makes convert_ leave the modules it reaches as
# they are (NOTE [What a hook registered before convert_ may write] in
# convert_handlers/inplace_guard.py); this rule covers hooks registered after it.
#
# Which modules check (:func:`forward_hooked`, per class, whatever the instance's settings):
# those that keep their output, or y plus bits from which backward rebuilds x, where eager keeps the
# input: LayerNorm, GroupNorm, RMSNorm and the HF RMSNorms (float32: y + per-row stats), GELU and
# Mish (y + 1 bit/elt + a sparse table), SiLU (y + bits), ELU, LeakyReLU, Hardtanh, ReLU6 and
# Hardswish (y), and timm's/torchvision's LayerNorm2d (``convert_handlers/timm.py``).
# Which need none: modules eager also keeps the output of (ReLU, Sigmoid, Tanh, and the in-place
# ELU/LeakyReLU: eager raises in backward on an edited output, and so does slimgrad's, by the same
# version check); modules whose saved tensors are their inputs or side tensors the output does not
# alias (Linear and Conv keep inputs; Dropout and Hardsigmoid keep bits; LeakyReLU with a negative
# slope keeps bits; SoftmaxDropoutMatmul keeps the probabilities and the value, not its output);
# BatchNorm (it keeps its output b only once an activation has read b unedited, by version;
# after an in-place edit it keeps its input, as eager: bit for bit, tested); and the ``*AfterNorm``
# activations, which keep nothing of their own: the next conv keeps the BatchNorm output b instead
# of act(b) only while act(b) is at the version it had at forward (NOTE [Derived saved inputs] in
# ``slimgrad/ops/_derived.py``), so an in-place edit makes that conv keep the edited tensor itself
# and the gradient stays exact (tested).
# Transformers' output-capturing hooks (``transformers/utils/output_capturing.py``) stay on the
# layers after the first call that asks for hidden states or attentions, and act only in a call
# that asks for outputs (they return at once otherwise): outside such a call (NOTE [Hidden states
# handed out per call]) they count as absent, so one such call does not turn the savings off for
# every later call. Hooks on the modules around this one (a parent whose output is this module's,
# a module its output is given to) and global forward pre-hooks: NOTE [Hooks registered after
# convert_ on the modules around] below.


def foreign(hooks: dict) -> bool:
    if not hooks:  # the common case: no hook at all, answered without a generator
        return False
    return any(_acts(f) for f in hooks.values())


def global_hooks_act() -> bool:
    """Whether a global module hook may act on the modules a fused block runs without calling
    them: any global backward hook, or a global forward (pre-)hook that is :func:`foreign`."""
    return (
        bool(_module._global_backward_hooks or _module._global_backward_pre_hooks)
        or foreign(_module._global_forward_hooks)
        or foreign(_module._global_forward_pre_hooks)
    )


_HF_CAPTURE = "transformers.utils.output_capturing"
_TRACKER = "torch.utils.module_tracker"


# NOTE [torch's module tracker is an observer]
# ``torch.utils.module_tracker.ModuleTracker`` (public; ``torch.utils.flop_counter.FlopCounterMode``
# enters one) registers a global forward pre-hook and a global forward hook on every module while
# it is active. They write nothing the module is given or returns: they record the module's name
# and register gradient hooks (``register_multi_grad_hook``) that record again in backward. Read
# as acting hooks, they sent every converted module to eager's op while the tracker was on (the
# savings lost under a FLOP count), and, worse, made a non-reentrant checkpoint's recompute take
# another path than its forward when the tracker was on for only one of them (``with
# FlopCounterMode(): loss = model(x)`` then ``loss.backward()`` outside it, or the other way round):
# torch raised CheckpointError (mismatched saved tensors) on a converted GPT-2, BERT or Llama under
# HF gradient checkpointing, where eager runs. So its two hook functions do not count: converted
# modules keep their paths, the same with or without the tracker (and ``ownership`` counts them
# among the observers that keep no tensor: an in-place write it grants unwatched is granted under
# the tracker too). That these two write nothing is
# read once from their source (``inplace_guard.hook_roles``, as for any hook around a module), not
# assumed; a subclass that overrides them, or a torch whose tracker has other hook names, is read
# as any other hook (eager's op). What differs from eager: a fused block (the gated MLP, GPT-2's
# MLP) does not call its child modules, so the tracker, and FlopCounterMode's per-module table,
# see the block and not its children (the FLOPs are counted, under the block).
_OBSERVERS: frozenset | None = None


def _observers() -> frozenset:
    global _OBSERVERS
    if _OBSERVERS is None:
        found = set()
        try:
            from torch.utils.module_tracker import ModuleTracker
        except ImportError:  # an older or newer torch without it: nothing recognised
            ModuleTracker = None
        if ModuleTracker is not None:
            from slimgrad.convert_handlers.inplace_guard import hook_roles

            probe = ModuleTracker()  # read as registered: bound methods (module, args, ...)
            for name in ("_fw_pre_hook", "_fw_post_hook"):
                bound = getattr(probe, name, None)
                fn = getattr(bound, "__func__", None)
                if fn is not None and hook_roles(bound) == frozenset():
                    found.add(fn)
        _OBSERVERS = frozenset(found)
    return _OBSERVERS


def _acts(f) -> bool:
    # a hook that may act on this call: not slimgrad's own, not torch's module tracker (NOTE
    # [torch's module tracker is an observer]), and not transformers' output-capturing hook
    # outside a call that asks for outputs (it returns at once there)
    mod = getattr(f, "__module__", None) or ""
    if mod.startswith("slimgrad."):
        return False
    if mod == _TRACKER and getattr(f, "__func__", None) in _observers():
        return False
    if mod == _HF_CAPTURE and getattr(f, "__name__", None) == "output_capturing_hook":
        from slimgrad.nn import _output_act as oa

        if not oa._COLLECTOR:
            oa._find_collector()
        return oa.requested()
    return True


def forward_hooked(m: torch.nn.Module) -> bool:
    own, glob = m._forward_hooks, _module._global_forward_hooks
    try:  # (``NoScript``'s defaults: every slimgrad module has them)
        near, free = m.near_hooks, m.near_free
    except AttributeError:  # a module of another library: no hooks around it are watched
        near = free = ()
    # checked on every call: hooks come and go after convert_ (``near_hooks``: NOTE [Hooks
    # registered after convert_ on the modules around])
    if not own and not glob and near == free:
        return False
    return _may_edit(own) or _may_edit(glob) or (near != free and near_writes(m))


def _may_edit(hooks: dict) -> bool:
    # a forward hook on the module itself (or a global one) that may write the output it is
    # given (NOTE [Forward hooks on an output-saving module]): one that acts on this call and,
    # its source read once per function, may write; transformers' output-capturing hook hands the
    # output out when a call asks for it (NOTE [Hidden states handed out per call])
    if not hooks:
        return False
    from slimgrad.convert_handlers.inplace_guard import hook_may_write

    for f in hooks.values():
        if _acts(f) and (_is_hf_capture(f) or hook_may_write(f)):
            return True
    return False


def _is_hf_capture(f) -> bool:
    mod = getattr(f, "__module__", None)
    return mod == _HF_CAPTURE and getattr(f, "__name__", None) == "output_capturing_hook"


# NOTE [Hooks registered after convert_ on the modules around]
# A hook on another module may write an output-saving module's output too (NOTE [Hooks on the
# modules around an output-saving one] in convert_handlers/inplace_guard.py, which reads those
# registered before convert_): a forward hook on a parent whose output may be this module's (BERT's
# post-norm layer, whose output is its last LayerNorm's; a Sequential ending in a GELU), a forward
# pre-hook or forward hook on a module its output is given to (the next Linear, the next layer and
# its children given that input), and a global forward pre-hook (``register_module_forward_pre_
# hook``: it runs on every module, the consumers included). Which dicts hold those hooks is a fact
# of the structure, read once at ``convert_`` (``state_consumers_``, from the reading of the
# converted model) and stored on the module: ``near_hooks``, a tuple of the dicts themselves
# (torch adds to and removes from them in place; the global one first, for every module), and
# ``near_free``, their contents as last found harmless. The check per call is part of the
# expression that checks the module's own hooks: ``near_hooks != near_free``, a comparison of two
# tuples of dicts in C (no Python call; equal, the common case, when no hook came or went since).
# When they differ, :func:`near_writes` reads each hook there (once per function,
# ``inplace_guard.hook_may_write``: its source, every write it makes to what it is given, a value
# it is given passed to a callable slimgrad cannot read, an attribute assigned on it; an
# unreadable hook may write; slimgrad's observers and transformers' output-capturing hook do not):
# if one may write, the module runs eager's op for that call and keeps what eager keeps (exact:
# eager's values, gradients and memory), and checks again at the next call; if none may, their
# contents become ``near_free`` and the module keeps its savings at no further cost. So a hook that
# only reads (a feature collector, a profiler's pre-hook) costs the savings nothing, and one that
# returns a new tensor instead of editing (``return out * 2``) neither: the module's own output,
# the one it keeps, is left as it was. ``near_free`` holds the hook functions it compared; it
# pickles and deep-copies as empty dicts (the copy reads its hooks again at its first call), and
# the dicts in ``near_hooks`` are the copied modules' own (one ``deepcopy`` or pickle of the
# model; the global dict is the process's). Not covered: a hook added by writing into a module's
# hook dict by hand after replacing that dict (``m._forward_hooks = OrderedDict(...)``), a module
# whose structure changed after ``convert_`` (run it again), and a tensor a read-only hook stores
# and the caller writes in place later (as any output handed out: NOTE [Modules whose output is
# the model's output]).
class _Seen(tuple):
    # ``near_free``: pickles and deep-copies as that many empty dicts
    __slots__ = ()

    def __reduce__(self):
        return (_Seen, (tuple({} for _ in self),))


class _Near(tuple):
    # ``near_hooks``: the global pre-hook dict first, then the neighbours' dicts; a copy keeps the
    # process's global dict (and the copied neighbours' dicts)
    __slots__ = ()

    def __reduce__(self):
        return (_near, (tuple(self[1:]),))


def _near(dicts: tuple = ()) -> _Near:
    return _Near((_module._global_forward_pre_hooks, *dicts))


#: the defaults of every module (``NoScript``): the global pre-hooks alone
NEAR_HOOKS, NEAR_FREE = _near(), _Seen(({},))


def watch_(m: torch.nn.Module, dicts) -> None:
    """Store on ``m`` the hook dicts of the modules around it that may write its output (NOTE
    [Hooks registered after convert_ on the modules around]); ``convert_`` calls it."""
    if not dicts:  # the class's defaults (nothing on the instance: nothing more for Dynamo to
        m.__dict__.pop("near_hooks", None)  # guard on in a compiled model)
        m.__dict__.pop("near_free", None)
        return
    m.__dict__["near_hooks"] = _near(tuple(dicts))
    m.__dict__["near_free"] = _Seen({} for _ in range(len(dicts) + 1))
    near_writes(m)  # those already there: read now, not at the first call


def near_writes(m: torch.nn.Module) -> bool:
    """Whether a hook around ``m`` may write its output now (NOTE [Hooks registered after
    convert_ on the modules around])."""
    near = m.near_hooks
    if near == m.near_free:
        return False
    from slimgrad.convert_handlers.inplace_guard import hook_may_write

    if any(hook_may_write(f) for d in near for f in d.values()):
        return True
    m.__dict__["near_free"] = _Seen(dict(d) for d in near)
    return False
