"""``profile``: where every byte of a training step goes, before and after ``convert_``.

For a target (an HF config name, ``module:factory``, or a model and inputs), runs one step of the
original model and one of its converted copy under :func:`slimgrad.memory.measure` (or
:func:`slimgrad.memory.estimate` under fake tensors) and reports, per module, the bytes saved for
backward, the peak and where it falls, the eager model's matmul-input floor, and what ``convert_``
saved. :func:`fit` searches the largest batch whose step fits in a memory budget, under fake
tensors, for slimgrad and for eager; :func:`hf_config_target` makes a target of any HF config
(a ``config.json``, a folder holding one, or a ``model_type``) with fields overridden by
:func:`parse_config_overrides`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from slimgrad.convert import ConvertConfig, convert_
from slimgrad.memory import StepMemory, estimate, measure
from slimgrad.targets import Target, hf_target
from slimgrad.verify import _call

__all__ = [
    "FitResult",
    "ProfileReport",
    "fit",
    "fit_batch",
    "hf_config_target",
    "parse_config_overrides",
    "profile",
    "resident_bytes",
]

MiB = 2**20


@dataclass
class ProfileReport:
    """Eager and converted step memory of one target, with a per-module table."""

    target: str
    batch: int
    eager: StepMemory
    converted: StepMemory | None
    resident_bytes: int  # parameters + buffers + inputs: live before the step
    depth: int
    estimated: bool
    device: str = "cpu"  # whose kernels the figures are for
    dtype: str = "float32"  # the model's floating parameters and inputs

    def rows(self) -> list[tuple[str, int, int]]:
        """(module prefix at ``depth``, eager saved bytes, converted saved bytes), largest first."""
        agg: dict[str, list[int]] = {}
        for i, m in enumerate((self.eager, self.converted)):
            if m is None:
                continue
            for path, b in m.by_module.items():
                key = ".".join(path.split(".")[: self.depth]) if path else "<outside modules>"
                agg.setdefault(key, [0, 0])[i] += b
        return sorted(((k, a, b) for k, (a, b) in agg.items()), key=lambda r: -max(r[1], r[2]))

    def table(self, limit: int = 25) -> str:
        e, c = self.eager, self.converted
        mode = "estimated under fake tensors" if self.estimated else "measured"
        weights = "" if self.dtype == "float32" else f", {self.dtype} weights"
        out = [
            f"{self.target}, batch {self.batch}{weights}, {self.device} kernels ({mode}); MiB "
            f"above the resident {self.resident_bytes / MiB:.1f} MiB of parameters, buffers and "
            "inputs"
        ]
        out.append(f"{'module':40s} {'eager saved':>12s} {'slimgrad':>12s}")
        for name, a, b in self.rows()[:limit]:
            out.append(f"{name[:40]:40s} {a / MiB:12.2f} {b / MiB:12.2f}")
        out.append("-" * 66)

        def line(label, f):
            a = f(e)
            b = f(c) if c is not None else float("nan")
            out.append(f"{label:40s} {a / MiB:12.2f} {b / MiB:12.2f}")

        line("saved for backward", lambda m: m.saved_bytes)
        line("peak (forward + backward)", lambda m: m.peak_bytes)
        out.append(f"{'floor (eager matmul inputs)':40s} {e.floor_bytes / MiB:12.2f}")
        out.append(f"eager peak at {e.peak_op} ({e.peak_phase})")
        if c is not None:
            out.append(f"slimgrad peak at {c.peak_op} ({c.peak_phase})")
            out.append(
                f"convert_ saved {(e.saved_bytes - c.saved_bytes) / MiB:.1f} MiB of saved tensors "
                f"({c.saved_bytes / max(e.saved_bytes, 1):.2f}x eager; "
                f"{c.saved_bytes / max(e.floor_bytes, 1):.2f}x the floor) and "
                f"{(e.peak_bytes - c.peak_bytes) / MiB:.1f} MiB of peak "
                f"({c.peak_bytes / max(e.peak_bytes, 1):.2f}x eager)"
            )
        return "\n".join(out)

    def plot(self, path: str) -> str:
        """Write a PNG of both memory timelines (live MiB over op index) to ``path``."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4))
        for label, m in (("eager", self.eager), ("slimgrad", self.converted)):
            if m is None or not m.timeline:
                continue
            xs = [i for i, _, _ in m.timeline]
            ys = [b / MiB for _, _, b in m.timeline]
            ax.plot(xs, ys, label=f"{label} (peak {m.peak_bytes / MiB:.1f} MiB)", lw=1)
            ax.axvline(m.backward_start, ls=":", lw=0.8, color=ax.lines[-1].get_color())
        ax.axhline(self.eager.floor_bytes / MiB, ls="--", lw=0.8, color="gray", label="eager floor")
        ax.set_xlabel("op index (dotted: backward starts)")
        ax.set_ylabel("live MiB above resident")
        ax.set_title(f"{self.target}, batch {self.batch}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def resident_bytes(model: nn.Module, inputs: Any) -> int:
    """Bytes of parameters, buffers and input tensors (live before a step), each storage once."""
    seen: dict[int, int] = {}
    tensors = list(model.parameters()) + list(model.buffers())
    flat = (
        inputs.values()
        if isinstance(inputs, dict)
        else (inputs if isinstance(inputs, (tuple, list)) else [inputs])
    )
    tensors += [t for t in flat if isinstance(t, torch.Tensor)]
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def _step_fn(model: nn.Module, inputs: Any, loss: Callable) -> Callable[[], torch.Tensor]:
    return lambda: loss(_call(model, inputs))


def _target_make(target: Any, batch: int, amp: torch.dtype | None) -> Callable:
    """``make_forward`` of ``slimgrad.plan``/``memory.estimate`` for a ``slimgrad.targets``
    target: a fresh model (seed 0, init skipped) and its loss step, under CPU autocast to ``amp``
    when given."""

    def make():
        torch.manual_seed(0)
        model = target.build(skip_init=True)
        step = _step_fn(model, target.inputs(batch), target.loss)
        if amp is None:
            return step, model

        def fwd():
            with torch.autocast("cpu", dtype=amp):
                return step()

        return fwd, model

    return make


def _to(inputs: Any, device: torch.device) -> Any:
    if isinstance(inputs, torch.Tensor):
        return inputs.to(device)
    if isinstance(inputs, dict):
        return {k: _to(v, device) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_to(v, device) for v in inputs)
    return inputs


def _cast_floating(inputs: Any, dtype: torch.dtype) -> Any:
    """``inputs`` with every floating tensor (in dicts, tuples, lists) cast to ``dtype``."""
    if isinstance(inputs, torch.Tensor):
        return inputs.to(dtype) if inputs.is_floating_point() else inputs
    if isinstance(inputs, dict):
        return {k: _cast_floating(v, dtype) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_cast_floating(v, dtype) for v in inputs)
    return inputs


def profile(
    target: Target,
    *,
    batch: int | None = None,
    convert: bool = True,
    config: ConvertConfig | None = None,
    fake: bool = False,
    depth: int = 2,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    progress: Callable[[str], None] | None = None,
) -> ProfileReport:
    """Measure (or estimate) one step of ``target``'s model, eager and converted.

    Args:
        target: from :func:`slimgrad.targets.resolve` or :func:`hf_config_target`.
        batch: batch size; the target's default when None.
        convert: also measure ``convert_(copy of the model, config)``.
        config: the ``ConvertConfig``.
        fake: estimate under ``FakeTensorMode`` (no compute, no memory) instead of measuring.
        depth: module-path depth of the per-module table.
        seed: RNG seed set before building and before each step.
        device: ``"cpu"`` or ``"cuda"``. Measured: the model and inputs are moved there before
            ``convert_``. Estimated (``fake=True``): CPU fake tensors stand for that device's
            tensors and its kernels' saved tensors are modelled (``slimgrad.memory.estimate``);
            ``convert_`` decides for that device (its device rule).
        dtype: cast the model (``model.to(dtype)``) and its floating inputs to this dtype before
            ``convert_``, e.g. ``torch.bfloat16`` for a bf16-weights step; None: as built.
        progress: called with a short message before each side's step (None: silent).

    Returns:
        A :class:`ProfileReport`.

    Raises:
        ValueError: ``batch`` is not positive or ``device`` is not cpu or cuda.
    """
    from slimgrad.memory import DEVICES

    kind = torch.device(device).type if isinstance(device, str | torch.device) else device
    if kind not in DEVICES:
        raise ValueError(
            f"slimgrad.profile: device must be one of {list(DEVICES)}; expected cpu or cuda, got "
            f"{device!r}. Pass --device cuda or --device cpu."
        )
    batch = target.default_batch if batch is None else batch
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(
            f"slimgrad.profile: batch must be a positive integer; expected >= 1, got {batch!r}. "
            "Pass --batch N."
        )
    say = progress or (lambda msg: None)

    def run(do_convert: bool):
        def make():
            torch.manual_seed(seed)
            model = target.build(skip_init=fake)
            inputs = target.inputs(batch)
            if dtype is not None:
                model, inputs = model.to(dtype), _cast_floating(inputs, dtype)
            if not fake and kind != "cpu":
                model, inputs = model.to(device), _to(inputs, torch.device(device))
            if do_convert:
                convert_(model, config, device=kind)
            return _step_fn(model, inputs, target.loss), model, inputs

        side = "slimgrad" if do_convert else "eager"
        say(f"{'estimating' if fake else 'measuring'} the {side} step, batch {batch}")
        if fake:
            holder = {}

            def make_fake():
                fwd, model, inputs = make()
                holder["resident"] = resident_bytes(model, inputs)
                return fwd, model

            return estimate(make_fake, device=kind), holder["resident"]
        fwd, model, inputs = make()
        torch.manual_seed(seed)
        return measure(fwd, module=model), resident_bytes(model, inputs)

    eager, resident = run(False)
    converted = run(True)[0] if convert else None
    named = str(dtype or torch.float32).removeprefix("torch.")
    return ProfileReport(target.name, batch, eager, converted, resident, depth, fake, kind, named)


# ------------------------------------------------------------------------------------ batch fit
@dataclass
class FitResult:
    """The largest batches whose step (resident + peak) fits in a budget, estimated.

    ``eager_batch`` / ``slimgrad_batch`` are 0 when even batch 1 does not fit and None when that
    side was not searched; ``report`` is the step at slimgrad's batch (eager's when slimgrad was
    not searched), None when that batch is 0; ``probes`` maps each batch tried to the bytes each
    side needed there.
    """

    target: str
    budget_bytes: int
    eager_batch: int | None
    slimgrad_batch: int | None
    report: ProfileReport | None
    probes: dict[int, dict[str, int]] = field(default_factory=dict)


def fit(
    target: Target,
    budget_bytes: int,
    *,
    convert: bool = True,
    eager: bool = True,
    config: ConvertConfig | None = None,
    max_batch: int = 1 << 16,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    progress: Callable[[str], None] | None = None,
) -> FitResult:
    """Largest batch whose step (resident + peak bytes) fits in ``budget_bytes``, per side.

    Every probe is an estimate under fake tensors (:func:`profile` with ``fake=True``). The
    search assumes the bytes grow with the batch (as a bisection does). It probes batches 1 and 2,
    then the batch where the straight line through the two nearest probes meets the budget and,
    when that one fits, the next batch: when the step's bytes are affine in the batch, as they
    usually are, that settles it in four or five probes. A round whose line did not halve the
    interval also bisects it. A probe of the converted step also gives eager's bytes at that
    batch; eager's search starts from them.

    Args:
        target: the target.
        budget_bytes: the memory budget in bytes (> 0).
        convert: search the converted (slimgrad) step's largest batch.
        eager: search the eager step's largest batch.
        config: the ``ConvertConfig``.
        max_batch: the largest batch tried.
        device: whose kernels (``"cpu"`` or ``"cuda"``; no GPU needed).
        dtype: the model's dtype, as :func:`profile` takes it.
        progress: called with one line per probe (batch, bytes per side, fits or over).

    Returns:
        A :class:`FitResult`.

    Raises:
        ValueError: ``budget_bytes`` or ``max_batch`` is not positive, or no side is searched.
    """
    if not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(
            f"slimgrad.profile.fit: budget_bytes must be a positive integer; expected > 0, got "
            f"{budget_bytes!r}. Pass a budget such as 8 * 2**30 (--fit-gib 8)."
        )
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(
            f"slimgrad.profile.fit: max_batch must be positive; expected >= 1, got {max_batch!r}. "
            "Pass e.g. max_batch=4096."
        )
    if not (convert or eager):
        raise ValueError(
            "slimgrad.profile.fit: nothing to search; expected convert=True or eager=True, got "
            "both False. Search at least one side."
        )
    say = progress or (lambda msg: None)
    probes: dict[int, dict[str, int]] = {}
    reports: dict[tuple[str, int], ProfileReport] = {}

    def used(side: str, b: int) -> int:
        have = probes.setdefault(b, {})
        if side not in have:
            rep = profile(
                target, batch=b, convert=side == "slimgrad", config=config, fake=True,
                device=device, dtype=dtype,
            )  # fmt: skip
            for name, m in (("eager", rep.eager), ("slimgrad", rep.converted)):
                if m is not None:
                    have[name] = rep.resident_bytes + m.peak_bytes
                    reports[(name, b)] = rep
            parts = [
                f"{name} {_fmt_bytes(n)} ({'fits' if n <= budget_bytes else 'over'})"
                for name, n in sorted(have.items(), reverse=True)
            ]
            say(f"batch {b}: {', '.join(parts)}")
        return have[side]

    def largest(side: str) -> int:
        lo, hi = 0, max_batch + 1  # lo fits (0: none yet); hi does not (max_batch + 1: unknown)
        fitting: list[int] = []

        def probe(b: int) -> None:
            nonlocal lo, hi
            if used(side, b) <= budget_bytes:
                lo = max(lo, b)
                fitting.append(b)
            else:
                hi = min(hi, b)

        for b in sorted(b for b, have in probes.items() if side in have):
            probe(b)  # what the other side's probes already measured for this side
        if not fitting:
            probe(1)
        while hi - lo > 1 and lo > 0:
            # the straight line through lo and hi, or (no batch over yet) through the two largest
            # fitting batches; doubling where there is no such line
            x0, x1 = (lo, hi) if hi <= max_batch else (sorted(fitting)[-2:] + [0])[:2]
            rise = used(side, x1) - used(side, x0) if x0 and x1 else 0
            width = hi - lo
            if rise > 0:
                guess = x0 + (budget_bytes - used(side, x0)) * (x1 - x0) // rise
                guess = min(max(guess, lo + 1), hi - 1)
                probe(guess)
                if lo == guess and guess + 1 < hi:
                    probe(guess + 1)  # affine bytes (the usual case): the guess is the answer
            else:
                probe(min(2 * lo, hi - 1))
            if hi <= max_batch and 2 * (hi - lo) > width:
                probe((lo + hi) // 2)  # the line did not halve the interval: bisect once
        return lo

    slim_b = largest("slimgrad") if convert else None
    eager_b = largest("eager") if eager else None
    side, b = ("slimgrad", slim_b) if convert else ("eager", eager_b)
    return FitResult(target.name, budget_bytes, eager_b, slim_b, reports.get((side, b)), probes)


def fit_batch(
    target: Target,
    budget_bytes: int,
    *,
    convert: bool = True,
    config: ConvertConfig | None = None,
    max_batch: int = 1 << 16,
    progress: bool | Callable[[str], None] = False,
    device: str = "cpu",
) -> tuple[int, ProfileReport | None]:
    """Largest batch whose step (resident + peak) fits in ``budget_bytes``, under fake tensors.

    One side only (the converted step, or eager's with ``convert=False``); :func:`fit` searches
    both. ``progress=True`` prints one line per probe to stderr.

    Returns:
        ``(batch, report at that batch)``; ``(0, None)`` when even batch 1 does not fit.
    """
    if progress is True:
        progress = _stderr("slimgrad.profile.fit_batch")
    r = fit(
        target, budget_bytes, convert=convert, eager=not convert, config=config,
        max_batch=max_batch, device=device, progress=progress or None,
    )  # fmt: skip
    return (r.slimgrad_batch if convert else r.eager_batch) or 0, r.report


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / MiB:.2f} MiB"


def _stderr(prefix: str) -> Callable[[str], None]:
    return lambda msg: print(f"{prefix}: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------- HF config targets
def _transformers(api: str):
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            f"slimgrad.profile.{api}: HF configs need transformers; expected it installed, got "
            "ImportError. Install the extra: pip install 'slimgrad[hf]'."
        ) from e
    return transformers


_NONE_WORDS = ("none", "null")
_TRUE_WORDS = ("true", "1", "yes", "on")
_FALSE_WORDS = ("false", "0", "no", "off")
_NO = object()  # "this type does not take the text"


def _members(tp: Any) -> list[Any]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(tp) for m in _members(a)]
    return [tp]


