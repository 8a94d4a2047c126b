"""The HF Llama RMSNorm's C++ node (NOTE [The RMSNorm node in C++] in slimgrad/ops/rms_norm.py)
against the Python Function it stands in for: the same bits, saved tensors, ops and ownership
answers (NOTE [dy's ownership asked by the C++ node] in slimgrad/_ext/norm_node.cpp).

Each comparison runs the same code twice, once with the node and once with ``_EXT_NODE`` None
(the Python Function), and checks which one ran, so a comparison cannot pass by running the same
path twice.
"""

from __future__ import annotations

import contextlib
import copy
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import slimgrad
import slimgrad.ops.rms_norm  # noqa: F401  (the module, not the function of the same name)
from slimgrad import _ext, ownership
from slimgrad.ops.rms_norm import hf_rms_norm
from tests import test_ownership as own_cases
from tests._ownership_helpers import reuse_on  # noqa: F401  (autouse)

R = sys.modules["slimgrad.ops.rms_norm"]

pytestmark = pytest.mark.skipif(not _ext.available(), reason="needs slimgrad's C++ extension")

NODE = "HFRMSNormNode"
PY = "_HFRMSNormFromOutputFnBackward"


@pytest.fixture
def node_on():
    assert R._EXT_NODE is not None
    return R._EXT_NODE


@contextlib.contextmanager
def _path(use_node: bool):
    real = R._EXT_NODE
    R._EXT_NODE = real if use_node else None
    try:
        yield
    finally:
        R._EXT_NODE = real


class _Norm:
    """``fn_cls`` for the ownership cases: the Llama RMSNorm over the last dim, its weights kept
    (their gradients compared too) and the node names seen."""

    weights: list = []
    names: list = []

    @classmethod
    def apply(cls, t):
        g = torch.Generator().manual_seed(7 + t.shape[-1])
        w = torch.nn.Parameter(torch.randn(t.shape[-1], generator=g))
        cls.weights.append(w)
        y = hf_rms_norm(t, w, 1e-6, "llama")
        cls.names.append(y.grad_fn.name())
        return y


def _both(run, *args, node=True):
    # node=False: a case where the node is never made (saved-tensor hooks: checkpoint)
    out = {}
    for use in (True, False):
        _Norm.weights, _Norm.names = [], []
        with _path(use):
            res = run(*args)
        names = set(_Norm.names)
        assert names and all((NODE in n) == (use and node) for n in names), names
        wg = [w.grad for w in _Norm.weights]
        out[use] = (res, wg)
    return out[True], out[False]


def _same(a, b):
    (ra, na), wa = a
    (rb, nb), wb = b
    own_cases._assert_bitwise(ra, rb)
    assert len(wa) == len(wb)
    for x, y in zip(wa, wb, strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y)
    assert na == nb, f"reuse granted: node {na}, Python {nb}"


@pytest.mark.parametrize(
    "name", [n for n in own_cases.SAFE + own_cases.UNSAFE + own_cases.CONSERVATIVE]
)
def test_ownership_case_same_answer_and_bits(name, node_on):
    # create_graph: the second derivatives, the same on both paths (NOTE [RMSNorm's second
    # derivatives through its own node] in ops/rms_norm.py)
    a, b = _both(own_cases._run, name, _Norm)
    _same(a, b)


@pytest.mark.parametrize(
    "name",
    list(own_cases.VIEW_GRANTED) + own_cases.VIEW_REFUSED_UNSAFE + own_cases.VIEW_REFUSED_SAFE,
)
def test_view_case_same_answer_and_bits(name, node_on):
    a, b = _both(own_cases._view_run, name, _Norm, node=name != "checkpoint")
    _same(a, b)


def test_grants_counted_and_switched_off(node_on, monkeypatch):
    def run():
        ownership.reset_reuse_count()
        out, n = own_cases._run("plain_chain", _Norm)
        return n

    with _path(True):
        assert run() == 1  # the node's grant shows in reuse_count("grad")
        with ownership.reuse_disabled():
            assert run() == 0
        assert run() == 1
        monkeypatch.setenv("SLIMGRAD_NO_REUSE", "1")
        assert run() == 0
        monkeypatch.setenv("SLIMGRAD_NO_REUSE", " Off ")
        assert run() == 1


def _llama(layers=2):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=170, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 1000, (2, 16))
    return model, ids


def _step(model, ids, ctx=contextlib.nullcontext, names=None, **kw):
    with ctx():
        loss = model(input_ids=ids, labels=ids, **kw).loss
    if names is not None:
        stack, seen = [loss.grad_fn], set()
        while stack:
            n = stack.pop()
            if n is None or id(n) in seen:
                continue
            seen.add(id(n))
            names.add(n.name())
            stack += [f for f, _ in n.next_functions]
    loss.backward()
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return loss.detach(), grads


