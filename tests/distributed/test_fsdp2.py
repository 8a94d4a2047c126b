"""A converted HF model under FSDP2 (``fully_shard`` per block and root, 2 gloo processes) equals
eager FSDP2: losses and full gradients over several optimizer steps, in fp32 and with a bf16-param /
fp32-reduce ``MixedPrecisionPolicy``; gradient-buffer reuse next to FSDP's own buffers changes no
bit; forward in-place writes inside sharded blocks; per-rank peak bytes measured with slimgrad's
tracker (``test_fsdp2_per_rank_peak``, run with -s, prints them).

Why reuse is safe next to FSDP2 (NOTE [Gradient-buffer ownership] in slimgrad/ownership.py,
"Distributed"): an all-gathered parameter is an ``nn.Parameter``, a leaf that requires grad, and
shares its storage with FSDP's all-gather output (each refuses it as a saved tensor:
``test_all_gathered_parameter_is_never_granted``); the reduce-scatter input is FSDP's own copy of
``unsharded_param.grad``, made after autograd accumulated it, and no autograd gradient aliases it;
FSDP's identity ``RegisterPostBackwardFunction`` hands gradients on without keeping them.
``test_reuse_changes_no_bit_under_fsdp2`` checks it end to end: reuse on and off give
bit-identical losses and full gradients, and reuse was granted on every rank.
"""

from __future__ import annotations

import functools

import pytest
import torch

from slimgrad import memory, ownership
from slimgrad.testing import DEFAULT_ATOL
from tests.distributed._gloo import (
    VOCAB,
    assert_steps_within_rule,
    prepare,
    reuse_for,
    run_on_two_ranks,
    tiny_gpt2,
    tiny_llama,
)

pytestmark = pytest.mark.distributed

pytest.importorskip("transformers")  # the tiny HF models (_gloo.tiny_llama, tiny_gpt2)
fsdp = pytest.importorskip("torch.distributed.fsdp")

STEPS = 3
MEM_T = 32  # tokens per row in the measured step
B, T = 2, 8


def _build(family: str):
    if family == "llama":
        model = tiny_llama()
        return model, list(model.model.layers)
    model = tiny_gpt2()  # tied embedding: one parameter at the root
    return model, list(model.transformer.h)


def _sharded(family: str, variant: str, mp: bool):
    model, blocks = _build(family)
    model = prepare(model, variant)
    policy = fsdp.MixedPrecisionPolicy()
    if mp and variant != "ref64":
        policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        fsdp.fully_shard(block, mp_policy=policy)
    fsdp.fully_shard(model, mp_policy=policy)
    return model


def _batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + 10 * rank + step)  # different data per rank
    return torch.randint(1, VOCAB, (B, T), generator=g)


