"""Records for the README's headline table: models at their families' own default configurations.

Runs ``slimgrad profile TARGET --verify --json`` (a measured CPU step, eager and converted, exact
tracker; loss and every gradient checked against float64) for each named HF target and appends one
record per target to ``benchmarks/results/default_configs.jsonl`` with the command, commit,
versions and machine. The named targets are random-init HF models built from the config class's
own defaults, except the layer count/width of Llama (12 x 768, see ``slimgrad.targets``): no
attention dropout for Llama (its default), GPT-2's and BERT's default dropout 0.1.

    .venv/bin/python benchmarks/default_configs.py [--no-verify] [TARGET ...]   # default: all
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from slimgrad.bench.harness import environment, git_commit

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "default_configs.jsonl"
TARGETS = ["llama", "gpt2", "bert", "vit", "resnet"]


def run(target: str, verify: bool = True) -> dict:
    cmd = ["slimgrad", "profile", target, *(["--verify"] if verify else []), "--json"]
    commit = git_commit()
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "slimgrad", *cmd[1:]],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    first, _, rest = proc.stdout.partition("\n")
    out = json.loads(first)
    verify = [line for line in rest.splitlines() if line.startswith("verify:")]
    for side in ("eager", "slimgrad"):  # the per-tensor list is long; the totals stay
        if isinstance(out.get(side), dict):
            out[side].pop("saved", None)
    return {
        "case": f"default_config/{target}",
        "command": " ".join(cmd),
        "profile": out,
        "verify": verify[0] if verify else None,
        "seconds": round(time.monotonic() - t0, 1),
        "commit": commit,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": environment(),
    }


def main(argv: list[str]) -> None:
    verify = "--no-verify" not in argv  # a full-size float64 check takes long on a small box
    for target in [a for a in argv if not a.startswith("--")] or TARGETS:
        rec = run(target, verify)
        with OUT.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        p = rec["profile"]
        print(
            f"{target}: peak {p['eager']['peak_bytes'] / 2**20:.1f} -> "
            f"{p['slimgrad']['peak_bytes'] / 2**20:.1f} MiB ({rec['seconds']} s); {rec['verify']}",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
