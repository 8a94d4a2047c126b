"""Registration of slimgrad's custom ops with ``torch.library``.

# NOTE [Custom ops and the memory tracker]
Every slimgrad op that torch.compile must trace is registered as ``slimgrad::<name>`` through
:func:`custom_op` below, which also records the op's Python implementation. ``slimgrad.memory``'s
dispatch mode sees a custom op as one call; to account exactly for the temporaries the op allocates
inside, the tracker runs the recorded Python implementation itself, with the mode still active,
instead of the opaque kernel. Hence the rule: a slimgrad kernel that is plain PyTorch goes through
this wrapper, never ``torch.library`` directly.

# NOTE [Calling a custom op eagerly]
Going through torch's custom-op dispatcher costs tens of microseconds of Python per call (schema
parsing of the arguments, the Python dispatcher, the ADInplaceOrView and autograd kernels that
torch registers for every custom op), on the host's time: on a GPU that is what a training step
waits for. :func:`custom_op` therefore returns a :class:`SlimOp`, which calls the recorded Python
implementation directly when nothing could tell the difference, i.e. all of:

- not under torch.compile / Dynamo, ``torch.jit.trace`` or a ``torch.func`` transform;
- no ``TorchDispatchMode`` (FakeTensorMode, export's proxy and functional modes, the memory
  tracker, ``slimgrad.testing.count_host_syncs``) and no ``TorchFunctionMode`` active;
- every tensor argument a plain ``torch.Tensor`` / ``nn.Parameter`` (no subclass: FakeTensor,
  FunctionalTensor, DTensor, ...), not on the meta device, and none requiring grad while grad
  mode is on (the registered op's autograd kernel then decides).

Otherwise it calls the registered op, so tracers, export and the tracker see one
``slimgrad::<name>`` call as before. What the dispatcher does and the direct call must do too: an
op registered with ``mutates_args`` gets the version counters of those arguments bumped after
the call (a Triton kernel's raw write is invisible to autograd; a torch in-place op inside the
implementation bumps them as well, and bumping twice is harmless). What it does not do: the
Python implementation runs with autograd's dispatch keys enabled, but grad mode is off or no
argument requires grad (above), so nothing is recorded. Under ``torch.profiler`` the direct call
is wrapped in ``record_function("slimgrad::<name>")``, so profiles still name the op.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import torch

from slimgrad import _ext
from slimgrad._autograd import compiling

NAMESPACE = "slimgrad"
_PYTHON_IMPLS: dict[str, Callable] = {}

_C = torch._C
_compiler = torch.compiler
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_PLAIN = (_Tensor, _Parameter)
_is_compiling = compiling  # NOTE [One-frame compile check] in slimgrad/_autograd.py
_dispatch_stack_len = _C._len_torch_dispatch_stack
_function_mode_on = _C._is_torch_function_mode_enabled
_functorch_on = _C._are_functorch_transforms_active
_is_tracing = _C._is_tracing
_grad_on = _C.is_grad_enabled
_bump = _C._increment_version
_profiling = _C._autograd._profiler_enabled


def _plain(a, grad: bool) -> bool:
    # a tensor argument the direct call may take (NOTE [Calling a custom op eagerly]); other
    # values are fine, lists/tuples are looked into (Tensor[] arguments)
    t = type(a)
    if t in _PLAIN:
        return not (a.is_meta or (grad and a.requires_grad))
    if t is list or t is tuple:
        return all(_plain(e, grad) for e in a)
    return not isinstance(a, _Tensor)


def straight() -> bool:
    """Whether nothing but eager PyTorch is watching: not compiling (read first: Dynamo folds it
    and traces nothing else here), no ``TorchDispatchMode`` (FakeTensorMode and the memory
    tracker included) or ``TorchFunctionMode``, no ``torch.func`` transform, no TorchScript
    trace, no profiler (NOTE [One gate per call]). Two calls once slimgrad's C++ extension is
    loaded, six without it (NOTE [One-call gate]).

    # NOTE [One gate per call]
    An op's public function that passes this gate, on arguments it has checked are plain
    tensors (``type(t) in (Tensor, Parameter)``, not meta), may take its straight path for the
    whole call: its autograd Function through the C apply (NOTE [Applying a Function without
    its Python wrapper] in slimgrad/_autograd.py), and the Python implementations of its custom
    ops through ``SlimOp.impl`` instead of :meth:`SlimOp.__call__`, which would ask
    :func:`direct_call_ok` again per custom op (inside a Function's forward grad mode is off, so
    the one condition of NOTE [Calling a custom op eagerly] not checked here holds). Nothing can
    change these facts between the gate and the op's forward. A backward asks the gate again: a
    mode may have been entered between forward and backward (``slimgrad.memory`` measures a
    backward alone). An op under the profiler takes its general path, so profiles still name
    each custom op.
    """
    if _compiler._is_compiling_flag:  # compiling() read in place (NOTE [One-call gate])
        return False
    w = _watchers
    if w is not None:
        return not w() or _counted_checkpoint()
    return (
        not (
            _dispatch_stack_len()
            or _function_mode_on()
            or _functorch_on()
            or _is_tracing()
            or _profiling()
        )
        or _counted_checkpoint()
    )


# NOTE [A FLOP count on one side of a checkpoint]
# A non-reentrant ``torch.utils.checkpoint`` runs its region twice, at forward and again inside
# backward, and hands the forward's nodes what the recompute saved: the two must save the same
# tensors (count, shapes, dtypes), or torch raises CheckpointError. The gate closes under any
# watcher, and an op's general path may save other tensors than its straight path (HF attention's
# straight path keeps q and k folded to (B·H, T, d), its general path 4-D; the dropout C kernels'
# bits). So a watcher on one side only (``with FlopCounterMode(): loss = model(x)`` and the
# backward outside it, or the other way round; the profiler likewise) sent the two runs down
# different paths: CheckpointError on a converted BERT with dropout, where eager runs. Under
# checkpoint's own saved-tensor hooks (forward and recompute alike), a step watched only by
# readers, torch's ``FlopCounterMode`` (any number) and the profiler, takes the straight path, as
# unwatched: they see every ATen op it issues, not slimgrad's custom ops by name. (Outside
# checkpoint's hooks the gate stays closed under them and FlopCounterMode sees a custom op as one
# op: the products inside the attention ops' and the fused loss's custom ops, which have no FLOP
# formula, are not counted there; left.) Any other watcher (a mode that may store or change results:
# selective checkpointing's, a user's; a function mode; a transform; a trace) closes the gate, on
# both sides where it is on both; on one side only, the two runs take different paths, which is
# safe only where an op's two paths save the same tensors: HF attention's general path folds q, k
# and v as its straight path does for that (``_math_path`` in convert_handlers/hf_attention.py),
# and a survey of the HF conformance families under a pass-through mode finds no other op that
# saves otherwise inside a layer. A module hook on one side only still changes what a converted
# module runs (eager's op): CheckpointError there (left: telling it would need the forward's
# decisions replayed in the recompute). Outside checkpoint's hooks nothing changes: the profiler
# still names each custom op there.
try:  # private: without it no hooks are seen (checkpoint's included: the features it serves off)
    _top_hooks = _C._autograd._top_saved_tensors_default_hooks
except AttributeError:  # pragma: no cover - depends on the torch release

    def _top_hooks(_ignore_empty: bool) -> None:
        return None


try:  # private: the dispatch modes on the stack; without it, no mode is taken as a reader
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as _mode_stack
except ImportError:  # pragma: no cover - depends on the torch release
    _mode_stack = None
_CHECKPOINT = "torch.utils.checkpoint"  # the module of checkpoint's own hook functions
_FLOP_COUNTER = "torch.utils.flop_counter"


def _checkpoints(hooks: tuple) -> bool:
    # whether saved-tensor hooks ``(pack, unpack)`` are torch.utils.checkpoint's own
    return getattr(hooks[0], "__module__", None) == _CHECKPOINT


def under_checkpoint() -> bool:
    """Whether the innermost saved-tensor hooks are torch.utils.checkpoint's own: a non-reentrant
    checkpoint's forward or its recompute inside backward."""
    hooks = _top_hooks(False)
    return hooks is not None and _checkpoints(hooks)


