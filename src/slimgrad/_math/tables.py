"""Data-dependent side tables under fake tensors and torch.compile.

# NOTE [Side tables under FakeTensorMode and torch.compile]
Several slimgrad ops keep a *side table* whose length depends on values: the fallback channels of
the norms (NOTE [Normalization from its output: the fallback channels] in ``ops/layer_norm.py``),
the exact-input tables of the output-based activations. Tracers see no values, so such a table is
built inside a ``slimgrad::<name>`` custom op (``slimgrad._library.custom_op``: the memory tracker
still runs its Python implementation) whose fake kernel sizes the table with
:func:`dynamic_size`. The eager path is unchanged, bit for bit: the custom op is only the boundary
tracers see.

:func:`dynamic_size` answers, from inside a ``register_fake`` kernel:

- under a tracer with a ``ShapeEnv`` (torch.compile's Dynamo and AOTAutograd, ``torch.export``, a
  ``FakeTensorMode(shape_env=ShapeEnv())``): a new *unbacked* SymInt, as
  ``torch.library.get_ctx().new_dynamic_size()`` gives. ``new_dynamic_size`` itself refuses (with
  ``DynamicOutputShapeException``) unless the ShapeEnv allows dynamic output shapes, and Dynamo's
  ShapeEnv allows them only with ``fullgraph=True`` or
  ``torch._dynamo.config.capture_dynamic_output_shape_ops``: every slimgrad op with a table then
  became a graph break in a default ``torch.compile`` (7 in a converted GPT-2, whose eager model
  breaks once). That flag exists because a *backend* may not handle tensors of data-dependent size
  (``nonzero`` feeding the user's ops). A slimgrad table never reaches the user's code: it flows
  only from a slimgrad custom op into the same op family's backward custom op (opaque kernels for
  every backend), so the size is allocated on the ShapeEnv directly, whatever the flag. This is
  what ``fullgraph=True`` already does for the same ops (tested: ``aot_eager`` and ``inductor``
  give eager's bits for the table's contents);
- under a ``FakeTensorMode`` without a ShapeEnv (an independent memory or FLOP tracker, and
  ``slimgrad.memory.estimate``) no symbolic size exists: ``otherwise`` (default 0), the usual case
  (no fallback channel, no hard element), as ``slimgrad.memory.estimate`` has always assumed for
  weights without values.

:func:`index_table` is the reusable table op: ``slimgrad::index_table(mask) -> flat indices``
(eager: ``mask.reshape(-1).nonzero()``), and :func:`select_table` gives the indices and the
selected values in one op.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from slimgrad._library import custom_op

__all__ = ["dynamic_size", "index_table", "select_table", "unsized"]


def _shape_env():
    return torch.library.get_ctx()._fake_mode.shape_env


def dynamic_size(*, max: int | None = None, otherwise: int = 0):
    """In a ``register_fake`` kernel: the length of a data-dependent side table.

    See NOTE [Side tables under FakeTensorMode and torch.compile].

    Args:
        max: a static inclusive upper bound (e.g. the number of candidate elements), or None.
        otherwise: the length to assume when the tracer has no ShapeEnv (no symbolic sizes).

    Returns:
        An unbacked ``torch.SymInt`` in ``[0, max]``, or ``otherwise``.
    """
    from torch._library.fake_impl import allocate_size

    env = _shape_env()
    if env is None:
        return otherwise if max is None else min(otherwise, max)
    return allocate_size(env, 0, max)


def unsized(t: torch.Tensor) -> bool:
    """True for a fake tensor whose tracer cannot size tables (a FakeTensorMode without a
    ShapeEnv): a Python implementation run on it (``slimgrad.memory``'s tracker) must not call
    ``nonzero``/``masked_select`` and assumes an empty table, as the fake kernels do."""
    return is_fake(t) and t.fake_mode.shape_env is None


def _flat_indices(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if unsized(mask):
        return mask.new_empty(0, dtype=dtype)
    return mask.reshape(-1).nonzero().view(-1).to(dtype)


@custom_op("index_table", mutates_args=())
def _index_table(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _flat_indices(mask, dtype)


@_index_table.register_fake
def _(mask, dtype):
    return mask.new_empty(dynamic_size(max=mask.numel()), dtype=dtype)


@custom_op("select_table", mutates_args=())
def _select_table(
    x: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    idx = _flat_indices(mask, dtype)
    if unsized(mask):
        return idx, x.new_empty(0)
    return idx, torch.masked_select(x, mask)


@_select_table.register_fake
def _(x, mask, dtype):
    k = dynamic_size(max=mask.numel())
    return mask.new_empty(k, dtype=dtype), x.new_empty(k)


def index_table(mask: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Flat (row-major, logical) indices of ``mask``'s True elements, as ``dtype``.

    Eager: ``mask.reshape(-1).nonzero().view(-1).to(dtype)``; traceable by any tracker (NOTE [Side
    tables under FakeTensorMode and torch.compile]).
    """
    return _index_table(mask, dtype)


def select_table(
    x: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype = torch.int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index_table(mask, dtype), torch.masked_select(x, mask))`` in one traceable op (``mask``
    has x's shape)."""
    return _select_table(x, mask, dtype)
