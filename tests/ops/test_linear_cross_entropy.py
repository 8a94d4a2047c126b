"""Fused linear + cross-entropy against F.cross_entropy(F.linear(...)), memory contract, reuse."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slimgrad import ownership
from slimgrad.kernels import _backend
from slimgrad.memory import measure
from slimgrad.ops.linear_cross_entropy import (
    causal_lm_loss,
    default_chunk_size,
)
from slimgrad.ops.linear_cross_entropy import (
    linear_cross_entropy as _lce,
)
from slimgrad.testing import OpObserver, assert_within_rule


def linear_cross_entropy(*args, precompute_grads=True, **kwargs):
    # most tests here exercise the precomputed-gradient path; the default (memory-first) recompute
    # path is tested by the *_default_* tests, 'none' and N < H
    return _lce(*args, precompute_grads=precompute_grads, **kwargs)


@pytest.fixture(autouse=True)
def _reuse_on(monkeypatch):
    # these tests assert that reuse happens: a developer's SLIMGRAD_NO_REUSE=1 must not leak in
    monkeypatch.delenv("SLIMGRAD_NO_REUSE", raising=False)


V, H = 37, 11  # prime vocabulary, odd hidden size


def _data(n=13, v=V, h=H, dtype=torch.float32, lead=None, n_ignored=2, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    shape = (n,) if lead is None else lead
    hid = torch.randn(*shape, h, generator=g, dtype=torch.float64).to(device, dtype)
    w = (torch.randn(v, h, generator=g, dtype=torch.float64) * 0.5).to(device, dtype)
    b = torch.randn(v, generator=g, dtype=torch.float64).to(device, dtype)
    t = torch.randint(0, v, shape, generator=g)
    flat = t.view(-1)
    flat[torch.randperm(flat.numel(), generator=g)[:n_ignored]] = -100
    return hid, w, b, t.to(device)


def _eager(h, w, t, b, **kw):
    return F.cross_entropy(F.linear(h, w, b).reshape(-1, w.shape[0]), t.reshape(-1), **kw)


def _run(fn, hid, w, b, t, gout=None, **kw):
    h = hid.clone().requires_grad_()
    w = w.clone().requires_grad_()
    b = b.clone().requires_grad_() if b is not None else None
    out = fn(h, w, t, b, **kw)
    if kw.get("reduction") == "none" and fn is _eager:
        out = out.reshape(t.shape)
    out.backward(gout if gout is not None else torch.ones_like(out))
    return [out.detach(), h.grad, w.grad] + ([b.grad] if b is not None else [])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chunk", [1, 4, 13, 64, None])
def test_matches_eager(device, reduction, eps, bias, chunk):
    hid, w, b, t = _data(device=device)
    b = b if bias else None
    gout = torch.randn(t.shape, device=device) if reduction == "none" else None
    kw = dict(reduction=reduction, label_smoothing=eps)
    ref = _run(_eager, hid, w, b, t, gout, **kw)
    got = _run(linear_cross_entropy, hid, w, b, t, gout, chunk_size=chunk, **kw)
    for r, o in zip(ref, got, strict=True):
        torch.testing.assert_close(o, r)


def test_batched_leading_dims():
    hid, w, b, t = _data(lead=(3, 5))
    for red in ("mean", "none"):
        ref = _run(_eager, hid, w, b, t, reduction=red)
        got = _run(linear_cross_entropy, hid, w, b, t, reduction=red, chunk_size=4)
        assert got[0].shape == ref[0].shape
        for r, o in zip(ref, got, strict=True):
            torch.testing.assert_close(o, r)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gradcheck_float64(reduction):
    hid, w, b, t = _data(n=5, v=7, h=3, dtype=torch.float64, n_ignored=1)
    h = hid.requires_grad_()
    w.requires_grad_()
    b.requires_grad_()

    def f(h, w, b):
        return linear_cross_entropy(
            h, w, t, b, label_smoothing=0.2, reduction=reduction, chunk_size=2
        )

    assert torch.autograd.gradcheck(f, (h, w, b))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_all_ignored_matches_torch(reduction, eps):
    hid, w, b, t = _data(n=6)
    t = torch.full_like(t, -100)
    kw = dict(reduction=reduction, label_smoothing=eps)
    ref = _run(_eager, hid, w, b, t, **kw)
    got = _run(linear_cross_entropy, hid, w, b, t, chunk_size=4, **kw)
    if reduction == "mean":
        assert torch.isnan(got[0]) and torch.isnan(ref[0])
    for r, o in zip(ref, got, strict=True):
        torch.testing.assert_close(o, r, equal_nan=True)


def test_custom_ignore_index():
    hid, w, b, t = _data(n_ignored=0)
    t[2] = 5
    t[9] = 5
    ref = _run(_eager, hid, w, b, t, ignore_index=5)
    got = _run(linear_cross_entropy, hid, w, b, t, ignore_index=5, chunk_size=3)
    for r, o in zip(ref, got, strict=True):
        torch.testing.assert_close(o, r)


@pytest.mark.parametrize("which", [0, 1, 2])
def test_backward_inputs_subsets(which):
    hid, w, b, t = _data()
    leaves = [hid.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()]
    ref_leaves = [x.detach().clone().requires_grad_() for x in leaves]
    linear_cross_entropy(leaves[0], leaves[1], t, leaves[2], chunk_size=4).backward(
        inputs=[leaves[which]]
    )
    _eager(ref_leaves[0], ref_leaves[1], t, ref_leaves[2]).backward(inputs=[ref_leaves[which]])
    for i, (x, r) in enumerate(zip(leaves, ref_leaves, strict=True)):
        if i == which:
            torch.testing.assert_close(x.grad, r.grad)
        else:
            assert x.grad is None


def test_bf16_autocast_within_rule():
    hid, w, b, t = _data(n=29, v=53, h=16)
    ref64 = _run(_eager, hid.double(), w.double(), b.double(), t, label_smoothing=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = _run(_eager, hid, w, b, t, label_smoothing=0.1)
        got = _run(linear_cross_entropy, hid, w, b, t, label_smoothing=0.1, chunk_size=8)
    for o, e in zip(got, eager, strict=True):
        assert o.dtype == e.dtype
    assert_within_rule(got, ref64, eager, atol=1e-2, names=["loss", "dh", "dW", "db"])


def test_bf16_inputs_within_rule():
    hid, w, b, t = _data(n=29, v=53, h=16)
    ref64 = _run(_eager, hid.double(), w.double(), b.double(), t)
    lo = [x.bfloat16() for x in (hid, w, b)]
    eager = _run(_eager, lo[0], lo[1], lo[2], t)
    got = _run(linear_cross_entropy, lo[0], lo[1], lo[2], t, chunk_size=8)
    assert got[0].dtype == torch.bfloat16
    assert_within_rule(got, ref64, eager, atol=1e-2, names=["loss", "dh", "dW", "db"])


def test_tied_weight_accumulates_into_embedding():
    torch.manual_seed(3)
    emb = torch.nn.Embedding(V, H)
    ids = torch.randint(0, V, (2, 7))
    labels = torch.randint(0, V, (2, 7))
    grads = []
    for fn in (_eager, linear_cross_entropy):
        emb.zero_grad(set_to_none=True)
        hs = torch.tanh(emb(ids) * 1.5)
        fn(hs, emb.weight, labels, None).backward()
        grads.append(emb.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0])


def test_memory_contract_saved_and_peak():
    n, h, v = 64, 32, 1001
    hid, w, b, t = _data(n=n, v=v, h=h)
    x0 = hid.requires_grad_()
    w.requires_grad_()

    ms = measure(lambda: linear_cross_entropy(x0 * 1, w, t, chunk_size=16))
    me = measure(lambda: _eager(x0 * 1, w, t, None))
    # 'mean': forward computes the gradients and keeps dh (N x H, like the hidden it replaces) and
    # dW (V x H, parameter-sized, float32); hidden, lse, target and W are not kept
    assert ms.saved_bytes == n * h * 4 + v * h * 4
    # (+ 8: the int64 scalar ``1`` of ``x0 * 1``, kept by MulBackward0 and made outside dispatch)
    assert ms.saved_input_bytes == 8
    assert me.saved_input_bytes == v * h * 4 + n * 8 + 8
    # eager keeps the N x V log-probabilities on top of the hidden
    assert me.saved_bytes >= n * h * 4 + n * v * 4
    assert ms.peak_bytes < me.peak_bytes
    assert ms.forward_peak_bytes < me.forward_peak_bytes


def test_memory_contract_reduction_none_recomputes():
    # per-token grad_output is unknown in forward: keeps hidden + lse, recomputes in backward
    n, h, v = 64, 32, 1001
    hid, w, b, t = _data(n=n, v=v, h=h)
    x0 = hid.requires_grad_()
    w.requires_grad_()
    gout = torch.randn(n)
    ms = measure(
        lambda: linear_cross_entropy(x0 * 1, w, t, reduction="none", chunk_size=16), grad=gout
    )
    me = measure(lambda: _eager(x0 * 1, w, t, None, reduction="none"), grad=gout)
    assert ms.saved_bytes == n * h * 4 + n * 4
    assert ms.saved_input_bytes == me.saved_input_bytes == v * h * 4 + n * 8 + 8
    assert ms.peak_bytes < me.peak_bytes


def test_memory_contract_weight_only_and_no_grad():
    n, h, v = 40, 16, 257
    hid, w, b, t = _data(n=n, v=v, h=h)
    w.requires_grad_()
    b.requires_grad_()
    # hidden needs no grad: no dh is computed or kept; dW (float32) + db
    ms = measure(lambda: linear_cross_entropy(hid * 1, w, t, b, chunk_size=8, reduction="sum"))
    assert ms.saved_bytes == v * h * 4 + v * 4
    with torch.no_grad():
        loss = linear_cross_entropy(hid, w, t, b, chunk_size=8)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, _eager(hid, w, t, b))


def test_estimate_under_fake_tensors_matches_measure():
    from slimgrad.memory import estimate

    n, h, v = 24, 16, 131

    def make():
        hid, w, b, t = _data(n=n, v=v, h=h)
        x0 = hid.requires_grad_()
        w.requires_grad_()
        return lambda: linear_cross_entropy(x0 * 1, w, t, chunk_size=8)

    fake, real = estimate(make), measure(make())
    assert fake.saved_bytes == real.saved_bytes == n * h * 4 + v * h * 4


class _CountLogitMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matmuls whose output is a logits chunk, (rows, V) or transposed (V, rows)."""

    # stores no result (NOTE [The fused loss under a mode that stores results]): the loss keeps
    # its own path under it
    _slimgrad_reads_ops = True

    def __init__(self, v, h=H):
        super().__init__()
        self.v, self.h, self.n = v, h, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # mm.out: the row-wise backward's logits go into one buffer (NOTE [One logits buffer for
        # the vocabulary blocks])
        mm = (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default)
        if func in mm and out.dim() == 2 and self.v in out.shape and self.h not in out.shape:
            self.n += 1
        return out