def _counted_checkpoint() -> bool:
    # NOTE [A FLOP count on one side of a checkpoint]: only readers watch, under checkpoint's hooks
    if _function_mode_on() or _functorch_on() or _is_tracing() or not under_checkpoint():
        return False
    if _dispatch_stack_len():
        if _mode_stack is None:
            return False
        for m in _mode_stack():  # (FlopCounterMode pushes a mode class of its module)
            if type(m).__module__ != _FLOP_COUNTER:
                return False
    return True


# NOTE [One-call gate]
# :func:`straight` reads the flag :func:`slimgrad._autograd.compiling` returns in place, saving
# that frame on every op call. Dynamo must not trace the read (it would guard on the flag, which is
# False at run time: a recompile per call), so ``straight`` is marked as having a constant result,
# as ``compiling`` is (NOTE [One-frame compile check] in slimgrad/_autograd.py): Dynamo calls it
# once at trace time, where torch.compile and torch.export hold the flag True, and uses the answer
# (False) as a constant, exactly what tracing ``not (compiling() or ...)`` gave.
# The five watchers are torch's own C checks; once slimgrad's C++ extension is loaded (built on
# the first ownership question, never at import: NOTE [Storage facts from the C++ API] in
# slimgrad/_ext) one call of its ``watchers`` reads the same five C++ facts that those Python
# bindings return (a bit mask, 0 for nobody), and ``straight`` is two calls instead of six;
# without the extension it asks torch's five bindings. tests/test_library.py checks that both
# give the same answer under each watcher.
straight._dynamo_marked_constant = True  # type: ignore[attr-defined]
_watchers = None  # the extension's watchers(), once it is loaded


