"""Shared helpers of the activation modules (see ``slimgrad.ops._output_act``)."""

from __future__ import annotations

import contextvars
import operator

import torch
from torch.nn.modules.lazy import LazyModuleMixin


def hf_name(module: torch.nn.Module) -> str | None:
    """Class name of a HF ``transformers.activations`` module, else None (no transformers
    import)."""
    cls = type(module)
    return cls.__name__ if cls.__module__.startswith("transformers.") else None


def type_error(api: str, expected: str, module: object) -> TypeError:
    return TypeError(
        f"slimgrad.nn.{api}.from_torch: unsupported module; expected {expected}, got "
        f"{type(module).__name__}. Convert only modules of the listed types."
    )


# NOTE [Keep y only where its consumer keeps it]
# SiLU, GELU, Mish, ELU and Hardswish keep y + side information (branch bits, a sparse table)
# where eager keeps x (NOTE [Gradient from the output] in slimgrad/ops/_output_act.py). That wins
# when y's consumer keeps y too (a Linear or convolution saves its input: y is then kept once, for
# both) and costs the side information above eager's bytes when nothing does (the loss keeps
# another tensor, a Dropout keeps its mask). Which holds is a fact of the model's structure, read
# once at ``convert_`` time by :func:`state_consumers_` and stored on the module as ``keep_y``.
# Three answers, from the module's call sites:
#   - kept: y goes straight to a Linear, convolution or HF Conv1D whose weight requires grad
#     (through ``nn.Identity`` / ``Dropout(p=0)`` children only, no hooks on the way); a Linear
#     or an attention's query only where y is viewed as a matrix (NOTE [A Linear keeps y itself
#     only where y is viewed as a matrix]);
#   - not kept: y is the model's output, or goes to a frozen one of those, or to another module of
#     ``torch.nn`` / ``slimgrad.nn`` (a Dropout with p > 0, a norm, a pool);
#   - unknown: anything else (an op of the forward's own code, ``h * 3``, ``h + r``, a sum; a
#     forward that cannot be traced; hooks on the way).
# The call site is read where the structure is written down:
#   - an ``nn.Sequential``: the next child; after its last child, what follows the Sequential in
#     its own parent, recursively; a Sequential consumer by its first child;
#   - a forward slimgrad knows by its qualified name (``_DECLARED``, the class's own method, no
#     instance override): HF GPT2MLP (act -> c_proj), timm Mlp (act -> drop1 -> norm -> fc2), HF
#     BertIntermediate (act -> the module's output), BertLayer.feed_forward_chunk (intermediate ->
#     output), BertOutput (its input -> dense), DebertaV2Layer (intermediate -> output),
#     AlbertLayer.ff_chunk (activation -> ffn_output), the feed_forward_chunk of BertLayer's
#     copies (RoBERTa, XLM-R, ELECTRA, CamemBERT),
#     OPTDecoderLayer (activation_fn -> fc2), the
#     BART-style encoder and decoder layers (activation_fn -> fc2 where ``activation_dropout`` is
#     0 at ``convert_`` time: ``F.dropout`` returns its input then);
#   - any other forward (its class's, no hooks on the parent), from ``convert_``'s fx trace of it
#     (NOTE [One reading of the structure per convert_] in
#     slimgrad/convert_handlers/inplace_guard.py; one graph for train and eval): the module called
#     once there, and a user of its output that is a child called with it first (through passing
#     children; the forward's output itself: the parent's own consumer), or a product with a
#     trained Linear's or convolution's output (``act(a) * b``: the product keeps y for b's
#     gradient). ViT's, GPT-NeoX's, T5's MLPs (act -> fc2) are read so;
#   - a module the swaps made, from the chain its class states (NOTE [A replacement states its
#     structure] in slimgrad/convert_handlers/inplace_guard.py; it is not traced);
#   - a consumer with its own forward keeps y where its trace hands its first input to a keeper
#     first (DeBERTa-v2's output block: dense);
#   - a module held at several places is kept where every place's consumer keeps its output.
#   A traced forward answers "not kept" where every user of the output is a child (or the
#   forward's output) that answers so, as a Sequential's next child does; a Dropout user is not
#   such an answer there (in eval it hands y itself to the next module, a Linear in BERT's
#   embeddings, and keeping y then saves x's bytes).
#   (The trace and the several places are read for those five activations and for a LayerNorm,
#   whose "unknown" is its own NOTE's below.)
# Only "kept" keeps y (an activation at a consumer that keeps nothing of y would keep y + side
# information where eager keeps x: 0.19 to 0.41 B per element above eager's bytes, and its step
# peaks above eager's by as much); "not kept" and "unknown" turn ``keep_y`` off.
# With ``keep_y`` off the module runs eager's op and keeps what eager keeps (x; in place, eager's
# copy of x: y + the side information would be above it too). A module built directly, not by
# ``convert_``, keeps y (the class's ``keep_y``). Run :func:`state_consumers_`
# again after changing the model's structure; weights frozen after ``convert_`` leave ``keep_y``
# as it was. Separately, a module whose output may be the model's output runs eager's op whatever
# its consumer (the caller may write it: NOTE [Modules whose output is the model's output] in
# slimgrad/convert_handlers/inplace_guard.py); so do the norms and LeakyReLU/Hardtanh/ReLU6 there.

