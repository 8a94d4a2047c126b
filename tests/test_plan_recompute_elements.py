"""slimgrad.plan against SAC in what SAC recomputes (issue 33, "at every budget, lower recompute
than SAC"). SAC (selective checkpointing saving every matmul/attention output) recomputes no
matmul FLOPs, and at SAC's peak the plan recomputes none either: equal in the planner's metric.
What SAC recomputes is every other op of every block; the plan's ``lean+sac`` blocks recompute
ops of that kind, its ``lean`` blocks none. Counted op by op in the backward
(``slimgrad.bench.recompute_count``): at SAC's peak and at every point of the curve at or above it,
the plan recomputes no more matmul FLOPs than SAC and strictly fewer elements; on the toy fewer also
than SAC of the very blocks the plan recomputes (on the Llama a lean+sac layer recomputes as many
elements as an eager+sac layer, up to the few that value-dependent side tables add or drop)."""

from __future__ import annotations

import warnings

import pytest
import torch

import slimgrad
from slimgrad.bench.recompute_count import BackwardCounts, backward_counts
from tests import _plan_cache
from tests.test_plan import _make
from tests.test_plan_budgets import _unconverted


def test_the_counter_counts_non_matmul_non_view_outputs_and_matmul_flops():
    a, b = torch.randn(3, 5), torch.randn(5, 7)
    with BackwardCounts() as c:
        y = a @ b  # 2 * 3 * 5 * 7 FLOPs, no elements
        z = y.relu()  # 21 elements
        z.view(7, 3).t()  # a view of a view: nothing
        z.sum(0)  # 7 elements
        z.add_(1)  # in place: 21 elements
    assert (c.elements, c.matmul_flops) == (21 + 7 + 21, 210)


def _counted_as_planned(make, blocks: list[str], flops: dict[str, int]) -> dict[str, int]:
    # every choice's recompute per block (``flops``) is what the backward of every block in it
    # runs more than every block in its plain choice; returns the plain choices' matmul FLOPs
    plain = {c: backward_counts(make, dict.fromkeys(blocks, c))[1] for c in ("lean", "eager")}
    for c, f in flops.items():
        got = backward_counts(make, dict.fromkeys(blocks, c))[1]
        assert got - plain["lean" if c.startswith("lean") else "eager"] == len(blocks) * f, c
    return plain


def test_the_plans_recompute_is_the_matmul_flops_its_backward_runs_more():
    # NOTE [Recompute is counted, not derived] in plan.py: a checkpointed block's recompute stops
    # once its backward has what it needs (fc2's product is saved by nothing: not recomputed), so
    # a choice's recompute is its backward's matmul FLOPs less the same block's without recompute
    top = _plan_cache.toy()
    blocks = list(top.choices)
    kind = top._measured[2][blocks[0]]
    make = _make()
    recomputing = [c for c in kind.flops if "recompute" in c]
    assert {"lean+recompute", "eager+recompute", "lean+recompute:fc2"} <= set(recomputing)
    plain = _counted_as_planned(make, blocks, kind.flops)
    # the whole block: fc1's forward product only (2 * 8 * 64 * 32 * 128 FLOPs), not fc2's
    assert kind.flops["lean+recompute"] == kind.flops["eager+recompute"] == 2 * 8 * 64 * 32 * 128
    assert top.baselines["checkpoint-all"].recompute_flops == 4 * kind.flops["eager+recompute"]
    # a mixed plan of the curve: its recompute is what its backward runs more than lean's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mid = slimgrad.plan(make, (top.curve[0].peak_bytes + top.curve[-1].peak_bytes) // 2,
                            reuse=top, verify=False)  # fmt: skip
    assert len(set(mid.choices.values())) > 1
    assert backward_counts(make, mid.choices)[1] - plain["lean"] == mid.recompute_flops > 0


