"""Supported versions, and which optional capabilities the running installation has.

One place says which torch and transformers releases slimgrad is tested with (the ranges in
``pyproject.toml``; the matrix in ``docs/compatibility.md``), and one registry says which features
are on and, for those that are off, why. ``slimgrad env`` prints both and ``report`` names the
features that are off; nothing here imports Triton, CUDA or transformers unless asked.

A torch older than :data:`TORCH_MIN` is refused at ``import slimgrad`` with one message (slimgrad
uses autograd and dispatch APIs that older releases lack or spell differently); a newer release
than the newest tested imports with one warning. A transformers release outside the tested range
gets one warning at the first ``convert_`` of an HF model.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

with warnings.catch_warnings():
    # without numpy, ``import torch`` warns "Failed to initialize NumPy" (torch.export imports its
    # numpy bridge); slimgrad never converts to or from numpy, so its own first import stays quiet
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch

#: Oldest and newest (major, minor) torch releases the test matrix runs (``make test-matrix``).
TORCH_MIN = (2, 11)
TORCH_MAX_TESTED = (2, 15)
#: Oldest and newest (major, minor) transformers releases the HF suites run under.
TRANSFORMERS_MIN = (5, 23)
TRANSFORMERS_MAX_TESTED = (5, 24)

_PIP_TORCH = (
    f"pip install 'torch>={TORCH_MIN[0]}.{TORCH_MIN[1]},"
    f"<{TORCH_MAX_TESTED[0]}.{TORCH_MAX_TESTED[1] + 1}'"
)
_PIP_HF = (
    f"pip install 'transformers>={TRANSFORMERS_MIN[0]}.{TRANSFORMERS_MIN[1]},"
    f"<{TRANSFORMERS_MAX_TESTED[0]}.{TRANSFORMERS_MAX_TESTED[1] + 1}'"
)


def parse_version(text: str) -> tuple[int, int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``; missing or non-numeric parts read as 0."""
    parts = re.findall(r"\d+", text.split("+")[0])[:3]
    nums = [int(p) for p in parts] + [0] * (3 - len(parts))
    return nums[0], nums[1], nums[2]


def _range_text(lo: tuple[int, int], hi: tuple[int, int]) -> str:
    return f">={lo[0]}.{lo[1]}, <={hi[0]}.{hi[1]}.x"


def torch_version_problem(version: str) -> tuple[str, str] | None:
    """``("error" | "warning", message)`` for a torch outside the tested range, else None."""
    v = parse_version(version)[:2]
    if v < TORCH_MIN:
        return "error", (
            f"slimgrad: torch {version} is not supported; expected torch "
            f"{_range_text(TORCH_MIN, TORCH_MAX_TESTED)}, got {version}. "
            f"Upgrade torch: {_PIP_TORCH}."
        )
    if v > TORCH_MAX_TESTED:
        return "warning", (
            f"slimgrad: torch {version} is newer than the newest release slimgrad is tested with; "
            f"expected torch {_range_text(TORCH_MIN, TORCH_MAX_TESTED)}, got {version}. slimgrad "
            "still checks every capability it uses and turns off what it cannot find (see "
            f"`slimgrad env`); to run a tested set: {_PIP_TORCH}."
        )
    return None


def transformers_version_problem(version: str) -> str | None:
    """A warning's text for a transformers release outside the tested range, else None."""
    v = parse_version(version)[:2]
    if TRANSFORMERS_MIN <= v <= TRANSFORMERS_MAX_TESTED:
        return None
    side = "older" if v < TRANSFORMERS_MIN else "newer"
    return (
        f"slimgrad.convert_: transformers {version} is {side} than the releases slimgrad is tested "
        f"with; expected transformers {_range_text(TRANSFORMERS_MIN, TRANSFORMERS_MAX_TESTED)}, "
        f"got {version}. HF handlers still match each model's code and keep HF's own forward "
        f"where it differs (see `slimgrad.report(model)`); to run a tested set: {_PIP_HF}."
    )


