"""slimgrad.plan on the issue-33 targets, under fake tensors (no compute, no memory).

For each target: the full-estimate peaks of eager, per-block checkpointing ("ckpt": every block
recomputed, nothing converted), torch's selective checkpointing saving matmul/attention outputs
("sac"), slimgrad (convert_) and slimgrad + checkpointing, and of eager, ckpt and sac with the
rest of the model (embeddings, head, loss) converted, as the planner composes its baselines
("rest_converted_peaks_bytes" next to "composed_peaks_bytes"); then plans at three budgets: the
lower of ckpt's and slimgrad's peaks ("low"), their midpoint ("mid") and SAC's peak ("sac"), each
with its full-estimate peak and recomputed matmul FLOPs as a fraction of the forward's, against
ckpt's and against plain checkpointing of the fewest blocks that fit, and the time (wall and
this process's CPU seconds: the box may be shared) of measuring and of each plan. Each plan's
recompute is also counted on the applied plan (``counted_recompute_flops``: its backward's matmul
FLOPs, op by op with :mod:`slimgrad.bench.recompute_count`, less those of the same blocks
without recompute: lean for a lean choice, eager for an eager one), as is
checkpoint-all's (``ckpt_counted_recompute_flops``, against every block eager): what the planner
composes from its per-kind measurements, checked on the whole mixed plan.

Targets: HF Llama ~1B (16 x 2048, intermediate 5504, vocab 32000, default config otherwise),
4 x 2048 tokens, fp32 weights under autocast bf16; GPT-2 medium, 8 x 1024, fp32; a
Llama-3-8B-like model (32 x 4096, intermediate 14336, 8 kv heads, vocab 128256), 1 x 4096, fp32.

    PYTHONPATH=src .venv/bin/python benchmarks/plan_targets.py --device cuda \\
        --out benchmarks/results/plan.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from datetime import datetime, timezone

import torch

from slimgrad.bench.harness import git_commit

GiB = 2**30
# the code this run imported (HEAD and a dirty flag), read now: a commit made while the run goes
# must not label it
COMMIT = git_commit()


def _llama(layers, hidden, inter, batch, seq, amp, **extra):
    import transformers as t

    from slimgrad.targets import hf_target

    cfg = t.LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter, **extra
    )
    cfg._attn_implementation = "sdpa"
    return hf_target("llama", cfg, t.LlamaForCausalLM, "causal", seq), batch, amp, str(cfg)


def _gpt2(batch, seq):
    import transformers as t

    from slimgrad.targets import hf_target

    cfg = t.GPT2Config(n_layer=24, n_embd=1024, n_head=16)
    cfg._attn_implementation = "sdpa"
    return hf_target("gpt2", cfg, t.GPT2LMHeadModel, "causal", seq), batch, None, "gpt2-medium"


TARGETS = {
    "llama_1b_bf16": (
        "HF Llama ~1B (16x2048, inter 5504, vocab 32000), 4x2048, autocast bf16",
        lambda: _llama(16, 2048, 5504, 4, 2048, torch.bfloat16, vocab_size=32000),
    ),
    "gpt2_medium": ("GPT-2 medium, 8x1024, fp32", lambda: _gpt2(8, 1024)),
    "llama3_8b_like": (
        "Llama-3-8B-like (32x4096, inter 14336, kv 8, vocab 128256), 1x4096, fp32",
        lambda: _llama(
            32,
            4096,
            14336,
            1,
            4096,
            None,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
        ),
    ),
}


def _maker(target, batch, amp):
    from slimgrad.profile import _target_make

    return _target_make(target, batch, amp)


def _full(make, device, choices, convert: bool, dtype):
    from slimgrad.memory import estimate
    from slimgrad.plan import apply_choices

    def made():
        fwd, model = make()
        conv = None if convert else (lambda m, **k: m)
        kw = {"dtype": dtype} if (convert and dtype is not None) else {}
        apply_choices(model, choices, convert=conv, **kw)
        return fwd, model

    return estimate(made, device=device, timeline=False).peak_bytes


def _counted(make, device, choices, dtype) -> int:
    # the backward's matmul FLOPs of one fake step with ``choices`` applied (the rest converted,
    # as in every plan), counted op by op (slimgrad.bench.recompute_count)
    from slimgrad.bench.recompute_count import backward_counts

    kw = {"dtype": dtype} if dtype is not None else {}
    return backward_counts(make, choices, fake=device, **kw)[1]


def _plain(choices: dict) -> dict:
    # each block's choice without recompute: "lean" for lean+..., "eager" for eager+...
    return {b: "lean" if c.startswith("lean") else "eager" for b, c in choices.items()}


def _ckpt_needed(make, device, blocks, budget, amp, full_ckpt):
    # the fewest blocks plain per-block checkpointing (nothing converted, the first k blocks
    # recomputed: an early block's backward runs last) needs to fit ``budget``: a bisection over
    # k of full estimates (the peak falls as k grows); (k, its peak) or None where even every
    # block is above the budget
    if full_ckpt > budget:
        return None
    lo, hi, peak = 0, len(blocks), full_ckpt  # hi fits
    while lo < hi:
        k = (lo + hi) // 2
        got = _full(make, device, {b: "eager+recompute" for b in blocks[:k]}, False, amp)
        if got <= budget:
            hi, peak = k, got
        else:
            lo = k + 1
    return hi, peak


def run(name: str, device: str, say, budgets=("low", "mid", "sac")) -> dict:
    import slimgrad

    label, build = TARGETS[name]
    target, batch, amp, _ = build()
    make = _maker(target, batch, amp)
    kw = {"dtype": amp} if amp is not None else {}
    t0, c0 = time.perf_counter(), time.process_time()
    top = slimgrad.plan(make, "1024TiB", device=device, verify=False, progress=say, **kw)
    measure_s, measure_cpu = time.perf_counter() - t0, time.process_time() - c0
    blocks = list(top.choices)

    def every(c):
        return {b: c for b in blocks}

    say("full estimates of the baselines")
    peaks = {
        "eager": _full(make, device, {}, False, amp),
        "ckpt": _full(make, device, every("eager+recompute"), False, amp),
        "sac": _full(make, device, every("eager+sac"), False, amp),
        "slimgrad": _full(make, device, every("lean"), True, amp),
        "slimgrad+ckpt": _full(make, device, every("lean+recompute"), True, amp),
    }
    # the same baselines as the planner composes them from its per-kind measurements: every
    # block in one choice and the rest of the model converted, as in every plan (NOTE [How plan
    # chooses], 2); their full estimates, to compare like with like
    composed = {k: v.peak_bytes for k, v in top.baselines.items()}
    say("full estimates of the baselines with the rest converted (as composed)")
    rest_converted = {
        "eager": _full(make, device, every("eager"), True, amp),
        "checkpoint-all": _full(make, device, every("eager+recompute"), True, amp),
        "sac": _full(make, device, every("eager+sac"), True, amp),
    }
    ckpt_frac = top.baselines["checkpoint-all"].recompute_fraction
    say("the backward's matmul FLOPs counted op by op (every block eager, checkpointed)")
    counted = {c: _counted(make, device, every(c), amp) for c in ("eager", "eager+recompute")}
    low = min(peaks["ckpt"], peaks["slimgrad"])
    mid = (peaks["ckpt"] + peaks["slimgrad"]) // 2
    plans = {}
    # "sac": SAC's own peak (it recomputes no matmul, every elementwise op)
    for tag, budget in (("low", low), ("mid", mid), ("sac", peaks["sac"])):
        if tag not in budgets:
            continue
        t1, c1 = time.perf_counter(), time.process_time()
        try:
            p = slimgrad.plan(make, budget, device=device, reuse=top, progress=say, **kw)
            wall, cpu = time.perf_counter() - t1, time.process_time() - c1  # the plan's alone
            say(f"checkpointing of the blocks needed to fit the {tag} budget")
            need = _ckpt_needed(make, device, blocks, budget, amp, peaks["ckpt"])
            per_block = top.baselines["checkpoint-all"].recompute_flops / len(blocks)
            plans[tag] = {
                "budget_bytes": budget,
                "peak_bytes": p.peak_bytes,
                # plain checkpointing of the first k blocks, nothing converted: the fewest that fit
                "ckpt_blocks_needed": None if need is None else need[0],
                "ckpt_needed_peak_bytes": None if need is None else need[1],
                "ckpt_needed_recompute_fraction": None
                if need is None
                else need[0] * per_block / p.forward_flops,
                "recompute_fraction": p.recompute_fraction,
                # the applied plan's backward, counted op by op, less that of the same blocks
                # without recompute (lean for a lean choice, eager for an eager one): equal to
                # recompute_flops where the per-kind measurements compose exactly
                "counted_recompute_flops": _counted(make, device, p.choices, amp)
                - _counted(make, device, _plain(p.choices), amp),
                "recompute_flops": p.recompute_flops,
                "vs_ckpt_recompute": p.recompute_fraction / ckpt_frac if ckpt_frac else None,
                "choices": sorted(
                    {c: list(p.choices.values()).count(c) for c in p.choices.values()}.items()
                ),
                "seconds": wall,
                "cpu_seconds": cpu,
                # the default path (slimgrad.plan(make, budget) from scratch): measuring + this
                "default_path_cpu_seconds": measure_cpu + cpu,
                "full_estimates": p.full_estimates,
            }
        except ValueError as e:
            plans[tag] = {"budget_bytes": budget, "error": str(e)}
    return {
        "case": f"plan_{name}",
        "target": label,
        "device": device,
        "estimated": True,
        "peaks_bytes": peaks,
        "composed_peaks_bytes": composed,
        "rest_converted_peaks_bytes": rest_converted,
        "ckpt_recompute_fraction": ckpt_frac,
        "ckpt_recompute_flops": top.baselines["checkpoint-all"].recompute_flops,
        "ckpt_counted_recompute_flops": counted["eager+recompute"] - counted["eager"],
        "slimgrad_ckpt_recompute_fraction": top.baselines["slimgrad+checkpoint"].recompute_fraction,
        "plans": plans,
        "measure_seconds": measure_s,
        "measure_cpu_seconds": measure_cpu,
        "per_kind": top.blocks,
        **_stamp(),
    }


def _stamp() -> dict:
    # what labels a record: the versions, the commit read at import (COMMIT) and the time
    from slimgrad.bench.harness import environment

    return {
        "versions": environment(),
        "commit": COMMIT,
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", nargs="*", default=list(TARGETS), choices=list(TARGETS))
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    ap.add_argument("--out", default=None, help="JSONL file to append the records to")
    ap.add_argument(
        "--budgets", nargs="*", default=["low", "mid", "sac"], choices=["low", "mid", "sac"]
    )
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")

    def say(msg):
        print(f"  {msg}", flush=True)

    rows = []
    for name in args.targets:
        print(f"{name}: {TARGETS[name][0]}", flush=True)
        rec = run(name, args.device, say, tuple(args.budgets))
        pk = rec["peaks_bytes"]
        print(
            "  peaks GiB: "
            + ", ".join(f"{k} {v / GiB:.2f}" for k, v in pk.items())
            + f"; ckpt recompute {rec['ckpt_recompute_fraction']:.3f}",
            flush=True,
        )
        for tag, p in rec["plans"].items():
            if "error" in p:
                print(f"  {tag} budget {p['budget_bytes'] / GiB:.2f} GiB: {p['error']}")
                continue
            print(
                f"  {tag} budget {p['budget_bytes'] / GiB:.2f} GiB: plan peak "
                f"{p['peak_bytes'] / GiB:.2f}, recompute {p['recompute_fraction']:.3f} "
                f"({p['vs_ckpt_recompute']:.2f}x ckpt's; counted on the applied plan: "
                f"{p['counted_recompute_flops']} FLOPs, planned {p['recompute_flops']}), "
                f"{p['choices']}; checkpointing needs "
                f"{p['ckpt_blocks_needed']} blocks ({p['ckpt_needed_recompute_fraction']})",
                flush=True,
            )
        rows.append(rec)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(rec, default=str) + "\n")
    return rows


if __name__ == "__main__":
    main()
