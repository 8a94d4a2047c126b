"""HF Wav2Vec2ForCTC (tiny, CTC sum loss) through ``slimgrad.verify``, train and eval (issue 30).

Its positional conv embedding runs GELU on ``conv(x)[:, :, :-1]`` (SamePad), a non-contiguous
input; the GELU computed y on a contiguous copy, other bits than eager's (NOTE [Eager's output on
a strided input] in slimgrad/_math/layout.py), and the eval run failed 19 gradients
(lm_head.weight err 1.73e-4 > bound 1.07e-4; eager's own err 5.30e-5). With y eager's, the
converted forward is eager's bit for bit and verify passes; a gradient 0.1% off in that GELU's
backward still fails it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad

transformers = pytest.importorskip("transformers")

_POS = "wav2vec2.encoder.pos_conv_embed.activation"


def _model_and_inputs():
    V = 97
    cfg = transformers.Wav2Vec2Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, pad_token_id=0,
        mask_time_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(cfg)
    g = torch.Generator().manual_seed(0)
    inputs = {
        "input_values": torch.randn(2, 800, generator=g),
        "labels": torch.randint(1, V, (2, 5), generator=g),
    }
    return model, inputs


def test_verify_passes_and_the_forward_is_eagers():
    model, inputs = _model_and_inputs()
    slim = slimgrad.convert_(copy.deepcopy(model))
    assert type(slim.get_submodule(_POS)).__module__.startswith("slimgrad."), "GELU not converted"
    # eval: the run that failed (train passed)
    rep = slimgrad.verify(model, slim, inputs, modes=("eval",))
    assert rep.ok, str(rep)
    eager = copy.deepcopy(model).eval()
    slim.eval()
    with torch.no_grad():
        assert torch.equal(slim(**inputs).logits, eager(**inputs).logits)


class _OffGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * (1 + 1e-3)


class _WrongGelu(nn.Module):
    def forward(self, x):
        return _OffGrad.apply(nn.functional.gelu(x))


def test_a_wrong_gradient_there_still_fails():
    model, inputs = _model_and_inputs()
    slim = slimgrad.convert_(copy.deepcopy(model))
    parent, _, leaf = _POS.rpartition(".")
    setattr(slim.get_submodule(parent), leaf, _WrongGelu())
    rep = slimgrad.verify(model, slim, inputs, modes=("eval",))
    assert not rep.ok
    bad = {g.name for g in rep.runs[0].grads if not g.ok}
    assert "wav2vec2.feature_extractor.conv_layers.0.conv.weight" in bad, str(rep)


@pytest.mark.parametrize("modes", [("train",), ("eval", "train")])
def test_a_train_run_with_input_gradients_runs_without_them(modes):
    # a run that takes input gradients hands the inputs as leaves that require grad; Wav2Vec2's
    # feature encoder then sets requires_grad on a view of one in training, which autograd
    # refuses (eager too): the run steps with the inputs as given, with a note saying why
    # (NOTE [Inputs the original will not take as leaves] in slimgrad/verify.py)
    model, inputs = _model_and_inputs()
    slim = slimgrad.convert_(copy.deepcopy(model))
    rep = slimgrad.verify(model, slim, inputs, modes=modes)
    assert rep.ok, str(rep)
    train = [r for r in rep.runs if "train" in r.name]
    assert train and all(not r.input_grads for r in train)
    assert all(any("input gradients not compared" in n for n in r.notes) for r in train)
