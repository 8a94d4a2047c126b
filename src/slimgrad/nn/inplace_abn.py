"""In-Place Activated BatchNorm modules: ``InPlaceABN`` and ``InPlaceABNSync``.

Drop-in for ``nn.BatchNorm{1,2,3}d`` followed by an invertible activation: same arguments,
Parameters, buffers and state_dict keys as ``nn.BatchNorm2d`` (a BatchNorm state_dict loads
unchanged), standard parametrisation (any sign of weight). The output is written over the input
only where ``slimgrad.ownership.owns_input`` proves at call time that nobody else can see the input
(NOTE [Gradient-buffer ownership]); otherwise it goes into a new tensor and the input is unchanged.

Memory: saves the output + one float per channel on both paths (in place the output reuses the
input's storage; out of place the input stays the caller's and the output is one new full-size
tensor, as eager BatchNorm's); eager BatchNorm + activation saves the input and the output. See
``slimgrad.ops.inplace_abn``.

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

from slimgrad import ownership
from slimgrad._autograd import first_order
from slimgrad._compile import eager_only
from slimgrad.nn._script import NoScript
from slimgrad.ops import _derived
from slimgrad.ops.inplace_abn import (
    check_activation,
    inplace_abn,
    inplace_abn_copy,
    inplace_abn_sync,
)
from slimgrad.ops.leaky_relu import leaky_relu

__all__ = [
    "InPlaceABN",
    "InPlaceABNSync",
    "LeakyReLUAfterABN",
    "MaxPool2dRecompute",
    "RecomputeABN",
    "convert_sequential_bn_act_",
    "global_hooks",
    "has_hooks",
    "occurrences",
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
# once per memo). Traced, the pair works differently: NOTE [ABN-activation pairs under
# torch.compile].
#
# NOTE [ABN-activation pairs under torch.compile]
# While Dynamo traces, the pair computes leaky_relu(BN(x)) as two ops: the InPlaceABN applies the
# identity activation (BN only) and the ReLU applies leaky_relu to whatever it gets. No registry
# is read (a WeakIdKeyDictionary is untraceable, and a tensor's ``_version`` traces to an
# unbacked SymInt that cannot be compared), so nothing breaks the graph, and the function is the
# pair's on every path: the ABN output through the ReLU gives leaky_relu(BN(x)) as the identity
# path does, anything else leaky_relu(x). The ReLU writes in place only where eager would write
# (``inplace``) and never over a traced pair output (tagged ``_TRACED_TAG`` at trace time): the
# ABN's backward keeps that tensor. An output of an InPlaceABN that ran eagerly (it already
# applied leaky_relu; ``_register_output`` tags it ``_TAG``, which Dynamo reads and guards on)
# sends a traced ReLU to the eager registry lookup (one graph break), so mixing eager and
# compiled modules stays exact. Under torch.compile the ABN keeps BN(x) and the leaky_relu keeps
# what the compiler's partitioner chooses (eager InPlaceABN's one-tensor contract is an eager one).
#
# Root cause of the wrong gradients the earlier eager-only guard hid (torch 2.13, aot_eager and
# inductor; pure-torch repros in tests/test_abn_compile.py): the registry calls were graph breaks
# (Dynamo refuses to trace WeakIdKeyDictionary.get/__setitem__/__delitem__), so the ReLU's
# leaky_relu(inplace=True) started a new graph whose *input* it wrote through slimgrad's
# mark_dirty autograd.Function. AOTAutograd runs the Function's forward body with grad disabled,
# records the write as an input mutation under no_grad (``mutations_under_no_grad_or_inference_
# mode=True``) and the output as a view of the input, and the Function's backward disappears: the
# compiled backward graph is ``return (tangents_1,)``, so the post-residual activation passed
# gradients through unscaled (every grad off by O(1); outputs exact). A second torch defect bites
# the two-op form: an in-place write over a tensor an autograd.Function saved is silently seen by
# its compiled backward (eager raises autograd's in-place error), hence the out-of-place
# leaky_relu on a traced pair output. The InPlaceABN's own mark_dirty Function never meets (1):
# traced, ``ownership.owns_input`` refuses, so it writes over ``x.clone()``, never a graph input.
_ABN_OUTPUTS: WeakIdKeyDictionary = WeakIdKeyDictionary()
ownership.register_registry(_ABN_OUTPUTS)


class _PairToken:
    pass


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version


_TAG = "_slimgrad_abn_pair"  # on an eager pair output: a traced ReLU asks the registry
_TRACED_TAG = "_slimgrad_abn_traced"  # on a traced pair output: BN(x), saved by the ABN's backward


def _register_output(out: torch.Tensor, token: _PairToken) -> None:
    # eager only (NOTE [ABN-activation pairs under torch.compile]): never called while tracing
    _ABN_OUTPUTS[out] = (token, _version(out))
    setattr(out, _TAG, token)


@eager_only
def _take_output(x: torch.Tensor, token: _PairToken) -> bool:
    entry = _ABN_OUTPUTS.get(x)
    if entry is None or entry[0] is not token or entry[1] != _version(x):
        return False
    del _ABN_OUTPUTS[x]
    x.__dict__.pop(_TAG, None)
    return True


class InPlaceABN(NoScript, nn.Module):
    """BatchNorm (1d/2d/3d) + invertible activation, computed in place where that is invisible.

    ``z = act(weight * (x - mean) / sqrt(var + eps) + bias)``, written over ``x`` when
    ``slimgrad.ownership.owns_input`` proves at call time that nobody else can see ``x`` (the
    parent runs ``v = layer(v)`` on a fresh ``v``: a later child of an ``nn.Sequential``,
    ``out = self.bn(out)`` after a conv; no hooks, no other holder); else into a new tensor, and
    ``x`` is left as it was (NOTE [Gradient-buffer ownership]).

    Memory: saves z (shared with the next layer) + one float per channel on both paths; in place z
    reuses x's storage, out of place z is one new full-size tensor (as eager BatchNorm's output).
    Eager BatchNorm + LeakyReLU(inplace) saves x and z.

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
        >>> layer(h) is h  # h is still visible here: computed out of place
        False
        >>> block = torch.nn.Sequential(conv, layer)
        >>> z = block(torch.randn(2, 3, 9, 9))  # written over conv's fresh output
    """

    _version = 2
    _api = "nn.InPlaceABN"
    # asks ownership.owns_input; its output is a new tensor or its owned input (NOTE [Forward
    # ownership from stated structure])
    _slimgrad_owns_input = True
    _slimgrad_fresh_output = True
    #: True where the output may be the model's output: the module returns a copy of what it
    #: keeps for backward (NOTE [A kept output at the model's output] in
    #: slimgrad/nn/_output_act.py; set by ``convert_``)
    at_output = False

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
        owned = ownership.owns_input(x, self)  # first use of x: NOTE [Gradient-buffer ownership]
        paired = "_pair_token" in self.__dict__
        if torch.compiler.is_compiling():  # NOTE [ABN-activation pairs under torch.compile]
            if not paired:
                return InPlaceABN._forward(self, x, owned)
            out = InPlaceABN._forward(self, x, owned, "identity")
            setattr(out, _TRACED_TAG, self._pair_token)
            return out
        return self._forward_paired(x, owned) if paired else self._forward(x, owned)

    def _forward(
        self, x: torch.Tensor, owned: bool = False, activation: str | None = None
    ) -> torch.Tensor:
        self._check_input_dim(x)
        factor, bn_training = self._factor_and_mode()
        rm, rv = self._running_stats()
        act = self.activation if activation is None else activation
        z = (inplace_abn if owned else inplace_abn_copy)(
            x, rm, rv, self.weight, self.bias, bn_training, factor, self.eps, act,
            self.activation_param if act != "identity" else 0.0,
        )  # fmt: skip
        # NOTE [A kept output at the model's output] in slimgrad/nn/_output_act.py
        return z.clone() if self.at_output and z.requires_grad else z

    def _forward_paired(self, x: torch.Tensor, owned: bool = False) -> torch.Tensor:
        # NOTE [ABN-activation pairs]; eager only (forward traces the pair differently)
        out = self._forward(x, owned)
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
        owned = ownership.owns_input(x, self)  # first use of x: NOTE [Gradient-buffer ownership]
        self._check_input_dim(x)
        if not owned:
            x = x.clone()
        factor, bn_training = self._factor_and_mode()
        rm, rv = self._running_stats()
        if bn_training and self.training:
            z = inplace_abn_sync(
                x, rm, rv, self.weight, self.bias, True, factor, self.eps, self.activation,
                self.activation_param, process_group=self.process_group,
            )  # fmt: skip
        else:
            z = inplace_abn(
                x, rm, rv, self.weight, self.bias, bn_training, factor, self.eps,
                self.activation, self.activation_param,
            )  # fmt: skip
        # NOTE [A kept output at the model's output] in slimgrad/nn/_output_act.py
        return z.clone() if self.at_output and z.requires_grad else z


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
        ctx.recipe = recipe.pinned()
        ctx.recipe_tensors = ctx.recipe.tensors
        ctx.conf = (training, eps, slope)
        if training:
            ctx.stats = (None, None)
        else:  # eval uses the running statistics as they are now (O(C) copies)
            ctx.stats = (running_mean.clone(), running_var.clone())
        ctx.save_for_backward(weight, bias, mean, invstd)
        return z

    @staticmethod
    @first_order("nn.RecomputeABN")
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
    torch.compile, under torch.utils.checkpoint's hooks) it is :class:`InPlaceABN`.

    Memory: with a recipe: 2 floats per channel (+ 2 running-stat copies in eval); the output is
    a new tensor (the conv output is freed by the caller). Eager BN + LeakyReLU keeps c and z.
    """

    _api = "nn.RecomputeABN"

    @eager_only
    def _forward_paired(self, x: torch.Tensor, owned: bool = False) -> torch.Tensor:
        return self._forward(x, owned)

    @eager_only
    def _forward(self, x: torch.Tensor, owned: bool = False) -> torch.Tensor:
        recipe = None
        if (
            torch.is_grad_enabled()
            and self.activation == "leaky_relu"
            and not x.is_meta  # NOTE [Meta tensors take eager's op] in slimgrad/_autograd.py
            and not torch.is_autocast_enabled(x.device.type)
            # the recipe kept for backward: not under checkpoint's hooks, whose forward holds a
            # stand-in (NOTE [A recipe made in a checkpoint's forward] in ops/_derived.py)
            and not _derived.under_checkpoint()
        ):
            recipe = _derived.lookup_recipe(x, "always")
        if recipe is None:
            out = super()._forward(x, owned)
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
        ctx.conf, ctx.recipe = conf, recipe.pinned()
        ctx.recipe_tensors = ctx.recipe.tensors
        return out

    @staticmethod
    @first_order("nn.MaxPool2dRecompute")
    def backward(ctx, grad):
        z = _recipe_of(ctx)()
        _, idx = torch.ops.aten.max_pool2d_with_indices(z, *ctx.conf)
        dz = torch.ops.aten.max_pool2d_with_indices_backward(grad, z, *ctx.conf, idx)
        _release(ctx)
        return dz, None, None


