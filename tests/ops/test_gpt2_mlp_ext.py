"""GPT-2's MLP node's backward issued from C++ (NOTE [GPT-2's MLP backward from C++] in
ops/gpt2_mlp.py; ``_ext/backward.cpp`` ``gpt2_mlp_bwd``): taken where the node's steps ran
straight, the Python body's bits, and the Python body wherever it hands back None."""

from __future__ import annotations

import copy

import pytest
import torch

import slimgrad
import slimgrad.nn.gpt2_mlp as ngm
import slimgrad.ops.gpt2_mlp as ogm
from slimgrad.ops.gpt2_mlp import gpt2_mlp
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
    # wraps the extension function: how often it ran its body (did not hand back None), and the
    # largest number of the GELU's hard elements it was handed (argument 13: idx)
    def __init__(self, fn):
        self.fn, self.ran, self.calls, self.hard = fn, 0, 0, []

    def __call__(self, *args):
        r = self.fn(*args)
        self.calls += 1
        self.ran += r is not None
        if r is not None and args[13] is not None:
            self.hard.append(args[13].shape[0])
        return r


def _warm():
    # the dropout and GELU C kernels are built by the first general-path calls in the process:
    # one call first, so the node's steps take their straight paths
    w1, w2 = torch.randn(8, 96, requires_grad=True), torch.randn(96, 8, requires_grad=True)
    gpt2_mlp(torch.randn(2, 7, 8), w1, None, w2, None, "tanh", 0.1).sum().backward()


@pytest.fixture
def counted(ext, monkeypatch):
    _warm()
    c = _Counted(ext.gpt2_mlp_bwd)
    monkeypatch.setattr(ogm, "_EXT_MLP", c)
    return c


@pytest.mark.parametrize("mode", ["train", "eval", "no_dropout"])
@pytest.mark.parametrize("frozen", [None, "c_fc", "c_fc_bias", "c_proj", "c_proj_bias", "ln_2"])
@pytest.mark.parametrize("padded", [False, True])
def test_model_bits_as_the_python_body(mode, frozen, padded, counted, monkeypatch):
    # HF GPT-2 (2 layers), converted: each ln_2 + MLP node's MLP backward runs in C++ (its
    # LayerNorm's in Python), and the loss, every gradient and the generator's state after the
    # steps equal the Python body's, frozen weights, eval (no dropout step) and p = 0 included
    nodes = [0]
    real = ngm._GPT2_LN_MLP_APPLY

    def node(*a):
        nodes[0] += 1
        return real(*a)

    monkeypatch.setattr(ngm, "_GPT2_LN_MLP_APPLY", node)
    model = slimgrad.convert_(gpt2_model(pdrop=0.0 if mode == "no_dropout" else 0.1))
    model.train(mode != "eval")
    if frozen is not None:
        for blk in model.transformer.h:
            if frozen == "ln_2":
                blk.ln_2.weight.requires_grad_(False)
                blk.ln_2.bias.requires_grad_(False)
            elif frozen.endswith("_bias"):
                getattr(blk.mlp, frozen[:-5]).bias.requires_grad_(False)
            else:
                getattr(blk.mlp, frozen).weight.requires_grad_(False)
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(3))
    kw = {}
    if padded:
        mask = torch.ones(2, 13, dtype=torch.long)
        mask[1, :4] = 0
        kw["attention_mask"] = mask
    ours = [gpt2_step(model, ids, **kw) for _ in range(2)]
    assert nodes[0] == 4  # 2 layers x 2 steps, padded or not
    assert counted.ran == counted.calls == 4
    after = torch.rand(3)  # the generator's state after the two steps: the same draws
    monkeypatch.setattr(ogm, "_EXT_MLP", None)
    for r in ours:
        assert_same_step(r, gpt2_step(model, ids, **kw))
    assert torch.equal(after, torch.rand(3))


def test_the_gelu_hard_elements_run_in_cpp(counted, monkeypatch):
    # the GELU's hard elements (its data-dependent exact part: index_select, gelu_backward,
    # index_put_) are issued from C++ too: a run with some and one without, each the Python bits
    g = torch.Generator().manual_seed(4)
    w1 = torch.randn(8, 96, generator=g).requires_grad_()
    w2 = torch.randn(96, 8, generator=g).requires_grad_()
    for scale in (0.3, 1e-3):  # 1e-3: h near 0, away from the hard window (1.0: dense fallback)
        x = (torch.randn(2, 7, 8, generator=g) * scale).requires_grad_()
        dy = torch.randn(2, 7, 8, generator=g)
        out = []
        for fn in (counted, None):
            monkeypatch.setattr(ogm, "_EXT_MLP", fn)
            torch.manual_seed(1)
            y = gpt2_mlp(x, w1, None, w2, None, "none", 0.2)
            out.append((y.detach(), torch.autograd.grad(y, (x, w1, w2), dy)))
        (y, gr), (y_p, gr_p) = out
        assert torch.equal(y, y_p)
        for a, b in zip(gr, gr_p, strict=True):
            assert torch.equal(a, b)
    assert counted.ran == 2
    assert counted.hard[0] > 0 and counted.hard[1] == 0


