"""What one call of the smooth activations' PyTorch path costs a GPU, pinned on CPU (NOTE [The
PyTorch path on a GPU] in ``slimgrad._math.smooth``): the number of aten ops it dispatches, the
host syncs ``slimgrad.testing.count_host_syncs`` sees, and the values the host reads
(``tolist``/``item``/``bool``/...: each one a device-to-host copy that waits for the GPU on CUDA).

The first CUDA run measured the former chunk loop (about 30 ops and 7 syncs per 2^16 elements) at
15 ms for a 1M-element GELU forward, 70x eager's forward and backward."""

from __future__ import annotations

import contextlib
import importlib
import math
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from slimgrad._math import smooth
from slimgrad.kernels import _backend
from slimgrad.testing import count_host_syncs

N = 1 << 20
# one call at up to BIG elements: the forward dispatches 72-76 ops and the backward 33 (torch
# 2.13); the bounds leave room for another torch's decompositions, not for a loop over chunks
FWD_OPS, BWD_OPS = 100, 45
# each further span (views and slices included): 37 ops forward, 25 backward (torch 2.13)
FWD_SPAN_OPS, BWD_SPAN_OPS = 42, 28


def _cases():
    gelu, mish, silu = (
        importlib.import_module(f"slimgrad.ops.{m}") for m in ("gelu", "mish", "silu")
    )
    out = []
    for a in ("none", "tanh"):
        out.append(
            (
                f"gelu_{a}",
                gelu.SPECS[a],
                lambda t, a=a: gelu._fwd_torch(t, a),
                lambda g, x, a=a: gelu._bwd_exact(g, x, a),
                lambda t, a=a: gelu.gelu(t, approximate=a),
            )
        )
    out.append(("silu", silu.SPEC, silu._fwd_torch, silu._bwd_exact, silu.silu))
    out.append(("mish", mish.SPEC, mish._fwd_torch, mish._bwd_exact, mish.mish))
    return out


CASES = _cases()
IDS = [c[0] for c in CASES]


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


@contextlib.contextmanager
def _host_reads():
    """Count the Tensor methods that hand a tensor's values to the host."""
    counts: Counter = Counter()
    with pytest.MonkeyPatch.context() as mp:
        for name in _READS:
            orig = getattr(torch.Tensor, name)

            def wrapped(self, *args, _orig=orig, _name=name, **kwargs):
                counts[_name] += 1
                return _orig(self, *args, **kwargs)

            mp.setattr(torch.Tensor, name, wrapped)
        yield counts


def _cost(call):
    with _Ops() as ops, count_host_syncs() as syncs, _host_reads() as reads:
        out = call()
    return out, ops.n, sum(syncs.values()), dict(reads)


@pytest.fixture(autouse=True)
def gpu_spans(monkeypatch):
    """The spans a CUDA tensor gets (BIG elements, whatever the dtype), on these CPU tensors."""
    monkeypatch.setattr(smooth, "CPU_SPAN", smooth.BIG)
    monkeypatch.setattr(smooth, "HALF_SPANS", 1)


