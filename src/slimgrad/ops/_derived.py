"""Derived saved inputs: keep a normalisation's output once, recompute the activation from it.

# NOTE [Derived saved inputs]
In ``Conv -> BatchNorm -> ReLU -> Conv`` eager PyTorch keeps two full-size tensors per block: the
BatchNorm input ``x`` (for x̂) and the ReLU output ``r`` (the next conv's input, for its weight
gradient). Both follow from the BatchNorm output ``b`` alone: x̂ = (b - β) / γ, and r = act(b) is
one cheap elementwise op. So a block needs to keep only ``b``. Three cooperating pieces make that
happen without any change to model code (``self.bn1(x)`` then ``self.relu(x)`` then
``self.conv2(x)``):

1. A *source* (slimgrad's BatchNorm in training) keeps its input ``x`` by default, exactly like
   eager, and registers its output ``b`` here with :func:`register_source` together with its
   version.
2. :func:`activation` applied to a *pristine* source output (same tensor object, version unchanged)
   asks the source to keep ``b`` instead of ``x`` (``keep_output``; the source may refuse, e.g.
   when too many channels have γ ≈ 0 or |β| > |γ|/2), computes ``r = act(b)`` out of place and
   registers ``r`` as *derived*: ``(base=b, act, versions)``. Its own Function keeps ``b`` (the same
   storage) for act'(b), with the aten backward kernel eager uses, so the gradient has eager's bits
   (LeakyReLU: ``leaky_relu_backward`` on b; ELU: ``elu_backward`` on b, or, for eager's in-place
   ``elu_``, on its output recomputed from b). For an in-place activation
   (``nn.ReLU/SiLU/LeakyReLU/ELU(inplace=True)``) a new ``r`` instead
   of overwriting ``b`` is only invisible when nobody else can see ``b``: the module asks
   ``slimgrad.ownership.owns_input`` (NOTE [Gradient-buffer ownership]), and without that proof
   runs eager's in-place op (``self.relu(out)`` for its side effect, ``a = self.relu(b)`` with
   ``b`` read later) and the BatchNorm keeps its input, as eager.
3. slimgrad's conv, given an input tagged as derived (:func:`lookup`), keeps ``b`` and the act
   instead of ``r`` and recomputes ``r = act(b)`` in backward, bit for bit the same kernel as in
   forward.

Where ``b`` is not pristine (``out += identity`` in a ResNet block bumps its version before the
ReLU) nothing is claimed: the BatchNorm keeps its input, or a recipe for it (below). The mechanism
only ever drops tensors that are provably re-derivable.

Safety. Registries are weak and keyed by tensor identity
(:class:`torch.utils.weak.WeakIdKeyDictionary`): a view or a copy of ``r`` is not tagged and takes
the eager path. Every tensor kept in place of another is a ``detach()`` alias, which shares the
version counter, so an in-place write to ``b`` after it was kept raises at backward: slimgrad's
"modified by an inplace operation" error naming the fix (through ``save_for_backward``, re-raised
by :func:`raise_written`, or :func:`check_version` for the source's switchable slot: NOTE [A kept
tensor written after forward]). Where eager trains through such a write (a ReLU, which keeps its
own output, after the BatchNorm) and the model's forward shows it, ``convert_`` keeps that ReLU
torch's (NOTE [A write after a BatchNorm output was claimed] in convert_handlers/inplace_guard.py).
A write to ``r`` after the conv ran does not matter: the conv
recomputes ``r`` as it was. Nothing is registered under no_grad / inference_mode (no Function runs)
or while torch.compile traces (the ops take their plain path there).

# NOTE [Recomputable inputs]
Some BatchNorm inputs cannot be rebuilt from the output: in a ResNet bottleneck ``bn3``'s output is
overwritten by ``out += identity`` and ``bn_downsample``'s output is only added, so the eager-style
BatchNorm would keep its input c (the biggest tensors of the block: 4x the bottleneck width). But c
= conv(x, W) where slimgrad's conv keeps x anyway (or b with x = act(b)) for its own weight
gradient. So the conv registers a :class:`Recipe` for its output (:func:`register_recipe`), and a
BatchNorm whose input has one keeps the recipe (references to tensors already kept: 0 bytes) instead
of c, and re-runs the same conv in backward (bit for bit: same op, same inputs; autocast's cast is
replayed). The cost is one extra forward convolution for such layers (ResNet-50: the 1x1 conv3 and
downsample convs); the versions of every ingredient are checked, so an in-place change of x or W
between forward and backward raises autograd's error instead of giving a wrong gradient. The
default policy (``"pointwise"``) replays 1x1 convs that do not reduce the channels (C_in <= C_out:
NOTE [Which convs the default replays]) only, and not one whose input is a
squeeze-excite output (NOTE [Gated derived tensors]): in EfficientNet-B0 and MobileNetV3 those
convs are projections whose replays were 11-12% of the step's convolution FLOPs, to save the
narrow output of an inverted-residual block; with those norms keeping their input the peak is
0.350x eager (EfficientNet-B0, 8x3x224x224 fp32; 0.325x with the replays). RegNetY's conv3 keeps
its width, and its replays (27 per step in regnety_016, 8x3x224x224 fp32) cost the most: with
those norms keeping their input the peak is 0.574x eager (0.465x replaying), and replaying costs
a sixth more step time on CPU (NOTE [A stand-in for x] in ops/conv.py; ``docs/measurements.md``).

Under saved-tensor hooks: the BatchNorm keeps its switchable slot as ctx attributes
(``save_for_backward`` cannot be changed after forward), which saved-tensor hooks do not see. So
inside a ``torch.utils.checkpoint`` (non-reentrant), ``save_on_cpu`` or other hooks region it
decides at forward and saves through ``save_for_backward``: b where the module's output was
claimed at the last weight version, else x, or a recipe's input where that is smaller than x
(NOTE [Under saved-tensor hooks] in ``ops/batch_norm.py``); b goes through the hooks once for the
norm, the activation, a gate and the next conv (NOTE [One pack per shared tensor]).

# NOTE [Which convs the default replays]
A replay of a 1x1 conv frees its output y (C_out values per pixel) for C_in / groups multiply-adds
per value of y: itemsize x groups / C_in bytes per multiply-add, whatever the resolution. In a
ResNet bottleneck the expanding conv3 (width -> 4 width) and the downsample conv (C_in -> 2 C_in
or 4 C_in) are the convs whose norms cannot keep their output (the residual add writes over it);
the reducing conv1 (4 width -> width) is replayed only where its norm keeps its input, i.e. where
that norm sees few values per channel (NOTE [Few values per channel] in ops/batch_norm.py), and
there its replay costs 4x the multiply-adds per freed byte of conv3's. So ``"pointwise"`` replays
a 1x1 conv only where C_in <= C_out (``ops/conv.py`` reads it from the weight's shape and
``groups``): a fact of the model's structure, the same on every call. In a torchvision ResNet-50
at 224x224 every norm sees more than 32 values per channel, so no conv1 is replayed and the
rule keeps the bytes and replays of replaying every 1x1 conv; at few values per channel (the
host-overhead proxy) it drops the conv1 replays. Per-rule bytes, FLOPs and step times are in
``docs/measurements.md`` (Replayed 1x1 convs); what the replays cost: NOTE [What a replayed
input costs] in ``ops/batch_norm.py``.

Nor does ``"pointwise"`` replay a conv whose norm, in training, sees at most 32 values per channel
(``_MAX_FEW``: NOTE [Few values per channel] in ``ops/batch_norm.py``; the norm tests it from its
input's shape, integer arithmetic it does anyway). Those P values per channel are the conv's output
positions (N x H x W), and a replay reads the conv's whole weight (C_out x C_in / groups values) to
rebuild P x C_out values: 2P / itemsize FLOPs per weight byte, and P x groups / C_in bytes freed per
weight byte read. At P <= 32 (at most 16 FLOPs per float32 weight byte) the replay is bound by that
read and its launch, not by its FLOPs, and frees at most 32 x groups / C_in of the bytes it reads
(at the host-overhead proxy 16 to 64 kB per layer, for 0.25 to 4 MB of weight). There the norm runs
aten's backward from x whether it keeps x or x's recipe, so keeping x changes no bit (and the call
takes eager's own op, fewer host calls). In a torchvision ResNet-50 (float32, exact bytes) at the
proxy's 2x3x32x32 the 16 replays of layers 2-4 (P = 32, 8 and 2) go, 20 -> 4 per step: saved
2,301,524 -> 2,924,116 B (eager 3,710,548), peak unchanged at 94,701,104 (eager 95,223,344). At
224x224 the smallest P is 49 even at batch 1 (layer4's 7x7), and every norm of the timm bench models
at 8x3x224x224 sees at least 392 values per channel, so there every replay stays: ResNet-50 at
8x3x224x224 saves 352,746,244 B and peaks at 419,810,728 B, as before (eager 682,703,620 and
730,811,816). Per-shape GFLOP/s and step times: ``docs/measurements.md`` (Replayed 1x1 convs).
``"always"`` still replays every conv that has a recipe.

# NOTE [Rebuilt once per backward]
Several nodes may rebuild the same tensor from one kept base b in one backward: in an
EfficientNet/RegNet block ``r = act(b)`` is the squeeze-excite input and ``y = r * g`` the
projection conv's input, so the BatchNorm after that conv (its recipe), the conv (dW) and the
squeeze-excite (dg) would each recompute act(b), and the first two y as well. Every consumer
instead holds a :class:`Rebuild` handle (made at forward time, which counts it as one *user* of
that derived tensor in a store shared by every tensor derived from b) and calls it in backward:
the first call in a backward (a graph task, ``torch._C._current_graph_task_id()``) computes the
value with :func:`apply_act` (for ``y`` the inner ``act(b)`` goes through the store too, so a
pending squeeze-excite finds it) and keeps it while users that have not yet had it remain; each
later call in the same task takes it, and the last one frees it (and gets ``exclusive=True``: it
may write over it, as over a fresh result). Whatever is left when the task ends (a consumer whose
backward did not run: ``backward(inputs=...)``, an unused branch, a double backward) is dropped
by an engine callback queued at the first store, so nothing outlives its backward, and a second
backward (``retain_graph=True``) recomputes. The value is the one :func:`apply_act` computes (the
same kernels on the same kept tensor: the same bits as recomputing it); the base's version is
checked at every hit. Outside a backward (task id -1) nothing is stored.

# NOTE [Held only between neighbours]
A value held from one consumer to the next is live across everything the backward runs in
between, so it may raise the peak. Two cases did (tiny timm models, exact tracker, SHARE on vs
off): (1) in regnety_002 the stem's ReLU(b) (4x32x16x16, 131072 bytes) feeds the first block's
shortcut conv (and its norm's recipe) and the branch's first conv; the shortcut runs first in
backward, so the value was held across the whole branch, and through that branch's norm backward,
the step's peak (+131072 bytes: 19 kB above eager's peak); (2) in a tiny ResNet-50 the last norm
of a bottleneck replays its conv from ReLU(b) (a recipe) and held it for that conv's dW, across the
norm's own dx (+65536 bytes). So: (1) a store shares only if all its users were registered within
``NEIGHBOURS`` forward events (:func:`_tick`: a norm output, a conv's recipe, a derived
activation, a user) of each other, i.e. inside one block, not across a branch; (2) a recipe's
handle (``Rebuild(..., user=False)``; its adopter, a norm, counts as the user) never holds what it
builds (nor the inner act(b) of a gate): it only counts its use down, and the next user rebuilds.
What remains shared: the projection conv's dW (building ``act(b) * g``) keeps act(b) for the
squeeze-excite's dg. That value is live while the conv allocates its weight gradient (besides the
gated value, as when it is built: a few hundred bytes in a toy block whose peak is that moment)
and its dx; the full-size peaks (benchmarks/timm_models.py, efficientnet_b0, regnety_016,
mobilenetv3_large_100, resnet50) are the same as without sharing, to the tenth of a MiB printed.
efficientnet_b0 (2x3x64x64) runs 65 SiLUs per step with sharing, 81 without (eager: 49).
"""

