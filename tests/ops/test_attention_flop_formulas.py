"""FlopCounterMode counts the attention ops' products (NOTE [The attention ops' FLOPs for
FlopCounterMode] in slimgrad/ops/softmax_dropout.py).

Each op called through the dispatcher (one op to the counter) against its Python implementation
run under the counter (its ATen products seen one by one): the same FLOPs, over shapes with
broadcast batch dims and every gradient mask; and a converted HF model's FLOPs under the counter,
with and without a checkpoint, against eager's.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import slimgrad
from slimgrad._library import python_impl
from slimgrad.ops import softmax_dropout as sd
from tests._gc_steps import checkpointed
from tests.conformance._hf_families import FAMILIES, build, inputs

sd.register_flop_formulas()
OPS = torch.ops.slimgrad

# (scores/probs shape, value shape): batch dims equal, broadcast, value 2-D
SHAPES = [((2, 3, 5, 7), (2, 3, 7, 4)), ((2, 3, 5, 7), (1, 3, 7, 4)), ((3, 5, 7), (7, 6))]


def _counted(fn, *args) -> int:
    with FlopCounterMode(display=False) as fc:
        fn(*args)
    return fc.get_total_flops()


def _both(name: str, *args) -> tuple[int, int]:
    # (the op through the dispatcher: its formula, its implementation: the ATen ops it issues)
    op = getattr(OPS, name)
    return _counted(op, *args), _counted(python_impl(f"slimgrad::{name}"), *args)


@pytest.mark.parametrize("s_shape, v_shape", SHAPES)
@pytest.mark.parametrize("p", [0.0, 0.25])
def test_softmax_dropout_matmul(s_shape, v_shape, p):
    s, v = torch.randn(s_shape), torch.randn(v_shape)
    formula, ops = _both("softmax_dropout_matmul_fwd", s, v, p, -1, torch.float32, False, None)
    assert formula == ops > 0
    out, probs, bits = OPS.softmax_dropout_matmul_fwd(s, v, p, -1, torch.float32, False, None)
    for mask in itertools.product([False, True], repeat=2):
        args = (torch.randn(out.shape), probs, bits, v, p, -1, False, torch.float32)
        args += (torch.float32, list(v.shape), list(mask))
        formula, ops = _both("softmax_dropout_matmul_bwd", *args)
        assert formula == ops


@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape",
    [((2, 3, 5, 4), (2, 3, 4, 7), (2, 3, 7, 6)), ((2, 3, 5, 4), (1, 3, 4, 7), (2, 3, 7, 6))],
)
def test_scores_softmax_dropout_matmul(q_shape, k_shape, v_shape):
    q, k_t, v = torch.randn(q_shape), torch.randn(k_shape), torch.randn(v_shape)
    fwd = (q, k_t, v, 0.25, torch.float32, False, None)
    formula, ops = _both("scores_softmax_dropout_matmul", *fwd)
    assert formula == ops > 0
    out, bits = OPS.scores_softmax_dropout_matmul(*fwd)
    for needs in itertools.product([False, True], repeat=3):
        args = (torch.randn(out.shape), q, k_t, v, bits, None, 0.25, torch.float32, False)
        formula, ops = _both("scores_softmax_dropout_matmul_bwd", *args, False, list(needs))
        assert formula == ops


def _forward_flops(model, batch) -> int:
    with FlopCounterMode(display=False) as fc:
        model(**batch)
    return fc.get_total_flops()


@pytest.mark.parametrize("fam", ["gpt2", "opt", "bert"])
def test_a_converted_models_forward_counts_its_products(fam):
    # before: GPT-2's attention counted half its bmm FLOPs unless checkpointed
    base = build(FAMILIES[fam]).train()
    batch = inputs(FAMILIES[fam], base, labels=False)
    eager = _forward_flops(base, batch)
    slim = slimgrad.convert_(copy.deepcopy(base))
    assert _forward_flops(slim, batch) == eager
    assert _forward_flops(checkpointed(slim), batch) == eager
