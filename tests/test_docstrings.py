"""Docstrings and comments in src/slimgrad state math, the Memory line and reasoning; measurement
logs (dates, commits, timings, measured MiB figures, the box they ran on) live in
benchmarks/results/ and docs/measurements.md (CONTRIBUTING.md, Style)."""

import ast
import io
import re
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "slimgrad"

# Each marker is something a contract or an argument never needs: a calendar date, a commit
# hash, a wall-clock figure, a measured (non-round) byte count in MiB/GiB, the machine or the
# sample a figure came from.
LOG_MARKERS = {
    "a date": r"\b20\d\d-[01]\d(?:-[0-3]\d)?\b",
    "a commit hash": r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b",
    "'measured on/at'": r"\bmeasured (?:on|at)\b",
    "a timing": r"(?<![\w.])(?:\d+(?:\.\d+)?\s?(?:ms|µs|us|ns)|\d+\.\d+\s?s)(?![\w])",
    "a measured MiB figure": r"(?<![\w.])\d+\.\d+\s?(?:KiB|MiB|GiB|KB|MB|GB)\b",
    "the box it ran on": r"\b\d-core (?:CPU )?box\b|\bloaded box\b|\bone-off (?:timing|script)\b",
    "a sample size of a timing": r"\bmedian of \d+ (?:interleaved )?(?:pairs|runs|rounds)\b",
    "a session": r"\bsessions?\b|\bhelper'?s tests\b|\brunning beside\b",
}
_MARKERS = [(what, re.compile(rx, re.I)) for what, rx in LOG_MARKERS.items()]


def _texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring line and comment in ``path``."""
    src = path.read_text(encoding="utf-8")
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                first = node.body[0].lineno
                out += [(first + i, line) for i, line in enumerate(doc.splitlines())]
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    return out


def log_lines(root: Path = SRC) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for line, text in _texts(path):
            for what, rx in _MARKERS:
                if rx.search(text):
                    rel = path.relative_to(root.parent).as_posix()
                    found.append(f"{rel}:{line}: {what}: {text.strip()}")
    return found


def test_markers_catch_what_they_name():
    hits = {
        what: bool(rx.search(text))
        for (what, rx), text in zip(
            _MARKERS,
            [
                "records of 2026-11-29",
                "at commit 3e13676 the step",
                "Measured on a shared CPU",
                "0.6-0.8 ms for 4x256x768; 1.45 s",
                "peak 403.7 MiB",
                "on the 2-core box",
                "median of 15 interleaved runs",
                "a helper's tests running beside",
            ],
            strict=True,
        )
    }
    assert all(hits.values()), hits
    # what contracts and reasoning do say is not a log
    fine = [
        "Memory: 4 B/elt fp32 + 8 B/row",
        "bucket_bytes (default 1 MiB); 64 MiB in float32",
        "1/8 B/elt, 2^16 elements, 0x7fffffff, float32, int64",
        "up to 1.78x the bound; ~30 s once",
        "the sums are computed as eager's (measured by slimgrad.memory)",
    ]
    assert [t for t in fine for _, rx in _MARKERS if rx.search(t)] == []


def test_no_measurement_logs_in_docstrings_or_comments():
    found = log_lines()
    assert not found, (
        "measurement logs in src/slimgrad (move them to docs/measurements.md or a record in "
        "benchmarks/results/, keep the reasoning):\n" + "\n".join(found)
    )
