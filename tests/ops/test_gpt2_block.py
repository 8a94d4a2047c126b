"""GPT-2's block with its LayerNorms folded into the nodes after them (NOTE [GPT-2's block with its
LayerNorms folded] in slimgrad/convert_handlers/hf_gpt2_block.py; NOTE [A LayerNorm folded into
its consumer's node] in slimgrad/ops/gpt2_mlp.py): ln_1 + c_attn and ln_2 + the MLP run as one
autograd node each, with the per-op converted model's loss, gradients, saved and peak bytes."""

from __future__ import annotations

import copy
import functools
import inspect

import pytest
import torch

import slimgrad
import slimgrad.nn.gpt2_mlp as ngm
import slimgrad.ops.gpt2_attention as oga
from slimgrad import ownership
from slimgrad.memory import estimate, measure

transformers = pytest.importorskip("transformers")
import slimgrad.convert_handlers.hf_gpt2_block as hb  # noqa: E402


def _model(layers=2, width=32, **cfg):
    c = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=4, vocab_size=97, n_positions=64,
        bos_token_id=0, eos_token_id=0, **cfg,
    )  # fmt: skip
    torch.manual_seed(0)
    return slimgrad.convert_(transformers.GPT2LMHeadModel(c))


def _per_op(model):
    # today's converted model: the blocks run HF's forward (per-op LayerNorms)
    m = copy.deepcopy(model)
    for blk in m.transformer.h:
        blk.__dict__.pop("forward", None)
    return m


@pytest.fixture
def folded(monkeypatch):
    # calls of the two folded nodes: [ln_1 + c_attn, ln_2 + MLP]
    n = [0, 0]
    real_a, real_m = oga._GPT2_LN_CONV1D_APPLY, ngm._GPT2_LN_MLP_APPLY

    def a(*args):
        n[0] += 1
        return real_a(*args)

    def m(*args):
        n[1] += 1
        return real_m(*args)

    monkeypatch.setattr(oga, "_GPT2_LN_CONV1D_APPLY", a)
    monkeypatch.setattr(ngm, "_GPT2_LN_MLP_APPLY", m)
    return n


def _step(model, ids, mask=None):
    torch.manual_seed(5)  # the dropout masks
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return loss.detach(), grads


def _assert_same(a, b):
    (la, ga), (lb, gb) = a, b
    assert torch.equal(la, lb)
    assert ga.keys() == gb.keys()
    for k in ga:
        assert torch.equal(ga[k], gb[k]), k


@pytest.mark.hf_release
def test_convert_puts_the_block_forward():
    # under every declared transformers release (5.24: the cache renamed to ``cache`` behind
    # @deprecate_kwarg; before: not recognised, HF's forward ran)
    model = _model()
    blk = model.transformer.h[0]
    sig = inspect.signature(inspect.unwrap(type(blk).forward))
    for blk in model.transformer.h:
        fwd = blk.__dict__.get("forward")
        assert type(fwd) is hb.GPT2BlockForward
        assert fwd.args == tuple(sig.parameters)[1:-1]
        assert fwd.cache_name == blk.attn.forward.cache_name == fwd.args[1]


def _hf_block():
    return transformers.models.gpt2.modeling_gpt2.GPT2Block


def _resigned(change):
    # a forward calling HF's, with the signature ``change`` makes of HF's (a release that adds,
    # moves or re-defaults a parameter)
    real = inspect.unwrap(_hf_block().forward)
    params = list(inspect.signature(real).parameters.values())

    def forward(self, *args, **kwargs):
        return real(self, *args, **kwargs)

    forward.__signature__ = inspect.Signature(change(params))
    return forward


def _set(params, i, **kw):
    return [*params[:i], params[i].replace(**kw), *params[i + 1 :]]


_VAR = inspect.Parameter.VAR_KEYWORD
_POK = inspect.Parameter.POSITIONAL_OR_KEYWORD


@pytest.mark.parametrize(
    "change",
    [
        # a new parameter before **kwargs
        lambda ps: [*ps[:-1], inspect.Parameter("output_attentions", _POK, default=False), ps[-1]],
        lambda ps: _set(ps, 6, default=True),  # use_cache's default
        lambda ps: [ps[0], ps[1], ps[3], ps[2], *ps[4:]],  # the cache after the mask
        lambda ps: ps[:-1],  # no **kwargs
        lambda ps: _set(ps, 2, name="layer_past"),  # a cache name not known
    ],
    ids=["new_parameter", "default", "moved", "no_kwargs", "cache_name"],
)
def test_another_signature_keeps_hfs(monkeypatch, change):
    # NOTE [GPT-2's block, recognised by structure and signature]: a release whose block forward
    # has another signature keeps HF's forward; the attention's forward is still put
    monkeypatch.setattr(_hf_block(), "forward", _resigned(change))
    model = _model()
    for blk in model.transformer.h:
        assert "forward" not in blk.__dict__
        assert "forward" in blk.attn.__dict__


