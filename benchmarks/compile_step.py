"""torch.compile of a converted HF model beside eager compiled (issue 16): step time, peak bytes.

For each model, the same training step (forward with labels, backward, SGD step; dropout on) in
two settings compiled with the same backend: ``eager`` (the model as built) and ``slimgrad``
(``slimgrad.convert_`` of a copy). ``--backend`` defaults to inductor.

- time: after 3 warm-up steps (compilation), ``--steps`` steps of each setting interleaved (A, B,
  A, B, ...); the median step in ms and the median of the per-pair ratios (spread: min-max),
  in wall time and in this process's CPU time (``cpu_ms_median``, ``cpu_ratio_median``: less
  sensitive to other processes on a shared machine).
- memory: slimgrad's exact tracker does not see inside inductor's generated code, so bytes come
  from torch's own CPU allocator counters: ``torch.profiler`` with ``profile_memory=True`` records
  every CPU allocation and free; the peak is the largest running sum over one step above what was
  live when it began (parameters, inputs and optimizer state excluded; ``.grad`` is cleared
  before the step, so gradients count).
- kept bytes: after forward, the unique storages the autograd graph holds (walked from the loss as
  ``slimgrad.memory`` walks it; a compiled region is one node holding what the partitioner saved),
  parameters excluded, for the compiled model (``kept_bytes``) and the same model uncompiled
  (``kept_bytes_uncompiled``): exact, independent of the allocator (NOTE [slimgrad ops under
  torch.compile] in ``slimgrad/_compile.py``).
- per step (``per_step``, from the profiled step): slimgrad custom-op calls, ``aten::nonzero``
  calls, scalar reads to the host (``aten::_local_scalar_dense``) and ATen ops in all: counts that
  do not depend on the machine's load, unlike the times.
- graph breaks: ``torch._dynamo.utils.counters["graph_break"]`` summed over the compilation;
  ``frames_compiled``: frames Dynamo compiled over the warm-up steps (a recompile adds one);
  ``guards``: leaf guards of every compiled frame's cache entries (``guard_count``: torch's private
  guard tree API; None where it is missing), summed over the entries; ``guards_per_entry`` lists
  them per cache entry (two entries for one frame: a recompile, whose stale entry Dynamo keeps; a
  call checks the most recently used entry first). Every compiled call checks its frame's guards.

Models (random init, float32): HF GPT-2 and Llama, "tiny" (2 layers, width 64, vocab 512, 2 x 64
tokens) and "small" (4 layers, width 128, vocab 2048, 4 x 128 tokens), as
``benchmarks/checkpointing.py``. Each family at its own default dropout (GUIDE: headline numbers at
the family's default configuration): GPT-2's 0.1 (embedding, attention, residual), Llama's
``attention_dropout`` 0.0; ``--llama-attention-dropout 0.1`` gives the records before this option
(recorded as ``attention_dropout``). ``--fast-loss`` adds a third setting, provider
``slimgrad_fast_loss``: the model converted with ``ConvertConfig(fast_loss=True)`` (the fused
loss computes the LM head's gradients in forward and keeps dW instead of recomputing the logits
in backward), timed in the same interleaved rounds.

Usage (from the repository root):
    PYTHONPATH=src .venv/bin/python benchmarks/compile_step.py \
        --out benchmarks/results/compile_step.jsonl
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings
from datetime import datetime, timezone

import torch

MiB = 2**20
KEYS = ("layers", "width", "vocab", "B", "T")
SIZES = {"tiny": (2, 64, 512, 2, 64), "small": (4, 128, 2048, 4, 128)}  # layers, width, vocab, B, T


def build(
    family: str, size: str, llama_attention_dropout: float = 0.0
) -> tuple[torch.nn.Module, dict]:
    import transformers

    layers, width, vocab, b, t = SIZES[size]
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=vocab, n_embd=width, n_layer=layers, n_head=4, n_positions=t,
            resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=width, intermediate_size=2 * width,
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=t, attention_dropout=llama_attention_dropout,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, vocab, (b, t), generator=g)
    return model.float().train(), {"input_ids": ids, "labels": ids.clone()}


def peak_bytes(step) -> int:
    return peak_and_counts(step)[0]


def peak_and_counts(step) -> tuple[int, dict]:
    """The step's peak bytes, and what it calls that is countable whatever the load: slimgrad
    custom-op calls, ``aten::nonzero`` and scalar reads to the host (``_local_scalar_dense``:
    ``item``, ``bool`` of a tensor), and ATen ops in all (torch.profiler's CPU events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    all_events = list(prof.profiler.kineto_results.events())
    events = [e for e in all_events if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    names = [e.name() for e in all_events]
    counts = {
        "custom_ops": sum(n.startswith("slimgrad::") for n in names),
        "nonzero": names.count("aten::nonzero"),
        "scalar_reads": names.count("aten::_local_scalar_dense"),
        "aten_ops": sum(n.startswith("aten::") for n in names),
    }
    return peak, counts


def make_step(model, batch, backend):
    fwd = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses = []

    def step():
        opt.zero_grad(set_to_none=True)
        loss = fwd(**batch).loss
        loss.backward()
        opt.step()
        losses.append(float(loss))

    return step, losses, fwd


def guard_count() -> int | None:
    """Leaf guards over the cache entries of every frame Dynamo compiled (torch-private API)."""
    per = guards_per_entry()
    return None if per is None else sum(per)


def guards_per_entry() -> list[int] | None:
    """Leaf guards of each cache entry of every frame Dynamo compiled (torch-private API)."""
    try:
        from torch._C._dynamo.guards import DictGuardManager
        from torch._dynamo.convert_frame import input_codes
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return None

    def leaves(mgr) -> int:
        kids = list(mgr.get_child_managers())
        if isinstance(mgr, DictGuardManager):
            kids += [m for kv in mgr.get_key_value_managers().values() for m in kv if m]
        return len(mgr.get_leaf_guards()) + sum(leaves(k) for k in kids)

    n = []
    try:
        for ref in input_codes.seen:
            code = ref()
            for entry in _debug_get_cache_entry_list(code) if code is not None else ():
                root = entry.guard_manager.root
                n.append(leaves(root) + len(root.get_epilogue_lambda_guards()))
    except AttributeError:  # a torch whose guard managers name these methods otherwise
        return None
    return n


def kept_bytes(model, fwd, batch) -> int:
    from slimgrad.memory import _storage, _walk_savers

    params = {_storage(p)._cdata for p in model.parameters()}
    loss = fwd(**batch).loss
    found = _walk_savers([loss.grad_fn])
    kept = sum(_storage(t).nbytes() for k, (t, _) in found.items() if k not in params)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return kept


def run(
    family: str,
    size: str,
    backend: str,
    steps: int,
    llama_attention_dropout: float = 0.0,
    fast_loss: bool = False,
) -> list[dict]:
    import slimgrad

    model, batch = build(family, size, llama_attention_dropout)
    conv = copy.deepcopy(model)
    slimgrad.convert_(conv)
    settings = {"eager": model, "slimgrad": conv}
    if fast_loss:  # a third setting: ConvertConfig(fast_loss=True), the head's gradients in forward
        settings["slimgrad_fast_loss"] = slimgrad.convert_(
            copy.deepcopy(model), slimgrad.ConvertConfig(fast_loss=True)
        )
    made, breaks, kept, frames, guards = {}, {}, {}, {}, {}
    for name, m in settings.items():
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch.manual_seed(0)
        step, losses, fwd = make_step(m, batch, backend)
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        warm_s = time.perf_counter() - t0
        breaks[name] = sum(torch._dynamo.utils.counters["graph_break"].values())
        frames[name] = torch._dynamo.utils.counters["frames"]["total"]
        guards[name] = guards_per_entry()
        torch.manual_seed(0)
        kept[name] = (kept_bytes(m, fwd, batch), kept_bytes(m, m, batch))
        made[name] = (step, losses, warm_s)
    ms = {n: [] for n in settings}
    cpu = {n: [] for n in settings}
    for _ in range(steps):
        for n in settings:
            t0, c0 = time.perf_counter(), time.process_time()
            made[n][0]()
            ms[n].append((time.perf_counter() - t0) * 1e3)
            cpu[n].append((time.process_time() - c0) * 1e3)
    ratios = {n: [s / e for s, e in zip(ms[n], ms["eager"], strict=True)] for n in settings}
    cpu_ratios = {n: [s / e for s, e in zip(cpu[n], cpu["eager"], strict=True)] for n in settings}
    recs = []
    peaks = {n: peak_and_counts(made[n][0]) for n in settings}
    for n in settings:
        step, losses, warm_s = made[n]
        k, k_eager = kept[n]
        recs.append(
            {
                "case": f"compile_step/{family}/{size}",
                "provider": n,
                "backend": backend,
                "shapes": dict(
                    zip(("layers", "width", "vocab", "B", "T"), SIZES[size], strict=True)
                ),
                "dtype": "float32",
                "graph_breaks": breaks[n],
                "frames_compiled": frames[n],
                "guards": None if guards[n] is None else sum(guards[n]),
                "guards_per_entry": guards[n],
                "attention_dropout": model.config.attention_dropout
                if family == "llama"
                else model.config.attn_pdrop,
                "peak_bytes": peaks[n][0],
                "per_step": peaks[n][1],
                "kept_bytes": k,
                "kept_bytes_uncompiled": k_eager,
                "step_ms_median": statistics.median(ms[n]),
                "warmup_s": round(warm_s, 2),
                "ratio_median": statistics.median(ratios[n]),
                "ratio_spread": [min(ratios[n]), max(ratios[n])] if n != "eager" else None,
                "cpu_ms_median": statistics.median(cpu[n]),
                "cpu_ratio_median": statistics.median(cpu_ratios[n]),
                "first_loss": losses[0],
                "device": "cpu",
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "commit": _commit(),
                "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
        )
    return recs


def _commit() -> str | None:
    import subprocess

    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="gpt2,llama")
    ap.add_argument("--sizes", default="tiny,small")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--llama-attention-dropout",
        type=float,
        default=0.0,
        help="Llama's attention_dropout (default 0.0: the family's default)",
    )
    ap.add_argument(
        "--fast-loss",
        action="store_true",
        help="also step the model converted with ConvertConfig(fast_loss=True) (provider "
        "slimgrad_fast_loss)",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    if args.threads is not None:  # 1: no thread pool spinning against a loaded machine
        torch.set_num_threads(args.threads)
    for size in args.sizes.split(","):
        for fam in args.families.split(","):
            recs = run(
                fam, size, args.backend, args.steps, args.llama_attention_dropout, args.fast_loss
            )
            for r in recs:
                print(
                    f"{r['case']:28s} {r['provider']:9s} breaks {r['graph_breaks']:2d} "
                    f"frames {r['frames_compiled']} guards {r['guards']} {r['guards_per_entry']} "
                    f"per step {r['per_step']} "
                    f"peak {r['peak_bytes'] / MiB:8.2f} MiB  kept {r['kept_bytes']} B "
                    f"(uncompiled {r['kept_bytes_uncompiled']} B)  "
                    f"step {r['step_ms_median']:8.2f} ms  "
                    f"ratio {r['ratio_median']:.2f} (cpu {r['cpu_ratio_median']:.2f})  "
                    f"warmup {r['warmup_s']} s  "
                    f"loss0 {r['first_loss']:.6f}",
                    flush=True,
                )
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
