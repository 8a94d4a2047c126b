"""The ``slimgrad`` command: ``slimgrad demo | bench | profile | estimate | env``.

Each subcommand is one entry of :data:`SUBCOMMANDS`: ``name -> Subcommand(help, add_arguments,
run, description, examples)``. ``add_arguments(parser)`` declares its options, ``run(args) -> int``
does the work and returns the exit status. Heavy imports (harness, demo, matplotlib, transformers)
happen inside ``run``, so ``slimgrad --help`` stays fast.

Bad input is found before any work starts and reported as one line on stderr, in the form
``slimgrad <subcommand>: <what is wrong>; expected <X>, got <Y>. <how to fix>.``, with exit status 2
(argparse's own errors, such as ``--batch x``, are one line too). Errors raised by a user's code
(a ``module:factory``, an HF config with ``--set``) are one line with the fix, never a traceback.
Progress of long work goes to stderr; results go to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SUBCOMMANDS", "Subcommand", "main"]

MiB = 2**20


@dataclass(frozen=True)
class Subcommand:
    """One ``slimgrad <name>`` subcommand."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str = ""  # the text of `slimgrad NAME --help` (help when empty)
    examples: str = ""  # shown under "examples:" in `slimgrad NAME --help`


class _UsageError(Exception):
    # a bad argument or a user's code failing: printed as one line, exit status 2
    pass


def _err(msg: str) -> int:
    print(" ".join(str(msg).split()), file=sys.stderr)
    return 2


def _one_line(sub: str, e: BaseException) -> str:
    # slimgrad's own messages start "slimgrad.<api>: "; the command speaks as "slimgrad <sub>: "
    text = " ".join(str(e).split())
    head, sep, rest = text.partition(": ")
    if sep and head.startswith("slimgrad.") and " " not in head:
        text = rest
    return f"slimgrad {sub}: {text}"


def _progress(sub: str) -> Callable[[str], None]:
    return lambda msg: print(f"slimgrad {sub}: {msg}", file=sys.stderr, flush=True)


class _Parser(argparse.ArgumentParser):
    # argparse's own errors (an unknown flag, `--batch x`) as one line, exit status 2
    def error(self, message: str):  # type: ignore[override]
        print(f"{self.prog}: {message}. Run `{self.prog} --help` for the usage.", file=sys.stderr)
        raise SystemExit(2)


def _check_device(sub: str, device: str, *, measured: bool = True) -> None:
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise _UsageError(
            f"slimgrad {sub}: bad --device; expected a torch device such as cpu or cuda, got "
            f"{device!r} ({' '.join(str(e).split())}). Pass --device cpu or --device cuda."
        ) from None
    if measured and dev.type == "cuda" and not torch.cuda.is_available():
        raise _UsageError(
            f"slimgrad {sub}: --device {device} needs a CUDA GPU; expected "
            "torch.cuda.is_available(), got False. Run on a GPU machine, or use --device cpu"
            + (", or --estimate (models CUDA's kernels without a GPU)." if sub != "bench" else ".")
        )


# ------------------------------------------------------------------------------------------ bench
_BENCH_DESCRIPTION = """\
Run a benchmark case side by side: eager PyTorch and slimgrad on the same model and inputs. Each
side's saved and peak bytes are measured exactly (slimgrad.memory), step times come from
interleaved eager/slimgrad pairs (the median of the per-pair ratios, with their spread), and every
gradient is checked against a float64 copy.

Records: with --out DIR, one JSON line is appended to DIR/CASE.jsonl. Without --out, a run inside
the slimgrad source checkout (the current directory below the folder holding the pyproject.toml of
the slimgrad being run) appends to that checkout's benchmarks/results; anywhere else nothing is
written. The command prints where it wrote.

Spread: a small case's step lasts about a millisecond, so one interruption (another process, page
faults) can make one pair's ratio 100x off; the report gives the middle half of the pairs'
ratios with min .. max, and says when the pairs disagree."""

_BENCH_EXAMPLES = """\
  slimgrad bench --list                              # the cases and the extras they need
  slimgrad bench conv_chain --small --repeat 5       # seconds; prints the side-by-side table
  slimgrad bench hf_gpt2 --json --out results/       # full size; record: results/hf_gpt2.jsonl
  slimgrad bench --all --small --no-record           # every case whose extras are installed"""


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("case", nargs="?", help="case name (see --list)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--all", action="store_true", help="run every case whose extras are installed")
    p.add_argument("--json", action="store_true", help="print the record as one JSON line")
    p.add_argument("--repeat", type=int, default=None, help="timed eager/slimgrad pairs (>= 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per side first (>= 0)")
    p.add_argument("--small", action="store_true", help="the case's small variant")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    p.add_argument("--dtype", default="float32", help="float32, float64, bfloat16 or float16")
    p.add_argument("--no-grad-check", action="store_true", help="skip the float64 gradient check")
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="append the record to DIR/CASE.jsonl (default: the checkout's benchmarks/results "
        "when run inside the slimgrad source checkout, else no record)",
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


