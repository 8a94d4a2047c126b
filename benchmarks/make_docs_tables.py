"""Generates the pages of docs/ that must follow the repository, and the README's headline table.

- ``docs/benchmarks.md``: tables from ``benchmarks/results/*.jsonl`` (the latest record of each
  case, device, dtype and size; every row says device, dtype, shapes and commit).
- ``docs/design-notes.md``: an index of the ``NOTE [Title]`` blocks in ``src/`` (the file each is
  written in, its first sentence).
- README.md: the headline table (between ``<!-- headline:begin -->`` and ``<!-- headline:end -->``)
  from ``benchmarks/results/default_configs.jsonl`` (``benchmarks/default_configs.py``), and the
  step-time limits (``<!-- limits:... -->``) from the GPU checks and the whole-model CPU records.

    python benchmarks/make_docs_tables.py           # rewrite the three
    python benchmarks/make_docs_tables.py --check   # exit 1 when one is out of date

``tests/test_docs.py`` runs the check. Pure Python: reads files, imports nothing from slimgrad.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MiB = 2**20
MARKERS = {
    "headline": ("<!-- headline:begin -->", "<!-- headline:end -->"),
    "limits": ("<!-- limits:begin -->", "<!-- limits:end -->"),
}

# Headline rows: {profile target[/dtype]: what the model is}. The targets are slimgrad.targets'
# named HF models, built from their config class's defaults (Llama at 12 x 768).
HEADLINE = {
    "gpt2": "HF GPT-2 small, `GPT2Config()` (dropout 0.1, its default)",
    "llama": "HF Llama 12 x 768, vocab 32000 (no attention dropout, its default)",
    "llama/bfloat16": "the same Llama in bf16 weights (`--dtype bfloat16`)",
    "bert": "HF BERT-base MLM, `BertConfig()` (dropout 0.1), 15% labelled",
    "vit": "HF ViT-base/16, `ViTConfig()`, 1000 classes",
    "resnet": "HF ResNet-50, `ResNetConfig()`, 1000 classes",
}


def _records(name: str) -> list[dict]:
    path = RESULTS / f"{name}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mib(b: float | None) -> str:
    return "-" if b is None else f"{b / MiB:,.1f}"


def _kib(b: float | None) -> str:
    return "-" if b is None else f"{b / 1024:,.1f}"


def _x(r: float | None, digits: int = 3) -> str:
    return "-" if r is None else f"{r:.{digits}f}"


def _commit(rec: dict) -> str:
    c = rec.get("commit") or "-"
    dirty = "+dirty" if c.endswith("+dirty") else ""
    return c.removesuffix("+dirty")[:7] + dirty


def _date(rec: dict) -> str:
    for k in ("time_utc", "time", "date_utc", "date"):
        if rec.get(k):
            return str(rec[k])[:10]
    return "-"


def _ver(rec: dict, key: str) -> str:
    v = rec.get("versions") or {}
    return str(v.get(key) or rec.get(key) or "-")


def _machine(rec: dict) -> str:
    return f"{rec.get('device', '-')}, {rec.get('torch', '-')}, {rec.get('threads', '-')} thr."


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return out


# ----------------------------------------------------------------------------- headline


def headline_rows() -> list[list[str]]:
    latest: dict[str, dict] = {}
    for rec in _records("default_configs"):
        latest[rec["case"].removeprefix("default_config/")] = rec
    rows = []
    for target, what in HEADLINE.items():
        rec = latest.get(target)
        if rec is None:
            continue
        p = rec["profile"]
        e, s = p["eager"], p["slimgrad"]
        text = target.split("/")[0] in ("gpt2", "llama", "bert")
        verify = (rec.get("verify") or "").removeprefix("verify: ").split(";")[0] or "not run"
        if rec.get("verify"):  # where it ran: the measured step's shape, or a smaller one
            shape = rec.get("verify_shape", "as measured")
            verify += " (this batch)" if shape == "as measured" else f" (at {shape})"
        rows.append(
            [
                what,
                f"{p['batch']}" + (" x 256 tokens" if text else " x 3 x 224²"),
                f"{_mib(e['peak_bytes'])} -> **{_mib(s['peak_bytes'])}**",
                f"**{s['peak_bytes'] / e['peak_bytes']:.2f}x**",
                f"{_mib(e['saved_bytes'])} -> {_mib(s['saved_bytes'])}",
                verify,
            ]
        )
    return rows


def headline() -> str:
    recs = _records("default_configs")
    if not recs:
        return "(no records in benchmarks/results/default_configs.jsonl)"
    last = recs[-1]
    rows = headline_rows()
    lines = _table(
        ["model (random init)", "batch", "peak MiB, eager -> slimgrad", "peak", "saved MiB"]
        + ["verify"],
        rows,
    )
    latest = {r["case"]: r for r in recs}.values()
    commits = sorted({_commit(r) for r in latest})
    lines.append("")
    lines.append(
        "One training step of a random-init model measured on CPU by `slimgrad profile TARGET` "
        "(exact byte counts from `slimgrad.memory`; parameters and their gradients count on both "
        "sides), in float32 unless the row says bf16 (weights and float inputs in bfloat16), "
        f"torch {_ver(last, 'torch')}, transformers {_ver(last, 'transformers')}, commit "
        f"{', '.join(commits)}, {_date(last)}. verify: `slimgrad profile TARGET --verify` on the "
        "same model, config and dtype passed (loss and every gradient within the error rule "
        "against float64, train and eval, padded and unpadded batches), at the measured batch or, "
        "where a float64 step of the full batch takes too long on a 2-core CPU, at the smaller "
        "batch the cell names. Records: `benchmarks/results/default_configs.jsonl` "
        "(`benchmarks/default_configs.py`); more in [docs/benchmarks.md](docs/benchmarks.md)."
    )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- benchmarks page


def _harness_key(rec: dict) -> tuple:
    return (rec.get("case"), rec.get("device"), rec.get("dtype"), bool(rec.get("small")))


def _is_harness(rec: dict) -> bool:
    return (
        "case" in rec
        and all(isinstance(rec.get(k), dict) for k in ("eager", "slimgrad"))
        and "peak_bytes" in rec["eager"]
        and "peak_bytes" in rec["slimgrad"]
    )


def _time_cell(rec: dict) -> str:
    if rec.get("estimated"):
        return "estimate: not timed"
    t = rec.get("time_ratio")
    if t is None:
        return "-"
    n = rec.get("repeat")
    spread = ""
    if rec.get("time_ratio_min") is not None and rec.get("time_ratio_max") is not None:
        spread = f" ({rec['time_ratio_min']:.2f}..{rec['time_ratio_max']:.2f}"
        spread += f", {n} pairs)" if n else ")"
    cpu = rec.get("cpu_time_ratio")
    extra = f"; process CPU {cpu:.2f}" if cpu is not None else ""
    return f"{t:.2f}{spread}{extra}"


def _grad_cell(rec: dict) -> str:
    g = rec.get("grad")
    if isinstance(g, dict):
        ok = g.get("ok", g.get("within_rule"))
        return "-" if ok is None else ("within rule" if ok else "**outside rule**")
    return "-"


def harness_section(recs: list[dict]) -> list[str]:
    latest: dict[tuple, dict] = {}
    counts: Counter = Counter()
    for rec in recs:
        if _is_harness(rec) and not rec.get("small"):
            latest[_harness_key(rec)] = rec
            counts[_harness_key(rec)] += 1
    out: list[str] = []
    for device in ("cpu", "cuda"):
        rows = []
        for key in sorted(k for k in latest if k[1] == device):
            rec = latest[key]
            e, s = rec["eager"], rec["slimgrad"]
            shapes = rec.get("shapes")
            shape = " ".join("x".join(map(str, sh)) for sh in shapes) if shapes else "-"
            rows.append(
                [
                    f"`{rec['case']}`" + (" (estimate)" if rec.get("estimated") else ""),
                    rec.get("dtype", "-"),
                    shape,
                    f"{_mib(e['peak_bytes'])} -> {_mib(s['peak_bytes'])}",
                    _x(s["peak_bytes"] / e["peak_bytes"]),
                    f"{_mib(e.get('saved_bytes'))} -> {_mib(s.get('saved_bytes'))}",
                    _time_cell(rec),
                    _grad_cell(rec),
                    f"{rec.get('device_name', '-')}, {_ver(rec, 'torch')}, "
                    f"{_ver(rec, 'torch_threads')} thr.",
                    f"{_commit(rec)} {_date(rec)} ({counts[key]})",
                ]
            )
        if not rows:
            continue
        out += [f"### {device.upper()}", ""]
        out += _table(
            [
                "case",
                "dtype",
                "input shapes",
                "peak MiB eager -> slimgrad",
                "peak ratio",
                "saved MiB",
                "step time ratio (min..max)",
                "gradients",
                "machine",
                "commit, date (records)",
            ],
            rows,
        )
        out.append("")
    return out


def _gpu_e2e() -> dict[str, dict]:
    latest: dict[str, dict] = {}
    for rec in _records("gpu_check"):
        if str(rec.get("step", "")).startswith("e2e:") and not rec.get("small"):
            latest[rec["step"].removeprefix("e2e:")] = rec
    return latest


def _cpu_models() -> dict[tuple, dict]:
    """The latest measured (not estimated) full-size CPU record of each whole-model case."""
    latest: dict[tuple, dict] = {}
    for path in sorted(RESULTS.glob("*.jsonl")):
        for rec in _records(path.stem):
            case = str(rec.get("case", ""))
            whole = case.startswith(("hf_", "timm_", "gpt2", "resnet50"))
            whole = whole and "moe_block" not in case
            if (
                whole
                and _is_harness(rec)
                and rec.get("device") == "cpu"
                and not rec.get("small")
                and not rec.get("estimated")
                and rec.get("time_ratio") is not None
            ):
                latest[_harness_key(rec)] = rec
    return latest


def limits() -> str:
    """The README's step-time limits, from the records."""
    gpu = _gpu_e2e()
    cpu = _cpu_models()
    out = []
    if gpu:
        t = [r["time_ratio"] for r in gpu.values()]
        p = [r["peak_ratio"] for r in gpu.values()]
        any_rec = next(iter(gpu.values()))
        each = ", ".join(f"`{k}` {r['time_ratio']:.2f}x" for k, r in gpu.items())
        out.append(
            f"- **GPU step time.** On one {any_rec.get('device_name', 'GPU')} (float32, torch "
            f"{_ver(any_rec, 'torch')}) converted models take **{min(t):.1f}-{max(t):.1f}x "
            f"eager's step time** ({each}), at {min(p):.2f}-{max(p):.2f}x eager's peak with every "
            f"gradient within the rule (`benchmarks/results/gpu_check.jsonl`, {_date(any_rec)}). "
            "The cost is host-side Python per op on launch-bound models; until it is fixed, on a "
            "GPU slimgrad buys memory with time."
        )
    if cpu:
        t = sorted(r["time_ratio"] for r in cpu.values())
        out.append(
            f"- **CPU step time** of the {len(t)} whole-model bench records (HF, timm, ResNet-50, "
            f"full size): median ratios {t[0]:.2f}-{t[-1]:.2f}x eager's, middle one "
            f"{t[len(t) // 2]:.2f}x. Layer-level cases that recompute in backward cost more "
            "(reversible chains, a BatchNorm chain); tiny models pay Python per op."
        )
    return "\n".join(out)


