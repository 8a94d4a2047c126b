import torch

from slimgrad.ops.sigmoid import sigmoid
from tests.ops._output_act_helpers import Case, OutputActTests


class TestSigmoid(OutputActTests):
    CASES = [Case("sigmoid", sigmoid, torch.sigmoid, eager_saves_output=True)]
