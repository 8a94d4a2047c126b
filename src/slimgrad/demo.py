"""``slimgrad demo``: train a small CNN and a small transformer, eager and slimgrad side by side.

For each model, two copies start from the same weights: ``eager`` (plain PyTorch) and ``slimgrad``
(``slimgrad.convert_`` of a copy). Both train for a few SGD steps on the same synthetic batches.
The first step of each side is measured exactly with ``slimgrad.memory.measure``; its gradients
are checked against a float64 copy with the error rule; the other steps are timed. A table
reports peak MiB, saved MiB, median step ms, max gradient error and whether the loss curves agree;
a PNG shows both memory timelines of the measured step. The transformer has dropout 0 so that both
sides compute the same function and their loss curves can be compared.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slimgrad.bench import models
from slimgrad.bench.cases.models import slim_copy

__all__ = ["run_demo"]

MiB = 2**20
# Loss curves agree when every step's losses match to this relative tolerance (float32 step noise;
# exact equality is expected while no slimgrad op changes the arithmetic).
LOSS_RTOL = 1e-4


def demo_cnn(width: int = 32, n_blocks: int = 3, num_classes: int = 10) -> nn.Sequential:
    """Stem conv + ``n_blocks`` of Conv->BN->LeakyReLU (the conv chain's block) + pool + linear."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.LeakyReLU(0.01, inplace=True),
        models.conv_chain(n_blocks, channels=width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, num_classes),
    )


def _tasks(small: bool) -> list[dict[str, Any]]:
    if small:
        cnn_batch, img, width, blocks = 2, 8, 8, 1
        gcfg, lm_batch, seq = models.GPTConfig.tiny(dropout=0.0), 2, 16
    else:
        cnn_batch, img, width, blocks = 16, 32, 32, 3
        gcfg = models.GPTConfig(
            vocab_size=256, n_positions=128, n_embd=128, n_layer=2, n_head=4, dropout=0.0
        )
        lm_batch, seq = 8, 64

    def cnn_batch_fn(step: int) -> tuple:
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(cnn_batch, 3, img, img, generator=g)
        # A learnable label: which channel has the largest mean.
        y = x.mean(dim=(2, 3)).argmax(dim=1)
        return x, y

    def lm_batch_fn(step: int) -> tuple:
        g = torch.Generator().manual_seed(2000 + step)
        start = torch.randint(0, gcfg.vocab_size, (lm_batch, 1), generator=g)
        stride = torch.randint(1, 4, (lm_batch, 1), generator=g)
        ids = (start + stride * torch.arange(seq)) % gcfg.vocab_size  # learnable sequences
        return ids, ids

    return [
        {
            "name": "cnn",
            "title": f"CNN ({blocks + 1} conv-BN-LeakyReLU blocks), {cnn_batch}x3x{img}x{img}",
            "build": lambda: models.WithLoss(demo_cnn(width, blocks), F.cross_entropy),
            "batch": cnn_batch_fn,
            "lr": 0.05,
        },
        {
            "name": "transformer",
            "title": f"GPT ({gcfg.n_layer} layers, {gcfg.n_embd} wide), {lm_batch}x{seq} tokens",
            "build": lambda: models.GPT(gcfg),
            "batch": lm_batch_fn,
            "lr": 0.1,
        },
    ]


def _train(
    task: dict[str, Any], steps: int, seed: int, advance: Callable[[], None]
) -> dict[str, Any]:
    from slimgrad.bench.harness import check_grads
    from slimgrad.memory import measure

    torch.manual_seed(seed)
    eager = task["build"]()
    slim = slim_copy(eager)
    sides = {"eager": eager, "slimgrad": slim}
    res: dict[str, Any] = {"title": task["title"], "converted": _converted(slim)}

    # Measured step (no optimizer update: it is the same forward/backward as step 0 below). Each
    # side runs once under the tracker first, and gc is off during the measured steps: see
    # slimgrad.bench.harness._measure for why.
    for rep in range(2):
        if rep == 1:
            gc.collect()
        for side, model in sides.items():
            xs = task["batch"](0)
            for p in model.parameters():
                p.grad = None
            enabled = gc.isenabled()
            gc.disable()
            try:
                # module=None: attribution hooks would refuse forward in-place writes
                m = measure(lambda model=model, xs=xs: model(*xs), module=None)
            finally:
                if enabled:
                    gc.enable()
            res[side] = {
                "peak_bytes": m.peak_bytes,
                "saved_bytes": m.saved_bytes,
                "timeline": [t[-1] for t in m.timeline],
                "timeline_op": [t[0] for t in m.timeline],
                "backward_start": getattr(m, "backward_start", None),
            }
            for p in model.parameters():
                p.grad = None
    advance()

    grad = check_grads(eager, slim, lambda: task["batch"](0), None, torch.float32)
    res["grad"] = grad

    opts = {s: torch.optim.SGD(m.parameters(), lr=task["lr"]) for s, m in sides.items()}
    losses: dict[str, list[float]] = {"eager": [], "slimgrad": []}
    times: dict[str, list[float]] = {"eager": [], "slimgrad": []}
    for step in range(steps):
        order = list(sides) if step % 2 == 0 else list(sides)[::-1]
        for side in order:
            model, xs = sides[side], task["batch"](step)
            opts[side].zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss = model(*xs)
            loss.backward()
            times[side].append((time.perf_counter() - t0) * 1e3)
            opts[side].step()
            losses[side].append(loss.detach().item())
        advance()
    for side in sides:
        res[side]["step_ms"] = statistics.median(times[side])
        res[side]["losses"] = losses[side]
    diffs = [abs(a - b) for a, b in zip(losses["eager"], losses["slimgrad"])]
    res["loss_max_abs_diff"] = max(diffs)
    res["loss_agree"] = all(
        math.isfinite(a) and abs(a - b) <= LOSS_RTOL * max(1.0, abs(a))
        for a, b in zip(losses["eager"], losses["slimgrad"])
    )
    return res