# NOTE [A LayerNorm whose output nobody keeps runs eager's op]
# slimgrad's LayerNorm keeps y where eager keeps x (plus mean and rstd on both sides). Where y's
# consumer keeps y (a Linear) that saves x's bytes; where nothing keeps y it saves nothing at best,
# and costs y's bytes above eager's where x's storage is kept anyway by another op: HF Persimmon's
# q/k norms take views of the fused qkv output, whose value slice the attention keeps, and hand y
# to the rotary embedding and a cat, which keep none of it. With gradient checkpointing the last
# layer's recomputation then held one batch x seq x hidden tensor more than eager's at the step's
# peak (1.020x eager's on a tiny config, 1.030x at hidden 128 / 64 tokens). So a LayerNorm whose
# output is known not to be kept (the "not kept" answer above, or a forward declared with
# ``_NOBODY``, or a traced forward that hands y only to modules that keep none of it: a
# ``MultiheadAttention(batch_first=True)`` on a LayerNorm of the model's input, whose query
# transpose makes the in-projection keep a copy, was 768 B above eager's 8160 saved bytes at
# B2 T6 D16) runs eager's op: eager's bytes and bits, never more. "Unknown" still keeps y (most
# norms hand y to a Linear in a forward no table lists). The trade: where the value slice is
# copied before the attention keeps it (a KV cache's cat, the eager attention's reshape), the q
# and k views keep the whole fused output (3 x hidden) where the two y's were 2 x hidden; that is
# still eager's own cost, never above it. RMSNorm and GroupNorm are left as they were: HF's eager
# RMSNorm keeps more than x, so eager's op is not the floor there.

_OUT = "<output>"  # the child's output is the parent's output
_NOBODY = "<kept by none>"  # the parent's own code uses y and keeps none of it (no child takes it)

#: {(class, method) the call is written in: {child: children y passes through, consumer last; or
#: _OUT}}
_DECLARED: dict[tuple[str, str], dict[str, tuple[str, ...] | str]] = {
    ("transformers.models.gpt2.modeling_gpt2.GPT2MLP", "forward"): {"act": ("c_proj",)},
    ("timm.layers.mlp.Mlp", "forward"): {"act": ("drop1", "norm", "fc2")},
    # BertLayer's copies (their output blocks are read from their traces: dense first)
    **{
        (f"transformers.models.{fam}.modeling_{fam}.{cls}Layer", "feed_forward_chunk"): {
            "intermediate": ("output",)
        }
        for fam, cls in (
            ("roberta", "Roberta"),
            ("xlm_roberta", "XLMRoberta"),
            ("electra", "Electra"),
            ("camembert", "Camembert"),
        )  # fmt: skip
    },
    ("transformers.models.albert.modeling_albert.AlbertLayer", "ff_chunk"): {
        "activation": ("ffn_output",)
    },
    # its forward (attention, output_attentions: no one fx graph) hands the intermediate's
    # output to the output block (whose trace hands it to dense first)
    ("transformers.models.deberta_v2.modeling_deberta_v2.DebertaV2Layer", "forward"): {
        "intermediate": ("output",)
    },
    # its forward (attention, caches: no one fx graph) hands the activation's output to fc2
    ("transformers.models.opt.modeling_opt.OPTDecoderLayer", "forward"): {
        "activation_fn": ("fc2",)
    },
    ("transformers.models.bert.modeling_bert.BertIntermediate", "forward"): {
        "intermediate_act_fn": _OUT
    },
    ("transformers.models.bert.modeling_bert.BertLayer", "feed_forward_chunk"): {
        "intermediate": ("output",)
    },
    # NOTE [A LayerNorm whose output nobody keeps runs eager's op]: the q/k norms' outputs go to
    # the partial rotary embedding (products with cos/sin, which are computed under no_grad) and
    # to torch.cat: nothing keeps them
    ("transformers.models.persimmon.modeling_persimmon.PersimmonAttention", "forward"): {
        "q_layernorm": _NOBODY,
        "k_layernorm": _NOBODY,
    },
}
# act -> F.dropout(p=self.activation_dropout) -> fc2: the dropout returns its input itself at p == 0
# (``_P0``: the consumer is fc2 where the module's ``activation_dropout`` is 0 at convert_ time)
_P0 = "<activation_dropout == 0>"
_DECLARED.update(
    {
        (f"transformers.models.{fam}.modeling_{fam}.{cls}{side}Layer", "forward"): {
            "activation_fn": (_P0, "fc2")
        }
        for fam, cls in (
            ("bart", "Bart"),
            ("mbart", "MBart"),
            ("marian", "Marian"),
            ("pegasus", "Pegasus"),
            ("whisper", "Whisper"),
        )  # fmt: skip
        for side in ("Encoder", "Decoder")
    }
)
# nn.TransformerEncoderLayer / DecoderLayer with norm_first (``_NF``: read only where the
# layer's ``norm_first`` is True at convert_ time): each norm's output is the query of an
# attention block (``_sa_block``, ``_mha_block``) or the input of ``_ff_block``'s linear1 (NOTE [A
# Linear keeps y itself only where y is viewed as a matrix])
_NF = "<norm_first>"
_DECLARED[("torch.nn.modules.transformer.TransformerEncoderLayer", "forward")] = {
    "norm1": (_NF, "self_attn"),
    "norm2": (_NF, "linear1"),
}
_DECLARED[("torch.nn.modules.transformer.TransformerDecoderLayer", "forward")] = {
    "norm1": (_NF, "self_attn"),
    "norm2": (_NF, "multihead_attn"),
    "norm3": (_NF, "linear1"),
}
#: {class: the child its forward hands its (first) input to first}
_ENTRY: dict[str, str] = {"transformers.models.bert.modeling_bert.BertOutput": "dense"}


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _class_forward(m) -> bool:
    # m runs its class's forward: nothing on the instance, or accelerate's wrapper whose hooks hand
    # the arguments on (accelerate_hooks.passes_arguments)
    from slimgrad.convert_handlers import accelerate_hooks

    return "forward" not in m.__dict__ or accelerate_hooks.passes_arguments(m)