@pytest.mark.parametrize("reduction, per_chunk", [("mean", 1), ("sum", 1), ("none", 2)])
def test_logits_computed_once_per_chunk(reduction, per_chunk):
    # 'mean'/'sum': 3 big matmuls like eager (logits, dh, dW); 'none' recomputes the logits
    hid, w, b, t = _data(n=13)
    h = hid.clone().requires_grad_()
    w.requires_grad_()
    with _CountLogitMatmuls(V) as c:
        out = linear_cross_entropy(h, w, t, b, reduction=reduction, chunk_size=4)
        out.sum().backward()
    assert c.n == 4 * per_chunk  # ceil(13 / 4) chunks


def test_few_tokens_keep_the_recompute_path():
    # N < H: dW (V x H) would outweigh eager's N x V log-probs, so hidden + lse are kept instead
    n, h, v = 12, 32, 211
    hid, w, b, t = _data(n=n, v=v, h=h)
    x0 = hid.requires_grad_()
    w.requires_grad_()
    ms = measure(lambda: linear_cross_entropy(x0 * 1, w, t, chunk_size=4))
    assert ms.saved_bytes == n * h * 4 + n * 4
    with _CountLogitMatmuls(v, h) as c:
        linear_cross_entropy(x0 * 1, w, t, chunk_size=4).backward()
    assert c.n == 2 * 3
    # without a weight gradient there is no dW to keep: forward computes dh (N x H) only
    w.requires_grad_(False)
    ms = measure(lambda: linear_cross_entropy(x0 * 1, w, t, chunk_size=4))
    assert ms.saved_bytes == n * h * 4


