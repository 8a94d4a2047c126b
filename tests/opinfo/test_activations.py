"""PyTorch OpInfo samples through slimgrad: relu, sigmoid, tanh, hardtanh, relu6, leaky_relu,
elu, gelu, silu, mish.

See tests/opinfo/_harness.py for the checks and tests/opinfo/_tables.py for REFUSED/KNOWN.

The cases come from a committed table (``_OPS``), not from the samples: generating every
activation sample at collection only to count them cost ~2.5 s CPU in every pytest process,
including the xdist workers that never run one. ``test_case_table_is_opinfos`` generates them
once and fails, naming the difference, when this torch's OpInfo samples no longer match it.
"""

import pytest

from tests.opinfo._harness import (
    _TEST_DOCS,
    BIG_DTYPES,
    DTYPES,
    INPLACE_DTYPES,
    SPECS,
    Finding,
    case_id,
    cases,
    run,
)

GROUPS = ("act",)

# op: (samples per dtype, big contiguous samples, big non-contiguous samples, has an in-place
# variant, error inputs). "Big" is harness.BIG_NUMEL; harness.cases() keeps a big sample only
# for the dtypes BIG_DTYPES names, and only when it is contiguous.
_OPS = {
    "relu": (41, (4,), (19, 31), True, 0),
    "sigmoid": (39, (3,), (17, 29), True, 0),
    "tanh": (35, (1,), (13, 25), True, 0),
    "hardtanh": (43, (5,), (21, 33), True, 1),
    "relu6": (39, (3,), (17, 29), True, 0),
    "leaky_relu": (9, (), (), True, 0),
    "elu": (39, (3,), (17, 29), True, 0),
    "gelu": (8, (), (), False, 1),
    "silu": (39, (3,), (17, 29), True, 0),
    "mish": (39, (3,), (17, 29), True, 0),
}
_KINDS = ("sample", "f64", "inplace", "error")


def _cases(kind: str) -> list:
    import torch

    out = []
    for key, (n, big, big_nc, has_inplace, n_err) in _OPS.items():
        if kind == "error":
            out += [(key, None, i) for i in range(n_err)]
            continue
        if kind == "inplace" and not has_inplace:
            continue
        for dt in DTYPES:
            if kind == "f64" and dt != torch.float64:
                continue
            if kind == "inplace" and dt not in INPLACE_DTYPES:
                continue
            out += [
                (key, dt, i)
                for i in range(n)
                if i not in big_nc and (i not in big or dt in BIG_DTYPES[kind])
            ]
    return out


def _case_test(kind: str):
    # harness.case_test with the committed cases; the same ids, KNOWN marks and checks.
    from tests.opinfo._tables import KNOWN

    params = []
    for key, dt, i in _cases(kind):
        cid = case_id(kind, key, dt, i)
        marks = []
        if cid in KNOWN:
            marks.append(pytest.mark.xfail(strict=True, raises=Finding, reason=KNOWN[cid]))
        params.append(pytest.param(key, dt, i, id=cid.split(":", 1)[1], marks=marks))

    @pytest.mark.parametrize("key,dtype,i", params)
    def test(key, dtype, i):
        run(kind, key, dtype, i)

    test.__doc__ = _TEST_DOCS[kind]
    return test


test_sample = _case_test("sample")
test_f64_gradcheck_double = _case_test("f64")
test_inplace = _case_test("inplace")
test_error_input = _case_test("error")


def test_case_table_is_opinfos():
    """The committed table names exactly the cases harness.cases() derives from the samples."""
    assert set(_OPS) == {s.key for s in SPECS if s.group in GROUPS}
    for kind in _KINDS:
        table, derived = _cases(kind), cases(kind, GROUPS)
        missing = [case_id(kind, *c) for c in derived if c not in table]
        extra = [case_id(kind, *c) for c in table if c not in derived]
        assert table == derived, f"{kind}: not in _OPS {missing[:8]}; not in OpInfo {extra[:8]}"
