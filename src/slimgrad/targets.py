"""Named training targets for ``slimgrad profile``: HF models from a config, ``module:factory``.

A target resolves to a :class:`Target`: a ``build()`` that returns a fresh model (random init,
nothing downloaded) and ``inputs(batch)`` that returns the inputs of one step; the loss is
``out.loss`` (HF models get labels) or the scalar output.

HF names (the ``[hf]`` extra): ``gpt2`` (GPT2LMHeadModel), ``bert`` (BertForMaskedLM, 15% of
positions labelled), ``llama`` (LlamaForCausalLM, a 12-layer 768-wide "small" config), ``vit``
(ViTForImageClassification), ``resnet`` (ResNetForImageClassification, ResNet-50). ``size="tiny"``
shrinks each config for tests.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

__all__ = ["HF_TARGETS", "Target", "resolve"]


@dataclass
class Target:
    name: str
    build: Callable[..., nn.Module]  # build(skip_init=False)
    inputs: Callable[[int], Any]  # batch -> inputs (tensor, tuple or dict)
    default_batch: int

    def loss(self, out: Any) -> torch.Tensor:
        from slimgrad.verify import _default_loss

        return _default_loss(out)


# The common part of the tiny transformer configs (HF's names, shared by BERT, Llama and ViT).
_TINY_TX = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128)
_TINY = {
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128),
    "bert": dict(_TINY_TX, vocab_size=1000, max_position_embeddings=128),
    "llama": dict(_TINY_TX, num_key_value_heads=4, vocab_size=1000),
    "vit": dict(_TINY_TX, image_size=32, patch_size=8),
    "resnet": dict(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="bottleneck"
    ),
}

_FULL = {
    # ImageNet head, as torchvision's ResNet-50 (25,557,032 params)
    "resnet": dict(num_labels=1000),
    "vit": dict(num_labels=1000),
    "llama": dict(
        num_hidden_layers=12,
        hidden_size=768,
        num_attention_heads=12,
        num_key_value_heads=12,
        intermediate_size=2048,
        vocab_size=32000,
    ),
}

# name: (config class, model class, input kind)
HF_TARGETS = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", "causal"),
    "bert": ("BertConfig", "BertForMaskedLM", "mlm"),
    "llama": ("LlamaConfig", "LlamaForCausalLM", "causal"),
    "vit": ("ViTConfig", "ViTForImageClassification", "image"),
    "resnet": ("ResNetConfig", "ResNetForImageClassification", "image"),
}


def hf_target(label: str, cfg: Any, model_cls: type, kind: str, seq: int) -> Target:
    """A :class:`Target` for an HF model class and config: ``kind`` is "causal" (labels = ids),
    "mlm" (15% of positions labelled) or "image" (pixel values and class labels)."""
    vocab = getattr(cfg, "vocab_size", None)

    def build(skip_init: bool = False) -> nn.Module:
        if skip_init:  # under fake tensors: HF's data-dependent init (trunc_normal_) cannot run
            from transformers.initialization import no_init_weights

            with no_init_weights():
                model = model_cls(cfg)
            model.tie_weights()  # tying happens during init, which was skipped
        else:
            model = model_cls(cfg)
        return model.train()

    def inputs(batch: int) -> dict:
        if kind == "causal":
            ids = torch.randint(0, vocab, (batch, seq))
            return {"input_ids": ids, "labels": ids, "use_cache": False}
        if kind == "mlm":
            ids = torch.randint(0, vocab, (batch, seq))
            labels = torch.where(torch.rand(batch, seq) < 0.15, ids, torch.full_like(ids, -100))
            return {"input_ids": ids, "labels": labels}
        px = getattr(cfg, "image_size", 224)
        h, w = (px, px) if isinstance(px, int) else tuple(px)
        return {
            "pixel_values": torch.randn(batch, getattr(cfg, "num_channels", 3), h, w),
            "labels": torch.randint(0, getattr(cfg, "num_labels", 2), (batch,)),
        }

    return Target(label, build, inputs, 8 if kind == "image" else 4)


def _hf(name: str, size: str, seq: int, overrides: dict | None) -> Target:
    try:
        transformers = importlib.import_module("transformers")
    except ImportError as e:
        raise ImportError(
            f"slimgrad.targets: target {name!r} needs HF transformers; expected it installed, got "
            "ImportError. Install the extra: pip install 'slimgrad[hf]'."
        ) from e
    cfg_name, model_name, kind = HF_TARGETS[name]
    kw = dict(_TINY[name] if size == "tiny" else _FULL.get(name, {}))
    kw.update(overrides or {})
    cfg = getattr(transformers, cfg_name)(**kw)
    if name != "resnet":
        cfg._attn_implementation = "sdpa"  # HF's default where torch has SDPA
    return hf_target(f"hf:{name}", cfg, getattr(transformers, model_name), kind, seq)


def _factory(spec: str) -> Target:
    mod_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"slimgrad.targets: cannot load factory {spec!r}; expected 'module:function' "
            f"importable from the current environment, got {type(e).__name__}: {e}. Check the "
            "module path."
        ) from e

    def build_and_inputs():
        made = fn()
        if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module)):
            raise TypeError(
                f"slimgrad.targets: factory {spec!r} must return (model, make_inputs); expected "
                f"(nn.Module, callable batch -> inputs), got {type(made).__name__}. Return a pair."
            )
        return made

    model0, make_inputs = build_and_inputs()
    return Target(spec, lambda skip_init=False: build_and_inputs()[0], make_inputs, 1)


def _case(case, small: bool) -> Target:
    # a built-in bench case: its eager model; profile converts a copy with convert_
    def build(skip_init: bool = False) -> nn.Module:
        eager, _, _ = case.build(torch.device("cpu"), torch.float32, small=small)
        if not isinstance(eager, nn.Module):
            raise ValueError(
                f"slimgrad.targets: bench case {case.name!r} is not a model; expected an "
                f"nn.Module, got {type(eager).__name__}. Profile a model-level case."
            )
        return eager

    def inputs(batch: int):
        _, _, make_inputs = case.build(torch.device("cpu"), torch.float32, small=small)
        return make_inputs()

    return Target(case.name, build, inputs, 1)


def resolve(
    target: str, *, size: str = "full", seq: int = 256, overrides: dict | None = None
) -> Target:
    """Resolve an HF name (``gpt2``, ``bert``, ``llama``, ``vit``, ``resnet``; ``hf:`` optional) or
    ``module:factory``.

    Args:
        target: the name.
        size: ``"full"`` (the default config) or ``"tiny"`` (a small one, for tests).
        seq: sequence length for text models.
        overrides: config fields to override (HF targets).

    Raises:
        ValueError: unknown name or unloadable factory.
        ImportError: an HF target without transformers installed.
    """
    if size not in ("full", "tiny"):
        raise ValueError(
            f"slimgrad.targets.resolve: size must be 'full' or 'tiny'; expected one of them, got "
            f"{size!r}. Use size='tiny' for a quick run."
        )
    name = target.removeprefix("hf:")
    if name in HF_TARGETS:
        return _hf(name, size, seq, overrides)
    if ":" in target:
        return _factory(target)
    from slimgrad.bench.harness import case_names, get_case

    if target in case_names():
        return _case(get_case(target), small=size == "tiny")
    raise ValueError(
        f"slimgrad.targets.resolve: unknown target {target!r}; expected one of "
        f"{sorted(HF_TARGETS)}, a built-in bench case, or 'module:factory'. "
        "Run `slimgrad bench --list` for the cases."
    )
