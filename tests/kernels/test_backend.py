"""Backend choice (slimgrad.kernels._backend): auto / torch / triton, env var, lazy imports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slimgrad.kernels import _backend as B


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(B.ENV_VAR, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with B.set_backend(None):
        yield


def test_auto_takes_torch_on_cpu():
    assert B.get_backend() == "auto"
    assert not B.use_triton(torch.ones(2))


def test_torch_forced_everywhere():
    with B.set_backend("torch"):
        assert not B.use_triton(torch.ones(2))
    assert not B.use_triton(torch.ones(2), backend="torch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only expectation")
def test_triton_forced_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setitem(B._found, "triton", True)
    with pytest.raises(RuntimeError, match=r"slimgrad.kernels: backend 'triton' needs CUDA"):
        B.use_triton(torch.ones(2), backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert B.use_triton(torch.ones(2), backend="triton")


def test_triton_forced_without_triton_is_an_error(monkeypatch):
    monkeypatch.setitem(B._found, "triton", False)
    with pytest.raises(RuntimeError, match="triton is not installed"):
        B.use_triton(torch.ones(2), backend="triton")
    assert not B.use_triton(torch.ones(2))  # auto: quietly the PyTorch path


def test_env_var_and_precedence(monkeypatch):
    monkeypatch.setitem(B._found, "triton", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(B.ENV_VAR, "triton")
    assert B.get_backend() == "triton"
    assert B.use_triton(torch.ones(2))
    with B.set_backend("torch"):  # set_backend beats the env var
        assert not B.use_triton(torch.ones(2))
        assert B.use_triton(torch.ones(2), backend="TRITON")  # the call beats both
    assert B.use_triton(torch.ones(2))  # restored


def test_bad_names():
    with pytest.raises(ValueError, match=r"slimgrad.kernels: unknown backend; expected one of"):
        B.set_backend("cuda")
    with pytest.raises(TypeError, match="must be a str"):
        B.use_triton(torch.ones(1), backend=1)


def test_bad_env_var(monkeypatch):
    monkeypatch.setenv(B.ENV_VAR, "fast")
    with pytest.raises(ValueError, match=r"\$SLIMGRAD_BACKEND"):
        B.use_triton(torch.ones(1))


def test_fake_and_meta_tensors_take_the_torch_path(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setitem(B._found, "triton", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not B.use_triton(torch.empty(2, device="meta"), backend="triton")
    with FakeTensorMode():
        assert not B.use_triton(torch.empty(2), backend="triton")


def test_import_slimgrad_and_backend_import_neither_triton_nor_cuda():
    code = (
        "import sys, torch; import slimgrad, slimgrad.kernels._backend as b; "
        "b.use_triton(torch.ones(1)); b.triton_available(); "
        "assert 'triton' not in sys.modules, 'triton imported'; "
        "assert not torch.cuda.is_initialized(), 'CUDA initialised'"
    )
    src = str(Path(B.__file__).resolve().parents[2])  # this checkout's src/, first on the path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.triton
def test_kernels_interpret_even_if_triton_was_imported_first():
    # NOTE [Kernels under the interpreter]: triton imported before TRITON_INTERPRET is set (as when
    # another test imported it) must not leave compiled helpers inside interpreted kernels.
    pytest.importorskip("triton")
    code = (
        "import triton, torch\n"
        "from tests.kernels._kern_helpers import interpreted\n"
        "import importlib\nfrom slimgrad.ops import _output_act\n"
        "gelu = importlib.import_module('slimgrad.ops.gelu')\n"
        "with interpreted('gelu', 'dropout', 'layer_norm', 'linear_cross_entropy') as K:\n"
        "    x = torch.randn(300)\n"
        "    y, bits, idx, xs = K.gelu._fwd_triton(x)\n"
        "    r = _output_act.smooth_fwd(gelu.SPECS['none'], x, gelu._fwd_torch)\n"
        "    assert torch.equal(bits, r[1])\n"
        "    assert torch.equal(idx.sort().values, r[2].sort().values)\n"
        "    out, b = K.dropout._fwd_triton(x, 0.5)\n"
        "    K.layer_norm._fwd_triton(x.view(10, 30), [30], None, None, 1e-5)\n"
        "    K.linear_cross_entropy.ce_fwd_chunk(x.view(10, 30), torch.zeros(10).long(), -1, 0.1)\n"
    )
    root = Path(__file__).resolve().parents[2]
    src = str(Path(B.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(root)])}
    env.pop("TRITON_INTERPRET", None)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root)


@pytest.mark.triton
def test_bench_script_smoke():
    # the GPU bandwidth benchmark's plumbing, on CPU under the interpreter (no timings)
    pytest.importorskip("triton")
    src = str(Path(B.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "slimgrad.bench.kernels",  # moved out of kernels/ (issue 15, the house)
        "--smoke",
        "--only",
        "gelu,dropout,rms,ce,inplace",
    ]
    out = subprocess.run(cmd, check=True, env=env, capture_output=True, text=True).stdout
    assert out.count("smoke ok") == 6, out


def test_auto_false_needs_an_explicit_triton(monkeypatch):
    monkeypatch.setitem(B._found, "triton", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.ones(2)
    assert not B.use_triton(x, auto=False)
    assert B.use_triton(x, backend="triton", auto=False)


def test_compiled_code_takes_the_torch_path(monkeypatch):
    monkeypatch.setitem(B._found, "triton", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen = []

    def f(x):
        seen.append(B.use_triton(x, backend="triton"))
        return x + 1

    torch.compile(f, backend="eager", fullgraph=False)(torch.ones(3))
    assert seen == [False]
    monkeypatch.setenv(B.ENV_VAR, "triton")  # no graph break on the env var / config either
    out = torch.compile(
        lambda x: x * 2 if B.use_triton(x) else x + 1, backend="eager", fullgraph=True
    )(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 2.0))


@pytest.mark.triton
def test_kernels_compile_for_sm90_without_a_gpu():
    # the real compiler (TTIR -> cubin, triton's bundled ptxas), one variant per kernel; the full
    # set of constexpr variants: `python -m slimgrad.kernels._compile_check`
    pytest.importorskip("triton")
    src = str(Path(B.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "slimgrad.kernels._compile_check", "--quick"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("ok ") == 11 and "FAIL" not in r.stdout, r.stdout
