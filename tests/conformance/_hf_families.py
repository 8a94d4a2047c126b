"""Tiny random HF configs for the conformance suite, their inputs, and the padding they run with.

Every family is built at fp32 with 2 layers, a hidden size of 32-64, 2-4 heads and a vocabulary of
a few hundred, with every dropout the config has switched on (attention dropout included), so a
training forward exercises the dropout paths a converted model replaces. Inputs are deterministic
(a fixed generator), so the eager model, the converted one and the float64 reference see the same
batch.

The padding here is written independently of ``slimgrad.verify``'s, so that the suite's verdict on
padded batches can cross-check verify's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

B, T = 3, 12  # batch rows, text length
VOCAB = 211
IMG = 32  # image side for the vision families
DROP = 0.1


@dataclass(frozen=True)
class Family:
    name: str
    config: str  # transformers config class
    model: str  # transformers model class
    kind: str  # causal | mlm | seq2seq | speech | image | clip
    overrides: dict = field(default_factory=dict)
    attn: str | None = None  # attn_implementation to build with; None: the class's default

    @property
    def text(self) -> bool:
        return self.kind in ("causal", "mlm", "seq2seq", "clip")

    @property
    def generates(self) -> bool:
        return self.kind in ("causal", "seq2seq")


_LM = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
_LLAMA = dict(
    _LM,
    intermediate_size=64,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attention_dropout=DROP,
    pad_token_id=0,
)
_BERT = dict(
    _LM,
    intermediate_size=64,
    max_position_embeddings=64,
    hidden_dropout_prob=DROP,
    attention_probs_dropout_prob=DROP,
    pad_token_id=1,
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family(
            "gpt2",
            "GPT2Config",
            "GPT2LMHeadModel",
            "causal",
            dict(
                vocab_size=VOCAB,
                n_embd=32,
                n_layer=2,
                n_head=4,
                n_positions=64,
                resid_pdrop=DROP,
                embd_pdrop=DROP,
                attn_pdrop=DROP,
                pad_token_id=0,
                bos_token_id=2,
                eos_token_id=2,
            ),
        ),
        Family(
            "gpt_neox",
            "GPTNeoXConfig",
            "GPTNeoXForCausalLM",
            "causal",
            dict(
                _LM,
                intermediate_size=64,
                max_position_embeddings=64,
                attention_dropout=DROP,
                hidden_dropout=DROP,
                pad_token_id=0,
            ),
        ),
        Family("llama", "LlamaConfig", "LlamaForCausalLM", "causal", _LLAMA),
        Family("llama_eager", "LlamaConfig", "LlamaForCausalLM", "causal", _LLAMA, "eager"),
        Family("mistral", "MistralConfig", "MistralForCausalLM", "causal", _LLAMA),
        Family(
            "mistral_sw",
            "MistralConfig",
            "MistralForCausalLM",
            "causal",
            dict(_LLAMA, sliding_window=5),  # shorter than T: the window masks something
        ),
        Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", "causal", _LLAMA),
        Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", "causal", dict(_LLAMA, head_dim=8)),
        Family("gemma", "GemmaConfig", "GemmaForCausalLM", "causal", dict(_LLAMA, head_dim=8)),
        Family(
            "gemma2",
            "Gemma2Config",
            "Gemma2ForCausalLM",
            "causal",
            dict(
                _LLAMA,
                head_dim=8,
                sliding_window=5,
                attn_logit_softcapping=5.0,
                final_logit_softcapping=3.0,
                query_pre_attn_scalar=8,
            ),
        ),
        Family(
            "phi3",
            "Phi3Config",
            "Phi3ForCausalLM",
            "causal",
            dict(_LLAMA, resid_pdrop=DROP, embd_pdrop=DROP, bos_token_id=2, eos_token_id=3),
        ),
        Family(
            "opt",
            "OPTConfig",
            "OPTForCausalLM",
            "causal",
            dict(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                ffn_dim=64,
                word_embed_proj_dim=32,
                max_position_embeddings=64,
                dropout=DROP,
                attention_dropout=DROP,
                pad_token_id=1,
            ),
        ),
        Family(
            "bloom",
            "BloomConfig",
            "BloomForCausalLM",
            "causal",
            dict(
                vocab_size=VOCAB,
                hidden_size=32,
                n_layer=2,
                n_head=4,
                attention_dropout=DROP,
                hidden_dropout=DROP,
                pad_token_id=3,
            ),
        ),
        Family(
            "falcon",
            "FalconConfig",
            "FalconForCausalLM",
            "causal",
            dict(_LM, attention_dropout=DROP, hidden_dropout=DROP, pad_token_id=0),
        ),
        Family(
            "mixtral",
            "MixtralConfig",
            "MixtralForCausalLM",
            "causal",
            dict(
                _LLAMA,
                num_local_experts=4,
                num_experts_per_tok=2,
                output_router_logits=True,
                router_aux_loss_coef=0.5,
            ),
        ),
        Family("bert", "BertConfig", "BertForMaskedLM", "mlm", _BERT),
        Family("bert_eager", "BertConfig", "BertForMaskedLM", "mlm", _BERT, "eager"),
        Family("roberta", "RobertaConfig", "RobertaForMaskedLM", "mlm", _BERT),
        Family(
            "distilbert",
            "DistilBertConfig",
            "DistilBertForMaskedLM",
            "mlm",
            dict(
                vocab_size=VOCAB,
                dim=32,
                n_layers=2,
                n_heads=4,
                hidden_dim=64,
                max_position_embeddings=64,
                dropout=DROP,
                attention_dropout=DROP,
                pad_token_id=0,
            ),
        ),
        Family(
            "deberta_v2",
            "DebertaV2Config",
            "DebertaV2ForMaskedLM",
            "mlm",
            dict(_BERT, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"]),
        ),
        Family(
            "electra",
            "ElectraConfig",
            "ElectraForMaskedLM",
            "mlm",
            dict(_BERT, embedding_size=32),
        ),
        Family(
            "t5",
            "T5Config",
            "T5ForConditionalGeneration",
            "seq2seq",
            dict(
                vocab_size=VOCAB,
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_decoder_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                dropout_rate=DROP,
                pad_token_id=0,
                decoder_start_token_id=0,
                eos_token_id=1,
            ),
        ),
        Family(
            "bart",
            "BartConfig",
            "BartForConditionalGeneration",
            "seq2seq",
            dict(
                vocab_size=VOCAB,
                d_model=32,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_position_embeddings=64,
                dropout=DROP,
                attention_dropout=DROP,
                activation_dropout=DROP,
                pad_token_id=1,
                bos_token_id=0,
                eos_token_id=2,
                decoder_start_token_id=2,
                forced_eos_token_id=None,
            ),
        ),
        Family(
            "whisper",
            "WhisperConfig",
            "WhisperForConditionalGeneration",
            "speech",
            dict(
                vocab_size=VOCAB,
                num_mel_bins=8,
                d_model=32,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_source_positions=8,
                max_target_positions=32,
                dropout=DROP,
                attention_dropout=DROP,
                activation_dropout=DROP,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
                decoder_start_token_id=1,
                suppress_tokens=None,
                begin_suppress_tokens=None,
            ),
        ),
        Family(
            "vit",
            "ViTConfig",
            "ViTForImageClassification",
            "image",
            dict(
                image_size=IMG,
                patch_size=8,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                hidden_dropout_prob=DROP,
                attention_probs_dropout_prob=DROP,
                num_labels=5,
            ),
        ),
        Family(
            "swin",
            "SwinConfig",
            "SwinForImageClassification",
            "image",
            dict(
                image_size=IMG,
                patch_size=4,
                embed_dim=16,
                depths=[1, 1],
                num_heads=[2, 4],
                window_size=4,
                hidden_dropout_prob=DROP,
                attention_probs_dropout_prob=DROP,
                drop_path_rate=0.0,
                num_labels=5,
            ),
        ),
        Family(
            "convnext",
            "ConvNextConfig",
            "ConvNextForImageClassification",
            "image",
            dict(
                num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=5, drop_path_rate=0.0
            ),
        ),
        Family(
            "resnet",
            "ResNetConfig",
            "ResNetForImageClassification",
            "image",
            dict(
                embedding_size=16,
                hidden_sizes=[16, 32],
                depths=[1, 1],
                layer_type="basic",
                num_labels=5,
            ),
        ),
        Family(
            "clip",
            "CLIPConfig",
            "CLIPModel",
            "clip",
            dict(
                text_config=dict(
                    vocab_size=VOCAB,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    max_position_embeddings=64,
                    attention_dropout=DROP,
                    dropout=DROP,
                    pad_token_id=1,
                    bos_token_id=0,
                    eos_token_id=2,
                ),
                vision_config=dict(
                    image_size=IMG,
                    patch_size=8,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    attention_dropout=DROP,
                    dropout=DROP,
                ),
                projection_dim=16,
            ),
        ),
    ]
}


def build(fam: Family) -> torch.nn.Module:
    """The family's model at fp32 with random weights (seed 0), in training mode."""
    import transformers

    cfg = getattr(transformers, fam.config)(**copy.deepcopy(fam.overrides))
    if fam.attn is not None:
        cfg._attn_implementation = fam.attn
    torch.manual_seed(0)
    model = getattr(transformers, fam.model)(cfg).float()
    return model.train()


