"""slimgrad inside activation checkpointing (issue 16): ``torch.utils.checkpoint`` reentrant and
not, selective checkpointing policies, HF ``gradient_checkpointing_enable`` before or after
``convert_``. Each case: the converted model under a checkpointing scheme gives the gradients eager
gives under the same scheme (and without it), buffers included, and ``slimgrad.verify`` passes.

Recompute must see what the first forward saw: in-place writes inside a region (ReLU(inplace),
InPlaceABN, dropout_, gradient-buffer reuse) must not change the region's inputs, and dropout's
mask must be drawn again bit for bit (checkpoint's ``preserve_rng_state``).
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import slimgrad
from slimgrad import ownership
from slimgrad.nn.inplace_abn import InPlaceABN
from slimgrad.nn.reversible import AdditiveCoupling, ReversibleSequential

REENTRANT = pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])


# --- plain-torch blocks -----------------------------------------------------------------------


class _MLP(nn.Module):
    """A transformer MLP block with a residual: LN -> Linear -> GELU -> Dropout -> Linear."""

    def __init__(self, d: int = 12) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 3 * d)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(3 * d, d)

    def forward(self, x):
        return x + self.fc2(self.drop(self.act(self.fc1(self.ln(x)))))


class _Basic(nn.Module):
    """torchvision's BasicBlock: conv-BN-ReLU(inplace)-conv-BN, ``out += x``, ReLU(inplace)."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


class _InplaceHead(nn.Module):
    """In-place writes inside the region: Linear -> dropout_ -> ReLU(inplace) -> Linear; with
    ``first`` the in-place ops come first and write over the region's own input."""

    def __init__(self, d: int = 12, first: bool = False) -> None:
        super().__init__()
        self.fc0 = nn.Identity() if first else nn.Linear(d, d)
        self.relu = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.25, inplace=True)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return self.fc(self.relu(self.drop(self.fc0(x))))


class _Net(nn.Module):
    """stem -> blocks (each under ``checkpoint`` when ``ckpt`` is set) -> scalar-ready output."""

    def __init__(self, stem: nn.Module, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.stem = stem
        self.blocks = nn.ModuleList(blocks)
        self.ckpt: dict | None = None  # checkpoint kwargs, or None for no checkpointing

    def forward(self, x):
        h = self.stem(x)
        for b in self.blocks:
            h = b(h) if self.ckpt is None else checkpoint(b, h, **self.ckpt)
        return h


def _mlp_net():
    return _Net(nn.Linear(12, 12), [_MLP(), _MLP()]), (torch.randn(3, 5, 12),)


def _cnn_net():
    stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU())
    return _Net(stem, [_Basic(), _Basic()]), (torch.randn(2, 3, 7, 5),)


def _inplace_net():
    return _Net(nn.Linear(12, 12), [_InplaceHead(), _InplaceHead()]), (torch.randn(4, 12),)


NETS = {"mlp": _mlp_net, "cnn": _cnn_net, "inplace": _inplace_net}


def _step(model: nn.Module, x: torch.Tensor, seed: int = 1):
    # .backward() (not autograd.grad): reentrant checkpointing only supports that
    x = x.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(x)
    r = torch.linspace(-1, 1, out.numel()).view_as(out)
    (out * r).sum().backward()
    grads = [x.grad] + [p.grad for p in model.parameters()]
    return out.detach(), grads, [b.clone() for b in model.buffers()]


def _ckpt_kwargs(reentrant: bool, **kw) -> dict:
    return {"use_reentrant": reentrant, **kw}


@REENTRANT
@pytest.mark.parametrize("net", list(NETS))
def test_converted_blocks_under_checkpoint_match_eager(net, reentrant):
    model, (x,) = NETS[net]()
    slim = slimgrad.convert_(copy.deepcopy(model))
    assert slimgrad.report(slim).converted, "nothing converted: the test would prove nothing"
    eager_plain = copy.deepcopy(model)
    for m in (model, slim):
        m.ckpt = _ckpt_kwargs(reentrant)
    out_e, g_e, b_e = _step(model, x)
    out_c, g_c, b_c = _step(slim, x)
    out_p, g_p, b_p = _step(eager_plain, x)  # no checkpointing: the same step (same masks)
    torch.testing.assert_close(out_c, out_e)
    torch.testing.assert_close(g_c, g_e)
    torch.testing.assert_close(g_c, g_p)
    # BatchNorm under checkpoint updates its running statistics in the recompute too (eager's
    # behaviour): the converted model must do the same
    torch.testing.assert_close(b_c, b_e)


