import torch

from slimgrad.ops.relu import relu
from tests.ops._output_act_helpers import Case, OutputActTests


class TestRelu(OutputActTests):
    CASES = [Case("relu", relu, torch.relu, eager_saves_output=True)]
