"""Per-call cost of one ownership decision (issue 31: "at most a few microseconds").

    PYTHONPATH=src python benchmarks/ownership_cost.py                 # print the records
    PYTHONPATH=src python benchmarks/ownership_cost.py --record        # and append them

Each kind runs ``N`` decisions in one loop (arm A) against the same loop calling a Python function
that decides nothing (arm B), in interleaved pairs; the cost of a decision is (A - B) / N in the
thread's CPU time, the median over the pairs (min..max beside it). Every decision in arm A is a
grant (counted with ``ownership.reuse_count``), so the whole rule runs each time:

- ``forward``: ``owns_input`` of a module stated in an ``nn.Sequential`` after a Linear;
- ``forward_bottleneck``: the same in a parent with 8 children whose forward fx traced (the
  structure check of NOTE [Forward ownership from stated structure] compares every child);
- ``backward_grad``: ``take`` on an incoming gradient (NOTE [Gradient-buffer ownership]);
- ``backward_view_grad``: the same on a gradient that is a whole-storage view of a fresh base
  (term 2b: a consumer that reshapes its gradient, as HF GPT-2's LayerNorm backward meets; NOTE
  [View gradients asked in C++]);
- ``backward_saved``: ``take_saved`` on a saved tensor (the counted mark only: ``take_saved``
  marks ctx consumed, which a loop repeats).

Records go to ``benchmarks/results/ownership_cost.jsonl`` with versions, commit and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch
from torch import nn

from slimgrad import ownership
from slimgrad.bench.harness import environment, git_commit

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "ownership_cost.jsonl"
N = 2000  # decisions per arm
PAIRS = 21
# the thread's CPU time: on a shared machine (load far above the core count) wall time mostly
# measures the wait for a core; CPU time is what the decisions cost
_clock = time.thread_time_ns


def _nothing(*args) -> None:
    return None


class _Asker(nn.Module):
    _slimgrad_owns_input = True

    def __init__(self) -> None:
        super().__init__()
        self.decide = ownership.owns_input
        self.ns: list[int] = []

    def forward(self, x):
        decide, n = self.decide, N
        t0 = _clock()
        for _ in range(n):
            decide(x, self)
        self.ns.append(_clock() - t0)
        return x


class _Bottleneck(nn.Module):
    # torchvision's Bottleneck shape: 8 children, the asker after the last BatchNorm
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv3, self.bn3 = nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)
        self.relu, self.downsample = _Asker(), None
        self.extra = nn.Identity()

    def forward(self, x):
        out = self.bn1(self.conv1(x))
        out = self.bn2(self.conv2(out))
        out = self.bn3(self.conv3(out))
        return self.relu(out) + self.extra(x)


def _forward_kind(model: nn.Module, asker: _Asker, x: torch.Tensor) -> tuple[list, int]:
    assert ownership.state_inputs_(model) == 1
    ratios, granted = [], 0
    with torch.no_grad():
        for i in range(PAIRS):
            order = ("A", "B") if i % 2 == 0 else ("B", "A")  # interleaved, alternating order
            t = {}
            for arm in order:
                asker.decide = ownership.owns_input if arm == "A" else _nothing
                asker.ns.clear()
                ownership.reset_reuse_count()
                model(x)
                t[arm] = asker.ns[0]
                if arm == "A":
                    granted = ownership.reuse_count("forward")
            ratios.append((t["A"] - t["B"]) / N / 1000)  # microseconds per decision
    return ratios, granted


class _Grad(torch.autograd.Function):
    decide = staticmethod(ownership.take)
    ns: list[int] = []

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad_out):
        decide = _Grad.decide
        t0 = _clock()
        for _ in range(N):
            decide(grad_out)
        _Grad.ns.append(_clock() - t0)
        return grad_out * 2


class _Saved(torch.autograd.Function):
    decide = staticmethod(ownership.take_saved)
    ns: list[int] = []

    @staticmethod
    def forward(ctx, x):
        y = x * 2
        ctx.save_for_backward(y)
        return y.clone()

    @staticmethod
    def backward(ctx, grad_out):
        (y,) = ctx.saved_tensors
        decide = _Saved.decide
        t0 = _clock()
        for _ in range(N):
            decide(ctx, y)
        _Saved.ns.append(_clock() - t0)
        return grad_out * 2


def _backward_kind(fn, counter: str, view: bool = False) -> tuple[list, int]:
    ratios, granted = [], 0
    for i in range(PAIRS):
        order = ("A", "B") if i % 2 == 0 else ("B", "A")
        t = {}
        for arm in order:
            real = ownership.take if fn is _Grad else ownership.take_saved
            fn.decide = staticmethod(real if arm == "A" else _nothing)
            fn.ns.clear()
            x = torch.randn(64, requires_grad=True)
            ownership.reset_reuse_count()
            y = fn.apply(x * 1.5)
            if view:  # its gradient arrives as ViewBackward0's reshape of mul's
                y = y.view(8, 8)
            (y * 3).sum().backward()
            del y
            t[arm] = fn.ns[0]
            if arm == "A":
                granted = ownership.reuse_count(counter)
        ratios.append((t["A"] - t["B"]) / N / 1000)
    return ratios, granted


def measure() -> list[dict]:
    torch.manual_seed(0)
    asker = _Asker()
    seq = nn.Sequential(nn.Linear(16, 16), asker)
    kinds = {"forward": lambda: _forward_kind(seq, asker, torch.randn(4, 16))}
    neck = _Bottleneck(4)
    kinds["forward_bottleneck"] = lambda: _forward_kind(neck, neck.relu, torch.randn(2, 4, 5, 5))
    kinds["backward_grad"] = lambda: _backward_kind(_Grad, "grad")
    kinds["backward_view_grad"] = lambda: _backward_kind(_Grad, "grad", view=True)
    kinds["backward_saved"] = lambda: _backward_kind(_Saved, "saved")
    env = environment()
    commit = git_commit()
    out = []
    for kind, run in kinds.items():
        load = os.getloadavg()[0]
        us, granted = run()
        if granted != N:
            raise RuntimeError(f"{kind}: {granted} of {N} decisions granted; expected all")
        out.append(
            {
                "case": "ownership_decision",
                "kind": kind,
                "decisions_per_arm": N,
                "pairs": PAIRS,
                "granted": granted,
                "clock": "thread CPU time",
                "us_per_decision": round(statistics.median(us), 3),
                "us_min": round(min(us), 3),
                "us_max": round(max(us), 3),
                "load_1min": round(load, 2),
                "python": env["python"],
                "torch": env["torch"],
                "cpu": env["cpu"],
                "cpu_count": env["cpu_count"],
                "commit": commit,
                "date": date.today().isoformat(),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", action="store_true", help=f"append to {RESULTS.name}")
    args = ap.parse_args(argv)
    recs = measure()
    for r in recs:
        print(json.dumps(r))
    if args.record:
        with RESULTS.open("a") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
