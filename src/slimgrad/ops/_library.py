"""Re-export of :mod:`slimgrad._library` (the custom-op registry lives below ``ops/`` so that
``slimgrad.memory`` can read it without importing the ops: NOTE [Custom ops and the memory
tracker] there)."""

from slimgrad._library import NAMESPACE, custom_op, python_impl

__all__ = ["NAMESPACE", "custom_op", "python_impl"]
