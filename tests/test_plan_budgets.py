"""slimgrad.plan against what a user would do instead (issue 33, "Targets"): at every budget it
recomputes less than plain checkpointing of the blocks needed to fit and than SAC; a budget too
low names the lowest reachable peak and its recompute; the baselines it composes are the full
estimates of those models (every block in one choice, the rest converted)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import slimgrad
import slimgrad.memory as sm
from slimgrad.plan import _estimate_with, _fmt, apply_choices
from tests import _plan_cache
from tests.test_plan import _make


@pytest.fixture(scope="module")
def top():
    return _plan_cache.toy()


def _unconverted(choices: dict) -> int:
    # the user's own model: nothing converted, the named blocks checkpointed (or SAC)
    def made():
        fwd, m = _make()()
        apply_choices(m, choices, convert=lambda m, **k: m)
        return fwd, m

    return sm.estimate(made).peak_bytes


def test_every_budget_recomputes_less_than_checkpointing_the_blocks_needed(top):
    blocks = list(top.choices)
    per_block = top.baselines["checkpoint-all"].recompute_flops // len(blocks)
    # plain checkpointing of the first k blocks (an early block's backward runs last)
    ckpt = [
        _unconverted(dict.fromkeys(blocks[:k], "eager+recompute")) for k in range(len(blocks) + 1)
    ]
    assert ckpt == sorted(ckpt, reverse=True)  # each block more checkpointed keeps less
    budgets = sorted({*ckpt, *((a + b) // 2 for a, b in zip(ckpt, ckpt[1:]))})
    checked = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for budget in budgets:
            k = next(k for k, peak in enumerate(ckpt) if peak <= budget)
            p = slimgrad.plan(_make(), budget, reuse=top)
            assert p.verified and p.peak_bytes <= budget
            # never more than checkpointing's k blocks; lower where slimgrad's lean blocks fit
            # with fewer recomputed (on this toy a block's finer choices, fc1 or fc2 alone, free
            # nothing, so where the budget needs k recomputed blocks the plan recomputes k)
            assert p.recompute_flops <= k * per_block, (budget, k, p.recompute_flops)
            checked += p.recompute_flops < k * per_block
    assert checked >= 2, checked


def test_at_sacs_peak_the_plan_recomputes_no_matmul(top):
    # SAC recomputes no matmul (and every elementwise op). On this toy it keeps less than the lean
    # blocks (393,216 B a block against 610,304): at its peak a plan of lean, eager and recomputed
    # blocks recomputes one block's matmuls; with lean+sac (a default choice: NOTE [Lean ops under
    # selective checkpointing]) none. Fails before lean+sac (an unknown choice)
    kept = top.blocks["blocks.0"]["kept_bytes"]
    assert kept["lean+sac"] <= kept["eager+sac"] < kept["lean"]
    assert top.blocks["blocks.0"]["recompute_flops"]["lean+sac"] == 0
    sac = _unconverted(dict.fromkeys(top.choices, "eager+sac"))
    without = ("eager", "lean", "lean+recompute", "eager+recompute")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = slimgrad.plan(_make(), sac, reuse=top)
        before = slimgrad.plan(_make(), sac, choices=without)
    assert default.verified and default.peak_bytes <= sac and before.peak_bytes <= sac
    assert default.recompute_flops == 0 < before.recompute_flops
    assert "lean+sac" in default.choices.values()
    # at a budget everything fits, nothing is recomputed: lean+sac never starts the curve
    assert set(top.choices.values()) == {"lean"} and top.curve[0].recompute_flops == 0


def _step(make, choices: dict, kw: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    fwd, m = make()
    apply_choices(m, choices, **kw)
    torch.manual_seed(123)
    loss = fwd()
    loss.backward()
    return loss.detach(), [p.grad for p in m.parameters()]


def _llama_tiny(attn: str, amp: bool):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256, attention_dropout=0.1,
    )  # fmt: skip
    cfg._attn_implementation = attn

    def make():
        torch.manual_seed(0)
        m = transformers.LlamaForCausalLM(cfg).train()
        ids = torch.randint(0, 256, (2, 32))

        def fwd():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                return m(input_ids=ids, labels=ids, use_cache=False).loss

        return fwd, m

    return make


@pytest.mark.parametrize(
    "case", ["toy", "llama-sdpa-fp32", "llama-sdpa-bf16", "llama-eager-fp32", "llama-eager-bf16"]
)
def test_lean_sac_gives_the_lean_models_bits(case):
    # NOTE [Lean ops under selective checkpointing]: the loss and every gradient torch.equal to
    # the lean model's, dropout on (the toy's 0.2, the Llama's attention dropout 0.1)
    if case == "toy":
        make, kw, blocks = _make(), {}, [f"blocks.{i}" for i in range(4)]
    else:
        _, attn, dt = case.split("-")
        make = _llama_tiny(attn, dt == "bf16")
        kw = {"dtype": torch.bfloat16} if dt == "bf16" else {}
        blocks = [f"model.layers.{i}" for i in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, grads = _step(make, dict.fromkeys(blocks, "lean"), kw)
        loss2, grads2 = _step(make, dict.fromkeys(blocks, "lean+sac"), kw)
    assert torch.equal(loss, loss2)
    assert len(grads) == len(grads2)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2, strict=True))


def test_a_budget_too_low_names_the_lowest_peak_and_its_recompute(top):
    budget = top.curve[-1].peak_bytes // 2
    with warnings.catch_warnings(), pytest.raises(ValueError) as e:
        warnings.simplefilter("ignore")
        slimgrad.plan(_make(), budget, reuse=top)
    msg = str(e.value)
    m = re.fullmatch(
        r"slimgrad\.plan: the budget is below the lowest peak this model can reach; expected a "
        r"budget of at least (.+) \(the applied plan's full estimate; recompute ([0-9.]+) x the "
        r"forward's matmul FLOPs\), got (.+)\. Raise the budget or shrink the batch\.",
        msg,
    )
    assert m is not None, msg
    assert m.group(3) == _fmt(budget)
    # the peak it names is the full estimate of the most recomputed plan (every block at its
    # hull's last point) or of the composed curve's lowest one, whichever is lower, and the cost
    # is that plan's
    blocks, _, kind_of, p0, allowed, fwd_flops = top._measured
    from slimgrad.plan import _Model, _walk

    composed = _Model(blocks, kind_of, p0, allowed)
    path = _walk(composed)
    lowest = min(path, key=lambda x: (composed.peak(x), composed.flops(x)))
    full = sorted(
        (_estimate_with(_make(), "t", "cpu", x, (), {}).peak_bytes, composed.flops(x) / fwd_flops)
        for x in (lowest, path[-1])
    )
    # the lower peak; of equal peaks, the lower recompute
    assert m.group(1) == _fmt(full[0][0])
    assert float(m.group(2)) == pytest.approx(full[0][1], abs=5e-4)


def _llama_big_head():
    # vocab 4096 against 64 wide: the head's bytes are a large part of the step's
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        num_hidden_layers=5, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=4096,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"

    def make():
        torch.manual_seed(0)
        m = transformers.LlamaForCausalLM(cfg).train()
        ids = torch.randint(0, 4096, (2, 128))

        def fwd():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return m(input_ids=ids, labels=ids, use_cache=False).loss

        return fwd, m

    return make


def test_the_composed_baselines_are_their_models_with_the_rest_converted():
    # NOTE [How plan chooses], 2: a plan's baselines compose every block in one choice with the
    # rest of the model converted, as every plan has it; they are those models' full estimates,
    # and the unconverted model (its own head) peaks above them
    make = _llama_big_head()
    kw = {"dtype": torch.bfloat16}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the two choices these baselines are made of (and the SAC baseline, always measured)
        top = slimgrad.plan(make, "1TiB", verify=False, choices=("eager", "eager+recompute"), **kw)
        blocks = list(top.choices)
        for label, c in (("eager", "eager"), ("checkpoint-all", "eager+recompute")):
            every = dict.fromkeys(blocks, c)
            rest_converted = _estimate_with(make, "t", "cpu", every, (), kw).peak_bytes
            composed = top.baselines[label].peak_bytes
            assert abs(composed - rest_converted) <= 0.01 * rest_converted, (label, composed)

            def unconverted(every=every):
                fwd, m = make()
                apply_choices(m, every, convert=lambda m, **k: m)
                return fwd, m

            assert sm.estimate(unconverted).peak_bytes > rest_converted, label
