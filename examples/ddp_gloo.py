"""Plain PyTorch DDP with a converted model: ``slimgrad.convert_`` before ``DDP(model)``.

Two processes on CPU (the gloo backend; the same code runs NCCL on GPUs) train a small
Conv-BatchNorm-ReLU / Linear-GELU-LayerNorm classifier, each on its own shard of the batches,
three times: eager float32, converted float32 and eager float64. DDP all-reduces the gradients, so
after a few SGD steps every parameter depends on both ranks' gradients. Each rank asserts that the
converted run's step losses and final parameters are within the error rule against float64
(``|slimgrad - ref64| <= 2 |eager - ref64| + atol``).

Run: ``python examples/ddp_gloo.py [--steps 3]`` (seconds on CPU; torch only).
"""

from __future__ import annotations

import argparse
import copy
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import slimgrad
from slimgrad.testing import assert_within_rule

WORLD, BATCH = 2, 8


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(256, 128),
        nn.GELU(),
        nn.LayerNorm(128),
        nn.Linear(128, 10),
    )


def batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    return [
        (torch.randn(BATCH, 3, 16, 16, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
        for _ in range(steps)
    ]


def train(model: nn.Module, data, dtype: torch.dtype) -> tuple[list[float], list[torch.Tensor]]:
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.02, momentum=0.9)
    losses = []
    for x, y in data:
        loss = nn.functional.cross_entropy(ddp(x.to(dtype)), y)
        loss.backward()  # DDP all-reduces the gradients here
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def worker(rank: int, port: int, steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        eager = make_model()
        lean = slimgrad.convert_(copy.deepcopy(eager))  # before DDP: it wraps plain modules
        ref = copy.deepcopy(eager).double()
        if rank == 0:
            print(str(slimgrad.report(lean)).splitlines()[0])
        data = batches(rank, steps)
        runs = {
            "eager": train(eager, data, torch.float32),
            "slimgrad": train(lean, data, torch.float32),
            "float64": train(ref, data, torch.float64),
        }
        (l_e, p_e), (l_s, p_s), (l_r, p_r) = runs.values()
        assert_within_rule(
            torch.tensor(l_s, dtype=torch.float32),
            torch.tensor(l_r, dtype=torch.float64),
            torch.tensor(l_e, dtype=torch.float32),
            names=["loss"],
        )
        names = [n for n, _ in lean.named_parameters()]
        assert_within_rule(p_s, p_r, p_e, names=names)
        print(
            f"rank {rank}: losses {' '.join(f'{v:.6f}' for v in l_s)} (float64 "
            f"{' '.join(f'{v:.6f}' for v in l_r)}); {len(names)} parameters within the error rule"
        )
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    # fork: the workers inherit the imported torch and slimgrad instead of importing them again
    mp.start_processes(
        worker, args=(free_port(), args.steps), nprocs=WORLD, join=True, start_method="fork"
    )
    print(f"ddp: {WORLD} processes, {args.steps} steps, losses and parameters within the rule")


if __name__ == "__main__":
    main()
