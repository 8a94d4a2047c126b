"""Exact memory accounting of one training step: live bytes, peak, bytes saved for backward, floor.

A *step* is ``out = forward(); out.backward()``. :func:`measure` runs it and reports, in bytes above
what was live before the step, deterministically on any device (CPU included):

- ``peak_bytes``: the most live tensor bytes at any moment of forward + backward;
- ``saved_bytes``: unique storages created in the step that autograd keeps at the end of forward;
- ``floor_bytes``: the part of ``saved_bytes`` kept by matmul-like nodes (the "matmul-input floor":
  what an exact backward must keep unless it recomputes matmuls); ``floor_input_bytes``: the
  pre-existing (non-Parameter) storages such nodes keep, e.g. a first layer's input, which are in
  ``saved_input_bytes`` rather than ``saved_bytes``;
- per autograd node, per module, per op breakdowns and a timeline.

:func:`estimate` runs the same measurement under ``FakeTensorMode``: no memory is allocated and
nothing is computed, so big models and batches can be sized on a laptop.

# NOTE [How live bytes are counted]
A ``TorchDispatchMode`` sees every op (forward, backward and AccumulateGrad run on the calling
thread on CPU, with the mode active). Each tensor output registers its *storage*, keyed by its
StorageImpl (``UntypedStorage._cdata``): views and in-place results share the key and count once. A
free is seen through ``weakref.finalize`` on the Python storage object: PyTorch keeps one Python
object per StorageImpl for as long as the StorageImpl lives, so the finalizer fires exactly when the
memory is released. Ops that write an argument (schema ``(a!)``: in-place, ``out=``, ``resize_``,
``set_``) get their arguments' sizes re-read afterwards, and ``UntypedStorage.resize_``, which does
not go through the dispatcher, is wrapped for the duration of the step only. A storage first met as
an op *input* existed before the step: it is not counted, but a resize or free of it during the step
is. slimgrad's own custom ops are run through their Python implementation so the tracker sees the
temporaries they allocate (NOTE [Custom ops and the memory tracker] in
``slimgrad/_library.py``).

Gradient sums. Where two gradients meet at one tensor, autograd's engine sums them in its input
buffer (``InputBuffer::accumulate``, torch/csrc/autograd/input_buffer.cpp): with grad mode off, in
place (``old.add_(new)``) when ``old`` is a plain strided tensor (no subclass, not nested, not a
zero tensor), non-overlapping and dense, and the buffer holds the last reference to it and to its
storage (``use_count() == 1`` for both); else out of place (``old + new``). Under a dispatch mode
the mode's Python objects raise those use counts, so the engine always sums out of place, and a
tracker that counted what it sees would hold one gradient-sized buffer more than a real run (a
tied embedding's two weight gradients at the end of GPT-2's backward: vocab x hidden). The
tracker counts the sum as a real run does it: an ``aten.add.Tensor`` is the engine's sum when
  (a) it is called by C++ code the engine runs (no Python frame between the engine's entry,
      ``torch.autograd.graph._engine_run_backward``, and the mode: not a hook, not a custom
      Function's backward; the frames are read by slimgrad's C++ extension, ``call_origin``,
      never in Python, and without the extension no sum qualifies: it counts out of place, at
      most one gradient buffer above a real run), grad mode is off, and its operands meet the
      engine's layout and dtype conditions above (``old`` not a view: a view's base holds the
      storage too);
  (b) the current autograd node (``torch._C._current_autograd_node``) has already run its own
      backward (an op from it came before: the sum follows the node's apply; retain_grad's C++
      hook, which also sums ``.grad + grad``, runs before the node's apply), and ``old`` was made
      before that node began, while the result is new;
  (c) ``old``'s storage is freed right after the call, before any other op or free: the buffer
      held its last reference. A sum inside a built-in node's formula whose first operand
      existed before the node ran adds something the node still holds (an input gradient, a
      saved tensor), which cannot die there, so (b) and (c) single out the buffer's sum.
Such a sum is counted in place: no new bytes, its result takes ``old``'s bytes (timeline op
``aten.add (in place)``). Any other sum, or when (c) fails, counts out of place as it runs.
AccumulateGrad needs nothing of this: it steals an unshared incoming gradient (``detach``, no
bytes) or copies it, and adds into an existing ``.grad`` in place (``add_``), under the mode as
without it. ``tests/test_memory_truth.py`` checks the peaks against the CPU allocator of a real run
(``torch.profiler``, no mode): tied GPT-2 eager and converted, fp32 and autocast, a leaf and an
activation used twice, first gradients kept by hooks, expanded and view gradients, retain_grad
over two backward calls, ``.grad`` accumulation. Not seen by any dispatch mode: the 0-dim tensors
PyTorch makes from Python numbers inside an op call (8 bytes each; autograd keeps some, e.g.
``x * 0.5``'s scalar), and a kernel's internal scratch, freed before the kernel returns.

# NOTE [How saved bytes are counted]
At the end of forward the autograd graph is walked from the output. Each node's saved tensors
(``_raw_saved_*`` of built-in nodes, ``saved_tensors`` of custom Functions) and a custom Function's
tensor attributes (``ctx.foo = t``: side buffers) name the node that keeps each storage; a storage
kept by several nodes counts once. A ``CopySlices`` node (an in-place op on a view of a tensor that
requires grad: ``x[:, 1:3].mul_(y)``, ``x[i] = v``) keeps the in-place op's own node
(``CopySlices::fn``: MulBackward0, IndexPutBackward0, ...) and with it that node's saved tensors,
but PyTorch binds no accessor for it, so the walk asks slimgrad's C++ extension for it
(``copy_slices_fn``, NOTE [Storage facts from the C++ API]) and walks it as a node of the graph, its
tensors attributed to the module of the CopySlices node; without the extension they are not counted
(``saved_bytes`` below eager's keeping by them). No ``saved_tensors_hooks`` are installed: they
would change what is measured (a hook's unpacked tensor is a second reference, so an op that reuses
a dead saved buffer, see NOTE [Gradient-buffer ownership] in ``slimgrad/ownership.py``, could no
longer prove it dead), and they do not nest with the hooks of the code being measured. Saved tensors
packed by someone else's hooks (e.g. ``torch.utils.checkpoint``) are not unpacked by the walk, since
unpacking would recompute them; the tensors their packed objects hold (e.g. ``save_on_cpu``'s
copies) count, what a hook keeps elsewhere (checkpoint's inputs, in its closure) shows only in
``retained_bytes``. Module attribution: each module's forward post-hook claims the graph nodes
created since its inputs (inner modules first), keyed by the nodes' sequence numbers; a storage
belongs to the module of its earliest saver.

# NOTE [The matmul-input floor]
``floor_bytes`` counts the storages created in the step and kept by at least one node of a
matmul-like class: mm, addmm, bmm, baddbmm, addbmm, mv, addmv, dot, linear, matmul, every
convolution, embedding (its indices), fused attention (q, k, v, out, logsumexp); and slimgrad
Functions whose class sets ``_slimgrad_floor = True``. All tensors such a node keeps count;
parameters do not (they are resident anyway). The rationale: dW = x^T dy needs x exactly unless x is
recomputed. The floor depends on the op graph (math attention's P @ V keeps P), so compare a
converted model with the floor of the *eager* model of the same case.
"""

from __future__ import annotations

import contextlib
import os
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from slimgrad._compat import is_non_overlapping_and_dense
from slimgrad._library import python_impl

__all__ = ["DEVICES", "SavedStorage", "StepMemory", "estimate", "measure"]

try:  # (the estimate's tensors; without it every tensor answers ``is_meta`` itself)
    from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
except ImportError:  # pragma: no cover
    _FakeTensor = ()

_FLOOR_NODE = re.compile(
    r"^(Mm|Addmm|Bmm|Baddbmm|Addbmm|Mv|Addmv|Dot|Vdot|Linear|Matmul|Embedding|EmbeddingBag"
    r"|.*Conv.*|.*ScaledDotProduct.*|.*FlashAttention.*|.*EfficientAttention.*|.*FlexAttention.*"
    r"|.*CudnnAttention.*)Backward\d*$"
)


def _is_floor_node(node: Any) -> bool:
    fwd_cls = getattr(type(node), "_forward_cls", None)
    if fwd_cls is not None:
        return bool(getattr(fwd_cls, "_slimgrad_floor", False))
    return bool(_FLOOR_NODE.match(type(node).__name__))


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    # meta tensors hold no memory (layout probes, shape arithmetic); fake tensors are not meta
    # (``is_meta`` is False on them: their fake device is the modelled one) and are counted. A
    # fake tensor's ``is_meta`` is its fake device's, read through a Python dispatch of
    # ``prim.device`` under the estimate's modes, for every tensor of every op the tracker sees;
    # ``fake_device`` is the same answer, read as an attribute
    if not isinstance(t, torch.Tensor) or t.is_sparse or t.is_nested:
        return None
    if t.fake_device.type == "meta" if isinstance(t, _FakeTensor) else t.is_meta:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


# An op's arguments and outputs are tensors, scalars and plain tuples, lists and dicts of them:
# walked directly, the tensors come in tree_flatten's order without its per-node cost (the
# tracker's largest host cost per op); any other object is left to tree_flatten
_SCALARS = frozenset(
    (int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout,
     torch.memory_format, torch.Size)
)  # fmt: skip


