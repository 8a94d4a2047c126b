"""The fallback channels renewed at an optimizer step (NOTE [Fallback channels renewed at the
optimizer step] in ``slimgrad/_math/norms.py``): what a training step pays for them, compiled or
not (under torch.compile the side op reads the renewed entries at run time), and that the cheaper
renewal finds what a fresh search finds."""

from __future__ import annotations

import math

import pytest
import torch

from slimgrad._math import norms
from tests._counting import OpCounts


def _old_mask(weight, bias, out_dtype):
    # the rule as written before (isfinite): the reference the cheaper mask must equal
    acc = norms.acc_dtype((weight if weight is not None else bias).dtype)
    w = weight.detach().reshape(-1).to(acc) if weight is not None else None
    b = bias.detach().reshape(-1).to(acc) if bias is not None else None
    aw = w.abs() if w is not None else torch.ones_like(b)
    ok = aw >= torch.finfo(out_dtype).tiny
    if b is not None:
        ok &= b.abs() <= norms.BETA_OVER_GAMMA_MAX * aw
    ok &= torch.isfinite(aw)
    return ~ok


_SPECIAL = [0.0, -0.0, 1.0, -2.5, 1e-40, -1e-40, 1e-30, math.inf, -math.inf, math.nan]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_mask_is_the_isfinite_rule(dtype, out_dtype, with_bias):
    vals = _SPECIAL + [torch.finfo(dtype).max, -torch.finfo(dtype).max, torch.finfo(dtype).tiny]
    w = torch.tensor([a for a in vals for _ in vals], dtype=torch.float64).to(dtype)
    b = torch.tensor([c for _ in vals for c in vals], dtype=torch.float64).to(dtype)
    b = b if with_bias else None
    assert torch.equal(norms._fallback_mask(w, b, out_dtype), _old_mask(w, b, out_dtype))


def _llama_norms(n=5, d=17):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(d, generator=g)) for _ in range(n)]


def test_renewal_without_fallback_channels_runs_no_nonzero():
    # five RMSNorm weights of one optimizer, none with a fallback channel: the renewal reads
    # whether any falls back (one `any`) and runs no nonzero; before: nonzero and the composite
    # isfinite (14 ATen ops, 11 now)
    ws = _llama_norms()
    opt = torch.optim.SGD(ws, lr=0.1)
    for w in ws:
        assert norms.fallback_or_none(w, None, torch.float32) is None
    norms._renew(opt)
    with OpCounts() as ops:
        norms._renew(opt)
    assert "aten.nonzero" not in ops.count, dict(ops.count)
    assert "aten.isfinite" not in ops.count and "aten.ne" not in ops.count, dict(ops.count)
    assert ops.count["aten.any"] == 1
    assert sum(ops.count.values()) <= 11, dict(ops.count)
    for w in ws:  # renewed: the next forward's key hits, and finds no channel
        assert norms._FB_CACHE[id(w)][1][0][0] == w._version
        assert norms.fallback_or_none(w, None, torch.float32) is None


@pytest.mark.parametrize("bad", [0.0, 1e-42, math.inf, -math.inf, math.nan])
def test_renewal_finds_what_a_fresh_search_finds(bad):
    ws = _llama_norms()
    gamma = torch.randn(17, generator=torch.Generator().manual_seed(3))
    lw = torch.nn.Parameter(gamma.clone())
    lb = torch.nn.Parameter(torch.randn(17, generator=torch.Generator().manual_seed(4)))
    opt = torch.optim.SGD([*ws, lw, lb], lr=0.1)
    for w in ws:
        norms.fallback_or_none(w, None, torch.float32)
    norms.fallback_or_none(lw, lb, torch.float32, norms.layer_norm_gamma)
    with torch.no_grad():  # visible writes (version counters move), as an optimizer step's
        ws[1][3] = bad
        ws[4][0] = bad
        ws[4][16] = bad
        lw[5] = bad
    norms._renew(opt)
    for w in ws:
        entry = norms._FB_CACHE[id(w)]
        fresh = norms._find_fallback_channels(w, None, torch.float32)
        assert torch.equal(entry[2], fresh) and entry[4] == (fresh.shape[0] > 0)
        got = norms.fallback_or_none(w, None, torch.float32)  # a hit: the renewed entry
        assert (got is None) == (fresh.shape[0] == 0)
        assert got is None or torch.equal(got, fresh)
    entry = norms._FB_CACHE[id(lw)]
    fresh = norms._find_scaled(lw, lb, torch.float32, norms.layer_norm_gamma)
    assert torch.equal(entry[2], fresh)
    assert ws[1][3] != ws[1][3] or ws[1][3].abs() < 1e-30 or ws[1][3].isinf()
    assert torch.equal(norms._FB_CACHE[id(ws[1])][2], torch.tensor([3]))


def test_stepped_parameters_follow_a_new_group():
    # the ids of an optimizer's parameters are kept between steps; a group added later is seen
    a, b = _llama_norms(2)
    opt = torch.optim.SGD([a], lr=0.1)
    norms.fallback_or_none(a, None, torch.float32)
    norms.fallback_or_none(b, None, torch.float32)
    norms._renew(opt)
    opt.add_param_group({"params": [b]})
    with torch.no_grad():
        b[2] = 0.0
    norms._renew(opt)
    entry = norms._FB_CACHE[id(b)]
    assert entry[1][0][0] == b._version  # renewed under b's current version
    assert torch.equal(entry[2], torch.tensor([2]))


