"""Per device and dtype: a replacement only where it keeps no more than eager's kernel keeps there.

# NOTE [Never more than eager, per device and dtype]
What eager PyTorch keeps for backward depends on the kernel it dispatches to, and that depends on
the device and the dtype. ``convert_`` chooses a slimgrad replacement for an op family only where
the replacement keeps no more than eager's kernel keeps on the device and dtype the model runs
on. The rule is written once, here: :data:`RULES` maps each ``ConvertConfig`` technique (and the
two HF attention origins, which the ``dropout`` technique's attention pass converts) to a function
``(device type, dtype) -> reason or None``. ``convert_`` asks it before calling a handler or a
pattern (the reason goes into the report) and the HF attention asks it again at call time with
the query's device and dtype, so a model converted on CPU and moved to CUDA keeps SDPA there.

What eager keeps (from PyTorch's ``tools/autograd/derivatives.yaml``, the autograd formula of each
op, which is the same on every device; the device decides *which* op runs):

- ``attention`` (HF ``"sdpa"`` origin; slimgrad keeps the scaled q and k, v and 1 bit/elt of
  dropout mask, B x H x T x T, and recomputes P in backward; with a float mask it keeps P too):
  ``F.scaled_dot_product_attention`` is ``CompositeImplicitAutograd``; its backend choice
  (``aten/src/ATen/native/transformers/{sdp_utils_cpp.cpp,cuda/sdp_utils.cpp}``) decides what is
  kept.
    * CPU: with dropout the only backend is the math path (``_scaled_dot_product_attention_math``):
      it keeps the scaled q and k, P, the dropout noise and the dropped P, all T x T per head
      (float32 for float16/bfloat16 inputs and under autocast, with a float32 copy of v: NOTE
      [SDPA's math path in half precision and under autocast] in ``hf_attention.py``): more than
      slimgrad in every dtype. Without dropout CPU runs ``_scaled_dot_product_flash_attention_
      for_cpu`` (q, k, v, out, logsumexp), and slimgrad's attention hands such calls to SDPA.
    * CUDA, float16/bfloat16/float32: a fused backend (flash: fp16/bf16; memory-efficient: also
      fp32 and arbitrary masks; cuDNN), dropout included. Their derivative formulas keep q, k, v,
      out and logsumexp (B x H x T, fp32) + the RNG seed/offset: O(T) per row, far less than P.
      slimgrad keeps SDPA there.
    * CUDA, float64: no fused backend takes float64, the math path runs (as on CPU): replaced.
    * any other device type (mps, xpu, ...): its kernels are not modelled here: SDPA kept.
- ``attention_eager`` (HF ``"eager"`` origin): the family's ``eager_attention_forward`` keeps the
  scores' softmax P, the dropout mask (CPU: a noise tensor of P's dtype; CUDA: ``native_dropout``'s
  bool mask) and the dropped P on every device: slimgrad keeps less everywhere.
- ``activations``: relu/sigmoid/tanh/elu keep their output, gelu/silu/mish/hardswish/leaky_relu/
  hardtanh their input, on every device; slimgrad keeps the output (+ 1 bit/elt for smooth ones).
  Gated MLPs (technique ``activations``) keep eager's matmul inputs and act(gate) or gate.
- ``norms``: ``native_layer_norm`` keeps input, mean, rstd (CPU: stats in the input's dtype, see
  ``torch._refs.native_layer_norm``; CUDA: float32 stats for half inputs); ``native_group_norm``
  keeps input, mean, rstd; ``rms_norm`` keeps its input (CUDA's ``_fused_rms_norm``: + fp32 rstd;
  CPU's composite: + its intermediates). slimgrad keeps the output + per-row stats: no more.
- ``dropout``: CPU's ``at::dropout`` is not fused (``is_fused_kernel_acceptable`` is CUDA/XPU/
  lazy/privateuse1 only): it keeps a noise tensor in the input's dtype; CUDA runs ``native_dropout``
  and keeps a bool mask (1 byte/elt). slimgrad keeps 1 bit/elt.
- ``selective_saving`` / ``linear``: ``addmm``/``mm``/``convolution`` (CUDA: ``cudnn_convolution``)
  keep input and weight on every device; slimgrad keeps a subset of them.
- ``batch_norm``, ``inplace_abn``: ``native_batch_norm`` (CPU) and ``cudnn_batch_norm`` (CUDA) keep
  input, weight, running stats, saved mean/invstd (cuDNN: + its reserve space); slimgrad keeps
  the output shared with the next op + per-channel stats.
- ``fused_loss``: eager's LM head + ``cross_entropy`` keeps the logits' log_softmax (B x T x V) on
  every device; slimgrad keeps the hidden states and per-row statistics.

Decided per device type and dtype only: shapes and runtime settings (``sdpa_kernel``, a mask
layout a fused backend refuses) are call-time facts, and at call time slimgrad's attention hands
everything it does not take to SDPA itself, which then keeps what eager keeps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar

import torch

from slimgrad.convert_handlers import accelerate_hooks as _accelerate_hooks

__all__ = ["RULES", "check", "refuse", "stands_for", "targets", "tensor_device"]

Target = tuple[str, "torch.dtype | None"]  # (device type, floating dtype or None if unknown)

_FUSED_CUDA = "float16, bfloat16 and float32"


def _everywhere(_device: str, _dtype: torch.dtype | None) -> str | None:
    return None


def _sdpa_attention(device: str, dtype: torch.dtype | None) -> str | None:
    if device == "cpu":
        return None
    if device == "cuda":
        if dtype == torch.float64:
            return None
        got = "an unknown dtype" if dtype is None else str(dtype).removeprefix("torch.")
        return (
            f"on cuda with {got}, eager's SDPA runs a fused kernel (flash, memory-efficient or "
            "cuDNN; dropout included) that keeps q, k, v, out and logsumexp: O(T) per row; "
            "slimgrad's attention keeps 1 bit per score (T x T; with a float mask also the "
            "probabilities), more. SDPA kept "
            f"(slimgrad's attention replaces SDPA on cpu, and on cuda only for float64, where no "
            f"fused kernel runs; cuda's fused kernels take {_FUSED_CUDA})"
        )
    return (
        f"on {device}, what eager's SDPA keeps is not modelled by slimgrad; expected cpu or cuda, "
        f"got {device}. SDPA kept"
    )


# {technique or attention origin: (device type, dtype) -> reason eager keeps less, or None}
RULES: dict[str, Callable[[str, torch.dtype | None], str | None]] = {
    "activations": _everywhere,
    "norms": _everywhere,
    "dropout": _everywhere,
    "selective_saving": _everywhere,
    "linear": _everywhere,
    "batch_norm": _everywhere,
    "inplace_abn": _everywhere,
    "fused_loss": _everywhere,
    "attention": _sdpa_attention,
    "attention_eager": _everywhere,
}

# Under ``slimgrad.memory.estimate(..., device="cuda")`` fake CPU tensors stand for CUDA tensors
# (autograd on fake CUDA tensors aborts a CPU-only PyTorch): call-time checks read their device
# through this.
_STANDS_FOR: ContextVar[str | None] = ContextVar("slimgrad_stands_for", default=None)


@contextlib.contextmanager
def stands_for(device: str | None) -> Iterator[None]:
    """CPU tensors stand for ``device`` tensors while this is active (:func:`tensor_device`): in
    call-time checks and in ``convert_``'s default targets, not for an explicit ``device=``."""
    token = _STANDS_FOR.set(device)
    try:
        yield
    finally:
        _STANDS_FOR.reset(token)


