"""Backend choice (slimgrad.kernels._backend): auto / torch / triton, env var, lazy imports."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from slimgrad.kernels import _backend as B
from tests._child import run_checks


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


# The checks that need a fresh interpreter run in one child (tests/_child.py), in this order:
# import slimgrad imports neither triton nor CUDA; the real compiler (one variant per kernel, then
# In-Place ABN's ELU kernels), before anything runs under the interpreter (kernel modules
# decorated under the interpreter stay bound as attributes of slimgrad.kernels once imported, and
# the compiler would be handed those); triton imported before TRITON_INTERPRET is set (here with
# the kernel modules already imported for the compiler, which the interpreted run must not
# reuse); then the GPU benchmark's smoke run, which sets the flag and drops the kernel modules
# itself.
_CHECK_IMPORTS = """
    import sys, torch; import slimgrad, slimgrad.kernels._backend as b
    b.use_triton(torch.ones(1)); b.triton_available()
    assert 'triton' not in sys.modules, 'triton imported'
    assert not torch.cuda.is_initialized(), 'CUDA initialised'
"""

# NOTE [Kernels under the interpreter]: triton imported before TRITON_INTERPRET is set (as when
# another test imported it) must not leave compiled helpers inside interpreted kernels.
_CHECK_INTERPRET_AFTER_TRITON = """
    import triton, torch
    from tests.kernels._kern_helpers import interpreted
    import importlib
    from slimgrad.ops import _output_act
    gelu = importlib.import_module('slimgrad.ops.gelu')
    with interpreted('gelu', 'dropout', 'layer_norm', 'linear_cross_entropy') as K:
        x = torch.randn(300)
        y, bits, idx, xs = K.gelu._fwd_triton(x)
        r = _output_act.smooth_fwd(gelu.SPECS['none'], x, gelu._fwd_torch)
        assert torch.equal(bits, r[1])
        assert torch.equal(idx.sort().values, r[2].sort().values)
        out, b = K.dropout._fwd_triton(x, 0.5)
        K.layer_norm._fwd_triton(x.view(10, 30), [30], None, None, 1e-5)
        K.linear_cross_entropy.ce_fwd_chunk(x.view(10, 30), torch.zeros(10).long(), -1, 0.1)
"""

# the real compiler (TTIR -> cubin, triton's bundled ptxas), one variant per kernel; the full set
# of constexpr variants: `python -m slimgrad.kernels._compile_check`
_CHECK_COMPILE_SM90 = """
    import contextlib, io
    from slimgrad.kernels import _compile_check
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = _compile_check.main(["--quick"])
    out = buf.getvalue()
    assert rc == 0 and out.count("ok ") == 11 and "FAIL" not in out, out
"""

# In-Place ABN's kernels by the real compiler, ELU (the largest code path) in float32 and a
# 16-bit dtype: the interpreter accepts code the compiler rejects (a float64 literal once made the
# ELU reduction's loop-carried sums change type)
_CHECK_COMPILE_INPLACE_ABN = """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from slimgrad.kernels import inplace_abn as K
    st = lambda *names: {n: "i32" for n in names}
    done = []
    for act, dt in ((2, "fp32"), (2, "bf16")):  # ELU: a superset of the other activations' code
        sigs = {
            K._apply_kernel: {"x_ptr": f"*{dt}", "scale_ptr": "*fp32", "shift_ptr": "*fp32",
                              **st("S", "NS", "sN", "sC", "sS"), "param": "fp32"},
            K._reduce_kernel: {"z_ptr": f"*{dt}", "dz_ptr": f"*{dt}", "mean_ptr": "*fp32",
                               "invstd_ptr": "*fp32", "sdy_ptr": "*fp64", "sdyx_ptr": "*fp64",
                               **st("S", "NS", "PER", "zN", "zC", "zS", "gN", "gC", "gS"),
                               "param": "fp32"},
            K._dx_kernel: {"z_ptr": f"*{dt}", "dz_ptr": f"*{dt}", "dx_ptr": f"*{dt}",
                           "k_ptr": "*fp32", "p_ptr": "*fp32", "q_ptr": "*fp32",
                           **st("S", "NS", "zN", "zC", "zS", "gN", "gC", "gS", "xN", "xC",
                                "xS"), "param": "fp32"},
        }
        for fn, sig in sigs.items():
            const = {"ACT": act, "BLOCK": K._BLOCK}
            src = ASTSource(fn=fn, signature={**sig, "ACT": "constexpr", "BLOCK": "constexpr"},
                            constexprs=const)
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32))
            assert k.asm.get("cubin"), fn
            done.append((fn.__name__, act, dt))
    assert len(done) == 6, done
    # this compiled-mode module stays imported: the smoke check after it must not run it
"""

# the GPU bandwidth benchmark's plumbing, on CPU under the interpreter (no timings); its main()
# sets TRITON_INTERPRET and drops the kernel modules itself (python -m slimgrad.bench.kernels)
_CHECK_BENCH_SMOKE = """
    import contextlib, io
    from slimgrad.bench.kernels import main  # moved out of kernels/ (issue 15, the house)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["--smoke", "--only", "gelu,dropout,rms,ce,inplace"])
    out = buf.getvalue()
    assert rc == 0 and out.count("smoke ok") == 6, out
"""

_CHILD_ENV = {"TRITON_INTERPRET": None, B.ENV_VAR: None, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def first_child():
    checks = {"imports": _CHECK_IMPORTS}
    if importlib.util.find_spec("triton") is not None:
        checks["compile"] = _CHECK_COMPILE_SM90
        checks["compile_inplace_abn"] = _CHECK_COMPILE_INPLACE_ABN
        checks["interpret_after_triton"] = _CHECK_INTERPRET_AFTER_TRITON
        checks["smoke"] = _CHECK_BENCH_SMOKE
    return run_checks(checks, env=_CHILD_ENV)


def test_import_slimgrad_and_backend_import_neither_triton_nor_cuda(first_child):
    assert first_child["imports"] == "ok", first_child["imports"]


@pytest.mark.triton
def test_inplace_abn_kernels_compile_for_sm90(first_child):
    pytest.importorskip("triton")
    res = first_child["compile_inplace_abn"]
    assert res == "ok", res


@pytest.mark.triton
def test_kernels_interpret_even_if_triton_was_imported_first(first_child):
    pytest.importorskip("triton")
    res = first_child["interpret_after_triton"]
    assert res == "ok", res


@pytest.mark.triton
def test_bench_script_smoke(first_child):
    pytest.importorskip("triton")
    assert first_child["smoke"] == "ok", first_child["smoke"]


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
def test_kernels_compile_for_sm90_without_a_gpu(first_child):
    pytest.importorskip("triton")
    assert first_child["compile"] == "ok", first_child["compile"]
