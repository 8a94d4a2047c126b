"""CPU C kernels: the loader (slimgrad.kernels._cpu), the 'cpu' backend choice, and the ops' C paths
against their PyTorch paths (NOTE [CPU C kernels], NOTE [Kernel backend choice])."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from slimgrad.kernels import _backend as B
from slimgrad.kernels import _cpu

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


def test_compile_error_falls_back(toy):
    (toy / "src" / "toy.c").write_text("this is not C;")
    with pytest.warns(RuntimeWarning, match="SLIMGRAD_BACKEND=torch"):
        assert _cpu.load("toy") is None
    assert "failed on toy.c" in _cpu.last_error("toy")


@needs_cc
def test_concurrent_builds_are_safe(toy):
    # two processes build the same library into an empty cache at once; both load it
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; "
        "import slimgrad.kernels._cpu as c; c.SRC_DIR = Path(sys.argv[2]); "
        "lib = c.load('toy'); assert lib is not None, c.last_error('toy'); print('ok')"
    )
    env = {**os.environ, "SLIMGRAD_CACHE": str(toy / "cache"), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, SRC, str(toy / "src")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert [o[0].strip() for o in outs] == ["ok", "ok"]
    files = [f.name for f in (toy / "cache" / "cpu").iterdir()]
    assert len(files) == 1 and files[0].startswith("toy-"), files  # no temporary left behind


def test_import_slimgrad_compiles_nothing(tmp_path):
    code = (
        "import slimgrad, slimgrad.ops, slimgrad.nn, sys; "
        "assert 'slimgrad.kernels._cpu' not in sys.modules or "
        "not sys.modules['slimgrad.kernels._cpu']._libs"
    )
    env = {**os.environ, "PYTHONPATH": SRC, "SLIMGRAD_CACHE": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    assert not (tmp_path / "cpu").exists() or not list((tmp_path / "cpu").iterdir())


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
