"""Buffer ownership: when a backward may write its result into a buffer nobody else reads, and when
a forward may write over its input.

Once forward is done the backward graph is fixed, and reference counts tell which buffers are dead.
A backward that writes its result into such a buffer (its incoming gradient, or a saved tensor at
its last use) needs one fewer full-size transient. Done wrong, it corrupts gradients silently
(inplace-abn PR #218, Liger-Kernel's RMSNorm on Gemma-2). This module is the one place that decides;
see NOTE [Gradient-buffer ownership].

Public API (all cheap, no allocation):

- :func:`take` (incoming gradient) and :func:`take_saved` (a saved tensor at its last use): return
  the tensor when the caller may overwrite it, else None; each granted reuse bumps
  :func:`reuse_count`.
- :func:`reusable`: the same predicate, without counting.
- :func:`reuse_disabled`: context manager turning reuse off (also ``SLIMGRAD_NO_REUSE=1`` in the
  environment).
- :func:`mark_consumed` / :func:`check_not_consumed`: invalidate a Function's saved tensors after
  reuse, so a second backward raises a clear error instead of reading garbage.
- :func:`owns_input`: whether a module's forward may write over its input (InPlaceABN over a conv
  output, an in-place ReLU's derived path after a BatchNorm); grants count as
  ``reuse_count("forward")``.
- :func:`refused_writes` / :func:`keeps_no_tensor`: the forward writes refused because a hook
  or a mode could keep the input, by reason (``slimgrad.memory.measure`` reports a step's), and
  how a hook or mode states that it keeps no tensor (NOTE [Forward writes a watcher refuses]).

# NOTE [Gradient-buffer ownership]
A backward may overwrite a tensor ``g`` only if every one of these holds (checked on torch 2.13 /
CPython 3.11 over 15 cases; no single term suffices):

1. The TensorImpl's use count (``at::Tensor::use_count()``) is the calibrated one of a gradient
   nobody else holds: 1, the Python object (torch 2.13, 2.15), or 2 where autograd's call into
   Python keeps its own handle for the call (torch 2.11); a sibling still pending on the same
   gradient must show one more (checked in calibration). Catches a gradient that autograd hands
   to a sibling node still pending (the Gemma-2 pattern), a user ``gradient=G`` and the
   ``autograd.grad`` result of a non-leaf input (the engine keeps it as a captured gradient).
2. Nothing but ``g`` reaches its memory. (a) ``g`` not a view: the StorageImpl's use count
   (``c10::Storage::use_count()``) is a fresh tensor's, read without making a storage object
   (NOTE [Storage facts without a storage object]): no other tensor (a view, a ``cat`` slice, an
   expanded ``sum`` gradient) shares the memory, and nobody keeps ``g.untyped_storage()``; one
   use more passes only if it is the storage object PyTorch keeps alive with the storage and
   nobody else holds it (the refcount of a probe's kept-alive object, and no weak reference to it
   but slimgrad.memory's tracker finalizers); no C++ weak reference to the StorageImpl either
   (torch's ``StorageWeakRef``: its weak count). A weak reference can give the buffer back to a
   later hook. (b) ``g`` a
   view (``nn.Linear`` on 3-D input hands the next backward a reshape view of its 2-D mm result;
   LayerNorm, dropout etc. then pass it on): with term 4 (the view covers its whole storage
   densely from offset 0), all of:
   - its base ``b = g._base`` is a plain strided ``torch.Tensor`` on ``g``'s device, with no
     autograd state (not ``requires_grad``, no ``grad_fn``, no ``.grad``) and the same data
     pointer. (PyTorch roots every view at a non-view base, so views of views are covered.)
   - ``(sys.getrefcount(b), b._use_count())`` equals the calibrated pair of a base that only
     the view holds: use count 2 = the view's autograd metadata + ``b``'s Python object, refcount
     = our locals + the one reference PyTorch keeps on the Python object of a tensor C++ also
     holds. A Python holder of the base (a hook or node prehook that keeps it) raises the
     refcount; a C++ holder (another engine buffer, a SavedVariable under ``retain_graph``, a
     leaf's ``.grad``) raises the use count. Reading ``g._base`` may create ``b``'s Python object;
     PyTorch keeps it with ``b`` (freed with it; it adds no holder of the memory).
   - the storage signature equals a fresh tensor's with ONE more use (``b``'s TensorImpl): a
     second view of the same base (``chunk``/``split`` halves, two views handed to two pending
     backwards) adds a use, and nobody keeps the storage object. Every TensorImpl that can read
     the memory shares that StorageImpl, so these counts prove ``g`` is the only way in; once a
     sibling view is gone, the remaining one may be granted.
   - ``weakref.getweakrefcount`` is 0 for ``b`` and for ``g`` (checked for plain gradients too):
     a weak reference taken by a hook can be dereferenced by a later hook that then reads the
     buffer (measured: both corrupt without this term).
   Saved tensors that are views are refused (no calibrated signature). Conservative: refuses
   disjoint slices and partial views (``cat`` slices, offsets, expands) too. Term 2b was checked
   on 21 view cases (tests/test_ownership.py: 3-D ``F.linear``, hooks/prehooks/weakrefs/
   ``autograd.grad`` on the base, sibling views, partial/expanded/``as_strided`` views, a saved
   tensor's view with and without ``retain_graph``, checkpoint), each bitwise vs reuse off.
3. ``sys.getrefcount(g)`` equals the baseline measured for the chain that called the backward.
   Catches extra *Python* holders of the same object, which terms 1-2 miss: a tensor hook that
   keeps ``g``, an upstream Function that returns its own saved tensor as the gradient. The chain
   is a fact of the running node's class, decided once per class (``_chain_of``): the engine's
   running node (``torch._C._current_autograd_node()``, which for a Python Function is ``ctx``)
   names the Function, and its ``backward`` (or ``vjp``) is slimgrad's ``_autograd.first_order``
   wrapper, torch's ``once_differentiable`` wrapper (both recognised by their code objects) or a
   plain function called by autograd's ``BackwardCFunction.apply``; each chain has its own
   baseline, never chosen by the count itself; a node that runs through slimgrad's wrapper that
   turns autocast off has that chain's own (NOTE [The chain through autocast's wrapper]); any
   other chain (another decorator, a callable object, no Python node) has none: refused. A
   deeper call (a helper between the backward and ``take``) holds more references, so it
   refuses. No frame is read. The baselines are measured by probe Functions run through autograd
   on the first question in the process (never at import); if that fails, reuse is never
   granted. A view gradient has the same refcount and use count as a plain one (checked).
4. Non-overlapping and dense, offset 0, covering its whole storage, plain strided ``torch.Tensor``
   (no subclass, functorch wrapper, conj/neg bit; a view only under term 2b): an in-place kernel
   writes every byte exactly once.
5. Grad mode off (no ``create_graph=True``: a double backward may have saved ``g``) and ``not
   g.requires_grad`` (a saved non-leaf input may require grad; a leaf that does never qualifies).
6. Running inside the autograd engine (``torch._C._current_graph_task_id() != -1``), not being
   traced by torch.compile/functorch, and reuse not disabled (:func:`reuse_disabled`,
   ``SLIMGRAD_NO_REUSE=1``). For saved tensors (:func:`take_saved`) also: the graph is not kept
   (``retain_graph=True`` keeps saved tensors intact, so no reuse), and (refcount, use count) are
   those calibrated for a saved tensor nobody else holds, kept by autograd or by a
   ``saved_tensors_hooks`` pair that packs a detached alias: a hook that keeps the packed tensor
   elsewhere, or unpacks a tensor it also holds, adds a reference. (``slimgrad.memory`` installs
   no hooks, so measuring a step never changes what this rule grants.)
7. The memory is torch's own: the StorageImpl's DataPtr deleter is the raw deleter of the
   allocator torch uses for that device type (``from_numpy``, ``frombuffer``, ``from_dlpack``,
   ``torch.load`` mmap, pinned and shared-memory storages differ, and another owner, e.g. a NumPy
   array kept by a Function or another process, can read them). Terms 1-3 count torch and Python
   holders only; this term covers the rest.

The storage facts of terms 1, 2, 4 and 7 come from slimgrad's C++ extension (NOTE [Storage facts
from the C++ API] in slimgrad/_ext), built on the first question and cached; without it (no
compiler, a failed build) reuse is never granted and ``slimgrad env`` says why.

Distributed (DDP, FSDP2, tensor parallel; tests/distributed/test_ddp_bucketing.py,
test_fsdp2.py, test_tensor_parallel.py, each on 2 gloo processes). Nothing here is shared between
processes: calibration, the chain cache and :func:`reuse_count` are per process (per rank);
:func:`reuse_disabled` is process-wide on purpose (CUDA backward runs on autograd's device threads).
The buffers a data-parallel wrapper reads are never granted:

- DDP buckets hold *parameter* gradients (``param.grad``: a view of the bucket under
  ``gradient_as_bucket_view=True``, else copied in by DDP's post-accumulate hook), never an incoming
  activation gradient. A tensor autograd hands both to a parameter's AccumulateGrad and to a
  slimgrad backward (``h + pos`` with ``pos`` a parameter of ``h``'s shape) is copied or added by
  AccumulateGrad, which runs first; were it stolen into ``.grad``, that reference would fail term 1.
  ``no_sync`` accumulation adds into ``.grad``: the same.
- An FSDP2 all-gathered (unsharded) parameter is an ``nn.Parameter`` (a subclass: term 4), a leaf
  that requires grad (term 5), and shares its storage with FSDP's all-gather output (term 2): each
  term alone refuses it as a saved tensor (on torch 2.13 all three fail; a write over it
  would change the gradients FSDP reduce-scatters, tests/distributed/test_fsdp2.py). It never
  arrives as an incoming gradient. Its reduce-scatter input is FSDP's
  own copy of ``unsharded_param.grad``, made after accumulation; no autograd gradient aliases it.
  FSDP's ``RegisterPostBackwardFunction`` passes gradients on without keeping them, so a gradient
  it hands on keeps the calibrated counts and may be granted (bit-identical to reuse off, tested).
- DTensors (tensor parallel) are subclasses: refused by term 4; ops see DTensors only through
  ``slimgrad._dtensor`` (NOTE [DTensor at a slimgrad op]), which hands them local shards.
- On CUDA, NCCL reads bucket and reduce-scatter buffers on its own streams; since those buffers
  are never granted, no write here races with a collective.

Calibration (on the first question, :func:`_calibrate`): a y = 2x Function's backward probes its
gradient in chains whose safety is known: plain, through a ``* 1`` (same figures), with a hook
that keeps the gradient (refcount exactly one higher), with the gradient also on the backward's
own evaluation stack (exactly one higher: NOTE [Reference counts and the interpreter]; only on an
interpreter in ``_REFCOUNT_SHOWN``), beside a sibling still pending on it (use count exactly one
higher), and, for term 2b, after ``.view(1, 5)`` (a whole-storage view of a fresh base: gives the
base pair) and the same with a hook keeping that base (base refcount exactly one higher). Any
mismatch or exception: no baseline, never reuse (views alone: ``_VIEW_SIG`` None refuses every
view). The baselines are kept per interpreter call mode, which a failed Dynamo trace changes for
the rest of the process (NOTE [Calibration per call mode] at the end of this module).

Calling pattern (the refcount baseline depends on it; any deviation adds references, so it fails
safe, refusing reuse, never the other way):

    class _MyFn(torch.autograd.Function):
        @staticmethod
        def backward(ctx, grad_out):          # @once_differentiable allowed; no *args repacking
            buf = ownership.take(grad_out)    # FIRST use of grad_out, called directly from backward
            ...                               # buf is grad_out (overwrite it) or None (allocate)

- Call it directly in the Function's ``backward`` staticmethod (plain, ``@once_differentiable`` or
  ``@first_order``), on the bare parameter, before any other use: no ``g = grad_out``, no
  list/tuple/ctx attribute holding it, not from a helper the backward calls (a helper holds one
  more reference: refused), not from a hook (no chain of its own; the engine's handle shows).
- Several gradients (``backward(ctx, g1, g2)``) are fine: call ``take`` on each parameter.
- Saved tensors: ``a, b = ctx.saved_tensors`` then ``buf = ownership.take_saved(ctx, a)`` with ``a``
  held only by that one local (do not keep the ``saved_tensors`` tuple in a variable); then
  ``mark_consumed`` is done by ``take_saved`` and the Function's backward must start with
  ``ownership.check_not_consumed(ctx, api)``.
- Never inside a ``custom_op`` kernel (the dispatcher adds references; compile forbids unannounced
  mutation): take the buffer in the Function's eager backward and pass it down as an explicit
  ``out``.
- Write with ordinary in-place ops under the backward's no-grad mode: they bump the version counter,
  so any holder this predicate could not see still gets autograd's "modified by an inplace
  operation" error.

Forward (:func:`owns_input`). A forward in-place write over a module's input ``x`` (InPlaceABN
writing BN+act over the conv output; ``ReLUAfterNorm(inplace=True)`` returning a new tensor instead
of writing over the BN output, which is the same question: may we treat ``x`` as dead?) is decided
from the structure ``convert_`` states (:func:`state_inputs_`: in the parent's forward, every call
of the module takes a fresh value nothing else reads) and cheap public facts at the call (the
stated parent is running, hooks, modes, ``x``'s own holders): NOTE [Forward ownership from stated
structure] below. No frame, bytecode or reference count is read, and nothing is calibrated.
Otherwise the module takes its out-of-place path (InPlaceABN: a new output, the input unchanged;
ReLU: eager's ``relu_``). The functional ops (``slimgrad.ops.inplace_abn``) write over their
argument as documented; the modules decide.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import threading
import types
import weakref
from collections.abc import Iterator

import torch
from torch.autograd.function import once_differentiable

from slimgrad import _ext
from slimgrad._autograd import AUTOCAST_OFF_RUN as _AC_RUN
from slimgrad._autograd import _AutocastFreeBackward, first_order
from slimgrad._autograd import compiling as _compiling

__all__ = [
    "calibrated",
    "check_not_consumed",
    "grant",
    "keeps_no_tensor",
    "mark_consumed",
    "owns_input",
    "refused_writes",
    "register_registry",
    "reusable",
    "reuse_count",
    "reuse_disabled",
    "reuse_enabled",
    "reset_reuse_count",
    "state_inputs_",
    "take",
    "take_saved",
]

ENV_VAR = "SLIMGRAD_NO_REUSE"

# Process-wide, not thread-local: on CUDA the autograd engine runs backward functions on its own
# device threads, which would not see a thread-local flag set around ``loss.backward()``.
_disabled_depth = 0
_counter = {"grad": 0, "saved": 0, "forward": 0}
_counter_lock = threading.Lock()

# Calibrated on the first question (see _calibrate). None: calibration failed; never reuse.
# Keyed by the chain that called the Function's backward (_chain_of: "plain" for autograd's
# BackwardCFunction.apply, "once" for torch's once_differentiable wrapper, "first_order" for
# slimgrad's _autograd.first_order wrapper). Any other chain (another wrapper) has no baseline:
# never reuse. Value: (refcount, tensor use count) of an incoming gradient nobody else holds (terms
# 3 and 1).
_GRAD_REFCOUNT: dict | None = None
# (refcount, tensor use count) of a saved tensor nobody else holds: as autograd keeps it, and as a
# saved_tensors_hooks pair that packs a detached alias keeps it.
_SAVED_SIGS: dict | None = None  # caller code -> {(refcount, use count)}
# Read from probes once the C++ extension is loaded (_load_facts; NOTE [Storage facts without a
# storage object]), process-wide: (the storage use count of a tensor nobody else shares, the
# refcount of a storage object that only PyTorch keeps alive as _obj_refcount sees it, the storage
# weak count of a storage without weak references). None: not loaded yet, or unavailable.
_STORAGE_SIG: tuple[int, int | None, int] | None = None
# For a gradient that is a view (term 2b): _view_sig(g) of a whole-storage view whose base nobody
# else holds: (base refcount, base use count) as _view_sig sees them. Its storage has one use more
# than a fresh one (the base's TensorImpl): _storage_free(g, 1).
_VIEW_SIG: tuple[int, int] | None = None
# The same pair as the extension's view_base reads it, process-wide, once measured (NOTE [View
# gradients asked in C++]): [pair], or [None] where its calibration failed (then _view_sig asks).
_VIEW_EXT: list = []


# NOTE [Reference counts and the interpreter]
# Terms 3 and 6 (and the storage-object check of _storage_free) compare Python reference counts
# with baselines taken on the running interpreter. That is sound only where every holder of an
# object adds one to its count. Heap holders (containers, attributes, closure cells, frame locals)
# always own a reference, but CPython 3.14 lets the evaluation stack borrow a local's reference
# (LOAD_FAST_BORROW): a second use of a gradient on the backward's own stack
# (``f(grad_out, ownership.take(grad_out))``) would no longer show; and a free-threaded build keeps
# per-thread counts. So reference counts are read only on a GIL-enabled CPython whose minor version
# was shown to hold (``_REFCOUNT_SHOWN``: tests/test_ownership_refcount.py, run with each Python of
# the matrix), and the calibration measures the property on the running interpreter too (a holder
# on the backward's stack must add exactly one). Elsewhere no backward buffer is reused and no
# forward write relies on a storage object's count (the same bits, a few more bytes), and
# ``slimgrad env`` and ``report`` say why.
_REFCOUNT_SHOWN = ((3, 11), (3, 12), (3, 13))


def refcount_problem() -> str | None:
    """Why Python reference counts cannot decide ownership on this interpreter, or None
    (NOTE [Reference counts and the interpreter])."""
    import sysconfig

    impl = sys.implementation.name
    if impl != "cpython":
        return f"{impl} is not CPython (reference counts are not CPython's)"
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        return "a free-threaded CPython build (its reference counts are per thread)"
    v = sys.version_info[:2]
    if v not in _REFCOUNT_SHOWN:
        shown = ", ".join(f"{a}.{b}" for a, b in _REFCOUNT_SHOWN)
        return (
            f"Python {v[0]}.{v[1]}: reference-count facts were shown to hold on {shown} only "
            "(CPython 3.14 borrows references on the evaluation stack)"
        )
    return None


_REFCOUNTS_OK: bool | None = None


def refcounts_ok() -> bool:
    """Whether Python reference counts may decide ownership here (:func:`refcount_problem` is
    None), read once per process: for callers outside this module that compare a count."""
    global _REFCOUNTS_OK
    if _REFCOUNTS_OK is None:
        _REFCOUNTS_OK = refcount_problem() is None
    return _REFCOUNTS_OK


# os.environ's own dict (bytes keys on POSIX): one dict lookup per question instead of the
# Mapping methods of os.environ; it is what os.environ reads and writes (monkeypatch.setenv too)
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(ENV_VAR) if hasattr(os.environ, "encodekey") else None
if not isinstance(_ENV_DATA, dict) or _ENV_KEY is None:  # another os.environ: read it each time
    _ENV_DATA = None


def _env_disabled() -> bool:
    if _ENV_DATA is not None and _ENV_KEY not in _ENV_DATA:
        return False
    return os.environ.get(ENV_VAR, "").strip().lower() not in ("", "0", "false", "no", "off")


def _disabled() -> bool:
    return _disabled_depth > 0 or _env_disabled()


@contextlib.contextmanager
def reuse_disabled() -> Iterator[None]:
    """Turn gradient-buffer reuse off, process-wide (debugging; results are identical either way).

    Process-wide because autograd runs CUDA backward functions on its own threads; nests.

    Example:
        >>> with slimgrad.ownership.reuse_disabled():
        ...     loss.backward()
    """
    global _disabled_depth
    with _counter_lock:
        _disabled_depth += 1
        for m in _NODE:
            m.set_reuse_off(_disabled_depth)
    try:
        yield
    finally:
        with _counter_lock:
            _disabled_depth -= 1
            for m in _NODE:
                m.set_reuse_off(_disabled_depth)


def reuse_enabled() -> bool:
    """False inside :func:`reuse_disabled` or with ``SLIMGRAD_NO_REUSE=1``."""
    return not _disabled()


def reuse_count(kind: str | None = None) -> int:
    """Reuses granted in this process since the last reset (``kind``: "grad", "saved", None for
    both of those backward kinds, or "forward" for :func:`owns_input` grants). Per process: under
    DDP/FSDP each rank counts its own."""
    if kind is None:
        return _counter["grad"] + _node_grants() + _counter["saved"]
    if kind == "grad":
        return _counter["grad"] + _node_grants()
    if kind not in _counter:
        raise ValueError(
            "slimgrad.ownership.reuse_count: unknown kind; expected 'grad', 'saved', 'forward' or "
            f"None, got {kind!r}. Pass one of those."
        )
    return _counter[kind]


def reset_reuse_count() -> None:
    """Reset the debug counter read by :func:`reuse_count`."""
    with _counter_lock:
        for k in _counter:
            _counter[k] = 0
        for m in _NODE:
            m.node_grants(True)


# The C++ RMSNorm node's ownership answers (NOTE [dy's ownership asked by the C++ node] in
# slimgrad/_ext/norm_node.cpp): its grants count in reuse_count("grad"), reuse_disabled's depth
# reaches it. [the extension module] once loaded.
_NODE: list = []


def _node_grants() -> int:
    return _NODE[0].node_grants() if _NODE else 0


def _use_node(mod) -> None:
    if hasattr(mod, "node_grants"):
        mod.set_reuse_off(_disabled_depth)
        _NODE.append(mod)


_ext.when_loaded(_use_node)


def calibrated() -> bool:
    """Whether the refcount baselines of the backward terms are measured for the current call mode
    (measuring them on the first question, never at import; if that fails, reuse is never
    granted)."""
    return _ensure_calibrated() and _GRAD_REFCOUNT is not None and _SAVED_SIGS is not None


# NOTE [Storage facts without a storage object]
# ``t.untyped_storage()`` creates the storage's Python object, and PyTorch keeps that object alive
# with the storage from then on (it is "preserved", so the same object comes back next time), and
# with it one more reference to the StorageImpl, for as long as the tensor lives (the storage's use
# count is 1 for a fresh tensor, 2 after one ``untyped_storage()`` call whose result was dropped).
# The autograd engine sums two gradients of one tensor in place only if it holds the last reference
# to the buffer's TensorImpl and to its storage (``InputBuffer``'s ``can_accumulate_inplace``), so
# every gradient these checks had looked at was summed out of place later: a fresh full-size buffer
# and a write that eager does not make (regnety_016, 8x3x224x224: 50 of its 77 adds a step;
# efficientnet_b0: 16; the accumulation into a squeeze-excite input and into a residual block's
# input, where the gradient passed through a granted backward). So no check here creates a storage
# object. The facts come from slimgrad's small C++ extension (NOTE [Storage facts from the C++ API]
# in slimgrad/_ext), each read through a public accessor of PyTorch's C++ API: the tensor's and the
# storage's use counts, the storage's weak count (a C++ weak reference, torch's ``StorageWeakRef``,
# can give the storage back later), whether a storage object exists (so :func:`_storage_free`
# refuses a storage shared with another tensor without making one), its size in bytes (term 4) and
# whether its DataPtr's deleter is the device allocator's own (term 7). The extension is built on
# the first question (never at import) and cached; without it (no compiler, a failed build) no
# storage question is answered yes, so reuse is never granted (``slimgrad env`` says why). The
# counts of a storage nobody else holds are read once, from two probe tensors made at import (a
# fresh one, and one whose storage object PyTorch keeps alive), so asking later allocates nothing,
# even inside a measured region (slimgrad.memory sees every allocation).

_PROBE_FRESH = torch.empty(1)
_PROBE_KEPT = torch.empty(1)
_PROBE_KEPT.untyped_storage()  # dropped: PyTorch keeps the object alive with the storage
_FACTS = None  # the extension's facts function, once loaded
_PLAIN_FACTS = None  # and its plain_facts
_BACKWARD_FACTS = None  # and its backward_facts, where the probes' counts were read (_STORAGE_SIG)
_VIEW_BASE = None  # and its view_base, likewise (NOTE [View gradients asked in C++])


def _load_facts() -> bool:
    # Load the extension (building it on first use) and read the probes' counts. Once per process;
    # process-wide (the refcount of a kept-alive storage object is read with C calls only, which
    # the call mode of NOTE [Calibration per call mode] does not change).
    global _FACTS, _PLAIN_FACTS, _BACKWARD_FACTS, _STORAGE_SIG, _VIEW_BASE
    if _FACTS is not None:
        return _STORAGE_SIG is not None
    mod = _ext.load()  # its own lock; after a failure, returns None at once
    if mod is None:
        return False
    with _calib_lock:
        if _FACTS is None:
            try:
                fresh, kept = mod.facts(_PROBE_FRESH), mod.facts(_PROBE_KEPT)
                obj, sensitive = None, True  # None: a storage object's count decides nothing
                if refcount_problem() is None:  # NOTE [Reference counts and the interpreter]
                    obj = _obj_refcount(_PROBE_KEPT)
                    keep = _PROBE_KEPT.untyped_storage()
                    sensitive = _obj_refcount(_PROBE_KEPT) == obj + 1  # a kept object must show
                    del keep
                ok = (
                    fresh[0] == 1  # our probe's Python object is its only C++ handle
                    and fresh[1] == 1
                    and fresh[3] == 0
                    and kept[1] == fresh[1] + 1  # the kept-alive storage object holds one use
                    and kept[3] == 1
                    and kept[2] == fresh[2]
                    and fresh[5] == kept[5] == 1
                    and sensitive
                )
                _STORAGE_SIG = (fresh[1], obj, fresh[2]) if ok else None
            except Exception:  # any surprise: never reuse
                _STORAGE_SIG = None
            _PLAIN_FACTS = mod.plain_facts
            _BACKWARD_FACTS = getattr(mod, "backward_facts", None) if _STORAGE_SIG else None
            _VIEW_BASE = getattr(mod, "view_base", None) if _STORAGE_SIG else None
            _FACTS = mod.facts
    return _STORAGE_SIG is not None


def _facts(t: torch.Tensor):
    # the extension's facts of t (NOTE [Storage facts from the C++ API]), or None when they are
    # unavailable (no extension, a probe mismatch) or t has no storage
    if _FACTS is None and not _load_facts():
        return None
    if _STORAGE_SIG is None:
        return None
    return _FACTS(t)


def storage_facts_available() -> bool:
    """Whether the storage facts reuse needs are available (loads or builds the C++ extension)."""
    return _load_facts()


def _only_tracker_weakrefs(st) -> bool:
    # Python weak references to the storage object: only slimgrad.memory's tracker finalizers
    # (one per storage it follows; it never reads the storage through them). Any other (a hook's
    # weakref.ref/proxy/finalize, a WeakValueDictionary) can give the buffer back later: refused.
    refs = weakref.getweakrefs(st)
    if not refs:
        return True
    mem = sys.modules.get("slimgrad.memory")
    free = getattr(getattr(mem, "_Tracker", None), "_free", None)
    registry = getattr(weakref.finalize, "_registry", {})
    for r in refs:
        fin = r.__callback__
        info = registry.get(fin) if isinstance(fin, weakref.finalize) else None
        if free is None or info is None or getattr(info.func, "__func__", None) is not free:
            return False
    return True


def _storage_nbytes(t: torch.Tensor) -> int | None:
    f = _facts(t)
    return None if f is None else f[4]


def _obj_refcount(t: torch.Tensor) -> int:
    # the refcount of t's storage object as seen here (it exists already when this is asked)
    st = t.untyped_storage()
    return sys.getrefcount(st)


def _storage_free(t: torch.Tensor, others: int = 0, f=None) -> bool:
    # No holder of t's StorageImpl but t and ``others`` known TensorImpls (a view's base), and
    # nobody keeps its storage object, and no C++ weak reference to it. One holder more may be
    # the storage object PyTorch keeps alive with the storage once one was made (by
    # slimgrad.memory's tracker, or an ``untyped_storage()`` call whose result was dropped): asking
    # for it then returns that object and creates none, and it passes if only PyTorch holds it
    # (the probe's refcount), nobody holds a weak reference to it but the tracker, and asking made
    # no new one (the use count did not move). Otherwise refused.
    if f is None:
        f = _facts(t)
    if f is None:
        return False
    use, obj, weak = _STORAGE_SIG
    n = f[1]
    if f[2] != weak:
        return False
    if n == use + others:
        return True
    if n != use + others + 1 or not f[3] or obj is None:
        # another tensor shares the storage (refused, no storage object made), or the storage
        # object's count cannot be read here (NOTE [Reference counts and the interpreter])
        return False
    return (
        _obj_refcount(t) == obj
        and _FACTS(t)[1] == n
        and _only_tracker_weakrefs(t.untyped_storage())
    )


def _storage_alone(t: torch.Tensor) -> bool:
    # no other tensor shares the StorageImpl, and nobody keeps its Python storage object
    return _storage_free(t)


def _torch_owned(t: torch.Tensor, f=None) -> bool:
    # Term 7: memory torch allocated itself. from_numpy/frombuffer/from_dlpack (and torch.load's
    # mmap-able storages) wrap memory another owner can read; shared memory (share_memory_,
    # DataLoader workers) may be read by another process; pinned host memory has its own
    # allocator. The storage's DataPtr deleter must be the raw deleter of the allocator torch uses
    # for that device type (each of those differs). Not covered: CUDA memory this process exported
    # through CUDA IPC (torch.multiprocessing) and still writes to; autograd's gradients are fresh
    # allocations of this process.
    if f is None:
        f = _facts(t)
    return f is not None and f[5] == 1


def _view_sig(t: torch.Tensor, f):
    # (refcount, use count) of t's base, or None if the base is not a plain strided tensor
    # without autograd state sharing t's memory (f: t's plain facts; None in the
    # calibration, which runs before the extension is loaded and whose views are known to share
    # their base's storage). Reads ``t._base`` (which may create the base's Python object;
    # PyTorch preserves it with the base, no reference is added).
    base = t._base
    fake = type(base) is not torch.Tensor  # then only a FakeTensor: f from _fake_plain_facts
    if (
        type(base) is not type(t)  # torch.Tensor (NOTE [Ownership under fake tensors])
        or (fake and not _is_fake(base))  # no other subclass gets the fake hold's discount
        or base._is_view()
        or base.requires_grad
        or base.grad is not None
        or base.grad_fn is not None
        or base.layout != torch.strided
        or base.is_nested
        or base.device != t.device
        or (_fake_weakcount(base) if fake else weakref.getweakrefcount(base)) != 0
        or torch._C._functorch.is_functorch_wrapped_tensor(base)
    ):
        return None
    if f is None:
        use = base._use_count()
    else:
        fb = _FACTS(base)
        if fb is None or fb[6] != f[5]:  # not the same StorageImpl (f: t's plain facts)
            return None
        use = fb[0]
        if fake:  # the fake machinery's own hold on a view's base (NOTE [Ownership under ...])
            extra = _fake_view_uses()
            if extra is None:
                return None
            use -= extra
    sig = (sys.getrefcount(base), use)
    del base
    return sig


# NOTE [View gradients asked in C++]
# Term 2b's questions about a view gradient's base (_view_sig: ``t._base``, then about ten
# attributes of it, each a Python call) were most of what :func:`grant` cost on a view gradient,
# and HF GPT-2's LayerNorm backward meets one each call (its consumer reshapes a 2-D gradient).
# The extension's ``view_base`` asks the same questions in one call (each through the C++
# accessor the Python attribute calls; the base's Python object made first, as ``t._base`` makes
# it) and returns the base's (refcount, use count) as it reads them: its refcount counts its own
# one reference where _view_sig's counts its local and getrefcount's argument, so the pair it
# must match is measured with _VIEW_SIG's two view probes (a plain base, and one a hook keeps,
# which must show exactly one more), in each chain, once per process (:func:`_view_base_sig`, at
# the first view question that gets this far: no Python frame holds the base, so the pair does
# not depend on the call mode of NOTE [Calibration per call mode]; where the calibration would
# be disturbed, that question asks _view_sig and the next one measures). grant asks view_base
# only for a gradient the extension's backward_facts answered (exactly ``torch.Tensor``) and only
# where _VIEW_SIG is calibrated too; a FakeTensor under the estimate (NOTE [Ownership under fake
# tensors]), a failed measurement and a process without the extension ask _view_sig. Both give
# the same answers on every view case of tests/test_ownership.py (run both ways).
def _view_probe(t):
    # the view signature the calibration records: _view_sig's, or view_base's while
    # _view_base_sig measures
    if _CALIB_EXT[0]:
        return _VIEW_BASE(t)
    return _view_sig(t, None)


_CALIB_EXT = [False]


def _view_base_sig() -> tuple[int, int] | None:
    # view_base's pair, taken at the first call that can (NOTE [View gradients asked in C++])
    if _VIEW_EXT:
        return _VIEW_EXT[0]
    if _VIEW_BASE is None or not _calibration_undisturbed():
        return None  # this question goes to _view_sig
    with _calib_lock:
        if not _VIEW_EXT:
            try:
                with _probing():
                    sig = _calibrate_view_base(torch.arange(1.0, 6.0, requires_grad=True))
            except Exception:  # any surprise: the view questions stay in Python
                sig = None
            _VIEW_EXT.append(sig)
    return _VIEW_EXT[0]


def _dense_whole(t: torch.Tensor, f=None) -> bool:
    if t.storage_offset() != 0:
        return False
    if f is None:
        f = _facts(t)
    if f is None or f[4] != t.numel() * t.element_size():
        return False
    if t.is_contiguous():  # row-major strides: dense, non-overlapping (the loop below agrees)
        return True
    expected = 1
    for size, stride in sorted(
        ((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda p: p[1]
    ):
        if stride != expected:
            return False
        expected *= size
    return True


# The chain that called a Function's backward, decided once per node class (the Function's
# ``_backward_cls``) from what the class states: slimgrad's ``first_order`` wrapper marks itself,
# torch's ``once_differentiable`` wrapper is recognised by its code object, a plain function is the
# Function's own ``backward`` (or ``vjp``). Anything else (another decorator, a callable object)
# has no baseline: refused. The node comes from ``torch._C._current_autograd_node()`` (the engine's
# running node; for a Python Function it is ``ctx`` itself), so no frame is read.
_ONCE_CODE = once_differentiable(lambda ctx, g: g).__code__
_FIRST_ORDER_CODE = first_order("ownership")(lambda ctx, g: g).__code__
_CHAINS: dict = {}
_current_node = torch._C._current_autograd_node


def _chain_of(node_cls: type) -> str | None:
    fwd = getattr(node_cls, "_forward_cls", None)
    if fwd is None:
        return None
    fn = fwd.vjp if fwd.vjp is not torch.autograd.Function.vjp else fwd.backward
    if fn is not fwd.vjp:  # the Function's own backward, whatever autocast answers now
        raw = inspect.getattr_static(fwd, "backward", None)
        if isinstance(raw, _AutocastFreeBackward):
            fn = raw.fn
    code = getattr(fn, "__code__", None)
    if code is _FIRST_ORDER_CODE:
        return "first_order"
    if code is _ONCE_CODE:
        return "once"
    if type(fn) is types.FunctionType and not hasattr(fn, "__wrapped__"):
        return "plain"
    return None


# NOTE [The chain through autocast's wrapper]
# A backward that the engine calls inside autocast runs through _autograd's wrapper, which turns
# autocast off around it (NOTE [Backward without autocast] in _autograd.py): one more frame, which
# holds one more reference to each incoming gradient. That is a chain of its own: the running node
# is the one the wrapper states it runs (``_autograd.AUTOCAST_OFF_RUN.node``, set by the wrapper on
# the thread that runs it), and its baselines are measured by calibration's probes run through the
# same wrapper inside autocast, as every chain's are. Without it every grant there was refused
# (safe: eager's allocation), so a backward inside autocast kept more than one outside it.
# Calibration keeps the wrapper's chains only where their gradient count is exactly one above the
# direct chain's and their saved-tensor signatures are the direct chain's (the wrapper holds the
# gradients it passes on, never a saved tensor): then a count the direct chain grants is never met
# under the wrapper, and ``grant`` reads which node the wrapper runs only after the direct
# chain's count refused (no cost outside autocast), and ``take_saved`` never needs to.
_AC_KIND = {None: None, "plain": "plain@ac", "once": "once@ac", "first_order": "first_order@ac"}
_AC_KINDS = frozenset(_AC_KIND.values())


def _caller() -> str | None:
    # the chain of the running node (for calibration's probes; take/take_saved inline it)
    node = _current_node()
    if node is None:
        return None
    cls = type(node)
    try:
        kind = _CHAINS[cls]
    except KeyError:
        kind = _CHAINS[cls] = _chain_of(cls)
    return _AC_KIND[kind] if node is _AC_RUN.node else kind


_grad_on = torch._C.is_grad_enabled
_functorch_on = torch._C._are_functorch_transforms_active
_graph_task_id = torch._C._current_graph_task_id
_keep_graph = torch._C._autograd._get_current_graph_task_keep_graph
_getrefcount = sys.getrefcount
_weakcount = weakref.getweakrefcount


def _plain_facts(t, kind: int):
    # the extension's facts of a plain dense whole-storage tensor (terms 4, 5 and the tensor part
    # of 2 and 7 in one call), None otherwise or without the extension
    if _FACTS is None and not _load_facts():
        return None
    if _STORAGE_SIG is None:
        return None
    f = _PLAIN_FACTS(t, kind)
    if f is None and type(t) is not torch.Tensor:  # NOTE [Ownership under fake tensors]
        return _fake_plain_facts(t, kind)
    return f


# NOTE [Ownership under fake tensors]
# slimgrad.memory.estimate runs the step on fake tensors, so :func:`take` and :func:`take_saved`
# decide there as in the real step, or the estimate would model none of the buffer reuse the real
# step gets (a lean GELU MLP estimated 1.12x its real CPU step with the GELU's C kernel modelled;
# planned blocks measured 18.6% below their estimate). A FakeTensor carries a TensorImpl and a
# StorageImpl like a real tensor's, and autograd holds and hands them on the same way: the same
# Python references, tensor and storage use counts and weak counts. So every term is read as
# for a real tensor, from the same extension facts, except the one a FakeTensor cannot pass by
# its type: term 4's "exactly torch.Tensor" (a view's base: a FakeTensor too). Checked on a lean
# 4-block GELU/dropout MLP, a 2-layer GPT-2 and a 2-layer Llama (64 wide): the estimate asks the
# same questions in the same order as the real step under slimgrad.memory.measure and gets the
# same answers (12 of 12, 8 of 14, 5 of 7 granted). Only while every active mode is a
# FakeTensorMode or slimgrad.memory's tracker (the estimate's own machinery, as for
# :func:`owns_input`); nothing is written to real memory there. Not where the fake CPU tensors
# stand for CUDA ones (``estimate(device="cuda")``): there the ops' call-time choices (the smooth
# activations' Triton kernels write no incoming gradient) are not the CPU ones the fake step makes,
# so no reuse is modelled, as before (an estimate above the step, never below it).
#
# Two holds the fake machinery adds are not counted, since the real step has neither and nothing
# real can be read through them:
# - the fake mode's converter memo (``tensor_memo``, a WeakValueDictionary) keeps a weak
#   reference to each fake output its dispatch computed, but not to one its dispatch cache
#   replayed: so the first estimate in a process (cache misses) refused gradients that later
#   estimates (cache hits) granted (a small ResNet's first estimate granted 3 of 4 where the
#   second granted 4). :func:`_fake_weakcount` leaves out exactly the memo's KeyedRef to ``t``;
# - a fake view holds its base twice where a real view holds it once (measured once outside the
#   running modes by :func:`_fake_view_uses`, one view and two, which must add one and two such
#   uses; anything else refuses fake views): term 2b reads the base's use count less that.
# So eager's 3-D ``F.linear`` dx (a whole-storage view of a fresh base: term 2b) is granted in the
# estimate where the real step grants it (tests/test_estimate_views.py); before, the estimate
# of a converted Linear running eager's op found 0 of the real step's grants.
def _fake_weakcount(t) -> int:
    # weak references to a FakeTensor but the one its fake mode's converter memo keeps
    n = _weakcount(t)
    if n:
        conv = getattr(getattr(t, "fake_mode", None), "fake_tensor_converter", None)
        memo = getattr(getattr(conv, "meta_converter", None), "tensor_memo", None)
        data = getattr(memo, "data", None)  # WeakValueDictionary: key -> KeyedRef
        if type(data) is dict:
            for r in weakref.getweakrefs(t):
                if type(r) is weakref.KeyedRef and data.get(r.key) is r:
                    n -= 1
    return n


_FAKE_VIEW_USES: list = []  # [the uses a view adds to its fake base beyond a real one's, or None]


def _fake_view_uses() -> int | None:
    # measured once, outside the running modes, on a base with one view and with two
    if not _FAKE_VIEW_USES:
        extra = None
        try:
            from torch._subclasses.fake_tensor import FakeTensorMode

            with _modes_aside(), torch.no_grad():
                real = torch.empty(4)
                u0 = real._use_count()
                rv = real.view(2, 2)
                one = real._use_count() - u0
                with FakeTensorMode():
                    b = torch.empty(4)
                    v0 = b._use_count()
                    bv = b.view(2, 2)
                    fake = b._use_count() - v0
                    bw = b.view(4)
                    fake2 = b._use_count() - v0
                del rv, bv, bw
            if one == 1 and fake >= one and fake2 == 2 * fake:
                extra = fake - one
        except Exception:  # any surprise: fake views are refused (an estimate above the step)
            extra = None
        _FAKE_VIEW_USES.append(extra)
    return _FAKE_VIEW_USES[0]


def _is_fake(t) -> bool:
    try:  # private; without it no tensor is taken for a FakeTensor (their views are refused)
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:  # pragma: no cover - depends on the torch release
        return False
    return isinstance(t, FakeTensor)


def _fake_plain_facts(t, kind: int):
    # the tuple of the extension's plain_facts for a FakeTensor under the estimate, else None
    if not _estimate_modes_only(t):
        return None
    from slimgrad.convert_handlers.device_rule import tensor_device

    if tensor_device(t.device) != "cpu":
        return None
    if t.layout != torch.strided or t.is_nested or t.is_conj() or t.is_neg():
        return None
    if t.numel() == 0 or t.storage_offset() != 0:
        return None
    view, rg = t._is_view(), t.requires_grad
    if (kind == 0 and rg) or (kind != 0 and view) or (kind != 0 and rg and t.is_leaf):
        return None
    f = _FACTS(t)  # (use, storage use, weak, has object, nbytes, torch-owned, StorageImpl)
    if f is None or not _dense_whole(t, f):
        return None
    return (f[0], f[1], f[2], f[3], f[5], f[6], int(view))


# NOTE [One call per backward question]
# take/take_saved are asked once per backward of every converted op, so the questions are ordered
# by cost, each refusing as early as it can, and the answers are the ones the terms of NOTE
# [Gradient-buffer ownership] give in any order (each term only refuses):
# - take reads the refcount (term 3) and calls grant/_saved_ok with the call-mode probe as an
#   argument: the probe's refcount there is what _call_mode() measures (one plain Python call
#   deep, from a frame that holds nothing else: NOTE [Calibration per call mode]), so one
#   getrefcount reads the mode, and only a changed mode calls _ensure_calibrated, with that count
#   (asked there, _call_mode() would also see the reference grant's own argument holds);
# - a refcount that is no chain's baseline refuses before the running node is read (_GRAD_RCS:
#   the calibrated refcounts of the current mode; a gradient a residual add hands to two
#   consumers shows one reference more);
# - one call of the extension's backward_facts reads grad mode, the graph task, functorch, the
#   Python weak references of a gradient and the graph's keep flag of a saved tensor, then the
#   plain facts (terms 4, 5, 6 and the tensor parts of 1, 2 and 7), where six calls asked them.
#   Where it refuses a tensor that is not exactly ``torch.Tensor`` (a FakeTensor under the
#   estimate: NOTE [Ownership under fake tensors]), the terms are asked one by one as before;
# - grant is take's question in one frame, for a hot backward that asks compiling() itself (it
#   needs the answer anyway): called directly from the backward with ``PROBE``, it reads the
#   gradient's count and the probe's in its own frame, one plain call deep from the backward as
#   take reads them (the same counts, the same baselines), without take's frame and its compile
#   check. take and reusable call it with the count they read.
_GRAD_RCS: frozenset = frozenset()  # the refcounts of _RCS_OF (NOTE [One call per ...])
_RCS_OF: dict | None = None  # the _GRAD_REFCOUNT whose refcounts _GRAD_RCS holds


def _refresh_rcs(grads: dict | None) -> None:
    # the refcounts of the direct chains: a count none has is refused before the running node is
    # read, unless a node runs through autocast's wrapper on this thread (its chain's counts are
    # one more, which is also a direct chain's count with one holder more)
    global _GRAD_RCS, _RCS_OF
    _GRAD_RCS = frozenset(b[0] for k, b in (grads or {}).items() if k not in _AC_KINDS)
    _RCS_OF = grads


def grant(t: torch.Tensor, probe: object, refcount: int | None = None, count: bool = True) -> bool:
    """Whether a backward may overwrite its incoming gradient ``t`` (counted in
    :func:`reuse_count` when granted): :func:`take`'s question in one frame, for a backward
    that has asked :func:`slimgrad._autograd.compiling` itself (it must be False: reference
    counts mean nothing while Dynamo traces) and holds a tensor, not None.

    Call it as ``ownership.grant(grad, ownership.PROBE)`` directly from the Function's
    ``backward``, on the bare parameter, as its first use (NOTE [Gradient-buffer ownership]):
    ``PROBE`` is how the call mode is read (NOTE [One call per backward question]); any other
    object refuses. ``refcount`` and ``count`` are for :func:`take` and :func:`reusable`, which
    read ``t``'s count one frame above this one."""
    # terms 1-7 for an incoming gradient; the cheap facts first, then one extension call
    # (NOTE [One call per backward question])
    if refcount is None:  # asked from a backward: t's count here is the one take reads
        refcount = _getrefcount(t)
    if probe is not _MODE_PROBE:  # another object's count is no call mode
        return False
    mode = _getrefcount(probe)  # _call_mode()'s count (NOTE [Calibration per call mode])
    if mode != _MODE and not _ensure_calibrated(mode):
        return False
    grads = _GRAD_REFCOUNT
    if grads is not _RCS_OF:  # the baselines changed (a new call mode): their refcounts
        _refresh_rcs(grads)
    if refcount not in _GRAD_RCS and _AC_RUN.node is None:
        return False
    node = _current_node()
    if grads is None or node is None:
        return False
    cls = type(node)
    kind = _CHAINS[cls] if cls in _CHAINS else _CHAINS.setdefault(cls, _chain_of(cls))
    base = grads[kind] if kind in grads else None
    if base is None:
        return False
    if refcount != base[0]:
        # NOTE [The chain through autocast's wrapper]: asked only where the direct chain's count
        # refuses (the wrapper's count is calibrated one above it)
        if node is not _AC_RUN.node:
            return False
        kind = _AC_KIND[kind]
        if kind not in grads or refcount != grads[kind][0]:
            return False
        base = grads[kind]
    if _disabled_depth or ((_ENV_DATA is None or _ENV_KEY in _ENV_DATA) and _env_disabled()):
        return False
    fast = _BACKWARD_FACTS if _STORAGE_SIG is not None else None
    f = None if fast is None else fast(t, 0)
    exact = f is not None  # backward_facts answered: t is exactly torch.Tensor
    if f is None:
        if fast is not None and type(t) is torch.Tensor:
            return False  # a per-call term or a plain fact refused
        if _grad_on() or _graph_task_id() == -1 or _functorch_on():
            return False
        if _weakcount(t) and (type(t) is torch.Tensor or _fake_weakcount(t)):
            return False
        f = _plain_facts(t, 0)
    if f is None or f[0] != base[1] or f[4] != 1:  # terms 4-5; 1; 7
        return False
    if f[6]:  # 2b: a view (NOTE [View gradients asked in C++])
        if _VIEW_SIG is None:
            return False
        sig = (_VIEW_EXT[0] if _VIEW_EXT else _view_base_sig()) if exact else None
        if sig is not None:
            if _VIEW_BASE(t) != sig:
                return False
        elif _view_sig(t, f) != _VIEW_SIG:
            return False
        use, _, weak = _STORAGE_SIG
        # the base's TensorImpl is the one more use (the common case first: _storage_free's own)
        if not ((f[1] == use + 1 and f[2] == weak) or _storage_free(t, 1, f)):
            return False
    else:
        use, _, weak = _STORAGE_SIG
        # 2a: nothing else holds the storage (the common case first)
        if not ((f[1] == use and f[2] == weak) or _storage_free(t, 0, f)):
            return False
    if count:
        with _counter_lock:
            _counter["grad"] += 1
    return True