def _tensors(obj: Any, out: list) -> list:
    t = type(obj)
    if t is tuple or t is list:
        for a in obj:
            _tensors(a, out)
    elif t is dict:
        for a in obj.values():
            _tensors(a, out)
    elif isinstance(obj, torch.Tensor):
        out.append(obj)
    elif t not in _SCALARS:
        out.extend(a for a in tree_flatten(obj)[0] if isinstance(a, torch.Tensor))
    return out


# Gradient sums (NOTE [How live bytes are counted]). The frames that stand
# between the engine (C++) and a dispatch mode's __torch_dispatch__: dynamo's disable wrappers.
_WRAPPER_FILES = frozenset(
    os.path.join(os.path.dirname(torch.__file__), *f)
    for f in (("_dynamo", "eval_frame.py"), ("_compile.py",))
)
_ENGINE_CODE = torch.autograd.graph._engine_run_backward.__code__
_PY_BACKWARD_CODE = torch.autograd.function.BackwardCFunction.apply.__code__
_ADD = torch.ops.aten.add.Tensor

# The tracker's and _KernelDispatch's own reads of an op's tensors (storage, layout, dtype, device)
# are Python calls that every torch-function mode on the stack intercepts (the estimate's
# _FakeDeepcopy and _CudaFunctions, which pass them through unchanged; they are on the stack for
# ops dispatched from C++, e.g. the whole backward of a CUDA estimate: NOTE [Routing in backward]).
# They read and never route, so they run with torch functions off; the op itself and slimgrad's
# Python implementations run as before, under the modes. A private torch API: without it the reads
# pass through the modes (the same answers, slower).
_NO_TORCH_FUNCTION = getattr(torch._C, "DisableTorchFunction", contextlib.nullcontext)

# what the tracker needs of an op overload, computed at its first call: its name, the (position,
# name) of each argument its schema writes (``(a!)``), and whether it is one of slimgrad's ops
_OPS: dict[Any, tuple[str, tuple[tuple[int, str], ...], bool]] = {}


def _op_facts(func: Any) -> tuple[str, tuple[tuple[int, str], ...], bool]:
    facts = _OPS.get(func)
    if facts is not None:
        return facts
    name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
    schema = getattr(func, "_schema", None)
    writes = ()
    if schema is not None:
        writes = tuple(
            (i, a.name)
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
    _OPS[func] = facts = (name, writes, func.namespace == "slimgrad")
    return facts


_ORIGINS = ("python", "engine", "function")


_ORIGIN_ARGS = (_ENGINE_CODE, _PY_BACKWARD_CODE, _WRAPPER_FILES)


def _origin_reader() -> Callable[..., int] | None:
    # Who called the op being counted: "engine" (C++ code the engine runs: a built-in node's
    # apply, the input buffer's sum, a C++ hook), "function" (a custom Function's Python
    # backward) or "python" (any other Python code: a hook, user code). Read from the Python
    # frames below __torch_dispatch__ by slimgrad's C++ extension (``call_origin(*_ORIGIN_ARGS)``
    # called from __torch_dispatch__ itself, CPython's public frame API; NOTE [Storage facts from
    # the C++ API]); no frame is read in Python. None without the extension: every op then
    # counts as "python", so no gradient sum is taken for the engine's in-place one (sums count
    # out of place: a peak up to one gradient buffer above a real run's, never below).
    from slimgrad import _ext

    return getattr(_ext.load(), "call_origin", None)


def _plain_dense(t: Any) -> bool:
    # can_accumulate_inplace's "vanilla tensor with a favorable memory layout" (FakeTensor stands
    # for the plain tensor it fakes)
    from torch._subclasses.fake_tensor import FakeTensor

    return (
        isinstance(t, torch.Tensor)
        and type(t) in (torch.Tensor, torch.nn.Parameter, FakeTensor)
        and t.layout == torch.strided
        and not t.is_nested
        and not t._is_zerotensor()
        and is_non_overlapping_and_dense(t)
    )


@dataclass
class SavedStorage:
    """One storage that autograd keeps at the end of forward."""

    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    kind: str  # "step" (created in the step), "input" (pre-existing) or "param"
    module: str
    savers: list[str] = field(default_factory=list)
    floor: bool = False


@dataclass
class StepMemory:
    """Exact byte counts of one step (all relative to the live bytes before the step)."""

    peak_bytes: int
    forward_peak_bytes: int
    retained_bytes: int
    end_bytes: int
    saved_bytes: int
    saved_input_bytes: int
    saved_param_bytes: int
    floor_bytes: int
    floor_input_bytes: int
    peak_op: str
    peak_phase: str
    by_node: dict[str, int]
    by_module: dict[str, int]
    by_dtype: dict[str, int]
    saved: list[SavedStorage]
    timeline: list[tuple[int, str, int]]
    n_ops: int
    backward_start: int
    #: with ``measure(workspace=...)`` (NOTE [Intra-op workspace]): the most bytes an op held
    #: inside itself beyond its inputs and outputs, per op name (ops with none are left out)
    workspace_bytes: dict[str, int] = field(default_factory=dict)
    #: the peak counting each op's workspace on top of the live bytes around it; None unmeasured
    peak_with_workspace_bytes: int | None = None
    #: the op at that peak
    peak_with_workspace_op: str = ""
    #: forward writes over an input that slimgrad.ownership refused in this step because a hook or
    #: a mode could keep the input, by reason (NOTE [Forward writes a watcher refuses]); each
    #: makes the step keep a tensor the unwatched step writes over
    writes_refused: dict[str, int] = field(default_factory=dict)

    def to_dict(self, timeline: bool = False) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("saved", "timeline")}
        d["saved"] = [s.__dict__ for s in self.saved]
        if timeline:
            d["timeline"] = self.timeline
        return d

    def summary(self) -> str:
        mib = 2**20
        lines = [
            f"peak      {self.peak_bytes / mib:10.2f} MiB  ({self.peak_phase}, at {self.peak_op})",
            f"saved     {self.saved_bytes / mib:10.2f} MiB  "
            f"(floor {self.floor_bytes / mib:.2f} MiB)",
            f"retained  {self.retained_bytes / mib:10.2f} MiB  end {self.end_bytes / mib:.2f} MiB",
        ]
        for name, b in sorted(self.by_node.items(), key=lambda kv: -kv[1])[:10]:
            lines.append(f"  {name:40s} {b / mib:10.2f} MiB")
        for reason, n in sorted(self.writes_refused.items()):
            lines.append(
                f"forward write refused x{n}: {reason} could keep the input (state it with "
                "slimgrad.ownership.keeps_no_tensor if it keeps no tensor)"
            )
        return "\n".join(lines)


# NOTE [Intra-op workspace]
# The tracker counts storages at op boundaries, so a buffer an op allocates and frees inside itself
# (cuDNN's convolution workspace, cuBLAS's, a kernel's scratch) is invisible to it, and on CUDA
# ``torch.cuda.max_memory_allocated`` sits above the tracker's peak by that much (ResNet-50 on the
# first GPU run: 13,565,952 B on both sides). ``measure(workspace=...)`` reads an allocator's
# requested-bytes counters around every op the tracker sees: with ``before`` and ``after`` its
# current requested bytes at the op's entry and exit and ``peak`` its peak in between (the peak is
# reset at entry), the op's workspace is ``peak - max(before, after)``: what it held beyond both its
# inputs and its outputs. On CUDA these are the caching allocator's host-side counters
# (``torch.cuda.memory_stats`` / ``reset_peak_memory_stats``: no device sync; a block is taken and
# given back on the host when the op is launched). Reported beside the exact figures, which it
# leaves unchanged: ``workspace_bytes`` (the largest per op name) and ``peak_with_workspace_bytes``
# = the tracker's peak or, if higher, ``max(live before, live after) + workspace`` at some op. An
# op that dispatches other ops inside the tracker (slimgrad's custom ops, run as their Python
# implementation) is not measured itself: its inner ops are, and its own reading would have been
# reset by them. Any source with ``current()``, ``peak()`` and ``reset_peak()`` (requested bytes)
# can stand in for the allocator: the tests inject one on CPU.


class CudaAllocatorStats:
    """The CUDA caching allocator's requested-bytes counters, for ``measure(workspace=...)``.

    Host-side reads (no device sync); ``reset_peak`` also resets ``max_memory_allocated``.

    Args:
        device: the CUDA device (default: the current one).
    """

    def __init__(self, device: Any = None) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else (
            torch.device(device)
        )  # fmt: skip
        index = self.device.index
        self._index = torch.cuda.current_device() if index is None else index

    def _requested(self) -> dict:
        return torch.cuda.memory_stats_as_nested_dict(self._index)["requested_bytes"]["all"]

    def current(self) -> int:
        return int(self._requested()["current"])

    def peak(self) -> int:
        return int(self._requested()["peak"])

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self._index)


