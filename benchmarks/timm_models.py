"""Bench records for the six timm models of issue 18 (cases ``timm_*``, bench/cases/timm.py).

Each case runs through ``slimgrad.bench.harness.run_case``: the exact tracker's saved and peak
bytes per side, ``--repeat`` interleaved eager/slimgrad step pairs (median step time per side, the
median of the per-pair ratios and their spread), the float64 gradient check (GUIDE.md rule), one
record appended to ``benchmarks/results/timm_<model>.jsonl``. A summary line per model follows.

timm needs torchvision, whose wheel for this torch does not import on a CPU-only torch until two op
schemas are defined: this script applies the tests' shim (``tests/conformance/_timm_shim.py``; it
also puts ``<venv>/timm-site`` on ``sys.path``). The shim is a set-up concern of the tests and of
this script only; the library never imports timm or torchvision.

Usage (from the repository root):
    PYTHONPATH=src:. .venv/bin/python benchmarks/timm_models.py [--models resnet50 ...]
        [--repeat 7] [--threads 1] [--small] [--no-grad-check] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import sys
import time

MiB = 2**20


def main(argv: list[str] | None = None) -> int:
    from tests.conformance._timm_shim import timm  # defines the schemas, puts timm on sys.path

    if timm is None:
        print("timm (and torchvision) are not installed: run `make env`", file=sys.stderr)
        return 2

    from slimgrad.bench.cases.timm import MODELS
    from slimgrad.bench.harness import run_case

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--repeat", type=int, default=None, help="timed pairs (default: the case's)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--small", action="store_true", help="the tiny siblings (a quick look)")
    ap.add_argument("--no-grad-check", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--out", default="benchmarks/results", help="record directory ('' for none)")
    args = ap.parse_args(argv)
    if args.threads is not None:  # on a shared, loaded box 1 thread avoids OpenMP barrier stalls
        import torch

        torch.set_num_threads(args.threads)

    for name in args.models:
        t0 = time.perf_counter()
        rec = run_case(
            f"timm_{name}",
            small=args.small,
            repeat=args.repeat,
            warmup=args.warmup,
            grad_check=False if args.no_grad_check else None,
            out_dir=args.out or None,
            progress=lambda msg, n=name: print(f"[{n}] {msg}", file=sys.stderr, flush=True),
        )
        e, s, g = rec["eager"], rec["slimgrad"], rec["grad"]
        grads = "not checked"
        if g is not None:
            grads = f"{'ok' if g['ok'] else 'FAILED'} ({g['n_tensors']} tensors)"
        print(
            f"{name}: peak {e['peak_bytes'] / MiB:.1f} -> {s['peak_bytes'] / MiB:.1f} MiB "
            f"({rec['peak_ratio']:.3f}), saved {e['saved_bytes'] / MiB:.1f} -> "
            f"{s['saved_bytes'] / MiB:.1f} MiB ({rec['saved_ratio']:.3f}), step "
            f"{e['step_ms']:.0f} -> {s['step_ms']:.0f} ms, ratio {rec['time_ratio']:.3f} "
            f"[{rec['time_ratio_min']:.3f}, {rec['time_ratio_max']:.3f}] over {rec['repeat']}; "
            f"grads {grads}; "
            f"{time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
