"""HF transformers glue shared by the HF ``convert_`` passes, and HF's RMSNorm handler.

Nothing here rebinds an HF class or module-level function. The attention pass lives in
``hf_attention.py``, the fused LM-head loss in ``hf_loss.py``.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import sys
import textwrap
import weakref

import torch.nn as nn

from slimgrad.convert_handlers import accelerate_hooks as _accelerate_hooks

# NOTE [Decorators that do not change the computation]
# HF decorates model forwards with helpers that change no arithmetic, and adds or moves them
# between releases (transformers 5.24 put ``@deprecate_kwarg`` on every causal LM's forward). A
# matcher that decides by what a forward computes (``hf_loss``'s templates) accepts a decorator
# only when it is in ``KNOWN_DECORATORS``: its name, looked up in the forward's own module, IS the
# transformers object named there (not a look-alike of the same name); and the forward's wrapper
# layers at run time (``functools.wraps``' ``__wrapped__`` chain) are exactly the wrappers those
# decorators make, each recognised by its code object (a wrapper added by other code, or a
# decorator that wraps where it did not, refuses). Kinds:
#   "doc"           sets the docstring and returns the function itself (no layer);
#   "return_tuple"  ``can_return_tuple``: pops ``return_dict`` (default: the config's) and turns
#                   the output into a tuple; the fused forward does the same itself;
#   "rename_kwarg"  ``deprecate_kwarg(old, version, new_name=...)``: renames (or only warns about)
#                   a keyword argument before the call, warning or raising as HF decides; the fused
#                   forward runs behind the same decorator, HF's own, built from the same literal
#                   arguments, so a call with the old name behaves as HF's forward.
# Anything else (``merge_with_config_defaults`` fills arguments from the config,
# ``capture_outputs`` collects outputs, a user's wrapper) refuses, and the reason names it.
KNOWN_DECORATORS: dict[str, tuple[str, str]] = {
    # name: (transformers module that defines it, kind)
    "auto_docstring": ("transformers.utils.auto_docstring", "doc"),
    "can_return_tuple": ("transformers.utils.generic", "return_tuple"),
    "deprecate_kwarg": ("transformers.utils.deprecation", "rename_kwarg"),
}


def _probe_fn(self, x=None):  # a function for the decorators to wrap, to learn their wrapper code
    return x


@functools.cache
def _known_decorators() -> dict[str, tuple[object, str, object]]:
    # {name: (the transformers object, kind, its wrapper's code object or None)} for the
    # transformers installed; a name it does not define is not known
    out = {}
    for name, (modname, kind) in KNOWN_DECORATORS.items():
        try:
            obj = getattr(importlib.import_module(modname), name)
            if kind == "return_tuple":
                code = obj(_probe_fn).__code__
            elif kind == "rename_kwarg":
                code = obj("_slimgrad_old", "0.0", new_name="_slimgrad_new")(_probe_fn).__code__
            else:
                code = None
        except (ImportError, AttributeError, TypeError, ValueError):
            continue
        out[name] = (obj, kind, code)
    return out


class Decorator:
    """One decorator of a matched forward (NOTE [Decorators that do not change the computation]):
    ``name``, ``kind``, the transformers object ``obj`` and its literal ``args``/``kwargs``."""

    def __init__(self, name: str, kind: str, obj, args: tuple, kwargs: dict) -> None:
        self.name, self.kind, self.obj, self.args, self.kwargs = name, kind, obj, args, kwargs

    def apply(self, fn):
        # the same decorator around ``fn`` (rename_kwarg: HF's own deprecate_kwarg)
        return self.obj(*self.args, **self.kwargs)(fn)


def forward_decorators(fn, nodes: list, g: dict) -> tuple[list[Decorator] | None, str]:
    """The decorators of ``fn`` (a class's forward; ``nodes``: its source's decorator list,
    ``g``: its module's globals), outermost first, when each is in ``KNOWN_DECORATORS`` and its
    run-time wrapper layers are theirs; else ``(None, the reason)`` naming the decorator."""
    known = _known_decorators()
    found: list[Decorator] = []
    for node in nodes:
        call = node if isinstance(node, ast.Call) else None
        target = call.func if call is not None else node
        what = f"@{_unparse(node)}"
        if not isinstance(target, ast.Name) or target.id not in known:
            return None, f"forward has decorator {what}, not one known to leave it unchanged"
        obj, kind, _ = known[target.id]
        if g.get(target.id) is not obj:
            return None, (
                f"forward's {what} is not transformers' {target.id} (another object of that name)"
            )
        args, kwargs = (), {}
        if call is not None:
            if kind == "return_tuple":
                return None, f"forward has decorator {what}, called with arguments"
            if kind == "rename_kwarg":
                try:
                    args = tuple(ast.literal_eval(a) for a in call.args)
                    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
                except ValueError:
                    return None, f"forward's {what} has arguments that are not literals"
                if None in kwargs or "return_dict" in (*args[:1], kwargs.get("new_name")):
                    return None, f"forward's {what} renames return_dict or unpacks arguments"
        found.append(Decorator(target.id, kind, obj, args, kwargs))
    expected = [known[d.name][2] for d in found if known[d.name][2] is not None]
    layers, f = [], fn
    while hasattr(f, "__wrapped__") and len(layers) <= len(expected):
        layers.append(f)
        f = f.__wrapped__
    got = [getattr(x, "__code__", None) for x in layers]
    if len(got) != len(expected) or any(a is not b for a, b in zip(got, expected)):
        names = [getattr(c, "co_qualname", "?") for c in got]
        return None, (
            f"forward's wrapper layers at run time ({', '.join(names) or 'none'}) are not the ones "
            f"its source's decorators make ({', '.join('@' + d.name for d in found) or 'none'})"
        )
    return found, ""


def _unparse(node) -> str:
    try:
        return ast.unparse(node)
    except Exception:  # noqa: BLE001 - only used for names in messages
        return "?"


class CodeReason(str):
    """A handler's refusal because an HF class's code is not what it knows (a release changed a
    forward, a decorator it does not know), as opposed to this instance's settings (hooks, a
    LoRA head, an attention implementation, the device rule). Refusals of this kind on a family
    in ``CLAIMED`` are warned about (NOTE [A refused known family is loud])."""


# NOTE [A refused known family is loud]
# The HF classes whose techniques slimgrad's tests and conformance suites gate (the classes that
# convert on the transformers versions the matrix tests). When a handler refuses one of them
# because of the class's code (a ``CodeReason``), a new transformers most likely changed something
# slimgrad should follow: ``convert_`` gives one UserWarning naming the class, the technique and
# the reason, on top of the report's line. Refusals for the instance's own settings stay in the
# report only.
CLAIMED: dict[str, frozenset[str]] = {
    f"transformers.models.{path}": frozenset(techniques)
    for path, techniques in {
        "bart.modeling_bart.BartForConditionalGeneration": ["attention", "attention_eager"],
        "bert.modeling_bert.BertForMaskedLM": ["attention", "attention_eager", "fused_loss"],
        "clip.modeling_clip.CLIPModel": ["attention", "attention_eager"],
        "cohere.modeling_cohere.CohereForCausalLM": ["attention", "attention_eager", "fused_loss"],
        "distilbert.modeling_distilbert.DistilBertForMaskedLM": [
            "attention",
            "attention_eager",
            "fused_loss",
        ],
        "electra.modeling_electra.ElectraForMaskedLM": [
            "attention",
            "attention_eager",
            "fused_loss",
        ],
        "gemma.modeling_gemma.GemmaForCausalLM": ["attention", "attention_eager", "fused_loss"],
        "gemma2.modeling_gemma2.Gemma2ForCausalLM": ["attention", "attention_eager", "fused_loss"],
        "gpt2.modeling_gpt2.GPT2LMHeadModel": ["attention", "fused_loss"],
        "gpt_neox.modeling_gpt_neox.GPTNeoXForCausalLM": [
            "attention",
            "attention_eager",
            "fused_loss",
        ],
        "granite.modeling_granite.GraniteForCausalLM": [
            "attention",
            "attention_eager",
            "fused_loss",
        ],
        "llama.modeling_llama.LlamaForCausalLM": ["attention", "attention_eager", "fused_loss"],
        "mistral.modeling_mistral.MistralForCausalLM": [
            "attention",
            "attention_eager",
            "fused_loss",
        ],
        "mixtral.modeling_mixtral.MixtralForCausalLM": [
            "attention",
            "attention_eager",
            "fused_loss",
        ],
        "opt.modeling_opt.OPTForCausalLM": ["attention", "attention_eager", "fused_loss"],
        "phi3.modeling_phi3.Phi3ForCausalLM": ["attention", "attention_eager", "fused_loss"],
        "qwen2.modeling_qwen2.Qwen2ForCausalLM": ["attention", "attention_eager", "fused_loss"],
        "qwen3.modeling_qwen3.Qwen3ForCausalLM": ["attention", "attention_eager", "fused_loss"],
        "roberta.modeling_roberta.RobertaForMaskedLM": [
            "attention",
            "attention_eager",
            "fused_loss",
        ],
        "swin.modeling_swin.SwinForImageClassification": ["attention", "attention_eager"],
        "t5.modeling_t5.T5ForConditionalGeneration": ["attention"],
        "vit.modeling_vit.ViTForImageClassification": ["attention", "attention_eager"],
        "whisper.modeling_whisper.WhisperForConditionalGeneration": [
            "attention",
            "attention_eager",
        ],
        "xlm_roberta.modeling_xlm_roberta.XLMRobertaForMaskedLM": [
            "attention",
            "attention_eager",
            "fused_loss",
        ],
    }.items()
}


def note_refusal(rep, model: nn.Module, technique: str, reason) -> None:
    """Record on ``rep`` a refusal that ``convert_`` warns about: ``reason`` is a ``CodeReason``
    and ``model``'s exact class is claimed for ``technique`` (NOTE [A refused known family is
    loud]). A user's subclass is not claimed: its own code may legitimately differ."""
    cls = type(model)
    if isinstance(reason, CodeReason) and technique in CLAIMED.get(
        f"{cls.__module__}.{cls.__qualname__}", ()
    ):
        rep.refused_known.append((cls.__name__, technique, str(reason)))