def _plain(m) -> bool:
    # its own class's forward (or accelerate's wrapper whose hooks hand the arguments on:
    # accelerate_hooks.passes_arguments), no hooks that could replace its input or output (a lazy
    # module's own initializing pre-hook aside: it fills the parameters in, the input passes)
    pre = m._forward_pre_hooks if isinstance(m, torch.nn.Module) else None
    if pre and isinstance(m, LazyModuleMixin):
        init = getattr(m, "_initialize_hook", None)
        pre = [k for k in pre if init is None or k != init.id]
    return isinstance(m, torch.nn.Module) and not (
        not _class_forward(m)
        or pre
        or m._forward_hooks
        or m._backward_pre_hooks
        or m._backward_hooks
    )


def _passes(m) -> bool:
    # returns its input itself (nn.Identity; a Dropout with p == 0 in train and eval)
    import slimgrad.nn as snn

    if not _plain(m):
        return False
    t = type(m)
    return t is torch.nn.Identity or (t in (torch.nn.Dropout, snn.Dropout) and m.p == 0)


def _sequential(m) -> bool:
    return isinstance(m, torch.nn.Sequential) and type(m).forward is torch.nn.Sequential.forward


def _keepers() -> tuple:
    import slimgrad.nn as snn

    nn = torch.nn
    return (
        nn.Linear,
        snn.Linear,
        nn.Conv1d,
        snn.Conv1d,
        nn.Conv2d,
        snn.Conv2d,
        nn.Conv3d,
        snn.Conv3d,
    )


# NOTE [A BatchNorm consumer keeps y]
# Eager's BatchNorm (``native_batch_norm``'s backward) keeps its input whenever a gradient flows
# through it, train or eval, frozen affine or not: an activation whose output goes straight to one
# (``Sequential(conv, act, bn)``, MobileNetV3's conv -> Hardswish -> BN) costs eager x (its own) and
# y (the norm's). Keeping y there keeps what eager keeps anyway, and the activation's x is saved.
# slimgrad's BatchNorm keeps y too (its input), except in eval with a frozen affine (nothing
# full-size) and in training where a following *AfterNorm activation claims its output (then it
# keeps that output): there the activation keeps x, eager's bytes, read per call (NOTE [Keep y
# only where the producer does not keep x]). Answered "kept" for torch's BatchNorm1d/2d/3d,
# conditionally for slimgrad's (their own forward, no hooks).


# NOTE [A Linear keeps y itself only where y is viewed as a matrix]
# "The consumer keeps y" holds only where it keeps y's own storage. A Linear (``F.linear``) on a
# 2-D input, or on a contiguous one of more dimensions, keeps a view of it; on a 3+-D input that
# cannot be viewed as a matrix (an LSTM's batch_first output, strides (H, B*H, 1); a transpose
# before the activation) it keeps a contiguous copy (``matmul``'s reshape), so y would be kept
# twice: the activation's y + side information where eager's keeps x, and the Linear's copy on
# both sides. LSTM(batch_first) -> SiLU -> Linear at 8x50x64 kept 4.125 B per element above
# eager's bytes (peak +7.7%, Hardswish +10.6%); Conv1d -> transpose -> SiLU -> Linear peaked 17%
# above eager's (Hardswish 33%). So a Linear consumer answers "kept where y is viewed as a matrix"
# (``_FLAT``, a :class:`KeepYWhen` read per call): y has x's layout (an elementwise op keeps a dense
# input's strides), so the activation keeps y where x is contiguous or at most 2-D, else x, as
# eager (one ``is_contiguous`` per call; a non-contiguous input that could still be viewed as a
# matrix keeps x too: eager's bytes). A convolution, a BatchNorm and HF's Conv1D keep their input
# as it is (Conv1D views it or raises, as eager). ``nn.MultiheadAttention``'s in-projection is a
# Linear on its query: with ``batch_first`` it transposes the query first, so it never keeps y
# itself ("not kept": a LayerNorm before it runs eager's op, as does a smooth activation); without
# it, the Linear's rule. TransformerEncoderLayer(batch_first=True, norm_first=True) at B8 T64 D64
# kept one (B, T, D) tensor above eager's (norm1's y, with the attention's copy); a LayerNorm's
# own output is contiguous, so its Linear consumers need no call-time check.


def _batch_norms() -> tuple:
    import slimgrad.nn as snn

    nn = torch.nn
    return (
        nn.BatchNorm1d,
        nn.BatchNorm2d,
        nn.BatchNorm3d,
        snn.BatchNorm1d,
        snn.BatchNorm2d,
        snn.BatchNorm3d,
    )


