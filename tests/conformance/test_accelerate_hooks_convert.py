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
import functools

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.convert_handlers import accelerate_hooks as _accelerate_hooks
from slimgrad.convert_handlers import device_rule
from slimgrad.memory import measure
from tests._threads import one_thread_each_test  # noqa: F401 (an autouse fixture)
from tests.conformance._accelerate_nets import each as _each
from tests.conformance._accelerate_nets import llama as _llama
from tests.conformance._accelerate_nets import net as _net
from tests.conformance._accelerate_nets import quiet as _quiet

accelerate = pytest.importorskip("accelerate")
from accelerate.hooks import (  # noqa: E402
    AlignDevicesHook,
    CpuOffload,
    ModelHook,
    add_hook_to_module,
    attach_align_device_hook,
    remove_hook_from_submodules,
)

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


_MAPS = {
    "cpu": {"model": "cpu", "lm_head": "cpu"},
    # the layer's weights on meta between its calls, loaded by its hooks (offload_dir)
    "disk": {
        "model.embed_tokens": "cpu",
        "model.layers.0": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    },
}


@pytest.mark.hf_release
def test_llama_under_dispatch_model_converts_with_the_undispatched_bits(tmp_path):
    # the table's modules, the attention and the fused loss (NOTE [The fused loss under
    # accelerate's hooks]). A layer on disk turned every decision to meta's (NOTE [The device a
    # module runs on]): the attention stayed SDPA and the loss HF's, so none of the gradients were
    # the undispatched converted model's
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    got = {}
    for where, convert in [(None, True), ("cpu", False), ("cpu", True), ("disk", False)]:
        got[where, convert] = _llama_step(where, convert, ids, tmp_path)
    got["disk", True] = _llama_step("disk", True, ids, tmp_path, targets=(("cpu", torch.float32),))
    rows0, _, loss0, g0 = got[None, True]
    kinds = {k for _, k, _ in rows0}
    assert kinds >= {
        "LlamaRMSNorm",
        "Linear",
        "LlamaMLP",
        "LlamaForCausalLM.forward",
        "LlamaForCausalLM attention (sdpa)",
    }
    savings = []
    for where in _MAPS:
        (rows, saved, loss, g), (_, eager_saved, _, g_eager) = got[where, True], got[where, False]
        assert rows == rows0, where
        assert torch.equal(loss, loss0), where
        offloaded = {n for n, v in g_eager.items() if v is None}  # eager's too: loaded per call
        assert offloaded == {n for n, v in g.items() if v is None}, where
        assert g.keys() == g0.keys() and bool(offloaded) == (where == "disk")
        for n in g0.keys() - offloaded:
            assert torch.equal(g[n], g0[n]), (where, n)
        savings.append(eager_saved - saved)
    assert savings[0] == savings[1] > 0  # measured 19,716 B of 42,228 (disk: of 79,348)


def _llama_step(where, convert, ids, tmp_path, targets=None):
    m = _llama()
    if where is not None:
        off = tmp_path / f"{where}-{convert}"
        m = _quiet(accelerate.dispatch_model, m, _MAPS[where], offload_dir=off, force_hooks=True)
    if convert:
        slimgrad.convert_(m)
        if targets is not None:
            assert slimgrad.report(m).targets == targets
    saved = measure(lambda: m(input_ids=ids, labels=ids).loss, timeline=False).saved_bytes
    m.zero_grad(set_to_none=True)
    loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    rows = sorted(slimgrad.report(m).converted) if convert else None
    return rows, saved, loss.detach(), {n: p.grad for n, p in m.named_parameters()}


def test_offloaded_llama_keeps_hfs_forward_with_the_reason():
    # cpu_offload offloads the head too: the fused loss, which reads its weight without calling
    # it, would read meta; the rest converts, the attention included
    m = _llama()
    _quiet(accelerate.cpu_offload, m, execution_device="cpu")
    slimgrad.convert_(m)
    rows = {k: r for _, k, r in slimgrad.report(m).skipped}
    assert (
        "the head's Linear is offloaded by an accelerate hook" in rows["LlamaForCausalLM.forward"]
    )
    assert type(m.model.layers[0].mlp.down_proj).__module__.startswith("slimgrad.")
    kinds = {k for _, k, _ in slimgrad.report(m).converted}
    assert "LlamaForCausalLM attention (sdpa)" in kinds