def check_torch() -> None:
    """Called once at ``import slimgrad``: refuse an unsupported torch, warn on an untested one."""
    problem = torch_version_problem(torch.__version__)
    if problem is None:
        return
    kind, msg = problem
    if kind == "error":
        raise ImportError(msg)
    warnings.warn(msg, UserWarning, stacklevel=3)


_hf_checked = False


def check_transformers(stacklevel: int = 3) -> None:
    """Warn once per process when the installed transformers is outside the tested range;
    ``stacklevel`` as :func:`warnings.warn`'s, counted from this function's caller's caller."""
    global _hf_checked
    if _hf_checked:
        return
    _hf_checked = True
    try:
        from importlib.metadata import version

        msg = transformers_version_problem(version("transformers"))
    except Exception:  # not installed or no metadata: nothing to say
        return
    if msg is not None:
        warnings.warn(msg, UserWarning, stacklevel=stacklevel)


# --------------------------------------------------------------------------------- features
@dataclass(frozen=True)
class Feature:
    """One optional capability: whether it is on here, and why not when it is off."""

    name: str
    on: bool
    detail: str


def _ownership() -> Feature:
    from slimgrad import _ext, ownership

    name = "buffer reuse (ownership)"
    if ownership._env_disabled():
        return Feature(name, False, f"turned off by {ownership.ENV_VAR}=1")
    off = "backward buffers are never reused (same gradients, a few more transient bytes)"
    problem = ownership.refcount_problem()  # NOTE [Reference counts and the interpreter]
    if problem is not None:
        return Feature(name, False, f"{problem}: {off}")
    if not (ownership._ensure_calibrated() and ownership.calibrated()):
        return Feature(name, False, f"calibration refused on torch {torch.__version__}: {off}")
    ok, why = _ext.probe()  # builds nothing
    if not ok:
        return Feature(name, False, f"no storage facts ({why}): {off}")
    if ownership._FACTS is not None and ownership._STORAGE_SIG is None:
        return Feature(name, False, f"storage facts disagree with torch {torch.__version__}: {off}")
    return Feature(name, True, f"calibrated; storage facts from {why}")


def _forward_writes() -> Feature:
    from slimgrad import _ext, ownership

    name = "forward in-place writes (owns_input)"
    if ownership._env_disabled():
        return Feature(name, False, f"turned off by {ownership.ENV_VAR}=1")
    ok, why = _ext.probe()  # builds nothing
    if not ok:
        return Feature(name, False, f"no storage facts ({why}): lean ops write out of place")
    return Feature(
        name,
        True,
        "from the structure convert_ states (NOTE [Forward ownership from stated structure]); "
        "refused under a dispatch or function mode other than slimgrad's tracker",
    )


def _backward_bodies() -> Feature:
    from slimgrad import _ext

    name = "C++ backward bodies (RMSNorm, gated MLP)"
    ok, why = _ext.probe()  # builds nothing
    if not ok:  # NOTE [Backward bodies from C++] in slimgrad/_ext
        return Feature(name, False, f"{why}: their Python bodies run (the same results)")
    return Feature(name, True, f"from {why}")


def _triton() -> Feature:
    if importlib.util.find_spec("triton") is None:
        return Feature("Triton kernels", False, "triton is not installed (pip install triton)")
    if not torch.cuda.is_available():
        return Feature("Triton kernels", False, "no CUDA device (CPU runs the C or PyTorch path)")
    return Feature("Triton kernels", True, "CUDA tensors use Triton kernels")


def _c_kernels() -> Feature:
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return Feature("C CPU kernels", False, "no C compiler (cc/gcc) on PATH: PyTorch path")
    return Feature("C CPU kernels", True, f"built on first use with {cc}")


