"""The ``slimgrad`` command: ``slimgrad demo | bench | profile | estimate | env``.

Each subcommand is one entry of :data:`SUBCOMMANDS`: ``name -> Subcommand(help, add_arguments,
run)``. ``add_arguments(parser)`` declares its options, ``run(args) -> int`` does the work and
returns the exit status. Heavy imports (harness, demo, matplotlib, transformers) happen inside
``run``, so ``slimgrad --help`` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["SUBCOMMANDS", "Subcommand", "main"]

MiB = 2**20


@dataclass(frozen=True)
class Subcommand:
    """One ``slimgrad <name>`` subcommand."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _err(msg: str) -> int:
    print(msg, file=sys.stderr)
    return 2


# ------------------------------------------------------------------------------------------ bench
def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("case", nargs="?", help="case name (see --list)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--all", action="store_true", help="run every case whose extras are installed")
    p.add_argument("--json", action="store_true", help="print the record as one JSON line")
    p.add_argument("--repeat", type=int, default=None, help="timed eager/slimgrad pairs")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per side first")
    p.add_argument("--small", action="store_true", help="the case's small variant")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    p.add_argument("--dtype", default="float32", help="float32, float64, bfloat16 or float16")
    p.add_argument("--no-grad-check", action="store_true", help="skip the float64 gradient check")
    p.add_argument(
        "--out", default="benchmarks/results", help="folder of the JSONL records (CASE.jsonl)"
    )
    p.add_argument("--no-record", action="store_true", help="write no record")
    p.add_argument(
        "--no-reuse", action="store_true", help="turn gradient-buffer reuse off (slimgrad side)"
    )
    p.add_argument(
        "--verify", action="store_true", help="also run slimgrad.verify (loss and every gradient)"
    )


_DTYPES = ("float32", "float64", "bfloat16", "float16")


def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / MiB:,.1f}"


def _fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.3f}"


def format_record(rec: dict) -> str:
    """A human-readable summary of one bench record (plain text, aligned)."""
    e, s = rec["eager"], rec["slimgrad"]
    rows = [
        ("saved MiB", _mib(e.get("saved_bytes")), _mib(s.get("saved_bytes")), rec["saved_ratio"]),
        ("peak MiB", _mib(e.get("peak_bytes")), _mib(s.get("peak_bytes")), rec["peak_ratio"]),
        ("floor MiB", _mib(e.get("floor_bytes")), _mib(s.get("floor_bytes")), None),
        ("step ms", f"{e['step_ms']:,.1f}", f"{s['step_ms']:,.1f}", rec["time_ratio"]),
    ]
    shapes = " ".join(
        "x".join(map(str, sh)) if isinstance(sh, list) else sh for sh in rec["shapes"]
    )
    lines = [
        f"case {rec['case']} ({rec['dtype']}, {rec['device']}: {rec['device_name']}) "
        f"inputs {shapes}",
        f"{'':<10} {'eager':>12} {'slimgrad':>12} {'ratio':>8}",
    ]
    lines += [f"{n:<10} {a:>12} {b:>12} {_fmt_ratio(r):>8}" for n, a, b, r in rows]
    if rec.get("saved_over_eager_floor") is not None:
        lines.append(
            f"saved / eager floor: eager {rec['eager_saved_over_floor']:.3f}, "
            f"slimgrad {rec['saved_over_eager_floor']:.3f}"
        )
    if rec.get("saved_over_eager_floor_with_inputs") is not None:
        lines.append(
            f"with pre-existing inputs: eager {rec['eager_saved_over_floor_with_inputs']:.3f}, "
            f"slimgrad {rec['saved_over_eager_floor_with_inputs']:.3f}"
        )
    lines.append(
        f"time ratio spread over {rec['repeat']} pairs: "
        f"{rec['time_ratio_min']:.3f} .. {rec['time_ratio_max']:.3f}"
    )
    g = rec.get("grad")
    if g is not None:
        verdict = "OK" if g["ok"] else "VIOLATED"
        lines.append(
            f"gradients ({g['n_tensors']} tensors, vs float64, dropout off): {verdict}; "
            f"max|g-g64| slimgrad {g['max_abs_err']:.3e}, eager {g['eager_max_abs_err']:.3e}"
            + (f"; unmatched {g['unmatched']}" if g["unmatched"] else "")
        )
        for v in g.get("violations", []):
            lines.append(
                f"  {v['name']}: max|g-g64| {v['err']:.3e} > bound {v['bound']:.3e} "
                f"(eager {v['eager_err']:.3e}, max|g64| {v['max_abs']:.3e})"
            )
    if "record_path" in rec:
        lines.append(f"record appended to {rec['record_path']}")
    return "\n".join(lines)