#: The call-mode probe a backward passes to :func:`grant` (NOTE [Calibration per call mode]).
PROBE = _MODE_PROBE = object()  # passed to _nested and grant: held by this module and the call


def _saved_ok(t: torch.Tensor, refcount: int, probe: object) -> bool:
    mode = _getrefcount(probe)  # _call_mode()'s count (NOTE [Calibration per call mode])
    if mode != _MODE and not _ensure_calibrated(mode):
        return False
    sigs = _SAVED_SIGS
    node = _current_node()
    if sigs is None or node is None:
        return False
    cls = type(node)
    kind = _CHAINS[cls] if cls in _CHAINS else _CHAINS.setdefault(cls, _chain_of(cls))
    if _disabled_depth or ((_ENV_DATA is None or _ENV_KEY in _ENV_DATA) and _env_disabled()):
        return False
    fast = _BACKWARD_FACTS if _STORAGE_SIG is not None else None
    f = None if fast is None else fast(t, 1)
    if f is None:
        if fast is not None and type(t) is torch.Tensor:
            return False  # a per-call term or a plain fact refused
        if _grad_on() or _graph_task_id() == -1 or _functorch_on() or _keep_graph():
            return False
        f = _plain_facts(t, 1)
    return (
        f is not None
        and (refcount, f[0]) in sigs.get(kind, ())
        and f[4] == 1  # term 7
        and _storage_free(t, 0, f)
    )


