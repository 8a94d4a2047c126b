"""slimgrad.plan beside torch.compile's ``activation_memory_budget`` (issue 33): small HF models.

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
- ``recompute_flops``: matmul FLOPs (the planner's formulas: ``torch.utils.flop_counter``'s and
  CPU's fused SDPA, from the shapes in the graphs inductor receives) of the compiled backward
  graph less the backward's at budget 1.0; ``forward_flops``: the forward graph's at 1.0.

Then :func:`slimgrad.plan` on the same model at a budget equal to each measured compiled peak,
the plan applied (``convert_(model, plan=plan)``, uncompiled) and its step measured the same
way (profiler peak, kept bytes), with the plan's own recompute FLOPs (matmul FLOPs its backward
recomputes); and the plan at the lowest peak of its curve whose recompute is at most the
compiled model's (``... at compiled B's recompute``), measured the same way. For reference, the
uncompiled model and ``convert_`` alone (no recompute) measured the same way. One JSON line per
setting. Both recomputes count the same FLOPs (records before the ``--model`` option counted
the compiled graphs' ``mm``/``bmm``/``addmm``/``baddbmm`` alone).

Models (``--model``; random init, fp32, sdpa attention): ``llama`` (4 layers x 128, intermediate
256, vocab 2048, 2 x 128 tokens: the logits and the loss set its peak), ``llama-long`` (8 x 128,
intermediate 344, vocab 512, 2 x 512 tokens) and ``gpt2`` (6 x 128, vocab 512, 2 x 256 tokens,
dropout 0.1: GPT-2's default), whose blocks' saved tensors set the peak.

Usage (from the repository root; inductor compiles 4 graphs per budget, minutes on 2 cores):
    PYTHONPATH=src .venv/bin/python benchmarks/plan_vs_compile_budget.py --model llama-long \\
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

# name -> (family, layers, width, intermediate (Llama), vocab, B, T): "llama" is the first record's
# model, whose peak the logits and the loss set; "llama-long" and "gpt2" are activation-bound
# (the blocks' saved tensors set the peak), GPT-2 at its default dropout (0.1)
MODELS = {
    "llama": ("llama", 4, 128, 256, 2048, 2, 128),
    "llama-long": ("llama", 8, 128, 344, 512, 2, 512),
    "gpt2": ("gpt2", 6, 128, None, 512, 2, 256),
}
KEYS = ("layers", "width", "intermediate", "vocab", "B", "T")
_model = "llama"  # set by main (--model)


def _shapes() -> dict:
    return dict(zip(KEYS, MODELS[_model][1:], strict=True))


def _config():
    import transformers

    fam, layers, width, inter, vocab, _, t = MODELS[_model]
    if fam == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=vocab, n_embd=width, n_layer=layers, n_head=4, n_positions=t
        )
        cls = transformers.GPT2LMHeadModel
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=width, intermediate_size=inter,
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=t,
        )  # fmt: skip
        cls = transformers.LlamaForCausalLM
    cfg._attn_implementation = "sdpa"
    return cfg, cls


def build() -> tuple[torch.nn.Module, dict]:
    cfg, cls = _config()
    *_, vocab, b, t = MODELS[_model]
    torch.manual_seed(0)
    model = cls(cfg).float().train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, vocab, (b, t), generator=g)
    # use_cache=False as the planner's target (slimgrad.targets.hf_target) steps it: no K/V cache
    return model, {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


def matmul_flops(gm: torch.fx.GraphModule) -> int:
    """The graph's matmul FLOPs by the planner's formulas (``torch.utils.flop_counter``'s and
    CPU's fused SDPA: NOTE [Recompute is counted, not derived] in slimgrad/plan.py), on the
    nodes' fake values."""
    from torch.utils._pytree import tree_map

    from slimgrad.plan import _flop_formulas

    formulas = _flop_formulas()
    total = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        f = formulas.get(getattr(node.target, "overloadpacket", None))
        if f is None:
            continue

        def val(a):
            return a.meta["val"] if isinstance(a, torch.fx.Node) else a

        args, kwargs = tree_map(val, node.args), tree_map(val, node.kwargs)
        total += f(*args, **kwargs, out_val=node.meta["val"])
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
    from slimgrad.profile import _target_make
    from slimgrad.targets import hf_target

    cfg, cls = _config()
    fam, *_, b, t = MODELS[_model]
    return _target_make(hf_target(fam, cfg, cls, "causal", t), b, None)


def planned(budget_bytes: int, reuse=None, most_recompute: int | None = None):
    """(the plan at ``budget_bytes`` applied and measured, the plan); with ``most_recompute``,
    ({}, plan) where the plan recomputes more than that (not measured)."""
    import slimgrad

    try:
        plan = slimgrad.plan(_make_forward(), budget_bytes, reuse=reuse)
    except ValueError as e:  # below the lowest reachable peak: slimgrad's error says which
        return {"error": str(e).splitlines()[0]}, reuse
    if most_recompute is not None and plan.recompute_flops > most_recompute:
        return {}, plan
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
    ap.add_argument("--model", default="llama", choices=list(MODELS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    global _model
    _model = args.model
    warnings.filterwarnings("ignore")
    import slimgrad

    common = {
        "case": f"plan_compile_budget/{args.model}",
        "shapes": _shapes(),
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
        # the other side of the same comparison: the lowest peak the plan's curve reaches at no
        # more recompute than the compiled model's (the plan made at that point's peak and
        # measured the same way). The curve's peaks are composed, a plan's are whole-model
        # estimates (NOTE [How plan chooses] in slimgrad/plan.py): where the plan made at a
        # point's peak recomputes more than the compiled model, the next point up is tried
        n = len(recs)
        if top is not None:
            fits = [q for q in top.curve if q.recompute_flops <= c["recompute_flops"]]
            for at in sorted(fits, key=lambda q: q.peak_bytes):
                q, top = planned(at.peak_bytes, reuse=top, most_recompute=c["recompute_flops"])
                if "peak_bytes" in q:
                    recs.append({"setting": f"slimgrad.plan at compiled {b}'s recompute",
                                 "budget_bytes": at.peak_bytes, **q})  # fmt: skip
                    break
        for r in recs[n - 2 :]:
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