def test_weight_grad_buffer_reused_when_owned():
    hid, w, b, t = _data()
    h, w2 = hid.clone().requires_grad_(), w.clone().requires_grad_()
    ownership.reset_reuse_count()
    linear_cross_entropy(h.sin(), w2, t, chunk_size=4).backward()
    assert ownership.reuse_count("saved") == 2  # dh and dW
    ref = _run(_eager, hid.sin(), w, None, t)
    torch.testing.assert_close(w2.grad, ref[2])
    torch.testing.assert_close(h.grad, ref[1] * hid.cos())


def test_non_contiguous_hidden():
    # a (T, B, H) -> (B, T, H) transposed hidden: reshape(-1, H) inside copies; dh keeps its shape
    hid, w, b, t = _data(lead=(5, 3))
    hid_t = hid.transpose(0, 1)  # (3, 5, H), non-contiguous
    tt = t.transpose(0, 1)
    hid_cm = hid.reshape(-1, H).t().contiguous().t()  # (15, H), column-major
    for hh, th in ((hid_t, tt), (hid_cm, t.reshape(-1))):
        for red in ("mean", "sum"):
            ref = _run(_eager, hh, w, b, th, reduction=red)
            got = _run(linear_cross_entropy, hh, w, b, th, reduction=red, chunk_size=4)
            for r, o in zip(ref, got, strict=True):
                torch.testing.assert_close(o, r)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_scaled_grad_output_and_repeated_backward(reduction):
    # backward scales the saved gradients by grad_output, out of place under retain_graph
    hid, w, b, t = _data()
    ref = _run(_eager, hid, w, b, t, torch.tensor(-2.5), reduction=reduction)
    h, w2, b2 = (x.clone().requires_grad_() for x in (hid, w, b))
    out = linear_cross_entropy(h, w2, t, b2, reduction=reduction, chunk_size=4)
    out.backward(torch.tensor(-1.5), retain_graph=True)
    out.backward(torch.tensor(-1.0))
    for r, o in zip(ref, [out.detach(), h.grad, w2.grad, b2.grad], strict=True):
        torch.testing.assert_close(o, r)


