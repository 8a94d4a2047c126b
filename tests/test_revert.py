"""``slimgrad.revert_``: the model ``convert_`` was given, back in place (NOTE [What convert_
records for revert_] in slimgrad/revert.py): each module's own class, the same Parameter and
buffer objects, the user's hooks, attributes and mode, nothing slimgrad put on it; eager's bits;
type-keyed tools (``torch.ao.quantization``, ``torch.jit.script``) work as on the eager model."""

from __future__ import annotations

import copy
import io
import types
import warnings

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.plan import Plan

transformers = pytest.importorskip("transformers")


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 36, 16),
        nn.GELU(),
        nn.LayerNorm(16),
        nn.Dropout(0.1),
        nn.Linear(16, 4),
    )


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)
        self.ln = nn.LayerNorm(8)

    def forward(self, x):
        return self.ln(x + self.fc2(self.act(self.fc1(x))))


def _blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_Block(), _Block(), _Block(), nn.Linear(8, 2))


def _llama():
    t = transformers
    cfg = t.LlamaConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        num_hidden_layers=1, vocab_size=64, attention_dropout=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    return t.LlamaForCausalLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _shape(model: nn.Module) -> list:
    # per module: its class, its attribute names, how many hooks each hook dict holds, its mode
    return [
        (
            type(m),
            sorted(m.__dict__),
            [(k, len(v)) for k, v in sorted(m.__dict__.items()) if "hooks" in k],
            m.training,
        )
        for m in model.modules()
    ]


def _step(model: nn.Module, inputs) -> tuple:
    # output (or loss) and every gradient, dropout masks from one seed
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    if isinstance(out, torch.Tensor):
        y = out
        out.square().sum().backward()
    else:
        y = out.loss if out.loss is not None else out.logits
        (out.loss if out.loss is not None else out.logits.square().sum()).backward()
    return y.detach(), [p.grad for p in model.parameters()]


def _bits(a: tuple, b: tuple) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    assert len(a[1]) == len(b[1])
    for x, y in zip(a[1], b[1], strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def _reverts(make, inputs, **convert_kwargs) -> nn.Module:
    # convert_ then revert_: the eager model's classes, attributes, hooks, tensors and bits; then
    # convert_ again: the first conversion's bits (a training step reads no running statistics)
    model = make()
    fresh, eager = _shape(copy.deepcopy(model)), copy.deepcopy(model)
    tensors = [id(t) for t in (*model.parameters(), *model.buffers())]
    slimgrad.convert_(model, **convert_kwargs)
    assert any(type(m).__module__.startswith("slimgrad.") for m in model.modules())
    first = _step(model, inputs)
    assert slimgrad.revert_(model) is model
    assert _shape(model) == fresh
    assert [id(t) for t in (*model.parameters(), *model.buffers())] == tensors
    _bits(_step(model, inputs), _step(eager, inputs))
    slimgrad.convert_(model, **convert_kwargs)
    _bits(_step(model, inputs), first)
    slimgrad.revert_(model)
    assert _shape(model) == fresh
    return model


def test_cnn_type_keyed_tools_after_revert():
    # the repro: quantize_dynamic left converted Linears as they were and fuse_modules
    # raised an AssertionError on the converted Conv2d/BatchNorm2d/ReLU
    img = torch.randn(2, 3, 8, 8)
    model = _reverts(_cnn, img)
    model.eval()
    q = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {nn.Linear}, torch.qint8)
    assert type(q[4]) is type(q[8]) is torch.ao.nn.quantized.dynamic.Linear
    fused = torch.ao.quantization.fuse_modules(copy.deepcopy(model), [["0", "1", "2"]])
    assert type(fused[0]) is torch.ao.nn.intrinsic.ConvReLU2d
    torch.testing.assert_close(fused(img), model(img))


