"""``slimgrad.report`` names every module with parameters (or state_dict buffers) that ``convert_``
leaves alone, grouped by type, with a reason (NOTE [Coverage in the report] in
``slimgrad/convert.py``): plain torch (GRU, LSTM, SyncBatchNorm in one process and under DDP,
Embedding, a custom module, a conv subclass with its own forward), timm and torchvision layers
(weight-standardised convs, frozen BatchNorms), and tiny timm / HF models whose coverage was low
(issue 30, class 8). The "nothing to save" reasons are checked with the exact tracker.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

import slimgrad
from slimgrad.memory import measure
from tests._threads import one_thread
from tests.conformance._timm_shim import timm

needs_timm = pytest.mark.skipif(timm is None, reason="timm (and torchvision) not installed")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


class Custom(nn.Module):
    def __init__(self, n: int = 6):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.gain


class OwnForwardConv(nn.Conv2d):
    def forward(self, x):
        return super().forward(x) * 2


def _left_alone_lines(rep) -> dict[str, str]:
    # {type name: its "  = <Type> xN (names): reason" line}, from the printed report only
    out = {}
    for line in str(rep).splitlines():
        if line.startswith("  = "):
            kind = line[4:].split(" x", 1)[0]
            assert kind not in out, f"{kind} has two lines:\n{rep}"
            out[kind] = line
    return out


def _holds_state(m: nn.Module) -> bool:
    if any(p is not None for p in m._parameters.values()):
        return True
    return any(
        b.is_floating_point() and k not in m._non_persistent_buffers_set
        for k, b in m._buffers.items()
        if b is not None
    )


def _unconverted_types(model: nn.Module) -> set[str]:
    # every torch module holding state that is not inside a slimgrad replacement (one whose
    # children convert_ converts, CONVERT_CHILDREN, is looked through)
    kinds: set[str] = set()

    def visit(m: nn.Module) -> None:
        if type(m).__module__.startswith("slimgrad."):
            if m is not model and not getattr(m, "CONVERT_CHILDREN", False):
                return
        elif _holds_state(m):
            kinds.add(type(m).__name__)
        for c in m.children():
            visit(c)

    visit(model)
    return kinds


def _assert_covered(model: nn.Module) -> dict[str, str]:
    rep = slimgrad.report(model)
    lines = _left_alone_lines(rep)
    missing = _unconverted_types(model) - set(lines)
    assert not missing, f"left alone but not in the report: {missing}\n{rep}"
    for kind, line in lines.items():
        assert line.split("): ", 1)[1].strip(), f"{kind} has no reason:\n{rep}"
    return lines


def _plain_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 6),  # converts
        nn.GRU(6, 6),
        nn.LSTM(6, 6),
        nn.RNN(6, 6),
        nn.GRUCell(6, 6),
        nn.SyncBatchNorm(6),
        nn.BatchNorm2d(6),  # converts
        Custom(),
        nn.Embedding(10, 6),
        OwnForwardConv(6, 6, 1),
        nn.Conv2d(6, 6, 1),  # converts
        nn.LayerNorm(6),  # converts
    )


REASONS = {
    "GRU": "slimgrad has no RNN op",
    "LSTM": "slimgrad has no RNN op",
    "RNN": "slimgrad has no RNN op",
    "GRUCell": "slimgrad has no RNN op",
    "SyncBatchNorm": "slimgrad's BatchNorm does not sync",
    "Custom": f"no handler for {__name__}.Custom",
    "Embedding": "nothing to save",
    "OwnForwardConv": "a subclass converts only when its forward is its parent's",
}


def test_every_plain_torch_module_left_alone_is_named_with_its_reason():
    model = slimgrad.convert_(_plain_model())
    rep = slimgrad.report(model)
    lines = _assert_covered(model)
    assert set(lines) == set(REASONS), str(rep)
    for kind, why in REASONS.items():
        assert why in lines[kind], lines[kind]
    # the converted ones are not left alone
    converted = {n for n, _, _ in rep.converted}
    assert {"0", "6", "10", "11"} <= converted, str(rep)
    assert not converted & {n for n, _, _ in rep.left_alone}
    assert [n for n, _, _ in rep.left_alone] == ["1", "2", "3", "4", "5", "7", "8", "9"]


def test_report_groups_a_type_on_one_line_and_elides_names():
    model = nn.Sequential(*[Custom() for _ in range(5)], nn.Linear(6, 6))
    slimgrad.convert_(model)
    rep = slimgrad.report(model)
    assert len(rep.left_alone) == 5
    assert _left_alone_lines(rep) == {
        "Custom": f"  = Custom x5 (0, 1, 2, +2 more): no handler for {__name__}.Custom"
    }
    assert "left alone (they run as before): 5 modules with parameters or buffers, of 1 type\n" in (
        str(rep)
    )


def test_a_skipped_module_is_told_once_and_a_parameterless_one_stays_in_skipped():
    model = nn.Sequential(nn.Linear(6, 6), nn.GELU(), OwnForwardConv(6, 6, 1))
    slimgrad.convert_(model, filter_fn=lambda m, n: n != "1")
    rep = slimgrad.report(model)
    text = str(rep)
    assert "  - GELU x1 (1): filter_fn returned False" in text
    assert text.count("OwnForwardConv") == 2  # its line: type, then the reason's class name
    assert [n for n, _, _ in rep.left_alone] == ["2"]


def test_a_parametrized_weight_is_named_with_its_module():
    model = nn.Sequential(
        nn.utils.parametrizations.weight_norm(nn.Linear(4, 4)), nn.MultiheadAttention(4, 2)
    )
    slimgrad.convert_(model)
    lines = _assert_covered(model)
    assert "is parametrized" in lines["ParametrizedLinear"]
    assert "listed with its reason" in lines["ParametrizationList"]
    assert "reads its weight directly" in lines["NonDynamicallyQuantizableLinear"]
    assert (
        "no handler for torch.nn.modules.activation.MultiheadAttention"
        in (lines["MultiheadAttention"])
    )


def test_the_model_itself_is_named():
    model = nn.Linear(4, 4)  # convert_ replaces submodules, not the module it is given
    slimgrad.convert_(model)
    assert "the model itself" in _left_alone_lines(slimgrad.report(model))["Linear"]


def test_sync_batch_norm_single_process_left_as_is_and_exact():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 6, 3), nn.SyncBatchNorm(6), nn.ReLU())
    model = slimgrad.convert_(copy.deepcopy(ref))
    assert type(model[1]) is nn.SyncBatchNorm
    assert "SyncBatchNorm" in _assert_covered(model)
    x = torch.randn(2, 3, 7, 5)
    torch.testing.assert_close(model(x), ref(x))
    torch.testing.assert_close(model[1].running_mean, ref[1].running_mean)


@contextlib.contextmanager
def _process_group(backend: str):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sync_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3), nn.SyncBatchNorm(6), nn.ReLU(), nn.Conv2d(6, 2, 1))


def _check_sync_named(model: nn.Module, name: str) -> None:
    rep = slimgrad.report(model)
    assert (name, "SyncBatchNorm") in {(n, k) for n, k, _ in rep.left_alone}, str(rep)
    assert "does not sync" in _assert_covered(model)["SyncBatchNorm"]


def test_sync_batch_norm_with_a_process_group_is_named():
    # what SyncBatchNorm syncs over is decided at call time; a process group makes no difference
    # to convert_, which leaves it and says why
    with _process_group("gloo"):
        model = slimgrad.convert_(_sync_model())
        assert type(model[1]) is nn.SyncBatchNorm
        _check_sync_named(model, "1")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="DDP with SyncBatchNorm needs CUDA")
def test_sync_batch_norm_under_ddp_is_named():
    with _process_group("nccl"):
        ref = _sync_model().cuda()
        ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(ref), device_ids=[0])
        slimgrad.convert_(ddp)
        assert type(ddp.module[1]) is nn.SyncBatchNorm
        _check_sync_named(ddp, "module.1")
        x = torch.randn(2, 3, 7, 5, device="cuda")
        out, want = ddp(x), ref(x)
        out.square().sum().backward()
        want.square().sum().backward()
        torch.testing.assert_close(out, want)
        for p, q in zip(ddp.module.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)


def test_embedding_eager_keeps_no_float_tensor():
    # the reason "nothing to save": eager's embedding keeps only the (pre-existing) indices
    emb = nn.Embedding(50, 16)
    idx = torch.randint(0, 50, (4, 9))
    m = measure(lambda: emb(idx).sum(), module=emb)
    assert m.saved_bytes == 0
    assert m.saved_input_bytes == idx.numel() * idx.element_size()


@needs_timm
def test_timm_and_torchvision_layers_left_alone_are_named():
    import torchvision

    layers = timm.layers
    torch.manual_seed(0)
    model = nn.Sequential(
        layers.ScaledStdConv2d(3, 6, 3),
        layers.StdConv2d(6, 6, 3),
        torchvision.ops.misc.FrozenBatchNorm2d(6),
        layers.FrozenBatchNormAct2d(6, act_layer=nn.ReLU),
        layers.EvoNorm2dS0(6, group_size=2),
        nn.Conv2d(6, 6, 1),  # converts
        _plain_model(),
    )
    ref = copy.deepcopy(model[:6])
    slimgrad.convert_(model)
    lines = _assert_covered(model)
    assert "standardises its weight in forward" in lines["ScaledStdConv2d"]
    assert "standardises its weight in forward" in lines["StdConv2d"]
    assert "nothing to save" in lines["FrozenBatchNorm2d"]
    assert "nothing to save" in lines["FrozenBatchNormAct2d"]
    assert "no handler for timm.layers.evo_norm.EvoNorm2dS0" in lines["EvoNorm2dS0"]
    assert "Conv2d" not in lines and "LayerNorm" not in lines
    # the left-alone layers compute as before
    x = torch.randn(2, 3, 9, 7)
    torch.testing.assert_close(model[:6](x), ref(x))


@needs_timm
def test_frozen_batch_norm_eager_keeps_per_channel_only():
    # the reason "nothing to save", measured: x * scale + shift keeps the (1, C, 1, 1) scale
    import torchvision

    fbn = torchvision.ops.misc.FrozenBatchNorm2d(6)
    x = torch.randn(4, 6, 9, 7, requires_grad=True)
    m = measure(lambda: fbn(x * 1).sum())
    assert m.saved_bytes == 6 * 4


@needs_timm
def test_children_of_a_block_convert_left_as_is_are_named_inside_it():
    block = timm.models.convnext.ConvNeXtBlock(8, 8)
    model = nn.Sequential(nn.Conv2d(3, 8, 1), block)
    slimgrad.convert_(model, filter_fn=lambda m, n: n != "1")
    rep = slimgrad.report(model)
    lines = _assert_covered(model)
    assert "filter_fn returned False" in lines["ConvNeXtBlock"]  # its own gamma
    assert "inside 1, which convert_ left as is: filter_fn returned False" in lines["Conv2d"]
    assert ("1.conv_dw", "Conv2d") in {(n, k) for n, k, _ in rep.left_alone}


# tiny variants of the models whose coverage issue 30 reports as low, and the types they leave
TIMM_MODELS = {
    "test_efficientnet_evos": {"EvoNorm2dS0"},
    "test_nfnet": {"ScaledStdConv2d"},
    "repvgg_a0": set(),  # train-time branches are conv + BatchNorm: all convert
    "mobileone_s0": set(),
    "fastvit_t8": {"LayerScale2d"},
    "poolformerv2_s12": {"Scale", "StarReLU"},
}


def _mobileone_s0():
    # mobileone_s0 with fewer blocks: its first stage (two depthwise + pointwise MobileOneBlock
    # pairs, the second with its identity BatchNorm branch) and the first pair of each later
    # stage, 10 blocks of 42, of the same types (convert_ took 16 s of CPU on the whole model)
    from timm.models import byobnet

    cfg = byobnet.model_cfgs["mobileone_s0"]
    blocks = (cfg.blocks[0], *(stage[:2] for stage in cfg.blocks[1:]))
    return byobnet.ByobNet(dataclasses.replace(cfg, blocks=blocks), num_classes=3)


def _repvgg_a0():
    # repvgg_a0 with at most two RepVggBlocks a stage (the second with its identity BatchNorm
    # branch), 7 of its 21 stage blocks, of the same types
    from timm.models import byobnet

    cfg = byobnet.model_cfgs["repvgg_a0"]
    blocks = tuple(dataclasses.replace(b, d=min(b.d, 2)) for b in cfg.blocks)
    return byobnet.ByobNet(dataclasses.replace(cfg, blocks=blocks), num_classes=3)


_TIMM_BUILD = {"mobileone_s0": _mobileone_s0, "repvgg_a0": _repvgg_a0}
# one block per stage, of the same types (convert_ took 5.4 s of CPU on the whole fastvit_t8)
_TIMM_KW = {"fastvit_t8": dict(layers=(1, 1, 1, 1))}


@needs_timm
@pytest.mark.parametrize("name", list(TIMM_MODELS))
def test_timm_models_report_every_type_left_alone(name):
    torch.manual_seed(0)
    build = _TIMM_BUILD.get(name)
    kw = _TIMM_KW.get(name, {})
    ref = build() if build else timm.create_model(name, pretrained=False, num_classes=3, **kw)
    model = slimgrad.convert_(copy.deepcopy(ref))
    assert set(_assert_covered(model)) == TIMM_MODELS[name], str(slimgrad.report(model))
    x = torch.randn(1, 3, 64, 64)
    torch.testing.assert_close(model.eval()(x), ref.eval()(x))


def test_hf_convnextv2_reports_grn_and_its_layer_norm():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ConvNextV2Config(
        hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=3, image_size=32
    )
    torch.manual_seed(0)
    ref = transformers.ConvNextV2ForImageClassification(cfg)
    model = slimgrad.convert_(copy.deepcopy(ref))
    lines = _assert_covered(model)
    assert set(lines) == {"ConvNextV2GRN", "ConvNextV2LayerNorm"}, str(slimgrad.report(model))
    assert "no handler for transformers.models.convnextv2" in lines["ConvNextV2GRN"]
    assert "a subclass converts only when its forward is" in lines["ConvNextV2LayerNorm"]
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(model.eval()(x).logits, ref.eval()(x).logits)


def _clip_like(name: str):
    transformers = pytest.importorskip("transformers")
    text = dict(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=16,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    cfg_cls, model_cls = {
        "clip": (transformers.CLIPConfig, transformers.CLIPModel),
        "siglip": (transformers.SiglipConfig, transformers.SiglipModel),
    }[name]
    return model_cls(cfg_cls(text_config=text, vision_config=vision))


@pytest.mark.parametrize(
    "name,own", [("clip", "logit_scale"), ("siglip", "logit_scale, logit_bias")]
)
def test_a_root_whose_attention_a_pattern_changed_names_its_own_parameters(name, own):
    # the HF attention pattern's row names the root ("CLIPModel attention (sdpa)"): it changes the
    # attention function the forward calls, not how the root's own logit_scale is used
    torch.manual_seed(0)
    model = slimgrad.convert_(_clip_like(name))
    kind = type(model).__name__
    assert any(
        n == "" and k.startswith(f"{kind} attention")
        for n, k, _ in slimgrad.report(model).converted
    )
    lines = _assert_covered(model)
    assert kind in lines, str(slimgrad.report(model))
    assert f"its own parameters/buffers ({own})" in lines[kind]
    assert [n for n, k, _ in slimgrad.report(model).left_alone if k == kind] == [""]


class _ActThenOwnCode(nn.Module):
    # the GELU's output goes through the forward's own code (an unknown consumer: NOTE [Keep y
    # only where its consumer keeps it] in slimgrad/nn/_output_act.py), SiLU's straight to a
    # Linear (kept there)
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 8)
        self.tail = nn.Sequential(nn.SiLU(), nn.Linear(8, 4))

    def forward(self, x):
        return self.tail(self.fc2(self.act(self.fc1(x)) * 2))


def test_an_activation_that_runs_eagers_op_for_its_consumer_is_named():
    # issue 30 (SwinV2): a converted GELU whose output its consumer is not known to keep runs
    # eager's op; the report listed it as converted and no more
    from slimgrad.nn._output_act import NOT_KEPT_AFTER

    model = _ActThenOwnCode()
    slimgrad.convert_(model)
    rep = slimgrad.report(model)
    assert ("act", "GELU", NOT_KEPT_AFTER) in rep.eager_op
    assert not [r for r in rep.eager_op if r[0].startswith("tail")]
    assert f"  ~ GELU x1 (act): {NOT_KEPT_AFTER}" in str(rep)
    # and it does: the step keeps what eager's keeps
    x = torch.randn(5, 6)
    eager = _ActThenOwnCode()
    eager.load_state_dict(model.state_dict())
    got = [measure(lambda m=m: m(x).sum(), timeline=False).saved_bytes for m in (model, eager)]
    assert got[0] <= got[1]
