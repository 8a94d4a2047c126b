"""``NoScript``: the base that makes ``torch.jit.script`` of a slimgrad module fail clearly.

TorchScript compiles a module's Python source; slimgrad's modules call autograd Functions (and
read version counters, weak registries and side tables) that TorchScript cannot compile, and its
error points at a line inside slimgrad. ``torch.jit.script`` calls ``__prepare_scriptable__`` on the
module and on every submodule before compiling, so each slimgrad module answers there with the API,
the reason and the fix. ``torch.jit.trace`` is refused at op entry instead (``refuse_jit`` in
``slimgrad/_autograd.py``).
"""

from __future__ import annotations

from slimgrad.nn._hooks import NEAR_FREE, NEAR_HOOKS

__all__ = ["NoScript"]


class NoScript:
    """Mixin for every ``slimgrad.nn`` module: ``torch.jit.script`` raises a clear error."""

    __slots__ = ()
    # no hooks around it but the global pre-hooks (NOTE [Hooks registered after convert_ on the
    # modules around] in nn/_hooks.py; ``convert_`` sets them per module)
    near_hooks, near_free = NEAR_HOOKS, NEAR_FREE

    def __prepare_scriptable__(self):
        name = type(self).__name__
        raise RuntimeError(
            f"slimgrad.nn.{name}: torch.jit.script cannot compile slimgrad's autograd Functions; "
            "expected an eager, torch.compile or torch.export run, got torch.jit.script of a "
            "converted model. Script the model before slimgrad.convert_ or after "
            "slimgrad.revert_(model) (or leave this module unconverted with convert_(model, "
            "filter_fn=...)), or use torch.compile / torch.export on the converted one."
        )
