"""Which implementation an op runs: the plain-PyTorch path, the Triton kernels or the CPU C kernels.

# NOTE [Kernel backend choice]
Every op with a ``kernels/<stem>.py`` asks :func:`use_triton` once per call, with its input tensor,
and then calls either ``ops.<stem>._fwd_torch`` or ``kernels.<stem>._fwd_triton`` (same signature,
same results up to the error rule, same memory contract). An op with a C file
``kernels/cpu/<stem>.c`` (NOTE [CPU C kernels] in ``kernels/_cpu.py``) asks :func:`use_cpu`, which
returns the loaded library or None (then the PyTorch path). The choice, first match wins:

1. ``backend=`` passed to :func:`use_triton` / :func:`use_cpu` (an op's own argument, if any);
2. :func:`set_backend` (process-wide; also usable as a context manager);
3. the environment variable ``SLIMGRAD_BACKEND``, read once: at ``convert_`` or the first call that
   needs it, whichever comes first, and again only after :func:`set_backend` (any argument,
   ``None`` included, and when its context manager restores) or :func:`refresh`; a change to the
   variable in between is not seen;
4. ``"auto"``.

Decided once: the process-wide name (2-4) is resolved once and kept until :func:`set_backend` or
:func:`refresh` drops it, so a converted model follows a later ``set_backend`` at its next call;
a C library is looked up once per stem (``kernels/_cpu.py`` keeps it, or the failure). No call
reads the environment on the ``"auto"``, ``"torch"`` and ``"cpu"`` paths; a forced ``"triton"`` on
a CPU tensor checks ``TRITON_INTERPRET`` (the interpreter, tests only). What stays per call is what
the call's tensor decides: its device and dtype, whether it is fake, and whether torch.compile is
tracing.

``"torch"`` always takes the PyTorch path. ``"auto"`` takes Triton for CUDA tensors when triton is
importable, the C kernels for CPU tensors of the dtypes the op's C file handles when a C compiler
works (if none does: the PyTorch path, after one warning naming the cause), PyTorch otherwise (MPS,
meta/fake tensors, other dtypes); an op whose Triton kernel changes
something observable besides speed passes ``auto=False`` and gets its kernel only when
``"triton"`` is asked for explicitly (dropout: the Triton mask is drawn by a Philox kernel, not by
the generator calls eager makes, so the default keeps eager's masks). ``"triton"`` forces the
kernels; it is an error where they cannot run: triton missing, or a CPU tensor without
``TRITON_INTERPRET=1`` (the interpreter runs kernels on CPU tensors, as the tests do). ``"cpu"``
forces the C kernels for CPU tensors (an error if they cannot be built; other devices and dtypes
take the PyTorch path). The C kernels give the PyTorch path's results (bit for bit where the tests
say so, else within the error rule) and the same memory contract, so ``"auto"`` may pick them
for any op; ``SLIMGRAD_BACKEND=torch`` turns them off.

Code that torch.compile traces (``torch.compiler.is_compiling()``) and fake/meta/functional
tensors (tracing, export, ``slimgrad.memory`` estimates) always take the PyTorch path: inductor
generates its own kernels from it. The ops' ``torch.library`` custom ops are opaque to the tracer
and run their Python implementation at run time, where the choice above applies.

``import slimgrad`` imports neither triton nor CUDA and compiles nothing: this module only asks
``importlib.util.find_spec("triton")`` (no import), ``kernels/<stem>.py`` are imported by the op
at the first call that takes the Triton path, and a C file is built at the first call that takes
the C path.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import warnings
from types import ModuleType

import torch

from slimgrad._autograd import compiling

__all__ = [
    "BACKENDS",
    "get_backend",
    "kernels",
    "refresh",
    "set_backend",
    "triton_available",
    "use_cpu",
    "use_triton",
]

BACKENDS = ("auto", "torch", "triton", "cpu")
ENV_VAR = "SLIMGRAD_BACKEND"

_state: dict[str, str | None] = {"backend": None}  # set_backend's name, None: not set
_found: dict[str, bool] = {}
# the process-wide name in force (set_backend's, else $SLIMGRAD_BACKEND's, else "auto"), resolved
# once; None: resolve at the next call (NOTE [Kernel backend choice], "Decided once")
_resolved: list[str | None] = [None]


def _check(backend: str, source: str) -> str:
    if not isinstance(backend, str):
        raise TypeError(
            f"slimgrad.kernels: {source} must be a str; expected one of {BACKENDS}, got "
            f"{type(backend).__name__}. Pass backend='auto', 'torch', 'triton' or 'cpu'."
        )
    b = backend.strip().lower()
    if b not in BACKENDS:
        raise ValueError(
            f"slimgrad.kernels: unknown {source}; expected one of {BACKENDS}, got {backend!r}. "
            f"Use 'auto' (Triton on CUDA when installed, C kernels on CPU), 'torch', 'triton' or "
            f"'cpu'."
        )
    return b


def triton_available() -> bool:
    """True when triton can be imported (checked once, without importing it)."""
    ok = _found.get("triton")
    if ok is None:
        ok = importlib.util.find_spec("triton") is not None
        _found["triton"] = ok
    return ok


def cpu_kernel_would_run(
    x: torch.Tensor, stem: str, dtypes: tuple[torch.dtype, ...] = (torch.float32,)
) -> bool:
    """Whether :func:`use_cpu` would pick ``kernels/cpu/<stem>.c`` for ``x`` if ``x`` were real.

    For ops whose PyTorch path keeps temporaries the C kernel does not: under fake tensors
    (``slimgrad.memory.estimate``) such an op allocates what the C kernel would (its outputs
    only), so the estimate models the real CPU step. Never true for a backend other than
    ``"auto"``/``"cpu"``, another device or dtype, or a stem whose C file cannot be built.
    """
    if compiling():
        return False
    b = _resolved[0] or _resolve()
    if (b != "auto" and b != "cpu") or not x.is_cpu or x.dtype not in dtypes:
        return False
    _cpu = _cpu_module[0] or _load_cpu_module()
    libs = _cpu._libs
    if stem in libs:
        return libs[stem] is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _cpu.load(stem) is not None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _resolve() -> str:
    b = _state["backend"]
    if b is None:
        env = os.environ.get(ENV_VAR)
        b = _check(env, f"${ENV_VAR}") if env else "auto"
    _resolved[0] = b
    return b


def resolve_now() -> None:
    """Resolve the process-wide name now unless it is resolved (``convert_`` calls it, so code
    that torch.compile traces reads a name, not None: a name first resolved by the compiled call
    made the second call recompile). A bad ``$SLIMGRAD_BACKEND`` is left for the first op call to
    report, as without it."""
    if _resolved[0] is None:
        try:
            _resolve()
        except (TypeError, ValueError):
            pass


def get_backend() -> str:
    """The backend in force when no per-call ``backend`` is given: :func:`set_backend`, else
    ``$SLIMGRAD_BACKEND`` (read once, NOTE [Kernel backend choice]), else ``"auto"``."""
    return _resolved[0] or _resolve()


def refresh() -> None:
    """Forget the resolved process-wide backend: the next call reads :func:`set_backend`'s setting
    and ``$SLIMGRAD_BACKEND`` again (after changing the variable inside a running process)."""
    _resolved[0] = None


class _Restore(contextlib.AbstractContextManager):
    def __init__(self, old: str | None):
        self._old = old

    def __exit__(self, *exc) -> None:
        _state["backend"] = self._old
        _resolved[0] = None


def set_backend(backend: str | None) -> contextlib.AbstractContextManager:
    """Set the process-wide backend (``None``: back to ``$SLIMGRAD_BACKEND``, read again, or
    ``"auto"``). Models converted before follow it from their next call.

    Returns a context manager that restores the previous setting, so both forms work::

        slimgrad.kernels._backend.set_backend("torch")
        with slimgrad.kernels._backend.set_backend("triton"):
            ...

    Raises:
        ValueError: unknown name. TypeError: not a str.
    """
    old = _state["backend"]
    _state["backend"] = None if backend is None else _check(backend, "backend")
    _resolved[0] = None  # resolved again at the next call (and $SLIMGRAD_BACKEND read again)
    return _Restore(old)


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_FAKE_MODE_KEY = torch._C._TorchDispatchModeKey.FAKE
_get_dispatch_mode = torch._C._get_dispatch_mode


def _is_fake(t: torch.Tensor) -> bool:
    if t.is_meta:
        return True
    if type(t) not in _PLAIN:  # plain tensors (every eager call) skip the imports below
        # torch-internal classes (no CUDA init): tracing by torch.compile / export / slimgrad.memory
        from torch._subclasses.fake_tensor import FakeTensor
        from torch._subclasses.functional_tensor import FunctionalTensor

        if isinstance(t, (FakeTensor, FunctionalTensor)):
            return True
    # a real tensor inside an active FakeTensorMode (allow_non_fake_inputs, e.g. a gradient handed
    # to slimgrad.memory.estimate): what the kernel would write next to it is fake, so no kernel
    return _get_dispatch_mode(_FAKE_MODE_KEY) is not None


#: Process-wide names (``_resolved[0]``) under which :func:`use_triton` answers False for every
#: tensor not on CUDA: a hot path reads ``not x.is_cuda and _resolved[0] in NO_TRITON_OFF_CUDA``
#: (attribute reads, no call) and asks :func:`use_triton` only otherwise.
NO_TRITON_OFF_CUDA = ("auto", "torch", "cpu")


def use_triton(x: torch.Tensor, backend: str | None = None, *, auto: bool = True) -> bool:
    """Whether an op called on ``x`` should run its Triton kernels (NOTE [Kernel backend choice]).

    Args:
        x: the op's main input (its device decides ``"auto"``).
        backend: per-call override, ``None`` for the process-wide choice.
        auto: whether ``"auto"`` may pick Triton for this op (False: only an explicit
            ``"triton"`` does).

    Raises:
        ValueError: unknown backend name.
        RuntimeError: ``"triton"`` forced where the kernels cannot run (triton missing, or a CPU
            tensor without ``TRITON_INTERPRET=1``).
    """
    if compiling():  # first: dynamo then traces nothing else here
        return False
    b = (_resolved[0] or _resolve()) if backend is None else _check(backend, "backend")
    if b == "auto":  # a CPU tensor (the common case) answers without the fake check
        return auto and x.is_cuda and triton_available() and not _is_fake(x)
    if b != "triton" or _is_fake(x):
        return False
    if not triton_available():
        raise RuntimeError(
            "slimgrad.kernels: backend 'triton' was forced but triton is not installed; expected "
            "an importable triton, got none. `pip install slimgrad[triton]`, or use "
            "backend='auto'."
        )
    if not x.is_cuda and not (x.device.type == "cpu" and _interpret()):
        raise RuntimeError(
            f"slimgrad.kernels: backend 'triton' needs CUDA tensors; expected device 'cuda' (or "
            f"'cpu' with TRITON_INTERPRET=1), got {x.device.type!r}. Move the tensors to the GPU "
            f"or use backend='auto'."
        )
    return True


def kernels(stem: str) -> ModuleType:
    """``slimgrad.kernels.<stem>``, imported on first use (this imports triton)."""
    # sys.modules first: import_module costs microseconds per call even for a loaded module
    name = f"slimgrad.kernels.{stem}"
    mod = sys.modules.get(name)
    return mod if mod is not None else importlib.import_module(name)


_cpu_module: list[ModuleType | None] = [None]  # slimgrad.kernels._cpu once imported


def _load_cpu_module() -> ModuleType:
    mod = importlib.import_module("slimgrad.kernels._cpu")
    _cpu_module[0] = mod
    return mod


def use_cpu(
    x: torch.Tensor,
    stem: str,
    backend: str | None = None,
    *,
    dtypes: tuple[torch.dtype, ...] = (torch.float32,),
):
    """The compiled ``kernels/cpu/<stem>.c`` if an op called on ``x`` should run it, else None.

    Args:
        x: the op's main input: a CPU tensor of one of ``dtypes``, not fake, not being traced.
        stem: the C file's stem.
        backend: per-call override, ``None`` for the process-wide choice.
        dtypes: the dtypes the C kernels handle (others take the PyTorch path).

    Returns:
        A ``ctypes.CDLL`` (see ``slimgrad.kernels._cpu``) or None (use the PyTorch path).

    Raises:
        ValueError: unknown backend name.
        RuntimeError: ``"cpu"`` forced and the C file cannot be built.
    """
    if compiling():  # torch.compiler.is_compiling() (NOTE [One-frame compile check])
        return None
    b = (_resolved[0] or _resolve()) if backend is None else _check(backend, "backend")
    if (b != "auto" and b != "cpu") or not x.is_cpu or x.dtype not in dtypes:
        return None
    # _is_fake(x), its plain-tensor case inline (this runs on every call of a C-backed op)
    if type(x) not in _PLAIN or x.is_meta or _get_dispatch_mode(_FAKE_MODE_KEY) is not None:
        if _is_fake(x):
            return None
    _cpu = _cpu_module[0] or _load_cpu_module()
    libs = _cpu._libs  # built or failed once per stem (NOTE [CPU C kernels]); read, no call
    lib = libs[stem] if stem in libs else None
    if lib is not None:
        return lib
    if b == "cpu":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lib = _cpu.load(stem)
        if lib is None:
            raise RuntimeError(
                f"slimgrad.kernels: backend 'cpu' was forced but the C kernels for {stem!r} cannot "
                f"be built; expected a working C compiler, got {_cpu.last_error(stem)}. Install "
                f"gcc or set CC=..., or use backend='auto'."
            )
        return lib
    return _cpu.load(stem)
