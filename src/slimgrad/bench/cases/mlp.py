"""GPT-2 MLP block: Linear(768, 3072) -> GELU(tanh) -> Linear(3072, 768) -> dropout 0.1, 4x256.

Eager keeps fc1's input, GELU's input (fc1's output), fc2's input (GELU's output) and a float32
dropout mask (CPU); slimgrad keeps fc1's input, GELU's output (shared with fc2) + 1 bit per
element + a sparse table, and a 1-bit dropout mask (``slimgrad.nn.dropout``). On CPU float32 the
GELU and dropout passes run as compiled C (NOTE [CPU C kernels]); the record names the backend.

Run: ``PYTHONPATH=src python -m slimgrad.bench.cases.mlp [--small] [--repeat N]``, or
``slimgrad bench mlp`` (the harness; appends to ``benchmarks/results/mlp.jsonl``).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time

import torch

from slimgrad.nn.gelu import GELU

_DROPOUT_P = 0.1


def _slim_dropout():
    try:
        from slimgrad.nn.dropout import Dropout  # 1-bit masks (norm/dropout engineer)
    except ImportError:
        return None
    return Dropout


def build(device="cpu", dtype=torch.float32, small: bool = False):
    """(eager_model, slim_model, make_inputs) for the MLP block; same initial weights, no
    sharing."""
    d, h, tokens = (64, 256, (2, 16)) if small else (768, 3072, (4, 256))
    slim_dropout = _slim_dropout()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(d, h), torch.nn.GELU("tanh"), torch.nn.Linear(h, d)]
    if slim_dropout is not None:
        layers.append(torch.nn.Dropout(_DROPOUT_P))
    eager = torch.nn.Sequential(*layers).to(device=device, dtype=dtype)
    slim = copy.deepcopy(eager)
    slim[1] = GELU.from_torch(slim[1])
    if slim_dropout is not None:
        slim[3] = slim_dropout.from_torch(slim[3])

    def make_inputs():
        return torch.randn(*tokens, d, device=device, dtype=dtype)

    return eager, slim, make_inputs


def _backend_name(x) -> str:
    from slimgrad.kernels import _backend

    b = _backend.get_backend()
    if b in ("auto", "cpu") and _backend.use_cpu(x, "output_act") is not None:
        return f"{b}: C kernels (kernels/cpu)"
    return f"{b}: PyTorch"


def _step(model, x, g, seed):
    torch.manual_seed(seed)  # same dropout mask for both models (slimgrad draws like eager)
    out = model(x)
    out.backward(g)


def main(argv=None) -> dict:
    from slimgrad.memory import measure
    from slimgrad.testing import rule_ok

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args(argv)
    eager, slim, make_inputs = build(small=args.small)
    torch.manual_seed(1)
    x = make_inputs()
    g = torch.randn(*x.shape[:-1], eager[2].out_features)

    # memory: the input x exists before the step; fc1 keeps it in both (a matmul input), so it is
    # counted in the floor: floor = fc1 input + fc2 input, saved = everything autograd keeps.
    mem = {}
    for name, model in (("eager", eager), ("slimgrad", slim)):
        _step(model, x, g, 2)  # warm-up (tables, allocator)
        model.zero_grad()

        def fwd(model=model):
            torch.manual_seed(2)
            return model(x)

        m = measure(fwd, grad=g, module=model)
        mem[name] = {
            "saved_bytes": m.saved_bytes + m.saved_input_bytes,
            "floor_bytes": m.floor_bytes + m.saved_input_bytes,
            "peak_bytes": m.peak_bytes,
            "by_node": m.by_node,
        }
    eager_floor = mem["eager"]["floor_bytes"]

    # gradients: both models vs a float64 eager copy, same dropout mask (seeded)
    ref = copy.deepcopy(eager).double()
    grads = {}
    for name, model in (("eager", eager), ("slimgrad", slim), ("ref64", ref)):
        model.zero_grad()
        xx = x.double() if name == "ref64" else x
        _step(model, xx, g.to(xx.dtype), 3)
        grads[name] = {k: p.grad.clone() for k, p in model.named_parameters()}
    rule = {}
    for k in grads["eager"]:
        ok, err, bound = rule_ok(grads["slimgrad"][k], grads["ref64"][k], grads["eager"][k])
        rule[k] = {"ok": ok, "err": err, "bound": bound}

    # interleaved timing: alternate which model goes first; median of per-pair ratios
    times = {"eager": [], "slimgrad": []}
    for i in range(args.repeat + 2):
        order = (("eager", eager), ("slimgrad", slim))
        for name, model in order if i % 2 == 0 else order[::-1]:
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            _step(model, x, g, 4 + i)
            times[name].append(time.perf_counter() - t0)
    te, ts = times["eager"][2:], times["slimgrad"][2:]  # drop warm-up pairs
    ratios = sorted(b / a for a, b in zip(te, ts))
    rec = {
        "case": "mlp",
        "small": args.small,
        "shapes": {"x": list(x.shape), "hidden": eager[0].out_features},
        "dtype": "float32",
        "dropout": "slimgrad.nn.dropout" if len(slim) == 4 else "none (not merged)",
        "memory": {k: {kk: vv for kk, vv in v.items() if kk != "by_node"} for k, v in mem.items()},
        "by_node": {k: v["by_node"] for k, v in mem.items()},
        "saved_over_floor": {k: v["saved_bytes"] / eager_floor for k, v in mem.items()},
        "step_ms": {"eager": 1e3 * statistics.median(te), "slimgrad": 1e3 * statistics.median(ts)},
        "time_ratio_median": statistics.median(ratios),
        "time_ratio_range": [ratios[0], ratios[-1]],
        "grad_rule": rule,
        "device": "cpu",
        "backend": _backend_name(x),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    print(json.dumps(rec, indent=1))
    return rec


if __name__ == "__main__":
    main()