@pytest.mark.parametrize("view", [False, True])
def test_reuse_is_bitwise_and_counted(view):
    # view: the hidden is a full view of its base, like HF's last_hidden_state = ln_f(x).view(...)
    hid, w, b, t = _data(n=17)
    wt = torch.randn(t.shape)
    outs, counts = [], []
    for disabled in (True, False):
        h = hid.clone().requires_grad_()
        w2 = w.clone().requires_grad_()
        ownership.reset_reuse_count()
        with ownership.reuse_disabled() if disabled else torch.enable_grad():
            hs = h.sin().view(1, 17, H) if view else h.sin()
            tt = t.view(1, 17) if view else t
            out = linear_cross_entropy(hs, w2, tt, reduction="none", chunk_size=4)
            del hs
            loss = (out * wt.view_as(out)).sum()
            loss.backward()
        outs.append((h.grad, w2.grad))
        counts.append((ownership.reuse_count("grad"), ownership.reuse_count("saved")))
    assert counts == [(0, 0), (1, 1)]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("holder", ["user", "other_node"])
def test_hidden_held_elsewhere_is_not_overwritten(holder, reduction):
    # 'none' keeps the hidden (and must not overwrite it); 'mean' keeps only its own dh
    hid, w, b, t = _data(n=13)
    x = hid.clone().requires_grad_()
    ownership.reset_reuse_count()
    hs = x.sin()
    other = hs.pow(2).sum()  # PowBackward keeps hs; it runs after our node
    loss = linear_cross_entropy(hs, w, t, chunk_size=4, reduction=reduction).sum() + other
    if holder == "other_node":
        del hs  # only autograd's two savers remain
    loss.backward()
    assert ownership.reuse_count("saved") == (1 if reduction == "mean" else 0)
    if holder == "user":
        assert torch.equal(hs, hid.sin())  # the caller's tensor is intact
    x2 = hid.clone().requires_grad_()
    hs2 = x2.sin()
    (_eager(hs2, w, t, None, reduction=reduction).sum() + hs2.pow(2).sum()).backward()
    torch.testing.assert_close(x.grad, x2.grad)


@pytest.mark.parametrize("n", [9, 13])  # 9 < H: recompute path (saved hidden); 13: saved dh
def test_retain_graph_keeps_saved_hidden_and_second_backward_raises_after_reuse(n):
    hid, w, b, t = _data(n=n)
    x = hid.clone().requires_grad_()
    ownership.reset_reuse_count()
    loss = linear_cross_entropy(x.sin(), w, t, chunk_size=4)
    loss.backward(retain_graph=True)
    g1 = x.grad.clone()
    loss.backward()
    assert ownership.reuse_count("saved") == 1  # the second (last) backward may reuse
    torch.testing.assert_close(x.grad, 2 * g1)
    with pytest.raises(RuntimeError, match="backward ran a second time"):
        loss.backward()


def test_causal_lm_loss_matches_hf():
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    hid, w, b, _ = _data(lead=(2, 9))
    labels = torch.randint(0, V, (2, 9))
    labels[0, :3] = -100
    for nib in (None, torch.tensor(11)):
        h1 = hid.clone().requires_grad_()
        ref = loss_utils.ForCausalLMLoss(F.linear(h1, w), labels, V, num_items_in_batch=nib)
        ref.backward()
        h2 = hid.clone().requires_grad_()
        got = causal_lm_loss(h2, w, labels, num_items_in_batch=nib, chunk_size=5)
        got.backward()
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, ref)
        torch.testing.assert_close(h2.grad, h1.grad)


def test_causal_lm_loss_on_tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_embd=16,
        n_layer=1,
        n_head=2,
        vocab_size=61,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 61, (2, 7))
    ref = model(ids, labels=ids).loss
    ref.backward()
    ref_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    hs = model.transformer(ids).last_hidden_state
    got = causal_lm_loss(hs, model.lm_head.weight, ids)
    got.backward()
    torch.testing.assert_close(got, ref)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[k], msg=k)