@pytest.mark.hf_release
def test_an_unknown_wrapper_keeps_hfs_and_deprecate_kwarg_does_not(monkeypatch):
    from transformers.utils.deprecation import deprecate_kwarg

    stock = _hf_block().forward

    @functools.wraps(stock)
    def logged(self, *args, **kwargs):  # a wrapper of some other decorator: it could do anything
        return stock(self, *args, **kwargs)

    monkeypatch.setattr(_hf_block(), "forward", logged)
    for blk in _model().transformer.h:
        assert "forward" not in blk.__dict__
    cache = inspect.signature(inspect.unwrap(stock)).parameters
    renamed = deprecate_kwarg("layer_past", "9.0.0", new_name=list(cache)[2])(stock)
    monkeypatch.setattr(_hf_block(), "forward", renamed)
    for blk in _model().transformer.h:
        assert type(blk.__dict__.get("forward")) is hb.GPT2BlockForward


@pytest.mark.parametrize("child", ["crossattention", "adapter"])
def test_another_structure_keeps_hfs(child):
    # a child the block forward does not run (a cross-attention; one a release or a user added)
    c = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(c)
    for blk in model.transformer.h:
        blk.add_module(child, torch.nn.Identity())
    slimgrad.convert_(model)
    for blk in model.transformer.h:
        assert "forward" not in blk.__dict__


@pytest.mark.hf_release
def test_a_deprecated_cache_keyword_runs_hfs_forward(folded):
    # a call naming the cache by the other known name (5.24: the deprecated past_key_values;
    # 5.23: cache, not a parameter) runs HF's forward, whose decorator renames it where it has one
    model = _model().train()
    per_op = _per_op(model)
    blk, ref_blk = model.transformer.h[0], per_op.transformer.h[0]
    params = inspect.signature(inspect.unwrap(type(blk).forward)).parameters
    other = "cache" if "past_key_values" in params else "past_key_values"
    x = torch.randn(2, 7, 32)
    torch.manual_seed(5)
    got = blk(x, **{other: None})
    torch.manual_seed(5)
    want = ref_blk(x, **{other: None})
    assert torch.equal(got, want)
    assert folded == [0, 0]
    torch.manual_seed(5)
    assert torch.equal(blk(x), want)  # the same call without it folds, with the same bits
    assert folded == [1, 1]


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("frozen", [None, "ln_1", "ln_2", "c_attn", "c_fc", "wte", "all_ln"])
def test_bits_as_per_op(train, frozen, folded):
    model = _model().train(train)
    if frozen == "wte":
        model.transformer.wte.weight.requires_grad_(False)
        model.transformer.wpe.weight.requires_grad_(False)
    elif frozen is not None:
        for blk in model.transformer.h:
            if frozen == "all_ln":
                ps = [*blk.ln_1.parameters(), *blk.ln_2.parameters()]
            elif frozen == "c_attn":
                ps = blk.attn.c_attn.parameters()
            elif frozen == "c_fc":
                ps = blk.mlp.c_fc.parameters()
            else:
                ps = getattr(blk, frozen).parameters()
            for p in ps:
                p.requires_grad_(False)
    ids = torch.randint(0, 97, (2, 24))
    ref = _step(_per_op(model), ids)
    assert folded == [0, 0]
    _assert_same(_step(model, ids), ref)
    # train: both folds in each block; eval: the attention runs HF's forward (no dropout), the
    # MLP's fold still applies
    assert folded == ([2, 2] if train else [0, 2])


@pytest.mark.hf_release
def test_padding_mask_runs_the_attention_per_op_and_folds_the_mlp(folded):
    model = _model().train()
    ids = torch.randint(0, 97, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, 17:] = 0
    ref = _step(_per_op(model), ids, mask)
    _assert_same(_step(model, ids, mask), ref)
    assert folded == [0, 2]