from __future__ import annotations

import weakref
from functools import partial as _partial
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from slimgrad import ownership
from slimgrad._autograd import (
    FxTraceError,
    direct_apply,
    refuse_jit,
    unwrap_if_dead,
)
from slimgrad._autograd import (
    compiling as _compiling,
)
from slimgrad._errors import internal_error, raise_if_written
from slimgrad._library import (  # under_checkpoint: ops call it as _derived.under_checkpoint
    _CHECKPOINT,
    _checkpoints,
    _top_hooks,
    under_checkpoint,  # noqa: F401
)
from slimgrad._math.norms import unseen

__all__ = [
    "ACTIVATIONS",
    "Derived",
    "Rebuild",
    "Recipe",
    "activation",
    "apply_act",
    "check_version",
    "raise_written",
    "lookup",
    "lookup_recipe",
    "register_gated",
    "register_recipe",
]

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "leaky_relu", "elu", "hardswish")

# An activation is named by a str (``"relu"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"``) or, for
# the ones with parameters, a tuple: ``("leaky_relu", negative_slope, inplace)`` and
# ``("elu", alpha, inplace)``. ``inplace`` only selects which of eager's backward formulas to
# reproduce bit for bit: eager's in-place ELU differentiates from its output (``is_result=True``),
# so the derived Function recomputes that output from b first; out of place, from b itself.
# torch.nn.ELU is ``elu(x, alpha, scale=1, input_scale=1)``. Eager's in-place ``hardswish_`` keeps a
# copy of its input and differentiates from it, as out of place: one spec for both.
#
# NOTE [Gated derived tensors]
# Squeeze-excite gating ``y = x * g`` (``slimgrad.ops.squeeze_excite``) with x kept (or x = act(b),
# b kept) registers y as derived with the spec ``("gate", inner, g, g_version, gate_first)``:
# ``apply_act`` rebuilds y as ``apply_act(inner, b) * g`` (``inner`` None: ``b * g``), the same
# multiply in the same operand order, so a following slimgrad conv keeps b instead of y. g (one
# value per sample and channel) is a detached alias; its version is checked at lookup (forward) and
# at every rebuild (backward), so an in-place change of g raises autograd's error instead of
# giving a wrong gradient. Only ``apply_act`` knows this spec: it is never an activation's own.


# NOTE [Registries keyed by identity]
# A registry maps a tensor (by identity, as long as its Python object lives) to a value, as
# torch.utils.weak.WeakIdKeyDictionary does: {id(t): (weakref.ref(t, drop), value)}, the entry
# dropped by the weak reference's callback when t dies (before its id can be reused). One weak
# reference per key, kept when a key is registered again (ownership.owns_input counts it as the
# registry's, not a reader: ownership.register_registry). A hit is ``data.get(id(t))`` and
# ``entry[0]() is t``: two calls where WeakIdKeyDictionary.get made 6 to 12 in Python (the key
# object, its hash, and on a hit its __eq__ and two derefs); that was ~1,000 of a converted
# ResNet-50 step's 18,000 Python calls. A weak reference is dereferenced only with the tensor of
# that id in hand (a lookup, ``in``), so it returns that live tensor or None, never a tensor whose
# Python object only C++ keeps (what WeakIdRef's ``_fix_weakref`` is for when it iterates).
class _Registry:
    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data: dict[int, tuple] = {}

    def get(self, t, default=None):
        e = self.data.get(id(t))
        return e[1] if e is not None and e[0]() is t else default

    def __contains__(self, t) -> bool:
        e = self.data.get(id(t))
        return e is not None and e[0]() is t

    def __setitem__(self, t, value) -> None:
        _put(self.data, t, value)

    def __len__(self) -> int:
        return len(self.data)


def _put(data: dict, t, value) -> None:
    k = id(t)
    e = data.get(k)
    if e is not None and e[0]() is t:
        data[k] = (e[0], value)  # one weak reference per key
        return
    # NOTE [A registry entry dropped in C]
    data[k] = (weakref.ref(t, _partial(data.pop, k)), value)


# NOTE [A registry entry dropped in C]
# The weak reference's callback is ``functools.partial(data.pop, k)``: called with the dead
# reference, it runs ``data.pop(k, ref)`` (ref is the default), all in C, no Python frame per dying
# key. The entry at k is always t's own when it runs: an entry is replaced only for the same live
# tensor (which keeps its weak reference, above) or for another tensor of the same id, which can
# exist only after t died, and t's callback runs as t dies (a tensor whose Python object torch
# resurrects keeps its weak references and is not dead).


_SOURCES = _Registry()
_DERIVED = _Registry()
_RECIPES = _Registry()
for _registry in (_SOURCES, _DERIVED, _RECIPES):  # their weak references are not readers
    ownership.register_registry(_registry)
_SOURCES_D, _DERIVED_D, _RECIPES_D = _SOURCES.data, _DERIVED.data, _RECIPES.data
# torch.compiler.is_compiling itself (Dynamo folds it by identity), without a wrapper's frame;
# transforms_active's and refuse_jit's tests themselves (the C functions): one call, not two or
# three, on the hot path (refuse_jit raises only where the tracing state is set)
_is_compiling = torch.compiler.is_compiling
_transforms_active = torch._C._are_functorch_transforms_active
_jit_tracing = torch._C._is_tracing


