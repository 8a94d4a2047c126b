"""Lightning with ``slimgrad.integrations.SlimgradLightningCallback``: converted at ``setup``.

Trains a small LightningModule (Linear-GELU-LayerNorm-Linear, cross-entropy, SGD) for a few steps
three times from the same weights and batches: eager float32, with the callback (the module is
converted before ``configure_optimizers``) and eager float64 as the reference. Asserts the final
parameters of the converted run are within the error rule against float64
(``|slimgrad - ref64| <= 2 |eager - ref64| + atol``), and prints the per-step peaks the callback
recorded beside eager's.

Run: ``python examples/lightning_callback.py [--steps 3]`` (needs ``lightning``; ``make
test-integrations`` installs it beside the dev venv).
"""

from __future__ import annotations

import argparse
import tempfile

import lightning.pytorch as pl
import torch

from slimgrad.integrations import SlimgradLightningCallback
from slimgrad.testing import assert_within_rule


class Net(pl.LightningModule):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
            torch.nn.Linear(256, 4),
        ).to(dtype)  # fmt: skip

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x.to(self.net[0].weight.dtype)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def train(dtype: torch.dtype, convert: bool, steps: int, root: str):
    g = torch.Generator().manual_seed(2)
    data = torch.utils.data.TensorDataset(
        torch.randn(64 * steps, 16, generator=g), torch.randint(0, 4, (64 * steps,), generator=g)
    )
    cb = SlimgradLightningCallback(convert=convert)
    model = Net(dtype)
    trainer = pl.Trainer(
        max_steps=steps, callbacks=[cb], accelerator="cpu", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=64))
    if convert:
        assert cb.report is not None and type(model.net[1]).__module__.startswith("slimgrad.")
    return [p.detach().clone() for p in model.parameters()], cb.peaks.peaks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    steps = p.parse_args().steps
    with tempfile.TemporaryDirectory() as root:
        eager, eager_peaks = train(torch.float32, False, steps, root)
        slim, slim_peaks = train(torch.float32, True, steps, root)
        ref, _ = train(torch.float64, False, steps, root)
    assert_within_rule(slim, ref, eager)
    for step in sorted(slim_peaks):
        print(f"step {step}: peak {slim_peaks[step] / 2**10:.1f} KiB (eager "
              f"{eager_peaks[step] / 2**10:.1f} KiB)")  # fmt: skip
    print(f"lightning: {steps} steps, parameters within the error rule against float64")


if __name__ == "__main__":
    main()