def _spread_lines(rec: dict) -> list[str]:
    # NOTE [Spread of short steps] (bench/harness.py): min and max are the most interrupted pairs
    n, lo, hi = rec["repeat"], rec["time_ratio_min"], rec["time_ratio_max"]
    q1, q3 = rec.get("time_ratio_q1"), rec.get("time_ratio_q3")
    all_ms = rec.get("step_ms_all") or {}
    ratios = [
        s / e for e, s in zip(all_ms.get("eager", []), all_ms.get("slimgrad", []), strict=False)
    ]
    head = f"time ratio over {n} pair{'s' if n != 1 else ''}: median {rec['time_ratio']:.3f}"
    if n <= 5 and len(ratios) == n:
        line = f"{head}; each pair: {', '.join(f'{r:.3f}' for r in sorted(ratios))}"
        wide = hi > 1.5 * lo
    elif q1 is not None and q3 is not None:
        line = f"{head}; middle half {q1:.3f} .. {q3:.3f} (min .. max {lo:.3f} .. {hi:.3f})"
        wide = q3 > 1.5 * q1
    else:  # a record without quartiles (a case with its own run)
        line = f"{head}; min .. max {lo:.3f} .. {hi:.3f}"
        wide = hi > 1.5 * lo
    lines = [line]
    if wide:
        step = min(rec["eager"]["step_ms"], rec["slimgrad"]["step_ms"])
        lines.append(
            f"  the pairs disagree: a {step:,.2f} ms step is short next to what interrupts it "
            "(other processes, page faults); trust the median, or rerun with more --repeat on a "
            "quiet machine"
        )
    return lines


def format_record(rec: dict) -> str:
    """A human-readable summary of one bench record (plain text, aligned)."""
    if "table" in rec:  # a case with its own runner and summary (host_overhead)
        tail = [f"record appended to {rec['record_path']}"] if "record_path" in rec else []
        return "\n".join([f"case {rec['case']} ({rec['device_name']})", rec["table"], *tail])
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
    lines += _spread_lines(rec)
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


def _bench_cases(args: argparse.Namespace) -> list[str]:
    # every check before the first case runs; the case names to run
    if args.all and args.case:
        raise _UsageError(
            f"slimgrad bench: --all takes no case; expected no name, got {args.case!r}. "
            "Drop the name or --all."
        )
    if not args.all and not args.case:
        raise _UsageError(
            "slimgrad bench: no case given; expected a case name, got nothing. "
            "Run `slimgrad bench --list` to see them."
        )
    if args.dtype not in _DTYPES:
        raise _UsageError(
            f"slimgrad bench: unknown --dtype; expected one of {list(_DTYPES)}, got "
            f"{args.dtype!r}. Pass e.g. --dtype float32."
        )
    if args.repeat is not None and args.repeat < 1:
        raise _UsageError(
            f"slimgrad bench: --repeat must be >= 1; expected a count of timed pairs such as 5, "
            f"got {args.repeat}. Pass --repeat 5."
        )
    if args.warmup is not None and args.warmup < 0:
        raise _UsageError(
            f"slimgrad bench: --warmup must be >= 0; expected e.g. 1, got {args.warmup}. "
            "Pass --warmup 1."
        )
    if args.no_record and args.out is not None:
        raise _UsageError(
            f"slimgrad bench: --no-record and --out contradict; expected one of them, got both "
            f"(--out {args.out}). Drop one."
        )
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        raise _UsageError(
            f"slimgrad bench: --out must be a folder; expected a directory for CASE.jsonl, got the "
            f"file {args.out!r}. Pass a folder (it is created if missing)."
        )
    _check_device("bench", args.device)
    from slimgrad.bench.harness import get_case, list_cases

    if args.all:
        return [c.name for c in list_cases() if not c.missing()]
    try:
        case = get_case(args.case)
    except ValueError as e:
        raise _UsageError(_one_line("bench", e)) from None
    missing = case.missing()
    if missing:
        raise _UsageError(
            f"slimgrad bench: case {case.name!r} needs {', '.join(missing)}; expected them "
            "importable, got ImportError. Install them (e.g. pip install 'slimgrad[hf]')."
        )
    return [case.name]


