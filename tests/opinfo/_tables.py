"""What the OpInfo suite expects beyond "same as eager" (see tests/opinfo/_harness.py).

REFUSED: samples a slimgrad op does not support. The op must raise a slimgrad error naming it.
    {op key: [(regex over the check's description, regex over the error message)]}; the
    description is "<check> <op> <dtype> #<index> (<sample>)", e.g.
    "double conv2d f64 #3 (T[1, 1, 4, 4], T[1, 1, 3, 3], ...)". An entry that matches a sample
    slimgrad then computes fails (StaleRefusal), so the list stays exact.

KNOWN: findings still open, as strict xfails: {"<kind>:<op>-<dtype>-<index>": reason}.
"""

# Second derivatives: issue 15 allows "eager's second derivatives or a clear slimgrad error".
# None refused: silu and mish refused them on empty samples (a 0 in the shape: neither y, bits nor
# x kept) until an activation on a leaf that requires grad kept the leaf, as eager (NOTE [An input
# the graph holds] in slimgrad/ops/_output_act.py); the samples are such leaves, so eager's
# second derivatives are compared there now.
REFUSED: dict[str, list[tuple[str, str]]] = {}


def _ids(prefix: str, indices: list[int], reason: str) -> list[tuple[str, str]]:
    return [(f"{prefix}-{i}", reason) for i in indices]


# Open findings (see /work/notes/opinfo_findings.md for messages and reproducers). Generated
# from `python -m tests.opinfo._report` (<out>.known) as `*_ids(prefix, indices, reason)` rows,
# reasons written by hand. None open: the last one, sample:group_norm-f32-27 (dgamma over the
# rule), is fixed in ops/group_norm.py (NOTE [GroupNorm's fallback channels]).
KNOWN: dict[str, str] = {}


# Gradient subsets not run because eager PyTorch itself crashes the process on them (a segfault
# cannot be caught; both sides would die): {(op key, variant): reason}. The subsets that include
# the input still run.
#   torch 2.13 CPU: F.group_norm on a channels_last (20, 6, 10, 10) input that does not require
#   grad, with weight or bias requiring grad, segfaults in backward (eager; slimgrad's group_norm
#   takes eager's path for non-contiguous inputs, so it crashes the same way).
EAGER_SEGFAULTS_WITHOUT_INPUT_GRAD: dict[tuple[str, str], str] = {
    ("group_norm", "channels_last"): "eager F.group_norm backward segfaults (weight/bias only)",
}