def _bench_list() -> int:
    from slimgrad.bench.harness import broken_case_modules, list_cases

    cases = list_cases()
    width = max((len(c.name) for c in cases), default=4)
    for c in cases:
        missing = c.missing()
        note = f"  [needs {', '.join(missing)}]" if missing else ""
        print(f"{c.name:<{width}}  {c.description}{note}")
    for mod, err in broken_case_modules().items():
        print(f"(failed to import {mod}: {err})")
    if not cases:
        print("(no cases registered)")
    return 0


def _bench_run(args: argparse.Namespace) -> int:
    if args.list:
        return _bench_list()
    if args.all:
        if args.case:
            return _err(
                f"slimgrad bench: --all takes no case; expected no name, got {args.case!r}. "
                "Drop the name or --all."
            )
        from slimgrad.bench.harness import list_cases

        codes = [_bench_one(args, c.name) for c in list_cases() if not c.missing()]
        return max(codes, default=0)
    if not args.case:
        return _err(
            "slimgrad bench: no case given; expected a case name, got nothing. "
            "Run `slimgrad bench --list` to see them."
        )
    return _bench_one(args, args.case)


def _bench_one(args: argparse.Namespace, case: str) -> int:
    if args.dtype not in _DTYPES:
        return _err(
            f"slimgrad bench: unknown --dtype; expected one of {list(_DTYPES)}, got "
            f"{args.dtype!r}. Pass e.g. --dtype float32."
        )
    import torch

    from slimgrad import ownership
    from slimgrad.bench.harness import run_case

    try:
        with ownership.reuse_disabled() if args.no_reuse else contextlib.nullcontext():
            rec = run_case(
                case,
                device=args.device,
                dtype=getattr(torch, args.dtype),
                small=args.small,
                repeat=args.repeat,
                warmup=args.warmup,
                grad_check=False if args.no_grad_check else None,
                out_dir=None if args.no_record else args.out,
                progress=None if args.json else (lambda m: print(f"[{case}] {m}", flush=True)),
            )
    except (ValueError, RuntimeError) as e:
        return _err(str(e))
    print(json.dumps(rec) if args.json else format_record(rec))
    grad = rec.get("grad")
    status = 1 if grad is not None and not grad["ok"] else 0
    if args.verify:
        status = max(status, _bench_verify(case, args))
    return status


def _bench_verify(case: str, args: argparse.Namespace) -> int:
    import torch

    import slimgrad
    from slimgrad.bench.harness import get_case

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    eager, slim, make_inputs = get_case(case).build(device, dtype, small=args.small)
    if not (isinstance(eager, torch.nn.Module) and isinstance(slim, torch.nn.Module)):
        return _err(f"slimgrad bench: --verify needs module cases; {case!r} is not one.")
    xs = make_inputs()
    rep = slimgrad.verify(eager, slim, xs if isinstance(xs, tuple) else (xs,))
    print(rep)
    return 0 if rep.ok else 1


# ------------------------------------------------------------------------------------------ env
def _env_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _env_run(args: argparse.Namespace) -> int:
    from slimgrad._compat import (
        TORCH_MAX_TESTED,
        TORCH_MIN,
        TRANSFORMERS_MAX_TESTED,
        TRANSFORMERS_MIN,
        features,
    )
    from slimgrad.bench.harness import environment, git_commit

    info = environment()
    info["commit"] = git_commit()
    info["tested torch"] = (
        f"{TORCH_MIN[0]}.{TORCH_MIN[1]} .. {TORCH_MAX_TESTED[0]}.{TORCH_MAX_TESTED[1]}"
    )
    lo, hi = TRANSFORMERS_MIN, TRANSFORMERS_MAX_TESTED
    info["tested transformers"] = f"{lo[0]}.{lo[1]} .. {hi[0]}.{hi[1]}"
    feats = features()
    if args.json:
        info["features"] = {f.name: {"on": f.on, "detail": f.detail} for f in feats}
        print(json.dumps(info))
        return 0
    width = max(len(k) for k in info)
    for k, v in info.items():
        print(f"{k:<{width}}  {v if v is not None else '-'}")
    print("\nfeatures:")
    for f in feats:
        print(f"  [{'on ' if f.on else 'off'}] {f.name}: {f.detail}")
    return 0


# ------------------------------------------------------------------------------------------ demo
def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=5, help="training steps per model")
    p.add_argument("--small", action="store_true", help="tiny models (seconds; used by tests)")
    p.add_argument("--out", default="slimgrad_demo_memory.png", help="PNG of the memory timelines")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")


def _demo_run(args: argparse.Namespace) -> int:
    from slimgrad.demo import run_demo

    if args.steps < 1:
        return _err(
            f"slimgrad demo: --steps must be positive; expected >= 1, got {args.steps}. "
            "Pass e.g. --steps 5."
        )
    result = run_demo(steps=args.steps, small=args.small, out=None if args.no_plot else args.out)
    return 0 if result["ok"] else 1


