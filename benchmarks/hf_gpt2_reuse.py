"""Converted HF GPT-2: gradient-buffer reuse on vs off (issue 6), one JSONL record.

Builds the ``hf_gpt2`` bench case's model (``GPT2LMHeadModel(GPT2Config(n_layer=L))``, random
init, dropout 0.1, 4 x 256 tokens, labels = ids), converts a copy with ``slimgrad.convert_`` and
compares the converted model with itself, reuse on against ``slimgrad.ownership.reuse_disabled()``:

- every parameter gradient of one step, same seed (same dropout masks): ``torch.equal`` (reuse must
  never change a bit; the script fails otherwise);
- exact bytes from ``slimgrad.memory.measure``: peak, backward peak (the largest live bytes after
  backward starts), saved, and how many buffers were reused (``ownership.reuse_count``);
- step time, interleaved on/off pairs (median ratio and spread).

Usage (from the repository root):
    PYTHONPATH=src python benchmarks/hf_gpt2_reuse.py --layers 12 --repeat 3 \
        --out benchmarks/results/hf_gpt2.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import statistics
import time
from datetime import datetime, timezone

import torch


def _step(model, ids, seed):
    torch.manual_seed(seed)
    model(ids).backward()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _clear(model):
    for p in model.parameters():
        p.grad = None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSONL file to append the record to")
    args = ap.parse_args(argv)

    from transformers import GPT2Config, GPT2LMHeadModel

    import slimgrad
    from slimgrad import ownership
    from slimgrad.bench.cases.models import HFCausalLMLoss
    from slimgrad.bench.harness import environment, git_commit
    from slimgrad.memory import measure

    torch.manual_seed(0)
    eager = HFCausalLMLoss(GPT2LMHeadModel(GPT2Config(n_layer=args.layers))).train()
    slim = slimgrad.convert_(copy.deepcopy(eager))
    del eager
    ids = torch.randint(0, slim.model.config.vocab_size, (4, 256))

    def mode(on: bool):
        return contextlib.nullcontext() if on else ownership.reuse_disabled()

    # gradients: bit for bit
    grads = {}
    for on in (True, False):
        with mode(on):
            _step(slim, ids, seed=1)
        grads[on] = _grads(slim)
        _clear(slim)
    differ = [n for n in grads[True] if not torch.equal(grads[True][n], grads[False][n])]
    if differ or grads[True].keys() != grads[False].keys():
        raise SystemExit(f"reuse changed gradients: {differ[:5]}")

    # memory: exact bytes (one untracked pass first: lazy caches must not land in a measured step)
    mem = {}
    for on in (True, False, True, False):
        with mode(on):
            ownership.reset_reuse_count()
            gc.collect()
            torch.manual_seed(2)
            m = measure(lambda: slim(ids))
            reused = {k: ownership.reuse_count(k) for k in ("grad", "saved")}
        _clear(slim)
        bwd_peak = max(live for i, _, live in m.timeline if i >= m.backward_start)
        mem["on" if on else "off"] = {
            "peak_bytes": m.peak_bytes,
            "backward_peak_bytes": bwd_peak,
            "forward_peak_bytes": m.forward_peak_bytes,
            "saved_bytes": m.saved_bytes,
            "retained_bytes": m.retained_bytes,
            "reused_buffers": reused,
        }

    # time: interleaved pairs, alternating which side goes first
    times = {"on": [], "off": []}
    for on in (True, False):  # warm-up
        with mode(on):
            _step(slim, ids, seed=3)
        _clear(slim)
    for i in range(args.repeat):
        order = (True, False) if i % 2 == 0 else (False, True)
        for on in order:
            with mode(on):
                t0 = time.perf_counter()
                _step(slim, ids, seed=3)
                times["on" if on else "off"].append((time.perf_counter() - t0) * 1e3)
            _clear(slim)
    ratios = [a / b for a, b in zip(times["on"], times["off"], strict=True)]
    rec = {
        "case": "hf_gpt2",
        "kind": "grad_buffer_reuse_on_vs_off",
        "provider": "slimgrad",
        "n_layer": args.layers,
        "note": (
            "converted model against itself, reuse on vs slimgrad.ownership.reuse_disabled(); "
            f"GPT2Config(n_layer={args.layers}), 4x256 tokens, dropout 0.1, CPU fp32"
        ),
        "shapes": [list(ids.shape)],
        "dtype": "float32",
        "device": "cpu",
        "grads_bitwise_equal": True,
        "n_grads": len(grads[True]),
        "reuse_on": {**mem["on"], "step_ms": statistics.median(times["on"])},
        "reuse_off": {**mem["off"], "step_ms": statistics.median(times["off"])},
        "backward_peak_saved_bytes": mem["off"]["backward_peak_bytes"]
        - mem["on"]["backward_peak_bytes"],
        "step_ms_all": times,
        "time_ratio_on_over_off": statistics.median(ratios),
        "time_ratio_min": min(ratios),
        "time_ratio_max": max(ratios),
        "repeat": args.repeat,
        "versions": {k: v for k, v in environment().items() if k != "gpus"},
        "commit": git_commit(),
        "time_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    line = json.dumps(rec)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    print(line)
    return rec


if __name__ == "__main__":
    main()