def _compare_llama(prepare=None, ctx=contextlib.nullcontext, expect_node=True, **kw):
    model, ids = _llama()
    slim = slimgrad.convert_(copy.deepcopy(model))
    if prepare is not None:
        prepare(slim)
    res = {}
    for use in (True, False):
        names: set = set()
        ownership.reset_reuse_count()
        with _path(use):
            loss, grads = _step(slim, ids, ctx, names, **kw)
        res[use] = (loss, grads, ownership.reuse_count("grad"))
        assert any(NODE in n for n in names) == (use and expect_node), names
    (la, ga, na), (lb, gb, nb) = res[True], res[False]
    assert torch.equal(la, lb)
    assert ga.keys() == gb.keys()
    for k in ga:
        assert torch.equal(ga[k], gb[k]), k
    assert na == nb
    return res


def test_llama_step_bitwise(node_on):
    res = _compare_llama()
    assert res[True][2] > 0  # dy's buffer reused through the node


def test_llama_frozen_weights_bitwise(node_on):
    def freeze(m):
        for n, p in m.named_parameters():
            if "norm" in n:
                p.requires_grad_(False)

    _compare_llama(freeze)


def test_llama_zero_gamma_takes_the_python_function(node_on):
    def zero(m):
        with torch.no_grad():
            m.model.norm.weight[3] = 0.0  # a fallback channel: the Python Function keeps x's column
            m.model.layers[0].input_layernorm.weight[5] = 0.0

    res = _compare_llama(zero)
    assert res[True][2] == res[False][2]


def test_llama_under_autocast_bitwise(node_on):
    _compare_llama(ctx=lambda: torch.autocast("cpu", dtype=torch.bfloat16))


def test_llama_anomaly_mode_bitwise(node_on):
    _compare_llama(ctx=lambda: torch.autograd.detect_anomaly(check_nan=True))


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_layers_bitwise(node_on, reentrant):
    def checkpointed(m):
        m.gradient_checkpointing_enable({"use_reentrant": reentrant})
        m.train()

    _compare_llama(checkpointed)


def test_profiler_takes_the_python_function(node_on):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        _compare_llama(expect_node=False)


def test_saved_tensors_hooks_take_the_python_function(node_on):
    x0 = torch.randn(3, 5, 16)
    w0 = torch.randn(16)
    packed = {}
    for use in (True, False):
        seen = []

        def pack(t, seen=seen):
            seen.append((tuple(t.shape), t.dtype, t.untyped_storage().nbytes()))
            return t

        x = x0.clone().requires_grad_()
        w = torch.nn.Parameter(w0.clone())
        with _path(use), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = hf_rms_norm(x, w, 1e-6)
        # under saved-tensor hooks the node is not made: the Python Function (its packed tensors
        # are what slimgrad.memory's walk reads)
        assert y.grad_fn.name() == PY
        y.sum().backward()
        packed[use] = (seen, x.grad, w.grad)
    assert packed[True][0] == packed[False][0] == [((3, 5, 16), torch.float32, 240 * 4),
                                                    ((3, 5, 1), torch.float32, 15 * 4),
                                                    ((16,), torch.float32, 64)]  # fmt: skip
    assert torch.equal(packed[True][1], packed[False][1])
    assert torch.equal(packed[True][2], packed[False][2])


class _Log(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_forward_issues_the_python_functions_ops(node_on):
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(16))
    R._hf_node(x, w, 1e-6)  # the fallback-channel cache filled outside the log
    logs = []
    for use in (True, False):
        with _Log() as log:
            if use:  # the node's entry itself: hf_rms_norm under a mode takes the Function
                y = node_on(x, w, 1e-6, R._norms.CHUNK_ELEMS)
            else:
                y = R._HF_RMS_APPLY(x, w, 1e-6, "llama", True)[0]
        assert (NODE in y.grad_fn.name()) == use
        logs.append(log.ops)
    assert logs[0] == logs[1], logs


def test_backward_under_a_mode_runs_the_python_tail(node_on):
    # a dispatch mode entered between forward and backward (slimgrad.memory measures a backward
    # alone): the node's backward runs the Python Function's tail, the same ops and bits
    x0, w0 = torch.randn(6, 16), torch.randn(16)
    out = {}
    for use in (True, False):
        x = x0.clone().requires_grad_()
        w = torch.nn.Parameter(w0.clone())
        with _path(use):
            y = hf_rms_norm(x * 1, w, 1e-6)
        assert (NODE in y.grad_fn.name()) == use
        with _Log() as log:
            (y * 3).sum().backward()
        out[use] = (log.ops, x.grad, w.grad)
    assert out[True][0] == out[False][0]
    assert torch.equal(out[True][1], out[False][1]) and torch.equal(out[True][2], out[False][2])


def test_noncontiguous_gradient_takes_the_python_tail(node_on):
    x0, w0 = torch.randn(8, 16), torch.randn(16)
    out = {}
    for use in (True, False):
        x = x0.clone().requires_grad_()
        w = torch.nn.Parameter(w0.clone())
        with _path(use):
            y = hf_rms_norm(x, w, 1e-6)
        assert (NODE in y.grad_fn.name()) == use
        y.t().contiguous().sum(0).pow(2).sum().backward()  # dy: transposed
        out[use] = (x.grad, w.grad)
    assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1])


