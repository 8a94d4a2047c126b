"""One intra-op thread for a test or module, the count restored after (shared by the fixtures of
the tiny-model test files: thread start-up and OpenMP spin-waits, not arithmetic, dominate there,
and some rule bounds were found with one thread)."""

from __future__ import annotations

import contextlib

import pytest
import torch


@contextlib.contextmanager
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def one_thread_each_test():
    """One intra-op thread for every test of a module that imports this fixture."""
    with one_thread():
        yield
