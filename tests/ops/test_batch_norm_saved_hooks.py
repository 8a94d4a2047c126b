"""BatchNorm under saved-tensor hooks (NOTE [Under saved-tensor hooks] in ops/batch_norm.py): what a
converted BatchNorm keeps goes through save_for_backward, so the hooks see it, and a model inside a
hooks region keeps (and an offload moves) fewer bytes than eager, with eager's gradients."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import slimgrad
from slimgrad.memory import measure


class _Bottleneck(nn.Module):
    # torchvision's Bottleneck shape: 1x1 -> 3x3 -> 1x1 (expanding 4x), BatchNorm after each conv,
    # the last one's output added to the block input (so no activation can claim it)
    def __init__(self, c: int = 16, w: int = 4) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, w, 1, bias=False), nn.BatchNorm2d(w)
        self.conv2, self.bn2 = nn.Conv2d(w, w, 3, padding=1, bias=False), nn.BatchNorm2d(w)
        self.conv3, self.bn3 = nn.Conv2d(w, c, 1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += x
        return self.relu(out)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), _Bottleneck())
    with torch.no_grad():  # non-trivial affine parameters and statistics
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return m.train()


def _pair(seed: int = 0):
    m = _model(seed)
    slim = slimgrad.convert_(copy.deepcopy(m))
    assert slimgrad.report(slim).converted, slimgrad.report(slim)  # not eager vs eager
    return m, slim


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(seed))


def _step_packing(model: nn.Module, x: torch.Tensor):
    # bytes of full-size (non-Parameter, not per-channel) tensors the pack hook is handed, and
    # the gradients (eager also packs its O(C) statistics; slimgrad keeps those as attributes)
    packed = []

    def pack(t):
        if not isinstance(t, nn.Parameter) and t.dim() > 1:
            packed.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().sum()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    return sum(packed), grads


def _assert_same(ga, gb) -> None:
    assert len(ga) == len(gb)
    for a, b in zip(ga, gb):
        assert torch.equal(a, b)


def test_hooks_see_fewer_bytes_than_eager_with_eager_gradients():
    eager, lean = _pair()
    x = _x()
    eager_bytes, ge = _step_packing(eager, x)
    lean_bytes, gl = _step_packing(lean, x)
    # bn3 saves its conv's input (4 channels) through the hooks instead of its own (16 channels):
    # exactly 12 channels of 4x12x12 float32 fewer
    assert eager_bytes - lean_bytes == 12 * 4 * 12 * 12 * 4
    _assert_same(ge, gl)
    for a, b in zip(eager.state_dict().values(), lean.state_dict().values()):
        assert torch.equal(a, b)  # running statistics updated alike


def test_peak_under_save_on_cpu_below_eager():
    eager, lean = _pair()
    x = _x()

    def fwd(model):
        def f():
            with torch.autograd.graph.save_on_cpu():
                return model(x).square().sum()

        return f

    peaks = []
    grads = []
    for model in (eager, lean):
        measure(fwd(model))  # steady state
        model.zero_grad(set_to_none=True)
        peaks.append(measure(fwd(model)).peak_bytes)
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    assert peaks[1] < peaks[0]
    _assert_same(*grads)


def test_frozen_affine_eval_packs_nothing_full_size():
    eager, lean = _pair()
    for m in (eager, lean):
        m.eval()
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.weight.requires_grad_(False)
                mod.bias.requires_grad_(False)
    x = _x()
    eager_bytes, _ = _step_packing(eager, x)
    lean_bytes, gl = _step_packing(lean, x)
    # the four BatchNorms keep nothing (eager keeps each one's input): 16 + 4 + 4 + 16 channels
    assert eager_bytes - lean_bytes == (16 + 4 + 4 + 16) * 4 * 12 * 12 * 4
    # the same path as without hooks (dx = dy γ invstd: within the rule of eager, tested in
    # test_batch_norm.py), so the same bits
    lean(x).square().sum().backward()
    _assert_same(gl, [p.grad for p in lean.parameters() if p.requires_grad])


@pytest.mark.parametrize("bottleneck_only", [False, True])
def test_non_reentrant_checkpoint_matches_eager(bottleneck_only):
    # inside the region the BatchNorms save through save_for_backward (x, or bn3's conv input)
    # and run aten's backward: eager's bits there. With only the bottleneck checkpointed, the stem
    # outside it keeps its BatchNorm output (NOTE [Derived saved inputs]), so x.grad and the stem's
    # gradients follow the error rule, not eager's bits: compare the bottleneck's.
    eager, lean = _pair()
    x = _x().requires_grad_()
    grads = []
    for model in (eager, lean):
        if bottleneck_only:
            h = model[2](model[1](model[0](x)))
            y = checkpoint(model[3], h, use_reentrant=False)
            ps = list(model[3].parameters())
        else:
            y = checkpoint(model, x, use_reentrant=False)
            ps = [x, *model.parameters()]
        y.square().sum().backward()
        grads.append([p.grad.clone() for p in ps])
        x.grad = None
        model.zero_grad(set_to_none=True)
    _assert_same(*grads)