def hf_models(model: nn.Module):
    """Yield ``(name, module)`` for the outermost HF ``PreTrainedModel`` instances in ``model``,
    user subclasses included (each pass then decides from the instance's own code whether it may
    touch it); their configs are shared with their submodules."""
    mu = sys.modules.get("transformers.modeling_utils")
    base = getattr(mu, "PreTrainedModel", None)
    if base is None:  # transformers not imported: no HF model can be in there
        return
    seen: set[int] = set()
    for name, m in model.named_modules():
        if id(m) in seen or not isinstance(m, base):
            continue
        seen.update(id(sub) for sub in m.modules())
        yield name, m


# NOTE [HF RMSNorm templates]
# An HF RMSNorm converts when its class's ``forward`` (and ``_norm``, where forward calls it) is,
# after dropping annotations and docstrings, exactly one of the sources below: that source is what
# ``slimgrad.ops.rms_norm.HF_VARIANTS[variant]`` computes, op for op (NOTE [HF RMSNorm cast
# orders]). A subclass with its own forward, a patched instance forward, or any other code keeps
# HF's module (the report says why). The class names in ``TABLE`` are the transformers 5.23
# classes whose code is one of these templates; a class renamed or added later is not matched.

_LLAMA_BODY = """
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
"""
_NORM_RSQRT = """
def _norm(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
"""
_NORM_POW = """
def _norm(self, hidden_states):
    mean_squared = hidden_states.pow(2).mean(-1, keepdim=True) + self.eps
    return hidden_states * torch.pow(mean_squared, -0.5)
"""
# (variant, eps attribute, forward sources, _norm source or None)
_TEMPLATES = [
    (
        "llama",
        "variance_epsilon",
        [
            "def forward(self, hidden_states):"
            + _LLAMA_BODY
            + "    return self.weight * hidden_states.to(input_dtype)\n"
        ],
        None,
    ),
    (
        "scale_then_cast",
        "variance_epsilon",
        [
            "def forward(self, hidden_states):"
            + _LLAMA_BODY
            + "    return (self.weight * hidden_states).to(input_dtype)\n"
        ],
        None,
    ),
    (
        "fp32_scale_then_cast",
        "variance_epsilon",
        [
            "def forward(self, hidden_states):"
            + _LLAMA_BODY
            + "    return (self.weight.to(torch.float32) * hidden_states).to(input_dtype)\n"
        ],
        None,
    ),
    (
        "t5",
        "variance_epsilon",
        [
            """
def forward(self, hidden_states):
    variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    if self.weight.dtype in [torch.float16, torch.bfloat16]:
        hidden_states = hidden_states.to(self.weight.dtype)
    return self.weight * hidden_states
"""
        ],
        None,
    ),
    (
        "gemma",
        "eps",
        [
            """
def forward(self, x):
    output = self._norm(x.float())
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)
"""
        ],
        _NORM_RSQRT,
    ),
    (
        "centered",
        "eps",
        [
            """
def forward(self, x):
    output = self._norm(x.float())
    output = output * (1.0 + self.weight).float()
    return output.type_as(x)
"""
        ],
        _NORM_RSQRT,
    ),
    (
        "float_scale",
        "eps",
        [
            """
def forward(self, x):
    output = self._norm(x.float())
    output = output * self.weight.float()
    return output.type_as(x)
"""
        ],
        _NORM_RSQRT,
    ),
    (
        "float_scale_pow",
        "eps",
        [
            """
def forward(self, hidden_states):
    normed_output = self._norm(hidden_states.float())
    if self.with_scale:
        normed_output = normed_output * self.weight.float()
    return normed_output.type_as(hidden_states)
"""
        ],
        _NORM_POW,
    ),
    (
        "cast_then_scale",
        "eps",
        [
            """
def forward(self, x):
    output = self._norm(x.float()).type_as(x)
    return output * self.weight
"""
        ],
        _NORM_RSQRT,
    ),
    (
        "unweighted",
        "eps",
        ["def forward(self, x):\n    return self._norm(x.float()).type_as(x)\n"],
        _NORM_RSQRT,
    ),
]