def _numpy() -> Feature:
    if importlib.util.find_spec("numpy") is None:
        return Feature("numpy", False, "not installed (only slimgrad's tests use it)")
    return Feature("numpy", True, "installed")


@functools.cache
def _installed(name: str) -> str | None:
    # a distribution's version, read once per process: reading the installed distributions'
    # metadata costs milliseconds (more with a long sys.path), and ``features_off`` runs at every
    # ``convert_``; a package installed or upgraded later is not the one this process imported
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def _transformers() -> Feature:
    v = _installed("transformers")
    if v is None:
        return Feature("HF handlers", False, "transformers is not installed (pip install '.[hf]')")
    msg = transformers_version_problem(v)
    if msg is None:
        return Feature("HF handlers", True, f"transformers {v} (tested range)")
    return Feature("HF handlers", True, f"transformers {v} is outside the tested range")


def _keep_graph() -> Feature:
    ok = hasattr(torch._C._autograd, "_get_current_graph_task_keep_graph")
    return Feature(
        "retain_graph detection",
        ok,
        "torch._C._autograd._get_current_graph_task_keep_graph"
        + (
            " present"
            if ok
            else " missing: BatchNorm keeps its input under every backward; step_in_backward "
            "does not refuse retain_graph=True"
        ),
    )


def _step_in_backward(i: int) -> Callable[[], Feature]:
    # the private queries of slimgrad.step_in_backward (NOTE [A graph task that accumulates
    # nothing] there); the module, not the function of the same name slimgrad exports
    def probe() -> Feature:
        return Feature(*importlib.import_module("slimgrad.step_in_backward")._features()[i][:3])

    probe.__name__ = f"_step_in_backward_{i}"
    return probe


def _ctx_fields() -> Feature:
    from slimgrad import _autograd

    on = _autograd.CTX_FIELDS  # NOTE [Saving through ctx's fields] in slimgrad/_autograd.py
    return Feature(
        "direct ctx fields (straight paths)",
        on,
        "torch._C._FunctionBase has to_save, non_differentiable, materialize_grads"
        if on
        else "torch._C._FunctionBase lacks to_save/non_differentiable/materialize_grads: the "
        "straight paths call save_for_backward and its siblings (one Python call more each)",
    )


def _modes_aside() -> Feature:
    try:  # NOTE [Calibration outside dispatch modes] in slimgrad/ownership.py
        from torch.utils._python_dispatch import _disable_current_modes  # noqa: F401
    except ImportError:
        ok = False
    else:
        ok = True
    return Feature(
        "ownership calibration outside dispatch modes",
        ok,
        "torch.utils._python_dispatch._disable_current_modes"
        + (
            " present"
            if ok
            else " missing: the ownership baselines are measured under whatever mode the first "
            "call runs in (a memory.estimate run first can leave later real steps without "
            "view-gradient reuses)"
        ),
    )


def _dense_check() -> Feature:
    ok = _prims_dense is not None
    return Feature(
        "engine in-place sum model (memory tracker)",
        True,
        "torch._prims_common" if ok else "public-API layout check (torch._prims_common lacks it)",
    )


def _conv_backend() -> Feature:
    from slimgrad import memory  # NOTE [Fake tensors model the CPU conv backward's outputs]

    ok = memory._ONEDNN_BACKENDS is not None
    return Feature(
        "estimate of oneDNN conv backward outputs",
        ok,
        "torch._C._select_conv_backend present"
        if ok
        else "torch._C._select_conv_backend or its backend enum differs: memory.estimate's peak "
        "can be one conv weight below the real CPU step's where a frozen-weight conv with a bias "
        "sets it",
    )


