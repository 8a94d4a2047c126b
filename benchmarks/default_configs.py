"""Records for the README's headline table: models at their families' own default configurations.

Runs ``slimgrad profile TARGET --json`` (a measured CPU step, eager and converted, exact tracker)
for each named HF target and appends one record per target to
``benchmarks/results/default_configs.jsonl`` with the command, commit, versions and machine. The
named targets are random-init HF models built from the config class's own defaults, except the
layer count/width of Llama (12 x 768, see ``slimgrad.targets``): no attention dropout for Llama
(its default), GPT-2's and BERT's default dropout 0.1.

Each record also carries a gradient check of the same model and config (``slimgrad profile TARGET
--verify``: loss and every gradient against float64, train and eval, padded and unpadded): at the
measured shape with ``--verify full`` (a float64 step of a full-size model: half an hour on a
2-core CPU), at batch 1 (text: x 32 tokens) with ``--verify small`` (the default), or none.
``--dtype bfloat16`` profiles a bf16-weights step (case ``default_config/TARGET/bfloat16``).

    .venv/bin/python benchmarks/default_configs.py [--verify full|small|none]
        [--dtype float32|bfloat16] [TARGET ...]                          # default: all, float32
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from slimgrad.bench.harness import environment, git_commit

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "default_configs.jsonl"
TARGETS = ["llama", "gpt2", "bert", "vit", "resnet"]
TEXT = ("llama", "gpt2", "bert")
SMALL_SEQ = 32


def _slimgrad(args: list[str]) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "slimgrad", *args],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return proc.stdout


def _verify_line(stdout: str) -> str | None:
    found = [line for line in stdout.splitlines() if line.startswith("verify:")]
    return found[0] if found else None


def run(target: str, verify: str = "small", dtype: str = "float32") -> dict:
    d = [] if dtype == "float32" else ["--dtype", dtype]
    cmd = ["profile", target, *d, *(["--verify"] if verify == "full" else []), "--json"]
    commit = git_commit()
    t0 = time.monotonic()
    stdout = _slimgrad(cmd)
    first, _, rest = stdout.partition("\n")
    out = json.loads(first)
    for side in ("eager", "slimgrad"):  # the per-tensor list is long; the totals stay
        if isinstance(out.get(side), dict):
            out[side].pop("saved", None)
    rec = {
        "case": f"default_config/{target}" + ("" if dtype == "float32" else f"/{dtype}"),
        "command": " ".join(["slimgrad", *cmd]),
        "profile": out,
        "verify": _verify_line(rest) if verify == "full" else None,
    }
    if verify == "full":
        rec["verify_shape"] = "as measured"
    if verify == "small":
        small = ["--batch", "1", *(["--seq", str(SMALL_SEQ)] if target in TEXT else [])]
        vcmd = ["profile", target, *d, *small, "--verify"]
        rec["verify_command"] = " ".join(["slimgrad", *vcmd])
        rec["verify"] = _verify_line(_slimgrad(vcmd))
        rec["verify_shape"] = f"1 x {SMALL_SEQ} tokens" if target in TEXT else "1 image"
    rec.update(
        seconds=round(time.monotonic() - t0, 1),
        commit=commit,
        time_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        versions=environment(),
    )
    return rec


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("targets", nargs="*", metavar="TARGET", help=f"of {TARGETS} (default: all)")
    p.add_argument("--verify", choices=("full", "small", "none"), default="small")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args(argv)
    if set(args.targets) - set(TARGETS):
        p.error(f"unknown targets {sorted(set(args.targets) - set(TARGETS))}; expected {TARGETS}")
    for target in args.targets or TARGETS:
        rec = run(target, args.verify, args.dtype)
        with OUT.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        pr = rec["profile"]
        print(
            f"{rec['case']}: peak {pr['eager']['peak_bytes'] / 2**20:.1f} -> "
            f"{pr['slimgrad']['peak_bytes'] / 2**20:.1f} MiB ({rec['seconds']} s); {rec['verify']}",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