class _Plain(ast.NodeTransformer):
    # drop annotations, return annotations and docstrings: they do not change what runs
    def visit_FunctionDef(self, node):
        node.returns = None
        node.decorator_list = node.decorator_list
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]
        node.body = body
        return self.generic_visit(node)

    def visit_arg(self, node):
        node.annotation = None
        return node

    def visit_AnnAssign(self, node):
        if node.value is None:
            return None
        return ast.copy_location(ast.Assign(targets=[node.target], value=node.value), node)


def _plain_dump(src: str) -> str:
    tree = _Plain().visit(ast.parse(textwrap.dedent(src)))
    return ast.dump(tree.body[0])


# {function: its plain dump or None}: a class's code is read once, at its first instance (a 16-layer
# Llama has 33 RMSNorms of one class); a new function (a patched forward) is a new key
_DUMPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _source_dump(fn) -> str | None:
    if fn in _DUMPS:
        return _DUMPS[fn]
    try:
        dump = _plain_dump(inspect.getsource(inspect.unwrap(fn)))
    except (OSError, TypeError, SyntaxError, IndexError):
        dump = None
    try:
        _DUMPS[fn] = dump
    except TypeError:  # None, or an object without weak references: read again next time
        pass
    return dump


_TEMPLATE_DUMPS = [
    (v, eps_attr, {_plain_dump(f) for f in fwds}, _plain_dump(norm) if norm else None)
    for v, eps_attr, fwds, norm in _TEMPLATES
]


