"""``verify``: prove that a converted model computes the same loss and gradients as the original.

Both models run the same step on the same inputs with the same RNG seed (so dropout draws the same
masks), next to a float64 copy of the original as the reference. Each parameter's gradient must
satisfy the GUIDE.md rule ``max|g - g64| <= 2 * max|g_eager - g64| + atol``: the converted model may
be as far from exact as eager PyTorch is at that dtype (times two), never further.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from slimgrad.testing import DEFAULT_ATOL, max_abs_err

__all__ = ["GradCheck", "VerifyReport", "verify"]


@dataclass
class GradCheck:
    """One parameter's gradient against the float64 reference."""

    name: str
    err: float  # max|g_converted - g64|
    eager_err: float  # max|g_eager - g64|
    bound: float  # 2 * eager_err + atol
    ok: bool


@dataclass
class VerifyReport:
    """Loss and per-parameter gradient agreement of a converted model with its original."""

    loss_eager: float
    loss_converted: float
    loss_ref64: float
    loss_ok: bool
    grads: list[GradCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.loss_ok and all(g.ok for g in self.grads)

    @property
    def max_grad_err(self) -> float:
        return max((g.err for g in self.grads), default=0.0)

    def __str__(self) -> str:
        bad = [g for g in self.grads if not g.ok]
        head = (
            f"verify: {'OK' if self.ok else 'FAILED'}; loss eager {self.loss_eager:.6g}, converted "
            f"{self.loss_converted:.6g}, float64 {self.loss_ref64:.6g}; {len(self.grads)} grads, "
            f"max err {self.max_grad_err:.3e}"
        )
        lines = [head] + [
            f"  {g.name}: err {g.err:.3e} > bound {g.bound:.3e} (eager err {g.eager_err:.3e})"
            for g in bad
        ]
        return "\n".join(lines)


def _cast(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, Mapping):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(v, dtype) for v in obj)
    return obj


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _default_loss(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, torch.Tensor):
        return out if out.numel() == 1 else out.float().square().mean()
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return _default_loss(out[0])
    raise TypeError(
        "slimgrad.verify: cannot make a loss from the model's output; expected a tensor or "
        f"an object with .loss, got {type(out).__name__}. Pass loss_fn=."
    )


def _step(model, inputs, loss_fn, seed) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    torch.manual_seed(seed)
    loss = loss_fn(_call(model, inputs))
    grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    return loss.detach(), {n: g for (n, _), g in zip(params, grads)}


def verify(
    model: nn.Module,
    converted: nn.Module,
    inputs: Any,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    seed: int = 0,
    atol: float | None = None,
) -> VerifyReport:
    """Compare a converted model with its original on one step, against a float64 reference.

    Args:
        model: the original model (left unchanged; a float64 copy is made from it).
        converted: the converted model (e.g. ``slimgrad.convert_(copy.deepcopy(model))``); its
            parameter names must match ``model``'s.
        inputs: a tensor, a tuple of positional inputs, or a dict of keyword inputs.
        loss_fn: maps the model's output to a scalar loss; default: ``out.loss`` (HF), a scalar
        output,
            or the mean square of a tensor output.
        seed: the RNG seed set before each of the three runs (same dropout masks).
        atol: the absolute term of the rule; default by dtype (``slimgrad.testing.DEFAULT_ATOL``).

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is True when the loss and every gradient pass the
        rule.

    Raises:
        ValueError: the two models' trainable parameter names differ.
    """
    loss_fn = loss_fn or _default_loss
    names_a = [n for n, p in model.named_parameters() if p.requires_grad]
    names_b = [n for n, p in converted.named_parameters() if p.requires_grad]
    if names_a != names_b:
        raise ValueError(
            "slimgrad.verify: the models' trainable parameters differ; expected the same names, "
            "got "
            f"{len(names_a)} vs {len(names_b)} (first difference: "
            f"{next((a, b) for a, b in zip(names_a + [None], names_b + [None]) if a != b)}). "
            "Convert a copy of the same model."
        )
    ref = copy.deepcopy(model).to(torch.float64)
    loss_e, grads_e = _step(model, inputs, loss_fn, seed)
    loss_c, grads_c = _step(converted, inputs, loss_fn, seed)
    loss_r, grads_r = _step(ref, _cast(inputs, torch.float64), loss_fn, seed)
    checks = []
    for name in names_a:
        g_e, g_c, g_r = grads_e[name], grads_c[name], grads_r[name]
        if g_r is None and g_c is None and g_e is None:
            continue
        a = (
            atol
            if atol is not None
            else DEFAULT_ATOL.get(g_c.dtype if g_c is not None else None, 1e-6)
        )
        e_err = max_abs_err(g_e, g_r)
        err = max_abs_err(g_c, g_r)
        bound = 2.0 * e_err + a
        checks.append(GradCheck(name, err, e_err, bound, err <= bound))
    # the loss is one number of any magnitude: its absolute term scales with it
    la = atol if atol is not None else DEFAULT_ATOL.get(loss_c.dtype, 1e-6)
    la *= max(1.0, abs(float(loss_r)))
    loss_ok = max_abs_err(loss_c, loss_r) <= 2.0 * max_abs_err(loss_e, loss_r) + la
    return VerifyReport(float(loss_e), float(loss_c), float(loss_r), loss_ok, checks)
