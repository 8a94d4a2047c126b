"""plan names the user's contract breach when make_forward's step uses real tensors made outside it
(adv25 F4).

NOTE [Real tensors captured by make_forward] (src/slimgrad/plan.py). A BertForMaskedLM whose
``ids`` were made before plan (a real tensor, read as a global or closed over) failed every choice
(the converted MLM loss head indexes by the real labels' values) and plan said "This is a
slimgrad bug" with an inner MoE message. Now it raises a ValueError in the GUIDE form naming the
real tensor and the fix; the diagnosis flags neither a model built outside on real tensors nor
inputs built inside make_forward.
"""

import pytest
import torch
import torch.nn as nn

import slimgrad
from slimgrad.plan import _outside_tensor

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

_CFG = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=32,
)
_IDS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))


def _global_ids():
    torch.manual_seed(0)
    m = transformers.BertForMaskedLM(transformers.BertConfig(**_CFG)).train()
    return (lambda: m(input_ids=_IDS, labels=_IDS).loss), m


def _closure_labels():
    labels = _IDS.clone()  # real: made before plan calls make

    def make():
        torch.manual_seed(0)
        m = transformers.BertForMaskedLM(transformers.BertConfig(**_CFG)).train()
        ids = torch.randint(0, 64, (2, 16))  # inside: fake
        return (lambda: m(input_ids=ids, labels=labels).loss), m

    return make


@pytest.mark.parametrize("make", [_global_ids, _closure_labels()], ids=["global", "closure"])
def test_plan_names_real_inputs_made_outside_make_forward(make):
    with pytest.raises(ValueError) as info:
        slimgrad.plan(make, "1TiB")
    msg = str(info.value)
    assert msg.startswith("slimgrad.plan: the step uses a real tensor made outside make_forward")
    assert "shape (2, 16), torch.int64" in msg
    assert "Build the inputs inside make_forward" in msg
    assert "slimgrad bug" not in msg


def test_outside_tensor_flags_only_captured_real_tensors():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.table = torch.arange(8.0)  # a real tensor attribute of a model built outside

        def forward(self, x):
            return self.fc(x) + self.table

    real_model = nn.Sequential(Block(), Block())  # built outside, on real tensors
    captured = torch.randn(4, 8)

    def inside():
        x = torch.randn(4, 8)
        return (lambda: real_model(x).sum()), real_model

    def outside():
        return (lambda: real_model(captured).sum()), real_model

    def outside_index():
        x = torch.randn(4, 8)
        return (lambda: real_model(x)[captured[:, 0] > 0].sum()), real_model

    assert _outside_tensor(inside, "slimgrad.plan", "cpu") is None
    found = _outside_tensor(outside, "slimgrad.plan", "cpu")
    assert found is not None and "shape (4, 8), torch.float32" in found
    found = _outside_tensor(outside_index, "slimgrad.plan", "cpu")
    assert found is not None and "shape (4, 8), torch.float32" in found