def _rank(tp: Any) -> int:
    # bool before int (bool("1") is no test), numbers before text, text last
    order = {bool: 0, int: 1, float: 2}
    if tp in order:
        return order[tp]
    if typing.get_origin(tp) is typing.Literal:
        return 3
    return 5 if tp is str else 4


def _as(tp: Any, text: str) -> Any:
    low = text.lower()
    if tp is bool:
        return True if low in _TRUE_WORDS else False if low in _FALSE_WORDS else _NO
    if tp in (int, float):
        try:
            return tp(text)
        except ValueError:
            return _NO
    if typing.get_origin(tp) is typing.Literal:
        return next((v for v in typing.get_args(tp) if str(v) == text), _NO)
    if tp is str:
        return text
    container = typing.get_origin(tp) or tp
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = _NO
    if container in (list, tuple, dict):
        if container is tuple and isinstance(value, list):
            return tuple(value)
        return value if isinstance(value, container) else _NO
    return text if value is _NO else value  # Any, torch.dtype, a sub-config: JSON or the text


def _describe(tp: Any) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "text"}
    if tp in names:
        return names[tp]
    if tp is type(None):
        return "None"
    if typing.get_origin(tp) is typing.Literal:
        return f"one of {list(typing.get_args(tp))}"
    container = typing.get_origin(tp) or tp
    return {list: "a JSON list", tuple: "a JSON list", dict: "a JSON object"}.get(
        container, getattr(tp, "__name__", str(tp))
    )