class _Tracker(TorchDispatchMode):
    # keeps storage keys, sizes and finalizers, never a tensor: ownership.owns_input may grant a
    # forward write under it (NOTE [Forward ownership from stated structure])
    _slimgrad_keeps_no_tensor = True

    # computes every op it sees as asked, storing no result it could hand back in place of a
    # later call's: NOTE [The down product after the saves] in slimgrad/ops/gated_mlp.py
    _slimgrad_reads_ops = True

    def __init__(self, stats: Any = None) -> None:
        super().__init__()
        self.stats = stats  # NOTE [Intra-op workspace]
        self.resets = 0
        self.workspace: dict[str, int] = {}
        self.peak_ws = 0
        self.peak_ws_op = ""
        self.sizes: dict[int, int] = {}  # key -> current nbytes, for every storage followed
        self.base: dict[int, int] = {}  # key -> nbytes at first sight, for pre-existing storages
        self.created: set[int] = set()  # keys created in the step and still alive
        self.finalizers: list[weakref.finalize] = []
        self.cur = 0
        self.peak = 0
        self.peak_op = ""
        self.peak_index = 0
        self.n_ops = 0
        # matmul FLOPs of the ops run so far, counted while ``flop_formulas`` is set (packet ->
        # formula over the op's arguments and output, as torch.utils.flop_counter's registry)
        self.flop_formulas: dict | None = None
        self.matmul_flops = 0
        self.op_name = "<start>"
        self.timeline: list[tuple[int, str, int]] = []
        self.active = True
        self.born: dict[int, int] = {}  # key -> index of the op that created it (step storages)
        # the autograd node whose ops run now (a "window" of consecutive ops under one node)
        self.window: tuple[Any, int] | None = None  # (node, graph task id)
        self.window_start = 0
        self.window_applied = False  # the node's own backward has dispatched an op
        self.call_origin = _origin_reader()  # who calls an op in a window (None: "python")
        # an engine gradient sum waiting to learn whether its first operand dies right after:
        # (old key, out key, live bytes after the out-of-place call, op name, op index)
        self.pending: tuple[int, int, int, str, int] | None = None

    # --- bookkeeping -------------------------------------------------------------------------
    def _free(self, key: int) -> None:
        if not self.active:
            return
        if self.pending is not None and self.pending[0] == key and key in self.sizes:
            self._sum_in_place()
            return
        self.settle()
        size = self.sizes.pop(key, None)
        if size is None:
            return
        # a storage created in the step leaves with all its bytes; a pre-existing one too (its
        # growth during the step was counted, its original bytes were part of the baseline and now
        # leave it)
        self.created.discard(key)
        self.base.pop(key, None)
        self.cur -= size
        self.timeline.append((self.n_ops, f"free:{self.op_name}", self.cur))

    def _follow(self, st: torch.UntypedStorage, created: bool) -> int:
        key = st._cdata
        if key in self.sizes:
            return key
        n = st.nbytes()
        self.sizes[key] = n
        if created:
            self.created.add(key)
            self.born[key] = self.n_ops
            self.cur += n
        else:
            self.base[key] = n
        self.finalizers.append(weakref.finalize(st, self._free, key))
        return key

    def _resized(self, st: torch.UntypedStorage) -> None:
        self.settle()
        key = st._cdata
        if key not in self.sizes:
            self._follow(st, created=False)
            return
        n = st.nbytes()
        self.cur += n - self.sizes[key]
        self.sizes[key] = n

    def _bump(self) -> None:
        if self.cur > self.peak:
            self.peak = self.cur
            self.peak_op = self.op_name
            self.peak_index = self.n_ops
        self.timeline.append((self.n_ops, self.op_name, self.cur))

    def note_resize(self, st: torch.UntypedStorage) -> None:
        self._resized(st)
        self._bump()

    # --- gradient sums the engine does in place (NOTE [How live bytes are counted]) ----------
    def settle(self) -> None:
        # the pending sum's first operand did not die right after it: out of place, as counted
        if self.pending is None:
            return
        _, _, value, name, index = self.pending
        self.pending = None
        if value > self.peak:
            self.peak = value
            self.peak_op = name
            self.peak_index = index
        self.timeline.append((index, name, value))

    def _sum_in_place(self) -> None:
        # the first operand died right after the sum: the engine's buffer held its last reference,
        # so without the mode the sum is ``old.add_(new)``; its result takes old's bytes
        old, out, _, name, index = self.pending
        self.pending = None
        self.created.discard(old)
        self.base.pop(old, None)
        self.born.pop(old, None)
        old_size = self.sizes.pop(old)
        self.cur -= self.sizes[out]  # the result's own bytes were never allocated...
        self.sizes[out] = old_size  # ...it lives in old's, which stay counted
        self.timeline.append((index, f"{name} (in place)", self.cur))

    def _window(self) -> bool:
        # enter the current autograd node's window; return whether its backward has run an op
        node = torch._C._current_autograd_node()
        if node is None:
            self.window = None
            return False
        task = torch._C._current_graph_task_id()
        if self.window is None or self.window[0] is not node or self.window[1] != task:
            self.window = (node, task)
            self.window_start = self.n_ops
            self.window_applied = False
        return self.window_applied

    def _engine_sum(self, func, args, kwargs, out, origin: str) -> tuple[int, int] | None:
        # (old key, out key) when this is the engine's input-buffer sum ``old + new`` that
        # InputBuffer::accumulate (torch/csrc/autograd/input_buffer.cpp) would do in place
        # if it held the last reference to old: checked here except that last condition, which
        # the caller proves by old's storage dying right after the call
        if func is not _ADD or kwargs or len(args) != 2 or origin != "engine":
            return None
        if not self.window_applied or torch.is_grad_enabled():
            return None
        old, new = args
        if not (_plain_dense(old) and isinstance(new, torch.Tensor) and _plain_dense(out)):
            return None
        if old._is_view():  # its base shares the storage: storage use_count > 1
            return None
        if type(new) not in (torch.Tensor, torch.nn.Parameter, type(old)):
            return None
        if not (old.shape == new.shape == out.shape and old.dtype == new.dtype == out.dtype):
            return None
        if old.device != out.device:
            return None
        ko, kn, kout = _storage(old), _storage(new), _storage(out)
        if ko is None or kn is None or kout is None:
            return None
        ko, kn, kout = ko._cdata, kn._cdata, kout._cdata
        if len({ko, kn, kout}) != 3 or ko not in self.created or kout not in self.created:
            return None
        # old was buffered before this node ran (an earlier node's gradient): a sum inside a
        # node's formula whose first operand existed before the node ran adds something the node
        # still holds (its inputs, its saved tensors), which cannot die right after the sum
        if self.born.get(ko, self.n_ops) > self.window_start or self.born.get(kout) != self.n_ops:
            return None
        return ko, kout

    # --- the mode ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.settle()  # another op: a pending sum's first operand did not die right after it
        kwargs = kwargs or {}
        name, writes, ours = _op_facts(func)
        sizes = self.sizes
        with _NO_TORCH_FUNCTION():
            for t in _tensors(kwargs, _tensors(args, [])):
                st = _storage(t)
                if st is not None and st._cdata not in sizes:
                    self._follow(st, created=False)
        self._window()
        call = self.call_origin  # called here: it reads the frames below this method's
        origin = _ORIGINS[call(*_ORIGIN_ARGS)] if call and self.window is not None else "python"
        impl = python_impl(func.name()) if ours else None
        stats = self.stats
        if stats is not None:
            stats.reset_peak()
            self.resets += 1
            mark, live_before, before = self.resets, self.cur, stats.current()
        if impl is not None:
            with self:
                out = impl(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
            if self.flop_formulas is not None:
                formula = self.flop_formulas.get(func.overloadpacket)
                if formula is not None:
                    self.matmul_flops += formula(*args, **kwargs, out_val=out)
        if stats is not None:
            peak, after = stats.peak(), stats.current()
        self.n_ops += 1
        self.op_name = name
        with _NO_TORCH_FUNCTION():
            for i, arg in writes:
                val = kwargs.get(arg) if arg in kwargs or i >= len(args) else args[i]
                for t in _tensors(val, []):
                    st = _storage(t)
                    if st is not None:
                        self._resized(st)
            for t in _tensors(out, []):
                st = _storage(t)
                if st is not None and st._cdata not in sizes:
                    self._follow(st, created=True)
            if stats is not None and self.resets == mark:  # no op ran inside this one
                ws = peak - max(before, after)
                if ws > 0:
                    self.workspace[name] = max(self.workspace.get(name, 0), ws)
                    if max(live_before, self.cur) + ws > self.peak_ws:
                        self.peak_ws = max(live_before, self.cur) + ws
                        self.peak_ws_op = name
            if self.window is not None:
                summed = self._engine_sum(func, args, kwargs, out, origin)
                if origin != "python":
                    self.window_applied = True
                if summed is not None:  # counted when its first operand's fate is known
                    self.pending = (*summed, self.cur, name, self.n_ops)
                    return out
        self._bump()
        return out

    def close(self) -> None:
        self.settle()
        self.window = None
        self.active = False
        for f in self.finalizers:
            f.detach()
        self.finalizers.clear()


def _is_param(t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or isinstance(
        getattr(t, "_base", None), torch.nn.Parameter
    )


@dataclass
class _Saver:
    name: str
    floor: bool
    seq: int


def _grad_fns(obj: Any) -> list:
    with _NO_TORCH_FUNCTION():  # reads only (_NO_TORCH_FUNCTION's comment)
        return [t.grad_fn for t in _tensors(obj, []) if t.grad_fn]


def _walk_savers(roots: list) -> dict[int, tuple[torch.Tensor, list[_Saver]]]:
    """Storage key -> (one tensor on it, its savers), walking the graph from ``roots``."""
    found: dict[int, tuple[torch.Tensor, list[_Saver]]] = {}
    seen: set[int] = set()
    stack = list(roots)
    order: list[Any] = []
    wrapped = _copy_slices_reader()  # NOTE [How saved bytes are counted]: CopySlices' own node
    claim: dict[int, int] = {}  # id of a node a CopySlices wraps -> the CopySlices' sequence number
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        order.append(node)
        for nxt, _ in getattr(node, "next_functions", ()):
            stack.append(nxt)
        if wrapped is not None and type(node).__name__ == "CopySlices":
            inner = wrapped(node)
            if inner is not None:
                claim[id(inner)] = _seq(node)
                stack.append(inner)
    cpp_saved = getattr(_ext_module(), "node_saved", None)  # slimgrad's C++ RMSNorm node
    for node in order:
        saver = _Saver(type(node).__name__, _is_floor_node(node), claim.get(id(node), _seq(node)))
        kept = cpp_saved(node) if cpp_saved is not None else None
        for t in _node_tensors(node) if kept is None else kept:
            st = _storage(t)
            if st is None:
                continue
            entry = found.setdefault(st._cdata, (t, []))
            if all(sv.seq != saver.seq or sv.name != saver.name for sv in entry[1]):
                entry[1].append(saver)
    return found


def _copy_slices_reader() -> Callable[[Any], Any] | None:
    return getattr(_ext_module(), "copy_slices_fn", None)


def _ext_module():
    from slimgrad import _ext

    return _ext.load()


def _seq(node: Any) -> int:
    try:
        return int(node._sequence_nr())
    except (AttributeError, RuntimeError):
        return -1


# node type -> its ``_raw_saved_*`` attributes (sorted, as ``dir`` lists them)
_RAW_SAVED: dict[type, tuple[str, ...]] = {}


def _raw_saved_attrs(node: Any) -> list[str]:
    # what ``[a for a in dir(node) if a.startswith("_raw_saved_")]`` lists, without building and
    # sorting every attribute name per node: the type's, read once, and the instance's own
    cls = type(node)
    names = _RAW_SAVED.get(cls)
    if names is None:
        names = _RAW_SAVED[cls] = tuple(a for a in dir(cls) if a.startswith("_raw_saved_"))
    own = getattr(node, "__dict__", None)
    if own:
        extra = [a for a in own if type(a) is str and a.startswith("_raw_saved_")]
        if extra:
            return sorted({*names, *extra})
    return list(names)


def _node_tensors(node: Any):
    for attr in _raw_saved_attrs(node):
        try:
            raw = getattr(node, attr)
        except RuntimeError:  # freed (retain_graph=False after a backward)
            continue
        raws = raw if isinstance(raw, (list, tuple)) else (raw,)
        if any(r is not None and getattr(r, "unpack_hook", None) is not None for r in raws):
            # packed by someone's hooks: unpacking could recompute (checkpoint); count the tensors
            # the packed objects hold themselves (e.g. save_on_cpu's copies), without unpacking
            for r in raws:
                try:
                    packed = r.data
                except (RuntimeError, AttributeError):
                    continue
                for t in tree_flatten(packed)[0]:
                    if isinstance(t, torch.Tensor):
                        yield t
            continue
        public = "saved_tensors" if attr == "_raw_saved_tensors" else attr.replace("_raw", "", 1)
        try:
            val = getattr(node, public)
        except RuntimeError:
            continue
        for t in tree_flatten(val)[0]:
            if isinstance(t, torch.Tensor):
                yield t
    if getattr(type(node), "_forward_cls", None) is not None:
        for v in vars(node).values() if hasattr(node, "__dict__") else ():
            for t in tree_flatten(v)[0]:
                if isinstance(t, torch.Tensor):
                    yield t


class _ModuleClaims:
    """Module path of each graph node created inside a module's forward (by sequence number)."""

    def __init__(self, module: torch.nn.Module | None):
        self.owner: dict[int, str] = {}
        self.bounds: list[set[int]] = []
        self.handles = []
        if module is None:
            return
        for name, mod in module.named_modules():
            path = name or type(module).__name__

            def pre(_m, args, kwargs):
                self.bounds.append({_seq(n) for n in _grad_fns((args, kwargs))})

            def post(_m, args, kwargs, out, path=path):
                bound = self.bounds.pop() if self.bounds else set()
                self._claim(_grad_fns(out), bound, path)

            # they keep graph nodes' sequence numbers, never a tensor: a module they watch may
            # still write over its input (NOTE [Forward ownership from stated structure])
            pre._slimgrad_keeps_no_tensor = post._slimgrad_keeps_no_tensor = True

            self.handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
            self.handles.append(mod.register_forward_hook(post, with_kwargs=True, always_call=True))

    def _claim(self, roots: list, bound: set[int], path: str) -> None:
        # walk the module's own subgraph (down to its inputs' nodes), through nodes that inner
        # modules already claimed, and claim the rest
        stack = list(roots)
        seen: set[int] = set()
        while stack:
            node = stack.pop()
            if node is None or not hasattr(node, "next_functions"):
                continue
            seq = _seq(node)
            if seq < 0 or seq in bound or seq in seen:
                continue
            seen.add(seq)
            if type(node).__name__ == "AccumulateGrad":
                continue
            self.owner.setdefault(seq, path)
            stack.extend(n for n, _ in node.next_functions)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def measure(
    forward: Callable[[], torch.Tensor],
    *,
    backward: bool = True,
    grad: torch.Tensor | None = None,
    module: torch.nn.Module | None = None,
    timeline: bool = True,
    workspace: Any = None,
) -> StepMemory:
    """Run one step under the exact tracker and return its byte counts.

    Args:
        forward: zero-argument callable that runs the forward and returns the output (usually the
            loss).
        backward: also run ``out.backward(grad)`` under the tracker.
        grad: the gradient of ``out``; None requires a scalar output.
        module: the model, to attribute saved bytes to module paths (``by_module``) and to
            recognise its parameters. Attribution installs forward hooks on every module; they
            keep no tensor and say so, so a module they watch writes over its input in forward as
            in an unwatched step (``slimgrad.ownership.owns_input``). A converted block that
            calls its children's weights directly while no hook is on them (``GatedMLP``'s
            straight path: eager's ops for the gate, up and down projections and the activation)
            calls the children themselves once they carry these hooks, as it does for any hook,
            so that each child's forward runs: its saved bytes are then those of the converted
            children (a slimgrad activation keeps its output and bits, not x), which can differ
            from the unwatched step's. Measure without ``module`` for the figures of the step
            as it runs unwatched.
        timeline: keep the per-op timeline (``StepMemory.timeline``).
        workspace: also attribute each op's intra-op workspace from an allocator's counters
            (NOTE [Intra-op workspace]): ``"cuda"`` for the CUDA caching allocator
            (:class:`CudaAllocatorStats`), or an object with ``current()``, ``peak()`` and
            ``reset_peak()``; fills ``workspace_bytes`` and ``peak_with_workspace_bytes`` and
            leaves every other figure as without it. None: off.

    Returns:
        A :class:`StepMemory`; every figure is in bytes above what was live before the step.
        Tensors a library caches on first use (lookup tables, RNG buffers) count in the step that
        creates them: run one step before measuring for steady-state figures.

    Raises:
        TypeError: ``forward`` did not return a tensor.
        ValueError: ``backward=True`` with a non-scalar output and no ``grad``.

    Example:
        >>> lin = torch.nn.Linear(64, 64)
        >>> x = torch.randn(32, 64)
        >>> m = measure(lambda: lin(x).relu().sum(), module=lin)
        >>> m.saved_bytes  # the ReLU output, 32*64*4
        8192
    """
    if workspace == "cuda":
        workspace = CudaAllocatorStats()
    elif workspace is not None and not all(
        callable(getattr(workspace, m, None)) for m in ("current", "peak", "reset_peak")
    ):
        raise TypeError(
            "slimgrad.memory.measure: workspace must be 'cuda' or an allocator-stats object; "
            "expected one with current(), peak() and reset_peak(), got "
            f"{type(workspace).__name__}. Pass workspace='cuda' on a CUDA device."
        )
    from slimgrad import ownership

    tracker = _Tracker(workspace)
    mods = _ModuleClaims(module)
    refused_before = ownership.refused_writes()
    param_keys: set[int] = set()
    if module is not None:
        for p in module.parameters():
            st = _storage(p)
            if st is not None:
                param_keys.add(st._cdata)
    orig_resize = torch.UntypedStorage.resize_

    def resize_(st, size):
        r = orig_resize(st, size)
        tracker.note_resize(st)
        return r

    torch.UntypedStorage.resize_ = resize_
    try:
        with tracker:
            out = forward()
            if not isinstance(out, torch.Tensor):
                raise TypeError(
                    "slimgrad.memory.measure: forward must return a tensor (the loss); expected "
                    f"torch.Tensor, got {type(out).__name__}. Return the loss from forward."
                )
            tracker.settle()
            forward_peak = tracker.peak
            retained = tracker.cur
            backward_start = tracker.n_ops
            snap = _snapshot(tracker, out, mods.owner, param_keys)
            if backward:
                if grad is None and out.numel() != 1:
                    raise ValueError(
                        "slimgrad.memory.measure: backward needs a scalar output or grad=; "
                        f"expected numel 1, got shape {tuple(out.shape)}. Pass "
                        "grad=torch.ones_like(out) or reduce the output."
                    )
                if out.requires_grad:
                    out.backward(grad)
            del out
            tracker.settle()
            tracker.window = None
        end = tracker.cur
    finally:
        torch.UntypedStorage.resize_ = orig_resize
        tracker.close()
        mods.remove()
    if tracker.peak_index <= backward_start:
        phase = "forward"
    else:
        phase = "backward"
    return StepMemory(
        peak_bytes=tracker.peak,
        forward_peak_bytes=forward_peak,
        retained_bytes=retained,
        end_bytes=end,
        peak_op=tracker.peak_op,
        peak_phase=phase,
        timeline=tracker.timeline if timeline else [],
        n_ops=tracker.n_ops,
        backward_start=backward_start,
        **snap,
        workspace_bytes=dict(sorted(tracker.workspace.items())),
        peak_with_workspace_bytes=None if workspace is None else max(tracker.peak, tracker.peak_ws),
        peak_with_workspace_op=tracker.peak_op
        if tracker.peak_ws <= tracker.peak
        else tracker.peak_ws_op,
        writes_refused={
            k: n - refused_before.get(k, 0)
            for k, n in ownership.refused_writes().items()
            if n > refused_before.get(k, 0)
        },
    )


def _snapshot(
    tracker: _Tracker, out: torch.Tensor, owner: dict[int, str], param_keys: set[int]
) -> dict:
    roots = [out.grad_fn] if out.grad_fn is not None else []
    found = _walk_savers(roots) if roots else {}
    saved: list[SavedStorage] = []
    by_node: dict[str, int] = {}
    by_module: dict[str, int] = {}
    by_dtype: dict[str, int] = {}
    totals = {"step": 0, "input": 0, "param": 0}
    floor = floor_input = 0
    for key, (t, savers) in found.items():
        if key in tracker.created:
            kind = "step"
        elif key in param_keys or _is_param(t):
            kind = "param"
        else:
            kind = "input"
        nbytes = tracker.sizes.get(key)
        if nbytes is None:  # never seen by the mode (e.g. made before the step, never an op input)
            nbytes = t.untyped_storage().nbytes()
        earliest = min(savers, key=lambda sv: sv.seq)
        s = SavedStorage(
            nbytes=nbytes,
            dtype=str(t.dtype).replace("torch.", ""),
            shape=tuple(t.shape),
            kind=kind,
            module=owner.get(earliest.seq, ""),
            savers=[sv.name for sv in savers],
            floor=kind == "step" and any(sv.floor for sv in savers),
        )
        saved.append(s)
        totals[kind] += nbytes
        if kind == "input" and any(sv.floor for sv in savers):
            floor_input += nbytes
        if kind != "step":
            continue
        if s.floor:
            floor += nbytes
        first = next((sv.name for sv in savers if sv.floor), savers[0].name)
        by_node[first] = by_node.get(first, 0) + nbytes
        by_module[s.module] = by_module.get(s.module, 0) + nbytes
        by_dtype[s.dtype] = by_dtype.get(s.dtype, 0) + nbytes
    saved.sort(key=lambda s: (-s.nbytes, s.kind, s.module, s.savers, s.shape, s.dtype))
    return {
        "saved_bytes": totals["step"],
        "saved_input_bytes": totals["input"],
        "saved_param_bytes": totals["param"],
        "floor_bytes": floor,
        "floor_input_bytes": floor_input,
        "by_node": dict(sorted(by_node.items())),
        "by_module": dict(sorted(by_module.items())),
        "by_dtype": dict(sorted(by_dtype.items())),
        "saved": saved,
    }


# NOTE [Estimating what CUDA kernels keep]
# ``estimate(..., device="cuda")`` gives the figures of the same step on a CUDA device without
# one. Fake CUDA tensors can be created on a CPU-only PyTorch, but autograd on them aborts the
# process ("PyTorch is not linked with support for cuda devices", from the device guard), so the
# step runs on fake *CPU* tensors that stand for CUDA ones, and the ops whose CUDA kernel keeps
# something else than the CPU kernel are routed to the op CUDA would run. Those ops are real aten
# ops with meta kernels: their autograd node is the one from PyTorch's
# ``tools/autograd/derivatives.yaml``, so what is kept is PyTorch's own formula, not a copy of it:
#
# - ``F.scaled_dot_product_attention`` (``CompositeImplicitAutograd``; CUDA picks a backend in
#   ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``, default order flash, memory-
#   efficient, math, each only if enabled by ``torch.backends.cuda.*_sdp_enabled()``):
#     * flash (float16/bfloat16, no ``attn_mask``, head dim <= 256, not padded here):
#       ``_scaled_dot_product_flash_attention``; derivatives.yaml passes query, key, value, output,
#       logsumexp (B x H x T, fp32), cum_seq_q/k (undefined for dense inputs) and rng_state
#       (philox seed + offset) to its backward: those are kept.
#     * memory-efficient (float16/bfloat16/float32, masks allowed):
#       ``_scaled_dot_product_efficient_attention`` keeps query, key, value, attn_bias, output,
#       log_sumexp (B x H x ceil(T/32)*32, fp32), philox_seed and philox_offset. A bool mask is
#       first made an additive float mask in the query's dtype, as ``convert_boolean_attn_mask``
#       does, and that (B x 1 x T x S, padded to a multiple of 16 in S as ``preprocess_mask``
#       does) is the attn_bias kept.
#     * math (float64 or a backend-disabling setting): ``_scaled_dot_product_attention_math``
#       composed in Python with CUDA's dropout: q and k scaled by sqrt(scale), S = q k^T, causal or
#       given mask added, softmax (``_safe_softmax``), ``native_dropout``, @ V: it keeps the
#       scaled q and k, P, the bool dropout mask and the dropped P (T x T each).
#   The cuDNN backend (``_scaled_dot_product_cudnn_attention``: the same q, k, v, out, logsumexp +
#   philox seed/offset) is not chosen: by PyTorch's default order it comes after flash and
#   memory-efficient, which take every case it takes here. GQA (``enable_gqa`` with fewer kv
#   heads) goes to flash when it qualifies, else to math (memory-efficient has no GQA).
# - ``F.dropout`` out of place, training, 0 < p < 1: CUDA runs ``native_dropout`` (its autograd
#   keeps a bool mask, 1 byte/elt) where CPU's ``at::dropout`` keeps a noise tensor in the input's
#   dtype (``is_fused_kernel_acceptable`` in ``aten/src/ATen/native/Dropout.cpp`` is CUDA/XPU/lazy
#   only). The in-place ``dropout_`` is unfused on CUDA too: not routed.
# - ``native_layer_norm`` of a float16/bfloat16 input: CUDA's kernel returns (and autograd keeps)
#   mean and rstd in float32; CPU's in the input's dtype (``torch._refs.native_layer_norm``).
# Not modelled (the CPU figures stand): ``cudnn_batch_norm``'s reserve space (cuDNN-sized; its
# other saved tensors match ``native_batch_norm``'s), ``_fused_rms_norm`` (``F.rms_norm`` on CUDA:
# keeps input + fp32 rstd; on fake CPU it decomposes and keeps the composite's intermediates, so the
# eager figure is an over-estimate there), cuBLAS/cuDNN workspaces, and the caching allocator's
# rounding (the figures are tensor bytes; ``torch.cuda.max_memory_allocated`` rounds each block up
# to 512 bytes). slimgrad's own ops keep their docstring contract on every device; the estimate
# runs their PyTorch path. Call-time checks that depend on the device (the HF attention's device
# rule) see CUDA through ``convert_handlers.device_rule.stands_for``.

#
# NOTE [Routing in backward]
# A torch-function mode is popped while its own handler runs, and ``out.backward()`` reaches the
# engine through the modes' handlers (``Tensor.backward`` is overridable): called plainly, the
# whole backward ran without the routing above. A checkpointed region (``torch.utils.checkpoint``
# non-reentrant, HF ``gradient_checkpointing_enable``) recomputes its forward in backward, so its
# recompute ran CPU's SDPA and dropout where its forward had run CUDA's and saved a different
# number of tensors ("CheckpointError: A different number of tensors was saved"; the estimate
# failed for every checkpointed model with attention or dropout). So ``_CudaFunctions`` runs
# ``Tensor.backward`` itself, with the mode pushed back: ``autograd.backward``'s steps
# (``_make_grads``, then the engine), and the recompute is routed as the forward was.

#: devices ``estimate`` models: ``cpu`` (the kernels of the running PyTorch) and ``cuda``
DEVICES = ("cpu", "cuda")


def _cuda_sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    aten = torch.ops.aten
    cuda = torch.backends.cuda
    dt = query.dtype
    gqa = bool(enable_gqa) and query.shape[-3] != key.shape[-3]
    dims = query.dim() == key.dim() == value.dim() == 4
    head = query.shape[-1]
    same_head = head == key.shape[-1] == value.shape[-1]
    if (
        cuda.flash_sdp_enabled()
        and dims
        and same_head
        and dt in (torch.float16, torch.bfloat16)
        and attn_mask is None
        and head <= 256
        and head % 8 == 0
    ):
        out = aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, scale=scale
        )
        return out[0]
    if (
        cuda.mem_efficient_sdp_enabled()
        and dims
        and not gqa
        and dt in (torch.float16, torch.bfloat16, torch.float32)
        and not (is_causal and attn_mask is not None)
    ):
        bias = attn_mask
        if bias is not None:
            if bias.dtype == torch.bool:  # convert_boolean_attn_mask: -inf where False
                bias = torch.zeros(bias.shape, dtype=dt).masked_fill(~bias, float("-inf"))
            bias = bias.to(dt)
            s = bias.shape[-1]
            if s % 16:  # preprocess_mask / pad_bias: aligned storage, sliced view
                bias = torch.nn.functional.pad(bias, (0, 16 - s % 16))[..., :s]
            shape = (*query.shape[:-1], key.shape[-2])
            bias = bias.expand(shape)
        need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        out = aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, need_lse, dropout_p, is_causal, scale=scale
        )
        return out[0]
    return _cuda_sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale, gqa)