def _use_extension(mod) -> None:
    global _watchers
    _watchers = getattr(mod, "watchers", None)


_ext.when_loaded(_use_extension)


def direct_call_ok(args: tuple, kwargs: dict) -> bool:
    """Whether a slimgrad custom op may run its Python implementation directly on these
    arguments (NOTE [Calling a custom op eagerly])."""
    if (
        _is_compiling()
        or _dispatch_stack_len()
        or _function_mode_on()
        or _functorch_on()
        or _is_tracing()
    ):
        return False
    grad = _grad_on()
    for a in args:
        if not _plain(a, grad):
            return False
    if kwargs:
        for a in kwargs.values():
            if not _plain(a, grad):
                return False
    return True


class SlimOp:
    """A registered ``slimgrad::<name>`` op that, called eagerly with plain tensors, runs its
    Python implementation without the dispatcher (NOTE [Calling a custom op eagerly]).

    Everything else (``register_fake``, ``_opoverload``, ...) is the ``CustomOpDef``'s.
    """

    def __init__(self, op_def: torch.library.CustomOpDef, fn: Callable) -> None:
        self._def = op_def
        self._fn = fn
        #: the Python implementation, for a caller past :func:`straight` (NOTE [One gate per
        #: call]); it bumps no version counter, so only for ops that mutate nothing
        self.impl = (
            fn
            if not any(
                a.alias_info is not None and a.alias_info.is_write
                for a in op_def._opoverload._schema.arguments
            )
            else None
        )
        self._qualname = op_def._qualname
        schema = op_def._opoverload._schema
        self._mutated = tuple(
            (i, a.name)
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        self.__name__ = getattr(fn, "__name__", "op")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        self.__doc__ = fn.__doc__
        self.__module__ = getattr(fn, "__module__", __name__)

    def __call__(self, *args, **kwargs):
        if direct_call_ok(args, kwargs):
            if _profiling():  # profiles name the op as the dispatcher's call would
                with torch.autograd.profiler.record_function(self._qualname):
                    out = self._fn(*args, **kwargs)
            else:
                out = self._fn(*args, **kwargs)
            for i, name in self._mutated:
                t = args[i] if i < len(args) else kwargs.get(name)
                if isinstance(t, _Tensor):
                    _bump((t,))
            return out
        return self._def(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._def, name)

    def __repr__(self) -> str:
        return f"SlimOp({self._def._qualname})"


def custom_op(
    name: str,
    *,
    mutates_args: Iterable[str] | str = (),
    device_types: str | Iterable[str] | None = None,
    schema: str | None = None,
):
    """``torch.library.custom_op`` in the ``slimgrad`` namespace, visible to the memory tracker,
    called without the dispatcher where nothing can tell (NOTE [Calling a custom op eagerly]).

    Args:
        name: op name without namespace, e.g. ``"gelu_fwd"``.
        mutates_args, device_types, schema: as for ``torch.library.custom_op``.

    Returns:
        A decorator turning the Python implementation into a :class:`SlimOp`.
    """
    qualname = f"{NAMESPACE}::{name}"

    def deco(fn: Callable) -> SlimOp:
        op = torch.library.custom_op(
            qualname, mutates_args=mutates_args, device_types=device_types, schema=schema
        )(fn)
        _PYTHON_IMPLS[qualname] = fn
        if device_types is None:
            _lean_kernels(op, fn)
        return SlimOp(op, fn)

    return deco


# NOTE [Lean dispatcher kernels]
# Compiled, every slimgrad custom op is called through the dispatcher (inductor's generated code
# calls ``torch.ops.slimgrad.<name>.default``), as it is under FakeTensorMode and the memory
# tracker. ``torch.library.custom_op`` registers two Python kernels per op: an Autograd kernel
# that, with grad off or no argument requiring grad, builds a metadata dataclass, asks whether the
# op is an out= op and redispatches below autograd; and a CompositeExplicitAutograd kernel that
# looks the implementation up per device, runs it under ``torch._dynamo.disable`` and checks that
# no output aliases an input. For an op that mutates nothing and names no device type,
# :func:`_lean_kernels` registers over both, once, at definition: an Autograd kernel that
# redispatches below autograd itself when grad is off or nothing requires grad, and otherwise
# calls torch's own kernel (built by the same private function from the same ``CustomOpDef``, so a
# later ``register_autograd`` and the "no autograd formula" error behave as before); and a
# backend kernel that runs the implementation through :func:`slimgrad._compile.eager_only`
# (``torch.compiler.disable`` once Dynamo is loaded) and makes torch's aliasing check. The same
# results, checks and errors, fewer Python frames per call (``tests/test_compile_dispatch.py``).
# A mutating op keeps torch's kernels (its version-counter bumps live there); a torch without
# the private function keeps torch's kernels as well.
# With grad mode off (a compiled graph's forward and backward, a backward's own calls), the
# Autograd kernel calls the backend kernel itself when the keys left below autograd are only the
# dense CPU / CUDA backends, BackendSelect and ADInplaceOrView (fallthroughs for an op that
# mutates nothing and returns no view): the redispatch would reach that same kernel, through one
# more round of argument boxing. Any other key (a dispatch mode's or a subclass's Python key,
# functionalization, functorch, conjugate/negative bits, sparse) takes the redispatch, and so does
# Meta: there the redispatch reaches the Meta kernel ``register_fake`` installs (the fake
# implementation), not the Python implementation, which needs values.
# A torch without DispatchKeySet's raw bits (private) keeps torch's kernels.
# The backend kernel runs the implementation through ``eager_only`` (``torch.compiler.disable``:
# Dynamo must not compile the implementation's frames) only while a Dynamo frame callback is
# active; with none (inductor's generated code runs under AOTAutograd's disabled runtime wrapper,
# and a backward under the autograd engine) the wrapper would set none and restore none, and the
# implementation is called itself: three Python frames and four eval-frame switches fewer per
# call. Export (which annotates disabled calls) keeps the wrapper. The callback is read with
# torch's private ``get_eval_frame_callback``; a torch without it always takes the wrapper.
try:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _eval_frame_callback
except (ImportError, AttributeError):
    _eval_frame_callback = None
if not hasattr(_compiler, "_is_exporting_flag"):
    _eval_frame_callback = None
try:
    _PLAIN_BELOW_AUTOGRAD = 0
    for _k in ("CPU", "CUDA", "BackendSelect", "ADInplaceOrView"):
        _PLAIN_BELOW_AUTOGRAD |= _C.DispatchKeySet(getattr(_C.DispatchKey, _k)).raw_repr()
    _NOT_PLAIN_BELOW_AUTOGRAD: int | None = ~_PLAIN_BELOW_AUTOGRAD & (2**64 - 1)
except AttributeError:
    _NOT_PLAIN_BELOW_AUTOGRAD = None


def _lean_kernels(op_def, fn: Callable) -> None:
    try:  # private: torch's Autograd kernel for a custom op, and its aliasing check
        from torch._library.autograd import make_autograd_impl
        from torch._library.utils import _c_check_aliasing_constraint

        aliased = _C._any_output_is_alias_to_input_or_output
        redispatch = op_def._opoverload._handle.redispatch_boxed  # OpOverload.redispatch's body
    except (ImportError, AttributeError):  # keep torch's own kernels
        return
    if _NOT_PLAIN_BELOW_AUTOGRAD is None:
        return
    opov = op_def._opoverload
    sch = opov._schema
    if sch.is_mutable or sch._is_view_op() or torch.Tag.out in opov.tags:
        return
    from slimgrad._compile import eager_only, never_compiled

    name = op_def._name
    full = make_autograd_impl(opov, op_def)  # reads op_def's register_autograd at call time
    after_autograd = _C._after_autograd_keyset
    below_autograd = _C._AutoDispatchBelowAutograd
    any_requires_grad = _C._any_requires_grad
    run = eager_only(fn)
    module = getattr(fn, "__module__", "???")
    callback = _eval_frame_callback
    compiler = _compiler

    def autograd_kernel(keyset, *args, **kwargs):
        if _grad_on():
            if any_requires_grad(*args):
                return full(keyset, *args, **kwargs)
        elif not (keyset & after_autograd).raw_repr() & _NOT_PLAIN_BELOW_AUTOGRAD:
            # nothing between here and the backend kernel (NOTE [Lean dispatcher kernels])
            return backend_kernel(*args, **kwargs)
        with below_autograd():
            return redispatch(keyset & after_autograd, *args, **kwargs)

    def backend_kernel(*args, **kwargs):
        # no Dynamo callback active (a compiled graph's call, a backward's): torch.compiler.
        # disable's wrapper would set none and restore none, so the implementation runs itself
        # (NOTE [Lean dispatcher kernels]); otherwise through eager_only
        if callback is not None and callback() is None and not compiler._is_exporting_flag:
            out = fn(*args, **kwargs)
        else:
            out = run(*args, **kwargs)
        if aliased(args, kwargs, out if type(out) is tuple else (out,)):  # torch's error
            _c_check_aliasing_constraint(name, args, kwargs, out, lambda: module)
        return out

    never_compiled(autograd_kernel)  # NOTE [Kernels Dynamo never compiles] in slimgrad/_compile.py
    never_compiled(backend_kernel)
    lib = op_def._lib
    with warnings.catch_warnings():  # the dispatcher's note on overriding, as torch filters it
        warnings.filterwarnings("ignore", message="Warning only once for all operators")
        lib.impl(name, autograd_kernel, "Autograd", with_keyset=True)
        lib.impl(name, backend_kernel, "CompositeExplicitAutograd")


def python_impl(qualname: str) -> Callable | None:
    """The Python implementation recorded for ``slimgrad::<name>``, or None."""
    return _PYTHON_IMPLS.get(qualname)
