"""ReversibleSequential under DistributedDataParallel (2 gloo processes) equals plain DDP."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from slimgrad.nn.reversible import ReversibleSequential
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


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {}
        for kind in ("rev_exact", "plain_exact", "rev_float", "plain_float"):
            model = nn.parallel.DistributedDataParallel(_net(kind))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            torch.manual_seed(100 + rank)  # different data per rank
            for _ in range(2):
                x = torch.randn(2, 3, 5, 5)
                opt.zero_grad()
                model(x).square().sum().backward()
                opt.step()
            results[kind] = [p.detach().clone() for p in model.parameters()]
            results[kind + "_grad"] = [p.grad.clone() for p in model.parameters()]
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_matches_plain_ddp(tmp_path):
    # torch.multiprocessing's spawn API with the fork start method: the children skip re-importing
    # torch and the test modules (3x faster on a loaded 2-core box; nothing CUDA is initialised).
    mp.start_processes(
        _worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True, start_method="fork"
    )
    r0 = torch.load(tmp_path / "rank0.pt")
    r1 = torch.load(tmp_path / "rank1.pt")
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