def _run(family: str, variant: str, rank: int) -> dict:
    mp = variant.endswith("_bf16")
    model = _sharded(family, variant.removesuffix("_bf16"), mp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    with reuse_for(variant):
        for step in range(STEPS):
            ids = _batch(rank, step)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad.full_tensor() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
    return {"loss": losses, "grad": grads, "reuse": ownership.reuse_count()}


VARIANTS = ("ref64", "eager", "slimgrad", "no_reuse", "eager_bf16", "slimgrad_bf16")


def _peak(family: str, variant: str, rank: int, sharded: bool) -> int:
    # one warm-up step (lazy caches), then the measured step; a longer batch than training's
    if sharded:
        model = _sharded(family, variant, mp=False)
    else:
        model = prepare(_build(family)[0], variant)
    # the same batch on both ranks: the bytes must then agree (data-dependent side tables, e.g.
    # a smooth activation's hard elements, would otherwise differ per rank)
    ids = torch.randint(1, VOCAB, (B, MEM_T), generator=torch.Generator().manual_seed(7))
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    return memory.measure(lambda: model(input_ids=ids, labels=ids).loss).peak_bytes


def _train(family: str, rank: int) -> dict:
    res = {v: _run(family, v, rank) for v in VARIANTS}
    res["peak"] = {
        (v, sharded): _peak(family, v, rank, sharded)
        for v in ("eager", "slimgrad")
        for sharded in (True, False)
    }
    return res


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def ranks(request, tmp_path_factory):
    """Every variant trained on both ranks (one pair of processes per family)."""
    train = functools.partial(_train, request.param)
    return run_on_two_ranks(train, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("mp", [False, True], ids=["fp32", "bf16_params"])
def test_converted_fsdp2_matches_eager_fsdp2(ranks, mp):
    sfx = "_bf16" if mp else ""
    # a bf16 forward's loss is one rounded scalar: bf16's atol (its gradients keep fp32's)
    loss_atol = DEFAULT_ATOL[torch.bfloat16] if mp else None
    for res in ranks:
        ref, eager, ours = res["ref64"], res["eager" + sfx], res["slimgrad" + sfx]
        assert ours["reuse"] > 0  # gradient buffers were reused next to FSDP's
        for what, atol in (("loss", loss_atol), ("grad", None)):
            assert_steps_within_rule(
                ours[what], ref[what], eager[what], what, steps=STEPS, atol=atol
            )


def test_reuse_changes_no_bit_under_fsdp2(ranks):
    for res in ranks:
        on, off = res["slimgrad"], res["no_reuse"]
        assert on["reuse"] > 0 and off["reuse"] == 0
        assert len(on["loss"]) == len(on["grad"]) == STEPS
        torch.testing.assert_close(
            (on["loss"], on["grad"]), (off["loss"], off["grad"]), rtol=0, atol=0
        )


def test_fsdp2_per_rank_peak(ranks, request):
    # Per-rank peak of one training step above the bytes live at its start (slimgrad.memory's
    # exact tracker runs in each process; it sees FSDP's all-gather buffers, their frees and the
    # reduce-scatter buffers). Eager and converted start from the same FSDP state, so their
    # difference is the saving per rank. The one-process figures exclude the resident parameters
    # while FSDP's include the all-gathered ones: compare within a setting, not across.
    for res in ranks:
        peak = res["peak"]
        assert peak["slimgrad", True] < peak["eager", True]
        assert peak["slimgrad", False] < peak["eager", False]
    assert ranks[0]["peak"] == ranks[1]["peak"]  # same shapes on both ranks: same bytes
    mib = {
        f"{v} {'fsdp2 per rank' if s else 'one process'}": b
        for (v, s), b in ranks[0]["peak"].items()
    }
    print(f"\n{request.node.callspec.id} peak bytes (B={B}, T={MEM_T}): {mib}")


class _SavesWeight(torch.autograd.Function):
    """y = x * sum(w), saving w (under FSDP2: the all-gathered parameter); backward asks
    ownership for w's buffer and, when ``reckless``, writes over it anyway."""

    @staticmethod
    def forward(ctx, x, w, reckless, seen):
        ctx.save_for_backward(x, w)
        ctx.reckless, ctx.seen = reckless, seen
        return x * w.sum()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        ctx.seen.append(ownership.take_saved(ctx, w) is not None)
        dx, dw = g * w.sum(), (g * x).sum().expand_as(w).clone()
        if ctx.reckless:
            # an unchecked reuse of FSDP's all-gather output, written around the version counter
            # (a plain in-place write gets autograd's "modified by an inplace operation" error)
            w.data.zero_()
        return dx, dw, None, None


class _Block(torch.nn.Module):
    def __init__(self, reckless: bool, seen: list) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        self.reckless, self.seen = reckless, seen

    def forward(self, x):
        y = self.lin(x)
        return _SavesWeight.apply(y, self.lin.weight, self.reckless, self.seen)


def _probe_fsdp_buffers(rank: int) -> dict:
    out = {}
    for reckless in (False, True):
        for sharded in (False, True) if not reckless else (True,):
            seen: list = []
            torch.manual_seed(0)
            model = torch.nn.Sequential(_Block(reckless, seen), _Block(reckless, seen))
            if sharded:
                for block in model:
                    fsdp.fully_shard(block)
                fsdp.fully_shard(model)
            x = torch.randn(3, 6, generator=torch.Generator().manual_seed(rank))
            model(x).sum().backward()
            grads = [p.grad for p in model.parameters()]
            if sharded:
                grads = [g.full_tensor() for g in grads]
            out[reckless, sharded] = {"grad": grads, "seen": seen}
    return out


def _extras(rank: int) -> dict:
    return {"probe": _probe_fsdp_buffers(rank), "cnn": _train_cnn(rank)}


@pytest.fixture(scope="module")
def extras(tmp_path_factory):
    """The probe and CNN runs below, in one pair of processes."""
    return run_on_two_ranks(_extras, tmp_path_factory.mktemp("extras"))


def test_all_gathered_parameter_is_never_granted(extras):
    # A saved all-gathered parameter is read again later in backward (the Linear's dx reads the
    # same buffer): ownership must refuse it, and a write over it must change the gradients that
    # FSDP reduce-scatters (so the comparison below would catch a wrong grant).
    for res in (r["probe"] for r in extras):
        assert res[False, True]["seen"] == [False, False]  # refused under FSDP2
        assert res[False, False]["seen"] == [False, False]  # a leaf that requires grad
        sharded, bad = res[False, True]["grad"], res[True, True]["grad"]
        assert any(not torch.equal(a, b) for a, b in zip(sharded, bad, strict=True))


def _cnn() -> torch.nn.Module:
    def block():
        return torch.nn.Sequential(
            torch.nn.Conv2d(4, 4, 3, padding=1),
            torch.nn.BatchNorm2d(4),
            torch.nn.ReLU(inplace=True),  # converted: writes over BN's output when it owns it
        )

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1),
        block(),
        block(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 5 * 5, 3),
    )


