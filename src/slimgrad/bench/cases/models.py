"""Model-level cases: whole models, eager against ``slimgrad.convert_`` of a copy of the same model.

``eager_<case>(device, dtype, small)`` builds the eager side alone, ``(model, make_inputs)``: use it
under ``FakeTensorMode`` (``slimgrad.memory.estimate``), where the deep copy that makes the slimgrad
side would read fake storages (undefined behaviour; it crashed the interpreter here).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools

import torch
from torch import nn

from slimgrad.bench import harness, models
from slimgrad.bench.harness import register_case

# Set by eager_side_only(): a build whose slimgrad side nobody reads (an estimate or measure of
# the eager side, gpu_check.case_step) skips the copy and its convert_, most of a model build's
# time; nothing else changes: the copy is made after the eager model, and the inputs are drawn
# from their own seed
_EAGER_SIDE_ONLY = contextvars.ContextVar("slimgrad_bench_eager_side_only", default=False)


@contextlib.contextmanager
def eager_side_only():
    """Within it, :func:`slim_copy` returns None: builds make their eager side alone."""
    token = _EAGER_SIDE_ONLY.set(True)
    try:
        yield
    finally:
        _EAGER_SIDE_ONLY.reset(token)


def slim_copy(model: nn.Module, config=None) -> nn.Module | None:
    """``slimgrad.convert_(copy.deepcopy(model), config)``: the slimgrad side of a case (None
    within :func:`eager_side_only`)."""
    import slimgrad

    if _EAGER_SIDE_ONLY.get():
        return None
    return slimgrad.convert_(copy.deepcopy(model), config)


def place(model: nn.Module, device, dtype) -> nn.Module:
    """``model.to(device, dtype)``, skipped when already there (under FakeTensorMode, ``.to`` of a
    model with tied weights fails: the parameter swap meets a weakref)."""
    device = torch.device(device)
    for t in [*model.parameters(), *model.buffers()]:
        same_device = t.device.type == device.type and (
            device.index is None or t.device.index == device.index
        )
        if not same_device or (t.is_floating_point() and t.dtype != dtype):
            return model.to(device=device, dtype=dtype)
    return model


def eager_resnet50(device, dtype, small=False, input_grad=False):
    """The eager side of case ``resnet50``: ``(model, make_inputs)`` (no copy is made).

    ``model`` is ``WithLoss(net)`` (the network is ``model.model``); ``make_inputs()`` returns
    ``(images, labels)``, the images requiring grad if ``input_grad``. The other ResNet cases
    start from it too.
    """
    if small:
        net, batch, size, classes = models.resnet_small(num_classes=10), 2, 32, 10
    else:
        net, batch, size, classes = models.resnet50(), 8, 224, 1000
    eager = place(models.WithLoss(net), device, dtype)

    def make_inputs():
        x = torch.randn(batch, 3, size, size, device=device, dtype=dtype, requires_grad=input_grad)
        return x, torch.randint(0, classes, (batch,), device=device)

    return eager, make_inputs


@register_case(
    "resnet50",
    description="torchvision-faithful ResNet-50 + cross-entropy, 8x3x224x224 "
    "(small: 2-stage, 2x3x32x32)",
    repeat=3,
)
def build_resnet50(device, dtype, small=False):
    eager, make_inputs = eager_resnet50(device, dtype, small)
    return eager, slim_copy(eager), make_inputs


def eager_gpt2(device, dtype, small=False):
    """The eager side of case ``gpt2``: ``(model, make_inputs)`` (no copy is made)."""
    cfg = models.GPTConfig.tiny() if small else models.GPTConfig.small()
    batch, seq = (2, 16) if small else (4, 256)
    eager = place(models.GPT(cfg), device, dtype)

    def make_inputs():
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
        return ids, ids

    return eager, make_inputs


@register_case(
    "gpt2",
    description="GPT-2 small in plain PyTorch (SDPA, dropout 0.1), 4x256 tokens "
    "(small: tiny, 2x16)",
    repeat=3,
)
def build_gpt2(device, dtype, small=False):
    eager, make_inputs = eager_gpt2(device, dtype, small)
    return eager, slim_copy(eager), make_inputs


def eager_conv_chain(device, dtype, small=False):
    """The eager side of case ``conv_chain``: ``(model, make_inputs)`` (no copy is made)."""
    chain = models.conv_chain(2, channels=8) if small else models.conv_chain(8)
    shape = (2, 8, 9, 11) if small else (16, 64, 56, 56)
    eager = place(chain, device, dtype)

    def make_inputs():
        return torch.randn(shape, device=device, dtype=dtype)

    return eager, make_inputs


@register_case(
    "conv_chain",
    description="8 x Conv2d(64,64,3,pad=1)->BN->LeakyReLU(0.01, inplace), 16x64x56x56 "
    "(small: 2 blocks, 2x8x9x11)",
    repeat=5,
)
def build_conv_chain(device, dtype, small=False):
    eager, make_inputs = eager_conv_chain(device, dtype, small)
    return eager, slim_copy(eager), make_inputs


class HFCausalLMLoss(nn.Module):
    """``model(input_ids=ids, labels=ids, use_cache=False).loss`` as a module of ``ids``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss


def hf_gpt2(small: bool = False) -> nn.Module:
    """``GPT2LMHeadModel(GPT2Config())`` (random init, dropout 0.1) wrapped in HFCausalLMLoss."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if small:
        cfg = GPT2Config(
            vocab_size=97,
            n_positions=64,
            n_embd=32,
            n_layer=2,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
        )
    else:
        cfg = GPT2Config()
    return HFCausalLMLoss(GPT2LMHeadModel(cfg))


def eager_hf_gpt2(device, dtype, small=False):
    """The eager side of case ``hf_gpt2``: ``(model, make_inputs)`` (no copy is made)."""
    eager = place(hf_gpt2(small), device, dtype)
    vocab = eager.model.config.vocab_size
    batch, seq = (2, 16) if small else (4, 256)

    def make_inputs():
        return torch.randint(0, vocab, (batch, seq), device=device)

    return eager, make_inputs


@register_case(
    "hf_gpt2",
    description="HF GPT2LMHeadModel(GPT2Config()), random init, 4x256 tokens, labels=ids "
    "[hf extra]",
    requires=("transformers",),
    repeat=3,
)
def build_hf_gpt2(device, dtype, small=False):
    eager, make_inputs = eager_hf_gpt2(device, dtype, small)
    return eager, slim_copy(eager), make_inputs


@register_case(
    "hf_gpt2_fast_loss",
    description="hf_gpt2 converted with ConvertConfig(fast_loss=True): the LM-head gradients "
    "computed in forward (3 matmuls like eager, a parameter-sized dW kept) [hf extra]",
    requires=("transformers",),
    repeat=3,
)
def build_hf_gpt2_fast_loss(device, dtype, small=False):
    import slimgrad

    eager, make_inputs = eager_hf_gpt2(device, dtype, small)
    return eager, slim_copy(eager, slimgrad.ConvertConfig(fast_loss=True)), make_inputs


class HFLoss(nn.Module):
    """``model(input_ids=ids, attention_mask=mask, labels=labels).loss`` as a module (``use_cache``
    off for causal LMs)."""

    def __init__(self, model: nn.Module, causal: bool) -> None:
        super().__init__()
        self.model = model
        self.causal = causal

    def forward(self, ids, mask, labels) -> torch.Tensor:
        extra = {"use_cache": False} if self.causal else {}
        return self.model(input_ids=ids, attention_mask=mask, labels=labels, **extra).loss


def padded_batch(vocab, batch, seq, device, *, left: bool, mlm: bool = False):
    """Token ids, attention mask and labels with every other row padded by ``seq // 8`` tokens
    (left or right): the mask is honoured, so HF builds and applies it. Labels are -100 on padding
    (and, for ``mlm``, on all but a seeded 15% of the real tokens)."""
    ids = torch.randint(1, vocab, (batch, seq), device=device)
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    pad = max(1, seq // 8)
    for row in range(1, batch, 2):
        cols = slice(0, pad) if left else slice(seq - pad, seq)
        mask[row, cols] = 0
        ids[row, cols] = 0
    labels = ids.masked_fill(mask == 0, -100)
    if mlm:
        keep = torch.rand(batch, seq, device=device) < 0.15
        labels = labels.masked_fill(~keep, -100)
    return ids, mask, labels


_MOE = dict(
    num_experts_per_tok=2,
    norm_topk_prob=True,
    output_router_logits=True,
    router_aux_loss_coef=0.02,
    experts_implementation="eager",
)
# The MoE cases' full size: 8 experts of intermediate 1024, so that the 2 experts a token is routed
# to compute hf_llama's 2 x 1024 = 2048 intermediate features per token (the small variants keep
# the 512 of _DECODERS)
_MOE_FULL = {
    "mixtral": {"intermediate_size": 1024},
    "qwen3_moe": {"moe_intermediate_size": 1024},
}

# HF decoder families at the Llama 12 x 768 shape class (intermediate 2048, vocab 32000, 12 heads
# of 64, attention dropout 0.1): {name: (config class, model class, overrides)}
_DECODERS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": None}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": None}),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # MoE: 8 experts (intermediate 1024 at full size, _MOE_FULL), top-2, the eager expert loop,
    # router aux loss in the loss
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"intermediate_size": 512, "num_local_experts": 8, **_MOE},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"head_dim": None, "moe_intermediate_size": 512, "num_experts": 8, **_MOE},
    ),
}


def eager_hf_text(name: str, device, dtype, small=False, *, layers=None, experts="eager"):
    """The eager side of cases ``hf_bert`` / ``hf_llama`` and the decoder families
    (``hf_mistral``, ``hf_qwen2``, ...): ``(model, make_inputs)``.

    ``layers`` overrides the number of decoder layers (a shorter model of the same width, for
    boxes too slow for 12). ``experts`` is the MoE families' ``experts_implementation``:
    ``"eager"`` (the expert loop, the only one ``convert_`` converts) or None (transformers'
    default, ``"grouped_mm"`` where its kernel exists; cases ``hf_<family>_grouped_mm``).
    """
    import transformers

    if name == "bert":
        cfg_cls, model_cls, causal = transformers.BertConfig, transformers.BertForMaskedLM, False
        full: dict = {}
        tiny = dict(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=97,
            max_position_embeddings=64,
        )
    else:
        cfg_name, model_name, extra = _DECODERS[name]
        cfg_cls = getattr(transformers, cfg_name)
        model_cls, causal = getattr(transformers, model_name), True
        full = dict(
            num_hidden_layers=12,
            hidden_size=768,
            num_attention_heads=12,
            num_key_value_heads=12,
            intermediate_size=2048,
            vocab_size=32000,
            attention_dropout=0.1,
        )
        tiny = dict(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=2,
            num_key_value_heads=2,
            intermediate_size=64,
            vocab_size=97,
            attention_dropout=0.1,
        )
        for d in (full, tiny):  # head_dim None: hidden / heads, as Llama (the config's own differs)
            d.update(extra)
            if "head_dim" in d:
                d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        full.update(_MOE_FULL.get(name, {}))
    kwargs = dict(tiny if small else full)
    if layers is not None:
        kwargs["num_hidden_layers"] = layers
    if "experts_implementation" in kwargs:
        kwargs["experts_implementation"] = experts
    cfg = cfg_cls(**kwargs)
    cfg._attn_implementation = "sdpa"
    eager = place(HFLoss(model_cls(cfg).train(), causal), device, dtype)
    batch, seq = (2, 16) if small else (4, 256)

    def make_inputs():
        return padded_batch(cfg.vocab_size, batch, seq, device, left=causal, mlm=not causal)

    return eager, make_inputs


class Autocast(nn.Module):
    """``model(*args)`` under ``torch.autocast(<its device>, dtype)``, the result in float32: the
    weights stay as they are (float32), the matmuls run in ``dtype``."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.model = model
        self.dtype = dtype

    def forward(self, *args) -> torch.Tensor:
        device = next(self.model.parameters()).device.type
        with torch.autocast(device, dtype=self.dtype):
            return self.model(*args).float()


