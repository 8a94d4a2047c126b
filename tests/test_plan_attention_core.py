"""The attention core recomputed alone (``lean+recompute:attention-core``, NOTE [The attention
core, recomputed] in slimgrad/attention_core.py): the bits of the lean model without recompute
(dropout on), estimated as measured, its FLOPs counted as FlopCounterMode counts SDPA's, nothing
outside the wrapped modules changed."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch

import slimgrad
import slimgrad.memory as sm
from slimgrad.plan import apply_choices

transformers = pytest.importorskip("transformers")

CORE = "lean+recompute:attention-core"
LAYERS = ("model.layers.0", "model.layers.1")


def _llama(impl: str, drop: float = 0.1):
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, attention_dropout=drop,
    )  # fmt: skip
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train(), torch.randint(0, 512, (2, 64))


def _step(model, ids, amp: bool):
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _applied(base, choice):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return apply_choices(copy.deepcopy(base), dict.fromkeys(LAYERS, choice))


@functools.cache
def _lean_step(impl: str, amp: bool):
    # the lean model's loss and gradients (dropout on), the reference of every recomputed row
    base, ids = _llama(impl)
    return _step(_applied(base, "lean"), ids, amp)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "autocast"])
def test_the_recomputed_core_gives_the_lean_models_bits(impl, amp):
    base, ids = _llama(impl)
    a = _applied(base, CORE)
    attn = a.model.layers[0].self_attn
    assert attn.config._attn_implementation == "slimgrad_core"
    calls = []
    inner = attn._slimgrad_core_inner
    attn._slimgrad_core_inner = lambda *x, **k: calls.append(x[1:4]) or inner(*x, **k)
    la, ga = _step(a, ids, amp)
    lb, gb = _lean_step(impl, amp)
    assert len(calls) == 2  # forward and the recompute in backward
    # NOTE [SDPA's autocast casts, before the checkpoint]: the checkpoint keeps SDPA's bfloat16
    # casts of q and k (float32 after RoPE), not the float32 tensors
    want = torch.bfloat16 if amp and impl == "sdpa" else torch.float32
    assert [t.dtype for t in calls[0][:2]] == [want, want]
    assert torch.equal(la, lb)
    for n, g in ga.items():
        assert torch.equal(g, gb[n]), n


def test_the_core_keeps_less_and_is_estimated_as_measured():
    # SDPA, float32, dropout on: the core's kept dropout mask and output are not kept
    def make(choice):
        def made():
            m, ids = _llama("sdpa")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                apply_choices(m, dict.fromkeys(LAYERS, choice))
            return (lambda: m(input_ids=ids, labels=ids, use_cache=False).loss), m

        return made

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lean = sm.estimate(make("lean"))
        core = sm.estimate(make(CORE))
        fwd, m = make(CORE)()
        fwd().backward()  # warm-up
        m.zero_grad(set_to_none=True)
        real = sm.measure(fwd)
    assert core.retained_bytes < lean.retained_bytes
    assert (real.peak_bytes, real.retained_bytes) == (core.peak_bytes, core.retained_bytes)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_the_core_is_a_plan_choice_with_the_cores_matmul_flops(impl):
    # a choice's recompute is what its backward runs more than lean's (NOTE [Recompute is counted,
    # not derived] in plan.py), counted with FlopCounterMode's formulas and CPU's fused SDPA as
    # CUDA's (it counted 0 before); at most the core's forward: QK^T and PV, 2 x 2 x B x H x T x
    # T x D per layer (the backward needs the probabilities, not PV)
    from slimgrad.bench.recompute_count import backward_counts

    def make():
        m, ids = _llama(impl)
        return (lambda: m(input_ids=ids, labels=ids, use_cache=False).loss), m

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the two choices read (a default choice: narrowing keeps only what is offered)
        p = slimgrad.plan(make, "1TiB", verify=False, choices=(CORE, "lean+recompute:self_attn"))
        lean = backward_counts(make, dict.fromkeys(LAYERS, "lean"))[1]

        def counted(c):
            return (backward_counts(make, dict.fromkeys(LAYERS, c))[1] - lean) // len(LAYERS)

        kind = p.blocks["model.layers.0"]
        flops = kind["recompute_flops"]
        assert 0 < flops[CORE] == counted(CORE) <= 4 * 2 * 4 * 64 * 64 * 16
        assert CORE in kind["kept_bytes"] and CORE not in kind["refused"]
        attn = "lean+recompute:self_attn"
        assert flops[CORE] < flops[attn] == counted(attn)


def test_only_the_wrapped_modules_change():
    base, ids = _llama("sdpa")
    cfg = base.config
    a = _applied(base, "lean")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_choices(a, {"model.layers.0": CORE}, convert=lambda m, **k: m)
    assert base.config is cfg and cfg._attn_implementation == "sdpa"
    assert a.model.layers[0].self_attn.config._attn_implementation == "slimgrad_core"
    assert a.model.layers[1].self_attn.config is a.config
    assert a.config._attn_implementation == "slimgrad"


def test_a_class_that_reads_its_implementation_is_refused():
    # GPT-2's attention compares config._attn_implementation with "eager": an unconverted eager
    # GPT-2 would take another branch under the new name
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32)
    cfg._attn_implementation = "eager"
    m = transformers.GPT2LMHeadModel(cfg)
    with pytest.raises(NotImplementedError, match=r"^slimgrad\.convert_: the attention core"):
        apply_choices(m, {"transformer.h.0": CORE}, convert=lambda m, **k: m)
    assert m.transformer.h[0].attn.config._attn_implementation == "eager"


def test_gpt2s_core_is_recomputed_with_the_lean_models_bits():
    # GPT2Attention compares its implementation with "eager": the SDPA model's ("slimgrad" once
    # converted) gives the same answer under the new name, so it wraps
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, attn_pdrop=0.1
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    base, ids = transformers.GPT2LMHeadModel(cfg).train(), torch.randint(0, 256, (2, 64))
    blocks = ("transformer.h.0", "transformer.h.1")
    out = []
    for choice in (CORE, "lean"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = apply_choices(copy.deepcopy(base), dict.fromkeys(blocks, choice))
        out.append((m.transformer.h[0].attn.config._attn_implementation, *_step(m, ids, False)))
    (name, la, ga), (_, lb, gb) = out
    assert name == "slimgrad_core"
    assert torch.equal(la, lb)
    for n, g in ga.items():
        assert torch.equal(g, gb[n]), n


@pytest.mark.parametrize("how", ["lean+recompute", "hf", CORE])
def test_checkpointed_eager_attention_runs_its_first_autocast_call(how, monkeypatch):
    # slimgrad's eager attention probes a new combination of dtypes at its first call (here:
    # float32 q, k and bfloat16 v under CPU autocast); inside a checkpointed region the probe's
    # saved tensors reached the checkpoint's hooks, which found fewer in the recompute
    # (CheckpointError: 35 saved vs 30), with HF's own gradient checkpointing too
    from slimgrad.convert_handlers import hf_attention

    monkeypatch.setattr(hf_attention, "_PROBES", {})
    base, ids = _llama("eager")
    if how == "hf":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a = slimgrad.convert_(copy.deepcopy(base))
        a.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        a = _applied(base, how)
    la, ga = _step(a, ids, True)
    lb, gb = _lean_step("eager", True)
    assert torch.equal(la, lb)
    for n, g in ga.items():
        assert torch.equal(g, gb[n]), n
