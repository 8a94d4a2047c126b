"""No frame, bytecode or raw-memory inspection in slimgrad's Python code (issue 31, CONTRIBUTING.md
"Decide once"): ownership and the memory tracker decide from stated facts; the one place that
reads CPython frames (the tracker's ``call_origin``) is the optional C++ extension."""

from __future__ import annotations

import re
from pathlib import Path

import slimgrad

SRC = Path(slimgrad.__file__).parent
# what reads frames or bytecode: sys._getframe, inspect.currentframe/stack, frame.f_back, dis
FORBIDDEN = re.compile(
    r"_getframe|currentframe\(|inspect\.stack\(|\.f_back\b|\.f_code\b"
    r"|^\s*(import dis\b|from dis\b)",
    re.M,
)


def test_no_frame_or_bytecode_reads_in_python():
    hits = [
        f"{p.relative_to(SRC)}:{src[: m.start()].count(chr(10)) + 1}: {m.group(0)}"
        for p in sorted(SRC.rglob("*.py"))
        for src in [p.read_text()]
        for m in FORBIDDEN.finditer(src)
    ]
    assert hits == []


def test_no_ctypes_outside_the_c_kernel_loader():
    # kernels/_cpu.py loads slimgrad's own compiled C kernels with ctypes (it reads no torch
    # object); nothing else imports ctypes
    users = sorted(
        str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if "import ctypes" in p.read_text()
    )
    assert users == ["kernels/_cpu.py"]
