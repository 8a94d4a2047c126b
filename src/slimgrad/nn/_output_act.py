"""Shared helpers of the activation modules (see ``slimgrad.ops._output_act``)."""

from __future__ import annotations

import torch


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
