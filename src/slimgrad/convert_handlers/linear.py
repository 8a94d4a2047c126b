"""convert_ handlers for plain ``torch.nn.Linear``, by class name.

``TABLE`` ({qualified class name: (ConvertConfig field, handler)}) is merged into
``slimgrad.convert._TABLE``. Empty: ``nn.Linear`` is left as it is.
"""

from __future__ import annotations

TABLE: dict = {}
