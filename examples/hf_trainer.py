"""HF Trainer with a converted model: ``slimgrad.convert_`` first, then ``Trainer`` as usual.

Trains a tiny random-init Llama (its default config: no attention dropout) for a few steps, three
times with the same seed and the same batches: eager float32, converted float32, and eager float64
as the reference. The rows have different lengths and a collator pads them (attention mask, -100
labels on padding), so the converted attention sees real padding masks. Asserts every logged step
loss of the converted run is within the error rule against float64:
``|slimgrad - ref64| <= 2 |eager - ref64| + atol``.

Run: ``python examples/hf_trainer.py [--steps 4] [--gradient-checkpointing] [--peft]`` (seconds on
CPU; needs the ``[hf]`` extra and accelerate, which Trainer requires; ``--peft`` needs peft).
"""

from __future__ import annotations

import argparse
import copy
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import slimgrad
from slimgrad.testing import assert_within_rule

PAD, VOCAB = 0, 128


def make_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        pad_token_id=PAD,
    )
    return LlamaForCausalLM(cfg)


def make_data(n: int = 32) -> list[dict]:
    """Token rows of 8 to 32 tokens: a list works as a map-style dataset."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(8, 33, (n,), generator=g).tolist()
    return [{"input_ids": torch.randint(1, VOCAB, (k,), generator=g)} for k in lengths]


def pad_collator(rows: list[dict]) -> dict:
    """Right-pads a batch: ids with PAD, attention_mask 0 and labels -100 on the padding."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), longest), PAD)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = r["input_ids"]
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def train(model: torch.nn.Module, data: list[dict], steps: int) -> list[float]:
    """Trainer.train() for ``steps`` steps; returns each step's logged loss."""
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=steps,
            per_device_train_batch_size=4,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=pad_collator)
        trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--peft", action="store_true", help="LoRA adapters (peft) on q/v projections")
    args = ap.parse_args()

    eager = make_model()
    lean = slimgrad.convert_(copy.deepcopy(eager))  # before Trainer: it only sees a model
    ref = copy.deepcopy(eager).double()
    print(str(slimgrad.report(lean)).splitlines()[0])

    models = {"eager": eager, "slimgrad": lean, "float64": ref}
    if args.peft:  # adapters on the converted model (PEFT wraps slimgrad's Linear as nn.Linear)
        from peft import LoraConfig, get_peft_model

        for name, model in models.items():
            torch.manual_seed(2)  # the same adapter init on every side
            cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
            models[name] = get_peft_model(model, cfg)
            if name == "float64":
                models[name].double()
    if args.gradient_checkpointing:  # HF's own switch, before or after convert_ alike
        for model in models.values():
            model.gradient_checkpointing_enable()
    data = make_data()
    losses = {name: train(model, data, args.steps) for name, model in models.items()}
    for step, row in enumerate(zip(*losses.values(), strict=True)):
        print(f"step {step}: " + "  ".join(f"{n} {v:.7f}" for n, v in zip(losses, row)))
    assert len(losses["slimgrad"]) == args.steps
    assert_within_rule(
        torch.tensor(losses["slimgrad"], dtype=torch.float32),
        torch.tensor(losses["float64"], dtype=torch.float64),
        torch.tensor(losses["eager"], dtype=torch.float32),
        names=["loss"],
    )
    print(f"trainer: {args.steps} step losses within the error rule against float64")


if __name__ == "__main__":
    main()
