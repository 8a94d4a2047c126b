"""``memory.estimate(..., device="cuda")``: what CUDA kernels keep, modelled on CPU (NOTE
[Estimating what CUDA kernels keep] in ``slimgrad/memory.py``). Exact byte formulas."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from slimgrad.memory import estimate

B, H, D = 2, 3, 16
I64 = 8  # philox seed / offset: int64 scalars


def _attn(T, dtype, device, *, dropout=0.1, mask=None, causal=True, backend=None):
    def make():
        q, k, v = (torch.randn(B, H, T, D, dtype=dtype, requires_grad=True) for _ in range(3))
        m = None
        if mask == "bool":
            m = torch.ones(B, 1, T, T, dtype=torch.bool).tril()
        return lambda: (
            F.scaled_dot_product_attention(
                q, k, v, attn_mask=m, dropout_p=dropout, is_causal=causal and m is None
            )
            .float()
            .sum()
        )

    if backend is None:
        return estimate(make, device=device)
    with torch.nn.attention.sdpa_kernel(backend):
        return estimate(make, device=device)


def _nbytes(dtype):
    return torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("T", [17, 64])
def test_cuda_fp32_runs_memory_efficient_attention(T):
    m = _attn(T, torch.float32, "cuda")
    assert set(m.by_node) == {"ScaledDotProductEfficientAttentionBackward0"}
    # q, k, v are inputs (pre-existing); created in the step: out, logsumexp (B x H x ceil32(T),
    # fp32), philox seed + offset
    lse = B * H * (-(-T // 32) * 32) * 4
    assert m.saved_bytes == B * H * T * D * 4 + lse + 2 * I64
    assert m.saved_input_bytes == 3 * B * H * T * D * 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_half_runs_flash_attention(dtype):
    T = 40
    m = _attn(T, dtype, "cuda")
    assert set(m.by_node) == {"ScaledDotProductFlashAttentionBackward0"}
    # out + logsumexp (B x H x T, fp32) + rng_state (2 x uint64) + unused (uint64 scalar)
    assert m.saved_bytes == B * H * T * D * _nbytes(dtype) + B * H * T * 4 + 2 * 8 + 8


def test_cuda_bool_mask_is_kept_as_a_padded_float_bias():
    T = 20
    m = _attn(T, torch.float32, "cuda", mask="bool")
    assert set(m.by_node) == {"ScaledDotProductEfficientAttentionBackward0"}
    lse = B * H * 32 * 4
    bias = B * 1 * T * 32 * 4  # B x 1 x T x S padded to a multiple of 16 in S
    assert m.saved_bytes == B * H * T * D * 4 + lse + 2 * I64 + bias


def test_attention_rows_are_o_t_on_cuda_and_o_t2_on_cpu():
    per_row = {}
    for device in ("cpu", "cuda"):
        a, b = (_attn(T, torch.float32, device).saved_bytes for T in (64, 128))
        per_row[device] = (a / 64, b / 128)
    assert per_row["cuda"][1] == pytest.approx(per_row["cuda"][0], rel=0.01)  # O(T) per row
    assert per_row["cpu"][1] > 1.8 * per_row["cpu"][0]  # math path: T x T


def test_cuda_float64_and_disabled_backends_run_the_math_path():
    T = 24
    m = _attn(T, torch.float64, "cuda")
    # scaled q and k (B x H x T x D each), P and the dropped P (T x T, fp64), the bool mask
    tt = B * H * T * T
    assert "ScaledDotProductEfficientAttentionBackward0" not in m.by_node
    assert m.saved_bytes == 2 * B * H * T * D * 8 + 2 * tt * 8 + tt
    from torch.nn.attention import SDPBackend

    m = _attn(T, torch.float32, "cuda", backend=SDPBackend.MATH)
    assert m.saved_bytes == 2 * B * H * T * D * 4 + 2 * tt * 4 + tt


def test_cuda_dropout_keeps_a_bool_mask_cpu_a_noise_tensor():
    def make():
        x = torch.randn(5, 7, requires_grad=True)
        return lambda: F.dropout(x * 2, 0.3).sum()

    n = 35
    assert estimate(make, device="cuda").saved_bytes == n  # native_dropout's bool mask
    assert estimate(make, device="cpu").saved_bytes == n * 4  # _dropout_impl's float noise


def test_cuda_layer_norm_keeps_float32_stats_for_half_inputs():
    def make():
        x = torch.randn(6, 32, dtype=torch.bfloat16, requires_grad=True)
        w = torch.ones(32, dtype=torch.bfloat16, requires_grad=True)
        return lambda: F.layer_norm(x, (32,), w, w).float().sum()

    # mean + rstd (6 rows); the output's copy to float is not saved
    assert estimate(make, device="cuda").saved_bytes == 2 * 6 * 4
    assert estimate(make, device="cpu").saved_bytes == 2 * 6 * 2


def test_estimate_rejects_other_devices():
    with pytest.raises(ValueError, match="device must be one of"):
        estimate(lambda: lambda: torch.ones(1), device="mps")


transformers = pytest.importorskip("transformers")


def test_profile_gpt2_cuda_attention_is_o_t(capsys):
    from slimgrad.cli import main

    batch, layers, heads, width = 2, 2, 4, 64  # the tiny GPT-2 config
    for seq in (32, 40):
        argv = ["profile", "gpt2", "--size", "tiny", "--seq", str(seq), "--batch", str(batch)]
        assert main([*argv, "--estimate", "--device", "cuda", "--json"]) == 0
        rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert rec["device"] == "cuda" and rec["estimated"]
        node = "ScaledDotProductEfficientAttentionBackward0"
        kept = {}
        for side in ("eager", "slimgrad"):  # convert_ kept SDPA on cuda
            assert "_SoftmaxDropoutMatmulFnBackward" not in rec[side]["by_node"]
            kept[side] = sum(s["nbytes"] for s in rec[side]["saved"] if node in s["savers"])
        assert kept["eager"] == kept["slimgrad"]
        assert rec["slimgrad"]["saved_bytes"] < rec["eager"]["saved_bytes"]
        # per layer: c_attn's output (q, k, v), out, logsumexp (T up to a multiple of 32),
        # philox seed + offset: O(T) per row, no B x H x T x T tensor. No mask: HF skips the
        # causal mask for unpadded rows, and under fake tensors too (NOTE [Index tensors keep
        # their values under fake tensors] in slimgrad/memory.py)
        up = lambda n, k: -(-n // k) * k  # noqa: E731
        per_layer = (
            batch * seq * 3 * width * 4
            + batch * seq * width * 4
            + batch * heads * up(seq, 32) * 4
            + 2 * 8
        )
        assert kept["slimgrad"] == layers * per_layer
    assert main(["profile", "gpt2", "--size", "tiny", "--set", "n_layer"]) == 2
    assert "--set takes KEY=VALUE" in capsys.readouterr().err
