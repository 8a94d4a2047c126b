"""Autograd plumbing shared by every slimgrad Function: double backward, torch.func, TorchScript.

# NOTE [Second derivatives]
A slimgrad Function's backward computes first derivatives from what it kept, often not the input
(an activation keeps its output and 1 bit; a norm keeps its output and row statistics). Under
``create_graph=True`` (WGAN-GP penalties, Hessian-vector products, MAML) autograd differentiates
that backward again. torch's ``once_differentiable`` then returns gradients with no history when
the incoming gradient needs none, so ``autograd.grad(..., allow_unused=True)`` silently answers
None where eager answers a tensor. slimgrad's rule: a second derivative is either eager's, or a
clear error, never a silent None.

:func:`first_order` replaces ``once_differentiable`` on every backward:

- without ``create_graph`` it calls the backward as is (``slimgrad.ownership`` knows this chain
  by the wrapper's code object and has a refcount baseline for it, like autograd's own and
  ``once_differentiable``'s);
- with ``create_graph`` and a ``double`` implementation, that runs instead: it computes the first
  derivatives with differentiable torch ops from the saved tensors (an op that keeps its inputs
  recomputes eager's forward and differentiates it), so autograd gets eager's second derivatives;
- with ``create_graph`` and no ``double``, the first derivatives are computed as usual (their
  values are right) and tied to :class:`_SecondOrderRefused` nodes whose inputs are everything the
  backward read that requires grad (saved tensors, incoming gradients). Differentiating them
  raises a ``slimgrad.<op>`` error naming the op and the fix; when nothing they read requires grad
  the result has no history, as eager's has none.

# NOTE [torch.func transforms]
``torch.func`` (grad, vmap, jacrev, functional_call under them) needs ``setup_context`` and vmap
rules on every autograd Function, and wraps tensors in functorch wrappers that slimgrad's
ownership proofs and C kernels cannot see through. slimgrad ops therefore call eager's op while a
transform is active (:func:`transforms_active`): the same function and gradients, eager's memory.

# NOTE [Meta tensors take eager's op]
A meta tensor has a shape, strides and a dtype but no values and no bytes (deferred init, shape
inference, accelerate's ``init_empty_weights`` models run before their weights load). What a
slimgrad op saves instead of eager's inputs is bytes a meta tensor does not have
(``slimgrad.memory`` counts a meta tensor as 0 B), and several ops decide from what meta lacks:
values (BatchNorm's bad channels, ELU's tail table, Hardswish's and the smooth activations' side
tables, whose sizes depend on the data) or an autocast state (torch has none for the meta device:
``torch.is_autocast_enabled("meta")`` raises, and eager's ops on meta are never cast). So such an
op whose input is a meta tensor calls eager's op with the same arguments: eager's output (shape,
strides, dtype) and eager's backward on meta. The test reads the input's ``is_meta`` where the op
leaves its straight path (those gates take non-meta tensors only: NOTE [One gate per call] in
slimgrad/_library.py) or next to its other tests for eager's op (BatchNorm's plain path), and
before any autocast query (conv asks only under some autocast); an attribute read, no call. Ops
whose Functions read no values (linear, conv, the monotone activations, dropout) keep running on
meta outside autocast, with eager's layouts. A FakeTensor is not meta (its device is the one it
stands for): ``slimgrad.memory``'s estimate still runs slimgrad's ops. tests/test_meta_device.py
runs the converted module types and the general paths of the ops on meta, in training and eval,
against eager's output and gradient layouts.

# NOTE [In-place Functions under torch.compile]
torch 2.13's AOTAutograd loses the backward of an autograd.Function that writes a *graph input*
in place (``ctx.mark_dirty``): it runs the forward without grad, records the write as an input
mutation under no_grad, and the compiled backward passes the incoming gradient through unchanged.
A slimgrad in-place activation (``relu_``, ``leaky_relu_``, ``sigmoid_``, ``tanh_``, ``elu_``,
``hardtanh_``, ``relu6_``, ``hardswish_``, ``inplace=True``) on the first tensor of a compiled
region (after a graph break, or a compiled submodule's input) gave wrong gradients without any
error (aot_eager and inductor; eager Dynamo is right). While Dynamo traces, those ops therefore
call torch's own in-place op (:func:`eager_op`); memory under torch.compile is the compiler's
anyway. tests/test_compile_inplace.py checks every in-place op on a graph input against eager.

# NOTE [Forward-mode AD is refused]
A slimgrad Function's backward works from what it kept, and it has no forward-mode rule (``jvp``):
torch's default for an autograd Function without one raises its generic "You must implement the
jvp function for custom autograd.Function to use it with forward mode AD", which names neither
the op nor a fix. Under ``torch.func.jvp`` (and the other transforms) the ops already run eager's
op (NOTE [torch.func transforms]); forward-mode AD with dual tensors
(``torch.autograd.forward_ad``) reaches the Functions themselves. :func:`refuse_forward_ad` gives
every slimgrad Function defined so far (walked once through ``type.__subclasses__`` from
``torch.autograd.Function``, skipping any that defines its own ``jvp``) a ``jvp`` that raises the
``slimgrad.<op>`` error with the ``ConvertConfig`` switch that leaves the op to torch (while
torch.compile traces, the attribute reads as torch's default ``jvp``: Dynamo refuses to trace a
Function with a custom one, so a plain override broke every compiled graph at every op). Only
forward AD calls ``jvp``: nothing runs on the normal path. ``slimgrad/__init__.py`` calls it after
its imports, and each module that defines Functions but is imported later (only when converting
some models) calls it at its end; it is idempotent. The refusal is raised while forward AD
handles the op's output, after its forward ran: nothing was written but the output.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable

import torch

__all__ = [
    "CTX_FIELDS",
    "compiling",
    "direct_apply",
    "eager_op",
    "first_order",
    "refuse_forward_ad",
    "refuse_jit",
    "FxProxy",
    "FxTraceError",
    "refuse_second_order",
    "tie_refusal",
    "transforms_active",
    "unwrap_if_dead",
]


class _SecondOrderRefused(torch.autograd.Function):
    """Identity on a first derivative; differentiating it raises (NOTE [Second derivatives])."""

    @staticmethod
    def forward(ctx, op: str, fix: str | None, grad: torch.Tensor, *deps: torch.Tensor):
        ctx.op = op
        ctx.fix = fix
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, *args):
        fix = ctx.fix or (
            "leave this module unconverted (convert_(model, filter_fn=...)) or call the torch op "
            "for double backward"
        )
        raise RuntimeError(
            f"slimgrad.{ctx.op}: a second derivative through this op was requested "
            "(backward with create_graph=True, then differentiated again); expected first "
            "derivatives only, got a double backward. slimgrad keeps only what first derivatives "
            f"need: {fix}."
        )


def _deps(ctx, grads: tuple) -> list[torch.Tensor]:
    try:
        saved = list(ctx.saved_tensors)
    except RuntimeError:  # already freed or consumed: nothing more to tie to
        saved = []
    return [t for t in (*saved, *grads) if isinstance(t, torch.Tensor) and t.requires_grad]


def tie_refusal(
    op: str, grad: torch.Tensor, *deps: torch.Tensor, fix: str | None = None
) -> torch.Tensor:
    """``grad`` itself (as a view) whose derivative with respect to ``deps`` raises the
    ``slimgrad.<op>`` second-derivative error (NOTE [Second derivatives]). For a backward that
    ties its results by hand, e.g. to anchors of its inputs when nothing it saved has history.
    ``fix``: the error's how-to-fix sentence where the generic one (leave the module
    unconverted) is not the best advice."""
    return _SecondOrderRefused.apply(op, fix, grad, *deps)


def refuse_second_order(op: str, backward: Callable, ctx, grads: tuple, fix: str | None = None):
    """Run ``backward(ctx, *grads)`` without grad and tie each floating result to everything it
    read that has history (saved tensors, ``grads``) through :func:`tie_refusal`: the first
    derivatives are right, differentiating them raises. For a ``double=`` that only sometimes
    has eager's second derivatives (NOTE [Second derivatives]). ``fix``: as for
    :func:`tie_refusal`."""
    # grad mode is on here (create_graph): ownership.take refuses, so nothing is overwritten, and
    # this extra call would hold one more reference anyway.
    deps = _deps(ctx, grads)
    with torch.no_grad():
        out = backward(ctx, *grads)
    if not deps:
        return out
    single = not isinstance(out, tuple)
    outs = (out,) if single else out
    tied = tuple(
        tie_refusal(op, o, *deps, fix=fix)
        if isinstance(o, torch.Tensor) and o.is_floating_point()
        else o
        for o in outs
    )
    return tied[0] if single else tied


def first_order(op: str, double: Callable | None = None) -> Callable:
    """Decorate a Function's ``backward`` (under ``@staticmethod``) instead of
    ``once_differentiable`` (NOTE [Second derivatives]).

    Args:
        op: the public name after ``slimgrad.``, e.g. ``"ops.conv"``; errors name it.
        double: ``double(ctx, *grads)``, the backward written with differentiable torch ops,
            used under ``create_graph=True``; None: second derivatives raise a clear error.
    """

    def deco(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def wrapper(ctx, *args):
            if torch.is_grad_enabled():  # autograd turns grad mode on only for create_graph=True
                if double is not None:
                    return double(ctx, *args)
                return refuse_second_order(op, backward, ctx, args)
            return backward(ctx, *args)

        return wrapper

    return deco


# NOTE [Applying a Function without its Python wrapper]
# ``torch.autograd.Function.apply`` is a Python classmethod around the C ``_FunctionBase.apply``:
# for a Function without ``setup_context`` outside torch.func transforms it unwraps dead functorch
# wrappers among the arguments and calls the C apply. The wrapper's Python frames cost about as
# much as the C apply itself on CPU (docs/measurements.md). :func:`direct_apply` gives that call
# without the wrapper's frames. It is for eager only: while Dynamo traces (it recognises
# ``Function.apply``, not the C method) or a transform is active the caller uses ``cls.apply``.


def direct_apply(cls: type) -> Callable:
    """The C ``apply`` of autograd Function ``cls`` (no ``setup_context``), bound to ``cls``: call
    it as ``cls.apply`` with every tensor argument passed through ``unwrap_if_dead``, only when
    neither ``torch.compiler.is_compiling()`` nor :func:`transforms_active` (NOTE [Applying a
    Function without its Python wrapper])."""
    if cls.setup_context is not torch.autograd.function._SingleLevelFunction.setup_context:
        raise RuntimeError(
            f"slimgrad._autograd.direct_apply: {cls.__name__} defines setup_context; expected a "
            "Function with forward(ctx, ...) only, got one whose apply binds default arguments. "
            "Call cls.apply instead; this is a slimgrad bug; please report it."
        )
    return torch._C._FunctionBase.__dict__["apply"].__get__(None, cls)


# NOTE [One-frame compile check]
# ``torch.compiler.is_compiling()`` is two Python frames in eager (it asks
# ``torch.jit.is_scripting()`` first); slimgrad's hot paths ask it several times per op call
# (about 490 calls per tiny GPT-2 step). :func:`compiling` is the same answer in one frame: in
# eager it reads the flag ``is_compiling`` returns (torch.compile holds it True while it traces,
# torch.export sets it); while Dynamo traces, the function is marked as having a constant result
# (what ``torch.compiler.assume_constant_result`` does, without importing Dynamo at slimgrad's
# import), so Dynamo evaluates it once at trace time (True) and installs no guard on the flag,
# exactly as it treats ``is_compiling`` itself. tests/test_autograd.py checks both: one compiled
# frame over several calls, True inside it, False in eager.
_compiler = torch.compiler


def compiling() -> bool:
    """``torch.compiler.is_compiling()`` in one frame (NOTE [One-frame compile check])."""
    return _compiler._is_compiling_flag


compiling._dynamo_marked_constant = True  # type: ignore[attr-defined]


# NOTE [Saving through ctx's fields]
# ``ctx.save_for_backward(*t)``, ``ctx.mark_non_differentiable(*t)`` and
# ``ctx.set_materialize_grads(v)`` are Python methods whose whole work is one assignment to a field
# of torch's C ``_FunctionBase`` (``to_save``, ``non_differentiable``, ``materialize_grads``), which
# the C ``apply`` reads when the forward returns: saved-tensor hooks, version checks and output
# wrapping happen there, not in the methods. A forward on an op's straight path (NOTE [One gate
# per call] in slimgrad/_library.py: eager, not traced) assigns the fields itself, one Python call
# fewer each. While Dynamo traces a forward it intercepts the method calls (not the fields), so
# every other path keeps calling them. :data:`CTX_FIELDS` is whether this torch has the three
# fields (read once at import); without them the straight paths call the methods too.
CTX_FIELDS = all(
    type(torch._C._FunctionBase.__dict__.get(name)).__name__ == "getset_descriptor"
    for name in ("to_save", "non_differentiable", "materialize_grads")
)

#: ``torch._C._functorch.unwrap_if_dead``: what ``Function.apply`` does to each tensor argument.
unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def eager_op(inplace: bool = False) -> bool:
    """True where a slimgrad op must call eager's op instead of its Function: under torch.func
    (NOTE [torch.func transforms]), and for an in-place call while Dynamo traces (NOTE [In-place
    Functions under torch.compile])."""
    return transforms_active() or (inplace and torch.compiler.is_compiling())


def transforms_active() -> bool:
    """True inside ``torch.func`` transforms (grad, vmap, jacrev, ...): slimgrad ops then run
    eager's op (NOTE [torch.func transforms])."""
    return torch._C._are_functorch_transforms_active()


