"""Compiled C kernels for CPU tensors: one C file per stem, built on first use, loaded with ctypes.

# NOTE [CPU C kernels]
``load(stem)`` compiles ``kernels/cpu/<stem>.c`` with the system C compiler (``$CC``, else ``cc``,
else ``gcc``) into a shared library, caches it, and returns it as a ``ctypes.CDLL`` (None when that
is impossible). The C files are plain C99 + OpenMP: no torch headers, no Python API, so a build
takes well under a second (a torch C++ extension takes ~30 s). Callers allocate every buffer in
Python with torch (so ``slimgrad.memory`` sees each allocation) and pass ``tensor.data_ptr()``,
element counts and scalars; the C side only reads and writes those buffers. Hold every such tensor
in a variable until the call returns: ``f(x.clone().data_ptr())`` hands C freed memory (the
temporary dies before the call), a heap corruption that crashes later, elsewhere.

- Flags: ``-O3 -fPIC -shared -fopenmp -ffp-contract=off -fno-math-errno`` and ``-march=native``
  when the compiler accepts it (else without it; else without ``-fopenmp``, one thread). Never
  ``-ffast-math``: the kernels must round exactly as the PyTorch path does (contractions into FMA
  are off; a kernel that needs torch's fused multiply-add calls ``fmaf``).
- Cache: ``$SLIMGRAD_CACHE`` (else ``~/.cache/slimgrad``)/``cpu/<stem>-<key>.so``, the key a hash
  of the source, the flags, the compiler's ``--version`` and the CPU's model and flags
  (``-march=native`` code is only valid on the CPU it was built for). A build writes a temporary
  file in the same directory and ``os.replace``-s it into place, so concurrent processes
  (pytest-xdist workers) never load a half-written library; the loser of a race simply rebuilds
  the same bytes.
- Binding: an op module lists its C functions' ctypes signatures once (``_c_signatures(ctypes)``)
  and gets them through :func:`functions`, which sets them on first use and keeps the table on
  the library object.
- Threads: kernels take the thread count as an argument (``threads()``, i.e.
  ``torch.get_num_threads()``), so ``torch.set_num_threads`` and ``OMP_NUM_THREADS`` govern them
  as they govern torch's own ops (the library links the ``libgomp.so.1`` torch has loaded).
- Failure (no compiler, a compile error, a load error): ``load`` returns None, the op takes its
  PyTorch path, and one warning per process names the cause and the ways out (install a C compiler
  or set ``CC``; ``SLIMGRAD_BACKEND=torch`` to silence it). ``import slimgrad`` compiles nothing.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

__all__ = [
    "FLAGS",
    "available",
    "cache_dir",
    "compiler",
    "functions",
    "last_error",
    "load",
    "threads",
]

# -fno-math-errno: sqrtf may vectorize (errno is never read; results are unchanged)
FLAGS = (
    "-O3",
    "-fPIC",
    "-shared",
    "-fopenmp",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-std=gnu99",
)
_NATIVE: tuple[str, ...] = ("-march=native",)  # tests may swap it for another target
SRC_DIR = Path(__file__).with_name("cpu")

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}
_errors: dict[str, str] = {}
_warned: dict[str, bool] = {}
_probe: dict[str, object] = {}


def cache_dir() -> Path:
    """Where built libraries go: ``$SLIMGRAD_CACHE/cpu`` or ``~/.cache/slimgrad/cpu``."""
    root = os.environ.get("SLIMGRAD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "slimgrad"
    )
    return Path(root) / "cpu"


def compiler() -> str | None:
    """The C compiler to use (``$CC``, else ``cc``/``gcc`` on PATH), or None."""
    cc = os.environ.get("CC")
    if cc:
        return cc
    return shutil.which("cc") or shutil.which("gcc")


def threads() -> int:
    """Thread count passed to the kernels: torch's own (``torch.get_num_threads()``)."""
    return max(1, torch.get_num_threads())


def functions(lib: ctypes.CDLL, signatures) -> dict:
    """``lib``'s C functions with their ctypes signatures set, bound on first use and kept on the
    library object (each C file belongs to one op module; binding per call costs more than a small
    kernel). ``signatures(ctypes)`` returns ``{key: (C name, argtypes, restype)}``."""
    fns = getattr(lib, "_slimgrad_fns", None)
    if fns is None:
        fns = {}
        for key, (name, args, res) in signatures(ctypes).items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
            fns[key] = fn
        lib._slimgrad_fns = fns
    return fns


