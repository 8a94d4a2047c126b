import torch.nn.functional as F

from slimgrad.ops.elu import elu
from tests.ops._output_act_helpers import Case, OutputActTests


class TestElu(OutputActTests):
    CASES = [
        Case("alpha0.7", lambda x, ip: elu(x, 0.7, ip), lambda x: F.elu(x, 0.7)),
        Case("default", lambda x, ip: elu(x, inplace=ip), F.elu),
        Case("alpha-0.7_bits", lambda x, ip: elu(x, -0.7, ip), lambda x: F.elu(x, -0.7), bits=True),
    ]
    COMPILE_CASES = [CASES[0], CASES[2]]