def _offload_to_cuda(m):
    # no CUDA call: the weights go to meta (a CPU copy in the weights map) until a forward
    attach_align_device_hook(m, execution_device="cuda", offload=True)


@pytest.mark.parametrize(
    "attach, device",
    [
        (lambda m: None, "cpu"),
        (lambda m: accelerate.cpu_offload(m, execution_device="cpu"), "cpu"),
        (_offload_to_cuda, "cuda"),
        (lambda m: add_hook_to_module(m, CpuOffload(execution_device="cuda")), "cuda"),
    ],
    ids=["no_hook", "cpu_offload", "offload_to_cuda", "CpuOffload_cuda"],
)
def test_the_device_rule_decides_for_the_hooks_execution_device(attach, device):
    # NOTE [The device a module runs on]: read from the weights, cpu_offload's decided for meta
    # and a hook running the net on cuda for cpu (CpuOffload) or meta
    m = _net()
    attach(m)
    assert device_rule.targets(m) == ((device, torch.float32),)


@pytest.mark.parametrize(
    "current, same, other",
    [(None, ["cuda", 0, "cuda:0"], "cuda:1"), (1, ["cuda", 1, "cuda:1"], "cuda:0")],
    ids=["cuda_not_initialised", "current_device_1"],
)
def test_an_accelerator_without_an_index_is_its_current_device(monkeypatch, current, same, other):
    # "cuda" and "cuda:0" counted as two devices, refusing the fused loss (no CUDA call: offload
    # puts the weights on meta until a forward)
    if current is not None:
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    for devices, why in [(same, None), ([*same, other], "several devices")]:
        m = _net()
        for c, d in zip([m[0][0], m[1], m[3], m[0][1]], devices, strict=False):
            attach_align_device_hook(c, execution_device=d, offload=True)
        got = _accelerate_hooks.one_device_reason(m)
        assert got is None if why is None else why in got, (devices, got)


def test_a_module_that_would_run_on_meta_is_a_convert_error():
    # "meta" in a device_map makes it accelerate's main device: every hook runs on meta, which
    # fails in eager only when the output goes back to the input's device, and in a converted
    # LayerNorm with autocast's "unknown device type"
    m = _quiet(
        accelerate.dispatch_model,
        _net(),
        {"0": "cpu", "1": "meta", "2": "cpu", "3": "cpu"},
        force_hooks=True,
    )
    with pytest.raises(
        RuntimeError,
        match=r"^slimgrad\.convert_: module '0\.0' \(Linear\) \(and '0\.1', '1', '3'\) would "
        r"run on meta: its accelerate hook's execution device is meta, which holds no data; "
        r"expected .* got meta\. Map it to 'cpu', 'disk' or an accelerator in the device_map",
    ):
        slimgrad.convert_(m)
    m = _net()  # an ancestor's hook placing its submodules on meta
    add_hook_to_module(m[0], AlignDevicesHook("meta", place_submodules=True))
    with pytest.raises(RuntimeError, match=r"module '0\.0' .*\(and '0\.1'\) .*hook of '0' places"):
        slimgrad.convert_(m)


def _each_align_naming_none(m):
    _each(lambda: AlignDevicesHook(io_same_device=True))(m)


@pytest.mark.parametrize(
    "build",
    [lambda: torch.device("meta"), lambda: accelerate.init_empty_weights()],
    ids=["device_meta", "init_empty_weights"],
)
@pytest.mark.parametrize(
    "attach",
    [lambda m: None, _each(ModelHook), _each_align_naming_none],
    ids=["no_hook", "ModelHook", "AlignDevicesHook_no_device"],
)
def test_tensors_on_meta_no_hook_places_convert_as_without_hooks(build, attach):
    # built on meta to plan or estimate: init_empty_weights keeps the buffers on cpu, which made
    # the meta parameters an error where a wholly-meta net converted (no hook names a device)
    with build():
        m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3))
    attach(m)
    slimgrad.convert_(m)
    assert len(slimgrad.report(m).converted) == 4


