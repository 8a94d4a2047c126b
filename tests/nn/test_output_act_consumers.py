"""NOTE [Keep y only where its consumer keeps it] (slimgrad/nn/_output_act.py), issue 30 class 7:
a converted activation keeps no more than eager, saved bytes and peak, whatever its consumer.

Activation types x consumer kinds, slimgrad's tracker, exact: an activation in a module's own
forward whose output goes to an op that keeps nothing of it (``h * 3``, ``h + x``, a sum) keeps
x, as eager (y + side information was up to 0.4 B/elt above eager's bytes); one whose consumer is
known to keep y (a Linear in a ``Sequential`` or in a forward read from its convert-time trace)
keeps y + 1 bit/elt, below eager by about x's bytes; a forward that cannot be traced, or a
producer that keeps its output (a ReLU), keeps x.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import slimgrad
from slimgrad.memory import measure
from slimgrad.ops.gelu import gelu
from slimgrad.ops.silu import silu

N, F_ = 64, 32  # 2,048 elements: past the few-element rule (NOTE [Few elements])

ACTS = {
    "gelu": lambda: nn.GELU(),
    "gelu_tanh": lambda: nn.GELU("tanh"),
    "silu": nn.SiLU,
    "mish": nn.Mish,
    "hardswish": nn.Hardswish,
    "elu": nn.ELU,
    "hardsigmoid": nn.Hardsigmoid,
    "leaky_relu": nn.LeakyReLU,
    "sigmoid": nn.Sigmoid,
    "tanh": nn.Tanh,
    "relu6": nn.ReLU6,
}
# keep y + 1 bit/elt (+ a side table) where the consumer keeps y
SMOOTH = ("gelu", "gelu_tanh", "silu", "mish", "hardswish")


class _Times3(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.l1, self.act, self.l2 = nn.Linear(F_, F_), act, nn.Linear(F_, F_)

    def forward(self, x):
        return self.act(self.l1(x)) * 3.0


class _Residual(_Times3):
    def forward(self, x):
        return self.act(self.l1(x)) + x


class _Sum(_Times3):
    def forward(self, x):
        return self.act(self.l1(x)).sum(-1, keepdim=True)


class _Linear(_Times3):  # read from its trace: the Linear keeps y
    def forward(self, x):
        return self.l2(self.act(self.l1(x)))


class _AfterReLU(_Times3):  # the ReLU keeps its output, the activation's x: x costs nothing
    def __init__(self, act):
        super().__init__(act)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.l2(self.act(self.relu(self.l1(x))))


class _Gated(_Linear):  # the product keeps y for l2's output's gradient
    def forward(self, x):
        return self.act(self.l1(x)) * self.l2(x)


class _Untraceable(_Times3):  # data-dependent control flow: no trace, the consumer is unknown
    def forward(self, x):
        h = self.act(self.l1(x))
        if float(h.detach().flatten()[0]) > -100:
            h = self.l2(h)
        return h


def _seq(act):
    return nn.Sequential(nn.Linear(F_, F_), act, nn.Linear(F_, F_))


# {kind: (model builder, whether y is kept)}
KINDS = {
    "h * 3": (_Times3, False),
    "h + x": (_Residual, False),
    "sum": (_Sum, False),
    "own forward, Linear": (_Linear, True),
    "own forward, act(a) * b": (_Gated, True),
    "untraceable, Linear": (_Untraceable, False),
    "own forward, ReLU before, Linear": (_AfterReLU, False),
    "Sequential, Linear": (_seq, True),
}
# a representative table: three activations that keep y + side information on every kind, the
# other three on the kinds that were above eager (and one pinned saving); a residual add keeps
# nothing either, as ``h * 3``, and a producer that keeps its output is read from the same trace
# as the consumer: two activations each; the activations that keep y or bits whatever the
# consumer on one kind
TWO = ("h + x", "own forward, ReLU before, Linear")
ROWS = [
    *((a, k) for a in ("gelu", "gelu_tanh", "silu") for k in KINDS if k not in TWO),
    *(
        (a, k)
        for a in ("mish", "hardswish", "elu")
        for k in ("h * 3", "sum", "own forward, Linear")
    ),
    *((a, k) for a in ("gelu_tanh", "silu") for k in TWO),
    *((a, "h * 3") for a in ("hardsigmoid", "leaky_relu", "sigmoid", "tanh", "relu6")),
]


def _bytes(model, x):
    w = torch.randn_like(model(x))
    step = lambda m: lambda: (m(x) * w).sum()  # noqa: E731
    step(model)().backward()  # warm-up: tables built at a first call are not the step's
    return measure(step(model), timeline=False)


@pytest.mark.parametrize("kind", list(KINDS))
def test_never_above_eager(kind):
    build, kept = KINDS[kind]
    for act in [a for a, k in ROWS if k == kind]:
        torch.manual_seed(0)
        eager = build(ACTS[act]())
        slim = slimgrad.convert_(copy.deepcopy(eager))
        x = torch.randn(N, F_) * 3**0.5  # l1's output about N(0, 1)
        pinned = act in (*SMOOTH, "elu") and kept
        if pinned:
            # y kept once for both, + 1 bit/elt (ELU: + 8 B per element below -2, none here):
            # inputs near the biases, where no element is hard on any CPU (erf-GELU's window
            # follows this CPU's erf: NOTE [A window from eager's own forward error] in
            # slimgrad/_math/smooth.py)
            x = x * 0.1
        torch.manual_seed(1)
        e = _bytes(eager, x)
        torch.manual_seed(1)
        s = _bytes(slim, x)
        assert s.saved_bytes <= e.saved_bytes, (act, kind, s.saved_bytes, e.saved_bytes)
        assert s.peak_bytes <= e.peak_bytes, (act, kind, s.peak_bytes, e.peak_bytes)
        n = N * F_
        if pinned:
            side = 0 if act == "elu" else n // 8
            assert s.saved_bytes == e.saved_bytes - 4 * n + side, (act, kind)
            assert s.peak_bytes <= e.peak_bytes - 4 * n + side, (act, kind)
        elif act in (*SMOOTH, "elu"):
            assert s.saved_bytes == e.saved_bytes, (act, kind)  # x, as eager


def _x_sized_forward_allocations(st, nbytes):
    # the forward's allocations of exactly ``nbytes`` (x's size): steps of the live bytes
    rows = [r for r in st.timeline if r[0] < st.backward_start]
    return sum(b[2] - a[2] == nbytes for a, b in zip(rows, rows[1:], strict=False))


@pytest.mark.parametrize(
    ("op", "ref", "x_star"), [(gelu, F.gelu, -0.7518), (silu, F.silu, -1.2785)]
)
def test_dense_fallback_peak(op, ref, x_star):
    # every element near x* (hard on any CPU): the op keeps x, eager's bytes; the registered op's
    # path (the tracker's) held the bits and the C kernel's workspace through its copy of x: 0.16
    # B/elt above eager's peak; and made that copy, dropped for x itself (NOTE [The dense
    # fallback without a copy of x] in slimgrad/ops/_output_act.py): x, y and the copy live at
    # once, the step's peak where the model is shallow (torchvision's ViT, one layer: +3.0%)
    torch.manual_seed(0)
    x0 = (torch.full((N, F_), x_star) + 1e-3 * torch.randn(N, F_)).requires_grad_()
    w = torch.randn(N, F_)
    step = lambda f: lambda: (f(x0 * 1.0) * w).sum()  # noqa: E731
    for f in (ref, op):
        step(f)().backward()
    e, s = (measure(step(f)) for f in (ref, op))
    assert s.saved_bytes == e.saved_bytes
    assert s.peak_bytes <= e.peak_bytes, (s.peak_bytes, e.peak_bytes)
    # x's product and y, as eager: no copy of x
    nbytes = x0.numel() * 4
    assert _x_sized_forward_allocations(s, nbytes) == _x_sized_forward_allocations(e, nbytes) == 2


# NOTE [A Linear keeps y itself only where y is viewed as a matrix] (slimgrad/nn/_output_act.py):
# a Linear (or nn.MultiheadAttention's in-projection) on a 3-D y it cannot view as a matrix keeps a
# contiguous copy, not y: there y + side information was kept besides that copy (LSTM batch_first
# -> act -> Linear: +4.125 B/elt; Conv1d -> transpose -> act -> Linear: peak +17%)
class _Transpose(nn.Module):
    def forward(self, x):
        return x.transpose(1, 2)


class _LSTMAct(nn.Module):  # read from its trace: y is the LSTM's batch_first output's layout
    def __init__(self, act):
        super().__init__()
        self.rnn, self.act, self.fc = nn.LSTM(8, 32, batch_first=True), act, nn.Linear(32, 8)

    def forward(self, x):
        return self.fc(self.act(self.rnn(x)[0]))


class _MHAAct(nn.Module):  # the activation's output is the attention's query, key and value
    def __init__(self, act, batch_first):
        super().__init__()
        self.fc, self.act = nn.Linear(8, 32), act
        self.mha = nn.MultiheadAttention(32, 4, batch_first=batch_first)

    def forward(self, x):
        h = self.act(self.fc(x))
        return self.mha(h, h, h, need_weights=False)[0]


# {kind: (builder, input shape)}; the attention without batch_first keeps a view of y (its
# in-projection's input), but y may be what it returns (NOTE [Modules whose output is the model's
# output]): x there too
LAYOUTS = {
    "LSTM batch_first": (_LSTMAct, (4, 17, 8)),
    "transpose": (
        lambda a: nn.Sequential(nn.Conv1d(8, 32, 3, padding=1), _Transpose(), a, nn.Linear(32, 8)),
        (4, 8, 17),
    ),
    "MHA batch_first": (lambda a: _MHAAct(a, True), (4, 17, 8)),
    "MHA": (lambda a: _MHAAct(a, False), (17, 4, 8)),
}


@pytest.mark.parametrize(
    ("kind", "act"),
    [
        ("LSTM batch_first", "silu"),
        ("LSTM batch_first", "hardswish"),
        ("transpose", "gelu_tanh"),
        ("transpose", "hardswish"),
        ("MHA batch_first", "mish"),
        ("MHA", "silu"),
    ],
)
def test_never_above_eager_where_the_consumer_copies_y(kind, act):
    build, shape = LAYOUTS[kind]
    torch.manual_seed(0)
    eager = build(ACTS[act]())
    slim = slimgrad.convert_(copy.deepcopy(eager))
    x = torch.randn(*shape)
    torch.manual_seed(1)
    e = _bytes(eager, x)
    torch.manual_seed(1)
    s = _bytes(slim, x)
    assert s.saved_bytes == e.saved_bytes, (s.saved_bytes, e.saved_bytes)  # x, as eager
    assert s.peak_bytes <= e.peak_bytes, (s.peak_bytes, e.peak_bytes)


@pytest.mark.parametrize("batch_first", [True, False])
def test_layer_norm_before_attention(batch_first):
    # TransformerEncoderLayer(norm_first=True): norm1's y is the attention's query; with
    # batch_first the attention transposes it and its in-projection keeps a copy: norm1 runs
    # eager's op (it kept y besides the copy: one (B, T, D) tensor above eager's); without, the
    # in-projection keeps y itself, and the saving stays
    torch.manual_seed(0)
    eager = nn.TransformerEncoderLayer(
        32, 4, 64, dropout=0.0, batch_first=batch_first, norm_first=True
    )
    slim = slimgrad.convert_(copy.deepcopy(eager))
    x = torch.randn(2, 16, 32) if batch_first else torch.randn(16, 2, 32)
    torch.manual_seed(1)
    e = _bytes(eager, x)
    torch.manual_seed(1)
    s = _bytes(slim, x)
    assert s.saved_bytes <= e.saved_bytes, (s.saved_bytes, e.saved_bytes)
    assert s.peak_bytes <= e.peak_bytes, (s.peak_bytes, e.peak_bytes)
    assert slim.norm1.keep_y is not batch_first
