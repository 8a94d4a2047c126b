"""Per-step peak memory for training loops (``slimgrad.integrations``).

# NOTE [Step peaks in a training loop]
A framework's callbacks see the start and the end of each optimizer step, not the function that
runs it, so :func:`slimgrad.memory.measure` (which calls the step) cannot be used there. A
:class:`StepPeaks` is started and stopped around the step instead:

- on CUDA it reads the caching allocator: ``torch.cuda.reset_peak_memory_stats`` at the start,
  ``max_memory_allocated`` at the end; the figure is the peak of allocated bytes above what was
  allocated when the step started (the allocator counts every tensor on the device, the model's
  included), at no cost per op.
- elsewhere (CPU) it runs slimgrad's exact tracker (the ``TorchDispatchMode`` behind
  ``slimgrad.memory.measure``) from start to stop: the peak of bytes created in the step above the
  bytes live at its start, as ``measure(...).peak_bytes`` counts them (a storage ``resize_`` inside
  the step, as FSDP does, is not followed). The tracker costs Python time on every op, so it runs
  only on every ``every``-th step.

Started and stopped on the same thread, with nothing entered between them left open (the tracker
is a dispatch mode: modes nest).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StepPeaks"]


class StepPeaks:
    """Records the peak memory of steps: ``start(step, device)`` before, ``stop()`` after.

    Args:
        every: measure steps ``0, every, 2*every, ...`` (step numbers as the caller counts them);
            1 measures all. On CUDA measuring costs nothing per op; on CPU the exact tracker runs
            for the measured steps (NOTE [Step peaks in a training loop]).

    Attributes:
        peaks: ``{step: peak bytes above the step's start}`` of the measured steps.
        how: ``{step: "cuda allocator" | "slimgrad tracker"}``.

    Example:
        >>> rec = StepPeaks()
        >>> lin = torch.nn.Linear(8, 8)
        >>> rec.start(0, torch.device("cpu"))
        >>> lin(torch.randn(4, 8)).sum().backward()
        >>> rec.stop()
        >>> rec.peaks[0] > 0
        True
    """

    def __init__(self, every: int = 1) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(
                "slimgrad.integrations.StepPeaks: every must be a positive int; expected >= 1, "
                f"got {every!r}. Pass every=1 to measure each step."
            )
        self.every = every
        self.peaks: dict[int, int] = {}
        self.how: dict[int, str] = {}
        self._open: tuple[int, Any, Any] | None = None  # (step, device, tracker or base bytes)

    def start(self, step: int, device: torch.device | str) -> None:
        """Begin measuring ``step`` on ``device`` (a no-op for steps not measured)."""
        if self._open is not None:
            raise RuntimeError(
                "slimgrad.integrations.StepPeaks.start: a step is already being measured; "
                f"expected stop() after step {self._open[0]}, got start({step}). Call stop() at "
                "the end of each step."
            )
        if step % self.every:
            return
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            self._open = (step, device, base)
            return
        from slimgrad.memory import _Tracker

        tracker = _Tracker()
        tracker.__enter__()
        self._open = (step, device, tracker)

    def stop(self) -> int | None:
        """End the step begun by :meth:`start`; returns its peak in bytes (None: not measured)."""
        if self._open is None:
            return None
        step, device, state = self._open
        self._open = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - state
            self.how[step] = "cuda allocator"
        else:
            try:
                state.settle()
                peak = state.peak
            finally:
                state.__exit__(None, None, None)
                state.close()
            self.how[step] = "slimgrad tracker"
        self.peaks[step] = int(peak)
        return int(peak)

    @property
    def measuring(self) -> bool:
        """Whether a step is being measured now."""
        return self._open is not None
