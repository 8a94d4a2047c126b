"""ResNet with slimgrad's CNN handlers (ReLUs unchanged): same gradients, fewer bytes kept.

The ResNet-50 targets (8x224²) are measured by the bench case ``slimgrad.bench.cases.batch_norm``;
here a small ResNet checks the byte formula exactly:

    saved(slimgrad) = saved(eager) - Σ_{BN except the stem and few-valued bn1/bn2} |BN input|

(each BN input is dropped: bn1/bn2 keep their output in place of the ReLU output the next conv kept,
bn3/downsample keep a recipe; the stem BN keeps its output in place of its input because its ReLU
feeds a max-pool; per channel each BN keeps save_mean and save_invstd, as eager, and γ and β as
themselves, not copies, per NOTE [BatchNorm keeps its parameters, not copies] in
``ops/batch_norm.py``. A training BN with at most ``_MAX_FEW`` values per channel keeps x, as
eager (NOTE [Few values per channel] in ``ops/batch_norm.py``): its ReLU and the next conv then
keep the ReLU output, as eager, so nothing is dropped; the default policy replays no conv for such
a norm (NOTE [Which convs the default replays] in ``ops/_derived.py``).)
"""

import copy

import pytest
import torch
from torch import nn

from slimgrad.convert_handlers.cnn import convert_cnn_
from slimgrad.memory import measure
from slimgrad.nn.batch_norm import BatchNorm2d
from slimgrad.ops.batch_norm import _MAX_FEW
from slimgrad.testing import assert_within_rule
from tests.models._resnet_helpers import randomize_bn_, resnet50, small_resnet


def test_resnet50_helper_is_torchvision_sized():
    assert sum(p.numel() for p in resnet50().parameters()) == 25_557_032


def _grads(model, x0, dtype):
    x = x0.to(dtype).requires_grad_()
    y = model(x)
    w = torch.linspace(-1, 1, y.numel(), dtype=dtype).view_as(y)
    (y * w).sum().backward()
    return [y, x.grad] + [p.grad for p in model.parameters()] + list(model.buffers())


@pytest.mark.parametrize("block", ["bottleneck", "basic"])
def test_same_gradients_float64_and_within_rule_float32(block):
    torch.manual_seed(0)
    base = randomize_bn_(small_resnet(block, width=4, layers=(1, 2, 1, 1)))
    x0 = torch.randn(3, 3, 33, 31)
    res = {}
    for name, dt, conv in [
        ("ref", torch.float64, False),
        ("ours64", torch.float64, True),
        ("eager", torch.float32, False),
        ("ours", torch.float32, True),
    ]:
        m = copy.deepcopy(base).to(dt)
        if conv:
            convert_cnn_(m)
            assert isinstance(m.layer1[0].bn2, BatchNorm2d)
        res[name] = _grads(m, x0, dt)
    for a, b in zip(res["ours64"], res["ref"]):
        torch.testing.assert_close(a, b)
    assert_within_rule(res["ours"], res["ref"], res["eager"])


def test_saved_bytes_formula_and_peak():
    torch.manual_seed(0)
    eager = randomize_bn_(small_resnet("bottleneck", width=8, layers=(2, 1, 1, 1)))
    ours = convert_cnn_(copy.deepcopy(eager))
    x0 = torch.randn(2, 3, 48, 40)

    bn_in, few = {}, {}
    hooks = []
    for name, mod in eager.named_modules():
        if isinstance(mod, nn.BatchNorm2d):

            def rec(m, inp, out, name=name):
                bn_in[name] = inp[0].numel() * inp[0].element_size()
                few[name] = inp[0].numel() <= _MAX_FEW * inp[0].shape[1]

            hooks.append(mod.register_forward_hook(rec))

    me = measure(lambda: eager(x0 * 1).square().sum())
    for h in hooks:
        h.remove()
    ms = measure(lambda: ours(x0 * 1).square().sum())
    convs = dict(eager.named_modules())

    def conv_of(bn: str) -> nn.Conv2d:  # the conv whose output the BN normalizes
        head, _, leaf = bn.rpartition(".")
        return convs[f"{head}.0" if leaf == "1" else f"{head}.conv{leaf[2:]}"]

    def replayed(c: nn.Conv2d) -> bool:  # NOTE [Which convs the default replays] in ops/_derived
        return c.kernel_size == (1, 1) and c.in_channels <= c.out_channels

    # few-valued BNs keep x, whatever their conv (the default replays none there): nothing dropped
    keeps_x = [k for k in bn_in if k != "bn1" and few[k]]
    assert any(conv_of(k).kernel_size == (1, 1) for k in keeps_x), "a few-valued bn1 after conv1"
    assert any(replayed(conv_of(k)) for k in keeps_x), "a few-valued bn3 after a pointwise conv"
    assert any(replayed(conv_of(k)) for k in bn_in if k != "bn1" and not few[k]), "one stays"
    assert keeps_x, "the shape must reach NOTE [Few values per channel]"
    dropped = sum(v for k, v in bn_in.items() if k != "bn1" and k not in keeps_x)
    # nothing per channel beyond eager: every BN keeps eager's save_mean and save_invstd and γ, β
    # as themselves (NOTE [BatchNorm keeps its parameters, not copies] in ops/batch_norm.py); the
    # few-valued ones that keep x run eager's own node, which keeps exactly eager's bytes
    assert ms.saved_bytes == me.saved_bytes - dropped
    assert ms.peak_bytes < me.peak_bytes
    assert ms.saved_bytes < 0.75 * me.saved_bytes


