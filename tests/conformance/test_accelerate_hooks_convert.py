"""Modules carrying accelerate's hooks convert, the hook running around the replacement (NOTE [A
replacement carries accelerate's hook] in convert_handlers/accelerate_hooks.py; issue 30, misc30).

``add_hook_to_module`` (``dispatch_model``/``device_map``, ``cpu_offload``) sets the module's
``forward`` on the instance, and the table refused every such module: a ``device_map`` model
converted nothing (GPT-2: 0 of its LayerNorms, Conv1Ds, MLPs and head). Each row converts the
hooked modules, keeps the bytes and the gradients of the same model converted without hooks (bit
for bit), and runs the hook: an offloaded module's weights are loaded before the forward and
unloaded after it.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.memory import measure
from tests._threads import one_thread

accelerate = pytest.importorskip("accelerate")
from accelerate.hooks import (  # noqa: E402
    AlignDevicesHook,
    ModelHook,
    add_hook_to_module,
    attach_align_device_hook,
    remove_hook_from_submodules,
)


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def _net() -> nn.Sequential:
    block = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16))
    return nn.Sequential(block, nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 8))


def _each(make):
    def attach(m):
        for c in m.modules():
            if c is not m:
                add_hook_to_module(c, make())

    return attach


_HOOKS = {
    "AlignDevicesHook_each": _each(lambda: AlignDevicesHook("cpu", io_same_device=True)),
    "ModelHook_each": _each(ModelHook),
    "attach_align_device_hook": lambda m: attach_align_device_hook(m, execution_device="cpu"),
    "cpu_offload": lambda m: accelerate.cpu_offload(m, execution_device="cpu"),
}


def _run(m, x):
    saved = measure(lambda: m(x).pow(2).sum(), timeline=False).saved_bytes
    xi = x.clone().requires_grad_()
    m(xi).pow(2).sum().backward()
    return saved, xi.grad


@pytest.mark.parametrize("how", list(_HOOKS))
def test_hooked_modules_convert_with_the_unhooked_bytes_and_bits(how):
    torch.manual_seed(0)
    eager = _net()
    plain, slim = copy.deepcopy(eager), copy.deepcopy(eager)
    for m in (eager, slim):
        _HOOKS[how](m)
    hooks = {n: c._hf_hook for n, c in slim.named_modules() if "_hf_hook" in c.__dict__}
    for m in (plain, slim):
        slimgrad.convert_(m)
    rep = slimgrad.report(slim)
    assert not rep.skipped and not rep.left_alone, str(rep)
    assert len(rep.converted) == len(slimgrad.report(plain).converted) == 5
    for n, c in slim.named_modules():
        if n in hooks and not isinstance(c, nn.Sequential):  # containers keep theirs
            assert type(c).__module__.startswith("slimgrad."), n
            assert c._hf_hook is hooks[n] and c._old_forward.__self__ is c
    x = torch.randn(64, 8)
    (s_plain, g_plain), (s_slim, g_slim) = _run(plain, x), _run(slim, x)
    s_eager, g_eager = _run(eager, x)
    assert s_slim == s_plain < s_eager
    assert torch.equal(g_slim, g_plain)
    torch.testing.assert_close(g_slim, g_eager)
    if how == "cpu_offload":  # the hook loaded the weights for the forward and unloaded them
        assert all(p.device.type == "meta" for p in slim.parameters())
    else:
        for a, b in zip(plain.parameters(), slim.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)


def test_removing_the_hooks_leaves_the_replacements_plain():
    torch.manual_seed(0)
    slim = _net()
    attach_align_device_hook(slim, execution_device="cpu")
    slimgrad.convert_(slim)
    remove_hook_from_submodules(slim)
    for c in slim.modules():  # accelerate puts back the forward its wrapper ran, as for torch's
        assert not {"_old_forward", "_hf_hook"} & set(c.__dict__)
        assert getattr(c.forward, "__func__", None) is type(c).forward
    x = torch.randn(4, 8)
    torch.testing.assert_close(slim(x), slim[3](slim[2](slim[1](slim[0][1](slim[0][0](x))))))


class _OwnPre(ModelHook):
    def pre_forward(self, module, *args, **kwargs):  # its own: may read anything of the class
        return args, kwargs


def _patched_then_hooked(m):
    lin = m[1]
    lin.forward = lambda x: nn.Linear.forward(lin, x) * 1.0  # set on the instance, then hooked
    add_hook_to_module(lin, ModelHook())


@pytest.mark.parametrize(
    "attach, why",
    [
        (lambda m: add_hook_to_module(m[1], _OwnPre()), "_OwnPre overrides ModelHook's"),
        (_patched_then_hooked, "over a forward set on the instance before the hook"),
    ],
    ids=["own_pre_forward", "patched_before_hook"],
)
def test_a_hook_convert_cannot_state_keeps_the_module(attach, why):
    torch.manual_seed(0)
    slim = _net()
    attach(slim)
    slimgrad.convert_(slim)
    assert type(slim[1]) is nn.Linear
    assert type(slim[3]).__module__.startswith("slimgrad.")  # the others still convert
    reasons = [r for n, _, r in slimgrad.report(slim).left_alone if n == "1"]
    assert len(reasons) == 1 and why in reasons[0], reasons


def _llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            return fn(*args, **kwargs)
        finally:
            logging.disable(logging.NOTSET)


def test_llama_under_dispatch_model_converts_with_the_undispatched_bits():
    # the table's modules and the fused loss (NOTE [The fused loss under accelerate's hooks])
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    got = {}
    for dispatch, convert in [(True, False), (False, True), (True, True)]:
        m = _llama()
        if dispatch:
            dm = {"model": "cpu", "lm_head": "cpu"}
            m = _quiet(accelerate.dispatch_model, m, dm, force_hooks=True)
        if convert:
            slimgrad.convert_(m)
        saved = measure(lambda m=m: m(input_ids=ids, labels=ids).loss, timeline=False).saved_bytes
        m.zero_grad(set_to_none=True)
        m(input_ids=ids, labels=ids).loss.backward()
        rows = sorted(slimgrad.report(m).converted) if convert else None
        got[dispatch, convert] = (rows, saved, {n: p.grad for n, p in m.named_parameters()})
    (rows0, _, g0), (rows1, s1, g1) = got[False, True], got[True, True]
    assert rows1 == rows0
    kinds = {k for _, k, _ in rows1}
    assert kinds >= {"LlamaRMSNorm", "Linear", "LlamaMLP", "LlamaForCausalLM.forward"}
    assert s1 < got[True, False][1]  # below the dispatched eager model's
    assert g1.keys() == g0.keys()
    for n in g0:
        assert torch.equal(g1[n], g0[n]), n


def test_offloaded_llama_keeps_hfs_forward_with_the_reason():
    m = _llama()
    _quiet(accelerate.cpu_offload, m, execution_device="cpu")
    slimgrad.convert_(m)
    rows = {k: r for _, k, r in slimgrad.report(m).skipped}
    assert "offloads weights" in rows["LlamaForCausalLM.forward"]
    assert type(m.model.layers[0].mlp.down_proj).__module__.startswith("slimgrad.")


def test_hooked_activation_after_a_batch_norm_runs_as_the_pattern_replacement():
    # the batch_norm pattern's replacement copies the module's dict: the hook's wrapper came along
    # bound to the original ReLU, which then ran (eager's 3,968 B where the pair keeps 2,400 B)
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3))
    plain, slim = copy.deepcopy(eager), copy.deepcopy(eager)
    for m in (eager, slim):
        _each(lambda: AlignDevicesHook("cpu"))(m)
    for m in (plain, slim):
        slimgrad.convert_(m)
    assert type(slim[2]).__name__ == "ReLUAfterNorm"
    assert slim[2].forward.args[0] is slim[2] and slim[2]._old_forward.__self__ is slim[2]
    x = torch.randn(2, 3, 9, 9)
    (s_plain, g_plain), (s_slim, g_slim) = _run(plain, x), _run(slim, x)
    assert s_slim == s_plain < _run(eager, x)[0]
    assert torch.equal(g_slim, g_plain)
