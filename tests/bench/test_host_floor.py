"""The host_floor bench case (NOTE [Host floor] in bench/cases/host_floor.py)."""

from __future__ import annotations

import json

import pytest
import torch

from slimgrad.bench import harness, models
from slimgrad.bench.cases import host_floor
from slimgrad.cli import format_record

pytest.importorskip("transformers")

FIELDS = ("step_ms", "time_ratio", "time_ratio_q1", "time_ratio_q3", "python_calls", "aten_ops")


def test_small_run_record_and_fields(tmp_path):
    rec = harness.run_case("host_floor", small=True, out_dir=tmp_path)
    assert [r["model"] for r in rec["models"]] == list(host_floor.MODELS)
    for r in rec["models"]:
        v = r["variants"]
        assert set(host_floor.MAIN_VARIANTS) <= set(v)
        for x in v.values():
            assert all(k in x for k in FIELDS)
            assert x["python_calls"] > 0 and x["aten_ops"] > 0
            assert x["time_ratio_min"] <= x["time_ratio"] <= x["time_ratio_max"]
        assert v["eager"]["time_ratio"] == 1.0
        # one attribution variant per converted kind, and the differences are slimgrad's minus it
        kinds = r["above_floor"]["by_kind"]
        assert kinds and all(f"slimgrad, {k} at floor_direct" in v for k in kinds)
        for k, d in kinds.items():
            other = v[f"slimgrad, {k} at floor_direct"]["python_calls"]
            assert d["python_calls"] == v["slimgrad"]["python_calls"] - other
        assert r["floor_grad_err"] < 1e-4  # the pass-through Functions compute eager's gradients
        for side in host_floor.MAIN_VARIANTS:
            assert r["memory_tiny"][side]["peak_bytes"] > 0
    # the floor saves what eager saves (ResNet: the same ATen ops on both sides)
    resnet = rec["models"][-1]["memory_tiny"]
    assert resnet["floor"]["saved_bytes"] == resnet["eager"]["saved_bytes"]
    for r in rec["models"]:  # checkpointing keeps less than the same model without it
        mem = r["memory_tiny"]
        assert mem["eager_ckpt"]["saved_bytes"] < mem["eager"]["saved_bytes"]
        assert mem["floor_ckpt"]["saved_bytes"] < mem["floor"]["saved_bytes"]
    line = json.loads((tmp_path / "host_floor.jsonl").read_text().splitlines()[-1])
    assert line["models"] == rec["models"] and "table" not in line
    text = format_record(rec)
    assert "floor_ckpt" in text and "record appended" in text


def test_floor_replaces_what_slimgrad_converts():
    torch.manual_seed(0)
    net = models.resnet_small()
    plan = host_floor.converted(net)
    assert not plan["attention"] and not plan["loss"]
    assert set(plan["modules"].values()) == {"Conv2d", "BatchNorm2d", "ReLU", "Linear"}
    floor = host_floor.floor_(net, plan)
    for name, m in floor.named_modules():
        assert ("forward" in vars(m)) == (name in plan["modules"]), name


def _gradcheck(fn, *inputs):
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5)


def test_pass_through_functions_gradcheck():
    f64 = {"dtype": torch.float64, "requires_grad": True}
    x = torch.randn(2, 3, 5, **f64)
    w, b = torch.randn(4, 5, **f64), torch.randn(4, **f64)
    _gradcheck(host_floor._Linear.apply, x, w, b)
    _gradcheck(host_floor._Conv1D.apply, x, w.t().detach().requires_grad_(), b)
    g5, b5 = torch.randn(5, **f64), torch.randn(5, **f64)
    _gradcheck(lambda x, w, b: host_floor._LayerNorm.apply(x, w, b, [5], 1e-5), x, g5, b5)
    _gradcheck(lambda x, w: host_floor._RMSNorm.apply(x, w, 1e-6), x, g5)
    _gradcheck(host_floor._GELUTanh.apply, x)
    _gradcheck(host_floor._SiLU.apply, x)
    _gradcheck(lambda x: host_floor._ReLU.apply(x, False), x)
    img = torch.randn(2, 3, 5, 5, **f64)
    cw = torch.randn(4, 3, 3, 3, **f64)
    _gradcheck(
        lambda x, w, b: host_floor._Conv2d.apply(x, w, b, [1, 1], [1, 1], [1, 1], 1), img, cw, b
    )
    rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    g3, b3 = torch.randn(3, **f64), torch.randn(3, **f64)
    _gradcheck(lambda x, w, b: host_floor._BatchNorm.apply(x, w, b, rm, rv, 0.1, 1e-5), img, g3, b3)
    q, k, v = (torch.randn(1, 2, 4, 3, **f64) for _ in range(3))
    _gradcheck(
        lambda q, k, v: host_floor._MathAttention.apply(q, k, v, None, 0.0, True, 0.5), q, k, v
    )
    target = torch.tensor([1, -100, 3, 0])
    logits = torch.randn(4, 5, **f64)
    _gradcheck(lambda z: host_floor._CrossEntropy.apply(z, target, -100, 1), logits)


def test_attention_matches_sdpa():
    q = torch.randn(1, 4, 6, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, 6, 8, requires_grad=True) for _ in range(2))
    attn = torch.nn.Module()
    attn.num_key_value_groups = 2
    for dropout, kind in ((0.0, "flash"), (1e-9, "math")):  # math: dropout makes no difference
        out, _ = host_floor._floor_attention(attn, q, k, v, None, dropout=dropout, is_causal=True)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
        ).transpose(1, 2)
        torch.testing.assert_close(out, ref, msg=kind)
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), g)
        want = torch.autograd.grad(ref, (q, k, v), g)
        for a, e in zip(got, want, strict=True):
            torch.testing.assert_close(a, e, msg=kind)


def test_refuses_other_devices_and_dtypes_and_unknown_kinds():
    with pytest.raises(ValueError, match="runs on CPU in float32"):
        host_floor.run(dtype=torch.float64, small=True)
    with pytest.raises(ValueError, match="through its runner"):
        host_floor._no_pair("cpu", torch.float32)
    with pytest.raises(NotImplementedError, match="no pass-through floor"):
        host_floor._floor_forward(torch.nn.GELU())
