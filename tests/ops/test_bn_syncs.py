"""Host syncs of BatchNorm and In-Place ABN per training step (NOTE [Decided once per parameter
version] in slimgrad/_math/abn.py; NOTE [Host syncs] in slimgrad/testing.py).

Which channels cannot be rebuilt from the output depends on γ and β only; it was read from the
device on every call (converted ResNet-50, 2x3x32x32, SGD steps: 33 reads of ``bool(ok.all())``
plus ~30 ``nonzero`` per step; ResNet-50 with In-Place ABN: 16 + 14, and 14 ``tolist`` in
backward). Now: no sync at the dispatcher, and one device read per step (ParamChannels.reads: the
first BatchNorm after the optimizer step decides every layer), none while the parameters do not
change.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from slimgrad.bench.harness import get_case
from slimgrad.convert_handlers.cnn import convert_cnn_
from slimgrad.testing import count_host_syncs

_abn = importlib.import_module("slimgrad._math.abn")
_bn = importlib.import_module("slimgrad.ops.batch_norm")
_iabn = importlib.import_module("slimgrad.ops.inplace_abn")
CASES = ("resnet50", "resnet50_inplace_abn")


def _reads() -> int:
    return _abn._SIDE.reads + _bn._BAD.reads


def per_step(case: str) -> list[tuple[int, int]]:
    """(dispatcher syncs, device reads) of three steps after a first (warm-up) step: an SGD step,
    then two without one (the first still sees the parameters the last SGD step changed). The
    16x16 crop leaves every InPlaceABN at <= 32 values per channel, where a training call is
    eager's BatchNorm (NOTE [Few values per channel in InPlaceABN]): its own path is counted at
    any count here."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_iabn, "_MAX_FEW", 0)
        return _per_step(case)


def _per_step(case: str) -> list[tuple[int, int]]:
    torch.manual_seed(0)
    _, slim, make_inputs = get_case(case).build(torch.device("cpu"), torch.float32, small=True)
    opt = torch.optim.SGD(slim.parameters(), lr=0.05, momentum=0.9)
    x, y = make_inputs()
    x = x[:, :, :16, :16].contiguous()
    out = []
    for optimizer in (True, True, False, False):
        before = _reads()
        with count_host_syncs() as syncs:
            slim(x, y).backward()
            if optimizer:
                opt.step()
            opt.zero_grad()
        out.append((sum(syncs.values()), _reads() - before))
    return out[1:]


EXPECTED = [(0, 1), (0, 1), (0, 0)]


@pytest.mark.parametrize("case", CASES)
def test_one_read_per_parameter_update(case):
    assert per_step(case) == EXPECTED


# What the Triton row below reaches with the backend set to "triton", as CUDA reaches it:
# BatchNorm has no Triton kernel (a plain BatchNorm backward takes its PyTorch path, as on CUDA,
# not the C kernels the other rows run on CPU); InPlaceABN's backward is its Triton wrapper (its
# forward is eager's batch_norm kernel eagerly: NOTE [Same forward as eager] in
# ops/inplace_abn.py), and the LeakyReLU after the residual sum is leaky_relu's (in place).
# ResNet-50's ReLUs after a BatchNorm compute from the kept output with aten's ops; the one after
# the residual sum is torch.relu_ (no Triton code on any backend: the row counts the PyTorch
# paths CUDA runs).
TRITON_CALLED = {
    "resnet50": [],
    "resnet50_inplace_abn": [
        "inplace_abn._bwd_triton",
        "leaky_relu._bwd_triton",
        "leaky_relu._fwd_triton_",
    ],
}
TRITON_LAUNCHED = {
    "resnet50": [],
    "resnet50_inplace_abn": [
        "_output_act._mono_bwd_kernel",
        "_output_act._mono_fwd_kernel",
        "inplace_abn._dx_kernel",
        "inplace_abn._reduce_kernel",
    ],
}


