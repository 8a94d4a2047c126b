"""Tiny HF GPT-2's step with the MLP node's backward from C++ on and off, interleaved (issue 32).

    PYTHONPATH=src python benchmarks/gpt2_mlp_ext_ab.py --pairs 60

The model is ``slimgrad.bench.cases.host_overhead``'s tiny HF GPT-2 (12 layers x 64 wide, 1 x 16
tokens, dropout 0.1, one thread). One converted copy runs with the extension's ``gpt2_mlp_bwd`` in
use (NOTE [GPT-2's MLP backward from C++] in ops/gpt2_mlp.py) and with it off (the Python body;
the attention node's C++ bodies stay on in both), against the eager model, each step (forward +
backward + ``grad = None``) timed by ``time.thread_time`` in rounds of eager, on, off (the order
of on and off alternating); it prints the medians of on / eager, off / eager and on / off with
the load average. Both bodies give the same bits (tests/ops/test_gpt2_mlp_ext.py). No record is
written.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import statistics
import time

import torch

import slimgrad
from slimgrad import _ext
from slimgrad.bench.cases import host_overhead as ho


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=60)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if _ext.load() is None:
        raise SystemExit(f"the C++ extension is not here: {_ext.error()}")
    gm = importlib.import_module("slimgrad.ops.gpt2_mlp")
    on = gm._EXT_MLP
    torch.manual_seed(0)
    eager, loss_fn = ho.build_model("hf_gpt2")
    eager.train()
    slim = slimgrad.convert_(copy.deepcopy(eager))
    ran = [0]

    def counted(*args):
        r = on(*args)
        ran[0] += r is not None
        return r

    def step(model, body=False) -> int:
        gm._EXT_MLP = body
        t0 = time.thread_time_ns()
        ho._step(model, loss_fn)
        return time.thread_time_ns() - t0

    for _ in range(3):
        step(eager, None), step(slim, counted), step(slim, None)
    if ran[0] == 0:
        raise SystemExit("gpt2_mlp_bwd never ran its body here: nothing to compare")
    r_on, r_off, r_ab = [], [], []
    for i in range(a.pairs):
        e = step(eager, None)
        if i % 2:
            t_on, t_off = step(slim, on), step(slim, None)
        else:
            t_off, t_on = step(slim, None), step(slim, on)
        r_on.append(t_on / e)
        r_off.append(t_off / e)
        r_ab.append(t_on / t_off)
    gm._EXT_MLP = on
    q = statistics.quantiles(r_ab, n=4)
    print(
        f"load {os.getloadavg()[0]:.1f}, {a.pairs} rounds ({ran[0]} C++ backward bodies in the "
        f"warm-up): on / eager {statistics.median(r_on):.3f}, off / eager "
        f"{statistics.median(r_off):.3f}, on / off {statistics.median(r_ab):.3f} "
        f"(quartiles {q[0]:.3f}-{q[2]:.3f})"
    )


if __name__ == "__main__":
    main()