def gpu_check_section() -> list[str]:
    rows = []
    for rec in _gpu_e2e().values():
        ms = rec.get("step_ms") or {}
        rows.append(
            [
                f"`{rec['step'].removeprefix('e2e:')}`",
                _x(rec.get("peak_ratio")),
                f"{ms.get('eager', 0):.1f} -> {ms.get('slimgrad', 0):.1f}",
                f"{rec['time_ratio']:.2f} "
                f"({rec['time_ratio_min']:.2f}..{rec['time_ratio_max']:.2f})",
                "within rule" if rec.get("grad_ok") else "**outside rule**",
                rec.get("device_name", "-"),
                f"{_commit(rec)} {_date(rec)}",
            ]
        )
    if not rows:
        return []
    return [
        "### GPU end-to-end checks (`python -m slimgrad.bench.gpu_check`)",
        "",
        "float32, full-size cases, interleaved pairs; `benchmarks/results/gpu_check.jsonl`.",
        "",
        *_table(
            [
                "case",
                "peak ratio",
                "step ms eager -> slimgrad",
                "step time ratio (min..max)",
                "gradients",
                "device",
                "commit, date",
            ],
            rows,
        ),
        "",
    ]


def checkpointing_section() -> list[str]:
    latest: dict[tuple, dict] = {}
    for rec in _records("checkpointing"):
        latest[(rec["case"], rec["setting"])] = rec
    rows = [
        [
            f"`{rec['case']}`",
            rec.get("shapes", "-"),
            setting,
            _mib(rec.get("peak_bytes")),
            f"{_commit(rec)} {_date(rec)}",
        ]
        for (case, setting), rec in sorted(latest.items())
    ]
    if not rows:
        return []
    return [
        "### Activation checkpointing (`benchmarks/checkpointing.py`)",
        "",
        "Peak of one step, exact tracker, CPU float32, every layer/block checkpointed.",
        "",
        *_table(["case", "shapes", "setting", "peak MiB", "commit, date"], rows),
        "",
    ]


