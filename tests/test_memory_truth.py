"""slimgrad.memory against the allocator of a real run (no dispatch mode): gradient sums.

Ground truth: ``torch.profiler`` with ``profile_memory=True`` records every CPU allocation and free
(bytes, in order) without holding tensors and without a dispatch mode, so autograd's engine runs
as in training. The live bytes are read at the end of each top-level aten op, where the tracker
reads them too (a kernel's internal scratch, freed before it returns, is no tensor the step keeps).
Model, inputs and a warm-up step are made inside the profiled region, so every free is seen.

The cases: gradients meeting at one tensor, which the engine sums in place (``old.add_(new)``)
when its buffer holds the last reference to the first one, else out of place; and
AccumulateGrad's rules for ``.grad``. NOTE [How live bytes are counted] in slimgrad/memory.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

import slimgrad.memory as memory
from slimgrad.memory import estimate, measure

_MARK = "__slimgrad_truth_step__"


def _real(setup, step):
    """(peak, end) bytes of ``step(setup())`` in a real run, above the bytes live at its start."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        state = setup()
        with record_function(_MARK):
            step(state)
        del state
    mem, tops, marks = [], [], []

    def walk(node, in_op):
        if node.name == "[memory]":
            mem.append((node.start_time_ns, node.extra_fields.alloc_size))
            return
        is_op = node.name.startswith("aten::")
        if node.name == _MARK:
            marks.append(node)
        if is_op and not in_op:
            tops.append(node.end_time_ns)
        for child in node.children:
            walk(child, in_op or is_op)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, False)
    (mark,) = marks
    mem.sort()

    def live(t):
        return sum(n for when, n in mem if when <= t)

    base = live(mark.start_time_ns - 1)
    ends = [t for t in tops if mark.start_time_ns <= t <= mark.end_time_ns]
    return max(live(t) - base for t in ends), live(mark.end_time_ns) - base


def _no_in_place_sums(monkeypatch):
    # the tracker as it was: every gradient sum counted out of place
    monkeypatch.setattr(memory._Tracker, "_engine_sum", lambda *a, **k: None)


def _check(setup, forward, monkeypatch, *, sum_bytes, slack=0):
    """Tracker vs real run; ``sum_bytes``: what the old tracker over-counts at the peak (0:
    nothing; None: something, up to one gradient, at a sum that is not the new peak)."""
    state = setup()
    forward(state).backward()  # warm-up: one-time caches stay out of the measured step
    real_peak, real_end = _real(setup, lambda s: forward(s).backward())
    state = setup()
    m = measure(lambda: forward(state))
    assert 0 <= real_peak - m.peak_bytes <= slack, (real_peak, m.peak_bytes, m.peak_op)
    assert m.end_bytes == real_end
    with monkeypatch.context() as mp:
        _no_in_place_sums(mp)
        state = setup()
        old = measure(lambda: forward(state))
    if sum_bytes is None:
        assert old.peak_bytes > real_peak, (old.peak_bytes, real_peak)
    else:
        assert old.peak_bytes - m.peak_bytes == sum_bytes, (old.peak_bytes, m.peak_bytes)
    return m


N, D, K = 96, 64, 8


def _leaf_used_twice():
    torch.manual_seed(0)
    x = torch.randn(N, D, requires_grad=True)
    w1, w2 = torch.randn(D, K), torch.randn(D, K)
    return x, w1, w2


def _two_matmuls(s):
    x, w1, w2 = s
    return (x @ w1).sum() + (x @ w2).sum()


def test_leaf_used_by_two_matmuls_sums_in_place(monkeypatch):
    # x's two gradients (N x D each) meet in AccumulateGrad's buffer: a real run adds the second
    # into the first, so the peak holds two of them, not three
    m = _check(_leaf_used_twice, _two_matmuls, monkeypatch, sum_bytes=N * D * 4)
    assert any(op.endswith("(in place)") for _, op, _ in m.timeline)


def test_estimate_sums_in_place_too(monkeypatch):
    state = _leaf_used_twice()
    m = measure(lambda: _two_matmuls(state))
    e = estimate(lambda: (lambda s: lambda: _two_matmuls(s))(_leaf_used_twice()))
    assert (e.peak_bytes, e.end_bytes) == (m.peak_bytes, m.end_bytes)
    with monkeypatch.context() as mp:
        _no_in_place_sums(mp)
        e_old = estimate(lambda: (lambda s: lambda: _two_matmuls(s))(_leaf_used_twice()))
    assert e_old.peak_bytes - e.peak_bytes == N * D * 4


def test_activation_used_twice_sums_in_place(monkeypatch):
    def forward(s):
        x, w1, w2 = s
        h = x.relu()  # h's two gradients meet in ReluBackward's buffer
        return (h @ w1).sum() + (h @ w2).sum()

    _check(_leaf_used_twice, forward, monkeypatch, sum_bytes=N * D * 4)


def test_first_gradient_kept_by_a_node_hook_is_summed_out_of_place(monkeypatch):
    # the later matmul's node runs first; its hook keeps the gradient it sends to x, so the
    # engine does not own the first gradient and the sum allocates
    kept = []

    def forward(s):
        x, w1, w2 = s
        a, b = x @ w1, x @ w2
        b.grad_fn.register_hook(lambda grad_inputs, grad_outputs: kept.append(grad_inputs[0]))
        return a.sum() + b.sum()

    _check(_leaf_used_twice, forward, monkeypatch, sum_bytes=0)
    assert kept


