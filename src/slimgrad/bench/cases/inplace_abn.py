"""8 x [Conv2d(64, 64, 3, padding=1) -> BN + LeakyReLU(0.01)], 16x64x56x56: InPlaceABN vs eager.

Eager: ``BatchNorm2d`` + ``LeakyReLU(0.01, inplace=True)``. slimgrad:
``InPlaceABN(activation='leaky_relu')`` sharing the same Parameters.
Targets (issue 3): saved <= 0.50 and peak <= 0.56 of eager, step <= 1.05x.

Run: ``PYTHONPATH=src python -m slimgrad.bench.cases.inplace_abn [--small] [--steps N]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from torch import nn

from slimgrad.nn.inplace_abn import InPlaceABN

NAME = "inplace_abn_chain"
BLOCKS, CHANNELS, SHAPE = 8, 64, (16, 64, 56, 56)
SMALL_SHAPE = (4, 64, 14, 14)


def _eager(device, dtype) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        layers += [
            nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1),
            nn.BatchNorm2d(CHANNELS),
            nn.LeakyReLU(0.01, inplace=True),
        ]
    return nn.Sequential(*layers).to(device=device, dtype=dtype)


def _slim(eager: nn.Sequential) -> nn.Sequential:
    # Same Parameters; buffers copied so the two models' running statistics evolve separately.
    layers: list[nn.Module] = []
    for m in eager:
        if isinstance(m, nn.BatchNorm2d):
            bn = copy.copy(m)
            bn._buffers = {k: (v.clone() if v is not None else v) for k, v in m._buffers.items()}
            layers.append(InPlaceABN.from_torch(bn, activation="leaky_relu", activation_param=0.01))
        elif isinstance(m, nn.LeakyReLU):
            continue
        else:
            layers.append(m)
    return nn.Sequential(*layers)


def build(device="cpu", dtype=torch.float32, small: bool = False):
    """Returns (eager_model, slim_model, make_inputs).

    ``make_inputs() -> (x, up)``; the loss is ``(model(x) * up).sum()``.
    """
    device = torch.device(device)
    torch.manual_seed(0)
    eager = _eager(device, dtype)
    with torch.no_grad():
        for m in eager:
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    slim = _slim(eager)
    shape = SMALL_SHAPE if small else SHAPE

    def make_inputs():
        g = torch.Generator(device="cpu").manual_seed(1)
        x = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
        up = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
        return x, up

    return eager, slim, make_inputs


def _loss(model, x, up):
    return (model(x) * up).sum()


def measure_memory(model, x, up):
    from slimgrad.memory import measure

    model.zero_grad(set_to_none=True)
    m = measure(lambda: _loss(model, x, up), module=model, timeline=False)
    model.zero_grad(set_to_none=True)
    return m


def time_steps(eager, slim, x, up, steps: int = 5):
    """Interleaved A/B steps (forward + backward): wall and process-CPU ms per step; the first round
    is a warm-up. CPU time is the steadier figure on a shared machine."""
    times: dict[str, list[tuple[float, float]]] = {"eager": [], "slim": []}
    for i in range(steps + 1):
        order = (("eager", eager), ("slim", slim))
        for name, model in order if i % 2 == 0 else order[::-1]:
            model.zero_grad(set_to_none=True)
            t0, c0 = time.perf_counter(), time.process_time()
            _loss(model, x, up).backward()
            dt, dc = (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3
            if i > 0:
                times[name].append((dt, dc))
    return times


def grad_errors(eager, slim, x, up):
    """max|grad - grad_ref64| over all Parameters for eager and slim (one step each)."""
    ref = copy.deepcopy(eager).to(torch.float64)
    out = {}
    grads = {}
    for name, model in (("eager", eager), ("slim", slim), ("ref64", ref)):
        model.zero_grad(set_to_none=True)
        xx, uu = (x.double(), up.double()) if name == "ref64" else (x, up)
        _loss(model, xx, uu).backward()
        grads[name] = [p.grad.detach().clone() for p in model.parameters()]
    for name in ("eager", "slim"):
        out[name] = max(
            float((a.double() - r).abs().max()) for a, r in zip(grads[name], grads["ref64"])
        )
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    eager, slim, make_inputs = build(args.device, torch.float32, small=args.small)
    x, up = make_inputs()
    me, ms = measure_memory(eager, x, up), measure_memory(slim, x, up)
    act_bytes = x.numel() * x.element_size()
    rec = {
        "case": NAME,
        "shape": list(x.shape),
        "device": str(x.device),
        "torch": torch.__version__,
        "activation_bytes": act_bytes,
        "eager": {"saved_bytes": me.saved_bytes, "peak_bytes": me.peak_bytes},
        "slim": {"saved_bytes": ms.saved_bytes, "peak_bytes": ms.peak_bytes},
        "saved_ratio": ms.saved_bytes / me.saved_bytes,
        "peak_ratio": ms.peak_bytes / me.peak_bytes,
    }
    err = grad_errors(eager, slim, x, up)
    rec["grad_max_err"] = err
    rec["grad_rule_ok"] = err["slim"] <= 2 * err["eager"] + 1e-6  # GUIDE.md rule, all Parameters
    if args.steps > 0:
        t = time_steps(eager, slim, x, up, args.steps)
        for j, kind in enumerate(("wall", "cpu")):
            ratios = [s[j] / e[j] for s, e in zip(t["slim"], t["eager"])]
            rec[f"step_{kind}_ms"] = {k: statistics.median(v[j] for v in t[k]) for k in t}
            rec[f"step_{kind}_ratio_median"] = statistics.median(ratios)
            rec[f"step_{kind}_ratio_range"] = [min(ratios), max(ratios)]
    print(json.dumps(rec, indent=1))
    return rec


if __name__ == "__main__":
    main()