def host_floor_section() -> list[str]:
    recs = [r for r in _records("host_floor") if not r.get("small")]
    if not recs:
        return []
    rec = recs[-1]
    rows = []
    for m in rec["models"]:
        scale = m.get("memory_at_scale") or {}
        e_calls = m["variants"]["eager"]["python_calls"]
        for v, x in m["variants"].items():
            mem = scale.get(v) or {}
            each = [
                f"{o['variants'][v]['time_ratio']:.3f}"
                for r in recs
                for o in r["models"]
                if o["model"] == m["model"] and v in o["variants"]
            ]
            rows.append(
                [
                    f"`{m['model']}`",
                    v,
                    " / ".join(each),
                    f"{x['time_ratio_q1']:.3f}..{x['time_ratio_q3']:.3f}",
                    f"{x['python_calls']:,} ({x['python_calls'] / e_calls:.2f}x)",
                    _mib(mem.get("peak_bytes")),
                    _mib(mem.get("retained_bytes")),
                ]
            )
    sizes = "; ".join(
        f"{m['model']}: {m['memory_at_scale']['size']}"
        for m in rec["models"]
        if m.get("memory_at_scale")
    )
    loads = [x for r in recs for m in r["models"] for x in m["load"]]
    return [
        "### Host floor (`slimgrad bench host_floor`)",
        "",
        "NOTE [Host floor]: the host-overhead proxy's tiny models (1 thread, CPU time, "
        f"{rec['models'][0]['rounds']} interleaved rounds, median ratio to eager with the middle "
        f"half; load average {min(loads):.1f}..{max(loads):.1f}), Python calls per step, and the "
        f"exact peak and retained bytes at a realistic size ({sizes}). `floor`: one minimal "
        "autograd Function per op slimgrad converts (`floor_direct`: applied without "
        "`Function.apply`'s Python wrapper, as slimgrad's ops are); `*_ckpt`: per-block "
        "checkpointing; `slimgrad, K at floor*`: kind K at that floor, the rest converted. "
        "Latest record "
        f"{_commit(rec)} {_date(rec)}; the time ratio of each of the {len(recs)} full records, "
        "oldest first.",
        "",
        *_table(
            [
                "model",
                "variant",
                "time ratio (each record)",
                "middle half (latest)",
                "Python calls",
                "peak MiB",
                "retained MiB",
            ],
            rows,
        ),
        "",
    ]