@register_case(
    "hf_bert",
    description="HF BertForMaskedLM(BertConfig()) (bert-base, dropout 0.1), 4x256 tokens, every "
    "other row right-padded by 32, 15% of real tokens labelled [hf extra]",
    requires=("transformers",),
    repeat=3,
)
def build_hf_bert(device, dtype, small=False):
    eager, make_inputs = eager_hf_text("bert", device, dtype, small)
    return eager, slim_copy(eager), make_inputs


@register_case(
    "hf_llama",
    description="HF LlamaForCausalLM, 12 x 768 (intermediate 2048, vocab 32000, attention dropout "
    "0.1), 4x256 tokens, every other row left-padded by 32 [hf extra]",
    requires=("transformers",),
    repeat=3,
)
def build_hf_llama(device, dtype, small=False):
    eager, make_inputs = eager_hf_text("llama", device, dtype, small)
    return eager, slim_copy(eager), make_inputs


_FAMILY_NOTES = {
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM (q/k RMSNorm, head_dim 64)",
    "gemma": "GemmaForCausalLM (GeGLU tanh, 1 + weight RMSNorm, tied head, head_dim 64)",
    "phi3": "Phi3ForCausalLM (fused qkv and gate_up projections)",
}


def _family_case(fam: str) -> None:
    @register_case(
        f"hf_{fam}",
        description=f"HF {_FAMILY_NOTES[fam]} at the hf_llama shape class: 12 x 768 (intermediate "
        "2048, vocab 32000, 12 heads, attention dropout 0.1), 4x256 tokens, every other row "
        "left-padded by 32 [hf extra]",
        requires=("transformers",),
        repeat=3,
    )
    def build(device, dtype, small=False):
        eager, make_inputs = eager_hf_text(fam, device, dtype, small)
        return eager, slim_copy(eager), make_inputs


