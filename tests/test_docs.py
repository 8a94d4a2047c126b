"""The README and docs/ stay true: the quick start runs, generated pages match their sources,
links resolve, and the README stays a front page."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def _generator():
    spec = importlib.util.spec_from_file_location(
        "make_docs_tables", ROOT / "benchmarks" / "make_docs_tables.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to docs/"
    assert len(_python_blocks(README)) == 1, "one quick start; other code goes to docs/"


def test_readme_quick_start_runs_and_saves_memory(capsys):
    (code,) = _python_blocks(README)
    exec(compile(code, "README.md quick start", "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out
    saved = dict(re.findall(r"^(eager|slimgrad) saved ([0-9.]+) MiB", out, flags=re.M))
    assert set(saved) == {"eager", "slimgrad"}, out
    assert float(saved["slimgrad"]) < float(saved["eager"]), out


def test_getting_started_code_runs(capsys):
    pytest.importorskip("transformers")
    blocks = _python_blocks(ROOT / "docs" / "getting-started.md")
    assert blocks
    for i, code in enumerate(blocks):
        exec(compile(code, f"getting-started.md block {i}", "exec"), {"__name__": "__docs__"})
    assert "peak" in capsys.readouterr().out


def test_generated_pages_are_up_to_date():
    """docs/benchmarks.md, docs/design-notes.md and the README's generated blocks follow
    benchmarks/results/*.jsonl and the NOTE blocks in src/."""
    gen = _generator()
    stale = [
        p.relative_to(ROOT).as_posix()
        for p, text in gen.outputs().items()
        if not p.exists() or p.read_text() != text
    ]
    assert not stale, f"out of date: {stale}; run python benchmarks/make_docs_tables.py"


def test_design_notes_index_finds_every_block():
    gen = _generator()
    found, cites = gen.notes()
    assert len(found) >= 90  # the index is not silently empty
    for title, (path, line, _) in found.items():
        text = (ROOT / path).read_text().splitlines()[line - 1]
        assert f"NOTE [{title}]" in text


def test_readme_and_docs_links_resolve():
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    bad = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            if not (page.parent / target).exists():
                bad.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not bad, bad


def test_every_docs_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert [p for p in pages if f": {p}" not in nav] == []
