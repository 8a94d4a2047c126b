"""Issue 30, class 7: saved and peak bytes never above eager's, for every torch.nn type convert_
replaces, over tiny shapes.

Each module type in convert_'s table that is a torch.nn class (activations, inplace and not,
BatchNorm1d/2d/3d, GroupNorm, LayerNorm, RMSNorm, Dropout, Linear, Conv1d/2d/3d and
ConvTranspose1d/2d/3d) runs after a layer that makes its input (a 1x1 conv, or a Linear on the
last dim), "alone" (a frozen layer of that kind follows it inside the model) and followed by a
layer that keeps its input ("kept": a 1x1 conv or a Linear), over shapes of 1-8 per dim in
float32, bfloat16 and float16 (the whole model in that dtype; float16 where its code path is not
bfloat16's: FLOAT16_PATHS), contiguous and channels_last (4-D), in train and in eval where the
module's forward depends on the mode. One warm-up step of the
converted model first (lazily built tables do not count), then ``slimgrad.memory.measure`` of a
step ``(model(x) * w).sum()`` of the converted and the eager model: the module under test is
slimgrad's, and the converted one's saved and peak bytes are at most eager's. Known findings are
strict xfails with their numbers.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import slimgrad
from slimgrad.memory import measure

CONV = {3: nn.Conv1d, 4: nn.Conv2d, 5: nn.Conv3d}
CONVT = {3: nn.ConvTranspose1d, 4: nn.ConvTranspose2d, 5: nn.ConvTranspose3d}
BN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}

# shapes per rank, (batch, channels, *spatial): 1-8 per dim, odd and prime sizes
SHAPES = {
    2: [(2, 3), (8, 8)],
    3: [(2, 3, 5), (4, 8, 7)],
    4: [(2, 3, 1, 1), (1, 4, 2, 3), (3, 8, 5, 7)],
    5: [(2, 3, 2, 3, 2)],
}

# the activations (shape-agnostic, 4-D only): a tensor of at most 512 values (they keep x there,
# NOTE [Few elements] in ops/_output_act.py) and one above, contiguous and channels_last
ACT_SHAPES = [(2, 3, 1, 1), (3, 8, 5, 7)]

ACTS = {
    "ReLU": lambda ip: nn.ReLU(inplace=ip),
    "ReLU6": lambda ip: nn.ReLU6(inplace=ip),
    "Hardtanh": lambda ip: nn.Hardtanh(-0.7, 0.9, inplace=ip),
    "LeakyReLU": lambda ip: nn.LeakyReLU(0.1, inplace=ip),
    "LeakyReLU_neg": lambda ip: nn.LeakyReLU(-0.2, inplace=ip),
    "ELU": lambda ip: nn.ELU(inplace=ip),
    "ELU_neg": lambda ip: nn.ELU(-0.5),  # eager's in-place ELU refuses alpha < 0 in backward
    "GELU": lambda ip: nn.GELU(),
    "GELU_tanh": lambda ip: nn.GELU("tanh"),
    "SiLU": lambda ip: nn.SiLU(inplace=ip),
    "Mish": lambda ip: nn.Mish(inplace=ip),
    "Hardswish": lambda ip: nn.Hardswish(inplace=ip),
    "Hardsigmoid": lambda ip: nn.Hardsigmoid(inplace=ip),
    "Sigmoid": lambda ip: nn.Sigmoid(),
    "Tanh": lambda ip: nn.Tanh(),
}
# in place where eager can differentiate it (not LeakyReLU with a negative slope)
INPLACE = {"ReLU", "ReLU6", "Hardtanh", "LeakyReLU", "ELU", "SiLU", "Mish"}
INPLACE |= {"Hardswish", "Hardsigmoid"}

ACT_NAMES = set(ACTS) | {f"{a}/inplace" for a in INPLACE}

# name -> (module factory (shape -> module acting on the channels or the last dim), ranks, "chan"
# for a module over dim 1 (after a 1x1 conv) or "last" for one over the last dim (after a Linear),
# whether its forward depends on train/eval)
MODULES = {
    **{a: (lambda s, f=f: f(False), (4,), "chan", False) for a, f in ACTS.items()},
    **{
        f"{a}/inplace": (lambda s, f=ACTS[a]: f(True), (4,), "chan", False) for a in sorted(INPLACE)
    },
    "BatchNorm": (lambda s: BN[len(s)](s[1]), (2, 3, 4, 5), "chan", True),
    "GroupNorm1": (lambda s: nn.GroupNorm(1, s[1]), (2, 3, 4, 5), "chan", False),
    "GroupNormC": (lambda s: nn.GroupNorm(s[1], s[1]), (3, 4, 5), "chan", False),
    "LayerNorm": (lambda s: nn.LayerNorm(s[-1]), (2, 3, 4), "last", False),
    "RMSNorm": (lambda s: nn.RMSNorm(s[-1]), (2, 3, 4), "last", False),
    "Dropout": (lambda s: nn.Dropout(0.3), (2, 3, 4), "chan", True),
    "Linear": (lambda s: nn.Linear(s[-1], s[-1]), (2, 3, 4), "last", False),
    "Conv": (lambda s: CONV[len(s)](s[1], s[1], 3, padding=1), (3, 4, 5), "chan", False),
    "ConvTranspose": (lambda s: CONVT[len(s)](s[1], s[1], 3, padding=1), (3, 4, 5), "chan", False),
}

# Measured above eager's (issue 30, class 7): strict xfails, so a
# fix shows up as an unexpected pass. Key: "name-context" (context: alone or kept); bytes are
# saved / peak, converted (eager), at the first shape that broke.
# (was: GroupNorm1-alone and GroupNormC-alone, before a frozen 1x1 conv, train, channels_last
# (1, 4, 2, 3): float32 peak 432 (400) and 456 (424), bfloat16/float16 216 (200) and 228 (212):
# NOTE [A stand-in for x] in ops/conv.py)
KNOWN: dict[str, str] = {}
# (was: RMSNorm-first, float32 on the model's input, weight-only backward: the op kept y and rstd,
# eager xhat alone; saved 7,200 (6,720) at channels_last (3, 8, 5, 7), peak 116 (112) at (2, 3, 1,
# 1): NOTE [A weight-only backward keeps no rstd] in ops/rms_norm.py)


def _pre(shape, where: str) -> nn.Module:
    # the layer that makes the module's input (its output is a non-leaf, as in a model)
    if where == "last" or len(shape) == 2:
        return nn.Linear(shape[-1], shape[-1]) if where == "last" else nn.Linear(shape[1], shape[1])
    return CONV[len(shape)](shape[1], shape[1], 1)


def _randomize(m: nn.Module, gen: torch.Generator) -> None:
    for mod in m.modules():
        w = getattr(mod, "weight", None)
        if isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.GroupNorm)):
            with torch.no_grad():
                c = w.numel()
                w.copy_(torch.rand(c, generator=gen) + 0.5)
                mod.bias.copy_((torch.rand(c, generator=gen) - 0.5) * 0.8)
                if isinstance(mod, nn.modules.batchnorm._BatchNorm):
                    mod.running_mean.copy_(torch.randn(c, generator=gen) * 0.1)
                    mod.running_var.copy_(torch.rand(c, generator=gen) + 0.5)


def _skip(name: str, shape, train: bool) -> bool:
    per_channel = shape[0] * (int(torch.tensor(shape[2:]).prod()) if len(shape) > 2 else 1)
    if name == "BatchNorm" and train and per_channel == 1:
        return True  # training BatchNorm needs more than 1 value per channel (as torch)
    if name == "GroupNorm1" and per_channel * shape[1] == 1:
        return True  # more than 1 value per group (as torch)
    return name == "GroupNormC" and per_channel == 1


# "first": the module on the model's input itself (a tensor that does not require grad, as a batch
# of data), a layer that keeps its input after it: the modules with parameters, whose backward
# then computes their parameters' gradients only (was: RMSNorm bfloat16 (4, 8, 7), peak 2,536
# (2,488): its weight-only backward's float32 copy of dy, NOTE in _math/norms.py)
FIRST = {"BatchNorm", "GroupNorm1", "GroupNormC", "LayerNorm", "RMSNorm", "Linear", "Conv"}
FIRST |= {"ConvTranspose"}


def _contexts(name: str) -> tuple[str, ...]:
    return ("alone", "kept", "first") if name in FIRST else ("alone", "kept")


def _params():
    for name in MODULES:
        for context in _contexts(name):
            why = KNOWN.get(f"{name}-{context}")
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            yield pytest.param(name, context, id=f"{name}-{context}", marks=marks)


@pytest.mark.parametrize(("name", "context"), list(_params()))
def test_saved_and_peak_never_above_eager(name, context):
    _sweep(name, context, torch.float32)


# bfloat16 and float16 (every module type here runs both on CPU in eager): the same sweep. Measured
# above eager's in both dtypes (issue 30, class 7): strict xfails, keyed and written as KNOWN
# (the bfloat16 numbers; "alike": float16's differ by a few bytes).
# (was: Dropout-alone, bfloat16 (2, 3) peak 54 (40), (8, 8) peak 392 (388), float16 the same:
# NOTE [Dropout's mask temporaries] in ops/dropout.py; Hardtanh-alone and Hardtanh/inplace-alone,
# channels_last (3, 8, 5, 7) after a frozen 1x1 conv, bfloat16 peak 6,811 (6,724), float16 6,813:
# the bit mask's backward multiplies by the bool mask into eager's layout, ops/hardtanh.py)
KNOWN_LOW: dict[str, str] = {}

LOW = (torch.bfloat16, torch.float16)


# float16 runs where its coverage arcs (branch arcs of src/slimgrad and this file) are not
# bfloat16's; elsewhere a float16 row ran the same arcs as the bfloat16 row, on values of the same
# size, and is left out
FLOAT16_PATHS = {
    "Hardtanh-alone", "Hardtanh-kept", "Hardtanh/inplace-alone", "Hardtanh/inplace-kept",
    "RMSNorm-alone", "RMSNorm-first",
}  # fmt: skip


def _low_params():
    for dtype in LOW:
        for name in MODULES:
            for context in _contexts(name):
                if dtype == torch.float16 and f"{name}-{context}" not in FLOAT16_PATHS:
                    continue
                why = KNOWN_LOW.get(f"{name}-{context}")
                marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
                yield pytest.param(
                    name, context, dtype, id=f"{name}-{context}-{str(dtype)[6:]}", marks=marks
                )


@pytest.mark.parametrize(("name", "context", "dtype"), list(_low_params()))
def test_saved_and_peak_never_above_eager_low_precision(name, context, dtype):
    _sweep(name, context, dtype)


def _sweep(name, context, dtype):
    make, ranks, where, moded = MODULES[name]
    failures = []
    for rank in ranks:
        for shape in ACT_SHAPES if name in ACT_NAMES else SHAPES[rank]:
            for cl in (False, True) if rank == 4 and shape[1] > 3 else (False,):
                for train in (True, False) if moded else (True,):
                    if _skip(name, shape, train):
                        continue
                    if cl and context == "first" and name.startswith("GroupNorm"):
                        continue  # eager's CPU GroupNorm backward crashes (SIGSEGV, torch 2.13)
                    got = _measure(name, make, where, shape, cl, train, context, dtype)
                    if got:
                        failures.append(got)
    assert not failures, "\n".join(failures)


def _measure(name, make, where, shape, cl, train, context, dtype=torch.float32) -> str | None:
    gen = torch.Generator().manual_seed(sum(shape) * 7 + len(shape))
    torch.manual_seed(len(name) + sum(shape))
    # "alone": a frozen layer follows inside the model (it keeps nothing of the module's output
    # that eager's does not keep too; convert_ leaves an output-saving module at the model's
    # output end unconverted)
    kept = context != "alone"
    first = nn.Identity() if context == "first" else _pre(shape, where)
    mods = [first, make(shape), _pre(shape, where).requires_grad_(kept)]
    eager = nn.Sequential(*mods)
    _randomize(eager, gen)
    eager.to(dtype).train(train)
    slim = copy.deepcopy(eager)
    slimgrad.convert_(slim)
    assert type(slim[1]).__module__.startswith("slimgrad."), (name, slimgrad.report(slim))
    fmt = torch.channels_last if cl else torch.contiguous_format
    x = torch.randn(shape, generator=gen).to(dtype).contiguous(memory_format=fmt)
    w = torch.randn(shape, generator=gen).to(dtype).contiguous(memory_format=fmt)  # out: x's shape

    def step(m):
        return lambda: (m(x) * w).sum()

    step(slim)().backward()  # warm-up (eager builds nothing lazily)
    me = measure(step(eager), timeline=False)
    ms = measure(step(slim), timeline=False)
    if ms.saved_bytes > me.saved_bytes or ms.peak_bytes > me.peak_bytes:
        dt = "" if dtype == torch.float32 else f" {str(dtype)[6:]}"
        return (
            f"{name}{dt} {'train' if train else 'eval'} {shape}{' cl' if cl else ''}: saved "
            f"{ms.saved_bytes} ({me.saved_bytes}), peak {ms.peak_bytes} ({me.peak_bytes})"
        )
    return None
