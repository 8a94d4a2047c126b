"""HF gated MLPs (``down(act(gate(x)) * up(x))``) -> :mod:`slimgrad.nn.gated_mlp`.

Empty until the gated-MLP op lands: ``TABLE`` maps qualified HF class names to
``(ConvertConfig field, handler)`` and is merged into ``slimgrad.convert._TABLE``.
"""

from __future__ import annotations

TABLE: dict = {}
