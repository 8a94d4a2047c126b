"""slimgrad.ops: functional ops that keep less for backward (torch.nn.functional names)."""

from slimgrad.ops.batch_norm import batch_norm
from slimgrad.ops.conv import (
    conv1d,
    conv2d,
    conv3d,
    conv_transpose1d,
    conv_transpose2d,
    conv_transpose3d,
)
from slimgrad.ops.drop_path import drop_path
from slimgrad.ops.dropout import dropout, dropout_
from slimgrad.ops.elu import elu, elu_
from slimgrad.ops.gated_mlp import gated_mlp, gated_mlp_fused
from slimgrad.ops.gelu import gelu, gelu_, gelu_fast, gelu_new
from slimgrad.ops.group_norm import group_norm
from slimgrad.ops.hardsigmoid import hardsigmoid, hardsigmoid_
from slimgrad.ops.hardswish import hardswish, hardswish_
from slimgrad.ops.hardtanh import hardtanh, hardtanh_, relu6, relu6_
from slimgrad.ops.inplace_abn import inplace_abn, inplace_abn_sync
from slimgrad.ops.layer_norm import layer_norm
from slimgrad.ops.leaky_relu import leaky_relu, leaky_relu_
from slimgrad.ops.linear import conv1d_addmm, linear
from slimgrad.ops.linear_cross_entropy import causal_lm_loss, linear_cross_entropy
from slimgrad.ops.linear_scale import linear_scale
from slimgrad.ops.matmul import matmul
from slimgrad.ops.mish import mish, mish_
from slimgrad.ops.qkv_attention import qkv_attention
from slimgrad.ops.relu import relu, relu_
from slimgrad.ops.reversible import reversible_sequential
from slimgrad.ops.rms_norm import hf_rms_norm, rms_norm
from slimgrad.ops.sigmoid import sigmoid, sigmoid_
from slimgrad.ops.silu import silu, silu_
from slimgrad.ops.softmax_dropout import (
    eager_attention,
    scores_softmax_dropout_matmul,
    softmax_dropout_matmul,
)
from slimgrad.ops.squeeze_excite import squeeze_excite
from slimgrad.ops.tanh import tanh, tanh_

__all__ = [
    "eager_attention",
    "squeeze_excite",
    "scores_softmax_dropout_matmul",
    "qkv_attention",
    "linear_scale",
    "drop_path",
    "batch_norm",
    "causal_lm_loss",
    "conv1d",
    "conv1d_addmm",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "dropout",
    "dropout_",
    "elu",
    "elu_",
    "gelu",
    "gelu_",
    "gelu_fast",
    "gelu_new",
    "gated_mlp",
    "gated_mlp_fused",
    "group_norm",
    "hardsigmoid",
    "hardsigmoid_",
    "hardswish",
    "hardswish_",
    "hardtanh",
    "hf_rms_norm",
    "hardtanh_",
    "inplace_abn",
    "inplace_abn_sync",
    "layer_norm",
    "leaky_relu",
    "leaky_relu_",
    "linear",
    "linear_cross_entropy",
    "matmul",
    "mish",
    "mish_",
    "relu",
    "relu6",
    "relu6_",
    "relu_",
    "reversible_sequential",
    "rms_norm",
    "sigmoid",
    "sigmoid_",
    "silu",
    "silu_",
    "softmax_dropout_matmul",
    "tanh",
    "tanh_",
]
