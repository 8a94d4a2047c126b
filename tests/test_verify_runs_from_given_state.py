"""verify: every run steps from the models' state as given, and the report's checks say what ran.

Before, a train run's buffer updates (BatchNorm running statistics) carried into the eval run: a
converted BatchNorm with another momentum failed the eval run too, with the train run's buffer
message, though an eval step updates no buffer, and the eval run's reference was not the model as
given. The checks text said no input gradient was compared (it read the first run only, which by
design takes none) and named ``out.loss`` as the loss of a model that returns a tensor.
"""

from __future__ import annotations

import copy
import types

import torch
from torch import nn

import slimgrad
from tests._threads import one_thread


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)
    )


def test_eval_run_starts_from_the_buffers_as_given():
    with one_thread():
        m = _cnn()
        c = slimgrad.convert_(copy.deepcopy(m))
        c[1].momentum = 0.2  # a wrong conversion: only training updates differ
        x = torch.randn(2, 3, 8, 8)
        rep = slimgrad.verify(m, c, x)
        train, ev = rep.runs
        assert not train.ok and any("running_mean" in f for f in train.failures)
        assert ev.ok, str(rep)  # (failed before: the train step's buffers carried over)
        # the eval run's eager loss is the model as given, in eval mode
        want = copy.deepcopy(m).eval()(x).float().square().mean().item()
        assert ev.loss_eager == want
        assert torch.equal(m[1].running_mean, _cnn()[1].running_mean)  # the original untouched


def test_checks_name_the_runs_that_take_input_gradients_and_the_loss():
    with one_thread():
        m = _cnn()
        c = slimgrad.convert_(copy.deepcopy(m))
        rep = slimgrad.verify(m, c, torch.randn(2, 3, 8, 8))
        assert rep.ok, str(rep)
        text = str(rep)
        assert [len(r.input_grads) for r in rep.runs] == [0, 1]
        assert "input gradients: input, the rule against float64 (in inputs (eval)" in text
        assert "loss: the rule against float64 (the output's mean square)" in text


class _WithLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        y = self.fc(x)
        return types.SimpleNamespace(loss=y.square().mean(), logits=y)


def test_checks_name_out_loss_where_the_output_has_one():
    with one_thread():
        torch.manual_seed(0)
        m = _WithLoss()
        rep = slimgrad.verify(m, slimgrad.convert_(copy.deepcopy(m)), torch.randn(4, 5))
        assert rep.ok, str(rep)
        assert "loss: the rule against float64 (out.loss)" in str(rep)