def _keeps_input(
    m, depth: int = 0, sites: dict | None = None, read=None
) -> bool | KeepYWhen | None:
    # whether m saves the very tensor it is called with for its weight's gradient; None: unknown;
    # with ``sites``, a KeepYWhen for a slimgrad BatchNorm (NOTE [Keep y only where the producer
    # does not keep x])
    import slimgrad.nn as snn

    if m is None or depth > 32 or not _plain(m):
        return None
    t = type(m)
    if isinstance(m, LazyModuleMixin):  # what its first call turns it into (LazyLinear: Linear)
        t = getattr(m, "cls_to_become", None) or t
    name = _name(t)
    if t in _keepers() or isinstance(m, snn.Conv1D) or name == "transformers.pytorch_utils.Conv1D":
        w = m._parameters.get("weight")
        if w is None or not w.requires_grad:
            return False
        # NOTE [A Linear keeps y itself only where y is viewed as a matrix]
        return _FLAT if sites is not None and t in (torch.nn.Linear, snn.Linear) else True
    if t is torch.nn.MultiheadAttention:
        # NOTE [A Linear keeps y itself only where y is viewed as a matrix]: the query's
        # in-projection is a Linear on it, batch_first transposes it first (a copy is kept)
        if m.batch_first:
            return False
        w = m._parameters.get("in_proj_weight" if m._qkv_same_embed_dim else "q_proj_weight")
        if w is None or not w.requires_grad:
            return False
        return _FLAT if sites is not None else True
    if _NORM_Y.get() and _keeps_norm_output(m, t):
        return True  # NOTE [GroupNorm's fallback channels only where y is kept after it]
    if t in _batch_norms():  # NOTE [A BatchNorm consumer keeps y]
        if sites is None or not t.__module__.startswith("slimgrad."):
            return True
        # an *AfterNorm after it claims its output b in training: it keeps b, not its input
        return KeepYWhen(bn=m, claimed=isinstance(_neighbour(m, sites, True), _after_norms()))
    if _sequential(m):
        for c in m._modules.values():
            if c is None or _passes(c):
                continue
            return _keeps_input(c, depth + 1, sites)
        return None
    entry = _ENTRY.get(name)
    if entry is not None and _declared_method(m, "forward", name):
        return _keeps_input(m._modules.get(entry), depth + 1, sites)
    if t.__module__.startswith(("torch.nn.", "slimgrad.nn.")):
        return False  # a library module that is not one of the keepers
    graph = read(m) if read is not None else None
    if graph is not None:  # its trace: the child its first input goes to first
        first = next((n for n in graph.nodes if n.op == "placeholder"), None)
        while first is not None:
            users = list(first.users)
            if len(users) != 1 or users[0].op != "call_module" or users[0].args[:1] != (first,):
                return None
            c = _at(m, users[0].target)
            if not _passes(c):
                r = _keeps_input(c, depth + 1, sites, read)
                # NOTE [A Linear keeps y itself only where y is viewed as a matrix]
                return r if r is True or r is _FLAT else None
            first = users[0]
    return None


# NOTE [GroupNorm's fallback channels only where y is kept after it] (ops/group_norm.py): asked
# about a GroupNorm's output, a module that keeps its input as it is called with it keeps y too:
# eager's activations that keep their input and its pools (out of place), slimgrad's SiLU, GELU
# and Mish (they keep an input that a GroupNorm keeps: NOTE [An input its producer keeps] in
# slimgrad/ops/_output_act.py), and slimgrad's other activations where they run eager's op
# (``keep_y`` False, read after every module's own ``keep_y`` is set)
_NORM_Y: contextvars.ContextVar[bool] = contextvars.ContextVar("_NORM_Y", default=False)


def _keeps_norm_output(m, t) -> bool:
    import slimgrad.nn as snn

    if getattr(m, "inplace", False):
        return False
    if t in _input_keepers() or t in (snn.SiLU, snn.GELU, snn.Mish):
        return True
    eager_when_off = (snn.ELU, snn.Hardswish, snn.LeakyReLU, snn.Hardtanh, snn.ReLU6)
    return t in eager_when_off and m.__dict__.get("keep_y", True) is False


def _input_keepers() -> tuple:
    # torch.nn modules whose autograd node keeps their input (out of place)
    nn = torch.nn
    return (
        nn.SiLU, nn.GELU, nn.Mish, nn.ELU, nn.Hardswish, nn.Hardsigmoid, nn.LeakyReLU,
        nn.Hardtanh, nn.ReLU6, nn.Softplus,
        nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
        nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
        nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
    )  # fmt: skip


def _norm_y_kept(m, sites: dict, read) -> bool:
    # whether a GroupNorm's output is known to be kept by its consumer; a timm GroupNormAct's
    # consumer is its own act (after drop: the chain its class states)
    tok = _NORM_Y.set(True)
    try:
        stated = getattr(type(m), "_slimgrad_output_statement", None)
        if stated is not None and getattr(type(m), "forward", None) is stated[0]:
            for t in stated[1]:
                c = m._modules.get(t)
                if c is None:
                    return False
                if not _passes(c):
                    return _keeps_input(c, 0, None, read) is True
        return _kept_after(m, sites, read=read) is True
    finally:
        _NORM_Y.reset(tok)


def _declared_method(m, method: str, name: str) -> bool:
    # m's class defines ``method`` itself (no subclass or instance override)
    fn = getattr(type(m), method, None)
    return (
        fn is not None
        and method not in m.__dict__
        and f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}"
        == f"{name}.{method}"
    )


def _kept_after(
    child, sites: dict, depth: int = 0, when: bool = False, read=None
) -> bool | KeepYWhen | None:
    # whether what ``child`` returns is kept by the module it is handed to; None: unknown; with
    # ``when``, a KeepYWhen where a slimgrad BatchNorm's mode decides; with ``read`` (module ->
    # its convert-time trace or None), a forward no table lists is read from its trace, and a
    # module held at several places is kept after where every place keeps its output (NOTE [Keep
    # y only where its consumer keeps it])
    where = sites.get(id(child), ())
    if not where:
        return False  # the model's output
    if depth > 32:
        return None
    if len(where) != 1:  # held at several places
        if read is None:
            return None
        flat = False
        for parent, name in where:
            r = _kept_at(child, parent, name, sites, depth, when, read)
            if r is _FLAT:
                flat = True
            elif r is not True:
                return None
        return _FLAT if flat else True
    parent, name = where[0]
    return _kept_at(child, parent, name, sites, depth, when, read)