def _cuda_sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale, gqa):
    # aten's _scaled_dot_product_attention_math, with CUDA's dropout (native_dropout)
    if gqa:
        rep = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(rep, -3)
        value = value.repeat_interleave(rep, -3)
    scale = scale if scale is not None else 1.0 / query.shape[-1] ** 0.5
    root = scale**0.5
    attn = torch.matmul(query * root, key.transpose(-2, -1) * root)
    if is_causal:
        attn_mask = torch.ones(attn.shape[-2:], dtype=torch.bool).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=attn.dtype).masked_fill(
                ~attn_mask, float("-inf")
            )
        attn = attn + attn_mask
    attn = torch.ops.aten._safe_softmax(attn, -1)
    if dropout_p > 0.0:
        attn = torch.ops.aten.native_dropout(attn, dropout_p, True)[0]
    return torch.matmul(attn, value)


def _cuda_dropout(input, p=0.5, training=True, inplace=False):
    if training and not inplace and 0.0 < p < 1.0 and input.numel() > 0:
        return torch.ops.aten.native_dropout(input, p, True)[0]
    return None


def _backward_here(t, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    # ``Tensor.backward`` past its torch-function check: autograd.backward's own steps
    grads = torch.autograd._make_grads((t,), (gradient,), is_grads_batched=False)
    if retain_graph is None:
        retain_graph = create_graph
    torch.autograd.graph._engine_run_backward(
        (t,), grads, retain_graph, create_graph, (), allow_unreachable=True, accumulate_grad=True
    )


class _CudaFunctions(torch.overrides.TorchFunctionMode):
    # routes the Python-level ops whose CUDA kernel keeps something else (NOTE [Estimating what
    # CUDA kernels keep])
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.backward and kwargs.get("inputs") is None:
            # NOTE [Routing in backward]
            with self:
                return _backward_here(*args, **kwargs)
        if func is torch.nn.functional.scaled_dot_product_attention:
            return _cuda_sdpa(*args, **kwargs)
        if func is torch.nn.functional.dropout or func is torch.dropout:
            names = ("input", "p", "training", "inplace")
            if func is torch.dropout:
                names = ("input", "p", "train")
            bound = dict(zip(names, args), **kwargs)
            if "train" in bound:
                bound["training"] = bound.pop("train")
            out = _cuda_dropout(**bound)
            if out is not None:
                return out
        return func(*args, **kwargs)


_GROUPED_MM_DTYPES = (torch.float16, torch.float32, torch.float64)
_GROUPED_MM = getattr(getattr(torch.ops.aten, "_grouped_mm", None), "default", None)


def _grouped_mm_out(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    # the output of aten._grouped_mm (shapes as _create_grouped_mm_output_tensor in
    # torch/_meta_registrations.py), rows padded to 16 bytes as the CPU and CUDA kernels pad them
    if a.dim() == 2 and b.dim() == 2:
        shape = (offs.size(0), a.size(0), b.size(1))
    elif a.dim() == 2:
        shape = (a.size(0), b.size(-1))
    elif b.dim() == 2:
        shape = (a.size(1), b.size(1))
    else:
        shape = (a.size(0), a.size(1), b.size(-1))
    align = 16 // a.dtype.itemsize
    row = -(-shape[-1] // align) * align
    stride = (row, 1) if len(shape) == 2 else (shape[1] * row, row, 1)
    return torch.empty_strided(shape, stride, dtype=a.dtype)


# NOTE [Index tensors keep their values under fake tensors]
# A model's code branches on the values of index tensors it makes itself: HF's mask builder
# (transformers.masking_utils.find_packed_sequence_indices) asks whether ``position_ids``, an
# ``arange``, holds one sequence per row, and skips the 4-D causal mask when it does, but only
# when the tensor is not a FakeTensor (HF's ``is_tracing``). Under fake tensors every such step
# took the masked branch the real step does not take: a (B, 1, T, T) mask saved by SDPA and, with
# grouped-query attention, ``repeat_kv``'s copies of k and v instead of ``enable_gqa`` (a 4-layer
# HF Llama, 128 wide, 2 x 128 tokens, use_cache=False: estimated 9,243,148 B against the real
# step's 8,194,572). So under :func:`fake_tensors` an op whose tensor arguments are all real CPU
# integer or bool tensors of at most ``_VALUE_NUMEL`` elements, or an integer ``arange``, runs on
# real tensors when its results are such tensors too: their values are known without the data
# (positions, offsets, lengths), and code that branches on them takes the real step's branch.
# Random ops, ``torch.tensor`` literals (kept fake, with their ``constant``) and anything with a
# fake, floating or larger argument or result run on fake tensors as before; those hold no bytes
# worth modelling differently, and the tracker counts a real result's storage as a fake one's.
_VALUE_NUMEL = 1 << 16
_INDEX_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_ARANGE = (
    torch.ops.aten.arange.default,
    torch.ops.aten.arange.start,
    torch.ops.aten.arange.start_step,
)
_LIFT = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


def _index_values(ts: list) -> bool:
    return all(
        type(t) is torch.Tensor
        and t.device.type == "cpu"
        and t.dtype in _INDEX_DTYPES
        and t.numel() <= _VALUE_NUMEL
        for t in ts
    )


def _other_tensor(obj) -> bool:
    # whether ``obj`` holds a tensor that is not an index tensor where ``tree_flatten`` finds it
    # too (plain tuples, lists and dicts: it flattens each of them), so that ``_known_values``
    # returns None for it; False says nothing (the flatten decides)
    if isinstance(obj, torch.Tensor):
        return not _index_values((obj,))
    if type(obj) is tuple or type(obj) is list:
        return any(_other_tensor(a) for a in obj)
    if type(obj) is dict:
        return any(_other_tensor(a) for a in obj.values())
    return False


# op overload -> whether it may run on real values (not a lift, not seeded random), at first call
_VALUE_OPS: dict[Any, bool] = {}


def _known_values(func, args, kwargs):
    # NOTE [Index tensors keep their values under fake tensors]: the real result, or None
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    may = _VALUE_OPS.get(func)
    if may is None:
        may = _VALUE_OPS[func] = not (
            func in _LIFT or torch.Tag.nondeterministic_seeded in func.tags
        )
    if not may:
        return None
    with _NO_TORCH_FUNCTION():  # reads only (_NO_TORCH_FUNCTION's comment)
        if _other_tensor(args) or _other_tensor(kwargs):  # the common case, without a flatten
            return None
        flat = tree_flatten((args, kwargs))[0]
        ts = [a for a in flat if isinstance(a, torch.Tensor)]
        if ts:
            if not _index_values(ts):
                return None
        elif func not in _ARANGE or torch.device(kwargs.get("device") or "cpu").type != "cpu":
            return None
    with unset_fake_temporarily():
        out = func(*args, **kwargs)
    with _NO_TORCH_FUNCTION():
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        return out if _index_values(outs) else None


# NOTE [Fake tensors model the CPU conv backward's outputs]
# aten's ``convolution_backward`` (ATen/native/Convolution.cpp) picks a backend with
# ``select_conv_backend`` and returns what that backend returns. oneDNN's (``Mkldnn`` and
# ``MkldnnTranspose``: ``mkldnn_convolution_backward`` and its transposed twin in
# ATen/native/mkldnn/Conv.cpp) computes the weight and bias gradients in one primitive
# (``convolution_backward_weights``), so whenever the bias gradient is asked (``output_mask[2]``)
# it returns a weight gradient too, asked for or not, and convolution_backward hands it on. The
# caller drops it (eager's ConvolutionBackward0 under a frozen weight; before NOTE [The bias
# gradient with dW] in ops/conv.py, the dx call of its derived-input path, which now asks dx
# alone), but it is an output: the tracker counts a weight-sized tensor
# for that op, and where the op sets the peak the real step's peak was above the estimate by the
# weight's bytes, since the fake (meta) kernel returns only what the mask asks (Conv-BN-ReLU x3,
# 3x3 convs of 8 channels at 2x3x9x7, converted: 12,616 B real, 10,312 B estimated). The other CPU
# backends (Slow2d/3d, SlowDilated2d/3d, SlowTranspose2d/3d, NNPACK, Empty) return what the mask
# asks. So under fake tensors on CPU a convolution_backward that asks the bias gradient and not the
# weight's asks both where the real call takes oneDNN, and the caller drops the weight gradient as
# the real one does. The backend is torch's own choice: ``torch._C._select_conv_backend``, the
# selector convolution_backward calls, given the same input, weight, parameters and bias sizes, so
# it reads what the kernel reads (dtype, sizes, layout, groups, stride, dilation, transposed,
# whether oneDNN is built and enabled in ``torch.backends.mkldnn``, the thread count of its 1x1
# rule: estimate with the thread count the real step will have). The binding derives
# ``need_backward`` from grad mode, which only admits XNNPACK and Winograd, inference-only
# backends chosen after oneDNN. ``MkldnnTranspose`` has no Python name (torch/csrc/Module.cpp binds
# the others of ConvUtils.h's ``ConvBackend``): it is the value after ``Mkldnn``, taken only while
# ``MkldnnEmpty`` is the one after it. Without the selector (a private binding) or with another
# enum layout, the estimate keeps the meta kernel's outputs (a peak up to one weight below the real
# step's where such a call sets it), and ``slimgrad env`` names the feature off.
# CUDA (``estimate(device="cuda")``): cuDNN and the 2-d depthwise kernel are handed a two-entry
# mask and the bias gradient is ``grad_output.sum`` (Convolution.cpp), so they return what the mask
# asks, as the meta kernel does, and nothing is added; the 3-d depthwise and slow CUDA kernels are
# taken to do the same (not checked on a device). Not modelled on either device, and not seen by
# the tracker on either side: what a backend allocates and frees inside the call (x and the
# gradient made contiguous in its memory format, oneDNN's reorders, the slow backends' per-group
# slices, cuDNN's workspace: NOTE [Intra-op workspace]).
_CONV_BWD = torch.ops.aten.convolution_backward.default
_CONV_BWD_ARGS = tuple(a.name for a in _CONV_BWD._schema.arguments)


def _onednn_backends() -> frozenset[int] | None:
    select = getattr(torch._C, "_select_conv_backend", None)
    kinds = getattr(torch._C, "_ConvBackend", None)
    members = getattr(kinds, "__members__", {})
    if select is None or "Mkldnn" not in members or "MkldnnEmpty" not in members:
        return None
    mkldnn, empty = int(members["Mkldnn"]), int(members["MkldnnEmpty"])
    if empty != mkldnn + 2 or any(int(v) == mkldnn + 1 for v in members.values()):
        return None
    return frozenset((mkldnn, mkldnn + 1))  # Mkldnn, MkldnnTranspose


_ONEDNN_BACKENDS = _onednn_backends()


def _conv_bwd_args(args: tuple, kwargs: dict) -> dict:
    bound = dict(zip(_CONV_BWD_ARGS, args))
    bound.update(kwargs)
    return bound


def _onednn_backward(bound: dict) -> bool:
    # NOTE [Fake tensors model the CPU conv backward's outputs]: whether the real call takes oneDNN
    if _ONEDNN_BACKENDS is None:
        return False
    try:
        backend = torch._C._select_conv_backend(
            bound["input"],
            bound["weight"],
            None,
            bound["stride"],
            bound["padding"],
            bound["dilation"],
            bound["transposed"],
            bound["output_padding"],
            bound["groups"],
            bound["bias_sizes"],
        )
    except (RuntimeError, TypeError):  # the op itself reports what is wrong with its arguments
        return False
    return int(backend) in _ONEDNN_BACKENDS


class _KernelDispatch(TorchDispatchMode):
    # aten-level differences between fake kernels and the modelled device's kernels:
    # - ``_grouped_mm``'s meta kernel checks CUDA's bf16-only rule, which CPU's kernel (and CUDA's
    #   fallback) does not have: another float dtype gets the meta's output shape in the input's
    #   dtype, its rows padded to 16 bytes (CPU's kernel pads them too: a 6 x 5 float32 output
    #   has strides (8, 1); the meta pads only in a CUDA build);
    # - CUDA's layer norm keeps float32 statistics for half inputs (NOTE [Estimating what CUDA
    #   kernels keep]);
    # - CPU's oneDNN convolution backward returns a weight gradient with every bias gradient
    #   (NOTE [Fake tensors model the CPU conv backward's outputs]).

    # computes every op it sees as asked, storing no result it could hand back in place of a
    # later call's: NOTE [The down product after the saves] in slimgrad/ops/gated_mlp.py
    _slimgrad_reads_ops = True

    def __init__(self, cuda: bool) -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (known := _known_values(func, args, kwargs)) is not None:
            return known
        if func is _GROUPED_MM and kwargs.get("out_dtype") is None:
            a, b = args[0], args[1]
            offs = args[2] if len(args) > 2 else kwargs.get("offs")
            if a.dtype == b.dtype and a.dtype in _GROUPED_MM_DTYPES:
                return _grouped_mm_out(a, b, offs)
        if func is _CONV_BWD and not self.cuda:
            # NOTE [Fake tensors model the CPU conv backward's outputs]
            bound = _conv_bwd_args(args, kwargs)
            mask = bound["output_mask"]
            if mask[2] and not mask[1] and _onednn_backward(bound):
                bound["output_mask"] = [mask[0], True, True]
                return func(*(bound[name] for name in _CONV_BWD_ARGS))
        out = func(*args, **kwargs)
        if self.cuda and func is torch.ops.aten.native_layer_norm.default:
            y, mean, rstd = out
            if mean.dtype in (torch.float16, torch.bfloat16):
                return y, mean.float(), rstd.float()
        return out


# NOTE [Building a model under fake tensors]
# ``make_forward`` builds models under ``FakeTensorMode``, and building often deep-copies one
# (``convert_(copy.deepcopy(model))``, the bench cases' slimgrad side) and places it (``.to``).
# Three things in PyTorch break there, and :func:`fake_tensors` routes around them:
#
# - A ``FakeTensor`` is cloned (its fake storage has data pointer 0), then its whole ``__dict__``
#   is deep-copied: that includes ``fake_mode``, so the copy gets its *own* ``FakeTensorMode``
#   (with deep copies of its caches, ShapeEnv and converter memo: C++ objects and storages copied
#   as bytes), and the two models' tensors belong to different modes. On torch 2.13 (CPU) this
#   segfaulted the interpreter in resnet50's slimgrad side; the first GPU run (torch 2.11)
#   segfaulted in the same kind of build (resnet50_inplace_abn, hf_gpt2; not re-run there).
# - ``__dict__`` also holds ``constant``: the real tensor behind a small fake one (BatchNorm's
#   ``num_batches_tracked = torch.tensor(0)``). A real tensor is copied by storage:
#   ``new_empty([])`` under the fake mode is a fake (meta) tensor, and ``set_`` of it to the
#   copied CPU storage raises "Attempted to set the storage of a tensor on device "meta" to a
#   storage on different device "cpu"" (resnet50, either side: its copy is made to build the
#   case).
#
# - ``Module.to``/``.float()``/``.double()`` (``Module._apply``) always *swaps* a fake parameter
#   with its converted copy (``torch.utils.swap_tensors``), even when nothing changes, and the swap
#   refuses a tensor that has a weak reference, which every fake parameter has (PyTorch's
#   fake-tensor bookkeeping holds one): "_apply(): Couldn't swap Linear.weight" for any module
#   made under fake tensors and then placed (the attention, bn_relu_chain and conv_frozen cases).
#
# So a fake tensor is cloned in its own mode (``clone`` gives the copy fresh fake internals,
# ``constant`` included) and only the attributes a fresh fake tensor does not have (user
# attributes, ``_is_param``) are deep-copied; a real tensor (a constant, a captured table) is
# deep-copied with the fake mode set aside, so it stays real, as the original is. PyTorch's own
# ``FakeCopyMode`` is not used: it returns a fake tensor as it is, so the copy would share the
# original's buffers and parameters. While building, the swap of two fake tensors of one mode on
# one device is ``t1.data = t2`` (what ``_apply`` does for real tensors), and a no-op when ``t2`` is
# ``t1``; any other swap is PyTorch's.


def _fake_deepcopy(t: torch.Tensor, memo: dict) -> torch.Tensor:
    import copy

    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    if id(t) in memo:
        return memo[id(t)]
    if not isinstance(t, FakeTensor):
        with unset_fake_temporarily():
            new = torch.Tensor.__deepcopy__(t, memo)
        memo[id(t)] = new
        return new
    if not t.is_leaf:
        raise RuntimeError(
            "slimgrad.memory.fake_tensors: deepcopy of a tensor that is not a graph leaf; "
            f"expected a leaf (a parameter or buffer), got one made by {type(t.grad_fn).__name__}. "
            "Copy the model before running it."
        )
    with torch.no_grad():
        new = t.clone(memory_format=torch.preserve_format)
    memo[id(t)] = new
    if t.requires_grad:
        new.requires_grad_()
    if t.grad is not None:
        new.grad = _fake_deepcopy(t.grad, memo)
    fresh = set(new.__dict__)
    for k, v in t.__dict__.items():
        if k not in fresh:
            setattr(new, k, copy.deepcopy(v, memo))
    return new


class _FakeDeepcopy(torch.overrides.TorchFunctionMode):
    # NOTE [Building a model under fake tensors]
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__deepcopy__:
            return _fake_deepcopy(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _fake_swap(t1: torch.Tensor, t2: torch.Tensor, _swap=torch.utils.swap_tensors) -> None:
    from torch._subclasses.fake_tensor import FakeTensor

    fakes = isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor)
    if fakes and t1 is t2:
        return
    if fakes and t1.fake_mode is t2.fake_mode and t1.device == t2.device and type(t1) is type(t2):
        with torch.no_grad():
            t1.data = t2
        return
    _swap(t1, t2)


@contextlib.contextmanager
def fake_tensors(device: str = "cpu"):
    """The ``FakeTensorMode`` :func:`estimate` runs under, for building models and inputs.

    Real tensors may be mixed in (slimgrad's constant tables), and ``copy.deepcopy`` of a model
    made under it gives an independent fake copy, and ``module.to(dtype)`` works (NOTE [Building
    a model under fake tensors]).

    Args:
        device: whose kernels the fake ones stand for (``"cpu"`` or ``"cuda"``; :func:`estimate`
            adds the CUDA routing of Python-level ops).

    Raises:
        NotImplementedError: inside it, an output's size depended on tensor values.

    Example:
        >>> import copy
        >>> with fake_tensors():
        ...     bn = torch.nn.BatchNorm1d(4)
        ...     twin = copy.deepcopy(bn)
        >>> twin.weight is bn.weight
        False
    """
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensorMode,
    )

    swap = torch.utils.swap_tensors
    torch.utils.swap_tensors = _fake_swap
    try:
        with (
            FakeTensorMode(allow_non_fake_inputs=True) as mode,
            _KernelDispatch(device == "cuda"),
            _FakeDeepcopy(),
        ):
            yield mode
    except (DynamicOutputShapeException, DataDependentOutputException) as e:
        raise NotImplementedError(
            "slimgrad.memory.estimate: the step's sizes depend on tensor values, which fake "
            f"tensors do not have; expected value-independent shapes, got {e} (e.g. MoE "
            "routing through nonzero). Measure a real small batch with slimgrad.memory.measure "
            "instead."
        ) from e
    finally:
        torch.utils.swap_tensors = swap


def estimate(make_forward: Callable[[], Any], *, device: str = "cpu", **kwargs) -> StepMemory:
    """:func:`measure` under ``FakeTensorMode``: the same figures without allocating or computing.

    Args:
        make_forward: zero-argument callable, run under fake tensors, that builds the model and
            inputs (on CPU) and returns the ``forward`` callable for :func:`measure`, or a
            ``(forward, module)`` pair. A model whose constructor reads tensor values (timm's
            RegNet, ConvNeXt, ViT) is built before, on real tensors, and returned as ``module``:
            its parameters' ``.grad`` are put back after the step (NOTE [A model built outside
            the estimate]).
        device: whose kernels to model, one of :data:`DEVICES`. ``"cuda"``: the CPU tensors stand
            for CUDA tensors and the ops whose CUDA kernels keep something else run as those
            kernels would (fused SDPA, fused dropout, float32 layer-norm statistics; NOTE
            [Estimating what CUDA kernels keep]); no GPU is needed. ``convert_`` called inside
            ``make_forward`` decides for CUDA (the device rule).
        **kwargs: passed to :func:`measure`.

    Returns:
        The :class:`StepMemory` the real step would have, exact unless the model's code branches on
        fake tensors (as HF's causal-mask construction can) or a slimgrad side table whose length
        depends on values holds entries in the real step: fake tensors have no values, so each such
        table is estimated empty, the usual case (NOTE [Side tables under FakeTensorMode and
        torch.compile] in ``slimgrad/_math/tables.py``). A smooth activation's hard elements
        (8 B each in float32: the value and its int32 index) and a norm's fallback channels are
        such tables; a real step that fills one keeps those bytes more than its estimate.

    Raises:
        ValueError: ``device`` is not one of :data:`DEVICES`.
        NotImplementedError: an output's size depends on tensor values (``nonzero``, boolean
            indexing, ``.item()``), e.g. MoE routing: no exact estimate exists; or
            ``make_forward``'s build reads tensor values (build the model outside it).
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from slimgrad.convert_handlers.device_rule import stands_for

    kind = device.type if isinstance(device, torch.device) else device
    if kind not in DEVICES:
        raise ValueError(
            f"slimgrad.memory.estimate: device must be one of {list(DEVICES)}; expected a "
            f"modelled device, got {device!r}. Pass device='cuda' or device='cpu'."
        )
    cuda = kind == "cuda"
    with contextlib.ExitStack() as stack:
        mode = stack.enter_context(fake_tensors(kind))
        if cuda:
            stack.enter_context(stands_for("cuda"))
            stack.enter_context(_CudaFunctions())
        made = _build(make_forward)
        if isinstance(made, tuple):
            forward, module = made
            kwargs.setdefault("module", module)
        else:
            forward = made
        # NOTE [A model built outside the estimate]: a real model's tensors stand in as fakes
        module = kwargs.get("module")
        swapped, kept = ([], []) if module is None else _fake_in_place(module, mode)
        try:
            return measure(forward, **kwargs)
        finally:
            for slots, name, t in swapped:
                _REAL_OF.pop(id(slots[name]), None)
                slots[name] = t
            with unset_fake_temporarily(), torch.no_grad():
                for b, v in kept:
                    if not torch.equal(b, v):
                        b.copy_(v)


def _fake_in_place(module: torch.nn.Module, mode: Any) -> tuple[list, list]:
    # NOTE [A model built outside the estimate]: each real parameter and floating buffer of
    # ``module``'s tree, in its module's slot, replaced by a fake one (one per tensor: tied ones
    # stay tied); returns (slots, name, real tensor) to put back, and (buffer, copy) of the real
    # buffers that stay (index tensors) to write back
    from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

    for pname, p in module.named_parameters(remove_duplicate=True):
        if is_fake(p):
            continue
        if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
            # a stand-in without them runs another step than the real one
            raise ValueError(
                "slimgrad.memory.estimate: a model built before estimate steps on fake stand-ins "
                "of its parameters; expected parameters without tensor hooks, got "
                f"{pname!r} with hooks (e.g. step_in_backward's or "
                "register_post_accumulate_grad_hook). Estimate before registering them, or build "
                "the model (and its hooks) inside make_forward (NOTE [A model built outside the "
                "estimate])."
            )
    fakes: dict[int, torch.Tensor] = {}
    swapped, kept = [], []
    for sub in module.modules():
        for slots in (sub._parameters, sub._buffers):
            for name, t in list(slots.items()):
                if t is None or is_fake(t) or id(t) in fakes and fakes[id(t)] is t:
                    continue
                if slots is sub._buffers and not (t.is_floating_point() or t.is_complex()):
                    with unset_fake_temporarily():
                        kept.append((t, t.clone()))
                    fakes[id(t)] = t
                    continue
                fake = fakes.get(id(t))
                if fake is None:
                    fake = mode.from_tensor(t, static_shapes=True)
                    if isinstance(t, torch.nn.Parameter):
                        fake = torch.nn.Parameter(fake, requires_grad=t.requires_grad)
                        if t.grad is not None:  # accumulated into, as the real step does
                            fake.grad = mode.from_tensor(t.grad, static_shapes=True)
                        # NOTE [Real values behind the stand-ins]
                        _REAL_OF[id(fake)] = (fake, t)
                    fakes[id(t)] = fake
                swapped.append((slots, name, t))
                slots[name] = fake
    return swapped, kept


# NOTE [Real values behind the stand-ins]
# A step may pick what it keeps from its parameters' values: a slimgrad BatchNorm keeps a copy of
# the input channels whose γ, β cannot rebuild x̂ from its output (ops/batch_norm.py's bad
# channels), which fake tensors cannot tell. Estimated as "no such channel", a 32-channel
# Conv -> BatchNorm -> ReLU model built before the estimate, with one channel's |β| above |γ|/2,
# kept 1,024 B less than its real step (that channel's x at 4x8x8 float32). For a model built
# outside the estimate the real parameters are there: each Parameter's stand-in maps to it
# (``real_of``) for the step, and the BatchNorm decides from the real γ, β as the real step does
# (the same cached decision, NOTE [Decided once per parameter version] in _math/abn.py). A model
# built inside ``make_forward`` has fake parameters only: there no such channel is assumed.
_REAL_OF: dict[int, tuple] = {}  # id(a Parameter's fake stand-in) -> (stand-in, real Parameter)


def real_of(t: torch.Tensor) -> torch.Tensor | None:
    """The real Parameter that fake ``t`` stands in for during :func:`estimate` of a model built
    before it, or None (NOTE [Real values behind the stand-ins])."""
    e = _REAL_OF.get(id(t))
    return e[1] if e is not None and e[0] is t else None


# NOTE [A model built outside the estimate]
# Some constructors read tensor values while they build: timm's RegNet sizes its stages from
# ``torch.unique`` of float widths and ``.item()``, ConvNeXt and ViT take drop-path rates from
# ``torch.linspace(...).tolist()``. Fake tensors have no values, so such a build cannot run inside
# ``make_forward``; the error says so (not the step's value-dependent sizes) and names the way out:
# build the model before ``estimate``, on real tensors, and have ``make_forward`` make the inputs
# and return ``(forward, model)``. For the step each real parameter and floating buffer in the
# model's module slots is replaced by a fake one of the estimate's mode (one per tensor, so tied
# weights stay tied; a Parameter stays a Parameter), and put back afterwards: the step is the one a
# model built under fake tensors runs (a parameter's ``.grad`` has a fake stand-in too, added to as
# the real one is; parameters with tensor hooks are refused: their stand-ins would have none), and
# the real model keeps its values and ``.grad``. Integer
# and bool buffers stay real, as they are in a model built under fake tensors (HF's
# ``position_ids``, an ``arange``: NOTE [Index tensors keep their values under fake tensors]), and
# are copied first and written back where the step changed them (``num_batches_tracked``). Run on
# the real tensors instead, the step mixed them with fake ones: each use of a real parameter made a
# fake copy with a storage of its own, so a view of a weight (the head's ``weight.t()`` that addmm
# keeps, 1,472,000 B in regnety_002) counted as step bytes instead of a parameter's,
# ``num_batches_tracked`` (a small integer tensor keeps its values: NOTE [Index tensors keep their
# values under fake tensors]) was incremented for real, and the parameters were left with fake
# gradients. A tensor held elsewhere than a module slot is not replaced. The figures are the real
# step's (timm regnety_002 at 2x3x32x32, the bench case's small regnety_016, eager and converted:
# estimate = measure).
def _build(make_forward: Callable[[], Any]) -> Any:
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )

    try:
        return make_forward()
    except (DynamicOutputShapeException, DataDependentOutputException) as e:
        raise NotImplementedError(
            "slimgrad.memory.estimate: make_forward reads tensor values while it builds, which "
            f"fake tensors do not have; expected a build whose sizes need no values, got {e} "
            "(e.g. timm RegNet's torch.unique of its widths, drop-path rates from "
            "torch.linspace(...).tolist()). Build the model before estimate, on real tensors, "
            "and return (forward, model) from make_forward (NOTE [A model built outside the "
            "estimate])."
        ) from e
