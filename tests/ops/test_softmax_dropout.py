import pytest
import torch
import torch.nn.functional as F

from slimgrad.memory import measure
from slimgrad.ops.softmax_dropout import softmax_dropout_matmul
from slimgrad.testing import assert_within_rule


def _eager(s, v, p=0.1, training=True, dim=-1):
    return torch.matmul(F.dropout(F.softmax(s, dim), p, training), v)


def _run(fn, s, v, p, g, seed=3, grads=(True, True), inputs=None, **kw):
    s, v = s.clone().requires_grad_(grads[0]), v.clone().requires_grad_(grads[1])
    torch.manual_seed(seed)
    y = fn(s, v, p, **kw)
    y.backward(g, inputs=inputs(s, v) if inputs else None)
    return [y.detach(), s.grad, v.grad]


SHAPES = [((2, 3, 7, 7), (2, 3, 7, 5)), ((1, 13, 13), (1, 13, 3)), ((2, 1, 5, 5), (2, 4, 5, 2))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("ss,vs", SHAPES)
def test_matches_eager_bit_for_bit(device, dtype, p, ss, vs):
    s = torch.randn(ss, dtype=dtype, device=device)
    v = torch.randn(vs, dtype=dtype, device=device)
    out_shape = torch.broadcast_shapes(ss[:-1], vs[:-2] + (1,))[:-1] + (ss[-2], vs[-1])
    g = torch.randn(out_shape, dtype=dtype, device=device)
    for o, r in zip(_run(softmax_dropout_matmul, s, v, p, g), _run(_eager, s, v, p, g)):
        if ss[:-2] == vs[:-2]:
            assert torch.equal(o, r)
        else:  # broadcast batch: the reduction order of dv may differ
            torch.testing.assert_close(o, r)


def test_dim_and_eval_mode():
    s, v = torch.randn(2, 6, 5), torch.randn(2, 6, 4)
    g = torch.randn(2, 5, 4)
    for kw in ({"dim": -2}, {"training": False}):
        out = _run(softmax_dropout_matmul, s.transpose(1, 2), v, 0.3, g, **kw)
        ref = _run(_eager, s.transpose(1, 2), v, 0.3, g, **kw)
        for o, r in zip(out, ref):
            torch.testing.assert_close(o, r)


@pytest.mark.parametrize("p", [0.0, 0.2, 0.6])
def test_gradcheck(p):
    s = torch.randn(2, 5, 5, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)

    def f(s, v):
        torch.manual_seed(7)
        return softmax_dropout_matmul(s, v, p)

    assert torch.autograd.gradcheck(f, (s, v))


def test_create_graph_raises_clear_error():
    s = torch.randn(4, 4, requires_grad=True)
    y = softmax_dropout_matmul(s, torch.randn(4, 2), 0.1)
    (g,) = torch.autograd.grad(y.pow(2).sum(), s, create_graph=True)
    with pytest.raises(RuntimeError, match="slimgrad.ops.softmax_dropout_matmul: a second"):
        g.sum().backward()


def test_backward_inputs_subsets():
    s, v = torch.randn(3, 6, 6), torch.randn(3, 6, 4)
    g = torch.randn(3, 6, 4)
    for pick in (lambda s, v: [s], lambda s, v: [v]):
        out = _run(softmax_dropout_matmul, s, v, 0.3, g, inputs=pick)
        ref = _run(_eager, s, v, 0.3, g, inputs=pick)
        for o, r in zip(out, ref):
            assert (o is None) == (r is None)
            if o is not None:
                assert torch.equal(o, r)


def test_memory_contract():
    b, h, t, d = 2, 3, 17, 8
    s0 = torch.randn(b, h, t, t, requires_grad=True)
    v0 = torch.randn(b, h, t, d, requires_grad=True)
    m = measure(lambda: softmax_dropout_matmul(s0 * 1, v0 * 1, 0.1).sum())
    me = measure(lambda: _eager(s0 * 1, v0 * 1, 0.1).sum())
    n_s, n_v = b * h * t * t, b * h * t * d
    assert m.saved_bytes == 4 * n_s + (n_s + 7) // 8 + 4 * n_v  # P + bits + V
    assert me.saved_bytes == 3 * 4 * n_s + 4 * n_v  # P, float mask, dropped P, V
    assert m.floor_bytes == m.saved_bytes
    # dS not needed (scores without grad): V is not kept
    s1 = torch.randn(b, h, t, t)
    m = measure(lambda: softmax_dropout_matmul(s1 * 1, v0 * 1, 0.1).sum())
    assert m.saved_bytes == 4 * n_s + (n_s + 7) // 8


def test_mask_reproducible_under_autocast_and_compile():
    s, v = torch.randn(2, 9, 9), torch.randn(2, 9, 9)
    g = torch.randn(2, 9, 9)
    ref = _run(_eager, s, v, 0.25, g, seed=5)
    torch._dynamo.reset()
    f = torch.compile(softmax_dropout_matmul, backend="aot_eager", fullgraph=True)
    for o, r in zip(_run(f, s, v, 0.25, g, seed=5), ref):
        torch.testing.assert_close(o, r)
    res = []
    for fn in (softmax_dropout_matmul, _eager):
        ss, vv = s.clone().requires_grad_(), v.clone().requires_grad_()
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(ss.bfloat16(), vv, 0.25)
        y.backward(g.to(y.dtype))
        res.append((y.detach(), ss.grad, vv.grad))
    assert res[0][0].dtype == res[1][0].dtype
    for o, r in zip(*res):
        torch.testing.assert_close(o, r)


def test_independent_calls_retain_graph_hooks():
    s, v = torch.randn(64, 64), torch.eye(64)
    torch.manual_seed(0)
    a = softmax_dropout_matmul(s, v, 0.5)
    b = softmax_dropout_matmul(s, v, 0.5)
    assert not torch.equal(a != 0, b != 0)
    ss = s.clone().requires_grad_()
    y = softmax_dropout_matmul(ss, v, 0.5)
    y.retain_grad()
    seen = []
    y.register_hook(seen.append)
    y.sum().backward(retain_graph=True)
    g1 = ss.grad.clone()
    y.sum().backward()
    torch.testing.assert_close(ss.grad, 2 * g1)
    assert len(seen) == 2


def test_inplace_on_saved_v_raises_nan_no_grad_zero_size():
    s = torch.randn(5, 5, requires_grad=True)
    v = torch.randn(5, 3)
    y = softmax_dropout_matmul(s, v, 0.2)
    v.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    sn = torch.randn(4, 4)
    sn[1, 2] = float("nan")
    sn[2, 0] = float("inf")
    g = torch.randn(4, 2)
    vv = torch.randn(4, 2)
    out, ref = _run(softmax_dropout_matmul, sn, vv, 0.3, g), _run(_eager, sn, vv, 0.3, g)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, equal_nan=True)
    with torch.no_grad():
        torch.manual_seed(1)
        a = softmax_dropout_matmul(s, v, 0.2)
        torch.manual_seed(1)
        assert torch.equal(a, _eager(s, v, 0.2))
    e = torch.randn(0, 4, 4, requires_grad=True)
    softmax_dropout_matmul(e, torch.randn(0, 4, 2), 0.1).sum().backward()
    assert e.grad.shape == (0, 4, 4)


