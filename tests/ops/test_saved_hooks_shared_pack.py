"""Issue 33: under saved-tensor hooks a BatchNorm output shared by the norm, its activation, a
squeeze-excite gate and the next conv goes through the hooks once (NOTE [One pack per shared
tensor] in ops/_derived.py): an offloading hook copies it once, as many bytes as the model keeps
without hooks, with the gradients of the model without hooks, bit for bit."""

import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.memory import measure
from tests.conformance._timm_shim import timm

# odd spatial sizes; 396 values per channel (> 32: NOTE [Few values per channel])
N, H, W = 4, 11, 9
PLANE = N * H * W * 4  # bytes of one float32 channel


class _Block(nn.Module):
    # conv -> BN -> act -> conv -> BN -> act -> conv: each BN output b is kept by the BN, the
    # activation and the next conv (NOTE [Derived saved inputs])
    def __init__(self, act) -> None:
        super().__init__()
        self.c1, self.bn1, self.a1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), act()
        self.c2, self.bn2, self.a2 = nn.Conv2d(8, 6, 3, padding=1), nn.BatchNorm2d(6), act()
        self.c3 = nn.Conv2d(6, 4, 3, padding=1)

    def forward(self, x):
        x = self.a1(self.bn1(self.c1(x)))
        x = self.a2(self.bn2(self.c2(x)))
        return self.c3(x)


ACTS = {
    "relu": nn.ReLU,
    "relu_inplace": lambda: nn.ReLU(inplace=True),  # the claim needs ownership of b
    "silu": nn.SiLU,
    "leaky_relu": lambda: nn.LeakyReLU(0.1),
    "gelu": nn.GELU,
}


def _lean(act: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = _Block(ACTS[act]).train()
    with torch.no_grad():  # non-trivial affine parameters (|β| < |γ|/2: every channel from b)
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    lean = slimgrad.convert_(m)
    assert slimgrad.report(lean).converted
    return lean


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(N, 3, H, W, generator=torch.Generator().manual_seed(seed))


def _counting(model: nn.Module, copy_: bool, hold: bool = False):
    # hooks that record, per storage, the bytes of each non-parameter tensor they are handed; with
    # copy_ they pack a copy and unpack another (an offload: save_on_cpu on a GPU)
    # (hold: every tensor handed over is held until the hooks go, so a storage freed after its
    # pack cannot lend its address to a later one: the counts are per storage, not per address;
    # off where a test measures bytes)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    packs: list[tuple[int, int]] = []
    held: list[torch.Tensor] = []

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            packs.append((ptr, t.numel() * t.element_size()))
            if hold:
                held.append(t)
        return t.clone() if copy_ else t

    def unpack(t):
        return t.clone() if copy_ else t

    return packs, (lambda: torch.autograd.graph.saved_tensors_hooks(pack, unpack))


def _step(model: nn.Module, x: torch.Tensor, hooks=None, retain: bool = False):
    # one step (inside hooks() if given); then a no-op optimizer step that moves every parameter's
    # version on (NOTE [Under saved-tensor hooks]: a claimed norm keeps b from the next version)
    if hooks is None:
        loss = model(x).square().sum()
    else:
        with hooks():
            loss = model(x).square().sum()
    loss.backward(retain_graph=retain)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1)
    return loss, grads


def _assert_same(ga, gb) -> None:
    assert len(ga) == len(gb)
    for a, b in zip(ga, gb):
        assert torch.equal(a, b)


@pytest.mark.parametrize("copy_", [False, True], ids=["identity", "offload"])
@pytest.mark.parametrize("act", list(ACTS))
def test_each_norm_output_goes_through_the_hooks_once(act, copy_):
    lean = _lean(act)
    x = _x()
    _, plain = _step(lean, x)
    packs, hooks = _counting(lean, copy_, hold=True)
    _step(lean, x, hooks)  # the first weight version in the region: the norms keep x
    packs.clear()
    _, grads = _step(lean, x, hooks)
    # x (3 channels, kept by the first conv), each BN output (8 and 6 channels) once and the
    # output (4, kept by the loss's square); before, each BN output went through the hooks three
    # times (BN, activation, conv): 3 + 3 (8 + 6) + 4 channels; and each BN's batch mean and
    # invstd (NOTE [Batch statistics under saved-tensor hooks] in ops/batch_norm.py)
    ptrs = [p for p, _ in packs]
    assert len(ptrs) == len(set(ptrs)) == 4 + 2 * 2
    assert sum(n for _, n in packs) == (3 + 8 + 6 + 4) * PLANE + 2 * (8 + 6) * 4
    _assert_same(grads, plain)  # the unhooked converted model's bits