def test_fallback_channel_keeps_the_per_op_bytes_and_bits(folded):
    # a gamma of 0: a fallback channel (ops/layer_norm.py), y not known kept after (x kept)
    model = _model().train()
    with torch.no_grad():
        for blk in model.transformer.h:
            blk.ln_1.weight[3] = 0.0
            blk.ln_2.weight[5] = 0.0
    ids = torch.randint(0, 97, (2, 24))
    per_op = _per_op(model)
    _assert_same(_step(model, ids), _step(per_op, ids))
    assert folded == [2, 2]
    a = measure(lambda: _loss(model, ids), module=model, timeline=False)
    b = measure(lambda: _loss(per_op, ids), module=per_op, timeline=False)
    assert (a.saved_bytes, a.peak_bytes) == (b.saved_bytes, b.peak_bytes)


def _loss(model, ids):
    torch.manual_seed(5)
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("where", ["ln_1", "ln_2", "attn", "mlp", "c_attn"])
def test_a_hooked_child_runs_it_as_a_module(where, folded):
    model = _model().train()
    seen = []
    for blk in model.transformer.h:
        mod = blk.attn.c_attn if where == "c_attn" else getattr(blk, where)
        mod.register_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
    ids = torch.randint(0, 97, (2, 24))
    ref = _step(_per_op(model), ids)
    n_ref = len(seen)
    _assert_same(_step(model, ids), ref)
    assert len(seen) == 2 * n_ref == 4  # the hook fired in both models, once per block
    # a hooked LayerNorm, attention or MLP: HF's block forward; a hooked c_attn: only ln_1's fold
    # is off
    assert folded == {"c_attn": [0, 2]}.get(where, [0, 0])


def test_hf_gradient_checkpointing_still_checkpoints(folded):
    # transformers wraps GPT2Block's class forward to checkpoint it: the block forward steps
    # aside while it is on (before: the folds ran unchecked, keeping every block's tensors)
    model = _model().train()
    model.gradient_checkpointing_enable({"use_reentrant": False})
    ids = torch.randint(0, 97, (2, 24))
    per_op = _per_op(model)
    _assert_same(_step(model, ids), _step(per_op, ids))
    assert folded == [0, 0]
    a = measure(lambda: _loss(model, ids), module=model, timeline=False)
    b = measure(lambda: _loss(per_op, ids), module=per_op, timeline=False)
    assert (a.saved_bytes, a.peak_bytes) == (b.saved_bytes, b.peak_bytes)


def test_plan_recompute_takes_the_folds(folded):
    # a block recomputed by torch.utils.checkpoint around the block's call (slimgrad.plan's
    # lean+recompute does the same): the recompute takes the same nodes
    from torch.utils.checkpoint import checkpoint

    model = _model().train()
    per_op = _per_op(model)
    for m in (model, per_op):
        for blk in m.transformer.h:
            call = blk.forward

            def fwd(*a, _call=call, **k):
                return checkpoint(_call, *a, use_reentrant=False, **k)

            blk.forward = fwd
    ids = torch.randint(0, 97, (2, 24))
    ref = _step(per_op, ids)
    assert folded == [0, 0]
    _assert_same(_step(model, ids), ref)
    assert folded == [4, 4]  # forward and recompute


def test_not_while_compiling(folded, monkeypatch):
    # compiling() is the first check (Dynamo folds it): HF's forward, the per-op path
    import slimgrad.convert_handlers.hf_attention as hfa

    model = _model().train()
    ids = torch.randint(0, 97, (2, 24))
    ref = _step(_per_op(model), ids)
    monkeypatch.setattr(hb, "compiling", lambda: True)
    monkeypatch.setattr(hfa, "compiling", lambda: True)
    _assert_same(_step(model, ids), ref)
    assert folded == [0, 0]


def _python_nodes(loss) -> int:
    # the autograd graph's nodes made by Python Functions (each a Python backward call)
    seen, todo, n = set(), [loss.grad_fn], 0
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        n += type(f).__name__.endswith("Backward") and hasattr(f, "saved_tensors")
        todo.extend(g for g, _ in f.next_functions)
    return n


def test_three_python_nodes_per_block_where_there_were_four():
    model = _model(layers=3).train()
    ids = torch.randint(0, 97, (2, 24))
    n_fold = _python_nodes(_loss(model, ids))
    n_per_op = _python_nodes(_loss(_per_op(model), ids))
    # per block: ln_1, attention, ln_2, MLP -> ln_1 + c_attn, attention, ln_2 + MLP
    assert n_per_op - n_fold == 3


