"""Conformance: a forward that hands its work to a callable object it holds, called with the module
itself (diffusers' attention processors: ``self.processor(self, hidden_states, ...)``), in a
forward torch.fx cannot trace (NOTE [A callable object given its module] in
slimgrad/convert_handlers/inplace_guard.py).

Before, any such call counted as a stored callable that may write what it is given, so the
LayerNorm in front of every such attention stayed eager: its savings lost though the processor
writes nothing. Each reading processor now keeps the norm converted with eager's gradients and
fewer saved bytes; each writing one, whatever the route of its write (its own code, a method of the
module, a method or callable of the object, a child that writes, an argument passed by keyword or
through ``**kwargs``), keeps the norm eager, with eager's gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slimgrad
from slimgrad import memory
from slimgrad.convert_handlers.inplace_guard import kept_reason
from tests._threads import one_thread


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


class _Reads:
    # diffusers' AttnProcessor2_0, in short: the module's children and torch functions only
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        residual = hidden_states
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        q = attn.to_q(hidden_states)
        k = attn.to_k(encoder_hidden_states)
        v = attn.to_v(encoder_hidden_states)
        b, t, _ = q.shape
        n = attn.heads
        q, k, v = (z.view(b, -1, n, z.shape[-1] // n).transpose(1, 2) for z in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        o = attn.to_out[0](o.transpose(1, 2).reshape(b, t, -1))
        o = attn.to_out[1](o)
        return o + residual if attn.residual else o


class _ReadsWithHelper(_Reads):
    # a method of the module that reads, and state kept on the object (a shape, not a tensor)
    def __call__(self, attn, hidden_states, **kwargs):
        self.last_shape = tuple(hidden_states.shape)
        h = attn.prepare(hidden_states)
        return super().__call__(attn, h, **kwargs)


class _WritesOwn(_Reads):
    def __call__(self, attn, hidden_states, **kwargs):
        hidden_states.mul_(0.5)
        return super().__call__(attn, hidden_states, **kwargs)


class _WritesAugmented(_Reads):
    def __call__(self, attn, hidden_states, **kwargs):
        hidden_states += 1.0
        return super().__call__(attn, hidden_states, **kwargs)


class _WritesItem(_Reads):
    def __call__(self, attn, hidden_states, **kwargs):
        hidden_states[:, 0] = 0.0
        return super().__call__(attn, hidden_states, **kwargs)


class _WritesInplaceKw(_Reads):
    def __call__(self, attn, hidden_states, **kwargs):
        return super().__call__(attn, F.relu(hidden_states, inplace=True), **kwargs)


class _WritesModuleMethod(_Reads):
    def __call__(self, attn, hidden_states, **kwargs):
        attn.scale_in_place(hidden_states)
        return super().__call__(attn, hidden_states, **kwargs)


class _WritesOwnMethod(_Reads):
    def __call__(self, attn, hidden_states, **kwargs):
        self.rotate(hidden_states)
        return super().__call__(attn, hidden_states, **kwargs)

    def rotate(self, h):
        h.mul_(-1.0)


class _WritesHeldCallable(_Reads):
    def __init__(self):
        self.fn = lambda h: h.clamp_(-1.0, 1.0)

    def __call__(self, attn, hidden_states, **kwargs):
        self.fn(hidden_states)
        return super().__call__(attn, hidden_states, **kwargs)


class _WritesChild(_Reads):
    def __call__(self, attn, hidden_states, **kwargs):
        attn.act(hidden_states)  # an in-place child: ReLU(inplace=True)
        return super().__call__(attn, hidden_states, **kwargs)


class _WritesVarargs(_Reads):
    def __call__(self, attn, *args, **kwargs):
        args[0].sub_(0.25)
        return super().__call__(attn, *args, **kwargs)


class _WritesThroughAlias(_Reads):
    def __call__(self, attn, hidden_states, **kwargs):
        view = hidden_states.view(-1)
        view.add_(0.125)
        return super().__call__(attn, hidden_states, **kwargs)


class _ParentWrites(_Reads):
    def __call__(self, attn, hidden_states, **kwargs):
        hidden_states.mul_(0.5)
        return super().__call__(attn, hidden_states, **kwargs)


class _WritesInParent(_ParentWrites):
    # the write is in the parent class's __call__, reached through super()
    def __call__(self, attn, hidden_states, **kwargs):
        return super().__call__(attn, hidden_states, **kwargs)


_READERS = {"processor": _Reads, "processor with helper": _ReadsWithHelper}
_WRITERS = {
    "mul_": _WritesOwn,
    "+=": _WritesAugmented,
    "item assignment": _WritesItem,
    "inplace=True": _WritesInplaceKw,
    "a method of the module": _WritesModuleMethod,
    "a method of the object": _WritesOwnMethod,
    "a callable the object holds": _WritesHeldCallable,
    "an in-place child": _WritesChild,
    "*args": _WritesVarargs,
    "a view": _WritesThroughAlias,
    "a parent's __call__": _WritesInParent,
}


class _Attention(nn.Module):
    def __init__(self, d, processor, how):
        super().__init__()
        self.heads, self.residual, self.how = 2, False, how
        self.to_q, self.to_k, self.to_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.to_out = nn.ModuleList([nn.Linear(d, d), nn.Dropout(0.0)])
        self.act = nn.ReLU(inplace=True)
        self.processor = processor

    def prepare(self, h):
        return h.contiguous()

    def scale_in_place(self, h):
        h.mul_(2.0)

    def forward(self, hidden_states, encoder_hidden_states=None, **cross_attention_kwargs):
        if hidden_states.ndim == 4:  # never true: torch.fx cannot trace this forward
            hidden_states = hidden_states.flatten(1, 2)
        if self.how == "keyword":
            return self.processor(self, hidden_states=hidden_states, **cross_attention_kwargs)
        if self.how == "spread":
            return self.processor(self, **{"hidden_states": hidden_states})
        cross, kw = encoder_hidden_states, cross_attention_kwargs
        return self.processor(self, hidden_states, encoder_hidden_states=cross, **kw)


class _Block(nn.Module):
    def __init__(self, d, processor, how):
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn1 = _Attention(d, processor, how)
        self.norm2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn1(self.norm1(x))
        return x + self.ff(self.norm2(x))


def _step(m, x):
    m.zero_grad(set_to_none=True)
    loss = m(x).square().mean()
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in m.named_parameters()}


_HOW = ["positional", "keyword", "spread"]


@pytest.mark.parametrize("how", _HOW)
@pytest.mark.parametrize("name", list(_READERS))
def test_reading_processor_keeps_the_norm_converted(name, how):
    torch.manual_seed(0)
    m = _Block(16, _READERS[name](), how)
    c = slimgrad.convert_(copy.deepcopy(m))
    assert kept_reason(c.norm1) is None
    assert type(c.norm1) is not nn.LayerNorm
    x = torch.randn(2, 8, 16)
    want_loss, want = _step(m, x)
    got_loss, got = _step(c, x)
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    eager = memory.measure(lambda: m(x).square().mean(), backward=False)
    conv = memory.measure(lambda: c(x).square().mean(), backward=False)
    # the norm's input (2 x 8 x 16 float32) is no longer kept
    assert conv.saved_bytes <= eager.saved_bytes - 2 * 8 * 16 * 4


@pytest.mark.parametrize("how", _HOW)
@pytest.mark.parametrize("name", list(_WRITERS))
def test_writing_processor_keeps_the_norm_eager(name, how):
    if how != "positional" and name == "*args":
        pytest.skip("a call by keyword passes no positional argument to write")
    torch.manual_seed(0)
    m = _Block(16, _WRITERS[name](), how)
    c = slimgrad.convert_(copy.deepcopy(m))
    assert kept_reason(c.norm1) is not None
    assert type(c.norm1) is nn.LayerNorm
    x = torch.randn(2, 8, 16)
    want_loss, want = _step(m, x)
    got_loss, got = _step(c, x)  # (a converted norm1 raised autograd's in-place error here)
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    for k in want:  # norm2 and the MLP are converted: within rounding of eager's
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_decorated_or_c_call_is_a_stored_callable():
    # a __call__ that is not a plain Python function of the object and the module may write
    class _Decorated(_Reads):
        @torch.no_grad()
        def __call__(self, attn, hidden_states, **kwargs):
            return super().__call__(attn, hidden_states, **kwargs)

    torch.manual_seed(0)
    c = slimgrad.convert_(_Block(16, _Decorated(), "positional"))
    assert kept_reason(c.norm1) is not None