def test_frozen_backbone_eval_keeps_no_conv_or_bn_input():
    # Frozen weights, BN in eval, gradient wanted for the input (memsave_torch's case): convs keep
    # no input and BNs nothing full-size; what remains is what ReLU/max-pool keep, as in eager.
    torch.manual_seed(0)
    eager = small_resnet("bottleneck", width=4, layers=(1, 1, 1, 1)).eval()
    eager.requires_grad_(False)
    ours = convert_cnn_(copy.deepcopy(eager))
    x0 = torch.randn(2, 3, 32, 32)
    bn_in, hooks = [], []
    for mod in eager.modules():
        if isinstance(mod, nn.BatchNorm2d):
            hooks.append(mod.register_forward_hook(lambda m, i, o: bn_in.append(i[0].shape)))
    pooled = []
    hooks.append(eager.maxpool.register_forward_hook(lambda m, i, o: pooled.append(o.numel() * 4)))
    me = measure(lambda: eager((x0 * 1).requires_grad_()).square().sum())
    for h in hooks:
        h.remove()
    ms = measure(lambda: ours((x0 * 1).requires_grad_()).square().sum())
    # dropped: every BN input, and the conv inputs that no ReLU keeps (the leaf input, the max-pool
    # output); nothing added: a BN keeps the running statistics, γ and β as themselves and computes
    # invstd in backward (NOTE [BatchNorm keeps its parameters, not copies] in ops/batch_norm.py).
    # Except at BNs whose channels hold no more bytes than 5 floats (running mean, var, invstd, γ,
    # β: the bound _eval_cannot_win still applies): they run eager's own node and keep what eager
    # keeps, their input (NOTE [Eval calls that cannot win] in ops/batch_norm.py)
    lean = [sh for sh in bn_in if sh.numel() // sh[1] * 4 > 5 * 4]
    assert len(lean) < len(bn_in), "the shape must reach a BN that cannot win"
    dropped = sum(sh.numel() * 4 for sh in lean) + x0.numel() * 4 + pooled[0]
    assert ms.saved_bytes == me.saved_bytes - dropped


def test_graph_and_registries_freed_by_refcount():
    # No reference cycles: with the cyclic gc off, dropping the loss frees every registry entry
    # (and with it the kept tensors), with or without a backward.
    import gc

    from slimgrad.ops import _derived

    model = convert_cnn_(small_resnet("bottleneck", width=4, layers=(1, 1, 1, 1)))
    x = torch.randn(2, 3, 32, 32)
    regs = (_derived._SOURCES, _derived._DERIVED, _derived._RECIPES)
    gc.collect()
    # entries of tensors an earlier test still holds (e.g. a forward hook's list of outputs in
    # tests/conformance/test_torch_patterns.py) are not this model's: count from them
    before = [len(r) for r in regs]
    gc.disable()
    try:
        for do_backward in (True, False):
            loss = model(x).square().sum()
            assert len(_derived._SOURCES) > before[0]
            if do_backward:
                loss.backward()
            del loss
            assert [len(r) for r in regs] == before
    finally:
        gc.enable()
