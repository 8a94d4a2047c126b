"""Reversible chain step time, side by side: plain autograd, slimgrad (float and exact mode), a
minimal hand-written RevNet backward, and revlib when it is importable; one JSONL record per depth.

The chain is the ``reversible`` bench case's (N additive couplings, F = G = conv3x3(32, 32) + ReLU,
input 8x64x32x32 fp32, loss ``(chain(x) * r).sum()``), every variant on copies of the same blocks.
Per round each variant runs one step, in an order rotated every round (so no variant always
follows the same one); for every step the script records wall time, process CPU time and the
process's minor page faults. It reports, relative to plain autograd:

- ``wall_median_ratio``: median over rounds of the per-round ratio (the harness's statistic);
- ``cpu_min_ratio``: min CPU time over min CPU time (the method of the research note's revlib
  figures: "CPU time per step, 1 thread, min of 7 interleaved runs");
- ``fg_over_plain``: one no-grad forward of every F and G over the median plain step, the recompute
  any RevNet backward must do (a lower bound on the ratio, up to what plain autograd itself
  wastes: zero-filled slice gradients, concatenations, page faults);
- per variant: median and min wall/CPU ms and the median minor faults per step.

The hand-written variant is the RevNet algorithm and nothing else (one Function over the chain,
saves the output, per block one recompute of G then F under enable_grad, autograd.grad for the
vector-Jacobian products): no RNG replay, no BatchNorm handling, no diagnostic, no safety checks.
It is the floor this machine gives the algorithm in PyTorch.

Usage (from the repository root; revlib is optional: ``pip install --no-deps revlib``):
    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/reversible_revlib.py --depths 32 64 \
        --rounds 9 --out benchmarks/results/reversible_revlib.jsonl
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import time
import warnings
from datetime import datetime, timezone

import torch
from torch import nn

from slimgrad.bench.cases import reversible as case
from slimgrad.bench.harness import device_name, git_commit


class _HandRevFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, blocks, x, *params):
        ctx.blocks = blocks
        with torch.no_grad():
            for b in blocks:
                x1, x2 = x.chunk(2, dim=1)
                y1 = x1 + b.F(x2)
                x = torch.cat([y1, x2 + b.G(y1)], dim=1)
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        y1, y2 = (t.contiguous() for t in y.chunk(2, dim=1))
        dy1, dy2 = (t.contiguous() for t in dy.chunk(2, dim=1))
        grads = []
        for b in reversed(ctx.blocks):
            with torch.enable_grad():
                y1_l = y1.detach().requires_grad_()
                g = b.G(y1_l)
                pg = list(b.G.parameters())
                dz, *dpg = torch.autograd.grad(g, [y1_l, *pg], dy2)
            x2 = y2 - g.detach()
            dy1 = dy1 + dz
            with torch.enable_grad():
                x2_l = x2.detach().requires_grad_()
                f = b.F(x2_l)
                pf = list(b.F.parameters())
                dw, *dpf = torch.autograd.grad(f, [x2_l, *pf], dy1)
            x1 = y1 - f.detach()
            dy2 = dy2 + dw
            grads = dpf + dpg + grads
            y1, y2 = x1, x2
        return (None, torch.cat([dy1, dy2], dim=1), *grads)


class _HandRev(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        params = [p for b in self.blocks for p in (*b.F.parameters(), *b.G.parameters())]
        return _HandRevFn.apply(list(self.blocks), x, *params)


def _models(n: int) -> dict[str, nn.Module]:
    plain, _, rev, _ = case.build(n)
    _, _, exact, _ = case.build(n, exact=True)
    blocks = list(plain.body)
    models = {"plain": plain, "slimgrad_float": rev, "slimgrad_exact": exact}
    models["hand_written"] = case._Loss(_HandRev(copy.deepcopy(blocks)))
    try:
        import revlib
    except ImportError:
        revlib = None
    if revlib is not None:
        fs = [m for b in copy.deepcopy(blocks) for m in (b.F, b.G)]
        models["revlib"] = case._Loss(revlib.ReversibleSequential(*fs, split_dim=1))
    return models


def _fg_ms(plain: nn.Module, x: torch.Tensor, repeat: int = 3) -> float:
    halves = x.detach().chunk(2, dim=1)
    ts = []
    with torch.no_grad():
        for _ in range(repeat):
            t0 = time.perf_counter()
            for b in plain.body:
                b.F(halves[1])
                b.G(halves[0])
            ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def run(n: int, rounds: int) -> dict:
    models = _models(n)
    _, _, _, make_inputs = case.build(1)
    x, r = make_inputs()
    names = list(models)
    stats = {k: {"wall": [], "cpu": [], "faults": []} for k in names}

    def step(m):
        for p in m.parameters():
            p.grad = None
        x.grad = None
        m(x, r).backward()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # exact mode's int64 promotion warning, once per step
        for m in models.values():  # warm-up
            step(m)
        for i in range(rounds):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                c0, w0 = time.process_time(), time.perf_counter()
                step(models[name])
                w1, c1 = time.perf_counter(), time.process_time()
                stats[name]["wall"].append((w1 - w0) * 1e3)
                stats[name]["cpu"].append((c1 - c0) * 1e3)
                f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                stats[name]["faults"].append(f1 - f0)
    fg = _fg_ms(models["plain"], x)
    plain = stats["plain"]
    rec = {
        "case": f"reversible_revlib_n{n}",
        "n_blocks": n,
        "rounds": rounds,
        "torch_threads": torch.get_num_threads(),
        "device_name": device_name(torch.device("cpu")),
        "fg_over_plain": fg / statistics.median(plain["wall"]),
        "variants": {},
        "commit": git_commit(),
        "time_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    for name, s in stats.items():
        rec["variants"][name] = {
            "wall_ms_median": statistics.median(s["wall"]),
            "wall_ms_min": min(s["wall"]),
            "cpu_ms_min": min(s["cpu"]),
            "minor_faults_median": statistics.median(s["faults"]),
            "wall_median_ratio": statistics.median(
                a / b for a, b in zip(s["wall"], plain["wall"], strict=True)
            ),
            "cpu_min_ratio": min(s["cpu"]) / min(plain["cpu"]),
        }
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=None, help="JSONL file to append the records to")
    args = ap.parse_args()
    for n in args.depths:
        rec = run(n, args.rounds)
        print(f"N = {n}: F+G forward = {rec['fg_over_plain']:.3f} of a plain step")
        for name, v in rec["variants"].items():
            print(
                f"  {name:15s} wall median {v['wall_ms_median']:8.1f} ms  "
                f"x{v['wall_median_ratio']:.3f} (median of rounds)  "
                f"cpu-min x{v['cpu_min_ratio']:.3f}  faults/step {v['minor_faults_median']:.0f}"
            )
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