def compile_section() -> list[str]:
    latest: dict[tuple, dict] = {}
    for rec in _records("compile_step"):
        latest[(rec["case"], rec["provider"])] = rec
    rows = []
    for (case, provider), rec in sorted(latest.items()):
        sh = rec.get("shapes") or {}
        rows.append(
            [
                f"`{case}`",
                provider,
                ", ".join(f"{k} {v}" for k, v in sh.items()),
                str(rec.get("graph_breaks", "-")),
                _mib(rec.get("peak_bytes")),
                _kib(rec.get("kept_bytes")),
                _kib(rec.get("kept_bytes_uncompiled")),
                f"{rec['step_ms_median']:.1f}",
                _x(rec.get("ratio_median"), 2),
                _machine(rec),
                _date(rec),
            ]
        )
    if not rows:
        return []
    return [
        "### torch.compile (`benchmarks/compile_step.py`)",
        "",
        "Compiled training step (inductor), eager compiled vs converted compiled, float32, dropout "
        "on; peak from torch's CPU allocator counters; kept after forward: the storages the "
        "autograd graph holds (parameters excluded), compiled and the same model uncompiled; "
        "median step time of interleaved pairs.",
        "",
        *_table(
            [
                "case",
                "side",
                "shapes",
                "graph breaks",
                "peak MiB",
                "kept KiB",
                "kept uncompiled KiB",
                "step ms",
                "ratio",
                "machine",
                "date",
            ],
            rows,
        ),
        "",
    ]


