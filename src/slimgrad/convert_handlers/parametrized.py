"""Modules whose weight is computed from other Parameters stay as they are.

# NOTE [Parametrized weights stay eager]
``torch.nn.utils.parametrize`` (``register_parametrization``; ``parametrizations.weight_norm``,
``spectral_norm``, ``orthogonal``) turns the module into a generated subclass
(``ParametrizedLinear``) whose ``weight`` is a property computed on each access from
``parametrizations.weight.original*``. The older hook API (``nn.utils.weight_norm``,
``nn.utils.spectral_norm``) keeps the class but removes the ``weight`` Parameter: a forward
pre-hook computes it from ``weight_g``/``weight_v`` (``weight_orig`` and the ``weight_u``/
``weight_v`` buffers for spectral norm) and stores it as a plain tensor attribute before each
call. Handlers build their replacement by sharing the original's Parameters: those built on a
fresh module (``Linear``, ``LayerNorm``, ``GroupNorm``) failed to assign the plain ``weight``
tensor as a Parameter ("cannot assign 'torch.FloatTensor' as parameter 'weight'"); those that
copy the module's ``__dict__`` (the convolutions, BatchNorm) carried the hook along and ran, but
with a weight that is a new non-leaf tensor each call, which the per-parameter decisions made
once per Parameter version (NOTE "Decide once" in CONTRIBUTING.md) do not describe. So ``convert_``
decides once, before any handler runs, that such a module stays eager, and the report says why;
its parametrization runs exactly as eager's and its gradients reach ``weight_g``/``weight_v``/
``original0`` as in eager. The module's children (the parametrization modules) stay too.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

__all__ = ["parametrized_reason"]


def _hook_parametrized(module: nn.Module) -> list[str]:
    # names a forward pre-hook computes (nn.utils.weight_norm / spectral_norm, or any hook that
    # stores a plain tensor under a name the class registers as a Parameter)
    names = []
    for hook in module._forward_pre_hooks.values():
        name = getattr(hook, "name", None)
        if isinstance(name, str) and name not in module._parameters:
            names.append(f"{name} ({type(hook).__name__} hook)")
    for name in ("weight", "bias"):
        v = module.__dict__.get(name)
        if isinstance(v, torch.Tensor) and not any(n.startswith(f"{name} ") for n in names):
            names.append(f"{name} (a plain tensor attribute)")
    return names


def parametrized_reason(module: nn.Module) -> str | None:
    """Why ``module`` stays eager because a Parameter of it is computed (NOTE [Parametrized
    weights stay eager]), or None when every Parameter is a plain one."""
    if parametrize.is_parametrized(module):
        names = sorted(module.parametrizations.keys())
        what = ", ".join(
            f"{n} ({', '.join(type(p).__name__ for p in module.parametrizations[n])})"
            for n in names
        )
        return (
            f"its {what} is parametrized (torch.nn.utils.parametrize); expected plain Parameters, "
            "got a tensor computed from 'parametrizations.*.original' on each access. It runs "
            "as eager (NOTE [Parametrized weights stay eager] in convert_handlers/parametrized.py)"
        )
    hooked = _hook_parametrized(module)
    if hooked:
        return (
            f"its {', '.join(hooked)} is computed before each call (nn.utils.weight_norm / "
            "spectral_norm hook API); expected plain Parameters. It runs as eager (NOTE "
            "[Parametrized weights stay eager] in convert_handlers/parametrized.py)"
        )
    return None