def _bench_out_dir(args: argparse.Namespace) -> str | None:
    # where records go: --out, else the checkout's benchmarks/results when run inside the checkout
    if args.no_record:
        return None
    if args.out is not None:
        return args.out
    from slimgrad.bench.harness import repo_results_dir

    repo = repo_results_dir()
    if repo is None:
        print(
            "slimgrad bench: no record written (outside the slimgrad source checkout the default "
            "is none); pass --out DIR to append it to DIR/CASE.jsonl.",
            file=sys.stderr,
        )
    return None if repo is None else str(repo)


def _bench_run(args: argparse.Namespace) -> int:
    if args.list:
        return _bench_list()
    try:
        cases = _bench_cases(args)
    except _UsageError as e:
        return _err(str(e))
    out_dir = _bench_out_dir(args)
    return max((_bench_one(args, name, out_dir) for name in cases), default=0)


def _bench_one(args: argparse.Namespace, case: str, out_dir: str | None) -> int:
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
                out_dir=out_dir,
                progress=lambda m: print(f"[{case}] {m}", file=sys.stderr, flush=True),
            )
    except (ValueError, RuntimeError) as e:
        return _err(_one_line("bench", e))
    print(json.dumps(rec) if args.json else format_record(rec))
    if args.json and "record_path" in rec:
        print(f"slimgrad bench: record appended to {rec['record_path']}", file=sys.stderr)
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
        return _err(
            f"slimgrad bench: --verify needs module cases; expected a case whose sides are "
            f"nn.Modules, got {case!r}. Drop --verify for this case."
        )
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


def _have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _demo_run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        return _err(
            f"slimgrad demo: --steps must be positive; expected >= 1, got {args.steps}. "
            "Pass e.g. --steps 5."
        )
    out = None if args.no_plot else args.out
    if out is not None and not _have_matplotlib():
        print(
            "slimgrad demo: no PNG: matplotlib is not installed (pip install 'slimgrad[plot]'); "
            "running without the plot.",
            file=sys.stderr,
        )
        out = None
    from slimgrad.demo import run_demo

    result = run_demo(steps=args.steps, small=args.small, out=out)
    return 0 if result["ok"] else 1


# --------------------------------------------------------------------------------- profile/estimate
_FACTORY_CONTRACT = """\
Your own model, as MODULE:FACTORY (e.g. mymodel:build for build() in ./mymodel.py; the current
directory is on the import path):
  FACTORY is called with no arguments and returns (model, make_inputs); it is called once to
  check that, then once more for each model a run needs (eager, the copy slimgrad converts):
    model        an nn.Module with fresh weights, used as returned (train or eval mode);
    make_inputs  make_inputs(batch: int) -> the inputs of one step: a tensor (model(x)), a tuple
                 (model(*xs)) or a dict (model(**kw)).
  The loss is out.loss when the output has one, the output when it is a scalar, else the mean of
  the squared output (the first element of a tuple output). The default batch is 1 (--batch N).
  With --estimate and --fit-gib both run under fake tensors: no .item() or other
  data-dependent Python in them.
  Example mymodel.py:
    import torch
    def build():
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                    torch.nn.Linear(256, 10))
        return model, lambda batch: torch.randn(batch, 64)"""

_HF_HELP = """\
HF models: the named targets gpt2, bert, llama, vit, resnet (random init; --size tiny shrinks
them), or any HF config with --hf-config: a config.json, a folder holding one, or a model_type
(llama, mistral, ...: its class's defaults). Only local files are read; nothing is downloaded. The
model is the config's causal-LM head, else its masked-LM head, else its image classifier.
--set KEY=VALUE overrides a config field: the key must be one of the config's fields and the
value is read as the field's type (integer, number, true/false, JSON for lists)."""

_PROFILE_DESCRIPTION = f"""\
Where every byte of one training step goes, eager PyTorch against the same model converted by
slimgrad.convert_: per module, the bytes saved for backward; the peak and where it falls; the
eager matmul-input floor. Measured by running the step on --device, or with --estimate under fake
tensors (no compute, no memory). --fit-gib N searches the largest batch whose step fits in N GiB
(estimated), for slimgrad and for eager, printing each batch it tries to stderr.

{_HF_HELP}

{_FACTORY_CONTRACT}

Plots (--plot) need matplotlib: pip install 'slimgrad[plot]'."""

_PROFILE_EXAMPLES = """\
  slimgrad profile gpt2 --size tiny --seq 64             # seconds: measured on this CPU
  slimgrad profile resnet --fit-gib 8                    # largest batch in 8 GiB, both sides
  slimgrad profile llama --dtype bfloat16 --verify       # a bf16-weights step, checked
  slimgrad profile --hf-config llama --set num_hidden_layers=4 --estimate --device cuda
  slimgrad profile --hf-config ./my-model/config.json --batch 2 --seq 512 --estimate
  slimgrad profile mymodel:build --batch 16 --plot step.png --verify"""