def test_bf16_within_rule():
    s, v = torch.randn(2, 11, 11), torch.randn(2, 11, 6)
    g = torch.randn(2, 11, 6)
    sb, vb, gb = s.bfloat16(), v.bfloat16(), g.bfloat16()
    out = _run(softmax_dropout_matmul, sb, vb, 0.1, gb)
    eager = _run(_eager, sb, vb, 0.1, gb)
    ref = _run(_eager, sb.double(), vb.double(), 0.1, gb.double())
    assert_within_rule(out, ref, eager)


def _eager_causal(s, v, p=0.1, training=True):
    keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    return _eager(s.masked_fill(~keep, float("-inf")), v, p, training)


def _causal(s, v, p=0.1, training=True):
    return softmax_dropout_matmul(s, v, p, training, causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("q,k", [(7, 7), (5, 11), (11, 5), (1, 3)])
def test_causal_matches_eager_masked_fill_bit_for_bit(dtype, p, q, k):
    s = torch.randn(2, 3, q, k, dtype=dtype)
    v = torch.randn(2, 3, k, 5, dtype=dtype)
    g = torch.randn(2, 3, q, 5, dtype=dtype)
    for o, r in zip(_run(_causal, s, v, p, g), _run(_eager_causal, s, v, p, g)):
        assert torch.equal(o, r)


def test_causal_needs_last_dim():
    s, v = torch.randn(2, 5, 5), torch.randn(2, 5, 3)
    with pytest.raises(ValueError, match="softmax_dropout_matmul: causal masks the last two dims"):
        softmax_dropout_matmul(s, v, 0.1, dim=1, causal=True)
    with pytest.raises(ValueError, match="causal masks the last two dims"):
        softmax_dropout_matmul(torch.randn(5), torch.randn(5, 2), 0.1, causal=True)


def test_gradcheck_causal():
    s = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 6, 3, dtype=torch.float64, requires_grad=True)

    def f(s, v):
        torch.manual_seed(7)
        return softmax_dropout_matmul(s, v, 0.2, causal=True)

    assert torch.autograd.gradcheck(f, (s, v))


