"""The check shared by the tests of convert_'s reading of a model's structure
(tests/test_convert_one_reading.py, tests/test_convert_child_reads.py): the flags the reading sets
on the converted model are the ones a fresh reading of it sets."""

from __future__ import annotations

import collections

from torch import nn

import slimgrad
from slimgrad.convert_handlers import inplace_guard as _guard
from slimgrad.nn import _output_act

FLAGS = ("keep_y", "at_output", "handed_out", "y_kept_after")


def flags(model: nn.Module) -> list:
    return [
        (n, {k: m.__dict__[k] for k in FLAGS if k in m.__dict__})
        for n, m in model.named_modules(remove_duplicate=False)
    ]


def convert_and_read_afresh(model: nn.Module):
    """``convert_(model)``, then the converted model read afresh (``state_consumers_`` without
    the traces): the same flags and the same eager-op rows as the reading convert_ made. Returns
    the report."""
    slimgrad.convert_(model)
    return read_afresh(model)


def read_afresh(model: nn.Module):
    """The check of :func:`convert_and_read_afresh` on a model ``convert_`` already converted."""
    rep = slimgrad.report(model)
    mapped, eager_op = flags(model), list(rep.eager_op)
    _output_act.state_consumers_(model, rep)  # the converted model read afresh (no traces)
    assert flags(model) == mapped
    assert rep.eager_op == eager_op
    return rep


def count_traces(monkeypatch) -> collections.Counter:
    """The guard's traces, counted by ``id`` of the module traced, for the test."""
    seen = collections.Counter()
    trace = _guard._trace

    def counting(m, *state):
        seen[id(m)] += 1
        return trace(m, *state)

    monkeypatch.setattr(_guard, "_trace", counting)
    return seen