for _fam in _FAMILY_NOTES:
    _family_case(_fam)


def eager_hf_llama_autocast(device, dtype, small=False):
    """The eager side of case ``hf_llama_autocast``: hf_llama's model with ``dtype`` weights
    (float32 by default) run under ``torch.autocast(dtype=bfloat16)``."""
    eager, make_inputs = eager_hf_text("llama", device, dtype, small)
    return Autocast(eager, torch.bfloat16), make_inputs


def eager_hf_autocast(name: str, device, dtype, small=False):
    """The eager side of the ``hf_<name>_autocast`` cases (``name``: ``"gpt2"`` or a decoder family
    such as ``"llama"``): the model with ``dtype`` weights (float32 by default) run under
    ``torch.autocast(dtype=bfloat16)``, the loss in float32."""
    if name == "gpt2":
        eager, make_inputs = eager_hf_gpt2(device, dtype, small)
    else:
        eager, make_inputs = eager_hf_text(name, device, dtype, small)
    return Autocast(eager, torch.bfloat16), make_inputs


@register_case(
    "hf_llama_autocast",
    description="hf_llama (float32 weights) under torch.autocast(bfloat16): 12 x 768, 4x256 "
    "tokens, every other row left-padded by 32 [hf extra]",
    requires=("transformers",),
    repeat=3,
)
def build_hf_llama_autocast(device, dtype, small=False):
    eager, make_inputs = eager_hf_llama_autocast(device, dtype, small)
    return eager, slim_copy(eager), make_inputs


def _autocast_case(name: str, what: str) -> None:
    @register_case(
        f"hf_{name}_autocast",
        description=f"{what} (float32 weights) under torch.autocast(bfloat16) [hf extra]",
        requires=("transformers",),
        repeat=3,
    )
    def build(device, dtype, small=False):
        eager, make_inputs = eager_hf_autocast(name, device, dtype, small)
        return eager, slim_copy(eager), make_inputs


