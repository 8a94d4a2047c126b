"""HF GPT-2's attention output as one autograd node (ops/gpt2_attention.py; the forward in
convert_handlers/hf_attention.py; NOTEs [One node for GPT-2's attention output], [GPT-2's attention
output as one node]): the per-op converted path's loss, gradients and bytes, bit for bit."""

from __future__ import annotations

import contextlib
import copy
import io

import pytest
import torch
import torch.utils._python_dispatch

import slimgrad
import slimgrad.ops.gpt2_attention as oga
from slimgrad.convert_handlers.hf_attention import GPT2AttentionForward
from slimgrad.ops.gpt2_attention import gpt2_attention
from tests._counting import count_calls
from tests.ops._gpt2_helpers import assert_same_step, gpt2_model, gpt2_step, measure_step

transformers = pytest.importorskip("transformers")


@pytest.fixture
def count(monkeypatch):
    # how many calls took the one-node path
    return count_calls(monkeypatch, oga, "_GPT2_ATTENTION_APPLY")


def _hf_forward(model):
    # the per-op converted path: HF's own forward on every attention
    for m in model.modules():
        if isinstance(m.__dict__.get("forward"), GPT2AttentionForward):
            del m.__dict__["forward"]


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("frozen", [None, "c_attn", "c_proj", "c_proj_bias", "wte"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_bits_as_per_op(train, frozen, use_cache, count):
    model = gpt2_model()
    model.train(train)
    if frozen == "wte":
        model.transformer.wte.weight.requires_grad_(False)
    elif frozen is not None:
        for blk in model.transformer.h:
            p = {
                "c_attn": blk.attn.c_attn.weight,
                "c_proj": blk.attn.c_proj.weight,
                "c_proj_bias": blk.attn.c_proj.bias,
            }[frozen]
            p.requires_grad_(False)
    conv = slimgrad.convert_(copy.deepcopy(model))
    attn = conv.transformer.h[0].attn
    assert type(attn) is type(model.transformer.h[0].attn)  # HF's class, its own instance forward
    assert isinstance(attn.__dict__["forward"], GPT2AttentionForward)
    ids = torch.randint(0, 97, (2, 24))
    got = gpt2_step(conv, ids, use_cache=use_cache)
    assert count[0] == (2 if train else 0)  # both blocks ran the node in training
    per_op = copy.deepcopy(conv)
    _hf_forward(per_op)
    assert_same_step(got, gpt2_step(per_op, ids, use_cache=use_cache))
    assert conv.state_dict().keys() == model.state_dict().keys()


def test_tail_path_and_masks_as_per_op(count, monkeypatch):
    # a padded batch (HF builds a mask tensor) runs HF's forward; block_ok refused: the rest of
    # HF's forward after the split (the attention function, c_proj, resid_dropout)
    conv = slimgrad.convert_(gpt2_model())
    per_op = copy.deepcopy(conv)
    _hf_forward(per_op)
    ids = torch.randint(0, 97, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[0, :5] = 0
    assert_same_step(
        gpt2_step(conv, ids, attention_mask=mask), gpt2_step(per_op, ids, attention_mask=mask)
    )
    assert count[0] == 0
    monkeypatch.setattr(oga, "block_ok", lambda *a: False)
    assert_same_step(gpt2_step(conv, ids), gpt2_step(per_op, ids))
    assert count[0] == 0


def _args(seed=0, b=2, h=4, t=13, d=8):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, t, d, generator=g, requires_grad=True) for _ in range(3))
    w = torch.randn(h * d, 24, generator=g, requires_grad=True)
    bias = torch.randn(24, generator=g, requires_grad=True)
    return [q, k, v, w, bias]


@pytest.mark.parametrize("subset", [None, "qkv", "weights", "k"])
@pytest.mark.parametrize("t", [1, 13])
def test_functional_bits_and_subsets(subset, t, monkeypatch):
    args = _args(t=t)
    dy = torch.randn(2, t, 24, generator=torch.Generator().manual_seed(9))
    outs = []
    for node in (True, False):
        if not node:
            monkeypatch.setattr(oga, "block_ok", lambda *a: False)
        torch.manual_seed(1)
        y = gpt2_attention(*args, scaling=0.3, attn_p=0.2, resid_p=0.3)
        inputs = {None: args, "qkv": args[:3], "weights": args[3:], "k": args[1:2]}[subset]
        outs.append((y.detach(), torch.autograd.grad(y, inputs, dy)))
    (y, g), (y_p, g_p) = outs
    assert torch.equal(y, y_p)
    for a, b in zip(g, g_p, strict=True):
        assert torch.equal(a, b)


def test_functional_eval_and_errors():
    args = _args()
    y = gpt2_attention(*args, training=False)
    torch.testing.assert_close(
        y,
        torch.nn.functional.scaled_dot_product_attention(*args[:3], is_causal=True)
        .transpose(1, 2)
        .reshape(2, 13, 32)
        @ args[3]
        + args[4],
    )
    with pytest.raises(ValueError, match="slimgrad.ops.gpt2_attention"):
        gpt2_attention(*args, attn_p=1.5)
    with pytest.raises(ValueError, match="scaling must be >= 0"):
        gpt2_attention(*args, scaling=-1.0)


@pytest.mark.parametrize("width, tokens", [(32, 24), (64, 16)])
def test_memory_as_per_op_and_below_eager(width, tokens):
    # NOTE [One node for GPT-2's attention output]: the same saved bytes; the peak at most A's
    # bytes (4 B x tokens x width) above the per-op path's
    model = gpt2_model(width=width)
    conv = slimgrad.convert_(copy.deepcopy(model))
    per_op = copy.deepcopy(conv)
    _hf_forward(per_op)
    ids = torch.randint(0, 97, (2, tokens))

    measure_step(conv, ids)  # first-use caches
    measure_step(per_op, ids)
    node, ref, eager = measure_step(conv, ids), measure_step(per_op, ids), measure_step(model, ids)
    assert node.saved_bytes == ref.saved_bytes < eager.saved_bytes
    a_bytes = 4 * ids.numel() * width
    assert ref.peak_bytes <= node.peak_bytes <= ref.peak_bytes + a_bytes
    assert node.peak_bytes < eager.peak_bytes


def test_hf_forward_where_the_node_does_not_apply(count):
    conv = slimgrad.convert_(gpt2_model(layers=1))
    attn = conv.transformer.h[0].attn
    x = torch.randn(2, 24, 32, requires_grad=True)
    attn(x)
    assert count[0] == 1
    with torch.no_grad():
        attn(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attn(x)
    attn(x.detach())  # nothing before needs a gradient, the weights do: the node again
    assert count[0] == 2
    for child in ("c_proj", "resid_dropout"):
        h = getattr(attn, child).register_forward_hook(lambda m, i, o: None)
        attn(x)
        h.remove()
    h = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    attn(x)
    h.remove()
    assert count[0] == 2
    attn.resid_dropout.p = 0.0  # the per-op Dropout with p = 0 (HF's forward)
    attn(x)
    attn.resid_dropout.p = 0.1
    attn.eval()
    attn(x)
    attn.train()
    conv.config._attn_implementation = "sdpa"  # HF's attention again: HF's forward
    attn(x)
    assert count[0] == 2


def test_not_put_where_the_forward_is_not_hfs():
    model = gpt2_model(layers=2)
    blk0, blk1 = model.transformer.h
    blk0.attn.forward = lambda *a, **k: (a[0], None)  # a patched forward stays the user's

    class Mine(type(blk1.attn)):
        def forward(self, hidden_states, **kwargs):
            return super().forward(hidden_states, **kwargs)

    blk1.attn.__class__ = Mine
    slimgrad.convert_(model)
    assert not isinstance(blk0.attn.__dict__["forward"], GPT2AttentionForward)
    assert "forward" not in blk1.attn.__dict__
    assert not any(r[1] == "GPT2Attention.forward" for r in slimgrad.report(model).converted)


def test_report_and_copies(count):
    conv = slimgrad.convert_(gpt2_model())
    rows = [r for r in slimgrad.report(conv).converted if r[1] == "GPT2Attention.forward"]
    assert [r[0] for r in rows] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    ids = torch.randint(0, 97, (2, 24))
    ref = gpt2_step(conv, ids)
    buf = io.BytesIO()
    torch.save(conv, buf)
    buf.seek(0)
    for other in (copy.deepcopy(conv), torch.load(buf, weights_only=False)):
        fwd = other.transformer.h[0].attn.__dict__["forward"]
        assert fwd.module is other.transformer.h[0].attn  # its own module, not the original's
        assert_same_step(ref, gpt2_step(other, ids))
    assert count[0] == 6


def test_double_backward_refused():
    args = _args()
    y = gpt2_attention(*args)
    (gq,) = torch.autograd.grad(y.square().sum(), args[0], create_graph=True)
    with pytest.raises(RuntimeError, match="slimgrad.ops.gpt2_attention"):
        gq.sum().backward()


def test_checkpoint_and_saved_tensor_hooks(count):
    conv = slimgrad.convert_(gpt2_model(layers=1))
    attn = conv.transformer.h[0].attn
    x = torch.randn(2, 24, 32, requires_grad=True)
    dy = torch.randn(2, 24, 32)
    torch.manual_seed(2)
    ref = torch.autograd.grad(attn(x)[0], [x, *attn.parameters()], dy)
    packed = []

    def pack(t):
        packed.append(t)
        return t

    torch.manual_seed(2)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = attn(x)[0]
    assert packed  # what the node keeps goes through save_for_backward
    got = torch.autograd.grad(y, [x, *attn.parameters()], dy)
    torch.manual_seed(2)
    y = torch.utils.checkpoint.checkpoint(lambda t: attn(t)[0], x, use_reentrant=False)
    ck = torch.autograd.grad(y, [x, *attn.parameters()], dy)
    assert count[0] == 4  # the checkpoint's recompute too
    for a, b, c in zip(ref, got, ck, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_verify_passes():
    model = gpt2_model(layers=1)
    conv = slimgrad.convert_(copy.deepcopy(model))
    ids = torch.randint(0, 97, (2, 24))
    rep = slimgrad.verify(model, conv, {"input_ids": ids, "labels": ids})
    assert rep.ok, rep


class _Watching(torch.utils._python_dispatch.TorchDispatchMode):
    # a dispatch mode that only watches (as the memory tracker does): straight() is False under it;
    # it says it stores no result (NOTE [The fused loss under a mode that stores results]), so
    # the fused loss keeps its own path, as under the tracker
    _slimgrad_reads_ops = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_under_a_dispatch_mode_the_node_runs_its_general_steps_with_the_same_bits(count):
    # NOTE [GPT-2's attention node under dispatch modes]: the memory tracker and the estimate's
    # fake mode run the node as the unwatched step does (before: HF's per-op forward there)
    conv = slimgrad.convert_(gpt2_model())
    ids = torch.randint(0, 97, (2, 24))
    straight_step = gpt2_step(conv, ids)
    assert count[0] == 2
    with _Watching():
        watched = gpt2_step(conv, ids)
    assert count[0] == 4
    assert_same_step(straight_step, watched)
    per_op = copy.deepcopy(conv)
    _hf_forward(per_op)
    with _Watching():
        assert_same_step(watched, gpt2_step(per_op, ids))
    args = _args()
    dy = torch.randn(2, 13, 24, generator=torch.Generator().manual_seed(9))
    outs = []
    for mode in (None, _Watching()):
        torch.manual_seed(1)
        with mode or contextlib.nullcontext():
            y = gpt2_attention(*args, attn_p=0.2, resid_p=0.3)
            outs.append((y.detach(), torch.autograd.grad(y, args, dy)))
    assert count[0] == 6
    (y, g), (y_w, g_w) = outs
    assert torch.equal(y, y_w)
    for a, b in zip(g, g_w, strict=True):
        assert torch.equal(a, b)


def test_not_under_compile_functorch_or_a_trace(count):
    args = _args()
    torch.func.vjp(lambda q: gpt2_attention(q, *args[1:]), args[0])
    # a TorchScript trace: the per-op path, whose scores op refuses it
    with pytest.raises(RuntimeError, match="torch.jit.trace cannot record"):
        torch.jit.trace(lambda *a: gpt2_attention(*a), tuple(args), check_trace=False)
    assert count[0] == 0
    gpt2_attention(*args)
    assert count[0] == 1


def test_recomputed_block_with_the_cache_takes_the_node_again(count):
    # NOTE [GPT-2's attention after a second cache update]: GPT2Model passes the cache to the
    # block positionally, the recompute appends its keys a second time; before: the node in
    # forward, the per-op path in the recompute, torch's CheckpointError (metadata differ)
    import warnings

    from slimgrad.plan import apply_choices

    model = gpt2_model(layers=1)
    lean = slimgrad.convert_(copy.deepcopy(model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_choices(model, {"transformer.h.0": "lean+recompute"}, passed=(), api="test")
    ids = torch.randint(0, 97, (2, 24))
    got = gpt2_step(model, ids)
    assert count[0] == 2  # forward and recompute
    # the recomputed block runs without the cache (NOTE [A recomputed block does not write the KV
    # cache]), so its bits are a call's without one (eager's with and without differ by rounding)
    assert_same_step(gpt2_step(lean, ids, use_cache=False), got)
    assert count[0] == 3


@pytest.mark.parametrize("is_causal", [False, True])
def test_an_is_causal_keyword_runs_hfs_forward_with_its_values(is_causal, count):
    # HF passes an ``is_causal`` keyword on to the attention function, which honours it; the node
    # is causal exactly where T > 1: an explicit keyword runs HF's forward (the per-op path)
    conv = slimgrad.convert_(gpt2_model(layers=1))
    conv.train()
    attn = conv.transformer.h[0].attn
    per = copy.deepcopy(attn)
    _hf_forward(per)
    x = torch.randn(2, 7, 32)
    torch.manual_seed(5)
    a = attn(x, is_causal=is_causal)[0]
    torch.manual_seed(5)
    b = per(x, is_causal=is_causal)[0]
    assert torch.equal(a, b)
    assert count[0] == 0
