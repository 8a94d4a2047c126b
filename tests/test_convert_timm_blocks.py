"""convert_handlers.timm_blocks: timm's Attention and ConvNeXtBlock, exact on every path.

The fast paths (``ops.qkv_attention``, ``ops.linear_scale``) against timm's modules: forward bit
for bit, gradients by the error rule (``slimgrad.verify`` against float64), the bytes they no
longer keep, exactly; every input the fast path does not cover runs timm's own forward (masks,
qk_norm, timm's non-fused path, attention dropout in training, hooks, conv_mlp, no layer scale,
GlobalResponseNorm MLPs). Skipped without timm (tests/conformance/_timm_shim.py imports it).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.convert_handlers import timm_blocks
from slimgrad.memory import measure
from slimgrad.testing import assert_within_rule
from tests.conformance._timm_shim import timm

pytestmark = pytest.mark.skipif(timm is None, reason="timm (and torchvision) not installed")


def _affine(model):
    for m in model.modules():
        if isinstance(m, nn.LayerNorm) and m.weight is not None:
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.2, 0.2)
    for name, p in model.named_parameters():
        if name.endswith("gamma"):
            nn.init.uniform_(p, -1.0, 1.0)  # layer scale: signs and sizes, not 1e-6
    return model


def _vit(**kw):
    torch.manual_seed(0)
    vt = timm.models.vision_transformer
    args = dict(img_size=16, patch_size=4, embed_dim=24, depth=2, num_heads=3, num_classes=5)
    return _affine(vt.VisionTransformer(**{**args, **kw}))


def _convnext(**kw):
    torch.manual_seed(0)
    args = dict(depths=(2, 1, 1, 1), dims=(8, 8, 16, 16), num_classes=5)
    return _affine(timm.models.convnext.ConvNeXt(**{**args, **kw}))


def _converted(model, **kw):
    return slimgrad.convert_(copy.deepcopy(model), **kw)


def _skipped(model):
    return {n: r for n, _, r in slimgrad.report(model).skipped}


# ------------------------------------------------------------------------------------- ViT


def test_vit_attention_converts_verifies_and_forward_is_eager():
    model = _vit()
    slim = _converted(model)
    assert all(type(b.attn) is timm_blocks.Attention for b in slim.blocks)
    assert list(slim.state_dict()) == list(model.state_dict())
    x = torch.randn(3, 3, 16, 16)
    res = slimgrad.verify(model, slim, x)
    assert res.ok, str(res)
    torch.testing.assert_close(slim(x), model(x), rtol=0, atol=0)


def _attn_pair(**kw):
    model = _vit(**kw)
    holder = nn.ModuleDict({"attn": copy.deepcopy(model.blocks[0].attn)})
    slimgrad.convert_(holder)
    return model.blocks[0].attn, holder["attn"]


def _attn_step(att, x, dy, **kw):
    torch.manual_seed(1)
    x = x.clone().requires_grad_()
    y = att(x, **kw)
    grads = torch.autograd.grad(y, [x, *att.parameters()], dy)
    return [y, *grads]


def _same(a, b):
    for s, e in zip(a, b, strict=True):
        torch.testing.assert_close(s, e, rtol=0, atol=0)


def _fast_matches(slim, eager, x, dy, **call):
    # the fast path: forward bit for bit, gradients by the rule against float64
    got, want = _attn_step(slim, x, dy, **call), _attn_step(eager, x, dy, **call)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    ref = _attn_step(copy.deepcopy(eager).double(), x.double(), dy.double(), **call)
    assert_within_rule(got, ref, want)


def test_attention_saves_v_exactly():
    eager, slim = _attn_pair()
    assert type(slim) is timm_blocks.Attention
    b, n, c = 3, 10, 24
    x0 = torch.randn(b, n, c, requires_grad=True)

    def step(att):
        # the input comes from a ReLU that keeps it anyway (as LayerNorm's output does)
        return lambda: att(torch.relu(x0)).square().sum()

    ms = measure(step(slim))
    x0.grad = None
    for p in eager.parameters():
        p.grad = None
    me = measure(step(eager))
    assert me.saved_bytes - ms.saved_bytes == b * n * c * 4  # v


def _mask(b, n, kind):
    g = torch.Generator().manual_seed(3)
    if kind == "bool":
        m = torch.rand(b, 1, n, n, generator=g) > 0.3
        m[..., 0] = True
        return m
    return torch.randn(b, 1, n, n, generator=g)


@pytest.mark.parametrize("case", ["float_mask", "bool_mask", "causal", "not_fused", "drop", "hook"])
def test_attention_paths_are_timms(case):
    kw = dict(attn_drop_rate=0.25) if case == "drop" else {}
    eager, slim = _attn_pair(**kw)
    for m in (eager, slim):
        m.train()
        if case == "not_fused":
            m.fused_attn = False
    calls = []
    if case == "hook":
        slim.qkv.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    x, dy = torch.randn(2, 7, 24), torch.randn(2, 7, 24)
    call = {}
    if case.endswith("mask"):
        call["attn_mask"] = _mask(2, 7, case.split("_")[0])
    if case == "causal":
        call["is_causal"] = True
    if case == "causal":
        _fast_matches(slim, eager, x, dy, **call)
    else:
        _same(_attn_step(slim, x, dy, **call), _attn_step(eager, x, dy, **call))
    if case == "hook":
        assert calls == [torch.Size([2, 7, 72])]


def test_attention_no_grad_eval_and_qk_norm():
    eager, slim = _attn_pair()
    x = torch.randn(2, 7, 24)
    with torch.no_grad():
        torch.testing.assert_close(slim(x), eager(x), rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # eager's ops: timm's forward, bit for bit
        ys = slim(x.requires_grad_())
        ye = timm.layers.Attention.forward(slim, x)
    torch.testing.assert_close(ys, ye, rtol=0, atol=0)
    slim.eval(), eager.eval()
    _fast_matches(slim, eager, x.detach(), x.detach())
    model = _vit(qk_norm=True, attn_drop_rate=0.1)  # timm's forward, its norms converted
    res = slimgrad.verify(model, _converted(model), torch.randn(2, 3, 16, 16))
    assert res.ok, str(res)


def test_attention_subclass_with_own_forward_stays():
    class MyAttention(timm.layers.Attention):
        def forward(self, x, attn_mask=None, is_causal=False):
            return super().forward(x) * 2

    holder = nn.ModuleDict({"a": MyAttention(24, num_heads=3)})
    slimgrad.convert_(holder)
    assert type(holder["a"]) is MyAttention
    assert "MyAttention overrides forward" in _skipped(holder)["a"]


# --------------------------------------------------------------------------------- ConvNeXt


def test_convnext_converts_verifies_channels_last_and_odd_sizes():
    model = _convnext(drop_path_rate=0.2)
    slim = _converted(model)
    blocks = [m for m in slim.modules() if type(m) is timm_blocks.ConvNeXtBlock]
    assert len(blocks) == 5
    assert list(slim.state_dict()) == list(model.state_dict())
    x = torch.randn(2, 3, 35, 33)  # odd: 8x8, 4x4, 2x2, 1x1 after the stem
    res = slimgrad.verify(model, slim, x.to(memory_format=torch.channels_last), modes=("train",))
    assert res.ok, str(res)
    for mod in (model, slim):
        mod.eval()
    torch.testing.assert_close(slim(x), model(x), rtol=0, atol=0)


def test_convnext_block_output_and_strides_are_eagers():
    model = _convnext()
    slim = _converted(model)
    be, bs = model.stages[0].blocks[0], slim.stages[0].blocks[0]
    for x in (
        torch.randn(2, 8, 9, 7),
        torch.randn(2, 8, 9, 7).to(memory_format=torch.channels_last),
    ):
        ye, ys = be(x), bs(x)
        torch.testing.assert_close(ys, ye, rtol=0, atol=0)
        assert ys.stride() == ye.stride()


def test_convnext_saves_fc2_output_exactly():
    model = _convnext()
    slim = _converted(model)
    # the same converted model with every block on timm's forward: a no-op hook on a module the
    # fast path does not call (mlp.norm)
    ref = copy.deepcopy(slim)
    for m in ref.modules():
        if type(m) is timm_blocks.ConvNeXtBlock:
            m.mlp.norm.register_forward_hook(lambda *a: None)
    x = torch.randn(2, 3, 32, 32)
    ms = measure(lambda: slim(x).square().mean())
    mr = measure(lambda: ref(x).square().mean())
    # every block's fc2 output, batch 2: stage 0 (2 blocks of 8 x 8x8), 1 (8 x 4x4), 2, 3
    fc2_out = 2 * 4 * (2 * 8 * 64 + 8 * 16 + 16 * 4 + 16 * 1)
    assert mr.saved_bytes - ms.saved_bytes == fc2_out
    assert ms.peak_bytes <= mr.peak_bytes


@pytest.mark.parametrize(
    "kw, why",
    [
        (dict(conv_mlp=True), "conv_mlp=True"),
        (dict(ls_init_value=None), "no layer scale"),
        (dict(use_grn=True), "expected timm's Mlp"),
    ],
)
def test_convnext_blocks_without_the_pattern_stay(kw, why):
    model = _convnext(**kw)
    slim = _converted(model)
    skipped = _skipped(slim)
    assert why in skipped["stages.0.blocks.0"], skipped
    assert not any(type(m) is timm_blocks.ConvNeXtBlock for m in slim.modules())
    assert type(slim.stages[0].blocks[0]) is timm.models.convnext.ConvNeXtBlock


def test_convnext_hooks_and_dropout_take_timms_forward():
    slim = _converted(_convnext())
    bs = slim.stages[0].blocks[0]

    def timms(x):  # timm's own forward on the same (converted) children
        return timm.models.convnext.ConvNeXtBlock.forward(bs, x)

    calls = []
    handle = bs.mlp.fc2.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    x = torch.randn(2, 8, 5, 6, requires_grad=True)
    _same(_conv_step(bs, x), _conv_step(timms, x, bs))
    assert calls == [torch.Size([2, 5, 6, 8])] * 2
    handle.remove()
    bs.mlp.drop2.p = 0.3  # dropout after fc2: the same mask from the same seed
    _same(_conv_step(bs, x), _conv_step(timms, x, bs))


def _conv_step(fn, x, block=None):
    torch.manual_seed(1)
    y = fn(x)
    params = list((block or fn).parameters())
    return [y, *torch.autograd.grad(y.square().sum(), [x, *params])]


def test_converted_blocks_refuse_jit_script_clearly():
    _, slim = _attn_pair()
    with pytest.raises(RuntimeError, match="slimgrad.nn.Attention: torch.jit.script"):
        torch.jit.script(slim)
    block = _converted(_convnext()).stages[0].blocks[0]
    with pytest.raises(RuntimeError, match="slimgrad.nn.ConvNeXtBlock: torch.jit.script"):
        torch.jit.script(block)