def _kept_at(child, parent, name, sites, depth, when, read) -> bool | KeepYWhen | None:
    # _kept_after at one place: ``child`` is ``parent``'s child ``name``
    bn_sites = sites if when else None
    if _sequential(parent):
        if not _class_forward(parent):
            return None
        names = [k for k, c in parent._modules.items() if c is not None]
        # this place's (a module held twice has two names)
        return _after_in_chain(parent, names, names.index(name), sites, depth, when, read)
    pname = _name(type(parent))
    for (cls, method), rule in _DECLARED.items():
        if cls == pname and name in rule and _declared_method(parent, method, cls):
            spec = rule[name]
            if spec == _OUT:
                return _kept_after(parent, sites, depth + 1, when, read)
            if spec == _NOBODY:
                return False
            for t in spec:  # the first child that does not pass y on is its consumer
                if t == _P0:
                    if getattr(parent, "activation_dropout", None) != 0:
                        return None
                    continue
                if t == _NF:
                    if getattr(parent, "norm_first", None) is not True:
                        return None
                    continue
                c = parent._modules.get(t)
                if not _passes(c):
                    return _keeps_input(c, 0, bn_sites, read)
            return None
    if read is None or not _plain(parent):
        return None
    stated = getattr(type(parent), "_slimgrad_output_statement", None)
    if stated is not None and getattr(type(parent), "forward", None) is stated[0]:
        # a module the swaps made: the chain its class states (NOTE [A replacement states its
        # structure] in slimgrad/convert_handlers/inplace_guard.py), read as a Sequential's
        chain = stated[1](parent) if callable(stated[1]) else stated[1]
        if name not in chain:
            return None
        return _after_in_chain(parent, chain, chain.index(name), sites, depth, when, read)
    graph = read(parent)
    if graph is None:
        return None
    calls = _calls_of(graph, parent, child)
    if len(calls) != 1:  # called twice (or not at all) in the forward
        return None
    return _used_by(calls[0], parent, sites, depth, when, read)


def _after_in_chain(parent, chain, i, sites, depth, when, read) -> bool | KeepYWhen | None:
    # whether what ``parent``'s child ``chain[i]`` returns is kept, where ``parent`` hands it along
    # ``chain`` (child names in call order): the first child after it that does not pass it on,
    # past the chain's end the parent's own consumer; a None name or a child gone is a value the
    # forward makes afresh (unknown)
    for t in chain[i + 1 :]:
        c = None if t is None else parent._modules.get(t)
        if c is None:
            return None
        if not _passes(c):
            return _keeps_input(c, 0, sites if when else None, read)
    return _kept_after(parent, sites, depth + 1, when, read)


def _calls_of(graph, parent, m) -> list:
    # the nodes of ``parent``'s trace that call its child ``m``
    return [n for n in graph.nodes if n.op == "call_module" and _at(parent, n.target) is m]


def _at(parent, target: str):
    # the module a trace's ``call_module`` target names below ``parent`` (None if gone)
    m = parent
    for part in target.split("."):
        m = m._modules.get(part) if isinstance(m, torch.nn.Module) else None
        if m is None:
            return None
    return m


def _used_by(node, parent, sites, depth, when, read) -> bool | KeepYWhen | None:
    # whether a user of ``node``'s tensor in ``parent``'s trace keeps that very tensor: a child
    # called with it first that keeps its input, through children that pass it on; the parent's
    # output (the tensor itself) asks the parent's own consumer. Any other use keeps nothing
    # known: None (not established) unless another user keeps it; False where every user is a
    # child (or the parent's consumer) known not to keep it, as a Sequential's chain answers
    if depth > 32:
        return None
    found = None
    known_not = bool(node.users)
    for u in node.users:
        r = None
        if u.op == "output":
            if u.args[0] is node:
                r = _kept_after(parent, sites, depth + 1, when, read)
        elif u.op == "call_module" and u.args[:1] == (node,):
            c = _at(parent, u.target)
            if _passes(c):
                r = _used_by(u, parent, sites, depth + 1, when, read)
            elif c is not None:
                r = _keeps_input(c, 0, sites if when else None, read)
        elif u.op == "call_function" and u.target in (operator.mul, torch.mul) and not u.kwargs:
            # a product keeps each factor for the other's gradient: y where the other factor is
            # a trained Linear's or convolution's output (a gated MLP written as act(a) * b)
            if len(u.args) == 2 and node in u.args:
                o = u.args[1] if u.args[0] is node else u.args[0]
                c = None
                if isinstance(o, torch.fx.Node) and o is not node and o.op == "call_module":
                    c = _at(parent, o.target)
                if type(c) in _keepers():
                    w = c._parameters.get("weight")
                    r = (w is not None and w.requires_grad) or None
        if r is True or r is _FLAT:  # a Linear's answer as soon as one is found (as before)
            return r
        if isinstance(r, KeepYWhen) and found is None:
            found = r
        # a Dropout hands y itself on in eval (to a Linear, say): not a known "not kept"
        known_not = known_not and r is False
        if known_not and u.op == "call_module" and _drops(_at(parent, u.target)):
            known_not = False
    return False if known_not else found


def _drops(m) -> bool:
    import slimgrad.nn as snn

    return isinstance(m, (torch.nn.modules.dropout._DropoutNd, snn.Dropout))