def test_default_chunk_size():
    assert default_chunk_size(1024, 768, 50257) == 256  # ceil(2^23 / 50257) = 167 -> pow2
    assert default_chunk_size(1 << 20, 1024, 1 << 12) == 1 << 18  # Liger: N / ceil(V / H)
    assert default_chunk_size(5, 8, 3) == 5  # never more than N
    assert default_chunk_size(0, 8, 3) == 1


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(reduction="avg"), ValueError, "unknown reduction"),
        (dict(label_smoothing=1.5), ValueError, "label_smoothing out of range"),
        (dict(chunk_size=0), ValueError, "chunk_size must be a positive int"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    hid, w, b, t = _data()
    with pytest.raises(exc, match=f"slimgrad.ops.linear_cross_entropy: {match}"):
        linear_cross_entropy(hid, w, t, **kwargs)


def test_bad_shapes_and_types():
    hid, w, b, t = _data()
    with pytest.raises(ValueError, match="shapes do not match"):
        linear_cross_entropy(hid, w[:, :5], t)
    with pytest.raises(ValueError, match="target shape"):
        linear_cross_entropy(hid, w, t[:3])
    with pytest.raises(TypeError, match="target must be class indices"):
        linear_cross_entropy(hid, w, t.float())
    with pytest.raises(TypeError, match="dtypes differ"):
        linear_cross_entropy(hid.double(), w, t)
    t2 = t.clone()
    t2[0] = V
    with pytest.raises(ValueError, match="target out of range"):
        linear_cross_entropy(hid, w, t2)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_compile_aot_eager(reduction):
    # torch 2.11: a scalar loss returned through a no-op .to() got all-zero gradients
    hid, w, b, t = _data()
    torch._dynamo.reset()
    f = torch.compile(linear_cross_entropy, backend="aot_eager", fullgraph=True)
    kw = dict(label_smoothing=0.1, reduction=reduction)
    gout = torch.full(t.shape, 0.7) if reduction == "none" else torch.tensor(0.7)
    ref = _run(_eager, hid, w, b, t, gout, **kw)
    got = _run(f, hid, w, b, t, gout, chunk_size=4, **kw)
    for r, o in zip(ref, got, strict=True):
        torch.testing.assert_close(o, r)


def test_double_backward_refused_clearly():
    # first derivatives under create_graph=True are eager's; differentiating them raises a
    # slimgrad error (never a silent None)
    hid, w, b, t = _data()
    h = hid.clone().requires_grad_()
    wr = w.clone().requires_grad_()
    loss = linear_cross_entropy(h, wr, t)
    gh, gw = torch.autograd.grad(loss, (h, wr), create_graph=True)
    h2, w2 = hid.clone().requires_grad_(), w.clone().requires_grad_()
    ref = torch.autograd.grad(torch.nn.functional.cross_entropy(h2 @ w2.T, t), (h2, w2))
    torch.testing.assert_close(gh.detach(), ref[0])
    torch.testing.assert_close(gw.detach(), ref[1])
    with pytest.raises(RuntimeError, match="slimgrad.ops.linear_cross_entropy: a second"):
        (gh.square().sum() + gw.square().sum()).backward()


def test_forced_overwrite_of_a_shared_hidden_is_caught_by_autograd(monkeypatch):
    # Safety net behind the ownership predicate: if it ever granted a shared hidden, the write bumps
    # the version counter and the other saver fails loudly instead of reading dh as its input.
    monkeypatch.setattr(ownership, "_saved_ok", lambda *args: True)
    hid, w, b, t = _data(n=9)
    x = hid.clone().requires_grad_()
    hs = x.sin()
    other = hs.pow(2).sum()  # PowBackward saves hs; runs after our node
    # reduction='none' keeps the hidden ('mean'/'sum' keep only their own dh)
    loss = linear_cross_entropy(hs, w, t, chunk_size=4, reduction="none").sum() + other
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_bench_case_small_agrees_with_eager():
    from slimgrad.bench.cases.linear_cross_entropy import _grads, build

    eager, slim, make_inputs = build("cpu", torch.float32, small=True)
    x, target = make_inputs()
    ref, got = _grads(eager, x, target), _grads(slim, x, target)
    assert len(ref) == len(got) == 4  # loss, ln_f weight/bias, lm_head weight
    for r, o in zip(ref, got, strict=True):
        torch.testing.assert_close(o, r)


def test_memory_contract_under_bf16_autocast():
    n, h, v = 48, 32, 509
    hid, w, b, t = _data(n=n, v=v, h=h)
    x0 = hid.requires_grad_()
    w.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ms = measure(lambda: linear_cross_entropy(x0 * 1, w, t, chunk_size=16))
        me = measure(lambda: _eager(x0 * 1, w, t, None))
    # ours: dh in bf16 (the compute dtype) + dW in float32; no weight copy is kept
    assert ms.saved_bytes == n * h * 2 + v * h * 4
    assert me.saved_bytes >= n * v * 4 + v * h * 2  # eager keeps fp32 log-probs + bf16 W
    assert ms.saved_bytes < me.saved_bytes
    assert ms.peak_bytes < me.peak_bytes


def test_default_mean_path_keeps_hidden_and_lse_only():
    n, h, v = 64, 32, 1001
    hid = torch.randn(n, h)
    w = torch.randn(v, h, requires_grad=True)
    t = torch.randint(0, v, (n,))
    x0 = hid.requires_grad_()
    m = measure(lambda: _lce(x0 * 1, w, t, chunk_size=16))  # precompute_grads=False
    assert m.saved_bytes == n * h * 4 + n * 4  # hidden (created in the step) + float32 lse
    ref = F.cross_entropy(F.linear(x0.detach().double(), w.detach().double()), t)
    got = _lce(x0, w, t, chunk_size=16)
    torch.testing.assert_close(got.double(), ref)


def test_dh_is_reusable_by_the_op_before(monkeypatch):
    # default (recompute) path: dh comes back in hidden's shape (not a view of an (N, H) result):
    # the layer_norm before the head may write its dx into it; bitwise the same as reuse off
    import contextlib

    from slimgrad.ops.layer_norm import layer_norm

    monkeypatch.delenv("SLIMGRAD_NO_REUSE", raising=False)
    hid, w, b, t = _data(n=13)
    grads, counts = [], []
    for reuse in (True, False):
        h, wt = hid.clone().reshape(1, 13, H).requires_grad_(), w.clone().requires_grad_()
        ownership.reset_reuse_count()
        with ownership.reuse_disabled() if not reuse else contextlib.nullcontext():
            y = layer_norm(h * 1, (H,))
            (_lce(y, wt, t.reshape(1, 13), b, chunk_size=4) * 1).backward()
        grads.append((h.grad, wt.grad))
        counts.append(ownership.reuse_count("grad"))
    assert counts[1] == 0 and counts[0] >= 1
    for a, c in zip(*grads, strict=True):
        assert torch.equal(a, c)


@pytest.mark.parametrize("retain", [False, True])
@pytest.mark.parametrize("views_refused", [False, True])
@pytest.mark.parametrize("lead", [(13,), (1, 13)])
def test_precomputed_dh_is_reusable_by_the_op_before(monkeypatch, lead, views_refused, retain):
    # precompute_grads=True: dh comes back as a plain tensor of hidden's shape (the saved dh when
    # ownership grants it, else a fresh one under retain_graph), never a view of an (N, H) buffer:
    # the layer_norm before the head writes its dx into it even where view gradients are refused
    # (ownership's term 2b off); bitwise the same as reuse off
    import contextlib

    from slimgrad.ops.layer_norm import layer_norm

    monkeypatch.delenv("SLIMGRAD_NO_REUSE", raising=False)
    if views_refused:
        monkeypatch.setattr(ownership, "_VIEW_SIG", None)
    hid, w, b, t = _data(n=13)
    grads, counts = [], []
    for reuse in (True, False):
        h, wt = hid.clone().reshape(*lead, H).requires_grad_(), w.clone().requires_grad_()
        ptr = {}
        ownership.reset_reuse_count()
        with ownership.reuse_disabled() if not reuse else contextlib.nullcontext():
            x1 = h * 1
            x1.register_hook(lambda g, ptr=ptr: ptr.__setitem__("dx", g.data_ptr()))
            y = layer_norm(x1, (H,))
            y.register_hook(lambda g, ptr=ptr: ptr.__setitem__("dy", (g.data_ptr(), g._base)))
            loss = _lce(y, wt, t.reshape(lead), b, chunk_size=4, precompute_grads=True) * 1
            loss.backward(retain_graph=retain)
        grads.append((h.grad, wt.grad))
        counts.append((ownership.reuse_count("grad"), ownership.reuse_count("saved")))
        assert ptr["dy"][1] is None  # not a view
        assert (ptr["dx"] == ptr["dy"][0]) == reuse  # layer_norm's dx written into dh
    assert counts == [(1, 0 if retain else 2), (0, 0)]  # layer_norm's reuse; dh and dW
    for a, c in zip(*grads, strict=True):
        assert torch.equal(a, c)


# NOTE [Logit transforms]: logit_scale and logit_softcap are elementwise on each chunk's logits


def _eager_tf(h, w, t, b, scale=1.0, cap=None, **kw):
    z = F.linear(h, w, b) * scale
    if cap is not None:
        z = torch.tanh(z / cap) * cap
    return F.cross_entropy(z.reshape(-1, w.shape[0]), t.reshape(-1), **kw)


_TRANSFORMS = [(0.37, None), (1.0, 0.9), (2.5, 1.7)]


@pytest.mark.parametrize("precompute", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("scale,cap", _TRANSFORMS)
def test_logit_transforms_gradcheck_float64(precompute, reduction, scale, cap):
    hid, w, b, t = _data(n=5, v=7, h=3, dtype=torch.float64, n_ignored=1)

    def ours(h, w, t, b, **kw):
        return _lce(h, w, t, b, **kw, chunk_size=2, precompute_grads=precompute,
                    logit_scale=scale, logit_softcap=cap)  # fmt: skip

    def f(h, w, b):
        return ours(h, w, t, b, label_smoothing=0.2, reduction=reduction)

    inputs = [x.clone().requires_grad_() for x in (hid, w, b)]
    assert torch.autograd.gradcheck(f, inputs)
    kw = dict(label_smoothing=0.2, reduction=reduction)
    gout = torch.randn(t.shape, dtype=torch.float64) if reduction == "none" else None
    ref = _run(lambda *a, **k: _eager_tf(*a, scale, cap, **k), hid, w, b, t, gout, **kw)
    got = _run(ours, hid, w, b, t, gout, **kw)
    for r, o in zip(ref, got, strict=True):
        torch.testing.assert_close(o, r.reshape(o.shape))


@pytest.mark.parametrize("precompute", [True, False])
@pytest.mark.parametrize("scale,cap", _TRANSFORMS)
def test_logit_transforms_float32_within_rule(precompute, scale, cap):
    hid, w, b, t = _data(n=29, v=V, h=H)
    h64, w64, b64 = hid.double(), w.double(), b.double()
    ref = _run(lambda *a, **k: _eager_tf(*a, scale, cap, **k), h64, w64, b64, t)
    eager = _run(lambda *a, **k: _eager_tf(*a, scale, cap, **k), hid, w, b, t)
    got = _run(
        lambda *a, **k: _lce(*a, **k, chunk_size=8, precompute_grads=precompute,
                             logit_scale=scale, logit_softcap=cap),  # fmt: skip
        hid, w, b, t,
    )  # fmt: skip
    assert_within_rule(got, ref, eager, names=["loss", "dh", "dW", "db"])


def test_logit_transforms_keep_the_memory_contract():
    # the transform lives in each chunk: what is saved for backward does not change
    n, h, v = 64, 32, 1001
    hid, w, b, t = _data(n=n, v=v, h=h)
    x0 = hid.requires_grad_()
    w.requires_grad_()
    for pre in (True, False):
        plain = measure(lambda p=pre: _lce(x0 * 1, w, t, chunk_size=16, precompute_grads=p))
        tf = measure(
            lambda p=pre: _lce(
                x0 * 1, w, t, chunk_size=16, precompute_grads=p, logit_scale=0.5, logit_softcap=3.0
            )  # fmt: skip
        )
        assert tf.saved_bytes == plain.saved_bytes


def test_causal_lm_loss_with_softcap_matches_hf():
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    hid, w, b, t = _data(lead=(2, 9))
    labels = t.clone()
    labels[0, :2] = -100
    h = hid.clone().requires_grad_()
    z = torch.tanh(F.linear(h, w) * 0.5 / 2.0) * 2.0
    ref = loss_utils.ForCausalLMLoss(z, labels, V, num_items_in_batch=torch.tensor(5))
    got = causal_lm_loss(hid, w, labels, num_items_in_batch=torch.tensor(5), logit_scale=0.5,
                         logit_softcap=2.0)  # fmt: skip
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(logit_scale="2"), TypeError, "logit_scale must be a number"),
        (dict(logit_scale=float("inf")), ValueError, "logit_scale must be finite"),
        (dict(logit_softcap=0.0), ValueError, "logit_softcap must be a positive finite"),
        (dict(logit_softcap=-1.0), ValueError, "logit_softcap must be a positive finite"),
    ],
)
def test_bad_logit_transforms(kwargs, exc, match):
    hid, w, b, t = _data()
    with pytest.raises(exc, match=f"slimgrad.ops.linear_cross_entropy: {match}"):
        linear_cross_entropy(hid, w, t, **kwargs)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_func_transforms_and_jit_trace(reduction):
    # Issue 15: torch.func transforms run eager's cross_entropy(linear(...)); torch.jit.trace
    # refuses clearly.
    from torch.func import grad, vmap

    torch.manual_seed(0)
    h, w, t = torch.randn(3, 4, 6), torch.randn(7, 6), torch.randint(0, 7, (3, 4))
    t[0, 0] = -100

    def eager(h, w, t):
        z = torch.tanh(F.linear(h, w) * 0.5 / 3.0) * 3.0
        out = F.cross_entropy(z.reshape(-1, 7), t.reshape(-1), reduction=reduction,
                              label_smoothing=0.1)  # fmt: skip
        return out.reshape(t.shape) if reduction == "none" else out

    def ours(h, w, t):
        return linear_cross_entropy(h, w, t, reduction=reduction, label_smoothing=0.1,
                                    logit_scale=0.5, logit_softcap=3.0)  # fmt: skip

    torch.testing.assert_close(
        grad(lambda h, w: ours(h, w, t).sum(), argnums=(0, 1))(h, w),
        grad(lambda h, w: eager(h, w, t).sum(), argnums=(0, 1))(h, w),
    )
    torch.testing.assert_close(
        vmap(ours, (0, None, 0))(h, w, t), vmap(eager, (0, None, 0))(h, w, t)
    )
    with pytest.raises(RuntimeError, match="slimgrad.ops.linear_cross_entropy: torch.jit"):
        torch.jit.trace(lambda h: ours(h, w, t), h.requires_grad_())