@pytest.mark.parametrize("act", ["relu_inplace", "silu"])
def test_offloaded_bytes_are_the_saved_bytes_without_hooks(act):
    # what an offload copies is what the model keeps without hooks (the tracker's saved bytes),
    # and under identity hooks the step keeps and peaks exactly as without them
    lean = _lean(act)
    x = _x()

    def fwd(hooks=None):
        def f():
            if hooks is None:
                return lean(x).square().sum()
            with hooks():
                return lean(x).square().sum()

        return f

    def measured(hooks=None):
        m = measure(fwd(hooks), module=lean)
        lean.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p in lean.parameters():
                p.mul_(1)
        return m

    plain = measured()
    packs, offload = _counting(lean, True)
    measured(offload)
    packs.clear()
    measured(offload)
    # the tracker counts what the step made: not the input x (3 channels, live before it); the
    # norms' batch statistics (2 x (8 + 6) float32) are packed too (NOTE [Batch statistics under
    # saved-tensor hooks] in ops/batch_norm.py)
    assert plain.saved_bytes == (8 + 6 + 4) * PLANE + 2 * (8 + 6) * 4
    assert sum(n for _, n in packs) == (3 + 8 + 6 + 4) * PLANE + 2 * (8 + 6) * 4
    _, identity = _counting(lean, False)
    measured(identity)
    m = measured(identity)
    assert (m.saved_bytes, m.peak_bytes) == (plain.saved_bytes, plain.peak_bytes)


def test_a_hook_that_frees_its_copy_at_unpack_is_unpacked_once():
    # torchtune-style offloading hands each packed tensor back once and forgets it: the shared
    # pack is unpacked once per backward and its value handed to every node that keeps it
    lean = _lean("relu_inplace")
    x = _x()
    _, plain = _step(lean, x)
    store: dict[int, torch.Tensor] = {}
    unpacked: list[int] = []

    def pack(t):
        store[len(store)] = t.clone()
        return len(store) - 1

    def unpack(i):
        unpacked.append(i)
        return store.pop(i)

    def hooks():
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    for _ in range(2):
        store.clear()
        unpacked.clear()
        _, grads = _step(lean, x, hooks)
        assert not store and len(unpacked) == len(set(unpacked))
    _assert_same(grads, plain)


def test_retain_graph_then_a_freed_graph_as_without_hooks():
    lean = _lean("silu")
    x = _x()
    _, hooks = _counting(lean, True)
    _step(lean, x, hooks)
    with hooks():
        loss = lean(x).square().sum()
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in lean.parameters()]
    lean.zero_grad(set_to_none=True)
    loss.backward()  # the shared pack is read again in a second backward
    _assert_same([p.grad for p in lean.parameters()], first)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_a_subset_backward_reads_the_pack_and_lets_it_go():
    # backward(inputs=...) runs the conv and the activation but not the norm that made the pack:
    # the value held for the norm is let go at the task's end, and the next full backward reads it
    lean = _lean("relu")
    x = _x()
    _, hooks = _counting(lean, False)
    _step(lean, x, hooks)
    with hooks():
        loss = lean(x).square().sum()
    (gw,) = torch.autograd.grad(loss, [lean.c3.weight], retain_graph=True)
    loss.backward()
    assert torch.equal(gw, lean.c3.weight.grad)


def test_second_derivatives_under_hooks_are_those_without():
    lean = _lean("silu")
    x = _x().requires_grad_()
    _, hooks = _counting(lean, False)
    _step(lean, x, hooks)
    out = []
    for h in (None, hooks):
        if h is None:
            y = lean(x).square().sum()
        else:
            with h():
                y = lean(x).square().sum()
        (gx,) = torch.autograd.grad(y, x, create_graph=True)
        out.append(torch.autograd.grad(gx.square().sum(), list(lean.parameters())))
    _assert_same(*out)


