"""The house's layout rules (CONTRIBUTING.md), read from the source's imports with ``ast``:

- kernels are leaves: no module under ``src/slimgrad/kernels/`` imports ``slimgrad.ops`` or
  ``slimgrad.bench`` (the math they share lives below both);
- the math they share (``src/slimgrad/_math/``) imports nothing from ``slimgrad.ops``,
  ``slimgrad.kernels``, ``slimgrad.bench``, ``slimgrad.convert`` or ``slimgrad.nn``;
- ``slimgrad.memory`` imports nothing from ``slimgrad.ops``.

Every import counts: ``import``/``from`` statements at any depth (inside functions too), relative
ones resolved, and ``importlib.import_module("...")`` with a literal name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "slimgrad"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module name ``path`` imports (statically or by a literal importlib call)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else None
    package = package or _module_name(path)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names.add(mod)
            names.update(f"{mod}.{a.name}" for a in node.names)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
    return names


def _hits(names: set[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in forbidden))


KERNEL_MODULES = sorted(PKG.joinpath("kernels").rglob("*.py"))


@pytest.mark.parametrize("path", KERNEL_MODULES, ids=_module_name)
def test_kernels_are_leaves(path):
    bad = _hits(imports_of(path), ("slimgrad.ops", "slimgrad.bench", "slimgrad.convert"))
    assert not bad, f"{_module_name(path)} imports {bad}; kernels import nothing from ops/bench"


MATH_MODULES = sorted(PKG.joinpath("_math").rglob("*.py"))


@pytest.mark.parametrize("path", MATH_MODULES, ids=_module_name)
def test_shared_math_lies_below_ops_and_kernels(path):
    # NOTE [Kernels are leaves] in slimgrad._math: what ops and kernels share imports neither
    bad = _hits(
        imports_of(path),
        ("slimgrad.ops", "slimgrad.kernels", "slimgrad.bench", "slimgrad.convert", "slimgrad.nn"),
    )
    assert not bad, f"{_module_name(path)} imports {bad}; slimgrad._math lies below ops and kernels"


def test_memory_imports_nothing_from_ops():
    bad = _hits(imports_of(PKG / "memory.py"), ("slimgrad.ops",))
    assert not bad, f"slimgrad.memory imports {bad}"


def test_the_reader_sees_every_import_form(tmp_path):
    # the rule checks above cannot pass vacuously: each import form is found
    pkg = tmp_path / "slimgrad" / "kernels"
    pkg.mkdir(parents=True)
    f = pkg / "probe.py"
    f.write_text(
        "import importlib\n"
        "from slimgrad.ops import relu\n"
        "from ..bench import harness\n"
        "def g():\n"
        "    import slimgrad.convert\n"
        "    return importlib.import_module('slimgrad.ops.gelu')\n"
    )
    global SRC
    old, SRC = SRC, tmp_path
    try:
        names = imports_of(f)
    finally:
        SRC = old
    assert _hits(names, ("slimgrad.ops", "slimgrad.bench", "slimgrad.convert")) == [
        "slimgrad.bench",
        "slimgrad.bench.harness",
        "slimgrad.convert",
        "slimgrad.ops",
        "slimgrad.ops.gelu",
        "slimgrad.ops.relu",
    ]
