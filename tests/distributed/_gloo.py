"""Run a training function on 2 gloo ranks (forked processes) and collect what each returns."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _worker(rank: int, port: int, out_dir: str, train: Callable[[int], dict]) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.save(train(rank), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_two_ranks(train: Callable[[int], dict], out_dir) -> tuple[dict, dict]:
    """``train(rank)`` on each of 2 gloo ranks; returns the two ranks' results.

    torch.multiprocessing's spawn API with the fork start method: the children skip re-importing
    torch and the test modules (3x faster on a loaded 2-core box; nothing CUDA is initialised).
    """
    mp.start_processes(
        _worker,
        args=(_free_port(), str(out_dir), train),
        nprocs=WORLD,
        join=True,
        start_method="fork",
    )
    return tuple(torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD))
