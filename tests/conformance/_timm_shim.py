"""Import timm in the tests (and only there) on a CPU-only torch.

timm imports torchvision. The torchvision wheel that matches this torch (0.28.0 for torch 2.13) is
built with CUDA and its C extension fails to load on a CPU-only torch, so its Python code then
registers fake (meta) kernels for ``torchvision::nms`` and ``torchvision::qnms`` on schemas that do
not exist, and ``import torchvision`` raises "operator torchvision::nms does not exist". Defining
the two schemas (no kernels: nothing here calls them) lets the import go through. This is a test
set-up concern only: slimgrad itself never imports timm or torchvision and never defines ops in
another library's namespace. One script outside the library applies it too:
``benchmarks/timm_models.py`` (the bench records of the ``timm_*`` cases) imports timm through
this module.

Where they live: ``make env`` installs timm and torchvision with ``pip --target`` into
``<venv>/timm-site``, outside the venv's site-packages, so that transformers (which imports
torchvision whenever it can find it) keeps working everywhere else in the dev environment
(the bench, the CLI). This module puts that directory on ``sys.path`` after defining the schemas.

``timm`` is this module's attribute, or None when timm (or torchvision) is not installed; the
suites skip then. Importing this module imports torchvision; timm itself is imported at the first
attribute read of ``timm`` (or any ``import timm``), see ``_Timm``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

__all__ = ["timm"]


def _define_torchvision_schemas() -> None:
    try:
        torch.ops.torchvision.nms.default  # noqa: B018  (a working torchvision defined it)
        return
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "DEF")  # noqa: TOR901  (schemas only)
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
    _define_torchvision_schemas.lib = lib  # keep the Library alive (it unregisters when freed)


def _prepare() -> bool:
    """timm-site on ``sys.path`` and torchvision imported (its schemas defined where its extension
    cannot load); False where timm or torchvision is not installed."""
    site = Path(sys.prefix) / "timm-site"
    if site.is_dir() and str(site) not in sys.path:
        sys.path.append(str(site))
    if importlib.util.find_spec("timm") is None or importlib.util.find_spec("torchvision") is None:
        return False
    try:  # a torchvision whose extension loads (a CUDA torch) defines its own schemas
        import torchvision  # noqa: F401
    except RuntimeError:  # "operator torchvision::nms does not exist": define them, try again
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        _define_torchvision_schemas()
        import torchvision  # noqa: F401
    return True


class _Timm:
    """``timm`` itself, imported at the first attribute read.

    Importing timm defines ~1,000 ``nn.Module`` subclasses, and every ``torch.fx`` trace (the
    in-place guard of ``convert_`` runs many) patches ``nn.Module.__call__`` and ``__getattr__``
    on the class, which CPython propagates to every subclass: with timm loaded such a patch costs
    several times what it does without, and a trace-heavy test file pays it on every trace. So a
    test process imports timm only where a test uses it, and
    ``tests/conftest.py`` runs the modules that import this shim last. ``import timm`` and
    ``from timm... import`` work anywhere once this module is imported (torchvision is prepared and
    timm-site is on the path): they import timm the same way.
    """

    def __getattr__(self, name: str):
        import timm as t

        return getattr(t, name)

    def __repr__(self) -> str:
        return "<timm, imported at first use (tests/conformance/_timm_shim.py)>"


timm = _Timm() if _prepare() else None