def _norm_grads(w):
    from slimgrad.ops.rms_norm import hf_rms_norm

    torch.manual_seed(0)
    x = torch.randn(3, w.shape[0], requires_grad=True)
    y = hf_rms_norm(x, w, 1e-6)
    w.grad = None
    (y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
    return x.grad, w.grad


def test_a_weight_sharing_storage_with_what_an_optimizer_steps_is_renewed():
    # review24c: an optimizer over a flat buffer the norm's weight aliases through .data writes
    # the weight without moving its version; the fallback-channel entry must not be carried to the
    # new step count as if that optimizer had not touched it (NaN gradients from a stale "no
    # fallback channel" answer, where the weight is now zero); with the extension's key, as a
    # converted model runs
    from slimgrad import _ext

    _ext.load()
    d = 8
    flat = torch.nn.Parameter(torch.ones(2 * d))
    w = torch.nn.Parameter(torch.empty(0))
    w.data = flat.data[:d]
    opt = torch.optim.SGD([flat], lr=1.0)
    _norm_grads(w)
    flat.grad = torch.cat([torch.ones(d), torch.zeros(d)])
    opt.step()
    assert w._version == 0 and bool((w == 0).all())
    dx, dw = _norm_grads(w)
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()
    wr = torch.nn.Parameter(w.detach().clone())
    torch.manual_seed(0)
    x = torch.randn(3, d, requires_grad=True)
    y = wr * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    (y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
    assert torch.equal(dx, x.grad)


@pytest.mark.parametrize("fused", [False, True])
def test_another_optimizers_step_keeps_the_entries_current(fused):
    # NOTE [Another optimizer's step]: two optimizers stepped alternately (compile_step's compiled
    # eager and converted models, a GAN's two halves): the step of one leaves the other's entries
    # current, so their next forwards hit the cache (no ATen op at all: before, each missed and
    # ran the mask and a nonzero); what they answer is what a fresh search finds, fallback
    # channels included
    mine, other = _llama_norms(3), _llama_norms(2)
    with torch.no_grad():
        mine[1][4] = 0.0
    kw = {"fused": True} if fused else {}
    opt_mine = torch.optim.SGD(mine, lr=0.1, **kw)
    opt_other = torch.optim.SGD(other, lr=0.1, **kw)
    for p in (*mine, *other):
        p.grad = torch.zeros_like(p)
    for w in (*mine, *other):
        norms.fallback_or_none(w, None, torch.float32)
    for _ in range(2):
        opt_mine.step()
        for w in mine:  # renewed by its own optimizer's step
            norms.fallback_or_none(w, None, torch.float32)
        opt_other.step()
        with OpCounts() as ops:
            got = [norms.fallback_or_none(w, None, torch.float32) for w in mine]
        assert ops.count == {"aten.clone": 1}, dict(ops.count)  # mine[1]'s table, copied
        for w, g in zip(mine, got, strict=True):
            fresh = norms._find_fallback_channels(w, None, torch.float32)
            assert (g is None) == (fresh.shape[0] == 0) and (g is None or torch.equal(g, fresh))


def _w_sharing(flat: torch.nn.Parameter, d: int, how: str) -> tuple[torch.nn.Parameter, int]:
    # (w, the element of flat where w's memory starts): w is one half of flat's memory, through
    # flat's own storage object ("view_first", "view") or another one with its own start address
    if how == "dlpack":
        return torch.nn.Parameter(torch.from_dlpack(flat.detach()[d:])), d
    if how == "untyped_storage":
        s = flat.untyped_storage()[d * 4 : 2 * d * 4]
        return torch.nn.Parameter(torch.empty(0).set_(s, 0, (d,), (1,))), d
    start = 0 if how == "view_first" else d
    w = torch.nn.Parameter(torch.empty(0))
    w.data = flat.data[start : start + d]  # one storage object
    return w, start


@pytest.mark.parametrize("how", ["view_first", "view", "dlpack", "untyped_storage"])
def test_another_optimizer_over_shared_memory_leaves_the_entry_stale(how):
    # NOTE [Another optimizer's step]: an entry whose weight shares memory with a parameter the
    # stepping optimizer holds (written without moving the weight's version) is not carried: its
    # next forward finds the zeroed channels afresh. Memory shared through a second storage object
    # starts at another address; the renewal compares memory ranges (review25c: comparing start
    # addresses carried it and the next backward gave NaN gradients)
    d = 8
    flat = torch.nn.Parameter(torch.ones(2 * d))
    w, start = _w_sharing(flat, d, how)
    assert w.data_ptr() == flat.data_ptr() + start * 4
    mine = torch.nn.Parameter(torch.ones(d))
    opt_mine = torch.optim.SGD([mine, w], lr=1.0)
    opt_flat = torch.optim.SGD([flat], lr=1.0)
    for p in (mine, w):
        p.grad = torch.zeros_like(p)
    assert norms.fallback_or_none(w, None, torch.float32) is None
    opt_mine.step()
    assert norms.fallback_or_none(w, None, torch.float32) is None
    flat.grad = torch.zeros(2 * d)
    flat.grad[start : start + d] = 1
    version = w._version
    opt_flat.step()
    assert w._version == version and bool((w == 0).all())  # written, its version unmoved
    got = norms.fallback_or_none(w, None, torch.float32)
    assert got is not None and torch.equal(got, torch.arange(d))