def reusable(grad: torch.Tensor | None) -> bool:
    """Whether a backward may overwrite its incoming gradient ``grad`` (no counting).

    Call it directly from the Function's ``backward`` on its bare parameter
    (NOTE [Gradient-buffer ownership]).

    Args:
        grad: the incoming gradient, or None.

    Returns:
        True if no other reader of ``grad``'s memory exists; False otherwise (and always under
        :func:`reuse_disabled`, outside backward, with grad mode on, or if calibration failed).
    """
    if _compiling() or grad is None:
        return False
    refcount = _getrefcount(grad)
    return grant(grad, _MODE_PROBE, refcount, False)


def take(grad: torch.Tensor | None) -> torch.Tensor | None:
    """Return ``grad`` if the caller may overwrite it (counted in :func:`reuse_count`), else None.

    Call it directly from the Function's ``backward`` on its bare parameter, as its first use
    (NOTE [Gradient-buffer ownership]). Every deviation from that pattern only makes it refuse.

    Example:
        >>> @staticmethod
        ... def backward(ctx, grad_out):
        ...     buf = ownership.take(grad_out)
        ...     return grad_out.mul_(2) if buf is not None else grad_out * 2
    """
    # a traced backward: no refcounts, no unannounced mutation; the call mode's baselines (NOTE
    # [Calibration per call mode]) are checked in grant (NOTE [One call per backward question])
    if _compiling() or grad is None:
        return None
    refcount = _getrefcount(grad)
    return grad if grant(grad, _MODE_PROBE, refcount) else None