# Off: every consumer rebuilds its own (NOTE [Held only between neighbours]).
SHARE = True
# NOTE [Held only between neighbours]: a store's value is held only when all its users were
# registered within this many forward events (_tick) of each other (in the timm CNNs a block's
# users span at most 3; the stem's ReLU, used by a branch and its shortcut, 18).
NEIGHBOURS = 8
_CLOCK = [0]


def _tick() -> int:
    # one forward event: a norm output registered, a conv's recipe, a derived activation, a user
    _CLOCK[0] += 1
    return _CLOCK[0]


class _Store:
    # NOTE [Rebuilt once per backward]: per base b, the users counted at forward time and the
    # values rebuilt in the current backward, both keyed by id(act spec) (a handle holds its spec)
    __slots__ = ("entries", "span", "users")

    def __init__(self) -> None:
        self.users: dict[int, int] = {}
        # forward clock (_tick) of the first and the last user registered: NOTE [Held only
        # between neighbours]
        self.span = [-1, -1]
        # id(act): [task, base version, value, users left, act (ids are compared with it)]
        self.entries: dict[int, list] = {}


class Rebuild:
    """One consumer's handle on ``apply_act(act, b)`` (NOTE [Rebuilt once per backward]).

    ``handle(b)`` returns ``(value, exclusive)``: ``exclusive`` when no other consumer of this
    backward will be handed the same tensor (the caller may write over it)."""

    __slots__ = ("act", "hold", "store")

    def __init__(self, act, store: _Store, user: bool = True, hold: bool | None = None) -> None:
        # hold: may keep the value for the next user; by default only a counted user's handle.
        # A recipe's (user=False: its adopter, a norm, counts) never does: the norm allocates its
        # dx right after (NOTE [Held only between neighbours]).
        self.act, self.store = act, store
        self.hold = user if hold is None else hold
        if user:
            self.add_user(1)

    def add_user(self, n: int) -> None:
        users = self.store.users
        k = id(self.act)
        users[k] = (users[k] if k in users else 0) + n
        if n > 0:
            _CLOCK[0] += 1  # _tick()
            now = _CLOCK[0]
            span = self.store.span
            if span[0] < 0:
                span[0] = now
            span[1] = now

    def __call__(self, b: torch.Tensor) -> tuple[torch.Tensor, bool]:
        return _rebuilt(self.store, self.act, b, True, self.hold)


def _rebuilt(
    store: _Store, act, b: torch.Tensor, consume: bool, hold: bool = True
) -> tuple[torch.Tensor, bool]:
    # consume: a user's call (counts down); else a producer's (the gate needs act(b) first).
    # hold: the value may be kept for a later user (NOTE [Held only between neighbours]).
    key = id(act)
    task = torch._C._current_graph_task_id()
    e = store.entries.get(key)
    left = store.users.get(key, 0)
    if e is not None:
        if e[0] == task and e[1] == b._version and e[4] is act:
            value = e[2]
            left = e[3]
            if value is not None:
                if not consume:
                    return value, False
                e[3] -= 1
                if e[3] <= 0:  # the last user: let go (the task-end callback holds the entry)
                    del store.entries[key]
                    e[2] = None
                    return value, True
                return value, False
            # consumed by users that did not hold it: rebuild, counting on from there
        del store.entries[key]  # another backward's, or b changed since, or not held
        e[2] = None
    if type(act) is tuple and act[0] == "gate":  # NOTE [Gated derived tensors]
        _, inner, g, g_version, gate_first = act
        check_version(g, g_version, "squeeze-excite gate")
        x = _rebuilt(store, inner, b, False, hold)[0] if inner is not None else b
        value = g * x if gate_first else x * g
    else:
        value = apply_act(act, b)
    left -= 1 if consume else 0
    if (
        not SHARE
        or task < 0
        or left <= 0
        or torch.is_grad_enabled()
        or store.span[1] - store.span[0] > NEIGHBOURS
    ):
        return value, True
    # a user that may not hold it still counts down (an entry without a value)
    entry = [task, b._version, value if hold else None, left, act]
    store.entries[key] = entry

    def drop(store=store, key=key, entry=entry) -> None:  # the task's end: drop what is left
        entry[2] = None
        if store.entries.get(key) is entry:
            del store.entries[key]

    torch.autograd.Variable._execution_engine.queue_callback(drop)
    return value, not hold


# NOTE [Records made without a Python frame]
# Derived and Recipe are made on the hot path (a Recipe for every conv output of a step, a Derived
# for every claimed activation): as SimpleNamespace subclasses without a Python __init__ they are
# built by the C constructor from keyword arguments, no Python frame per record (the dataclasses
# they were cost one __init__ frame each: 53 of a converted ResNet-50 step's calls). They compare
# and hash by identity, as the ``dataclass(eq=False)`` classes did; a field not passed reads the
# class's default.
class _Record(SimpleNamespace):
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__


class Derived(_Record):
    """``Derived(base=, base_version=, act=, version=, store=None)``: a tensor that is
    ``apply_act(act, base)``.

    base: detached alias of b (shares b's version counter); act: an activation spec (a str or a
    tuple, see ACTIVATIONS); version: the derived tensor's version when it was registered; store:
    NOTE [Rebuilt once per backward], shared by b's derived tensors; pack: b's one pack under
    saved-tensor hooks (NOTE [One pack per shared tensor]), or None; region: NOTE [A lookup across
    a checkpoint boundary]."""

    store: _Store | None = None
    pack: list | None = None
    # NOTE [A lookup across a checkpoint boundary]: checkpoint's pack hook active where this was
    # registered, or None outside any checkpoint
    region: object | None = None

    def consumer(self) -> Rebuild:
        """A handle for one node that will rebuild this tensor in backward (counted as a user)."""
        if self.store is None:
            self.store = _Store()
        return Rebuild(self.act, self.store)


class Recipe(_Record):
    """How to recompute a tensor y bit for bit: ``fn(*tensors)``;
    ``Recipe(fn=, tensors=, versions=, version=, cheap=False, rebuild=None)``. Every tensor is a
    detached alias of one that another node keeps anyway (a conv's weight and bias: the
    Parameters themselves), so keeping the recipe costs no bytes, and must be unchanged
    (``versions``; ``version``: y's when it was registered). ``cheap``: the producer is pointwise
    (a 1x1 conv that does not reduce the channels: NOTE [Which convs the default replays]), so
    re-running it costs little next to the rest of the network.
    ``rebuild``: the handle fn rebuilds its derived input with (NOTE [Rebuilt once per
    backward]); each adopter (lookup_recipe) counts as one user of it until it drops the recipe
    (drop()). ``pack``: the first tensor's one pack under saved-tensor hooks (NOTE [One pack per
    shared tensor]), or None."""

    cheap: bool = False
    rebuild: Rebuild | None = None
    pack: list | None = None
    # NOTE [A recipe made in a checkpoint's forward]: checkpoint's pack hook where the first
    # tensor is a stand-in (its shape, dtype and device; no values), else None
    region: object | None = None

    def pinned(self) -> Recipe:
        """This recipe as its adopter keeps it (a :class:`NodeRecipe`'s tensors read now)."""
        return self

    def drop(self) -> None:
        """An adopter no longer keeps this recipe (its backward will not call it)."""
        if self.rebuild is not None:
            self.rebuild.add_user(-1)

    def __call__(self) -> torch.Tensor:
        if self.region is not None:  # NOTE [A recipe made in a checkpoint's forward]
            raise internal_error(
                "slimgrad.ops: a recipe made in a checkpoint's forward (a stand-in for its input) "
                "was called"
            )
        for t, v in zip(self.tensors, self.versions):
            if t is not None and t._version != v:
                check_version(t, v, "tensor kept to recompute a normalisation input")
        if torch.is_grad_enabled():  # a double backward (create_graph): no graph for the replay
            with torch.no_grad():
                return self.fn(*self.tensors)
        return self.fn(*self.tensors)  # a backward runs without grad mode: as under no_grad


