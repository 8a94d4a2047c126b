"""GPT-2's attention node's backward issued from C++ (NOTE [GPT-2's attention backward from C++] in
ops/gpt2_attention.py; ``_ext/backward.cpp`` ``gpt2_attention_bwd``): taken where the node's
steps ran straight, the Python body's bits, and the Python body wherever it hands back None."""

from __future__ import annotations

import copy

import pytest
import torch

import slimgrad
import slimgrad.ops.gpt2_attention as oga
from slimgrad.ops.gpt2_attention import gpt2_attention
from tests._counting import count_calls
from tests.ops._gpt2_helpers import (
    assert_equal_each,
    assert_same_step,
    ext_or_skip,
    gpt2_model,
    gpt2_step,
    under_a_function_mode,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture
def ext():
    return ext_or_skip()


class _Counted:
    # wraps the extension function: how often it ran its body (did not hand back None)
    def __init__(self, fn):
        self.fn, self.ran, self.calls = fn, 0, 0

    def __call__(self, *args):
        r = self.fn(*args)
        self.calls += 1
        self.ran += r is not None
        return r


@pytest.fixture
def counted(ext, monkeypatch):
    # the dropout C kernels are built by the first general-path call in the process: one call
    # first, so the node's steps take their straight paths
    gpt2_attention(*_args(), attn_p=0.2, resid_p=0.3).sum().backward()
    c = _Counted(ext.gpt2_attention_bwd)
    monkeypatch.setattr(oga, "_EXT_BWD", c)
    c.conv1d = _Counted(ext.conv1d_bwd)
    monkeypatch.setattr(oga, "_EXT_CONV1D", c.conv1d)
    c.fwd = _Counted(ext.gpt2_attention_fwd)
    monkeypatch.setattr(oga, "_EXT_FWD", c.fwd)
    return c


def _python_bodies(monkeypatch):
    for name in ("_EXT_BWD", "_EXT_CONV1D", "_EXT_FWD"):
        monkeypatch.setattr(oga, name, None)


@pytest.mark.parametrize("frozen", [None, "c_attn", "c_attn_bias", "c_proj", "c_proj_bias", "ln_1"])
@pytest.mark.parametrize("padded", [False, True])
def test_model_bits_as_the_python_body(frozen, padded, counted, monkeypatch):
    # HF GPT-2 (2 layers, dropout 0.1 on), converted: each attention node's backward and each
    # ln_1 + c_attn node's c_attn backward run in C++, and the loss and every gradient equal the
    # Python bodies', frozen weights included; a padded batch takes HF's per-op attention (its
    # mask) and per-op ln_1 and c_attn, unchanged
    nodes = count_calls(monkeypatch, oga, "_GPT2_ATTENTION_APPLY")
    model = slimgrad.convert_(gpt2_model().train())
    if frozen is not None:
        for blk in model.transformer.h:
            if frozen == "ln_1":
                blk.ln_1.weight.requires_grad_(False)
            elif frozen.endswith("_bias"):
                getattr(blk.attn, frozen[:-5]).bias.requires_grad_(False)
            else:
                getattr(blk.attn, frozen).weight.requires_grad_(False)
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(3))
    kw = {}
    if padded:
        mask = torch.ones(2, 13, dtype=torch.long)
        mask[1, :4] = 0
        kw["attention_mask"] = mask
    ours = [gpt2_step(model, ids, **kw) for _ in range(2)]
    assert counted.ran == nodes[0] == (0 if padded else 4)  # 2 layers x 2 steps
    assert counted.conv1d.ran == counted.fwd.ran == (0 if padded else 4)
    after = torch.rand(3)  # the generator's state after the two steps: the same draws
    _python_bodies(monkeypatch)
    for r in ours:
        assert_same_step(r, gpt2_step(model, ids, **kw))
    assert torch.equal(after, torch.rand(3))


def _args(seed=0, b=2, h=4, t=13, d=8):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, t, d, generator=g, requires_grad=True) for _ in range(3))
    w = torch.randn(h * d, 24, generator=g, requires_grad=True)
    bias = torch.randn(24, generator=g, requires_grad=True)
    return [q, k, v, w, bias]


def _grads(args, subset, dy, ext_fn, monkeypatch, fwd=None):
    monkeypatch.setattr(oga, "_EXT_BWD", ext_fn)
    monkeypatch.setattr(oga, "_EXT_FWD", fwd)
    torch.manual_seed(1)
    y = gpt2_attention(*args, scaling=0.3, attn_p=0.2, resid_p=0.3)
    inputs = {None: args, "qkv": args[:3], "weights": args[3:], "k": args[1:2], "v": args[2:3]}
    return y.detach(), torch.autograd.grad(y, inputs[subset], dy)


