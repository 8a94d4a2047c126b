"""verify leaves the original model as it found it, and puts the converted one back.

NOTE [verify leaves the models as it found them] (src/slimgrad/verify.py). The models here keep an
eval-time cache the way timm's LeViT, EfficientViT and EfficientFormer do: in eval mode the
attention bias ``table[:, idx]`` (a non-leaf tensor when autograd is on) is stored in a dict
attribute, which ``copy.deepcopy`` then refuses.
"""

import copy

import pytest
import torch
import torch.nn as nn

import slimgrad


class _CachedBias(nn.Module):
    """LeViT's attention-bias cache in plain torch: ``table[:, idx]`` kept per device in eval."""

    def __init__(self, n: int = 6, heads: int = 2):
        super().__init__()
        self.table = nn.Parameter(torch.randn(heads, n))
        self.register_buffer("idx", torch.randint(0, n, (n, n)), persistent=False)
        self.cache: dict[str, torch.Tensor] = {}
        self.qk = nn.Linear(n, n)

    def bias(self, device: torch.device) -> torch.Tensor:
        if self.training:
            return self.table[:, self.idx]
        key = str(device)
        if key not in self.cache:
            self.cache[key] = self.table[:, self.idx]  # non-leaf with autograd on
        return self.cache[key]

    @torch.no_grad()
    def train(self, mode: bool = True):
        super().train(mode)
        if mode and self.cache:
            self.cache = {}  # timm clears (rebinds) the cache when training starts
        return self

    def forward(self, x):  # x: (batch, n, n)
        attn = self.qk(x).unsqueeze(1) + self.bias(x.device)  # (batch, heads, n, n)
        return attn.softmax(-1).sum(1)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = _CachedBias()
        self.bn = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(6, 3)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.last_seen = None  # an attribute a forward rebinds

    def forward(self, x):
        h = self.attn(x) + self.frozen(x)
        self.last_seen = h.shape[0]
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        return self.head(self.drop(h))


def _state(m: nn.Module) -> dict:
    # everything verify could change: values and identities of parameters, buffers, .grad,
    # requires_grad, every module's mode and its own attributes (caches included, by identity
    # and content)
    def attrs(mod):
        out = {}
        for k, v in vars(mod).items():
            if k in ("_parameters", "_buffers", "_modules") or k.endswith("hooks"):
                continue
            out[k] = (id(v), dict(v) if type(v) is dict else v)
        return out

    return {
        "params": {
            n: (
                id(p),
                p.detach().clone(),
                p.requires_grad,
                None if p.grad is None else p.grad.clone(),
            )
            for n, p in m.named_parameters()
        },
        "buffers": {n: (id(b), b.clone()) for n, b in m.named_buffers()},
        "modes": {n: mod.training for n, mod in m.named_modules()},
        "attrs": {n: attrs(mod) for n, mod in m.named_modules()},
    }


def _assert_same_state(before: dict, after: dict) -> None:
    assert before["modes"] == after["modes"]
    assert before["params"].keys() == after["params"].keys()
    for n, (i, v, rg, g) in before["params"].items():
        i2, v2, rg2, g2 = after["params"][n]
        assert (i, rg) == (i2, rg2), n
        torch.testing.assert_close(v2, v, rtol=0, atol=0)
        assert (g is None) == (g2 is None), n
        if g is not None:
            torch.testing.assert_close(g2, g, rtol=0, atol=0)
    assert before["buffers"].keys() == after["buffers"].keys()
    for n, (i, v) in before["buffers"].items():
        i2, v2 = after["buffers"][n]
        assert i == i2, n
        torch.testing.assert_close(v2, v, rtol=0, atol=0)
    assert before["attrs"].keys() == after["attrs"].keys()
    for n, a in before["attrs"].items():
        b = after["attrs"][n]
        assert a.keys() == b.keys(), (n, set(a) ^ set(b))
        for k, (i, v) in a.items():
            i2, v2 = b[k]
            assert i == i2, (n, k)
            if isinstance(v, dict):
                assert v.keys() == v2.keys() and all(v[x] is v2[x] for x in v), (n, k)
            else:
                assert v is v2 or v == v2, (n, k)


def _prepared(model: nn.Module) -> nn.Module:
    # a caller's model mid-training: accumulated .grad, a submodule in another mode than its parent
    torch.manual_seed(1)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    model.train()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.eval()
    return model


@pytest.mark.parametrize("modes", [("train", "eval"), ("eval",), ("eval", "train")])
def test_the_original_and_the_converted_model_are_left_as_they_were(modes):
    torch.manual_seed(0)
    m = _prepared(_Net())
    conv = _prepared(copy.deepcopy(m))
    x = torch.randn(4, 6, 6)
    before, before_c = _state(m), _state(conv)
    rep = slimgrad.verify(m, conv, x, modes=modes)
    assert rep.ok, str(rep)
    _assert_same_state(before, _state(m))
    _assert_same_state(before_c, _state(conv))
    assert m.attn.cache == {} and conv.attn.cache == {}
    copy.deepcopy(m)  # a non-leaf cache left behind makes this raise
    copy.deepcopy(conv)
    # the original is never run: BatchNorm's statistics are where the caller left them
    torch.testing.assert_close(m.bn.running_mean, torch.zeros(6), rtol=0, atol=0)
    assert int(m.bn.num_batches_tracked) == 0


