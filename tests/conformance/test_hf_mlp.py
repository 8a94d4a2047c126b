"""Conformance of HF gated-MLP conversion over dtypes and modes (``convert_handlers/hf_mlp.py``).

Each row converts one tiny HF MLP (Llama's SwiGLU, Gemma's tanh GeGLU, Phi-3's fused gate_up) with
``convert_`` and runs eager and converted on the same input in train/eval x grad/no_grad/
inference_mode, parameters in float32/bfloat16/float64, inputs in float32/bfloat16/float16/float64,
and under CPU autocast: the converted MLP raises where eager raises, returns eager's dtype and bits,
and its gradients are eager's bits (the error rule is implied).
"""

from __future__ import annotations

import copy

import pytest
import torch

import slimgrad
from slimgrad.nn.gated_mlp import GatedMLP

transformers = pytest.importorskip("transformers")

_CFG = dict(hidden_size=12, intermediate_size=19, num_attention_heads=2, vocab_size=31)
FAMILIES = {
    "llama": ("LlamaConfig", "llama", "LlamaMLP"),
    "gemma": ("GemmaConfig", "gemma", "GemmaMLP"),
    "phi3": ("Phi3Config", "phi3", "Phi3MLP"),
    # same template, other families (tanh GeGLU: Gemma3)
    "gemma3": ("Gemma3TextConfig", "gemma3", "Gemma3MLP"),
    "olmo2": ("Olmo2Config", "olmo2", "Olmo2MLP"),
    "cohere": ("CohereConfig", "cohere", "CohereMLP"),
    "granite": ("GraniteConfig", "granite", "GraniteMLP"),
    "stablelm": ("StableLmConfig", "stablelm", "StableLmMLP"),
    "deepseek_v3": ("DeepseekV3Config", "deepseek_v3", "DeepseekV3MLP"),
}
PARAM_DTYPES = [torch.float32, torch.bfloat16, torch.float64]
INPUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
MODES = [(True, "grad"), (True, "no_grad"), (False, "grad"), (False, "inference_mode")]


def _mlp(name, pdt):
    cfg_name, mod, cls = FAMILIES[name]
    cfg = getattr(transformers, cfg_name)(**_CFG)
    module = getattr(transformers.models, mod)
    torch.manual_seed(0)
    return getattr(getattr(module, f"modeling_{mod}"), cls)(cfg).to(pdt)


def _run(m, x0, training, mode, autocast):
    m.train(training)
    x = x0.clone().requires_grad_(mode == "grad")
    ctx = {"grad": torch.enable_grad, "no_grad": torch.no_grad}.get(mode, torch.inference_mode)
    try:
        with ctx(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = m(x)
    except Exception as e:  # noqa: BLE001 - the converted module must raise what eager raises
        return type(e), None
    if mode != "grad":
        return y.detach().clone(), None
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype)
    ps = [x, *m.parameters()]
    return y.detach(), torch.autograd.grad(y, ps, gy)


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("pdt", PARAM_DTYPES, ids=str)
def test_converted_mlp_matches_eager_in_every_dtype_and_mode(name, pdt):
    eager = _mlp(name, pdt)
    holder = slimgrad.convert_(torch.nn.Sequential(copy.deepcopy(eager)))
    conv = holder[0]
    assert type(conv) is GatedMLP, slimgrad.report(holder)
    problems = []
    for xdt in INPUT_DTYPES:
        x0 = torch.randn(2, 5, _CFG["hidden_size"]).to(xdt)
        for training, mode in MODES:
            for autocast in (False, True):
                tag = f"x {xdt}, {'train' if training else 'eval'}, {mode}, autocast={autocast}"
                ye, ge = _run(eager, x0, training, mode, autocast)
                yc, gc = _run(conv, x0, training, mode, autocast)
                if isinstance(ye, type) or isinstance(yc, type):
                    if ye is not yc:
                        problems.append(f"{tag}: eager {ye}, converted {yc}")
                    continue
                try:
                    torch.testing.assert_close(yc, ye, rtol=0, atol=0)
                    for a, b in zip(gc or (), ge or (), strict=True):
                        torch.testing.assert_close(a, b, rtol=0, atol=0)
                except AssertionError as err:
                    problems.append(f"{tag}: {str(err).splitlines()[0]}")
    assert not problems, "\n".join(problems)