def take_saved(ctx, saved: torch.Tensor | None) -> torch.Tensor | None:
    """Return a saved tensor for in-place reuse at its last use, or None; marks ``ctx`` consumed.

    Refused under ``retain_graph=True`` (saved tensors must stay intact), when any other tensor or
    Python reference shares the memory (e.g. the next layer saved the same storage, or the user
    still holds the forward output), and in every case :func:`take` refuses. Call pattern:
    ``a, b = ctx.saved_tensors`` then ``buf = ownership.take_saved(ctx, a)`` directly in
    ``backward`` (NOTE [Gradient-buffer ownership]).
    """
    if _compiling() or saved is None:
        return None
    refcount = _getrefcount(saved)
    if not _saved_ok(saved, refcount, _MODE_PROBE):
        return None
    mark_consumed(ctx)
    with _counter_lock:
        _counter["saved"] += 1
    return saved


def mark_consumed(ctx) -> None:
    """Record that ``ctx``'s saved tensors were overwritten (:func:`check_not_consumed` raises)."""
    ctx._slimgrad_consumed = True


def check_not_consumed(ctx, api: str) -> None:
    """Raise a clear RuntimeError if a backward already overwrote ``ctx``'s saved tensors.

    Args:
        ctx: the autograd ctx.
        api: the public name to report, e.g. ``"slimgrad.nn.InPlaceABN"``.
    """
    if getattr(ctx, "_slimgrad_consumed", False):
        raise RuntimeError(
            f"{api}: backward ran a second time, but the first backward reused this op's saved "
            "tensors in place; expected retain_graph=True on the first backward, got "
            "retain_graph=False. Pass retain_graph=True to the first backward (saved tensors are "
            "then kept intact)."
        )


