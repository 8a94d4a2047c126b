"""The gated MLP under autocast (NOTE [The gated MLP's peak under autocast] in
slimgrad/ops/gated_mlp.py): both backward peaks counted in bytes exactly as the tracker counts
them, and ``slimgrad.nn.GatedMLP`` running the lean op (x, g and u kept) wherever its backward
peaks at most at eager's. Before, the element counts of the fp32 rule ran eager's ops at small
shapes and a converted HF Llama's MLP under bf16 autocast kept eager's 81,920 B a layer."""

from __future__ import annotations

import warnings

import pytest
import torch

from slimgrad.memory import measure
from slimgrad.nn.gated_mlp import GatedMLP
from slimgrad.ops.gated_mlp import _autocast_peaks, _fwd_torch, gated_mlp, lean_wins

BF16 = torch.bfloat16
# (tokens, hidden, intermediate, outputs): the plan's Llama shape, a few-token and a
# many-token one, odd and prime sizes, one where eager's backward is lower (32, 64, 18)
SHAPES = [
    (64, 64, 128, 64),
    (32, 64, 18, 64),
    (256, 688, 512, 688),
    (1, 64, 128, 64),
    (33, 40, 72, 24),
    (7, 24, 200, 56),
    (512, 64, 128, 64),
]


def _weights(n, d, i, do):
    torch.manual_seed(0)
    x0 = torch.randn(n, d, requires_grad=True)
    ws = [torch.nn.Parameter(torch.randn(*s) * 0.1) for s in ((i, d), (i, d), (do, i))]
    return x0, ws


def _backward_peak(lean: bool, shape) -> int:
    x0, (wg, wu, wd) = _weights(*shape)

    def step():
        with torch.autocast("cpu", dtype=BF16):
            x = x0 * 1  # a non-leaf x (a norm's output in a model)
            if lean:
                y = gated_mlp(x, wg, wu, wd)
            else:
                y = _fwd_torch(x, wg, None, wu, None, wd, None, "silu", False)
            return y.float().sum()

    m = measure(step)
    return max(live for _, _, live in m.timeline[m.backward_start :])


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_backward_peaks_are_the_formulas(shape):
    ours, eager = _autocast_peaks(*shape, 4, 2, 4)
    # beside the block: the loss and its gradient, one float each
    assert _backward_peak(True, shape) - ours == 8
    assert _backward_peak(False, shape) - eager == 8
    assert lean_wins(*shape, "autocast", (4, 2, 4)) == (ours <= eager)


def _module_step(shape, amp=True):
    n, d, i, _ = shape
    torch.manual_seed(0)
    mlp = GatedMLP(d, i)
    x0 = torch.randn(n, d, requires_grad=True)

    def step():
        with torch.autocast("cpu", dtype=BF16, enabled=amp):
            return mlp(x0 * 1).float().sum()

    return step, mlp, x0


def test_module_keeps_x_g_u_under_autocast_where_lean_is_lower():
    # the plan's Llama shape: x (fp32) + g and u (bf16); eager would keep x's two bf16 casts, the
    # weights' casts and g, act(g), u, h (131,072 B; the module kept that before)
    n, d, i, _ = shape = SHAPES[0]
    step, _, _ = _module_step(shape)
    m = measure(step)
    assert m.saved_bytes == n * d * 4 + 2 * n * i * 2 == 49_152
    assert m.saved_param_bytes == 3 * d * i * 4  # the fp32 weights, re-cast in backward


def test_module_runs_eager_where_eagers_backward_is_lower():
    n, d, i, _ = shape = SHAPES[1]
    assert not lean_wins(*shape, "autocast", (4, 2, 4))
    step, _, _ = _module_step(shape)
    # x's two casts, the weights' casts, g, act(g), u, h: eager's set
    assert measure(step).saved_bytes == 2 * n * d * 2 + 3 * d * i * 2 + 4 * n * i * 2


@pytest.mark.parametrize("shape", SHAPES[:2], ids=str)
def test_module_bits_as_eager_under_autocast(shape):
    step, mlp, x0 = _module_step(shape)
    loss = step()
    loss.backward()
    ours = [loss.detach(), x0.grad, *(p.grad for p in mlp.parameters())]
    x0.grad = None
    for p in mlp.parameters():
        p.grad = None
    with torch.autocast("cpu", dtype=BF16):
        ref = mlp._eager(x0 * 1, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn)
        ref = ref.float().sum()
    ref.backward()
    want = [ref.detach(), x0.grad, *(p.grad for p in mlp.parameters())]
    for a, b in zip(ours, want, strict=True):
        assert torch.equal(a, b)


def test_hf_llama_mlp_keeps_g_and_u_under_autocast():
    transformers = pytest.importorskip("transformers")
    import slimgrad

    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 512, (2, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        slimgrad.convert_(model)

    def step():
        with torch.autocast("cpu", dtype=BF16):
            return model(input_ids=ids, labels=ids, use_cache=False).loss

    m = measure(step, module=model)
    # g and u in bf16 (x, the norm's output, is the norm's; the weights are parameters); before:
    # 81,920 B (x's two bf16 casts and g, act(g), u, h, by the MLP and its children)
    mlp = "model.layers.0.mlp"
    kept = sum(b for k, b in m.by_module.items() if k == mlp or k.startswith(mlp + "."))
    assert kept == 2 * 64 * 128 * 2 == 32_768