def _train_cnn(rank: int) -> dict:
    out = {}
    for variant in ("ref64", "eager", "slimgrad", "no_reuse"):
        model = prepare(_cnn(), variant)
        for block in (model[1], model[2]):
            fsdp.fully_shard(block)
        fsdp.fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grads = []
        with reuse_for(variant):
            for step in range(STEPS):
                g = torch.Generator().manual_seed(100 + 10 * rank + step)
                x = torch.randn(4, 3, 5, 5, generator=g, dtype=next(model.parameters()).dtype)
                model(x).square().mean().backward()
                grads.append([p.grad.full_tensor() for p in model.parameters()])
                opt.step()
                opt.zero_grad()
        out[variant] = {"grad": grads, "forward": ownership.reuse_count("forward")}
    return out


def test_forward_inplace_writes_under_fsdp2(extras):
    # Conv-BN-ReLU blocks, each fully_shard-ed: the converted in-place ReLU takes the derived path
    # (the BatchNorm keeps its output) inside FSDP's blocks (ownership.owns_input grants it:
    # FSDP's hooks sit on the block, not on the ReLU, and BN's output is no FSDP buffer). That
    # grant writes nothing (owns_input(writes=False)), so reuse off takes the same path: the same
    # grants, the same bits, within the error rule over the steps.
    for res in (r["cnn"] for r in extras):
        assert res["slimgrad"]["forward"] > 0
        assert res["no_reuse"]["forward"] == res["slimgrad"]["forward"]
        for a, b in zip(res["slimgrad"]["grad"], res["no_reuse"]["grad"], strict=True):
            assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
        for variant in ("slimgrad", "no_reuse"):
            grads = (res[v]["grad"] for v in (variant, "ref64", "eager"))
            assert_steps_within_rule(*grads, "grad", steps=STEPS, label=f"{variant} step")
