"""The gated MLP's activation recomputed (``lean+recompute:mlp-activation``, NOTE [The MLP's
activation, recomputed] in slimgrad/plan.py): the lean model's bits, g and u kept where ``lean``
runs eager's ops (intermediate 18 < hidden 64: the op's backward peaks above eager's for one
block alone), chosen by the planner where it lowers the step's peak, planned = measured."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import slimgrad
import slimgrad.memory as sm
from slimgrad.nn.gated_mlp import GatedMLP
from slimgrad.plan import ACT, CHOICE_HELP, apply_choices

transformers = pytest.importorskip("transformers")

CHOICE = f"lean+recompute:{ACT}"
INTER = 18  # intermediate size


def _build(layers: int = 2, seq: int = 64, vocab: int = 32):
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=INTER, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train(), torch.randint(0, vocab, (2, seq))


def _applied(base, choice, layers=2):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = [f"model.layers.{i}" for i in range(layers)]
        return apply_choices(copy.deepcopy(base), dict.fromkeys(names, choice))


def _loss(model, ids, amp):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        return model(input_ids=ids, labels=ids, use_cache=False).loss


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "autocast"])
def test_the_recomputed_activation_gives_the_lean_models_bits_and_keeps_g_and_u(amp):
    base, ids = _build()
    a, b = _applied(base, CHOICE), _applied(base, "lean")
    mlp = a.model.layers[0].mlp
    assert isinstance(mlp, GatedMLP) and mlp.recompute_activation
    assert not b.model.layers[0].mlp.recompute_activation
    got = []
    for m in (a, b):
        loss = _loss(m, ids, amp)
        loss.backward()
        got.append((loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (la, ga), (lb, gb) = got
    assert torch.equal(la, lb)
    for n, g in ga.items():
        assert torch.equal(g, gb[n]), n
    # what the MLP (and its children) keeps: g and u in the matmuls' dtype (x is the norm's);
    # lean runs eager's ops here and keeps act(g), the product and (autocast) x's casts too
    s, n_tok = (2 if amp else 4), ids.numel()

    def kept(m):
        r = sm.measure(lambda: _loss(m, ids, amp), module=m)
        name = "model.layers.0.mlp"
        return sum(v for k, v in r.by_module.items() if k == name or k.startswith(name + "."))

    assert kept(a) == 2 * n_tok * INTER * s
    assert kept(b) > kept(a)


def test_not_offered_without_a_gated_mlp_and_refused_when_applied():
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return x + self.fc(x).relu()

    net = nn.Sequential(Block(), Block())
    with pytest.raises(ValueError, match=r"^slimgrad\.convert_: block '0' has no gated MLP"):
        apply_choices(net, {"0": CHOICE})

    def make():
        m = nn.Sequential(Block(), Block(), Block())
        x = torch.randn(4, 8)
        return (lambda: m(x).sum()), m

    # asked for by name, and still not offered: only lean (and the SAC baseline) is measured
    p = slimgrad.plan(make, "1TiB", verify=False, choices=("lean", CHOICE))
    assert CHOICE not in p.blocks["0"]["kept_bytes"] and "lean" in p.blocks["0"]["kept_bytes"]
    assert CHOICE not in p.blocks["0"]["refused"]  # not measured and refused: not offered
    assert CHOICE in CHOICE_HELP


def test_planned_where_it_lowers_the_peak_and_a_real_step_measures_the_plan():
    # 6 layers, 2 x 64 tokens: the kept activations set the peak at the start of backward;
    # each block's recomputed activation frees its act(g) and product (the op keeps g and u, the
    # norm keeps x), no matmul recomputed
    layers = 6

    def make():
        m, ids = _build(layers)
        return (lambda: m(input_ids=ids, labels=ids, use_cache=False).loss), m

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        top = slimgrad.plan(make, "1TiB", choices=("lean", CHOICE), verify=False)
        kept = top.blocks["model.layers.0"]["kept_bytes"]
        assert kept[CHOICE] < kept["lean"]
        budget = top.curve[-1].peak_bytes  # every block's activation recomputed
        assert budget < top.baselines["slimgrad"].peak_bytes
        p = slimgrad.plan(make, budget, reuse=top, choices=("lean", CHOICE))
        assert p.verified and p.peak_bytes <= budget and p.recompute_flops == 0
        assert CHOICE in p.choices.values()
        real, ids = _build(layers)
        slimgrad.convert_(real, plan=p)
        got = sm.measure(lambda: real(input_ids=ids, labels=ids, use_cache=False).loss)

        def make_applied():
            m, ids = _build(layers)
            slimgrad.convert_(m, plan=p)
            return (lambda: m(input_ids=ids, labels=ids, use_cache=False).loss), m

        est = sm.estimate(make_applied)
    assert got.peak_bytes == p.peak_bytes, (got.peak_bytes, p.peak_bytes)
    assert abs(est.peak_bytes - p.peak_bytes) <= 0.01 * p.peak_bytes