@REENTRANT
@pytest.mark.parametrize("net", list(NETS))
def test_verify_under_checkpoint(net, reentrant):
    model, (x,) = NETS[net]()
    model.ckpt = _ckpt_kwargs(reentrant)
    slim = slimgrad.convert_(copy.deepcopy(model))
    rep = slimgrad.verify(model, slim, x)
    assert rep.ok, str(rep)
    assert ("reentrant torch.utils.checkpoint" in str(rep)) == reentrant


@REENTRANT
def test_dropout_mask_is_redrawn_bit_for_bit(reentrant):
    # d loss / d x = r * mask / (1 - p): the recompute's mask must be the forward's, bit for bit
    drop = slimgrad.convert_(nn.Sequential(nn.Dropout(0.4)))
    assert type(drop[0]).__module__.startswith("slimgrad.")
    x0 = torch.randn(6, 33)
    r = torch.randn(6, 33)

    def grad_x(wrap, **kw):
        x = (x0 + 0).requires_grad_()
        h = x * 1  # a non-leaf region input
        torch.manual_seed(3)
        y = wrap(h, **kw)
        torch.manual_seed(99)  # the RNG moves on before backward (other layers' dropout)
        (y * r).sum().backward()
        return y.detach(), x.grad

    y_p, g_p = grad_x(lambda h: drop(h))
    y_c, g_c = grad_x(lambda h, **kw: checkpoint(drop, h, use_reentrant=reentrant, **kw))
    assert torch.equal(y_c, y_p) and torch.equal(g_c, g_p)
    assert torch.equal(g_c != 0, y_c != 0)  # the gradient's mask is the output's mask
    # the test can fail: without preserve_rng_state the recompute draws another mask
    _, g_bad = grad_x(
        lambda h, **kw: checkpoint(drop, h, use_reentrant=reentrant, preserve_rng_state=False)
    )
    assert not torch.equal(g_bad, g_p)


def _policy(ctx, op, *args, **kwargs):
    # keep the matmuls' outputs, recompute everything else (torchtitan's selective AC shape)
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_HEAVY = (
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.convolution.default,
    torch.ops.aten.native_layer_norm.default,
    torch.ops.aten.gelu.default,
)


def _save_heavy(ctx, op, *args, **kwargs):
    # also keep convolutions, norms and GELU: slimgrad's Functions then see cached aten outputs in
    # the recompute. (A MUST_SAVE-everything policy is no test: eager itself fails under it on CPU,
    # since SAC caches the outputs that BatchNorm's counter add_ and dropout's bernoulli_ write.)
    return CheckpointPolicy.MUST_SAVE if op in _HEAVY else CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("policy", [_policy, _save_heavy], ids=["save_mm", "save_heavy"])
@pytest.mark.parametrize("net", ["mlp", "cnn"])
def test_selective_checkpoint_policy(net, policy):
    model, (x,) = NETS[net]()
    slim = slimgrad.convert_(copy.deepcopy(model))
    eager_plain = copy.deepcopy(model)
    ctx_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    for m in (model, slim):
        m.ckpt = _ckpt_kwargs(False, context_fn=ctx_fn)
    out_e, g_e, b_e = _step(model, x)
    out_c, g_c, b_c = _step(slim, x)
    out_p, g_p, _ = _step(eager_plain, x)
    torch.testing.assert_close(out_c, out_e)
    torch.testing.assert_close(g_c, g_e)
    torch.testing.assert_close(g_c, g_p)
    torch.testing.assert_close(b_c, b_e)  # BatchNorm: updated in the recompute too, as eager
    rep = slimgrad.verify(model, slim, x, modes=("train",))
    assert rep.ok, str(rep)


