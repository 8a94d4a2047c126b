"""HF mixture-of-experts banks with 3-D expert weights -> :class:`GatedExperts`.

# NOTE [MoE expert banks by template]
transformers 5.x holds the routed experts of Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, OLMoE,
GLM-4-MoE and ~50 other families (``_FAMILIES`` below) as one module with two 3-D Parameters,
``gate_up_proj`` (E, 2 I, D) and ``down_proj`` (E, D, I), and one eager forward, the same source
in every family (``_TEMPLATE``): a loop over the experts that received tokens, each running
``down(act(gate) * up)`` with ``gate, up = linear(x_e, gate_up_proj[e]).chunk(2, -1)`` on its rows
``x_e = hidden_states[token_idx]``, scaling by the routing weights and ``index_add_``-ing into the
output. The class is decorated with ``@use_experts_implementation``, whose forward dispatches on
``config._experts_implementation`` to that eager loop (``"eager"``) or to another implementation
(``"grouped_mm"``, transformers' default where its kernel exists, ``"batched_mm"``, hub kernels).

An instance converts when (checked at convert time; otherwise ``NotImplementedError(reason)`` and
it stays as it is):

- its class's forward is that dispatcher (the decorator's source, parsed) around the template
  (parsed: docstrings and annotations ignored, every name as in the template), or the template
  itself; no patched forward on the instance (``convert_`` checks that);
- its config dispatches to the eager loop now (``"eager"``); under ``"grouped_mm"`` and the
  others the loop is not what runs, and their batched kernels sum in another order;
- ``gate_up_proj`` and ``down_proj`` are plain Parameters of matching 3-D shapes, the module is not
  parametrized and not expert-parallel (``_is_expert_parallel``), and ``act_fn`` computes what
  :func:`slimgrad.nn.gated_mlp.activation_of` names (SiLU, erf GELU, tanh GELU) with no hooks.

The replacement runs the same loop statement for statement (the same routing tables, the same
experts in the same order, the same ``index_add_`` calls), with each expert's three lines
``linear -> chunk -> act * up -> linear`` replaced by
:func:`slimgrad.ops.gated_mlp.gated_mlp_fused` on the same operands (the expert's weight views
``gate_up_proj[e]``, ``down_proj[e]``): eager's bits in forward and eager's gradient formulas on
the same operands (bit for bit on CPU in fp32, bf16 and under autocast:
``tests/test_convert_hf_moe.py``).
It keeps per expert the rows ``x_e`` and the fused pre-activation (D + 2 I elements per routed
token) instead of eager's ``x_e``, the pre-activation, ``act(gate)`` and the product (D + 4 I):
2 I elements per (token, expert) pair less; the routing-weight product keeps, as in eager, the
expert's output. Parameters, submodules, attributes and hooks are the original's (state_dict keys
unchanged).

At call time the replacement decides again, so it computes what the original computes then: a
config switched to another experts implementation runs that implementation on this module (as the
dispatcher would), and an ``act_fn`` replaced or hooked after conversion, or a global module hook,
runs the original loop unchanged. Left untouched: the decorated classes with other layouts or
forwards (GPT-OSS, Aria, NemotronH, MuseSpark, ... : transposed, biased, ungated or post-normed
banks), and the non-eager implementations (grouped_mm keeps what eager's ``grouped_mm`` keeps).
PEFT LoRA on the banks (``target_parameters``) parametrizes this module during its forward; the
loop reads each weight view once per expert, as eager does, so the adapters' gradients are eager's.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import torch
import torch.nn as nn
from torch.nn.modules import module as _module_globals

from slimgrad.nn.gated_mlp import activation_of
from slimgrad.ops.gated_mlp import gated_mlp_fused

__all__ = ["PATTERNS", "TABLE", "GatedExperts", "gated_experts_from_hf"]

_TEMPLATE = """
def forward(
    self,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()

    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[token_idx]
        gate, up = nn.functional.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
        current_hidden_states = self.act_fn(gate) * up
        current_hidden_states = nn.functional.linear(current_hidden_states, self.down_proj[expert_idx])
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))

    return final_hidden_states
