"""CPU C kernels: the loader (slimgrad.kernels._cpu), the 'cpu' backend choice, and the ops' C paths
against their PyTorch paths (NOTE [CPU C kernels], NOTE [Kernel backend choice])."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from slimgrad.kernels import _backend as B
from slimgrad.kernels import _cpu
from tests._child import run_checks

SRC = str(Path(_cpu.__file__).resolve().parents[2])

_TOY = textwrap.dedent(
    """
    #include <stdint.h>
    void axpy(float *y, const float *x, float a, int64_t n, int nt) {
    #pragma omp parallel for num_threads(nt)
        for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
    }
    """
)


def _have_cc() -> bool:
    return _cpu.compiler() is not None


needs_cc = pytest.mark.skipif(not _have_cc(), reason="no C compiler")


@pytest.fixture
def toy(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "toy.c").write_text(_TOY)
    monkeypatch.setattr(_cpu, "SRC_DIR", src)
    monkeypatch.setenv("SLIMGRAD_CACHE", str(tmp_path / "cache"))
    _cpu._reset("toy")
    yield tmp_path
    _cpu._reset("toy")


def _axpy(lib, y, x, a):
    import ctypes

    f = lib.axpy
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_int64, ctypes.c_int]
    f(y.data_ptr(), x.data_ptr(), a, y.numel(), _cpu.threads())


@needs_cc
def test_load_builds_caches_and_runs(toy):
    lib = _cpu.load("toy")
    assert lib is not None and _cpu.last_error("toy") is None
    built = list((toy / "cache" / "cpu").glob("toy-*.so"))
    assert len(built) == 1
    y, x = torch.ones(37), torch.arange(37.0)
    _axpy(lib, y, x, 2.0)
    torch.testing.assert_close(y, 1 + 2 * torch.arange(37.0), rtol=0, atol=0)
    assert _cpu.load("toy") is lib  # once per process
    # a fresh process reuses the cached file (no compiler needed then)
    _cpu._reset("toy")
    mtime = built[0].stat().st_mtime_ns
    assert _cpu.load("toy") is not None
    assert built[0].stat().st_mtime_ns == mtime
    # a changed source gets a new key
    (toy / "src" / "toy.c").write_text(_TOY + "\n/* changed */\n")
    _cpu._reset("toy")
    assert _cpu.load("toy") is not None
    assert len(list((toy / "cache" / "cpu").glob("toy-*.so"))) == 2


def test_no_compiler_falls_back_with_one_warning(toy, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.warns(RuntimeWarning, match=r"slimgrad.kernels: cannot build the CPU C kernels"):
        assert _cpu.load("toy") is None
    assert "nonexistent" in _cpu.last_error("toy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # only once
        assert _cpu.load("toy") is None


@needs_cc
def test_builds_without_openmp_when_the_compiler_lacks_it(toy, monkeypatch):
    # a compiler that rejects -fopenmp (clang without libomp): the third attempt drops it
    real = _cpu._run_cc

    def no_omp(cc, flags, src, out):
        if "-fopenmp" in flags:
            return subprocess.CompletedProcess([cc], 1, "", "unsupported option '-fopenmp'")
        return real(cc, flags, src, out)

    monkeypatch.setattr(_cpu, "_run_cc", no_omp)
    lib = _cpu.load("toy")
    assert lib is not None
    y, x = torch.zeros(5), torch.ones(5)
    _axpy(lib, y, x, 3.0)
    assert torch.equal(y, torch.full((5,), 3.0))


def test_compile_error_falls_back(toy):
    (toy / "src" / "toy.c").write_text("this is not C;")
    with pytest.warns(RuntimeWarning, match="SLIMGRAD_BACKEND=torch"):
        assert _cpu.load("toy") is None
    assert "failed on toy.c" in _cpu.last_error("toy")


def test_unusable_cache_falls_back(toy, monkeypatch):
    blocker = toy / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SLIMGRAD_CACHE", str(blocker))
    with pytest.warns(RuntimeWarning, match="SLIMGRAD_CACHE to a writable directory"):
        assert _cpu.load("toy") is None


@needs_cc
def test_concurrent_builds_are_safe(toy):
    # two processes build the same library into an empty cache at once, a child and this one (the
    # child imports first, then both start on one signal); both load it
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; "
        "import slimgrad.kernels._cpu as c; c.SRC_DIR = Path(sys.argv[2]); "
        "print('ready', flush=True); sys.stdin.readline(); "
        "lib = c.load('toy'); assert lib is not None, c.last_error('toy'); print('ok')"
    )
    env = {**os.environ, "SLIMGRAD_CACHE": str(toy / "cache"), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", code, SRC, str(toy / "src")],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()[-2000:]
        child.stdin.write("go\n")
        child.stdin.flush()
        lib = _cpu.load("toy")  # the toy fixture's sources and cache, as the child's
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
        child.wait()
    assert lib is not None, _cpu.last_error("toy")
    assert child.returncode == 0 and out.strip() == "ok", (out, err[-2000:])
    files = [f.name for f in (toy / "cache" / "cpu").iterdir()]
    assert len(files) == 1 and files[0].startswith("toy-"), files  # no temporary left behind


# One fresh child (tests/_child.py) for both: first `import slimgrad` compiles nothing (an empty
# cache stays empty), then, with no compiler, an op's first call warns once and runs on PyTorch
_CHECK_IMPORT_COMPILES_NOTHING = """
    import os, sys
    from pathlib import Path
    import slimgrad, slimgrad.ops, slimgrad.nn
    assert 'slimgrad.kernels._cpu' not in sys.modules or \\
        not sys.modules['slimgrad.kernels._cpu']._libs
    cache = Path(os.environ['SLIMGRAD_CACHE']) / 'cpu'
    assert not cache.exists() or not list(cache.iterdir()), list(cache.iterdir())