@REENTRANT
def test_inplace_abn_inside_checkpoint(reentrant):
    # InPlaceABN writes BN + leaky_relu over the conv output inside the region; the region's input
    # (the conv's input) must reach the recompute unchanged
    torch.manual_seed(0)
    block = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), InPlaceABN(5, activation_param=0.1))
    x0 = torch.randn(2, 3, 6, 5)
    r = torch.randn(2, 5, 6, 5)

    def run(ckpt):
        blk = copy.deepcopy(block)
        x = x0.clone().requires_grad_()
        h = x * 1
        y = checkpoint(blk, h, use_reentrant=reentrant) if ckpt else blk(h)
        (y * r).sum().backward()
        return y.detach(), [x.grad, *[p.grad for p in blk.parameters()]], h.detach()

    y_p, g_p, h_p = run(False)
    y_c, g_c, h_c = run(True)
    torch.testing.assert_close(y_c, y_p)
    torch.testing.assert_close(g_c, g_p)
    assert torch.equal(h_c, x0)  # the region's input was not written over


@REENTRANT
def test_inplace_write_over_the_region_input_raises_as_eager(reentrant):
    # the region's first ops write over the region's input (dropout_ then ReLU(inplace)): eager
    # raises autograd's in-place error in backward (non-reentrant: the saved input changed;
    # reentrant: the recompute writes over its detached leaf input); slimgrad must raise it too,
    # never hand back a gradient computed from the overwritten input
    model = _Net(nn.Linear(12, 12), [_InplaceHead(first=True)])
    slim = slimgrad.convert_(copy.deepcopy(model))
    assert len(slimgrad.report(slim).converted) == 4  # dropout, ReLU and the two Linears
    x = torch.randn(4, 12)
    for m in (model, slim):
        m.ckpt = _ckpt_kwargs(reentrant)
        with pytest.raises(RuntimeError, match="in-?place operation"):
            _step(m, x)


@REENTRANT
def test_gradient_buffer_reuse_inside_checkpoint(reentrant):
    # backward reuses dead gradient buffers inside the recomputed region; bit for bit as with
    # reuse off, and reuse does happen there (else this proves nothing)
    model, (x,) = NETS["mlp"]()
    slim = slimgrad.convert_(model)
    slim.ckpt = _ckpt_kwargs(reentrant)
    ownership.reset_reuse_count()
    out_a, g_a, _ = _step(slim, x)
    granted = ownership.reuse_count()
    with ownership.reuse_disabled():
        out_b, g_b, _ = _step(slim, x)
    assert granted > 0
    assert torch.equal(out_a, out_b)
    for a, b in zip(g_a, g_b):
        assert torch.equal(a, b)


@REENTRANT
@pytest.mark.parametrize("exact", [False, True])
def test_reversible_inside_checkpoint(reentrant, exact):
    torch.manual_seed(0)
    blocks = [
        AdditiveCoupling(
            nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.ReLU()),
        )
        for _ in range(3)
    ]
    rev = ReversibleSequential(*blocks, exact=exact).double()
    x0 = torch.randn(2, 4, 5, 3, dtype=torch.float64)
    r = torch.randn(2, 4, 5, 3, dtype=torch.float64)

    def run(ckpt):
        rev.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        y = checkpoint(rev, x * 1, use_reentrant=reentrant) if ckpt else rev(x * 1)
        (y * r).sum().backward()
        return [x.grad, *[p.grad for p in rev.parameters()]]

    want = run(False)
    for _ in range(2):  # twice: a backward's in-place rebuild must not leak into the next
        got = run(True)
        if exact:
            for a, b in zip(got, want):
                assert torch.equal(a, b)
        else:
            torch.testing.assert_close(got, want)


# --- HF gradient_checkpointing_enable before / after convert_ ------------------------------------

transformers = pytest.importorskip("transformers")
V = 64


def _hf(name: str):
    torch.manual_seed(0)
    t = transformers
    if name == "gpt2":  # dropout 0.1 everywhere: the recompute must redraw the same masks
        cfg = t.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=16)
        return t.GPT2LMHeadModel(cfg)
    cfg = t.LlamaConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        num_hidden_layers=2,
        vocab_size=V,
        attention_dropout=0.1,
    )
    return t.LlamaForCausalLM(cfg)