_autocast_case("gpt2", "hf_gpt2 (GPT-2 small, 4x256 tokens, labels=ids)")
for _fam in _FAMILY_NOTES:
    _autocast_case(_fam, f"hf_{_fam} (12 x 768, 4x256 tokens, left-padded rows)")


# MoE decoders: {family: what the description says}
_MOE_NOTES = {
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM (q/k RMSNorm, head_dim 64)",
}


def eager_hf_moe(name: str, device, dtype, small=False, *, layers=None, experts="eager",
                 autocast=False):  # fmt: skip
    """The eager side of the MoE cases ``hf_<name>``, ``hf_<name>_autocast`` and
    ``hf_<name>_grouped_mm`` (``name``: ``"mixtral"`` or ``"qwen3_moe"``): ``(model,
    make_inputs)``.

    The hf_llama shape class with its MLP replaced by 8 experts of intermediate 1024, top-2 (each
    token's two experts compute hf_llama's 2048 intermediate features), ``norm_topk_prob``, the
    router's load-balancing loss (coefficient 0.02) added to the loss; 4x256 tokens, every other
    row left-padded by 32. ``layers``, ``experts``: as :func:`eager_hf_text` (``experts="eager"``
    is the expert loop, the only implementation ``convert_`` converts). ``autocast``: wrapped in
    :class:`Autocast` (bfloat16), the weights in ``dtype``.

    MoE routing depends on tensor values (``nonzero``, ``where`` on the top-k table), so these
    cases run with real tensors only (``slimgrad.memory.measure``, not ``estimate``).
    """
    eager, make_inputs = eager_hf_text(name, device, dtype, small, layers=layers, experts=experts)
    return (Autocast(eager, torch.bfloat16) if autocast else eager), make_inputs


def _moe_cases(fam: str) -> None:
    what = f"HF {_MOE_NOTES[fam]}, 12 x 768 (8 experts of intermediate 1024, top-2, vocab 32000)"

    @register_case(
        f"hf_{fam}",
        description=f"{what}, experts_implementation='eager' (the expert loop: the only one "
        "convert_ converts), router aux loss, 4x256 tokens, left-padded rows [hf extra]",
        requires=("transformers",),
        repeat=3,
    )
    def build(device, dtype, small=False):
        """The eager expert loop (``experts_implementation="eager"``, the only setting convert_
        converts: its banks become ``GatedExperts``); see :func:`eager_hf_moe`."""
        eager, make_inputs = eager_hf_moe(fam, device, dtype, small)
        return eager, slim_copy(eager), make_inputs

    @register_case(
        f"hf_{fam}_autocast",
        description=f"hf_{fam} (float32 weights, eager expert loop) under "
        "torch.autocast(bfloat16) [hf extra]",
        requires=("transformers",),
        repeat=3,
    )
    def build_autocast(device, dtype, small=False):
        """hf_<family> under ``torch.autocast(bfloat16)`` (``experts_implementation="eager"``,
        the only setting convert_ converts)."""
        eager, make_inputs = eager_hf_moe(fam, device, dtype, small, autocast=True)
        return eager, slim_copy(eager), make_inputs

    @register_case(
        f"hf_{fam}_grouped_mm",
        description=f"{what}, transformers' default experts_implementation ('grouped_mm' where "
        "its kernel exists): the expert banks stay unconverted; the rest converts; no float64 "
        "gradient check (torch._grouped_mm has no float64 kernel) [hf extra]",
        requires=("transformers",),
        grad_check=False,
        repeat=3,
    )
    def build_grouped_mm(device, dtype, small=False):
        """hf_<family> with transformers' default experts implementation (``grouped_mm``):
        ``convert_`` leaves the expert banks as they are (the batched kernel sums in another
        order than the loop; ``slimgrad.report`` says so) and converts the rest. The harness's
        float64 reference cannot run it (``torch._grouped_mm``: "Expected mat_a to be Float32,
        BFloat16 or Float16 matrix, got Double"), so the case skips the gradient check."""
        eager, make_inputs = eager_hf_moe(fam, device, dtype, small, experts=None)
        return eager, slim_copy(eager), make_inputs


