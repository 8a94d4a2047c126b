"""ReversibleSequential under DistributedDataParallel (2 gloo processes) equals plain DDP."""

import pytest
import torch
from torch import nn

from slimgrad.nn.reversible import ReversibleSequential
from tests.distributed._gloo import run_on_two_ranks, train_ddp
from tests.nn._reversible_helpers import QuantisedPlain, additive_blocks

pytestmark = pytest.mark.distributed


def _net(kind: str) -> nn.Module:
    torch.manual_seed(0)
    stem = nn.Conv2d(3, 4, 3, padding=1)
    blocks = additive_blocks(3, 4, seed=1)
    body = {
        "rev_exact": lambda: ReversibleSequential(*blocks, exact=True),
        "plain_exact": lambda: QuantisedPlain(blocks),
        "rev_float": lambda: ReversibleSequential(*blocks),
        "plain_float": lambda: nn.Sequential(*blocks),
    }[kind]()
    return nn.Sequential(stem, nn.ReLU(), body, nn.Flatten(), nn.Linear(4 * 5 * 5, 2))


def _train(rank: int) -> dict:
    def batch(step: int) -> torch.Tensor:
        if step == 0:
            torch.manual_seed(100 + rank)  # different data per rank
        return torch.randn(2, 3, 5, 5)

    results = {}
    for kind in ("rev_exact", "plain_exact", "rev_float", "plain_float"):
        results[kind], results[kind + "_grad"] = train_ddp(
            _net(kind), batch, lambda y: y.square().sum()
        )
    return results


def test_ddp_matches_plain_ddp(tmp_path):
    r0, r1 = run_on_two_ranks(_train, tmp_path)
    for res in (r0, r1):
        # exact mode: the reversible backward reproduces plain autograd to the bit, and so do the
        # all-reduced gradients and the updated weights
        for suffix in ("", "_grad"):
            for a, b in zip(res["rev_exact" + suffix], res["plain_exact" + suffix], strict=True):
                assert torch.equal(a, b)
            # float mode: equal up to the rebuild's rounding
            torch.testing.assert_close(res["rev_float" + suffix], res["plain_float" + suffix])
    for kind in ("rev_exact", "rev_float"):
        for a, b in zip(r0[kind], r1[kind], strict=True):
            assert torch.equal(a, b)  # replicas stay in sync