_ESTIMATE_DESCRIPTION = f"""\
`slimgrad profile` under fake tensors: the same per-module report of one training step, eager
and converted, computed without allocating or running anything, so full-size models and batches
that would not fit on this machine take seconds. --device cuda models what CUDA's kernels keep
(fused attention, fused dropout), no GPU needed. The tests check that an estimate equals a
measured run's bytes on gpt2, bert, vit and resnet. Every option of `slimgrad profile` applies
(--estimate is implied).

{_HF_HELP}

{_FACTORY_CONTRACT}"""

_ESTIMATE_EXAMPLES = """\
  slimgrad estimate gpt2 --batch 16 --seq 1024           # GPT-2 small, as CPU kernels keep it
  slimgrad estimate --hf-config llama --set num_hidden_layers=8 --device cuda --batch 4
  slimgrad estimate mymodel:build --batch 64 --json"""


def _profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "target",
        nargs="?",
        help="gpt2, bert, llama, vit or resnet (HF, random init), a bench case "
        "(`slimgrad bench --list`), or MODULE:FACTORY (below); or use --hf-config",
    )
    p.add_argument(
        "--hf-config",
        metavar="CONFIG",
        default=None,
        help="an HF config.json, a folder holding one, or a model_type such as llama "
        "(instead of TARGET; local files only)",
    )
    p.add_argument(
        "--batch", type=int, default=None, help="batch size (>= 1; default: the target's)"
    )
    p.add_argument("--seq", type=int, default=256, help="sequence length of text models")
    p.add_argument(
        "--size", choices=("full", "tiny"), default="full", help="size of the named HF targets"
    )
    p.add_argument("--estimate", action="store_true", help="fake tensors: no compute, no memory")
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="whose kernels: measured there, or with --estimate modelled (no GPU needed)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="the model's weights and float inputs (bfloat16: a bf16-weights step)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override an HF config field, e.g. --set n_layer=24 (repeatable)",
    )
    p.add_argument(
        "--fit-gib",
        type=float,
        default=None,
        metavar="N",
        help="largest batch whose step fits in N GiB, slimgrad's and eager's (estimated)",
    )
    p.add_argument(
        "--plot", default=None, metavar="PNG", help="write both memory timelines here (matplotlib)"
    )
    p.add_argument("--depth", type=int, default=2, help="module-path depth of the table (>= 1)")
    p.add_argument("--no-convert", action="store_true", help="eager only")
    p.add_argument("--inplace-abn", action="store_true", help="ConvertConfig(inplace_abn=True)")
    p.add_argument("--verify", action="store_true", help="also check loss and every gradient")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _estimate_args(p: argparse.ArgumentParser) -> None:
    _profile_args(p)
    p.set_defaults(estimate=True)


def _check_profile_args(args: argparse.Namespace, sub: str) -> None:
    def bad(msg: str) -> _UsageError:
        return _UsageError(f"slimgrad {sub}: {msg}")

    if (args.target is None) == (args.hf_config is None):
        got = "both" if args.target is not None else "neither"
        raise bad(
            f"one model to profile; expected TARGET or --hf-config CONFIG, got {got}. Pass e.g. "
            f"`slimgrad {sub} gpt2` or `slimgrad {sub} --hf-config llama`."
        )
    for flag, value, least, example in (
        ("--batch", args.batch, 1, "--batch 4 (or leave it out for the target's default)"),
        ("--seq", args.seq, 1, "--seq 256"),
        ("--depth", args.depth, 1, "--depth 2"),
    ):
        if value is not None and value < least:
            raise bad(
                f"{flag} must be positive; expected an integer >= {least}, got {value}. "
                f"Pass e.g. {example}."
            )
    if args.fit_gib is not None:
        if not math.isfinite(args.fit_gib) or args.fit_gib <= 0 or args.fit_gib * 2**30 < 1:
            raise bad(
                f"--fit-gib must be a positive number of GiB; expected e.g. 8 or 0.5, got "
                f"{args.fit_gib}. Pass --fit-gib 8."
            )
        for flag, given in (("--batch", args.batch is not None), ("--verify", args.verify)):
            if given:
                raise bad(
                    f"--fit-gib searches the batch under fake tensors; expected it without "
                    f"{flag}, got both. Drop {flag}, or drop --fit-gib to profile one batch."
                )
    if args.verify and (args.estimate or args.no_convert):
        got = "--no-convert" if args.no_convert else (
            "--estimate" if sub == "profile" else "the estimate subcommand"
        )  # fmt: skip
        raise bad(
            f"--verify needs a measured, converted run; expected `slimgrad profile ... --verify` "
            f"without --estimate or --no-convert, got {got}. Drop --verify or {got}."
        )
    if args.inplace_abn and args.no_convert:
        raise bad(
            "--inplace-abn configures the conversion; expected it without --no-convert, got "
            "both. Drop one."
        )
    if args.size != "full" and (
        args.hf_config is not None or ":" in args.target.removeprefix("hf:")
    ):
        raise bad(
            f"--size applies to the named HF targets and bench cases; expected it without "
            f"{'--hf-config' if args.hf_config else 'a module:factory target'}, got --size "
            f"{args.size}. Shrink the model with --set (HF configs) or in your factory."
        )
    if args.plot is not None:
        if not _have_matplotlib():
            raise bad(
                "--plot needs matplotlib; expected it installed, got ModuleNotFoundError. Install "
                "the extra: pip install 'slimgrad[plot]', or drop --plot."
            )
        path = Path(args.plot)
        if path.suffix.lower() not in ("", ".png"):
            raise bad(
                f"--plot writes a PNG; expected a .png path, got {args.plot!r}. Pass e.g. "
                "--plot step.png."
            )
        if not path.resolve().parent.is_dir():
            raise bad(
                f"--plot's folder does not exist; expected an existing folder, got "
                f"{str(path.resolve().parent)!r}. Create it or pass another path."
            )
    _check_device(sub, args.device, measured=not (args.estimate or args.fit_gib is not None))


