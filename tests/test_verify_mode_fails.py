"""An original that steps its inputs in train mode but raises in eval mode (adv26 F7).

NOTE [A mode the original cannot run] (src/slimgrad/verify.py). HF Qwen3Next and RecurrentGemma
with gradient checkpointing step in train mode, but in eval mode their cache raises transformers'
"`get_seq_length` can only be called on Attention layers" (an unconverted copy raises the same).
Before the fix that raw error came out of verify; now verify raises its own GUIDE-form
RuntimeError naming the model, the mode, the original error and the ways out, and
``modes=("train",)`` (or ``use_cache=False``) verifies what the model runs.
"""

import copy

import pytest
import torch
import torch.nn as nn

import slimgrad


class _TrainOnly(nn.Module):
    def __init__(self, fail_in: str = "eval"):
        super().__init__()
        self.fail_in = fail_in
        self.l1 = nn.Linear(6, 16)
        self.n = nn.LayerNorm(16)
        self.l2 = nn.Linear(16, 4)

    def forward(self, x):
        if self.training == (self.fail_in == "train"):
            raise ValueError("no cache here")
        return self.l2(self.n(self.l1(x)))


def test_a_mode_the_original_cannot_run_is_verifys_error():
    torch.manual_seed(0)
    model = _TrainOnly()
    conv = slimgrad.convert_(copy.deepcopy(model))
    x = torch.randn(4, 6)
    with pytest.raises(RuntimeError) as info:
        slimgrad.verify(model, conv, x)
    msg = str(info.value)
    assert msg.startswith("slimgrad.verify: the original model (_TrainOnly)"), msg
    assert "in eval mode" in msg and "ValueError: no cache here" in msg, msg
    assert "modes=('train',)" in msg and "use_cache=False" in msg, msg
    assert isinstance(info.value.__cause__, ValueError)
    assert model.training and conv.training  # the modes put back
    # what the model runs is verified, a wrong conversion still caught
    assert slimgrad.verify(model, conv, x, modes=("train",)).ok
    bad = slimgrad.convert_(copy.deepcopy(model))
    with torch.no_grad():
        bad.n.weight.mul_(1.05)
    assert not slimgrad.verify(model, bad, x, modes=("train",)).ok


def test_the_first_mode_failing_is_verifys_error_too():
    # the same failure in the first mode came out raw, unlike one mode later
    model = _TrainOnly(fail_in="train")
    conv = slimgrad.convert_(copy.deepcopy(model))
    with pytest.raises(RuntimeError) as info:
        slimgrad.verify(model, conv, torch.randn(4, 6))
    msg = str(info.value)
    assert msg.startswith("slimgrad.verify: the original model (_TrainOnly) cannot run a step"), msg
    assert "in train mode" in msg and "ValueError: no cache here" in msg, msg
    assert isinstance(info.value.__cause__, ValueError)
    assert slimgrad.verify(model, conv, torch.randn(4, 6), modes=("eval",)).ok


class _MisconfiguredNorm(nn.Module):
    # HF EfficientNet with a misconfigured width: a BatchNorm sized for other channels
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(32)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


@pytest.mark.parametrize("modes", [("train", "eval"), ("eval",)])
def test_an_original_that_cannot_run_its_first_step_is_verifys_error(modes):
    torch.manual_seed(0)
    model = _MisconfiguredNorm()
    conv = slimgrad.convert_(copy.deepcopy(model))
    with pytest.raises(RuntimeError) as info:
        slimgrad.verify(model, conv, torch.randn(2, 3, 5, 5), modes=modes)
    msg = str(info.value)
    assert msg.startswith("slimgrad.verify: the original model (_MisconfiguredNorm)"), msg
    assert f"in {modes[0]} mode" in msg and "RuntimeError: running_mean should contain" in msg, msg
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "slimgrad.verify" not in str(info.value.__cause__)
    assert model.training and conv.training  # the modes put back


def _tiny_recurrent_gemma():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.RecurrentGemmaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=99,
        head_dim=8,
        lru_width=32,
        attention_window_size=8,
        block_types=["recurrent", "recurrent"],  # a cache of linear-attention layers only
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.gradient_checkpointing_enable()
    return model


def test_hf_recurrent_gemma_checkpointed_eval_names_the_way_out():
    model = _tiny_recurrent_gemma()
    ids = torch.randint(3, 99, (2, 8), generator=torch.Generator().manual_seed(3))
    inputs = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    model.eval()
    with pytest.raises(ValueError, match="get_seq_length"):  # the original itself, unconverted
        model(**inputs)
    model.train()
    conv = slimgrad.convert_(copy.deepcopy(model))
    with pytest.raises(RuntimeError, match=r"RecurrentGemmaForCausalLM\) cannot run a step"):
        slimgrad.verify(model, conv, inputs, padded=False)
    rep = slimgrad.verify(model, conv, {**inputs, "use_cache": False}, padded=False)
    assert rep.ok, str(rep)
