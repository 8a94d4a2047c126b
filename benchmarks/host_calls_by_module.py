"""Where a converted tiny model's extra host work comes from, by module kind (issue 32).

    PYTHONPATH=src python benchmarks/host_calls_by_module.py                     # hf_llama, calls
    PYTHONPATH=src python benchmarks/host_calls_by_module.py --pairs 30          # and time ratios
    PYTHONPATH=src python benchmarks/host_calls_by_module.py --diff norms --top 30
    PYTHONPATH=src python benchmarks/host_calls_by_module.py --floor 40          # Function floor

The model is one of ``slimgrad.bench.cases.host_overhead.MODELS`` at its size there (tiny: 12
layers x 64 wide, 1x16 tokens; ResNet-50 at 2x3x32x32), one thread. Each row converts a deep copy
of the eager model with only one kind of module converted (``convert_``'s ``filter_fn`` on the
module or one of its ancestors: ``norms`` = a class named ``*Norm``, ``attention`` =
``*Attention``, ``mlp`` = ``*MLP``; ``model`` = the model-level passes only, with no submodule
converted (``filter_fn`` true for the root alone: HF's fused loss and attention interface);
``all`` = the plain ``convert_``) and reports, against eager:

- Python and C calls per step (forward + backward + ``grad = None``) counted by ``cProfile``:
  deterministic, the same on any machine, so the row's excess is that kind's exact call cost;
- with ``--pairs N``, the step-time ratio converted / eager: the median of N interleaved pairs of
  single steps timed by ``time.thread_time`` (the host_overhead case's method; noisy on a loaded
  machine: the load average is printed beside it).

``--diff KIND`` prints the functions whose per-step call counts differ between eager and that row
(converted minus eager), the largest first: which frames the kind adds or removes.

``--floor N`` measures what one Python autograd Function costs at each norm's place (N interleaved
rounds; the model itself is not converted): three copies of the eager model whose norms return
their output (a) as it is, (b) through ``view_as`` (one C++ autograd node) and (c) through a
Python ``autograd.Function`` that does the same view and passes the gradient back, with forward
and backward timed apart; then the same Function and view on a norm's output in a tight loop.
(c) - (b) per norm call is the Function's cost inside the model, against its cost alone.
No record is written: the host_overhead case makes the records.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import os
import pstats
import statistics
import time
import types

import torch

import slimgrad
from slimgrad.bench.cases import host_overhead as ho

KINDS = {"norms": "Norm", "attention": "Attention", "mlp": "MLP"}


def _kind_filter(model: torch.nn.Module, suffix: str):
    # a module converts when it or an ancestor is of a class named *suffix (filter_fn sees the
    # qualified name; the ancestors are found from the eager model's names)
    def keep(module: torch.nn.Module, name: str) -> bool:
        parts = name.split(".") if name else []
        for i in range(len(parts), -1, -1):
            sub = model.get_submodule(".".join(parts[:i]))
            if type(sub).__name__.endswith(suffix):
                return True
        return False

    return keep


def converted(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """A deep copy of ``model`` with only ``kind``'s modules converted (see the module doc)."""
    m = copy.deepcopy(model)
    if kind == "all":
        return slimgrad.convert_(m)
    if kind == "model":
        # the model itself only (its model-level passes convert it), none of its submodules
        return slimgrad.convert_(m, filter_fn=lambda mod, name: name == "")
    no_loss = slimgrad.ConvertConfig(fused_loss=False)
    return slimgrad.convert_(m, no_loss, filter_fn=_kind_filter(model, KINDS[kind]))


def _counts(model, loss_fn) -> tuple[int, dict]:
    prof = cProfile.Profile()
    prof.enable()
    ho._step(model, loss_fn)
    prof.disable()
    st = pstats.Stats(prof)
    short = {}
    for (f, line, fn), v in st.stats.items():
        key = f"{f.split('site-packages/')[-1].split('src/')[-1]}:{line}({fn})"
        short[key] = short.get(key, 0) + v[1]
    return st.total_calls, short


def _ratio(eager, slim, loss_fn, pairs: int) -> float:
    ratios = []
    for _ in range(pairs):
        t0 = time.thread_time()
        ho._step(eager, loss_fn)
        t1 = time.thread_time()
        ho._step(slim, loss_fn)
        t2 = time.thread_time()
        ratios.append((t2 - t1) / max(t1 - t0, 1e-9))
    return statistics.median(ratios)


class _Pass(torch.autograd.Function):
    # the least a Python Function can do: a view forward, the gradient passed back
    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        return dy