def _enable(model, reentrant):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated alias is what users call
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )


def _hf_grads(model, batch):
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@REENTRANT
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_gradient_checkpointing(name, when, reentrant):
    model = _hf(name)
    ids = torch.randint(0, V, (2, 9))
    batch = {"input_ids": ids, "labels": ids}
    plain = copy.deepcopy(model)
    slim = copy.deepcopy(model)
    _enable(model, reentrant)
    if when == "before":
        _enable(slim, reentrant)
        slimgrad.convert_(slim)
    else:
        slimgrad.convert_(slim)
        _enable(slim, reentrant)
    assert slimgrad.report(slim).converted
    assert all(
        getattr(m, "gradient_checkpointing", True)
        for m in slim.modules()
        if hasattr(m, "_gradient_checkpointing_func")
    )
    loss_e, g_e = _hf_grads(model, batch)
    loss_c, g_c = _hf_grads(slim, batch)
    loss_p, g_p = _hf_grads(plain, batch)
    torch.testing.assert_close(loss_c, loss_e)
    torch.testing.assert_close(g_c, g_e)
    torch.testing.assert_close(g_c, g_p)
    # verify (train mode: HF checkpoints only in training); the padded batches and eval mode
    # once per family (CI time)
    full = when == "after" and reentrant
    rep = slimgrad.verify(
        model, slim, batch, padded=full, modes=("train", "eval") if full else ("train",)
    )
    assert rep.ok, str(rep)
    assert ("reentrant torch.utils.checkpoint" in str(rep)) == reentrant


# --- memory: the combination saves over either alone (exact tracker) ------------------------------


def _peak(model, loss_of) -> int:
    from slimgrad.memory import measure

    model.train()
    loss_of(model).backward()  # warm-up (first-use caches), then a measured step
    model.zero_grad(set_to_none=True)
    return measure(lambda: loss_of(model), module=None, timeline=False).peak_bytes


def test_gpt2_checkpointing_and_slimgrad_save_more_together():
    # long enough rows that what checkpointing drops outweighs the recompute's own transients
    # (at 16 tokens slimgrad alone is lower than both together)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=256, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 256, (2, 64))

    def loss_of(m):
        torch.manual_seed(5)
        return m(input_ids=ids, labels=ids).loss

    ck, slim = copy.deepcopy(model), slimgrad.convert_(copy.deepcopy(model))
    _enable(ck, False)
    both = slimgrad.convert_(copy.deepcopy(model))
    _enable(both, False)
    p_eager, p_ck, p_slim, p_both = (_peak(m, loss_of) for m in (model, ck, slim, both))
    assert p_ck < p_eager and p_slim < p_eager
    assert p_both < min(p_ck, p_slim), (p_eager, p_ck, p_slim, p_both)


def test_cnn_checkpoint_peak_not_above_eager_checkpoint():
    model, (x,) = NETS["cnn"]()
    slim = slimgrad.convert_(copy.deepcopy(model))
    for m in (model, slim):
        m.ckpt = _ckpt_kwargs(False)
    r = torch.randn(2, 4, 7, 5)

    def loss_of(m):
        return (m(x) * r).sum()

    # no full-size tensor above eager + checkpoint (per-channel statistics may differ by bytes;
    # today a BatchNorm input per block is kept: +3616 B here, with the patch +32 B)
    act_bytes = 2 * 4 * 7 * 5 * 4  # one block activation, float32
    assert _peak(slim, loss_of) < _peak(model, loss_of) + act_bytes


def test_convert_of_reentrant_checkpoint_model_does_not_warn():
    # convert_'s fx traces call forward on Proxies; torch's "None of the inputs have
    # requires_grad=True" warning from a reentrant checkpoint there would alarm users
    import warnings

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = torch.nn.Sequential(
                torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(inplace=True)
            )

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=True)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        slimgrad.convert_(Net())
    msgs = [str(w.message) for w in seen]
    assert not [m for m in msgs if "requires_grad" in m], msgs