# Gradient-buffer reuse (issue 6; NOTE [Gradient-buffer ownership] in slimgrad/ownership.py): P's
# buffer holds the rebuilt D for dV when take_saved proves P dead. Each case runs with reuse on
# and off; every gradient must match bit for bit and the counter tells whether P was reused.


def _reuse_case(case, reuse, causal=False, p=0.3):
    from slimgrad import ownership

    gen = torch.Generator().manual_seed(5)
    s0 = torch.randn(2, 3, 7, 7, generator=gen, dtype=torch.float64).float().requires_grad_()
    v0 = torch.randn(2, 3, 7, 5, generator=gen, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(2, 3, 7, 5, generator=gen)
    kept = []
    hooks = (
        torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t)
        if case == "hook_keeps_saved"
        else _nullctx()
    )
    ownership.reset_reuse_count()
    torch.manual_seed(11)
    with ownership.reuse_disabled() if not reuse else _nullctx():
        with hooks:
            o = softmax_dropout_matmul(s0 * 1, v0 * 1, p, causal=causal)
        loss = (o * w).sum()
        got = {}
        if case == "retain_graph":  # the first backward keeps P intact; the last may reuse it
            loss.backward(retain_graph=True)
            got["s.grad1"], got["v.grad1"] = s0.grad.clone(), v0.grad.clone()
        loss.backward()
    got["s.grad"], got["v.grad"] = s0.grad, v0.grad
    if kept:  # every tensor the hook kept (P among them) must be intact after backward
        for i, t in enumerate(kept):
            got[f"kept{i}"] = t
    return got, ownership.reuse_count("saved")


class _nullctx:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.fixture
def _reuse_on(monkeypatch):
    monkeypatch.delenv("SLIMGRAD_NO_REUSE", raising=False)


@pytest.mark.parametrize(
    "case, reused", [("plain", 1), ("causal", 1), ("retain_graph", 1), ("hook_keeps_saved", 0)]
)
def test_reuse_is_bitwise_identical(_reuse_on, case, reused):
    causal = case == "causal"
    on, n_on = _reuse_case(case, True, causal)
    off, n_off = _reuse_case(case, False, causal)
    assert (n_on, n_off) == (reused, 0)
    assert on.keys() == off.keys()
    for k in off:
        assert torch.equal(on[k], off[k]), k


def test_second_backward_after_reuse_raises():
    s0 = torch.randn(2, 5, 5, requires_grad=True)
    v0 = torch.randn(2, 5, 3, requires_grad=True)
    loss = softmax_dropout_matmul(s0 * 1, v0 * 1, 0.3).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


def test_reuse_p0_and_no_value_grad_take_nothing(_reuse_on):
    from slimgrad import ownership

    s0 = torch.randn(2, 5, 5, requires_grad=True)
    ownership.reset_reuse_count()
    softmax_dropout_matmul(s0 * 1, torch.randn(2, 5, 3), 0.3).sum().backward()  # no dV needed
    softmax_dropout_matmul(s0 * 1, torch.randn(2, 5, 3, requires_grad=True), 0.0).sum().backward()
    assert ownership.reuse_count("saved") == 0