def rms_norm_variant(module: nn.Module) -> tuple[str, str]:
    """``(variant, eps attribute)`` of an HF RMSNorm instance whose code is a known template
    (NOTE [HF RMSNorm templates]); raises NotImplementedError with the reason otherwise."""
    cls = type(module)
    if _accelerate_hooks.patched(module):  # NOTE [A replacement carries accelerate's hook]
        raise NotImplementedError("its forward is patched on the instance")
    fwd = _source_dump(cls.forward)
    if fwd is None:
        raise NotImplementedError("the source of its forward is not available")
    for variant, eps_attr, fwds, norm in _TEMPLATE_DUMPS:
        if fwd not in fwds:
            continue
        if norm is not None and (
            "_norm" in vars(module) or _source_dump(getattr(cls, "_norm", None)) != norm
        ):
            raise NotImplementedError("its _norm is not HF's x * rsqrt(mean(x^2) + eps)")
        return variant, eps_attr
    raise NotImplementedError(
        "its forward is not one of the HF RMSNorm templates slimgrad computes bit for bit"
    )


def rms_norm_from_hf(module: nn.Module) -> nn.Module:
    """An HF RMSNorm -> :class:`slimgrad.nn.rms_norm.HFRMSNorm` of its template's variant: HF's
    forward bit for bit in every dtype (NOTE [HF RMSNorm templates])."""
    from slimgrad.nn.rms_norm import HFRMSNorm

    variant, eps_attr = rms_norm_variant(module)
    return HFRMSNorm.from_hf(module, variant, eps_attr)


