"""``slimgrad.memory.measure(workspace=...)``: intra-op workspace from an allocator's counters
(NOTE [Intra-op workspace]), on CPU with an injected stand-in for CUDA's caching allocator."""

from __future__ import annotations

import pytest
import torch

from slimgrad.memory import measure

N_OUT = 64 * 4  # the op's output: 64 float32
WORKSPACE = 1_000_000  # the op's scratch, far above everything else in the step


class FakeAllocator:
    """Requested-bytes counters as the CUDA caching allocator keeps them."""

    def __init__(self) -> None:
        self.cur = 5_000  # bytes live before the step (parameters, inputs)
        self.top = self.cur
        self.resets = 0

    def alloc(self, n: int) -> None:
        self.cur += n
        self.top = max(self.top, self.cur)

    def free(self, n: int) -> None:
        self.cur -= n

    def current(self) -> int:
        return self.cur

    def peak(self) -> int:
        return self.top

    def reset_peak(self) -> None:
        self.resets += 1
        self.top = self.cur


ALLOC = FakeAllocator()


@torch.library.custom_op("sgtest_ws::scratch_double", mutates_args=())
def scratch_double(x: torch.Tensor) -> torch.Tensor:
    # like a cuDNN convolution: the output, and a workspace taken and given back inside the op
    ALLOC.alloc(x.numel() * x.element_size())
    ALLOC.alloc(WORKSPACE)
    y = x * 2
    ALLOC.free(WORKSPACE)
    return y


@scratch_double.register_fake
def _(x):
    return torch.empty_like(x)


def _step():
    x = torch.randn(64)
    w = torch.randn(64, requires_grad=True)
    return lambda: (scratch_double(x) * w).sum()


def test_workspace_is_attributed_to_its_op_and_leaves_the_exact_figures_unchanged():
    torch.manual_seed(0)
    plain = measure(_step(), timeline=True)
    torch.manual_seed(0)
    ALLOC.resets = 0
    m = measure(_step(), timeline=True, workspace=ALLOC)
    assert ALLOC.resets == m.n_ops  # one reading per op the tracker saw
    assert m.workspace_bytes == {"sgtest_ws.scratch_double": WORKSPACE}
    # the op's output is live (N_OUT) when the workspace is taken on top of it
    assert m.peak_with_workspace_bytes == N_OUT + WORKSPACE
    assert m.peak_with_workspace_op == "sgtest_ws.scratch_double"
    new = ("workspace_bytes", "peak_with_workspace_bytes", "peak_with_workspace_op")
    same = {k: v for k, v in m.to_dict(timeline=True).items() if k not in new}
    assert same == {k: v for k, v in plain.to_dict(timeline=True).items() if k not in new}
    assert plain.workspace_bytes == {} and plain.peak_with_workspace_bytes is None


def test_no_workspace_gives_the_tracker_peak():
    def step():
        w = torch.randn(64, requires_grad=True)
        return lambda: (w * 3).relu().sum()

    quiet = FakeAllocator()  # an allocator that saw nothing beyond the ops' own tensors
    m = measure(step(), workspace=quiet)
    assert m.workspace_bytes == {} and m.peak_with_workspace_bytes == m.peak_bytes
    assert m.peak_with_workspace_op == m.peak_op


def test_bad_workspace_argument():
    with pytest.raises(TypeError, match=r"slimgrad\.memory\.measure: workspace must be"):
        measure(lambda: torch.ones(1, requires_grad=True).sum(), workspace=object())


def test_an_op_run_as_its_python_implementation_leaves_the_reading_to_its_inner_ops():
    from slimgrad._library import custom_op

    @custom_op("_test_workspace_outer")
    def outer(x: torch.Tensor) -> torch.Tensor:
        return scratch_double(scratch_double(x))

    @outer.register_fake
    def _(x):
        return torch.empty_like(x)

    def step():
        x = torch.randn(64)
        w = torch.randn(64, requires_grad=True)
        return lambda: (outer(x) * w).sum()

    m = measure(step(), workspace=ALLOC)
    # the outer op's own reading (reset by its inner ops) is not taken: its inner ops' are
    assert m.workspace_bytes == {"sgtest_ws.scratch_double": WORKSPACE}
    # the second inner call: its input (the first's output) and its output are live
    assert m.peak_with_workspace_bytes == 2 * N_OUT + WORKSPACE


def test_cuda_allocator_stats_reads_the_requested_bytes_counters(monkeypatch):
    # CUDA's counters, faked: the plumbing of CudaAllocatorStats without a GPU
    from slimgrad.memory import CudaAllocatorStats

    seen = []
    stats = {"requested_bytes": {"all": {"current": 7, "peak": 11}}}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(
        torch.cuda, "memory_stats_as_nested_dict", lambda i: seen.append(("stats", i)) or stats
    )
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda i: seen.append(("reset", i)))
    s = CudaAllocatorStats()
    assert (s.current(), s.peak()) == (7, 11)
    s.reset_peak()
    assert seen == [("stats", 3), ("stats", 3), ("reset", 3)]
    assert CudaAllocatorStats("cuda:1")._index == 1
