"""The timm bench cases (slimgrad/bench/cases/timm.py) at their small size, through the harness.

Skipped without timm (tests/conformance/_timm_shim.py imports it). One intra-op thread, as in the
timm conformance suite (its docstring says why).
"""

from __future__ import annotations

import json

import pytest
import torch

from slimgrad.bench.harness import get_case, run_case
from tests._threads import one_thread
from tests.conformance._timm_shim import timm

pytestmark = pytest.mark.skipif(timm is None, reason="timm (and torchvision) not installed")

SIX = (
    "resnet50",
    "efficientnet_b0",
    "vit_small_patch16_224",
    "regnety_016",
    "convnext_tiny",
    "mobilenetv3_large_100",
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def test_six_cases_are_registered_full_size():
    from slimgrad.bench.cases.timm import FULL_BATCH, FULL_SIZE, MODELS

    assert tuple(MODELS) == SIX
    assert (FULL_BATCH, FULL_SIZE) == (8, 224)
    for name in SIX:
        case = get_case(f"timm_{name}")
        assert case.requires == ("timm",)
        assert name in case.description and "8x3x224x224" in case.description


def test_full_size_inputs_without_building_the_model():
    from slimgrad.bench.cases.timm import eager_timm

    with torch.device("meta"):
        model, make_inputs = eager_timm("resnet50", "meta", torch.float32)
        x, y = make_inputs()
    assert tuple(x.shape) == (8, 3, 224, 224) and tuple(y.shape) == (8,)
    assert int(sum(p.numel() for p in model.parameters())) == 25_557_032  # timm's resnet50


@pytest.mark.parametrize("name", ["efficientnet_b0", "vit_small_patch16_224"])
def test_small_case_records_savings_and_gradients(name, tmp_path):
    rec = run_case(f"timm_{name}", small=True, repeat=1, warmup=0, out_dir=tmp_path)
    assert rec["grad"]["ok"], rec["grad"]
    from slimgrad.bench.cases.timm import eager_timm

    model, _ = eager_timm(name, "cpu", torch.float32, small=True)
    assert rec["grad"]["n_tensors"] == sum(p.requires_grad for p in model.parameters())
    assert not rec["grad"]["unmatched"]
    assert rec["saved_ratio"] < 1.0 and rec["peak_ratio"] <= 1.0, rec
    assert rec["small"] and rec["shapes"][0][:2] == [2, 3]
    lines = (tmp_path / f"timm_{name}.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["case"] == f"timm_{name}"
