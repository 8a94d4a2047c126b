"""slimgrad._ext's backward bodies (NOTE [Backward bodies from C++] in slimgrad/_ext): the C++
bodies give the Python bodies' bits, buffers and ops, are taken where their case holds, and hand
back to Python (None) where it does not."""

from __future__ import annotations

import importlib

import pytest
import torch

import slimgrad
from slimgrad import _ext
from slimgrad.memory import measure

R = importlib.import_module("slimgrad.ops.rms_norm")
G = importlib.import_module("slimgrad.ops.gated_mlp")


@pytest.fixture
def ext():
    if _ext.load() is None:
        pytest.skip(f"the C++ extension is not here ({_ext.error()}): the Python bodies run")
    return _ext.load()


class _Counted:
    # wraps an extension function: how often it ran its body (did not hand back None)
    def __init__(self, fn):
        self.fn, self.ran = fn, 0

    def __call__(self, *args):
        r = self.fn(*args)
        self.ran += r is not None
        return r


@pytest.fixture
def counted(ext, monkeypatch):
    rms, mlp = _Counted(ext.rms_norm_bwd), _Counted(ext.gated_mlp_bwd)
    # the Python Functions' bodies (the C++ RMSNorm node has its own tests: test_rms_norm_node.py)
    monkeypatch.setattr(R, "_EXT_NODE", None)
    monkeypatch.setattr(R, "_EXT_BWD", rms)
    monkeypatch.setattr(G, "_EXT_BWD", mlp)
    return rms, mlp


def _python_bodies(monkeypatch):
    monkeypatch.setattr(R, "_EXT_BWD", None)
    monkeypatch.setattr(G, "_EXT_BWD", None)


def _grads(model, ids):
    for p in model.parameters():
        p.grad = None
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


def test_hf_llama_grads_bit_identical_to_the_python_bodies(counted, monkeypatch):
    # a 2-layer, 256-wide HF Llama: every RMSNorm (5) and MLP (2) backward runs in C++ (at the
    # token counts where each applies), and every gradient is torch.equal to the Python bodies'
    # (two steps: the second with the tables warm)
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=128,
    )
    model = slimgrad.convert_(transformers.LlamaForCausalLM(cfg).train())
    # 66 tokens: the RMSNorms' one-chunk bodies; 256: the MLPs' lean backward (it runs where it
    # peaks below eager's: NOTE [The gated MLP's peak against eager's] in ops/gated_mlp.py)
    batches = [torch.randint(0, 512, (2, t)) for t in (33, 128)]
    ours = [[_grads(model, ids) for _ in range(2)] for ids in batches]
    rms, mlp = counted
    assert (rms.ran, mlp.ran) == (10, 4)
    _python_bodies(monkeypatch)
    for steps, ids in zip(ours, batches, strict=True):
        ref = _grads(model, ids)
        for step in steps:
            for a, b in zip(step, ref, strict=True):
                assert torch.equal(a, b)


def _rms_case(kind, shape, dtype, grad, need_w):
    from slimgrad.nn.rms_norm import HFRMSNorm, RMSNorm

    torch.manual_seed(1)
    d = shape[-1]
    if kind == "hf":
        transformers = pytest.importorskip("transformers")
        norm = HFRMSNorm.from_hf(transformers.models.llama.modeling_llama.LlamaRMSNorm(d), "llama")
    elif kind == "nn2d":  # a normalized shape of two dims: a 2-D weight
        norm = RMSNorm(list(shape[-2:]), eps=1e-6)
    else:
        norm = RMSNorm(d, eps=1e-6)
    norm = norm.to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    norm.weight.requires_grad_(need_w)
    x = torch.randn(shape, dtype=dtype)
    g = torch.randn(shape, dtype=dtype)
    if grad == "transposed":
        g = g.transpose(-1, -2).contiguous().transpose(-1, -2)

    def run():
        xr = x.clone().requires_grad_()
        y = norm(xr * 1)
        if grad == "granted":  # the gradient reaching the norm is a dead buffer
            (y * g).sum().backward()
        else:
            y.backward(g)
        return [xr.grad] + ([norm.weight.grad] if need_w else [])

    def both():
        norm.weight.grad = None
        out = run()
        norm.weight.grad = None
        return out

    return both, g.is_contiguous()


