import torch

from slimgrad.bench.cases.mlp import build, main
from slimgrad.memory import measure


def test_build_small_same_function_less_saved():
    eager, slim, make_inputs = build("cpu", torch.float32, small=True)
    x = make_inputs()
    torch.manual_seed(5)
    ye = eager(x)
    torch.manual_seed(5)
    ys = slim(x)
    torch.testing.assert_close(ys, ye)
    assert not any(pe is ps for pe, ps in zip(eager.parameters(), slim.parameters()))
    slim(x).sum().backward()  # warm-up

    def run(model):
        return lambda: (torch.manual_seed(6), model(x))[1].sum()

    m, me = measure(run(slim)), measure(run(eager))
    hid = x.shape[0] * x.shape[1] * eager[0].out_features * 4
    assert me.saved_bytes - m.saved_bytes >= 0.9 * hid  # GELU input not kept; bits + table kept


def test_main_small_record():
    rec = main(["--small", "--repeat", "1"])
    assert rec["case"] == "mlp" and all(v["ok"] for v in rec["grad_rule"].values())
    assert rec["saved_over_floor"]["slimgrad"] < rec["saved_over_floor"]["eager"]
