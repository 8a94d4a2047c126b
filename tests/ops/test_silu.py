import importlib

import torch
import torch.nn.functional as F

from slimgrad.ops.silu import silu, silu_
from tests.ops._output_act_helpers import Case, OutputActTests
from tests.ops._smooth_helpers import (
    check_adversarial_fallback,
    check_every_16bit,
    check_full_range,
    check_hard_window_every_float32,
    check_output_vs_eager,
    check_random_inputs,
)

M = importlib.import_module("slimgrad.ops.silu")

CASE = Case("silu", silu, F.silu, spec=M.SPEC, scale=1.0, double_backward=False)


class TestSilu(OutputActTests):
    CASES = [
        CASE,
        Case("silu_scale4", silu, F.silu, spec=M.SPEC, scale=4.0, double_backward=False),
    ]


def test_every_float32_near_minimum():
    check_hard_window_every_float32(M.SPEC, M._fwd_torch, M._bwd_exact)


def test_full_range_float32():
    check_full_range(M.SPEC, M._fwd_torch, M._bwd_exact)


def test_every_16bit_value():
    for dtype in (torch.bfloat16, torch.float16):
        check_every_16bit(M.SPEC, M._fwd_torch, M._bwd_exact, dtype)


def test_random_inputs():
    check_random_inputs(lambda t: silu(t), F.silu)


def test_adversarial_inputs_fall_back():
    check_adversarial_fallback(silu, F.silu, M.SPEC)


def test_inplace_keeps_no_clone():
    # eager silu_ saves a clone of x; ours keeps the overwritten output (shared with the next
    # Linear) + bits + table only
    from slimgrad.memory import measure

    fc1, fc2 = torch.nn.Linear(20, 64), torch.nn.Linear(64, 20)
    x = torch.randn(50, 20)
    fc2(silu_(fc1(x))).sum().backward()
    m = measure(lambda: fc2(silu_(fc1(x))).sum())
    me = measure(lambda: fc2(F.silu(fc1(x), inplace=True)).sum())
    hid = 50 * 64 * 4
    assert me.floor_bytes == hid and me.saved_bytes == 2 * hid  # the clone
    assert hid < m.saved_bytes < 1.2 * hid


def test_output_vs_eager():
    check_output_vs_eager(M.SPEC, M._fwd_torch)
