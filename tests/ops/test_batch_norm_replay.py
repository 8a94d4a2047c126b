"""Which convs a BatchNorm's default policy replays (NOTE [Which convs the default replays] in
slimgrad/ops/_derived.py): a 1x1 conv that does not reduce the channels, and only where the
training norm sees more than 32 values per channel (``_MAX_FEW``). At fewer the replay reads the
conv's whole weight to free a few kB, and the norm keeps x: eager's op, the same bits.
"""

from __future__ import annotations

import copy
import cProfile
import pstats

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.memory import measure
from slimgrad.ops.batch_norm import _MAX_FEW
from slimgrad.testing import OpObserver
from tests._threads import one_thread
from tests.models._resnet_helpers import randomize_bn_, small_resnet


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _block(c_in: int, c_out: int, policy: str = "pointwise") -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(c_in, c_out, 1), nn.BatchNorm2d(c_out))
    with torch.no_grad():
        m[1].weight.uniform_(0.5, 1.5)
        m[1].bias.uniform_(-0.2, 0.2)
    m = slimgrad.convert_(m)
    m[1].recompute_input = policy
    return m


class _Convs(OpObserver):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def see(self, func, args, kwargs) -> None:
        self.n += func is torch.ops.aten.convolution.default


def _step(m: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    return measure(lambda: m(x), grad=dy)


# (c_in, c_out, input shape, replayed): values per channel P = N x H x W of the conv's output.
# 32 and 33 straddle the bound; (8, 512, 7, 7) is ResNet-50's layer4 conv3 at 8x3x224x224 (P =
# 392: kept), (2, 512, 1, 1) the same conv at the host-overhead proxy's 2x3x32x32 (P = 2: skipped)
CASES = [
    (8, 32, (2, 8, 4, 4), False),
    (8, 32, (1, 8, 3, 11), True),
    (512, 2048, (2, 512, 1, 1), False),
    (512, 2048, (8, 512, 7, 7), True),
]


@pytest.mark.parametrize("c_in, c_out, shape, replayed", CASES)
def test_saved_bytes_and_replays_by_values_per_channel(c_in, c_out, shape, replayed):
    m = _block(c_in, c_out)
    eager = nn.Sequential(nn.Conv2d(c_in, c_out, 1), nn.BatchNorm2d(c_out))
    eager.load_state_dict(m.state_dict())
    torch.manual_seed(1)
    x = torch.randn(shape, requires_grad=True)
    n, _, h, w = shape
    p = n * h * w
    assert (p > _MAX_FEW) == replayed
    dy = torch.randn(n, c_out, h, w)
    ms, me = _step(m, x, dy), _step(eager, x, dy)
    c_bytes = p * c_out * 4  # the conv's output, the norm's input
    stats = 2 * c_out * 4  # save_mean, save_invstd
    # the conv keeps x (the caller's: no new bytes); the norm keeps its input or a recipe (0 B)
    assert me.saved_bytes == c_bytes + stats
    assert ms.saved_bytes == (stats if replayed else c_bytes + stats)
    assert ms.peak_bytes <= me.peak_bytes
    with _Convs() as c:
        m(x).backward(dy)
    assert c.n == (2 if replayed else 1)  # forward, and the replay in the norm's backward


@pytest.mark.parametrize("shape", [(2, 16, 4, 4), (2, 16, 2, 2), (1, 16, 3, 11)])
def test_skipped_replay_gives_the_replay_s_bits(shape):
    # "always" replays the conv at any count; the default keeps x where P <= 32: same bits
    torch.manual_seed(2)
    x0 = torch.randn(shape)
    dy = torch.randn(shape[0], 64, *shape[2:])
    grads = []
    for policy in ("pointwise", "always"):
        m = _block(16, 64, policy)
        x = x0.clone().requires_grad_()
        y = m(x)
        y.backward(dy)
        grads.append([y, x.grad, *(p.grad for p in m.parameters()), m[1].running_var])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_few_values_norm_after_a_pointwise_conv_is_eager_s_op():
    # P = 8: the norm does not adopt the conv's recipe, so it calls torch.batch_norm itself (NOTE
    # [Eager's batch_norm without its wrapper]): 16 Python calls per module call, counted by
    # cProfile as the host-overhead bench counts them (23 adopting the recipe through its Function)
    m = _block(16, 64)
    conv, bn = m[0], m[1]
    x = torch.randn(2, 16, 2, 2, requires_grad=True)
    bn(conv(x))
    c = conv(x)
    prof = cProfile.Profile()
    prof.enable()
    bn(c)
    prof.disable()
    assert pstats.Stats(prof).total_calls <= 16


@pytest.mark.parametrize("size, replays", [(32, 2), (160, 8)])
def test_resnet_replays_only_where_its_norms_see_more_than_32_values(size, replays):
    # bottleneck ResNet, one block per stage: a conv3 and a downsample conv per stage are 1x1 with
    # C_in <= C_out. At 2x3x32x32 the stages run on 8x8, 4x4, 2x2, 1x1 pixels: only layer1's norms
    # see more than 32 values per channel (2 x 64; the replays before: 8); at 2x3x160x160 every
    # stage does (layer4: 2 x 5 x 5 = 50)
    torch.manual_seed(0)
    eager = randomize_bn_(small_resnet("bottleneck", width=8, layers=(1, 1, 1, 1)))
    slim = slimgrad.convert_(copy.deepcopy(eager))
    always = copy.deepcopy(slim)
    for mod in always.modules():
        if hasattr(mod, "recompute_input"):
            mod.recompute_input = "always"
    x = torch.randn(2, 3, size, size)
    counts = []
    for m in (eager, slim):
        with _Convs() as c:
            m(x).square().sum().backward()
        counts.append(c.n)
    assert counts[1] - counts[0] == replays
    # the same gradients as replaying every recipe (bit for bit: a replay is the forward's op)
    slim.zero_grad(set_to_none=True)
    for m in (slim, always):
        m(x).square().sum().backward()
    for a, b in zip(slim.parameters(), always.parameters()):
        assert torch.equal(a.grad, b.grad)