def test_weights_on_meta_under_another_modules_hook_convert_as_without_hooks():
    # no hook places module 3: its weights' meta is the device rule's to decide, as without hooks
    m = _net()
    attach_align_device_hook(m[1], execution_device="cpu")
    m[3].to("meta")
    slimgrad.convert_(m)
    assert len(slimgrad.report(m).converted) == 5
    assert set(device_rule.targets(m)) == {("cpu", torch.float32), ("meta", torch.float32)}


def _wrapped(fn):
    @functools.wraps(fn)
    def w(*args, **kwargs):
        return fn(*args, **kwargs)

    return w


@pytest.mark.parametrize(
    "wrap",
    [_wrapped, lambda fn: torch.compile(fn, backend="eager")],
    ids=["functools_wraps", "torch_compile"],
)
def test_a_forward_wrapped_over_an_offload_hook_runs_where_the_hook_places_it(wrap):
    # the wrapper still calls accelerate's, whose hook loads the weights for each call: the
    # module runs on the hook's device (convert_ refused it as running on meta)
    torch.manual_seed(0)
    eager = _net()
    slim = copy.deepcopy(eager)
    for m in (eager, slim):
        accelerate.cpu_offload(m, execution_device="cpu")
        m[1].forward = wrap(m[1].forward)
    slimgrad.convert_(slim)
    assert slimgrad.report(slim).targets == (("cpu", torch.float32),)
    assert type(slim[1]) is nn.Linear and type(slim[3]).__module__ == "slimgrad.nn.linear"
    x = torch.randn(4, 8)
    (_, g_eager), (_, g_slim) = _run(eager, x), _run(slim, x)
    torch.testing.assert_close(g_slim, g_eager)


def test_an_offloaded_module_returning_to_the_input_device_keeps_the_unhooked_bits():
    # offload=True with io_same_device=True: the weights loaded for the call and unloaded after,
    # the output sent back to the input's device
    torch.manual_seed(0)
    eager = _net()
    unhooked, plain, slim = copy.deepcopy(eager), copy.deepcopy(eager), copy.deepcopy(eager)
    for m in (eager, slim):
        add_hook_to_module(m[1], AlignDevicesHook("cpu", offload=True, io_same_device=True))
    for m in (plain, slim):
        slimgrad.convert_(m)
    assert type(slim[1]).__module__ == "slimgrad.nn.linear"
    assert slim[1].weight.is_meta
    x = torch.randn(64, 8)
    saved = {}
    for k, m in {"eager": eager, "unhooked": unhooked, "plain": plain, "slim": slim}.items():
        saved[k] = measure(lambda m=m: m(x).pow(2).sum(), timeline=False).saved_bytes
    assert saved["eager"] - saved["slim"] == saved["unhooked"] - saved["plain"] > 0
    outs = {}
    for k, m in {"plain": plain, "slim": slim}.items():
        xi = x.clone().requires_grad_()
        y = m[1](m[0](xi))
        out = m(xi)
        out.pow(2).sum().backward()
        outs[k] = (y, out, xi.grad)
    assert outs["slim"][0].device == x.device and slim[1].weight.is_meta
    for a, b in zip(outs["plain"], outs["slim"], strict=True):
        assert torch.equal(a, b)
    for i in (0, 3):  # the modules the hook leaves alone
        for a, b in zip(plain[i].parameters(), slim[i].parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)


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


def test_verify_names_the_offloaded_gradients_it_cannot_compare():
    # the offload hook loads a copy of the weights for each call and the gradient goes to it:
    # verify compared 6 of 8 gradients and said OK without naming the other 2
    torch.manual_seed(0)
    eager = _net()
    attach_align_device_hook(eager[1], execution_device="cpu", offload=True)
    slim = copy.deepcopy(eager)
    slimgrad.convert_(slim)
    rep = slimgrad.verify(eager, slim, torch.randn(4, 8), padded=False, modes=("train",))
    assert rep.ok, str(rep)
    assert len(rep.grads) == 6
    notes = [n for n in rep.runs[0].notes if "not compared" in n]
    assert len(notes) == 1 and notes[0].startswith(
        "2 parameter gradient(s) not compared ('1.weight', '1.bias'): an accelerate hook offloads"
    ), rep.runs[0].notes