# NOTE [A recipe that reads x from eager's conv node]
# A conv whose input and weight both need gradients runs eager's op (NOTE [A conv that keeps what
# eager keeps] in ops/conv.py), and eager's node keeps x until its backward. Its recipe held a
# detached alias of x: for as long as y lived, not until the conv's backward, so where y outlived
# it x did too. y outlives it wherever the caller holds the output through backward, the usual
# loop ``out = model(x); loss = crit(out); loss.backward()`` when the model ends in a conv (a
# segmentation head, a UNet, a generator): the last conv's input stayed alive for the whole
# backward, peak above eager's (conv-ReLU-conv-ReLU-conv, 4 x 32 x 32 x 32, output held:
# 2,186,772 B against eager's 2,149,780; not held: 1,625,492 against 2,100,628); and inside a
# reentrant checkpoint's backward, whose recomputed outputs it holds until the region's backward
# is done. Where no saved-tensor hooks are active, the recipe keeps eager's node instead and reads
# x as the node's saved input (``_saved_input``, the tensor itself) when it is read: the node lets
# x go at its backward, which runs after every reader's (a norm after the conv: its backward
# comes first). Under hooks, reading it would unpack (an offloading hook copies): x is kept.
# Where the node has let x go (or x was written in place since), reading raises: a lookup then
# finds no recipe (readable_tensors; the BatchNorm's inline lookup likewise), and an adopter keeps
# a plain copy made at its forward (``pinned``), so a backward of the BatchNorm that runs after
# the conv's (its output used elsewhere first) still replays it (a review found both crashing).
class NodeRecipe(Recipe):
    """A :class:`Recipe` whose first tensor is eager's conv node's saved input, read when read
    (``node``), its weight and bias in ``params`` (NOTE [A recipe that reads x from eager's conv
    node])."""

    @property
    def tensors(self) -> tuple:
        # RuntimeError where the node has run its backward (x let go) or x was written in place
        # since: a lookup then finds no recipe (readable_tensors)
        return (self.node._saved_input, *self.params)

    def pinned(self) -> Recipe:
        """A plain :class:`Recipe` of the tensors read now, for an adopter that keeps it (its
        node may run its backward before the adopter's replay)."""
        fields = {**vars(self), "tensors": self.tensors}
        del fields["node"], fields["params"]
        return Recipe(**fields)


def readable_tensors(r: Recipe) -> tuple | None:
    """``r.tensors``, or None where a :class:`NodeRecipe` cannot read its node's input any more."""
    try:
        return r.tensors
    except RuntimeError:
        return None


# NOTE [One pack per shared tensor]
# Without hooks a BN -> act -> conv block keeps one tensor, b (the norm's output), for three nodes:
# the norm (x̂ from b), the activation (act'(b)) and the next conv (dW from act(b)); a squeeze-excite
# gate and a norm that replays its input conv (NOTE [Recomputable inputs]) may read it too. Under
# ``saved_tensors_hooks`` each of those nodes packed its own b through save_for_backward: identity
# hooks kept one storage, but an offloading hook copies each pack (``save_on_cpu`` moved b three
# or four times). So b goes through the hooks once, in a *pack*: the plain list ``[packed,
# state]`` made by :func:`pack_once`, which calls the innermost hooks' pack hook on a detached
# alias of b (as autograd's save_for_backward does: under no_grad, and a pack hook that writes
# over its input is refused as autograd refuses it). The pack rides on the records
# (``Derived.pack``, ``Recipe.pack``, the norm's source), and each node that would have saved b
# keeps the list as a ctx attribute instead (a user, counted at forward: ``state.users``), so the
# tracker and a later hook see its packed object, and calls :func:`read_pack` in backward: the
# first reader of a backward (graph task) runs the unpack hook once and holds the value for the
# others of that backward (the last reader, or the task's end, lets it go: a hook that frees its
# copy at unpack, as torchtune's offloading does, is unpacked once per backward, as autograd
# does). Where the unpack hands back b's own memory (identity hooks), a write over b since forward
# raises autograd's in-place error (autograd checks no version under hooks). Each user drops the
# list after its backward unless the graph is retained (:func:`release_pack`), so the packed
# object goes with the last user; a second backward then raises as eager's. A norm under hooks
# packs b when an activation's claim comes (after the activation asked for ownership of b: a pack
# made at forward, a second holder of b's storage, made every in-place activation refuse), with
# the hooks active at the claim, the activation's own, and nowhere else: an unhooked step makes
# no call for it. Where no hooks are active at the claim (a region around the norm alone), the
# norm keeps b as without hooks: the activation keeps b itself there, as eager's does. Each
# consumer (the activation, a gate, the next conv, a norm replaying that conv) shares the pack
# only where the hooks active at its own forward are the very pair the pack was made with
# (:func:`shared`): else it saves through save_for_backward under its own hooks, as eager's
# node, so a region around part of a block, nested regions and a checkpoint boundary inside a
# block hand each hook what eager's nodes hand it. A hook that recomputes (a checkpoint built on
# saved_tensors_hooks, index-matched as torch's) sees the same packs in the same order in its
# recompute as in its forward: the claim that packs comes inside its region in both or in
# neither, and a recompute inside a backward takes this same path. Not under
# torch.utils.checkpoint's own hooks (its pack holds no tensor, so sharing moves no byte there;
# its unpack may run once per saved tensor per backward: NOTE [Under saved-tensor hooks] in
# ops/batch_norm.py); a claim under them keeps b as without hooks (the checkpoint holds its
# input b itself). What an offload still copies
# twice is eager's own double keeping (a ResNet block output kept by its ReLU and the next conv)
# and a norm's ingredient kept by eager's conv node (NOTE [A conv that keeps what eager keeps] in
# ops/conv.py), which packs it through autograd. A torchvision ResNet-50 at 4x3x112x112 (identity
# hooks counting per storage, the step after a weight version in the region) hands over 78 packs,
# 77,307,520 B (58 storages, 48,160,384 B) against eager's 371 packs, 132,397,696 B (319
# storages, 87,542,400 B). Of the 29,147,136 B handed over more than once, 27,541,504 B are block
# outputs, handed over by eager's ops as often (in-place ReLU, next conv1, downsample conv), and
# 1,605,632 B the max-pool output: conv1 and the downsample conv, as eager, and its downsample norm
# (its replay ingredient, a quarter of the conv output eager's norm packs). No tensor is handed
# over more often than eager's ops hand it but that one (tests/ops/
# test_saved_hooks_shared_pack_resnet.py).
class _PackState:
    __slots__ = ("left", "pack", "ref", "task", "unpack", "users", "value", "version")


_task_id = torch._C._current_graph_task_id
_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
#: a user's pack after its backward freed the graph (NOTE [One pack per shared tensor])
RELEASED: list = []


def pack_hooks() -> tuple | None:
    """The innermost saved-tensor hooks ``(pack, unpack)`` that :func:`pack_once` packs with, or
    None where none are active or they are torch.utils.checkpoint's (NOTE [One pack per shared
    tensor]); a recompute inside a backward gets its hooks as its forward did."""
    hooks = _top_hooks(False)
    return None if hooks is None or _checkpoints(hooks) else hooks


# NOTE [A claim under checkpoint's hooks]
# A BatchNorm call that ran under a user's saved-tensor hooks and decided from its last weight
# version's calls to keep b for its activation (``pre``, b packed at the claim) is not claimed by an
# activation that runs under torch.utils.checkpoint's hooks (a non-reentrant checkpoint of the
# activation and the next conv, the BatchNorm outside it): the forward's claim and the recompute
# inside backward (which makes none) saved different tensors with equal shapes, and checkpoint
# handed the conv the wrong one: c2.weight's gradient off by 16.6 with SiLU, 7.7 GELU, 20.9
# Hardswish from the second step on (review25b's t11; the test in
# tests/ops/test_saved_hooks_shared_pack_regions.py). Refused there, the BatchNorm keeps x as an
# unclaimed call does, and the activation and the conv save what they save without a claim, at
# forward and in the recompute alike. (``under_checkpoint``, imported above from _library.py.)