@pytest.mark.parametrize("wrt", ["x", "w", "both"])
def test_gradient_subsets_bitwise(node_on, wrt):
    # autograd.grad of a subset: the node computes what the Python Function computes (its
    # needs_input_grad is requires_grad at forward, not the subset asked)
    x0, w0 = torch.randn(6, 16), torch.randn(16)
    out = {}
    for use in (True, False):
        x = x0.clone().requires_grad_()
        w = torch.nn.Parameter(w0.clone())
        with _path(use):
            y = hf_rms_norm(x * 1, w, 1e-6)
        assert (NODE in y.grad_fn.name()) == use
        inputs = {"x": [x], "w": [w], "both": [x, w]}[wrt]
        out[use] = torch.autograd.grad((y * y.detach().flip(0)).sum(), inputs)
    for a, b in zip(out[True], out[False], strict=True):
        assert torch.equal(a, b)


def test_large_input_takes_the_python_function(node_on):
    # more rows than one chunk of rms_norm_bwd_torch: the chunked Python body
    x = torch.randn(R._norms.CHUNK_ELEMS // 16 + 64, 16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(16))
    assert node_on(x, w, 1e-6, R._norms.CHUNK_ELEMS) is None
    assert hf_rms_norm(x, w, 1e-6).grad_fn.name() == PY


def test_entry_refuses_what_it_does_not_cover(node_on):
    w = torch.nn.Parameter(torch.randn(16))
    x = torch.randn(4, 16, requires_grad=True)
    c = R._norms.CHUNK_ELEMS
    assert node_on(x, w, 1e-6, c) is not None
    assert node_on(x.detach().view(2, 2, 16).transpose(0, 1), w, 1e-6, c) is not None
    assert node_on(x.double(), w.double(), 1e-6, c) is None
    assert node_on(x, w.bfloat16(), 1e-6, c) is None
    assert node_on(x, torch.randn(8), 1e-6, c) is None
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        dual = fwAD.make_dual(torch.randn(4, 16), torch.randn(4, 16))
        assert node_on(dual, w, 1e-6, c) is None


def test_memory_tracker_numbers_unchanged(node_on):
    from slimgrad import memory

    model, ids = _llama()
    slim = slimgrad.convert_(copy.deepcopy(model))
    got = {}
    for use in (True, False):
        with _path(use):
            r = memory.measure(lambda: slim(input_ids=ids, labels=ids).loss)
        for p in slim.parameters():
            p.grad = None
        got[use] = (r.saved_bytes, r.peak_bytes)
    assert got[True] == got[False]


@pytest.mark.parametrize("keep", [False, True], ids=["dropped", "kept"])
def test_storage_object_of_dy_same_answer(node_on, keep):
    # a hook asks for dy's storage object: dropped, PyTorch alone keeps it (granted, as
    # ownership.py's _storage_free); kept by the hook, refused
    def run():
        ownership.reset_reuse_count()
        kept = []
        x = torch.randn(5, 16, generator=torch.Generator().manual_seed(3)).requires_grad_()
        w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 16))
        _Norm.names.append(hf_rms_norm(x, w, 1e-6).grad_fn.name())
        y = hf_rms_norm(x * 1.5, w, 1e-6)
        _Norm.names.append(y.grad_fn.name())
        y.register_hook(lambda g: kept.append(g.untyped_storage()) if keep else None)
        y.register_hook(lambda g: g.untyped_storage().nbytes() and None)
        (y * 3).sum().backward()
        return {"x.grad": x.grad, "w.grad": w.grad}, ownership.reuse_count("grad")

    a, b = _both(run)
    _same(a, b)
    assert a[0][1] == (0 if keep else 1)


def test_output_modified_in_place_raises_on_both_paths(node_on):
    msgs = []
    for use in (True, False):
        x = torch.randn(4, 16, requires_grad=True)
        w = torch.nn.Parameter(torch.randn(16))
        with _path(use):
            y = hf_rms_norm(x * 1, w, 1e-6)
        assert (NODE in y.grad_fn.name()) == use
        y2 = y * 1
        y.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (y2 * y2).sum().backward()
        msgs.append(True)
    assert msgs == [True, True]


def test_graph_walk_sees_the_nodes_saved_tensors(node_on):
    # slimgrad.memory's graph walk (NOTE [How saved bytes are counted]) outside any mode: the
    # node's saved tensors are the Function's (y, rstd, the weight), freed after backward
    from slimgrad.memory import _storage, _walk_savers

    x0, w0 = torch.randn(3, 7, 17), torch.randn(17)
    kept = {}
    for use in (True, False):
        x = x0.clone().requires_grad_()
        w = torch.nn.Parameter(w0.clone())
        with _path(use):
            y = hf_rms_norm(x, w, 1e-6)
        assert (NODE in y.grad_fn.name()) == use
        found = _walk_savers([y.grad_fn])
        kept[use] = sorted(_storage(t).nbytes() for t, _ in found.values())
        y.sum().backward()
        assert _walk_savers([y.grad_fn]) == {}
    assert kept[True] == kept[False] == [17 * 4, 21 * 4, 21 * 17 * 4]