def test_backward_peak_one_score_buffer(_reuse_on):
    # Backward holds P + one S-sized buffer (dS written into dP; D for dV in P's buffer when P is
    # dead, else a transient freed before dP exists), never a zero gradient for P: what it adds to
    # what forward kept stays below two S-sized buffers, with reuse on and off, and reuse on is
    # not higher (measured here: 31720 vs 37672 bytes above forward's 29741).
    from slimgrad import ownership

    b, h, t, d = 2, 3, 31, 8
    n_s = b * h * t * t
    s0 = torch.randn(b, h, t, t, requires_grad=True)
    v0 = torch.randn(b, h, t, d, requires_grad=True)

    def bwd_extra(m):
        return max(live for i, _, live in m.timeline if i >= m.backward_start) - m.retained_bytes

    for causal in (False, True):
        f = _causal if causal else softmax_dropout_matmul
        measure(lambda f=f: f(s0 * 1, v0 * 1, 0.1).sum())  # warm caches (the bit-unpack table)
        m = measure(lambda f=f: f(s0 * 1, v0 * 1, 0.1).sum())
        with ownership.reuse_disabled():
            m_off = measure(lambda f=f: f(s0 * 1, v0 * 1, 0.1).sum())
        ref = _eager_causal if causal else _eager
        me = measure(lambda ref=ref: ref(s0 * 1, v0 * 1, 0.1).sum())
        assert bwd_extra(m) <= bwd_extra(m_off) < 2 * 4 * n_s
        assert m.peak_bytes <= m_off.peak_bytes < me.peak_bytes


def test_causal_under_compile_bitwise_and_no_reuse(_reuse_on):
    # the mask and the in-place softmax live inside the custom op: one graph, same bits as eager
    # mode; take_saved refuses under torch.compile (a traced backward), so nothing is reused
    from slimgrad import ownership

    s0, v0 = torch.randn(2, 3, 7, 7), torch.randn(2, 3, 7, 5)

    def f(s, v):
        return softmax_dropout_matmul(s * 1, v * 1, 0.3, causal=True)

    outs = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        s, v = s0.clone().requires_grad_(), v0.clone().requires_grad_()
        torch.manual_seed(3)
        ownership.reset_reuse_count()
        y = fn(s, v)
        y.pow(2).sum().backward()
        outs.append((y.detach(), s.grad, v.grad, ownership.reuse_count("saved")))
    assert outs[1][3] == 0
    for a, b in zip(outs[0][:3], outs[1][:3], strict=True):
        assert torch.equal(a, b)


# mask: F.scaled_dot_product_attention's attn_mask applied inside the op (bool or additive
# float, rows with no finite score give 0 as SDPA's safe softmax), nothing extra kept


def _eager_masked(s, v, p, mask, causal=False):
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    probs = torch.ops.aten._safe_softmax(s, -1)  # SDPA's math path: dead rows give 0
    return torch.matmul(F.dropout(probs, p, True), v)


def _masks(q, k):
    keep = torch.rand(2, 1, q, k, generator=torch.Generator().manual_seed(2)) > 0.3
    keep[0, :, 0] = False  # a row with nothing to attend to
    additive = torch.randn(2, 3, q, k).masked_fill(~keep, float("-inf"))
    return {"bool": keep, "float": additive, "float_finite": torch.randn(1, 3, q, k)}


@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("kind", ["bool", "float", "float_finite"])
@pytest.mark.parametrize("causal", [False, True])
def test_mask_matches_eager_safe_softmax_bit_for_bit(p, kind, causal):
    s, v = torch.randn(2, 3, 6, 6), torch.randn(2, 3, 6, 4)
    g = torch.randn(2, 3, 6, 4)
    mask = _masks(6, 6)[kind]
    if kind == "float_finite":
        mask.requires_grad_()
    res = []
    for fn in (
        lambda s, v, p: softmax_dropout_matmul(s, v, p, causal=causal, mask=mask),
        lambda s, v, p: _eager_masked(s, v, p, mask, causal),
    ):
        mask.grad = None
        res.append(_run(fn, s, v, p, g) + ([mask.grad] if mask.requires_grad else []))
    for o, r in zip(*res):
        assert not o.isnan().any()
        assert torch.equal(o, r)


