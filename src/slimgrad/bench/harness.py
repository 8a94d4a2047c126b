"""Side-by-side benchmark harness: eager PyTorch against slimgrad on the same model and inputs.

A *case* builds an eager model, the slimgrad version of the same model (same initial weights) and a
function making inputs. :func:`run_case` then, for each side:

- measures one step exactly with :func:`slimgrad.memory.measure` (saved, peak, floor, retained
  bytes), after one discarded instrumented step per side (lazy initialisation stays out of it);
- times ``repeat`` interleaved eager/slimgrad step pairs after ``warmup`` steps each, and reports
  the median step time per side, the median of the per-pair ratios slimgrad/eager and their spread
  (min, quartiles, max; NOTE [Spread of short steps]);
- checks every gradient with the error rule ``max|g - g64| <= 2 max|g_eager - g64| + atol``
  against a float64 copy of the eager model (dropout set to p=0 on all three models for this check
  only, so that the three runs compute the same function);
- appends one JSON record to ``<out_dir>/<case>.jsonl`` when given an ``out_dir`` (by default it
  writes nothing; ``slimgrad bench`` writes into :func:`repo_results_dir` or ``--out``).

# NOTE [Benchmark step]
A step is ``out = model(*inputs); out.backward(grad)`` with every ``.grad`` set to None first and
no optimizer. ``grad`` is None when ``out`` is a scalar (a loss); otherwise a fixed random tensor
of ``out``'s shape (seeded, the same for both sides), so that op-level cases need no loss whose own
saved tensors would blur the figures. Inputs are made fresh (same seed) before every step, outside
the timed and measured region, so in-place ops that overwrite their input cannot leak from one step
into the next. Figures are bytes above what was live before the step (parameters, buffers and
inputs are not counted), as ``slimgrad.memory`` defines them.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib
import importlib.util
import json
import os
import pkgutil
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    import resource as _resource  # POSIX only
except ImportError:  # pragma: no cover - Windows
    _resource = None

from slimgrad import ownership
from slimgrad.kernels import _backend
from slimgrad.testing import DEFAULT_ATOL, max_abs_err

__all__ = [
    "Case",
    "available",
    "case_names",
    "check_grads",
    "environment",
    "get_case",
    "git_commit",
    "list_cases",
    "register_case",
    "repo_results_dir",
    "run_case",
    "slim_version",
]

BuildFn = Callable[..., tuple[Any, Any, Callable[[], Any]]]

MEMORY_FIELDS = (
    "saved_bytes",
    "saved_input_bytes",
    "saved_param_bytes",
    "peak_bytes",
    "forward_peak_bytes",
    "retained_bytes",
    "end_bytes",
    "floor_bytes",
    "floor_input_bytes",
)


@dataclass(frozen=True)
class Case:
    """A named benchmark case.

    Attributes:
        name: unique name, used by ``slimgrad bench NAME`` and as the record file's stem.
        build: ``build(device, dtype, small=False) -> (eager, slim, make_inputs)``. ``eager`` and
        ``slim`` are callables (usually ``nn.Module``) taking ``*make_inputs()``; ``make_inputs()``
        returns a tensor or a tuple of tensors, fresh on every call. See NOTE [Benchmark step].
        description: one line for ``slimgrad bench --list``.
        requires: importable top-level modules the case needs (e.g. ``("transformers",)``).
        grad_check: run the float64 gradient check by default.
        repeat: default number of timed eager/slimgrad pairs.
        warmup: untimed steps per side before timing.
        provider: which slimgrad implementation runs (``"torch"``, ``"triton"``, ...), for the
        record. source: module that registered the case.
        run: optional runner for a case made of several runs (e.g. a depth sweep): ``run_case``
        calls ``run(**its keyword arguments)`` instead of running ``build``'s pair, and returns
        what it returns (a record of the same form; the runner writes its own records).
    """

    name: str
    build: BuildFn
    description: str = ""
    requires: tuple[str, ...] = ()
    grad_check: bool = True
    repeat: int = 5
    warmup: int = 1
    provider: str = "torch"
    source: str = ""
    tags: tuple[str, ...] = field(default_factory=tuple)
    run: Callable[..., dict[str, Any]] | None = None

    def missing(self) -> list[str]:
        """The modules in ``requires`` that cannot be imported here."""
        return [m for m in self.requires if importlib.util.find_spec(m) is None]


_REGISTRY: dict[str, Case] = {}
_BROKEN: dict[str, str] = {}  # case module -> import error, shown by `slimgrad bench --list`
_DISCOVERED = False


def register_case(
    name: str | None = None,
    *,
    description: str = "",
    requires: Sequence[str] = (),
    grad_check: bool = True,
    repeat: int = 5,
    warmup: int = 1,
    provider: str = "torch",
    tags: Sequence[str] = (),
) -> Callable[[BuildFn], BuildFn]:
    """Decorator registering ``build`` as a case (see :class:`Case` and ``slimgrad.bench.cases``).

    Args:
        name: case name; defaults to the build function's module stem.
        description, requires, grad_check, repeat, warmup, provider, tags: as :class:`Case`.

    Raises:
        ValueError: the name is already taken by another build function, or repeat/warmup are
        invalid.

    Example:
        >>> @register_case("my_op", description="my op at 8x64x32x32")  # doctest: +SKIP
        ... def build(device, dtype, small=False):
        ...     return eager, slim, make_inputs
    """
    if repeat < 1 or warmup < 0:
        raise ValueError(
            "slimgrad.bench.register_case: repeat must be >= 1 and warmup >= 0; expected e.g. "
            f"repeat=5, warmup=1, got repeat={repeat}, warmup={warmup}. Pass valid counts."
        )

    def deco(build: BuildFn) -> BuildFn:
        case_name = name or build.__module__.rsplit(".", 1)[-1]
        doc = (build.__doc__ or "").strip().splitlines()
        case = Case(
            name=case_name,
            build=build,
            description=description or (doc[0] if doc else ""),
            requires=tuple(requires),
            grad_check=grad_check,
            repeat=repeat,
            warmup=warmup,
            provider=provider,
            source=build.__module__,
            tags=tuple(tags),
        )
        _add(case)
        return build

    return deco


def _build_id(build: Any) -> str:
    # functools.partial has no __qualname__; its repr names the function and bound arguments.
    return getattr(build, "__qualname__", None) or repr(build)


def _add(case: Case) -> None:
    if not isinstance(case, Case):
        raise TypeError(
            "slimgrad.bench: CASES must hold slimgrad.bench.harness.Case objects; expected Case, "
            f"got "
            f"{type(case).__name__}. Build them with Case(name=..., build=...)."
        )
    old = _REGISTRY.get(case.name)
    # Re-importing the same module (e.g. importlib.reload) re-registers the same build: allowed.
    if old is not None and (old.source, _build_id(old.build)) != (
        case.source,
        _build_id(case.build),
    ):
        raise ValueError(
            f"slimgrad.bench.register_case: case name {case.name!r} is taken; expected a new "
            f"name, got one already registered by {old.source}. Rename one of the cases."
        )
    _REGISTRY[case.name] = case


def _discover() -> None:
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True
    import slimgrad.bench.cases as pkg

    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        modname = f"{pkg.__name__}.{info.name}"
        try:
            mod = importlib.import_module(modname)
            if any(c.source == modname for c in _REGISTRY.values()):
                continue  # registered with @register_case
            if hasattr(mod, "CASES"):
                for case in mod.CASES:
                    if isinstance(case, Case) and not case.source:
                        case = replace(case, source=modname)
                    _add(case)
            elif callable(getattr(mod, "build", None)):
                # the module docstring's first line describes the case (cases/__init__.py)
                doc = (mod.__doc__ or "").strip().splitlines()
                register_case(info.name, description=doc[0] if doc else "")(mod.build)
        except Exception as e:  # a broken case module must not break the other cases or the CLI
            _BROKEN[modname] = f"{type(e).__name__}: {e}"


def case_names() -> list[str]:
    """Names of all registered cases, sorted."""
    _discover()
    return sorted(_REGISTRY)


def list_cases() -> list[Case]:
    """All registered cases, sorted by name."""
    _discover()
    return [_REGISTRY[n] for n in sorted(_REGISTRY)]


def broken_case_modules() -> dict[str, str]:
    """Case modules that failed to import: ``{module: error}``."""
    _discover()
    return dict(_BROKEN)


def get_case(name: str) -> Case:
    """The case called ``name``.

    Raises:
        ValueError: no such case (the message lists the known ones).
    """
    _discover()
    if name not in _REGISTRY:
        raise ValueError(
            f"slimgrad.bench: unknown case; expected one of {case_names()}, got {name!r}. "
            "Run `slimgrad bench --list`."
        )
    return _REGISTRY[name]


def available(case: Case) -> bool:
    return not case.missing()


# -------------------------------------------------------------------------------- environment
def slim_version() -> str:
    import slimgrad

    return getattr(slimgrad, "__version__", "unknown")


def _dist_version(name: str) -> str | None:
    # Metadata only: `slimgrad env` and the records must not import triton (test_import).
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def append_record(out_dir: str | os.PathLike, name: str, rec: dict[str, Any]) -> str:
    """Append ``rec`` as one JSON line to ``<out_dir>/<name>.jsonl`` (made if missing); returns
    the file's path."""
    path = Path(out_dir) / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(rec) + "\n")
    return str(path)