# NOTE [fx symbolic tracing of a converted model]
# ``torch.fx.symbolic_trace`` runs each non-leaf module's forward on ``torch.fx.Proxy`` objects (a
# slimgrad module is not a leaf: fx's default leaves are the ``torch.nn`` namespace). A Proxy is no
# tensor: it cannot go through an autograd Function, and any Python test on it (``if
# x.requires_grad``) raises fx's TraceError. So a slimgrad op reached with a Proxy records eager's
# op (the one it replaces, with the same arguments): the GraphModule computes eager's values and
# keeps what eager keeps, exact. To keep the savings in a traced model, fx-trace the unconverted
# model (its torch.nn modules stay ``call_module`` leaves) and ``convert_`` the GraphModule. The
# test is never on an op's straight path: it sits where the op already rejects a non-tensor
# argument, or in an ``except FxTraceError`` around the op's first test on its input (free on
# Python 3.11+ unless raised). tests/test_fx_jit_refusals.py traces every converted module type.
FxProxy = torch.fx.Proxy
FxTraceError = torch.fx.proxy.TraceError


def refuse_jit(api: str) -> None:
    """Raise a clear error under ``torch.jit.trace`` (its recorded graph would drop slimgrad's
    autograd Functions and their saving)."""
    if torch.jit.is_tracing():
        raise RuntimeError(
            f"slimgrad.{api}: torch.jit.trace cannot record slimgrad's autograd Functions; "
            "expected an eager, torch.compile or torch.export run, got a TorchScript trace. "
            "Trace the unconverted model, or use torch.compile / torch.export on the converted one."
        )


