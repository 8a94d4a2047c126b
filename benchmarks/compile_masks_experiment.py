"""Experiment (issue 32, the masks question): can compiled converted HF GPT-2 draw the dropout
masks compiled eager draws? Not a feature: it patches two private functions for this process only.

Compiled eager GPT-2 (tiny, 0.1 dropout everywhere) draws its 7 masks with inductor's RNG: one
``inductor_seeds(7)`` per graph call, then ``aten.rand(shape) > p`` per dropout, in graph order
(embedding, then per layer attention, residual, MLP); the seed index of each draw is its order in
the graph. With ``patch``: slimgrad's traced CPU dropout draws ``torch.rand_like(x) > p`` (the
decomposition of ``aten.native_dropout``) instead of the eager ``bernoulli_`` custom op, and the
attention scores op draws its mask in the graph at the same place, packs it, and passes the bits to
a custom op that applies them (its backward is ``slimgrad::scores_softmax_dropout_matmul_bwd``).
Prints the first three losses (seeds 0, 1, 2) of both and the worst relative gradient difference
of step 0.

Usage: PYTHONPATH=src .venv/bin/python benchmarks/compile_masks_experiment.py [patch]
"""

import copy
import importlib
import sys
import warnings

import torch

sys.path.insert(0, "benchmarks")  # compile_step.build
warnings.filterwarnings("ignore")
import compile_step as cs  # noqa: E402

import slimgrad  # noqa: E402

torch.set_num_threads(1)
D = importlib.import_module("slimgrad.ops.dropout")
SD = importlib.import_module("slimgrad.ops.softmax_dropout")
patch = "patch" in sys.argv


def fwd_traced(ctx, x, p):
    keep = torch.rand_like(x) > p
    ctx.p, ctx.packed = p, True
    ctx.save_for_backward(D._pack_traced(keep))
    return keep * x * float(1.0 / (1.0 - p))


@torch.library.custom_op("c23::sdm_bits", mutates_args=())
def sdm_bits(
    q: torch.Tensor,
    k_t: torch.Tensor,
    v: torch.Tensor,
    bits: torch.Tensor,
    p: float,
    mm_dtype: torch.dtype,
    causal: bool,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    probs = SD._softmax_fwd(torch.matmul(q, k_t), -1, causal, mask, own=True)
    keep = D._unpack_traced(bits, probs.shape)
    dropped = keep * probs * float(1.0 / (1.0 - p))
    return torch.matmul(dropped, v)


@sdm_bits.register_fake
def _(q, k_t, v, bits, p, mm_dtype, causal, mask):
    s = torch.matmul(q, k_t)
    return torch.matmul(s, v)


def setup(ctx, inputs, output):
    q, k_t, v, bits, p, mm_dtype, causal, mask = inputs
    ctx.save_for_backward(q, k_t, v, bits, mask)
    ctx.p, ctx.mm_dtype, ctx.causal, ctx.fused = p, mm_dtype, causal, D._fused(q)


def backward(ctx, d_out):
    q, k_t, v, bits, mask = ctx.saved_tensors
    needs = [True, True, True]
    dq, dk, dv = SD._scores_sdm_bwd(
        d_out, q, k_t, v, bits, mask, ctx.p, ctx.mm_dtype, ctx.causal, ctx.fused, needs
    )
    return dq, dk, dv, None, None, None, None, None


sdm_bits.register_autograd(backward, setup_context=setup)


def scores_traced(q, k_t, v, p, mm_dtype, causal, mask):
    shape = (*torch.broadcast_shapes(q.shape[:-2], k_t.shape[:-2]), q.shape[-2], k_t.shape[-1])
    keep = torch.rand(shape, dtype=q.dtype, device=q.device) > p
    bits = D._pack_traced(keep)
    return (sdm_bits(q, k_t, v, bits, p, mm_dtype, causal, mask), bits)


if patch:
    D._DropoutTracedFn.forward = staticmethod(fwd_traced)
    SD._scores_sdm = scores_traced

model, batch = cs.build("gpt2", "tiny")
conv = copy.deepcopy(model)
slimgrad.convert_(conv)
res = {}
for name, m in (("eager", model), ("slim", conv)):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    f = torch.compile(m)
    losses, grads = [], None
    for i in range(3):
        torch.manual_seed(i)
        m.zero_grad(set_to_none=True)
        loss = f(**batch).loss
        loss.backward()
        losses.append(loss.item())
        if i == 0:
            grads = {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}
    res[name] = (losses, grads)
    print(
        name,
        "losses",
        [f"{v:.7f}" for v in losses],
        "breaks",
        sum(torch._dynamo.utils.counters["graph_break"].values()),
        "guards",
        cs.guard_count(),
    )
le, ge = res["eager"]
ls, gs = res["slim"]
print("loss diffs", [abs(a - b) for a, b in zip(le, ls)])
worst = max(
    ((ge[k] - gs[k]).abs().max().item() / (ge[k].abs().max().item() + 1e-30), k)
    for k in ge
    if k in gs
)
print("worst grad rel diff (step 0)", worst, "params compared", len([k for k in ge if k in gs]))