def _factory_target(args: argparse.Namespace, sub: str):
    from slimgrad.targets import resolve

    spec = args.target
    mod_name, _, fn_name = spec.partition(":")
    if not (
        mod_name and all(p.isidentifier() for p in mod_name.split(".")) and fn_name.isidentifier()
    ):
        raise _UsageError(
            f"slimgrad {sub}: bad MODULE:FACTORY target; expected e.g. mymodel:build (a module "
            f"and a function in it), got {spec!r}. See the factory contract in "
            f"`slimgrad {sub} --help`."
        )
    cwd = os.getcwd()
    if cwd not in sys.path:  # the console script, unlike `python -m`, does not put it there
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:
        raise _UsageError(
            f"slimgrad {sub}: cannot import module {mod_name!r} of {spec!r}; expected a module "
            f"importable from the current directory ({cwd}) or the environment, got "
            f"{_msg(e)}. Run from the folder holding "
            f"{mod_name.replace('.', '/')}.py, or install its package."
        ) from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        got = "nothing" if fn is None else type(fn).__name__
        raise _UsageError(
            f"slimgrad {sub}: module {mod_name!r} has no factory {fn_name!r}; expected a "
            f"function, got {got}. Define `def {fn_name}(): return model, make_inputs` in "
            f"{getattr(module, '__file__', mod_name)}."
        )
    try:
        target = resolve(spec)  # calls the factory once and checks what it returns
    except Exception as e:
        own = str(e).startswith("slimgrad.")
        raise _UsageError(
            _one_line(sub, e)
            if own
            else f"slimgrad {sub}: factory {spec!r} raised; expected {fn_name}() to return "
            f"(model, make_inputs), got {_msg(e)}. Call "
            f"{fn_name}() in Python to see the traceback; the contract is in "
            f"`slimgrad {sub} --help`."
        ) from None
    if not callable(target.inputs):
        raise _UsageError(
            f"slimgrad {sub}: factory {spec!r} returned a make_inputs that is not callable; "
            f"expected a function batch -> inputs, got {type(target.inputs).__name__}. Return "
            "(model, lambda batch: torch.randn(batch, ...))."
        )
    return target


def _msg(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split()).rstrip('.')}"


def _check_hf_builds(target, sub: str, who: str, fix: str) -> None:
    # the model class's own checks (e.g. hidden size divisible by the heads) before any work: the
    # model built on the meta device, which allocates nothing whatever the config's size
    import torch

    try:
        with torch.device("meta"):
            target.build(skip_init=True)
    except Exception as e:
        raise _UsageError(
            f"slimgrad {sub}: {who} does not build a model; expected values the model class "
            f"accepts, got {_msg(e)}. {fix}."
        ) from None