def _example(members: list[Any]) -> str:
    for tp, ex in ((bool, "true"), (int, "2"), (float, "0.1")):
        if tp in members:
            return ex
    return "VALUE"


def _config_fields(config_class: type) -> dict[str, Any]:
    """The settable fields of an HF config class, name -> type (the default's type where the
    annotation is not a type)."""
    out: dict[str, Any] = {}
    if dataclasses.is_dataclass(config_class):
        for f in dataclasses.fields(config_class):
            tp = f.type
            if isinstance(tp, str):  # an unevaluated annotation: fall back on the default's type
                tp = type(f.default) if f.default not in (None, dataclasses.MISSING) else Any
            out[f.name] = tp
    try:
        defaults = config_class().to_dict()
    except Exception:  # a config that needs arguments: its dataclass fields only
        defaults = {}
    for k, v in defaults.items():
        if not k.startswith("_") and k not in ("model_type", "transformers_version"):
            out.setdefault(k, type(v) if v is not None else Any)
    return out


def parse_config_overrides(config_class: type, items: Sequence[str]) -> dict[str, Any]:
    """Parse ``KEY=VALUE`` strings against an HF config class's fields.

    Each key must be a field of ``config_class``; each value is read as the field's type
    (integer, number, ``true``/``false``, one of a ``Literal``'s values, JSON for lists and
    dicts, ``None`` where the field allows it, text otherwise).

    Returns:
        ``{key: parsed value}``.

    Raises:
        ValueError: an item without ``=``, an unknown key (the message names close matches), or
            a value the field's type does not take.
    """
    api = "slimgrad.profile.parse_config_overrides"
    cls = config_class.__name__
    known = _config_fields(config_class)
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key, text = key.strip(), raw.strip()
        if not sep or not key:
            raise ValueError(
                f"{api}: --set takes KEY=VALUE; expected e.g. num_hidden_layers=2, got {item!r}. "
                "Pass --set KEY=VALUE."
            )
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=3, cutoff=0.6)
            fix = (
                f"Did you mean {' or '.join(repr(c) for c in close)}?"
                if close
                else f"Use one of {cls}'s fields: {', '.join(sorted(known))}."
            )
            raise ValueError(
                f"{api}: unknown field {key!r} of {cls}; expected a {cls} field, got {key!r}. {fix}"
            )
        members = sorted(_members(known[key]), key=_rank)
        if type(None) in members and text.lower() in _NONE_WORDS:
            out[key] = None
            continue
        value = next((v for v in (_as(m, text) for m in members if m is not type(None))
                      if v is not _NO), _NO)  # fmt: skip
        if value is _NO:
            want = " or ".join(dict.fromkeys(_describe(m) for m in members))
            raise ValueError(
                f"{api}: bad value for {cls}.{key}; expected {want}, got {raw!r}. Pass e.g. "
                f"--set {key}={_example(members)}."
            )
        out[key] = value
    return out