# Forward in-place writes ------------------------------------------------------------------------

# NOTE [Forward ownership from stated structure]
# A module C that asks :func:`owns_input` (its class sets ``_slimgrad_owns_input = True``:
# InPlaceABN, the ``*AfterNorm`` activations) is granted a forward write over its input ``x`` only
# from facts stated before the call and cheap public facts read at it; no frame, bytecode or
# Python reference count is read.
#
# Stated by :func:`state_inputs_` (``convert_`` runs it), per parent Q with such children, from
# Q's forward as the code is written (an ``nn.Sequential`` by its order; any other forward from a
# torch.fx trace with every child a leaf, in train and in eval mode, both traces agreeing; one
# trace serves both where the forward cannot read a mode flag: NOTE [One trace serves both modes]
# in slimgrad/convert_handlers/inplace_guard.py):
# S1. C is a child of Q and of no other module of the model, and every call of C in Q's forward
#     takes one positional argument and no keyword arguments;
# S2. that argument is a value nothing else in Q's forward reads (its node has one user, C's call;
#     an fx Proxy still alive after the trace, i.e. stored on ``self``, in a list, a global or a
#     closure, counts as another reader), and it is *fresh*: the output of a child whose type
#     states a new output it keeps no Python reference to (torch's and slimgrad's convolutions,
#     Linear, BatchNorm, InPlaceABN, or a class with ``_slimgrad_fresh_output = True``), of an
#     op that always allocates its result (``+ - * /``, ``cat``, ``clone``, ``F.batch_norm``,
#     ``F.conv2d``, ...), or an in-place ``+= -= *= /=`` / an ``nn.Identity`` / ``nn.Dropout``
#     child applied to such a fresh value that only it reads (its result is that same tensor).
#     ``self.relu(out)`` for its side effect, ``y = self.relu(b); y + b``, ``return self.bn(f),
#     f``, keyword arguments, a value-dependent branch (the trace fails) and a view or alias op
#     (``view``, ``contiguous``, ``to``, ...) are not stated.
# A class whose forward the fx trace cannot follow may state it itself, as
# ``_slimgrad_forward_statement = (forward, {C's name: names of the Identity/Dropout children
# between a value the forward makes fresh and C})``, used only while the instance's forward is
# that function and its children are of those kinds (slimgrad's timm BatchNormAct2d:
# ``act(drop(batch_norm(x)))``).
# S3. What the statement was made from: Q's children (their types in order, a None slot included;
#     another instance of the same type computes what the stated one did) and
#     the attributes the fx trace read on Q (recorded by the stand-in's class; a flag such as
#     ``self.use_residual``, compared by identity; a tensor attribute, Parameter or buffer only as
#     present, absent or None, since a tensor's value cannot pick a traced path). A forward that
#     reads a list, dict or set attribute (whose contents can change without an assignment) is
#     not stated.
# Stored in Q's ``__dict__`` as {C's name: names of the children whose outputs reach C}, with Q's
# forward function and the S3 snapshot; Q gets two slimgrad hooks (a pre-hook and an
# always-called post hook) that keep a per-thread stack of running stated parents.
#
# Checked at the call, all cheap reads of public state:
# C1. the innermost running stated parent is Q, Q's forward is the stated one (no instance
#     ``forward`` attribute), S3's children and attributes are what they were (else the
#     statement is stale: refused until :func:`state_inputs_` runs again), and C is stated for
#     it; a direct call of C (``model.relu(t)``), of ``Q.forward`` without ``Q.__call__``, or a
#     call under torch.compile finds no stated parent;
# C2. no forward or backward hook on C, on the children whose outputs reach C, or globally, except
#     slimgrad's observers that keep no tensor (functions with ``_slimgrad_keeps_no_tensor``:
#     ``slimgrad.memory.measure(module=...)``'s attribution hooks); C not ``compile()``d;
# C3. no TorchDispatchMode but those stated to keep no tensor (slimgrad's memory tracker, which
#     keeps storage keys; keeps_no_tensor), no TorchFunctionMode (either could keep any op's
#     output; NOTE [Forward writes a watcher refuses]), no functorch transform,
#     reuse not disabled (for a caller that writes);
# C4. ``x`` plain (``torch.Tensor``, strided, not a view, not a leaf that requires grad, not
#     functorch-wrapped), its TensorImpl held by its Python object only (``_use_count() == 1``: no
#     SavedVariable, no view's base link), no weak reference but one per slimgrad registry
#     (:func:`register_registry`), dense over its whole storage, the storage shared with no other
#     tensor and its storage object kept by nobody, and torch-owned memory (terms 2a, 4 and 7 of
#     the backward rule, from the C++ extension).
# What the stated structure does not see, and therefore is outside the contract: a forward whose
# path depends on the contents of an attribute object changed in place after ``convert_`` (not a
# list, dict or set: those are not stated), on a global or a class attribute, and a child of Q
# that calls C through a reference it keeps outside the module tree.
_STATED = "_slimgrad_stated_inputs"
_REGISTRIES: list = []


class _Running(threading.local):
    def __init__(self) -> None:
        self.stack: list = []


_running = _Running()
_module_hooks = torch.nn.modules.module
_dispatch_depth = torch._C._len_torch_dispatch_stack
_function_mode_on = torch._C._is_torch_function_mode_enabled


def register_registry(registry) -> None:
    """Account for ``registry`` (a ``torch.utils.weak.WeakIdKeyDictionary`` of slimgrad's own) in
    :func:`owns_input`: its one weak reference per key is not another reader."""
    if not any(r is registry for r in _REGISTRIES):
        _REGISTRIES.append(registry)


def _weakrefs_accounted(t: torch.Tensor, n: int | None = None) -> bool:
    if n is None:
        n = weakref.getweakrefcount(t)
    if n == 0:
        return True
    found = 0  # each registry holds at most one weak reference to t: stop once all are found
    for r in _REGISTRIES:
        if t in r:
            found += 1
            if found == n:
                return True
    return False


def _observers_only(hooks) -> bool:
    # an empty dict, or hooks that state they keep no tensor (slimgrad.memory's attribution), or
    # torch's module tracker's (FlopCounterMode's), which keep none either: names, and gradient
    # hooks on the tensors' nodes (NOTE [torch's module tracker is an observer] in nn/_hooks.py)
    if not hooks:
        return True
    from slimgrad.nn._hooks import _observers

    seen = _observers()
    return all(
        getattr(f, "_slimgrad_keeps_no_tensor", False) or getattr(f, "__func__", None) in seen
        for f in hooks.values()
    )