# NOTE [Value-dependent saves under torch.utils.checkpoint]
# A non-reentrant checkpoint runs the region twice, at forward and again inside backward, hands the
# forward's nodes what the recompute saved (matched by order) and, by default, raises
# CheckpointError where a recomputed tensor's shape, dtype or device differs from the forward's.
# The recompute's inputs need not be the forward's: a user's saved-tensor hooks around the region
# pack its inputs (a bf16 pack is lossy), and a kernel may not be deterministic. Eager's nodes save
# tensors whose shapes the shapes decide, so eager runs, with the recompute's gradient. A slimgrad
# op whose saved tensors' sizes the values decide (the smooth activations' hard-element table and
# dense fallback, InPlaceABN's side channels for ELU) raised CheckpointError there (Linear -> GELU
# -> Linear in bf16-packing hooks: 1,748 hard elements at forward, 1,752 in the recompute; issue
# 30), or with ``determinism_check="none"`` read the recompute's tensors with the forward's flags.
# So under checkpoint's own hooks (forward and recompute alike: :func:`under_checkpoint`) such a
# tensor is saved "held": :func:`hold` gives a 0-element view of its whole storage, whose metadata
# the shapes decide and which keeps that storage alive as the tensor would (the same bytes;
# checkpoint's hooks keep what the recompute saves by reference). Backward rebuilds it from its
# storage's size (:func:`whole`) and reads every value-dependent choice from what came back, never
# from the forward's ctx, so the gradient is the recompute's own: eager's answer on the
# recompute's inputs, within the error rule. Where the recompute saw what the forward saw (no
# hooks, lossless ones), the same tensors and bits as before. A tensor on part of a storage is
# copied first (a table is a few bytes per hard element).
# A held view is a uint8 view whatever it holds, so which storage a value-dependent choice puts in
# which slot changes no saved metadata. Selective activation checkpointing also matches the
# recompute's aten ops to the forward's, call by call per op (NOTE [The same ops under selective
# checkpointing] in ops/batch_norm.py): so under checkpoint's hooks such an op issues the same ops
# whichever choice its values make (NOTE [Side tables under torch.utils.checkpoint] in
# ops/_output_act.py; InPlaceABN's side channels: ``uniform`` in _math/abn.side_channels).
# It also hands the recompute the forward's output of every op its policy saves: a policy saving
# aten.as_strided or aten.view had the recompute's held views be the forward's (its bits, idx, xs
# beside the recompute's y: x.grad off by 0.29, silently, where the dense fallback flipped). So
# :func:`hold` and :func:`whole` run where no dispatch mode sees them (``unseen``: NOTE [A search
# the modes never see] in _math/norms.py), as does slot 0's as_strided in place: no policy has
# them to save or match. Their copy of a part of a storage is no tracker's either.
# NOTE [No write into a buffer a policy may cache]
# Selective activation checkpointing stores the output of every op its policy saves, with that
# output's version, and in the recompute hands it back only where the version is unchanged: a
# write over it after the op ran (its own in-place op's version bump, which autograd makes after
# the dispatch modes saw the op, or a later copy into it) raises "Tensor cached during selective
# activation checkpoint has been mutated". Eager's in-place activations are single ops a policy
# sees as pointwise (``aten.silu_``, ``aten.hardsigmoid_``); slimgrad's issued ops a policy saving
# every non-pointwise op stores and then saw written: the in-place smooth activations' ``copy_``
# of y into x (its own output, bumped as it returns) and Hardsigmoid's side bits, packed chunk by
# chunk into an ``aten.empty`` buffer. Linear -> x * 1 -> SiLU(inplace) -> Linear raised where
# eager ran. Under checkpoint's hooks (the forward's and the recompute's alike) the smooth
# activations' copy runs where no dispatch mode sees it (it allocates nothing: no tracker misses a
# byte; the recompute runs it again, on its own x), and Hardsigmoid joins its chunks' packed bytes
# (``torch.cat``; one chunk: pack_bits' own output), writing into nothing made before.


def hold(t: torch.Tensor) -> torch.Tensor:
    """A 0-element uint8 view of ``t``'s whole storage (``t`` copied first unless it is exactly its
    contiguous storage), made where no dispatch mode sees it: NOTE [Value-dependent saves under
    torch.utils.checkpoint]."""
    return unseen(_hold, t)


def _hold(t: torch.Tensor) -> torch.Tensor:
    if (
        t.storage_offset()
        or not t.is_contiguous()
        or t.untyped_storage().nbytes() != t.numel() * t.element_size()
    ):
        t = t.clone(memory_format=torch.contiguous_format)
    # flat first: view(uint8) needs stride(-1) == 1, which a contiguous tensor with a trailing
    # size-1 dimension need not have (empty_strided((3, 1), (1, 7)))
    return t.detach().reshape(-1).view(torch.uint8).as_strided((0,), (1,))


