"""Compiled converted HF GPT-2 against compiled eager, same seeds: do they draw the same dropout
masks (issue 32, the masks question)?

Compiled eager GPT-2 (tiny, 0.1 dropout everywhere) draws its 7 masks with inductor's RNG: one
``inductor_seeds(7)`` per graph call, then ``aten.rand(shape) > p`` per dropout, in graph order
(embedding, then per layer attention, residual, MLP); the i-th draw takes the i-th seed. The
converted model traces its draws the same way at the same places (NOTE [Dropout traced under
torch.compile] in ``slimgrad/ops/dropout.py``, NOTE [The attention's dropout draw under
torch.compile] in ``ops/softmax_dropout.py``). Prints the first three losses (seeds 0, 1, 2) of
both, their differences, and the worst relative gradient difference of step 0 (other ops round
differently: gradients agree to float32 rounding, not bit for bit).

Usage: PYTHONPATH=src .venv/bin/python benchmarks/compile_masks.py
"""

import copy
import sys
import warnings

import torch

sys.path.insert(0, "benchmarks")  # compile_step.build
warnings.filterwarnings("ignore")
import compile_step as cs  # noqa: E402

import slimgrad  # noqa: E402

torch.set_num_threads(1)


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
