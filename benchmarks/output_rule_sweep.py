"""Which norms run eager's op at the model's output, over tiny HF families, and what it costs.

    PYTHONPATH=src python benchmarks/output_rule_sweep.py [--seq 64] [family ...]

For each family (BERT, RoBERTa, DeBERTa-v2, BART, OPT, T5, GPT-2, Llama, Mistral, ViT, CLIP; tiny
configs, train mode, batch 2) it converts a copy of the eager model and prints the modules whose
output may be the model's output (``keep_y`` False: NOTE [Modules whose output is the model's
output] in slimgrad/convert_handlers/inplace_guard.py), the exact saved and peak bytes of one
step (the loss a fixed weighting of every returned hidden state) for eager and slimgrad (after one
warm-up step), and the largest gradient difference from eager. ``--hidden-states`` makes each call
ask for the hidden states (``output_hidden_states=True``: NOTE [Hidden states handed out per call]
in slimgrad/nn/_output_act.py). Prints only; no records.
"""

from __future__ import annotations

import argparse
import copy

import torch

import slimgrad
from slimgrad.memory import measure

FAMILIES = [
    "bert", "roberta", "deberta-v2", "bart", "opt", "t5", "gpt2", "llama", "mistral", "vit", "clip",
]  # fmt: skip


def build(name: str, seq: int) -> torch.nn.Module:
    import transformers as T

    kw = dict(num_hidden_layers=3, num_attention_heads=4, intermediate_size=64, vocab_size=99)
    kw.update(hidden_size=32)
    torch.manual_seed(0)
    if name == "bert":
        return T.BertModel(T.BertConfig(**kw))
    if name == "roberta":
        return T.RobertaModel(T.RobertaConfig(**kw))
    if name == "deberta-v2":
        return T.DebertaV2Model(T.DebertaV2Config(**kw))
    if name == "bart":
        cfg = T.BartConfig(
            d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=99,
        )  # fmt: skip
        return T.BartModel(cfg)
    if name == "opt":
        cfg = T.OPTConfig(
            hidden_size=32, num_hidden_layers=3, num_attention_heads=4, ffn_dim=64,
            vocab_size=99, word_embed_proj_dim=32,
        )  # fmt: skip
        return T.OPTModel(cfg)
    if name == "t5":
        return T.T5Model(T.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=4, vocab_size=99))
    if name == "gpt2":
        return T.GPT2Model(T.GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=99))
    if name == "llama":
        return T.LlamaModel(T.LlamaConfig(num_key_value_heads=2, **kw))
    if name == "mistral":
        return T.MistralModel(T.MistralConfig(num_key_value_heads=2, **kw))
    if name == "vit":
        return T.ViTModel(T.ViTConfig(image_size=16, patch_size=4, **kw))
    vision = {k: v for k, v in kw.items() if k != "vocab_size"}
    cfg = T.CLIPConfig(
        text_config=dict(**kw, max_position_embeddings=max(seq, 32)),
        vision_config=dict(image_size=16, patch_size=4, **vision),
        projection_dim=16,
    )
    return T.CLIPModel(cfg)


def inputs(name: str, seq: int) -> dict:
    ids = torch.arange(3, 3 + 2 * seq).view(2, seq) % 99
    mask = torch.ones_like(ids)
    mask[1, seq - seq // 4 :] = 0
    pix = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    if name == "vit":
        return {"pixel_values": pix}
    if name == "clip":
        return {"input_ids": ids, "attention_mask": mask, "pixel_values": pix}
    if name in ("bart", "t5"):
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": ids[:, :5]}
    return {"input_ids": ids, "attention_mask": mask}


def returned(name: str, out) -> list[torch.Tensor]:
    if name == "clip":
        return [
            out.text_embeds, out.image_embeds, out.text_model_output.last_hidden_state,
            out.vision_model_output.last_hidden_state,
        ]  # fmt: skip
    found = [out.last_hidden_state]
    for extra in ("encoder_last_hidden_state", "pooler_output"):
        if getattr(out, extra, None) is not None:
            found.append(getattr(out, extra))
    return found


def loss(ts: list[torch.Tensor]) -> torch.Tensor:
    return sum((t * torch.linspace(-1, 1, t.numel()).view(t.shape)).sum() for t in ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", default=FAMILIES)
    ap.add_argument("--seq", type=int, default=9)
    ap.add_argument("--hidden-states", action="store_true", help="calls ask for hidden states")
    args = ap.parse_args()
    extra = {"output_hidden_states": True} if args.hidden_states else {}
    torch.set_num_threads(1)
    for name in args.families:
        eager = build(name, args.seq)
        ours = slimgrad.convert_(copy.deepcopy(eager))
        off = [n for n, m in ours.named_modules() if getattr(m, "keep_y", True) is False]
        mem, grads = [], []
        for m in (eager, ours):
            m.train()

            def step(m=m, name=name):
                return loss(returned(name, m(**inputs(name, args.seq), **extra)))

            step().backward()  # warm-up: caches count in the step that makes them
            m.zero_grad()
            r = measure(step, timeline=False)
            mem.append((r.saved_bytes, r.peak_bytes))
            m.zero_grad()
            torch.manual_seed(1)  # the same dropout masks on each side
            step().backward()
            grads.append([p.grad for p in m.parameters()])
        diff = max((a - b).abs().max().item() for a, b in zip(*grads, strict=True) if a is not None)
        print(
            f"{name}: eager saved/peak {mem[0][0]:,}/{mem[0][1]:,}  slimgrad "
            f"{mem[1][0]:,}/{mem[1][1]:,}  max |dgrad| {diff:.2e}  eager's op at the output "
            f"({len(off)}): {off}"
        )


if __name__ == "__main__":
    main()