def test_mask_equals_sdpa_math_path_with_dropout():
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 4)
    for mask in (_masks(5, 7)["bool"], _masks(5, 7)["float"]):
        torch.manual_seed(4)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.2, scale=0.25)
        torch.manual_seed(4)
        s = (q * 0.5) @ (k.transpose(-2, -1) * 0.5)
        assert torch.equal(softmax_dropout_matmul(s, v, 0.2, mask=mask), ref)


def test_gradcheck_float_mask():
    s = torch.randn(2, 4, 5, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    m = torch.randn(1, 4, 5, dtype=torch.float64, requires_grad=True)

    def f(s, v, m):
        torch.manual_seed(7)
        return softmax_dropout_matmul(s, v, 0.2, mask=m)

    assert torch.autograd.gradcheck(f, (s, v, m))


def test_mask_keeps_nothing_extra():
    b, h, t, d = 2, 3, 17, 8
    s0 = torch.randn(b, h, t, t, requires_grad=True)
    v0 = torch.randn(b, h, t, d, requires_grad=True)
    keep = torch.rand(b, 1, t, t) > 0.2
    plain = measure(lambda: softmax_dropout_matmul(s0 * 1, v0 * 1, 0.1).sum())
    masked = measure(lambda: softmax_dropout_matmul(s0 * 1, v0 * 1, 0.1, mask=keep).sum())
    assert masked.saved_bytes == plain.saved_bytes


def test_mask_errors():
    s, v = torch.randn(2, 3, 5, 5), torch.randn(2, 3, 5, 4)
    with pytest.raises(TypeError, match="softmax_dropout_matmul: a float mask .* expected dtype"):
        softmax_dropout_matmul(s, v, 0.1, mask=torch.zeros(5, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="softmax_dropout_matmul: mask must broadcast"):
        softmax_dropout_matmul(s, v, 0.1, mask=torch.ones(4, 3, 5, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="softmax_dropout_matmul: mask must be a tensor"):
        softmax_dropout_matmul(s, v, 0.1, mask=[[True]])


def test_torch_func_transforms_and_jit_trace():
    # Issue 15: torch.func transforms run eager's composition (same mask from the same seed);
    # torch.jit.trace refuses clearly.
    from torch.func import grad

    s, v = torch.randn(3, 6, 6), torch.randn(3, 6, 2)
    res = []
    for fn in (
        lambda s: softmax_dropout_matmul(s, v, 0.2, causal=True),
        lambda s: (
            F.dropout(
                F.softmax(s.masked_fill(torch.ones(6, 6).triu(1).bool(), float("-inf")), -1), 0.2
            )
            @ v
        ),
    ):
        torch.manual_seed(7)
        res.append(grad(lambda t, fn=fn: fn(t).sin().sum())(s))
    torch.testing.assert_close(res[0], res[1])
    with pytest.raises(RuntimeError, match="slimgrad.ops.softmax_dropout_matmul: torch.jit"):
        torch.jit.trace(lambda t: softmax_dropout_matmul(t, v, 0.2), s.requires_grad_())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tiny_half_precision_bits_are_packed_as_the_fakes_declare(dtype):
    # A (1, 2, 2) half-precision dropout keeps eager's noise in ops/dropout.py (_keeps_noise);
    # the softmax-dropout ops always pack: their fakes declare uint8[ceil(n / 8)] bits.
    from slimgrad.ops import softmax_dropout as sd

    s, v = torch.randn(1, 2, 2, dtype=dtype), torch.randn(1, 2, 2, dtype=dtype)
    torch.library.opcheck(sd._sdm_fwd._def._opoverload, (s, v, 0.5, -1, dtype, False, None))
    q, k_t = torch.randn(1, 2, 2, dtype=dtype), torch.randn(1, 2, 2, dtype=dtype)
    torch.library.opcheck(sd._scores_sdm._def._opoverload, (q, k_t, v, 0.5, dtype, False, None))
    # the straight path (no custom op) saves the same packed bits
    saved = []

    def pack(t):
        saved.append(t)
        return t

    s.requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = softmax_dropout_matmul(s, v, 0.5)
    assert [t.shape for t in saved if t.dtype == torch.uint8] == [torch.Size([1])]
    out.sum().backward()
