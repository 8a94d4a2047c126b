"""What a plan at SAC's peak recomputes beside SAC, op by op, on issue 33's targets (fake tensors).

SAC (torch's selective checkpointing saving every matmul/attention output) recomputes no matmul
FLOPs and every other op of every block; a plan at SAC's peak recomputes no matmul FLOPs either,
so the planner's metric calls them equal. This counts the rest with
:mod:`slimgrad.bench.recompute_count` under fake tensors standing for CUDA: the elements the
backward's non-matmul, non-view ops compute, less those of the same model without recompute (the
plan against every block ``lean``, SAC against every block ``eager``; the rest of the model
converted in all four, as the planner's baselines), and the backward's matmul FLOPs. The budget
is SAC's peak with the rest converted (the planner's SAC baseline, ``Plan.baselines["sac"]``).

    PYTHONPATH=src .venv/bin/python benchmarks/plan_sac_elements.py \\
        --out benchmarks/results/plan_sac_elements.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

from plan_targets import TARGETS, _maker, _stamp


def run(name: str, say) -> dict:
    import slimgrad
    from slimgrad.bench.recompute_count import backward_counts

    label, build = TARGETS[name]
    target, batch, amp, _ = build()
    make = _maker(target, batch, amp)
    kw = {"dtype": amp} if amp is not None else {}
    c0 = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        top = slimgrad.plan(make, "1024TiB", device="cuda", verify=False, **kw)
        budget = top.baselines["sac"].peak_bytes
        p = slimgrad.plan(make, budget, device="cuda", reuse=top, **kw)
    blocks = list(top.choices)
    counts = {}
    for key, choices in (
        ("lean", dict.fromkeys(blocks, "lean")),
        ("eager", dict.fromkeys(blocks, "eager")),
        ("sac", dict.fromkeys(blocks, "eager+sac")),
        ("plan", p.choices),
    ):
        say(f"  counting {key}")
        counts[key] = backward_counts(make, choices, fake="cuda", **kw)
    plan_el = counts["plan"][0] - counts["lean"][0]
    sac_el = counts["sac"][0] - counts["eager"][0]
    picked = sorted({c: list(p.choices.values()).count(c) for c in set(p.choices.values())}.items())
    return {
        "case": f"plan_sac_elements_{name}",
        "target": label,
        "device": "cuda",
        "estimated": True,
        "budget_bytes": budget,
        "plan_peak_bytes": p.peak_bytes,
        "plan_choices": picked,
        "plan_recompute_flops": p.recompute_flops,
        "backward_elements": {k: v[0] for k, v in counts.items()},
        "backward_matmul_flops": {k: v[1] for k, v in counts.items()},
        "plan_recomputed_elements": plan_el,
        "sac_recomputed_elements": sac_el,
        "plan_over_sac_elements": plan_el / sac_el if sac_el else None,
        "cpu_seconds": time.process_time() - c0,
        **_stamp(),
    }


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", nargs="*", default=list(TARGETS), choices=list(TARGETS))
    ap.add_argument("--out", default=None, help="JSONL file to append the records to")
    args = ap.parse_args(argv)

    def say(msg):
        print(msg, flush=True)

    rows = []
    for name in args.targets:
        say(f"{name}: {TARGETS[name][0]}")
        rec = run(name, say)
        say(
            f"  SAC's peak {rec['budget_bytes'] / 2**30:.2f} GiB: plan {rec['plan_choices']}, "
            f"elements recomputed {rec['plan_recomputed_elements']:,} against SAC's "
            f"{rec['sac_recomputed_elements']:,} ({rec['plan_over_sac_elements']})"
        )
        rows.append(rec)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
    return rows


if __name__ == "__main__":
    main()
