"""``SlimgradCallback``: slimgrad inside ``transformers.Trainer`` with one argument.

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[SlimgradCallback()])

At ``on_init_end`` (the Trainer is built, no optimizer exists yet) the model is converted in
place with ``slimgrad.convert_`` unless it already was (``slimgrad.report`` finds a report, through
PEFT wrappers too); converted modules share the original Parameters, so an optimizer the Trainer
was given is still right. ``args.gradient_checkpointing`` is applied by the Trainer afterwards, on
the converted model, as it would be on the original.

Each optimizer step's peak memory is recorded (:class:`slimgrad.integrations.StepPeaks`, NOTE
[Step peaks in a training loop]) and written into the log entry of every logging step as
``slimgrad_peak_mib`` (the highest peak since the previous log) in ``trainer.state.log_history``
(which the Trainer saves in ``trainer_state.json``). Reporting integrations (TensorBoard, W&B)
receive the log before this callback sees it; read ``callback.peaks`` or the log history.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback

from slimgrad.integrations._peaks import StepPeaks

__all__ = ["SlimgradCallback"]


def _converted(model: torch.nn.Module) -> bool:
    import slimgrad

    try:
        slimgrad.report(model)
    except RuntimeError:
        return False
    return True


class SlimgradCallback(TrainerCallback):
    """A ``TrainerCallback`` that converts the model and records per-step peaks.

    Args:
        config: the ``slimgrad.ConvertConfig`` for ``convert_`` (None: the defaults).
        convert: convert the Trainer's model at ``on_init_end`` (False: only record peaks).
        peak_every: measure the peak of every ``peak_every``-th optimizer step; 0 turns it off.
            On CUDA it costs nothing per op; on CPU slimgrad's tracker runs for those steps.

    Attributes:
        peaks: :class:`~slimgrad.integrations.StepPeaks` (``peaks.peaks``: step -> bytes).
        report: the ``ConvertReport`` of the conversion (None until converted).
    """

    def __init__(self, config: Any = None, *, convert: bool = True, peak_every: int = 1) -> None:
        if not isinstance(peak_every, int) or isinstance(peak_every, bool) or peak_every < 0:
            raise ValueError(
                "slimgrad.integrations.SlimgradCallback: peak_every must be an int >= 0; expected "
                f"e.g. 1 (every step) or 0 (off), got {peak_every!r}. Pass peak_every=1."
            )
        self.config = config
        self.convert = convert
        self.peaks = StepPeaks(every=max(peak_every, 1))
        self._measure = peak_every > 0
        self._logged_upto = -1
        self.report = None

    def on_init_end(self, args, state, control, model=None, **kwargs):
        if not self.convert or model is None:
            return
        import slimgrad

        if not _converted(model):
            slimgrad.convert_(model, self.config)
        self.report = slimgrad.report(model)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self._measure and model is not None and not self.peaks.measuring:
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
            self.peaks.start(state.global_step, device)

    def on_step_end(self, args, state, control, **kwargs):
        self.peaks.stop()

    def on_log(self, args, state, control, logs=None, **kwargs):
        new = [b for s, b in self.peaks.peaks.items() if s > self._logged_upto]
        if not new or not state.log_history:
            return
        self._logged_upto = max(self.peaks.peaks)
        state.log_history[-1]["slimgrad_peak_mib"] = round(max(new) / 2**20, 3)

    def on_train_end(self, args, state, control, **kwargs):
        self.peaks.stop()  # a step cut short (max_steps reached inside accumulation)
