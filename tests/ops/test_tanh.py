import torch

from slimgrad.ops.tanh import tanh
from tests.ops._output_act_helpers import Case, OutputActTests


class TestTanh(OutputActTests):
    CASES = [Case("tanh", tanh, torch.tanh, eager_saves_output=True)]