def _hooks_refusal(m: torch.nn.Module) -> str | None:
    # C2 for one module: None where it holds, else why a forward write is refused there (NOTE
    # [Forward writes a watcher refuses]); empty dicts are the common case: no call for them
    if (m._forward_hooks and not _observers_only(m._forward_hooks)) or (
        m._forward_pre_hooks and not _observers_only(m._forward_pre_hooks)
    ):
        return f"a forward hook on {type(m).__name__}"
    if m._backward_hooks or m._backward_pre_hooks:
        return f"a backward hook on {type(m).__name__}"
    if "forward" in m.__dict__:
        return f"an instance attribute forward on {type(m).__name__}"
    if m._compiled_call_impl is not None:
        return f"{type(m).__name__} compiled (Module.compile)"
    return None


def _global_hooks_ok() -> bool:
    g = _module_hooks
    return (
        _observers_only(g._global_forward_hooks)
        and _observers_only(g._global_forward_pre_hooks)
        and not g._global_backward_hooks
        and not g._global_backward_pre_hooks
    )


def _modes_refusal() -> str | None:
    # C3: a dispatch mode sees (and may keep) every op's output; None where every active mode
    # states that it keeps none (slimgrad's tracker, keeps_no_tensor), else why a forward write
    # is refused (NOTE [Forward writes a watcher refuses])
    if _function_mode_on():
        return "a TorchFunctionMode"
    n = _dispatch_depth()
    if not n:
        return None
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    modes = _get_current_dispatch_mode_stack()
    names = [type(m).__name__ for m in modes if not getattr(m, "_slimgrad_keeps_no_tensor", False)]
    if len(modes) == n and not names:
        return None
    return f"TorchDispatchMode {', '.join(names) or '(not on the Python mode stack)'}"


# NOTE [Forward writes a watcher refuses]
# A forward hook, a global module hook, a TorchDispatchMode or a TorchFunctionMode sees tensors a
# forward would write over and could keep them (C2, C3 above); no public fact tells one that keeps
# nothing from one that keeps everything, so the write is refused under it unless it states that
# it keeps no tensor (keeps_no_tensor; slimgrad's own tracker, attribution hooks and OpObserver
# do). A refused write costs bytes: the watched step keeps what eager's in-place op would not (a
# converted ResNet-50 at 8x224 under a plain counting dispatch mode peaks 10.9% above the
# unwatched step). So each refusal is counted by reason (refused_writes), only on the refusing
# path (nothing on a granted call), and slimgrad.memory.measure reports the refusals of the step
# it measures (StepMemory.writes_refused): the user sees why the watched step keeps more.
_refused: dict[str, int] = {}


def _refuse(reason: str) -> bool:
    with _counter_lock:
        _refused[reason] = _refused.get(reason, 0) + 1
    return False


def refused_writes() -> dict[str, int]:
    """Forward writes :func:`owns_input` refused because a hook or a mode could keep the input.

    Counted since the process started, by reason (``"a forward hook on BatchNorm2d"``,
    ``"TorchDispatchMode MyCounter"``, ``"a global module hook"``, ...). Each refusal makes the
    step keep a tensor the unwatched step writes over (NOTE [Forward writes a watcher refuses]);
    :func:`slimgrad.memory.measure` reports the refusals of the step it measures. Refusals for
    other reasons (a residual, a view, reuse turned off) are not counted here.

    Returns:
        A new dict {reason: count}.
    """
    with _counter_lock:
        return dict(_refused)


def keeps_no_tensor(obj):
    """State that a hook function or a dispatch mode keeps no tensor it sees.

    A module's forward may then write over its input while ``obj`` watches, as in an unwatched
    step (NOTE [Forward writes a watcher refuses]). The statement is the caller's promise: a hook
    or mode that keeps a tensor (or a view of it) after stating this reads overwritten values.

    Args:
        obj: a hook function (forward or forward pre-hook, module or global), or a
            ``TorchDispatchMode`` instance or class (a class states it for all its instances).

    Returns:
        ``obj``, so it also serves as a decorator.

    Raises:
        TypeError: ``obj`` is a bound method or another object that cannot carry the statement.
    """
    try:
        obj._slimgrad_keeps_no_tensor = True
    except (AttributeError, TypeError):
        raise TypeError(
            "slimgrad.ownership.keeps_no_tensor: expected a function, a TorchDispatchMode "
            f"instance or class, got {type(obj).__name__} (which takes no attribute). State the "
            "underlying function (method.__func__) or wrap the hook in a plain function."
        ) from None
    return obj


def _estimate_modes_only(x) -> bool:
    # x is a FakeTensor and every active mode is the estimate's machinery (FakeTensorMode,
    # slimgrad.memory's tracker)
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    def ours(m) -> bool:  # slimgrad.memory's estimate machinery (fake tensors only)
        return type(m).__module__ == "slimgrad.memory"

    return (
        type(x) is FakeTensor
        and all(
            isinstance(m, FakeTensorMode) or ours(m) for m in _get_current_dispatch_mode_stack()
        )
        and all(ours(m) for m in _get_current_function_mode_stack())
    )


def _fake_input_ok(x) -> bool:
    # Under fake tensors (slimgrad.memory.estimate) the decision models the real step's: the same
    # statement and hooks, and the facts a fake tensor carries (not a view, dense from offset 0,
    # no other C++ holder, no weak reference but slimgrad's registries). Its storage's holders
    # are not read (no real memory: nothing can be corrupted); in a stated structure without
    # foreign hooks they are the real step's.
    return (
        _estimate_modes_only(x)
        and x.layout == torch.strided
        and not x._is_view()
        and not (x.is_leaf and x.requires_grad)
        and x.numel() > 0
        and x.storage_offset() == 0
        and (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last))
        and x._use_count() == 1
        and (not (n := _fake_weakcount(x)) or _weakrefs_accounted(x, n))
    )


def _enter(module, args) -> None:
    if not _compiling():
        stack = _running.stack
        stack += (module,)  # append without a method call: these hooks run on every parent call


def _leave(module, args, output) -> None:
    stack = _running.stack
    if stack and stack[-1] is module:
        del stack[-1]


_enter._slimgrad_keeps_no_tensor = True  # type: ignore[attr-defined]
_leave._slimgrad_keeps_no_tensor = True  # type: ignore[attr-defined]


def _asks(m: object) -> bool:
    return bool(getattr(type(m), "_slimgrad_owns_input", False))


def _fresh_producer(m: torch.nn.Module) -> bool:
    # a child whose output is a new tensor it keeps no Python reference to (S2)
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.conv import _ConvNd

    cls = type(m)
    if getattr(cls, "_slimgrad_fresh_output", False):
        return True
    if "forward" in m.__dict__:
        return False
    known = cls.__module__.startswith(("torch.nn.", "slimgrad."))
    return known and isinstance(m, (_ConvNd, torch.nn.Linear, _BatchNorm))


def _passes_through(m: torch.nn.Module) -> bool:
    # children whose output is their input or a new tensor (S2): Identity, Dropout
    cls = type(m)
    return (
        cls in (torch.nn.Identity, torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d)
        and "forward" not in m.__dict__
    )


def _fresh_ops() -> tuple[frozenset, frozenset, frozenset, frozenset]:
    import operator

    import torch.nn.functional as F

    fns = frozenset(
        {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg}
        | {torch.add, torch.sub, torch.mul, torch.div, torch.cat, torch.clone}
        | {F.batch_norm, F.layer_norm, F.group_norm, F.instance_norm, F.linear}
        | {F.conv1d, F.conv2d, F.conv3d}
    )
    methods = frozenset({"add", "sub", "mul", "div", "clone"})
    inplace_fns = frozenset({operator.iadd, operator.isub, operator.imul, operator.itruediv})
    inplace_methods = frozenset({"add_", "sub_", "mul_", "div_"})
    return fns, methods, inplace_fns, inplace_methods


def _fresh_value(node, kids: dict, kept: set, ops, sources: list) -> bool:
    # S2 for one fx node: read by one user only, and fresh (collects the children it came from)
    fns, methods, inplace_fns, inplace_methods = ops
    if len(node.users) != 1 or node in kept:
        return False
    if node.op == "call_module":
        m = kids.get(node.target)
        if m is None or _asks(m):
            return False
        sources.append(node.target)
        if _fresh_producer(m):
            return True
        if _passes_through(m) and len(node.args) == 1 and not node.kwargs:
            a = node.args[0]
            return hasattr(a, "users") and _fresh_value(a, kids, kept, ops, sources)
        return False
    if node.op == "call_function" and node.target in fns:
        return True
    if node.op == "call_method" and node.target in methods:
        return True
    inplace = (node.op == "call_function" and node.target in inplace_fns) or (
        node.op == "call_method" and node.target in inplace_methods
    )
    if inplace and node.args and hasattr(node.args[0], "users"):
        return _fresh_value(node.args[0], kids, kept, ops, sources)
    return False


def _recording_class(cls: type, reads: set) -> type | None:
    # parent's class, recording every attribute name its instances are asked for (the trace's
    # reads: S3 of NOTE [Forward ownership from stated structure]); None if it cannot be made
    get = cls.__getattribute__

    def __getattribute__(self, name, _get=get, _add=reads.add):
        _add(name)
        return _get(self, name)

    try:
        return type(cls)(
            cls.__name__,
            (cls,),
            {"__getattribute__": __getattribute__, "__module__": cls.__module__},
        )
    except Exception:  # a metaclass or __init_subclass__ that refuses: not stated
        return None


def _trace_stand_in(
    parent: torch.nn.Module, training: bool, reads: set | None = None
) -> torch.nn.Module | None:
    # A trace runs parent's forward as Python on real objects: what it does to ``self`` that fx
    # does not record (timm's BatchNormAct2d bumps ``num_batches_tracked``, momentum=None then
    # reads it with ``float``; ``self.x = ...``) would change the user's model at convert_ time.
    # The trace runs on a stand-in instead: parent's class and attributes, its own attribute
    # dict, and copies of its buffers and tensor attributes; the same children and Parameters
    # (children are leaves, not run; fx records Parameter use as graph nodes).
    cls = type(parent)
    if reads is not None:
        cls = _recording_class(cls, reads)
        if cls is None:
            return None
    try:
        new = object.__new__(cls)
    except TypeError:  # a class whose instances object.__new__ cannot make: not stated
        return None
    attrs = dict(parent.__dict__)
    for k, v in attrs.items():
        if type(v) is torch.Tensor:
            attrs[k] = v.detach().clone()
    attrs["_buffers"] = {
        k: None if b is None else b.detach().clone() for k, b in parent._buffers.items()
    }
    attrs["training"] = training
    new.__dict__.update(attrs)
    return new


def _fx_statement(parent: torch.nn.Module, kids: dict, training: bool, reads: set) -> dict | None:
    # {consumer name: names of the children whose outputs reach it}, from one fx trace of
    # parent's forward (in train or eval mode, on a stand-in: parent itself is left as it was)
    # with every child a leaf; None if the trace fails. ``reads`` gets the attribute names the
    # trace asked the stand-in for.
    import warnings

    import torch.fx

    proxies: list = []

    class _Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m, qualname) -> bool:
            return True

        def proxy(self, node):
            p = super().proxy(node)
            proxies.append(weakref.ref(p))
            return p

    from slimgrad.convert_handlers.inplace_guard import untouched

    try:  # the stand-in shares parent's containers and children: NOTE [A trace leaves the
        # model as it was] (convert_handlers/inplace_guard.py)
        with untouched(parent), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # (made inside: its attribute dict gets the trace's stand-ins of what cannot be
            # put back)
            stand_in = _trace_stand_in(parent, training, reads)
            graph = None if stand_in is None else _Tracer().trace(stand_in)
    except Exception:  # fx raises many types on Python it cannot trace
        return None
    if graph is None:
        return None
    kept = {p.node for r in proxies if (p := r()) is not None}  # proxies someone kept (S2)
    ops = _fresh_ops()
    calls: dict = {}
    for node in graph.nodes:
        if node.op == "call_module" and node.target in kids and _asks(kids[node.target]):
            calls.setdefault(node.target, []).append(node)
    stated: dict = {}
    for name, nodes in calls.items():
        sources: list = []
        ok = all(
            len(n.args) == 1
            and not n.kwargs
            and hasattr(n.args[0], "users")
            and _fresh_value(n.args[0], kids, kept, ops, sources)
            for n in nodes
        )
        if ok:
            stated[name] = tuple((s, type(kids[s])) for s in dict.fromkeys(sources))
    return stated