def step_in_backward_section() -> list[str]:
    rows = []
    for rec in _records("step_in_backward"):
        if rec.get("case") != "step_in_backward/time":
            continue
        rows.append(
            [
                rec.get("model", "-"),
                rec.get("optimizer", "-"),
                "x".join(map(str, rec.get("batch_seq", []))),
                f"{rec['ratio_median']:.2f} ({rec['ratio_min']:.2f}..{rec['ratio_max']:.2f}, "
                f"{rec.get('repeat')} pairs)",
                "yes" if rec.get("params_bit_identical") else "**no**",
                _machine(rec),
                _commit(rec),
            ]
        )
    peaks = []
    for rec in _records("step_in_backward"):
        if "peak_bytes" in rec and "side" in rec and "optimizer" in rec:
            peaks.append(
                [
                    f"`{rec['case']}`",
                    rec["side"],
                    rec["optimizer"],
                    _mib(rec["peak_bytes"]),
                    _x(rec.get("ratio_to_eager_plain")),
                    "estimate" if rec.get("estimated") else "measured",
                    _commit(rec),
                ]
            )
    out = ["### `step_in_backward` (`benchmarks/step_in_backward.py`)", ""]
    if peaks:
        out += [
            "Peak of one whole step (optimizer state warmed up on every side); ratio to the eager "
            "model's plain loop.",
            "",
            *_table(
                ["case", "side", "optimizer", "peak MiB", "ratio", "how", "commit"],
                peaks,
            ),
            "",
        ]
    if rows:
        out += [
            "Step time, `step_in_backward` over the plain loop:",
            "",
            *_table(
                [
                    "model",
                    "optimizer",
                    "batch x seq",
                    "ratio (min..max)",
                    "parameters bit-identical",
                    "machine",
                    "commit",
                ],
                rows,
            ),
            "",
        ]
    return out if len(out) > 2 else []


def kernels_section() -> list[str]:
    latest: dict[tuple, dict] = {}
    for rec in _records("kernels"):
        latest[(rec["case"], rec.get("dtype"), rec.get("device_name"))] = rec
    rows = [
        [
            f"`{rec['case']}`",
            f"{rec.get('numel', 0):,}",
            rec.get("dtype", "-"),
            _x(rec.get("fwd_fraction_of_copy"), 2),
            _x(rec.get("bwd_fraction_of_copy"), 2),
            _x(rec.get("triton_over_eager"), 2),
            rec.get("device_name", "-"),
            _commit(rec),
        ]
        for _, rec in sorted(latest.items())
    ]
    if not rows:
        return []
    return [
        "### Triton kernels (`python -m slimgrad.bench.kernels`)",
        "",
        "Forward and backward bandwidth as a fraction of a device copy's; Triton fwd+bwd time over "
        "eager's (below 1: faster).",
        "",
        *_table(
            [
                "kernel",
                "elements",
                "dtype",
                "fwd / copy",
                "bwd / copy",
                "fwd+bwd vs eager",
                "device",
                "commit",
            ],
            rows,
        ),
        "",
    ]