def _profile_target(args: argparse.Namespace, sub: str):
    """The target and, when it runs a user's code or config, (how to name it, how to fix it)."""
    if args.hf_config is not None:
        from slimgrad.profile import hf_config_target

        try:
            target = hf_config_target(args.hf_config, seq=args.seq, overrides=args.set)
        except (ValueError, ImportError) as e:
            raise _UsageError(_one_line(sub, e)) from None
        user = (f"the HF config {args.hf_config!r}", "Fix the --set values or the config")
        _check_hf_builds(target, sub, *user)
        return target, user
    from slimgrad.targets import HF_TARGETS, resolve

    name = args.target.removeprefix("hf:")
    if name in HF_TARGETS:
        overrides = None
        if args.set:
            from slimgrad.profile import parse_config_overrides

            try:
                import transformers

                cfg_class = getattr(transformers, HF_TARGETS[name][0])
                overrides = parse_config_overrides(cfg_class, args.set)
            except (ValueError, ImportError) as e:
                raise _UsageError(_one_line(sub, e)) from None
        try:
            target = resolve(args.target, size=args.size, seq=args.seq, overrides=overrides)
        except (ValueError, ImportError) as e:
            raise _UsageError(_one_line(sub, e)) from None
        except Exception as e:  # the config class rejects a --set value (its own validation)
            if not overrides:
                raise
            raise _UsageError(
                f"slimgrad {sub}: {HF_TARGETS[name][0]} rejects --set {' '.join(args.set)}; "
                f"expected values it accepts, got {_msg(e)}. Fix the --set values."
            ) from None
        if not overrides:
            return target, None
        user = (f"the {name} config with --set {' '.join(args.set)}", "Fix the --set values")
        _check_hf_builds(target, sub, *user)
        return target, user
    if args.set:
        raise _UsageError(
            f"slimgrad {sub}: --set overrides HF config fields; expected an HF target (gpt2, "
            f"bert, llama, vit, resnet or --hf-config), got {args.target!r}. Drop --set, or set "
            "the values in your factory."
        )
    if ":" in args.target:
        return _factory_target(args, sub), (
            f"the factory {args.target!r}",
            "Run that step in Python to see the traceback (the factory contract is in "
            f"`slimgrad {sub} --help`)",
        )
    try:
        return resolve(args.target, size=args.size, seq=args.seq), None
    except (ValueError, ImportError) as e:
        raise _UsageError(_one_line(sub, e)) from None


@contextlib.contextmanager
def _user_code(sub: str, user: tuple[str, str] | None) -> Iterator[None]:
    # a user's factory or config failing while its model is built or run: one line, exit 2
    if user is None:  # slimgrad's own targets: a failure is a slimgrad bug, with its traceback
        yield
        return
    try:
        yield
    except _UsageError:
        raise
    except Exception as e:
        who, fix = user
        raise _UsageError(
            f"slimgrad {sub}: {who} failed while its model was built or run; expected a model "
            f"that runs a training step on its inputs, got {_msg(e)}. {fix}."
        ) from None


def _report_dict(rep) -> dict:
    return {
        "target": rep.target,
        "batch": rep.batch,
        "estimated": rep.estimated,
        "device": rep.device,
        "dtype": rep.dtype,
        "resident_bytes": rep.resident_bytes,
        "eager": rep.eager.to_dict(),
        "slimgrad": rep.converted.to_dict() if rep.converted else None,
    }


def _profile_run(args: argparse.Namespace) -> int:
    sub = getattr(args, "_name", "profile")
    try:
        _check_profile_args(args, sub)
        target, user = _profile_target(args, sub)
        with _user_code(sub, user):
            return _profile_work(args, sub, target)
    except _UsageError as e:
        return _err(str(e))


def _profile_work(args: argparse.Namespace, sub: str, target) -> int:
    import slimgrad
    from slimgrad.profile import profile

    say = _progress(sub)
    config = slimgrad.ConvertConfig(inplace_abn=args.inplace_abn)
    convert = not args.no_convert
    if args.fit_gib is not None:
        return _fit_work(args, sub, target, config, convert)
    dtype = _profile_dtype(args)
    rep = profile(
        target,
        batch=args.batch,
        convert=convert,
        config=config,
        fake=args.estimate,
        depth=args.depth,
        device=args.device,
        dtype=dtype,
        progress=say,
    )
    print(json.dumps(_report_dict(rep), default=str) if args.json else rep.table())
    if args.plot:
        print(f"memory timelines: {rep.plot(args.plot)}")
    if args.verify:
        import copy

        from slimgrad.profile import _cast_floating

        say("verifying the loss and every gradient against float64")
        model, inputs = target.build(), target.inputs(rep.batch)
        if dtype is not None:
            model, inputs = model.to(dtype), _cast_floating(inputs, dtype)
        lean = slimgrad.convert_(copy.deepcopy(model), config)
        vr = slimgrad.verify(model, lean, inputs, loss_fn=target.loss, seed=0)
        print(vr)
        return 0 if vr.ok else 1
    return 0


def _profile_dtype(args: argparse.Namespace):
    import torch

    return None if args.dtype == "float32" else getattr(torch, args.dtype)