"""

_CHECK_NO_COMPILER_FALLS_BACK = """
    import os
    os.environ['CC'] = '/nonexistent/cc'
    import warnings, torch, torch.nn.functional as F
    from slimgrad.ops.gelu import gelu
    x = torch.randn(1000, requires_grad=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        gelu(x * 1, 'tanh').sum().backward(); gelu(x * 1).sum().backward()
    msgs = [str(m.message) for m in w if 'cannot build' in str(m.message)]
    assert len(msgs) == 1 and '/nonexistent/cc' in msgs[0], msgs
    xe = x.detach().requires_grad_(); F.gelu(xe, approximate='tanh').sum().backward()
    F.gelu(xe).sum().backward(); torch.testing.assert_close(x.grad, xe.grad)
"""


@pytest.fixture(scope="module")
def fresh_child(tmp_path_factory):
    env = {
        "SLIMGRAD_CACHE": str(tmp_path_factory.mktemp("cpu_cache")),
        "OMP_NUM_THREADS": "1",
        B.ENV_VAR: None,
        "CC": None,
    }
    checks = {"import": _CHECK_IMPORT_COMPILES_NOTHING, "no_cc": _CHECK_NO_COMPILER_FALLS_BACK}
    return run_checks(checks, env=env)


def test_import_slimgrad_compiles_nothing(fresh_child):
    assert fresh_child["import"] == "ok", fresh_child["import"]


# backend choice ----------------------------------------------------------------------------------


@pytest.fixture
def clean_backend(monkeypatch):
    monkeypatch.delenv(B.ENV_VAR, raising=False)
    with B.set_backend(None):
        yield


@needs_cc
def test_use_cpu_auto_torch_and_forced(clean_backend, monkeypatch):
    x = torch.ones(3)
    assert B.use_cpu(x, "output_act") is not None  # auto: C on CPU float32
    assert B.use_cpu(x.double(), "output_act") is None  # dtype not handled
    assert B.use_cpu(x, "output_act", dtypes=(torch.float64,)) is None
    assert B.use_cpu(torch.empty(3, device="meta"), "output_act") is None
    assert not B.use_triton(x, backend="cpu")  # 'cpu' never means Triton
    with B.set_backend("torch"):
        assert B.use_cpu(x, "output_act") is None
    monkeypatch.setenv(B.ENV_VAR, "torch")
    assert B.use_cpu(x, "output_act") is None
    assert B.use_cpu(x, "output_act", backend="cpu") is not None  # the call beats the env var
    monkeypatch.setenv(B.ENV_VAR, "triton")
    assert B.use_cpu(x, "output_act") is None


def test_forced_cpu_without_compiler_is_an_error(clean_backend, toy, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(RuntimeError, match=r"backend 'cpu' was forced but the C kernels for 'toy'"):
        B.use_cpu(torch.ones(2), "toy", backend="cpu")


def test_auto_without_compiler_takes_torch(clean_backend, toy, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.warns(RuntimeWarning):
        assert B.use_cpu(torch.ones(2), "toy") is None


def test_compiled_code_and_fake_tensors_take_torch(clean_backend):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert B.use_cpu(torch.empty(2), "output_act", backend="cpu") is None
    seen = []

    def f(x):
        seen.append(B.use_cpu(x, "output_act"))
        return x + 1

    torch.compile(f, backend="eager")(torch.ones(3))
    assert seen == [None]


# the smooth activations (GELU erf/tanh, SiLU, Mish): C path vs PyTorch path -------------------

import importlib  # noqa: E402

from slimgrad import ownership  # noqa: E402
from slimgrad.memory import measure  # noqa: E402
from slimgrad.ops import _output_act as oa  # noqa: E402
from slimgrad.testing import assert_within_rule  # noqa: E402
from tests.ops._output_act_helpers import all_float32_between, assert_grid_within_rule  # noqa: E402

_G = importlib.import_module("slimgrad.ops.gelu")
_S = importlib.import_module("slimgrad.ops.silu")
_M = importlib.import_module("slimgrad.ops.mish")


def _gelu(a):
    return lambda t, inplace=False: _G.gelu(t, a, inplace)


# name -> (spec, fwd, bwd_exact, op(x, inplace), eager)
SMOOTH = {
    "gelu": (
        _G.SPECS["none"],
        lambda t: _G._fwd_torch(t, "none"),
        lambda g, x: _G._bwd_exact(g, x, "none"),
        _gelu("none"),
        lambda t: torch.nn.functional.gelu(t),
    ),
    "gelu_tanh": (
        _G.SPECS["tanh"],
        lambda t: _G._fwd_torch(t, "tanh"),
        lambda g, x: _G._bwd_exact(g, x, "tanh"),
        _gelu("tanh"),
        lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
    ),
    "silu": (_S.SPEC, _S._fwd_torch, _S._bwd_exact, _S.silu, torch.nn.functional.silu),
    "mish": (_M.SPEC, _M._fwd_torch, _M._bwd_exact, _M.mish, torch.nn.functional.mish),
}


@pytest.fixture(scope="module")
def lib():
    lib = _cpu.load(oa.C_STEM)
    if lib is None:
        pytest.skip(f"C kernels unavailable: {_cpu.last_error(oa.C_STEM)}")
    return lib


def _inputs(spec):
    xs = oa.inverse(spec).x_star
    gen = torch.Generator().manual_seed(3)
    yield "randn0.577", torch.randn(200_003, generator=gen) * 0.577
    yield "randn3_2d", (torch.randn(301, 499, generator=gen) * 3)
    near = spec.window[torch.float32] + 0.3
    yield "near_x*", all_float32_between(xs - near, xs + near, 5)
    yield "tail", all_float32_between(-6.0, -1.0, 401)
    yield "odd7", torch.randn(7, generator=gen) - 0.75
    yield "noncontig", (torch.randn(40, 66, generator=gen) - 1).t()[3:, ::3]


def _eq_sorted(r, c):
    # y and bits bit for bit; the hard elements as a set (same count, same (index, x) pairs)
    assert torch.equal(r[0], c[0]) or torch.equal(r[0].isnan(), c[0].isnan())
    torch.testing.assert_close(r[0], c[0], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(r[1], c[1])
    assert r[2].dtype == c[2].dtype and r[3].dtype == c[3].dtype
    ri, ci = r[2].sort(), c[2].sort()
    assert torch.equal(ri.values, ci.values)
    torch.testing.assert_close(r[3][ri.indices], c[3][ci.indices], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", list(SMOOTH))
def test_forward_bitwise_and_grad_as_torch(lib, name):
    spec, fwd, bwd, _, _ = SMOOTH[name]
    for label, x in _inputs(spec):
        r = oa.smooth_fwd(spec, x, fwd)
        c = oa.smooth_fwd_c(lib, spec, x, fwd)
        for a, b in zip(r, c):  # finite inputs: same order too, bit for bit
            assert torch.equal(a, b), label
        g = torch.randn(x.shape)
        gr = oa.smooth_grad(spec, g, *r, bwd)
        gc = oa.smooth_grad_c(lib, spec, g, *c, bwd)
        # torch's float32 sqrt is not always correctly rounded (C's sqrtf is): s may differ by an
        # ulp, f' by a few float32 ulp; everything else is the same arithmetic
        torch.testing.assert_close(gc, gr, rtol=2e-6, atol=5e-7, msg=label)
        assert gc.shape == g.shape


@pytest.mark.parametrize("name", list(SMOOTH))
def test_nan_inf_zero_and_fallback(lib, name):
    spec, fwd, bwd, _, _ = SMOOTH[name]
    xs = oa.inverse(spec).x_star
    vals = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.5, -2.0, 1e30, -1e30, xs]
    x = torch.tensor(vals * 3000)
    x[::7] = torch.randn(x[::7].shape)
    r, c = oa.smooth_fwd(spec, x, fwd, fallback=False), oa.smooth_fwd_c(lib, spec, x, fwd, False)
    _eq_sorted(r, c)
    g = torch.randn(x.shape)
    torch.testing.assert_close(
        oa.smooth_grad_c(lib, spec, g, *c, bwd), oa.smooth_grad(spec, g, *r, bwd), equal_nan=True
    )
    # adversarial: more than 1/16 hard -> both fall back to dense x, same tensors
    x = torch.full((3001,), xs) + torch.linspace(-0.01, 0.01, 3001)
    r, c = oa.smooth_fwd(spec, x, fwd), oa.smooth_fwd_c(lib, spec, x, fwd)
    assert oa.is_dense_fallback(x.numel(), *c[1:]) and oa.is_dense_fallback(x.numel(), *r[1:])
    for a, b in zip(r, c):
        assert torch.equal(a, b)
    # zero-size
    z = torch.empty(0, 3)
    r, c = oa.smooth_fwd(spec, z, fwd), oa.smooth_fwd_c(lib, spec, z, fwd)
    assert [t.shape for t in r] == [t.shape for t in c]


@pytest.mark.parametrize("name", list(SMOOTH))
def test_every_float32_near_minimum_within_rule(lib, name):
    # the C path on every float32 of x* +- (window + 0.3), as the PyTorch path's own grid test
    spec, fwd, bwd, _, _ = SMOOTH[name]
    xs = oa.inverse(spec).x_star
    near = spec.window[torch.float32] + 0.3
    x = all_float32_between(xs - near, xs + near)
    ref = spec.df(x.double())
    c = oa.smooth_fwd_c(lib, spec, x, fwd, fallback=False)
    g = torch.ones_like(x)
    ours = (oa.smooth_grad_c(lib, spec, g, *c, bwd).double() - ref).abs()
    eager = (bwd(g, x).double() - ref).abs()
    assert_grid_within_rule(ours, eager, 1e-6)
    # and a strided sweep of [-40, 40]
    x = all_float32_between(-40.0, 40.0, 4099)
    c = oa.smooth_fwd_c(lib, spec, x, fwd, fallback=False)
    g = torch.ones_like(x)
    ref = spec.df(x.double())
    ours = (oa.smooth_grad_c(lib, spec, g, *c, bwd).double() - ref).abs()
    assert_grid_within_rule(ours, (bwd(g, x).double() - ref).abs(), 1e-6)


def _step(op, x0, g, inplace=False):
    x = x0.clone().requires_grad_()
    h = x * 1
    y = op(h, inplace)
    y.backward(g)
    return y.detach(), x.grad


@pytest.mark.parametrize("name", list(SMOOTH))
def test_op_on_both_backends(clean_backend, lib, name):
    spec, _, _, op, eager = SMOOTH[name]
    x0 = torch.randn(33, 65) * 1.5
    g = torch.randn(33, 65)
    res = {}
    for backend in ("torch", "cpu"):
        with B.set_backend(backend):
            res[backend] = [_step(op, x0, g, ip) for ip in (False, True)]

            def fwd():
                h = x0.clone().requires_grad_() * 1
                return op(h).sum()

            res[backend].append(measure(fwd).saved_bytes)
    assert res["torch"][2] == res["cpu"][2]  # the memory contract does not depend on the backend
    for (yt, gt), (yc, gc) in zip(res["torch"][:2], res["cpu"][:2]):
        assert torch.equal(yt, yc)
        torch.testing.assert_close(gc, gt, rtol=2e-6, atol=5e-7)
    x64 = x0.double().requires_grad_()
    eager(x64).backward(g.double())
    xe = x0.clone().requires_grad_()
    eager(xe).backward(g)
    assert_within_rule(res["cpu"][0][1], x64.grad, xe.grad)


def test_ops_fall_back_when_the_compiler_is_missing(fresh_child):
    # a fresh process, an empty cache and no compiler: the op warns once, then runs on PyTorch
    assert fresh_child["no_cc"] == "ok", fresh_child["no_cc"]


# gradient-buffer reuse (issue 6; NOTE [Gradient-buffer ownership]) -----------------------------


def _reuse_case(op, case):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 7, 13, generator=gen).requires_grad_()
    wl = torch.randn(5, 7, 13, generator=gen)
    out = {}
    h = x * 1.5
    if case == "plain_chain":
        y = op(h)
        (y * wl).sum().backward()
    elif case == "used_twice":
        y = op(h)
        ((y * wl).sum() + y.sin().sum()).backward()
    elif case == "sibling_pending":
        x2 = torch.randn(5, 7, 13, generator=gen).requires_grad_()
        r = x2 * 1.25  # created first: its node runs after op's, reading the same gradient
        ((op(h) + r) * wl).sum().backward()
        out["x2.grad"] = x2.grad
    elif case == "hook_keeps":
        y = op(h)
        kept = []
        y.register_hook(kept.append)
        (y * wl).sum().backward()
        out["kept"] = kept[0]
    elif case == "user_gradient":
        y = op(h)
        G = torch.randn(5, 7, 13, generator=gen)
        y.backward(gradient=G)
        out["G"] = G
    out["x.grad"] = x.grad
    return out


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("name", list(SMOOTH))
@pytest.mark.parametrize(
    "case", ["plain_chain", "used_twice", "sibling_pending", "hook_keeps", "user_gradient"]
)
def test_grad_reuse_bitwise(clean_backend, monkeypatch, backend, name, case):
    monkeypatch.delenv(ownership.ENV_VAR, raising=False)
    if backend == "cpu" and not _have_cc():
        pytest.skip("no C compiler")
    op = SMOOTH[name][3]
    res = []
    with B.set_backend(backend):
        for disabled in (False, True):
            ownership.reset_reuse_count()
            if disabled:
                with ownership.reuse_disabled():
                    out = _reuse_case(op, case)
            else:
                out = _reuse_case(op, case)
            res.append((out, ownership.reuse_count("grad")))
    (on, n_on), (off, n_off) = res
    assert n_off == 0
    assert n_on == (1 if case in ("plain_chain", "used_twice") else 0), case
    assert on.keys() == off.keys()
    for k in on:
        assert torch.equal(on[k], off[k]), k


# dropout: pack + apply in C, the mask drawn by torch as eager draws it -------------------------

_D = importlib.import_module("slimgrad.ops.dropout")


def _dropout_run(backend, x0, g, p, inplace, seed=13):
    with B.set_backend(backend):
        x = x0.clone().requires_grad_()
        h = x * 1
        torch.manual_seed(seed)
        y = _D.dropout(h, p, inplace=inplace)
        bits = _D._dropout_fwd(x0, p)[1] if not inplace else None
        y.backward(g)
        return y.detach(), x.grad, bits


@pytest.mark.parametrize("n", [1, 7, 33, 1000, 70_001])
@pytest.mark.parametrize("p", [1e-6, 0.1, 0.5, 1 - 1e-6])
def test_dropout_c_matches_torch_and_eager(clean_backend, n, p):
    if not _have_cc():
        pytest.skip("no C compiler")
    x0 = torch.randn(n)
    x0[::5] = float("nan")
    x0[1::7] = float("inf")
    x0[2::11] = -0.0
    g = torch.randn(n)
    g[3::13] = float("inf")
    for inplace in (False, True):
        yt, gt, _ = _dropout_run("torch", x0, g, p, inplace)
        yc, gc, _ = _dropout_run("cpu", x0, g, p, inplace)
        torch.manual_seed(13)
        xe = x0.clone().requires_grad_()
        ye = torch.nn.functional.dropout(xe * 1, p)
        ye.backward(g)
        for a, b in ((yt, yc), (gt, gc), (ye.detach(), yc), (xe.grad, gc)):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))  # bit for bit, -0 and NaN


def test_dropout_c_bits_and_apply_direct():
    lib = _cpu.load(_D.C_STEM)
    if lib is None:
        pytest.skip("no C compiler")
    for n in (1, 8, 31, 32, 33, 65_536 + 9):
        noise = (torch.rand(n) < 0.7).float()
        x = torch.randn(n)
        out = torch.empty(n)
        bits = _D._c_fwd(lib, noise, x, out, 0.3)
        from slimgrad.ops._bits import pack_bits

        assert torch.equal(bits, pack_bits(noise != 0))
        ref = noise.clone().div_(0.7).mul_(x)
        assert torch.equal(out, ref)
        g = torch.randn(n)
        with B.set_backend("torch"):
            want = _D._apply_mask_torch(g, bits, 0.3, False)
        with B.set_backend("cpu"):
            got = _D._apply_mask_torch(g, bits, 0.3, False)
            assert torch.equal(got, want)
            g2 = g.clone()
            assert _D._apply_mask_torch(g2, bits, 0.3, False, inplace=True) is g2
            assert torch.equal(g2, want)


def test_dropout_memory_same_on_both_backends(clean_backend):
    if not _have_cc():
        pytest.skip("no C compiler")
    x0 = torch.randn(37, 41)
    saved = []
    for backend in ("torch", "cpu"):
        with B.set_backend(backend):
            m = measure(lambda: _D.dropout(x0.clone().requires_grad_() * 1, 0.2).sum())
            saved.append((m.saved_bytes, m.peak_bytes))
    assert saved[0][0] == saved[1][0] == (37 * 41 + 7) // 8
    assert saved[1][1] <= saved[0][1]  # no bool / unpacked temporaries on the C path


def test_threads_do_not_change_results(lib):
    # OpenMP splits by 2^16-element blocks with per-block offsets: the same bytes for any count.
    # (eager's own F.gelu, which gives y, may round differently at its thread chunks' edges: the
    # same y for both here, so only slimgrad's passes are compared)
    spec, fwd0, bwd, _, _ = SMOOTH["gelu_tanh"]
    x = torch.randn(3 * 65536 + 77) * 2
    y0 = fwd0(x)

    def fwd(t):
        return y0.clone()

    g = torch.randn(x.shape)
    res = []
    old = torch.get_num_threads()
    try:
        for nt in (1, 3):
            torch.set_num_threads(nt)
            c = oa.smooth_fwd_c(lib, spec, x, fwd, fallback=False)
            res.append((*c, oa.smooth_grad_c(lib, spec, g, *c, bwd)))
    finally:
        torch.set_num_threads(old)
    for name, a, b in zip(("y", "bits", "idx", "xs", "dx"), *res):
        assert torch.equal(a, b), name


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 targets")
@pytest.mark.parametrize("target", ["-march=haswell", "-march=x86-64"])
def test_other_instruction_sets_give_the_same_bytes(lib, monkeypatch, tmp_path, target):
    # the AVX2 gathers (haswell) and the plain scalar loop (x86-64: no AVX, software fmaf) must
    # give what the native build gives, bit for bit
    monkeypatch.setattr(_cpu, "_NATIVE", (target,))
    monkeypatch.setattr(_cpu, "_libs", {})
    monkeypatch.setenv("SLIMGRAD_CACHE", str(tmp_path))
    other = _cpu.load(oa.C_STEM)
    if other is None:
        pytest.skip(f"cannot build for {target}: {_cpu.last_error(oa.C_STEM)}")
    spec, fwd, bwd, _, _ = SMOOTH["gelu_tanh"]
    x = torch.randn(65536 + 1003) * 2
    g = torch.randn(x.shape)
    a = oa.smooth_fwd_c(lib, spec, x, fwd)
    b = oa.smooth_fwd_c(other, spec, x, fwd)
    for t, u in zip(a, b):
        assert torch.equal(t, u)
    assert torch.equal(
        oa.smooth_grad_c(lib, spec, g, *a, bwd), oa.smooth_grad_c(other, spec, g, *b, bwd)
    )


def test_int64_index_collection(lib):
    # tensors above 2^31 elements list their hard elements as int64: the same kernel, checked on a
    # small input by calling the int64 variant directly
    spec, fwd, _, _, _ = SMOOTH["silu"]
    x = torch.randn(70_001) * 2
    y, bits, idx, xs = oa.smooth_fwd_c(lib, spec, x, fwd, fallback=False)
    inv = oa.inverse(spec)
    n = x.numel()
    nb = (n + oa.CHUNK - 1) // oa.CHUNK
    cnt = torch.empty(2 * nb, dtype=torch.int64)
    flags = torch.empty((n + 31) // 32, dtype=torch.uint8)
    fns = oa._c_fns(lib)
    w, tail = oa._window(spec, torch.float32)  # as smooth_fwd_c: window and exact left tail
    has_tail, tail_v = (0, 0.0) if tail is None else (1, float(tail))
    bits2 = torch.empty_like(bits)  # held: the kernel writes into it
    fns["smooth_fwd_f32"](
        x.data_ptr(), bits2.data_ptr(), cnt.data_ptr(), flags.data_ptr(), n, inv.x_star, w,
        has_tail, tail_v, 1,
    )  # fmt: skip
    assert torch.equal(bits2, bits)
    per = cnt.view(nb, 2).sum(1)
    off = per.cumsum(0) - per
    i64 = torch.empty(idx.numel(), dtype=torch.int64)
    xs64 = torch.empty(idx.numel())
    fns["smooth_collect_i64"](
        x.data_ptr(), cnt.data_ptr(), flags.data_ptr(), off.data_ptr(), i64.data_ptr(),
        xs64.data_ptr(), n, inv.x_star, w, has_tail, tail_v, 1,
    )  # fmt: skip
    assert torch.equal(i64, idx.long()) and torch.equal(xs64, xs)
