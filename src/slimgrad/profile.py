"""``profile``: where every byte of a training step goes, before and after ``convert_``.

For a target (an HF config name, ``module:factory``, or a model and inputs), runs one step of the
original model and one of its converted copy under :func:`slimgrad.memory.measure` (or
:func:`slimgrad.memory.estimate` under fake tensors) and reports, per module, the bytes saved for
backward, the peak and where it falls, the eager model's matmul-input floor, and what ``convert_``
saved. ``fit_batch`` searches the largest batch whose step fits in a memory budget, under fake
tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from slimgrad.convert import ConvertConfig, convert_
from slimgrad.memory import StepMemory, estimate, measure
from slimgrad.targets import Target
from slimgrad.verify import _call

__all__ = ["ProfileReport", "fit_batch", "profile", "resident_bytes"]

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
        out = [
            f"{self.target}, batch {self.batch}, {self.device} kernels ({mode}); MiB above the "
            f"resident {self.resident_bytes / MiB:.1f} MiB of parameters, buffers and inputs"
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


def _to(inputs: Any, device: torch.device) -> Any:
    if isinstance(inputs, torch.Tensor):
        return inputs.to(device)
    if isinstance(inputs, dict):
        return {k: _to(v, device) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_to(v, device) for v in inputs)
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
) -> ProfileReport:
    """Measure (or estimate) one step of ``target``'s model, eager and converted.

    Args:
        target: from :func:`slimgrad.targets.resolve`.
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
    batch = batch or target.default_batch
    if batch < 1:
        raise ValueError(
            f"slimgrad.profile: batch must be positive; expected >= 1, got {batch}. Pass --batch N."
        )

    def run(do_convert: bool):
        def make():
            torch.manual_seed(seed)
            model = target.build(skip_init=fake)
            inputs = target.inputs(batch)
            if not fake and kind != "cpu":
                model, inputs = model.to(device), _to(inputs, torch.device(device))
            if do_convert:
                convert_(model, config, device=kind)
            return _step_fn(model, inputs, target.loss), model, inputs

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
    return ProfileReport(target.name, batch, eager, converted, resident, depth, fake, kind)


def fit_batch(
    target: Target,
    budget_bytes: int,
    *,
    convert: bool = True,
    config: ConvertConfig | None = None,
    max_batch: int = 1 << 16,
    progress: bool = False,
    device: str = "cpu",
) -> tuple[int, ProfileReport | None]:
    """Largest batch whose step (resident + peak) fits in ``budget_bytes``, under fake tensors.

    Returns:
        ``(batch, report at that batch)``; ``(0, None)`` when even batch 1 does not fit.
    """

    bar = _Progress(f"fit {target.name} in {budget_bytes / 2**30:.2f} GiB") if progress else None

    def need(b: int) -> tuple[int, ProfileReport]:
        rep = profile(target, batch=b, convert=convert, config=config, fake=True, device=device)
        m = rep.converted if convert else rep.eager
        used = rep.resident_bytes + m.peak_bytes
        if bar is not None:
            bar.note(f"batch {b}: {used / 2**30:.2f} GiB")
        return used, rep

    lo, lo_rep = 0, None
    hi = 1
    while hi <= max_batch:
        used, rep = need(hi)
        if used > budget_bytes:
            break
        lo, lo_rep = hi, rep
        hi *= 2
    hi = min(hi, max_batch + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        used, rep = need(mid)
        if used <= budget_bytes:
            lo, lo_rep = mid, rep
        else:
            hi = mid
    if bar is not None:
        bar.close()
    return lo, lo_rep


class _Progress:
    # a rich spinner with the last probe, when rich is installed; silent otherwise
    def __init__(self, title: str):
        try:
            from rich.progress import Progress, SpinnerColumn, TextColumn
        except ImportError:
            self.p = None
            return
        self.p = Progress(SpinnerColumn(), TextColumn("{task.description}"), transient=True)
        self.p.start()
        self.title = title
        self.task = self.p.add_task(title)

    def note(self, text: str) -> None:
        if self.p is not None:
            self.p.update(self.task, description=f"{self.title}: {text}")

    def close(self) -> None:
        if self.p is not None:
            self.p.stop()
