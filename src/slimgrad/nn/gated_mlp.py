"""``slimgrad.nn.GatedMLP``: HF's gated MLPs (LlamaMLP, Phi3MLP, ...) keeping the pre-activations.

The module holds the original projection and activation modules under their original names, so
``state_dict`` keys and values are unchanged and code that reaches ``mlp.gate_proj`` still finds
it. Each call decides from what the modules are *now* (NOTE [Gated MLP: which path]).

# NOTE [Gated MLP: which path]
- every projection a plain ``nn.Linear`` (or ``slimgrad.nn.Linear``) without hooks or a patched
  forward: :func:`slimgrad.ops.gated_mlp.gated_mlp` (or ``gated_mlp_fused``), which keeps x, g
  and u; where the op's backward alone would peak above eager's (NOTE [The gated MLP's peak
  against eager's], and in bytes under autocast NOTE [The gated MLP's peak under autocast], both
  in ``slimgrad/ops/gated_mlp.py``) eager's ops, unless ``recompute_activation`` is set
  (``slimgrad.plan``'s ``lean+recompute:mlp-activation``);
- a projection that is anything else (a PEFT LoRA layer, a quantized linear, a hooked Linear) is
  called as a module, so it computes, keeps and hooks exactly as in eager; what is left
  (``act(g) * u`` and a plain down projection) is :func:`~slimgrad.ops.gated_mlp.glu_linear`,
  or :func:`~slimgrad.ops.gated_mlp.glu` before a down projection that is called;
- the activation module no longer one this op computes exactly, a hook on it, a global module
  hook, a ``torch.func`` transform, or no autograd recording: the eager composition, calling every
  module (the HF forward, op for op).
Hooks registered by ``slimgrad.memory`` to attribute bytes to modules change no value and do not
count as hooks.

# NOTE [The gated MLP's children under autocast]
Where the op loses and the children run one by one under autocast, eager's ``F.linear`` makes
each weight's (and bias's) cast before x's (autograd sequence numbers: bias, weight, x), so in
backward x's cast node, created later, runs first: x's gradient from the projection is cast back
and summed with the other projection's before the weight's gradient is cast to float32. A
converted Linear casts x first and makes its weight's cast token after, so its token ran first and
x's 16-bit gradient stayed alive through the weight gradient's float32 cast: where that cast is
the step's peak (few tokens: a frozen ``down_proj``, 1-3 tokens, a non-leaf x, bf16 autocast) the
peak was 2 B per element of x above eager's (16 B at 1 token of 8 features, 96 B at 3 tokens of
16). The module makes the gate's, up's and down's tokens (cached per autocast region, so the
children's own calls find them) before calling the children: x's casts come after every token, as
in eager, and backward casts x's gradients first (the same bits: independent casts). Biases
that require grad get their (cached) casts made there too, each before its weight's token, as
eager's ``F.linear`` makes them: with the weights' tokens alone the children cast the biases
after x, their float32 casts ran before x's in backward and ``mlp_bias=True`` rows peaked 16-192 B
above eager's (review26b). Measured (tracker) at 1-64 tokens, 4-128 wide, leaf, non-leaf and
no-grad x, each projection frozen or not, with and without biases: never above eager's peak where
main was not (tests/conformance/test_never_more_than_eager_mlp.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as _module

from slimgrad._autograd import compiling, unwrap_if_dead
from slimgrad.nn import gelu as _sng
from slimgrad.nn import linear as _snl
from slimgrad.nn import silu as _sns
from slimgrad.nn._hooks import foreign
from slimgrad.nn._script import NoScript
from slimgrad.ops.gated_mlp import (
    _GATED_MLP_APPLY,
    _act,
    _down_after,
    _top_hooks,
    gated_mlp,
    gated_mlp_fused,
    glu,
    glu_linear,
    later_ok,
    lean_wins,
)
from slimgrad.ops.gated_mlp import _fwd_torch as _eager_ops
from slimgrad.ops.linear import _autocast_cast, autocast_weight, keeps_master

__all__ = ["GatedMLP", "activation_of"]


_TYPE_NAMES: dict[type, str] = {}  # a class's full name, built once per class (every call asks)


def activation_of(act: object) -> str | None:
    """The :mod:`slimgrad.ops.gated_mlp` activation that ``act(x)`` computes bit for bit, or
    None: ``'silu'`` (``nn.SiLU``, HF ``SiLUActivation``), ``'gelu'`` (``nn.GELU()``, HF
    ``GELUActivation``), ``'gelu_tanh'`` (``nn.GELU('tanh')``, HF ``GELUTanh``); slimgrad's SiLU
    and GELU (same outputs). The python formulas (HF ``NewGELUActivation``, ``gelu_fast``, ...)
    round differently: None."""
    if not isinstance(act, nn.Module) or "forward" in act.__dict__:
        return None
    t = type(act)
    name = _TYPE_NAMES.get(t)
    if name is None:
        name = _TYPE_NAMES[t] = f"{t.__module__}.{t.__qualname__}"
    if name in ("torch.nn.modules.activation.SiLU", "slimgrad.nn.silu.SiLU"):
        return "silu"
    if name in ("torch.nn.modules.activation.GELU", "slimgrad.nn.gelu.GELU"):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(act.approximate)
    if name == "transformers.activations.SiLUActivation":
        return "silu"
    fn = getattr(act, "act", None)
    if name == "transformers.activations.GELUActivation" and fn is F.gelu:
        return "gelu"
    if (
        name in ("transformers.activations.GELUTanh", "transformers.activations.PytorchGELUTanh")
        and isinstance(fn, functools.partial)
        and fn.func is F.gelu
        and not fn.args
        and fn.keywords == {"approximate": "tanh"}
    ):
        return "gelu_tanh"
    return None


def _hooked(m: nn.Module) -> bool:
    f, fp, b, bp = m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks
    if not (f or fp or b or bp):  # the common case, without a generator per dict
        return False
    return foreign(f) or foreign(fp) or foreign(b) or foreign(bp)


def _global_hooks() -> bool:
    f, fp = _module._global_forward_hooks, _module._global_forward_pre_hooks
    b, bp = _module._global_backward_hooks, _module._global_backward_pre_hooks
    if not (f or fp or b or bp):
        return False
    return foreign(f) or foreign(fp) or foreign(b) or foreign(bp)


# the classes whose instances the forward checks inline, fixed at import: torch.compile reads
# them as constants (a table filled at the first call made the second call's trace recompile)
_SILUS = (nn.SiLU, _sns.SiLU)
_GELUS = (nn.GELU, _sng.GELU)
_LINEARS = (nn.Linear, _snl.Linear)


_grad_on = torch._C.is_grad_enabled
_functorch_on = torch._C._are_functorch_transforms_active
_is_tracing = torch._C._is_tracing
_any_autocast = torch._C._is_any_autocast_enabled
_compiling = compiling  # NOTE [One-frame compile check] in slimgrad/_autograd.py
_PLAIN = (torch.Tensor, nn.Parameter)
_Parameter = nn.Parameter


def _plain_linear(m: nn.Module) -> bool:
    if type(m) not in _LINEARS or "forward" in m.__dict__:
        return False
    p = m._parameters  # m.weight without Module.__getattr__ (a Linear's weight is a Parameter)
    w = p["weight"] if "weight" in p else m.weight
    if w.ndim != 2:
        return False
    # _hooked(m) only when some hook dict is not empty
    hooks = m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
    return not (hooks and _hooked(m))


def _autocast_sizes(x: torch.Tensor, gate, up, down) -> tuple | None:
    # (x's, autocast's and the weights' bytes per element) where the op's backward under autocast
    # is the one NOTE [The gated MLP's peak under autocast] in ops/gated_mlp.py counts in bytes:
    # plain bias-free Linears whose leaf weights (one dtype, all needing a gradient) the op
    # casts itself, x a non-leaf of more bytes per element than autocast's dtype; else None
    dev = x.device.type
    if x.grad_fn is None or not torch.is_autocast_enabled(dev):
        return None
    dt = torch.get_autocast_dtype(dev)
    ws = []
    for m in (gate, up, down):
        w, b = _params(m)
        if b is not None or not (w.requires_grad and keeps_master(w, dt)):
            return None
        ws.append(w)
    if not (ws[0].dtype == ws[1].dtype == ws[2].dtype and x.element_size() > dt.itemsize):
        return None
    return (x.element_size(), dt.itemsize, ws[0].element_size())


def _tokens_first(x: torch.Tensor, gw, gb, up, dw, db) -> None:
    # NOTE [The gated MLP's children under autocast]: each projection's bias cast, then its
    # weight's cast token, made before the children cast x (eager's F.linear: bias, weight,
    # x), so that backward casts x's gradients back (and sums them) before the weights' and
    # biases' gradients, in eager's order
    dev = x.device.type
    if not torch.is_autocast_enabled(dev):
        return
    dt = torch.get_autocast_dtype(dev)
    ub = None
    if up is not None:
        uw, ub = _params(up)
    for w, b in ((gw, gb), (None if up is None else uw, ub), (dw, db)):
        if b is not None and b.requires_grad:  # cached per region: the child's call finds it
            _autocast_cast(b, dev, dt)
        if w is not None and keeps_master(w, dt):
            autocast_weight(w, dt)


def _params(m: nn.Module) -> tuple:
    # (weight, bias) of a plain Linear (_plain_linear) without Module.__getattr__
    p = m._parameters
    return (
        p["weight"] if "weight" in p else m.weight,
        p["bias"] if "bias" in p else m.bias,
    )


def _autocast_key(x: torch.Tensor):
    # autocast's part of the decision's facts: off (None), on for another device only (False),
    # or its dtype on x's device
    if not _any_autocast():
        return None
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else False


class GatedMLP(NoScript, nn.Module):
    """``down(act(gate(x)) * up(x))`` (``fused``: ``gate, up = gate_up(x).chunk(2, -1)``;
    ``down(up * act(gate))``, HF Phi-3), keeping x, gate(x) and up(x) for backward.

    Memory: saves x + gate(x) + up(x): D s_x + 2 I s bytes per token (D hidden, I intermediate,
    s bytes/elt); eager also keeps act(gate(x)) and the product (D s_x + 4 I s). See
    :mod:`slimgrad.ops.gated_mlp` for selective saving and autocast.

    Args:
        hidden_size: D. intermediate_size: I.
        bias: projections with biases.
        activation: ``'silu'``, ``'gelu'`` or ``'gelu_tanh'``.
        fused: one ``gate_up_proj`` (2 I outputs, gate first) and ``activation_fn`` (Phi-3's
            names) instead of ``gate_proj``, ``up_proj`` and ``act_fn`` (Llama's).

    Example:
        >>> mlp = GatedMLP(8, 16)
        >>> y = mlp(torch.randn(2, 8))
    """

    # convert_ converts the children it holds (the activation module, which the eager fallback
    # paths call) in the same pass, so a second convert_ changes nothing
    CONVERT_CHILDREN = True

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        activation: str = "silu",
        fused: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        acts = {"silu": nn.SiLU(), "gelu": nn.GELU(), "gelu_tanh": nn.GELU(approximate="tanh")}
        if activation not in acts:
            raise ValueError(
                f"slimgrad.nn.GatedMLP: unknown activation; expected one of {tuple(acts)}, got "
                f"{activation!r}. Use 'silu' (SwiGLU), 'gelu' or 'gelu_tanh' (GeGLU)."
            )
        kw = dict(bias=bias, device=device, dtype=dtype)
        if fused:
            self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, **kw)
        else:
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
            self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)
        act_name = "activation_fn" if fused else "act_fn"
        self.add_module(act_name, acts[activation])
        self._roles = (
            ("gate_up_proj", None, "down_proj", act_name)
            if fused
            else ("gate_proj", "up_proj", "down_proj", act_name)
        )
        self.activation, self.fused = activation, fused

    @classmethod
    def from_hf(
        cls, module: nn.Module, roles: tuple[str, str | None, str, str], activation: str
    ) -> GatedMLP:
        """A GatedMLP holding ``module``'s own submodules, parameters and buffers (no copy, the
        same ``state_dict``), its plain attributes and training mode.

        Args:
            module: the HF MLP.
            roles: the attribute names of (gate, up, down, activation); up None for a fused
                ``gate_up`` projection (gate rows first).
            activation: what ``module``'s activation computes (:func:`activation_of`).
        """
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for k, v in vars(module).items():
            if not k.startswith("_") and k != "training":
                setattr(new, k, v)
        for k, p in module._parameters.items():  # the forward reads none; state_dict keeps them
            new.register_parameter(k, p)
        for k, b in module._buffers.items():
            new.register_buffer(k, b, persistent=k not in module._non_persistent_buffers_set)
        for k, m in module._modules.items():
            new.add_module(k, m)
        new._roles = tuple(roles)
        new.activation, new.fused = activation, roles[1] is None
        new.train(module.training)
        return new

    #: True: the lean op (``act(g) * u`` recomputed in backward from the kept g and u) wherever
    #: it can run, also where its backward peaks above eager's (the peak rule's eager ops keep
    #: act(g) and the product): ``slimgrad.plan``'s ``lean+recompute:mlp-activation`` sets it
    #: (NOTE [The MLP's activation, recomputed] in slimgrad/plan.py)
    recompute_activation = False

    # the shapes (x, gate weight, down weight) of the last straight call and whether the lean
    # backward wins there (NOTE [The gated MLP's peak against eager's] in ops/gated_mlp.py):
    # decided once per shape, read as one tuple compare
    _lean_key = None
    _lean = True

    # NOTE [The gated MLP's general-path decision, once per facts]
    # Off the straight path (autocast, biases, mixed dtypes, fused) the lean-or-eager decision
    # (NOTE [The gated MLP's peak against eager's], in bytes under autocast) reads shapes,
    # dtypes, x's leafness, autocast's state and each weight's gradient flags, through several
    # Python calls (the byte comparison under autocast among them) on every call. It is decided
    # once per tuple of those facts and read back as one tuple compare, as the straight path's
    # ``_lean_key``; under torch.compile it is decided in the trace and nothing is stored
    # (tests/nn/test_gated_mlp_decide_once.py).
    _general_key = None
    _general_lean = True

    def _general_lean_of(self, x, gate, up, down, gw, gb, dw, db, d) -> bool:
        i = gw.shape[0] // 2 if self.fused else gw.shape[0]
        # the op's backward runs straight without biases in one dtype (a FakeTensor too)
        path = (
            "fused"
            if self.fused
            else "general"
            if gb is not None
            or db is not None
            or _params(up)[1] is not None
            or _any_autocast()
            or not x.dtype == gw.dtype == dw.dtype == _params(up)[0].dtype
            else "straight"
        )
        sizes = _autocast_sizes(x, gate, up, down) if path == "general" else None
        if sizes is not None:  # NOTE [The gated MLP's peak under autocast]
            path = "autocast"
        return lean_wins(x.numel() // d, d, i, dw.shape[0], path, sizes)

    def _eager(self, x, gate, up, down, act):
        if self.fused:
            g, u = gate(x).chunk(2, dim=-1)
            return down(u * act(g))
        return down(act(gate(x)) * up(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g_name, u_name, d_name, a_name = self._roles
        mods = self._modules  # what getattr finds for a submodule, without Module.__getattr__
        if g_name in mods and d_name in mods and a_name in mods and (u_name in mods or not u_name):
            gate, down, act = mods[g_name], mods[d_name], mods[a_name]
            up = mods[u_name] if u_name is not None else None
        else:
            gate, down, act = getattr(self, g_name), getattr(self, d_name), getattr(self, a_name)
            up = getattr(self, u_name) if u_name is not None else None
        a = self.activation
        t = type(act)
        if t in _SILUS:  # activation_of(act) == a for torch's and slimgrad's SiLU, inline
            act_ok = a == "silu" and "forward" not in act.__dict__
        elif t in _GELUS:  # and GELU
            ap = act.approximate
            act_ok = (
                a == ("gelu" if ap == "none" else "gelu_tanh" if ap == "tanh" else None)
                and "forward" not in act.__dict__
            )
        else:
            act_ok = activation_of(act) == a
        if (
            not _grad_on()
            or _functorch_on()
            or not act_ok
            # _hooked(act) and _global_hooks() only when some hook dict is not empty
            or (
                (act._forward_hooks or act._forward_pre_hooks)
                or (act._backward_hooks or act._backward_pre_hooks)
            )
            and _hooked(act)
            or (
                (_module._global_forward_hooks or _module._global_forward_pre_hooks)
                or (_module._global_backward_hooks or _module._global_backward_pre_hooks)
            )
            and _global_hooks()
        ):
            return self._eager(x, gate, up, down, act)
        lin = _LINEARS
        if (  # gated_mlp's straight path for plain Linears without biases, its frames inline
            # (_plain_linear and _params of each projection; NOTE [Linear's straight path])
            up is not None
            and type(gate) in lin
            and type(up) in lin
            and type(down) in lin
            and "weight" in (gp := gate._parameters)
            and "weight" in (up_ := up._parameters)
            and "weight" in (dp := down._parameters)
            and type(gw := gp["weight"]) is _Parameter
            and type(uw := up_["weight"]) is _Parameter
            and type(dw := dp["weight"]) is _Parameter
            and "bias" in gp
            and "bias" in up_
            and "bias" in dp
            and gp["bias"] is None
            and up_["bias"] is None
            and dp["bias"] is None
            and "forward" not in gate.__dict__
            and "forward" not in up.__dict__
            and "forward" not in down.__dict__
            and not (
                gate._forward_hooks
                or gate._forward_pre_hooks
                or gate._backward_hooks
                or gate._backward_pre_hooks
                or up._forward_hooks
                or up._forward_pre_hooks
                or up._backward_hooks
                or up._backward_pre_hooks
                or down._forward_hooks
                or down._forward_pre_hooks
                or down._backward_hooks
                or down._backward_pre_hooks
            )
            and gw.ndim == 2
            and uw.ndim == 2
            and dw.ndim == 2
            and type(x) in _PLAIN
            and (xs := x.shape)
            and xs[-1] == gw.shape[1]
            and xs[-1] == uw.shape[1]
            and (x.requires_grad or gw.requires_grad or uw.requires_grad or dw.requires_grad)
            and not (_compiling() or _is_tracing() or _any_autocast())
        ):
            if (key := (xs, gw.shape, dw.shape)) != self._lean_key:  # a new shape: decide it
                d = xs[-1]
                n = x.numel() // d if d else 0
                self.__dict__["_lean_key"] = key  # plain attributes, no Module.__setattr__
                self.__dict__["_lean"] = lean_wins(n, d, gw.shape[0], dw.shape[0])
            # NOTE [The gated MLP's peak against eager's] in ops/gated_mlp.py
            if not self._lean and not self.recompute_activation:
                # plain bias-free Linears without hooks: eager's ops on their weights, directly
                # (eager's bits and bytes, without the converted submodules' per-call cost)
                return _eager_ops(x, gw, None, uw, None, dw, None, a, False)
            # NOTE [The down product after the saves] in ops/gated_mlp.py (_later_list, inline)
            later = [] if _top_hooks(False) is not None and later_ok() else None
            y = _GATED_MLP_APPLY(
                unwrap_if_dead(x), gw, None, uw, None, dw, None, None, None, None, None, a, False,
                later,
            )  # fmt: skip
            return y if later is None else _down_after(y, later)
        if x.is_meta:  # NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py
            return self._eager(x, gate, up, down, act)
        plain_down = _plain_linear(down)
        if plain_down and _plain_linear(gate) and (up is None or _plain_linear(up)):
            (gw, gb), (dw, db) = _params(gate), _params(down)
            d = x.shape[-1] if x.ndim else 0  # NOTE [The gated MLP's peak against eager's]
            if d and gw.ndim == 2 and dw.ndim == 2:
                if _compiling():  # traced: decided in the trace, nothing stored
                    lean = self._general_lean_of(x, gate, up, down, gw, gb, dw, db, d)
                else:  # NOTE [The gated MLP's general-path decision, once per facts]
                    uw, ub = _params(up) if up is not None else (None, None)
                    key = (
                        x.shape, x.dtype, x.grad_fn is None, _autocast_key(x),
                        gw.shape, gw.dtype, gw.requires_grad, gw.grad_fn is None, gb is None,
                        dw.shape, dw.dtype, dw.requires_grad, dw.grad_fn is None, db is None,
                        None if uw is None else (uw.dtype, uw.requires_grad, uw.grad_fn is None),
                        ub is None,
                    )  # fmt: skip
                    if key != self._general_key:
                        self.__dict__["_general_key"] = key  # no Module.__setattr__
                        self.__dict__["_general_lean"] = self._general_lean_of(
                            x, gate, up, down, gw, gb, dw, db, d
                        )
                    lean = self.__dict__["_general_lean"]
                if not self.recompute_activation and not lean:
                    if _any_autocast():
                        _tokens_first(x, gw, gb, up, dw, db)
                    if self.fused:  # eager's ops (act computes ``a``: checked above)
                        g, u = gate(x).chunk(2, dim=-1)
                        return down(u * _act(g, a))
                    return self._eager(x, gate, up, down, act)
            if self.fused:
                return gated_mlp_fused(x, gw, dw, gb, db, a)
            uw, ub = _params(up)
            return gated_mlp(x, gw, uw, dw, gb, ub, db, a)
        if self.fused:  # the projections that are not plain Linears are called
            g, u = gate(x).chunk(2, dim=-1)
        else:
            g, u = gate(x), up(x)
        if plain_down:
            return glu_linear(g, u, down.weight, down.bias, a)
        return down(glu(g, u, a))

    # a fresh product through the down projection, on every path (NOTE [A replacement states
    # its structure] in slimgrad/convert_handlers/inplace_guard.py)
    _slimgrad_output_statement = (forward, lambda m: (None, m._roles[2]))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, fused={self.fused}"
