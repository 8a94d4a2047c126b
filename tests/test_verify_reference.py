"""verify when its float64 reference cannot run (NOTE [A float64 reference that cannot run] in
slimgrad/verify.py): a slimgrad message naming the original error, never the model's raw error
from inside verify and never a pass. Issue 30: HF XGLMForCausalLM raised torch's "value cannot be
converted to type float without overflow" out of verify."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad

_MSG = "slimgrad.verify: the float64 reference cannot run"


class _Overflow(nn.Module):
    # XGLM's pattern: a float32 buffer filled with the input dtype's lowest value
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        h = self.fc(x)
        low = torch.full((1,), torch.finfo(h.dtype).min, dtype=torch.float32)
        return h + low.clamp(min=0).to(h.dtype)


class _DtypeCheck(nn.Module):
    # a module that refuses float64 inputs in its forward
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        if x.dtype == torch.float64:
            raise TypeError("float64 is not supported here")
        return self.fc(x)


class _Float32Only(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.dtype = x.dtype
        return x * 2

    @staticmethod
    def backward(ctx, g):
        if ctx.dtype == torch.float64:
            raise RuntimeError("this kernel has no float64 backward")
        return g * 2


class _BackwardRefuses(nn.Module):
    # forward runs in float64, backward refuses it
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        return _Float32Only.apply(self.fc(x))


MODELS = {"overflow": _Overflow, "dtype_check": _DtypeCheck, "backward": _BackwardRefuses}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_run_fails_with_a_slimgrad_message(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    rep = slimgrad.verify(model, copy.deepcopy(model), torch.randn(3, 6))
    assert not rep.ok
    assert len(rep.runs) == 2  # train and eval
    for run in rep.runs:
        assert not run.ok
        assert any(f.startswith(_MSG) for f in run.failures), run.failures
    text = str(rep)
    assert "expected a float64 copy of the original model to run the step" in text
    assert {"overflow": "overflow", "dtype_check": "TypeError", "backward": "no float64"}[
        name
    ] in text


class _RefusesFloat64Copy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def _apply(self, fn, recurse=True):
        if fn(torch.zeros(())).dtype == torch.float64:
            raise TypeError("this module stays float32")
        return super()._apply(fn, recurse)

    def forward(self, x):
        return self.fc(x)


def test_a_copy_that_cannot_be_made_float64_raises_a_slimgrad_error():
    model = _RefusesFloat64Copy()
    with pytest.raises(RuntimeError, match=r"slimgrad.verify: the float64 reference cannot be made;"
                       r" expected .*got TypeError: this module stays float32\. "):  # fmt: skip
        slimgrad.verify(model, copy.deepcopy(model), torch.randn(3, 6))


class _MaskedOnlyIn64(nn.Module):
    # a text model whose float64 copy fails only on a padded batch: the unpadded runs pass
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.fc = nn.Linear(8, 11)

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)
        if attention_mask is not None and not bool(attention_mask.all()):
            low = torch.full((1,), torch.finfo(h.dtype).min, dtype=torch.float32)
            h = h + low.clamp(min=0).to(h.dtype)
        return self.fc(h)


def test_only_the_runs_it_cannot_make_fail():
    torch.manual_seed(0)
    model = _MaskedOnlyIn64()
    rep = slimgrad.verify(model, copy.deepcopy(model), {"input_ids": torch.randint(0, 11, (3, 6))})
    assert not rep.ok
    status = {r.name: r.ok for r in rep.runs}
    assert status["inputs (train)"] and status["inputs (eval)"], status
    padded = [r for r in rep.runs if "padded" in r.name]
    assert len(padded) == 4
    for run in padded:
        assert not run.ok and any(f.startswith(_MSG) for f in run.failures), run.failures


def test_a_wrong_gradient_still_fails_where_the_reference_runs():
    # the new branch does not turn failures into passes: a converted model with a wrong gradient
    torch.manual_seed(0)
    model = _DtypeCheck()
    fine = nn.Sequential(nn.Linear(6, 4))
    fine[0].load_state_dict(model.fc.state_dict())
    wrong = copy.deepcopy(fine)
    wrong[0].weight.register_hook(lambda g: g * (1 + 1e-3))
    x = torch.randn(3, 6)
    assert slimgrad.verify(fine, copy.deepcopy(fine), x).ok
    rep = slimgrad.verify(fine, wrong, x)
    assert not rep.ok
    assert any(not g.ok for r in rep.runs for g in r.grads if g.name == "0.weight")


def test_hf_xglm():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.XGLMConfig(
        vocab_size=97, d_model=32, num_layers=2, attention_heads=4, ffn_dim=64,
        max_position_embeddings=64, pad_token_id=1,
    )  # fmt: skip
    model = transformers.XGLMForCausalLM(cfg)
    x = torch.randint(3, 97, (2, 9))
    rep = slimgrad.verify(model, slimgrad.convert_(copy.deepcopy(model)), {"input_ids": x,
                          "labels": x}, padded=False)  # fmt: skip
    assert not rep.ok
    for run in rep.runs:
        assert any(f.startswith(_MSG) and "overflow" in f for f in run.failures), run.failures


class _SetsRequiresGradOnAView(nn.Module):
    # as HF Wav2Vec2's feature encoder: requires_grad set on a view of the input in training
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        h = x[:, None]
        if self.training:
            h.requires_grad = True
        return self.lin(h).sum()


def test_inputs_the_original_will_not_take_as_leaves():
    torch.manual_seed(0)
    model = _SetsRequiresGradOnAView()
    slim = slimgrad.convert_(copy.deepcopy(model))
    x = torch.randn(2, 4)
    before = copy.deepcopy(model.state_dict())
    rep = slimgrad.verify(model, slim, x, modes=("train",), loss_fn=lambda out: out)
    assert rep.ok, str(rep)
    (run,) = rep.runs
    assert not run.input_grads
    assert any("input gradients not compared" in n for n in run.notes), run.notes
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the original as it was
    assert all(p.grad is None for p in model.parameters())