def test_a_tiny_llamas_recompute_is_what_its_backward_runs_more():
    # every choice of a 2-layer HF Llama (no dropout: CPU's fused SDPA, whose FLOPs the planner
    # counts as CUDA's formula does; a kind of two blocks: measured as one pair), fp32 and with
    # choices= leaving the plain choices out (they are measured all the same)
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=64, max_position_embeddings=64,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"

    def make():
        torch.manual_seed(0)
        m = transformers.LlamaForCausalLM(cfg).train()
        ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(3))
        return (lambda: m(input_ids=ids, labels=ids, use_cache=False).loss), m

    blocks = ["model.layers.0", "model.layers.1"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        every = slimgrad.plan(make, "1TiB", verify=False)
        some = slimgrad.plan(make, "1TiB", verify=False, choices=("lean+recompute",))
    kind = every._measured[2][blocks[0]]
    assert {"lean+recompute:attention-core", "lean+recompute:mlp"} <= set(kind.flops)
    _counted_as_planned(make, blocks, kind.flops)
    # the lean layer's recompute stops where eager's does: before the down projection's product
    # (NOTE [The down product after the saves] in ops/gated_mlp.py; it ran it before)
    assert kind.flops["lean+recompute"] == kind.flops["eager+recompute"] > 0
    for c, f in some._measured[2][blocks[0]].flops.items():
        assert f == kind.flops[c], c


def _compare(make, blocks, top: slimgrad.Plan, sac_peak: int, kw: dict, same_blocks: bool) -> int:
    # returns how many of the budgets' plans recompute something (lean+sac blocks)
    def count(choices):
        return backward_counts(make, choices, **kw)

    lean = count(dict.fromkeys(blocks, "lean"))
    eager = count(dict.fromkeys(blocks, "eager"))
    sac = count(dict.fromkeys(blocks, "eager+sac"))
    sac_elements, sac_flops = sac[0] - eager[0], sac[1] - eager[1]
    assert sac_flops == 0 < sac_elements
    low = min(sac_peak, top.baselines["sac"].peak_bytes)
    budgets = sorted({sac_peak, top.baselines["sac"].peak_bytes} | {
        p.peak_bytes for p in top.curve if p.peak_bytes >= low
    })  # fmt: skip
    seen, recomputing = set(), 0
    for budget in budgets:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = slimgrad.plan(make, budget, reuse=top, **kw)
        assert p.verified and p.peak_bytes <= budget
        key = tuple(sorted(p.choices.items()))
        if key in seen:
            continue
        seen.add(key)
        got = count(p.choices)
        elements, flops = got[0] - lean[0], got[1] - lean[1]
        assert flops <= sac_flops and p.recompute_flops == 0, (budget, p.choices)
        assert elements < sac_elements, (budget, p.choices, elements, sac_elements)
        redone = [n for n, c in p.choices.items() if c not in ("lean", "eager")]
        recomputing += bool(redone)
        assert elements > 0 or not redone, (budget, p.choices, elements)
        if redone and same_blocks:
            # SAC of the very blocks the plan recomputes (the rest eager) recomputes more
            same = count({n: "eager+sac" if n in redone else "eager" for n in blocks})
            assert elements < same[0] - eager[0], (budget, p.choices, elements, same)
    return recomputing


def test_the_toy_recomputes_fewer_elements_than_sac():
    top = _plan_cache.toy()
    blocks = list(top.choices)
    sac_peak = _unconverted(dict.fromkeys(blocks, "eager+sac"))
    # at SAC's peak the plan is two lean+sac blocks and two lean (NOTE [Lean ops under selective
    # checkpointing]); one lean+sac block at the curve's point above it
    assert _compare(_make(), blocks, top, sac_peak, {}, same_blocks=True) >= 2


def test_a_tiny_llama_under_bf16_autocast_recomputes_fewer_elements_than_sac():
    transformers = pytest.importorskip("transformers")
    from slimgrad.memory import estimate
    from slimgrad.plan import apply_choices

    cfg = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=128, max_position_embeddings=128,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"

    def make():
        torch.manual_seed(0)
        m = transformers.LlamaForCausalLM(cfg).train()
        ids = torch.randint(0, 128, (2, 128), generator=torch.Generator().manual_seed(3))

        def fwd():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return m(input_ids=ids, labels=ids, use_cache=False).loss

        return fwd, m

    blocks = [f"model.layers.{i}" for i in range(4)]
    kw = {"dtype": torch.bfloat16}
    # the choices that recompute no matmul and can keep less than lean (what the curve holds at
    # and above SAC's peak with every choice allowed: lean, then lean+sac block by block)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        top = slimgrad.plan(make, "1TiB", verify=False, choices=("lean", "lean+sac"), **kw)

    def unconverted():
        fwd, m = make()
        apply_choices(m, dict.fromkeys(blocks, "eager+sac"), convert=lambda m, **k: m)
        return fwd, m

    # SAC's peak unconverted is above every lean layer's; with the rest converted (the planner's
    # SAC baseline) below it: there the plan takes one lean+sac layer
    assert _compare(make, blocks, top, estimate(unconverted).peak_bytes, kw, False) >= 1
