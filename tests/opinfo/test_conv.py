"""PyTorch OpInfo samples through slimgrad: conv1d/2d/3d, conv_transpose1d/2d/3d.

See tests/opinfo/_harness.py for the checks and tests/opinfo/_tables.py for REFUSED/KNOWN.
"""

import pytest

from tests.opinfo._harness import params, run

GROUPS = ("conv",)

# aten's note on OpInfo's own padding='same' samples with even kernels (eager and slimgrad alike)
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")


@pytest.mark.parametrize("key,dtype,i", params("sample", GROUPS))
def test_sample(key, dtype, i):
    """Forward (values, dtype, strides, mutated arguments) and every gradient vs eager."""
    run("sample", key, dtype, i)


@pytest.mark.parametrize("key,dtype,i", params("f64", GROUPS))
def test_f64_gradcheck_double(key, dtype, i):
    """float64: gradcheck, second derivatives vs eager (no silent None), gradgradcheck."""
    run("f64", key, dtype, i)


@pytest.mark.parametrize("key,dtype,i", params("error", GROUPS))
def test_error_input(key, dtype, i):
    """OpInfo error_inputs: eager's error type, and eager's message or a slimgrad one."""
    run("error", key, dtype, i)


@pytest.mark.parametrize("key,dtype,i", params("noncontig", GROUPS))
def test_noncontiguous(key, dtype, i):
    """The sample with every tensor non-contiguous (OpInfo's noncontiguous()), float32."""
    run("noncontig", key, dtype, i)


@pytest.mark.parametrize("key,dtype,i", params("channels_last", GROUPS))
def test_channels_last(key, dtype, i):
    """The sample with a 4-D/5-D input in channels_last, float32."""
    run("channels_last", key, dtype, i)
