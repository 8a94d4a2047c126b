"""convert_ handlers for timm's blocks (ViT attention, ConvNeXt blocks), by class name.

``TABLE`` ({qualified class name: (ConvertConfig field, handler)}) is merged into
``slimgrad.convert._TABLE``; ``PATTERNS`` (``(ConvertConfig field or None, pattern)``) run after
convert's own passes. Both are empty until a handler is proven exact.
"""

from __future__ import annotations

TABLE: dict = {}
PATTERNS: list = []
