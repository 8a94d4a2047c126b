"""What Dynamo guards on for a compiled converted HF RMSNorm (NOTE [What a compiled HF RMSNorm
reads] in ``slimgrad/ops/rms_norm.py``): every guard is checked on every compiled call, so the
trace reads only what decides the lean case, and the side op is called through its OpOverload."""

from __future__ import annotations

import pytest
import torch

import slimgrad

pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402


def _guards() -> list[tuple[str, int]]:
    # (source, leaf guards) over every compiled frame's cache entries (torch-private API)
    try:
        from torch._C._dynamo.guards import DictGuardManager
        from torch._dynamo.convert_frame import input_codes
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        pytest.skip("this torch has no cache-entry debug API")
    out: list[tuple[str, int]] = []

    def walk(mgr):
        if mgr.get_leaf_guards():
            out.append((mgr.get_source(), len(mgr.get_leaf_guards())))
        kids = list(mgr.get_child_managers())
        if isinstance(mgr, DictGuardManager):
            kids += [m for kv in mgr.get_key_value_managers().values() for m in kv if m]
        for k in kids:
            walk(k)

    for ref in input_codes.seen:
        code = ref()
        for entry in _debug_get_cache_entry_list(code) if code is not None else ():
            walk(entry.guard_manager.root)
    return out


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
        return _guards()
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