def _checkpoint_forward() -> Feature:
    # NOTE [A recipe made in a checkpoint's forward] in slimgrad/ops/_derived.py: told by the
    # name of torch.utils.checkpoint's forward pack hook; probed by a tiny non-reentrant checkpoint
    from torch.utils.checkpoint import checkpoint

    from slimgrad.ops import _derived

    seen = []

    def body(t):
        seen.append(_derived.forward_region(_derived._top_hooks(False)) is not None)
        return t * 2

    with torch.enable_grad():
        checkpoint(body, torch.ones(1, requires_grad=True), use_reentrant=False)
    ok = seen == [True]
    return Feature(
        "conv recipes in a checkpoint's forward",
        ok,
        "a non-reentrant checkpoint's forward is told from its recompute: a conv's recipe there "
        "holds a stand-in for its input"
        if ok
        else "torch.utils.checkpoint's forward pack hook is not named as expected: a conv inside "
        "a non-reentrant checkpoint keeps its input alive while its output lives (up to one "
        "input above eager's peak there)",
    )


def _down_after_saves() -> Feature:
    # NOTE [The down product after the saves] in slimgrad/ops/gated_mlp.py, NOTE [A product after
    # the saves under autocast] in slimgrad/ops/linear.py
    hooks = hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks")
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack  # noqa: F401
    except ImportError:
        modes = hasattr(torch._C, "_len_torch_dispatch_stack")
        what = "torch._C._len_torch_dispatch_stack (dispatch modes unread: none allowed)"
    else:
        modes = True
        what = "torch.utils._python_dispatch._get_current_dispatch_mode_stack"
    ok = hooks and modes
    return Feature(
        "products after their saves (gated MLP, GPT-2's MLP, Linear under autocast)",
        ok,
        f"torch._C._autograd._top_saved_tensors_default_hooks and {what}"
        + (
            " present"
            if ok
            else " missing: a checkpointed block ending in a gated MLP, GPT-2's MLP (or, under "
            "autocast, a Linear) recomputes its last product, which eager's linear does not"
        ),
    )


_FEATURES: tuple[Callable[[], Feature], ...] = (
    _ownership,
    _forward_writes,
    _backward_bodies,
    _triton,
    _c_kernels,
    _numpy,
    _transformers,
    _keep_graph,
    _step_in_backward(0),
    _step_in_backward(1),
    _ctx_fields,
    _modes_aside,
    _dense_check,
    _conv_backend,
    _checkpoint_forward,
    _down_after_saves,
)


def features() -> list[Feature]:
    """Every optional capability with its state; cheap (no kernels are built, no CUDA init)."""
    out = []
    for f in _FEATURES:
        try:
            out.append(f())
        except Exception as e:  # a probe must never break `slimgrad env`
            out.append(Feature(f.__name__.strip("_"), False, f"probe failed: {type(e).__name__}"))
    return out


def features_off() -> list[Feature]:
    """The capabilities that are off in this installation (``report`` lists these)."""
    # Triton without CUDA, numpy and transformers absent: nothing a converted model misses
    quiet = ("Triton kernels", "numpy", "HF handlers")
    return [f for f in features() if not f.on and f.name not in quiet]


# ------------------------------------------------------------------- guarded private imports
try:  # torch._prims_common: private; its absence uses the public-API check below
    from torch._prims_common import is_non_overlapping_and_dense_or_false as _prims_dense
except ImportError:  # pragma: no cover - depends on the torch release
    _prims_dense = None


def _dense_public(t: torch.Tensor) -> bool:
    # c10's compute_non_overlapping_and_dense: dims sorted by stride (size-1 dims ignored) must
    # tile memory exactly, each stride the product of the sizes before it
    if t.dim() == 1:
        return t.size(0) < 2 or t.stride(0) == 1
    dims = sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d)))
    expected = 1
    for d in dims:
        size = t.size(d)
        if size < 2:  # c10 sorts size-0/1 dims last and stops there
            continue
        if t.stride(d) != expected:
            return False
        expected *= size
    return True


def is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements tile a block of memory exactly, in some dimension order."""
    if _prims_dense is not None:
        return bool(_prims_dense(t))
    return _dense_public(t)
