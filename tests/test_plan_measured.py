"""Planned = measured, per dtype and budget (issue 33, "Targets").

For HF Llama and GPT-2 (tiny configs, the families' defaults otherwise), in float32 and under bf16
autocast, at a low, a middle and a high budget of the plan's own curve (every pair of the three, in
6 rows): the model a user gets from ``slimgrad.convert_(model, plan=p)`` estimates at the plan's
peak and within the budget, and a real step of it, on a freshly built model whose parameters have no
``.grad`` yet (what ``estimate`` counts: the step allocates every gradient), measures within 1% of
``p.peak_bytes`` and within the budget. (A step measured after an earlier backward adds into
gradients that already exist: it peaked 0.94x the plan in float32 and 0.75x under bf16 autocast on
GPT-2, a gap of the measurement, not of the plan.)
"""

from __future__ import annotations

import warnings

import pytest
import torch

import slimgrad
import slimgrad.memory as sm

transformers = pytest.importorskip("transformers")

AMPS = {"fp32": None, "autocast_bf16": torch.bfloat16}


def _build(family: str):
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg).train()
    cfg = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).train()


def _make(family: str, amp, plan=None, kw=None):
    def make():
        m = _build(family)
        if plan is not None:
            slimgrad.convert_(m, plan=plan, **kw)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))

        def fwd():
            with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                return m(input_ids=ids, labels=ids).loss

        return fwd, m

    return make


# the choices on each model's hull (NOTE [How plan chooses], 3), as the search over every choice
# finds them: restricted to them, the greedy walks the same hull through the same measurements (a
# kind of four blocks measures each choice in a step of its own), so the curve, its budgets and
# the plans are those of the full search (checked when this list was made; the other choices are
# never on a curve here and cost an estimate each)
_HULL = {
    ("llama", "fp32"): ("lean", "lean+recompute"),
    ("llama", "autocast_bf16"): ("lean", "lean+sac", "lean+recompute"),
    ("gpt2", "fp32"): ("lean", "lean+sac", "lean+recompute:attn", "lean+recompute"),
    ("gpt2", "autocast_bf16"): ("lean", "lean+sac", "lean+recompute"),
}


@pytest.fixture(scope="module")
def tops():
    # one measured plan per family and dtype; each budget reuses its measurements
    cache = {}

    def get(family: str, dtype: str):
        if (family, dtype) not in cache:
            amp = AMPS[dtype]
            kw = {"dtype": amp} if amp else {}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cache[family, dtype] = slimgrad.plan(
                    _make(family, amp), "1TiB", verify=False, choices=_HULL[family, dtype], **kw
                )
        return cache[family, dtype]

    return get


def _budget(top, where: str) -> int:
    peaks = sorted(p.peak_bytes for p in top.curve)
    lo, hi = peaks[0], peaks[-1]
    return {"low": lo, "mid": (lo + hi) // 2, "high": hi}[where]


_APPLIED: dict[tuple, int] = {}
_REAL: dict[tuple, int] = {}  # a real step per plan: two budgets of one curve can plan the same

# 6 rows of the 12: every pair of family, dtype and budget
_ROWS = [
    ("llama", "fp32", "low"),
    ("llama", "fp32", "high"),
    ("llama", "autocast_bf16", "mid"),
    ("gpt2", "fp32", "mid"),
    ("gpt2", "autocast_bf16", "low"),
    ("gpt2", "autocast_bf16", "high"),
]


@pytest.mark.parametrize("family, dtype, where", _ROWS, ids=["-".join(r) for r in _ROWS])
def test_a_real_step_measures_the_plans_peak(tops, family, dtype, where):
    amp = AMPS[dtype]
    kw = {"dtype": amp} if amp else {}
    top = tops(family, dtype)
    budget = _budget(top, where)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = slimgrad.plan(_make(family, amp), budget, reuse=top, **kw)
        # the model convert_(plan=) makes, estimated whole once per plan (two budgets of one
        # curve can plan the same one)
        key = (family, dtype, tuple(sorted(p.choices.items())))
        if key not in _APPLIED:
            _APPLIED[key] = sm.estimate(_make(family, amp, p, kw)).peak_bytes
        applied = _APPLIED[key]
        # a real step of a fresh model from the same config: no .grad yet
        if key not in _REAL:
            fwd, model = _make(family, amp, p, kw)()
            assert all(q.grad is None for q in model.parameters())
            _REAL[key] = sm.measure(fwd, module=model, timeline=False).peak_bytes
        real = _REAL[key]
    assert p.verified and p.peak_bytes <= budget, (p.peak_bytes, budget)
    assert applied <= budget and abs(applied - p.peak_bytes) <= 0.01 * p.peak_bytes, (applied, p)
    assert real <= budget, (real, budget, p.choices)
    assert abs(real - p.peak_bytes) <= 0.01 * p.peak_bytes, (real, p.peak_bytes, p.choices)
