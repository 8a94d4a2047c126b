"""Run every OpInfo case outside pytest and write the findings file.

    .venv/bin/python -m tests.opinfo._report [out.md] [op ...]

Per op: counts (ok, refused, failing) and each failing sample grouped by class, with a
reproducer line (the pytest id).
"""

from __future__ import annotations

import collections
import sys
import time
import traceback

import torch

from tests.opinfo import _harness as H

KINDS = ("sample", "f64", "inplace", "error", "noncontig", "channels_last")
FILES = {
    "act": "activations",
    "dropout": "dropout",
    "norm": "norms",
    "conv": "conv",
    "linear": "linear",
}
TESTS = {
    "sample": "test_sample",
    "f64": "test_f64_gradcheck_double",
    "inplace": "test_inplace",
    "error": "test_error_input",
    "noncontig": "test_noncontiguous",
    "channels_last": "test_channels_last",
}


def main(argv):
    out = argv[0] if argv else "/work/notes/opinfo_findings.md"
    only = set(argv[1:])
    torch.set_num_threads(1)
    stats = collections.defaultdict(collections.Counter)
    fails = collections.defaultdict(list)
    t0 = time.process_time()
    per_op_time = collections.Counter()
    timings = []
    for spec in H.SPECS:
        if only and spec.key not in only:
            continue
        for kind in KINDS:
            for key, dt, i in H.cases(kind, (spec.group,)):
                if key != spec.key:
                    continue
                t = time.process_time()
                torch.manual_seed(0)
                try:
                    status = H.run(kind, key, dt, i)
                except H.Finding as e:
                    status = "fail"
                    cls = e.cls
                    msg = str(e)
                except Exception as e:  # noqa: BLE001
                    status = "fail"
                    cls = "harness/other: " + type(e).__name__
                    msg = "".join(traceback.format_exception_only(e)).strip()
                dt_s = time.process_time() - t
                per_op_time[key] += dt_s
                timings.append((dt_s, H.case_id(kind, key, dt, i)))
                stats[key][f"{kind}:{status}"] += 1
                if status == "fail":
                    cid = H.case_id(kind, key, dt, i)
                    node = (
                        f"tests/opinfo/test_{FILES[spec.group]}.py::{TESTS[kind]}"
                        f"[{cid.split(':', 1)[1]}]"
                    )
                    fails[key].append((cls, cid, node, msg))
    lines = [
        "# OpInfo findings (tests/opinfo, issue 15)",
        "",
        f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on main "
        f"({_head()}), {time.process_time() - t0:.0f} s CPU single-threaded.",
        "Reproduce one: `.venv/bin/python -m pytest -q -p no:cacheprovider '<node id>'`;",
        "re-generate: `.venv/bin/python -m tests.opinfo._report [out.md] [op ...]`.",
        "Kinds: sample = forward + grads (all dtypes), f64 = gradcheck + double backward vs "
        "eager + gradgradcheck, inplace = OpInfo in-place variant, error = error_inputs.",
        "",
        "## Counts",
        "",
        "| op | " + " | ".join(KINDS) + " | CPU s |",
        "|---|" + "---|" * (len(KINDS) + 1),
    ]
    for key, c in stats.items():
        cells = []
        for k in KINDS:
            ok, ref, bad = c[f"{k}:ok"] + c[f"{k}:n/a"], c[f"{k}:refused"], c[f"{k}:fail"]
            cells.append(
                f"{ok} ok"
                + (f", {ref} refused" if ref else "")
                + (f", **{bad} fail**" if bad else "")
            )
        lines.append(f"| {key} | " + " | ".join(cells) + f" | {per_op_time[key]:.1f} |")
    lines += ["", "## Failures by op and class", ""]
    for key, items in fails.items():
        lines.append(f"### {key} ({len(items)} failing)")
        by = collections.defaultdict(list)
        for cls, cid, node, msg in items:
            by[cls].append((cid, node, msg))
        for cls, its in by.items():
            lines.append(f"- **{cls}** ({len(its)}):")
            for _cid, node, msg in its[:6]:
                m = " ".join(msg.split())[:400]
                lines.append(f"  - `{node}`: {m}")
            if len(its) > 6:
                lines.append(
                    f"  - ... and {len(its) - 6} more: "
                    + ", ".join(c.split(":", 1)[1] for c, _, _ in its[6:40])
                )
        lines.append("")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(out + ".known", "w") as f:
        f.write(known_source(fails))
    with open(out + ".times", "w") as f:
        f.writelines(f"{t:.4f} {c}\n" for t, c in sorted(timings, reverse=True))
    print("\n".join(lines[:40]))


def known_source(fails) -> str:
    """KNOWN entries for _tables.py: one line per (kind, op, dtype, class), the indices listed."""
    groups = collections.defaultdict(list)
    first = {}
    for items in fails.values():
        for cls, cid, _node, msg in items:
            kind, rest = cid.split(":", 1)
            stem, idx = rest.rsplit("-", 1)
            g = (f"{kind}:{stem}", cls)
            groups[g].append(int(idx))
            first.setdefault(g, " ".join(msg.split()))
    lines = []
    for (prefix, cls), idx in groups.items():
        m = first[(prefix, cls)]
        m = m[m.find(": ", m.find(")")) + 2 :] if ")" in m else m
        reason = f"{cls}: {m[:150]}".replace('"', "'")
        lines.append(f'    *_ids("{prefix}", {sorted(idx)}, "{reason}"),')
    return "\n".join(lines) + "\n"


def _head():
    import os
    import subprocess

    if os.environ.get("OPINFO_COMMIT"):  # a snapshot of main (git archive) under PYTHONPATH
        return os.environ["OPINFO_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001
        return "?"


if __name__ == "__main__":
    main(sys.argv[1:])
