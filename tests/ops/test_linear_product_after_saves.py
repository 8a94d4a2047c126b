"""The converted Linear under autocast, and GPT-2's MLP, inside a non-reentrant checkpoint leave
their last product until after their saves (NOTE [A product after the saves under autocast] in
slimgrad/ops/linear.py, NOTE [c_proj's product after the saves] in slimgrad/ops/gpt2_mlp.py): the
checkpoint's recompute stops before it, as before eager's linear; the same bits; under other
saved-tensor hooks the product stays in forward."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from slimgrad.bench.recompute_count import BackwardCounts
from slimgrad.ops import conv1d_addmm, linear
from tests import _gc_steps


def _leaves(shape, n_in, n_out, bias, conv1d, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, n_in, generator=g).requires_grad_()
    w = torch.nn.Parameter(torch.randn(*((n_in, n_out) if conv1d else (n_out, n_in)), generator=g))
    b = torch.nn.Parameter(torch.randn(n_out, generator=g)) if bias else None
    return x, w, b


def _fn(x, w, b, conv1d):
    if conv1d:
        return lambda: conv1d_addmm(x * 1, w, b)
    return lambda: linear(x * 1, w, b)


def _step(fn, leaves, ckpt: bool):
    # one step of fn under bf16 autocast, in a non-reentrant checkpoint (deferred) or not
    for t in leaves:
        t.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = checkpoint(fn, use_reentrant=False) if ckpt else fn()
    w = torch.linspace(-1, 1, y.numel()).view(y.shape)
    (y.float() * w).sum().backward()
    return y.detach().clone(), [t.grad.clone() for t in leaves]


@pytest.mark.parametrize("shape", [(5,), (2, 3), (1, 2, 3)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("conv1d", [False, True])
def test_under_a_checkpoint_the_bits_are_the_ops_without_it(shape, bias, conv1d):
    x, w, b = _leaves(shape, 12, 7, bias, conv1d)
    leaves = [t for t in (x, w, b) if t is not None]
    fn = _fn(x, w, b, conv1d)
    plain, hooked = _step(fn, leaves, False), _step(fn, leaves, True)
    assert torch.equal(plain[0], hooked[0])
    for a, c in zip(plain[1], hooked[1], strict=True):
        assert torch.equal(a, c)


@pytest.mark.parametrize("conv1d", [False, True])
def test_a_checkpoint_ending_in_the_linear_does_not_recompute_its_product(conv1d):
    # issue 33 (a GPT-NeoX MLP under bf16 autocast recomputed its down projection under HF
    # gradient checkpointing: 1.44x eager's recomputed matmul FLOPs)
    n, d, o = 6, 16, 24
    x, w, b = _leaves((n,), d, o, True, conv1d)
    w0, b0 = _leaves((n,), d, d, True, False, seed=1)[1:]

    def block(t):
        h = torch.relu(linear(t, w0, b0))  # a product whose input is saved before it
        return conv1d_addmm(h, w, b) if conv1d else linear(h, w, b)

    flops = []
    for ck in (False, True):
        for t in (x, w, b, w0, b0):
            t.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = checkpoint(block, x * 1, use_reentrant=False) if ck else block(x * 1)
        with BackwardCounts() as c:
            y.float().sum().backward()
        flops.append(c.matmul_flops)
    assert flops[1] - flops[0] == 2 * n * d * d  # the first product only


@pytest.mark.parametrize("family", ["gpt_neox", "phi3"])
def test_hf_checkpointed_after_convert_under_autocast_recomputes_what_eager_does(family):
    # a 2-layer GPT-NeoX (its MLP: converted Linears around a GELU) and a Phi-3 small enough
    # that its MLP takes eager's ops on converted Linears, bf16 autocast, HF gradient
    # checkpointing after convert_: the recomputed matmul FLOPs (the step counted whole) are
    # eager's, and the gradients are those of the converted model without checkpointing

    transformers = pytest.importorskip("transformers")
    common = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128)
    if family == "gpt_neox":
        cfg = transformers.GPTNeoXConfig(**common, intermediate_size=256)
        cls = transformers.GPTNeoXForCausalLM
    else:
        cfg = transformers.Phi3Config(
            **common, intermediate_size=88, num_key_value_heads=2, pad_token_id=0
        )
        cls = transformers.Phi3ForCausalLM
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    base = cls(cfg).train()
    ids = torch.randint(1, 128, (2, 32), generator=torch.Generator().manual_seed(2))
    _gc_steps.assert_recomputes_what_eager_does(_gc_steps.steps(base, ids, True))


def test_no_output_features_and_a_broadcast_bias_under_a_checkpoint():
    # review: y.view(-1, 0) cannot infer its rows (an error where the call without hooks returns
    # a (3, 0) output); a bias F.linear broadcasts over more than one dim is not deferred
    for out_features, bias_shape in ((0, (0,)), (5, (3, 1, 5))):
        x, w, _ = _leaves((2, 3, 1), 8, out_features, False, False)
        b = torch.nn.Parameter(torch.randn(bias_shape))
        leaves = [x, w, b]
        fn = _fn(x, w, b, False)
        plain, hooked = _step(fn, leaves, False), _step(fn, leaves, True)
        assert torch.equal(plain[0], hooked[0])
        for a, c in zip(plain[1], hooked[1], strict=True):
            assert torch.equal(a, c)


def test_a_copying_pack_hook_sees_no_transient_of_the_product():
    # review: under a hook that copies what it packs, a product left until after the saves made
    # its weight cast (262,144 B here) beside the copy of x: one cast above the parent's peak,
    # level with eager's (whose autocast cache holds the cast through the region). Such hooks
    # get the product in forward
    from slimgrad.memory import measure

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 256, generator=g)
    w = torch.nn.Parameter(torch.randn(512, 256, generator=g) * 0.05)

    def step(op):
        def run():
            hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)
            with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
                return op(x, w).float().sum()

        return run

    slim = measure(step(linear), timeline=False).peak_bytes
    eager = measure(step(torch.nn.functional.linear), timeline=False).peak_bytes
    assert slim + 512 * 256 * 2 <= eager, (slim, eager)


@pytest.mark.parametrize("amp", [False, True])
def test_hf_gpt2_without_dropout_checkpointed_recomputes_what_eager_does(amp):
    # NOTE [c_proj's product after the saves] in ops/gpt2_mlp.py: GPT-2 at dropout 0 (no dropout
    # step after c_proj), HF gradient checkpointing after convert_, fp32 (the one-node MLP) and
    # bf16 autocast (its autocast node)

    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(1, 128, (2, 32), generator=torch.Generator().manual_seed(2))
    _gc_steps.assert_recomputes_what_eager_does(_gc_steps.steps(base, ids, amp))


@pytest.mark.parametrize("amp", [False, True])
@pytest.mark.parametrize("shape", [(40,), (2, 20), (1, 2, 20)])
def test_gpt2_mlp_without_dropout_deferred_or_not_the_same_bits(amp, shape, monkeypatch):
    # under the same checkpoint (whose hooks change the node's GELU path: NOTE [Output and side
    # information under saved-tensor hooks] in ops/_monotone.py), c_proj's product left until
    # after the saves or run in forward: the same output and gradients
    import importlib

    from slimgrad.ops.gpt2_mlp import gpt2_mlp

    mod = importlib.import_module("slimgrad.ops.gpt2_mlp")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, 16, generator=g).requires_grad_()
    ps = [torch.nn.Parameter(torch.randn(*s, generator=g) * 0.2) for s in
          ((16, 64), (64,), (64, 16), (16,))]  # fmt: skip
    leaves = [x, *ps]
    out = []
    for deferred in (False, True):
        if not deferred:  # the one node (fp32) and the per-op Conv1Ds (autocast)
            for m in (mod, importlib.import_module("slimgrad.ops.linear")):
                monkeypatch.setattr(m, "_top_hooks", lambda _ignore_empty: None)
        else:
            monkeypatch.undo()
        for t in leaves:
            t.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            y = checkpoint(lambda: gpt2_mlp(x * 1, *ps, p=0.0, training=True), use_reentrant=False)
        (y.float() * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum().backward()
        out.append((y.detach(), [t.grad.clone() for t in leaves]))
    assert torch.equal(out[0][0], out[1][0])
    for a, c in zip(out[0][1], out[1][1], strict=True):
        assert torch.equal(a, c)


@pytest.mark.parametrize("op", ["gated_mlp", "gpt2_mlp_frozen_proj"])
@pytest.mark.parametrize("amp", [False, True])
def test_a_copying_pack_hook_sees_the_parents_peak(op, amp, monkeypatch):
    # review: c_proj's input (the GELU output) waiting for a deferred product sat beside a cloning
    # pack hook's copies, one activation above the parent's peak (bf16 autocast; fp32 with c_proj's
    # weight frozen). Under such hooks the products run in forward: the peak with the deferral
    # switched off, to the byte
    import importlib

    from slimgrad.memory import measure
    from slimgrad.ops.gated_mlp import gated_mlp
    from slimgrad.ops.gpt2_mlp import gpt2_mlp

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g)
    if op == "gated_mlp":
        ws = [torch.nn.Parameter(torch.randn(*s, generator=g) * 0.1) for s in
              ((128, 64), (128, 64), (64, 128))]  # fmt: skip

        def call():
            return gated_mlp(x * 1, *ws)
    else:
        ws = [torch.nn.Parameter(torch.randn(*s, generator=g) * 0.1) for s in
              ((64, 256), (256,), (256, 64), (64,))]  # fmt: skip
        ws[2].requires_grad_(False)

        def call():
            return gpt2_mlp(x.requires_grad_() * 1, *ws, p=0.0, training=True)

    def step():
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)
        with hooks, torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            return call().float().sum()

    peaks = []
    for deferred in (True, False):
        if not deferred:
            for name in ("slimgrad.ops.linear", "slimgrad.ops.gated_mlp", "slimgrad.ops.gpt2_mlp"):
                monkeypatch.setattr(importlib.import_module(name), "_top_hooks", lambda _i: None)
        peaks.append(measure(step, timeline=False).peak_bytes)
    assert peaks[0] == peaks[1]