def _triton_counts(mp: pytest.MonkeyPatch) -> dict:
    # per case, the counts, the Triton entry points the ops called (the functions they read from
    # slimgrad.kernels.<stem> through _backend.kernels) and the kernels launched
    import functools
    import inspect

    from triton.runtime.interpreter import InterpretedFunction

    import slimgrad.bench.models as models
    from slimgrad.kernels import _backend

    # the interpreter's time grows with the channels: the same two-stage ResNet at a quarter of
    # the width (4 to 32 channels), the same layers and so the same counts
    mp.setattr(models, "resnet_small", functools.partial(models.resnet_small, width=4))
    called: set[str] = set()
    launched: set[str] = set()
    kernels, run = _backend.kernels, InterpretedFunction.run

    def counted(name, f):
        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            called.add(name)
            return f(*args, **kwargs)

        return wrapper

    wrapped: set[str] = set()

    def counting_kernels(stem):
        mod = kernels(stem)
        if stem not in wrapped:
            wrapped.add(stem)
            for name, f in list(vars(mod).items()):
                if ("_triton" in name or name == "apply_") and inspect.isfunction(f):
                    mp.setattr(mod, name, counted(f"{stem}.{name}", f))
        return mod

    def counting_run(self, *args, **kwargs):
        launched.add(f"{self.fn.__module__.rpartition('.')[2]}.{self.fn.__name__}")
        return run(self, *args, **kwargs)

    mp.setattr(_backend, "kernels", counting_kernels)
    mp.setattr(InterpretedFunction, "run", counting_run)
    out = {}
    for case in CASES:
        called.clear()
        launched.clear()
        out[case] = (per_step(case), sorted(called), sorted(launched))
    return out


@pytest.mark.triton
def test_triton_backend_same_counts(monkeypatch):
    # the Triton wrappers' Python code as on CUDA, under the interpreter (in this process: the
    # backend is read per call, and the kernel modules are imported anew with TRITON_INTERPRET=1,
    # tests/kernels/_kern_helpers.interpreted); the names of the wrappers and kernels that ran
    # are compared, so a change of routing that skips them fails here (a stem other than these
    # two shows in the names as well)
    pytest.importorskip("triton")
    from slimgrad.kernels import _backend
    from tests.kernels._kern_helpers import interpreted

    with interpreted("inplace_abn", "leaky_relu"), _backend.set_backend("triton"):
        got = _triton_counts(monkeypatch)
    assert got == {c: (EXPECTED, TRITON_CALLED[c], TRITON_LAUNCHED[c]) for c in CASES}


def _bn_relu(c=5):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.BatchNorm2d(c), torch.nn.ReLU())
    torch.nn.init.uniform_(m[0].weight, 0.5, 1.5)
    return m


def _copy(m):
    return convert_cnn_(copy.deepcopy(m))


def _grads(m, x):
    m.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    (m(x) * torch.linspace(-1, 1, x.numel(), dtype=x.dtype).view(x.shape)).sum().backward()
    return [x.grad, m[0].weight.grad, m[0].bias.grad]


def test_decision_follows_an_inplace_change_of_gamma():
    # a channel made bad (γ = 0) between steps keeps its input: the cached decision is dropped
    eager = _bn_relu().double()
    slim = _copy(eager)
    x = torch.randn(3, 5, 4, 4, dtype=torch.float64)
    for a, b in zip(_grads(slim, x), _grads(eager, x), strict=True):
        torch.testing.assert_close(a, b)
    reads = _bn._BAD.reads
    for m in (eager, slim):
        with torch.no_grad():
            m[0].weight[2] = 0.0
    for a, b in zip(_grads(slim, x), _grads(eager, x), strict=True):
        torch.testing.assert_close(a, b)
    assert _bn._BAD.reads == reads + 1
    y = slim(x)
    assert y.grad_fn.next_functions[0][0].bad.tolist() == [2]


_OURS = ("_math/abn.py", "ops/batch_norm.py", "ops/inplace_abn.py", "kernels/inplace_abn.py")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", CASES)
def test_cuda_syncs_per_step(case):
    # on the device: torch's sync debug mode warns at every synchronizing CUDA call; those raised
    # from these files are the one read per parameter update (others are reported, not judged)
    import warnings

    torch.manual_seed(0)
    dev = torch.device("cuda")
    _, slim, make_inputs = get_case(case).build(dev, torch.float32, small=True)
    opt = torch.optim.SGD(slim.parameters(), lr=0.05, momentum=0.9)
    x, y = make_inputs()
    ours, others = [], []
    for i, optimizer in enumerate((True, True, False, False)):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                slim(x, y).backward()
                if optimizer:
                    opt.step()
                opt.zero_grad()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        mine = [w for w in syncs if w.filename.replace("\\", "/").endswith(_OURS)]
        if i:
            ours.append(len(mine))
            others.append(sorted({f"{w.filename}:{w.lineno}" for w in syncs if w not in mine}))
    print(case, "syncs from BatchNorm/ABN per step", ours, "elsewhere", others)
    # at most the one read per parameter update, none while the parameters do not change (H200,
    # torch 2.11: resnet50_inplace_abn [1, 1, 0]; resnet50 [0, 0, 0], no synchronizing call at all)
    assert all(n <= 1 for n in ours[:2]) and ours[2] == 0, (ours, others)
