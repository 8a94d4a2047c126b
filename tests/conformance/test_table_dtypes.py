"""Conformance over dtypes and modes for every module type convert_'s table swaps.

Each row builds one module, converts a copy inside a Sequential with the default ConvertConfig,
and runs both on the same input in train/eval x grad/no_grad/inference_mode, with parameters in
float32/bfloat16/float64 and inputs in float32/bfloat16/float16/float64. Converted must do what
eager does: raise where eager raises, same output dtype and values, the input left as eager
leaves it (or changed as eager changes it, for inplace=True), and gradients within the error
rule against a float64 reference.
"""

import copy
import itertools

import pytest
import torch
import torch.nn as nn

import slimgrad
from slimgrad.testing import assert_within_rule, rule_ok

transformers = pytest.importorskip("transformers")
from transformers import activations as hf_act  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

# Every tensor here is on the CPU: seed its generator alone. torch.manual_seed also seeds the
# accelerators' generators, which on a machine without one means a lazy call that formats the
# caller's whole stack each time (most of this file's CPU time under pytest).
_seed = torch.default_generator.manual_seed

MODULES = {
    "LayerNorm": lambda: nn.LayerNorm(8),
    "RMSNorm": lambda: nn.RMSNorm(8),
    "RMSNorm_no_weight": lambda: nn.RMSNorm(8, elementwise_affine=False),
    "GroupNorm": lambda: nn.GroupNorm(2, 8),
    "LlamaRMSNorm": lambda: LlamaRMSNorm(8),
    "GELU": lambda: nn.GELU(),
    "GELU_tanh": lambda: nn.GELU("tanh"),
    "SiLU": lambda: nn.SiLU(),
    "SiLU_inplace": lambda: nn.SiLU(inplace=True),
    "Mish": lambda: nn.Mish(),
    "ReLU": lambda: nn.ReLU(),
    "ReLU_inplace": lambda: nn.ReLU(inplace=True),
    "Sigmoid": lambda: nn.Sigmoid(),
    "Tanh": lambda: nn.Tanh(),
    "Hardtanh": lambda: nn.Hardtanh(-0.5, 2.0),
    "ReLU6": lambda: nn.ReLU6(),
    "LeakyReLU": lambda: nn.LeakyReLU(0.2),
    "LeakyReLU_negative": lambda: nn.LeakyReLU(-0.2),
    "ELU": lambda: nn.ELU(),
    "ELU_negative": lambda: nn.ELU(-0.5),
    "Dropout": lambda: nn.Dropout(0.3),
    "Dropout_0": lambda: nn.Dropout(0.0),
    "Dropout_1": lambda: nn.Dropout(1.0),
    "Dropout_inplace": lambda: nn.Dropout(0.3, inplace=True),
    "HF_GELUActivation": lambda: hf_act.GELUActivation(),
    "HF_NewGELU": lambda: hf_act.NewGELUActivation(),
    "HF_FastGELU": lambda: hf_act.FastGELUActivation(),
    "Conv1d": lambda: nn.Conv1d(8, 8, 1),
    "BatchNorm1d": lambda: nn.BatchNorm1d(8),
}
PARAM_DTYPES = [torch.float32, torch.bfloat16, torch.float64]
INPUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# (training, grad mode): train with and without grad, eval with grad and under inference_mode
MODES = [(True, "grad"), (True, "no_grad"), (False, "grad"), (False, "inference_mode")]


def _build(name, pdt, training):
    _seed(0)
    m = MODULES[name]().to(pdt)
    w = getattr(m, "weight", None)
    if isinstance(w, torch.Tensor):
        with torch.no_grad():
            w.uniform_(0.5, 1.5)
    return m.train(training)


def _close(a, b) -> bool:
    try:
        torch.testing.assert_close(a, b)
    except AssertionError:
        return False
    return True


def _run(mod, x0, mode):
    # (output, input after the call, grads of (input, params) or None), or the error's type
    x = x0.clone().requires_grad_(mode == "grad")
    xin = x.clone() if mode == "grad" else x
    _seed(1)
    try:
        if mode == "grad":
            out = mod(xin)
        elif mode == "no_grad":
            with torch.no_grad():
                out = mod(xin)
        else:
            with torch.inference_mode():
                xin = xin.clone()
                out = mod(xin)
    except Exception as e:  # eager's error must be the converted one's too
        return type(e)
    grads = None
    if mode == "grad" and out.requires_grad:
        _seed(2)
        gy = torch.randn_like(out)
        params = [p for p in mod.parameters() if p.requires_grad]
        grads = torch.autograd.grad(out, [x, *params], gy, allow_unused=True)
    return out.detach().clone(), xin.detach().clone(), grads


@pytest.mark.parametrize("name", sorted(MODULES))
def test_converted_module_matches_eager_in_every_dtype_and_mode(name):
    for pdt in PARAM_DTYPES:
        # one eager module, its converted copy and a float64 copy, run through every row in the
        # same order (BatchNorm's running statistics move the same way on each)
        eager = _build(name, pdt, True)
        wrap = slimgrad.convert_(nn.Sequential(copy.deepcopy(eager)))
        lean = wrap[0]
        if not type(lean).__module__.startswith("slimgrad."):
            # untouched (trivially exact) only where a reason is reported; float32 must convert
            assert pdt != torch.float32, f"{name}: float32 not converted"
            assert slimgrad.report(wrap).skipped, f"{name}: skipped without a reason"
            continue
        ref = copy.deepcopy(eager).double()
        for xdt, (training, mode) in itertools.product(INPUT_DTYPES, MODES):
            for m in (eager, lean, ref):
                m.train(training)
            _seed(3)
            shape = (4, 8, 3) if name == "Conv1d" else (4, 8)
            x0 = (torch.randn(shape, dtype=torch.float64) * 3).to(xdt)
            a, b = _run(eager, x0, mode), _run(lean, x0, mode)
            r = _run(ref, x0.double(), mode)
            _check(f"{name} params {pdt} input {xdt} train={training} {mode}", a, b, r, xdt)


def _check(row, a, b, r, xdt):
    if isinstance(a, type) or isinstance(b, type):
        assert a == b, f"{row}: eager gave {a}, converted {b}"
        return
    assert b[0].dtype == a[0].dtype, row
    if not _close(b[0], a[0]):
        # half precision: HF's gelu_new/gelu_fast round after every op, slimgrad's tanh-GELU
        # once; the output must then be within the rule against float64
        assert b[0].dtype in (torch.bfloat16, torch.float16), row
        ok, err, bound = rule_ok(b[0], r[0], a[0])
        assert ok, f"{row}: output err {err:.3e} > bound {bound:.3e}"
    torch.testing.assert_close(b[1], a[1], msg=lambda m: f"{row}: input after: {m}")
    if a[2] is None:
        assert b[2] is None, row
        return
    # float64: eager is the reference itself; allow float64 rounding of O(1) gradients
    atol = 1e-10 if xdt == torch.float64 else None
    assert_within_rule(list(b[2]), list(r[2]), list(a[2]), atol=atol)