def test_first_gradient_kept_by_a_tensor_hook_is_summed_out_of_place(monkeypatch):
    # the user keeps t's gradient; CloneBackward passes that same tensor on to x's buffer first
    kept = []

    def forward(s):
        x, w1, w2 = s
        a = x @ w1
        t = x.clone()
        t.register_hook(kept.append)
        return a.sum() + (t @ w2).sum()

    _check(_leaf_used_twice, forward, monkeypatch, sum_bytes=0)
    assert kept


def test_expanded_first_gradient_is_summed_out_of_place(monkeypatch):
    # x.sum()'s gradient (stride 0, not dense) arrives first: the engine cannot add into it
    def forward(s):
        x, w1, _ = s
        return (x @ w1).sum() + x.sum()

    _check(_leaf_used_twice, forward, monkeypatch, sum_bytes=0)


def test_view_first_gradient_is_summed_out_of_place(monkeypatch):
    # the first gradient to reach x is TBackward0's transposed view: its base shares the storage
    def setup():
        torch.manual_seed(0)
        return torch.randn(D, N, requires_grad=True), torch.randn(D, K), torch.randn(N, K)

    def forward(s):
        x, w1, w2 = s
        return (x @ w2).sum() + (x.t() @ w1).sum()

    _check(setup, forward, monkeypatch, sum_bytes=0)


def test_retained_grad_summed_over_two_backward_calls(monkeypatch):
    # the second backward's gradient of h reaches retain_grad's hook, which replaces h.grad by
    # h.grad + grad: out of place, though the old h.grad dies right after (not the engine's sum)
    keep = []

    def forward(s):
        x, w1, _ = s
        h = x.clone()
        h.retain_grad()
        keep.append(h)
        loss = (h @ w1).sum()
        loss.backward(retain_graph=True)
        return loss

    _check(_leaf_used_twice, forward, monkeypatch, sum_bytes=0)
    assert keep[-1].grad is not None


@pytest.mark.parametrize("grads", ["none", "zeros", "kept"])
def test_param_grad_accumulation(grads, monkeypatch):
    # AccumulateGrad: steals the incoming gradient (no .grad), adds in place (a .grad exists),
    # over two backward calls in one step
    def setup():
        torch.manual_seed(0)
        lin = torch.nn.Linear(D, D)
        if grads == "zeros":
            for p in lin.parameters():
                p.grad = torch.zeros_like(p)
        return lin, torch.randn(N, D)

    def forward(s):
        lin, x = s
        if grads == "kept":
            lin(x.cos()).sum().backward()
        return lin(x.sin()).sum()

    _check(setup, forward, monkeypatch, sum_bytes=0)


transformers = pytest.importorskip("transformers")
V, H = 4000, 64


@pytest.mark.parametrize("convert", [False, True], ids=["eager", "converted"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast_bf16"])
def test_tied_gpt2(convert, autocast, monkeypatch):
    import slimgrad

    def setup():
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(
            n_layer=1,
            n_embd=H,
            n_head=4,
            vocab_size=V,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = transformers.GPT2LMHeadModel(cfg)
        if convert:
            slimgrad.convert_(model)
            assert slimgrad.report(model).converted, slimgrad.report(model)  # not eager vs eager
        return model, torch.randint(0, V, (2, 8))

    def forward(s):
        model, ids = s
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return model(input_ids=ids, labels=ids).loss

    # the head's gradient reaches the tied weight first. Converted: slimgrad's fused loss hands
    # it over unshared; eager autocast: it is ToCopyBackward0's fp32 copy: the engine adds the
    # embedding's gradient into it. Eager fp32: it is a view (TBackward0), summed out of place.
    # The real run may hold up to two more 0-dim tensors than the tracker: PyTorch makes them
    # from Python numbers inside an op call (autograd keeps some, e.g. MulBackward0's scalar
    # operand), and a dispatch mode receives the Python number, so no tracker sees them.
    in_place = convert or autocast
    m = _check(setup, forward, monkeypatch, sum_bytes=None if in_place else 0, slack=16)
    e = estimate(lambda: (lambda s: lambda: forward(s))(setup()))
    assert (e.peak_bytes, e.end_bytes) == (m.peak_bytes, m.end_bytes)


def test_without_the_extension_sums_count_out_of_place(monkeypatch):
    # the caller of an op is read by the C++ extension (call_origin); without it no sum is taken
    # for the engine's in-place one: the peak is one gradient above the real run's, never below
    state = _leaf_used_twice()
    _two_matmuls(state).backward()
    real_peak, _ = _real(_leaf_used_twice, lambda s: _two_matmuls(s).backward())
    monkeypatch.setattr(memory, "_origin_reader", lambda: None)
    state = _leaf_used_twice()
    m = measure(lambda: _two_matmuls(state))
    assert m.peak_bytes - real_peak == N * D * 4
    assert not any(op.endswith("(in place)") for _, op, _ in m.timeline)
