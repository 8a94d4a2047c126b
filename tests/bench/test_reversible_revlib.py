"""benchmarks/reversible_revlib.py: its hand-written RevNet (the step-time floor the records compare
against) computes plain autograd's gradients, and one tiny run yields a complete record."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import torch

from tests.nn._reversible_helpers import additive_blocks

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "reversible_revlib.py"


def _script():
    spec = importlib.util.spec_from_file_location("reversible_revlib", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_hand_written_revnet_equals_plain_autograd_float64():
    mod = _script()
    blocks = [b.double() for b in additive_blocks(3, 4, seed=2)]
    plain = torch.nn.Sequential(*copy.deepcopy(blocks))
    hand = mod._HandRev(copy.deepcopy(blocks))
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    r = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    got, want = [], []
    for model, out in ((hand, got), (plain, want)):
        xl = x.clone().requires_grad_()
        (model(xl) * r).sum().backward()
        out += [xl.grad, *[p.grad for p in model.parameters()]]
    torch.testing.assert_close(got, want)


def test_tiny_run_gives_a_complete_record(monkeypatch):
    mod = _script()
    from slimgrad.bench.cases import reversible as case

    build = case.build
    monkeypatch.setattr(mod.case, "build", lambda n, **kw: build(n, small=True, **kw))
    rec = mod.run(2, rounds=2)
    assert rec["n_blocks"] == 2 and rec["fg_over_plain"] > 0
    for name in ("plain", "slimgrad_float", "slimgrad_exact", "hand_written"):
        v = rec["variants"][name]
        assert v["wall_ms_median"] > 0 and v["cpu_min_ratio"] > 0
    assert rec["variants"]["plain"]["wall_median_ratio"] == 1.0
