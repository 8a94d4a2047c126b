"""InPlaceABNSync on 2 gloo processes equals one-process BatchNorm over the concatenated batch."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from slimgrad.nn.inplace_abn import InPlaceABNSync

pytestmark = pytest.mark.distributed

SIZES = [3, 5]  # unequal per-rank batches
C = 4


def _bounds(rank):
    lo = sum(SIZES[:rank])
    return lo, lo + SIZES[rank]


def _check_layer(rank, group):
    torch.manual_seed(0)
    full = torch.randn(sum(SIZES), C, 3, 2, dtype=torch.float64) * 2 + 0.5
    g = torch.randn_like(full)
    ref = nn.BatchNorm2d(C, momentum=0.3).double()
    with torch.no_grad():
        ref.weight.copy_(torch.tensor([1.5, -0.7, 0.0, 2.0]))  # a zero-weight channel too
        ref.bias.copy_(torch.tensor([0.1, 0.2, -0.3, 0.0]))
    layer = InPlaceABNSync(C, momentum=0.3, activation="leaky_relu", activation_param=0.1,
                           process_group=group).double()  # fmt: skip
    layer.load_state_dict(ref.state_dict())
    lo, hi = _bounds(rank)
    for step in range(2):
        xf = (full + step).requires_grad_()
        want = nn.functional.leaky_relu(ref(xf), 0.1)
        (want * g).sum().backward()
        x = (full[lo:hi] + step).requires_grad_()
        out = layer(x * 1)
        (out * g[lo:hi]).sum().backward()
        torch.testing.assert_close(out.detach(), want.detach()[lo:hi])
        torch.testing.assert_close(x.grad, xf.grad[lo:hi])
        grads = torch.stack([layer.weight.grad, layer.bias.grad])
        dist.all_reduce(grads)  # local sums, as nn.SyncBatchNorm; their sum is the full-batch grad
        torch.testing.assert_close(grads[0], ref.weight.grad)
        torch.testing.assert_close(grads[1], ref.bias.grad)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(layer.state_dict()[k], v)
        layer.zero_grad()
        ref.zero_grad()


def _check_ddp(rank, world):
    torch.manual_seed(1)
    ref = nn.Sequential(
        nn.Conv2d(3, C, 3, padding=1), nn.BatchNorm2d(C), nn.LeakyReLU(0.01), nn.Conv2d(C, 2, 1)
    ).double()
    model = nn.Sequential(
        nn.Conv2d(3, C, 3, padding=1), InPlaceABNSync(C), nn.Conv2d(C, 2, 1)
    ).double()
    sd = {
        k.replace("3.", "2.", 1) if k.startswith("3.") else k: v
        for k, v in ref.state_dict().items()
    }
    model.load_state_dict(sd)
    ddp = nn.parallel.DistributedDataParallel(model)
    full = torch.randn(sum(SIZES), 3, 5, 4, dtype=torch.float64)
    g = torch.randn(sum(SIZES), 2, 5, 4, dtype=torch.float64)
    lo, hi = _bounds(rank)
    (ddp(full[lo:hi]) * g[lo:hi]).sum().backward()
    (ref(full) * g).sum().backward()
    ref_params = [p for n, p in ref.named_parameters()]
    for p, r in zip(model.parameters(), ref_params):
        torch.testing.assert_close(p.grad * world, r.grad)  # DDP averages the per-rank sums
    torch.testing.assert_close(model[1].running_mean, ref[1].running_mean)
    torch.testing.assert_close(model[1].running_var, ref[1].running_var)


def _worker(rank, world, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        _check_layer(rank, None)  # default group, looked up at call time
        _check_layer(rank, dist.new_group([0, 1]))  # explicit group
        _check_ddp(rank, world)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_sync_two_gloo_processes(tmp_path):
    # forkserver: the workers fork from a clean server that imported torch once, not from this
    # test process and whatever state earlier tests left in it (tests/distributed/_gloo.py). A
    # deadline turns a hung collective into a failure instead of a stuck suite.
    mp.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed", "slimgrad"])
    ctx = mp.start_processes(
        _worker, args=(2, str(tmp_path / "init")), nprocs=2, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("gloo workers did not finish within 120 s")
