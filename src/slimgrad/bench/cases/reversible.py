"""Reversible chain of N additive couplings (F = G = conv3x3 + ReLU) vs plain and checkpoint.

Input 8x64x32x32 fp32 (``small``: 2x8x8x8), loss ``(y * r).sum()``. ``build(n_blocks, ...)`` returns
the three models on the same blocks (same weights) and an input maker; ``main()`` measures each with
``slimgrad.memory.measure`` at N = 4, 8, 16, 32, 64, times interleaved steps (CPU time per step,
one thread) and prints/appends JSON records. For ``slimgrad bench`` the module also registers
harness cases ``reversible_n{N}`` (eager = plain chain, slim = ReversibleSequential) and
``reversible_exact_n{N}`` (eager = plain autograd of the fixed-point network, slim = exact mode).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from slimgrad.nn.reversible import AdditiveCoupling, ReversibleSequential

DEPTHS = (4, 8, 16, 32, 64)


def _blocks(n_blocks: int, c_half: int, device, dtype) -> list[nn.Module]:
    def fn() -> nn.Module:
        return nn.Sequential(nn.Conv2d(c_half, c_half, 3, padding=1), nn.ReLU())

    torch.manual_seed(0)
    return [AdditiveCoupling(fn(), fn()).to(device, dtype) for _ in range(n_blocks)]


class _Checkpointed(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False)
        return x


class _Loss(nn.Module):
    # model(x, r) -> (model(x) * r).sum(), so every side is measured on the same scalar loss
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return (self.body(x) * r).sum()


def build(n_blocks: int, device="cpu", dtype=torch.float32, small: bool = False, exact=False):
    """(plain_model, checkpoint_model, rev_model, make_inputs): same blocks, separate copies.

    Each model maps ``(x, r)`` to the loss ``(chain(x) * r).sum()``; ``make_inputs()`` returns fresh
    ``(x, r)`` with x requiring grad. With ``exact=True`` the plain model is plain autograd of the
    same fixed-point network (``ReversibleSequential(..., exact=True, reversible=False)``) and there
    is no checkpoint model (None).
    """
    shape = (2, 8, 8, 8) if small else (8, 64, 32, 32)
    blocks = _blocks(n_blocks, shape[1] // 2, device, dtype)
    if exact:
        plain = _Loss(ReversibleSequential(*copy.deepcopy(blocks), exact=True, reversible=False))
        ckpt = None
    else:
        plain = _Loss(nn.Sequential(*copy.deepcopy(blocks)))
        ckpt = _Loss(_Checkpointed(copy.deepcopy(blocks)))
    rev = _Loss(ReversibleSequential(*copy.deepcopy(blocks), exact=exact))

    def make_inputs():
        g = torch.Generator().manual_seed(1)
        x = torch.randn(shape, generator=g).to(device, dtype).requires_grad_(True)
        r = torch.randn(shape, generator=g).to(device, dtype)
        return x, r

    return plain, ckpt, rev, make_inputs


def _harness_build(n_blocks: int, device, dtype, small: bool = False, exact: bool = False):
    plain, _, rev, make_inputs = build(n_blocks, device, dtype, small, exact=exact)
    # same parameter names on both sides: plain.body.0.F.0.weight == rev.body.0.F.0.weight
    return plain, rev, make_inputs


try:  # the bench harness lands separately; without it only main() is available
    from slimgrad.bench.harness import Case

    CASES = [
        Case(
            name=f"reversible_n{n}",
            build=functools.partial(_harness_build, n),
            description=f"reversible chain, {n} additive conv couplings, 8x64x32x32",
            repeat=3,
        )
        for n in DEPTHS
    ] + [
        Case(
            name=f"reversible_exact_n{n}",
            build=functools.partial(_harness_build, n, exact=True),
            description=f"reversible chain, exact (fixed-point) mode, {n} couplings, 8x64x32x32",
            repeat=3,
        )
        for n in DEPTHS
    ]
except ImportError:  # pragma: no cover
    CASES = []


def _step(model: nn.Module, inputs) -> None:
    for p in model.parameters():
        p.grad = None
    model(*inputs).backward()


def _grads(model: nn.Module, inputs) -> list[torch.Tensor]:
    _step(model, inputs)
    return [inputs[0].grad, *[p.grad for p in model.parameters()]]


def _rel_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((u - v).abs().max() / v.abs().max().clamp_min(1e-30)) for u, v in zip(a, b))


def run(depths=DEPTHS, small=False, repeat=5, exact=False, out: Path | None = None) -> list[dict]:
    """Measure and time plain / checkpoint / reversible at each depth; one record per depth."""
    from slimgrad.memory import measure

    torch.set_num_threads(1)
    records = []
    for n in depths:
        plain, ckpt, rev, make_inputs = build(n, small=small, exact=exact)
        models = {"plain": plain, "ckpt": ckpt, "rev": rev}
        models = {k: m for k, m in models.items() if m is not None}
        rec: dict = {"case": "reversible", "n_blocks": n, "small": small, "exact": exact}
        ref = _grads(models["plain"], make_inputs())
        for name, m in models.items():
            inputs = make_inputs()
            for p in m.parameters():
                p.grad = None
            mem = measure(lambda m=m, inputs=inputs: m(*inputs))
            rec[f"{name}_peak_bytes"] = mem.peak_bytes
            rec[f"{name}_saved_bytes"] = mem.saved_bytes
            rec[f"{name}_retained_bytes"] = mem.retained_bytes
            got = _grads(m, make_inputs())
            rec[f"{name}_grad_rel_err"] = _rel_err(got, ref)
            rec[f"{name}_grads_bit_identical"] = all(torch.equal(a, b) for a, b in zip(got, ref))
        rec["param_bytes"] = sum(p.numel() * p.element_size() for p in models["rev"].parameters())
        report = models["rev"].body.last_reconstruction
        if report is not None:
            rec["rev_reconstruction_max_abs"] = report.max_abs
            rec["rev_reconstruction_max_rel"] = report.max_rel
        # interleaved timing: CPU time of one step (one thread), pairs plain/ckpt/rev in turn
        times: dict[str, list[float]] = {k: [] for k in models}
        for m in models.values():
            _step(m, make_inputs())  # warm-up
        for _ in range(repeat):
            for name, m in models.items():
                inputs = make_inputs()
                t0 = time.process_time()
                _step(m, inputs)
                times[name].append(time.process_time() - t0)
        for name in [k for k in ("ckpt", "rev") if k in models]:
            ratios = [a / b for a, b in zip(times[name], times["plain"])]
            rec[f"{name}_over_plain_median"] = statistics.median(ratios)
            rec[f"{name}_over_plain_min"] = min(ratios)
            rec[f"{name}_over_plain_max"] = max(ratios)
        for name in models:
            rec[f"{name}_step_ms_median"] = 1e3 * statistics.median(times[name])
        rec.update(
            commit=_commit(),
            torch=torch.__version__,
            device="cpu",
            threads=torch.get_num_threads(),
            repeat=repeat,
            timing="process_time per step, interleaved",
        )
        records.append(rec)
        print(json.dumps(rec), flush=True)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            with out.open("a") as f:
                f.write(json.dumps(rec) + "\n")
    return records


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="*", default=list(DEPTHS))
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--exact", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="append JSONL records here")
    args = ap.parse_args(argv)
    run(args.depths, args.small, args.repeat, args.exact, args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
