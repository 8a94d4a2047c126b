"""The gated MLP under a non-reentrant checkpoint leaves its down product until after its saves
(NOTE [The down product after the saves] in slimgrad/ops/gated_mlp.py): the checkpoint's recompute
stops before it, as before eager's ``F.linear``; the bits are those of the op without checkpoint,
and under other saved-tensor hooks (which may copy what they pack) the product stays in forward."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import slimgrad
from slimgrad.bench.recompute_count import BackwardCounts
from slimgrad.ops import gated_mlp, gated_mlp_fused
from tests import _gc_steps

G = importlib.import_module("slimgrad.ops.gated_mlp")


def _identity_hooks():
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def _step(fn, leaves, ckpt: bool, amp: bool):
    # one step of fn, under a non-reentrant checkpoint (the deferred product) or not
    for t in leaves:
        t.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        y = checkpoint(fn, use_reentrant=False) if ckpt else fn()
    w = torch.linspace(-1, 1, y.numel()).view(y.shape).to(y.dtype)
    (y * w).sum().backward()
    return y.detach().clone(), [t.grad.clone() for t in leaves]


def _case(shape, d, i, dtype, fused, down_bias, seed=0):
    g = torch.Generator().manual_seed(seed)

    def p(*s):
        return torch.nn.Parameter((torch.randn(*s, generator=g) * 0.2).to(dtype))

    x = torch.randn(*shape, d, generator=g).to(dtype).requires_grad_()
    wd, bd = p(d + 3, i), (p(d + 3) if down_bias else None)
    if fused:
        wgu = p(2 * i, d)
        return (lambda: gated_mlp_fused(x * 1, wgu, wd, down_bias=bd)), [x, wgu, wd, bd]
    wg, wu = p(i, d), p(i, d)
    return (lambda: gated_mlp(x * 1, wg, wu, wd, down_bias=bd)), [x, wg, wu, wd, bd]


@pytest.mark.parametrize("shape", [(7,), (2, 5), (1, 3, 4)])
@pytest.mark.parametrize("dtype,amp", [(torch.float32, False), (torch.bfloat16, False),
                                       (torch.float32, True)])  # fmt: skip
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("down_bias", [False, True])
def test_under_a_checkpoint_the_bits_are_the_ops_without_it(shape, dtype, amp, fused, down_bias):
    fn, leaves = _case(shape, 12, 20, dtype, fused, down_bias)
    leaves = [t for t in leaves if t is not None]
    plain = _step(fn, leaves, False, amp)
    hooked = _step(fn, leaves, True, amp)
    assert torch.equal(plain[0], hooked[0])
    for a, b in zip(plain[1], hooked[1], strict=True):
        assert torch.equal(a, b)


def _ckpt_flops(fn, leaves):
    # (backward matmul FLOPs without, with a non-reentrant checkpoint around ``fn``)
    out = []
    for ck in (False, True):
        for t in leaves:
            t.grad = None
        y = checkpoint(fn, use_reentrant=False) if ck else fn()
        with BackwardCounts() as c:
            y.sum().backward()
        out.append(c.matmul_flops)
    return out


@pytest.mark.parametrize("fused", [False, True])
def test_a_checkpoint_recomputes_the_projections_not_the_down_product(fused):
    n, d, i = 12, 16, 40
    fn, leaves = _case((n,), d, i, torch.float32, fused, False)
    plain, ck = _ckpt_flops(fn, [t for t in leaves if t is not None])
    assert ck - plain == 2 * (2 * n * d * i)  # gate and up (fused: one 2 I wide), not down
    # with a down bias the product stays in forward (F.linear's decomposition with a bias is
    # not the one mm): recomputed, as before
    fn, leaves = _case((n,), d, i, torch.float32, fused, True)
    plain, ck = _ckpt_flops(fn, [t for t in leaves if t is not None])
    assert ck - plain == 2 * (2 * n * d * i) + 2 * n * i * (d + 3)


def _llama(attn: str):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=88, vocab_size=64, max_position_embeddings=64,
    )  # fmt: skip
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()


@pytest.mark.parametrize("amp", [False, True])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_hf_llama_checkpointed_after_convert_recomputes_what_eager_does(amp, attn, monkeypatch):
    # issue 33: slimgrad + HF gradient checkpointing recomputed the MLP's down projection (a fifth
    # to a quarter of a layer's matmuls at Llama's shapes), which checkpointing alone does not
    base = _llama(attn)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    got = _gc_steps.steps(base, ids, amp)
    eager_recompute = _gc_steps.assert_recomputes_what_eager_does(got)
    # the converted gradients under checkpointing: the bits of the product left in forward
    monkeypatch.setattr(G, "_top_hooks", lambda _ignore_empty: None)
    monkeypatch.setattr(importlib.import_module("slimgrad.nn.gated_mlp"), "_top_hooks",
                        lambda _ignore_empty: None)  # fmt: skip
    m = copy.deepcopy(base)
    slimgrad.convert_(m)
    before = _gc_steps.counted_step(_gc_steps.checkpointed(m), ids, amp)
    assert before[0] - got[True, False][0] > eager_recompute  # the down product, recomputed
    for a, b in zip(before[1], got[True, True][1], strict=True):
        assert torch.equal(a, b)


def test_save_on_cpu_and_a_later_in_place_write_on_the_output():
    # the output is a plain tensor of the op's node: a caller's in-place write after the fill is
    # seen by autograd as on any output; under offloading hooks the bits are the hook-free op's
    fn, leaves = _case((2, 5), 12, 20, torch.float32, False, False)
    out = []
    for hooks in (False, True):
        for t in leaves[:4]:
            t.grad = None
        ctx = torch.autograd.graph.save_on_cpu() if hooks else _identity_hooks()
        with ctx:
            y = fn()
            y.mul_(2)  # a ReLU(inplace)-like consumer
            z = F.silu(y)
        z.sum().backward()
        out.append((z.detach(), [t.grad.clone() for t in leaves[:4]]))
    assert torch.equal(out[0][0], out[1][0])
    for a, b in zip(out[0][1], out[1][1], strict=True):
        assert torch.equal(a, b)


def _sac_policy(exact: bool):
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx, op, *args, **kwargs):
        saved = op is torch.ops.aten.mm.default if exact else op.overloadpacket is torch.ops.aten.mm
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("mutation", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_selective_checkpointing_past_the_mlp(exact, mutation, fused):
    # review: under torch's selective checkpointing (plan's lean+sac), a recompute that runs past
    # the MLP (a norm after it in the block saves its output) got back forward's y for the
    # deferred ``mm.out`` and left the new buffer unfilled: an error, or with
    # allow_cache_entry_mutation wrong gradients; a policy naming ``mm.default`` recomputed the
    # product. Under such a mode the product stays in forward: the gradients without checkpoint,
    # and nothing recomputed where the policy saves the products
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    fn, leaves = _case((6,), 16, 40, torch.float32, fused, False)
    leaves = [t for t in leaves if t is not None]
    ln = torch.randn(19, generator=torch.Generator().manual_seed(5)).requires_grad_()

    def block():
        return F.layer_norm(fn(), (19,), ln)

    ctx = functools.partial(
        create_selective_checkpoint_contexts,
        _sac_policy(exact),
        allow_cache_entry_mutation=mutation,
    )
    got = []
    for sac in (False, True):
        for t in [*leaves, ln]:
            t.grad = None
        y = checkpoint(block, use_reentrant=False, context_fn=ctx) if sac else block()
        with BackwardCounts() as c:
            y.pow(2).sum().backward()
        got.append((c.matmul_flops, [t.grad.clone() for t in [*leaves, ln]]))
    assert got[1][0] == got[0][0]  # every product saved: none recomputed
    for a, b in zip(got[0][1], got[1][1], strict=True):
        assert torch.equal(a, b)