def _fit_work(args: argparse.Namespace, sub: str, target, config, convert: bool) -> int:
    from slimgrad.profile import fit

    gib = f"{args.fit_gib:g} GiB"
    say = _progress(sub)
    say(
        f"searching the largest batch of {target.name} within {gib} ({args.device} kernels, "
        "estimated under fake tensors); one line per batch tried"
    )
    r = fit(
        target, int(args.fit_gib * 2**30), convert=convert, eager=True, config=config,
        device=args.device, dtype=_profile_dtype(args), progress=say,
    )  # fmt: skip
    best = r.slimgrad_batch if convert else r.eager_batch
    if args.json:
        print(json.dumps({
            "target": target.name, "budget_bytes": r.budget_bytes, "device": args.device,
            "slimgrad_batch": r.slimgrad_batch, "eager_batch": r.eager_batch,
            "probes": {str(b): v for b, v in sorted(r.probes.items())},
            "report": _report_dict(r.report) if r.report is not None else None,
        }, default=str))  # fmt: skip
        return 0 if best else 1

    def side(name: str, b: int) -> str:
        return f"{name} {b}" if b else f"{name} none (batch 1 does not fit)"

    parts = ([side("slimgrad", r.slimgrad_batch)] if convert else []) + [
        side("eager", r.eager_batch)
    ]
    gain = (
        f" ({r.slimgrad_batch / r.eager_batch:.2f}x eager's)"
        if convert and r.eager_batch and r.slimgrad_batch
        else ""
    )
    print(f"{target.name}: largest batch fitting in {gib}: {', '.join(parts)}{gain}")
    if not best:
        return 1
    print(r.report.table())
    if args.plot:
        print(f"memory timelines: {r.report.plot(args.plot)}")
    return 0


# ------------------------------------------------------------------------------------------ plan
def _plan_choices_help() -> str:
    import textwrap

    from slimgrad.plan import CHOICE_HELP

    width = max(map(len, CHOICE_HELP))
    pad = " " * (width + 4)
    return "\n".join(
        textwrap.fill(h, 96, initial_indent=f"  {c:<{width}}  ", subsequent_indent=pad)
        for c, h in CHOICE_HELP.items()
    )


_PLAN_DESCRIPTION = f"""\
Fit one training step into a memory budget with the least recompute (slimgrad.plan): per
repeated block (decoder layers, GPT-2 blocks, ResNet blocks) eager, lean (slimgrad's ops), or
recomputed in backward (the whole block, one child such as the MLP, the attention core, the
gated MLP's activation), chosen by bytes freed per recomputed matmul FLOP against the step's
peak, estimated under fake tensors (no compute, no memory; --device cuda models CUDA's kernels
without a GPU). Prints the plan, the budget -> recompute curve next to eager, slimgrad,
checkpoint-all and SAC, and progress on stderr. The budget is the step's peak above what is
resident (weights, inputs), as `slimgrad estimate` reports it. Apply the plan in Python with
slimgrad.convert_(model, plan=slimgrad.plan(...)).

The choices per block (each offered where it applies; --choices names some):
{_plan_choices_help()}

{_HF_HELP}

{_FACTORY_CONTRACT}"""

_PLAN_EXAMPLES = """\
  slimgrad plan llama --size tiny --seq 64 --budget 8MiB
  slimgrad plan --hf-config llama --set num_hidden_layers=16 --batch 4 --seq 2048 \\
      --autocast bf16 --device cuda --budget 6GiB --plot curve.png
  slimgrad plan mymodel:build --batch 16 --budget 2GiB --json"""


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", nargs="?", help="as `slimgrad profile` takes it (below)")
    p.add_argument("--hf-config", metavar="CONFIG", default=None, help="an HF config (local)")
    p.add_argument("--budget", required=True, help="the step's peak, e.g. 6GiB, 512MiB or bytes")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: the target's)")
    p.add_argument("--seq", type=int, default=256, help="sequence length of text models")
    p.add_argument("--size", choices=("full", "tiny"), default="full", help="named HF targets")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="whose kernels")
    p.add_argument(
        "--autocast", default=None, choices=("bf16", "fp16"), help="run the step under autocast"
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="HF field")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the chosen plan's full estimate (a budget below the composed curve is "
        "still checked whole)",
    )
    p.add_argument(
        "--choices",
        default=None,
        metavar="C1,C2",
        help="consider only these choices (comma-separated, as listed above; "
        "'lean+recompute' also takes its ':<child>' forms); default: all",
    )
    p.add_argument("--plot", default=None, metavar="PNG", help="write the curve here")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _plan_run(args: argparse.Namespace) -> int:
    sub = "plan"
    try:
        if (args.target is None) == (args.hf_config is None):
            got = "both" if args.target is not None else "neither"
            raise _UsageError(
                f"slimgrad plan: one model to plan; expected TARGET or --hf-config CONFIG, got "
                f"{got}. Pass e.g. `slimgrad plan gpt2 --budget 6GiB`."
            )
        if args.batch is not None and args.batch < 1 or args.seq < 1:
            raise _UsageError(
                f"slimgrad plan: --batch and --seq must be positive; expected integers >= 1, got "
                f"{args.batch} and {args.seq}. Pass e.g. --batch 4 --seq 256."
            )
        from slimgrad.plan import parse_bytes

        try:
            budget = parse_bytes(args.budget)
        except (TypeError, ValueError) as e:
            raise _UsageError(_one_line(sub, e)) from None
        target, user = _profile_target(args, sub)
        with _user_code(sub, user):
            return _plan_work(args, target, budget)
    except _UsageError as e:
        return _err(str(e))