for _fam in _MOE_NOTES:
    _moe_cases(_fam)


def eager_hf_moe_block(name: str, device, dtype, small=False, *, autocast=False):
    """The eager side of cases ``hf_<name>_moe_block`` (and ``_autocast``): one sparse-MoE block
    (router + expert bank, ``experts_implementation="eager"``) of the ``hf_<name>`` model's first
    layer, as initialised there, on ``(4, 256, 768)`` hidden states that require grad (small:
    ``(2, 16, 32)``); the output's gradient is the harness's fixed random tensor.

    What ``convert_`` changes in an MoE model's MLP, at full width and token count but without
    the rest of the model: the whole models run too slowly on a small CPU box in bfloat16.
    """
    lm, _ = eager_hf_text(name, device, dtype, small, layers=1)
    block = lm.model.model.layers[0].mlp
    hidden = lm.model.config.hidden_size
    batch, seq = (2, 16) if small else (4, 256)

    def make_inputs():
        return torch.randn(batch, seq, hidden, device=device, dtype=dtype, requires_grad=True)

    return (Autocast(block, torch.bfloat16) if autocast else block), make_inputs


def _moe_block_cases(fam: str) -> None:
    what = f"one {_MOE_NOTES[fam].split(' ')[0].removesuffix('ForCausalLM')} sparse-MoE block"

    @register_case(
        f"hf_{fam}_moe_block",
        description=f"{what} (router + 8 experts of 1024, top-2, eager expert loop) of hf_{fam}, "
        "on 4x256x768 hidden states [hf extra]",
        requires=("transformers",),
        repeat=3,
    )
    def build(device, dtype, small=False):
        """See :func:`eager_hf_moe_block` (``experts_implementation="eager"``, the only setting
        convert_ converts)."""
        eager, make_inputs = eager_hf_moe_block(fam, device, dtype, small)
        return eager, slim_copy(eager), make_inputs

    @register_case(
        f"hf_{fam}_moe_block_autocast",
        description=f"hf_{fam}_moe_block (float32 weights) under torch.autocast(bfloat16) "
        "[hf extra]",
        requires=("transformers",),
        repeat=3,
    )
    def build_autocast(device, dtype, small=False):
        """hf_<family>_moe_block under ``torch.autocast(bfloat16)``."""
        eager, make_inputs = eager_hf_moe_block(fam, device, dtype, small, autocast=True)
        return eager, slim_copy(eager), make_inputs


for _fam in _MOE_NOTES:
    _moe_block_cases(_fam)


# {case: eager side builder (device, dtype, small) -> (model, make_inputs)} for estimate_case; not
# the MoE families: their expert loop routes by tensor values (nonzero), which fake tensors cannot
_DENSE = list(_FAMILY_NOTES)
_EAGER_SIDES = {
    "hf_gpt2": eager_hf_gpt2,
    "hf_llama_autocast": eager_hf_llama_autocast,
    **{f"hf_{n}": functools.partial(eager_hf_text, n) for n in ("llama", "bert", *_DENSE)},
    **{f"hf_{n}_autocast": functools.partial(eager_hf_autocast, n) for n in _DENSE},
    "hf_gpt2_autocast": functools.partial(eager_hf_autocast, "gpt2"),
}


