"""convert_ handlers for HF mixture-of-experts blocks with 3-D expert weight banks, by class name.

``TABLE`` ({qualified class name: (ConvertConfig field, handler)}) is merged into
``slimgrad.convert._TABLE``; ``PATTERNS`` (``(ConvertConfig field or None, pattern)``) run after
convert's own passes. Both are empty until a handler is proven exact.
"""

from __future__ import annotations

TABLE: dict = {}
PATTERNS: list = []