def _plan_work(args: argparse.Namespace, target, budget: int) -> int:
    import torch

    import slimgrad
    from slimgrad.profile import _target_make

    batch = args.batch or target.default_batch
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.autocast]
    make = _target_make(target, batch, amp)

    say = _progress("plan")
    say(f"planning {target.name}, batch {batch}, within {args.budget} ({args.device} kernels)")
    kwargs = {"dtype": amp} if amp is not None else {}
    if args.choices:
        kwargs["choices"] = tuple(c.strip() for c in args.choices.split(",") if c.strip())
    try:
        p = slimgrad.plan(
            make, budget, device=args.device, verify=not args.no_verify, progress=say, **kwargs
        )
    except ValueError as e:
        return _err(_one_line("plan", e))
    if args.json:
        print(json.dumps({"target": target.name, "batch": batch, **p.to_dict()}, default=str))
    else:
        print(p.summary())
        print(p.curve_text())
    if args.plot:
        print(f"curve: {p.plot(args.plot)}")
    return 0


SUBCOMMANDS: dict[str, Subcommand] = {
    "demo": Subcommand(
        "train a small CNN and transformer, eager vs slimgrad",
        _demo_args,
        _demo_run,
        "Train a small CNN and a small transformer for a few steps, eager and converted side by "
        "side: losses, gradients and measured memory; writes a PNG of both memory timelines "
        "(needs matplotlib: pip install 'slimgrad[plot]'; without it the demo runs, no PNG).",
        "  slimgrad demo --small --no-plot      # seconds\n"
        "  slimgrad demo --steps 10 --out memory.png",
    ),
    "bench": Subcommand(
        "run a benchmark case side by side",
        _bench_args,
        _bench_run,
        _BENCH_DESCRIPTION,
        _BENCH_EXAMPLES,
    ),
    "profile": Subcommand(
        "where every byte of a step goes, eager vs converted",
        _profile_args,
        _profile_run,
        _PROFILE_DESCRIPTION,
        _PROFILE_EXAMPLES,
    ),
    "estimate": Subcommand(
        "profile under fake tensors (big models and batches, no compute)",
        _estimate_args,
        _profile_run,
        _ESTIMATE_DESCRIPTION,
        _ESTIMATE_EXAMPLES,
    ),
    "plan": Subcommand(
        "fit a step into a memory budget with the least recompute",
        _plan_args,
        _plan_run,
        _PLAN_DESCRIPTION,
        _PLAN_EXAMPLES,
    ),
    "env": Subcommand(
        "print versions and devices (for bug reports)",
        _env_args,
        _env_run,
        "Print the versions of Python, torch, transformers and triton, the devices, the commit, "
        "the tested version ranges and every optional feature with its state and reason.",
        "  slimgrad env\n  slimgrad env --json",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="slimgrad",
        description="Same gradients, less memory: demo, benchmarks, reports.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `slimgrad COMMAND --help` for a command's options and examples, e.g.\n"
        "  slimgrad demo --small\n  slimgrad bench --list\n  slimgrad profile gpt2 --size tiny\n"
        "  slimgrad estimate gpt2 --batch 16 --device cuda\n  slimgrad env",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in SUBCOMMANDS.items():
        p = sub.add_parser(
            name,
            help=cmd.help,
            description=cmd.description or cmd.help,
            epilog=f"examples:\n{cmd.examples}" if cmd.examples else None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run, _name=name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``slimgrad`` console script; returns the exit status."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the subcommand's parser, which knows the options
        prog = f"slimgrad {args._name}" if hasattr(args, "_name") else "slimgrad"
        return _err(
            f"{prog}: unrecognized arguments: {' '.join(extra)}. Run `{prog} --help` for the usage."
        )
    if not hasattr(args, "_run"):
        parser.print_help()
        return 2
    return args._run(args)


if __name__ == "__main__":
    sys.exit(main())
