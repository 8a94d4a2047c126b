"""slimgrad under tensor parallelism on DTensors (2 gloo processes).

- A converted tiny HF Llama with ``parallelize_module`` ColwiseParallel/RowwiseParallel on every
  block's MLP (slimgrad's GatedMLP) and attention (converted: slimgrad attention with dropout on
  each rank's local heads, HFRMSNorm, the fused LM-head loss) trains like eager TP: losses and full
  gradients
  by the error rule against a float64 TP run, over 2 SGD steps, with the projections' outputs local
  (the default) and with DTensors reaching ``glu`` (``use_local_output=False``).
- ``slimgrad._dtensor``'s entry helpers (NOTE [DTensor at a slimgrad op]): pointwise ops and norms
  on sharded DTensors give eager's values, gradients and placements; what is not exact on local
  shards raises a clear error naming the op and the fix.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import slimgrad
from slimgrad import _dtensor, ops
from tests.distributed._gloo import (
    VOCAB,
    assert_steps_within_rule,
    prepare,
    run_on_two_ranks,
    tiny_llama,
)

pytestmark = pytest.mark.distributed

pytest.importorskip("transformers")  # the tiny HF Llama (_gloo.tiny_llama)
tensor = pytest.importorskip("torch.distributed.tensor")
tp = pytest.importorskip("torch.distributed.tensor.parallel")

STEPS = 2
B, T = 2, 8
ERROR_FORM = re.compile(r"^slimgrad\.[\w.]+: .+; expected .+, got .+\. .+\.$", re.S)


def _plan(local: bool) -> dict:
    col, row = tp.ColwiseParallel, tp.RowwiseParallel
    return {
        "self_attn.q_proj": col(),
        "self_attn.k_proj": col(),
        "self_attn.v_proj": col(),
        "self_attn.o_proj": row(),
        "mlp.gate_proj": col(use_local_output=local),
        "mlp.up_proj": col(use_local_output=local),
        "mlp.down_proj": row(),
    }


def _train_tp(variant: str, rank: int, local: bool) -> dict:
    # converted attention (softmax_dropout_matmul) with dropout on each rank's local heads
    model = prepare(tiny_llama(attention_dropout=0.1), variant)
    if variant == "slimgrad":
        assert type(model.model.layers[0].mlp).__name__ == "GatedMLP"
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
    for block in model.model.layers:
        tp.parallelize_module(block, mesh, _plan(local))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)  # TP: the same batch on both ranks
        ids = torch.randint(1, VOCAB, (B, T), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append([_full(p.grad) for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return {"loss": losses, "grad": grads}


def _full(t):
    return t.full_tensor() if _dtensor.is_dtensor(t) else t


# ``_dtensor`` helpers on DTensors: (name, slimgrad call, eager call on DTensors, input specs)
def _helper_cases():
    S, R = tensor.Shard, tensor.Replicate
    norm_specs = [((2, 6, 8), S(1)), ((8,), R())]
    return {
        "silu": (
            lambda x: _dtensor.pointwise("slimgrad.ops.silu", ops.silu, x),
            F.silu,
            [((4, 8), S(1))],
        ),
        "gelu_replicated": (
            lambda x: _dtensor.pointwise("slimgrad.ops.gelu", ops.gelu, x, approximate="tanh"),
            lambda x: F.gelu(x, approximate="tanh"),
            [((4, 8), R())],
        ),
        "rms_norm": (
            lambda x, w: _dtensor.rowwise(
                "slimgrad.ops.rms_norm",
                ops.rms_norm,
                x,
                {"weight": w},
                1,
                normalized_shape=(8,),
                eps=1e-6,
            ),
            lambda x, w: F.rms_norm(x, (8,), w, 1e-6),
            norm_specs,
        ),
        "hf_rms_norm": (
            lambda x, w: _dtensor.rowwise(
                "slimgrad.ops.hf_rms_norm", ops.hf_rms_norm, x, {"weight": w}, 1, eps=1e-6
            ),
            lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)),
            norm_specs,
        ),
        "layer_norm": (
            lambda x, w, b: _dtensor.rowwise(
                "slimgrad.ops.layer_norm",
                ops.layer_norm,
                x,
                {"weight": w, "bias": b},
                1,
                normalized_shape=(8,),
            ),
            lambda x, w, b: F.layer_norm(x, (8,), w, b),
            [((2, 6, 8), S(1)), ((8,), R()), ((8,), R())],
        ),
    }


def _run_helpers(rank: int) -> dict:
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
    out = {}
    for name, (ours, eager, specs) in _helper_cases().items():
        res = []
        for fn in (eager, ours):
            torch.manual_seed(0)
            ins = [
                tensor.distribute_tensor(torch.randn(shape), mesh, [pl]).requires_grad_()
                for shape, pl in specs
            ]
            y = fn(*ins)
            weights = torch.arange(y.numel()).reshape(y.shape).to(y.dtype).sin()
            (y * tensor.distribute_tensor(weights, mesh, y.placements)).sum().backward()
            res.append(
                {
                    "y": y.full_tensor(),
                    "placements": tuple(y.placements),
                    "grads": [i.grad.full_tensor() for i in ins],
                    "grad_placements": [tuple(i.grad.placements) for i in ins],
                }
            )
        out[name] = res
    out["errors"] = _errors(mesh)
    return out


def _errors(mesh) -> dict:
    S, R, P = tensor.Shard, tensor.Replicate, tensor.Partial
    x = tensor.distribute_tensor(torch.randn(2, 6, 8), mesh, [S(1)])
    w = tensor.distribute_tensor(torch.ones(8), mesh, [R()])
    partial = tensor.DTensor.from_local(torch.randn(4, 8), mesh, [P()])
    calls = {
        "refuse": lambda: _dtensor.refuse("slimgrad.ops.dropout", input=x),
        "partial": lambda: _dtensor.pointwise("slimgrad.ops.silu", ops.silu, partial),
        "inplace": lambda: _dtensor.pointwise("slimgrad.ops.silu", ops.silu, x, inplace=True),
        "mixed": lambda: _dtensor.pointwise(
            "slimgrad.ops.glu", lambda a, b: a * b, x, x.to_local()
        ),
        "norm_dim_sharded": lambda: _dtensor.rowwise(
            "slimgrad.ops.rms_norm",
            ops.rms_norm,
            tensor.distribute_tensor(torch.randn(2, 6, 8), mesh, [S(2)]),
            {"weight": w},
            1,
            normalized_shape=(8,),
        ),
        "weight_sharded": lambda: _dtensor.rowwise(
            "slimgrad.ops.rms_norm",
            ops.rms_norm,
            x,
            {"weight": tensor.distribute_tensor(torch.ones(8), mesh, [S(0)])},
            1,
            normalized_shape=(8,),
        ),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except NotImplementedError as e:
            out[name] = str(e)
    out["plain_is_not_dtensor"] = not _dtensor.any_dtensor(torch.ones(1), None)
    return out


def _sequence_parallel_norm(rank: int) -> dict:
    # a Llama RMSNorm under SequenceParallel: each rank holds half the sequence (Shard(1))
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
    out = {}
    for variant in ("eager", "slimgrad"):
        torch.manual_seed(0)
        norm = LlamaRMSNorm(8)
        norm.weight.data.normal_()
        if variant == "slimgrad":
            norm = slimgrad.convert_(torch.nn.Sequential(norm))[0]
            assert type(norm).__name__ != "LlamaRMSNorm"
        tp.parallelize_module(norm, mesh, tp.SequenceParallel())
        x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1))
        local = x.chunk(2, dim=1)[rank].requires_grad_()
        try:
            y = norm(local)
            y.full_tensor().sin().sum().backward()
            out[variant] = [y.full_tensor(), local.grad, norm.weight.grad.full_tensor()]
        except Exception as e:  # recorded: the call sites are not in the ops yet
            out[variant] = f"{type(e).__name__}: {e}"
    return out


def _train(rank: int) -> dict:
    res = {"sequence_parallel": _sequence_parallel_norm(rank)}
    res.update(
        {
            (v, local): _train_tp(v, rank, local)
            for local in (True, False)
            for v in ("ref64", "eager", "slimgrad")
        }
    )
    res["helpers"] = _run_helpers(rank)
    return res


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_on_two_ranks(_train, tmp_path_factory.mktemp("tp"))


@pytest.mark.parametrize("local", [True, False], ids=["local_outputs", "dtensor_into_glu"])
def test_converted_llama_tp_matches_eager_tp(ranks, local):
    for res in ranks:
        ref, eager, ours = (res[v, local] for v in ("ref64", "eager", "slimgrad"))
        for what in ("loss", "grad"):
            assert_steps_within_rule(ours[what], ref[what], eager[what], what, steps=STEPS)


@pytest.mark.parametrize("name", list(_helper_cases()) if tensor else [])
def test_dtensor_helpers_match_eager_on_dtensors(ranks, name):
    for res in ranks:
        eager, ours = res["helpers"][name]
        assert ours["placements"] == eager["placements"]
        assert ours["grad_placements"] == eager["grad_placements"]
        torch.testing.assert_close(ours["y"], eager["y"])
        torch.testing.assert_close(ours["grads"], eager["grads"])


def test_dtensor_refusals_name_the_op_and_the_fix(ranks):
    errors = ranks[0]["helpers"]["errors"]
    assert errors.pop("plain_is_not_dtensor") is True
    for name, msg in errors.items():
        assert msg is not None, f"{name}: no error"
        assert ERROR_FORM.match(msg), f"{name}: {msg}"
    assert errors["refuse"].startswith("slimgrad.ops.dropout: ")
    assert "Partial" in errors["partial"] and "inplace=False" in errors["inplace"]


def test_sequence_parallel_converted_rms_norm_matches_eager(ranks):
    for res in ranks:
        eager, ours = res["sequence_parallel"]["eager"], res["sequence_parallel"]["slimgrad"]
        assert not isinstance(eager, str), eager
        assert not isinstance(ours, str), ours
        torch.testing.assert_close(ours, eager)