@pytest.mark.skipif(timm is None, reason="timm (and torchvision) not installed")
def test_a_squeeze_excite_block_shares_the_norm_output():
    # conv -> BN -> SiLU -> squeeze-excite -> conv (torchvision's MBConv shape): b is kept by the
    # BN, the SiLU, the gate's product and the projecting conv, and goes through the hooks once
    from torchvision.ops import SqueezeExcitation

    class _MB(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1, self.bn, self.act = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU()
            self.se = SqueezeExcitation(8, 4)
            self.c2 = nn.Conv2d(8, 4, 1)

        def forward(self, x):
            return self.c2(self.se(self.act(self.bn(self.c1(x)))))

    torch.manual_seed(0)
    lean = slimgrad.convert_(_MB().train())
    x = _x()
    _, plain = _step(lean, x)
    packs, hooks = _counting(lean, True, hold=True)
    _step(lean, x, hooks)
    packs.clear()
    _, grads = _step(lean, x, hooks)
    big = [(p, n) for p, n in packs if n >= PLANE]  # full-size ones (the gate is N*C values)
    # x, b and the output (the loss's square keeps it); before: b four times
    assert len(big) == len({p for p, _ in big}) == 3
    assert sum(n for _, n in big) == (3 + 8 + 4) * PLANE
    _assert_same(grads, plain)


class _EditsActivation(nn.Module):
    # conv -> BN -> SiLU, the SiLU's output r written over in place before the next conv: that
    # conv keeps the edited r itself (r is no longer the pristine SiLU(b): NOTE [Derived saved
    # inputs]), while the BN and the SiLU still share b's one pack
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn, self.act = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU()
        self.c2 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        r = self.act(self.bn(self.c1(x)))
        r.mul_(2)
        return self.c2(r)


def test_an_activation_output_edited_in_place_is_kept_by_the_conv_itself():
    torch.manual_seed(0)
    eager = _EditsActivation().train()
    lean = slimgrad.convert_(copy.deepcopy(eager))
    x = _x()
    _, plain = _step(lean, x)
    packs, hooks = _counting(lean, True, hold=True)
    _step(lean, x, hooks)
    packs.clear()
    _, grads = _step(lean, x, hooks)
    # x, b (once: BN and SiLU), the edited r (the conv) and the output (the loss's square); and
    # the BN's batch mean and invstd (NOTE [Batch statistics under saved-tensor hooks])
    assert len(packs) == len({p for p, _ in packs}) == 4 + 2
    assert sum(n for _, n in packs) == (3 + 8 + 8 + 4) * PLANE + 2 * 8 * 4
    _assert_same(grads, plain)  # the unhooked converted model's bits (its rule: test_conv.py)


class _TwoActs(nn.Module):
    # one BN output claimed by two activations, each feeding its own conv: five nodes keep b
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.relu, self.silu = nn.ReLU(), nn.SiLU()
        self.c2, self.c3 = nn.Conv2d(8, 4, 3, padding=1), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        b = self.bn(self.c1(x))
        return self.c2(self.relu(b)) + self.c3(self.silu(b))


@pytest.mark.parametrize("copy_", [False, True], ids=["identity", "offload"])
def test_two_activations_on_one_output_share_its_pack(copy_):
    torch.manual_seed(0)
    lean = slimgrad.convert_(_TwoActs().train())
    x = _x()
    _, plain = _step(lean, x)
    packs, hooks = _counting(lean, copy_, hold=True)
    _step(lean, x, hooks)
    packs.clear()
    _, grads = _step(lean, x, hooks)
    # x, b once (the BN, both activations, both convs; before: five times) and the output; and
    # the BN's batch mean and invstd (NOTE [Batch statistics under saved-tensor hooks])
    assert len(packs) == len({p for p, _ in packs}) == 3 + 2
    assert sum(n for _, n in packs) == (3 + 8 + 4) * PLANE + 2 * 8 * 4
    _assert_same(grads, plain)
