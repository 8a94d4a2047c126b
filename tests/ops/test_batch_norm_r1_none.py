"""A double backward (R1 / gradient penalty) through a converted BatchNorm leaves ``.grad`` None
where eager leaves it None (β after Conv -> BN -> Conv: the penalty does not depend on it), so an
optimizer with weight decay skips it as eager's does (NOTE [BatchNorm's output gradient that
never came] in slimgrad/ops/batch_norm.py; issue 30)."""

import copy

import pytest
import torch
import torch.nn as nn

import slimgrad


def _conv_bn_conv(act):
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), *act, nn.Conv2d(8, 4, 3))
    with torch.no_grad():
        m[1].bias.fill_(0.5)
    return m, (3, 3, 9, 8)


def _lin_bn_lin():
    m = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    with torch.no_grad():
        m[1].bias.fill_(0.5)
    return m, (12, 16)


CASES = {
    "conv-bn-conv": lambda: _conv_bn_conv(()),
    "conv-bn-relu-conv": lambda: _conv_bn_conv((nn.ReLU(),)),
    "lin-bn1d-lin": _lin_bn_lin,
}


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("name", list(CASES))
def test_r1_penalty_grads_none_as_eager(name, train):
    torch.manual_seed(0)
    base, shape = CASES[name]()
    base.train(train)
    x = torch.randn(*shape)
    res = {}
    for side in ("eager", "slim"):
        m = copy.deepcopy(base)
        if side == "slim":
            slimgrad.convert_(m)
            assert any(type(a) is not type(b) for a, b in zip(base.modules(), m.modules()))
        # SGD: linear in the gradients (Adam amplifies rounding of near-zero ones); weight decay
        # moves a parameter whose .grad is a zero tensor, not one whose .grad is None
        opt = torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, weight_decay=0.1)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            (g,) = torch.autograd.grad(m(xi).mean(), xi, create_graph=True)
            g.pow(2).sum().backward()
            grads = {k: p.grad for k, p in m.named_parameters()}
            opt.step()
        res[side] = grads, {k: v.detach().clone() for k, v in m.state_dict().items()}
    (ge, se), (gs, ss) = res["eager"], res["slim"]
    assert {k for k, v in ge.items() if v is None} == {k for k, v in gs.items() if v is None}
    for k, v in ge.items():
        if v is not None:
            torch.testing.assert_close(gs[k], v, rtol=1e-4, atol=1e-6)
    for k, v in se.items():
        torch.testing.assert_close(ss[k], v, rtol=1e-4, atol=1e-6)


def test_retained_graph_after_a_missing_gradient():
    # the node that got no gradient keeps what it kept while the graph is retained: a later
    # backward through it is eager's
    torch.manual_seed(0)
    base, shape = CASES["conv-bn-conv"]()
    x = torch.randn(*shape)
    res = []
    for conv in (False, True):
        m = copy.deepcopy(base)
        if conv:
            slimgrad.convert_(m)
        xi = x.clone().requires_grad_(True)
        out = m(xi)
        (g,) = torch.autograd.grad(out.mean(), xi, create_graph=True, retain_graph=True)
        g.pow(2).sum().backward(retain_graph=True)
        out.square().sum().backward()
        res.append({k: p.grad for k, p in m.named_parameters()})
    for k, v in res[0].items():
        torch.testing.assert_close(res[1][k], v, rtol=1e-4, atol=1e-6)