# NOTE [Keep y only where the producer does not keep x]
# A smooth activation keeps y + side information so that x need not be kept; where x is the output
# of a module that keeps its own output anyway (ReLU, Sigmoid, Tanh: eager's and slimgrad's keep
# y), keeping x costs nothing and keeping y costs the side information above eager's bytes
# (``Sequential(conv, ReLU, SiLU, conv)``). So ``state_consumers_`` reads the activation's
# producer from the same structure as its consumer (the child before it in a plain
# ``nn.Sequential``, past ``nn.Identity`` / ``Dropout(p=0)``; before a Sequential's first child,
# what precedes the Sequential; in another forward, the child whose output its trace hands the
# activation) and turns ``keep_y`` off there. A ``ReLUAfterNorm`` keeps its
# output only where it ran eager's op: on a slimgrad BatchNorm's claimed output it keeps b and
# tags its output as derived (NOTE [Derived saved inputs] in slimgrad/ops/_derived.py). Which one
# ran is known at the activation's call, from its input: ``keep_y`` is then a :class:`KeepYWhen`
# that keeps y only for a derived input. The same object carries the condition of NOTE [A
# BatchNorm consumer keeps y] for eval: a slimgrad BatchNorm keeps its input in training and, in
# eval, only where gamma needs a gradient (eval with a frozen affine keeps nothing full-size), so
# an activation whose output goes to one keeps y only while that BatchNorm would keep it: a few
# attribute reads per call. Where the BatchNorm's output goes to an ``*AfterNorm`` activation, in
# training it keeps that output b, not its input (the claim), so nothing of y there.
class KeepYWhen:
    """``keep_y``'s conditional value (NOTE [Keep y only where the producer does not keep x])."""

    __slots__ = ("after_claim", "bn", "claimed", "flat")

    def __init__(
        self,
        after_claim: bool = False,
        bn: torch.nn.Module | None = None,
        claimed: bool = False,
        flat: bool = False,
    ) -> None:
        self.after_claim, self.bn, self.claimed, self.flat = after_claim, bn, claimed, flat

    def __call__(self, x: torch.Tensor) -> bool:
        # NOTE [A Linear keeps y itself only where y is viewed as a matrix]: y has x's layout
        if self.flat and not x.is_contiguous() and x.dim() > 2:
            return False
        if self.after_claim:
            from slimgrad.ops._derived import _DERIVED_D, _is_compiling

            if _is_compiling():  # no derived path under torch.compile: eager's ReLU ran
                return False
            e = _DERIVED_D.get(id(x))
            if e is None or e[0]() is not x:
                return False  # the ReLUAfterNorm ran eager's op: it keeps x
        bn = self.bn
        if bn is None:
            return True
        if bn.training or bn._buffers.get("running_mean") is None:  # batch statistics
            return not self.claimed
        w = bn._parameters.get("weight")
        return w is not None and w.requires_grad


#: a consumer that keeps y itself where y is viewed as a matrix (NOTE [A Linear keeps y itself
#: only where y is viewed as a matrix])
_FLAT = KeepYWhen(flat=True)


def _after_norms() -> tuple:
    from slimgrad.nn import batch_norm as b
    from slimgrad.nn.hardswish import HardswishAfterNorm

    return (
        b.ReLUAfterNorm, b.GELUAfterNorm, b.SiLUAfterNorm, b.LeakyReLUAfterNorm, b.ELUAfterNorm,
        HardswishAfterNorm,
    )  # fmt: skip


def _neighbour(child, sites: dict, after: bool, depth: int = 0):
    # in a plain Sequential, the module child's output is handed to (after: past passing children,
    # into a Sequential's first child; _OUT: the model's output), or the module whose output child
    # is called with (not after: into a Sequential's last child); None: not known (or, not after,
    # the model's input)
    where = sites.get(id(child), ())
    if not where and after:
        return _OUT
    if depth > 32 or len(where) != 1:
        return None
    parent = where[0][0]
    if not _sequential(parent) or not _class_forward(parent):
        return None
    kids = [c for c in parent._modules.values() if c is not None]
    i = kids.index(child)
    for c in kids[i + 1 :] if after else reversed(kids[:i]):
        if _passes(c):
            continue
        while _sequential(c) and _class_forward(c):
            inner = [k for k in c._modules.values() if k is not None and not _passes(k)]
            if not inner:
                return None
            c = inner[0] if after else inner[-1]
        return c
    return _neighbour(parent, sites, after, depth + 1)


def _traced_producer(m, sites: dict, read):
    # the child whose output m is called with in its parent's trace (a forward that is not a
    # plain Sequential's; NOTE [Keep y only where its consumer keeps it]), else None
    where = sites.get(id(m), ())
    if len(where) != 1:
        return None
    parent = where[0][0]
    if _sequential(parent) or not _plain(parent):
        return None
    graph = read(parent)
    if graph is None:
        return None
    calls = _calls_of(graph, parent, m)
    if len(calls) != 1 or not calls[0].args:
        return None
    a = calls[0].args[0]
    if not isinstance(a, torch.fx.Node) or a.op != "call_module":
        return None
    return _at(parent, a.target)


def _keeps_y_when(m, sites: dict, consumer, read=None) -> bool | KeepYWhen:
    # keep_y of a smooth activation m whose consumer's answer is ``consumer`` (not False); with
    # ``read``, its producer in a traced forward too
    import slimgrad.nn as snn

    bn = consumer if isinstance(consumer, KeepYWhen) else None
    p = _neighbour(m, sites, False)
    if p is None and read is not None:
        p = _traced_producer(m, sites, read)
    after_claim = False
    if p is not None and _plain(p):
        t = type(p)
        if t is snn.ReLUAfterNorm:
            after_claim = True
        elif t in (
            torch.nn.ReLU, snn.ReLU, torch.nn.Sigmoid, snn.Sigmoid, torch.nn.Tanh, snn.Tanh,
        ):  # fmt: skip
            return False  # it keeps its output, this module's x
    if not after_claim and (bn is None or bn is _FLAT):
        return True if bn is None else bn  # one object for every reading (tests/_readings.py)
    if bn is None:
        return KeepYWhen(after_claim)
    return KeepYWhen(after_claim, bn.bn, bn.claimed, bn.flat)


def _output_kinds() -> tuple:
    import slimgrad.nn as snn

    # converted modules that keep y where eager keeps x (the smooth activations also keep side
    # information, NOTE above); slimgrad's BatchNorm keeps x unless an activation follows it, and
    # ReLU/Sigmoid/Tanh keep y as eager does
    return (
        snn.LayerNorm, snn.RMSNorm, snn.HFRMSNorm, snn.GroupNorm,
        snn.LeakyReLU, snn.Hardtanh, snn.ReLU6,
    )  # fmt: skip


