"""slimgrad.nn: modules with torch.nn's names, arguments, defaults and state_dict keys.

Each has ``from_torch(module)``, which shares the original module's Parameters and buffers.
"""

from slimgrad.nn.batch_norm import (
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    GELUAfterNorm,
    ReLUAfterNorm,
    SiLUAfterNorm,
)
from slimgrad.nn.conv import (
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
)
from slimgrad.nn.drop_path import DropPath
from slimgrad.nn.dropout import Dropout
from slimgrad.nn.elu import ELU
from slimgrad.nn.gated_mlp import GatedMLP
from slimgrad.nn.gelu import GELU
from slimgrad.nn.group_norm import GroupNorm
from slimgrad.nn.hardsigmoid import Hardsigmoid
from slimgrad.nn.hardswish import Hardswish, HardswishAfterNorm
from slimgrad.nn.hardtanh import Hardtanh, ReLU6
from slimgrad.nn.inplace_abn import InPlaceABN, InPlaceABNSync
from slimgrad.nn.layer_norm import LayerNorm
from slimgrad.nn.leaky_relu import LeakyReLU
from slimgrad.nn.linear import Conv1D, Linear
from slimgrad.nn.linear_cross_entropy import LinearCrossEntropyLoss
from slimgrad.nn.mish import Mish
from slimgrad.nn.relu import ReLU
from slimgrad.nn.reversible import (
    AdditiveCoupling,
    AffineCoupling,
    ReconstructionReport,
    ReversibleSequential,
    check_invertible,
)
from slimgrad.nn.rms_norm import HFRMSNorm, RMSNorm
from slimgrad.nn.sigmoid import Sigmoid
from slimgrad.nn.silu import SiLU
from slimgrad.nn.softmax_dropout import SoftmaxDropoutMatmul
from slimgrad.nn.squeeze_excite import (
    EffectiveSEModule,
    SEModule,
    SqueezeExcitation,
    SqueezeExciteBlock,
)
from slimgrad.nn.tanh import Tanh

__all__ = [
    "SqueezeExciteBlock",
    "SqueezeExcitation",
    "SEModule",
    "EffectiveSEModule",
    "HardswishAfterNorm",
    "DropPath",
    "ELU",
    "GELU",
    "AdditiveCoupling",
    "AffineCoupling",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "Conv1D",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "Dropout",
    "GELUAfterNorm",
    "GroupNorm",
    "GatedMLP",
    "HFRMSNorm",
    "Hardsigmoid",
    "Hardswish",
    "Hardtanh",
    "InPlaceABN",
    "InPlaceABNSync",
    "LayerNorm",
    "LeakyReLU",
    "Linear",
    "LinearCrossEntropyLoss",
    "Mish",
    "RMSNorm",
    "ReLU",
    "ReLU6",
    "ReLUAfterNorm",
    "ReconstructionReport",
    "ReversibleSequential",
    "SiLU",
    "SiLUAfterNorm",
    "Sigmoid",
    "SoftmaxDropoutMatmul",
    "Tanh",
    "check_invertible",
]
