"""verify leaves no half of what a first forward did behind (adv25 F1).

NOTE [verify leaves the models as it found them] (src/slimgrad/verify.py). The converted model's
first forward runs inside verify. A module that installs something once on its first forward and
marks it (HF's output-capturing hooks with ``_output_capturing_hooks_installed``) must find, after
verify, either both the mark and what it installed, or neither; before the fix verify deleted the
mark and kept the hook, so the next forward installed a second one (HF Segformer crashed, DPT's
depth moved by ~1%). Here every kind of lazily created state: a forward hook, a forward pre-hook
with kwargs, a full backward hook, a buffer registered on first call (persistent and not), a
submodule and a cache dict, each with its mark. After verify the next forward (train and eval)
and backward of the converted model and of the original are bit-identical to copies made before
verify, and both keep the hooks, buffers and state_dict keys they had.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import slimgrad


class _LazyForwardHook(nn.Module):
    def forward(self, x):
        if not getattr(self, "_hooked", False):
            self.ln.register_forward_hook(lambda m, i, o: o * 2)
            self._hooked = True
        return x


class _LazyPreHookKwargs(nn.Module):
    def forward(self, x):
        if not getattr(self, "_pre", False):
            self.ln.register_forward_pre_hook(
                lambda m, a, kw: ((a[0] + 1.0,), kw), with_kwargs=True
            )
            self._pre = True
        return x


class _LazyBackwardHook(nn.Module):
    def forward(self, x):
        if not getattr(self, "_bw", False):
            self.out.register_full_backward_hook(lambda m, gi, go: (gi[0] * 3,))
            self._bw = True
        return x


class _LazyBuffer(nn.Module):
    def __init__(self, persistent: bool):
        super().__init__()
        self.persistent = persistent

    def forward(self, x):
        if "shift" not in self.ln._buffers:  # registered on the first call, then counted up
            shift = torch.ones(x.shape[-1], dtype=x.dtype)
            self.ln.register_buffer("shift", shift, self.persistent)
        self.ln.shift.add_(1.0)
        return x + self.ln.shift


class _LazySubmodule(nn.Module):
    def forward(self, x):
        if not getattr(self, "_made", False):
            # a new submodule, fixed values
            self.ln.extra = nn.Linear(x.shape[-1], x.shape[-1], dtype=x.dtype)
            with torch.no_grad():
                self.ln.extra.weight.fill_(0.25)
                self.ln.extra.bias.fill_(0.5)
            self.ln.register_forward_hook(lambda m, i, o: m.extra(o))
            self._made = True
        return x


class _LazyCache(nn.Module):
    def forward(self, x):
        if not hasattr(self, "_cache"):
            self._cache = {"c": 1.5}
            self.ln.register_forward_hook(lambda m, i, o: o + self._cache["c"])
        self._cache["c"] = self._cache["c"] * 2
        return x


_KINDS = {
    "forward_hook": _LazyForwardHook,
    "pre_hook_kwargs": _LazyPreHookKwargs,
    "backward_hook": _LazyBackwardHook,
    "buffer_persistent": lambda: _LazyBuffer(True),
    "buffer_nonpersistent": lambda: _LazyBuffer(False),
    "submodule": _LazySubmodule,
    "cache_dict": _LazyCache,
}


class _Net(nn.Module):
    def __init__(self, lazy: nn.Module):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.ln = nn.LayerNorm(8)
        self.drop = nn.Dropout(0.25)
        self.out = nn.Linear(8, 3)
        self.lazy = lazy

    def forward(self, x):
        # the lazy part installs on this model's modules as they are now (convert_ replaces them)
        object.__setattr__(self.lazy, "ln", self.ln)
        object.__setattr__(self.lazy, "out", self.out)
        h = self.lazy(F.gelu(self.fc(x)))
        return self.out(self.drop(self.ln(h)))


def _hook_counts(net: nn.Module) -> list[int]:
    return [
        len(getattr(m, k))
        for m in net.modules()
        for k in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_forward_hooks_with_kwargs",
            "_forward_pre_hooks_with_kwargs",
        )
    ]


def _step(net: nn.Module, x: torch.Tensor, train: bool):
    net.train(train)
    torch.manual_seed(3)
    out = net(x)
    grads = torch.autograd.grad(out.square().mean(), [p for p in net.parameters()])
    return [out.detach(), *grads]


@pytest.mark.parametrize("kind", list(_KINDS))
def test_next_forward_after_verify_is_bit_identical(kind):
    torch.manual_seed(0)
    model = _Net(_KINDS[kind]())
    converted = slimgrad.convert_(copy.deepcopy(model))
    x = torch.randn(4, 6)
    before = {"original": copy.deepcopy(model), "converted": copy.deepcopy(converted)}
    hooks = {"original": _hook_counts(model), "converted": _hook_counts(converted)}
    keys = {"original": list(model.state_dict()), "converted": list(converted.state_dict())}
    rep = slimgrad.verify(model, converted, x)
    assert rep.ok, str(rep)
    for name, net in (("original", model), ("converted", converted)):
        assert _hook_counts(net) == hooks[name], name
        assert list(net.state_dict()) == keys[name], name
        for train in (True, False, True):  # twice in train: the state a second forward sees
            got, want = _step(net, x, train), _step(before[name], x, train)
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w), (name, train)
        # and the same hooks as the copy after its own forwards
        assert _hook_counts(net) == _hook_counts(before[name]), name
