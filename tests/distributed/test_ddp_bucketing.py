"""Gradient-buffer reuse next to DDP's buckets (2 gloo processes): a converted model under
``DistributedDataParallel`` with ``gradient_as_bucket_view`` True and False, small buckets (one
parameter or two each) and ``no_sync`` accumulation gives eager DDP's gradients (error rule
against a float64 DDP run), reuse on and off give the same bits, and reuse was granted; the same
for a converted tiny HF GPT-2 (tied embedding, fused LM-head loss).

Why it is safe (NOTE [Gradient-buffer ownership], "Distributed", in slimgrad/ownership.py): DDP's
buckets hold parameter gradients (``param.grad``, a view of the bucket with
``gradient_as_bucket_view=True``, else a copy taken by DDP's post-accumulate hook), and a
backward asks for its incoming *activation* gradient. The one way those meet is a gradient
autograd hands to a parameter's AccumulateGrad and to a slimgrad backward at once (``z = h + pos``
below, ``pos`` a parameter of ``h``'s shape): AccumulateGrad runs first (the engine runs it as
soon as it is ready) and, the tensor being shared, copies it into ``.grad`` or adds it into the
bucket view; had it stolen the tensor, ``.grad`` would add a use and ``take`` would refuse it
(term 1). ``test_gradient_shared_with_a_bucketed_parameter`` checks that a write granted there
gives reuse off's bits, with and without bucket views and under ``no_sync``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from slimgrad import ownership
from tests.distributed._gloo import (
    VOCAB,
    assert_steps_within_rule,
    prepare,
    reuse_for,
    run_on_two_ranks,
    tiny_gpt2,
)

pytestmark = pytest.mark.distributed

try:
    import transformers
except ImportError:  # the [hf] extra: only the GPT-2 case needs it
    transformers = None

MICRO = 2  # micro-batches per optimizer step: the first MICRO - 1 under no_sync
STEPS = 2


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act1 = nn.GELU()
        self.pos = nn.Parameter(torch.randn(4, 16) * 0.1)  # dL/dpos is act1's incoming gradient
        self.norm = nn.LayerNorm(16)
        self.act2 = nn.SiLU()
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        z = self.act1(self.fc1(x)) + self.pos
        return self.fc2(self.act2(self.norm(z)))


def _run(variant: str, rank: int, bucket_view: bool) -> dict:
    torch.manual_seed(0)
    net = prepare(_Net(), variant)
    model = DDP(net, gradient_as_bucket_view=bucket_view, bucket_cap_mb=1e-4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    with reuse_for(variant):
        for step in range(STEPS):
            for micro in range(MICRO):
                g = torch.Generator().manual_seed(100 + 10 * rank + MICRO * step + micro)
                x = torch.randn(4, 8, generator=g, dtype=next(net.parameters()).dtype)
                sync = micro == MICRO - 1
                with contextlib.nullcontext() if sync else model.no_sync():
                    model(x).square().mean().backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
    return {"grad": grads, "reuse": ownership.reuse_count()}


def _train(rank: int) -> dict:
    res = {
        (v, bv): _run(v, rank, bv)
        for bv in (True, False)
        for v in ("ref64", "eager", "slimgrad", "no_reuse")
    }
    if transformers is not None:
        res["gpt2"] = _train_gpt2(rank)
    return res


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_on_two_ranks(_train, tmp_path_factory.mktemp("ddp"))


@pytest.mark.parametrize("bucket_view", [True, False], ids=["bucket_view", "copy"])
def test_converted_ddp_buckets_match_eager(ranks, bucket_view):
    for res in ranks:
        ref, eager, ours = (res[v, bucket_view] for v in ("ref64", "eager", "slimgrad"))
        assert ours["reuse"] > 0
        # micro k even: accumulated under no_sync (this rank's own); odd: all-reduced
        grads = (ours["grad"], ref["grad"], eager["grad"])
        assert_steps_within_rule(*grads, "grad", steps=STEPS * MICRO, label="micro")
    synced = [r["slimgrad", bucket_view]["grad"][1::2] for r in ranks]
    assert len(synced[0]) == STEPS
    torch.testing.assert_close(*synced, rtol=0, atol=0)  # synced micro-steps: replicas agree


@pytest.mark.parametrize("bucket_view", [True, False], ids=["bucket_view", "copy"])
def test_reuse_changes_no_bit_under_ddp(ranks, bucket_view):
    for res in ranks:
        on, off = res["slimgrad", bucket_view], res["no_reuse", bucket_view]
        assert on["reuse"] > 0 and off["reuse"] == 0
        torch.testing.assert_close(on["grad"], off["grad"], rtol=0, atol=0)


class _Triple(torch.autograd.Function):
    """y = 3x; backward writes 3g over its incoming gradient when ownership grants it."""

    @staticmethod
    def forward(ctx, x, seen):
        ctx.seen = seen
        return x * 3

    @staticmethod
    def backward(ctx, grad_out):
        buf = ownership.take(grad_out)
        ctx.seen.append(buf is not None)
        if buf is not None:
            return buf.mul_(3), None
        return grad_out * 3, None


class _Probe(nn.Module):
    def __init__(self, seen: list) -> None:
        super().__init__()
        self.seen = seen

    def forward(self, x):
        return _Triple.apply(x, self.seen)


def _probe_buckets(rank: int) -> dict:
    out = {}
    for bucket_view in (True, False):
        for reuse in (True, False):
            seen: list = []
            torch.manual_seed(0)
            net = _Net()
            net.act1 = _Probe(seen)  # its incoming gradient is also dL/dpos
            model = DDP(net, gradient_as_bucket_view=bucket_view, bucket_cap_mb=1e-4)
            with contextlib.nullcontext() if reuse else ownership.reuse_disabled():
                for micro in range(MICRO):
                    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank + micro))
                    with contextlib.nullcontext() if micro == MICRO - 1 else model.no_sync():
                        model(x).square().mean().backward()
            out[bucket_view, reuse] = {
                "grad": [p.grad.clone() for p in net.parameters()],
                "seen": seen,
            }
    return out


def test_gradient_shared_with_a_bucketed_parameter(tmp_path):
    # The probe's incoming gradient is the one AddBackward hands to pos's AccumulateGrad too.
    # AccumulateGrad runs first and, the tensor being shared, keeps a copy (or adds it into the
    # bucket view); only then may ``take`` grant it. Whatever it decides, the bits DDP all-reduces
    # and accumulates under no_sync are those of reuse off.
    for res in run_on_two_ranks(_probe_buckets, tmp_path):
        for bucket_view in (True, False):
            on, off = res[bucket_view, True], res[bucket_view, False]
            assert len(on["seen"]) == MICRO and off["seen"] == [False] * MICRO
            torch.testing.assert_close(on["grad"], off["grad"], rtol=0, atol=0)


def _run_gpt2(variant: str, rank: int, bucket_view: bool) -> dict:
    # tied embedding, fused LM-head loss once converted
    net = prepare(tiny_gpt2(n_positions=16), variant)
    model = DDP(net, gradient_as_bucket_view=bucket_view, bucket_cap_mb=0.01)
    grads = []
    with reuse_for(variant):
        for micro in range(MICRO):
            g = torch.Generator().manual_seed(10 * rank + micro)
            ids = torch.randint(1, VOCAB, (2, 8), generator=g)
            with contextlib.nullcontext() if micro == MICRO - 1 else model.no_sync():
                model(input_ids=ids, labels=ids).loss.backward()
            grads.append([p.grad.clone() for p in net.parameters()])
    return {"grad": grads, "reuse": ownership.reuse_count()}


def _train_gpt2(rank: int) -> dict:
    return {
        (v, bv): _run_gpt2(v, rank, bv)
        for bv in (True, False)
        for v in ("ref64", "eager", "slimgrad")
    }


def test_converted_gpt2_under_ddp_buckets(ranks):
    if transformers is None:
        pytest.skip("transformers is not installed (the [hf] extra)")
    # a converted HF model (tied embedding: the fused LM-head loss hands the tied weight's
    # gradient to AccumulateGrad next to the embedding's) under DDP with small buckets
    for res in (r["gpt2"] for r in ranks):
        for bv in (True, False):
            assert res["slimgrad", bv]["reuse"] > 0
            grads = (res[v, bv]["grad"] for v in ("slimgrad", "ref64", "eager"))
            label = f"bucket_view={bv} micro"
            assert_steps_within_rule(*grads, "grad", steps=MICRO, label=label)
