import torch

from slimgrad.bench.cases.mlp import build
from slimgrad.bench.harness import run_case
from slimgrad.memory import measure


def test_build_small_same_function_less_saved():
    eager, slim, make_inputs = build("cpu", torch.float32, small=True)
    x = make_inputs()
    torch.manual_seed(5)
    ye = eager(x)
    torch.manual_seed(5)
    ys = slim(x)
    torch.testing.assert_close(ys, ye)  # same seed: the same dropout mask on both sides
    assert not any(pe is ps for pe, ps in zip(eager.parameters(), slim.parameters()))
    slim(x).sum().backward()  # warm-up

    def run(model):
        return lambda: (torch.manual_seed(6), model(x))[1].sum()

    m, me = measure(run(slim)), measure(run(eager))
    hid = x.shape[0] * x.shape[1] * eager[0].out_features * 4
    assert me.saved_bytes - m.saved_bytes >= 0.9 * hid  # GELU input not kept; bits + table kept


def test_harness_record_small_floor_accounting():
    rec = run_case("mlp", small=True, repeat=1, out_dir=None)
    assert rec["grad"]["ok"], rec["grad"]
    (shape,) = rec["shapes"]
    x_bytes = shape[0] * shape[1] * shape[2] * 4
    hidden_bytes = shape[0] * shape[1] * 256 * 4  # small: Linear(64, 256)
    e, s = rec["eager"], rec["slimgrad"]
    # x exists before the step: fc1 keeps it on both sides, counted as a saved input only.
    assert e["saved_input_bytes"] == s["saved_input_bytes"] == x_bytes
    assert e["floor_bytes"] == hidden_bytes  # fc2's input; fc1's input x is pre-existing
    assert rec["saved_over_eager_floor"] == s["saved_bytes"] / e["floor_bytes"]
    assert rec["saved_over_eager_floor"] < rec["eager_saved_over_floor"]
    # counting x, a matmul input, on both sides of the ratio
    assert e["floor_input_bytes"] == s["floor_input_bytes"] == x_bytes
    assert rec["saved_over_eager_floor_with_inputs"] == (
        (s["saved_bytes"] + x_bytes) / (e["floor_bytes"] + x_bytes)
    )
    assert rec["saved_ratio"] < 1.0