def _args(seed=0, b=2, t=13, c=16, hid=40, bias=True):
    g = torch.Generator().manual_seed(seed)
    # x and W_fc scaled by 0.3, b_fc shifted by +1.5: h mostly outside the GELU's hard window (at
    # N(0, 1) entries more than 1/16 of h may lie in it, by the window this CPU's erf decides: NOTE
    # [A window from eager's own forward error], and the GELU keeps x densely, its general path)
    x = torch.randn(b, t, c, generator=g).mul_(0.3).requires_grad_()
    w1 = torch.randn(c, hid, generator=g).mul_(0.3).requires_grad_()
    b1 = torch.randn(hid, generator=g).add_(1.5).requires_grad_() if bias else None
    w2 = torch.randn(hid, c, generator=g, requires_grad=True)
    b2 = torch.randn(c, generator=g, requires_grad=True) if bias else None
    return [x, w1, b1, w2, b2]


def _grads(args, subset, dy, ext_fn, monkeypatch, approximate="tanh", p=0.3):
    monkeypatch.setattr(ogm, "_EXT_MLP", ext_fn)
    torch.manual_seed(1)
    y = gpt2_mlp(*args, approximate, p)
    live = [a for a in args if a is not None]
    inputs = {
        None: live, "x": args[:1], "fc": args[1:3], "proj": args[3:5], "w_proj": args[3:4],
        "b_proj": args[4:5], "w_fc": args[1:2],
    }[subset]  # fmt: skip
    return y.detach(), torch.autograd.grad(y, inputs, dy)