"""  # noqa: E501

# transformers.integrations.moe.use_experts_implementation's forward (closure: experts_interface,
# original_forward)
_DISPATCH = """
@wraps(original_forward)
def forward(self, *args, **kwargs):
    experts_forward = experts_interface.get_interface(self.config._experts_implementation, original_forward)
    return experts_forward(self, *args, **kwargs)
"""  # noqa: E501


def _canon(src: str) -> str | None:
    # the method's decorators, signature names and body, docstrings and annotations dropped; None:
    # not a function
    fdef = ast.parse(textwrap.dedent(src)).body[0]
    if not isinstance(fdef, ast.FunctionDef):
        return None
    body = fdef.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    a = fdef.args
    for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
        if arg is not None:
            arg.annotation = None
    decorators = "".join(ast.dump(d) for d in fdef.decorator_list)
    return decorators + "|" + ast.dump(a) + "".join(ast.dump(s) for s in body)


_CANON_TEMPLATE, _CANON_DISPATCH = _canon(_TEMPLATE), _canon(_DISPATCH)
_SOURCES: dict = {}


def _is(fn, canon: str) -> bool:
    # the function's own source: its code object's (getsource(fn) would follow __wrapped__)
    code = getattr(fn, "__code__", None)
    key = (code, canon)
    if key not in _SOURCES:
        try:
            _SOURCES[key] = code is not None and _canon(inspect.getsource(code)) == canon
        except (OSError, TypeError, SyntaxError, IndexError):
            _SOURCES[key] = False
    return _SOURCES[key]


def _parts(cls: type) -> tuple | None:
    # (original eager forward, experts interface or None) of a template class, else None
    fwd = cls.forward
    if _is(fwd, _CANON_TEMPLATE):
        return fwd, None
    if not _is(fwd, _CANON_DISPATCH):
        return None
    free = dict(zip(fwd.__code__.co_freevars, (c.cell_contents for c in fwd.__closure__ or ())))
    original, interface = free.get("original_forward"), free.get("experts_interface")
    if original is None or interface is None or not _is(original, _CANON_TEMPLATE):
        return None
    return original, interface


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _hooked(m: nn.Module) -> bool:
    return any(getattr(m, d, None) for d in _HOOK_DICTS)


def _global_hooks() -> bool:
    # hooks torch calls on every module (the act_fn call in eager's loop included)
    return any(
        getattr(_module_globals, f"_global{d}", None)
        for d in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    )


def _lean_activation(module: nn.Module) -> str | None:
    # the activation gated_mlp_fused computes for module.act_fn now, or None (run eager's loop)
    act = module._modules.get("act_fn")
    if act is None or _hooked(act) or _global_hooks():
        return None
    return activation_of(act)


class GatedExperts(nn.Module):
    """An HF expert bank (``MixtralExperts`` and its copies) keeping per expert its rows and the
    gate/up pre-activation; the product is recomputed in backward (NOTE [MoE expert banks by
    template] in ``slimgrad/convert_handlers/hf_moe.py``).

    Built by :func:`gated_experts_from_hf` from an instance; shares its Parameters, submodules,
    attributes and config, so ``state_dict`` keys and values are the original's.

    Memory: per (token, expert) pair, saves the expert's input row and fused pre-activation
    (D s_x + 2 I s bytes) plus, as eager, the expert's output for the routing weight (D s); eager
    also keeps act(gate) and the product (2 I s more).
    """

    def forward(self, hidden_states, top_k_index, top_k_weights):
        original, interface = self._slimgrad_hf_forward
        if interface is not None:  # the dispatcher's choice, made now
            impl = interface.get_interface(self.config._experts_implementation, original)
            if impl is not original:
                return impl(self, hidden_states, top_k_index, top_k_weights)
        activation = _lean_activation(self)
        if activation is None:
            return original(self, hidden_states, top_k_index, top_k_weights)
        # eager's loop (_TEMPLATE), statement for statement, the expert's MLP as one op
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
            expert_mask = expert_mask.permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[token_idx]
            current_hidden_states = gated_mlp_fused(
                current_state,
                self.gate_up_proj[expert_idx],
                self.down_proj[expert_idx],
                activation=activation,
            )
            weights = top_k_weights[token_idx, top_k_pos, None]
            current_hidden_states = current_hidden_states * weights
            final_hidden_states.index_add_(
                0, token_idx, current_hidden_states.to(final_hidden_states.dtype)
            )
        return final_hidden_states

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        # the original class's, for the non-eager implementations that call it on this module
        return self._slimgrad_hf_apply_gate(self, gate_up_out)


def gated_experts_from_hf(module: nn.Module) -> GatedExperts:
    """An HF expert bank -> :class:`GatedExperts` sharing its state (NOTE [MoE expert banks by
    template]).

    Raises:
        NotImplementedError: the class's forward is not the template, the config dispatches to
            another experts implementation, the banks or the activation are not the template's,
            or the module is parametrized, expert-parallel or its act_fn hooked; the message says
            which.
    """
    cls = type(module)
    parts = _parts(cls)
    if parts is None:
        raise NotImplementedError(
            f"{cls.__qualname__}.forward is not the eager expert loop of MixtralExperts (nor "
            "transformers' experts dispatcher around it) (NOTE [MoE expert banks by template])"
        )
    original, interface = parts
    if interface is not None:
        config = getattr(module, "config", None)
        impl = getattr(config, "_experts_implementation", None)
        if impl != "eager":
            raise NotImplementedError(
                f"config._experts_implementation is {impl!r}: the eager expert loop does not run "
                "(the batched implementations sum in another order); load the model with "
                "experts_implementation='eager' to convert it"
            )
    if torch.nn.utils.parametrize.is_parametrized(module):
        raise NotImplementedError("the module is parametrized")
    if getattr(module, "_is_expert_parallel", False):
        raise NotImplementedError("the module is expert-parallel (sharded banks)")
    gu, down = module._parameters.get("gate_up_proj"), module._parameters.get("down_proj")
    e = getattr(module, "num_experts", None)
    if (
        not isinstance(gu, nn.Parameter)
        or not isinstance(down, nn.Parameter)
        or not isinstance(e, int)
        or gu.dim() != 3
        or down.dim() != 3
        or gu.shape[0] != down.shape[0]
        or gu.shape[1] != 2 * down.shape[2]
        or gu.shape[2] != down.shape[1]
    ):
        raise NotImplementedError(
            "gate_up_proj and down_proj are not Parameters of shapes (E, 2 I, D) and (E, D, I), "
            "or num_experts is not an int"
        )
    act = module._modules.get("act_fn")
    if act is not None and _hooked(act):
        raise NotImplementedError("act_fn has hooks (eager's loop calls it as a module)")
    if activation_of(act) is None:
        raise NotImplementedError(
            f"activation {type(act).__name__} is not one the gated-MLP op computes bit for bit "
            "(nn.SiLU, SiLUActivation, nn.GELU, GELUActivation, GELUTanh)"
        )
    new = GatedExperts()
    for k, v in module.__dict__.items():
        if k in ("_parameters", "_buffers", "_modules"):
            new.__dict__[k] = dict(v)  # the same Parameters, buffers and submodules
        elif k == "_non_persistent_buffers_set":
            new.__dict__[k] = set(v)
        elif not (k.startswith("_") and "hook" in k):  # hooks: convert_ hands them over
            new.__dict__[k] = v
    new.__dict__["_slimgrad_hf_forward"] = (original, interface)
    new.__dict__["_slimgrad_hf_apply_gate"] = getattr(cls, "_apply_gate", None)
    return new


# transformers 5.23's expert banks whose forward is the template (found by parsing every
# @use_experts_implementation class); each instance is still checked by gated_experts_from_hf
_FAMILIES = [
    ("afmoe", "AfmoeExperts"),
    ("axk1", "AXK1Experts"),
    ("axk2", "AXK2Experts"),
    ("bailing_hybrid", "BailingHybridExperts"),
    ("cohere2_moe", "Cohere2MoeExperts"),
    ("deepseek_ocr2", "DeepseekOcr2TextExperts"),
    ("deepseek_v2", "DeepseekV2Experts"),
    ("deepseek_v3", "DeepseekV3Experts"),
    ("deepseek_v32", "DeepseekV32Experts"),
    ("diffusion_gemma", "DiffusionGemmaTextExperts"),
    ("dots1", "Dots1Experts"),
    ("dots3_note", "Dots3NoteExperts"),
    ("ernie4_5_moe", "Ernie4_5_MoeExperts"),
    ("ernie4_5_vl_moe", "Ernie4_5_VLMoeMoeExperts"),
    ("exaone_moe", "ExaoneMoeExperts"),
    ("flex_olmo", "FlexOlmoExperts"),
    ("flint", "FlintExperts"),
    ("gemma4", "Gemma4TextExperts"),
    ("glm4_moe", "Glm4MoeExperts"),
    ("glm4_moe_lite", "Glm4MoeLiteExperts"),
    ("glm4v_moe", "Glm4vMoeTextExperts"),
    ("glm_moe_dsa", "GlmMoeDsaExperts"),
    ("granitemoe", "GraniteMoeExperts"),
    ("granitemoe_swa", "GraniteMoeSWAExperts"),
    ("granitemoehybrid", "GraniteMoeHybridExperts"),
    ("granitemoeshared", "GraniteMoeSharedExperts"),
    ("hunyuan_v1_moe", "HunYuanMoEV1Experts"),
    ("hy_v3", "HYV3Experts"),
    ("inkling", "InklingExperts"),
    ("jamba", "JambaExperts"),
    ("kimi_linear", "KimiLinearExperts"),
    ("kolibri1", "Kolibri1Experts"),
    ("laguna", "LagunaExperts"),
    ("lfm2_moe", "Lfm2MoeExperts"),
    ("mellum", "MellumExperts"),
    ("mimo_v2_flash", "MiMoV2FlashExperts"),
    ("minimax", "MiniMaxExperts"),
    ("minimax_m2", "MiniMaxM2Experts"),
    ("mistral4", "Mistral4Experts"),
    ("mistral_large4", "MistralLarge4TextExperts"),
    ("mixtral", "MixtralExperts"),
    ("olmoe", "OlmoeExperts"),
    ("phimoe", "PhimoeExperts"),
    ("qwen2_moe", "Qwen2MoeExperts"),
    ("qwen3_5_moe", "Qwen3_5MoeExperts"),
    ("qwen3_moe", "Qwen3MoeExperts"),
    ("qwen3_next", "Qwen3NextExperts"),
    ("qwen3_omni_moe", "Qwen3OmniMoeThinkerTextExperts"),
    ("qwen3_omni_moe", "Qwen3OmniMoeTalkerTextExperts"),
    ("qwen3_vl_moe", "Qwen3VLMoeTextExperts"),
    ("qwen4_exp", "Qwen4ExpTextExperts"),
    ("solar_open", "SolarOpenExperts"),
    ("unlimited_ocr", "UnlimitedOcrTextExperts"),
    ("zaya", "ZayaExperts"),
]

_H = ("activations", gated_experts_from_hf)
# {qualified HF class name: (ConvertConfig field, handler)}; merged into slimgrad.convert._TABLE.
TABLE: dict = {f"transformers.models.{m}.modeling_{m}.{cls}": _H for m, cls in _FAMILIES}
PATTERNS: list = []
