"""Bandwidth benchmark of the Triton kernels (GPU): ``python -m slimgrad.kernels._bench``.

Per kernel and size it reports the achieved bandwidth, ``essential bytes / time``, as a fraction of
the measured device-to-device copy bandwidth (``y.copy_(x)``, read + write), and fwd+bwd time of the
Triton path against the PyTorch path (``ops.<stem>._fwd_torch`` / ``_bwd_torch``) and eager PyTorch
(autograd through ``torch.nn.functional``). Essential bytes are what any implementation must move:
inputs read once, outputs written once, packed bits at 1/8 B per element; temporaries are not
counted, so the fraction is a lower bound on how close a kernel is to the memory floor. Timing:
CUDA events, warm-up, then interleaved repetitions (A, B, C, A, B, C, ...), median reported.
Records (one JSON line per kernel and size, with device and versions) go to ``--out``.

``--smoke`` runs every case once at a tiny size under ``TRITON_INTERPRET=1`` on CPU to check the
plumbing (no timings, no records): the numbers are only meaningful on a GPU. Nothing here was run on
a GPU when it was written.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class _Case:
    name: str
    build: Callable  # (n, dtype, device) -> dict of callables and byte counts


def _elementwise(stem: str, fn_eager: Callable, args=()) -> _Case:
    def build(n, dtype, device):

        ref = importlib.import_module(f"slimgrad.ops.{stem}")
        k = importlib.import_module(f"slimgrad.kernels.{stem}")
        x = torch.randn(n, dtype=dtype, device=device)
        g = torch.randn_like(x)
        y = ref._fwd_torch(x, *args)
        es = x.element_size()
        smooth = stem in ("gelu", "silu", "mish")
        if smooth:
            saved = k._fwd_triton(x, *args)
            t_fwd = lambda: k._fwd_triton(x, *args)  # noqa: E731
            t_bwd = lambda: k._bwd_triton(g, *saved, *args)  # noqa: E731
            from slimgrad.ops import _output_act

            spec = ref.SPECS[args[0]] if stem == "gelu" else ref.SPEC
            r_saved = _output_act.smooth_fwd(spec, x, lambda t: ref._fwd_torch(t, *args))
            r_fwd = lambda: _output_act.smooth_fwd(  # noqa: E731
                spec, x, lambda t: ref._fwd_torch(t, *args)
            )
            r_bwd = lambda: ref._bwd_torch(g, *r_saved, *args)  # noqa: E731
            bits = math.ceil(n / 16)  # about half the elements keep a bit
        else:
            t_fwd = lambda: k._fwd_triton(x, *args)  # noqa: E731
            t_bwd = lambda: k._bwd_triton(g, y, *args)  # noqa: E731
            r_fwd = lambda: ref._fwd_torch(x, *args)  # noqa: E731
            r_bwd = lambda: ref._bwd_torch(g, y, *args)  # noqa: E731
            bits = 0
        return {
            "triton": (t_fwd, t_bwd),
            "torch_path": (r_fwd, r_bwd),
            "eager": _eager_step(lambda t: fn_eager(t, *args), x, g),
            "bytes": (2 * n * es + bits, 3 * n * es + bits),
        }

    return _Case(stem if not args else f"{stem}[{args[0]}]", build)


def _eager_step(fn, x, g):
    xr = x.clone().requires_grad_()

    def step():
        torch.autograd.backward(fn(xr), g, inputs=[xr])
        xr.grad = None

    return step


def _dropout_case() -> _Case:
    def build(n, dtype, device):
        from slimgrad.kernels import dropout as k

        ref = importlib.import_module("slimgrad.ops.dropout")

        x = torch.randn(n, dtype=dtype, device=device)
        g = torch.randn_like(x)
        _, bits = k._fwd_triton(x, 0.1)
        fused = device.type != "cpu"
        return {
            "triton": (lambda: k._fwd_triton(x, 0.1), lambda: k._bwd_triton(g, bits, 0.1, fused)),
            "torch_path": (
                lambda: ref._fwd_torch(x, 0.1),
                lambda: ref._bwd_torch(g, bits, 0.1, fused),
            ),
            "eager": _eager_step(lambda t: F.dropout(t, 0.1), x, g),
            "bytes": (2 * n * x.element_size() + n // 8, 2 * n * x.element_size() + n // 8),
        }

    return _Case("dropout", build)


def _norm_case(stem: str, d: int) -> _Case:
    def build(n, dtype, device):

        ref = importlib.import_module(f"slimgrad.ops.{stem}")
        k = importlib.import_module(f"slimgrad.kernels.{stem}")
        rows = max(1, n // d)
        x = torch.randn(rows, d, dtype=dtype, device=device)
        w = torch.rand(d, dtype=dtype, device=device) + 0.5
        b = torch.randn(d, dtype=dtype, device=device) * 0.1
        g = torch.randn_like(x)
        es = x.element_size()
        if stem == "layer_norm":
            args, mask = ([d], w, b, 1e-5), (True, True, True)
            eager = _eager_step(lambda t: F.layer_norm(t, [d], w, b, 1e-5), x, g)
            saved = ref._fwd_torch(x, *args)
            bwd_args = (g, *saved, w, b, [d], mask)
        else:
            args, mask = ([d], w, 1e-6), (True, True)
            eager = _eager_step(lambda t: F.rms_norm(t, [d], w, 1e-6), x, g)
            saved = ref._fwd_torch(x, *args)
            bwd_args = (g, *saved, w, [d], mask)
        return {
            "triton": (lambda: k._fwd_triton(x, *args), lambda: k._bwd_triton(*bwd_args)),
            "torch_path": (lambda: ref._fwd_torch(x, *args), lambda: ref._bwd_torch(*bwd_args)),
            "eager": eager,
            "bytes": (2 * x.numel() * es, 3 * x.numel() * es),
        }

    return _Case(f"{stem}[d={d}]", build)


def _ce_case(v: int) -> _Case:
    # the softmax part alone, on one chunk of float32 logits (rows x V)
    def build(n, dtype, device):
        from slimgrad.kernels import linear_cross_entropy as k

        rows = max(1, n // v)
        z = torch.randn(rows, v, device=device)
        t = torch.randint(0, v, (rows,), device=device)
        loss, lse = k.ce_fwd_chunk(z, t, -100, 0.0)
        s = torch.ones(rows, device=device)
        zz = z.clone()

        def torch_fwd():
            lse_ = torch.logsumexp(z, 1)
            return lse_ - z.gather(1, t[:, None]).squeeze(1), lse_

        def torch_grad():
            w = z.sub(lse[:, None]).exp_()
            w[torch.arange(rows, device=device), t] -= 1.0
            return w.mul_(s[:, None])

        return {
            "triton": (
                lambda: k.ce_fwd_chunk(z, t, -100, 0.0),
                lambda: k.ce_grad_chunk_(zz, t, lse, s, -100, 0.0),
            ),
            "torch_path": (torch_fwd, torch_grad),
            "eager": _eager_step(lambda q: F.cross_entropy(q, t), z, torch.ones((), device=device)),
            "bytes": (4 * z.numel(), 8 * z.numel()),
        }

    return _Case(f"ce_softmax[V={v}]", build)


def cases() -> list[_Case]:
    return [
        _elementwise("relu", F.relu),
        _elementwise("sigmoid", torch.sigmoid),
        _elementwise("gelu", lambda t, a: F.gelu(t, approximate=a), ("none",)),
        _elementwise("gelu", lambda t, a: F.gelu(t, approximate=a), ("tanh",)),
        _elementwise("silu", F.silu),
        _elementwise("mish", F.mish),
        _dropout_case(),
        _norm_case("layer_norm", 1024),
        _norm_case("layer_norm", 4096),
        _norm_case("rms_norm", 4096),
        _ce_case(50257),
    ]


def _time_interleaved(fns: dict[str, Callable], repeat: int, warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        for f in fns.values():
            f()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for name, f in fns.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            f()
            b.record()
            b.synchronize()
            times[name].append(a.elapsed_time(b))
    return {k: statistics.median(v) for k, v in times.items()}


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    ms = _time_interleaved({"copy": lambda: y.copy_(x)}, 20, 5)["copy"]
    return 2 * nbytes / (ms * 1e-3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1048576,16777216,134217728", help="elements per case")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--only", default="", help="comma-separated case name prefixes")
    p.add_argument("--out", default="benchmarks/results/kernels.jsonl")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny sizes, no timing")
    a = p.parse_args(argv)
    if a.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        for name in [m for m in sys.modules if m.startswith("slimgrad.kernels.")]:
            if name != "slimgrad.kernels._bench":
                del sys.modules[name]
    elif not torch.cuda.is_available():
        print("slimgrad.kernels._bench: needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    dtype = getattr(torch, a.dtype)
    device = torch.device("cpu" if a.smoke else "cuda")
    chosen = [
        c for c in cases() if not a.only or any(c.name.startswith(o) for o in a.only.split(","))
    ]
    if a.smoke:
        for c in chosen:
            parts = c.build(4096, dtype, device)
            for f in (*parts["triton"], *parts["torch_path"], parts["eager"]):
                f()
            print(f"smoke ok: {c.name}")
        return 0
    from slimgrad.bench.harness import environment

    env = environment()
    bw = copy_bandwidth(device)
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s ({env.get('device', device)})")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "a") as out:
        for n in [int(s) for s in a.sizes.split(",")]:
            for c in chosen:
                parts = c.build(n, dtype, device)
                (tf, tb), (rf, rb) = parts["triton"], parts["torch_path"]
                ms = _time_interleaved(
                    {
                        "triton_fwd": tf,
                        "triton_bwd": tb,
                        "torch_fwd": rf,
                        "torch_bwd": rb,
                        "eager_fwd_bwd": parts["eager"],
                    },
                    a.repeat,
                    a.warmup,
                )
                bf, bb = parts["bytes"]
                rec = {
                    "case": c.name,
                    "numel": n,
                    "dtype": a.dtype,
                    "ms": ms,
                    "bytes_fwd": bf,
                    "bytes_bwd": bb,
                    "copy_bandwidth_Bps": bw,
                    "fwd_fraction_of_copy": bf / (ms["triton_fwd"] * 1e-3) / bw,
                    "bwd_fraction_of_copy": bb / (ms["triton_bwd"] * 1e-3) / bw,
                    "triton_over_eager": (ms["triton_fwd"] + ms["triton_bwd"])
                    / ms["eager_fwd_bwd"],
                    "torch_path_over_eager": (ms["torch_fwd"] + ms["torch_bwd"])
                    / ms["eager_fwd_bwd"],
                    **env,
                }
                out.write(json.dumps(rec) + "\n")
                print(
                    f"{c.name:24s} n={n:>10d} fwd {rec['fwd_fraction_of_copy']:.0%} "
                    f"bwd {rec['bwd_fraction_of_copy']:.0%} of copy; fwd+bwd "
                    f"{rec['triton_over_eager']:.2f}x eager (torch path "
                    f"{rec['torch_path_over_eager']:.2f}x)"
                )
                del parts
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