class MaxPool2dRecompute(NoScript, nn.MaxPool2d):
    """``torch.nn.MaxPool2d`` that keeps nothing full-size when its input has a recipe (the output
    of :class:`RecomputeABN`): it re-runs the recipe and the pooling in backward (NOTE
    [Recomputed stem]). Elsewhere (under torch.utils.checkpoint's hooks too) exactly torch's.

    Memory: with a recipe: nothing; eager keeps its input and int64 indices.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # no recipe is made while tracing (RecomputeABN)
            return super().forward(input)
        return self._forward_eager(input)

    @eager_only
    def _forward_eager(self, input: torch.Tensor) -> torch.Tensor:
        recipe = None
        if (
            torch.is_grad_enabled()
            and input.requires_grad
            and not self.return_indices
            # the recipe kept for backward: not under checkpoint's hooks, whose forward holds a
            # stand-in (NOTE [A recipe made in a checkpoint's forward] in ops/_derived.py)
            and not _derived.under_checkpoint()
        ):
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


class LeakyReLUAfterABN(NoScript, nn.Module):
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

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # NOTE [ABN-activation pairs under torch.compile]
            if getattr(input, _TAG, None) is not None:  # an eager InPlaceABN's output
                return self._forward_eager(input)  # graph break: the registry decides
            own = getattr(input, _TRACED_TAG, None) is self._pair_token
            return torch.nn.functional.leaky_relu(
                input, self.negative_slope, self.inplace and not own
            )
        return self._forward_eager(input)

    @eager_only
    def _forward_eager(self, input: torch.Tensor) -> torch.Tensor:
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


_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def has_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has hooks of its own (forward, backward or state_dict ones)."""
    return any(getattr(module, k, None) for k in _HOOK_DICTS)


