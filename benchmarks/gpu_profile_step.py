"""Where the CUDA step time goes: eager vs slimgrad (auto and torch kernel backends) per bench case.

    OUT=dir python benchmarks/gpu_profile_step.py gpt2 resnet50

Per case and side: the step time with a sync after each step, the enqueue time of a loop of steps
(CPU-bound when it is close to the step time), and torch.profiler tables (by self CPU time and by
self CUDA time) in $OUT/prof_<case>.txt; one line per side in $OUT/prof_summary.txt. Records of the
runs on an H200 (torch 2.11) are in benchmarks/results/gpu/h200_<commit>_prof_*.txt.
"""

import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from slimgrad.bench.harness import get_case
from slimgrad.kernels import _backend

OUT = os.environ["OUT"]
dev = torch.device("cuda")


def step_fn(model, make_inputs, grad):
    def f():
        xs = make_inputs()
        xs = xs if isinstance(xs, tuple) else (xs,)
        y = model(*xs)
        y.backward(grad if y.numel() != 1 else None)
        for p in model.parameters():
            p.grad = None

    return f


def timeit(f, n=10):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        f()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def cpu_launch(f, n=5):
    # CPU time per step with the GPU ahead-free: time to enqueue (no sync inside => launch-bound)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    cpu = (time.perf_counter() - t) * 1e3 / n
    torch.cuda.synchronize()
    return cpu


for name in sys.argv[1:]:
    case = get_case(name)
    torch.manual_seed(0)
    eager, slim, make_inputs = case.build(dev, torch.float32, small=False)
    xs = make_inputs()
    xs = xs if isinstance(xs, tuple) else (xs,)
    y = eager(*xs)
    grad = None if y.numel() == 1 else torch.randn_like(y)
    del y, xs
    rows = []
    for label, model, be in (
        ("eager", eager, None),
        ("slim_auto", slim, "auto"),
        ("slim_torch", slim, "torch"),
    ):
        with _backend.set_backend(be):
            f = step_fn(model, make_inputs, grad)
            for _ in range(3):
                f()
            ms = timeit(f)
            cpu = cpu_launch(f)
            rows.append(
                f"{name} {label}: step {ms:.2f} ms (sync each), enqueue-loop {cpu:.2f} ms/step"
            )
            print(rows[-1], flush=True)
            if label != "slim_torch":
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(2):
                        f()
                    torch.cuda.synchronize()
                ka = prof.key_averages()
                with open(f"{OUT}/prof_{name}.txt", "a") as fh:
                    fh.write(f"==== {name} {label} step {ms:.2f} ms enqueue {cpu:.2f}\n")
                    fh.write(
                        ka.table(
                            sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=70
                        )
                    )
                    fh.write(
                        ka.table(
                            sort_by="self_device_time_total", row_limit=30, max_name_column_width=70
                        )
                    )
    with open(f"{OUT}/prof_summary.txt", "a") as fh:
        fh.write("\n".join(rows) + "\n")
    del eager, slim
    torch.cuda.empty_cache()