def _x(n: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_one_call_is_a_bounded_number_of_ops_and_one_host_read(case, dtype):
    _, spec, fwd, bwd, _ = case
    n = N if dtype == torch.float32 else N // 4
    x = _x(n, dtype)
    g = _x(n, dtype).flip(0)
    smooth.smooth_fwd(spec, x, fwd)  # the f' tables are built once per process
    side, f_ops, f_syncs, f_reads = _cost(lambda: smooth.smooth_fwd(spec, x, fwd, fallback=False))
    assert side[2].numel() > 0  # a side table was built (N(0, 1): about 1-2% hard)
    _, b_ops, b_syncs, b_reads = _cost(lambda: smooth.smooth_grad(spec, g, *side, bwd))
    assert (f_syncs, b_syncs) == (0, 0)
    assert f_reads == {"tolist": 1}, f_reads  # the table's three counts, read once
    assert b_reads == {}, b_reads
    assert f_ops <= FWD_OPS and b_ops <= BWD_OPS, (f_ops, b_ops)
    # the same ops at 1/4 of the size: nothing is done per 2^16-element chunk
    x16, g16 = x[: n // 4], g[: n // 4]
    side16, f16, *_ = _cost(lambda: smooth.smooth_fwd(spec, x16, fwd, fallback=False))
    _, b16, *_ = _cost(lambda: smooth.smooth_grad(spec, g16, *side16, bwd))
    assert (f16, b16) == (f_ops, b_ops)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_ops_grow_only_per_span(case, monkeypatch):
    """Past one span, each further span adds a bounded number of ops (and no host read)."""
    _, spec, fwd, bwd, _ = case
    n = N // 4
    x, g = _x(n, torch.float32), _x(n, torch.float32).flip(0)
    smooth.smooth_fwd(spec, x, fwd)
    side, f1, _, _ = _cost(lambda: smooth.smooth_fwd(spec, x, fwd, fallback=False))
    _, b1, _, _ = _cost(lambda: smooth.smooth_grad(spec, g, *side, bwd))
    monkeypatch.setattr(smooth, "CPU_SPAN", n // 4)
    side4, f4, s4, r4 = _cost(lambda: smooth.smooth_fwd(spec, x, fwd, fallback=False))
    _, b4, _, _ = _cost(lambda: smooth.smooth_grad(spec, g, *side4, bwd))
    assert s4 == 0 and r4 == {"tolist": 1}
    assert 0 < f4 - f1 <= 3 * FWD_SPAN_OPS and 0 < b4 - b1 <= 3 * BWD_SPAN_OPS, (f1, f4, b1, b4)
    for a, b in zip(side, side4, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_op_on_the_torch_backend_reads_the_host_once(case):
    """The public op (forward and backward through autograd) on the PyTorch path: no dispatcher
    sync, one host read (the forward's counts)."""
    fn = case[4]
    # a non-leaf input: on a leaf that requires grad the op keeps x, as eager (NOTE [An input the
    # graph holds] in ops/_output_act.py)
    x0 = (_x(N // 8, torch.float32) * 0.577).requires_grad_()
    x = x0.clone()  # CloneBackward: passes the gradient through, keeps nothing
    with _backend.set_backend("torch"):
        fn(x).sum().backward()  # tables, autograd warm-up
        x0.grad = None
        _, ops, syncs, reads = _cost(lambda: fn(x).sum().backward())
    assert syncs == 0 and reads == {"tolist": 1}, (syncs, reads)
    assert ops <= FWD_OPS + BWD_OPS + 20, ops


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_spans_do_not_change_results(case, monkeypatch):
    """Spans of 1, 3 and 16 CHUNKs give the same y, bits, side table (its order too) and gradient,
    with NaN/inf, a CHUNK whose float32 sum overflows and tail hits in most CHUNKs."""
    _, spec, fwd, bwd, _ = case
    chunk = smooth.CHUNK
    x = _x(9 * chunk + 5, torch.float32) * 1.7
    x[5 * chunk + 3], x[7 * chunk + 1], x[7 * chunk + 2] = math.nan, math.inf, -math.inf
    x[6 * chunk : 6 * chunk + 64] = 3e38
    x[8 * chunk + 9] = -2.75  # a tail hit after the NaN CHUNKs
    g = _x(x.numel(), torch.float32).flip(0)
    got = []
    for span in (chunk, 3 * chunk, 16 * chunk):
        monkeypatch.setattr(smooth, "CPU_SPAN", span)
        side = smooth.smooth_fwd(spec, x, fwd, fallback=False)
        got.append((*side, smooth.smooth_grad(spec, g, *side, bwd)))
    for other in got[1:]:
        for a, b in zip(got[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _half_cpu(monkeypatch):
    monkeypatch.setattr(smooth, "CPU_SPAN", smooth.CHUNK)
    monkeypatch.setattr(smooth, "HALF_SPANS", 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_half_spans_on_cpu_do_not_change_results(case, dtype, monkeypatch):
    """Half types on CPU run spans below a CHUNK (HALF_SPANS, NOTE [Sums below a CHUNK]): the
    same y, bits, side table (its order too) and gradient as spans of one CHUNK, with NaN/inf,
    tail hits and, in bfloat16, two CHUNKs whose float32 sum of t is unsure (one finite, one
    not)."""
    _, spec, fwd, bwd, _ = case
    _half_cpu(monkeypatch)
    chunk = smooth.CHUNK
    n = 4 * chunk + 77
    x = (_x(n, torch.float32) * 3).to(dtype)
    g = _x(n, dtype).flip(0)
    x[3], x[chunk + 5], x[chunk + 6] = math.nan, math.inf, -math.inf
    x[41] = x[chunk + 9] = x[2 * chunk + 11] = x[3 * chunk + 11] = -11.0  # tail hits
    if dtype == torch.bfloat16:  # float16's sums cannot overflow: only non-finite ones are inf
        x[2 * chunk : 2 * chunk + 2] = 1.69e38  # a float32 sum of t just below 3.4e38
        x[3 * chunk : 3 * chunk + 2] = 1.71e38  # just above
    resummed = []
    exact = smooth._exact_sums
    monkeypatch.setattr(smooth, "_exact_sums", lambda *a: resummed.append(1) or exact(*a))
    for m in (840, n):
        got = []
        for chunk_wide in (True, False):
            with monkeypatch.context() as mp:
                if chunk_wide:
                    mp.setattr(smooth, "_span", lambda t: chunk)
                side = smooth.smooth_fwd(spec, x[:m], fwd, fallback=False)
                got.append((*side, smooth.smooth_grad(spec, g[:m], *side, bwd)))
        for a, b in zip(*got, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    tail = spec.tail.get(dtype) is not None
    assert resummed == ([1] if tail and dtype == torch.bfloat16 else []), resummed


# half types on CPU: the ops one bfloat16 call dispatches (forward, backward), measured (torch
# 2.13) at 10^3, 10^5 and 10^6 elements (1, 13 and 16 spans of 8,192, 8,192 and 65,536 elements:
# HALF_MIN_SPAN at least; spans of one CHUNK: 1, 2 and 16), with a tail (SiLU, Mish: float64 sums
# below a CHUNK) and without (GELU: no tail in bfloat16)
HALF_OPS = {
    True: {1000: (58, 36), 100_000: (407, 372), 1_000_000: (498, 456)},
    False: {1000: (32, 36), 100_000: (309, 372), 1_000_000: (378, 456)},
}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_half_spans_on_cpu_a_bounded_number_of_ops(case, monkeypatch):
    """Half types on CPU: at most HALF_SPANS spans per call up to HALF_SPANS * CHUNK elements,
    whatever the size (no op per 8 elements); one host read."""
    _, spec, fwd, bwd, _ = case
    _half_cpu(monkeypatch)
    got = {}
    pins = HALF_OPS[spec.tail.get(torch.bfloat16) is not None]
    for size in pins:
        x, g = _x(size, torch.bfloat16), _x(size, torch.bfloat16).flip(0)
        smooth.smooth_fwd(spec, x, fwd)
        side, f_ops, f_syncs, f_reads = _cost(
            lambda x=x: smooth.smooth_fwd(spec, x, fwd, fallback=False)
        )
        _, b_ops, b_syncs, b_reads = _cost(
            lambda g=g, side=side: smooth.smooth_grad(spec, g, *side, bwd)
        )
        assert (f_syncs, b_syncs, f_reads, b_reads) == (0, 0, {"tolist": 1}, {})
        got[size] = (f_ops, b_ops)
    assert got == pins, got


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cuda_bit_identical_and_one_sync(case):
    """On CUDA: the frozen pre-speed-up implementation's y, bits, table and gradient, bit for bit;
    the forward synchronizes once (its counts), the backward never (torch's sync debug mode)."""
    import warnings

    from tests.ops.test_output_act_speed import ref_smooth_fwd, ref_smooth_grad

    _, spec, fwd, bwd, _ = case
    n = N + 2 * smooth.CHUNK + 13
    x = (_x(n, torch.float32) * 1.7).cuda()
    x[5], x[smooth.CHUNK + 3], x[smooth.CHUNK + 4] = math.nan, math.inf, -math.inf
    x[2 * smooth.CHUNK : 2 * smooth.CHUNK + 64] = 3e38
    g = _x(n, torch.float32).flip(0).cuda()
    for fallback in (False, True):
        ref = ref_smooth_fwd(spec, x, fwd, fallback)
        got = smooth.smooth_fwd(spec, x, fwd, fallback)
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    y, bits, idx, xs = ref_smooth_fwd(spec, x, fwd, False)
    torch.testing.assert_close(
        smooth.smooth_grad(spec, g, y, bits, idx, xs, bwd),
        ref_smooth_grad(spec, g, y, bits, idx, xs, bwd),
        rtol=0,
        atol=0,
        equal_nan=True,
    )
    torch.cuda.synchronize()
    old = torch.cuda.get_sync_debug_mode()
    try:
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as fw:
            warnings.simplefilter("always")
            side = smooth.smooth_fwd(spec, x, fwd, False)
        with warnings.catch_warnings(record=True) as bw:
            warnings.simplefilter("always")
            smooth.smooth_grad(spec, g, *side, bwd)
    finally:
        torch.cuda.set_sync_debug_mode(old)
    syncs = [w for w in fw if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    assert not [w for w in bw if "synchroniz" in str(w.message)]


# half types on CPU, at most HALF_DENSE_MAX elements: the ops one call of the activation
# dispatches (forward, backward), measured (torch 2.13); spans of 64 elements (16 per call)
# dispatched 700 to 900 and made a 1,000-element bfloat16 SiLU step 4.9x slower
# GELU, SiLU and Mish call eager's op without a copy of x (4: NOTE [Few elements without a copy
# of x] in slimgrad/ops/_output_act.py; GELU's custom op copied x for its dense side output: 5)
HALF_DENSE_OPS = (4, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_half_cpu_small_tensors_keep_x(case, dtype):
    """A half-type CPU tensor too small for HALF_SPANS spans of HALF_MIN_SPAN elements keeps x,
    as eager (keeps_x in ops._output_act): eager's y and gradient bit for bit, a handful of ops;
    one element more takes the spans."""
    name, _, fwd, _, op = case
    op(_x(1000, dtype).requires_grad_()).backward(_x(1000, dtype))  # one-time work
    got = {}
    for n in (1000, smooth.HALF_DENSE_MAX, smooth.HALF_DENSE_MAX + 1):
        x0 = _x(n, dtype).requires_grad_()
        # a non-leaf input: on a leaf that requires grad the op keeps x at every size (NOTE [An
        # input the graph holds] in ops/_output_act.py)
        x = x0.clone()  # CloneBackward: passes the gradient through, keeps nothing
        g = _x(n, dtype).flip(0)
        y, f_ops, _, _ = _cost(lambda x=x: op(x))
        _, b_ops, _, _ = _cost(lambda y=y, g=g: y.backward(g))
        xe = x0.detach().requires_grad_()
        ye = fwd(xe)
        ye.backward(g)
        if n <= smooth.HALF_DENSE_MAX:
            assert torch.equal(y, ye) and torch.equal(x0.grad, xe.grad)
            got[n] = (f_ops, b_ops)
        else:
            assert f_ops > 2 * got[n - 1][0]
    assert set(got.values()) == {HALF_DENSE_OPS}, (name, got)