# the ConvertConfig field whose False leaves an op's modules to torch, by the op module's stem
# (NOTE [Forward-mode AD is refused]); ops not listed get the filter_fn fix alone
_TECHNIQUE = {
    **dict.fromkeys(
        ("elu", "gelu", "hardsigmoid", "hardswish", "hardtanh", "leaky_relu", "mish", "relu",
         "sigmoid", "silu", "tanh", "gated_mlp", "gpt2_mlp", "_output_act", "_monotone"),
        "activations",
    ),
    **dict.fromkeys(("layer_norm", "rms_norm", "group_norm"), "norms"),
    **dict.fromkeys(("dropout", "drop_path", "softmax_dropout"), "dropout"),
    **dict.fromkeys(("conv", "linear", "matmul", "linear_scale"), "selective_saving"),
    **dict.fromkeys(("batch_norm", "inplace_abn", "_derived"), "batch_norm"),
    "linear_cross_entropy": "fused_loss",
    "hf_loss": "fused_loss",
}  # fmt: skip


def _forward_ad_message(cls: type) -> str:
    api = getattr(cls, "_slimgrad_api", None)
    if api is None:  # slimgrad.ops.gelu -> ops.gelu
        api = cls.__module__.removeprefix("slimgrad.")
    field = _TECHNIQUE.get(cls.__module__.rpartition(".")[2])
    switch = f"convert with ConvertConfig({field}=False), or " if field else ""
    return (
        f"slimgrad.{api}: forward-mode AD (torch.autograd.forward_ad dual tensors, jvp) is not "
        "supported by the lean op, which keeps only what reverse-mode gradients need; expected "
        "backward() or torch.autograd.grad, got a tangent on an input of its autograd Function "
        f"{cls.__name__}. For forward-mode AD {switch}leave this module unconverted with "
        "convert_(model, filter_fn=...)."
    )


