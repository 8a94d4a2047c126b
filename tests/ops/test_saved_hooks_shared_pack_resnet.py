"""Issue 33: a converted bottleneck ResNet (torchvision's block: conv1x1 -> BN -> ReLU -> conv3x3 ->
BN -> ReLU -> conv1x1 -> BN, + identity or a downsample conv1x1 -> BN, then ReLU in place) stepped
under saved-tensor hooks hands them each BatchNorm output once (for the norm, its ReLU and the next
conv: NOTE [One pack per shared tensor] in ops/_derived.py) and every other tensor it keeps once,
but the tensors eager's own ops keep twice or three times: a block output, kept by its in-place
ReLU (eager's op) and the next block's first conv and downsample conv (eager's node: NOTE [A conv
that keeps what eager keeps] in ops/conv.py), exactly as often as eager hands it over. The stem's
max-pool output is handed over once more than eager hands it: to the downsample norm, which re-runs
its 1x1 conv from it instead of keeping that conv's output, four times its size (NOTE [Under
saved-tensor hooks] in ops/batch_norm.py). An offload then moves less than eager's, and the
gradients are the unhooked converted model's, bit for bit."""

import copy
from collections import Counter

import torch
from torch import nn

import slimgrad
from slimgrad.bench.models import Bottleneck


def _Bottleneck(cin: int, width: int, stride: int) -> nn.Module:
    # torchvision's bottleneck (slimgrad.bench.models), with its downsample where shapes change
    cout = 4 * width
    down = None
    if stride != 1 or cin != cout:
        down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
    return Bottleneck(cin, width, stride, down)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 7, 2, 3, bias=False)
        self.bn1, self.relu = nn.BatchNorm2d(8), nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = nn.Sequential(_Bottleneck(8, 4, 1), _Bottleneck(16, 4, 1))
        self.layer2 = nn.Sequential(_Bottleneck(16, 8, 2), _Bottleneck(32, 8, 1))
        self.seen: dict = {}  # the tensors eager and converted both make: storage -> name

    def forward(self, x):
        self.seen = {x.untyped_storage().data_ptr(): "input"}
        x = self.relu(self.bn1(self.conv1(x)))
        self.seen[x.untyped_storage().data_ptr()] = "stem"
        x = self.maxpool(x)
        self.seen[x.untyped_storage().data_ptr()] = "maxpool"
        for i, blk in enumerate([*self.layer1, *self.layer2]):
            x = blk(x)
            self.seen[x.untyped_storage().data_ptr()] = f"block{i}"
        return x.mean((2, 3))


def _step(model, x, hooks=None):
    # one step (under the hooks if given), then a no-op optimizer step: every parameter's version
    # moves on (NOTE [Under saved-tensor hooks]: a claimed norm keeps b from the next version)
    if hooks is None:
        loss = model(x).square().sum()
    else:
        with hooks():
            loss = model(x).square().sum()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1)
    return grads


def _counting(model):
    # per storage, the packs and bytes of each non-parameter tensor handed to the hooks; each is
    # held until the hooks go (no storage lends its address to a later one) and offloaded (a copy)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    packs: list = []
    held: list = []

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            packs.append((ptr, t.numel() * t.element_size()))
            held.append(t)
        return t.clone()

    return packs, held, (lambda: torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))


def _steady_packs(model, x):
    packs, held, hooks = _counting(model)
    _step(model, x, hooks)  # the first weight version in the region: the norms keep x
    packs.clear()
    held.clear()
    grads = _step(model, x, hooks)
    by = Counter(p for p, _ in packs)
    named = {model.seen[p]: n for p, n in by.items() if p in model.seen}
    others = {p: n for p, n in by.items() if p not in model.seen}
    return packs, named, others, grads


def test_a_bottleneck_resnet_hands_over_what_eager_hands_over_twice_and_the_rest_once():
    torch.manual_seed(0)
    eager = _Net().train()
    lean = slimgrad.convert_(copy.deepcopy(eager))
    assert slimgrad.report(lean).converted
    x = torch.randn(4, 3, 32, 32)  # 256 and 64 values per channel: above 32, norms claimed
    plain = _step(lean, x)
    e_packs, e_named, _, _ = _steady_packs(eager, x)
    l_packs, l_named, l_others, grads = _steady_packs(lean, x)
    # eager: each block output twice (its ReLU, the next conv1), three times before a downsample;
    # the stem's ReLU output twice (the ReLU, the max-pool); the max-pool output twice (layer1's
    # conv1 and downsample conv); the input once; the last block output once (its ReLU)
    assert e_named == {
        "input": 1, "stem": 2, "maxpool": 2, "block0": 2, "block1": 3, "block2": 2, "block3": 1,
    }  # fmt: skip
    assert l_named == {**e_named, "maxpool": 3}
    # every other tensor the converted step keeps goes through the hooks once: each BatchNorm
    # output (norm, ReLU and conv), each recipe ingredient
    assert set(l_others.values()) == {1}
    e_bytes, l_bytes = sum(n for _, n in e_packs), sum(n for _, n in l_packs)
    assert l_bytes < e_bytes
    for a, b in zip(grads, plain, strict=True):
        assert torch.equal(a, b)
