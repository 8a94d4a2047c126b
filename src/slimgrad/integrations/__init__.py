"""One line of glue for the training frameworks people use with slimgrad.

- :class:`SlimgradCallback` (``slimgrad.integrations.hf``): a ``transformers.TrainerCallback`` that
  converts the Trainer's model when the Trainer is built (``convert_``, unless it already is) and
  records each optimizer step's peak memory (:class:`StepPeaks`), into ``trainer.state.log_history``
  at each logging step as ``slimgrad_peak_mib``.
- :class:`SlimgradLightningCallback` (``slimgrad.integrations.lightning``): a Lightning ``Callback``
  that converts the LightningModule at ``setup`` (before ``configure_optimizers``), with the same
  peak records.
- :class:`StepPeaks`: the per-step peak recorder both use; usable in a plain loop.

Importing ``slimgrad.integrations`` imports neither transformers nor lightning: each class is
loaded on first access.
"""

from __future__ import annotations

import importlib

from slimgrad.integrations._peaks import StepPeaks

__all__ = ["SlimgradCallback", "SlimgradLightningCallback", "StepPeaks"]

_LAZY = {
    "SlimgradCallback": "slimgrad.integrations.hf",
    "SlimgradLightningCallback": "slimgrad.integrations.lightning",
}


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)