def _refuse_jvp(cls: type, ctx, *tangents):
    raise NotImplementedError(_forward_ad_message(cls))


class _JvpRefusal:
    # a Function's ``jvp`` (NOTE [Forward-mode AD is refused]): the refusal, except while torch
    # compiles, when it is torch's own ``Function.jvp``. Dynamo will not trace a Function whose
    # ``jvp`` is not ``torch.autograd.Function.jvp`` ("Unsupported custom jvp": a graph break on
    # every slimgrad op); it reads the attribute while it compiles, with torch.compiler's
    # compiling flag held (the flag ``compiling`` reads), so it sees torch's default
    def __get__(self, obj, owner):
        if _compiler._is_compiling_flag:
            return torch.autograd.Function.jvp
        return functools.partial(_refuse_jvp, owner)


_JVP_REFUSAL = _JvpRefusal()


def refuse_forward_ad() -> None:
    """Give every slimgrad autograd Function defined so far without a ``jvp`` of its own one that
    raises the ``slimgrad.<op>`` forward-mode AD error (NOTE [Forward-mode AD is refused]).
    Idempotent; costs nothing on calls that do not use forward-mode AD."""
    stack = [torch.autograd.Function]
    while stack:
        c = stack.pop()
        stack.extend(c.__subclasses__())
        if c.__module__.startswith("slimgrad.") and "jvp" not in c.__dict__:
            c.jvp = _JVP_REFUSAL