def _make(layers, width, tokens, batch, fold):
    def make():
        model = _model(layers, width).train()
        if not fold:
            model = _per_op(model)
        ids = torch.randint(0, 97, (batch, tokens))
        return (lambda: _loss(model, ids)), model

    return make


@pytest.mark.parametrize("shape", [(2, 32, 24, 2), (4, 64, 16, 1)])
def test_bytes_as_per_op_and_the_estimate_is_the_step(shape, folded):
    from torch._subclasses.fake_tensor import FakeTensorMode

    out = {}
    for fold in (False, True):
        make = _make(*shape, fold)
        forward, model = make()
        forward().backward()  # warm-up: one-time tables stay out of the measured step
        for p in model.parameters():
            p.grad = None
        ownership.reset_reuse_count()
        real = measure(forward, module=model, timeline=False)
        granted = ownership.reuse_count()
        FakeTensorMode.cache_clear()
        ownership.reset_reuse_count()
        est = estimate(make, timeline=False)
        assert ownership.reuse_count() == granted
        assert (est.peak_bytes, est.saved_bytes) == (real.peak_bytes, real.saved_bytes)
        out[fold] = real
    assert folded == [3 * shape[0]] * 2  # warm-up, measured step and estimate took the folds
    a, b = out[True], out[False]
    assert a.saved_bytes == b.saved_bytes
    assert a.peak_bytes <= b.peak_bytes
    assert a.forward_peak_bytes <= b.forward_peak_bytes


@pytest.mark.parametrize("request_kw", ["output_hidden_states", "output_attentions"])
def test_a_call_asking_for_outputs_does_not_turn_the_fold_off_for_later_calls(folded, request_kw):
    # transformers leaves its output-capturing hooks on the layers after the first call that asks
    # for outputs; they act only in such a call (NOTE [Forward hooks on an output-saving module]).
    # Before: every later plain call ran HF's forward ([0, 0] nodes)
    model = _model()
    model.train()
    per_op = _per_op(model)
    ids = torch.randint(0, 97, (2, 24))
    torch.manual_seed(5)
    out = model(input_ids=ids, labels=ids, **{request_kw: True})
    torch.manual_seed(5)
    want = per_op(input_ids=ids, labels=ids, **{request_kw: True})
    assert folded == [0, 0]  # the asking call runs HF's forward: the hooks collect
    assert torch.equal(out.loss, want.loss)
    key = "hidden_states" if request_kw == "output_hidden_states" else "attentions"
    assert all(torch.equal(a, b) for a, b in zip(out[key], want[key], strict=True))
    got = _step(model, ids)
    assert folded == [2, 2]
    _assert_same(got, _step(per_op, ids))


def test_a_block_the_filter_leaves_alone_gets_no_instance_forwards():
    # filter_fn (and a plan's eager blocks, which enter as a filter) leave a block as it is: before,
    # its attention and the block still got the one-node forwards and the report listed them
    c = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(c)

    def keep(m, name):
        return not (name == "transformer.h.0" or name.startswith("transformer.h.0."))

    slimgrad.convert_(model, filter_fn=keep)
    h0, h1 = model.transformer.h
    assert "forward" not in h0.__dict__ and "forward" not in h0.attn.__dict__
    assert type(h1.__dict__.get("forward")) is hb.GPT2BlockForward
    rows = [r for r in str(slimgrad.report(model)).splitlines() if "GPT2Attention.forward" in r]
    assert len(rows) == 1 and "transformer.h.1.attn" in rows[0] and "h.0" not in rows[0], rows


def test_host_calls_per_call():
    # issue 32: a folded block's forward and backward (1 x 16 x 32), counted, not timed: 283
    # calls of and from slimgrad's code (329 before: each LayerNorm's C backward issued from C++,
    # NOTE [LayerNorm's backward from C++] in ops/layer_norm.py, 15 fewer per LayerNorm; the
    # dropout kernels' addresses read from a table, no frame; the nodes' saved tensors joined
    # without a call per step and saved through ctx's field, NOTE [Saving through ctx's fields])
    from tests._host_calls import slimgrad_calls

    blocks = _model(layers=1).train().transformer.h
    x = torch.randn(1, 16, 32, requires_grad=True)

    def step():
        torch.manual_seed(5)
        h = x * 1
        for blk in blocks:
            o = blk(h)
            h = o[0] if isinstance(o, tuple) else o
        (h * 1).sum().backward()

    for _ in range(3):  # kernels built, addresses read
        step()
    assert slimgrad_calls(step) <= 283
