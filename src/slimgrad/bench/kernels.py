"""Bandwidth benchmark of the Triton kernels (GPU): ``python -m slimgrad.bench.kernels``.

Per kernel and size it reports the achieved bandwidth, ``essential bytes / time``, as a fraction of
the measured device-to-device copy bandwidth (``y.copy_(x)``, read + write, timed the same way),
and fwd+bwd time of the Triton path against the PyTorch path (``ops.<stem>._fwd_torch`` /
``_bwd_torch``) and eager PyTorch (autograd through ``torch.nn.functional``, every input that has a
gradient in the Triton backward requiring grad there too). Where a public op exists, the whole op
(``slimgrad.ops.<stem>``, forward + autograd backward, backend choice ``auto``) is timed as well:
that is what a model pays, custom-op dispatch included. Essential bytes are what any implementation
must move: inputs read once, outputs written once, packed bits at 1/8 B per element; temporaries
are not counted, so the fraction is a lower bound on how close a kernel is to the memory floor.
Timing: CUDA events around ``--inner`` back-to-back calls (the CPU runs ahead, as in a model), after
a warm-up, interleaved over the variants (A, B, C, A, B, C, ...), median of ``--repeat`` samples.
Each case also records the largest difference of the Triton forward's output from the PyTorch
path's (a sanity check at full size; dropout: its Philox mask differs by design, not checked).
Records (one JSON line per kernel and size, with device, versions and commit) go to ``--out``.

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


def _first(t):
    return t[0] if isinstance(t, (tuple, list)) else t


def _diff(a, b) -> float:
    from slimgrad.testing import max_abs_err

    return max_abs_err(_first(a), _first(b))


def _step(fn: Callable, *leaves: torch.Tensor, g: torch.Tensor) -> Callable:
    # one autograd step of fn(*leaves) with output gradient g, grads for every leaf
    def step():
        torch.autograd.backward(fn(*leaves), g, inputs=list(leaves))
        for t in leaves:
            t.grad = None

    return step


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def _elementwise(stem: str, fn_eager: Callable, args=(), op: str | None = None) -> _Case:
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
        public = getattr(ref, op or stem)
        return {
            "triton": (t_fwd, t_bwd),
            "torch_path": (r_fwd, r_bwd),
            "eager": _step(lambda t: fn_eager(t, *args), _leaf(x), g=g),
            "op": _step(lambda t: public(t, *args), _leaf(x), g=g),
            "check": lambda: _diff(t_fwd(), r_fwd()),
            "bytes": (2 * n * es + bits, 3 * n * es + bits),
        }

    return _Case(stem if not args else f"{stem}[{args[0]}]", build)


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
            "eager": _step(lambda t: F.dropout(t, 0.1), _leaf(x), g=g),
            # the op draws eager's mask (auto never picks the Philox kernel): the PyTorch path
            "op": _step(lambda t: ref.dropout(t, 0.1), _leaf(x), g=g),
            "check": None,  # the Philox mask differs from eager's by design
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
            eager = _step(lambda t, w_, b_: F.layer_norm(t, [d], w_, b_, 1e-5),
                          _leaf(x), _leaf(w), _leaf(b), g=g)  # fmt: skip
            op = _step(lambda t, w_, b_: ref.layer_norm(t, [d], w_, b_, 1e-5),
                       _leaf(x), _leaf(w), _leaf(b), g=g)  # fmt: skip
            saved = ref._fwd_torch(x, *args)
            bwd_args = (g, *saved, w, b, [d], mask)
        else:
            args, mask = ([d], w, 1e-6), (True, True)
            eager = _step(lambda t, w_: F.rms_norm(t, [d], w_, 1e-6), _leaf(x), _leaf(w), g=g)
            op = _step(lambda t, w_: ref.rms_norm(t, [d], w_, 1e-6), _leaf(x), _leaf(w), g=g)
            saved = ref._fwd_torch(x, *args)
            bwd_args = (g, *saved, w, [d], mask)
        t_fwd = lambda: k._fwd_triton(x, *args)  # noqa: E731
        r_fwd = lambda: ref._fwd_torch(x, *args)  # noqa: E731
        return {
            "triton": (t_fwd, lambda: k._bwd_triton(*bwd_args)),
            "torch_path": (r_fwd, lambda: ref._bwd_torch(*bwd_args)),
            "eager": eager,
            "op": op,
            "check": lambda: _diff(t_fwd(), r_fwd()),
            "bytes": (2 * x.numel() * es, 3 * x.numel() * es),
        }

    return _Case(f"{stem}[d={d}]", build)


def _inplace_abn_case(c: int = 64, hw: int = 56) -> _Case:
    # BN statistics + normalise + leaky_relu written over x; backward: reduction pass + dx pass
    def build(n, dtype, device):
        from slimgrad.kernels import inplace_abn as k

        ref = importlib.import_module("slimgrad.ops.inplace_abn")
        # ResNet-like (N, 64, 56, 56); below one such sample (the smoke run) a tiny (2, 4, 16, 16)
        shape = (n // (c * hw * hw), c, hw, hw) if n >= c * hw * hw else (2, 4, 16, 16)
        x = torch.randn(shape, dtype=dtype, device=device)
        w = torch.rand(shape[1], device=device) + 0.5
        b = torch.randn(shape[1], device=device) * 0.1
        g = torch.randn_like(x)
        cfg = (True, 0.1, 1e-5, "leaky_relu", 0.01)
        # training mode re-normalises x on every call: repeated in-place calls stay bounded
        xt, xr, z = x.clone(), x.clone(), x.clone()
        _, invstd, idx, side, count = ref._fwd_torch(z, w, b, None, None, *cfg)
        bwd = (z, g, w, b, invstd, idx, side, count, True, 1e-5, "leaky_relu", 0.01)

        # the op writes over its input, which must not be a leaf: both steps start from t * 1
        def eager(t, w_, b_):
            h = F.batch_norm(t * 1, None, None, w_, b_, True)
            return F.leaky_relu(h, 0.01, inplace=True)

        def op(t, w_, b_):
            return ref.inplace_abn(t * 1, None, None, w_, b_, *cfg)

        def check():
            a, r = x.clone(), x.clone()
            k._fwd_triton(a, w, b, None, None, *cfg)
            ref._fwd_torch(r, w, b, None, None, *cfg)
            return _diff(a, r)

        nb = x.numel() * x.element_size()
        return {
            "triton": (lambda: k._fwd_triton(xt, w, b, None, None, *cfg),
                       lambda: k._bwd_triton(*bwd)),
            "torch_path": (lambda: ref._fwd_torch(xr, w, b, None, None, *cfg),
                           lambda: ref._bwd_torch(*bwd)),
            "eager": _step(eager, _leaf(x), _leaf(w), _leaf(b), g=g),
            "op": _step(op, _leaf(x), _leaf(w), _leaf(b), g=g),
            "check": check,
            # fwd: x read for the statistics, read + written by normalise+act; bwd: z and dz read
            # by the reduction, read again with dx written by the elementwise pass
            "bytes": (3 * nb, 5 * nb),
        }  # fmt: skip

    return _Case(f"inplace_abn[C={c}]", build)


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
            "eager": _step(
                lambda q: F.cross_entropy(q, t, reduction="sum"),
                _leaf(z),
                g=torch.ones((), device=device),
            ),  # fmt: skip
            "op": None,  # the op includes the vocabulary matmul: see the linear_cross_entropy case
            "check": lambda: _diff(k.ce_fwd_chunk(z, t, -100, 0.0), torch_fwd()),
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
        _inplace_abn_case(),
        _ce_case(50257),
    ]


def _time_interleaved(
    fns: dict[str, Callable], repeat: int, warmup: int, inner: int = 1
) -> dict[str, float]:
    """Median ms per call of each function: CUDA events around ``inner`` back-to-back calls,
    samples interleaved over the functions."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for name, f in fns.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(inner):
                f()
            b.record()
            b.synchronize()
            times[name].append(a.elapsed_time(b) / inner)
    return {k: statistics.median(v) for k, v in times.items()}


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, inner: int = 5) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    ms = _time_interleaved({"copy": lambda: y.copy_(x)}, 20, 5, inner)["copy"]
    return 2 * nbytes / (ms * 1e-3)