def test_host_calls_per_call():
    # issue 32: the HF causal loss at the tiny GPT-2 shape (1x16 tokens, 64 wide, V = 1000), its
    # forward through the C apply with the chunk size kept per shape, its backward without the
    # no-op casts: calls of and from slimgrad's code, counted, not timed (110 forward and 91
    # backward before)
    from slimgrad.ops.linear_cross_entropy import causal_lm_loss
    from tests._host_calls import slimgrad_calls

    torch.manual_seed(0)
    h0 = torch.randn(1, 16, 64)
    w = torch.randn(1000, 64, requires_grad=True)
    labels = torch.randint(0, 1000, (1, 16))
    box = []

    def forward():
        h = h0.clone().requires_grad_()
        box[:] = [causal_lm_loss(h * 1, w, labels)]

    forward()
    box[0].backward()
    assert slimgrad_calls(forward) <= 61
    assert slimgrad_calls(box[0].backward) <= 70


# NOTE [Label range without a host sync]: the labels are checked where the chunks read them


class _OpNames(OpObserver):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def see(self, func, args, kwargs) -> None:
        self.names.append(str(func))


@pytest.mark.parametrize("precompute", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_labels_are_not_read_back_to_the_host(precompute, reduction):
    # a step asks nothing of the labels' values on the host (on CUDA: no sync); before, every
    # call ran any() and read it back (aten._local_scalar_dense)
    hid, w, b, t = _data(n=64)
    h = hid.clone().requires_grad_()
    kw = dict(reduction=reduction, precompute_grads=precompute, chunk_size=16)
    _lce(h, w, t, **kw).sum().backward()  # one-time set-up
    with _OpNames() as ops:
        _lce(h, w, t, **kw).sum().backward()
    assert "aten._local_scalar_dense.default" not in ops.names
    assert "aten.any.default" not in ops.names


@pytest.mark.parametrize("precompute", [False, True])
@pytest.mark.parametrize("chunk", [None, 4])
@pytest.mark.parametrize("bad", [V, V + 5, -1, -7])
def test_label_out_of_range_is_slimgrads_error(precompute, chunk, bad):
    # above V or negative (and not ignore_index), in the first chunk or a later one: slimgrad's
    # ValueError naming the label (eager on CPU: "Target ... is out of bounds")
    hid, w, b, t = _data()
    for pos in (0, t.numel() - 1):
        t2 = t.clone()
        t2[pos] = bad
        with pytest.raises(ValueError, match=f"target out of range.*got {bad}\\.") as err:
            _lce(hid.requires_grad_(), w, t2, b, chunk_size=chunk, precompute_grads=precompute)
        if _backend.get_backend() in _backend.NO_TRITON_OFF_CUDA:
            # named after the chunk's gather refused it, not by a check up front
            assert isinstance(err.value.__cause__, RuntimeError)
        with pytest.raises(IndexError):  # eager refuses it too
            F.cross_entropy(F.linear(hid, w, b), t2)


@pytest.mark.parametrize("ignore_index", [-100, -1, 0, 5])
def test_ignore_index_anywhere_is_no_error(ignore_index):
    # ignore_index is no label: negative, or a class of its own, it counts nothing and raises
    # nothing; the other labels still must be in range
    hid, w, b, t = _data()
    t2 = t.clone()
    t2[::3] = ignore_index
    t2[t2 == -100] = 2
    got = _lce(hid, w, t2, b, ignore_index=ignore_index, chunk_size=4)
    want = F.cross_entropy(F.linear(hid, w, b), t2, ignore_index=ignore_index)
    torch.testing.assert_close(got, want)
    t2[1] = -100 if ignore_index != -100 else -3  # now an out-of-range label
    with pytest.raises(ValueError, match="target out of range"):
        _lce(hid, w, t2, b, ignore_index=ignore_index)


def test_causal_lm_loss_label_out_of_range():
    hid, w, b, t = _data(lead=(2, 7))
    t[1, 3] = V
    with pytest.raises(ValueError, match=f"target out of range.*got {V}\\."):
        causal_lm_loss(hid, w, t)


# NOTE [Anchors only where backward reads no input]


@pytest.mark.parametrize(
    "how", ["plain", "view_of_base", "view_of_leaf", "precompute", "none", "bias"]
)
def test_double_backward_refused_for_each_input(how):
    # differentiating a first derivative with respect to hidden, weight (and bias) raises
    # slimgrad's error whichever tensor the op saved (hidden itself, its base, no input at all)
    hid, w, b, t = _data(n=16)
    base = hid.clone().requires_grad_()
    if how == "view_of_base":
        h = base.view(4, 4, H)  # saved as its base: an anchor on h
        t = t.view(4, 4)
    elif how == "view_of_leaf":
        h = hid.clone().view(4, 4, H).requires_grad_()  # a leaf view of a base without grad
        t = t.view(4, 4)
    else:
        h = base
    wr = w.clone().requires_grad_()
    br = b.clone().requires_grad_() if how == "bias" else None
    kw = dict(precompute_grads=how == "precompute", reduction="none" if how == "none" else "mean")
    loss = _lce(h, wr, t, br, **kw).sum()
    inputs = (h, wr) if br is None else (h, wr, br)
    grads = torch.autograd.grad(loss, inputs, create_graph=True)
    for g in grads:
        for x in inputs:
            with pytest.raises(RuntimeError, match="slimgrad.ops.linear_cross_entropy: a second"):
                torch.autograd.grad(g.square().sum(), x, retain_graph=True, allow_unused=True)


def test_causal_lm_loss_under_torch_func_is_float32_for_bfloat16_hidden():
    # eager's composition under torch.func upcasts the logits as HF's ForCausalLMLoss (and the
    # op outside torch.func) does: a float32 loss, not a bfloat16 one
    from slimgrad.ops.linear_cross_entropy import causal_lm_loss

    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 8, generator=g).bfloat16()
    w = torch.randn(11, 8, generator=g).bfloat16()
    labels = torch.randint(0, 11, (2, 5), generator=g)
    seen = []

    def f(h):
        loss = causal_lm_loss(h, w, labels)
        seen.append(loss.dtype)
        return loss

    torch.func.grad(f)(h)
    assert seen == [causal_lm_loss(h, w, labels).dtype] == [torch.float32]