def _hf_config_class(spec: str) -> tuple[type, dict[str, Any]]:
    """The config class and stored fields of ``spec``: a ``config.json``, a folder holding one,
    or a ``model_type`` (``llama``: its class's defaults). Reads local files only.

    Raises:
        ValueError: no such file or folder, unreadable JSON, or an unknown ``model_type``.
        ImportError: transformers is not installed.
    """
    api = "slimgrad.profile.hf_config"
    _transformers("hf_config")
    from transformers import CONFIG_MAPPING

    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(
                f"{api}: folder {spec!r} holds no config.json; expected a folder with an HF "
                f"config.json, got none at {path!r}. Pass the config.json's folder or the file."
            )
    if not os.path.isfile(path):
        if spec in CONFIG_MAPPING:
            return CONFIG_MAPPING[spec], {}
        if os.sep in spec or "/" in spec or spec.endswith(".json"):
            raise ValueError(
                f"{api}: no such file or folder {spec!r}; expected a config.json or a folder "
                "holding one, got a missing path. Check the path."
            )
        close = difflib.get_close_matches(spec, list(CONFIG_MAPPING.keys()), n=3, cutoff=0.6)
        fix = f"Did you mean {' or '.join(repr(c) for c in close)}?" if close else (
            "Pass a model_type such as 'llama', 'gpt2' or 'bert', or a config.json path."
        )  # fmt: skip
        raise ValueError(
            f"{api}: unknown model_type {spec!r}; expected an HF model_type, a config.json or its "
            f"folder, got {spec!r}. {fix}"
        )
    try:
        with open(path) as f:
            stored = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{api}: cannot read {path!r}; expected an HF config.json, got "
            f"{type(e).__name__}: {e}. Check the file."
        ) from e
    model_type = stored.get("model_type") if isinstance(stored, dict) else None
    if model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"{api}: {path!r} names no known model_type; expected a 'model_type' transformers "
            f"knows (e.g. 'llama'), got {model_type!r}. Add or fix its model_type."
        )
    return CONFIG_MAPPING[model_type], stored