# NOTE [A kept output at the model's output]
# InPlaceABN (and InPlaceABNSync) keeps its output z for backward where eager's BatchNorm +
# activation keeps x and z, and ReversibleSequential (float mode) keeps its output to rebuild every
# block's input. Where that output may be the model's output, the caller may write it in place
# (autograd's "modified by an inplace operation" where eager trains) or through ``.data`` (wrong
# gradients, silently). Neither has an eager op to fall back on that keeps its savings, so there
# the module returns a copy of what it keeps (``at_output``, set by :func:`state_consumers_` from
# the same reading as the norms'): the kept tensor is never handed out, the gradients are the
# module's own bit for bit, and the cost is one output-sized tensor while the caller holds the
# copy (eager's BatchNorm + activation keeps two). Exact-mode ReversibleSequential keeps its own
# integer stream and hands out only its image: nothing to copy. RecomputeABN keeps no full-size
# tensor (it rebuilds z from the conv's input), so it is left as it is.

#: the reason ``report`` gives for a converted module that runs eager's op at the model's output
AT_OUTPUT = (
    "runs eager's op (keeps its input, as eager): its output may be the model's output, which "
    "the caller may write in place or through .data"
)
#: ... and for a module that returns a copy of its kept output there
COPY_AT_OUTPUT = (
    "returns a copy of its output (one more output-sized tensor): its output may be the model's "
    "output, which the caller may write in place or through .data, and it keeps that output for "
    "backward"
)
#: ... and where the output is not the model's but may be kept on a module past its forward
#: (NOTE [An output kept on the module escapes] in slimgrad/convert_handlers/inplace_guard.py)
KEPT_ON_MODULE = (
    "runs eager's op (keeps its input, as eager): its output may be kept on a module past its "
    "forward (self.<name> = ..., a list or dict there), where the user may write it in place or "
    "through .data"
)
#: ... and for a SiLU, GELU, Mish, ELU or Hardswish whose output its consumer is not known to keep
#: (NOTE [Keep y only where its consumer keeps it])
NOT_KEPT_AFTER = (
    "runs eager's op (keeps its input, as eager): what follows it is not known to keep its output, "
    "so keeping the output and its side bits could cost more than eager"
)
COPY_KEPT_ON_MODULE = (
    "returns a copy of its output (one more output-sized tensor): its output may be kept on a "
    "module past its forward, where the user may write it in place or through .data, and it "
    "keeps that output for backward"
)


# NOTE [Hidden states handed out per call]
# transformers hands a layer's output to the caller when a call asks for it
# (``output_hidden_states=True``: forward hooks on the layers, installed at the first such call,
# collect what each layer returns and its first input, while a context variable of
# ``transformers/utils/output_capturing.py`` holds that call's request). A post-norm layer's output
# is its last norm's y (BERT, RoBERTa, post-norm BART/OPT), which the converted norm keeps for
# backward where eager keeps x: the caller's in-place write raised autograd's error, or through
# ``.data`` changed the gradients silently, where eager (whose consumer may keep nothing of y: a
# frozen next layer) trains. The request is per call, so the decision is too, from two facts:
# ``convert_`` marks each norm whose output may be the output of a module below the root (the
# reading of NOTE [Modules whose output is the model's output], asked per module: ``handed_out``;
# HF models only); at call time such a norm runs eager's op (keeps x, as eager) while that context
# variable holds a request (any output: attentions too, conservatively). Without a request the
# variable is None or empty: one attribute read per marked norm call, nothing per unmarked one.
# A transformers without that variable (outside the declared range) counts as always requesting
# (eager's op, exact). Under a non-reentrant checkpoint's hooks such a norm runs eager's op
# whatever the request: the request is the top-level call's, which the recompute inside backward
# does not run under, so a norm that ran eager's op in a forward that asked for hidden states
# kept y in its recompute and torch raised CheckpointError (BERT or SegFormer with gradient
# checkpointing and output_hidden_states=True, where eager trains). Inside a checkpointed region
# its saved tensors live only during that region's backward, so eager's op there costs little.
# Hidden states a forward collects in its own source (DeBERTa-v2's encoder) are read there: every
# item of the tuple may be returned.

#: transformers' per-call output request (``output_capturing._active_collector``), once found;
#: [] before the first HF model is converted, [None] where transformers has none
_COLLECTOR: list = []


def _find_collector() -> None:
    if _COLLECTOR:
        return
    try:
        from transformers.utils import output_capturing
    except ImportError:
        output_capturing = None
    c = getattr(output_capturing, "_active_collector", None)
    # its ContextVar and the flag of its global (under torch.compile) read as its own get() does,
    # without that method's frame
    known = (
        isinstance(getattr(c, "context_var", None), contextvars.ContextVar)
        and isinstance(getattr(c, "compiling", None), bool)
        and hasattr(c, "global_var")
    )
    _COLLECTOR.append(c if known else None)


def requested() -> bool:
    """Whether the running transformers call asks for outputs beyond its own (NOTE [Hidden states
    handed out per call])."""
    c = _COLLECTOR[0] if _COLLECTOR else None
    if c is None:
        return bool(_COLLECTOR)  # converted an HF model, transformers has no collector: unknown
    return bool(c.global_var if c.compiling else c.context_var.get())


def _reader(traces):
    # module -> its trace (the convert-time reading's, read now where there is none), or None
    # where its forward cannot be traced to one graph for every call
    from slimgrad.convert_handlers.inplace_guard import Traces

    tr = traces if traces is not None else Traces()

    def read(m):
        if traces is not None and not traces.read_before_swaps(m):
            return None  # a module the swaps made is not traced (its class states its chain)
        try:
            return tr.every_call(m, after_swaps=True)
        except Exception:  # fx raises many types on Python it cannot trace
            return None

    return read


def _copy_kinds() -> tuple:
    import slimgrad.nn as snn

    # NOTE [A kept output at the model's output]
    return (snn.InPlaceABN, snn.ReversibleSequential)