@pytest.mark.parametrize("subset", [None, "qkv", "weights", "k", "v"])
@pytest.mark.parametrize("t", [1, 13])
def test_functional_bits_and_subsets(subset, t, counted, monkeypatch):
    # needs_input_grad subsets (each step only where its gradient is needed) and T = 1 (no causal
    # fill); dy is the caller's (not granted: the residual dropout writes a fresh buffer)
    args = _args(t=t)
    dy = torch.randn(2, t, 24, generator=torch.Generator().manual_seed(9))
    dy0 = dy.clone()
    y, g = _grads(args, subset, dy, counted, monkeypatch, counted.fwd)
    assert counted.ran == counted.fwd.ran == 1
    assert torch.equal(dy, dy0)  # the caller's gradient is never written over
    y_p, g_p = _grads(args, subset, dy, None, monkeypatch)
    assert torch.equal(y, y_p)
    assert_equal_each(g, g_p)


def test_a_non_contiguous_gradient_runs_the_python_body(counted, monkeypatch):
    args = _args()
    dy = torch.randn(2, 24, 13, generator=torch.Generator().manual_seed(9)).mT
    y, g = _grads(args, None, dy, counted, monkeypatch)
    assert (counted.calls, counted.ran) == (1, 0)  # handed back: the Python body ran
    y_p, g_p = _grads(args, None, dy, None, monkeypatch)
    assert_equal_each(g, g_p)


def test_under_a_torch_function_mode_the_python_body_runs(ext, monkeypatch):
    # the C++ body hands back None while a torch function mode is on (the mode would see the
    # Python body's calls); autograd's engine runs backward with the caller's modes off, so the
    # mode is entered around the extension's call itself
    under_mode, results = under_a_function_mode(ext.gpt2_attention_bwd)
    gpt2_attention(*_args(), attn_p=0.2, resid_p=0.3).sum().backward()  # the C kernels built
    args = _args()
    dy = torch.randn(2, 13, 24, generator=torch.Generator().manual_seed(9))
    y, g = _grads(args, None, dy, under_mode, monkeypatch)
    assert results == [None]
    y_p, g_p = _grads(args, None, dy, ext.gpt2_attention_bwd, monkeypatch)
    assert_equal_each(g, g_p)


def test_memory_and_retain_graph_as_the_python_body(counted, monkeypatch):
    # the tracker's measured step runs under a dispatch mode: the Python body (never the C++
    # one), so its bytes are the Python body's; a retained graph's second backward (dy not
    # granted) gives the first one's gradients
    model = slimgrad.convert_(gpt2_model().train())
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(3))
    rep = slimgrad.memory.measure(lambda: model(input_ids=ids, labels=ids).loss)
    assert counted.ran == counted.conv1d.ran == counted.fwd.ran == 0
    _python_bodies(monkeypatch)
    for p in model.parameters():
        p.grad = None
    rep_p = slimgrad.memory.measure(lambda: model(input_ids=ids, labels=ids).loss)
    assert (rep.peak_bytes, rep.saved_bytes) == (rep_p.peak_bytes, rep_p.saved_bytes)
    monkeypatch.setattr(oga, "_EXT_BWD", counted)
    monkeypatch.setattr(oga, "_EXT_CONV1D", counted.conv1d)
    monkeypatch.setattr(oga, "_EXT_FWD", counted.fwd)
    m2 = copy.deepcopy(model)
    torch.manual_seed(5)
    loss = m2(input_ids=ids, labels=ids).loss
    params = list(m2.parameters())
    first = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    second = torch.autograd.grad(loss, params, allow_unused=True)
    assert counted.ran == counted.conv1d.ran == 4  # 2 layers x 2 backwards
    assert counted.fwd.ran == 2
    for a, b in zip(first, second, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("t", [1, 2, 13])
def test_forward_saves_what_the_python_steps_save(t, counted, monkeypatch):
    # the node's saved tensors (the scores op's q, k^T, v and bits, c_proj's input, the residual
    # dropout's bits), its output and the generator's state after it: equal either way
    args = _args(t=t)
    outs = []
    for fwd in (counted.fwd, None):
        monkeypatch.setattr(oga, "_EXT_FWD", fwd)
        torch.manual_seed(1)
        y = gpt2_attention(*args, scaling=0.3, attn_p=0.2, resid_p=0.3)
        saved = [x for x in y.grad_fn.saved_tensors if x is not None]
        outs.append((y.detach(), saved, torch.rand(2)))
    assert counted.fwd.ran == 1
    (y, saved, after), (y_p, saved_p, after_p) = outs
    assert torch.equal(y, y_p) and torch.equal(after, after_p)
    assert len(saved) == len(saved_p) == 7
    for a, b in zip(saved, saved_p, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)
