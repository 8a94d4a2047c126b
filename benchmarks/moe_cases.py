"""Run the HF MoE bench cases (hf_mixtral, hf_qwen3_moe, their _autocast and _grouped_mm
variants) through ``slimgrad.bench.harness.run_case``, optionally with fewer decoder layers, and
append records that also carry process-CPU step times.

    PYTHONPATH=src .venv/bin/python benchmarks/moe_cases.py hf_mixtral --dtype float32 \\
        --layers 12 --threads 1 --repeat 3 --out benchmarks/results

Each record is run_case's (saved/peak/floor bytes exact with ``slimgrad.memory.measure`` on real
tensors: MoE routing depends on values, so fake tensors cannot run it; the float64 gradient check
of GUIDE.md; wall-clock step time in interleaved pairs) plus:

- ``model``: the shape actually run (layers, hidden, experts, top-k, expert intermediate, vocab,
  the experts implementation transformers resolved) and ``layers_full`` (the case's 12);
- ``cpu_ms_all`` / ``cpu_time_ratio`` (median of pairs, ``_min``/``_max``): ``time.process_time``
  of the same timed steps (the process's CPU time; with ``--threads 1`` it does not count waiting
  for the CPU on a loaded box, which wall time does);
- ``load_avg``: the box's 1/5/15-minute load averages at the start and the end;
- ``experts``: per side, the expert-bank classes after convert_ and, for the slimgrad side, what
  ``slimgrad.report`` says about the banks it skipped; ``convert``: the report's converted
  (``from -> to``: count) and skipped (``type``: count and first reason) modules;
- ``command``: the command line.

``--timing-only`` runs no memory measurement and no gradient check: it builds the case, warms each
side up once and times ``--repeat`` interleaved pairs (wall and process time), printing a JSON line
and writing no record (for the dense cases' step-time proxy, e.g. ``hf_qwen2``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from slimgrad.bench import harness
from slimgrad.bench.cases import models as cases


def _experts_of(model) -> list[str]:
    return sorted(
        {type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Experts")}
    )


def _build_fn(name: str, layers: int | None, sides: dict):
    fam = name.removeprefix("hf_")
    autocast = fam.endswith("_autocast")
    grouped = fam.endswith("_grouped_mm")
    fam = fam.removesuffix("_autocast").removesuffix("_grouped_mm")
    block = fam.endswith("_moe_block")
    fam = fam.removesuffix("_moe_block")

    def build(device, dtype, small=False):
        if block:
            eager, make_inputs = cases.eager_hf_moe_block(
                fam, device, dtype, small, autocast=autocast
            )
        elif fam in cases._MOE_NOTES:
            eager, make_inputs = cases.eager_hf_moe(
                fam, device, dtype, small, layers=layers, experts=None if grouped else "eager",
                autocast=autocast,
            )  # fmt: skip
        elif autocast:
            eager, make_inputs = cases.eager_hf_autocast(fam, device, dtype, small)
            if layers is not None:
                raise SystemExit("--layers is for the MoE cases only")
        else:
            eager, make_inputs = cases.eager_hf_text(fam, device, dtype, small, layers=layers)
        slim = cases.slim_copy(eager)
        sides.update(eager=eager, slimgrad=slim)
        return eager, slim, make_inputs

    return build


def _lm(model):
    # the HF model inside HFLoss / Autocast(HFLoss), or the MoE block (its experts hold config)
    while not hasattr(model, "config"):
        if hasattr(model, "experts"):
            return model.experts
        model = model.model
    return model


def _timed_pairs(eager, slim, fresh, repeat: int, record: list) -> None:
    # warm-up (one step per side) then interleaved pairs, as run_case times them
    for model in (eager, slim):
        harness._clear_grads(model)
        harness._step(model, fresh(), None)
        harness._clear_grads(model)
    for i in range(repeat):
        order = ((0, eager), (1, slim))
        for side, model in order if i % 2 == 0 else order[::-1]:
            xs = fresh()
            harness._clear_grads(model, xs)
            c0, t0 = time.process_time(), time.perf_counter()
            harness._step(model, xs, None)
            record.append(
                (side, (time.process_time() - c0) * 1e3, (time.perf_counter() - t0) * 1e3)
            )
            del xs
            harness._clear_grads(model)


def _profile(eager, slim, fresh, top: int) -> dict:
    # self-CPU time and calls per op name, one step per side (after the timed pairs)
    from torch.profiler import ProfilerActivity, profile

    per = {}
    for side, model in (("eager", eager), ("slimgrad", slim)):
        xs = fresh()
        harness._clear_grads(model, xs)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            harness._step(model, xs, None)
        harness._clear_grads(model)
        per[side] = {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()}
    keys = set(per["eager"]) | set(per["slimgrad"])
    rows = []
    for k in keys:
        (ems, ec), (sms, sc) = per["eager"].get(k, (0.0, 0)), per["slimgrad"].get(k, (0.0, 0))
        rows.append({"op": k, "eager_ms": ems, "slimgrad_ms": sms, "delta_ms": sms - ems,
                     "eager_calls": ec, "slimgrad_calls": sc})  # fmt: skip
    rows.sort(key=lambda r: -r["delta_ms"])
    total = {side: sum(v[0] for v in per[side].values()) for side in per}
    return {"self_cpu_total_ms": total, "top_growth": rows[:top], "top_shrink": rows[-top:][::-1]}


def _pair_stats(steps: list, col: int) -> dict:
    eager = [s[col] for s in steps if s[0] == 0]
    slim = [s[col] for s in steps if s[0] == 1]
    ratios = [b / a for a, b in zip(eager, slim)]
    return {
        "eager_all": eager,
        "slimgrad_all": slim,
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/moe_cases.py", description=__doc__.split("\n")[0])
    p.add_argument("case")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default: the case's 12)"
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-grad-check", action="store_true")
    p.add_argument("--timing-only", action="store_true")
    p.add_argument("--small", action="store_true")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        help="with --timing-only: torch.profiler on one more step per side; print the N ops "
        "whose self-CPU time grows most from eager to slimgrad",
    )
    p.add_argument("--out", default="benchmarks/results", help="records folder; '' writes none")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    load0 = os.getloadavg()
    sides: dict = {}
    build = _build_fn(a.case, a.layers, sides)
    seed = 0

    if a.timing_only:
        torch.manual_seed(seed)
        eager, slim, make_inputs = build("cpu", dtype, a.small)

        def fresh():
            torch.manual_seed(seed + 1)
            return harness._as_tuple(make_inputs())

        steps: list = []
        _timed_pairs(eager, slim, fresh, a.repeat, steps)
        prof = _profile(eager, slim, fresh, a.profile) if a.profile else None
        out = {
            "case": a.case,
            "dtype": a.dtype,
            "layers": _lm(eager).config.num_hidden_layers,
            "threads": torch.get_num_threads(),
            "cpu_ms": _pair_stats(steps, 1),
            "wall_ms": _pair_stats(steps, 2),
            "load_avg": [load0, os.getloadavg()],
            "commit": harness.git_commit(),
        }
        if prof is not None:
            out["profile"] = prof
        print(json.dumps(out))
        return 0

    # the timed steps of run_case go through harness._step; record their process time too
    steps: list = []
    phase = {"name": None}
    step = harness._step

    def timed_step(model, inputs, grad):
        if phase["name"] != "timing":
            return step(model, inputs, grad)
        c0 = time.process_time()
        try:
            return step(model, inputs, grad)
        finally:
            side = 0 if model is sides["eager"] else 1
            steps.append((side, (time.process_time() - c0) * 1e3))

    def progress(msg):
        phase["name"] = msg
        print(
            f"[{time.strftime('%H:%M:%S')}] {a.case} {a.dtype}: {msg}", file=sys.stderr, flush=True
        )

    case = dataclasses.replace(harness.get_case(a.case), build=build)
    harness._step = timed_step
    try:
        rec = harness.run_case(
            case, dtype=dtype, small=a.small, repeat=a.repeat,
            grad_check=False if a.no_grad_check else None, out_dir=None, seed=seed,
            progress=progress,
        )  # fmt: skip
    finally:
        harness._step = step
    cfg = _lm(sides["eager"]).config
    moe = "num_experts_per_tok" in cfg.to_dict()
    rec["model"] = {
        "layers": cfg.num_hidden_layers,
        "hidden": cfg.hidden_size,
        "heads": cfg.num_attention_heads,
        "vocab": cfg.vocab_size,
        "experts": getattr(cfg, "num_local_experts", getattr(cfg, "num_experts", None)),
        "top_k": getattr(cfg, "num_experts_per_tok", None),
        "expert_intermediate": getattr(cfg, "moe_intermediate_size", cfg.intermediate_size)
        if moe
        else None,
        "intermediate": None if moe else cfg.intermediate_size,
        "experts_implementation": getattr(cfg, "_experts_implementation", None),
        "autocast": a.case.endswith("_autocast"),
    }
    rec["layers_full"] = (
        1 if a.case.endswith(("_moe_block", "_block_autocast")) else 2 if a.small else 12
    )
    if rec["layers_full"] == 1:
        rec["model"]["layers"] = 1  # one block
    cpu = _pair_stats(steps, 1)
    rec["cpu_ms_all"] = {"eager": cpu["eager_all"], "slimgrad": cpu["slimgrad_all"]}
    rec["cpu_time_ratio"] = cpu["ratio"]
    rec["cpu_time_ratio_min"] = cpu["ratio_min"]
    rec["cpu_time_ratio_max"] = cpu["ratio_max"]
    rec["load_avg"] = [load0, os.getloadavg()]
    import slimgrad

    skipped = [
        {"module": n, "type": t, "reason": r}
        for n, t, r in slimgrad.report(sides["slimgrad"]).skipped
        if t.endswith("Experts")
    ]
    rec["experts"] = {
        "eager": _experts_of(sides["eager"]),
        "slimgrad": _experts_of(sides["slimgrad"]),
        # the first skipped bank (all have the same reason) and how many were skipped
        "skipped_first": skipped[0] if skipped else None,
        "skipped_count": len(skipped),
    }
    rep = slimgrad.report(sides["slimgrad"])
    conv: dict = {}
    for _, a_, b_ in rep.converted:
        conv[f"{a_} -> {b_}"] = conv.get(f"{a_} -> {b_}", 0) + 1
    skip: dict = {}
    for _, t, r in rep.skipped:
        skip.setdefault(t, [0, r])[0] += 1
    rec["convert"] = {"converted": conv, "skipped": skip}
    if rec["commit"] is None:  # a `git archive` export (no .git): the commit it was made from
        stamp = Path(__file__).resolve().parents[1] / ".slimgrad_commit"
        if stamp.exists():
            rec["commit"] = stamp.read_text().strip()
            rec["source"] = "git archive export of this commit (clean tree)"
    rec["command"] = "PYTHONPATH=src .venv/bin/python benchmarks/moe_cases.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    brief = {k: rec[k] for k in ("case", "dtype", "peak_ratio", "saved_ratio", "time_ratio")}
    brief.update(
        cpu_time_ratio=rec["cpu_time_ratio"],
        saved_over_eager_floor=rec["saved_over_eager_floor"],
        grad_ok=(rec["grad"] or {}).get("ok"),
        layers=rec["model"]["layers"],
    )
    print(json.dumps(brief))
    if a.out:
        path = Path(a.out) / f"{a.case}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