@pytest.mark.parametrize("kind", ["hf", "nn", "nn2d"])
@pytest.mark.parametrize("grad", ["granted", "held", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 7), (3, 5, 64), (2, 3, 33)])
def test_rms_norm_bits_equal_the_python_body(counted, monkeypatch, kind, grad, dtype, shape):
    if kind == "hf" and dtype == torch.float64:
        pytest.skip("HF's RMSNorm on float64 keeps x (the recompute path): no one-chunk body")
    rms, _ = counted
    for need_w in (True, False):
        step, contiguous = _rms_case(kind, shape, dtype, grad, need_w)
        step()  # warm-up: the fallback tables, the backend
        before = rms.ran
        ours = step()
        # a dy that is not contiguous is copied by the Python body (the C++ body hands it back)
        assert rms.ran == before + contiguous
        with monkeypatch.context() as m:
            m.setattr(R, "_EXT_BWD", None)
            ref = step()
        for a, b in zip(ours, ref, strict=True):
            assert torch.equal(a, b)


def test_rms_norm_several_chunks_and_fallback_channels_stay_in_python(counted, monkeypatch):
    # rows over one chunk (NOTE [RMSNorm's one-chunk backward in the tensors' own shapes]), and a
    # weight with a fallback channel (an index table saved): the Python body runs
    from slimgrad._math import norms
    from slimgrad.nn.rms_norm import RMSNorm

    rms, _ = counted
    monkeypatch.setattr(norms, "CHUNK_ELEMS", 64)
    norm = RMSNorm(16)
    x = torch.randn(40, 16, requires_grad=True)
    (norm(x * 1) * 2).sum().backward()
    assert rms.ran == 0
    monkeypatch.undo()
    monkeypatch.setattr(R, "_EXT_BWD", rms)
    with torch.no_grad():
        norm.weight[3] = 0.0
    (norm(x * 1) * 2).sum().backward()
    assert rms.ran == 0
    with torch.no_grad():
        norm.weight[3] = 1.0
    (norm(x * 1) * 2).sum().backward()
    assert rms.ran == 1


def test_subclasses_and_function_modes_get_none(ext):
    # a tensor subclass or a torch function mode would see Python's calls: handed back
    from torch.overrides import TorchFunctionMode

    class Sub(torch.Tensor):
        pass

    y, dy, w = torch.randn(4, 8), torch.randn(4, 8), torch.rand(8) + 0.5
    rstd = torch.rand(4, 1)
    assert ext.rms_norm_bwd(dy, y, rstd, w, 8, True, False, 1 << 15, False) is not None
    assert ext.rms_norm_bwd(dy.as_subclass(Sub), y, rstd, w, 8, True, False, 1 << 15, False) is None
    assert (
        ext.rms_norm_bwd(dy, y, rstd, w.as_subclass(Sub), [8], True, False, 1 << 15, False) is None
    )
    with TorchFunctionMode():
        assert ext.rms_norm_bwd(dy, y, rstd, w, 8, True, False, 1 << 15, False) is None
    with torch.profiler.profile():  # a watcher: refused only where the gate is asked
        assert ext.rms_norm_bwd(dy, y, rstd, w, 8, True, False, 1 << 15, True) is None
        assert ext.rms_norm_bwd(dy, y, rstd, w, 8, True, False, 1 << 15, False) is not None
    x, g, u = torch.randn(4, 8), torch.randn(4, 16), torch.randn(4, 16)
    wg, wu, wd = torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 16)
    assert ext.gated_mlp_bwd(dy, x, g, u, wg, wu, wd, 0) is not None
    assert ext.gated_mlp_bwd(dy, x, g.as_subclass(Sub), u, wg, wu, wd, 0) is None
    with TorchFunctionMode():
        assert ext.gated_mlp_bwd(dy, x, g, u, wg, wu, wd, 0) is None


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_gated_mlp_bits_equal_the_python_body(counted, monkeypatch, activation):
    from slimgrad.ops.gated_mlp import gated_mlp

    _, mlp = counted
    torch.manual_seed(0)
    wg = torch.nn.Parameter(torch.randn(37, 24) * 0.2)
    wu = torch.nn.Parameter(torch.randn(37, 24) * 0.2)
    wd = torch.nn.Parameter(torch.randn(24, 37) * 0.2)
    x0 = torch.randn(3, 5, 24)
    gy = torch.randn(3, 5, 24)

    def step():
        x = x0.clone().requires_grad_()
        y = gated_mlp(x * 1, wg, wu, wd, activation=activation)
        return torch.autograd.grad(y, [x, wg, wu, wd], gy)

    ours = step()
    assert mlp.ran == 1
    with monkeypatch.context() as m:
        m.setattr(G, "_EXT_BWD", None)
        ref = step()
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b)


