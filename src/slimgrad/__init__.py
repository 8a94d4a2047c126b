"""slimgrad: train the same PyTorch model, with the same gradients, in less memory.

Public API (few names on purpose):

- ``convert_(model, config=None, *, filter_fn=None, device=None, dtype=None)``: swap module
  instances for lean ones, in place, where they keep no more than eager on that device and dtype;
  ``ConvertConfig`` selects techniques; ``report(model)`` says what changed and why not;
  ``revert_(model)`` undoes it (the model's own module classes, the same Parameters).
- ``verify(model, converted, inputs)``: loss and every gradient against a float64 reference.
- ``slimgrad.memory.measure`` / ``estimate``: exact bytes of a training step (peak, saved, floor);
  ``estimate(..., device="cuda")`` models what CUDA kernels keep.
- ``plan(make_forward, budget)``: per-block eager / lean / recomputed choices that fit a memory
  budget with the least recompute; ``convert_(model, plan=plan)`` applies them.
- ``step_in_backward(model, OptimizerClass, **kwargs)``: each parameter's optimizer update as soon
  as its gradient is complete (bit-identical to the plain loop); the handle is an Optimizer.

Ops live in ``slimgrad.ops`` (functional) and ``slimgrad.nn`` (modules). ``import slimgrad`` imports
neither Triton nor CUDA.
"""

from slimgrad import _compat

_compat.check_torch()  # one clear message for an unsupported torch, before any private import

from slimgrad import _autograd, memory  # noqa: E402
from slimgrad.convert import ConvertConfig, ConvertReport, convert_, report  # noqa: E402
from slimgrad.plan import Plan, plan  # noqa: E402
from slimgrad.revert import revert_  # noqa: E402
from slimgrad.step_in_backward import step_in_backward  # noqa: E402
from slimgrad.verify import VerifyReport, verify  # noqa: E402

_autograd.refuse_forward_ad()  # NOTE [Forward-mode AD is refused] in slimgrad/_autograd.py
_autograd.backward_without_autocast()  # NOTE [Backward without autocast] in slimgrad/_autograd.py

__version__ = "0.1.0"

__all__ = [
    "ConvertConfig",
    "ConvertReport",
    "VerifyReport",
    "convert_",
    "memory",
    "Plan",
    "plan",
    "report",
    "revert_",
    "step_in_backward",
    "verify",
]
