"""HF gated MLPs (``down(act(gate(x)) * up(x))``) -> :class:`slimgrad.nn.gated_mlp.GatedMLP`.

# NOTE [Gated MLP by template]
An HF MLP instance converts when its class's ``forward`` *is* one of the templates below (the
source, parsed: parameter and local names and the ``self.<attribute>`` names abstracted, docstrings
and annotations ignored, no decorators), its instance has no patched forward, the attributes the
template calls are submodules, and the activation computes what
:func:`slimgrad.nn.gated_mlp.activation_of` names (SiLU, erf GELU, tanh GELU via ``F.gelu``).
Otherwise ``NotImplementedError(reason)`` and the module stays as it is. Nothing of transformers
is rebound or imported here. The projections may be anything callable as a module (PEFT LoRA
layers included): ``GatedMLP`` calls those that are not plain Linears (NOTE [Gated MLP: which
path] in ``slimgrad/nn/gated_mlp.py``).

Templates (the roles are read off the attribute names of the matched template):

- Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma2/3, OLMo/OLMo2, Cohere, Granite, StableLM,
  Ministral, the dense MLPs and shared experts of Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V2/V3:
  ``down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x));
  return down_proj`` (or returned directly);
- Phi-3: ``up_states = self.gate_up_proj(x); gate, up_states = up_states.chunk(2, dim=-1);
  up_states = up_states * self.activation_fn(gate); return self.down_proj(up_states)``.

MoE expert banks with 3-D weights (``MixtralExperts``, ``Qwen2MoeExperts``: a loop over the experts
hit) are not this template and are not in the table.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import torch.nn as nn

from slimgrad.convert_handlers import accelerate_hooks as _accelerate_hooks
from slimgrad.nn.gated_mlp import GatedMLP, activation_of

__all__ = ["TABLE", "gated_mlp_from_hf"]


class _Canon(ast.NodeTransformer):
    # first parameter after self -> x; locals -> _v0, _v1 (first store); self.<a> -> self._aN
    def __init__(self, param: str):
        self.param, self.names, self.attrs = param, {}, []

    def visit_Name(self, node):
        if node.id == self.param:
            return ast.copy_location(ast.Name("x", node.ctx), node)
        if isinstance(node.ctx, ast.Store) and node.id not in self.names and node.id != "self":
            self.names[node.id] = f"_v{len(self.names)}"
        if node.id in self.names:
            return ast.copy_location(ast.Name(self.names[node.id], node.ctx), node)
        return node

    def visit_Attribute(self, node):
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            if node.attr not in self.attrs:
                self.attrs.append(node.attr)
            new = ast.Attribute(node.value, f"_a{self.attrs.index(node.attr)}", node.ctx)
            return ast.copy_location(new, node)
        return self.generic_visit(node)

    def visit_Expr(self, node):
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return None  # docstrings
        return self.generic_visit(node)


def _canon(src: str) -> tuple[list[str], list[str]] | None:
    # (body statements dumped, self attribute names in order of first use); None: not a plain
    # two-parameter method without decorators
    fdef = ast.parse(textwrap.dedent(src)).body[0]
    if not isinstance(fdef, ast.FunctionDef) or fdef.decorator_list:
        return None
    a = fdef.args
    params = a.posonlyargs + a.args
    if len(params) != 2 or a.vararg or a.kwarg or a.kwonlyargs or a.defaults:
        return None
    c = _Canon(params[1].arg)
    body = [s for s in (c.visit(s) for s in fdef.body) if s is not None]
    return [ast.dump(s) for s in body], c.attrs


_ROLES = ("gate_proj", "up_proj", "down_proj", "act_fn")
_ROLES_FUSED = ("gate_up_proj", None, "down_proj", "activation_fn")
_TEMPLATES = [
    (
        """
        def forward(self, x):
            down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
            return down_proj
        """,
        _ROLES,
    ),
    (
        """
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        """,
        _ROLES,
    ),
    (
        """
        def forward(self, hidden_states):
            up_states = self.gate_up_proj(hidden_states)
            gate, up_states = up_states.chunk(2, dim=-1)
            up_states = up_states * self.activation_fn(gate)
            return self.down_proj(up_states)
        """,
        _ROLES_FUSED,
    ),
]
_CANON_TEMPLATES = [(_canon(src), roles) for src, roles in _TEMPLATES]
_MATCHED: dict = {}


def _match(fn) -> tuple | None:
    # the roles (gate, up, down, act attribute names of the instance) of a template forward
    if fn not in _MATCHED:
        try:
            got = _canon(inspect.getsource(fn))
        except (OSError, TypeError, SyntaxError, IndexError):
            got = None
        _MATCHED[fn] = None
        for (body, attrs), roles in _CANON_TEMPLATES:
            if got is not None and got[0] == body:
                where = {name: got[1][i] for i, name in enumerate(attrs)}
                _MATCHED[fn] = tuple(None if r is None else where[r] for r in roles)
                break
    return _MATCHED[fn]


def gated_mlp_from_hf(module: nn.Module) -> nn.Module:
    """An HF gated MLP -> :class:`~slimgrad.nn.gated_mlp.GatedMLP` sharing its submodules (NOTE
    [Gated MLP by template]).

    Raises:
        NotImplementedError: the forward is not a template, the instance's forward is patched,
            or the activation is not one computed exactly; the message says which.
    """
    if _accelerate_hooks.patched(module):  # NOTE [A replacement carries accelerate's hook]
        raise NotImplementedError("the instance has a patched forward")
    roles = _match(type(module).forward)
    if roles is None:
        raise NotImplementedError(
            f"{type(module).__qualname__}.forward is not the gated-MLP template "
            "down(act(gate(x)) * up(x)) (NOTE [Gated MLP by template])"
        )
    for r in roles:
        if r is not None and not isinstance(module._modules.get(r), nn.Module):
            raise NotImplementedError(f"self.{r} is not a submodule")
    act = module._modules[roles[3]]
    activation = activation_of(act)
    if activation is None:
        raise NotImplementedError(
            f"activation {type(act).__name__} is not one the gated-MLP op computes bit for bit "
            "(nn.SiLU, SiLUActivation, nn.GELU, GELUActivation, GELUTanh)"
        )
    return GatedMLP.from_hf(module, roles, activation)


_H = ("activations", gated_mlp_from_hf)
# {qualified HF class name: (ConvertConfig field, handler)}; merged into slimgrad.convert._TABLE.
TABLE = {
    f"transformers.models.{m}.modeling_{m}.{cls}": _H
    for m, cls in [
        ("llama", "LlamaMLP"),
        ("mistral", "MistralMLP"),
        ("qwen2", "Qwen2MLP"),
        ("qwen3", "Qwen3MLP"),
        ("gemma", "GemmaMLP"),
        ("gemma2", "Gemma2MLP"),
        ("phi3", "Phi3MLP"),
        ("qwen2_moe", "Qwen2MoeMLP"),
        ("qwen3_moe", "Qwen3MoeMLP"),
        # the same template (checked by parsing; the handler re-checks each instance)
        ("gemma3", "Gemma3MLP"),
        ("olmo", "OlmoMLP"),
        ("olmo2", "Olmo2MLP"),
        ("olmoe", "OlmoeMLP"),
        ("cohere", "CohereMLP"),
        ("cohere2", "Cohere2MLP"),
        ("granite", "GraniteMLP"),
        ("stablelm", "StableLmMLP"),
        ("deepseek_v2", "DeepseekV2MLP"),
        ("deepseek_v3", "DeepseekV3MLP"),
        ("ministral", "MinistralMLP"),
    ]
}
