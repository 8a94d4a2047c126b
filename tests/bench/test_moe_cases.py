"""The MoE bench cases (hf_mixtral, hf_qwen3_moe, their _autocast and _grouped_mm variants) and
benchmarks/moe_cases.py, which runs them with fewer layers and process-CPU step times."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from slimgrad.bench.harness import get_case

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_cases.py"


def _script():
    spec = importlib.util.spec_from_file_location("moe_cases", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "fam, n_params", [("mixtral", 304_048_896), ("qwen3_moe", 304_050_432)], ids=str
)
@pytest.mark.parametrize("experts", ["eager", None], ids=["eager", "default"])
def test_moe_case_full_shape(fam, n_params, experts):
    # the shape class (12 x 768, vocab 32000, 4x256 tokens) with 8 experts of 1024, top-2;
    # None resolves to transformers' default, grouped_mm (built on meta: no compute)
    from slimgrad.bench.cases.models import eager_hf_moe

    with torch.device("meta"):
        model, make_inputs = eager_hf_moe(fam, "meta", torch.float32, experts=experts)
    cfg = model.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (12, 768, 32000)
    assert cfg.num_experts_per_tok == 2 and cfg.output_router_logits
    assert cfg._experts_implementation == (experts or "grouped_mm")
    bank = model.model.model.layers[0].mlp.experts
    assert tuple(bank.gate_up_proj.shape) == (8, 2 * 1024, 768)
    assert sum(p.numel() for p in model.parameters()) == n_params
    assert [tuple(x.shape) for x in make_inputs()] == [(4, 256)] * 3
    with torch.device("meta"):
        short, _ = eager_hf_moe(fam, "meta", torch.float32, layers=3)
    assert len(short.model.model.layers) == 3


@pytest.mark.parametrize("fam", ["mixtral", "qwen3_moe"])
def test_grouped_mm_case_leaves_the_banks_and_says_why(fam):
    import slimgrad
    from slimgrad.convert_handlers.hf_moe import GatedExperts
    from slimgrad.nn.rms_norm import HFRMSNorm

    eager, slim, make_inputs = get_case(f"hf_{fam}_grouped_mm").build(
        "cpu", torch.float32, small=True
    )
    assert eager.model.config._experts_implementation == "grouped_mm"
    assert not any(isinstance(m, GatedExperts) for m in slim.modules())
    assert any(isinstance(m, HFRMSNorm) for m in slim.modules())  # the rest converts
    skipped = [r for _, t, r in slimgrad.report(slim).skipped if t.endswith("Experts")]
    assert len(skipped) == 2 and all("'grouped_mm'" in r for r in skipped), skipped
    loss = slim(*make_inputs())
    assert loss.dtype == torch.float32 and loss.requires_grad


def test_autocast_case_runs_the_eager_loop_under_autocast():
    from slimgrad.convert_handlers.hf_moe import GatedExperts

    eager, slim, _ = get_case("hf_mixtral_autocast").build("cpu", torch.float32, small=True)
    assert type(eager).__name__ == "Autocast" and eager.dtype == torch.bfloat16
    assert eager.model.model.config._experts_implementation == "eager"
    assert any(isinstance(m, GatedExperts) for m in slim.modules())


def test_script_record(tmp_path):
    # one small run with --layers: run_case's record plus the shape run, process-CPU times of the
    # same timed steps, and what convert_ did to the banks
    _script().main(
        ["hf_qwen3_moe", "--small", "--layers", "1", "--repeat", "2", "--out", str(tmp_path)]
    )
    (line,) = (tmp_path / "hf_qwen3_moe.jsonl").read_text().splitlines()
    rec = json.loads(line)
    assert rec["case"] == "hf_qwen3_moe" and rec["grad"]["ok"], rec["grad"]
    assert rec["model"]["layers"] == 1 and rec["model"]["experts_implementation"] == "eager"
    assert rec["slimgrad"]["saved_bytes"] < rec["eager"]["saved_bytes"]
    assert len(rec["cpu_ms_all"]["eager"]) == len(rec["cpu_ms_all"]["slimgrad"]) == 2
    assert rec["cpu_time_ratio_min"] <= rec["cpu_time_ratio"] <= rec["cpu_time_ratio_max"]
    assert rec["experts"]["slimgrad"] == ["GatedExperts"] and rec["experts"]["skipped_count"] == 0
    assert rec["convert"]["converted"]["Qwen3MoeExperts -> GatedExperts"] == 1


@pytest.mark.parametrize("fam", ["mixtral", "qwen3_moe"])
def test_moe_block_case(fam):
    # one sparse-MoE block of the model (router + the eager expert loop) on hidden states that
    # require grad; converted on the slimgrad side only, gradients within the rule under autocast
    from slimgrad.bench.harness import run_case
    from slimgrad.convert_handlers.hf_moe import GatedExperts

    eager, slim, make_inputs = get_case(f"hf_{fam}_moe_block_autocast").build(
        "cpu", torch.float32, small=True
    )
    assert type(eager).__name__ == "Autocast" and eager.dtype == torch.bfloat16
    assert type(eager.model).__name__.endswith("SparseMoeBlock")
    assert eager.model.experts.config._experts_implementation == "eager"
    assert any(isinstance(m, GatedExperts) for m in slim.modules())
    assert not any(isinstance(m, GatedExperts) for m in eager.modules())
    x = make_inputs()
    assert x.shape == (2, 16, 32) and x.requires_grad
    rec = run_case(f"hf_{fam}_moe_block", small=True, repeat=1, out_dir=None)
    assert rec["grad"]["ok"] and "input0" not in rec["grad"]["unmatched"], rec["grad"]
    assert rec["slimgrad"]["saved_bytes"] < rec["eager"]["saved_bytes"]


def test_grouped_mm_case_skips_the_float64_check():
    # torch._grouped_mm has no float64 kernel: the float64 reference of the gradient check fails
    assert get_case("hf_mixtral_grouped_mm").grad_check is False
    assert get_case("hf_mixtral").grad_check is True