def state_consumers_(model: torch.nn.Module, rep=None, *, traces=None) -> int:
    """Set ``keep_y`` on the converted modules of ``model`` that keep their output where eager
    keeps the input: False on a SiLU, GELU, Mish, ELU or Hardswish whose output is not known to be
    kept by its consumer (NOTE [Keep y only where its consumer keeps it]), and on any of those, a
    LayerNorm, RMSNorm, HF RMSNorm, GroupNorm, LeakyReLU, Hardtanh or ReLU6 whose output may be
    the model's output (NOTE [Modules whose output is the model's output] in
    ``slimgrad/convert_handlers/inplace_guard.py``): those run eager's op. ``y_kept_after`` on a
    LayerNorm and a GroupNorm whose consumer keeps their output (NOTE [GroupNorm's fallback
    channels only where y is kept after it] in ``slimgrad/ops/group_norm.py``). ``convert_`` runs
    it.

    Args:
        model: the converted model (in place).
        rep: ``convert_``'s report: the modules at the output are listed in its ``eager_op``
            with ``AT_OUTPUT``.
        traces: ``convert_``'s reading of the model before its swaps
            (``slimgrad.convert_handlers.inplace_guard.Traces``, NOTE [One reading of the structure
            per convert_]); None (a call after changing the model): every forward is read now.

    Returns:
        The number of modules that keep y.
    """
    import slimgrad.nn as snn
    from slimgrad.convert_handlers.inplace_guard import output_modules
    from slimgrad.nn._hooks import watch_

    sites: dict[int, list] = {}
    for parent in model.modules():
        for name, c in parent._modules.items():
            if c is not None:
                sites.setdefault(id(c), []).append((parent, name))
    from slimgrad.nn.inplace_abn import RecomputeABN

    n = 0
    smooth = (snn.SiLU, snn.GELU, snn.Mish, snn.ELU, snn.Hardswish)
    kinds = smooth + _output_kinds()
    copies = _copy_kinds()
    owners: dict[int, list] = {}
    norms: list = []  # the GroupNorms that keep y
    near: dict[int, list] = {}  # NOTE [Hooks registered after convert_ on the modules around]
    kept: set[int] = set()  # NOTE [An output kept on the module escapes] in inplace_guard.py
    if isinstance(model, kinds + copies):
        out = {id(model)}
    else:
        found = output_modules(model, kinds + copies, owners, traces, near, kept)
        out = {id(m) for m in found}
    hf = any(type(m).__module__.startswith("transformers.") for m in model.modules())
    read = _reader(traces)
    if hf:
        _find_collector()
    for m in model.modules():
        # subclasses too (timm's LayerNorm2d, LayerNormAct, GroupNormAct run the parent's forward)
        if isinstance(m, kinds):
            # a LayerNorm too where nothing keeps y: NOTE [A LayerNorm whose output nobody keeps
            # runs eager's op]
            keep = id(m) not in out and (
                (type(m) not in smooth and not isinstance(m, snn.LayerNorm))
                or _kept_after(m, sites, read=read) is not False
            )
            if keep and type(m) in smooth:
                # y only where a consumer is known to keep it (NOTE [Keep y only where its
                # consumer keeps it]); NOTE [Keep y only where the producer does not keep x]
                c = _kept_after(m, sites, when=True, read=read)
                keep = (c is True or isinstance(c, KeepYWhen)) and _keeps_y_when(m, sites, c, read)
            m.__dict__.pop("keep_y", None)
            if keep is not True:
                m.__dict__["keep_y"] = keep
            keep = keep is not False
            watch_(m, near.get(id(m), ()) if keep else ())
            n += keep
            if isinstance(m, snn.LayerNorm):
                # NOTE [Hidden states handed out per call]
                m.__dict__.pop("handed_out", None)
                if keep and hf and id(m) in owners:
                    m.handed_out = True
                # NOTE [LayerNorm's fallback columns only where y is kept after it] in
                # slimgrad/ops/layer_norm.py
                m.__dict__.pop("y_kept_after", None)
                if keep and _kept_after(m, sites) is True:
                    m.y_kept_after = True
            elif isinstance(m, snn.GroupNorm):
                m.__dict__.pop("y_kept_after", None)
                if keep:
                    norms.append(m)
        elif isinstance(m, copies):
            m.__dict__.pop("at_output", None)
            exact = isinstance(m, snn.ReversibleSequential) and m.exact  # keeps its own stream
            if id(m) in out and not isinstance(m, RecomputeABN) and not exact:
                m.at_output = True
    for m in norms:
        # NOTE [GroupNorm's fallback channels only where y is kept after it] in
        # slimgrad/ops/group_norm.py; after the loop: its consumer's keep_y is set
        if _norm_y_kept(m, sites, read):
            m.y_kept_after = True
    if rep is not None:
        reasons = {
            False: (AT_OUTPUT, COPY_AT_OUTPUT),
            True: (KEPT_ON_MODULE, COPY_KEPT_ON_MODULE),
        }
        rep.eager_op[:] = [
            (name or "<root>", type(m).__name__, reasons[id(m) in kept][m.at_output])
            if isinstance(m, copies)
            else (name or "<root>", type(m).__name__, reasons[id(m) in kept][0])
            for name, m in model.named_modules()
            if id(m) in out and (not isinstance(m, copies) or m.at_output)
        ]
        # the smooth activations that run eager's op for their consumer (a KeepYWhen decides
        # per call: it keeps y where its producer does not keep x, not listed)
        rep.eager_op += [
            (name or "<root>", type(m).__name__, NOT_KEPT_AFTER)
            for name, m in model.named_modules()
            if type(m) in smooth and id(m) not in out and m.__dict__.get("keep_y", True) is False
        ]
    return n
