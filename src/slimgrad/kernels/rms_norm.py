"""Triton kernels for RMSNorm from the output (the LayerNorm kernels with no mean and no beta).

Same signatures as ``slimgrad._math.norms.rms_norm_fwd_torch`` / ``rms_norm_bwd_torch`` (the op's
``_fwd_torch`` / ``_bwd_torch``); kernels and their description in ``kernels/layer_norm.py``.
``eps=None`` means ``torch.finfo(x.dtype).eps``, as ``F.rms_norm``. Memory: as
``slimgrad.ops.rms_norm`` (saves y + rstd + fallback columns).
"""

from __future__ import annotations

import torch

from slimgrad._math import norms as _ref
from slimgrad.kernels.layer_norm import norm_bwd, norm_fwd, side_columns


def _fwd_triton(x, normalized_shape, weight, eps):
    """``_math.norms.rms_norm_fwd_torch`` with rstd and the output in one kernel."""
    e = torch.finfo(x.dtype).eps if eps is None else eps
    out = norm_fwd(x, list(normalized_shape), weight, None, e, rms=True)
    if out is None:
        return _ref.rms_norm_fwd_torch(x, normalized_shape, weight, eps)
    y, _, rstd = out
    idx, xside = side_columns(x, normalized_shape, weight, None, y.dtype)
    return y, rstd, idx, xside


def _bwd_triton(dy, y, rstd, idx, xside, weight, normalized_shape, output_mask, out=None):
    """``_math.norms.rms_norm_bwd_torch`` in one pass over y and dy (``out``: dx's buffer, e.g.
    dy's own when ``slimgrad.ownership`` grants it)."""
    mask = (output_mask[0], output_mask[1], False)
    ns = list(normalized_shape)
    res = norm_bwd(dy, y, None, rstd, idx, xside, weight, None, ns, mask, True, out=out)
    if res is None:
        return _ref.rms_norm_bwd_torch(dy, y, rstd, idx, xside, weight, ns, output_mask, out=out)
    if out is not None and output_mask[0]:
        torch.autograd.graph.increment_version(out)  # a raw write: autograd must see it
    return res[0], res[1]
