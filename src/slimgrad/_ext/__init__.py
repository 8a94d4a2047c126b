"""Optional C++ extension: storage facts that PyTorch states through its public C++ API, and a few
backward bodies issued from C++.

# NOTE [Storage facts from the C++ API]
:mod:`slimgrad.ownership` needs to know who can reach a tensor's memory without making the
storage's Python object (NOTE [Storage facts without a storage object] in ownership.py explains
why making one costs a buffer). Python exposes none of these facts without making that object, so
``storage_facts.cpp`` reads them in C++, each through a public accessor of the installed torch's
headers, and :func:`facts` returns them as a tuple of ints:

0. ``at::Tensor::use_count()``: C++ handles of the TensorImpl (the argument is borrowed: the
   count is the one Python's ``t._use_count()`` reports).
1. ``c10::Storage::use_count()``: strong holders of the StorageImpl (TensorImpls sharing it, a
   kept storage object).
2. the StorageImpl's weak count (``Storage::getWeakStorageImpl().weak_use_count()``, less the
   weak pointer used to ask): raised by a C++ weak reference such as torch's ``StorageWeakRef``.
3. whether the storage has a Python object (``StorageImpl::pyobj_slot()->load_pyobj()``).
4. ``c10::Storage::nbytes()``.
5. whether the memory is torch's own: the DataPtr's deleter is the raw deleter of the allocator
   torch uses for that device type (``c10::GetAllocator(type)->raw_deleter()``). ``from_numpy``,
   ``frombuffer``, ``from_dlpack``, shared or mapped memory and pinned host memory carry other
   deleters, and another owner can read them.
6. the StorageImpl's address, as an identity (two tensors share memory iff they share it).

``backward_facts(t, kind)`` asks, in the same call as those facts, the per-call terms a backward's
question needs first (grad mode, the graph task, functorch, a gradient's Python weak references, a
saved tensor's kept graph: NOTE [One call per backward question] in ownership.py), and
``watchers()`` reads the five C++ facts behind ``slimgrad._library.straight`` (dispatch and
function modes, functorch, TorchScript tracing, the profiler: NOTE [One-call gate] there), each
what torch's own Python binding returns. ``view_base(t)`` asks term 2b's questions about a view
gradient's base in one call (NOTE [View gradients asked in C++] in ownership.py), and
``norm_key(weight, bias)`` reads the facts the fallback channels are cached by (NOTE [Fallback
channels, once per weight version] in slimgrad/_math/norms.py).

The same module has ``call_origin``, for slimgrad.memory's tracker only (never on a converted
step's path): whether the op being counted was called by C++ code the autograd engine runs, by a
custom Function's Python backward or by other Python code, read from the Python frames below
``__torch_dispatch__`` with CPython's public frame API (PyEval_GetFrame, PyFrame_GetBack,
PyFrame_GetCode), so slimgrad's Python code reads no frame (NOTE [How live bytes are counted]),
and ``copy_slices_fn``, the node a ``CopySlices`` node wraps (``CopySlices::fn``, which torch
binds no accessor for), for the tracker's graph walk (NOTE [How saved bytes are counted]).

# NOTE [Backward bodies from C++]
``backward.cpp`` (built into the same module) issues a few backward bodies' ATen ops from C++, so
a step does not pay Python's per-op binding for each: ``rms_norm_bwd``, the one-chunk backward of
``slimgrad._math.norms.rms_norm_bwd_torch`` (NOTE [RMSNorm's one-chunk backward in the tensors'
own shapes] there; ``ops/rms_norm.py``'s two Functions), and ``gated_mlp_bwd``, the gated MLP's
straight backward (NOTE [The gated MLP's straight backward] in ``ops/gated_mlp.py``, whose
``aten.silu_backward.grad_input`` went through the generic Python op binding). Each runs the same
ATen ops on the same operands in the same order as the Python body, through the C++ function each
Python binding calls (a Python int divisor as the wrapped-number tensor Python's argument parser
makes), and drops each temporary after its last use as Python does (one statement per call where a
C++ temporary would outlive it): the same bits, the same buffers and peak, the same ops for a
dispatch mode (slimgrad.memory's tracker, the fake-tensor estimate), the profiler and autograd.
It returns None, and the caller runs its Python body, for a tensor subclass (FakeTensor, DTensor),
a functorch or functional wrapper, under a torch function mode (it would see Python's calls), and
where the body's own case does not hold; where the Python body ran past the gate (NOTE [One-call
gate] in slimgrad/_library.py), ``rms_norm_bwd`` asks the gate's five watchers itself. Without the
extension the Python bodies run (the same bits); ``tests/test_ext_backward.py`` compares the two.
GPT-2's attention node has three more (NOTEs [GPT-2's attention backward from C++] and [GPT-2's
attention node's forward from C++] in ``slimgrad/ops/gpt2_attention.py``): ``gpt2_attention_bwd``
(the node's straight backward), ``conv1d_bwd`` (c_attn's backward inside the ln_1 + c_attn node)
and ``gpt2_attention_fwd`` (the node's straight forward, the one forward body here: each temporary
freed where the Python body frees it, so the same allocation order and peak);
``tests/ops/test_gpt2_attention_ext.py`` compares them with the Python bodies. GPT-2's MLP node
has ``gpt2_mlp_bwd`` (NOTE [GPT-2's MLP backward from C++] in ``slimgrad/ops/gpt2_mlp.py``;
``tests/ops/test_gpt2_mlp_ext.py``), and every LayerNorm backward on its C kernel over a granted
gradient has ``layer_norm_bwd`` (NOTE [LayerNorm's backward from C++] in
``slimgrad/ops/layer_norm.py``; ``tests/ops/test_layer_norm_ext.py``). The C kernels these call
(dropout's, GELU's, LayerNorm's) are the ones the Python bodies call through ctypes, by the
addresses of those ctypes functions (``slimgrad.ops.dropout.c_addr``).
``norm_node.cpp`` runs the same RMSNorm body as a C++ autograd node's backward (NOTE [The RMSNorm
node in C++] in slimgrad/ops/rms_norm.py; ``tests/ops/test_rms_norm_node.py``).

The sources are compiled with ``torch.utils.cpp_extension.load`` against the headers of the torch
that runs, on first use (never at ``import slimgrad``), and cached in ``$SLIMGRAD_CACHE/ext`` (else
``~/.cache/slimgrad/ext``), one directory per torch version, Python version and source hash
(torch's file lock there serialises concurrent builds, e.g. pytest-xdist workers; NOTE [A build
lock nobody holds] for the one a killed build leaves behind). Without a C++
compiler, or if the build or the import fails, :func:`load` returns None and :func:`error` says
why; ownership then grants no reuse (the out-of-place path: same results, a few more transient
bytes) and ``slimgrad env`` shows the reason. ``SLIMGRAD_NO_EXT=1`` skips the build.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

__all__ = [
    "available",
    "build_seconds",
    "cache_dir",
    "error",
    "facts",
    "load",
    "loaded",
    "probe",
    "when_loaded",
]

ENV_VAR = "SLIMGRAD_NO_EXT"
NAME = "slimgrad_storage_facts"
_FAILED = "build-failed.txt"
_STALE_LOCK_S = 600  # without flock: a lock this old is stale (several times a full build)
_GUARD = "slimgrad-build.flock"  # NOTE [A build lock nobody holds]
SOURCE = Path(__file__).with_name("storage_facts.cpp")
#: every source the module is built from (NOTE [Backward bodies from C++]: backward.cpp; NOTE
#: [The RMSNorm node in C++] in slimgrad/ops/rms_norm.py: norm_node.cpp)
SOURCES = (
    SOURCE,
    Path(__file__).with_name("backward.cpp"),
    Path(__file__).with_name("norm_node.cpp"),  # NOTE [The RMSNorm node in C++]
)

_lock = threading.Lock()
_state: dict = {"module": None, "error": None, "tried": False, "seconds": None}
_callbacks: list = []  # when_loaded's, run once the module is loaded


def cache_dir() -> Path:
    """Where builds go: ``$SLIMGRAD_CACHE/ext`` or ``~/.cache/slimgrad/ext``."""
    root = os.environ.get("SLIMGRAD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "slimgrad"
    )
    return Path(root) / "ext"


def _build_dir() -> Path:
    h = hashlib.sha256()
    for src in SOURCES:
        h.update(src.read_bytes())
    digest = h.hexdigest()[:16]
    py = f"py{sys.version_info[0]}{sys.version_info[1]}"
    return cache_dir() / f"{NAME}-torch{torch.__version__}-{py}-{digest}"


def _missing_tool() -> str | None:
    cxx = os.environ.get("CXX") or "c++"
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx}) to build the C++ extension; install g++ or set CXX"
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401  (the PyPI package puts the binary on its own path)
        except ImportError:
            return "ninja is not installed (pip install ninja) to build the C++ extension"
    return None


# NOTE [The extension builds from copies in its own folder]
# The build folder is named by the sources' bytes (:func:`_build_dir`), but torch's build.ninja in
# it names each source by its absolute path. Two checkouts or environments with the same sources
# (two worktrees, a CI clone beside a developer's) shared the folder and, each time the other had
# loaded last, rewrote build.ninja with their own paths: ninja then rebuilt the extension (a full
# compile) while every other process waited on torch's lock. The sources are copied into
# the folder once (a copy is written only when missing or different, atomically, so a later load
# sees an unchanged file and ninja finds nothing to do) and built from there: every loader names
# the same paths.


def _sources_in(path: Path) -> list[str]:
    out = []
    for src in SOURCES:
        data = src.read_bytes()
        dst = path / src.name
        try:
            same = dst.read_bytes() == data
        except OSError:
            same = False
        if not same:
            tmp = path / f".{src.name}.{os.getpid()}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, dst)
        out.append(str(dst))
    return out


# NOTE [A build lock nobody holds]
# torch's ``cpp_extension.load`` serialises builds in one folder with a FileBaton: the file
# ``lock``, created exclusively by the builder and deleted when it is done, while every other
# process polls for it to go away, with no timeout. A build killed mid-way (a CI clone stopped, a
# worker OOM-killed) never deletes it, and every later process waited forever using no CPU
# until a person removed it. A lock's age does not tell a dead
# builder from a slow one, and a pid does not name a process across containers sharing the cache.
# So every slimgrad load takes an exclusive ``flock`` on ``slimgrad-build.flock`` in the same folder
# for the whole of torch's load (:func:`_build_lock`), and only then lets torch take its baton:
# the kernel releases a flock when its process ends, however it ends. A process that gets the
# flock is then the only slimgrad loader of that folder, so a ``lock`` it finds was left by a
# builder that ended without releasing it (the folder is named by the sources' bytes, and every
# loader of these sources takes the flock first): it is removed, with a warning naming it. A
# loader waits for a live builder as before (on the flock, woken when it ends). Where ``flock``
# is unavailable (no ``fcntl``: Windows; a file system that refuses it), a lock older than
# ``_STALE_LOCK_S`` (several times a full build) is taken for stale, checked before torch
# waits: a younger one is waited on as torch does.


@contextlib.contextmanager
def _build_lock(path: Path):
    lock = path / "lock"
    fd = None
    try:
        import fcntl

        fd = os.open(path / _GUARD, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits while another process loads or builds here
    except (ImportError, OSError):
        if fd is not None:
            os.close(fd)
            fd = None
    try:
        if fd is not None:
            stale = lock.exists()
        else:
            try:
                stale = time.time() - lock.stat().st_mtime > _STALE_LOCK_S
            except OSError:
                stale = False
        if stale:
            lock.unlink(missing_ok=True)
            warnings.warn(
                f"slimgrad._ext: removed the stale build lock {lock}; expected no lock while no "
                "process builds the C++ extension, got one left by a build that ended without "
                "releasing it (a killed process). Nothing to do: the build goes on; if it "
                "recurs, look for processes killed while building.",
                RuntimeWarning,
                stacklevel=2,
            )
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the flock


def _build():
    # torch logs notes about CUDA_HOME and the compiler's ABI: not ours to report
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension

        path = _build_dir()
        path.mkdir(parents=True, exist_ok=True)
        with _build_lock(path):  # NOTE [A build lock nobody holds]
            sources = _sources_in(path)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return cpp_extension.load(
                    NAME,
                    sources,
                    extra_cflags=["-O2"],
                    build_directory=str(path),
                    verbose=False,
                )
    finally:
        log.setLevel(level)


def _reason(e: BaseException) -> str:
    # the compiler's first error line, else the message's last line (not the command line)
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    keys = ("error:", "not found", "No such file", "undefined symbol")
    detail = next((ln for ln in lines if any(k in ln for k in keys)), lines[-1] if lines else "")
    return f"{type(e).__name__}: {detail[:300]}"


def load():
    """The built extension module, building it on the first call in this process (None if that
    is impossible; :func:`error` says why). Thread-safe; later calls cost a dict lookup."""
    if _state["tried"]:
        return _state["module"]
    with _lock:
        if not _state["tried"]:
            if os.environ.get(ENV_VAR, "").strip().lower() not in ("", "0", "false", "no", "off"):
                _state["error"] = f"turned off by {ENV_VAR}=1"
            else:
                t0 = time.perf_counter()
                try:
                    missing = _missing_tool()
                    if missing is not None:
                        raise RuntimeError(missing)
                    _state["module"] = _build()
                except Exception as e:  # no compiler, a compile or import error: no extension
                    _state["error"] = _reason(e)
                _state["seconds"] = time.perf_counter() - t0
                _record(_state["error"])
            _state["tried"] = True
            if _state["module"] is not None:
                for fn in _callbacks:
                    fn(_state["module"])
    return _state["module"]


def when_loaded(fn) -> None:
    """Call ``fn(module)`` once the extension is loaded in this process (at once if it is
    already): for a caller that uses it where it is available and its own Python where not,
    without building it early. Never called if the extension cannot load."""
    with _lock:
        if _state["module"] is not None:
            fn(_state["module"])
        else:
            _callbacks.append(fn)


def _record(err: str | None) -> None:
    # the last outcome, for ``slimgrad env`` in another process (best effort)
    try:
        f = _build_dir() / _FAILED
        if err is None:
            f.unlink(missing_ok=True)
        else:
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(err)
    except OSError:
        pass


def probe() -> tuple[bool, str]:
    """(usable, why) without building anything: for ``slimgrad env``. Usable means loaded in this
    process, built and cached, or buildable here (a C++ compiler and ninja are present); a
    failure recorded by an earlier process for this torch and source is reported as such."""
    if os.environ.get(ENV_VAR, "").strip().lower() not in ("", "0", "false", "no", "off"):
        return False, f"turned off by {ENV_VAR}=1"
    if _state["module"] is not None:
        return True, f"the C++ extension ({_state['module'].__file__})"
    if _state["tried"]:
        return False, f"the C++ extension failed to build: {_state['error']}"
    path = _build_dir()
    if (path / f"{NAME}.so").exists():
        return True, f"the C++ extension (cached in {path})"
    if (path / _FAILED).exists():
        return False, "the C++ extension failed to build: " + (path / _FAILED).read_text()[:300]
    missing = _missing_tool()
    if missing is not None:
        return False, missing
    return True, f"the C++ extension, built on first use (once, cached in {path})"


def loaded() -> bool:
    """Whether :func:`load` already ran in this process and succeeded (builds nothing)."""
    return _state["module"] is not None


def available() -> bool:
    """Whether the extension can be used (builds it if needed)."""
    return load() is not None


def error() -> str | None:
    """Why the extension is unavailable (None if it loaded or was not tried yet)."""
    return _state["error"]


def build_seconds() -> float | None:
    """Seconds :func:`load` took to build (or load from the cache) in this process."""
    return _state["seconds"]


def facts(t: torch.Tensor):
    """``t``'s storage facts (NOTE [Storage facts from the C++ API]), or None without storage.
    Requires :func:`load` to have succeeded."""
    return _state["module"].facts(t)