def _declared_statement(kids: dict, declared: dict) -> dict:
    # a class's own statement of its forward ({child: children between a fresh value and it}),
    # checked against the instance's children as the fx and Sequential statements are
    stated: dict = {}
    for name, through in declared.items():
        c = kids.get(name)
        if c is None or not _asks(c) or sum(k is c for k in kids.values()) != 1:
            continue
        chain = [kids.get(t) for t in through]
        if all(
            m is not None
            and m is not c
            and not _asks(m)
            and _passes_through(m)
            and sum(k is m for k in kids.values()) == 1
            for m in chain
        ):
            stated[name] = tuple((t, type(m)) for t, m in zip(through, chain))
    return stated


def _sequential_statement(kids: dict) -> dict:
    names = list(kids)
    stated: dict = {}
    for i, name in enumerate(names):
        c = kids[name]
        if not _asks(c):
            continue
        prev = kids[names[i - 1]] if i > 0 else None
        if (
            prev is not None
            and _fresh_producer(prev)
            and sum(kids[n] is c for n in names) == 1
            and sum(kids[n] is prev for n in names) == 1
        ):
            stated[name] = ((names[i - 1], type(prev)),)
    return stated


class _Marker:
    # a snapshot's marker: the same object after copy.deepcopy (a copied model's statement holds)
    # and after pickling
    def __init__(self, name: str) -> None:
        self.name = name

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return self.name


_MISSING = _Marker("_MISSING")  # an attribute the forward asked for that the parent did not have
_TENSOR = _Marker("_TENSOR")  # a tensor attribute, Parameter or buffer (its value picks no path)
_MUTABLE = (list, dict, set, bytearray)
_MACHINERY: frozenset | None = None  # nn.Module's own attributes (hook dicts, training, ...)


def _attr_fact(parent: torch.nn.Module, name: str):
    # what an attribute the forward reads is, as the statement depends on it: the object itself
    # (compared by identity), _TENSOR for any tensor, _MISSING when absent
    d = parent.__dict__
    v = d.get(name, _MISSING)
    if v is _MISSING:
        for store in ("_parameters", "_buffers"):
            s = d.get(store)
            if s is not None and name in s:
                v = s[name]
                break
    return _TENSOR if isinstance(v, torch.Tensor) else v


def _snapshot(parent: torch.nn.Module, reads: set | None):
    # S3: what the statement was made from: every child's type (None included) and the
    # plain attributes the traced forward read; None if one of those is a mutable container
    # (its contents can change the path without any assignment)
    global _MACHINERY
    if _MACHINERY is None:
        _MACHINERY = frozenset(torch.nn.Module().__dict__)
    kids = tuple(type(c) for c in parent._modules.values())
    attrs = []
    cls = type(parent)
    for name in sorted(reads or ()):
        if (
            name in _MACHINERY
            or name == _STATED
            or name in parent._modules
            or (name.startswith("__") and name.endswith("__"))
            or (name not in parent.__dict__ and hasattr(cls, name))  # methods, class constants
        ):
            continue
        v = _attr_fact(parent, name)
        if isinstance(v, _MUTABLE):
            return None
        attrs.append((name, v))
    return kids, tuple(attrs)


def _unchanged(parent: torch.nn.Module, snap) -> bool:
    # S3 at the call: the children and read attributes are the ones stated (a few identity
    # compares; a child added, removed or of another type, or a flag the forward branches on
    # reassigned, makes the statement stale: refused until state_inputs_ runs again)
    kids, attrs = snap
    if tuple(map(type, parent._modules.values())) != kids:  # types compare by identity
        return False
    for name, v in attrs:
        if _attr_fact(parent, name) is not v:
            return False
    return True


def _install(module: torch.nn.Module) -> None:
    if not any(f is _enter for f in module._forward_pre_hooks.values()):
        module.register_forward_pre_hook(_enter)
    if not any(f is _leave for f in module._forward_hooks.values()):
        module.register_forward_hook(_leave, always_call=True)


def state_inputs_(model: torch.nn.Module) -> int:
    """State, for each module of ``model`` that asks :func:`owns_input` (InPlaceABN, the
    ``*AfterNorm`` activations), whether every call of it in its parent's forward takes a fresh
    value that nothing else reads (NOTE [Forward ownership from stated structure]). ``convert_``
    runs it; without a statement a module never writes over its input. Run it again after
    changing the model's structure or a parent's forward.

    Args:
        model: the model (in place: a parent with stated children gets two slimgrad hooks).

    Returns:
        The number of (parent, child) pairs stated.
    """
    from slimgrad.convert_handlers.inplace_guard import _mode_blind

    parents: dict = {}
    for parent in model.modules():
        for c in parent._modules.values():
            if c is not None:
                parents.setdefault(id(c), set()).add(id(parent))
    n = 0
    for parent in model.modules():
        kids = {k: c for k, c in parent._modules.items() if c is not None}
        fwd = type(parent).forward
        key = (fwd, parent.__dict__.get("forward"), tuple((k, id(c)) for k, c in kids.items()))
        old = parent.__dict__.get(_STATED)
        if old is not None and old[2] == key and _unchanged(parent, old[3]):
            n += len(old[1])  # the same forward, children and read attributes: stated already
            continue
        parent.__dict__.pop(_STATED, None)
        if not any(_asks(c) for c in kids.values()) or "forward" in parent.__dict__:
            continue
        declared = getattr(type(parent), "_slimgrad_forward_statement", None)
        reads: set | None = None  # the Sequential and declared forwards read only children
        if fwd is torch.nn.Sequential.forward:
            stated = _sequential_statement(kids)
        elif declared is not None and declared[0] is fwd:
            stated = _declared_statement(kids, declared[1])
        else:
            reads = set()
            train = _fx_statement(parent, kids, True, reads)
            # NOTE [One trace serves both modes] (convert_handlers/inplace_guard.py): a forward
            # that reads no mode flag runs the same Python on the stand-in in either mode
            blind = train is not None and _mode_blind(parent)
            evals = train if blind else _fx_statement(parent, kids, False, reads)
            if train is None or evals is None:
                continue
            stated = {c: p for c, p in train.items() if evals.get(c) == p}
        stated = {c: p for c, p in stated.items() if len(parents.get(id(kids[c]), ())) == 1}
        snap = _snapshot(parent, reads) if stated else None
        if snap is None:
            continue
        parent.__dict__[_STATED] = (fwd, stated, key, snap)
        _install(parent)
        n += len(stated)
    return n


def _stated_sources(module: torch.nn.Module):
    # C1: the children whose outputs reach ``module`` in the innermost running stated parent, or
    # None when the call is not a stated one
    stack = _running.stack
    if not stack:
        return None
    parent = stack[-1]
    if parent is module:  # module is itself a stated parent: its own parent is below
        if len(stack) < 2:
            return None
        parent = stack[-2]
    stated = parent.__dict__.get(_STATED)
    if stated is None or stated[0] is not type(parent).forward or "forward" in parent.__dict__:
        return None
    kids, attrs = stated[3]  # S3 (_unchanged, inlined): stale since convert_?
    if tuple(map(type, parent._modules.values())) != kids or (
        attrs and not _unchanged(parent, stated[3])
    ):
        return None
    mods = parent._modules
    for name, sources in stated[1].items():
        if mods.get(name) is module:
            out = []
            for s, cls in sources:  # the children the statement was made for (by type)
                m = mods.get(s)
                if type(m) is not cls:
                    return None
                out.append(m)
            return out
    return None


def _forward_ok(x, module, writes: bool) -> bool:
    sources = _stated_sources(module)
    if sources is None:
        return False
    why = _hooks_refusal(module)
    if why is not None:
        return _refuse(why)
    for s in sources:
        why = _hooks_refusal(s)
        if why is not None:
            return _refuse(why)
    g = _module_hooks
    if (
        (g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks)
        and not _global_hooks_ok()
    ) or g._global_backward_pre_hooks:
        return _refuse("a global module hook")
    if writes and (
        _disabled_depth or ((_ENV_DATA is None or _ENV_KEY in _ENV_DATA) and _env_disabled())
    ):
        return False
    if _functorch_on():
        return False
    if type(x) is not torch.Tensor:
        return _fake_input_ok(x)
    if _dispatch_depth() or _function_mode_on():
        why = _modes_refusal()
        if why is not None:
            return _refuse(why)
    f = _plain_facts(x, 2)  # C4: plain, not a view, dense over its storage; its holders
    if f is None or f[0] != 1 or f[4] != 1 or (_weakcount(x) and not _weakrefs_accounted(x)):
        return False
    use, _, weak = _STORAGE_SIG
    return (f[1] == use and f[2] == weak) or _storage_free(x, 0, f)


def owns_input(x: torch.Tensor, module: torch.nn.Module, writes: bool = True) -> bool:
    """Whether ``module``'s forward may write over its input ``x`` (nobody else can see it).

    True only where :func:`state_inputs_` stated that every call of ``module`` in its parent's
    forward takes a fresh value nothing else reads, the call comes from that parent's running
    forward, and the call-time facts hold: no hook but slimgrad's observers, no foreign dispatch
    or function mode, ``x`` plain and held by nobody else (NOTE [Forward ownership from stated
    structure]). False everywhere else (the caller's own tensor, a residual, a second consumer, a
    hook, a returned value, a view, torch.compile, a model ``convert_`` did not see), and then
    the module must not write over ``x``. The module's class sets ``_slimgrad_owns_input = True``.

    Args:
        x: the forward's input.
        module: the module whose forward is running (``self``).
        writes: the caller will write over ``x`` if granted (InPlaceABN). False for a caller that
            only skips an in-place write when granted (a derived activation computes out of place
            what eager's in-place op would write): then :func:`reuse_disabled` does not refuse,
            so turning reuse off changes no result.

    Returns:
        True if writing over ``x`` (or not writing it) is invisible to everyone else.
    """
    if not _running.stack or _compiling() or not _forward_ok(x, module, writes):
        return False
    with _counter_lock:
        _counter["forward"] += 1
    return True


# Calibration ------------------------------------------------------------------------------------


def _probe(t):
    # Same call depth and argument passing as take()/take_saved(): one call from backward.
    # ``t._use_count()`` is the tensor use count the extension's facts report (at::Tensor's).
    return sys.getrefcount(t), t._use_count(), _caller()