# The transformers 5.23 classes whose forward (and _norm) is one of ``_TEMPLATES`` (found by parsing
# every ``models/*/modeling_*.py``); the handler re-checks each instance's code when it converts.
RMS_NORM_CLASSES = (
    "transformers.models.afmoe.modeling_afmoe.AfmoeRMSNorm",
    "transformers.models.aimv2.modeling_aimv2.Aimv2RMSNorm",
    "transformers.models.apertus.modeling_apertus.ApertusRMSNorm",
    "transformers.models.arcee.modeling_arcee.ArceeRMSNorm",
    "transformers.models.aria.modeling_aria.AriaTextRMSNorm",
    "transformers.models.axk1.modeling_axk1.AXK1RMSNorm",
    "transformers.models.axk2.modeling_axk2.AXK2RMSNorm",
    "transformers.models.bailing_hybrid.modeling_bailing_hybrid.BailingHybridRMSNorm",
    "transformers.models.bamba.modeling_bamba.BambaRMSNorm",
    "transformers.models.beam.modeling_beam.BeamRMSNorm",
    "transformers.models.bitnet.modeling_bitnet.BitNetRMSNorm",
    "transformers.models.blt.modeling_blt.BltRMSNorm",
    "transformers.models.chameleon.modeling_chameleon.ChameleonRMSNorm",
    "transformers.models.clvp.modeling_clvp.ClvpRMSNorm",
    "transformers.models.cohere2_moe.modeling_cohere2_moe.Cohere2MoeRMSNorm",
    "transformers.models.cosmos3_edge.modeling_cosmos3_edge.Cosmos3EdgeTextRMSNorm",
    "transformers.models.csm.modeling_csm.CsmRMSNorm",
    "transformers.models.cwm.modeling_cwm.CwmRMSNorm",
    "transformers.models.deepseek_ocr2.modeling_deepseek_ocr2.DeepseekOcr2TextRMSNorm",
    "transformers.models.deepseek_ocr2.modeling_deepseek_ocr2.DeepseekOcr2VisionRMSNorm",
    "transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2RMSNorm",
    "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RMSNorm",
    "transformers.models.deepseek_v32.modeling_deepseek_v32.DeepseekV32RMSNorm",
    "transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4RMSNorm",
    "transformers.models.deimv2.modeling_deimv2.Deimv2RMSNorm",
    "transformers.models.dia.modeling_dia.DiaRMSNorm",
    "transformers.models.diffllama.modeling_diffllama.DiffLlamaRMSNorm",
    "transformers.models.diffusion_gemma.modeling_diffusion_gemma.DiffusionGemmaRMSNorm",
    "transformers.models.doge.modeling_doge.DogeRMSNorm",
    "transformers.models.dots1.modeling_dots1.Dots1RMSNorm",
    "transformers.models.dots3_note.modeling_dots3_note.Dots3NoteRMSNorm",
    "transformers.models.embedding_gemma2.modeling_embedding_gemma2.EmbeddingGemma2RMSNorm",
    "transformers.models.emu3.modeling_emu3.Emu3RMSNorm",
    "transformers.models.ernie4_5.modeling_ernie4_5.Ernie4_5RMSNorm",
    "transformers.models.ernie4_5_moe.modeling_ernie4_5_moe.Ernie4_5_MoeRMSNorm",
    "transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe.Ernie4_5_VLMoeRMSNorm",
    "transformers.models.esmfold2.modeling_esmfold2.EsmFold2RMSNorm",
    "transformers.models.eurobert.modeling_eurobert.EuroBertRMSNorm",
    "transformers.models.evolla.modeling_evolla.EvollaRMSNorm",
    "transformers.models.exaone4.modeling_exaone4.Exaone4RMSNorm",
    "transformers.models.exaone4_5.modeling_exaone4_5.Exaone4_5_RMSNorm",
    "transformers.models.exaone_moe.modeling_exaone_moe.ExaoneMoeRMSNorm",
    "transformers.models.falcon_h1.modeling_falcon_h1.FalconH1RMSNorm",
    "transformers.models.falcon_mamba.modeling_falcon_mamba.FalconMambaRMSNorm",
    "transformers.models.falcon_mamba.modeling_falcon_mamba.FalconMambaWeightlessRMSNorm",
    "transformers.models.flex_olmo.modeling_flex_olmo.FlexOlmoRMSNorm",
    "transformers.models.flint.modeling_flint.FlintRMSNorm",
    "transformers.models.gemma.modeling_gemma.GemmaRMSNorm",
    "transformers.models.gemma2.modeling_gemma2.Gemma2RMSNorm",
    "transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm",
    "transformers.models.gemma3n.modeling_gemma3n.Gemma3nRMSNorm",
    "transformers.models.gemma4.modeling_gemma4.Gemma4RMSNorm",
    "transformers.models.gemma4_unified.modeling_gemma4_unified.Gemma4UnifiedRMSNorm",
    "transformers.models.glm.modeling_glm.GlmRMSNorm",
    "transformers.models.glm4.modeling_glm4.Glm4RMSNorm",
    "transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeRMSNorm",
    "transformers.models.glm4_moe_lite.modeling_glm4_moe_lite.Glm4MoeLiteRMSNorm",
    "transformers.models.glm4v.modeling_glm4v.Glm4vRMSNorm",
    "transformers.models.glm4v_moe.modeling_glm4v_moe.Glm4vMoeRMSNorm",
    "transformers.models.glm4v_moe.modeling_glm4v_moe.Glm4vMoeTextRMSNorm",
    "transformers.models.glm5_next.modeling_glm5_next.Glm5NextRMSNorm",
    "transformers.models.glm5_next.modeling_glm5_next.Glm5NextTextRMSNorm",
    "transformers.models.glm_image.modeling_glm_image.GlmImageRMSNorm",
    "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaRMSNorm",
    "transformers.models.glm_ocr.modeling_glm_ocr.GlmOcrRMSNorm",
    "transformers.models.gpt_oss.modeling_gpt_oss.GptOssRMSNorm",
    "transformers.models.granite.modeling_granite.GraniteRMSNorm",
    "transformers.models.granite4_vision.modeling_granite4_vision.Granite4VisionTextRMSNorm",
    "transformers.models.granite_docling.modeling_granite_docling.GraniteDoclingTextRMSNorm",
    "transformers.models.granite_swa.modeling_granite_swa.GraniteSWARMSNorm",
    "transformers.models.granitemoe.modeling_granitemoe.GraniteMoeRMSNorm",
    "transformers.models.granitemoe_swa.modeling_granitemoe_swa.GraniteMoeSWARMSNorm",
    "transformers.models.granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridRMSNorm",
    "transformers.models.granitemoeshared.modeling_granitemoeshared.GraniteMoeSharedRMSNorm",
    "transformers.models.helium.modeling_helium.HeliumRMSNorm",
    "transformers.models.higgs_audio_v2.modeling_higgs_audio_v2.HiggsAudioV2RMSNorm",
    "transformers.models.hrm_text.modeling_hrm_text.HrmTextRMSNorm",
    "transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense.HunYuanDenseV1RMSNorm",
    "transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe.HunYuanMoEV1RMSNorm",
    "transformers.models.hunyuan_vl.modeling_hunyuan_vl.HunYuanVLRMSNorm",
    "transformers.models.hy_v3.modeling_hy_v3.HYV3RMSNorm",
    "transformers.models.hy_v4.modeling_hy_v4.HYV4RMSNorm",
    "transformers.models.hyperclovax.modeling_hyperclovax.HyperCLOVAXRMSNorm",
    "transformers.models.idefics.modeling_idefics.IdeficsRMSNorm",
    "transformers.models.idefics2.modeling_idefics2.Idefics2RMSNorm",
    "transformers.models.idefics3.modeling_idefics3.Idefics3RMSNorm",
    "transformers.models.inkling.modeling_inkling.InklingRMSNorm",
    "transformers.models.inkling2.modeling_inkling2.Inkling2RMSNorm",
    "transformers.models.internvl.modeling_internvl.InternVLVisionRMSNorm",
    "transformers.models.jamba.modeling_jamba.JambaRMSNorm",
    "transformers.models.jetmoe.modeling_jetmoe.JetMoeRMSNorm",
    "transformers.models.kimi_linear.modeling_kimi_linear.KimiLinearRMSNorm",
    "transformers.models.kolibri1.modeling_kolibri1.Kolibri1RMSNorm",
    "transformers.models.kosmos2_5.modeling_kosmos2_5.Kosmos2_5LayerNorm",
    "transformers.models.kyutai_speech_to_text.modeling_kyutai_speech_to_text.KyutaiSpeechToTextRMSNorm",
    "transformers.models.laguna.modeling_laguna.LagunaRMSNorm",
    "transformers.models.lfm2.modeling_lfm2.Lfm2RMSNorm",
    "transformers.models.lfm2_moe.modeling_lfm2_moe.Lfm2MoeRMSNorm",
    "transformers.models.lfm3.modeling_lfm3.Lfm3RMSNorm",
    "transformers.models.lfm3_vl.modeling_lfm3_vl.Lfm3VlVisionRMSNorm",
    "transformers.models.lighton_ocr.modeling_lighton_ocr.LightOnOcrRMSNorm",
    "transformers.models.llama.modeling_llama.LlamaRMSNorm",
    "transformers.models.llama4.modeling_llama4.Llama4TextL2Norm",
    "transformers.models.llama4.modeling_llama4.Llama4TextRMSNorm",
    "transformers.models.longcat_flash.modeling_longcat_flash.LongcatFlashRMSNorm",
    "transformers.models.longt5.modeling_longt5.LongT5LayerNorm",
    "transformers.models.mamba.modeling_mamba.MambaRMSNorm",
    "transformers.models.mamba2.modeling_mamba2.Mamba2RMSNorm",
    "transformers.models.mellum.modeling_mellum.MellumRMSNorm",
    "transformers.models.mimo_v2_flash.modeling_mimo_v2_flash.MiMoV2FlashRMSNorm",
    "transformers.models.minicpm3.modeling_minicpm3.MiniCPM3RMSNorm",
    "transformers.models.minimax.modeling_minimax.MiniMaxRMSNorm",
    "transformers.models.minimax_m2.modeling_minimax_m2.MiniMaxM2RMSNorm",
    "transformers.models.minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLRMSNorm",
    "transformers.models.ministral.modeling_ministral.MinistralRMSNorm",
    "transformers.models.ministral3.modeling_ministral3.Ministral3RMSNorm",
    "transformers.models.mistral.modeling_mistral.MistralRMSNorm",
    "transformers.models.mistral3.modeling_mistral3.Mistral3RMSNorm",
    "transformers.models.mistral4.modeling_mistral4.Mistral4RMSNorm",
    "transformers.models.mistral_large4.modeling_mistral_large4.MistralLarge4RMSNorm",
    "transformers.models.mixtral.modeling_mixtral.MixtralRMSNorm",
    "transformers.models.mllama.modeling_mllama.MllamaTextRMSNorm",
    "transformers.models.molmo2.modeling_molmo2.Molmo2RMSNorm",
    "transformers.models.moshi.modeling_moshi.MoshiRMSNorm",
    "transformers.models.mt5.modeling_mt5.MT5LayerNorm",
    "transformers.models.muse_glimmer.modeling_muse_glimmer.MuseGlimmerRMSNorm",
    "transformers.models.muse_glimmer.modeling_muse_glimmer.MuseGlimmerTextCenteredRMSNorm",
    "transformers.models.muse_glimmer_assistant.modeling_muse_glimmer_assistant.MuseGlimmerAssistantRMSNorm",
    "transformers.models.muse_spark.modeling_muse_spark.MuseSparkRMSNorm",
    "transformers.models.muse_spark.modeling_muse_spark.MuseSparkTextCenteredRMSNorm",
    "transformers.models.nanochat.modeling_nanochat.NanoChatRMSNorm",
    "transformers.models.nemotron_h.modeling_nemotron_h.NemotronHRMSNorm",
    "transformers.models.nemotron_h_omni.modeling_nemotron_h_omni.NemotronH_Omni_RMSNorm",
    "transformers.models.neomme.modeling_neomme.NeoMMERMSNorm",
    "transformers.models.neucodec.modeling_neucodec.NeuCodecRMSNorm",
    "transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm",
    "transformers.models.olmo3.modeling_olmo3.Olmo3RMSNorm",
    "transformers.models.olmo_hybrid.modeling_olmo_hybrid.OlmoHybridRMSNorm",
    "transformers.models.olmoe.modeling_olmoe.OlmoeRMSNorm",
    "transformers.models.openai_privacy_filter.modeling_openai_privacy_filter.OpenAIPrivacyFilterRMSNorm",
    "transformers.models.ovis2.modeling_ovis2.Ovis2RMSNorm",
    "transformers.models.paddleocr_vl.modeling_paddleocr_vl.PaddleOCRRMSNorm",
    "transformers.models.pe_audio.modeling_pe_audio.PeAudioEncoderRMSNorm",
    "transformers.models.pe_audio_video.modeling_pe_audio_video.PeAudioVideoEncoderRMSNorm",
    "transformers.models.pe_video.modeling_pe_video.PeVideoEncoderRMSNorm",
    "transformers.models.phi3.modeling_phi3.Phi3RMSNorm",
    "transformers.models.phi4_multimodal.modeling_phi4_multimodal.Phi4MultimodalRMSNorm",
    "transformers.models.pix2struct.modeling_pix2struct.Pix2StructLayerNorm",
    "transformers.models.pixtral.modeling_pixtral.PixtralRMSNorm",
    "transformers.models.pop2piano.modeling_pop2piano.Pop2PianoLayerNorm",
    "transformers.models.qianfan_ocr.modeling_qianfan_ocr.QianfanOCRVisionRMSNorm",
    "transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm",
    "transformers.models.qwen2_5_omni.modeling_qwen2_5_omni.Qwen2_5OmniRMSNorm",
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLRMSNorm",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeRMSNorm",
    "transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VLRMSNorm",
    "transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm",
    "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5RMSNorm",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeRMSNorm",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeRMSNorm",
    "transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextRMSNorm",
    "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeCode2WavRMSNorm",
    "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeRMSNorm",
    "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeTextRMSNorm",
    "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeThinkerTextRMSNorm",
    "transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLTextRMSNorm",
    "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeTextRMSNorm",
    "transformers.models.recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaRMSNorm",
    "transformers.models.sapiens2.modeling_sapiens2.Sapiens2RMSNorm",
    "transformers.models.seed_oss.modeling_seed_oss.SeedOssRMSNorm",
    "transformers.models.smollm3.modeling_smollm3.SmolLM3RMSNorm",
    "transformers.models.solar_open.modeling_solar_open.SolarOpenRMSNorm",
    "transformers.models.step3p7.modeling_step3p7.Step3p7RMSNorm",
    "transformers.models.switch_transformers.modeling_switch_transformers.SwitchTransformersLayerNorm",
    "transformers.models.t5.modeling_t5.T5LayerNorm",
    "transformers.models.t5gemma.modeling_t5gemma.T5GemmaRMSNorm",
    "transformers.models.t5gemma2.modeling_t5gemma2.T5Gemma2RMSNorm",
    "transformers.models.timesfm.modeling_timesfm.TimesFmRMSNorm",
    "transformers.models.timesfm2_5.modeling_timesfm2_5.TimesFm2_5RMSNorm",
    "transformers.models.udop.modeling_udop.UdopLayerNorm",
    "transformers.models.ultrabert.modeling_ultrabert.UltrabertRMSNorm",
    "transformers.models.ultravbert.modeling_ultravbert.UltraVBertRMSNorm",
    "transformers.models.umt5.modeling_umt5.UMT5LayerNorm",
    "transformers.models.unlimited_ocr.modeling_unlimited_ocr.UnlimitedOcrTextRMSNorm",
    "transformers.models.vaultgemma.modeling_vaultgemma.VaultGemmaRMSNorm",
    "transformers.models.vibevoice.modeling_vibevoice.VibeVoiceRMSNorm",
    "transformers.models.vibevoice_acoustic_tokenizer.modeling_vibevoice_acoustic_tokenizer.VibeVoiceAcousticTokenizerRMSNorm",
    "transformers.models.vibevoice_asr.modeling_vibevoice_asr.VibeVoiceAsrRMSNorm",
    "transformers.models.voxtral_realtime.modeling_voxtral_realtime.VoxtralRealtimeRMSNorm",
    "transformers.models.xcodec2.modeling_xcodec2.Xcodec2RMSNorm",
    "transformers.models.youtu.modeling_youtu.YoutuRMSNorm",
    "transformers.models.zamba.modeling_zamba.ZambaRMSNorm",
    "transformers.models.zamba2.modeling_zamba2.Zamba2RMSNorm",
    "transformers.models.zaya.modeling_zaya.ZayaRMSNorm",
)