# --------------------------------------------------------------------------------- profile/estimate
def _profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "target", help="gpt2, bert, llama, vit, resnet (HF, random init), a bench case, or mod:fn"
    )
    p.add_argument("--batch", type=int, default=None, help="batch size (HF targets)")
    p.add_argument("--seq", type=int, default=256, help="sequence length (HF text targets)")
    p.add_argument("--size", choices=("full", "tiny"), default="full", help="HF config size")
    p.add_argument("--estimate", action="store_true", help="fake tensors: no compute, no memory")
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="whose kernels: measured there, or with --estimate modelled (no GPU needed)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override an HF config field, e.g. --set n_layer=24 (repeatable)",
    )
    p.add_argument("--fit-gib", type=float, default=None, help="largest batch fitting in N GiB")
    p.add_argument("--plot", default=None, help="write a PNG of both memory timelines here")
    p.add_argument("--depth", type=int, default=2, help="module-path depth of the table")
    p.add_argument("--no-convert", action="store_true", help="eager only")
    p.add_argument("--inplace-abn", action="store_true", help="ConvertConfig(inplace_abn=True)")
    p.add_argument("--verify", action="store_true", help="also check loss and every gradient")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _estimate_args(p: argparse.ArgumentParser) -> None:
    _profile_args(p)
    p.set_defaults(estimate=True)


def _profile_run(args: argparse.Namespace) -> int:
    import slimgrad
    from slimgrad.profile import fit_batch, profile
    from slimgrad.targets import resolve

    overrides = {}
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            return _err(
                f"slimgrad profile: --set takes KEY=VALUE; expected e.g. n_layer=24, got "
                f"{item!r}. Pass --set KEY=VALUE."
            )
        try:
            overrides[key] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key] = raw
    try:
        target = resolve(args.target, size=args.size, seq=args.seq, overrides=overrides or None)
    except (ValueError, ImportError) as e:
        return _err(str(e))
    config = slimgrad.ConvertConfig(inplace_abn=args.inplace_abn)
    convert = not args.no_convert
    if args.fit_gib is not None:
        budget = int(args.fit_gib * 2**30)
        batch, rep = fit_batch(
            target, budget, convert=convert, config=config, progress=True, device=args.device
        )
        side = "slimgrad" if convert else "eager"
        if rep is None:
            print(f"{target.name}: even batch 1 does not fit in {args.fit_gib} GiB ({side})")
            return 1
        print(f"{target.name}: largest batch fitting in {args.fit_gib} GiB ({side}): {batch}")
        print(rep.table())
        return 0
    rep = profile(
        target,
        batch=args.batch,
        convert=convert,
        config=config,
        fake=args.estimate,
        depth=args.depth,
        device=args.device,
    )
    if args.json:
        out = {
            "target": rep.target,
            "batch": rep.batch,
            "estimated": rep.estimated,
            "device": rep.device,
            "resident_bytes": rep.resident_bytes,
            "eager": rep.eager.to_dict(),
            "slimgrad": rep.converted.to_dict() if rep.converted else None,
        }
        print(json.dumps(out, default=str))
    else:
        print(rep.table())
    if args.plot:
        print(f"memory timelines: {rep.plot(args.plot)}")
    if args.verify:
        if args.estimate or not convert:
            return _err("slimgrad profile: --verify needs a real, converted run; drop --estimate.")
        import copy

        torch_seed = 0
        model = target.build()
        lean = slimgrad.convert_(copy.deepcopy(model), config)
        vr = slimgrad.verify(model, lean, target.inputs(rep.batch), loss_fn=target.loss,
                             seed=torch_seed)  # fmt: skip
        print(vr)
        return 0 if vr.ok else 1
    return 0


SUBCOMMANDS: dict[str, Subcommand] = {
    "demo": Subcommand(
        "train a small CNN and transformer, eager vs slimgrad", _demo_args, _demo_run
    ),
    "bench": Subcommand("run a benchmark case side by side", _bench_args, _bench_run),
    "profile": Subcommand(
        "where every byte of a step goes, eager vs converted", _profile_args, _profile_run
    ),
    "estimate": Subcommand(
        "profile under fake tensors (big models and batches, no compute)",
        _estimate_args,
        _profile_run,
    ),
    "env": Subcommand("print versions and devices (for bug reports)", _env_args, _env_run),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slimgrad", description="Same gradients, less memory: demo, benchmarks, reports."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``slimgrad`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "_run"):
        parser.print_help()
        return 2
    return args._run(args)


if __name__ == "__main__":
    sys.exit(main())
