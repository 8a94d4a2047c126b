"""Where a converted tiny model's extra host work comes from, by module kind (issue 32).

    PYTHONPATH=src python benchmarks/host_calls_by_module.py                     # hf_llama, calls
    PYTHONPATH=src python benchmarks/host_calls_by_module.py --pairs 30          # and time ratios
    PYTHONPATH=src python benchmarks/host_calls_by_module.py --diff norms --top 30

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="hf_llama", choices=ho.MODELS)
    ap.add_argument("--kinds", nargs="*", default=["norms", "attention", "mlp", "model", "all"])
    ap.add_argument("--pairs", type=int, default=0)
    ap.add_argument("--diff", default=None)
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    eager, loss_fn = ho.build_model(a.model)
    eager.train()
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