def _llama_block():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    cfg = transformers.LlamaConfig(hidden_size=48, intermediate_size=80, num_attention_heads=4)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.mlp = LlamaRMSNorm(48), LlamaMLP(cfg)

        def forward(self, x):
            return x + self.mlp(self.norm(x))

    torch.manual_seed(0)
    return slimgrad.convert_(Block())


@pytest.mark.parametrize("n", [1, 7, 64])
@pytest.mark.parametrize("model", ["block", "hf_norm", "norm"])
def test_tracker_bytes_equal_the_python_bodies(counted, monkeypatch, model, n):
    # slimgrad.memory's tracker sees the same ops allocate and free the same buffers: saved and
    # peak bytes exactly the Python bodies' (granted gradients: the backward writes into dy)
    from slimgrad.nn.rms_norm import HFRMSNorm, RMSNorm

    torch.manual_seed(n)
    if model == "block":  # an HF RMSNorm and a gated MLP
        m, d = _llama_block(), 48
    elif model == "hf_norm":
        transformers = pytest.importorskip("transformers")
        m, d = HFRMSNorm.from_hf(transformers.models.llama.modeling_llama.LlamaRMSNorm(7)), 7
    else:
        m, d = RMSNorm(7), 7
    # the block's MLP at 2 (n + 32) tokens: where its lean backward runs (60 tokens and more at
    # (48, 80): NOTE [The gated MLP's peak against eager's] in ops/gated_mlp.py)
    x = torch.randn(2, n + 32 if model == "block" else n, d)
    rms, mlp = counted

    def loss():
        xr = x.clone().requires_grad_()
        return (m(xr * 1) * 2).sum()

    loss().backward()  # warm-up
    a = measure(loss, timeline=False)
    assert rms.ran and (mlp.ran or model != "block")
    with monkeypatch.context() as mp:
        mp.setattr(R, "_EXT_BWD", None)
        mp.setattr(G, "_EXT_BWD", None)
        b = measure(loss, timeline=False)
    assert (a.peak_bytes, a.saved_bytes) == (b.peak_bytes, b.saved_bytes)


def test_fake_tensor_estimate_stays_exact(counted):
    # the estimate runs the Python bodies (FakeTensor is a subclass: handed back), the real step
    # the C++ bodies: the same saved and peak bytes
    from slimgrad.memory import estimate

    def make():
        block = _llama_block()
        x = torch.randn(2, 33, 48, requires_grad=True)  # 66 tokens: the MLP's lean backward
        return lambda: (block(x * 1) * 2).sum()

    fwd = make()
    fwd().backward()  # warm-up
    real = measure(fwd, timeline=False)
    rms, mlp = counted
    assert rms.ran and mlp.ran
    est = estimate(make, device="cpu", timeline=False)
    assert (est.peak_bytes, est.saved_bytes) == (real.peak_bytes, real.saved_bytes)


def test_env_names_the_feature_and_why_it_is_off(monkeypatch):
    # `slimgrad env` and `report` state whether the C++ bodies run, and why not
    from slimgrad import _compat

    name = "C++ backward bodies (RMSNorm, gated MLP)"

    def feat():
        return {f.name: f for f in _compat.features()}[name]

    assert feat().on is _ext.probe()[0]
    monkeypatch.setenv(_ext.ENV_VAR, "1")
    off = feat()
    assert not off.on and _ext.ENV_VAR in off.detail and "Python bodies" in off.detail
    assert name in [f.name for f in _compat.features_off()]