def estimate_case(
    name: str,
    *,
    dtype: torch.dtype = torch.float32,
    small: bool = False,
    device: str = "cpu",
    out_dir=None,
    seed: int = 0,
) -> dict:
    """One step of case ``name`` per side under ``slimgrad.memory.estimate`` (fake tensors: no
    compute, no memory), as a record with the harness's memory fields.

    For the HF model cases (``hf_llama``, the decoder families, their ``_autocast`` variants,
    ``hf_gpt2``, ``hf_bert``) whose real runs at full size and in bfloat16 are too slow on a small
    CPU box. The figures are those of a first step (``slimgrad.memory.measure`` on a fresh model;
    exact unless the model branches on tensor values). No timing: ``step_ms`` is None.

    Args:
        name: the case (a key of the cases estimable here).
        dtype: the weights' dtype (``torch.bfloat16``: bf16 weights).
        small: the case's small variant. device: whose kernels are modelled (``"cpu"``/``"cuda"``).
        out_dir: append the record to ``out_dir/<name>.jsonl`` when given.
        seed: seeds the model and the inputs (the same for both sides).

    Returns:
        ``{"case", "estimated": True, "dtype", "device", "small", "eager": {...}, "slimgrad":
        {...}, "peak_ratio", "saved_ratio", "saved_over_eager_floor", "eager_saved_over_floor",
        "versions", "commit", "time_utc"}``; each side has the harness's ``MEMORY_FIELDS``,
        ``by_node`` and ``step_ms`` (None).

    Raises:
        ValueError: ``name`` is not a case this function can estimate.
    """
    from datetime import datetime, timezone

    import slimgrad
    from slimgrad import memory
    from slimgrad.bench.harness import MEMORY_FIELDS, _ratio, environment, git_commit

    if name not in _EAGER_SIDES:
        raise ValueError(
            f"slimgrad.bench.cases.models.estimate_case: unknown case; expected one of "
            f"{sorted(_EAGER_SIDES)}, got {name!r}. Run other cases with `slimgrad bench`."
        )
    commit = git_commit()

    def side(convert: bool) -> dict:
        def make():
            torch.manual_seed(seed)
            # built in float32, then cast as model.to(dtype) would (whose parameter swap fails
            # under FakeTensorMode with tied weights), keeping tied Parameters tied
            model, make_inputs = _EAGER_SIDES[name](device, torch.float32, small)
            for p in {id(p): p for p in model.parameters()}.values():
                p.data = p.data.to(dtype)
            for m in model.modules():
                for k, b in m._buffers.items():
                    if b is not None and b.is_floating_point():
                        m._buffers[k] = b.to(dtype)
            if convert:
                model = slimgrad.convert_(model)
            torch.manual_seed(seed + 1)
            xs = make_inputs()
            xs = xs if isinstance(xs, tuple) else (xs,)
            return lambda: model(*xs)

        m = memory.estimate(make, device=device, timeline=False)
        out = {f: int(getattr(m, f)) for f in MEMORY_FIELDS}
        out["by_node"] = {k: int(v) for k, v in sorted(m.by_node.items(), key=lambda kv: -kv[1])}
        out["step_ms"] = None
        return out

    eager, slim = side(False), side(True)
    rec = {
        "case": name,
        "estimated": True,
        "small": small,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "eager": eager,
        "slimgrad": slim,
        "saved_ratio": _ratio(slim["saved_bytes"], eager["saved_bytes"]),
        "peak_ratio": _ratio(slim["peak_bytes"], eager["peak_bytes"]),
        "saved_over_eager_floor": _ratio(slim["saved_bytes"], eager["floor_bytes"]),
        "eager_saved_over_floor": _ratio(eager["saved_bytes"], eager["floor_bytes"]),
        "time_ratio": None,
        "versions": {k: v for k, v in environment().items() if k != "gpus"},
        "commit": commit,
        "time_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if out_dir is not None:
        harness.append_record(out_dir, name, rec)
    return rec


def main(argv=None) -> int:
    """``python -m slimgrad.bench.cases.models CASE [--dtype D] [--small] [--out DIR]``: one
    :func:`estimate_case` record, printed (and appended under ``--out``)."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m slimgrad.bench.cases.models")
    p.add_argument("case", choices=sorted(_EAGER_SIDES))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--small", action="store_true")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", default=None, help="folder of the JSONL records (CASE.jsonl)")
    a = p.parse_args(argv)
    rec = estimate_case(
        a.case, dtype=getattr(torch, a.dtype), small=a.small, device=a.device, out_dir=a.out
    )
    print(json.dumps({k: v for k, v in rec.items() if k != "versions"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