# NOTE [Backward without autocast]
# A backward called inside an autocast region (``with torch.autocast(...): loss = model(x);
# loss.backward()``, common though torch advises against it) runs every custom Function's backward
# with autocast on. slimgrad's backwards recompute what their forward made and run C kernels and
# ``out=`` products on the tensors they kept: under autocast a recomputed product came back in
# bf16 beside float32 operands ("expected m1 and m2 to have the same dtype" on converted GPT-2,
# BERT, Llama, OPT, ViT), and the attention's dropout C kernel wrote float32 elements over a bf16
# recompute (heap corruption: glibc aborts; a review), where eager runs. So every slimgrad
# Function's backward runs with autocast off, as it runs when the backward is called outside
# autocast (the pattern torch documents, which every row tests): the gradient is that one, bit for
# bit, whatever autocast the caller's backward ran under. (Eager's own backward ops do follow
# autocast there: its gradients then carry bf16 products, a coarser answer than slimgrad's.)
# :func:`backward_without_autocast` installs, on each slimgrad Function, a ``backward`` attribute
# whose read (the engine reads it as it runs the node) answers the Function's own backward, or,
# while autocast is on and nothing compiles, the same backward under ``torch.autocast(device,
# enabled=False)`` for each device type whose autocast is on and the autograd engine runs a
# backward (``torch._C._current_graph_task_id()``, private: without it the backward is left as it
# is). Anywhere else it is the Function's own backward: while torch compiles (Dynamo reads the
# attribute with the compiling flag held) and where Dynamo's guards read it back on a later call
# (a compiled forward under autocast guards on the backward's code: an answer that changed with
# autocast outside a backward recompiled every step; the review). The Functions of
# the modules in ``_AUTOCAST_BLIND`` keep their backward as it is: every op in them is elementwise
# or a reduction over the tensors the forward kept and the incoming gradient (the activations,
# dropout, the norms; none of autocast's casting ops, none recomputed), so autocast changes
# nothing they compute, and the attribute read would cost each of their calls two host calls.
# The wrapper's frame holds one more reference to each incoming gradient; it states the node it
# runs (``AUTOCAST_OFF_RUN``), so ownership keeps its grants there (NOTE [The chain through
# autocast's wrapper] in ownership.py).
_AUTOCAST_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu")
_graph_task = getattr(torch._C, "_current_graph_task_id", None)
_AUTOCAST_BLIND = frozenset(
    f"slimgrad.ops.{m}"
    for m in (
        "_monotone",
        "_output_act",
        "drop_path",
        "dropout",
        "elu",
        "gelu",
        "group_norm",
        "hardsigmoid",
        "hardswish",
        "hardtanh",
        "inplace_abn",
        "layer_norm",
        "leaky_relu",
        "mish",
        "relu",
        "rms_norm",
        "sigmoid",
        "silu",
        "tanh",
    )
)
_any_autocast_on = torch._C._is_any_autocast_enabled