def git_commit() -> str | None:
    """HEAD of the git checkout slimgrad is imported from, with ``+dirty`` for tracked changes;
    where there is no checkout (a copied tree), ``$SLIMGRAD_COMMIT`` if set."""
    root = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("SLIMGRAD_COMMIT") or None
    return head + ("+dirty" if dirty else "") if head else None


def repo_results_dir(cwd: str | os.PathLike | None = None) -> Path | None:
    """The ``benchmarks/results`` folder of the source checkout slimgrad is imported from, when the
    current directory (``cwd``) is inside that checkout; None otherwise (an installed slimgrad, or
    a run from elsewhere): ``slimgrad bench`` then writes a record only where ``--out`` says."""
    root = Path(__file__).resolve().parents[3]  # <root>/src/slimgrad/bench/harness.py
    results = root / "benchmarks" / "results"
    if Path(__file__).resolve().parents[2].name != "src" or not results.is_dir():
        return None
    if not (root / "pyproject.toml").is_file():
        return None
    here = Path(cwd if cwd is not None else os.getcwd()).resolve()
    return results if here == root or root in here.parents else None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return _cpu_name() if device.type == "cpu" else device.type


def environment() -> dict[str, Any]:
    """Versions and devices, for records and ``slimgrad env``; imports neither triton nor HF."""
    info: dict[str, Any] = {
        "slimgrad": slim_version(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _dist_version("triton"),
        "transformers": _dist_version("transformers"),
        "numpy": _dist_version("numpy"),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "cuda": torch.version.cuda,
        "gpus": [],
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


# -------------------------------------------------------------------------------- running
def _as_tuple(xs: Any) -> tuple:
    return xs if isinstance(xs, tuple) else tuple(xs) if isinstance(xs, list) else (xs,)


# NOTE [Page faults in CPU step times]
# On CPU, the C allocator (glibc malloc) hands large freed blocks back to the kernel and faults
# fresh pages in on the next allocation; how many depends on the allocation history, not on the
# model, and a step with tens of thousands of faults takes a sixth longer than one with a few
# thousand (docs/measurements.md). Each timed step's count (``resource.getrusage``, the process's
# minor faults) is recorded with its time in ``minor_faults_all`` so a step-time spread can be read
# against it (None where unavailable).
def _minor_faults() -> int:
    return _resource.getrusage(_resource.RUSAGE_SELF).ru_minflt if _resource is not None else 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clear_grads(model: Any, inputs: Sequence[Any] = ()) -> None:
    if isinstance(model, nn.Module):
        for p in model.parameters():
            p.grad = None
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.is_leaf:
            x.grad = None


def _step(model: Any, inputs: tuple, grad: torch.Tensor | None) -> torch.Tensor:
    out = model(*inputs)
    out.backward(grad)
    return out


@contextlib.contextmanager
def _no_dropout(*models: Any) -> Iterator[None]:
    # Dropout masks differ between float32 and float64 (and between a slimgrad dropout and
    # eager's), so the gradient check turns dropout off; every dropout module (torch's or one
    # converted to slimgrad's) has `p`.
    saved: list[tuple[nn.Module, float]] = []
    for model in models:
        if not isinstance(model, nn.Module):
            continue
        for m in model.modules():
            if "Dropout" in type(m).__name__ and isinstance(getattr(m, "p", None), float):
                saved.append((m, m.p))
                m.p = 0.0
    try:
        yield
    finally:
        for m, p in saved:
            m.p = p


def _to64(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        y = x.detach().to(torch.float64)
        return y.requires_grad_(x.requires_grad)
    return x


def _named_grads(model: Any, inputs: Sequence[Any]) -> dict[str, torch.Tensor | None]:
    grads: dict[str, torch.Tensor | None] = {}
    if isinstance(model, nn.Module):
        for name, p in model.named_parameters():
            if p.requires_grad:
                grads[name] = p.grad
    for i, x in enumerate(inputs):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            grads[f"input{i}"] = x.grad
    return grads


def check_grads(
    eager: Any, slim: Any, fresh: Callable[[], tuple], grad: torch.Tensor | None, dtype: torch.dtype
) -> dict[str, Any]:
    """Check slimgrad's gradients against a float64 copy of ``eager`` with the error rule.

    Runs one step on ``eager``, ``slim`` and the float64 copy (dropout p=0 on all three), on
    ``fresh()`` inputs, backpropagating ``grad`` (None for a scalar output). Parameters are matched
    by name; inputs that require grad are checked as ``input<i>``. All ``.grad`` are cleared after.

    Returns:
        ``ok`` (every tensor within ``2 max|g_eager - g64| + atol`` and none unmatched),
        ``max_abs_err``, ``eager_max_abs_err``, ``atol``, ``n_tensors``, ``n_violations``, ``worst``
        (name closest to or furthest past its bound), ``violations`` (up to 5, worst first, with
        their errors, bound and scale), ``unmatched`` (names missing from ``slim``).
    """
    ref = copy.deepcopy(eager)
    if isinstance(ref, nn.Module):
        ref = ref.to(torch.float64)
    grad64 = grad.to(torch.float64) if grad is not None else None
    runs = {}
    with _no_dropout(eager, slim, ref):
        sides = (("eager", eager, grad), ("slimgrad", slim, grad), ("ref64", ref, grad64))
        for side, model, g in sides:
            xs = fresh()
            if side == "ref64":
                xs = tuple(_to64(x) for x in xs)
            _clear_grads(model, xs)
            _step(model, xs, g)
            runs[side] = _named_grads(model, xs)
            _clear_grads(model, xs)
    del ref
    atol = DEFAULT_ATOL.get(dtype, 1e-6)
    names = [n for n in runs["ref64"] if n in runs["slimgrad"] and n in runs["eager"]]
    unmatched = sorted(set(runs["ref64"]) - set(names))
    worst, worst_excess, max_err, max_eager_err, ok, n_bad = None, float("-inf"), 0.0, 0.0, True, 0
    violations: list[dict[str, Any]] = []
    for n in names:
        r, e, s = runs["ref64"][n], runs["eager"][n], runs["slimgrad"][n]
        if r is None and s is None and e is None:
            continue
        err, eager_err = max_abs_err(s, r), max_abs_err(e, r)
        bound = 2.0 * eager_err + atol
        max_err, max_eager_err = max(max_err, err), max(max_eager_err, eager_err)
        if err > bound:
            ok, n_bad = False, n_bad + 1
            scale = max_abs_err(r, torch.zeros_like(r)) if r is not None else 0.0
            violations.append(
                {"name": n, "err": err, "eager_err": eager_err, "bound": bound, "max_abs": scale}
            )
        if err - bound > worst_excess:
            worst, worst_excess = n, err - bound
    return {
        "ok": ok and not unmatched,
        "max_abs_err": max_err,
        "eager_max_abs_err": max_eager_err,
        "atol": atol,
        "n_tensors": len(names),
        "n_violations": n_bad,
        "worst": worst,
        # The 5 tensors furthest past their bound: name, errors, bound and max|g64| (scale).
        "violations": sorted(violations, key=lambda v: v["bound"] - v["err"])[:5],
        "unmatched": unmatched,
        "note": "float64 reference; dropout p=0 for this check",
    }


def _measure(model: Any, fresh: Callable[[], tuple], grad: torch.Tensor | None) -> dict[str, Any]:
    # The first step run under a dispatch mode imports torch._dynamo lazily, from inside the model's
    # forward; the import leaves reference cycles that keep that frame (and its activations)
    # alive until the cyclic gc runs, so the first measured side would read high. Import it first.
    import torch._dynamo  # noqa: F401

    from slimgrad.memory import measure

    xs = fresh()
    _clear_grads(model, xs)
    # No cyclic collection inside the step: it would free older garbage at a random moment. (A
    # gc.collect() first would do too, but is slow with a large heap.)
    enabled = gc.isenabled()
    gc.disable()
    try:
        # no per-module attribution: its forward hooks would make slimgrad.ownership refuse every
        # forward in-place write (a hooked module's input may be seen by the hook), so the step
        # measured would not be the step the model runs
        m = measure(lambda: model(*xs), grad=grad, module=None, timeline=False)
    finally:
        if enabled:
            gc.enable()
    out = {f: int(getattr(m, f)) for f in MEMORY_FIELDS if hasattr(m, f)}
    by_node = getattr(m, "by_node", None)
    if by_node:
        out["by_node"] = {k: int(v) for k, v in sorted(by_node.items(), key=lambda kv: -kv[1])}
    _clear_grads(model, xs)
    return out


def _first_call(name: str, model: Any, xs: tuple) -> torch.Tensor:
    try:
        out = model(*xs)
    except TypeError as e:
        raise TypeError(
            f"slimgrad.bench: case {name!r}: model(*make_inputs()) failed ({e}); expected "
            f"make_inputs() to return exactly the model's arguments, got {len(xs)} input(s). "
            "Return only the model's inputs (the harness backpropagates a fixed random gradient "
            "for non-scalar outputs), or wrap the model in a module that returns the loss."
        ) from e
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        raise TypeError(
            f"slimgrad.bench: case {name!r}: the model must return a tensor that requires grad; "
            f"expected torch.Tensor (the loss or an output), got {type(out).__name__}"
            f"{'' if not isinstance(out, torch.Tensor) else ' without grad'}. Return the loss "
            "or output tensor from forward."
        )
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _with_inputs(side: dict, eager: dict) -> float | None:
    # (saved + pre-existing inputs kept) / (eager floor + the pre-existing inputs its matmuls keep)
    keys = ("saved_bytes", "saved_input_bytes", "floor_bytes", "floor_input_bytes")
    if any(k not in d for d in (side, eager) for k in keys):
        return None
    return _ratio(
        side["saved_bytes"] + side["saved_input_bytes"],
        eager["floor_bytes"] + eager["floor_input_bytes"],
    )


def _shapes(xs: tuple) -> list:
    return [list(x.shape) if isinstance(x, torch.Tensor) else repr(x) for x in xs]


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    # NOTE [Spread of short steps]: the middle half of the per-pair ratios, within min .. max
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def run_case(
    case: Case | str,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    small: bool = False,
    repeat: int | None = None,
    warmup: int | None = None,
    grad_check: bool | None = None,
    out_dir: str | os.PathLike | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run one case side by side and return (and append) its record.

    Args:
        case: a :class:`Case` or its name.
        device, dtype: where and at which dtype the case is built.
        small: build the case's small variant (tests, quick looks).
        repeat: timed eager/slimgrad pairs (default: the case's); warmup: untimed steps per side
            (at least one runs: it also gives the output's shape).
        grad_check: run the float64 gradient check (default: the case's).
        out_dir: the record is appended to ``out_dir/<case>.jsonl``; None (the default) writes
            nothing.
        seed: seeds the build, the inputs and the output gradient.
        progress: called with a short message before each phase.

    Returns:
        The record: ``case``, ``provider``, ``kernel_backend`` (``slimgrad.kernels`` setting),
        ``grad_buffer_reuse`` (on/off) and ``grad_buffer_reuses`` (buffers the measured slimgrad
        step reused), ``shapes``, ``dtype``, ``device``, per side ``saved_bytes``,
        ``peak_bytes``, ``floor_bytes``, ... and ``step_ms``; ``saved_ratio``, ``peak_ratio``,
        ``time_ratio`` (slimgrad/eager; median of pairs) with ``time_ratio_min``/
        ``time_ratio_max`` and the quartiles ``time_ratio_q1``/``time_ratio_q3`` (NOTE [Spread of
        short steps]); ``saved_over_eager_floor`` and ``eager_saved_over_floor`` (each
        side's saved bytes over the eager floor, NOTE [The matmul-input floor] in
        ``slimgrad/memory.py``; pre-existing inputs are in neither) and the same ``*_with_inputs``
        (saved + ``saved_input_bytes`` over floor + ``floor_input_bytes``: a first layer's input
        is a matmul input too);
        ``grad``; ``versions``; ``commit``.

    Raises:
        ValueError: unknown case name or invalid counts.
        RuntimeError: the case needs a module that is not installed.
    """
    if isinstance(case, str):
        case = get_case(case)
    repeat = case.repeat if repeat is None else repeat
    warmup = case.warmup if warmup is None else warmup
    grad_check = case.grad_check if grad_check is None else grad_check
    if repeat < 1 or warmup < 0:
        raise ValueError(
            "slimgrad.bench.run_case: repeat must be >= 1 and warmup >= 0; expected e.g. repeat=5, "
            f"warmup=1, got repeat={repeat}, warmup={warmup}. Pass valid counts."
        )
    missing = case.missing()
    if missing:
        raise RuntimeError(
            f"slimgrad.bench: case {case.name!r} needs {missing}; expected them importable, got "
            "ImportError. Install the extra, e.g. `pip install slimgrad[hf]`."
        )
    if case.run is not None:
        return case.run(
            device=device, dtype=dtype, small=small, repeat=repeat, warmup=warmup,
            grad_check=grad_check, out_dir=out_dir, seed=seed, progress=progress,
        )  # fmt: skip
    device = torch.device(device)
    say = progress or (lambda msg: None)
    commit = git_commit()  # now, not after the run: the checkout may change meanwhile

    say("build")
    torch.manual_seed(seed)
    eager, slim, make_inputs = case.build(device, dtype, small=small)

    def fresh() -> tuple:
        torch.manual_seed(seed + 1)
        return _as_tuple(make_inputs())

    say("warm-up")
    grad = None
    for _ in range(max(warmup, 1)):
        for model in (eager, slim):
            xs = fresh()
            _clear_grads(model, xs)
            out = _first_call(case.name, model, xs)
            if out.numel() != 1 and grad is None:
                gen = torch.Generator(device="cpu").manual_seed(seed + 2)
                grad = torch.randn(out.shape, generator=gen, dtype=torch.float32)
                grad = grad.to(device=out.device, dtype=out.dtype)
            out.backward(grad if out.numel() != 1 else None)
            del out, xs
            _clear_grads(model)

    say("memory")
    # One untracked-result pass per side first: lazy initialisation met on the first instrumented
    # step (imports, caches) must not land inside a measured one. Then one gc pass, so no older
    # garbage is pending while gc is off during the measured steps.
    for model in (eager, slim):
        _measure(model, fresh, grad)
    gc.collect()
    mem = {"eager": _measure(eager, fresh, grad)}
    ownership.reset_reuse_count()
    mem["slimgrad"] = _measure(slim, fresh, grad)
    reuses = ownership.reuse_count()

    say("timing")
    times: dict[str, list[float]] = {"eager": [], "slimgrad": []}
    faults: dict[str, list[int]] = {"eager": [], "slimgrad": []}
    ratios = []
    # NOTE [Spread of short steps]
    # A small case's step lasts a fraction of a millisecond; anything that interrupts one step
    # (another process on a shared CPU, a burst of page faults, a full gc pass over a heap holding
    # transformers) multiplies that side of that one pair by 100-1000: on a shared CPU the per-pair
    # ratios of conv_chain --small spread over five orders of magnitude around a median near 1
    # (docs/measurements.md). The min and max of the ratios are then the two most
    # interrupted pairs, not the cost of the code: the record keeps them and the quartiles (the
    # middle half of the pairs), and gc stays off while the pairs run; a young-generation pass
    # between pairs, untimed, frees a step's cyclic garbage (held activations must not pile up).
    gc.collect()
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        for i in range(repeat):
            pair = {}
            order = (("eager", eager), ("slimgrad", slim))
            for side, model in order if i % 2 == 0 else order[::-1]:
                xs = fresh()
                _clear_grads(model, xs)
                _sync(device)
                f0 = _minor_faults()
                t0 = time.perf_counter()
                _step(model, xs, grad)
                _sync(device)
                pair[side] = (time.perf_counter() - t0) * 1e3
                faults[side].append(_minor_faults() - f0)
                del xs
                _clear_grads(model)
            for side in times:
                times[side].append(pair[side])
            ratios.append(pair["slimgrad"] / pair["eager"])
            gc.collect(1)
    finally:
        if gc_was_on:
            gc.enable()
    q1, q3 = _quartiles(ratios)

    grad_info = None
    if grad_check:
        say("gradient check")
        grad_info = check_grads(eager, slim, fresh, grad, dtype)

    xs = fresh()
    rec: dict[str, Any] = {
        "case": case.name,
        "provider": case.provider,
        "grad_buffer_reuse": ownership.reuse_enabled(),
        "grad_buffer_reuses": reuses,
        "kernel_backend": _backend.get_backend(),
        "small": small,
        "shapes": _shapes(xs),
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "device_name": device_name(device),
        "params_bytes": (
            sum(p.numel() * p.element_size() for p in eager.parameters())
            if isinstance(eager, nn.Module)
            else None
        ),
        "eager": {**mem["eager"], "step_ms": statistics.median(times["eager"])},
        "slimgrad": {**mem["slimgrad"], "step_ms": statistics.median(times["slimgrad"])},
        "step_ms_all": times,
        # NOTE [Page faults in CPU step times]
        "minor_faults_all": faults if _resource is not None else None,
        "repeat": repeat,
        "warmup": warmup,
        "saved_ratio": _ratio(mem["slimgrad"].get("saved_bytes"), mem["eager"].get("saved_bytes")),
        "peak_ratio": _ratio(mem["slimgrad"].get("peak_bytes"), mem["eager"].get("peak_bytes")),
        "saved_over_eager_floor": _ratio(
            mem["slimgrad"].get("saved_bytes"), mem["eager"].get("floor_bytes")
        ),
        "eager_saved_over_floor": _ratio(
            mem["eager"].get("saved_bytes"), mem["eager"].get("floor_bytes")
        ),
        "saved_over_eager_floor_with_inputs": _with_inputs(mem["slimgrad"], mem["eager"]),
        "eager_saved_over_floor_with_inputs": _with_inputs(mem["eager"], mem["eager"]),
        "time_ratio": statistics.median(ratios),
        "time_ratio_min": min(ratios),
        "time_ratio_max": max(ratios),
        "time_ratio_q1": q1,
        "time_ratio_q3": q3,
        "grad": grad_info,
        "versions": {k: v for k, v in environment().items() if k != "gpus"},
        "commit": commit,
        "time_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if out_dir is not None:
        rec["record_path"] = append_record(out_dir, case.name, rec)
    return rec
