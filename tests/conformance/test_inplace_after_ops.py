"""Conformance: whatever eager's output of a module takes, the converted module's output takes.

Issue 30: a converted ``nn.Linear`` returned, for 3-D and larger inputs, its 2-D product viewed in
the input's shape from inside its autograd Function, so every in-place write on it
(``ReLU(inplace=True)``, ``h += x``, ``h[0] = 0``) raised autograd's "Output 0 of _LinearFn is a
view and is being modified inplace" where eager trains; SiLU/GELU/Mish above 512 elements,
HF ``Conv1D``, ``linear_scale`` and ``linear_cross_entropy(reduction='none')`` did the same
(NOTE [Function outputs are not views] in ``slimgrad/ops/linear.py``).

Every row runs eager and converted side by side, 1-D to 4-D inputs where the module takes them,
train and eval, and compares what happens: the same outputs and gradients (assert_close), or the
same kind of error (a tensor saved by another op and then written: autograd's version error;
``resize_`` of a tensor that requires grad). Then each op's functional, 1-D to 5-D: its output is
no view of a tensor made inside its Function, an in-place write on it is taken, and backward gives
eager's gradients, or, where the op keeps its output for backward, autograd's version error.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D as HFConv1D

import slimgrad
import slimgrad.ops as sops
from slimgrad.convert_handlers import inplace_guard as _inplace_guard
from tests._threads import one_thread


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def _shapes(last: int) -> dict[int, tuple[int, ...]]:
    # channels last: (..., last); above 512 elements from 2-D on (the smooth activations' sparse
    # path, NOTE [Few elements])
    return {1: (last,), 2: (97, last), 3: (4, 29, last), 4: (2, 3, 17, last)}


# {name: (module builder, {input dim: input shape}, converts when a writer follows)}
MODULES = {
    "Linear": (lambda: nn.Linear(6, 5), _shapes(6), True),
    "Linear-nobias": (lambda: nn.Linear(6, 5, bias=False), _shapes(6), True),
    "Conv1D(HF)": (lambda: HFConv1D(5, 6), _shapes(6), True),
    "Conv1d": (lambda: nn.Conv1d(4, 3, 3), {2: (4, 9), 3: (2, 4, 9)}, True),
    "Conv2d": (lambda: nn.Conv2d(4, 3, 3), {3: (4, 6, 5), 4: (2, 4, 6, 5)}, True),
    "ConvTranspose1d": (lambda: nn.ConvTranspose1d(4, 3, 3), {2: (4, 9), 3: (2, 4, 9)}, True),
    "BatchNorm1d": (lambda: nn.BatchNorm1d(6), {2: (97, 6), 3: (5, 6, 29)}, True),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(6), {4: (2, 6, 9, 7)}, True),
    "Dropout": (lambda: nn.Dropout(0.3), _shapes(6), True),
    "ReLU": (lambda: nn.ReLU(), _shapes(6), True),  # eager keeps its output too
    "Sigmoid": (lambda: nn.Sigmoid(), _shapes(6), True),
    # keep their output where eager keeps the input: left eager when a writer follows (NOTE
    # [In-place writers after output-saving modules]); the rows check the pair behaves as eager
    "SiLU": (lambda: nn.SiLU(), _shapes(6), False),
    "GELU": (lambda: nn.GELU(), _shapes(6), False),
    "LayerNorm": (lambda: nn.LayerNorm(6), _shapes(6), False),
}


def _iadd(m, h):
    h += m.aux
    return h


def _setitem(m, h):
    h[0] = 0.0
    return h * m.aux


def _slice_mul(m, h):
    h[..., :1].mul_(3.0)
    return h * m.aux


def _retain_grad_hook(m, h):
    h.retain_grad()
    m.kept = h
    h.register_hook(lambda g: m.seen.append(g.clone()))
    return h * m.aux


def _saved_then_written(m, h):
    z = h * h  # mul keeps h: writing h afterwards must fail backward, as in eager
    h.add_(1.0)
    return z + h


def _resize(m, h):
    h.resize_(h.numel())
    return h


CONSUMERS = {
    "ReLU(inplace)": lambda m, h: m.relu(h) * m.aux,
    "SiLU(inplace)": lambda m, h: m.silu(h) * m.aux,
    "Dropout(inplace)": lambda m, h: m.drop(h) * m.aux,
    "iadd": _iadd,
    "setitem": _setitem,
    "slice.mul_": _slice_mul,
    "retain_grad+hook": _retain_grad_hook,
    "saved-then-written": _saved_then_written,
    "resize_": _resize,
}


class Probe(nn.Module):
    # the writers are children (torch.fx traces the forward: convert_'s in-place guard reads it)
    def __init__(self, op: nn.Module, how: str):
        super().__init__()
        self.op, self.how = op, how
        self.relu, self.silu = nn.ReLU(inplace=True), nn.SiLU(inplace=True)
        self.drop = nn.Dropout(0.3, inplace=True)
        self.aux = nn.Parameter(torch.tensor(0.75))
        self.seen: list[torch.Tensor] = []
        self.kept = None

    def forward(self, x):
        return CONSUMERS[self.how](self, self.op(x))


def _kind(err: RuntimeError) -> str:
    msg = str(err)
    for key in (
        "modified by an inplace operation",
        "cannot resize variables that require grad",
        "a leaf Variable that requires grad",  # eval dropout returns x: eager's "is being used"
    ):
        if key in msg:
            return key
    return msg  # anything else: the message itself (a converted-only error never matches)


def _outcome(model: Probe, x: torch.Tensor, no_grad: bool):
    x = x.clone().requires_grad_(not no_grad)
    model.seen.clear()
    torch.manual_seed(7)
    try:
        if no_grad:
            with torch.no_grad():
                y = model(x)
            y.mul_(2.0)  # after the no_grad region: a no_grad view would refuse this
            return "ok", [y]
        y = model(x)
        y.square().sum().backward()
    except RuntimeError as e:
        return "raised", _kind(e)
    grads = [p.grad for p in model.parameters()]
    kept = model.kept.grad if model.kept is not None else None
    return "ok", [y.detach(), x.grad, *grads, kept, *model.seen]


@functools.cache
def _converted(name: str, how: str, train: bool):
    # the pair does not depend on the input's dim: converted once per (module, consumer, mode),
    # never run; each row steps deep copies of both, a converted model that has run nothing, as
    # convert_ left it. With the global generator's state after the conversion, from which
    # the row draws its input
    make, _, converts = MODULES[name]
    torch.manual_seed(0)
    eager = Probe(make(), how).train(train)
    conv = slimgrad.convert_(copy.deepcopy(eager))
    ours = type(conv.op).__module__.startswith("slimgrad.")
    if converts:
        assert ours, slimgrad.report(conv)
    else:  # slimgrad's, or kept eager by the in-place guard with its reason (never silently)
        assert ours or _inplace_guard.kept_reason(conv.op), slimgrad.report(conv)
    return eager, conv, torch.get_rng_state()


def _compare(name: str, dim: int, how: str, train: bool, no_grad: bool = False):
    eager, conv, rng = _converted(name, how, train)
    eager, conv = copy.deepcopy(eager), copy.deepcopy(conv)
    x = torch.randn(*MODULES[name][1][dim], generator=torch.Generator().set_state(rng))
    got, want = _outcome(conv, x, no_grad), _outcome(eager, x, no_grad)
    assert got[0] == want[0], (name, dim, how, got, want)
    if got[0] == "raised":
        assert got[1] == want[1], (name, dim, how)
        return
    assert len(got[1]) == len(want[1])
    for a, b in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(a, b)


_ROWS = [(n, d) for n, (_, shapes, _) in MODULES.items() for d in shapes]


# The consumer rows: one per distinct code path. A row left out ran, train and eval, the same
# coverage arcs (slimgrad's source and this file's) as a kept row; every (module, dim) pair keeps
# a row. Left out that way: for the elementwise modules, Dropout, LayerNorm, the bias-free Linear
# and HF's Conv1D, every dim but the 1-D one with each consumer but ReLU(inplace) (the 1-D row
# takes their path); for Linear, the 3-D and 4-D rows that take the 2-D row's path; BatchNorm1d's
# 3-D rows that take the 2-D row's. The convolutions differ with each dim and consumer.
_EVERY = tuple(CONSUMERS)
_CONSUMER_ROWS = {
    ("Linear", 1): _EVERY,
    ("Linear", 2): _EVERY,
    ("Linear", 3): (
        "ReLU(inplace)",
        "Dropout(inplace)",
    ),
    ("Linear", 4): ("ReLU(inplace)",),
    ("Linear-nobias", 1): _EVERY,
    ("Linear-nobias", 2): ("ReLU(inplace)",),
    ("Linear-nobias", 3): ("ReLU(inplace)",),
    ("Linear-nobias", 4): ("ReLU(inplace)",),
    ("Conv1D(HF)", 1): _EVERY,
    ("Conv1D(HF)", 2): ("ReLU(inplace)",),
    ("Conv1D(HF)", 3): ("ReLU(inplace)",),
    ("Conv1D(HF)", 4): ("ReLU(inplace)",),
    ("Conv1d", 2): _EVERY,
    ("Conv1d", 3): _EVERY,
    ("Conv2d", 3): _EVERY,
    ("Conv2d", 4): _EVERY,
    ("ConvTranspose1d", 2): _EVERY,
    ("ConvTranspose1d", 3): _EVERY,
    ("BatchNorm1d", 2): _EVERY,
    ("BatchNorm1d", 3): (
        "ReLU(inplace)",
        "SiLU(inplace)",
    ),
    ("BatchNorm2d", 4): _EVERY,
    ("Dropout", 1): _EVERY,
    ("Dropout", 2): ("ReLU(inplace)",),
    ("Dropout", 3): ("ReLU(inplace)",),
    ("Dropout", 4): ("ReLU(inplace)",),
    ("ReLU", 1): _EVERY,
    ("ReLU", 2): ("ReLU(inplace)",),
    ("ReLU", 3): ("ReLU(inplace)",),
    ("ReLU", 4): ("ReLU(inplace)",),
    ("Sigmoid", 1): _EVERY,
    ("Sigmoid", 2): ("ReLU(inplace)",),
    ("Sigmoid", 3): ("ReLU(inplace)",),
    ("Sigmoid", 4): ("ReLU(inplace)",),
    ("SiLU", 1): _EVERY,
    ("SiLU", 2): ("ReLU(inplace)",),
    ("SiLU", 3): ("ReLU(inplace)",),
    ("SiLU", 4): ("ReLU(inplace)",),
    ("GELU", 1): _EVERY,
    ("GELU", 2): ("ReLU(inplace)",),
    ("GELU", 3): ("ReLU(inplace)",),
    ("GELU", 4): ("ReLU(inplace)",),
    ("LayerNorm", 1): _EVERY,
    ("LayerNorm", 2): ("ReLU(inplace)",),
    ("LayerNorm", 3): ("ReLU(inplace)",),
    ("LayerNorm", 4): ("ReLU(inplace)",),
}
_CASES = [(n, d, h) for (n, d), hows in _CONSUMER_ROWS.items() for h in hows]


@pytest.mark.parametrize(
    ("name", "dim", "how"), _CASES, ids=[f"{n}-{d}d-{h}" for n, d, h in _CASES]
)
def test_inplace_consumer_after_converted_module(name, dim, how):
    for train in (True, False):
        _compare(name, dim, how, train)


@pytest.mark.parametrize(("name", "dim"), _ROWS, ids=[f"{n}-{d}d" for n, d in _ROWS])
def test_output_made_under_no_grad_takes_a_later_inplace_write(name, dim):
    _compare(name, dim, "iadd", False, no_grad=True)


def test_linear_then_inplace_relu_reported_case():
    # the first example: Linear -> ReLU(inplace=True) on a 3-D batch, bit for bit
    torch.manual_seed(1)
    eager = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 3))
    conv = slimgrad.convert_(copy.deepcopy(eager))
    assert type(conv[0]) is slimgrad.nn.Linear
    x = torch.randn(2, 5, 8)
    outs = []
    for m in (conv, eager):
        y = m(x)
        y.square().sum().backward()
        outs.append([y, *(p.grad for p in m.parameters())])
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---- every op's functional: the output a Function returns is no view of its own tensors -----


def _w(*s):
    return torch.randn(*s, requires_grad=True)


def _last(d: int) -> list[tuple[int, ...]]:
    # (..., 8): a small input and one above 512 elements (the smooth activations' sparse path, NOTE
    # [Few elements]); 1-D: the features only
    small = (3, 5, 7, 2)[: d - 1] + (8,)
    return [small] if d == 1 else [small, (small[0] * 40, *small[1:])]


def _elementwise(d: int) -> list[tuple[int, ...]]:
    return [(8,), (608,)] if d == 1 else _last(d)


def _batch_first(d: int) -> list[tuple[int, ...]]:
    small = (6, 8, 9, 5, 3)[:d]
    return [small, (small[0] * 20, *small[1:])] if d >= 2 else []


# {name: (input shapes for dim d, slimgrad op, eager op, keeps its output)}
W5, B5, G5 = _w(5, 8), _w(5), _w(5)
WT, W7, WU, WD = _w(8, 5), _w(7, 8), _w(7, 8), _w(8, 7)
C8 = (_w(8), _w(8))
_W3, B4 = _w(4, 8, 3), _w(4)
FUNCTIONALS = {
    "linear": (_last, lambda x: sops.linear(x, W5, B5), lambda x: F.linear(x, W5, B5), False),
    "linear-nobias": (_last, lambda x: sops.linear(x, W5), lambda x: F.linear(x, W5), False),
    "conv1d_addmm": (
        _last,
        lambda x: sops.conv1d_addmm(x, WT, B5),
        # HF Conv1D's own formula (addmm: the bias is added inside the product, not after it)
        lambda x: torch.addmm(B5, x.reshape(-1, 8), WT).reshape(*x.shape[:-1], 5),
        False,
    ),
    "linear_scale": (
        _last,
        lambda x: sops.linear_scale(x, W5, B5, G5),
        lambda x: F.linear(x, W5, B5) * G5,
        False,
    ),
    "matmul": (_last, lambda x: sops.matmul(x, WT), lambda x: torch.matmul(x, WT), False),
    "gated_mlp": (
        _last,
        lambda x: sops.gated_mlp(x, W7, WU, WD),
        lambda x: F.linear(F.silu(F.linear(x, W7)) * F.linear(x, WU), WD),
        False,
    ),
    "dropout": (_elementwise, lambda x: sops.dropout(x, 0.3, True), None, False),
    "batch_norm": (
        _batch_first,
        lambda x: sops.batch_norm(x, None, None, *C8, True),
        lambda x: F.batch_norm(x, None, None, *C8, True),
        False,
    ),
    "conv1d": (
        lambda d: _batch_first(3) if d == 3 else ([(8, 9)] if d == 2 else []),
        lambda x: sops.conv1d(x, _W3, B4),
        lambda x: F.conv1d(x, _W3, B4),
        False,
    ),
    "relu": (_elementwise, sops.relu, F.relu, True),
    "sigmoid": (_elementwise, sops.sigmoid, torch.sigmoid, True),
    "tanh": (_elementwise, sops.tanh, torch.tanh, True),
    "silu": (_elementwise, sops.silu, F.silu, True),
    "gelu": (_elementwise, sops.gelu, F.gelu, True),
    "mish": (_elementwise, sops.mish, F.mish, True),
    "elu": (_elementwise, sops.elu, F.elu, True),
    "leaky_relu": (_elementwise, sops.leaky_relu, F.leaky_relu, True),
    "hardtanh": (_elementwise, sops.hardtanh, F.hardtanh, True),
    "hardswish": (_elementwise, sops.hardswish, F.hardswish, True),
    "layer_norm": (
        _last,
        lambda x: sops.layer_norm(x, (8,), *C8),
        lambda x: F.layer_norm(x, (8,), *C8),
        True,
    ),
    "rms_norm": (
        _last,
        lambda x: sops.rms_norm(x, (8,), C8[0]),
        lambda x: F.rms_norm(x, (8,), C8[0]),
        True,
    ),
    "group_norm": (
        _batch_first,
        lambda x: sops.group_norm(x, 2, *C8),
        lambda x: F.group_norm(x, 2, *C8),
        True,
    ),
}


def _function_view(y: torch.Tensor) -> bool:
    # a view that a custom Function returned (autograd refuses in-place writes on it); a view
    # taken after the Function (unbatched conv's squeeze, as eager's) is autograd's own
    return y._is_view() and isinstance(y.grad_fn, torch.autograd.function.BackwardCFunction)


@pytest.mark.parametrize("dim", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("name", list(FUNCTIONALS))
def test_functional_output_takes_inplace_writes(name, dim):
    shape_of, op, ref, keeps_output = FUNCTIONALS[name]
    sizes = shape_of(dim)
    if not sizes:
        pytest.skip("the op does not take this many dims")
    for size in sizes:
        torch.manual_seed(3)
        x = torch.randn(*size)
        xs = x.clone().requires_grad_()
        y = op(xs)
        assert not _function_view(y), f"{name}: a view of a tensor made inside its Function"
        y.mul_(2.0)  # taken (eager's output takes it)
        y[..., :1] = 0.5  # and through a view of it
        try:
            y.square().sum().backward()
        except RuntimeError as e:  # only where the op keeps its output: autograd's version error
            assert keeps_output and "modified by an inplace operation" in str(e), (name, e)
            continue
        if ref is None:  # dropout: no eager twin with the same mask
            continue
        xe = x.clone().requires_grad_()
        ye = ref(xe)
        ye.mul_(2.0)
        ye[..., :1] = 0.5
        ye.square().sum().backward()
        torch.testing.assert_close(y, ye)
        torch.testing.assert_close(xs.grad, xe.grad)


def test_linear_cross_entropy_unreduced_loss_takes_inplace_writes():
    torch.manual_seed(4)
    w = _w(11, 8)
    for shape in ((8,), (5, 8), (3, 4, 8), (2, 3, 4, 8)):
        x = torch.randn(*shape)
        t = torch.randint(0, 11, shape[:-1])
        got = []
        for lce in (
            sops.linear_cross_entropy,
            lambda h, w, t, reduction: F.cross_entropy(
                F.linear(h, w).reshape(-1, 11), t.reshape(-1), reduction=reduction
            ).reshape(t.shape),
        ):
            xs = x.clone().requires_grad_()
            w.grad = None
            loss = lce(xs, w, t, reduction="none")
            assert not _function_view(loss)
            loss.mul_(3.0)
            loss.sum().backward()
            got.append([loss, xs.grad, w.grad])
        for a, b in zip(*got, strict=True):
            torch.testing.assert_close(a, b)


def test_matmul_vector_result_made_under_no_grad_takes_a_later_write():
    # eager's matmul squeezes a vector operand's dim in place: its result is no view
    torch.manual_seed(5)
    v, m = torch.randn(8), torch.randn(8, 5, requires_grad=True)
    bias = torch.randn(5, requires_grad=True)
    for a, b in ((v, m), (m.t(), v)):
        got = []
        for mm in (sops.matmul, torch.matmul):
            with torch.no_grad():
                y = mm(a, b)
            y.add_(bias)  # grad mode: a view made under no_grad would refuse this
            bias.grad = None
            y.square().sum().backward()
            got.append([y, bias.grad])
        for p, q in zip(*got, strict=True):
            torch.testing.assert_close(p, q)
