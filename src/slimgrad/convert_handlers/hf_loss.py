"""HF LM-head losses for ``convert_``: a fused, chunked loss where it provably equals HF's forward.

A training forward with ``labels`` (``model.training`` and grad mode on) of a converted causal or
masked LM computes its loss from the hidden states through the chunked fused linear +
cross-entropy (:mod:`slimgrad.ops.linear_cross_entropy`), so the B x T x V logits and
log-probabilities are never materialised. **Its output's ``logits`` is then ``None``**, unless
``ConvertConfig(keep_logits=True)``: then the logits are computed as HF computes them but under
``torch.no_grad()`` (no autograd history, nothing more kept for backward; they cost the B x T x V
buffer and one more head matmul); a loss that differentiates them raises a clear error in
backward rather than silently missing that term's gradient. Every other call (no labels, ``eval()``,
``torch.no_grad()``, ``return_dict=False`` unless ``keep_logits``: a tuple has no slot for a
``None`` logits, ``torch.export``: NOTE [The fused loss under torch.export]) runs the class's own
forward and returns what HF returns, logits included.

NOTE [Fused LM loss by template]
The fused forward is applied only when the class's ``forward`` is, statement for statement, one of
the transformers 5.x templates this module implements: its AST (docstring stripped, annotations
dropped, local names renamed to their order of first assignment) must be

    [output_router_logits = <arg> if <arg> is not None else self.config.output_router_logits]
    out = self.<base>(<the forward's own parameters, by name or position>, **kwargs)
    h = out.last_hidden_state | out[0]
    [h = slice_logits_to_keep(h, logits_to_keep)]                   (causal LMs)
    logits = self.<a>(h) [.contiguous()];  logits = self.<b>(logits) ...      (the head)
    [one logit transform: / self.config.logits_scaling (Granite), * self.logit_scale (Cohere),
     final_logit_softcapping (Gemma2/3)]
    loss = None
    if labels is not None: HF's causal loss (self.loss_function) or CrossEntropyLoss over
        logits.view(-1, V) and labels.view(-1) (BERT, RoBERTa/XLM-R, ELECTRA, DistilBERT)
    [Mixtral's router aux-loss block]
    return <Output>(loss=loss, logits=logits, <key>=out.<key>, ...)

decorated with ``@can_return_tuple`` and only other decorators of ``hf.KNOWN_DECORATORS`` (NOTE
[Decorators that do not change the computation]): the fused call does what ``can_return_tuple``
does and runs behind the forward's own ``@deprecate_kwarg`` layers (HF's decorator, same
arguments), so a keyword renamed by a release reaches it as it reaches HF's body;
and the head must expand (through head modules whose own forward is a chain ``x = f(x)``) into
row-wise modules (Linear, LayerNorm, an elementwise activation) ending in an ``nn.Linear``: the
decoder whose ``h W^T + b`` the fused loss computes. The transform modules are called as they
are; an MLM head calls them on the labelled rows only (row-wise, so the same rows as eager's).
Anything else (a subclass that overrides forward, other head code, another loss term, a head
module with hooks or a patched forward, a LoRA-wrapped head, a custom ``loss_function``,
a float64 causal head (HF's causal loss is float32: ``logits.float()``),
``logits_to_keep`` other than 0, the router aux loss switched on) keeps HF's forward: at convert
time the report names the reason; at call time the class's forward runs. The fused forward is a
picklable callable kept on the instance (no class or function of transformers is rebound), so
``torch.save``/``torch.load``, ``copy.deepcopy`` and ``pickle`` carry it, and it re-checks the
class's forward in the process that calls it.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.nn.modules import module as _torch_module

from slimgrad._autograd import compiling
from slimgrad._compile import exporting
from slimgrad.convert_handlers import accelerate_hooks as _accelerate_hooks
from slimgrad.convert_handlers.decision import Decision
from slimgrad.convert_handlers.hf import CodeReason, forward_decorators, hf_models
from slimgrad.nn._hooks import foreign  # hooks other than slimgrad.memory's observers

__all__ = ["fuse_lm_loss", "lm_loss_pattern"]


def _skip_identity_view(t: torch.Tensor) -> torch.Tensor:
    # HF's base models end with ``ln_f(x).view(output_shape)``, an identity view: feed the loss its
    # base (same shape, strides, storage) so the gradient reaching ln_f is not a view of the
    # loss's dh, and ln_f's backward may reuse it (NOTE [Gradient-buffer ownership]). Not under
    # torch.compile: Dynamo cannot read ``_base`` (a graph break), and no buffer is reused there.
    if compiling():
        return t
    base = t._base
    if (
        base is not None
        and base.shape == t.shape
        and base.stride() == t.stride()
        and base.storage_offset() == t.storage_offset()
        and base.dtype == t.dtype
        and base.requires_grad == t.requires_grad
    ):
        return base
    return t


# ---------------------------------------------------------------------------------------------
# Templates (NOTE [Fused LM loss by template]); canonical local names _v0, _v1, ... in order of
# first assignment, the forward's parameters by their own names.


def _dumps(src: str) -> list[str]:
    return [ast.dump(s) for s in ast.parse(textwrap.dedent(src)).body]


_ROUTER_PRE = _dumps(
    "output_router_logits = (output_router_logits if output_router_logits is not None "
    "else self.config.output_router_logits)"
)
_HIDDEN = {
    _dumps("_v1 = _v0.last_hidden_state")[0]: "attr",
    _dumps("_v1 = _v0[0]")[0]: "index",
}
_SLICE = _dumps("_v1 = slice_logits_to_keep(_v1, logits_to_keep)")[0]
# (name, statements): the logits transform after the head (NOTE [Logit transforms] in the op)
_TRANSFORMS = [
    ("div_config_logits_scaling", _dumps("_v2 = _v2 / self.config.logits_scaling")),
    ("mul_logit_scale", _dumps("_v2 = _v2 * self.logit_scale")),
    (
        "softcap",
        _dumps(
            """
            if self.config.final_logit_softcapping is not None:
                _v2 = _v2 / self.config.final_logit_softcapping
                _v2 = torch.tanh(_v2)
                _v2 = _v2 * self.config.final_logit_softcapping
            """
        ),
    ),
]
_LOSS_NONE = _dumps("_v3 = None")[0]
# (kind, vocab size source, statements)
_LOSSES = [
    (
        "causal",
        "config",
        _dumps(
            """
            if labels is not None:
                _v3 = self.loss_function(logits=_v2, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
            """  # noqa: E501
        ),
    ),
    (
        "causal",
        "config",
        _dumps(
            """
            if labels is not None:
                _v3 = self.loss_function(_v2, labels, vocab_size=self.config.vocab_size, **kwargs)
            """
        ),
    ),
    (
        "causal",
        "self",
        _dumps(
            """
            if labels is not None:
                _v3 = self.loss_function(_v2, labels, self.vocab_size, **kwargs)
            """
        ),
    ),
    (
        "ce_new",
        "config",
        _dumps(
            """
            if labels is not None:
                _v4 = CrossEntropyLoss()
                _v3 = _v4(_v2.view(-1, self.config.vocab_size), labels.view(-1))
            """
        ),
    ),
    (
        "ce_new",
        "config",
        _dumps(
            """
            if labels is not None:
                labels = labels.to(_v2.device)
                _v4 = CrossEntropyLoss()
                _v3 = _v4(_v2.view(-1, self.config.vocab_size), labels.view(-1))
            """
        ),
    ),
    (
        "ce_new_nn",
        "config",
        _dumps(
            """
            if labels is not None:
                _v4 = nn.CrossEntropyLoss()
                _v3 = _v4(_v2.view(-1, self.config.vocab_size), labels.view(-1))
            """
        ),
    ),
    (
        "ce_attr",
        "logits",
        _dumps(
            """
            if labels is not None:
                _v3 = self.mlm_loss_fct(_v2.view(-1, _v2.size(-1)), labels.view(-1))
            """
        ),
    ),
]
# Mixtral (and other MoE LMs written the same way): the aux loss joins the loss only when
# output_router_logits; the fused forward runs only when it is off (aux_loss=None then)
_ROUTER_AUX = _dumps(
    """
    _v4 = None
    if output_router_logits:
        _v4 = load_balancing_loss_func(
            _v0.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask
        )
        if labels is not None:
            _v3 += self.router_aux_loss_coef * _v4.to(_v3.device)
    """
)


class _Spec:
    # what a matched forward does, in plain data
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Renamer(ast.NodeTransformer):
    def __init__(self, params):
        self.params, self.names = params, {}

    def visit_Name(self, node):
        if node.id in self.params:
            return node
        if isinstance(node.ctx, ast.Store) and node.id not in self.names:
            self.names[node.id] = f"_v{len(self.names)}"
        if node.id in self.names:
            return ast.copy_location(ast.Name(self.names[node.id], node.ctx), node)
        return node

    def visit_AnnAssign(self, node):
        if node.value is None:
            return None
        new = ast.Assign(targets=[node.target], value=node.value)
        return self.visit(ast.copy_location(new, node))

    def visit_Expr(self, node):
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return None  # docstrings and string statements
        return self.generic_visit(node)


def _normalised(fn):
    # (body statements, parameter names, decorator names, globals) of a plain function's source
    raw = inspect.unwrap(fn)
    tree = ast.parse(textwrap.dedent(inspect.getsource(raw)))
    fdef = tree.body[0]
    if not isinstance(fdef, ast.FunctionDef):
        raise TypeError("not a function definition")
    a = fdef.args
    params = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    varkw = a.kwarg.arg if a.kwarg else None
    names = set(params) | ({varkw} if varkw else set()) | ({a.vararg.arg} if a.vararg else set())
    ren = _Renamer(names)
    body = [s for s in (ren.visit(s) for s in fdef.body) if s is not None]
    return body, params, varkw, a.vararg is not None, fdef.decorator_list, raw.__globals__


def _self_path(node):
    # self.a.b -> ("a", "b"); anything else -> None
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and parts:
        return tuple(reversed(parts))
    return None


def _base_call(stmt, params, varkw):
    # _v0 = self.<path>(<params by name/position, constants>, **kwargs)
    if not (
        isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and isinstance(stmt.targets[0], ast.Name)
        and stmt.targets[0].id == "_v0"
        and isinstance(stmt.value, ast.Call)
    ):
        return None
    call = stmt.value
    path = _self_path(call.func)
    if path is None:
        return None
    pos = []
    for a in call.args:
        if not (isinstance(a, ast.Name) and a.id in params and a.id != "self"):
            return None
        pos.append(a.id)
    kws, star = [], False
    for k in call.keywords:
        if k.arg is None:
            if not (isinstance(k.value, ast.Name) and k.value.id == varkw) or star:
                return None
            star = True
        elif isinstance(k.value, ast.Name) and k.value.id in params and k.value.id != "self":
            kws.append((k.arg, "param", k.value.id))
        elif isinstance(k.value, ast.Constant):
            kws.append((k.arg, "const", k.value.value))
        else:
            return None
    if not star:
        return None
    return path, tuple(pos), tuple(kws)


def _head_step(stmt, first):
    # _v2 = self.<attr>(_v1 | _v2) [.contiguous()] -> (attr, contiguous)
    if not (
        isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and isinstance(stmt.targets[0], ast.Name)
        and stmt.targets[0].id == "_v2"
    ):
        return None
    call, contiguous = stmt.value, False
    if (
        first
        and isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "contiguous"
        and not call.args
        and not call.keywords
    ):
        call, contiguous = call.func.value, True
    if not (isinstance(call, ast.Call) and len(call.args) == 1 and not call.keywords):
        return None
    path = _self_path(call.func)
    arg = call.args[0]
    if path is None or len(path) != 1:
        return None
    if not (isinstance(arg, ast.Name) and arg.id == ("_v1" if first else "_v2")):
        return None
    return path[0], contiguous


def _return(stmt, names):
    # return Out(loss=_v3, logits=_v2, [aux_loss=_v4], key=_v0.key, ...)
    if not (isinstance(stmt, ast.Return) and isinstance(stmt.value, ast.Call)):
        return None
    call = stmt.value
    if not isinstance(call.func, ast.Name) or call.args:
        return None
    fields = []
    for k in call.keywords:
        v = k.value
        if k.arg is None:
            return None
        if isinstance(v, ast.Name) and v.id in names:
            fields.append((k.arg, names[v.id]))
        elif isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.value.id == "_v0":
            fields.append((k.arg, ("out", v.attr)))
        else:
            return None
    if ("logits", "logits") not in fields or ("loss", "loss") not in fields:
        return None
    return call.func.id, tuple(fields)


def _match(fn):
    # (_Spec, "") when ``fn`` (a class's forward) is a template; else (None, reason)
    try:
        body, params, varkw, varargs, decos, g = _normalised(fn)
    except (OSError, TypeError, SyntaxError, IndexError) as e:
        return None, f"forward's source is not available ({type(e).__name__})"
    decorators, why = forward_decorators(fn, decos, g)
    if decorators is None:
        return None, why
    kinds = [d.kind for d in decorators]
    if kinds.count("return_tuple") != 1:
        return None, "forward is not a known LM template (expected @can_return_tuple once)"
    # the converted forward: the fused call behind the forward's own @deprecate_kwarg layers
    entry = _after_renames
    for d in reversed(decorators):
        if d.kind == "rename_kwarg":
            entry = d.apply(entry)
    if "labels" not in params or varkw is None or varargs or params[0] != "self":
        return None, "forward's signature is not a template's (labels, **kwargs)"
    unknown = "forward is not a known LM template (other head code or loss terms)"
    i, n = 0, len(body)
    d = [ast.dump(s) for s in body]
    router = d[:1] == _ROUTER_PRE
    if router:
        if "output_router_logits" not in params:
            return None, unknown
        i += 1
    base = _base_call(body[i], params, varkw) if i < n else None
    if base is None:
        return None, unknown
    i += 1
    hidden = _HIDDEN.get(d[i]) if i < n else None
    if hidden is None:
        return None, unknown
    i += 1
    sliced = i < n and d[i] == _SLICE
    if sliced:
        from transformers.modeling_utils import slice_logits_to_keep

        if "logits_to_keep" not in params or g.get("slice_logits_to_keep") is not (
            slice_logits_to_keep
        ):
            return None, unknown
        i += 1
    head = []
    contiguous = False
    while i < n:
        step = _head_step(body[i], not head)
        if step is None:
            break
        head.append(step[0])
        contiguous = contiguous or step[1]
        i += 1
    if not head:
        return None, unknown
    transform = None
    for tname, stmts in _TRANSFORMS:
        if d[i : i + len(stmts)] == stmts:
            transform = tname
            i += len(stmts)
            break
    if transform == "softcap" and g.get("torch") is not torch:
        return None, unknown
    if i >= n or d[i] != _LOSS_NONE:
        return None, unknown
    i += 1
    loss = None
    for kind, vocab, stmts in _LOSSES:
        if d[i : i + len(stmts)] == stmts:
            loss, vocab_from = kind, vocab
            i += len(stmts)
            break
    if loss is None:
        return None, "forward's loss is not HF's causal-LM loss or a plain CrossEntropyLoss"
    if loss == "ce_new" and g.get("CrossEntropyLoss") is not nn.CrossEntropyLoss:
        return None, unknown
    if loss == "ce_new_nn" and g.get("nn") is not nn:
        return None, unknown
    causal = loss == "causal"
    if causal != sliced or (not causal and (transform or contiguous)):
        return None, unknown
    names = {"_v3": "loss", "_v2": "logits"}
    if router:
        if d[i : i + len(_ROUTER_AUX)] != _ROUTER_AUX:
            return None, "forward adds a router aux loss in a form slimgrad does not know"
        i += len(_ROUTER_AUX)
        names["_v4"] = "aux"
    ret = _return(body[i], names) if i == n - 1 else None
    if ret is None:
        return None, unknown
    out_cls = g.get(ret[0])
    from transformers.utils import ModelOutput

    if not (isinstance(out_cls, type) and issubclass(out_cls, ModelOutput)):
        return None, unknown
    return (
        _Spec(
            causal=causal,
            router=router,
            base=base,
            hidden=hidden,
            head=tuple(head),
            transform=transform,
            loss=loss,
            vocab_from=vocab_from,
            out=ret,
            varkw=varkw,
            signature=inspect.signature(inspect.unwrap(fn)),
            binds={},
            globals=g,
            entry=None if entry is _after_renames else entry,
        ),
        "",
    )


def _chain(fn):
    # a head module's forward ``x = self.a(x); x = self.b(x); ...; return x`` (or functions of
    # its module's globals): [("attr", a) | ("global", name), ...]; None if it is anything else
    try:
        body, params, varkw, varargs, decos, g = _normalised(fn)
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    if decos or varargs or len(params) != 2 or params[0] != "self" or not body:
        return None
    cur, steps = params[1], []
    for s in body[:-1]:
        if not (
            isinstance(s, ast.Assign)
            and len(s.targets) == 1
            and isinstance(s.targets[0], ast.Name)
            and isinstance(s.value, ast.Call)
            and len(s.value.args) == 1
            and not s.value.keywords
            and isinstance(s.value.args[0], ast.Name)
            and s.value.args[0].id == cur
        ):
            return None
        f = s.value.func
        path = _self_path(f)
        if path is not None and len(path) == 1:
            steps.append(("attr", path[0]))
        elif isinstance(f, ast.Name) and f.id not in params:
            steps.append(("global", g.get(f.id)))
        else:
            return None
        cur = s.targets[0].id
    last = body[-1]
    if not (isinstance(last, ast.Return) and isinstance(last.value, ast.Name)):
        return None
    if last.value.id != cur or not steps:
        return None
    return steps


_CACHE: dict = {}


def _cached(fn, how):
    key = (fn, how)
    if key not in _CACHE:
        _CACHE[key] = _match(fn) if how == "forward" else _chain(fn)
    return _CACHE[key]


# NOTE [The spec is a constant under torch.compile]
# A spec depends only on the forward function it was read from (``_CACHE``'s key) and, once made,
# never changes. Traced, every spec field the call reads was guarded element by element (the
# base call's keyword table, the output fields, the binding plan: 91 of the tiny HF Llama's 920
# guards, checked on every compiled call). So the call reads those fields from ``_layout(fn)``
# and its binding from ``_plan(fn, ...)``, two functions marked as having a constant result, as
# ``slimgrad._library.straight`` is: Dynamo calls them at trace time, outside the trace, and
# guards on their code and on the code of the forward ``fn`` (the class's ``forward``: a new
# function after a class is patched), not on what they return. What they return is plain data
# only (str, int, float, bool, None and tuples of them): Dynamo cannot wrap a class or a function
# from a constant's result (the output class is read from ``spec.globals``, traced and guarded).
# A layout or a default with anything else falls back to the traced read of the spec. The module
# facts a call depends on (its head, hooks, config, ``loss_function``) are read in the trace and
# guarded as before.
_LAYOUT_FIELDS = (
    "causal", "router", "base", "hidden", "head", "transform", "loss", "vocab_from", "out", "varkw",
)  # fmt: skip
_LAYOUTS: dict = {}


def _literal(v) -> bool:
    if v is None or type(v) in (str, int, float, bool):
        return True
    return type(v) is tuple and all(_literal(e) for e in v)


class _Layout:
    # a spec's plain-data fields (NOTE [The spec is a constant under torch.compile])
    def __init__(self, spec) -> None:
        for f in _LAYOUT_FIELDS:
            setattr(self, f, getattr(spec, f))


def _layout(fn):
    # the plain-data fields of the forward ``fn``'s spec (a _Layout), or None
    if fn not in _LAYOUTS:
        spec = _cached(fn, "forward")[0]
        ok = spec is not None and all(_literal(getattr(spec, f)) for f in _LAYOUT_FIELDS)
        _LAYOUTS[fn] = _Layout(spec) if ok else None
    return _LAYOUTS[fn]


_layout._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _plan(fn, nargs, names):
    # _binding for the forward ``fn``'s spec (NOTE [The spec is a constant under torch.compile])
    return _binding(_cached(fn, "forward")[0], nargs, names)


_plan._dynamo_marked_constant = True  # type: ignore[attr-defined]


_ROWWISE_TORCH = (nn.Linear, nn.LayerNorm, nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Identity)
_ROWWISE_SLIMGRAD = {"Linear", "LayerNorm", "GELU", "ReLU", "SiLU", "Tanh", "Sigmoid", "Mish"}


# NOTE [The fused loss under accelerate's hooks]
# A ``device_map`` model (``dispatch_model``) carries accelerate's hook on the LM itself and on
# every module with weights (NOTE [A replacement carries accelerate's hook] in
# convert_handlers/accelerate_hooks.py). The fused forward goes where the class's forward was
# under the LM's hook (``_old_forward``): the hook moves the arguments and the output as before.
# It calls the base model and the head's transform as modules (their hooks run, an offloading
# one loading and unloading its module's weights as in eager) but reads the decoder's weight
# without calling it, skipping its hook: exact only where that hook moves nothing. So it is
# fused where every hook in the model is one the table carries, all run on one and the same
# execution device (every activation arrives there), and no hook of the head's modules, the
# containers on the way to the decoder included (``_flatten`` asks ``_plain`` of each), offloads
# (their hooks move nothing then: their weights and inputs are on that device, each move a
# ``.to`` of a tensor already on it), read at ``convert_``; elsewhere HF's forward stays and the
# report says why. An offloading hook on the LM itself that places its submodules loads the
# head's weights around the LM's call, inside which the fused forward runs.


def _plain(m) -> str:
    # why calling (or not calling) ``m`` could differ from eager's ``m(x)``; "" when it cannot
    if not isinstance(m, nn.Module):
        return f"{type(m).__name__} is not a module"
    if "forward" in m.__dict__ and not _accelerate_hooks.moves_only(m):
        if _accelerate_hooks.carries(m):  # NOTE [The fused loss under accelerate's hooks]
            return (
                f"the head's {type(m).__name__} is offloaded by an accelerate hook, which loads "
                "its weights only around its own call; expected a head whose weights stay on "
                "its execution device, got an offloaded one"
            )
        return f"{type(m).__name__} has a patched forward"
    hooks = (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)
    glob = _global_hooks()
    if not any(hooks) and not any(glob):  # no hook at all (every call): nothing foreign
        return ""
    if any(foreign(h) for h in hooks) or any(foreign(h) for h in glob):
        return f"{type(m).__name__} has hooks"
    return ""


def _global_hooks():
    _m = _torch_module
    return (
        _m._global_forward_hooks,
        _m._global_forward_pre_hooks,
        _m._global_backward_hooks,
        _m._global_backward_pre_hooks,
    )


def _is_linear(m) -> bool:
    import slimgrad.nn as snn

    return type(m) in (nn.Linear, snn.Linear) and m.weight.ndim == 2


def _rowwise(m) -> bool:
    t = type(m)
    if t in _ROWWISE_TORCH:
        return True
    if t.__module__ == "transformers.activations":
        return True  # elementwise activations
    return t.__module__.startswith("slimgrad.nn.") and t.__name__ in _ROWWISE_SLIMGRAD


def _flatten(owner, steps, depth=0):
    # the head as [row-wise module, ...]: containers expanded through their chain forward
    out = []
    for kind, ref in steps:
        if kind == "attr":
            m = getattr(owner, ref, None)
        else:
            m = ref
        why = _plain(m)
        if why:
            return None, why
        if _rowwise(m):
            out.append(m)
            continue
        sub = _cached(type(m).forward, "chain") if depth < 8 else None
        if sub is None:
            return None, CodeReason(
                f"head module {type(m).__name__}'s forward is not a known chain"
            )
        got, why = _flatten(m, sub, depth + 1)
        if got is None:
            return None, why
        out += got
    return out, ""


def _head(model, spec):
    # (transform modules, decoder Linear) of the instance now, or (None, reason)
    mods, why = _flatten(model, [("attr", a) for a in spec.head])
    if mods is None:
        return None, why
    if not mods or not _is_linear(mods[-1]):
        return None, "the head does not end in an nn.Linear (e.g. a LoRA-wrapped head)"
    return (mods[:-1], mods[-1]), ""


def _transform_of(model, spec):
    # (logit_scale, logit_softcap) of the instance now
    if spec.transform == "div_config_logits_scaling":
        return 1.0 / float(model.config.logits_scaling), None
    if spec.transform == "mul_logit_scale":
        return float(model.logit_scale), None
    if spec.transform == "softcap":
        cap = model.config.final_logit_softcapping
        return 1.0, None if cap is None else float(cap)
    return 1.0, None


def _eager_logits(model, spec, transform, decoder, h):
    # the logits as HF computes them (same modules and operations), for keep_logits
    for m in transform:
        h = m(h)
    z = torch.nn.functional.linear(h, decoder.weight, decoder.bias)
    if spec.transform == "div_config_logits_scaling":
        z = z / model.config.logits_scaling
    elif spec.transform == "mul_logit_scale":
        z = z * model.logit_scale
    elif spec.transform == "softcap" and model.config.final_logit_softcapping is not None:
        c = model.config.final_logit_softcapping
        z = torch.tanh(z / c) * c
    return z


class _LogitsWithoutGradient(torch.autograd.Function):
    # keep_logits: the logits computed under no_grad, handed back as a tensor that requires grad
    # (through ``anchor``, the hidden states) so that a loss built on them fails loudly in
    # backward instead of silently missing that term's gradient. Saves nothing.
    @staticmethod
    def forward(ctx, logits, anchor):
        return logits

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            "slimgrad.ConvertConfig.keep_logits: a loss used the logits of a converted LM's "
            "training forward; expected only out.loss to be differentiated, got a gradient for "
            "the logits, which the fused loss computes without autograd history. Compute that "
            "term from a forward of the unconverted model, or convert with "
            "ConvertConfig(fused_loss=False) so the logits carry their gradient."
        )


class _Arg:
    # stands for the call's argument at a position (int) or keyword (str) in _binding
    __slots__ = ("key",)

    def __init__(self, key):
        self.key = key


def _binding(spec, nargs, names):
    # How the forward's parameters take a call with ``nargs`` positional arguments (self
    # included) and keywords ``names`` (in call order): ((parameter, how, what), ...) as
    # Signature.bind + apply_defaults would bind them (``how``: _FROM_ARG / _FROM_KW, from the
    # call at position / keyword ``what``; _VARKW, the **kwargs of keywords ``what``; _DEFAULT, the
    # default ``what``; _DEFAULT_OF, the signature's default of parameter ``what``, one that is
    # not plain data), or None when bind refuses the call. Binding depends on the call's shape
    # only, never on its values, so it is bound once per shape (with stand-ins) and kept on the
    # spec.
    # Traced, this runs outside the trace through _plan (NOTE [The spec is a constant under
    # torch.compile]): the table's contents are never guarded.
    key = (nargs, names)
    plan = spec.binds.get(key, _UNBOUND)
    if plan is _UNBOUND:
        try:
            ba = spec.signature.bind(*map(_Arg, range(nargs)), **{k: _Arg(k) for k in names})
        except TypeError:
            plan = None
        else:
            ba.apply_defaults()
            plan = tuple(
                (p, _VARKW, tuple(v))
                if p == spec.varkw
                else (p, _FROM_ARG if type(v.key) is int else _FROM_KW, v.key)
                if isinstance(v, _Arg)
                else (p, _DEFAULT, v)
                if _literal(v)
                else (p, _DEFAULT_OF, p)  # read from the signature in _bound
                for p, v in ba.arguments.items()
            )
        spec.binds[key] = plan
    return plan


_UNBOUND = object()
_FROM_ARG, _FROM_KW, _VARKW, _DEFAULT, _DEFAULT_OF = 0, 1, 2, 3, 4  # a plan is plain data


def _bound(plan, args, kw, spec):
    # the call's arguments by parameter name, as ``Signature.bind(...).arguments`` after
    # apply_defaults (``args`` with self first)
    out = {}
    for p, how, what in plan:
        if how == _FROM_KW:
            out[p] = kw[what]
        elif how == _FROM_ARG:
            out[p] = args[what]
        elif how == _VARKW:
            out[p] = {k: kw[k] for k in what}
        elif how == _DEFAULT:
            out[p] = what
        else:
            out[p] = spec.signature.parameters[what].default
    return out


def _why_not_now(model, spec, a, dec):
    # a reason the fused forward cannot run for this call ("" when it can), before any work;
    # ``a``: the call's arguments by parameter name (_bound)
    if not isinstance(a.get("labels"), torch.Tensor):
        return "no labels"
    if a["labels"].is_meta or dec.weight.is_meta:
        return "meta tensors"  # NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py
    if spec.vocab_from != "logits":
        vocab = model.config.vocab_size if spec.vocab_from == "config" else model.vocab_size
        if dec.weight.shape[0] != vocab:
            return "head size is not the vocabulary size"  # HF's view(-1, V) decides
    if spec.router:
        ori = a.get("output_router_logits")
        if ori if ori is not None else model.config.output_router_logits:
            return "router aux loss on"
    if spec.causal:
        if _loss_function(model) is not _for_causal_lm_loss():
            return "custom loss_function"
        if dec.weight.dtype == torch.float64:
            return "float64 head"  # HF's loss takes logits.float(): a float32 loss

        keep = a.get("logits_to_keep", 0)
        if isinstance(keep, bool) or not isinstance(keep, int) or keep != 0:
            return "logits_to_keep"
    elif spec.loss == "ce_attr":
        fn = getattr(model, "mlm_loss_fct", None)
        if type(fn) is not nn.CrossEntropyLoss or fn.weight is not None or fn.reduction == "none":
            return "loss module is not a plain CrossEntropyLoss"
    return ""


_HF_CAUSAL_LOSS: list = []  # transformers' ForCausalLMLoss, imported at convert_


def _for_causal_lm_loss():
    if not _HF_CAUSAL_LOSS:
        from transformers.loss.loss_utils import ForCausalLMLoss

        _HF_CAUSAL_LOSS.append(ForCausalLMLoss)
    return _HF_CAUSAL_LOSS[0]


_UNSET = object()


def _loss_function(model):
    # ``model.loss_function``. While Dynamo traces, HF's own property (PreTrainedModel's, the one
    # most classes inherit; transformers 5.23-5.24) is read as its body reads it, without its
    # ``logger.warning_once`` for an unset ``loss_type`` (GPT-2's default): Dynamo cannot trace a
    # logger call, and the property read there is a graph break of every compiled step
    # (tests/test_compile_graph_breaks.py). Other classes' properties, and the uncompiled call,
    # read ``model.loss_function`` itself.
    if compiling():
        mu = _hf_loss_property(type(model))
        if mu is not None:
            fn = getattr(model, "_loss_function", _UNSET)  # the property's hasattr
            if fn is not _UNSET:
                return fn
            loss_type = getattr(model, "loss_type", None)
            if loss_type is None or loss_type not in mu.LOSS_MAPPING:
                loss_type = "ForCausalLM"
            return mu.LOSS_MAPPING[loss_type]
    return model.loss_function


_LOSS_PROPERTY: dict = {}  # class -> transformers.modeling_utils when its loss_function is HF's


def _hf_loss_property(cls):
    # decided once per class, outside any trace: at convert_ (_FusedLMForward.__init__)
    if cls not in _LOSS_PROPERTY:
        import transformers.modeling_utils as mu

        own = inspect.getattr_static(cls, "loss_function", None)
        _LOSS_PROPERTY[cls] = (
            mu if own is mu.PreTrainedModel.__dict__.get("loss_function") else None
        )
    return _LOSS_PROPERTY[cls]


def _after_renames(self, *args, **kwargs):
    # the fused call behind HF's own @deprecate_kwarg decorators (NOTE [Decorators that do not
    # change the computation]); named ``forward`` with a ``self`` so that HF's messages name
    # ``<Class>.forward`` as they do for the class's forward
    fused = self.__dict__["forward"]
    if not isinstance(fused, _FusedLMForward):  # NOTE [The fused loss under accelerate's hooks]
        fused = self.__dict__["_old_forward"]
    spec, _ = _cached(type(self).forward, "forward")
    return fused._call(spec, args, kwargs)


_after_renames.__name__ = _after_renames.__qualname__ = "forward"


# NOTE [The fused loss under torch.export]
# ``torch.export`` traces forward only: the exported program keeps nothing for a backward, so the
# fused loss would save nothing there, and its training output (``logits=None``) would make the
# exported program's outputs differ from the exported eager model's. While exporting
# (``slimgrad._compile.exporting()``, strict and non-strict alike) the fused forward runs the
# class's forward: the exported graph is the eager model's, with the converted modules' ops inside,
# and its outputs are the exported eager model's, logits included (tests/test_compile_export.py).
# Non-strict export reads the top module's ``forward.__code__`` before it traces (for the names
# in its shape environment's messages); the fused forward, like slimgrad's other instance
# forwards (``decision.InstanceForward``), answers with the code of the class's forward, the
# object the same read gives for the model before ``convert_``.
class _FusedLMForward:
    """The instance's ``forward`` after ``convert_``: HF's own, or the fused loss where exact.

    See NOTE [Fused LM loss by template]. Kept on the instance as a plain picklable object.
    """

    def __init__(self, model: nn.Module, fast: bool, keep_logits: bool) -> None:
        self.model, self.fast, self.keep_logits = model, fast, keep_logits
        _hf_loss_property(type(model))  # decided here, never while Dynamo traces
        _for_causal_lm_loss()  # imported here: a table the traced call filled failed its guard

    @property
    def __signature__(self):
        return inspect.signature(type(self.model).forward.__get__(self.model))

    @property
    def __code__(self):
        # NOTE [The fused loss under torch.export]: what non-strict export reads
        return type(self.model).forward.__code__

    def __call__(self, *args, **kwargs):
        model = self.model
        cls_forward = type(model).forward
        if not (model.training and torch.is_grad_enabled()) or exporting():
            # nothing to save memory for (NOTE [The fused loss under torch.export])
            return cls_forward(model, *args, **kwargs)
        spec, _ = _cached(cls_forward, "forward")
        if spec is None:
            return cls_forward(model, *args, **kwargs)
        if spec.entry is not None:  # the forward's @deprecate_kwarg layers first, as HF's
            return spec.entry(model, *args, **kwargs)
        return self._call(spec, args, kwargs)

    def _call(self, spec, args, kwargs):
        model = self.model
        cls_forward = type(model).forward
        # as @can_return_tuple: return_dict from the call, else the config
        kw = dict(kwargs)
        return_dict = model.config.return_dict if hasattr(model, "config") else True
        passed = kw.pop("return_dict", return_dict)
        if passed is not None:
            return_dict = passed
        if not return_dict and not self.keep_logits:
            # a tuple drops None fields: without logits every later field would move one slot
            # left (``loss, logits = out[:2]`` would read the next field), so HF's forward runs
            return cls_forward(model, *args, **kwargs)
        plan = _plan(cls_forward, len(args) + 1, tuple(kw))  # _binding, a constant traced
        if plan is None:
            return cls_forward(model, *args, **kwargs)  # HF raises its own error
        a = _bound(plan, (model, *args), kw, spec)
        lay = _layout(cls_forward) or spec  # a constant traced (NOTE [The spec is a constant...])
        head, _ = _head(model, lay)
        if head is None or _why_not_now(model, lay, a, head[1]):
            return cls_forward(model, *args, **kwargs)
        out = self._fused(model, lay, a, head, spec.globals[lay.out[0]])
        if not return_dict and not isinstance(out, tuple):
            out = out.to_tuple()
        return out

    def _fused(self, model, spec, a, head, out_cls):
        # spec: the spec or its _Layout; out_cls: the output class it names
        from slimgrad.ops.linear_cross_entropy import causal_lm_loss, linear_cross_entropy

        extra = dict(a.pop(spec.varkw, {}))
        labels = a["labels"]
        if spec.router:
            ori = a["output_router_logits"]
            a["output_router_logits"] = (
                ori if ori is not None else model.config.output_router_logits
            )
        path, pos, kws = spec.base
        base = model
        for p in path:
            base = getattr(base, p)
        call_kw = {k: (a[v] if how == "param" else v) for k, how, v in kws}
        outputs = base(*[a[p] for p in pos], **call_kw, **extra)
        hidden = outputs.last_hidden_state if spec.hidden == "attr" else outputs[0]
        transform, dec = head
        scale, cap = _transform_of(model, spec)
        logits = None
        if self.keep_logits:
            with torch.no_grad():  # documented: no history, nothing kept for backward
                logits = _eager_logits(model, spec, transform, dec, hidden)
            if hidden.requires_grad:
                logits = _LogitsWithoutGradient.apply(logits, hidden)
        if spec.causal:
            h = _skip_identity_view(hidden)
            for m in transform:
                h = m(h)
            loss = causal_lm_loss(
                h,
                dec.weight,
                labels,
                dec.bias,
                ignore_index=extra.get("ignore_index", -100),
                num_items_in_batch=extra.get("num_items_in_batch"),
                shift_labels=extra.get("shift_labels"),
                precompute_grads=self.fast,
                logit_scale=scale,
                logit_softcap=cap,
            )
        else:
            ignore, smoothing, reduction = -100, 0.0, "mean"
            if spec.loss == "ce_attr":
                fn = model.mlm_loss_fct
                ignore, smoothing, reduction = fn.ignore_index, fn.label_smoothing, fn.reduction
            t = labels.to(hidden.device).reshape(-1)
            flat = hidden.reshape(-1, hidden.shape[-1])
            if not is_fake(t):
                # only labelled rows reach the (row-wise) head: the loss is over them only, as
                # eager's; the other rows would contribute 0 and are not counted
                keep = t != ignore
                flat, t = flat[keep], t[keep]
            # (slimgrad.memory.estimate, fake labels: which rows are labelled is data; all rows
            # are an upper bound)
            for m in transform:
                flat = m(flat)
            loss = linear_cross_entropy(
                flat,
                dec.weight,
                t,
                dec.bias,
                ignore_index=ignore,
                label_smoothing=smoothing,
                reduction=reduction,
            )
        vals = {"loss": loss, "logits": logits, "aux": None}
        fields_kw = {
            k: (vals[v] if isinstance(v, str) else getattr(outputs, v[1])) for k, v in spec.out[1]
        }
        return out_cls(**fields_kw)


def _fused_loss_reason(model: nn.Module, keep_logits: bool) -> tuple[bool, str | None]:
    # fuse_lm_loss's decision, changing nothing: (True, what it does) / (False, why not or None)
    if isinstance(model.__dict__.get("forward"), _FusedLMForward) or isinstance(
        model.__dict__.get("_old_forward"), _FusedLMForward
    ):
        return False, None  # already converted
    get_out = getattr(model, "get_output_embeddings", None)
    try:
        out_emb = get_out() if callable(get_out) else None
    except (AttributeError, NotImplementedError, TypeError):
        out_emb = None
    if out_emb is None:
        return False, None  # not an LM: nothing to say
    if _accelerate_hooks.patched(model):
        return False, "the instance's forward is patched; kept as it is"
    if "forward" in model.__dict__ and (why := _accelerate_hooks.one_device_reason(model)):
        # NOTE [The fused loss under accelerate's hooks]
        return False, f"{why}; HF's forward kept (the fused loss reads the head's weight)"
    spec, why = _cached(type(model).forward, "forward")
    if spec is None:
        return False, CodeReason(f"{why}; HF's forward kept")
    if spec.router and getattr(model.config, "output_router_logits", False):
        return False, (
            "config.output_router_logits=True adds the router aux loss to the loss; HF's forward "
            "kept"
        )
    head, why = _head(model, spec)
    if head is None:
        return False, type(why)(f"{why}; HF's forward kept")  # a CodeReason stays one
    extra = {
        None: "",
        "div_config_logits_scaling": " and logits / config.logits_scaling",
        "mul_logit_scale": " and logits * logit_scale",
        "softcap": " and config.final_logit_softcapping",
    }[spec.transform]
    if spec.causal:
        what = f"causal-LM loss fused with the LM head{extra} (chunked; training logits: "
    else:
        what = (
            "masked-LM loss on labelled positions only, fused with the decoder (training logits: "
        )
    what += "kept, detached)" if keep_logits else "None)"
    return True, what


def _fuse_now(model: nn.Module, fast: bool, keep_logits: bool) -> list:
    model._slimgrad_fast_loss = fast
    # NOTE [The fused loss under accelerate's hooks]
    _accelerate_hooks.set_forward(model, _FusedLMForward(model, fast, keep_logits))
    return []


def fuse_lm_loss(
    model: nn.Module, fast: bool = False, keep_logits: bool = False
) -> tuple[bool, str | None]:
    """Put the fused-loss forward on an HF LM instance where it is exact (NOTE [Fused LM loss by
    template]).

    Args:
        model: an HF ``PreTrainedModel`` instance.
        fast: precompute the head's gradients in forward (``ConvertConfig.fast_loss``).
        keep_logits: a training forward with labels also returns the (detached) logits
            (``ConvertConfig.keep_logits``).

    Returns:
        ``(True, what was done)``; ``(False, why not)`` for an LM whose forward or head is not
        one the fused loss implements exactly; ``(False, None)`` for a model that is no LM or is
        already converted.
    """
    ok, what = _fused_loss_reason(model, keep_logits)
    if ok:
        _fuse_now(model, fast, keep_logits)
    return ok, what


def lm_loss_pattern(model: nn.Module, config, allowed, found) -> list[Decision]:
    """``convert_`` pattern (technique ``fused_loss``): fused LM-head losses where exact.

    Returns the decisions, one per outermost HF LM: a ``patch`` that puts the fused-loss forward
    on the instance, or why its forward stays HF's.
    """
    out: list[Decision] = []
    fast, keep = config.fast_loss, config.keep_logits
    for name, m in hf_models(model):
        if not allowed(m, name):
            continue
        ok, what = _fused_loss_reason(m, keep)
        kind = f"{type(m).__name__}.forward"
        if ok:
            out.append(Decision(
                name, None, None, m, kind=kind, to=what,
                patch=lambda m=m: _fuse_now(m, fast, keep),
            ))  # fmt: skip
        elif what is not None:
            out.append(Decision(
                name, None, None, m, kind=kind, reason=f"fused loss: {what}",
                refusal=("fused_loss", what),
            ))  # fmt: skip
    return out
