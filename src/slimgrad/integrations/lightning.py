"""``SlimgradLightningCallback``: slimgrad inside a Lightning ``Trainer``.

    trainer = lightning.pytorch.Trainer(callbacks=[SlimgradLightningCallback()], ...)

At ``setup`` (before the strategy calls ``configure_optimizers`` and moves or wraps the module) the
LightningModule is converted in place with ``slimgrad.convert_`` unless it already was; converted
modules share the original Parameters. Each training batch's peak memory (forward, backward and
the optimizer step: ``on_train_batch_start`` to ``on_train_batch_end``) is recorded with
:class:`slimgrad.integrations.StepPeaks` (NOTE [Step peaks in a training loop]) and logged through
``pl_module.log("slimgrad_peak_mib", ...)`` when logging is possible.

Works with ``lightning.pytorch`` (Lightning 2.x) and with the older ``pytorch_lightning`` package:
whichever is installed (``lightning`` first).
"""

from __future__ import annotations

from typing import Any

import torch

from slimgrad.integrations._peaks import StepPeaks

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package
    from pytorch_lightning import Callback

__all__ = ["SlimgradLightningCallback"]


class SlimgradLightningCallback(Callback):
    """A Lightning ``Callback`` that converts the LightningModule and records per-batch peaks.

    Args:
        config: the ``slimgrad.ConvertConfig`` for ``convert_`` (None: the defaults).
        convert: convert at ``setup`` (False: only record peaks).
        peak_every: measure every ``peak_every``-th training batch; 0 turns it off.

    Attributes:
        peaks: :class:`~slimgrad.integrations.StepPeaks` (``peaks.peaks``: global step -> bytes).
        report: the ``ConvertReport`` of the conversion (None until converted).
    """

    def __init__(self, config: Any = None, *, convert: bool = True, peak_every: int = 1) -> None:
        if not isinstance(peak_every, int) or isinstance(peak_every, bool) or peak_every < 0:
            raise ValueError(
                "slimgrad.integrations.SlimgradLightningCallback: peak_every must be an int >= 0; "
                f"expected e.g. 1 (every batch) or 0 (off), got {peak_every!r}. Pass "
                "peak_every=1."
            )
        self.config = config
        self.convert = convert
        self.peaks = StepPeaks(every=max(peak_every, 1))
        self._measure = peak_every > 0
        self.report = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not self.convert or stage != "fit":
            return
        import slimgrad

        try:
            self.report = slimgrad.report(pl_module)
        except RuntimeError:
            slimgrad.convert_(pl_module, self.config)
            self.report = slimgrad.report(pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._measure and not self.peaks.measuring:
            device = next((p.device for p in pl_module.parameters()), torch.device("cpu"))
            self.peaks.start(trainer.global_step, device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        peak = self.peaks.stop()
        if peak is not None and trainer.logger is not None:
            pl_module.log("slimgrad_peak_mib", peak / 2**20, on_step=True, on_epoch=False)

    def on_train_end(self, trainer, pl_module) -> None:
        self.peaks.stop()
