"""Dropout's noise scale, shared by ``ops/dropout.py`` and ``kernels/dropout.py`` (below both:
NOTE [Kernels are leaves] in ``slimgrad._math``)."""

from __future__ import annotations

import torch

_SCALES: dict[tuple, float] = {}


def noise_scale(p: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """1 / (1 - p) rounded to ``dtype`` exactly as eager's ``noise.div_(1 - p)`` rounds it."""
    return torch.ones((), dtype=dtype, device=device).div_(1 - p)


def noise_scale_value(p: float, dtype: torch.dtype, device: torch.device) -> float:
    """:func:`noise_scale`'s value as a Python float, computed once per (p, dtype, device) and
    kept: the same bits without a tensor op and an ``.item()`` (a host sync on CUDA: NOTE [Host
    syncs] in slimgrad.testing) per call; a few p values per model, so the table stays small."""
    key = (p, dtype, device)
    s = _SCALES.get(key)
    if s is None:
        if len(_SCALES) > 256:
            _SCALES.clear()
        s = _SCALES[key] = noise_scale(p, dtype, device).item()
    return s
