import torch

from slimgrad import ownership
from slimgrad.bench.cases.linear_cross_entropy import build
from slimgrad.bench.harness import run_case


def test_build_small_same_loss_shared_parameters():
    eager, slim, make_inputs = build("cpu", torch.float32, small=True)
    x, target = make_inputs()
    assert (target[:, -1] == -100).all()
    torch.testing.assert_close(slim(x, target), eager(x, target))
    assert all(pe is ps for pe, ps in zip(eager.parameters(), slim.parameters(), strict=True))


def test_harness_record_small_reuse_on_and_off():
    on = run_case("linear_cross_entropy", small=True, repeat=1, out_dir=None)
    with ownership.reuse_disabled():
        off = run_case("linear_cross_entropy", small=True, repeat=1, out_dir=None, grad_check=False)
    assert on["grad"]["ok"], on["grad"]
    assert on["grad"]["n_tensors"] == 3  # ln_f weight and bias, lm_head weight
    # The N x V logits are never kept: slimgrad saves about the eager floor (ln_f's output).
    assert on["saved_ratio"] < 0.05 and on["saved_over_eager_floor"] < 1.1
    assert on["grad_buffer_reuse"] and on["grad_buffer_reuses"] >= 1
    assert not off["grad_buffer_reuse"] and off["grad_buffer_reuses"] == 0
    assert on["slimgrad"]["saved_bytes"] == off["slimgrad"]["saved_bytes"]
    assert on["slimgrad"]["peak_bytes"] < off["slimgrad"]["peak_bytes"]