def share_hooks(old: nn.Module, new: nn.Module) -> None:
    """Give ``new``, the replacement of ``old``, ``old``'s hook dicts themselves (not copies), as
    ``convert_`` does for the modules its table replaces (``slimgrad.convert._carry_hooks``): every
    hook registered before the conversion fires on ``new``, and its ``RemovableHandle`` still
    removes it (from a copy it would not: the converted model would keep running a removed hook).
    For the passes that swap modules themselves (``bn_act_pattern``, ``inplace_abn_pattern``)."""
    for k, v in old.__dict__.items():
        if k.startswith("_") and "hooks" in k and isinstance(v, dict):
            new.__dict__[k] = v
    new._is_full_backward_hook = old._is_full_backward_hook


def global_hooks() -> bool:
    """Whether global module forward/backward hooks are registered (they see every module)."""
    g = torch.nn.modules.module
    return bool(
        g._global_forward_hooks
        or g._global_forward_pre_hooks
        or g._global_backward_hooks
        or g._global_backward_pre_hooks
    )


def occurrences(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """``{id(module): [(parent, name), ...]}``: every place a module is held in ``model``'s tree
    (a module shared by several parents, or held twice by one, has several)."""
    occ: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent in model.modules():
        for name, child in parent._modules.items():
            if child is not None:
                occ.setdefault(id(child), []).append((parent, name))
    return occ


def _plain_sequential(m: nn.Module) -> bool:
    # a forward set on the instance (NOTE [A forward set on the instance] in
    # convert_handlers/inplace_guard.py) may index the children: fusing two of them moves the rest
    return (
        isinstance(m, nn.Sequential)
        and type(m).forward is nn.Sequential.forward
        and "forward" not in m.__dict__
    )


_HOOKED = "it or the activation after it has hooks (they would see act(BN(x)) as the BN output)"
_INSTANCE = (
    "it or the activation after it has a forward set on the instance (the fusion would drop it)"
)
_GLOBAL = "global module hooks are registered (they would see act(BN(x)) as the BN output)"


def _bn_site_reason(parent, name, relu_slope):
    # (reason this occurrence of a BatchNorm cannot pair, the activation module after it)
    if not _plain_sequential(parent):
        return "it is also used outside an nn.Sequential (or in one with its own forward)", None
    names = list(parent._modules.keys())
    k = names.index(name)
    act = parent._modules[names[k + 1]] if k + 1 < len(names) else None
    if act is None or _act_spec(act, relu_slope) is None:
        return "it is also used where no invertible activation follows it", None
    return None, act


def convert_sequential_bn_act_(model: nn.Module, config, allowed, rep) -> None:
    """convert_ pattern, only with ``ConvertConfig(inplace_abn=True)``: in every ``nn.Sequential``,
    BatchNorm{1,2,3}d followed by LeakyReLU (slope > 0), ELU (alpha > 0), Identity or ReLU becomes
    ``InPlaceABN`` + ``nn.Identity``: one full-size tensor per block, but the two slots no longer
    compute what they computed: the BatchNorm slot returns BN + activation, the activation slot the
    identity, so ``model[:k]`` ending at the BatchNorm, per-layer iteration, hooks added after
    conversion and replacing either slot see that. A ReLU becomes
    leaky_relu(``config.leaky_relu_slope``), which changes the whole model's function. Both are why
    this is opt-in; the default config keeps every slot's function and still keeps one tensor per
    block (``bn_act_pattern`` in ``slimgrad/convert_handlers/cnn.py``, NOTE [Derived saved inputs]).

    Parameters and buffers are shared. The InPlaceABN writes over the BatchNorm's input only when
    ``slimgrad.ownership.owns_input`` proves at call time that nobody else sees it (the previous
    child's fresh output, no hooks); the Sequential's own input, a tensor a hook keeps and the like
    get a new output tensor (NOTE [Gradient-buffer ownership]). Skipped, with the reason in the
    report: a BatchNorm or activation with hooks, any pair while global module hooks are
    registered, a BatchNorm or activation also used elsewhere than in such a pair (a module held by
    several parents stays one module: all its places are swapped together or none), Sequential
    subclasses with their own ``forward``.

    Args:
        model: the model (changed in place).
        config: a ``slimgrad.ConvertConfig`` (reads ``inplace_abn`` and ``leaky_relu_slope``).
        allowed: ``allowed(module, qualified_name) -> bool`` (``convert_``'s filter_fn).
        rep: the ``ConvertReport`` to append to.
    """
    relu_slope = config.leaky_relu_slope if getattr(config, "inplace_abn", False) else None
    names = {id(m): n for n, m in model.named_modules()}
    occ = occurrences(model)
    # candidate BatchNorms: some occurrence is directly followed by an invertible activation in a
    # plain nn.Sequential
    cands: dict[int, nn.Module] = {}
    for seq in model.modules():
        if not _plain_sequential(seq):
            continue
        kids = list(seq._modules.values())
        for bn, act in zip(kids, kids[1:]):
            if type(bn) in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d) and act is not None:
                if _act_spec(act, relu_slope) is not None:
                    cands.setdefault(id(bn), bn)
    ok: dict[int, tuple[nn.Module, list]] = {}  # id(bn) -> (bn, [(parent, name, act)])
    for key, bn in cands.items():
        fqn = names.get(key, "?")
        sites, reason = [], None
        for parent, name in occ.get(key, []):
            why, act = _bn_site_reason(parent, name, relu_slope)
            if why is not None:
                reason = why
                break
            sites.append((parent, name, act))
        specs = {_act_spec(a, relu_slope) for _, _, a in sites}
        if reason is None and len(specs) != 1:
            reason = "different activations follow it at its places"
        if reason is None and (has_hooks(bn) or any(has_hooks(a) for _, _, a in sites)):
            reason = _HOOKED
        if reason is None and global_hooks():
            reason = _GLOBAL
        own = ["forward" in m.__dict__ for m in [bn] + [a for _, _, a in sites]]
        if reason is None and any(own):
            # NOTE [Instance forward on a fused leaf]: the fusion replaces both modules by an
            # InPlaceABN + Identity computed from the class's function; a forward set on either
            # instance (lambda, MethodType, partial, wrapper) is code the fusion cannot carry over,
            # so the pair stays eager (outputs were off by 2.14 / 1.38 before this check)
            reason = _INSTANCE
        if not allowed(bn, fqn):
            continue  # the table pass reports it
        if reason is not None:
            rep.skipped.append((fqn, type(bn).__name__, "InPlaceABN: " + reason))
            continue
        ok[key] = (bn, sites)
    # an activation instance becomes nn.Identity everywhere, so each of its places must follow a
    # converted BatchNorm; drop pairs until that holds
    changed = True
    while changed:
        changed = False
        after: dict[int, int] = {}  # id(act) -> places that follow a converted BatchNorm
        for _, sites in ok.values():
            for _, _, act in sites:
                after[id(act)] = after.get(id(act), 0) + 1
        for key in list(ok):
            bn, sites = ok[key]
            bad = [a for _, _, a in sites if after[id(a)] != len(occ.get(id(a), []))]
            if bad:
                del ok[key]
                changed = True
                rep.skipped.append((
                    names.get(key, "?"), type(bn).__name__,
                    f"InPlaceABN: the activation after it ({names.get(id(bad[0]), '?')}) is also "
                    "used elsewhere",
                ))  # fmt: skip
    identity: dict[int, nn.Module] = {}
    for key, (bn, sites) in ok.items():
        spec = _act_spec(sites[0][2], relu_slope)
        abn = InPlaceABN.from_torch(bn, activation=spec[0], activation_param=spec[1])
        for parent, name, act in sites:
            parent._modules[name] = abn
            names_ = list(parent._modules.keys())
            nxt = names_[names_.index(name) + 1]
            parent._modules[nxt] = identity.setdefault(id(act), nn.Identity())
        acts = "+".join(dict.fromkeys(type(a).__name__ for _, _, a in sites))
        rep.converted.append((names.get(key, "?"), f"{type(bn).__name__}+{acts}", "InPlaceABN"))
    ownership.state_inputs_(model)  # NOTE [Forward ownership from stated structure]