class _AutocastOffRun(threading.local):
    # the node (``ctx``) whose backward :func:`_without_autocast`'s wrapper runs on this thread
    # (the engine runs a node's backward on one thread), None elsewhere: its frame holds one more
    # reference to each incoming gradient, a chain of its own for ``slimgrad.ownership`` (NOTE
    # [Gradient-buffer ownership], term 3)
    node = None


AUTOCAST_OFF_RUN = _AutocastOffRun()


def _without_autocast(fn: Callable) -> Callable:
    def run(*args):
        state = AUTOCAST_OFF_RUN
        outer = state.node
        state.node = args[0] if args else None
        try:
            with contextlib.ExitStack() as stack:
                for dev in _AUTOCAST_TYPES:
                    try:
                        on = torch.is_autocast_enabled(dev)
                    except (RuntimeError, TypeError, ValueError):  # a device type torch lacks
                        continue
                    if on:
                        stack.enter_context(torch.autocast(dev, enabled=False))
                return fn(*args)
        finally:
            state.node = outer

    functools.update_wrapper(run, fn)
    return run


def autocast_free(fn: Callable) -> Callable:
    """``fn(ctx, *grads)`` run with autocast off where autocast is on (NOTE [Backward without
    autocast]); for backwards registered with ``register_autograd``."""
    off = _without_autocast(fn)

    @functools.wraps(fn)
    def backward(*args):
        if _any_autocast_on() and _in_backward():
            return off(*args)
        return fn(*args)

    return backward


class _AutocastFreeBackward:
    # a Function's ``backward`` (NOTE [Backward without autocast])
    __slots__ = ("fn", "off")

    def __init__(self, fn: Callable) -> None:
        self.fn, self.off = fn, _without_autocast(fn)

    def __get__(self, obj, owner):
        if _any_autocast_on() and _in_backward():
            return self.off
        return self.fn


def _in_backward() -> bool:
    # the autograd engine runs a backward, nothing compiles (NOTE [Backward without autocast])
    return _graph_task is not None and _graph_task() != -1 and not _compiler._is_compiling_flag


def backward_without_autocast() -> None:
    """Make every slimgrad autograd Function defined so far run its backward with autocast off
    (NOTE [Backward without autocast]). Idempotent."""
    stack = [torch.autograd.Function]
    while stack:
        c = stack.pop()
        stack.extend(c.__subclasses__())
        if not c.__module__.startswith("slimgrad.") or "backward" not in c.__dict__:
            continue
        if c.__module__ in _AUTOCAST_BLIND:
            continue
        b = c.__dict__["backward"]
        if isinstance(b, _AutocastFreeBackward):
            continue
        c.backward = _AutocastFreeBackward(b.__func__ if isinstance(b, staticmethod) else b)