@pytest.mark.parametrize("subset", [None, "x", "fc", "proj", "w_proj", "b_proj", "w_fc"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("p", [0.3, 0.0])
def test_functional_bits_and_subsets(subset, approximate, p, counted, monkeypatch):
    # needs_input_grad subsets (each step only where its gradient is needed), both GELU forms,
    # with and without dropout; dy is the caller's (not granted: never written over)
    args = _args()
    dy = torch.randn(2, 13, 16, generator=torch.Generator().manual_seed(9))
    dy0 = dy.clone()
    y, g = _grads(args, subset, dy, counted, monkeypatch, approximate, p)
    assert counted.ran == 1
    assert torch.equal(dy, dy0)
    y_p, g_p = _grads(args, subset, dy, None, monkeypatch, approximate, p)
    assert torch.equal(y, y_p)
    assert_equal_each(g, g_p)


def test_without_biases(counted, monkeypatch):
    args = _args(bias=False)
    dy = torch.randn(2, 13, 16, generator=torch.Generator().manual_seed(9))
    y, g = _grads(args, None, dy, counted, monkeypatch)
    y_p, g_p = _grads(args, None, dy, None, monkeypatch)
    assert counted.ran == 1
    assert_equal_each(g, g_p)


def test_a_non_contiguous_gradient_runs_the_python_body(counted, monkeypatch):
    args = _args()
    dy = torch.randn(2, 16, 13, generator=torch.Generator().manual_seed(9)).mT
    y, g = _grads(args, None, dy, counted, monkeypatch)
    assert (counted.calls, counted.ran) == (1, 0)  # handed back: the Python body ran
    y_p, g_p = _grads(args, None, dy, None, monkeypatch)
    assert_equal_each(g, g_p)


def test_under_a_torch_function_mode_the_python_body_runs(ext, monkeypatch):
    # the C++ body hands back None while a torch function mode is on (the mode would see the
    # Python body's calls); autograd's engine runs backward with the caller's modes off, so the
    # mode is entered around the extension's call itself
    under_mode, results = under_a_function_mode(ext.gpt2_mlp_bwd)
    _warm()
    args = _args()
    dy = torch.randn(2, 13, 16, generator=torch.Generator().manual_seed(9))
    y, g = _grads(args, None, dy, under_mode, monkeypatch)
    assert results == [None]
    y_p, g_p = _grads(args, None, dy, ext.gpt2_mlp_bwd, monkeypatch)
    assert_equal_each(g, g_p)


def test_memory_and_retain_graph_as_the_python_body(counted, monkeypatch):
    # the tracker's measured step runs under a dispatch mode: the Python body (never the C++
    # one), so its bytes are the Python body's; a retained graph's second backward (dy not
    # granted) gives the first one's gradients
    model = slimgrad.convert_(gpt2_model().train())
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(3))
    rep = slimgrad.memory.measure(lambda: model(input_ids=ids, labels=ids).loss)
    assert counted.calls == 0
    monkeypatch.setattr(ogm, "_EXT_MLP", None)
    for p in model.parameters():
        p.grad = None
    rep_p = slimgrad.memory.measure(lambda: model(input_ids=ids, labels=ids).loss)
    assert (rep.peak_bytes, rep.saved_bytes) == (rep_p.peak_bytes, rep_p.saved_bytes)
    monkeypatch.setattr(ogm, "_EXT_MLP", counted)
    m2 = copy.deepcopy(model)
    torch.manual_seed(5)
    loss = m2(input_ids=ids, labels=ids).loss
    params = list(m2.parameters())
    first = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    second = torch.autograd.grad(loss, params, allow_unused=True)
    assert counted.ran == 4  # 2 layers x 2 backwards
    for a, b in zip(first, second, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def _allocations(fn) -> list[int]:
    # the CPU allocator's allocations and frees (bytes, + and -) in the order they happened while
    # fn ran, as the profiler records them (outside any dispatch mode: the C++ body runs)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    results = getattr(prof.profiler, "kineto_results", None)
    if results is None:
        pytest.skip("this torch's profiler does not expose its memory events")
    ev = [e for e in results.events() if e.name() == "[memory]"]
    return [e.nbytes() for e in sorted(ev, key=lambda e: e.start_ns())]


def test_allocations_in_the_python_body_order(counted, monkeypatch):
    # the same allocations and frees in the same order (so the same peak) as the Python body:
    # the node with dropout and the GELU's hard elements, dy the caller's (not granted), then dy
    # granted; forward outside the profiler (under it, slimgrad's gate takes the general paths)
    args = _args()
    dy = torch.randn(2, 13, 16, generator=torch.Generator().manual_seed(9))
    traces = []
    for fn in (counted, None):
        monkeypatch.setattr(ogm, "_EXT_MLP", fn)
        torch.manual_seed(1)
        y = gpt2_mlp(*args, "none", 0.3)
        traces.append(_allocations(lambda y=y: torch.autograd.grad(y, args, dy)))
    assert counted.ran == 1 and counted.hard[0] > 0
    assert traces[0] == traces[1] and len(traces[0]) > 10
    # dy granted (made by the multiplication's backward: nobody else holds it): the dropout's
    # pass and the rest as the Python body, into dy
    traces = []
    for fn in (counted, None):
        monkeypatch.setattr(ogm, "_EXT_MLP", fn)
        torch.manual_seed(1)
        y = gpt2_mlp(*args, "none", 0.3)
        loss = (y * dy).sum()
        traces.append(_allocations(lambda loss=loss: torch.autograd.grad(loss, args)))
    assert counted.ran == 2
    assert traces[0] == traces[1] and len(traces[0]) > 10


def test_create_graph_first_derivatives_as_the_python_body(counted, monkeypatch):
    # create_graph=True: the node's first-order body runs under no_grad (refuse_second_order),
    # the C++ one too, with dy not granted: the Python body's first derivatives, and
    # differentiating them raises either way
    args = _args()
    dy = torch.randn(2, 13, 16, generator=torch.Generator().manual_seed(9))
    res = []
    for fn in (counted, None):
        monkeypatch.setattr(ogm, "_EXT_MLP", fn)
        torch.manual_seed(1)
        y = gpt2_mlp(*args, "tanh", 0.3)
        g = torch.autograd.grad(y, args, dy, create_graph=True)
        with pytest.raises(RuntimeError, match="ops.gpt2_mlp"):
            torch.autograd.grad(g[0].sum(), args[0])
        res.append([t.detach() for t in g])
    assert counted.ran == 1
    for a, b in zip(*res, strict=True):
        assert torch.equal(a, b)


def test_under_checkpoint_runs_in_cpp(counted, monkeypatch):
    # under a non-reentrant torch.utils.checkpoint the GELU's side tables come back held (NOTE
    # [Side tables under torch.utils.checkpoint]): rebuilt, the C++ body takes them, with the
    # Python body's bits; the recompute's dense fallback (scale 1.0) runs the Python body
    import torch.utils.checkpoint as cp

    g = torch.Generator().manual_seed(4)
    w1 = torch.randn(8, 96, generator=g).requires_grad_()
    w2 = torch.randn(96, 8, generator=g).requires_grad_()
    for scale in (0.3, 1e-3, 1.0):
        x = (torch.randn(2, 7, 8, generator=g) * scale).requires_grad_()
        dy = torch.randn(2, 7, 8, generator=g)
        out = []
        for fn in (counted, None):
            monkeypatch.setattr(ogm, "_EXT_MLP", fn)
            torch.manual_seed(1)
            y = cp.checkpoint(gpt2_mlp, x, w1, None, w2, None, "none", 0.2, use_reentrant=False)
            out.append((y.detach(), torch.autograd.grad(y, (x, w1, w2), dy)))
        (y, gr), (y_p, gr_p) = out
        assert torch.equal(y, y_p)
        assert_equal_each(gr, gr_p)
    assert counted.calls == counted.ran == 2  # the dense fallback declined before the call
    assert counted.hard[0] > 0 and counted.hard[1] == 0