def benchmarks_page() -> str:
    files = sorted(p.stem for p in RESULTS.glob("*.jsonl"))
    harness_recs = []
    for name in files:
        harness_recs += [r for r in _records(name) if _is_harness(r)]
    out = [
        "# Benchmarks",
        "",
        "<!-- generated by benchmarks/make_docs_tables.py from benchmarks/results/*.jsonl; "
        "do not edit by hand -->",
        "",
        "Every number on this page comes from a committed record in `benchmarks/results/`. Bytes "
        "are exact counts from `slimgrad.memory` (MiB = 2^20 B); `(estimate)` rows were "
        "measured under fake tensors (`slimgrad.memory.estimate`: saved bytes equal the tracker's "
        "on a real step, peaks read a few percent high). Step time ratios are slimgrad over "
        "eager, the median of interleaved pairs with min..max; on a shared 2-core CPU box they "
        "drift from run to run (see [performance notes](performance.md)). Gradients: every "
        "parameter's gradient against a float64 copy by the error rule (dropout off for that "
        "check); `-` where that run did not check them.",
        "",
        "## Headline: default configurations",
        "",
        headline().replace("[docs/benchmarks.md](docs/benchmarks.md)", "this page"),
        "",
        "## Bench cases (`slimgrad bench CASE`)",
        "",
        "The latest full-size record of each case, device and dtype; in brackets the number of "
        "records of that key in the file (older ones stay as history). What each case builds: "
        "`slimgrad bench --list`. The HF decoder cases (`hf_llama`, `hf_mistral`, ...) run "
        "attention dropout 0.1 and every other row left-padded by 32; the headline above is at "
        "the families' defaults. MoE cases (`hf_mixtral*`, `hf_qwen3_moe*`) ran 2 decoder layers "
        "(`benchmarks/moe_cases.py`).",
        "",
        *harness_section(harness_recs),
        *gpu_check_section(),
        *checkpointing_section(),
        *host_floor_section(),
        *compile_section(),
        *step_in_backward_section(),
        *kernels_section(),
        "## Record files",
        "",
        *_table(
            ["file", "records"],
            [[f"`{n}.jsonl`", str(len(_records(n)))] for n in files],
        ),
        "",
        "The version matrix (`version_matrix.jsonl`) is on the [compatibility](compatibility.md) "
        "page.",
        "",
    ]
    return "\n".join(out)


# ----------------------------------------------------------------------------- design notes

_DEF = re.compile(r"^\s*(?:#|//)?\s*NOTE \[([^\]]+)\](:?)(.*)$")
_CITE = re.compile(r"NOTE \[([^\]]+)\]")


def _block(lines: list[str], start: int, inline: str) -> str:
    """The text of the block that starts at ``lines[start]``: its comment lines when a comment
    follows the header, else (in a docstring) its paragraph."""
    after = lines[start + 1].strip() if start + 1 < len(lines) else ""
    comment = after.startswith(("#", "//"))
    in_docstring = sum(line.count('"""') for line in lines[:start]) % 2 == 1
    if not comment and not in_docstring and lines[start].strip().startswith(("#", "//")):
        return ""  # a header over code, not over prose: a marker, not the block
    text = [inline.strip()] if inline.strip() else []
    for line in lines[start + 1 : start + 40]:
        s = line.strip()
        if comment and not s.startswith(("#", "//")):
            break
        s = s.lstrip("#/ ").strip()
        if not s or _DEF.match(s) or s.startswith(('"""', "'" * 3)):
            break
        text.append(s)
    return " ".join(text)


def _first_sentence(text: str) -> str:
    m = re.search(r"(.+?[a-z0-9)`]\.)(\s|$)", text)
    first = m.group(1) if m else text
    if len(first) > 220:
        first = first[:217].rsplit(" ", 1)[0] + " ..."
    return first.replace("|", "\\|") or "(see the source)"


