"""In-Place Activated BatchNorm modules: ``InPlaceABN`` and ``InPlaceABNSync``.

Drop-in for ``nn.BatchNorm{1,2,3}d`` followed by an invertible activation: same arguments,
Parameters, buffers and state_dict keys as ``nn.BatchNorm2d`` (a BatchNorm state_dict loads
unchanged), standard parametrisation (any sign of weight). The output is written over the input.

Memory: saves the output (same storage as the input) + one float per channel; eager BatchNorm +
activation saves the input and the output. See ``slimgrad.ops.inplace_abn``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slimgrad.ops.inplace_abn import check_activation, inplace_abn, inplace_abn_sync

__all__ = ["InPlaceABN", "InPlaceABNSync", "convert_sequential_bn_act_"]


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
        self._check_input_dim(x)
        factor, bn_training = self._factor_and_mode()
        rm, rv = self._running_stats()
        return inplace_abn(
            x, rm, rv, self.weight, self.bias, bn_training, factor, self.eps, self.activation,
            self.activation_param,
        )  # fmt: skip

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