def _wrapped(model: torch.nn.Module, tail) -> tuple[torch.nn.Module, int]:
    # a copy whose norms return tail(their eager output); forward set on the instances
    m = copy.deepcopy(model)
    norms = [mod for mod in m.modules() if type(mod).__name__.endswith("Norm")]
    for mod in norms:
        eager_forward = type(mod).forward

        def forward(self, *args, _f=eager_forward, **kwargs):
            return tail(_f(self, *args, **kwargs))

        mod.forward = types.MethodType(forward, mod)
    return m, len(norms)


def floor(eager, loss_fn, rounds: int) -> None:
    """Print the Function floor at the norms' places (``--floor``; see the module doc)."""
    tails = {"as is": lambda y: y, "view_as": lambda y: y.view_as(y), "Function": _Pass.apply}
    rows = {k: _wrapped(eager, f) for k, f in tails.items()}
    calls = {k: 0 for k in rows}
    for k, (m, _) in rows.items():
        for _ in range(3):
            ho._step(m, loss_fn)
        calls[k] = _counts(m, loss_fn)[0]
    fwd: dict = {k: [] for k in rows}
    bwd: dict = {k: [] for k in rows}
    for _ in range(rounds):
        for k, (m, _) in rows.items():
            t0 = time.thread_time_ns()
            loss = loss_fn(m)
            t1 = time.thread_time_ns()
            loss.backward()
            t2 = time.thread_time_ns()
            for p in m.parameters():
                p.grad = None
            fwd[k].append((t1 - t0) / 1e3)
            bwd[k].append((t2 - t1) / 1e3)
    n = rows["as is"][1]
    print(f"{n} norm calls per step; medians of {rounds} rounds (load {os.getloadavg()[0]:.1f})")
    f0, b0 = statistics.median(fwd["view_as"]), statistics.median(bwd["view_as"])
    for k in rows:
        f, b = statistics.median(fwd[k]), statistics.median(bwd[k])
        print(
            f"  {k:<9} {calls[k]:>6,} calls  fwd {f:8.0f} us ({(f - f0) / n:+6.1f} per norm vs "
            f"view_as)  bwd {b:8.0f} us ({(b - b0) / n:+6.1f})"
        )
    # alone: the same tails on a norm's output, nothing else running between the calls
    x = torch.randn(1, 16, 64, requires_grad=True)
    y = x * 2
    for k in ("view_as", "Function"):
        fwd_us, bwd_us = [], []
        for _ in range(2000):
            t0 = time.thread_time_ns()
            z = tails[k](y)
            t1 = time.thread_time_ns()
            (g,) = torch.autograd.grad(z, y, z, retain_graph=True)
            t2 = time.thread_time_ns()
            fwd_us.append((t1 - t0) / 1e3)
            bwd_us.append((t2 - t1) / 1e3)
            del z, g
        print(
            f"  alone {k:<9} fwd {statistics.median(fwd_us):5.1f} us  "
            f"autograd.grad through it {statistics.median(bwd_us):5.1f} us"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="hf_llama", choices=ho.MODELS)
    ap.add_argument("--kinds", nargs="*", default=["norms", "attention", "mlp", "model", "all"])
    ap.add_argument("--pairs", type=int, default=0)
    ap.add_argument("--diff", default=None)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--floor", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    eager, loss_fn = ho.build_model(a.model)
    eager.train()
    if a.floor:
        floor(eager, loss_fn, a.floor)
        return
    rows = {k: converted(eager, k) for k in a.kinds}
    for _ in range(3):  # lazy set-up (the C++ extension, caches) out of the counts
        ho._step(eager, loss_fn)
        for m in rows.values():
            ho._step(m, loss_fn)
    n_eager, c_eager = _counts(eager, loss_fn)
    print(f"{a.model}: eager {n_eager:,} calls per step")
    for k, m in rows.items():
        n, c = _counts(m, loss_fn)
        line = f"{k:<10} {n:>7,} calls ({n - n_eager:+,})"
        if a.pairs:
            r = _ratio(eager, m, loss_fn, a.pairs)
            line += f"  time ratio {r:.3f} (load {os.getloadavg()[0]:.1f})"
        print(line)
        if k == a.diff:
            keys = set(c) | set(c_eager)
            diff = sorted(keys, key=lambda s: -abs(c.get(s, 0) - c_eager.get(s, 0)))
            for s in diff[: a.top]:
                d = c.get(s, 0) - c_eager.get(s, 0)
                if d:
                    print(f"    {d:+5d}  {s}")


if __name__ == "__main__":
    main()
