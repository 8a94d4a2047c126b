"""torch's module tracker changes no converted module's path (NOTE [torch's module tracker is an
observer] in slimgrad/nn/_hooks.py).

``FlopCounterMode`` enters a ``torch.utils.module_tracker.ModuleTracker``, whose global forward
hooks sent every converted module to eager's op while it was on. Around only the forward, or only
the backward, of a step under HF's non-reentrant gradient checkpointing, the recompute then took
another path than the forward and torch raised CheckpointError on a converted GPT-2, BERT or Llama
(eager runs). Here the step runs, with the gradients of the same converted step without a count,
bit for bit; a whole step under the tracker keeps the converted model's bytes; a tracker subclass
whose hook writes, and any other global hook, still sends the modules to eager's op. The profiler
likewise, and a user's dispatch mode on one side: the gate closes under it, and HF attention's
general path now keeps what its straight path keeps (both fold q, k and v to (B·H, T, d)).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.module_tracker import ModuleTracker

import slimgrad
from slimgrad.memory import measure
from slimgrad.nn._hooks import forward_hooked
from tests._gc_steps import checkpointed
from tests.conformance._hf_families import FAMILIES, build, inputs

FAMS = ["gpt2", "bert", "llama", "llama_eager", "opt", "gpt_neox"]


class _Watching(TorchDispatchMode):
    # a user's dispatch mode that is not known to only read (the gate closes under it)
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _counted(on: bool, how: str = "flops"):
    if not on:
        return contextlib.nullcontext()
    if how == "flops":
        return FlopCounterMode(display=False)
    if how == "mode":
        return _Watching()
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])


def _step(model, batch, where: str | None, how: str = "flops"):
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    with _counted(where in ("forward", "both"), how):
        out = model(**batch) if isinstance(batch, dict) else model(batch)
        loss = out.loss if isinstance(batch, dict) else out.square().mean()
    with _counted(where in ("backward", "both"), how):
        loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def _assert_same(got, ref):
    for a, b in zip(got, ref, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


def _slim_checkpointed(fam: str):
    model = build(FAMILIES[fam]).train()
    batch = inputs(FAMILIES[fam], model, labels=True)
    slim = checkpointed(slimgrad.convert_(copy.deepcopy(model)))
    return model, slim, batch


@pytest.mark.parametrize(
    "where, how",
    [(w, "flops") for w in ("forward", "backward", "both")]
    + [(w, h) for h in ("profiler", "mode") for w in ("forward", "backward")],
)
@pytest.mark.parametrize("fam", FAMS)
def test_a_count_on_one_side_of_a_checkpointed_step(fam, where, how):
    # NOTE [A FLOP count on one side of a checkpoint] in slimgrad/_library.py
    _, slim, batch = _slim_checkpointed(fam)
    ref_loss, ref = _step(slim, batch, None)
    loss, got = _step(slim, batch, where, how)  # CheckpointError before, on one side
    if how == "mode" and where != "backward":
        # under a mode that may store results the fused loss takes eager's ops (NOTE [The fused
        # loss under a mode that stores results]): the loss's own rounding, the rest the same
        torch.testing.assert_close(loss, ref_loss)
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b)
        return
    assert torch.equal(loss, ref_loss)
    _assert_same(got, ref)


class _ConvNet(torch.nn.Module):
    # conv -> BN -> ReLU / GELU blocks, each checkpointed (non-reentrant), dropout between
    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), act, nn.Dropout(0.1))
            for act in (nn.ReLU(), nn.GELU(), nn.SiLU())
        )

    def forward(self, x):
        for b in self.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
        return x


@pytest.mark.parametrize("how", ["flops", "profiler", "mode"])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_count_on_one_side_of_checkpointed_conv_blocks(where, how):
    torch.manual_seed(0)
    slim = slimgrad.convert_(_ConvNet().train())
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    ref_loss, ref = _step(slim, x, None)
    loss, got = _step(slim, x, where, how)
    assert torch.equal(loss, ref_loss)
    if where == "forward" or how != "flops":
        _assert_same(got, ref)
    else:  # a backward under the FLOP counter may round otherwise (as before: up to 4e-8 here)
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("fam", ["gpt2", "llama"])
def test_the_tracker_keeps_the_converted_models_bytes(fam):
    model, slim, batch = _slim_checkpointed(fam)
    slim.gradient_checkpointing_disable()
    _step(slim, batch, None)  # first-call caches
    plain = measure(lambda: slim(**batch).loss)
    with ModuleTracker():
        tracked = measure(lambda: slim(**batch).loss)
    eager = measure(lambda: model(**batch).loss)
    assert tracked.saved_bytes == plain.saved_bytes < eager.saved_bytes
    assert tracked.peak_bytes == plain.peak_bytes


class _WritingTracker(ModuleTracker):
    # a subclass whose forward hook writes the output: read as any hook
    def _fw_post_hook(self, mod, input, output) -> None:
        super()._fw_post_hook(mod, input, output)
        if isinstance(output, torch.Tensor):
            output.mul_(1.0)


def test_only_the_trackers_own_hooks_are_observers():
    ln = slimgrad.convert_(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)))[1]
    assert not forward_hooked(ln)
    with ModuleTracker():
        assert not forward_hooked(ln)
    with _WritingTracker():
        assert forward_hooked(ln)
    h = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: o.mul_(1))
    try:
        assert forward_hooked(ln)  # another global hook that may write
    finally:
        h.remove()


def test_the_tracker_keeps_a_conv_bn_relu_chains_bytes():
    # the in-place ReLU after BatchNorm writes over b under the tracker as unwatched (ownership
    # counts its hooks as observers that keep no tensor): BatchNorm keeps b, not its input too
    nn = torch.nn
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        nn.Conv2d(16, 16, 3, padding=1),
    ).train()
    slim = slimgrad.convert_(copy.deepcopy(net))
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    slim(x).sum().backward()

    def step(m):
        return lambda: m(x).square().mean()

    plain = measure(step(slim))
    with ModuleTracker():
        tracked = measure(step(slim))
    eager = measure(step(net))
    assert tracked.saved_bytes == plain.saved_bytes < eager.saved_bytes
    assert tracked.peak_bytes == plain.peak_bytes
