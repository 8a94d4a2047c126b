"""slimgrad._library.custom_op: the direct eager call and when it is not taken (NOTE [Calling a
custom op eagerly] in src/slimgrad/_library.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from slimgrad import _ext
from slimgrad._library import SlimOp, custom_op, python_impl

_RUNS: list[str] = []


@custom_op("_test_library_scale", mutates_args=())
def _scale(x: torch.Tensor, k: float) -> torch.Tensor:
    _RUNS.append("impl")
    return x * k


@_scale.register_fake
def _(x, k):
    return torch.empty_like(x)


@custom_op("_test_library_raw_add_", mutates_args=("x",))
def _raw_add_(x: torch.Tensor, k: float) -> None:
    # a write autograd cannot see (``.data`` has a version counter of its own), as a Triton
    # kernel's store through a pointer
    x.data.add_(k)


@_raw_add_.register_fake
def _(x, k):
    return None


class _Seen(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def spy(monkeypatch):
    # counts the calls that go through the registered op (the dispatcher)
    calls: list[int] = []
    registered = _scale._def

    def through_dispatcher(*args, **kwargs):
        calls.append(1)
        return registered(*args, **kwargs)

    monkeypatch.setattr(_scale, "_def", through_dispatcher)
    _RUNS.clear()
    return calls


def test_custom_op_returns_slim_op_with_registered_def():
    assert isinstance(_scale, SlimOp)
    assert python_impl("slimgrad::_test_library_scale") is not None
    assert _scale._opoverload is torch.ops.slimgrad._test_library_scale.default


def test_eager_plain_tensors_call_the_python_impl_directly(spy):
    x = torch.randn(5)
    torch.testing.assert_close(_scale(x, 2.0), x * 2.0, rtol=0, atol=0)
    assert spy == [] and _RUNS == ["impl"]
    p = torch.nn.Parameter(torch.randn(3))
    with torch.no_grad():
        _scale(p, 2.0)
    assert spy == []


@pytest.mark.parametrize(
    "case", ["dispatch_mode", "fake", "meta", "grad", "function_mode", "no_grad"]
)
def test_registered_op_where_something_could_tell(spy, case):
    x = torch.randn(4)
    if case == "dispatch_mode":
        with _Seen() as mode:
            _scale(x, 3.0)
        assert "slimgrad._test_library_scale.default" in mode.ops
    elif case == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as fm:
            _scale(fm.from_tensor(x), 3.0)
    elif case == "meta":
        assert _scale(x.to("meta"), 3.0).is_meta
    elif case == "grad":  # autograd must see the op (its kernel decides what to do)
        _scale(x.requires_grad_(), 3.0)
    elif case == "function_mode":
        with torch.device("cpu"):  # a TorchFunctionMode
            _scale(x, 3.0)
    elif case == "no_grad":  # requires_grad under no_grad: nothing to record, direct
        x.requires_grad_()
        with torch.no_grad():
            _scale(x, 3.0)
        assert spy == []
        return
    assert spy == [1]


def test_compile_traces_the_registered_op():
    seen: list[str] = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    f = torch.compile(lambda x: _scale(x, 2.0) + 1, backend=backend, fullgraph=True)
    x = torch.randn(3)
    torch.testing.assert_close(f(x), x * 2.0 + 1, rtol=0, atol=0)
    assert "slimgrad._test_library_scale.default" in seen


@pytest.mark.parametrize("through", ["direct", "dispatcher"])
def test_mutated_args_get_their_version_bumped(through):
    x = torch.randn(4, requires_grad=True)
    h = x * 1  # a non-leaf that exp saves (its output) for backward
    y = h.exp()
    v = y._version
    with torch.no_grad():  # as inside an autograd Function: the direct call is taken
        if through == "dispatcher":
            with _Seen():
                _raw_add_(y, 1.0)
        else:
            _raw_add_(y, 1.0)
    assert y._version > v
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_real_op_direct_matches_dispatcher():
    # a slimgrad op's outputs are the same whichever way it is called
    from slimgrad.ops.layer_norm import _layer_norm_fwd

    torch.manual_seed(0)
    x, w, b = torch.randn(3, 7), torch.randn(7), torch.randn(7) * 3
    direct = _layer_norm_fwd(x, [7], w, b, 1e-5)
    with _Seen() as mode:
        registered = _layer_norm_fwd(x, [7], w, b, 1e-5)
    assert "slimgrad.layer_norm_fwd.default" in mode.ops
    for a, r in zip(direct, registered, strict=True):
        torch.testing.assert_close(a, r, rtol=0, atol=0)


def test_profiler_still_names_a_directly_called_op(spy):
    from torch.profiler import profile

    with profile() as prof:
        _scale(torch.randn(3), 2.0)
    assert spy == []
    assert "slimgrad::_test_library_scale" in {k.key for k in prof.key_averages()}


def test_straight_is_one_call_and_a_dynamo_constant():
    # NOTE [One-call gate]: straight reads the compile flag in place (no compiling() frame) and
    # Dynamo evaluates it once at trace time (no guard on the flag: a guard would fail at run
    # time, where the flag is False, and recompile per call)
    from slimgrad import _library
    from slimgrad._library import straight
    from tests._host_calls import slimgrad_calls

    assert straight() is True
    # without slimgrad's C++ extension: the gate's frame and torch's five C checks
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_library, "_watchers", None)
        assert straight() is True
        assert slimgrad_calls(straight, needs_ext=False) == 6
    # with it (loaded on the first ownership question): the gate's frame and one C call
    if _ext.load() is not None:
        assert _library._watchers is not None
        assert slimgrad_calls(straight) == 2
    with torch.profiler.profile():
        assert straight() is False
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    def f(x):
        return x + 1 if straight() else x - 1

    g = torch.compile(f, backend=backend)
    x = torch.zeros(3)
    for _ in range(3):
        torch.testing.assert_close(g(x), -torch.ones(3))
    assert len(frames) == 1
    torch.testing.assert_close(f(x), torch.ones(3))


def _torch_watchers() -> int:
    c = torch._C
    return (
        (1 if c._len_torch_dispatch_stack() else 0)
        | (2 if c._is_torch_function_mode_enabled() else 0)
        | (4 if c._are_functorch_transforms_active() else 0)
        | (8 if c._is_tracing() else 0)
        | (16 if c._autograd._profiler_enabled() else 0)
    )


def test_extension_watchers_are_torchs_own_checks():
    # NOTE [One-call gate]: the extension's watchers() reads the five C++ facts torch's Python
    # bindings return; each watcher on its own sets its bit, and straight() says the same with
    # and without the extension
    from torch.overrides import TorchFunctionMode

    from slimgrad import _library

    mod = _ext.load()
    if mod is None:
        pytest.skip(f"no C++ extension here: {_ext.error()}")
    seen = {}

    def check(name):
        got, want = mod.watchers(), _torch_watchers()
        fallback = _library._watchers
        _library._watchers = None
        try:
            python_answer = _library.straight()
        finally:
            _library._watchers = fallback
        assert got == want, name
        assert _library.straight() is python_answer is (got == 0), name
        seen[name] = seen.get(name, 0) | got  # jit.trace also runs the function untraced

    check("none")
    with _Seen():
        check("dispatch mode")
    with TorchFunctionMode():
        check("function mode")
    torch.func.vmap(lambda t: check("vmap") or t)(torch.ones(2, 3))

    def traced(t):
        check("jit trace")
        return t * 2

    torch.jit.trace(traced, torch.ones(2))
    with torch.profiler.profile():
        check("profiler")
    assert seen == {
        "none": 0,
        "dispatch mode": 1,
        "function mode": 2,
        "vmap": 4,
        "jit trace": 8,
        "profiler": 16,
    }