def whole(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The 1-D ``dtype`` tensor on all of the storage a :func:`hold` view holds (made where no
    dispatch mode sees it, as :func:`hold`)."""
    return unseen(_whole, h, dtype)


def _whole(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return h.as_strided((h.untyped_storage().nbytes(),), (1,), 0).view(dtype)


# NOTE [A lookup across a checkpoint boundary]
# A non-reentrant torch.utils.checkpoint runs its function twice, at forward and again inside
# backward, and hands the backward's nodes what the recompute saved, matched by index: so every op
# inside must save the same tensors in the same order both times. An op inside that looks up a
# registry by identity (a conv or a gate asking whether its input is a derived tensor act(b):
# NOTE [Derived saved inputs]) sees, for a tensor made before the checkpoint, at forward the
# registered tensor itself, but in the recompute what checkpoint hands back for its input, which
# under a user's saved-tensor hooks is what their unpack returns: another tensor, not registered.
# So the conv kept b at forward and x = act(b) in the recompute (equal shapes), and its backward
# rebuilt act(x): c2.weight's gradient off by 4.57 (SiLU, save_on_cpu; GELU and Hardswish alike,
# identity and copying hooks too) from the second step on, when the norm under hooks first keeps b
# for its activation. So a derived record carries its region, checkpoint's pack hook active where
# it was registered (None outside every checkpoint), and an op under checkpoint's hooks uses it
# only where that is its own region: a record made inside the region (at forward, and made again
# in the recompute under the recompute's hooks) is used both times; one made outside is used in
# neither, and the op keeps x itself, as eager's node does (the checkpoint holds x anyway: no byte
# is added). Outside every checkpoint nothing changes. NOTE [A claim under checkpoint's hooks] is
# the other split (the norm outside, the activation inside).
def region() -> object | None:
    """Checkpoint's pack hook where torch.utils.checkpoint's hooks are the innermost active ones,
    else None (NOTE [A lookup across a checkpoint boundary])."""
    h = _top_hooks(False)
    return None if h is None or not _checkpoints(h) else h[0]


def in_region(d: Derived) -> bool:
    """Whether an op running now may use derived record ``d`` (NOTE [A lookup across a
    checkpoint boundary]): not under checkpoint's hooks, or under those of ``d``'s own region."""
    h = _top_hooks(False)
    return h is None or h[0] is d.region or not _checkpoints(h)


def shared(p: list | None) -> list | None:
    """Pack ``p`` where the saved-tensor hooks active now are the very hooks it was packed with
    (the same pack and unpack objects: what autograd would pack this node's tensor with), else
    None: the node then saves through ``save_for_backward`` under its own hooks, as eager's does
    (NOTE [One pack per shared tensor])."""
    if p is None or p is RELEASED:
        return None
    hooks = _top_hooks(False)
    st = p[1]
    if hooks is None or hooks[0] is not st.pack or hooks[1] is not st.unpack:
        return None
    return p


def pack_once(t: torch.Tensor, hooks: tuple) -> list:
    """``t`` through ``hooks`` (from :func:`pack_hooks`), once, for every node that keeps it (NOTE
    [One pack per shared tensor]): ``[packed, state]`` with no user yet."""
    pack, unpack = hooks
    d = t.detach()
    version = t._version
    with torch.no_grad():
        packed = pack(d)
    if t._version != version:
        raise RuntimeError(
            "slimgrad.ops: a saved tensor pack hook modified its input in place; expected the "
            f"tensor at version {version}, got version {t._version}. Have the pack hook copy "
            "instead of writing over its input (autograd refuses the same)."
        )
    st = _PackState()
    # a weak reference to the alias packed (it shares t's version counter): alive where the hooks
    # keep it (identity hooks), so a write over t since can be refused at unpack
    st.pack, st.unpack, st.ref, st.version = pack, unpack, weakref.ref(d), version
    st.users, st.task, st.value, st.left = 0, None, None, 0
    return [packed, st]


def read_pack(p: list, what: str) -> torch.Tensor:
    """The tensor of pack ``p`` in this backward (NOTE [One pack per shared tensor]): unpacked
    once per graph task, the value held for that task's other users."""
    if p is RELEASED:
        raise RuntimeError(
            "Trying to backward through the graph a second time (or directly access saved "
            "tensors after they have already been freed). Specify retain_graph=True if you "
            "need to backward through the graph a second time."
        )
    st = p[1]
    task = _task_id()
    if st.value is not None and st.task == task:
        v = st.value
        st.left -= 1
        if st.left <= 0:
            st.value = None
        return v
    v = st.unpack(p[0])
    orig = st.ref()
    if orig is not None and orig._version != st.version and orig.data_ptr() == v.data_ptr():
        check_version(orig, st.version, what)
    if task != -1 and st.users > 1:
        st.task, st.value, st.left = task, v, st.users - 1

        def drop(st=st, task=task) -> None:  # the task's end: let go of what is left
            if st.task == task:
                st.value = None

        torch.autograd.Variable._execution_engine.queue_callback(drop)
    return v


def release_pack(p: list | None) -> list | None:
    """What a user keeps of pack ``p`` after its backward: :data:`RELEASED` where the graph is
    freed, else ``p``."""
    if p is None or p is RELEASED or _keep_graph is None or _keep_graph():
        return p
    return RELEASED


def register_recipe(
    y: torch.Tensor, fn, tensors: tuple, cheap: bool = False, rebuild: Rebuild | None = None
) -> None:
    """Register that ``y == fn(*tensors)`` bit for bit, with ``tensors`` kept by someone else
    (``rebuild``: the handle ``fn`` rebuilds a derived input with, not yet counted as a user)."""
    if _is_compiling():
        return
    tensors = tuple([t if t is None else t.detach() for t in tensors])
    versions = tuple([0 if t is None else t._version for t in tensors])
    put_recipe(
        y,
        Recipe(
            fn=fn,
            tensors=tensors,
            versions=versions,
            version=y._version,
            cheap=cheap,
            rebuild=rebuild,
        ),
    )


def put_recipe(y: torch.Tensor, recipe: Recipe) -> None:
    """:func:`register_recipe` of a made :class:`Recipe` (its tensors detached aliases, their
    versions read), for a caller that has checked that Dynamo is not tracing."""
    _CLOCK[0] += 1  # _tick()
    k = id(y)  # _put(_RECIPES_D, y, recipe), inline
    e = _RECIPES_D.get(k)
    if e is not None and e[0]() is y:
        _RECIPES_D[k] = (e[0], recipe)
    else:
        _RECIPES_D[k] = (weakref.ref(y, _partial(_RECIPES_D.pop, k)), recipe)


# NOTE [A recipe made in a checkpoint's forward]
# A conv's recipe holds its input x (NOTE [Recomputable inputs]) for as long as its output y lives,
# at no cost where the conv's own node keeps x. In a non-reentrant torch.utils.checkpoint's forward
# the nodes keep nothing (checkpoint's pack hook keeps no tensor; the recompute in backward saves
# again), so the recipe alone held x: where y outlived the region (its output, kept by the op
# after it) x stayed alive until y's backward where eager had let it go (ReLU -> trainable
# Conv2d(4, 8, 3) in the region, (2, 4, 9, 9): peak 23,336 B against eager's 20,744, x's 2,592 B
# above), and an InPlaceABN -> conv region kept the conv's input, InPlaceABN's output, likewise.
# The ops in the region must still decide as the recompute will (what they save, matched by
# order, shape and dtype), and in the forward a recipe is only ever read for those decisions and
# for the tensor a norm saves through the hooks (NOTE [Under saved-tensor hooks] in
# ops/batch_norm.py), which checkpoint's forward pack drops after reading its shape, dtype and
# device. So in checkpoint's forward (its pack hook is ``_checkpoint_hook``'s, read from the
# function's ``__qualname__``; the recompute's is ``_recomputation_hook``'s, and any other name
# keeps x as before) the conv registers a recipe whose first tensor is a stand-in for x: x's
# shape and dtype on y's storage (stride 0, no byte; made where no dispatch mode sees it), y's
# version counter in place of x's. ``region`` is that pack hook: an op under other hooks (or none)
# does not use the recipe (``usable``), a node that would keep the recipe itself as an attribute
# for its backward (a BatchNorm before its claim, RecomputeABN) keeps its input instead or does
# not use recipes under checkpoint's hooks, and calling it raises (no silent values). In the
# recompute the recipe holds x, which the conv's saved tensor keeps there anyway.
_FORWARD_HOOK = "_checkpoint_hook."


def forward_region(hooks: tuple | None) -> object | None:
    """Checkpoint's forward pack hook where ``hooks`` (the innermost saved-tensor hooks) are a
    non-reentrant checkpoint's forward ones, else None (NOTE [A recipe made in a checkpoint's
    forward])."""
    if hooks is None or not _checkpoints(hooks):
        return None
    q = getattr(hooks[0], "__qualname__", None)
    return hooks[0] if type(q) is str and q.startswith(_FORWARD_HOOK) else None


def stand_in(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor | None:
    """A tensor of ``like``'s shape and dtype on ``y``'s storage (stride 0: no byte), sharing y's
    version counter, or None where dtype or device differ (NOTE [A recipe made in a checkpoint's
    forward])."""
    if y.dtype != like.dtype or y.device != like.device or y.numel() == 0 or like.numel() == 0:
        return None
    return unseen(_stand_in, y, like.shape)


def _stand_in(y: torch.Tensor, shape) -> torch.Tensor:
    return y.detach().as_strided(shape, [0] * len(shape), y.storage_offset())


def usable(r: Recipe) -> bool:
    """Whether an op running now may use recipe ``r``: a stand-in's only under the hooks it was
    made under (NOTE [A recipe made in a checkpoint's forward])."""
    if r.region is None:
        return True
    h = _top_hooks(False)
    return h is not None and h[0] is r.region


def _usable_recipe(y: torch.Tensor, policy: str) -> Recipe | None:
    # the recipe of y if y is pristine, its ingredients unchanged and policy allows it
    if _is_compiling():
        return None
    return recipe_of(y, policy)


def recipe_of(y: torch.Tensor, policy: str) -> Recipe | None:
    """:func:`usable_recipe` for a caller that has checked that Dynamo is not tracing."""
    if policy == "never":
        return None
    e = _RECIPES_D.get(id(y))
    if e is None or e[0]() is not y:
        return None
    r = e[1]
    if y._version != r.version or (policy == "pointwise" and not r.cheap):
        return None
    if r.region is not None and not usable(r):
        return None
    ts = readable_tensors(r)
    if ts is None:
        return None
    for t, v in zip(ts, r.versions):
        if t is not None and t._version != v:
            return None
    return r


def has_recipe(y: torch.Tensor, policy: str = "pointwise") -> bool:
    """Whether :func:`lookup_recipe` would return a recipe (without counting a user)."""
    return _usable_recipe(y, policy) is not None


def lookup_recipe(y: torch.Tensor, policy: str = "pointwise") -> Recipe | None:
    """The recipe of ``y`` if ``y`` is pristine, its ingredients unchanged and ``policy`` allows it
    (``"always"``; ``"pointwise"``: only cheap producers; ``"never"``)."""
    r = _usable_recipe(y, policy)
    if r is not None and r.rebuild is not None:  # the caller keeps it: one more user
        r.rebuild.add_user(1)
    return r


def adopt_recipe(r: Recipe) -> Recipe:
    """The caller keeps ``r`` (from :func:`usable_recipe`): what :func:`lookup_recipe` counts."""
    if r.rebuild is not None:
        r.rebuild.add_user(1)
    return r


def usable_recipe(y: torch.Tensor, policy: str = "pointwise") -> Recipe | None:
    """:func:`lookup_recipe` without counting a user (:func:`adopt_recipe` does, for a caller that
    keeps it): one lookup for a caller that first decides, then keeps."""
    return _usable_recipe(y, policy)


def register_gated(
    y: torch.Tensor,
    base: torch.Tensor,
    inner,
    g: torch.Tensor,
    gate_first: bool,
    store: _Store | None = None,
    pack: list | None = None,
) -> None:
    """Register ``y == apply_act(inner, base) * g`` (NOTE [Gated derived tensors]); ``base`` is kept
    by the caller's node; ``store``: that of the derived input ``apply_act(inner, base)`` (its
    handle's), so rebuilding y also serves that input's consumers (NOTE [Rebuilt once per
    backward]); ``pack``: base's one pack (NOTE [One pack per shared tensor]), or None."""
    if _tracing():
        return
    gd = g.detach()
    spec = ("gate", inner, gd, gd._version, bool(gate_first))
    d = Derived(
        base=base.detach(),
        base_version=base._version,
        act=spec,
        version=y._version,
        store=store,
        pack=pack,
        region=region(),
    )
    _put(_DERIVED_D, y, d)


def _tracing() -> bool:
    return torch.compiler.is_compiling()


def register_source(out: torch.Tensor, source) -> None:
    """Register ``out`` as the output of ``source`` (has ``keep_output(out) -> bool``)."""
    if not _is_compiling():
        put_source(out, source)


def put_source(out: torch.Tensor, source) -> None:
    """:func:`register_source` for a caller that has checked that Dynamo is not tracing."""
    _CLOCK[0] += 1  # _tick()
    k = id(out)  # _put(_SOURCES_D, out, ...), inline
    e = _SOURCES_D.get(k)
    if e is not None and e[0]() is out:
        _SOURCES_D[k] = (e[0], (source, out._version))
    else:
        _SOURCES_D[k] = (weakref.ref(out, _partial(_SOURCES_D.pop, k)), (source, out._version))


def is_source(b: torch.Tensor) -> bool:
    """Whether ``b`` is a pristine registered source output (what :func:`claim_source` asks its
    source about); no side effect."""
    e = _SOURCES_D.get(id(b))
    return e is not None and e[0]() is b and b._version == e[1][1]


def claim_source(b: torch.Tensor) -> bool:
    """Ask the source of ``b`` (if pristine) to keep ``b`` instead of its input; True if so."""
    e = _SOURCES_D.get(id(b))
    if e is None or e[0]() is not b:
        return False
    source, version = e[1]
    if b._version != version:
        return False
    return bool(source.keep_output(b))


def lookup(x: torch.Tensor) -> Derived | None:
    """The derivation of ``x`` if ``x`` is a pristine derived tensor whose base is unchanged."""
    if _is_compiling():
        return None
    return _lookup(x)


def _lookup(x: torch.Tensor) -> Derived | None:
    # lookup() where the caller has checked that Dynamo is not tracing
    e = _DERIVED_D.get(id(x))
    if e is None or e[0]() is not x:
        return None
    d = e[1]
    if x._version != d.version or d.base._version != d.base_version:
        return None
    if type(d.act) is tuple and d.act[0] == "gate" and d.act[2]._version != d.act[3]:
        return None
    if not in_region(d):  # NOTE [A lookup across a checkpoint boundary]
        return None
    return d


# NOTE [Dropped at b's backward]
# A derived record (r = act(b), NOTE [Derived saved inputs]) holds b, a detached alias, for as long
# as r lives, so that a conv reading r in forward keeps b instead. Where r outlives b's own use (r
# is held through backward: a reentrant checkpoint's recompute keeps the region's outputs until
# the region's backward returns; a caller keeping a block's output), the record kept b alive past
# the BatchNorm's backward, where eager frees it: Conv-BN-ReLU blocks under reentrant checkpoint
# peaked in the conv's backward one activation above (4x32x16x16: 954,376 B vs eager's 918,024;
# 2x8x6x6 1.134x). A record is read only by forward lookups, and a forward that still reads r
# after b's node has run its backward and freed what it kept is no longer building that graph:
# so the BatchNorm's backward, where it lets go of what it kept (no retain_graph), drops the
# records made from its output (their keys and weak references chained on its ctx at
# registration; an entry is deleted only where it is still that reference's, i.e. r's own). A
# later lookup of r misses, and its consumer keeps r itself, as eager's does. 4x32x16x16 under
# reentrant checkpoint: 954,376 -> 823,304 B (eager 918,024).
def drop_derived(chain: tuple) -> None:
    """Delete the derived-registry entries chained on a BatchNorm ctx (NOTE [Dropped at b's
    backward])."""
    while chain is not None:
        k, ref, chain = chain
        e = _DERIVED_D.get(k)
        if e is not None and e[0] is ref:
            del _DERIVED_D[k]


# NOTE [A recipe dropped at its conv's backward]
# A conv's recipe (NOTE [Recomputable inputs]) holds the conv's kept input for as long as its
# output y lives; it is read by forward lookups and by norms that adopted it, whose backward runs
# before the conv's. Where y outlives the conv's backward (a reentrant checkpoint holds its
# region's outputs until the region's backward returns; a caller keeping y), the recipe kept that
# input past the conv's backward, where the conv's own node lets it go: under bf16 autocast the
# conv's cast copy of x, which nothing else holds (ReLU -> Conv2d(8, 8, 3) in a reentrant region,
# (2, 8, 9, 9): peak 21,912 B against eager's 20,744). So the conv's Function drops its output's
# registry entry in its first-order backward (inline, no call; the entry's key and weak
# reference set on its node at registration; deleted only where it is still y's own), as a
# BatchNorm drops
# its derived records (NOTE [Dropped at b's backward]). A norm that adopted the recipe holds it
# itself, so a retained graph's second backward still has it; only a later forward that reads y
# again misses it, and its norm keeps y, as eager's does.
def check_version(t: torch.Tensor, version: int, what: str) -> None:
    if t._version != version:
        raise RuntimeError(
            f"slimgrad.{_api_of(what)}: one of the variables needed for gradient computation has "
            f"been modified by an inplace operation: [{what}, {tuple(t.shape)}] is at version "
            f"{t._version}; expected version {version} instead. slimgrad keeps this tensor for "
            "backward in place of the one eager PyTorch keeps (NOTE [Derived saved inputs] in "
            f"slimgrad/ops/_derived.py). {_fix_of(what)}"
        )


# NOTE [A kept tensor written after forward]
# What slimgrad keeps in place of what eager keeps (a BatchNorm output b, kept once for the norm,
# its activation, a squeeze-excite gate and the next conv: NOTE [Derived saved inputs]) is
# version-checked at backward, as autograd checks what eager keeps. A write over it after forward
# that the structure did not show (user code writing a tensor the model handed out, a hook
# registered after ``convert_``; the in-place guard keeps the modules a written-over output
# reaches in the model's own forwards: NOTE [A write after a BatchNorm output was claimed] in
# convert_handlers/inplace_guard.py) cannot be undone at backward: the values x̂ and act'(b)
# came from are gone. So backward raises, naming the tensor and the fixes: autograd's error from
# ``ctx.saved_tensors`` is re-raised as slimgrad's (``raise_written``; the same first sentence,
# so code that matches autograd's message still matches), and ``check_version`` raises slimgrad's
# for the slots kept outside ``save_for_backward``.


def _api_of(what: str) -> str:
    if what.startswith("batch_norm"):
        return "ops.batch_norm"
    if what.startswith("squeeze-excite"):
        return "ops.squeeze_excite"
    return "ops"


def _fix_of(what: str) -> str:
    fix = "Do not modify it in place before backward: write into a clone (``t = t.clone()`` first)"
    if "output" in what:
        fix += ", or convert with ConvertConfig(batch_norm=False), which keeps what eager keeps"
    return fix + "."


def raise_written(e: RuntimeError, api: str) -> None:
    """Raise slimgrad's error for autograd's in-place error ``e`` from ``ctx.saved_tensors`` of a
    node that keeps a BatchNorm output in place of what eager keeps (NOTE [A kept tensor written
    after forward]); return for any other error (the caller re-raises it). Called inline from an
    ``except`` clause: nothing is added where nothing raises."""
    raise_if_written(
        e,
        api,
        "It keeps the output of a slimgrad BatchNorm for backward in place of what eager keeps "
        "(NOTE [Derived saved inputs] in slimgrad/ops/_derived.py); expected that output "
        f"unchanged from forward to backward, got a write over it. {_fix_of('batch_norm output')}",
    )


def apply_act(act, b: torch.Tensor) -> torch.Tensor:
    if type(act) is tuple:  # a spec is a str or a tuple itself (ACTIVATIONS): no call
        if act[0] == "gate":  # NOTE [Gated derived tensors]
            _, inner, g, g_version, gate_first = act
            check_version(g, g_version, "squeeze-excite gate")
            x = apply_act(inner, b) if inner is not None else b
            return g * x if gate_first else x * g
        if act[0] == "leaky_relu":
            return F.leaky_relu(b, act[1])
        if act[0] == "elu":
            return F.elu(b, act[1])
        raise _bad_act(act)
    if act == "relu":
        return torch.relu(b)
    if act == "gelu":
        return F.gelu(b)
    if act == "gelu_tanh":
        return F.gelu(b, approximate="tanh")
    if act == "silu":
        return F.silu(b)
    if act == "hardswish":
        return F.hardswish(b)
    raise _bad_act(act)


_A = torch.ops.aten


def _act_backward(act, grad: torch.Tensor, b: torch.Tensor, out=None) -> torch.Tensor:
    # The same aten backward kernels eager uses (ReLU's from the output, whose sign equals b's;
    # in-place LeakyReLU's from the output too, whose sign equals b's for a slope >= 0, the only
    # slopes eager's in-place op accepts under autograd, and which selects the same branch).
    # out: grad itself when the caller owns its buffer (ownership.take) and it has b's layout:
    # the kernels' out= overloads, elementwise, the same bits as a fresh result (tested).
    if out is not None:
        return _act_backward_into(act, grad, b, out)
    if type(act) is tuple:  # a spec is a str or a tuple itself (ACTIVATIONS): no call
        if act[0] == "leaky_relu":
            return _A.leaky_relu_backward(grad, b, act[1], False)
        if act[0] == "elu":
            if act[2]:  # eager elu_: from its output, recomputed from b bit for bit
                return _A.elu_backward(grad, act[1], 1, 1, True, F.elu(b, act[1]))
            return _A.elu_backward(grad, act[1], 1, 1, False, b)
        raise _bad_act(act)
    if act == "relu":
        return _A.threshold_backward(grad, b, 0)
    if act == "gelu":
        return _A.gelu_backward(grad, b)
    if act == "gelu_tanh":
        return _A.gelu_backward(grad, b, approximate="tanh")
    if act == "silu":
        return _A.silu_backward(grad, b)
    if act == "hardswish":  # eager's (in place: from its copy of the input, which is b)
        return _A.hardswish_backward(grad, b)
    raise _bad_act(act)


def _act_backward_into(act, grad, b, out):
    if type(act) is tuple:  # a spec is a str or a tuple itself (ACTIVATIONS): no call
        if act[0] == "leaky_relu":
            return _A.leaky_relu_backward.grad_input(grad, b, act[1], False, grad_input=out)
        if act[0] == "elu":
            if act[2]:
                r = F.elu(b, act[1])
                return _A.elu_backward.grad_input(grad, act[1], 1, 1, True, r, grad_input=out)
            return _A.elu_backward.grad_input(grad, act[1], 1, 1, False, b, grad_input=out)
        raise _bad_act(act)
    if act == "relu":
        return _A.threshold_backward.grad_input(grad, b, 0, grad_input=out)
    if act == "gelu":
        return _A.gelu_backward.grad_input(grad, b, grad_input=out)
    if act == "gelu_tanh":
        return _A.gelu_backward.grad_input(grad, b, approximate="tanh", grad_input=out)
    if act == "silu":
        return _A.silu_backward.grad_input(grad, b, grad_input=out)
    if act == "hardswish":
        return _A.hardswish_backward.out(grad, b, out=out)
    raise _bad_act(act)


def _bad_act(act) -> ValueError:
    return ValueError(
        f"slimgrad.ops._derived: unknown activation; expected one of {ACTIVATIONS}, got {act!r}. "
        "Use one of the listed names."
    )


def _act_double(ctx, grad: torch.Tensor) -> torch.Tensor:
    # create_graph=True: b is kept (with its graph), so eager's activation is recomputed from it and
    # differentiated with create_graph: eager's second derivatives (NOTE [Second derivatives])
    if ctx.pack is not None:
        # b's values from its pack (NOTE [One pack per shared tensor]), bridged to the anchor the
        # forward left on b: they differentiate as b itself
        from slimgrad.ops.layer_norm import bridged

        with torch.no_grad():
            v = read_pack(ctx.pack, "batch_norm output")
        b = bridged(ctx, "ops.activation", v)
        ctx.pack = release_pack(ctx.pack)
    else:
        try:
            (b,) = ctx.saved_tensors
        except RuntimeError as e:  # NOTE [A kept tensor written after forward]
            raise_written(e, "ops.activation")
            raise
    with torch.enable_grad():
        (db,) = torch.autograd.grad(apply_act(ctx.act, b), b, grad, create_graph=True)
    return db


class _DerivedActFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, b: torch.Tensor, act, pack):
        r = apply_act(act, b)
        ctx.act = act
        ctx.pack = pack
        if pack is None:
            ctx.save_for_backward(b)
        else:  # NOTE [One pack per shared tensor]: b's one pack, read in backward
            pack[1].users += 1
        return r

    @staticmethod
    def backward(ctx, grad):
        # first_order's test, inline (NOTE [First order, tested inline])
        if torch.is_grad_enabled():
            return _act_double(ctx, grad), None, None
        buf = ownership.take(grad)  # first use of grad: NOTE [Gradient-buffer ownership]
        if ctx.pack is None:
            try:
                (b,) = ctx.saved_tensors
            except RuntimeError as e:  # NOTE [A kept tensor written after forward]
                raise_written(e, "ops.activation")
                raise
        else:
            b = read_pack(ctx.pack, "batch_norm output")
            ctx.pack = release_pack(ctx.pack)
        if buf is not None and (buf.stride() != b.stride() or buf.dtype != b.dtype):
            buf = None  # a fresh result takes the layout eager's kernel picks
        return _act_backward(ctx.act, grad, b, buf), None, None


_ACT_APPLY = direct_apply(_DerivedActFn)


def _packed_act(x: torch.Tensor, spec, pack: list) -> torch.Tensor:
    # the activation keeping x's pack (NOTE [One pack per shared tensor]), with an anchor on x for
    # a second derivative (_act_double: the pack's values carry no graph)
    from slimgrad.ops.layer_norm import _ANCHOR_APPLY

    xu = unwrap_if_dead(x)
    box: list = []
    anchor = (_ANCHOR_APPLY(xu, box), box)
    r = _ACT_APPLY(xu, spec, pack)
    r.grad_fn._slimgrad_anchor = anchor
    return r


# NOTE [First order, tested inline]
# The Functions of the CNN hot path (conv, batch_norm, the derived activation) test grad mode at
# the top of their own ``backward`` (autograd turns it on only under ``create_graph=True``) and
# run their eager-formula ``double`` there: what ``_autograd.first_order`` does, without its
# wrapper's frame per backward. ``ownership.take`` in such a backward is called from autograd's
# plain chain (``ownership._chain_of``: "plain"), which has its own calibrated baseline.


def activation(
    x: torch.Tensor,
    act: str,
    inplace: bool = False,
    owned: bool = False,
    param: float = 0.0,
) -> torch.Tensor:
    """``act(x)`` that, after a slimgrad norm, lets the block keep only the norm output.

    If ``x`` is the pristine output of a registered source (slimgrad's BatchNorm in training) and
    the source agrees to keep ``x`` instead of its input, the result ``r`` is computed out of place,
    saves ``x`` (shared with the source) and is tagged so that a following slimgrad conv keeps ``x``
    instead of ``r``. With ``inplace=True`` that path needs ``owned`` (the caller's
    ``slimgrad.ownership.owns_input`` proved nobody else can see ``x``, so not writing over it is
    invisible); without it this is eager's in-place op. Otherwise this is exactly eager
    ``relu``/``relu_``/``gelu``/``silu``/``silu_``/``leaky_relu``/``leaky_relu_``/``elu``/
    ``elu_``. In-place LeakyReLU/ELU with a negative slope/alpha always take eager's op (which
    refuses them under autograd). See NOTE [Derived saved inputs].

    Args:
        x: input tensor.
        act: one of ``ACTIVATIONS``.
        inplace: as torch's ``inplace`` flag.
        owned: ``slimgrad.ownership.owns_input(x, module)`` of the calling module (needed for the
            derived path when ``inplace``).
        param: ``negative_slope`` for ``"leaky_relu"``, ``alpha`` for ``"elu"``; else unused.

    Returns:
        The activation output.

    Raises:
        ValueError: ``act`` is not one of ``ACTIVATIONS``.
    """
    if act not in ACTIVATIONS:
        raise _bad_act(act)
    spec = (act, float(param), bool(inplace)) if act in ("leaky_relu", "elu") else act
    try:
        derived = (
            (owned or not inplace)
            and not (inplace and type(spec) is tuple and spec[1] < 0)
            and x.requires_grad
            and torch.is_grad_enabled()
            and not _compiling()
            and not _transforms_active()  # NOTE [torch.func transforms]: eager's op
            # claim_source(x), inline: a pristine registered source output whose source keeps it
            and (k := id(x)) in _SOURCES_D
            and _SOURCES_D[k][0]() is x
            and x._version == _SOURCES_D[k][1][1]
            and _SOURCES_D[k][1][0].keep_output(x)
        )
    except FxTraceError:  # NOTE [fx symbolic tracing of a converted model]: eager's op below
        derived = False
    if derived:
        if _jit_tracing():
            refuse_jit("ops.activation")
        # NOTE [One pack per shared tensor]: the source's pack of x under saved-tensor hooks
        pack = _SOURCES_D[k][1][0].pack
        if pack is not None:  # shared only under the very hooks it was packed with
            pack = shared(pack)
        # the BatchNorm call's ctx (NOTE [Dropped at b's backward])
        src_ctx = _SOURCES_D[k][1][0].ctx
        # the C apply (NOTE [Applying a Function without its Python wrapper] in _autograd.py):
        # not compiling and no transform active, checked above
        if pack is None:
            r = _ACT_APPLY(unwrap_if_dead(x), spec, None)
        else:
            r = _packed_act(x, spec, pack)
        _CLOCK[0] += 1  # _tick()
        h = _top_hooks(False)  # region(), inline (NOTE [A lookup across a checkpoint boundary])
        d = Derived(
            base=x.detach(),
            base_version=x._version,
            act=spec,
            version=r._version,
            pack=pack,
            region=None if h is None or getattr(h[0], "__module__", None) != _CHECKPOINT else h[0],
        )
        # _put(_DERIVED_D, r, d), inline (NOTE [A registry entry dropped in C]): r is this
        # call's fresh output
        k = id(r)
        e = _DERIVED_D[k] if k in _DERIVED_D else None
        if e is not None and e[0]() is r:
            _DERIVED_D[k] = (e[0], d)
        else:
            _DERIVED_D[k] = (weakref.ref(r, _partial(_DERIVED_D.pop, k)), d)
        # NOTE [Dropped at b's backward]: the entry's key and weak reference, chained on b's call
        src_ctx.derived = (k, _DERIVED_D[k][0], src_ctx.derived)
        return r
    if act == "leaky_relu":
        return F.leaky_relu(x, param, inplace)
    if act == "elu":
        return F.elu(x, param, inplace)
    if inplace and act == "relu":
        return torch.relu_(x)
    if inplace and act == "silu":
        return F.silu(x, inplace=True)
    if inplace and act == "hardswish":
        return F.hardswish(x, inplace=True)
    return apply_act(act, x)
