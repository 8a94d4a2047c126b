"""In-Place Activated BatchNorm modules: ``InPlaceABN`` and ``InPlaceABNSync``.

Drop-in for ``nn.BatchNorm{1,2,3}d`` followed by an invertible activation: same arguments,
Parameters, buffers and state_dict keys as ``nn.BatchNorm2d`` (a BatchNorm state_dict loads
unchanged), standard parametrisation (any sign of weight). The output is written over the input.

Memory: saves the output (same storage as the input) + one float per channel; eager BatchNorm +
activation saves the input and the output. See ``slimgrad.ops.inplace_abn``.

For ``convert_(model, ConvertConfig(inplace_abn=True))`` on modules that call ``self.bn`` and then
``self.relu`` (torchvision's ResNets): ``LeakyReLUAfterABN`` (NOTE [ABN-activation pairs]), and
``RecomputeABN`` / ``MaxPool2dRecompute`` (NOTE [Recomputed stem]): a BatchNorm after a 1x1 conv or
before a max-pool keeps nothing full-size and runs eager's kernels on its recomputed input.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from slimgrad._compile import eager_only
from slimgrad.ops import _derived
from slimgrad.ops.inplace_abn import check_activation, inplace_abn, inplace_abn_sync
from slimgrad.ops.leaky_relu import leaky_relu

__all__ = [
    "InPlaceABN",
    "InPlaceABNSync",
    "LeakyReLUAfterABN",
    "MaxPool2dRecompute",
    "RecomputeABN",
    "convert_sequential_bn_act_",
]

# NOTE [ABN-activation pairs]
# torchvision's blocks call ``self.bn1`` and then ``self.relu`` (one ReLU instance, used after bn1,
# after bn2 and after the residual add). convert_ with ``inplace_abn=True`` turns each BatchNorm
# that is followed directly by that ReLU into an InPlaceABN(leaky_relu), which already applies the
# activation, and the ReLU instance into a LeakyReLUAfterABN: the identity on the output of one of
# *its own* InPlaceABNs, leaky_relu everywhere else (the post-residual call). Both sides hold the
# same ``_PairToken``; the InPlaceABN records its output in ``_ABN_OUTPUTS`` (weak, keyed by tensor
# identity) with that token and the output's version. The ReLU side takes the identity path only for
# the same tensor object, unchanged since (version), with its own token, and only once (the entry
# is consumed: ``relu(relu(bn(x)))`` applies leaky_relu the second time). Anything else (a view, a
# copy, an in-place change, another module's output) gets leaky_relu, so the pair computes
# leaky_relu(BN(x)) exactly on every path. Registration happens in every grad mode (the identity
# path must be taken under no_grad/eval too); inference tensors have no version counter, so there
# the identity is keyed by object only. deepcopy/pickle keep the pairing (one token object, copied
# once per memo). Under torch.compile the paired modules run eagerly (graph breaks around them;
# ``eager_only``, NOTE [Eager-only code under torch.compile]): traced, the registry lookups
# across graph breaks gave wrong gradients (aot_eager, torch 2.13), and correctness comes first.
_ABN_OUTPUTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


class _PairToken:
    pass


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version


@eager_only
def _register_output(out: torch.Tensor, token: _PairToken) -> None:
    _ABN_OUTPUTS[out] = (token, _version(out))


@eager_only
def _take_output(x: torch.Tensor, token: _PairToken) -> bool:
    entry = _ABN_OUTPUTS.get(x)
    if entry is None or entry[0] is not token or entry[1] != _version(x):
        return False
    del _ABN_OUTPUTS[x]
    return True


class InPlaceABN(nn.Module):
    """BatchNorm (1d/2d/3d) + invertible activation, computed in place.

    ``z = act(weight * (x - mean) / sqrt(var + eps) + bias)``, written over ``x``.

    Memory: saves z (shared with the next layer) + one float per channel; eager BatchNorm +
    LeakyReLU(inplace) saves x and z.

    Args:
        num_features: C of an (N, C, ...) input.
        eps, momentum, affine, track_running_stats: as ``nn.BatchNorm2d`` (``momentum=None``:
            cumulative moving average).
        activation: 'identity', 'leaky_relu' or 'elu' (must be invertible).
        activation_param: leaky_relu slope (> 0) or elu alpha (> 0).

    Raises:
        ValueError: a non-invertible activation or a non-positive slope/alpha.

    Example:
        >>> conv = torch.nn.Conv2d(3, 64, 3)
        >>> layer = InPlaceABN(64, activation="leaky_relu", activation_param=0.01)
        >>> h = conv(torch.randn(2, 3, 9, 9))
        >>> layer(h) is h  # conv's output now holds the result
        True
    """

    _version = 2
    _api = "nn.InPlaceABN"

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise ValueError(
                f"slimgrad.{self._api}: num_features must be a positive int; expected >= 1, got "
                f"{num_features!r}. Pass the channel count C of the input."
            )
        check_activation(self._api, activation, activation_param)
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.affine = affine
        self.track_running_stats = track_running_stats
        self.activation = activation
        self.activation_param = float(activation_param) if activation != "identity" else 0.0
        if affine:
            self.weight = nn.Parameter(torch.empty(num_features, **factory))
            self.bias = nn.Parameter(torch.empty(num_features, **factory))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_mean", torch.zeros(num_features, **factory))
            self.register_buffer("running_var", torch.ones(num_features, **factory))
            self.register_buffer(
                "num_batches_tracked",
                torch.tensor(
                    0,
                    dtype=torch.long,
                    **{k: v for k, v in factory.items() if k != "dtype"},
                ),
            )
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            self.running_mean.zero_()
            self.running_var.fill_(1)
            self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        if self.affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        s = (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
            f"track_running_stats={self.track_running_stats}, activation={self.activation!r}"
        )
        if self.activation != "identity":
            s += f", activation_param={self.activation_param}"
        return s

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # As nn.BatchNorm: checkpoints from before num_batches_tracked existed load with 0.
        version = local_metadata.get("version", None)
        if (version is None or version < 2) and self.track_running_stats:
            key = prefix + "num_batches_tracked"
            if key not in state_dict:
                state_dict[key] = (
                    self.num_batches_tracked
                    if self.num_batches_tracked is not None
                    and self.num_batches_tracked.device != torch.device("meta")
                    else torch.tensor(0, dtype=torch.long)
                )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"slimgrad.{self._api}: input must be a Tensor; expected torch.Tensor, got "
                f"{type(x).__name__}. Pass a tensor of shape (N, C, ...)."
            )
        if not 2 <= x.dim() <= 5:
            raise ValueError(
                f"slimgrad.{self._api}: wrong input rank; expected 2D, 3D, 4D or 5D input (as "
                f"BatchNorm1d/2d/3d), got {x.dim()}D input. Reshape to (N, C, ...)."
            )
        if x.shape[1] != self.num_features:
            raise ValueError(
                f"slimgrad.{self._api}: input has the wrong channel count; expected "
                f"{self.num_features}, got {x.shape[1]} (input shape {tuple(x.shape)}). Check "
                "num_features."
            )

    def _factor_and_mode(self) -> tuple[float, bool]:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = (
                1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            )
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        return factor, bn_training

    def _running_stats(self):
        # as nn.BatchNorm: buffers are used in eval, or in training when they are tracked
        use = not self.training or self.track_running_stats
        return (self.running_mean, self.running_var) if use else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "_pair_token" in self.__dict__:
            return self._forward_paired(x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        factor, bn_training = self._factor_and_mode()
        rm, rv = self._running_stats()
        return inplace_abn(
            x, rm, rv, self.weight, self.bias, bn_training, factor, self.eps, self.activation,
            self.activation_param,
        )  # fmt: skip

    @eager_only
    def _forward_paired(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE [ABN-activation pairs]; run eagerly under torch.compile (see there)
        out = self._forward(x)
        _register_output(out, self._pair_token)
        return out

    @classmethod
    def from_torch(
        cls,
        bn: nn.modules.batchnorm._BatchNorm,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
        **kwargs: Any,
    ) -> InPlaceABN:
        """Build from an ``nn.BatchNorm{1,2,3}d`` (or ``nn.SyncBatchNorm``), sharing its
        Parameters and buffers (no copy): training either updates both.

        Args:
            bn: the BatchNorm module.
            activation, activation_param: the activation that follows ``bn`` in the model.
            kwargs: extra constructor arguments (``process_group`` for ``InPlaceABNSync``).

        Raises:
            TypeError: ``bn`` is not a BatchNorm module.
        """
        if not isinstance(bn, nn.modules.batchnorm._BatchNorm):
            raise TypeError(
                f"slimgrad.{cls._api}.from_torch: bn must be a BatchNorm module; expected "
                f"nn.BatchNorm1d/2d/3d or nn.SyncBatchNorm, got {type(bn).__name__}. Pass the "
                "BatchNorm that precedes the activation."
            )
        new = cls(
            bn.num_features, eps=bn.eps, momentum=bn.momentum, affine=bn.affine,
            track_running_stats=bn.track_running_stats, activation=activation,
            activation_param=activation_param, device="meta", **kwargs,
        )  # fmt: skip
        new.weight, new.bias = bn.weight, bn.bias
        new.running_mean = bn.running_mean
        new.running_var = bn.running_var
        new.num_batches_tracked = bn.num_batches_tracked
        new.train(bn.training)
        return new


class InPlaceABNSync(InPlaceABN):
    """:class:`InPlaceABN` with batch statistics synchronised over a process group in training.

    One ``all_gather`` of (count, mean, M2) per channel in forward (unequal per-rank batches are
    fine), one ``all_reduce`` of (sum(dy), sum(dy * xhat)) in backward. Works on gloo (CPU) and
    NCCL.

    Args:
        process_group: the group to synchronise over; None (default) means the default group,
            looked up at each call (so the module can be built before ``init_process_group``).
        Other args: as :class:`InPlaceABN`.

    Raises:
        RuntimeError: (at forward, in training) torch.distributed is not initialised.
    """

    _api = "nn.InPlaceABNSync"

    def __init__(self, num_features: int, *args: Any, process_group=None, **kwargs: Any) -> None:
        super().__init__(num_features, *args, **kwargs)
        self.process_group = process_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        factor, bn_training = self._factor_and_mode()
        rm, rv = self._running_stats()
        if bn_training and self.training:
            return inplace_abn_sync(
                x, rm, rv, self.weight, self.bias, True, factor, self.eps, self.activation,
                self.activation_param, process_group=self.process_group,
            )  # fmt: skip
        return inplace_abn(
            x, rm, rv, self.weight, self.bias, bn_training, factor, self.eps, self.activation,
            self.activation_param,
        )  # fmt: skip


# NOTE [Recomputed stem]
# In ``conv -> BN -> ReLU -> max-pool`` (a ResNet stem) the activation z is no conv's input, yet
# InPlaceABN keeps it (for its own backward) and the max-pool keeps it plus int64 indices: 1.5x of
# a full-size tensor outside the matmul-input floor. Both follow from what the conv keeps anyway
# (its input and weight; NOTE [Recomputable inputs] in ``slimgrad/ops/_derived.py``): c = conv(x),
# z = leaky_relu(BN(c)). So ``RecomputeABN`` (given an input with a recipe) computes z with eager's
# own kernels (``native_batch_norm`` with batch statistics, ``leaky_relu_``), keeps the recipe and
# the per-channel statistics, and registers a recipe for z; ``MaxPool2dRecompute`` given such a z
# keeps only the recipe. In backward each re-runs the recipe (bit for bit the forward's ops on
# unchanged, version-checked tensors: same z, same argmax) and calls eager's backward kernels
# (``max_pool2d_with_indices_backward``, ``leaky_relu_backward``, ``native_batch_norm_backward``),
# so gradients are eager's exactly. Cost: the conv, BN and activation run twice more in backward
# (the ResNet-50 stem: about 4% of a step's FLOPs).


class _RecomputeABNFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, c, weight, bias, running_mean, running_var, training, momentum, eps, slope,
                recipe):  # fmt: skip
        z, mean, invstd = torch.ops.aten.native_batch_norm(
            c, weight, bias, running_mean, running_var, training, momentum, eps
        )
        torch.ops.aten.leaky_relu_(z, slope)
        ctx.recipe, ctx.recipe_tensors = recipe, recipe.tensors
        ctx.conf = (training, eps, slope)
        if training:
            ctx.stats = (None, None)
        else:  # eval uses the running statistics as they are now (O(C) copies)
            ctx.stats = (running_mean.clone(), running_var.clone())
        ctx.save_for_backward(weight, bias, mean, invstd)
        return z

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dz):
        weight, bias, mean, invstd = ctx.saved_tensors
        training, eps, slope = ctx.conf
        rm, rv = ctx.stats
        c = _recipe_of(ctx)()
        dy = _bn_leaky(c, weight, bias, rm, rv, training, eps, slope)  # z, then dy in its buffer
        torch.ops.aten.leaky_relu_backward.grad_input(dz, dy, slope, True, grad_input=dy)
        need = list(ctx.needs_input_grad[:3])
        dc, dw, db = torch.ops.aten.native_batch_norm_backward(
            dy, c, weight, rm, rv, mean if training else None, invstd if training else None,
            training, eps, need,
        )  # fmt: skip
        _release(ctx)
        return dc, dw, db, None, None, None, None, None, None, None


_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def _recipe_of(ctx):
    if ctx.recipe is None:
        raise RuntimeError(
            "Trying to backward through the graph a second time (or directly access saved "
            "tensors after they have already been freed). Specify retain_graph=True if you "
            "need to backward through the graph a second time."
        )
    return ctx.recipe


def _release(ctx) -> None:
    # ctx attributes live as long as the graph; drop the recipe once the graph is being freed, as
    # autograd does for save_for_backward tensors (it keeps them under retain_graph=True)
    if _keep_graph is not None and not _keep_graph():
        ctx.recipe = ctx.recipe_tensors = None


def _bn_leaky(c, weight, bias, rm, rv, training, eps, slope):
    # forward's ops on the same input: batch statistics recomputed by the same kernel
    with torch.no_grad():
        z = torch.ops.aten.native_batch_norm(c, weight, bias, rm, rv, training, 0.0, eps)[0]
        return torch.ops.aten.leaky_relu_(z, slope)


class RecomputeABN(InPlaceABN):
    """InPlaceABN(leaky_relu) that, when its input can be recomputed (the output of a slimgrad
    conv that keeps its own input), keeps nothing full-size: NOTE [Recomputed stem]. convert_ uses
    it where the activation feeds a max-pool (ResNet's stem). Elsewhere (no recipe, no_grad,
    torch.compile) it is :class:`InPlaceABN`.

    Memory: with a recipe: 2 floats per channel (+ 2 running-stat copies in eval); the output is
    a new tensor (the conv output is freed by the caller). Eager BN + LeakyReLU keeps c and z.
    """

    _api = "nn.RecomputeABN"

    @eager_only
    def _forward_paired(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)

    @eager_only
    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        recipe = None
        if (
            torch.is_grad_enabled()
            and self.activation == "leaky_relu"
            and not torch.is_autocast_enabled(x.device.type)
        ):
            recipe = _derived.lookup_recipe(x, "always")
        if recipe is None:
            out = super()._forward(x)
            token = self.__dict__.get("_pair_token")
            if token is not None:
                _register_output(out, token)
            return out
        self._check_input_dim(x)
        if self.training:
            torch.nn.functional._verify_batch_size(x.size())  # torch's error, as InPlaceABN
        factor, bn_training = self._factor_and_mode()
        rm, rv = self._running_stats()
        z = _RecomputeABNFn.apply(
            x, self.weight, self.bias, rm, rv, bn_training, factor, self.eps,
            self.activation_param, recipe,
        )  # fmt: skip
        _derived.register_recipe(
            z, _recompute_z(recipe, bn_training, self.eps, self.activation_param, rm, rv),
            (self.weight, self.bias),
        )  # fmt: skip
        token = self.__dict__.get("_pair_token")
        if token is not None:
            _register_output(z, token)
        return z


def _recompute_z(recipe, training, eps, slope, rm, rv):
    stats = (None, None) if training else (rm.clone(), rv.clone())

    def fn(weight, bias):
        return _bn_leaky(recipe(), weight, bias, *stats, training, eps, slope)

    return fn


class _MaxPoolRecomputeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, conf, recipe):
        out, _ = torch.ops.aten.max_pool2d_with_indices(z, *conf)
        ctx.conf, ctx.recipe, ctx.recipe_tensors = conf, recipe, recipe.tensors
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        z = _recipe_of(ctx)()
        _, idx = torch.ops.aten.max_pool2d_with_indices(z, *ctx.conf)
        dz = torch.ops.aten.max_pool2d_with_indices_backward(grad, z, *ctx.conf, idx)
        _release(ctx)
        return dz, None, None


class MaxPool2dRecompute(nn.MaxPool2d):
    """``torch.nn.MaxPool2d`` that keeps nothing full-size when its input has a recipe (the output
    of :class:`RecomputeABN`): it re-runs the recipe and the pooling in backward (NOTE
    [Recomputed stem]). Elsewhere exactly torch's.

    Memory: with a recipe: nothing; eager keeps its input and int64 indices.
    """

    @eager_only
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        recipe = None
        if torch.is_grad_enabled() and input.requires_grad and not self.return_indices:
            recipe = _derived.lookup_recipe(input, "always")
        if recipe is None or input.dim() != 4:
            return super().forward(input)
        pair = torch.nn.modules.utils._pair
        stride = self.stride if self.stride else self.kernel_size  # torch's default
        conf = (
            pair(self.kernel_size), pair(stride), pair(self.padding), pair(self.dilation),
            self.ceil_mode,
        )  # fmt: skip
        return _MaxPoolRecomputeFn.apply(input, conf, recipe)

    @classmethod
    def from_torch(cls, module: nn.MaxPool2d) -> MaxPool2dRecompute:
        """Replace ``module`` (an ``nn.MaxPool2d``; its arguments and hooks are kept).

        Raises:
            TypeError: ``module`` is not an ``nn.MaxPool2d``.
        """
        if type(module) is not nn.MaxPool2d:
            raise TypeError(
                "slimgrad.nn.MaxPool2dRecompute.from_torch: module type; expected "
                f"torch.nn.MaxPool2d, got {type(module).__name__}. Convert a plain "
                "torch.nn.MaxPool2d."
            )
        new = cls.__new__(cls)
        for k, v in module.__dict__.items():
            new.__dict__[k] = type(v)(v) if type(v) in (dict, OrderedDict, list, set) else v
        return new


class LeakyReLUAfterABN(nn.Module):
    """What convert_ (``inplace_abn=True``) puts in place of a ReLU that follows BatchNorms it
    turned into InPlaceABN(leaky_relu): the identity on the output of those InPlaceABNs (they
    already applied the activation), ``leaky_relu(x, negative_slope)`` on anything else (e.g. after
    torchvision's residual add). NOTE [ABN-activation pairs].

    Memory: nothing on the identity path; elsewhere as ``slimgrad.ops.leaky_relu`` (keeps its
    output, shared with the next layer; eager LeakyReLU(inplace) keeps it too).

    Args:
        negative_slope: the slope (> 0) of the InPlaceABNs it pairs with.
        inplace: as torch's ``inplace`` flag, on the leaky_relu path.
    """

    def __init__(self, negative_slope: float = 0.01, inplace: bool = False) -> None:
        super().__init__()
        check_activation("nn.LeakyReLUAfterABN", "leaky_relu", negative_slope)
        self.negative_slope = float(negative_slope)
        self.inplace = bool(inplace)
        self._pair_token = _PairToken()

    def extra_repr(self) -> str:
        return f"negative_slope={self.negative_slope}" + (", inplace=True" if self.inplace else "")

    @eager_only
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if _take_output(input, self._pair_token):
            return input
        return leaky_relu(input, self.negative_slope, self.inplace)

    def pair(self, abn: InPlaceABN) -> InPlaceABN:
        """Make ``abn`` (leaky_relu with this slope) one whose output this module passes through.

        Raises:
            ValueError: ``abn`` does not compute leaky_relu with this module's slope.
        """
        if not (
            isinstance(abn, InPlaceABN)
            and abn.activation == "leaky_relu"
            and abn.activation_param == self.negative_slope
        ):
            raise ValueError(
                "slimgrad.nn.LeakyReLUAfterABN.pair: the InPlaceABN must apply this module's "
                f"activation; expected leaky_relu with slope {self.negative_slope}, got "
                f"{getattr(abn, 'activation', type(abn).__name__)!r} with "
                f"{getattr(abn, 'activation_param', None)}. Build it with "
                "activation='leaky_relu' and the same slope."
            )
        abn._pair_token = self._pair_token
        return abn

    @classmethod
    def from_torch(cls, relu: nn.ReLU, negative_slope: float = 0.01) -> LeakyReLUAfterABN:
        """Replace ``relu`` (an ``nn.ReLU``; its ``inplace`` flag and hooks are kept).

        Raises:
            TypeError: ``relu`` is not an ``nn.ReLU``.
        """
        if type(relu) is not nn.ReLU:
            raise TypeError(
                "slimgrad.nn.LeakyReLUAfterABN.from_torch: module type; expected torch.nn.ReLU, "
                f"got {type(relu).__name__}. Convert a plain torch.nn.ReLU."
            )
        new = cls(negative_slope, relu.inplace)
        for k, v in relu.__dict__.items():
            if k.startswith("_") and "hook" in k and type(v) in (dict, OrderedDict):
                new.__dict__[k] = type(v)(v)
        new.train(relu.training)
        return new


def _act_spec(module: nn.Module, relu_slope: float | None) -> tuple[str, float] | None:
    # (activation, param) that InPlaceABN computes exactly like `module`, or None
    if type(module) is nn.LeakyReLU and module.negative_slope > 0:
        return "leaky_relu", float(module.negative_slope)
    if type(module) is nn.ELU and module.alpha > 0:
        return "elu", float(module.alpha)
    if type(module) is nn.Identity:
        return "identity", 0.0
    if type(module) is nn.ReLU and relu_slope is not None:
        return "leaky_relu", float(relu_slope)  # changes the model's function: opt-in only
    return None


def convert_sequential_bn_act_(model: nn.Module, config, allowed, rep) -> None:
    """convert_ pattern: in every ``nn.Sequential``, BatchNorm{1,2,3}d followed by LeakyReLU
    (slope > 0), ELU (alpha > 0) or Identity becomes ``InPlaceABN`` + ``nn.Identity`` (the same
    function, one full-size tensor per block). With ``config.inplace_abn`` a following ReLU becomes
    leaky_relu(``config.leaky_relu_slope``): an opt-in change of the model's function.

    Parameters and buffers are shared. Like ``nn.ReLU(inplace=True)``, the result is written over
    the BatchNorm's input: a tensor that another op saved for backward makes autograd raise; a
    reference kept outside autograd (e.g. by a forward hook on the preceding layer) sees the output.

    Args:
        model: the model (changed in place).
        config: a ``slimgrad.ConvertConfig`` (reads ``inplace_abn`` and ``leaky_relu_slope``).
        allowed: ``allowed(module, qualified_name) -> bool`` (``convert_``'s filter_fn).
        rep: the ``ConvertReport`` to append to.
    """
    relu_slope = config.leaky_relu_slope if getattr(config, "inplace_abn", False) else None
    for prefix, seq in list(model.named_modules()):
        if not isinstance(seq, nn.Sequential):
            continue
        names = list(seq._modules.keys())
        for a, b in zip(names, names[1:]):
            bn, act = seq._modules[a], seq._modules[b]
            if type(bn) not in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d):
                continue
            spec = _act_spec(act, relu_slope)
            fqn = f"{prefix}.{a}" if prefix else a
            if spec is None or not allowed(bn, fqn):
                continue
            setattr(seq, a, InPlaceABN.from_torch(bn, activation=spec[0], activation_param=spec[1]))
            setattr(seq, b, nn.Identity())
            rep.converted.append((fqn, f"{type(bn).__name__}+{type(act).__name__}", "InPlaceABN"))
