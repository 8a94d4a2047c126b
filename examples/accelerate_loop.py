"""An accelerate training loop with a converted model: ``slimgrad.convert_`` before ``prepare``.

A small GPT-style HF model (GPT-2 with its default dropout set to 0, so that three runs can be
compared step by step) is trained for a few steps by the usual accelerate loop (``prepare``,
``accelerator.backward``, ``optimizer.step``) three times on the same batches: eager float32,
converted float32 and eager float64. Asserts:

- every step loss of the converted run is within the error rule against float64
  (``|slimgrad - ref64| <= 2 |eager - ref64| + atol``);
- one training step of the prepared converted model peaks below the prepared eager model's, both
  measured by ``slimgrad.memory.measure``.

Run: ``python examples/accelerate_loop.py [--steps 3]`` (seconds on CPU; needs the ``[hf]`` extra
and accelerate).
"""

from __future__ import annotations

import argparse
import copy

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

import slimgrad
from slimgrad.testing import assert_within_rule

VOCAB, SEQ, BATCH = 256, 64, 4


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def make_batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(steps)]


def train(accelerator: Accelerator, model, batches) -> tuple[list[float], torch.nn.Module]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    model.train()
    losses = []
    for ids in batches:
        ids = ids.to(accelerator.device)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()

    accelerator = Accelerator(cpu=True)
    eager = make_model()
    lean = slimgrad.convert_(copy.deepcopy(eager))  # convert first; prepare sees plain modules
    ref = copy.deepcopy(eager).double()
    print(str(slimgrad.report(lean)).splitlines()[0])

    batches = make_batches(args.steps)
    runs = {
        name: train(accelerator, m, batches)
        for name, m in (("eager", eager), ("slimgrad", lean), ("float64", ref))
    }
    losses = {name: run[0] for name, run in runs.items()}
    for step, row in enumerate(zip(*losses.values(), strict=True)):
        print(f"step {step}: " + "  ".join(f"{n} {v:.7f}" for n, v in zip(losses, row)))
    assert_within_rule(
        torch.tensor(losses["slimgrad"], dtype=torch.float32),
        torch.tensor(losses["float64"], dtype=torch.float64),
        torch.tensor(losses["eager"], dtype=torch.float32),
        names=["loss"],
    )

    ids = batches[0]
    peaks = {}
    for name in ("eager", "slimgrad"):
        model = runs[name][1]
        step = slimgrad.memory.measure(lambda model=model: model(input_ids=ids, labels=ids).loss)
        peaks[name] = step.peak_bytes
        model.zero_grad(set_to_none=True)
    print(
        f"peak of one step: eager {peaks['eager'] / 2**20:.2f} MiB, "
        f"slimgrad {peaks['slimgrad'] / 2**20:.2f} MiB"
    )
    assert peaks["slimgrad"] < peaks["eager"], peaks
    print(f"accelerate: {args.steps} step losses within the error rule; peak below eager's")


if __name__ == "__main__":
    main()