def record(case: str, n: int, dtype: str, ms: dict, nbytes: tuple, bw: float, **extra) -> dict:
    """One JSON record from the timings (ms per call) of a case at one size."""
    bf, bb = nbytes
    tri = ms["triton_fwd"] + ms["triton_bwd"]
    rec = {
        "case": case,
        "numel": n,
        "dtype": dtype,
        "ms": ms,
        "bytes_fwd": bf,
        "bytes_bwd": bb,
        "copy_bandwidth_Bps": bw,
        "fwd_fraction_of_copy": bf / (ms["triton_fwd"] * 1e-3) / bw,
        "bwd_fraction_of_copy": bb / (ms["triton_bwd"] * 1e-3) / bw,
        "triton_over_eager": tri / ms["eager_fwd_bwd"],
        "torch_path_over_eager": (ms["torch_fwd"] + ms["torch_bwd"]) / ms["eager_fwd_bwd"],
        "op_over_eager": ms["op_fwd_bwd"] / ms["eager_fwd_bwd"] if "op_fwd_bwd" in ms else None,
    }
    rec.update(extra)
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1048576,16777216,134217728", help="elements per case")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--inner", type=int, default=5, help="back-to-back calls per timed sample")
    p.add_argument("--only", default="", help="comma-separated case name prefixes")
    p.add_argument("--out", default="benchmarks/results/kernels.jsonl")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny sizes, no timing")
    a = p.parse_args(argv)
    if a.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        # dropped from sys.modules and as their package's attribute: `from slimgrad.kernels import
        # inplace_abn` returns the attribute, a module a compiled-mode import left there, whose
        # kernels would ask for a GPU driver
        for name in [m for m in sys.modules if m.startswith("slimgrad.kernels.")]:
            if name != "slimgrad.kernels._backend":
                del sys.modules[name]
                parent, _, leaf = name.rpartition(".")
                if (pkg := sys.modules.get(parent)) is not None:
                    vars(pkg).pop(leaf, None)
    elif not torch.cuda.is_available():
        print("slimgrad.bench.kernels: needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    dtype = getattr(torch, a.dtype)
    device = torch.device("cpu" if a.smoke else "cuda")
    chosen = [
        c for c in cases() if not a.only or any(c.name.startswith(o) for o in a.only.split(","))
    ]
    if a.smoke:
        from slimgrad.kernels import _backend

        with _backend.set_backend("triton"):  # the ops' own calls take the kernels too
            for c in chosen:
                parts = c.build(4096, dtype, device)
                for f in (*parts["triton"], *parts["torch_path"], parts["eager"], parts["op"]):
                    if f is not None:
                        f()
                if parts["check"] is not None:
                    parts["check"]()
                print(f"smoke ok: {c.name}")
        return 0
    from slimgrad.bench.harness import device_name, environment, git_commit

    meta = {
        "device": str(device),
        "device_name": device_name(device),
        "versions": {k: v for k, v in environment().items() if k != "gpus"},
        "commit": git_commit(),
        "repeat": a.repeat,
        "inner": a.inner,
    }
    bw = copy_bandwidth(device, inner=a.inner)
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s ({meta['device_name']})")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "a") as out:
        for n in [int(s) for s in a.sizes.split(",")]:
            for c in chosen:
                parts = c.build(n, dtype, device)
                (tf, tb), (rf, rb) = parts["triton"], parts["torch_path"]
                fns = {
                    "triton_fwd": tf,
                    "triton_bwd": tb,
                    "torch_fwd": rf,
                    "torch_bwd": rb,
                    "eager_fwd_bwd": parts["eager"],
                }
                if parts["op"] is not None:
                    fns["op_fwd_bwd"] = parts["op"]
                ms = _time_interleaved(fns, a.repeat, a.warmup, a.inner)
                diff = parts["check"]() if parts["check"] is not None else None
                rec = record(c.name, n, a.dtype, ms, parts["bytes"], bw,
                             fwd_max_abs_diff_vs_torch_path=diff, **meta)  # fmt: skip
                out.write(json.dumps(rec) + "\n")
                out.flush()
                op = rec["op_over_eager"]
                print(
                    f"{c.name:24s} n={n:>10d} fwd {rec['fwd_fraction_of_copy']:.0%} "
                    f"bwd {rec['bwd_fraction_of_copy']:.0%} of copy; fwd+bwd "
                    f"{rec['triton_over_eager']:.2f}x eager (torch path "
                    f"{rec['torch_path_over_eager']:.2f}x"
                    + (f", op {op:.2f}x" if op is not None else "")
                    + ")"
                )
                del parts, fns
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