def test_optimizer_hooks_attributes_mode_kept():
    model, eager = _blocks(), _blocks()
    x = torch.randn(4, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    model[0].fc1.register_forward_hook(lambda m, i, o: calls.append("before"))
    slimgrad.convert_(model[1])  # a submodule alone, then the whole model (the submodule kept)
    slimgrad.convert_(model)
    h = model[0].fc1.register_forward_hook(lambda m, i, o: calls.append("after"))
    model[0].fc1.note = "mine"  # the user's attribute and setting on converted modules
    model[2].act.approximate = "tanh"
    eager[2].act.approximate = "tanh"
    model.eval()
    slimgrad.revert_(model)
    assert type(model[0].fc1) is nn.Linear and type(model[1].act) is nn.GELU
    assert model[0].fc1.note == "mine" and model[2].act.approximate == "tanh"
    assert not any(m.training for m in model.modules())
    model(x)
    assert calls == ["before", "after"]
    h.remove()
    model.train()
    calls.clear()
    _bits(_step(model, x), _step(eager, x))
    opt.step()  # the optimizer built before convert_ steps the same Parameters
    torch.optim.SGD(eager.parameters(), lr=0.1).step()
    _bits(_step(model, x), _step(eager, x))
    assert calls == ["before", "before"]  # one per step; the one removed is gone


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_hf_lm_with_labels(make):
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    model = make()
    config = model.config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _reverts(lambda: model, {"input_ids": ids, "labels": ids})
    # the fused loss, GPT-2's one-node forwards and the private configs are gone
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert all(m.config is config for m in model.modules() if "config" in m.__dict__)
    assert config._attn_implementation == "sdpa"
    out = model(input_ids=ids, labels=ids)
    assert out.logits is not None  # HF's own forward builds the logits
    slimgrad.convert_(model)
    assert model.config is not config  # the model's own copy names the slimgrad attention
    model.config.use_cache = False  # the user's setting since convert_ is carried back
    slimgrad.revert_(model)
    assert model.config is config and not config.use_cache
    assert config._attn_implementation == "sdpa"


def test_inplace_abn_pass_and_plan_wrappers():
    img = torch.randn(2, 3, 8, 8)
    _reverts(_cnn, img, config=slimgrad.ConvertConfig(inplace_abn=True))
    plan = Plan(
        budget_bytes=0, peak_bytes=0, predicted_peak_bytes=0, verified=True, recompute_flops=0,
        forward_flops=0, device="cpu",
        choices={"0": "lean+recompute", "1": "eager", "2": "lean+recompute:fc2"},
    )  # fmt: skip
    model = _reverts(_blocks, torch.randn(4, 8), plan=plan)
    assert "_slimgrad_plan" not in model.__dict__


def test_copies_and_no_ops():
    img = torch.randn(2, 3, 8, 8)
    eager = _cnn()
    ref = _step(copy.deepcopy(eager), img)
    slimgrad.convert_(eager)
    buf = io.BytesIO()
    torch.save(eager, buf)
    buf.seek(0)
    for m in (copy.deepcopy(eager), torch.load(buf, weights_only=False)):
        slimgrad.revert_(m)
        assert [type(c) for c in m] == [type(c) for c in _cnn()]
        _bits(_step(m, img), ref)
    plain = _cnn()
    before = _shape(plain)
    slimgrad.revert_(plain)  # never converted: nothing changes
    slimgrad.revert_(plain)
    assert _shape(plain) == before
    with pytest.raises(RuntimeError, match="slimgrad.report: this model was not converted"):
        slimgrad.report(slimgrad.revert_(eager))
    slimgrad.convert_(plain)
    with pytest.raises(ValueError, match=r"slimgrad.revert_: .*the replacement of a Linear"):
        slimgrad.revert_(plain[4])
    with pytest.raises(TypeError, match="slimgrad.revert_: model must be a torch.nn.Module"):
        slimgrad.revert_(plain.state_dict())


def test_jit_script_error_names_revert_and_works_after():
    model = slimgrad.convert_(_cnn())
    with pytest.raises(RuntimeError, match=r"slimgrad\.revert_\(model\)"):
        torch.jit.script(model)
    torch.jit.script(slimgrad.revert_(model))


def test_accelerate_hook_rebound_to_the_reverted_module():
    hooks = pytest.importorskip("accelerate.hooks")
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    hooks.add_hook_to_module(model[0], hooks.ModelHook())
    eager = copy.deepcopy(model)
    slimgrad.convert_(model)
    slimgrad.revert_(model)
    lin = model[0]
    assert type(lin) is nn.Linear and lin._old_forward.__self__ is lin
    assert lin.forward.args[0] is lin  # accelerate's wrapper calls the reverted module
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), eager(x), rtol=0, atol=0)


