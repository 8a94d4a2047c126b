import os

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    # Keep the suite within 2 cores: each xdist worker uses one intra-op thread.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
