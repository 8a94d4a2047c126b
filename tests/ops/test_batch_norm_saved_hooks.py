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


# NOTE [Under saved-tensor hooks]: from the second weight version on, a BatchNorm whose output an
# activation claimed saves that output through save_for_backward: what the hooks retain is what
# the model keeps without them, with its bits.


def _hooked_step(model: nn.Module, x: torch.Tensor, hooks):
    # one training step inside ``hooks()`` (None: no hooks): (saved bytes, gradients); then an
    # optimizer step that changes no value but moves every parameter's version on
    def fwd():
        if hooks is None:
            return model(x).square().sum()
        with hooks():
            return model(x).square().sum()

    saved = measure(fwd, module=model).saved_bytes
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1)
    return saved, grads


def _identity_hooks():
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


@pytest.mark.parametrize("hooks", [_identity_hooks, torch.autograd.graph.save_on_cpu])
def test_a_claimed_norm_keeps_its_output_under_hooks_from_the_next_version(hooks):
    _, lean = _pair()
    x = _x()
    plain_saved, plain = _hooked_step(lean, x, None)
    _hooked_step(lean, x, hooks)  # the first version in the region: x, the claims counted
    for _ in range(2):
        saved, grads = _hooked_step(lean, x, hooks)
        _assert_same(grads, plain)
        if hooks is _identity_hooks:  # save_on_cpu's copies are other storages
            assert saved == plain_saved
    lean.zero_grad(set_to_none=True)


def test_a_claimed_norm_under_non_reentrant_checkpoint_gives_the_lean_bits():
    # the recompute decides as its forward did (the same weight version): the same tensors are
    # saved, and the gradients are the lean model's without checkpointing
    _, lean = _pair()
    x = _x()
    _, plain = _hooked_step(lean, x, None)

    class _Ckpt(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return checkpoint(self.m, x, use_reentrant=False)

    wrapped = _Ckpt(lean)
    for _ in range(3):
        _, grads = _hooked_step(wrapped, x, None)
    _assert_same(grads, plain)


class _Switch(nn.Module):
    # conv -> BN -> ReLU -> conv, or (claim=False) the BN output written over in place and no
    # activation: a call whose claim does not come after calls that were all claimed
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.relu, self.conv2 = nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1)
        self.claim = True

    def forward(self, x):
        b = self.bn(self.conv1(x))
        if self.claim:
            return self.conv2(self.relu(b))
        return self.conv2(b.mul_(0.5))


def test_a_call_whose_claim_does_not_come_keeps_its_input():
    # it saved b at forward and b is then written over: b is never read back (no autograd error),
    # the gradients are those without hooks (x kept), and the next version saves x again
    torch.manual_seed(0)
    eager = _Switch().train()
    lean = slimgrad.convert_(copy.deepcopy(eager))
    x = _x()
    for _ in range(2):
        _hooked_step(lean, x, _identity_hooks)
    lean.claim = eager.claim = False
    _, plain = _hooked_step(lean, x, None)
    _, ref = _hooked_step(eager, x, None)
    _assert_same(plain, ref)  # x kept, aten's backward: eager's bits
    for _ in range(2):  # the wasted pack, then the next version's x
        _, grads = _hooked_step(lean, x, _identity_hooks)
        _assert_same(grads, plain)


class _WritesAfterClaim(nn.Module):
    # the BN output is read by the ReLU, then written over in the model's own forward: eager's
    # ReLU keeps its own output and its BatchNorm its input, so eager trains; convert_ reads the
    # write and leaves that ReLU torch's, so no node claims b (NOTE [A write after a BatchNorm
    # output was claimed] in convert_handlers/inplace_guard.py)
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.relu, self.conv2 = nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        b = self.bn(self.conv1(x))
        y = self.conv2(self.relu(b))
        b.mul_(2)
        return y + b.sum()


def test_a_write_over_a_read_output_trains_as_eager_with_and_without_identity_hooks():
    # identity hooks hand a saved tensor itself back and autograd checks no version under hooks:
    # with nothing claiming b, every step (the first weight version and the next) gives eager's
    # gradients, hooked or not
    torch.manual_seed(0)
    eager = _WritesAfterClaim().train()
    lean = slimgrad.convert_(copy.deepcopy(eager))
    assert type(lean.relu) is nn.ReLU
    x = _x()
    for hooks in (None, _identity_hooks, _identity_hooks):
        _, ge = _hooked_step(eager, x, hooks)
        _, gl = _hooked_step(lean, x, hooks)
        for a, b in zip(gl, ge, strict=True):
            torch.testing.assert_close(a, b)
        eager.zero_grad(set_to_none=True)
        lean.zero_grad(set_to_none=True)


def test_a_claimed_norm_after_an_expanding_1x1_conv_saves_the_conv_input():
    # conv (1x1, 4 -> 16: a recipe whose ingredient is a quarter of x) -> BN -> SiLU -> conv: from
    # the next version the BN saves the ingredient and accepts the claim, so the SiLU and the conv
    # keep b (eager's SiLU keeps b and the conv SiLU(b)): the hooks retain what the model keeps
    # without them, each copy a hook makes of the BN's is a quarter of b's, and every node gives
    # eager's bits (the BN replays its conv)
    torch.manual_seed(0)
    eager = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.Conv2d(4, 16, 1),
        nn.BatchNorm2d(16),
        nn.SiLU(),
        nn.Conv2d(16, 4, 3, padding=1),
    ).train()
    lean = slimgrad.convert_(copy.deepcopy(eager))
    x = _x()
    plain_saved, _ = _hooked_step(lean, x, None)
    _, ref = _hooked_step(eager, x, None)
    _hooked_step(lean, x, _identity_hooks)
    saved, grads = _hooked_step(lean, x, _identity_hooks)
    assert saved == plain_saved
    _assert_same(grads, ref)
    packed, _ = _step_packing(lean, x)
    packed_eager, _ = _step_packing(eager, x)
    # eager hands the hooks x (BN), b (SiLU) and SiLU(b) (conv); the lean model the ingredient
    # and b once, for the SiLU and the conv (NOTE [One pack per shared tensor] in ops/_derived.py)
    assert packed_eager - packed == (16 + 16 + 16 - 4 - 16) * 4 * 12 * 12 * 4