def _calib_fns(seen: list):
    class Grad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad_out):
            seen.append(("grad", _probe(grad_out)))
            seen.append(("stack", (grad_out, _probe(grad_out))[1][0]))  # grad_out on the stack
            if grad_out._is_view():
                seen.append(("view", _view_probe(grad_out)))
            return grad_out * 2

    class GradOnce(Grad):
        @staticmethod
        @once_differentiable
        def backward(ctx, grad_out):
            seen.append(("grad", _probe(grad_out)))
            seen.append(("stack", (grad_out, _probe(grad_out))[1][0]))  # grad_out on the stack
            if grad_out._is_view():
                seen.append(("view", _view_probe(grad_out)))
            return grad_out * 2

    class Saved(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = x * 2
            ctx.save_for_backward(y)
            return y.clone()

        @staticmethod
        def backward(ctx, grad_out):
            (y,) = ctx.saved_tensors
            seen.append(("saved", _probe(y)))
            return grad_out * y

    class SavedOnce(Saved):
        @staticmethod
        @once_differentiable
        def backward(ctx, grad_out):
            (y,) = ctx.saved_tensors
            seen.append(("saved", _probe(y)))
            return grad_out * y

    class GradFirst(Grad):
        @staticmethod
        @first_order("ownership.calibration")
        def backward(ctx, grad_out):
            seen.append(("grad", _probe(grad_out)))
            seen.append(("stack", (grad_out, _probe(grad_out))[1][0]))  # grad_out on the stack
            if grad_out._is_view():
                seen.append(("view", _view_probe(grad_out)))
            return grad_out * 2

    class SavedFirst(Saved):
        @staticmethod
        @first_order("ownership.calibration")
        def backward(ctx, grad_out):
            (y,) = ctx.saved_tensors
            seen.append(("saved", _probe(y)))
            return grad_out * y

    return (Grad, GradOnce, GradFirst), (Saved, SavedOnce, SavedFirst)


def _calibrate() -> None:
    global _GRAD_REFCOUNT, _SAVED_SIGS, _VIEW_SIG
    _GRAD_REFCOUNT = _SAVED_SIGS = _VIEW_SIG = None  # until proven
    if refcount_problem() is not None:  # NOTE [Reference counts and the interpreter]
        return
    try:
        x = torch.arange(1.0, 6.0, requires_grad=True)  # not randn: no global RNG draw
        grad_base: dict = {}
        saved_sigs: dict = {}
        view_sigs: set = set()
        view_ok = True
        ok = True
        for grad_fn, saved_fn in zip(*_calib_fns(seen := []), strict=True):
            seen.clear()
            (grad_fn.apply(x) * 3).sum().backward()
            ((grad_fn.apply(x) * 3) * 1).sum().backward()
            kept = []  # a hook that keeps the gradient must raise the refcount by exactly one
            y = grad_fn.apply(x)
            z = y * 3
            y.register_hook(lambda g, kept=kept: kept.append(g))
            z.sum().backward()
            (saved_fn.apply(x) * 3).sum().backward()
            (saved_fn.apply(x * 1) * 3).sum().backward()
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t):
                loss = (saved_fn.apply(x * 1) * 3).sum()
            loss.backward()
            # term 2b: F's gradient arrives as ViewBackward0's reshape of mul's fresh gradient (a
            # whole-storage view whose base only the view holds); then the same with a hook that
            # keeps that base (it must show in the signature)
            (grad_fn.apply(x).view(1, 5) * 3).sum().backward()
            v = grad_fn.apply(x).view(1, 5)
            v.register_hook(lambda g, kept=kept: kept.append(g))
            (v * 3).sum().backward()
            del v
            # term 1: a sibling still pending on the same gradient (the Gemma-2 pattern) is a C++
            # holder: the use count must be exactly one above the baseline
            r = x * 1.25
            ((grad_fn.apply(x) + r) * 3).sum().backward()
            del r
            vs = [p for k, p in seen if k == "view"]
            stack = [p for k, p in seen if k == "stack"]
            g = [p for k, p in seen if k == "grad"]
            sv = [p for k, p in seen if k == "saved"]
            caller = g[0][2]
            ok = (
                ok
                and len(g) == 6
                and len(sv) == 3
                and caller is not None
                and all(p[2] == caller for p in g + sv)
                and g[0] == g[1]
                # one C++ handle (the Python object), or two where autograd's call into Python
                # keeps its own (torch 2.11: the node's input list); never more
                and g[0][1] in (1, 2)
                and g[5][1] == g[0][1] + 1
                and g[2][0] == g[0][0] + 1
                # a holder on the backward's own evaluation stack adds exactly one (NOTE
                # [Reference counts and the interpreter]); a borrowing interpreter shows none
                and len(stack) == len(g)
                and all(n == p[0] + 1 for n, p in zip(stack, g))
                and sv[0] == sv[1]
                and caller not in grad_base
            )
            if not ok:
                break
            grad_base[caller] = g[0][:2]
            saved_sigs[caller] = frozenset({sv[0][:2], sv[2][:2]})
            view_ok = (
                view_ok
                and (
                    len(vs) == 2
                    # a view gradient: same refcount and use count as a plain one
                    and g[3][:2] == g[0][:2]
                    and vs[0] is not None
                    and vs[1] is not None
                    and vs[1][0] == vs[0][0] + 1  # the hook's reference to the base shows
                )
            )
            if view_ok:
                view_sigs.add(vs[0])
        # one view signature for both callers (it does not depend on the caller's frame); a
        # failure here refuses views only
        if ok and view_ok and len(view_sigs) == 1:
            _VIEW_SIG = view_sigs.pop()
        if ok:
            _calibrate_autocast_off(x, grad_base, saved_sigs)
            _GRAD_REFCOUNT, _SAVED_SIGS = grad_base, saved_sigs
    except Exception:  # any surprise: never reuse
        _GRAD_REFCOUNT = _SAVED_SIGS = _VIEW_SIG = None


def _raw_backward(fn_cls: type):
    return fn_cls.__dict__["backward"].__func__  # the probe's staticmethod


def _calibrate_autocast_off(x, grad_base: dict, saved_sigs: dict) -> None:
    # the chains through autocast's wrapper (NOTE [The chain through autocast's wrapper]): the
    # same probes, each Function's backward installed as slimgrad's are, run inside autocast. A
    # chain whose probes disagree gets no baseline (its grants are refused); the others keep theirs.
    grad_fns, saved_fns = _calib_fns(seen := [])
    for grad_fn, saved_fn in zip(grad_fns, saved_fns, strict=True):
        direct = _chain_of(grad_fn._backward_cls)
        kind = _AC_KIND[direct]
        if kind is None or kind in grad_base or direct not in grad_base:
            continue
        g_ac, s_ac = (
            type(
                f.__name__,
                (f,),
                {
                    "backward": _AutocastFreeBackward(_raw_backward(f)),
                    "__qualname__": f"{f.__qualname__}.autocast_off",
                },
            )
            for f in (grad_fn, saved_fn)
        )
        seen.clear()
        kept = []
        with torch.autocast("cpu", dtype=torch.bfloat16):
            (g_ac.apply(x) * 3).sum().backward()
            ((g_ac.apply(x) * 3) * 1).sum().backward()
            y = g_ac.apply(x)
            y.register_hook(lambda g, kept=kept: kept.append(g))
            (y * 3).sum().backward()
            (s_ac.apply(x) * 3).sum().backward()
            (s_ac.apply(x * 1) * 3).sum().backward()
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t):
                loss = (s_ac.apply(x * 1) * 3).sum()
            loss.backward()
        del y, kept
        stack = [p for k, p in seen if k == "stack"]
        g = [p for k, p in seen if k == "grad"]
        sv = [p for k, p in seen if k == "saved"]
        if (
            len(g) == 3
            and len(sv) == 3
            and all(p[2] == kind for p in g + sv)
            and g[0] == g[1]
            and g[2][0] == g[0][0] + 1
            and all(n == p[0] + 1 for n, p in zip(stack, g, strict=True))
            and sv[0] == sv[1]
            and g[0][0] == grad_base[direct][0] + 1
            and g[0][1] == grad_base[direct][1]
            and frozenset({sv[0][:2], sv[2][:2]}) == saved_sigs[direct]
        ):
            grad_base[kind] = g[0][:2]


def _calibrate_view_base(x) -> tuple[int, int] | None:
    # view_base's pair (NOTE [View gradients asked in C++]): term 2b's two view probes of
    # _calibrate, asked through view_base, in each chain; one pair for all, and the hook's
    # reference to the base must show exactly once. None: the view questions stay in Python.
    sigs = set()
    _CALIB_EXT[0] = True
    try:
        for grad_fn in _calib_fns(seen := [])[0]:
            seen.clear()
            kept = []
            (grad_fn.apply(x).view(1, 5) * 3).sum().backward()
            v = grad_fn.apply(x).view(1, 5)
            v.register_hook(lambda g, kept=kept: kept.append(g))
            (v * 3).sum().backward()
            del v
            vs = [p for k, p in seen if k == "view"]
            if len(vs) != 2 or vs[0] is None or vs[1] is None or vs[1][0] != vs[0][0] + 1:
                return None
            sigs.add(vs[0])
    finally:
        _CALIB_EXT[0] = False
    return sigs.pop() if len(sigs) == 1 else None


# NOTE [Calibration per call mode]
# The baselines above are Python reference counts, and CPython 3.11+ passes arguments to a plain
# Python-to-Python call in one of two ways: normally the callee's frame takes over the caller's
# stack reference (no extra count), but while an eval-frame hook (PEP 523) is installed every call
# goes through the generic vectorcall path, which leaves the caller's reference in place: one more
# count per argument in the callee (take(grad) called from backward sees refcount + 1). Dynamo
# installs such a hook while it runs, and in torch 2.13 a failed trace (e.g. torch.compile(...,
# fullgraph=True) raising Unsupported) leaves it installed for the rest of the process, although
# its callback is None again: from then on every refcount was one above the first baseline,
# and reuse was refused for good (safe, but the savings were lost). The mode is measured by one
# nested call (_call_mode); the baselines are kept per mode, and a mode met for the first time is
# calibrated then, with the same probes as the first, but only where nothing can distort them (no
# Dynamo callback active, i.e. not between a compiled region's graph breaks; no saved-tensor hooks,
# e.g. inside activation checkpointing; not under torch.func): otherwise that call refuses.


def _nested(o: object) -> int:
    return sys.getrefcount(o)


def _call_mode() -> int:
    return _nested(_MODE_PROBE)


_MODE: int | None = None  # the call mode whose baselines are in the globals above
_BY_MODE: dict[int, tuple] = {}
_calib_lock = threading.RLock()
_recalibrating = False


def _state() -> tuple:
    return _GRAD_REFCOUNT, _SAVED_SIGS, _VIEW_SIG


def _set_state(state: tuple) -> None:
    global _GRAD_REFCOUNT, _SAVED_SIGS, _VIEW_SIG
    _GRAD_REFCOUNT, _SAVED_SIGS, _VIEW_SIG = state


def _calibration_undisturbed() -> bool:
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and torch._C._dynamo.eval_frame.get_eval_frame_callback() is not None:
        return False
    return (
        torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        and not torch._C._are_functorch_transforms_active()
    )


# NOTE [Calibration outside dispatch modes]
# The first question of a process calibrates, and it may be asked inside slimgrad.memory.estimate
# (FakeTensorMode) or measure (the tracker). Run there, the probes were fake tensors: the fake
# machinery's holds (NOTE [Ownership under fake tensors]) gave a view signature of a use more, or
# none, so the mode's baselines refused every view gradient for the rest of the process,
# including the real steps after the estimate (a Linear->GELU->Linear->LayerNorm->Linear on
# 2x8x32 with eager's 3-D F.linear: 0 grants where 2). The probes run with the dispatch modes set
# aside: the baselines are those of real tensors whatever the first caller, and the tracker does
# not count the probes' tensors as part of the measured step.
def _modes_aside():
    try:
        from torch.utils._python_dispatch import _disable_current_modes
    except ImportError:  # pragma: no cover - a torch without it: calibrate as the call finds it
        return contextlib.nullcontext()
    return _disable_current_modes()


# NOTE [Calibration outside inference mode]
# The probes need autograd: a first question asked while ``torch.inference_mode()`` is on (a
# ``convert_`` run inside it asks one) made them inference tensors with no graph, their backward
# raised, and the process
# kept no baseline: every later gradient buffer was refused for good, in grad mode too (a float32
# InPlaceABN after such a ``convert_`` in the same process: dz refused, peak 13,296 B where the
# calibrated process has 10,992). The probes run with inference mode off, as with grad mode on
# (a backward runs without grad mode) and the dispatch modes aside.
@contextlib.contextmanager
def _probing():
    with torch.inference_mode(False), torch.enable_grad(), _modes_aside():
        yield


def _ensure_calibrated(mode: int | None = None) -> bool:
    """Whether the globals hold the baselines of the current call mode (NOTE [Calibration per
    call mode]); switches to them, calibrating a new mode once, where that is safe. ``mode``:
    the mode the caller measured as :func:`_call_mode` does (the probe's count one plain Python
    call deep, where nothing else holds it); None: measured here."""
    global _MODE, _recalibrating
    if mode is None:
        mode = _call_mode()
    if mode == _MODE or _recalibrating:  # during a calibration its own probes run
        return True
    with _calib_lock:
        state = _BY_MODE.get(mode)
        if state is None:
            if not _calibration_undisturbed():
                return False
            _recalibrating = True
            try:
                with _probing():
                    _calibrate()
            finally:
                _recalibrating = False
            state = _BY_MODE[mode] = _state()
        _set_state(state)
        _MODE = mode
    return True