def test_a_cache_the_caller_made_is_kept_and_the_copies_see_the_model_as_it_is():
    # an eval cache made under no_grad (a leaf, deep-copyable) stays, object and value
    torch.manual_seed(0)
    m = _Net().eval()
    x = torch.randn(4, 6, 6)
    with torch.no_grad():
        m(x)
    cached = m.attn.cache["cpu"]
    conv = copy.deepcopy(m)
    before, before_c = _state(m), _state(conv)
    rep = slimgrad.verify(m, conv, x, modes=("train", "eval"))
    assert rep.ok, str(rep)
    _assert_same_state(before, _state(m))
    _assert_same_state(before_c, _state(conv))
    assert m.attn.cache["cpu"] is cached


def test_an_original_holding_a_non_leaf_cache_is_refused_with_the_place():
    torch.manual_seed(0)
    m = _Net().eval()
    conv = copy.deepcopy(m)
    m(torch.randn(4, 6, 6))  # eval forward with autograd on: a non-leaf cache
    with pytest.raises(RuntimeError, match=r"slimgrad.verify: cannot copy the original model") as e:
        slimgrad.verify(m, conv, torch.randn(4, 6, 6))
    assert "autograd history in attribute attn.cache['cpu']" in str(e.value)
    m.train()  # clears the cache, as timm's modules do
    assert slimgrad.verify(m, conv, torch.randn(4, 6, 6)).ok


def test_a_wrong_cache_in_the_converted_model_still_fails():
    # the copies do not hide a converted model whose eval cache is wrong
    torch.manual_seed(0)
    m = _Net()
    bad = copy.deepcopy(m)

    class Stale(_CachedBias):
        def bias(self, device):
            return super().bias(device) if self.training else self.table.detach()[:, self.idx]

    stale = Stale()
    stale.load_state_dict(m.attn.state_dict())
    stale.idx = m.attn.idx.clone()
    bad.attn = stale
    rep = slimgrad.verify(m, bad, torch.randn(4, 6, 6))
    assert [r.ok for r in rep.runs] == [True, False], str(rep)
    assert [g.name for g in rep.runs[1].grads if not g.ok] == ["attn.table"]


# --- timm's models with eval-time attention-bias caches --------------------------------------


def _timm_builds():
    from tests.conformance._timm_shim import timm

    if timm is None:
        return {}
    from timm.models.efficientformer import EfficientFormer
    from timm.models.efficientvit_msra import EfficientVitMsra
    from timm.models.levit import Levit

    return {  # tiny configs (seconds on CPU); EfficientFormer's bias grid is fixed at 7x7 (224)
        "levit": (
            lambda: Levit(
                img_size=32,
                num_classes=5,
                embed_dim=(16, 24),
                key_dim=8,
                depth=(1, 1),
                num_heads=(2, 2),
            ),
            32,
        ),
        "efficientvit_msra": (
            lambda: EfficientVitMsra(
                img_size=32,
                num_classes=5,
                embed_dim=(16, 24, 32),
                key_dim=(4, 4, 4),
                depth=(1, 1, 1),
                num_heads=(2, 2, 2),
                window_size=(2, 2, 2),
            ),
            32,
        ),
        "efficientformer": (
            lambda: EfficientFormer(
                depths=(1, 1, 1, 1), embed_dims=(8, 8, 16, 16), num_vit=1, num_classes=5
            ),
            224,
        ),
    }


@pytest.fixture
def _one_thread():
    # as tests/conformance/test_timm.py: small grouped float64 convs crawl with more intra-op
    # threads on a loaded box
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["levit", "efficientvit_msra", "efficientformer"])
def test_timm_models_with_attention_bias_caches_are_left_as_they_were(name, _one_thread):
    builds = _timm_builds()
    if not builds:
        pytest.skip("timm is not installed")
    build, size = builds[name]
    torch.manual_seed(0)
    m = _prepared(build())
    conv = _prepared(slimgrad.convert_(copy.deepcopy(m)))
    caches = [mod for mod in m.modules() if hasattr(mod, "attention_bias_cache")]
    assert caches  # the model has the cache this test is about
    before, before_c = _state(m), _state(conv)
    rep = slimgrad.verify(m, conv, torch.randn(2, 3, size, size))
    assert rep.ok, str(rep)
    _assert_same_state(before, _state(m))
    _assert_same_state(before_c, _state(conv))
    assert all(mod.attention_bias_cache == {} for mod in caches)
    copy.deepcopy(m)
    copy.deepcopy(conv)


def test_verify_leaves_the_callers_rng_streams_as_they_were():
    import slimgrad

    torch.manual_seed(123)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Dropout(0.3), torch.nn.Linear(6, 2))
    lean = slimgrad.convert_(copy.deepcopy(model))
    x = torch.randn(4, 6)
    state = torch.random.get_rng_state()
    expected = torch.rand(5)
    torch.random.set_rng_state(state)
    assert slimgrad.verify(model, lean, (x,)).ok
    torch.testing.assert_close(torch.rand(5), expected, rtol=0, atol=0)
