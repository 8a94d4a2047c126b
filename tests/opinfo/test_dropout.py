"""PyTorch OpInfo samples through slimgrad: dropout (both sides draw from one
seed).

See tests/opinfo/_harness.py for the checks and tests/opinfo/_tables.py for REFUSED/KNOWN.
"""

import pytest

from tests.opinfo._harness import params, run

GROUPS = ("dropout",)


@pytest.mark.parametrize("key,dtype,i", params("sample", GROUPS))
def test_sample(key, dtype, i):
    """Forward (values, dtype, strides, mutated arguments) and every gradient vs eager."""
    run("sample", key, dtype, i)


@pytest.mark.parametrize("key,dtype,i", params("f64", GROUPS))
def test_f64_gradcheck_double(key, dtype, i):
    """float64: gradcheck, second derivatives vs eager (no silent None), gradgradcheck."""
    run("f64", key, dtype, i)


@pytest.mark.parametrize("key,dtype,i", params("inplace", GROUPS))
def test_inplace(key, dtype, i):
    """The OpInfo in-place variant against slimgrad's: values, identity, gradients."""
    run("inplace", key, dtype, i)
