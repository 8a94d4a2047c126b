"""ops.eager_attention: HF's eager attention core, recomputed in backward (NOTE [HF eager
attention, recomputed in backward] in slimgrad/ops/softmax_dropout.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slimgrad.memory import measure
from slimgrad.ops.softmax_dropout import eager_attention


def _eager(q, k, v, p, scaling, softcap, biases, softmax_dtype, probs_dtype):
    s = torch.matmul(q, k.transpose(2, 3)) * scaling
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    for b in biases:
        s = s + b
    probs = F.softmax(s, dim=-1, dtype=softmax_dtype) if softmax_dtype else F.softmax(s, -1)
    if probs_dtype is not None:
        probs = probs.to(probs_dtype)
    return torch.matmul(F.dropout(probs, p, p > 0), v)


def _inputs(dtype, bias_grad=False):
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 3, 5, 7, generator=g, dtype=torch.float64).to(dtype) for _ in range(3)
    )
    bias = torch.randn(1, 3, 5, 5, generator=g, dtype=torch.float64).to(dtype)
    mask = torch.zeros(2, 1, 5, 5, dtype=dtype)
    mask[0, :, :, :2] = torch.finfo(dtype).min
    return q, k, v, bias.requires_grad_(bias_grad), mask


CASES = {
    "llama": dict(softmax_dtype=torch.float32, probs_dtype="q"),
    "bert": dict(softmax_dtype=None, probs_dtype=None),
    "gemma2_softcap": dict(softmax_dtype=torch.float32, probs_dtype="q", softcap=2.0),
}


@pytest.mark.parametrize("p", [0.0, 0.4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_matches_eager_composition_bitwise(case, dtype, p):
    c = CASES[case]
    q, k, v, bias, mask = _inputs(dtype, bias_grad=True)
    kw = dict(
        scaling=0.3,
        softcap=c.get("softcap"),
        softmax_dtype=c["softmax_dtype"],
        probs_dtype=dtype if c["probs_dtype"] == "q" else None,
    )
    results = []
    for fn in ("ours", "eager"):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
        torch.manual_seed(1)
        if fn == "ours":
            out = eager_attention(*leaves[:3], p, biases=(leaves[3], mask), **kw)
        else:
            out = _eager(*leaves[:3], p, biases=(leaves[3], mask), **kw)
        g = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
        results.append([out, *torch.autograd.grad(out, leaves, g)])
    for a, b in zip(*results):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gradcheck_float64_and_second_derivative():
    q, k, v, bias, mask = _inputs(torch.float64, bias_grad=True)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]

    def f(q, k, v, b):
        return eager_attention(q, k, v, 0.0, scaling=0.3, softcap=2.0, biases=(b, mask))

    torch.autograd.gradcheck(f, leaves)
    # second derivatives: eager's, the backward being eager's own graph
    grads = []
    for fn in (f, lambda q, k, v, b: _eager(q, k, v, 0.0, 0.3, 2.0, (b, mask), None, None)):
        x = [t.detach().clone().requires_grad_() for t in leaves]
        (gq,) = torch.autograd.grad(fn(*x).pow(2).sum(), x[0], create_graph=True)
        grads.append(torch.autograd.grad(gq.sum(), x))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_backward_inputs_subset():
    q, k, v, bias, mask = _inputs(torch.bfloat16)
    results = []
    for fn in ("ours", "eager"):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(1)
        kw = dict(scaling=0.3, biases=(mask,), softmax_dtype=torch.float32)
        if fn == "ours":
            out = eager_attention(*leaves, 0.2, probs_dtype=torch.bfloat16, **kw)
        else:
            out = _eager(*leaves, 0.2, kw["scaling"], None, (mask,), torch.float32, torch.bfloat16)
        out.sum().backward(inputs=[leaves[1]])
        assert leaves[0].grad is None and leaves[2].grad is None
        results.append(leaves[1].grad)
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def test_saved_bytes_are_the_bits():
    # q, k, v are the caller's: only 1 bit per score is created and kept (eager: fp32 P,
    # bf16 noise and dropped P, 8 B per score)
    q, k, v, _, mask = _inputs(torch.bfloat16)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    kw = dict(scaling=0.3, biases=(mask,), softmax_dtype=torch.float32, probs_dtype=torch.bfloat16)
    ours = measure(lambda: eager_attention(*leaves, 0.2, **kw).float().sum())
    eager = measure(
        lambda: (
            _eager(*leaves, 0.2, 0.3, None, (mask,), torch.float32, torch.bfloat16).float().sum()
        )
    )
    scores = 2 * 3 * 5 * 5
    assert ours.saved_bytes == (scores + 7) // 8
    assert eager.saved_bytes == scores * (4 + 2 + 2)


def test_errors():
    q, k, v, _, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match=r"slimgrad.ops.eager_attention: p must be below 1"):
        eager_attention(q, k, v, 1.0, scaling=1.0)
    with pytest.raises(ValueError, match="at most two biases"):
        eager_attention(q, k, v, 0.1, scaling=1.0, biases=(None, None, None))


def test_meta_tensors_run_as_eager_does():
    # autocast knows no meta device (asking it whether it is on raises there): the operands are
    # folded as anywhere autocast casts nothing, and forward and backward run as eager's do
    q, k, v = (
        torch.randn(2, 6, 3, 4, device="meta", requires_grad=True).transpose(1, 2) for _ in range(3)
    )
    out = eager_attention(q, k, v, 0.0, scaling=0.5)
    assert out.shape == (2, 3, 6, 4) and out.device.type == "meta"
    out.sum().backward()


def _hf_grads(
    ours: bool, p: float, twice: bool = False, ckpt: bool = False, fresh_v: bool = False
) -> list[torch.Tensor]:
    # q, k, v as HF hands them over: view(B, T, H, d).transpose(1, 2) of one projection, whose
    # batch dims do not fold (the op keeps private 3-D copies: NOTE [Attention operands folded
    # before the op]); the projection weight's gradient, once or from two backward passes
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3 * 3 * 7, 16, generator=g).requires_grad_()
    x = torch.randn(2, 5, 16, generator=g)
    q, k, v = (t.view(2, 5, 3, 7).transpose(1, 2) for t in (x @ w.t()).split(21, -1))
    if fresh_v:  # a contiguous copy only the op holds (HF's .contiguous() layouts)
        v = v.contiguous()
    torch.manual_seed(1)
    if ours and ckpt:  # under non-reentrant checkpointing: the recomputed tensors, unshared
        out = torch.utils.checkpoint.checkpoint(
            lambda *t: eager_attention(*t, p, scaling=0.3), q, k, v, use_reentrant=False
        )
    elif ours:
        out = eager_attention(q, k, v, p, scaling=0.3)
    else:
        out = _eager(q, k, v, p, 0.3, None, (), None, None)
    del q, k, v  # the caller keeps none of them (a kept v is never written over)
    dy = torch.linspace(-1, 1, out.numel()).view(out.shape)
    out.backward(dy, retain_graph=twice)
    got = [w.grad]
    if twice:
        w.grad = None
        out.backward(dy)
        got.append(w.grad)
    return got


@pytest.mark.parametrize("p", [0.0, 0.4])
def test_dv_in_vs_buffer_leaves_a_second_backward_intact(p):
    # NOTE [The output's product not recomputed]: dv is written into v's kept fold only where
    # ownership.take_saved grants it, never under retain_graph=True
    (want,) = _hf_grads(False, p)
    got = []
    for fresh_v in (False, True):
        for twice in (False, True):
            for ckpt in (False, True):
                got += _hf_grads(True, p, twice=twice, ckpt=ckpt, fresh_v=fresh_v)
    for g in got:
        torch.testing.assert_close(g, want, rtol=0, atol=0)


def test_dv_takes_vs_buffer():
    # the write the test above guards ran (tests/_needs_reuse.py): v a contiguous copy the op
    # alone holds, one backward
    from slimgrad import ownership

    before = ownership.reuse_count("saved")
    _hf_grads(True, 0.0, fresh_v=True)
    assert ownership.reuse_count("saved") == before + 1


def test_a_v_the_caller_keeps_is_not_written_over():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(63, 16, generator=g).requires_grad_()
    x = torch.randn(2, 5, 16, generator=g)
    q, k, v = (t.view(2, 5, 3, 7).transpose(1, 2).contiguous() for t in (x @ w.t()).split(21, -1))
    before = v.detach().clone()
    out = eager_attention(q, k, v, 0.0, scaling=0.3)
    out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
    assert torch.equal(v.detach(), before)
