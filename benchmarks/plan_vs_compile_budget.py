"""slimgrad.plan beside torch.compile's ``activation_memory_budget`` (issue 33): small HF Llama.

Issue 33's target: "on a compiled model where you can measure it, at least as low a peak as
``activation_memory_budget`` at the same recompute". For each budget fraction (default 1.0, 0.5,
0.2, 0.0), the model is compiled with inductor (CPU) under
``torch._functorch.config.activation_memory_budget`` (a private config: without it the script
stops with a message), and one training step (forward with labels, backward, SGD) is measured:

- ``peak_bytes``: torch's profiler with ``profile_memory=True`` over one step after warm-up, the
  largest running sum of CPU allocations and frees above what was live when the step began
  (``benchmarks/compile_step.py``'s ``peak_bytes``; slimgrad's tracker does not see inside
  inductor's code); ``.grad`` is cleared before the step, so gradients count;
- ``kept_bytes``: after forward, the unique storages the autograd graph holds, parameters
  excluded (``compile_step.kept_bytes``);
- ``recompute_flops``: matmul FLOPs (``mm``, ``bmm``, ``addmm``, ``baddbmm``: 2 M N K per
  product, from the shapes in the graphs inductor receives) of the compiled backward graph less
  the backward's at budget 1.0; ``forward_flops``: the forward graph's at 1.0.

Then :func:`slimgrad.plan` on the same model at a budget equal to each measured compiled peak,
the plan applied (``convert_(model, plan=plan)``, uncompiled) and its step measured the same
way (profiler peak, kept bytes), with the plan's own recompute FLOPs (matmul FLOPs its backward
recomputes). For reference, the uncompiled model and ``convert_`` alone (no recompute) measured
the same way. One JSON line per setting.

Usage (from the repository root; inductor compiles 4 graphs per budget, minutes on 2 cores):
    PYTHONPATH=src .venv/bin/python benchmarks/plan_vs_compile_budget.py \\
        --out benchmarks/results/plan_compile_budget.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from datetime import datetime, timezone

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_step import _commit, kept_bytes, peak_bytes  # noqa: E402

MiB = 2**20
LAYERS, WIDTH, INTER, VOCAB, B, T = 4, 128, 256, 2048, 2, 128
SHAPES = {"layers": LAYERS, "width": WIDTH, "intermediate": INTER, "vocab": VOCAB, "B": B, "T": T}
_MATMULS = ("mm", "bmm", "addmm", "baddbmm")


def _config():
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return cfg


def build() -> tuple[torch.nn.Module, dict]:
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config()).float().train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, VOCAB, (B, T), generator=g)
    return model, {"input_ids": ids, "labels": ids.clone()}


def matmul_flops(gm: torch.fx.GraphModule) -> int:
    """2 M N K summed over the graph's matrix products (shapes from the nodes' fake values)."""
    total = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(getattr(node.target, "overloadpacket", None), "__name__", "")
        if name not in _MATMULS:
            continue
        a, b = (node.args[1], node.args[2]) if name in ("addmm", "baddbmm") else node.args[:2]
        sa, sb = a.meta["val"].shape, b.meta["val"].shape
        batch = sa[0] if len(sa) == 3 else 1
        total += 2 * int(batch) * int(sa[-2]) * int(sa[-1]) * int(sb[-1])
    return total


def _step_fn(model, batch, fwd):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        fwd(**batch).loss.backward()
        opt.step()

    return step


def _measure(model, batch, fwd) -> dict:
    step = _step_fn(model, batch, fwd)
    for _ in range(2):
        step()
    torch.manual_seed(0)
    kept = kept_bytes(model, fwd, batch)
    return {"peak_bytes": peak_bytes(step), "kept_bytes": kept}


def compiled(budget: float) -> dict:
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    try:
        import torch._functorch.config as fconfig

        fconfig.activation_memory_budget  # noqa: B018 - the private config this case is about
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"this torch has no activation_memory_budget ({e!r})") from e
    flops = {"forward": 0, "backward": 0}

    def inner(gm, example_inputs, **kw):
        flops["backward" if kw.get("is_backward") else "forward"] += matmul_flops(gm)
        return compile_fx_inner(gm, example_inputs, **kw)

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, inner_compile=inner)

    model, batch = build()
    torch._dynamo.reset()
    # the autograd cache would skip inner_compile (and so the FLOP count) on a hit
    with fconfig.patch(activation_memory_budget=budget, enable_autograd_cache=False):
        fwd = torch.compile(model, backend=backend)
        out = _measure(model, batch, fwd)
    torch._dynamo.reset()
    return {**out, **{f"{k}_matmul_flops": v for k, v in flops.items()}}


def _make_forward():
    import transformers

    from slimgrad.profile import _target_make
    from slimgrad.targets import hf_target

    target = hf_target("llama", _config(), transformers.LlamaForCausalLM, "causal", T)
    return _target_make(target, B, None)


def planned(budget_bytes: int, reuse=None):
    import slimgrad

    try:
        plan = slimgrad.plan(_make_forward(), budget_bytes, reuse=reuse)
    except ValueError as e:  # below the lowest reachable peak: slimgrad's error says which
        return {"error": str(e).splitlines()[0]}, reuse
    model, batch = build()
    slimgrad.convert_(model, plan=plan)
    out = _measure(model, batch, model)
    return {
        **out,
        "plan_peak_bytes": plan.peak_bytes,
        "recompute_flops": plan.recompute_flops,
        "forward_flops": plan.forward_flops,
        "choices": sorted(
            {c: list(plan.choices.values()).count(c) for c in plan.choices.values()}.items()
        ),
    }, plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="1.0,0.5,0.2,0.0")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import slimgrad

    common = {
        "case": "plan_compile_budget/llama",
        "shapes": SHAPES,
        "dtype": "float32",
        "device": "cpu",
        "backend": "inductor",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "commit": _commit(),
    }
    recs = []
    model, batch = build()
    recs.append({"setting": "uncompiled", **_measure(model, batch, model)})
    model, batch = build()
    slimgrad.convert_(model)
    recs.append({"setting": "slimgrad (convert_)", **_measure(model, batch, model)})
    base = None
    top = None
    for b in (float(x) for x in args.budgets.split(",")):
        c = compiled(b)
        if base is None:
            base = c
        c["recompute_flops"] = c["backward_matmul_flops"] - base["backward_matmul_flops"]
        c["forward_flops"] = base["forward_matmul_flops"]
        recs.append({"setting": f"compiled budget {b}", "activation_memory_budget": b, **c})
        p, top = planned(c["peak_bytes"], reuse=top)
        recs.append({"setting": f"slimgrad.plan at compiled {b}'s peak",
                     "budget_bytes": c["peak_bytes"], **p})  # fmt: skip
        for r in recs[-2:]:
            print(json.dumps(r), flush=True)
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    for r in recs[:2]:
        print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for r in recs:
                f.write(json.dumps({**common, **r, "time": now}) + "\n")


if __name__ == "__main__":
    main()
