"""Several checks that each need a fresh interpreter, run one after another in ONE child process.

A child's start (torch, slimgrad, maybe triton) costs more CPU than most such checks; a test file
whose checks are about import isolation or a process's first build/warning starts one child for
all of them, in an order where each check still sees what it needs (the first one a fresh
process). Each check is Python source run with ``exec`` in its own namespace; a failure is caught
and reported for that check only, so the test of each check passes or fails on its own.

    res = run_checks({"imports_nothing": CODE_A, "warns_once": CODE_B}, env=...)
    assert res["imports_nothing"] == "ok", res["imports_nothing"]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_RUNNER = """
import json, sys, traceback
checks = json.loads(sys.stdin.read())
res = {}
for name, code in checks:
    try:
        exec(compile(code, "<check " + name + ">", "exec"), {"__name__": "__check__"})
        res[name] = "ok"
    except BaseException:
        res[name] = traceback.format_exc()
    sys.stdout.flush()
sys.stderr.flush()
print("\\n@@checks@@" + json.dumps(res))
"""


def run_checks(
    checks: dict[str, str], env: dict[str, str] | None = None, timeout: float = 600
) -> dict[str, str]:
    """Run ``checks`` (name -> code, in this order) in one child; name -> "ok" or the traceback
    (every name gets the child's output tail when the child itself died)."""
    full = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "src"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
        **(env or {}),
    }
    full = {k: v for k, v in full.items() if v is not None}
    payload = json.dumps([(n, textwrap.dedent(c)) for n, c in checks.items()])
    r = subprocess.run(
        [sys.executable, "-c", _RUNNER],
        input=payload,
        capture_output=True,
        text=True,
        env=full,
        cwd=ROOT,
        timeout=timeout,
    )
    _, sep, tail = r.stdout.rpartition("\n@@checks@@")
    if r.returncode != 0 or not sep:
        died = f"the child exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return dict.fromkeys(checks, died)
    res = json.loads(tail)
    return {
        n: v if v == "ok" else f"{v}\n--- child stderr ---\n{r.stderr[-2000:]}"
        for n, v in res.items()
    }
