"""What Dynamo guards on for a compiled converted HF RMSNorm (NOTE [What a compiled HF RMSNorm
reads] in ``slimgrad/ops/rms_norm.py``): every guard is checked on every compiled call, so the
trace reads only what decides the lean case, and the side op is called through its OpOverload."""

from __future__ import annotations

import pytest
import torch

import slimgrad
from tests._dynamo_guards import guards

pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402


class _Norms(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norms = torch.nn.ModuleList([LlamaRMSNorm(64) for _ in range(5)])

    def forward(self, x):
        for n in self.norms:
            x = n(x) * 1.5
        return x.sum()


def _compiled_guards(model, x):
    torch._dynamo.reset()
    try:
        f = torch.compile(model, backend="eager")
        f(x).backward()
        f(x).backward()
        return guards()
    finally:
        torch._dynamo.reset()


def test_compiled_hf_rms_norm_reads_only_its_lean_case():
    torch.manual_seed(0)
    model = _Norms()
    slimgrad.convert_(model)
    x = torch.randn(2, 64, 64, requires_grad=True)
    guards = _compiled_guards(model, x)
    ops = [s for s, _ in guards if "ops_dot_rms_norm" in s]
    assert ops  # the walk sees the op module's guards
    # the straight path's gate, the DTensor registry, the TorchScript check and the side op's
    # wrapper objects are no longer read (before: 154 guards here, 127 now; eager: 56)
    for name in ("straight", "_dtensor", "refuse_jit", "_hf_side", "direct_call_ok"):
        assert not [s for s in ops if name in s], [s for s in ops if name in s]
    # 145 since the neighbour-hook check (NOTE [Hooks registered after convert_ on the modules
    # around] in nn/_hooks.py): 18 more, per norm that its instance holds no near_hooks/near_free
    # (2 each), once the class defaults and the polyfills of Dynamo's tuple/dict comparison
    assert sum(n for _, n in guards) <= 145


def test_compiled_hf_rms_norm_still_takes_the_general_path_when_not_lean():
    # no grad needed: HF's own ops, as before (no slimgrad Function, nothing saved)
    torch.manual_seed(0)
    model = _Norms()
    ref = _Norms()
    ref.load_state_dict(model.state_dict())
    slimgrad.convert_(model)
    x = torch.randn(2, 64, 64)
    torch._dynamo.reset()
    try:
        out = torch.compile(model, backend="eager")(x)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(out, ref(x), rtol=0, atol=0)