# {qualified class name: (ConvertConfig field, handler)}; merged into slimgrad.convert._TABLE.
TABLE = {name: ("norms", rms_norm_from_hf) for name in RMS_NORM_CLASSES}


# NOTE [GPT-2's MLP as one node]
# HF ``GPT2MLP`` converts to :class:`slimgrad.nn.gpt2_mlp.GPT2MLP` (one autograd node: NOTE [One
# node for GPT-2's MLP] in ``slimgrad/ops/gpt2_mlp.py``) when the instance's forward is HF's own
# ``GPT2MLP.forward`` (the function object of the transformers installed: a subclass that keeps
# it converts, one that overrides it or an instance with a patched forward does not), its
# ``c_fc``, ``c_proj``, ``act`` and ``dropout`` are submodules, ``c_fc``/``c_proj`` are
# transformers ``Conv1D`` and ``act`` is a GELU slimgrad converts (``nn.GELU``, HF's GELU
# activations). The children are then converted as usual; each call decides again whether the
# one-node path applies (NOTE [GPT-2 MLP: which path] in ``slimgrad/nn/gpt2_mlp.py``).
def gpt2_mlp_from_hf(module: nn.Module) -> nn.Module:
    """An HF ``GPT2MLP`` -> :class:`slimgrad.nn.gpt2_mlp.GPT2MLP` sharing its submodules (NOTE
    [GPT-2's MLP as one node]).

    Raises:
        NotImplementedError: the forward is not HF's, a child is missing or of another kind; the
            message says which.
    """
    from slimgrad.nn.gelu import _HF as _HF_GELUS
    from slimgrad.nn.gpt2_mlp import GPT2MLP

    hf = sys.modules.get("transformers.models.gpt2.modeling_gpt2")
    stock = getattr(getattr(hf, "GPT2MLP", None), "forward", None)
    if _accelerate_hooks.patched(module):  # NOTE [A replacement carries accelerate's hook]
        raise NotImplementedError("the instance has a patched forward")
    if stock is None or type(module).forward is not stock:
        raise NotImplementedError(
            f"{type(module).__qualname__}.forward is not transformers' GPT2MLP.forward"
        )
    mods = module._modules
    for name in ("c_fc", "c_proj", "act", "dropout"):
        if not isinstance(mods.get(name), nn.Module):
            raise NotImplementedError(f"self.{name} is not a submodule")
    for name in ("c_fc", "c_proj"):
        if type(mods[name]).__name__ != "Conv1D" or _accelerate_hooks.patched(mods[name]):
            raise NotImplementedError(f"self.{name} is not a transformers Conv1D")
    act = mods["act"]
    if not (isinstance(act, nn.GELU) or type(act).__name__ in _HF_GELUS) or (
        "forward" in act.__dict__
    ):
        raise NotImplementedError(
            f"activation {type(act).__name__} is not a GELU slimgrad converts"
        )
    if not isinstance(mods["dropout"], nn.Dropout):
        raise NotImplementedError("self.dropout is not an nn.Dropout")
    return GPT2MLP.from_hf(module)


TABLE["transformers.models.gpt2.modeling_gpt2.GPT2MLP"] = ("activations", gpt2_mlp_from_hf)
