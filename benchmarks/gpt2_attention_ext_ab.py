"""Tiny HF GPT-2's step with GPT-2's attention bodies from C++ on and off, interleaved (issue 32).

    PYTHONPATH=src python benchmarks/gpt2_attention_ext_ab.py --pairs 60
    PYTHONPATH=src python benchmarks/gpt2_attention_ext_ab.py --only fwd   # the forward alone

The model is ``slimgrad.bench.cases.host_overhead``'s tiny HF GPT-2 (12 layers x 64 wide, 1 x 16
tokens, dropout 0.1, one thread). One converted copy runs with the extension's
``gpt2_attention_fwd``, ``gpt2_attention_bwd`` and ``conv1d_bwd`` in use (NOTEs [GPT-2's attention
node's forward from C++], [GPT-2's attention backward from C++] in ops/gpt2_attention.py) and
with them off (the Python bodies; ``--only fwd``: only the forward off), against the eager model,
each step (forward + backward + ``grad = None``) timed by ``time.thread_time`` in rounds of
eager, on, off (the order of on and off alternating); it prints the medians of on / eager,
off / eager and on / off with the load average. Both bodies give the same bits
(tests/ops/test_gpt2_attention_ext.py). No record is written.
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

_NAMES = ("_EXT_FWD", "_EXT_BWD", "_EXT_CONV1D")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=60)
    ap.add_argument("--only", choices=("all", "fwd"), default="all")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if _ext.load() is None:
        raise SystemExit(f"the C++ extension is not here: {_ext.error()}")
    ga = importlib.import_module("slimgrad.ops.gpt2_attention")
    on = {n: getattr(ga, n) for n in _NAMES}
    off = dict(on, _EXT_FWD=None) if a.only == "fwd" else dict.fromkeys(_NAMES)
    torch.manual_seed(0)
    eager, loss_fn = ho.build_model("hf_gpt2")
    eager.train()
    slim = slimgrad.convert_(copy.deepcopy(eager))

    def step(model, bodies=None) -> int:
        if bodies is not None:
            for n, f in bodies.items():
                setattr(ga, n, f)
        t0 = time.thread_time_ns()
        ho._step(model, loss_fn)
        return time.thread_time_ns() - t0

    for _ in range(3):
        step(eager), step(slim, on), step(slim, off)
    r_on, r_off, r_ab = [], [], []
    for i in range(a.pairs):
        e = step(eager)
        if i % 2:
            t_on, t_off = step(slim, on), step(slim, off)
        else:
            t_off, t_on = step(slim, off), step(slim, on)
        r_on.append(t_on / e)
        r_off.append(t_off / e)
        r_ab.append(t_on / t_off)
    for n, f in on.items():
        setattr(ga, n, f)
    q = statistics.quantiles(r_ab, n=4)
    print(
        f"load {os.getloadavg()[0]:.1f}, {a.pairs} rounds: on / eager "
        f"{statistics.median(r_on):.3f}, off ({a.only}) / eager {statistics.median(r_off):.3f}, "
        f"on / off {statistics.median(r_ab):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})"
    )


if __name__ == "__main__":
    main()
