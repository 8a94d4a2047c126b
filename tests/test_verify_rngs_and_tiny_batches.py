"""verify seeds every global generator a model draws from, and leaves out a train step the original
cannot take at one value per BatchNorm channel (hunt 28b, issue 30).

NOTE [Every generator a model draws from] and NOTE [A batch the original cannot step in train
mode] (src/slimgrad/verify.py).
"""

import copy
import random

import numpy as np
import pytest
import torch
import torch.nn as nn

import slimgrad


class _Masked(nn.Module):
    """Masks features from numpy's or Python's global RNG (as HF SpecAugment does from numpy's)."""

    def __init__(self, source: str):
        super().__init__()
        self.source = source
        self.l1, self.bn, self.l2 = nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Linear(16, 3)

    def forward(self, x):
        h = self.l1(x)
        if self.training:
            if self.source == "numpy":
                keep = np.random.rand(h.shape[-1]) > 0.5
            else:
                keep = [random.random() > 0.5 for _ in range(h.shape[-1])]
            h = h * torch.tensor(keep, dtype=h.dtype)
        return self.l2(torch.relu(self.bn(h)))


@pytest.mark.parametrize("source", ["numpy", "random"])
def test_a_model_drawing_from_numpy_or_random_passes_against_its_copy(source):
    torch.manual_seed(0)
    m = _Masked(source)
    rep = slimgrad.verify(m, copy.deepcopy(m), torch.randn(8, 6))
    assert rep.ok, str(rep)


@pytest.mark.parametrize("source", ["numpy", "random"])
def test_a_wrong_conversion_drawing_from_numpy_or_random_still_fails(source):
    torch.manual_seed(0)
    m = _Masked(source)
    bad = copy.deepcopy(m)
    with torch.no_grad():
        bad.bn.weight.mul_(1.01)  # same names, another function
    rep = slimgrad.verify(m, bad, torch.randn(8, 6))
    assert not rep.ok


def _eval_cnn():
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Conv2d(8, 8, 1),
        nn.BatchNorm2d(8),  # one value per channel at batch 1
        nn.Flatten(),
        nn.Linear(8, 4),
    )
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-1, 1)
            mod.running_var.uniform_(0.5, 2)
    return m.eval()


def test_batch_one_eval_model_verifies_eval_and_says_train_is_left_out():
    m = _eval_cnn()
    conv = slimgrad.convert_(copy.deepcopy(m))
    rep = slimgrad.verify(m, conv, torch.randn(1, 3, 8, 8))
    assert rep.ok, str(rep)
    assert [r.name for r in rep.runs] == ["inputs (eval)"]
    line = next(c for c in rep.checks if c.startswith("modes:"))
    assert "train left out" in line and "one value per channel" in line, line
    assert not m.training and not conv.training


def test_batch_one_eval_model_still_fails_a_wrong_conversion():
    # the eval run left is a real check: the buffers restored after the refused train step
    # (the first BatchNorm updated its running statistics before the second refused)
    m = _eval_cnn()
    bad = copy.deepcopy(m)
    with torch.no_grad():
        bad[5].running_var.mul_(1.01)
    rep = slimgrad.verify(m, bad, torch.randn(1, 3, 8, 8))
    assert not rep.ok, str(rep)
    ok = slimgrad.verify(m, copy.deepcopy(m), torch.randn(1, 3, 8, 8))
    assert ok.ok, str(ok)


def test_train_only_at_one_value_per_channel_is_verifys_error():
    m = _eval_cnn()
    with pytest.raises(RuntimeError, match="slimgrad.verify: the original model .*one value per"):
        slimgrad.verify(m, copy.deepcopy(m), torch.randn(1, 3, 8, 8), modes=("train",))


def test_a_converted_model_that_raises_in_a_later_mode_is_not_blamed_on_the_original():
    class EvalBreaks(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)
            self.broken = False

        def forward(self, x):
            if self.broken and not self.training:
                raise KeyError("converted eval path")
            return self.lin(x)

    m = EvalBreaks()
    c = copy.deepcopy(m)
    c.broken = True
    with pytest.raises(KeyError, match="converted eval path"):
        slimgrad.verify(m, c, torch.randn(2, 4))


def test_hf_specaugment_from_numpy_passes_against_its_copy():
    # hunt 28b: Wav2Vec2Conformer draws its SpecAugment time masks from numpy's global RNG; verify
    # failed the model against its own unconverted copy, blaming a BatchNorm buffer
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    conf = transformers.Wav2Vec2ConformerConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_feat_extract_layers=2, conv_dim=[16, 16], conv_stride=[5, 4], conv_kernel=[10, 4],
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, vocab_size=20,
        output_hidden_size=32,
    )  # fmt: skip
    m = transformers.Wav2Vec2ConformerForCTC(conf)
    x = torch.randn(2, 1600)
    am = torch.ones(2, 1600, dtype=torch.long)
    am[1, -400:] = 0
    rep = slimgrad.verify(
        m, copy.deepcopy(m), {"input_values": x, "attention_mask": am},
        loss_fn=lambda o: o.logits.square().mean(),
    )  # fmt: skip
    assert rep.ok, str(rep)