def test_forward_wrapped_after_convert():
    # accelerate's hooks added after convert_ hold slimgrad's forward as ``_old_forward`` (the
    # fused-loss forward of an HF model, a slimgrad Linear's own): revert_ gives the wrapper the
    # original's; a wrapper revert_ cannot see into is an error that changes nothing
    hooks = pytest.importorskip("accelerate.hooks")
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    model = _llama()
    eager = copy.deepcopy(model)
    slimgrad.convert_(model)
    for m in (model, eager):
        hooks.add_hook_to_module(m, hooks.ModelHook())
        hooks.add_hook_to_module(m.lm_head, hooks.ModelHook())
    slimgrad.revert_(model)
    assert (
        model._old_forward.__func__ is type(model).forward
        and model.lm_head.forward.args[0] is model.lm_head
    )
    assert model.lm_head._old_forward.__func__ is nn.Linear.forward
    assert _shape(model) == _shape(eager)
    _bits(
        _step(model, {"input_ids": ids, "labels": ids}),
        _step(eager, {"input_ids": ids, "labels": ids}),
    )
    seq = slimgrad.convert_(nn.Sequential(nn.Linear(4, 4)))
    fused = slimgrad.convert_(_llama())
    for m in (fused, seq[0]):
        inner = m.forward
        m.forward = lambda *a, inner=inner, **k: inner(*a, **k)
        before = _shape(m)
        with pytest.raises(
            RuntimeError, match=r"slimgrad.revert_: module .* forward set since convert_"
        ):
            slimgrad.revert_(m if m is fused else seq)
        assert _shape(m) == before  # nothing changed


class _LoRA(nn.Module):
    # a LoRA-style wrapper put at a converted child's slot: it holds that child as base_layer
    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base_layer = base
        self.a = nn.Linear(base.in_features, 2, bias=False)
        self.b = nn.Linear(2, base.out_features, bias=False)

    def forward(self, x):
        return self.base_layer(x) + self.b(self.a(x))


def _wrap_slots(m) -> None:
    mlp = m.model.layers[0].mlp
    torch.manual_seed(3)
    mlp.gate_proj, mlp.down_proj = _LoRA(mlp.gate_proj), _LoRA(mlp.down_proj)


def _add_and_delete(m) -> None:
    mlp, norm, q = m.model.layers[0].mlp, m.model.norm, m.model.layers[0].self_attn.q_proj
    mlp.extra = nn.Identity()
    del mlp.act_fn
    mlp.act_fn = nn.Tanh()  # a new module at a slot emptied since: last, as on the eager model
    mlp.register_parameter("scale", nn.Parameter(torch.ones(3)))
    norm.register_buffer("extra_buf", torch.ones(3), persistent=False)
    q._private = 5  # a private attribute and a method override (a class attribute's name)
    q.forward = types.MethodType(lambda self, x: nn.Linear.forward(self, x) * 2, q)


def test_changes_inside_replaced_modules_kept():
    # Llama's MLP becomes a GatedMLP holding its own gate_proj/up_proj/down_proj/act_fn: what
    # the user put at those slots since convert_ (a LoRA-style wrapper), children, Parameters,
    # buffers and attributes added or deleted on replaced modules are on the reverted ones
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    model = _llama()
    eager = copy.deepcopy(model)
    slimgrad.convert_(model)
    for m in (model, eager):
        _wrap_slots(m)
        _add_and_delete(m)
    slimgrad.revert_(model)
    assert _shape(model) == _shape(eager)
    assert [n for n, _ in model.named_modules()] == [n for n, _ in eager.named_modules()]
    assert [n for n, _ in model.named_buffers()] == [n for n, _ in eager.named_buffers()]
    assert model.state_dict().keys() == eager.state_dict().keys()
    q = model.model.layers[0].self_attn.q_proj
    assert "forward" not in q.__dict__ or q.forward.__self__ is q
    _bits(
        _step(model, {"input_ids": ids, "labels": ids}),
        _step(eager, {"input_ids": ids, "labels": ids}),
    )