# model_type -> (transformers class name, input kind); the first task whose mapping has it wins
_HEADS = (
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "causal"),
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "mlm"),
    ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "image"),
)


def hf_config_target(
    spec: str, *, seq: int = 256, overrides: Sequence[str] | dict[str, Any] = ()
) -> Target:
    """A target from an HF config: a ``config.json``, a folder holding one, or a ``model_type``.

    The model is the config's causal-LM head (labels = input ids), else its masked-LM head (15%
    of positions labelled), else its image-classification head, built with random weights
    (nothing is downloaded; only local files are read).

    Args:
        spec: the path or ``model_type``.
        seq: sequence length of text models.
        overrides: ``KEY=VALUE`` strings (parsed by :func:`parse_config_overrides`) or a dict of
            already typed fields, applied over the stored config.

    Raises:
        ValueError: see :func:`_hf_config_class` and :func:`parse_config_overrides`; a config its
            class rejects; a model type with none of the three heads.
        ImportError: transformers is not installed.
    """
    api = "slimgrad.profile.hf_config_target"
    transformers = _transformers("hf_config_target")
    from transformers.models.auto import modeling_auto

    cls, stored = _hf_config_class(spec)
    if not isinstance(overrides, dict):
        overrides = parse_config_overrides(cls, overrides)
    model_type = cls.model_type
    head = next(
        ((getattr(modeling_auto, m)[model_type], kind) for m, kind in _HEADS
         if model_type in getattr(modeling_auto, m)),
        None,
    )  # fmt: skip
    if head is None:
        raise ValueError(
            f"{api}: model_type {model_type!r} has no causal-LM, masked-LM or image-"
            f"classification head in transformers; expected one of them, got none. Profile it "
            "as module:factory (a function returning the model and make_inputs)."
        )
    try:
        cfg = cls.from_dict({**stored, **overrides}) if stored else cls(**overrides)
    except Exception as e:  # the class's own validation: one line, the cause named
        raise ValueError(
            f"{api}: {cls.__name__} rejects these values; expected a valid {model_type} config, "
            f"got {type(e).__name__}: {' '.join(str(e).split()).rstrip('.')}. Fix the --set "
            "values or the config.json."
        ) from e
    kind = head[1]
    vocab = getattr(cfg, "vocab_size", None)
    if kind != "image" and not isinstance(vocab, int):
        raise ValueError(
            f"{api}: {cls.__name__} has no integer vocab_size; expected one for a text model, got "
            f"{vocab!r}. Pass --set vocab_size=N."
        )

    return hf_target(f"hf-config:{spec}", cfg, getattr(transformers, head[0]), kind, seq)