def notes() -> tuple[dict[str, tuple[str, int, str]], Counter]:
    """{title: (path, line, first sentence)} of every NOTE block in src/, and citation counts.

    A block is a line that holds only ``# NOTE [Title]`` (or the same inside a docstring),
    followed by its text, or ``# NOTE [Title]: text``; ``NOTE [Title] in file.py`` and other
    mentions are citations. Where a title heads several blocks, the longest one is listed."""
    headers: dict[str, list[tuple[tuple[int, int], str, int, str]]] = {}
    cites: Counter = Counter()
    for path in sorted((ROOT / "src").rglob("*")):
        if path.suffix not in (".py", ".c", ".cpp", ".h"):
            continue
        rel = path.relative_to(ROOT).as_posix()
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            for m in _CITE.finditer(line):
                cites[m.group(1)] += 1
            m = _DEF.match(line)
            if not m or not line.strip().startswith(("#", "//", "NOTE")):
                continue
            title, colon, rest = m.groups()
            if rest.strip() and not colon:  # "NOTE [X] in file.py": a citation
                continue
            text = _block(lines, i, rest)
            # a header on a line of its own ranks above an inline "NOTE [X]: ..." one
            rank = (0 if rest.strip() else 1, len(text))
            headers.setdefault(title, []).append((rank, rel, i + 1, text))
    found = {}
    for title, cands in headers.items():
        _, rel, line, text = max(cands, key=lambda c: c[0])
        found[title] = (rel, line, _first_sentence(text))
    return found, cites


def notes_page() -> str:
    found, cites = notes()
    # no line numbers or citation counts: the page changes when a block is added, moved to
    # another file or reworded, not on every edit above one
    rows = [
        [title, f"`{path}`", summary]
        for title, (path, _, summary) in sorted(found.items(), key=lambda kv: kv[0].lower())
    ]
    missing = sorted(t for t in cites if t not in found)
    out = [
        "# Design notes",
        "",
        "<!-- generated by benchmarks/make_docs_tables.py from the NOTE blocks in src/; "
        "do not edit by hand -->",
        "",
        "Reasoning that several files rely on is written once, in a `# NOTE [Title]` block next to "
        "the code it explains, and other places cite the title (CONTRIBUTING.md). This index lists "
        f"every block in `src/` ({len(rows)}): the file it is written in and its first sentence. "
        "Read the block itself in the source (search for `NOTE [Title]`).",
        "",
        *_table(["note", "written in", "first sentence"], rows),
        "",
    ]
    if missing:
        out += [
            "Cited but written nowhere as a block (a docstring or prose describes it): "
            + ", ".join(f"[{t}]" for t in missing)
            + ".",
            "",
        ]
    return "\n".join(out)


# ----------------------------------------------------------------------------- main


def readme_generated(readme: str) -> str:
    for name, make in (("headline", headline), ("limits", limits)):
        begin, end = MARKERS[name]
        if begin not in readme or end not in readme:
            raise SystemExit(f"README.md: the markers {begin} / {end} are missing")
        head, rest = readme.split(begin, 1)
        _, tail = rest.split(end, 1)
        readme = f"{head}{begin}\n{make()}\n{end}{tail}"
    return readme


def outputs() -> dict[Path, str]:
    readme = (ROOT / "README.md").read_text()
    return {
        ROOT / "docs" / "benchmarks.md": benchmarks_page(),
        ROOT / "docs" / "design-notes.md": notes_page(),
        ROOT / "README.md": readme_generated(readme),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a generated file is stale")
    args = ap.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        old = path.read_text() if path.exists() else None
        if old == text:
            continue
        stale.append(path.relative_to(ROOT).as_posix())
        if not args.check:
            path.write_text(text)
    if args.check and stale:
        print("out of date: " + ", ".join(stale) + "; run python benchmarks/make_docs_tables.py")
        return 1
    print(("rewrote: " + ", ".join(stale)) if stale else "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
