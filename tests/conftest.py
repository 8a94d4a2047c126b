import gc
import os
from pathlib import Path

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


# torch.manual_seed also queues a seed for every accelerator not yet initialized, each with the
# caller's formatted stack (traceback.format_stack under pytest's ~70 frames: ~4 ms a call, once per
# test); where no accelerator is present only the CPU generator draws, and seeding it is the same
_ACCELERATOR = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


@pytest.fixture(autouse=True)
def _seed():
    if _ACCELERATOR:
        torch.manual_seed(0)
    else:
        torch.default_generator.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _backend_resolved_per_test():
    # the process-wide kernel backend is resolved once (NOTE [Kernel backend choice]); a test that
    # changes $SLIMGRAD_BACKEND (monkeypatch) must not leave its choice to the tests after it
    from slimgrad.kernels import _backend

    _backend.refresh()
    yield
    _backend.refresh()


def pytest_configure(config):
    # Keep the suite within 2 cores: each xdist worker uses one intra-op thread.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


def _reuse_off_reason() -> str | None:
    from slimgrad._compat import features

    f = next(f for f in features() if f.name == "buffer reuse (ownership)")
    if not f.on:
        return f.detail
    from slimgrad import _ext

    if not _ext.available():  # builds it once per process if needed
        return f"the ownership extension is unavailable: {_ext.error()}"
    return None


def _uses_timm(path, seen: dict) -> bool:
    if path not in seen:
        seen[path] = "_timm_shim" in Path(path).read_text()
    return seen[path]


def pytest_collection_modifyitems(config, items):
    # the modules that may import timm run last (a stable sort: each keeps its order): once timm is
    # imported, every torch.fx trace in that process costs more (tests/conformance/_timm_shim.py,
    # _Timm), so the rest of the suite runs before it in each xdist worker
    seen: dict = {}
    items.sort(key=lambda it: _uses_timm(it.path, seen))

    # tests that assert a grant skip, with the reason, where this installation cannot grant
    from tests._needs_reuse import NEEDS_REUSE

    marked = [it for it in items if it.nodeid.split("[")[0] in NEEDS_REUSE]
    if not marked:
        return
    why = _reuse_off_reason()
    if why is None:
        return
    skip = pytest.mark.skip(reason=f"asserts buffer reuse, which is off here: {why}")
    for it in marked:
        it.add_marker(skip)


def pytest_collection_finish(session):
    # Collection imports every test module (transformers, timm, torch._dynamo, the parametrized
    # cases): ~780,000 objects that live to the end of the process, which every full gc pass
    # (automatic, and the bench harness's explicit gc.collect()) walked again. Frozen here, a pass
    # walks only what the tests themselves create; nothing a test creates is frozen.
    gc.collect()
    gc.freeze()
