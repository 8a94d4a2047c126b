"""slimgrad.integrations: StepPeaks, the HF Trainer callback (Lightning's, when installed)."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

import slimgrad
from slimgrad import memory
from slimgrad.integrations import StepPeaks
from tests._examples import run_example


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))


def test_import_loads_no_framework():
    code = (
        "import sys, slimgrad.integrations as I; "
        "print('transformers' in sys.modules, 'lightning' in sys.modules, I.StepPeaks.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "StepPeaks"]


def test_step_peaks_equal_measure():
    x = torch.randn(32, 16)
    for convert in (False, True):
        m = _mlp()
        if convert:
            slimgrad.convert_(m)
        m(x).sum().backward()  # warm-up: lazy caches out of the measured steps
        m.zero_grad(set_to_none=True)
        want = memory.measure(lambda m=m: m(x).sum(), timeline=False).peak_bytes
        m.zero_grad(set_to_none=True)
        rec = StepPeaks()
        rec.start(0, "cpu")
        m(x).sum().backward()
        assert rec.stop() == want == rec.peaks[0]
        assert rec.how[0] == "slimgrad tracker"
        m.zero_grad(set_to_none=True)


def test_step_peaks_every_and_misuse():
    rec = StepPeaks(every=2)
    for step in range(4):
        rec.start(step, "cpu")
        torch.randn(100).sum()
        rec.stop()
    assert sorted(rec.peaks) == [0, 2] and rec.peaks[0] >= 400
    rec.start(0, "cpu")
    with pytest.raises(RuntimeError, match="already being measured"):
        rec.start(1, "cpu")
    rec.stop()
    assert rec.stop() is None
    with pytest.raises(ValueError, match="positive int"):
        StepPeaks(every=0)


def _trainer(model, cb, steps=3):
    from transformers import Trainer, TrainingArguments

    ids = torch.randint(0, 97, (8, 16), generator=torch.Generator().manual_seed(1))
    ds = [{"input_ids": ids[i], "labels": ids[i]} for i in range(8)]
    args = TrainingArguments(
        output_dir="/tmp/slimgrad-test-trainer", per_device_train_batch_size=4, max_steps=steps,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
        disable_tqdm=True,
    )  # fmt: skip
    return Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])


def test_hf_trainer_callback_converts_same_losses_lower_peak():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from slimgrad.integrations import SlimgradCallback

    cfg = LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=97, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg)
    runs = {}
    for convert in (False, True):
        cb = SlimgradCallback(convert=convert)
        tr = _trainer(copy.deepcopy(base), cb)
        if convert:
            assert cb.report is not None and cb.report.converted
            assert type(tr.model.model.layers[0].mlp).__module__.startswith("slimgrad.")
        else:
            with pytest.raises(RuntimeError, match="not converted"):
                slimgrad.report(tr.model)
        tr.train()
        losses = [h["loss"] for h in tr.state.log_history if "loss" in h]
        peaks = [h["slimgrad_peak_mib"] for h in tr.state.log_history if "loss" in h]
        assert len(losses) == len(peaks) == 3
        assert sorted(cb.peaks.peaks) == [0, 1, 2]
        runs[convert] = losses, cb.peaks.peaks
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-5, atol=1e-6)
    # steady steps (the first also creates the optimizer's state)
    assert runs[True][1][2] < runs[False][1][2]


def test_hf_trainer_callback_keeps_a_converted_model():
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    from slimgrad.integrations import SlimgradCallback

    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=97, n_positions=32)
    m = slimgrad.convert_(GPT2LMHeadModel(cfg))
    rep = slimgrad.report(m)
    cb = SlimgradCallback(peak_every=0)
    _trainer(m, cb, steps=1).train()
    assert cb.report is rep  # not converted twice
    assert cb.peaks.peaks == {}
    with pytest.raises(ValueError, match="peak_every"):
        SlimgradCallback(peak_every=-1)


def test_lightning_callback_converts_same_weights_lower_peak(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")

    from slimgrad.integrations import SlimgradLightningCallback

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(16, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
                torch.nn.Linear(256, 4),
            )  # fmt: skip

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(2)
    ds = torch.utils.data.TensorDataset(
        torch.randn(192, 16, generator=g), torch.randint(0, 4, (192,), generator=g)
    )
    out = {}
    for convert in (False, True):
        cb = SlimgradLightningCallback(convert=convert)
        model = Net()
        trainer = pl.Trainer(
            max_steps=3, callbacks=[cb], accelerator="cpu", logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=str(tmp_path),
        )  # fmt: skip
        trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(ds, batch_size=64))
        assert (cb.report is not None) == convert
        assert sorted(cb.peaks.peaks) == [0, 1, 2]
        out[convert] = [p.detach().clone() for p in model.parameters()], cb.peaks.peaks
        if convert:
            assert type(model.net[1]).__module__.startswith("slimgrad.")
    for a, b in zip(out[True][0], out[False][0], strict=True):
        torch.testing.assert_close(a, b)
    assert out[True][1][2] < out[False][1][2]


def test_lightning_callback_example():
    pytest.importorskip("lightning.pytorch")
    out = run_example("lightning_callback.py", "--steps", "2")
    assert "lightning: 2 steps, parameters within the error rule against float64" in out


def test_step_in_backward_loop_example():
    pytest.importorskip("transformers")
    out = run_example("step_in_backward_loop.py", "--steps", "2")
    assert out.count("parameters bit-identical") == 2
    assert "step_in_backward: 2 steps bit-identical to the plain loop; step peak" in out
