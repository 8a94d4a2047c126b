"""What the OpInfo suite expects beyond "same as eager" (see tests/opinfo/_harness.py).

REFUSED: samples a slimgrad op does not support. The op must raise a slimgrad error naming it.
    {op key: [(regex over the check's description, regex over the error message)]}; the
    description is "<check> <op> <dtype> #<index> (<sample>)", e.g.
    "double conv2d f64 #3 (T[1, 1, 4, 4], T[1, 1, 3, 3], ...)". An entry that matches a sample
    slimgrad then computes fails (StaleRefusal), so the list stays exact.

KNOWN: findings still open, as strict xfails: {"<kind>:<op>-<dtype>-<index>": reason}.
"""

# Second derivatives: issue 15 allows "eager's second derivatives or a clear slimgrad error";
# these ops raise the error (tests/opinfo checks it is raised, names the op, and nothing else).
# Either form: the op's own message, or _autograd.first_order's refusing node.
_DOUBLE = r"^(double|gradgradcheck) "


def _double_refused(api: str) -> str:
    return (
        rf"^slimgrad\.{api}: (double backward is not supported|"
        r"a second derivative through this op was requested)"
    )


REFUSED: dict[str, list[tuple[str, str]]] = {
    "gelu": [(_DOUBLE, _double_refused(r"(ops\.)?gelu"))],
    "silu": [(_DOUBLE, _double_refused(r"(ops\.)?silu"))],
    "mish": [(_DOUBLE, _double_refused(r"(ops\.)?mish"))],
    "layer_norm": [(_DOUBLE, _double_refused(r"ops\.layer_norm"))],
    # rms_norm keeps y (not x) in every OpInfo sample: first_order's refusing node
    "rms_norm": [(_DOUBLE, _double_refused(r"ops\.rms_norm"))],
    # group_norm refuses on its own path; samples it sends to eager's F.group_norm
    # (#0-15, #20 here) differentiate twice like eager.
    "group_norm": [
        (
            r"^(double|gradgradcheck) group_norm f64 #(1[6-9]|2[1-9]|3[0-2]) ",
            _double_refused(r"ops\.group_norm"),
        )
    ],
}


def _ids(prefix: str, indices: list[int], reason: str) -> list[tuple[str, str]]:
    return [(f"{prefix}-{i}", reason) for i in indices]


# Open findings (see /work/notes/opinfo_findings.md for messages and reproducers). Generated
# from `python -m tests.opinfo._report` (<out>.known), reasons written by hand.
_NONE2 = (
    "silent None in double backward: d/dinput of <grads, v> is None where eager's is nonzero "
    "(the backward is not differentiable and does not refuse; issue 15 double backward)"
)
_BN_EMPTY = (
    "batch_norm refuses an empty 1-D input eager accepts: 'running_mean should contain one "
    "element per channel; expected 1 elements, got 0'"
)
_CONV_RANK = (
    "conv with padding='same' and a weight of another rank: aten's stride message instead of "
    "eager's 'Expected N-dimensional input for N-dimensional weight'"
)
_GELU_TYPE = "gelu: unknown approximate raises ValueError; eager raises RuntimeError"
_GN_RULE = (
    "group_norm grad weight (20, 6, 10, 10), 6 groups, f32: max|out-ref64| 1.022e-05 > "
    "2 max|eager-ref64| + atol = 1.014e-05"
)

KNOWN: dict[str, str] = dict(
    [
        *_ids("error:gelu-err", [0], _GELU_TYPE),
        *_ids("sample:group_norm-f32", [27], _GN_RULE),
        *_ids("sample:batch_norm-f64", [3, 4], _BN_EMPTY),
        *_ids("sample:batch_norm-f32", [3, 4], _BN_EMPTY),
        *_ids("sample:batch_norm-bf16", [3, 4], _BN_EMPTY),
        *_ids("sample:batch_norm-f16", [3, 4], _BN_EMPTY),
        *_ids("noncontig:batch_norm-f32", [3, 4], _BN_EMPTY),
        *_ids("f64:batch_norm-f64", [3, 4], _BN_EMPTY),
        *_ids("f64:batch_norm-f64", [0, 1, 2, 5, 6, 7, 8, 9, 10, 11], _NONE2),
        *_ids("f64:conv1d-f64", list(range(10)), _NONE2),
        *_ids("f64:conv2d-f64", list(range(30)), _NONE2),
        *_ids("f64:conv3d-f64", list(range(20)), _NONE2),
        *_ids("f64:conv_transpose1d-f64", list(range(10)), _NONE2),
        *_ids("f64:conv_transpose2d-f64", list(range(12)), _NONE2),
        *_ids("f64:conv_transpose3d-f64", list(range(10)), _NONE2),
        *_ids("error:conv2d-err", [5], _CONV_RANK),
        *_ids("error:conv3d-err", [5], _CONV_RANK),
    ]
)


# Gradient subsets not run because eager PyTorch itself crashes the process on them (a segfault
# cannot be caught; both sides would die): {(op key, variant): reason}. The subsets that include
# the input still run.
#   torch 2.13 CPU: F.group_norm on a channels_last (20, 6, 10, 10) input that does not require
#   grad, with weight or bias requiring grad, segfaults in backward (eager; slimgrad's group_norm
#   takes eager's path for non-contiguous inputs, so it crashes the same way).
EAGER_SEGFAULTS_WITHOUT_INPUT_GRAD: dict[tuple[str, str], str] = {
    ("group_norm", "channels_last"): "eager F.group_norm backward segfaults (weight/bias only)",
}
