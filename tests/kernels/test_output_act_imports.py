"""The activation kernels are leaves (CONTRIBUTING.md, NOTE [Kernels are leaves] in
``slimgrad._math``): they import nothing from ``slimgrad.ops``, ``slimgrad.bench`` or
``slimgrad.convert``, neither by an import statement nor through ``importlib``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import slimgrad

SRC = Path(slimgrad.__file__).parent
STEMS = ["relu", "sigmoid", "tanh", "hardtanh", "leaky_relu", "elu", "gelu", "silu", "mish"]
FILES = [f"kernels/{s}.py" for s in STEMS] + [
    "kernels/_output_act.py",
    "kernels/_common.py",
    "kernels/_backend.py",
    "kernels/_cpu.py",
    "_math/__init__.py",
    "_math/bits.py",
    "_math/smooth.py",
]
FORBIDDEN = ("slimgrad.ops", "slimgrad.bench", "slimgrad.convert")


def imported_modules(path: Path) -> list[str]:
    """Every module a file imports: import statements, ``from`` imports (with their names, so
    ``from slimgrad import ops`` counts) and ``importlib.import_module("...")`` string literals."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module":
            found += [a.value for a in node.args if isinstance(a, ast.Constant)]
    return found


@pytest.mark.parametrize("rel", FILES)
def test_kernel_imports_nothing_above_it(rel):
    mods = imported_modules(SRC / rel)
    bad = [m for m in mods if m.startswith(FORBIDDEN)]
    assert not bad, f"{rel} imports {bad}"


def test_the_reader_sees_every_form():
    import textwrap

    src = textwrap.dedent(
        """
        import slimgrad.ops.gelu
        from slimgrad import ops
        from slimgrad.bench import cases
        importlib.import_module("slimgrad.ops.silu")
        """
    )
    p = Path(__file__).with_name("_imports_probe.txt")
    try:
        p.write_text(src)
        mods = imported_modules(p)
    finally:
        p.unlink()
    assert {m for m in mods if m.startswith(FORBIDDEN)} == {
        "slimgrad.ops.gelu",
        "slimgrad.ops",
        "slimgrad.bench",
        "slimgrad.bench.cases",
        "slimgrad.ops.silu",
    }