def pad_id(model: torch.nn.Module) -> int:
    cfg = model.config
    pid = getattr(cfg, "pad_token_id", None)
    if pid is None and hasattr(cfg, "text_config"):
        pid = cfg.text_config.pad_token_id
    return 0 if pid is None else int(pid)


def inputs(fam: Family, model: torch.nn.Module, *, labels: bool) -> dict[str, Any]:
    """A deterministic batch for ``fam``; with ``labels`` the model computes its own loss."""
    g = torch.Generator().manual_seed(1234)
    pid = pad_id(model)
    special = {pid, 0, 1, 2, 3}

    def ids(rows, length):
        x = torch.randint(4, VOCAB, (rows, length), generator=g)
        assert not special.intersection(x.unique().tolist())
        return x

    out: dict[str, Any] = {}
    if fam.kind in ("causal", "mlm", "seq2seq", "clip"):
        out["input_ids"] = ids(B, T)
        out["attention_mask"] = torch.ones(B, T, dtype=torch.long)
    if fam.kind == "clip":
        eos = model.config.text_config.eos_token_id
        out["input_ids"][:, -1] = eos  # CLIP pools at the eos token
        out["pixel_values"] = torch.randn(B, 3, IMG, IMG, generator=g)
        if labels:
            out["return_loss"] = True
    elif fam.kind == "image":
        out["pixel_values"] = torch.randn(B, 3, IMG, IMG, generator=g)
        if labels:
            out["labels"] = torch.randint(0, 5, (B,), generator=g)
    elif fam.kind == "speech":
        n = 2 * model.config.max_source_positions
        out["input_features"] = torch.randn(B, model.config.num_mel_bins, n, generator=g)
        if labels:
            out["labels"] = ids(B, 7)
        else:
            out["decoder_input_ids"] = ids(B, 7)
    elif fam.kind == "causal" and labels:
        out["labels"] = out["input_ids"].clone()
    elif fam.kind == "mlm" and labels:
        lab = ids(B, T)
        lab[:, ::3] = -100  # some positions unlabelled, as in MLM
        out["labels"] = lab
    elif fam.kind == "seq2seq":
        if labels:
            out["labels"] = ids(B, 7)
        else:
            out["decoder_input_ids"] = ids(B, 7)
    return out


def pad(batch: dict[str, Any], model: torch.nn.Module, side: str) -> dict[str, Any]:
    """Rows 1 and 2 padded on ``side`` ('left'/'right') by 3 and 5 positions; row 0 unpadded.

    Padded positions get the pad id, attention_mask 0 and, when the labels align with the input
    ids, label -100.
    """
    if side == "none":
        return batch
    out = dict(batch)
    ids, mask = batch["input_ids"].clone(), batch["attention_mask"].clone()
    labels = batch.get("labels")
    aligned = isinstance(labels, torch.Tensor) and labels.shape == ids.shape
    labels = labels.clone() if aligned else labels
    for row, n in ((1, 3), (2, 5)):
        cols = slice(0, n) if side == "left" else slice(T - n, T)
        if "pixel_values" in batch and side == "right":  # CLIP pools at the last token: keep eos
            eos = ids[row, -1].item()
            ids[row, T - n - 1] = eos
        ids[row, cols] = pad_id(model)
        mask[row, cols] = 0
        if aligned:
            labels[row, cols] = -100
    out["input_ids"], out["attention_mask"] = ids, mask
    if aligned:
        out["labels"] = labels
    return out
