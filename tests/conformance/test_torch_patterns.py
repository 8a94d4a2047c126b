"""Conformance: plain-torch patterns through ``slimgrad.convert_``, default config and
``ConvertConfig(inplace_abn=True)``.

Each row builds a small model, converts a deep copy (same Parameters' values, same seed) and checks
against eager: outputs, the caller's inputs unchanged (eager leaves them unchanged in every row),
tensors kept by hooks, every parameter and input gradient, running statistics; in train mode and in
eval / no_grad / inference_mode; and that the report converts or names why not every BatchNorm.
With ``inplace_abn=True`` the reference is the eager model with each ReLU that the conversion
replaced (by an InPlaceABN's leaky_relu) swapped for ``LeakyReLU(slope)``: the opt-in function.
Rows that must keep the in-place saving also count ``ownership.reuse_count("forward")``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad import ownership
from slimgrad.nn.inplace_abn import InPlaceABN, LeakyReLUAfterABN
from slimgrad.testing import assert_within_rule, rule_ok

DEFAULT = slimgrad.ConvertConfig()
ABN = slimgrad.ConvertConfig(inplace_abn=True)
SLOPE = ABN.leaky_relu_slope


class _Keep:
    # a forward (pre-)hook that keeps what it sees; an object, so deepcopy gives each model its own
    def __init__(self):
        self.kept = []

    def __call__(self, mod, args, out=None):
        self.kept.append(args[0] if out is None else out)


class Stem(nn.Module):
    def __init__(self, c=4, k=3):
        super().__init__()
        self.conv = nn.Conv2d(3, c, k, padding=k // 2)

    def forward(self, x):
        return self.conv(x)


class PreActResidual(nn.Module):
    # body(h) + h with body = Sequential(BN, act, Conv): the BN's input h is read again after
    def __init__(self, act):
        super().__init__()
        self.stem = Stem()
        self.body = nn.Sequential(nn.BatchNorm2d(4), act, nn.Conv2d(4, 4, 3, padding=1))

    def forward(self, x):
        h = self.stem(x)
        return self.body(h) + h


class PostActResidual(nn.Module):
    # torchvision's BasicBlock: conv-bn-relu-conv-bn, out += identity, relu (one inplace ReLU)
    def __init__(self):
        super().__init__()
        self.stem = Stem()
        self.conv1 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4)

    def forward(self, x):
        x = self.stem(x)
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        out += identity
        out = self.relu(out)
        return out


class AddBlock(nn.Module):
    # x = x + block(x)
    def __init__(self, act):
        super().__init__()
        self.stem = Stem()
        self.block = nn.Sequential(
            nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), act, nn.Conv2d(4, 4, 1)
        )

    def forward(self, x):
        x = self.stem(x)
        x = x + self.block(x)
        return x


class SecondConsumer(nn.Module):
    # h feeds a BN+act block and, afterwards, another branch
    def __init__(self, act):
        super().__init__()
        self.stem = Stem()
        self.block = nn.Sequential(nn.BatchNorm2d(4), act)
        self.other = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        h = self.stem(x)
        a = self.block(h)
        return a + self.other(h)


class ReturnsFeature(nn.Module):
    # returns the conv feature it also feeds to BN (fx: two users; Sequential: the caller's)
    def __init__(self, act):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.act = act
        self.seq = nn.Sequential(nn.BatchNorm2d(4), copy.deepcopy(act))

    def forward(self, x):
        f = self.conv(x)
        y = self.bn(f)
        y = self.act(y)
        return f, y, self.seq(f)


class ReLUSideEffect(nn.Module):
    # ``self.relu(out)`` with the result unused, and ``a = relu(b); a + b``
    def __init__(self, second):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Conv2d(4, 2, 1)
        self.second = second

    def forward(self, x):
        out = self.conv(x)
        out = self.bn(out)
        if self.second:
            a = self.relu(out)
            return self.head(a + out)
        self.relu(out)
        return self.head(out)


class ReLUFresh(ReLUSideEffect):
    def forward(self, x):
        out = self.conv(x)
        out = self.bn(out)
        out = self.relu(out)
        return self.head(out)


class SharedTwice(nn.Module):
    # one Sequential(Conv, BN, act) used twice; one BN under two parents
    def __init__(self, act):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), act)
        bn = nn.BatchNorm2d(4)
        self.a = nn.Sequential(nn.Conv2d(3, 4, 1), bn, copy.deepcopy(act))
        self.b = nn.Sequential(nn.Conv2d(4, 4, 1), bn, nn.Conv2d(4, 4, 1))

    def forward(self, x):
        return self.b(self.block(self.block(self.a(x))))


class _UsesBN(nn.Module):
    def __init__(self, bn):
        super().__init__()
        self.bn = bn

    def forward(self, x):
        return self.bn(x) * 2


class FxSharedBN(nn.Module):
    # one BN: followed by the ReLU here (an fx pair), used without activation by a child
    def __init__(self, act):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = act
        self.sub = _UsesBN(self.bn)

    def forward(self, x):
        out = self.conv(x)
        out = self.bn(out)
        out = self.relu(out)
        return self.sub(out)


def _chain(act, n=3):
    layers = []
    for _ in range(n):
        layers += [nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), copy.deepcopy(act)]
    return nn.Sequential(nn.Conv2d(3, 4, 1), *layers)


def _lrelu():
    return nn.LeakyReLU(0.1, inplace=True)


def _img():
    return torch.randn(2, 3, 5, 6)


def _randomize(model):
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.rand(m.num_features, generator=g) * 0.4 - 0.2)
    return model


def _hooked(kind):
    def build(act):
        m = _chain(act, n=2)
        target = {"producer": m[1], "bn": m[2], "act": m[3]}[kind.split("_")[0]]
        if kind.endswith("pre"):
            target.register_forward_pre_hook(_Keep())
        else:
            target.register_forward_hook(_Keep())
        return m

    return build


# name -> (builder(act) -> model, input maker, activations to try). Rows with "relu" use nn.ReLU
# (converted by inplace_abn=True), rows with "leaky" LeakyReLU (converted by the default config).
ROWS = {
    "seq_bn_first_caller_input": (
        lambda act: nn.Sequential(nn.BatchNorm1d(6), act, nn.Linear(6, 3)),
        lambda: torch.randn(5, 6),
    ),
    "seq_flatten_view_input": (
        lambda act: nn.Sequential(nn.Flatten(), nn.BatchNorm1d(12), act, nn.Linear(12, 3)),
        lambda: torch.randn(5, 3, 2, 2),
    ),
    "chain_fresh": (_chain, _img),
    "preact_residual": (PreActResidual, _img),
    "postact_residual": (lambda act: PostActResidual(), _img),
    "x_plus_block_x": (AddBlock, _img),
    "second_consumer": (SecondConsumer, _img),
    "returned_intermediate": (ReturnsFeature, _img),
    "relu_inplace_side_effect": (lambda act: ReLUSideEffect(False), _img),
    "relu_inplace_a_plus_b": (lambda act: ReLUSideEffect(True), _img),
    "relu_inplace_fresh": (lambda act: ReLUFresh(False), _img),
    "shared_modules": (SharedTwice, lambda: torch.randn(2, 3, 5, 6)),
    "fx_shared_bn": (FxSharedBN, _img),
    "abn_after_abn": (
        lambda act: nn.Sequential(
            nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), act, nn.BatchNorm2d(4), nn.ELU()
        ),
        _img,
    ),
    "hook_on_producer": (_hooked("producer"), _img),
    "prehook_on_producer": (_hooked("producer_pre"), _img),
    "hook_on_bn": (_hooked("bn"), _img),
    "prehook_on_bn": (_hooked("bn_pre"), _img),
    "hook_on_act": (_hooked("act"), _img),
    "prehook_on_act": (_hooked("act_pre"), _img),
}


def _reference(eager, converted, config):
    # eager's function, with the ReLUs the conversion turned into leaky_relu swapped likewise
    ref = copy.deepcopy(eager)
    if not config.inplace_abn:
        return ref
    conv = dict(converted.named_modules(remove_duplicate=False))
    swapped = {}
    for name, m in list(ref.named_modules(remove_duplicate=False)):
        for n, c in list(m._modules.items()):
            path = f"{name}.{n}" if name else n
            if type(c) is nn.ReLU and type(conv.get(path)) in (LeakyReLUAfterABN, nn.Identity):
                new = swapped.setdefault(id(c), nn.LeakyReLU(SLOPE, inplace=c.inplace))
                new.__dict__.update({k: v for k, v in c.__dict__.items() if "hook" in k})
                m._modules[n] = new
    return ref


def _flat(out):
    return list(out) if isinstance(out, tuple) else [out]


def _keepers(model):
    return [
        h
        for m in model.modules()
        for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())
        if isinstance(h, _Keep)
    ]


def _kept_tensors(model):
    return [t for h in _keepers(model) for t in h.kept]


def _step(model, x0, train, mode):
    model.train(train)
    for h in _keepers(model):
        h.kept.clear()
    x = x0.clone().requires_grad_(mode == "grad")
    ctx = {"grad": torch.enable_grad, "no_grad": torch.no_grad}.get(mode, torch.inference_mode)
    with ctx():
        outs = _flat(model(x))
    grads = []
    if mode == "grad":
        w = [torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o) for o in outs]
        loss = sum((o * wi).sum() for o, wi in zip(outs, w))
        leaves = [x, *model.parameters()]
        grads = list(torch.autograd.grad(loss, leaves, allow_unused=True))
    return outs, x.detach(), _kept_tensors(model), grads, [b.clone() for b in model.buffers()]


def _check_report(eager, converted):
    rep = slimgrad.report(converted)
    # something converted: a row where nothing is would compare eager with eager
    assert rep.converted, f"nothing converted:\n{rep}"
    named = {n for n, _, _ in rep.converted} | {n for n, _, _ in rep.skipped}
    for name, m in eager.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            assert name in named, f"{name} neither converted nor skipped with a reason:\n{rep}"


ALL_MODES = ((True, "grad"), (False, "grad"), (False, "no_grad"), (True, "inference"))
FAST_MODES = ((True, "grad"), (False, "no_grad"), (True, "inference"))


def _run_row(build, make_x, act, config, dtype=torch.float64, modes=ALL_MODES):
    torch.manual_seed(0)
    eager = _randomize(build(act)).to(dtype)
    converted = slimgrad.convert_(copy.deepcopy(eager), config)
    ref = _reference(eager, converted, config)
    _check_report(eager, converted)
    torch.manual_seed(1)
    x0 = make_x().to(dtype)
    for train, mode in modes:
        got = _step(converted, x0, train, mode)
        want = _step(ref, x0, train, mode)
        assert torch.equal(got[1], x0), f"{mode}: the converted model changed the caller's input"
        for a, b in zip(got[0] + got[2] + got[3] + got[4], want[0] + want[2] + want[3] + want[4]):
            torch.testing.assert_close(a, b, msg=lambda m, mode=mode, t=train: f"{mode} {t}: {m}")
    return converted


# The default config keeps every module's function (BN -> LeakyReLU: derived saved input);
# inplace_abn=True fuses Sequential BN + LeakyReLU/ReLU slots into InPlaceABN. Eval with backward
# runs in the rows of the tests below
@pytest.mark.parametrize(
    "config, act",
    [(DEFAULT, "leaky"), (DEFAULT, "relu"), (ABN, "leaky"), (ABN, "relu")],
    ids=["default-leaky", "default-relu", "inplace_abn-leaky", "inplace_abn-relu"],
)
@pytest.mark.parametrize("row", list(ROWS))
def test_row_matches_eager(row, config, act):
    build, make_x = ROWS[row]
    if act == "relu" and row.startswith("relu_inplace"):
        pytest.skip("same model as the leaky row")
    act_module = _lrelu() if act == "leaky" else nn.ReLU(inplace=True)
    _run_row(build, make_x, act_module, config, modes=FAST_MODES)


def _grants(model, x):
    ownership.reset_reuse_count()
    model(x)
    return ownership.reuse_count("forward")


def test_fresh_chain_keeps_the_in_place_path():
    # default: no fusion; each in-place LeakyReLU on its BN's fresh output takes the derived path
    default = _run_row(_chain, _img, _lrelu(), DEFAULT)
    assert not any(isinstance(m, (InPlaceABN, nn.Identity)) for m in default.modules())
    assert _grants(default.train(), _img().double()) == 3
    # inplace_abn=True: each InPlaceABN writes over its conv's fresh output (3 of 3)
    converted = _run_row(_chain, _img, _lrelu(), ABN)
    assert sum(isinstance(m, InPlaceABN) for m in converted.modules()) == 3
    assert _grants(converted.train(), _img().double()) == 3
    relu = _run_row(_chain, _img, nn.ReLU(), ABN)
    assert sum(isinstance(m, InPlaceABN) for m in relu.modules()) == 3
    assert _grants(relu.train(), _img().double()) == 3
    # ``out = self.relu(out)`` after a converted BatchNorm: the derived path (new tensor) is granted
    fresh = _run_row(lambda a: ReLUFresh(False), _img, None, DEFAULT)
    assert _grants(fresh.train(), _img().double()) == 1


@pytest.mark.parametrize(
    "row, grants",
    [
        ("seq_bn_first_caller_input", 0),
        ("seq_flatten_view_input", 0),
        ("preact_residual", 0),
        ("second_consumer", 0),
        ("relu_inplace_side_effect", 0),
        ("relu_inplace_a_plus_b", 0),
        ("hook_on_producer", 1),  # the second block's producer has no hook
    ],
)
def test_unsafe_sites_take_the_out_of_place_path(row, grants):
    build, make_x = ROWS[row]
    converted = _run_row(build, make_x, _lrelu(), ABN)
    assert _grants(converted.train(), make_x().double()) == grants


@pytest.mark.parametrize("row", ["hook_on_bn", "prehook_on_bn", "hook_on_act", "prehook_on_act"])
def test_hooked_bn_or_act_is_skipped_with_the_reason(row):
    build, make_x = ROWS[row]
    converted = _run_row(build, make_x, _lrelu(), ABN)
    assert not isinstance(converted[2], InPlaceABN) and isinstance(converted[5], InPlaceABN)
    reasons = [r for n, _, r in slimgrad.report(converted).skipped if n == "2"]
    assert reasons and "hooks" in reasons[0]
    # the hooks are kept and still fire
    for h in _keepers(converted):
        h.kept.clear()
    converted(make_x().double())
    assert len(_kept_tensors(converted)) == 1


def test_shared_modules_stay_one_module():
    converted = _run_row(SharedTwice, ROWS["shared_modules"][1], _lrelu(), ABN)
    assert converted.a[1] is converted.b[1]  # one BN under two parents: one module
    assert not isinstance(converted.a[1], InPlaceABN)  # b uses it without an activation
    assert any(
        "outside" in r or "no invertible" in r for _, _, r in slimgrad.report(converted).skipped
    )
    assert isinstance(converted.block[1], InPlaceABN)  # the twice-used block: one module


def test_global_hooks():
    kept = []
    h = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: kept.append(o))
    try:
        # registered at conversion: the pairs are skipped with the reason
        torch.manual_seed(0)
        skipped = slimgrad.convert_(_randomize(_chain(_lrelu())).double(), ABN)
        assert not any(isinstance(m, InPlaceABN) for m in skipped.modules())
        assert any("global" in r for _, _, r in slimgrad.report(skipped).skipped)
    finally:
        h.remove()
    torch.manual_seed(0)
    eager = _randomize(_chain(_lrelu())).double()
    converted = slimgrad.convert_(copy.deepcopy(eager), ABN)
    x0 = _img().double()
    runs = []
    for m in (eager, converted):
        kept.clear()
        h = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: kept.append(o))
        try:
            ownership.reset_reuse_count()
            y = m(x0.clone())
            grants = ownership.reuse_count("forward")
        finally:
            h.remove()
        convs = [t for t in kept if t.shape[1] == 4][::3]  # every conv output the hook kept
        g = torch.autograd.grad(y.square().sum(), list(m.parameters()))
        runs.append((y, convs, g, grants))
    assert runs[1][3] == 0  # added after conversion: refused at call time
    torch.testing.assert_close(runs[1][0], runs[0][0])
    for a, b in zip(runs[1][1] + list(runs[1][2]), runs[0][1] + list(runs[0][2])):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("config", [DEFAULT, ABN], ids=["default", "inplace_abn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("row", ["chain_fresh", "preact_residual", "relu_inplace_a_plus_b"])
def test_low_precision_within_rule(row, dtype, config):
    build, make_x = ROWS[row]
    torch.manual_seed(0)
    eager = _randomize(build(_lrelu())).to(dtype)
    converted = slimgrad.convert_(copy.deepcopy(eager), config)
    _check_report(eager, converted)
    ref64 = copy.deepcopy(eager).double()
    x0 = make_x()
    res = []
    for m, dt in ((converted, dtype), (eager, dtype), (ref64, torch.float64)):
        x = x0.to(dt).requires_grad_()
        xc = x.detach().clone()
        (y,) = _flat(m(x))
        g = torch.autograd.grad(y.float().square().sum(), [x, *m.parameters()])
        assert torch.equal(x.detach(), xc)
        res.append([y, *g])
    # output and input gradient: the rule. Parameter gradients: InPlaceABN rebuilds x-hat from its
    # stored output, whose rounding the rule's eager side does not have (NOTE [Invertibility] in
    # slimgrad/ops/inplace_abn.py: dweight at most 1.36x the bound in fp32), in place or not
    # BatchNorm from its output (the default config) rebuilds x-hat the same way. On this tiny batch
    # (60 values per channel) the parameter gradients' error against the bound is rounding luck:
    # 60 seeds, 1 thread, chain_fresh float32: the earlier dx path had 6 seeds above 1.5x the
    # bound (max 2.11x, median 1.016x), the current float64-coefficient dx (NOTE [dx from the
    # output]) 5 (max 2.16x, median 0.896x), seed 0 among them at 1.52x. A fixed seed checks the
    # wiring here; tests/ops/test_bn_rule.py holds the statistics over 200 seeds.
    assert_within_rule(res[0][:2], res[2][:2], res[1][:2])
    slack = 1.5 if config is ABN or dtype != torch.float32 else 2.0
    for name, o, r, e in zip(range(2, len(res[0])), res[0][2:], res[2][2:], res[1][2:]):
        ok, err, bound = rule_ok(o, r, e)
        assert err <= slack * bound, (name, err, bound)


def test_saved_bytes_same_on_both_paths():
    # InPlaceABN keeps z + per-channel floats whether it writes in place or not
    from slimgrad.memory import measure

    torch.manual_seed(0)
    model = slimgrad.convert_(_randomize(nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8),
                                                       nn.LeakyReLU(0.1))), ABN)  # fmt: skip
    abn = model[1]
    x0 = torch.randn(4, 3, 6, 6)
    numel = 4 * 8 * 6 * 6
    per_channel = 8 * 4  # invstd, float32

    def saved_by_abn(fn):
        ownership.reset_reuse_count()
        r = measure(fn, backward=False)
        return r, ownership.reuse_count("forward")

    r_in, g_in = saved_by_abn(lambda: model(x0).sum())
    held = model[0](x0)  # the caller holds the conv output: out of place
    r_held, g_held = saved_by_abn(lambda: abn(held).sum())
    assert (g_in, g_held) == (1, 0)
    conv_keeps = 0  # conv's input x0 pre-exists; its weight is a Parameter
    for r in (r_in, r_held):
        assert r.saved_bytes == conv_keeps + numel * 4 + per_channel, r.saved_bytes


# F4: every slot of a converted Sequential keeps computing what it computed (default config):
# slices, per-layer iteration, hooks added after conversion, replacing a slot. inplace_abn=True
# fuses BN + activation slots (documented): the BN slot then returns BN + activation.
_SLOT_ACTS = {
    "leaky": lambda: nn.LeakyReLU(0.2),
    "leaky_inplace": lambda: nn.LeakyReLU(0.1, inplace=True),
    "elu": lambda: nn.ELU(),
    "elu_inplace": lambda: nn.ELU(0.7, inplace=True),
    "identity": nn.Identity,
    "relu_inplace": lambda: nn.ReLU(inplace=True),
}


def _slots(act):
    return _randomize(
        nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), act(),
            nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), act(),
            nn.Flatten(), nn.Linear(4 * 5 * 6, 3),
        )
    ).double()  # fmt: skip


def _slot_run(model, fn, x0, train):
    # fn(model, x) -> list of tensors; in train mode also every parameter and input gradient
    model.train(train)
    x = x0.clone().requires_grad_(train)
    with torch.set_grad_enabled(train):
        outs = fn(model, x)
    if not train:
        return outs
    loss = sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum() for o in outs)
    return outs + list(torch.autograd.grad(loss, [x, *model.parameters()], allow_unused=True))


def _per_layer(model, x):
    feats, h = [], x
    for layer in model:
        h = layer(h)
        feats.append(h.clone())  # a copy: an in-place activation overwrites h, as in eager
    return feats


def _after_bn_hooks(model, x):
    kept, grads = [], []
    h1 = model[1].register_forward_hook(lambda m, i, o: kept.append(o.clone()))
    h2 = model[1].register_full_backward_hook(lambda m, gi, go: grads.append(go[0].clone()))
    try:
        y = model(x)
        if y.requires_grad:
            torch.autograd.grad(y.sum(), [x], retain_graph=True)
    finally:
        h1.remove()
        h2.remove()
    return [y, *kept, *grads]


def _surgery(model, x):
    model[2] = nn.Tanh()
    model[4] = nn.Identity()
    return [model(x)]


def _slice(k):
    return lambda m, x: [m[:k](x)]


_SLOT_USES = {
    **{f"slice_{k}": _slice(k) for k in range(1, 7)},
    "bn_slot_alone": lambda m, x: [m[1](m[0](x))],
    "per_layer": _per_layer,
    "hooks_after_convert": _after_bn_hooks,
    "surgery": _surgery,
}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("use", list(_SLOT_USES))
@pytest.mark.parametrize("act", list(_SLOT_ACTS))
def test_every_slot_keeps_its_function(act, use, train):
    torch.manual_seed(0)
    eager = _slots(_SLOT_ACTS[act])
    converted = slimgrad.convert_(copy.deepcopy(eager))
    _check_report(eager, converted)
    assert not any(isinstance(m, InPlaceABN) for m in converted.modules())
    assert all(isinstance(c, type(e)) for c, e in zip(converted, eager))  # same slots, subclasses
    x0 = torch.randn(2, 3, 5, 6, dtype=torch.float64)
    try:
        want = _slot_run(eager, _SLOT_USES[use], x0, train)
    except RuntimeError as e:  # a full backward hook before an in-place op: torch refuses
        with pytest.raises(RuntimeError, match=str(e)[:40]):
            _slot_run(converted, _SLOT_USES[use], x0, train)
        return
    got = _slot_run(converted, _SLOT_USES[use], x0, train)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_inplace_abn_fuses_the_slots_as_documented():
    # opt-in: the whole model is eager's function, but the BN slot returns BN + activation
    torch.manual_seed(0)
    eager = _slots(_SLOT_ACTS["leaky"])
    converted = slimgrad.convert_(copy.deepcopy(eager), ABN)
    assert isinstance(converted[1], InPlaceABN) and isinstance(converted[2], nn.Identity)
    x0 = torch.randn(2, 3, 5, 6, dtype=torch.float64)
    full = [_slot_run(m, lambda m, x: [m(x)], x0, False) for m in (converted, eager)]
    torch.testing.assert_close(full[0][0], full[1][0])
    bn = [_slot_run(m, _SLOT_USES["slice_2"], x0, False)[0] for m in (converted, eager)]
    torch.testing.assert_close(bn[0], torch.nn.functional.leaky_relu(bn[1], 0.2))