def tensor_device(device) -> str:
    """The device type a tensor on ``device`` stands for (see :func:`stands_for`)."""
    kind = torch.device(device).type
    # not while Dynamo traces (it cannot trace ContextVar.get: a graph break per call); fake
    # tensors stand for CUDA ones under slimgrad.memory.estimate, which does not compile
    if kind == "cpu" and not torch.compiler.is_compiling():
        other = _STANDS_FOR.get()
        if other is not None:
            return other
    return kind


def check(family: str, device, dtype: torch.dtype | None) -> str | None:
    """Why slimgrad's replacement for ``family`` would keep more than eager on ``device`` with
    ``dtype``, or None when it keeps no more (NOTE [Never more than eager, per device and dtype]).

    Raises:
        RuntimeError: ``family`` has no rule (a technique added without one).
    """
    rule = RULES.get(family)
    if rule is None:
        raise RuntimeError(
            f"slimgrad.convert_: technique {family!r} has no device rule; expected one of "
            f"{sorted(RULES)}, got {family!r}. This is a slimgrad bug; please report it."
        )
    return rule(torch.device(device).type, dtype)


def refuse(family: str, where: Iterable[Target]) -> str | None:
    """The first reason ``check`` gives for any of the (device type, dtype) targets, or None."""
    for device, dtype in where:
        if (why := check(family, device, dtype)) is not None:
            return why
    return None


def targets(model: torch.nn.Module, device=None, dtype: torch.dtype | None = None) -> tuple:
    """The (device type, dtype) pairs ``convert_`` decides for: ``device``/``dtype`` when given,
    else those of the model's floating parameters and buffers (``("cpu", None)`` for none), each
    on the device its module runs on (an accelerate hook's execution device: NOTE [The device a
    module runs on] in accelerate_hooks.py)."""
    if device is not None:
        devices = {torch.device(device).type}
        tensors = [*model.parameters(), *model.buffers()]
    else:
        runs = _accelerate_hooks.run_devices(model)
        devices = {tensor_device(d) for _, _, d in runs} or {tensor_device("cpu")}
        tensors = [t for _, t, _ in runs]
    if dtype is not None:
        dtypes: set = {dtype}
    else:
        dtypes = {t.dtype for t in tensors if t.is_floating_point()} or {None}
    return tuple(sorted(((d, t) for d in devices for t in dtypes), key=str))