def _converted(slim: nn.Module) -> list[str]:
    # What convert_ swapped, as "name: From -> To"
    import slimgrad

    return [f"{n or '<root>'}: {a} -> {b}" for n, a, b in slimgrad.report(slim).converted]


def _plot(results: dict[str, dict[str, Any]], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results.values()):
        for side, style in (("eager", "-"), ("slimgrad", "--")):
            tl = [b / MiB for b in r[side]["timeline"]]
            label = f"{side} (peak {max(tl, default=0):.2f} MiB)"
            ax.step(r[side]["timeline_op"], tl, style, where="post", label=label)
        if r["eager"]["backward_start"] is not None:
            ax.axvline(r["eager"]["backward_start"], color="gray", lw=0.8, ls=":")
        ax.set_title(r["title"], fontsize=9)
        ax.set_xlabel("op index (eager; dotted line: backward starts)")
        ax.set_ylabel("live tensor MiB above start")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("slimgrad demo: memory over one training step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _print_table(results: dict[str, dict[str, Any]]) -> None:
    header = ("model", "side", "peak MiB", "saved MiB", "step ms", "max grad err", "loss curves")
    rows = []
    for name, r in results.items():
        g = r["grad"]
        for side in ("eager", "slimgrad"):
            err = g["eager_max_abs_err"] if side == "eager" else g["max_abs_err"]
            if side == "eager":
                agree = ""
            else:
                agree = "agree" if r["loss_agree"] else "DIFFER"
                agree += f" ({r['loss_max_abs_diff']:.0e})"
                if not g["ok"]:
                    agree += ", GRAD RULE VIOLATED"
            rows.append(
                (
                    name if side == "eager" else "",
                    side,
                    f"{r[side]['peak_bytes'] / MiB:.2f}",
                    f"{r[side]['saved_bytes'] / MiB:.2f}",
                    f"{r[side]['step_ms']:.1f}",
                    f"{err:.1e}",
                    agree,
                )
            )
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
        for row in (header, *rows):
            print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
        return
    table = Table(title="eager PyTorch vs slimgrad (max grad err: vs float64)")
    for i, h in enumerate(header):
        table.add_column(h, justify="right" if 2 <= i <= 5 else "left", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    console = Console()
    if not console.is_terminal:  # pipes and logs: no wrapping at 80 columns
        console = Console(width=max(console.width, 120))
    console.print(table)


def run_demo(
    steps: int = 5, small: bool = False, out: str | None = "slimgrad_demo_memory.png", seed: int = 0
) -> dict[str, Any]:
    """Run the demo, print its table, write the PNG; return the figures.

    Args:
        steps: SGD steps per model and side.
        small: tiny models (for tests).
        out: PNG path for the memory timelines; None writes none.
        seed: initial weights.

    Returns:
        ``{"ok": bool, "png": path or None, "models": {name: {...}}}``; ``ok`` is False when a
        gradient breaks the rule or the loss curves differ.
    """

    tasks = _tasks(small)
    total = len(tasks) * (steps + 1)
    results: dict[str, dict[str, Any]] = {}
    try:
        from rich.progress import Progress
    except ImportError:
        Progress = None  # noqa: N806
    if Progress is not None:
        with Progress(transient=False) as progress:
            bar = progress.add_task("training", total=total)
            for t in tasks:
                progress.update(bar, description=f"{t['name']}: eager + slimgrad")
                results[t["name"]] = _train(t, steps, seed, lambda: progress.advance(bar))
    else:
        for t in tasks:
            print(f"training {t['name']} ({steps} steps, eager + slimgrad) ...", flush=True)
            results[t["name"]] = _train(t, steps, seed, lambda: None)
    _print_table(results)
    for name, r in results.items():
        conv = r["converted"]
        shown = "; ".join(conv[:4]) + (f"; ... ({len(conv) - 4} more)" if len(conv) > 4 else "")
        tail = f": {shown}" if conv else ""
        print(f"{name}: convert_ replaced {len(conv)} module(s){tail}")
    png = None
    if out is not None:
        try:
            png = _plot(results, out)
            print(f"memory timelines written to {png}")
        except ImportError:
            print("matplotlib is not installed: no PNG (pip install slimgrad[dev]).")
    ok = all(r["grad"]["ok"] and r["loss_agree"] for r in results.values())
    return {"ok": ok, "png": png, "models": results}