def address(fn) -> int:
    """The address of a C function bound by :func:`functions` (0 if none), for slimgrad's C++
    bodies that call the same kernel the Python body calls (NOTE [Backward bodies from C++] in
    slimgrad/_ext)."""
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


def _version(cc: str) -> str:
    key = ("version", cc)
    v = _probe.get(key)
    if v is None:
        r = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60)
        if r.returncode:
            raise OSError(f"{cc} --version failed: {r.stderr.strip()[:200]}")
        v = r.stdout
        _probe[key] = v
    return str(v)


def _cpu_id() -> str:
    v = _probe.get("cpu")
    if v is None:
        v = platform.machine() + platform.processor()
        try:
            with open("/proc/cpuinfo") as fh:
                for line in fh:
                    if line.startswith(("model name", "flags", "Features")):
                        v += line
                        if line.startswith(("flags", "Features")):
                            break
        except OSError:
            pass
        _probe["cpu"] = v
    return str(v)


def _run_cc(cc: str, flags: list[str], src: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [cc, *flags, str(src), "-o", str(out), "-lm"], capture_output=True, text=True, timeout=300
    )


def _build(stem: str) -> Path:
    src = SRC_DIR / f"{stem}.c"
    if not src.is_file():
        raise FileNotFoundError(f"no C source {src}")
    cc = compiler()
    if cc is None:
        raise FileNotFoundError("no C compiler found (neither $CC, cc nor gcc)")
    version = _version(cc)
    text = src.read_bytes()
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    # native first; then portable; then without OpenMP (e.g. a clang without libomp: the pragmas
    # are ignored and the kernels run on one thread)
    attempts = [([*FLAGS, *_NATIVE], True), (list(FLAGS), False)]
    attempts.append(([f for f in FLAGS if f != "-fopenmp"], False))
    for flags, native in attempts:
        h = hashlib.sha256()
        for part in (text, " ".join(flags).encode(), cc.encode(), version.encode()):
            h.update(part)
            h.update(b"\0")
        if native:
            h.update(_cpu_id().encode())
        path = d / f"{stem}-{h.hexdigest()[:20]}.so"
        if path.is_file():
            return path
        fd, tmp = tempfile.mkstemp(prefix=f".{stem}-", suffix=".so", dir=d)
        os.close(fd)
        try:
            r = _run_cc(cc, flags, src, Path(tmp))
            if r.returncode == 0:
                os.replace(tmp, path)
                return path
            err = (r.stderr or r.stdout).strip()
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise OSError(f"{cc} failed on {src.name}: {err[-600:]}")


def load(stem: str) -> ctypes.CDLL | None:
    """The compiled ``kernels/cpu/<stem>.c`` as a ``ctypes.CDLL``, or None if it cannot be built.

    Built on the first call per process (cached on disk across processes); a failure is cached too
    and warned about once (NOTE [CPU C kernels]).
    """
    if stem in _libs:
        return _libs[stem]
    with _lock:
        if stem in _libs:
            return _libs[stem]
        lib = None
        try:
            lib = ctypes.CDLL(str(_build(stem)))
        except Exception as e:  # noqa: BLE001 - any failure means: use the PyTorch path
            _errors[stem] = f"{type(e).__name__}: {e}"
        _libs[stem] = lib
    if lib is None and not _warned.get(stem):
        _warned[stem] = True
        warnings.warn(
            f"slimgrad.kernels: cannot build the CPU C kernels for {stem!r}; expected a working C "
            f"compiler ($CC or cc) and a writable cache ({cache_dir()}), got {_errors[stem]}. "
            f"Falling back to the (slower) PyTorch path; install gcc/clang or set CC=..., set "
            f"SLIMGRAD_CACHE to a writable directory, or set SLIMGRAD_BACKEND=torch to silence "
            f"this.",
            RuntimeWarning,
            stacklevel=3,
        )
    return lib


def available(stem: str) -> bool:
    """Whether ``load(stem)`` gives a library (builds it on first use)."""
    return load(stem) is not None


def last_error(stem: str) -> str | None:
    """Why ``load(stem)`` returned None (None if it did not, or was not tried)."""
    return _errors.get(stem)


def _reset(stem: str | None = None) -> None:
    # tests: forget loaded libraries / failures (the on-disk cache stays)
    for d in (_libs, _errors, _warned):
        if stem is None:
            d.clear()
        else:
            d.pop(stem, None)
