"""The host_overhead bench case (NOTE [Host overhead proxy] in bench/cases/host_overhead.py)."""

from __future__ import annotations

import json

import pytest
import torch

from slimgrad.bench import harness
from slimgrad.bench.cases import host_overhead
from slimgrad.cli import format_record

pytest.importorskip("transformers")


def test_small_run_record_and_table(tmp_path):
    rec = harness.run_case("host_overhead", small=True, out_dir=tmp_path)
    assert [r["model"] for r in rec["models"]] == list(host_overhead.MODELS)
    for r in rec["models"]:
        for side in ("eager", "slimgrad"):
            assert r[side]["python_calls"] > 0 and r[side]["aten_ops"] > 0
            assert r[side]["step_ms"] > 0
        assert r["time_ratio_min"] <= r["time_ratio"] <= r["time_ratio_max"]
        assert r["python_calls_ratio"] == r["slimgrad"]["python_calls"] / r["eager"]["python_calls"]
    scale = rec["aten_ops_at_scale"]
    assert scale["ratio"] == scale["slimgrad"] / scale["eager"]
    line = json.loads((tmp_path / "host_overhead.jsonl").read_text().splitlines()[-1])
    assert line["models"] == rec["models"] and "table" not in line
    text = format_record(rec)
    assert "hf_llama" in text and "targets (issue 32)" in text and "record appended" in text
    assert torch.get_num_threads() >= 1  # the runner restored the thread count


def test_counts_are_deterministic_and_see_every_op():
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)

    def loss_fn(m):
        return m(x).sum()

    first = host_overhead._ops(lin, loss_fn)
    assert first == host_overhead._ops(lin, loss_fn)
    # one more op in the forward is one more counted op (plus its backward's)
    assert host_overhead._ops(lin, lambda m: (m(x) * 2).sum()) > first
    assert host_overhead._calls(lin, loss_fn) == host_overhead._calls(lin, loss_fn)


def test_refuses_other_devices_and_dtypes():
    with pytest.raises(ValueError, match="runs on CPU in float32"):
        host_overhead.run(dtype=torch.float64, small=True)
    with pytest.raises(ValueError, match="through its runner"):
        host_overhead._no_pair("cpu", torch.float32)
