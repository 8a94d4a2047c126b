"""A plain training loop with the optimizer step inside backward: ``slimgrad.step_in_backward``.

Trains a converted tiny HF GPT-2 for a few steps twice from the same weights and batches: the plain
loop (``loss.backward(); opt.step(); opt.zero_grad()``) and the same loop with the handle that
``step_in_backward`` returns in place of the optimizer. Asserts the parameters are bit for bit the
same after every step, and that a steady step's peak (``slimgrad.memory.measure`` over the whole
step: forward, backward and the optimizer's step; the optimizer state already made; the same
dropout masks, loss and parameters after it on both sides) is below the plain loop's: no step
holds every gradient at once.

Run: ``python examples/step_in_backward_loop.py [--steps 3]`` (seconds on CPU; needs the ``[hf]``
extra).
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import slimgrad
from slimgrad import memory


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    steps = p.parse_args().steps
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=512, n_positions=64,
                     tie_word_embeddings=False)  # fmt: skip
    base = slimgrad.convert_(GPT2LMHeadModel(cfg))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (4, 32), generator=g) for _ in range(steps + 1)]

    plain = copy.deepcopy(base)
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.1)
    sib = copy.deepcopy(base)
    sopt = slimgrad.step_in_backward(sib, torch.optim.AdamW, lr=1e-3, weight_decay=0.1)

    def plain_step(ids):
        loss = plain(input_ids=ids, labels=ids).loss
        loss.backward()
        popt.step()
        popt.zero_grad()
        return loss

    def sib_step(ids):
        loss = sib(input_ids=ids, labels=ids).loss
        loss.backward()  # each parameter is updated here, as soon as its gradient is complete
        sopt.step()  # marks the end of the step
        sopt.zero_grad()
        return loss

    for i, ids in enumerate(batches[:steps]):
        torch.manual_seed(100 + i)  # the same dropout masks on both sides (GPT-2's default 0.1)
        a = plain_step(ids)
        torch.manual_seed(100 + i)
        b = sib_step(ids)
        assert torch.equal(a, b), (i, a.item(), b.item())
        for (name, x), y in zip(plain.named_parameters(), sib.parameters(), strict=True):
            assert torch.equal(x, y), f"step {i}: {name} differs"
        print(f"step {i}: loss {a.item():.6f}, parameters bit-identical")

    # a steady step each (optimizer state exists on both sides), measured by the exact tracker
    ids = batches[steps]

    def measured(model, opt):
        losses = []

        def whole_step():  # forward, backward and the optimizer's step, all under the tracker
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            return losses[-1]

        torch.manual_seed(100 + steps)  # the same dropout masks on both sides here too
        return memory.measure(whole_step, backward=False, timeline=False).peak_bytes, losses[0]

    (peak_plain, a), (peak_sib, b) = measured(plain, popt), measured(sib, sopt)
    assert torch.equal(a, b), (a.item(), b.item())  # the same step on both sides
    for (name, x), y in zip(plain.named_parameters(), sib.parameters(), strict=True):
        assert torch.equal(x, y), f"measured step: {name} differs"
    assert peak_sib < peak_plain, (peak_sib, peak_plain)
    print(f"step_in_backward: {steps} steps bit-identical to the plain loop; step peak "
          f"{peak_sib / 2**20:.2f} MiB vs {peak_plain / 2**20:.2f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
