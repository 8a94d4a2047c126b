"""A converted model under DistributedDataParallel (2 gloo processes) equals plain DDP."""

import copy

import pytest
import torch
from torch import nn

import slimgrad
from tests.distributed._gloo import run_on_two_ranks, train_ddp

pytestmark = pytest.mark.distributed


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 5 * 5, 16),
        nn.LayerNorm(16),
        nn.GELU(),
        nn.Dropout(0.2),
        nn.Linear(16, 3),
    )


def _train(rank: int) -> dict:
    def batch(step: int) -> torch.Tensor:
        torch.manual_seed(100 + 10 * rank + step)  # different data per rank, same masks
        return torch.randn(4, 3, 5, 5)

    results = {}
    for kind in ("eager", "slimgrad"):
        net = _net()
        if kind == "slimgrad":
            net = slimgrad.convert_(copy.deepcopy(net))
        results[kind], results[kind + "_grad"] = train_ddp(net, batch, lambda y: y.square().mean())
    return results


def test_converted_ddp_matches_plain_ddp(tmp_path):
    r0, r1 = run_on_two_ranks(_train, tmp_path)
    for res in (r0, r1):
        for suffix in ("", "_grad"):
            torch.testing.assert_close(res["slimgrad" + suffix], res["eager" + suffix])
    for a, b in zip(r0["slimgrad"], r1["slimgrad"], strict=True):
        assert torch.equal(a, b)  # replicas stay in sync
