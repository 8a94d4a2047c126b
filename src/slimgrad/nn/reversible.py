"""Reversible blocks: a chain of invertible blocks that keeps no activations for backward.

``ReversibleSequential(*blocks)`` runs its blocks like ``nn.Sequential``; in training it saves only
its output and rebuilds every block input from the block's output in backward (math, memory and
safety rules: ``slimgrad/ops/reversible.py``, NOTE [Reversible chains: nothing is freed, nothing is
kept]). Blocks are :class:`AdditiveCoupling`, :class:`AffineCoupling`, or any module with an
``inverse`` method.

Memory: saves the chain output (exact mode: its int32 fixed-point stream, also 4 B/elt) + 10 KiB of
RNG state per block; eager saves every F/G activation and block output, linearly in depth.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from slimgrad.nn._script import NoScript
from slimgrad.ops import reversible as _ops

__all__ = [
    "AdditiveCoupling",
    "AffineCoupling",
    "ReconstructionReport",
    "ReversibleSequential",
    "check_invertible",
]


def _check_module(api: str, name: str, m: object) -> None:
    if not isinstance(m, nn.Module):
        raise TypeError(
            f"slimgrad.nn.{api}: {name} must be an nn.Module; expected nn.Module, got "
            f"{type(m).__name__}. Wrap the function in an nn.Module."
        )


def _check_split_dim(api: str, split_dim: object) -> None:
    if not isinstance(split_dim, int) or isinstance(split_dim, bool):
        raise TypeError(
            f"slimgrad.nn.{api}: split_dim must be an int; expected int, got "
            f"{type(split_dim).__name__}. Pass e.g. split_dim=1 (channels)."
        )


def _check_input(api: str, x: torch.Tensor, split_dim: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"slimgrad.nn.{api}: input must be a Tensor; expected Tensor, got {type(x).__name__}. "
            "Pass one tensor."
        )
    if not -x.dim() <= split_dim < x.dim() or x.shape[split_dim] < 2:
        got = f"shape {tuple(x.shape)}"
        raise ValueError(
            f"slimgrad.nn.{api}: cannot split the input in two along split_dim={split_dim}; "
            f"expected a dimension of size >= 2, got {got}. Choose split_dim to name the channel "
            "dimension."
        )


class _Coupling(nn.Module):
    _slimgrad_coupling = ""

    def __init__(self, F: nn.Module, G: nn.Module, split_dim: int) -> None:
        super().__init__()
        api = type(self).__name__
        _check_module(api, "F", F)
        _check_module(api, "G", G)
        _check_split_dim(api, split_dim)
        self.F = F
        self.G = G
        self.split_dim = split_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(type(self).__name__, x, self.split_dim)
        x1, x2 = _ops.split_halves(x, self.split_dim)
        y1 = _ops._half_fwd(self, x1, self.F(x2))
        y2 = _ops._half_fwd(self, x2, self.G(y1))
        return torch.cat([y1, y2], dim=self.split_dim)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """Rebuild the input from the output: ``x2 = c^-1(y2, G(y1))``, ``x1 = c^-1(y1, F(x2))``."""
        _check_input(type(self).__name__, y, self.split_dim)
        y1, y2 = _ops.split_halves(y, self.split_dim)
        x2 = _ops._half_inv(self, y2, self.G(y1))
        x1 = _ops._half_inv(self, y1, self.F(x2))
        return torch.cat([x1, x2], dim=self.split_dim)

    def extra_repr(self) -> str:
        return f"split_dim={self.split_dim}"


class AdditiveCoupling(NoScript, _Coupling):
    """Additive coupling (NICE/RevNet): ``y1 = x1 + F(x2)``, ``y2 = x2 + G(y1)``.

    The input is split along ``split_dim`` into ``x1`` (first ``ceil(n/2)``) and ``x2``; F maps x2's
    shape to x1's, G maps x1's shape to x2's.

    Args:
        F: module applied to the second half.
        G: module applied to the new first half.
        split_dim: dimension to split (1: channels of NCHW).

    Example:
        >>> blk = AdditiveCoupling(nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 3, padding=1))
        >>> blk.inverse(blk(torch.randn(1, 4, 5, 5))).shape
        torch.Size([1, 4, 5, 5])
    """

    _slimgrad_coupling = "additive"

    def __init__(self, F: nn.Module, G: nn.Module, split_dim: int = 1) -> None:
        super().__init__(F, G, split_dim)


class AffineCoupling(NoScript, _Coupling):
    """Affine coupling: ``(r, t) = F(x2)``, ``y1 = x1 * s(r) + t``, and the same with G on ``(x2,
    y1)``.

    ``s(r) = exp(clamp * tanh(r / clamp))`` lies in ``[e^-clamp, e^clamp]``: it cannot reach 0 (or
    overflow), so the inverse ``x1 = (y1 - t) / s`` always exists. F must return ``2 * size(x1)``
    along ``split_dim`` (first half the log-scale ``r``, second half the shift ``t``), G likewise
    for x2.

    Args:
        F: module on the second half, returning (r, t) concatenated along ``split_dim``.
        G: module on the new first half, returning (r, t) for x2.
        split_dim: dimension to split.
        clamp: bound of |log s|; must be finite and > 0.

    Raises:
        ValueError: ``clamp`` is not a finite positive number.
    """

    _slimgrad_coupling = "affine"

    def __init__(self, F: nn.Module, G: nn.Module, split_dim: int = 1, clamp: float = 2.0) -> None:
        super().__init__(F, G, split_dim)
        if not isinstance(clamp, (int, float)) or not math.isfinite(clamp) or clamp <= 0:
            raise ValueError(
                f"slimgrad.nn.AffineCoupling: clamp bounds |log scale| and must be finite and > 0; "
                f"expected e.g. 2.0, got {clamp!r}. Pass a positive float."
            )
        self.clamp = float(clamp)

    def extra_repr(self) -> str:
        return f"split_dim={self.split_dim}, clamp={self.clamp}"


@dataclass(frozen=True)
class ReconstructionReport:
    """How far rebuilt block inputs were from the real ones in the last backward (sampled elements).

    Attributes:
        per_block_abs: max |rebuilt - original| over the sampled elements of each block input, block
        order.
        per_block_scale: max |original| over the same elements.
        max_abs: the largest of ``per_block_abs``.
        max_rel: the largest per-block ratio ``per_block_abs / per_block_scale``.
    """

    per_block_abs: tuple[float, ...]
    per_block_scale: tuple[float, ...]
    max_abs: float
    max_rel: float


def _rel_errors(errors: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    # per block |rebuilt - original| / max|original| (0 where both are 0)
    return torch.where(errors == 0, torch.zeros_like(errors), errors / scales)


class _Sink:
    # Receives the diagnostic from backward; a plain object (not the module) so ctx holds no module
    # state.
    def __init__(self, warn_rel_error: float | None) -> None:
        self.first = 0
        self.errors: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.warn_rel_error = warn_rel_error

    def _record_reconstruction(
        self, first: int, errors: torch.Tensor, scales: torch.Tensor
    ) -> None:
        self.first = first
        self.errors = errors
        self.scales = scales
        if self.warn_rel_error is None:
            return
        rel = float(_rel_errors(self.errors, self.scales).max())  # the one sync per backward
        if not rel <= self.warn_rel_error:
            warnings.warn(
                "slimgrad.nn.ReversibleSequential: rebuilt activations drifted from the forward's "
                f"(float rounding amplified over {len(errors)} blocks); expected relative "
                f"reconstruction error <= {self.warn_rel_error:g}, got {rel:.3g}, so gradients are "
                "off by a similar or larger amount. Use exact=True for a bit-exact rebuild, or "
                "smaller activations; see last_reconstruction.",
                RuntimeWarning,
                stacklevel=2,
            )


class ReversibleSequential(NoScript, nn.Module):
    """A chain of invertible blocks that keeps no activations: backward rebuilds them.

    Same call, names and ``state_dict`` keys as ``nn.Sequential`` (``"0.F.weight"``). In training
    (grad enabled and something requires grad) it runs one autograd Function that saves only the
    chain output; backward walks the blocks in reverse, evaluating F and G once per block both to
    rebuild the input and for the gradient. No storage is ever freed or resized, so inputs, views,
    residuals and hook captures stay valid.

    Args:
        *blocks: :class:`AdditiveCoupling`, :class:`AffineCoupling`, or modules with
            ``inverse(y)`` (an ``OrderedDict`` of them also works, as for ``nn.Sequential``).
        exact: hold the residual stream in fixed point (integers counting ``2^-grid_bits``, in
            ``stream_dtype``; F and G run in the input dtype on the stream's value rounded to it,
            and their outputs are rounded onto the grid, straight-through in backward). Rebuilds
            are bit-exact and gradients equal plain autograd's on the same network bit for bit
            (``reversible=False``). Additive couplings only.
        grid_bits: fraction bits of the exact-mode grid (default 20: steps of ~1e-6). The
            stream must stay below ``2^(31-grid_bits)`` (2048 at 20) in int32; forward raises a
            RuntimeError, never overflows silently.
        stream_dtype: exact mode's stream: ``torch.int32`` (4 B/elt) or ``torch.int64`` (8 B/elt,
            range ``2^(63-grid_bits)``).
        preserve_rng_state: record the RNG state before each F and G and replay it in backward
            (dropout).
        reversible: False runs the same maths with ordinary autograd (keeps activations; a
            reference, or for higher-order gradients).
        warn_rel_error: after each backward, warn (RuntimeWarning) when the sampled
            reconstruction error relative to the activations' size exceeds this; None skips the
            check (and its one device sync per backward). Default 1e-5 (~100 float32 ulps):
            measured, a 1.2e-5 drift already meant 2.5% gradient error (ReLU sign flips).

    Raises:
        TypeError: a block is not an nn.Module with an ``inverse`` method (or a coupling).
        ValueError: couplings split along different dims, ``grid_bits`` outside 1..30 (int32;
            1..62 for int64), ``stream_dtype`` not int32/int64, or a ``warn_rel_error`` that is
            not None or > 0.
        NotImplementedError: ``exact=True`` with a non-additive block.

    Notes: inside the chain a coupling's F and G are called directly, so hooks on F, G and their
    submodules fire (a second time in backward, during the recompute) while hooks on the coupling
    module itself do not. Under ``create_graph=True`` the first derivatives are right and
    differentiating them again raises (use ``reversible=False``). Under ``torch.compile`` the
    chain runs eagerly behind one graph break (``torch.compiler.disable``); under ``torch.func``
    transforms it runs with ordinary autograd (float mode; exact mode raises). Only block
    parameters and the input receive gradients: a tensor requiring grad that F or G captures
    otherwise (closure, plain attribute) makes backward raise, and so does a parameter changed
    in place between forward and backward (e.g. ``optimizer.step()``), as autograd's saved
    tensors would.

    Memory: saves the chain output (float: 1x the input; exact: the int32 stream, 4 B/elt, or 8
    after a promotion to int64) + 10 KiB RNG state per block; eager saves all F/G activations and
    block outputs (linear in depth). Diagnostic: after each backward, :attr:`last_reconstruction`
    reports the reconstruction error on sampled elements (0 in exact mode).

    Example:
        >>> f = lambda: nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
        >>> net = ReversibleSequential(*[AdditiveCoupling(f(), f()) for _ in range(8)])
        >>> net(torch.randn(2, 8, 16, 16, requires_grad=True)).sum().backward()
    """

    def __init__(
        self,
        *blocks: nn.Module,
        exact: bool = False,
        grid_bits: int = 20,
        preserve_rng_state: bool = True,
        reversible: bool = True,
        warn_rel_error: float | None = 1e-5,
        stream_dtype: torch.dtype = torch.int32,
    ) -> None:
        super().__init__()
        api = "ReversibleSequential"
        if len(blocks) == 1 and isinstance(blocks[0], OrderedDict):
            items = list(blocks[0].items())
        else:
            items = [(str(i), b) for i, b in enumerate(blocks)]
        dims = set()
        for name, blk in items:
            is_coupling = isinstance(blk, _Coupling)
            if not isinstance(blk, nn.Module) or not (
                is_coupling or callable(getattr(blk, "inverse", None))
            ):
                raise TypeError(
                    f"slimgrad.nn.{api}: block {name} is not invertible; expected an "
                    "AdditiveCoupling, AffineCoupling or nn.Module with an inverse() method, got "
                    f"{type(blk).__name__}. Wrap F and G in a coupling, or add inverse(y) to it."
                )
            if is_coupling:
                dims.add(blk.split_dim)
            if exact and getattr(blk, "_slimgrad_coupling", None) != "additive":
                raise NotImplementedError(
                    f"slimgrad.nn.{api}: exact=True needs additive couplings (sums are exact in "
                    "fixed point, products are not); expected AdditiveCoupling, got "
                    f"{type(blk).__name__} at block {name}. Use exact=False (the error is then "
                    "reported in last_reconstruction)."
                )
            self.add_module(name, blk)
        if len(dims) > 1:
            raise ValueError(
                f"slimgrad.nn.{api}: all couplings must split along the same dim; expected one "
                f"split_dim, got {sorted(dims)}. Give every coupling the same split_dim."
            )
        if stream_dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"slimgrad.nn.{api}: stream_dtype is exact mode's integer stream; expected "
                f"torch.int32 or torch.int64, got {stream_dtype!r}. Use torch.int64 for a wider "
                "range."
            )
        top = torch.iinfo(stream_dtype).bits - 2
        bad_bits = not isinstance(grid_bits, int) or isinstance(grid_bits, bool)
        if bad_bits or not 1 <= grid_bits <= top:
            raise ValueError(
                f"slimgrad.nn.{api}: grid_bits sets the fixed-point fraction bits; expected an int "
                f"in 1..{top} for stream_dtype={stream_dtype}, got {grid_bits!r}. The default 20 "
                "allows |values| < 2048 in int32; stream_dtype=torch.int64 allows more bits."
            )
        self.stream_dtype = stream_dtype
        self.split_dim = dims.pop() if dims else 1
        self.exact = bool(exact)
        self.grid_bits = grid_bits
        self.preserve_rng_state = bool(preserve_rng_state)
        self.reversible = bool(reversible)
        bad_warn = warn_rel_error is not None and not (
            isinstance(warn_rel_error, (int, float)) and warn_rel_error > 0
        )
        if bad_warn:
            raise ValueError(
                f"slimgrad.nn.{api}: warn_rel_error is the relative reconstruction error above "
                f"which backward warns; expected a float > 0 or None, got {warn_rel_error!r}. "
                "Pass e.g. 1e-5, or None to never check."
            )
        self._sink = _Sink(warn_rel_error)

    @classmethod
    def from_torch(cls, module: nn.Sequential, **kwargs) -> ReversibleSequential:
        """The same chain from an ``nn.Sequential`` of invertible blocks, sharing its modules.

        Args:
            module: an ``nn.Sequential`` whose children are couplings or have ``inverse``.
            **kwargs: ``exact``, ``grid_bits``, ``stream_dtype``, ``preserve_rng_state``,
                ``reversible``, ``warn_rel_error``.

        Raises:
            TypeError: ``module`` is not an ``nn.Sequential``, or a child is not invertible.
        """
        if not isinstance(module, nn.Sequential):
            raise TypeError(
                "slimgrad.nn.ReversibleSequential.from_torch: module must be an nn.Sequential of "
                f"invertible blocks; expected nn.Sequential, got {type(module).__name__}. Build "
                "ReversibleSequential(*blocks) directly."
            )
        return cls(OrderedDict(module.named_children()), **kwargs)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def __getitem__(self, idx: int) -> nn.Module:
        return list(self._modules.values())[idx]

    #: True where the output may be the model's output: float mode returns a copy of the output
    #: it keeps for backward (NOTE [A kept output at the model's output] in
    #: slimgrad/nn/_output_act.py; set by ``convert_``). Exact mode keeps its own stream.
    at_output = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if any(isinstance(b, _Coupling) for b in self):
            _check_input("ReversibleSequential", x, self.split_dim)
        y = self._chain(x)
        return y.clone() if self.at_output and not self.exact and y.requires_grad else y

    def _chain(self, x: torch.Tensor) -> torch.Tensor:
        return _ops.reversible_sequential(
            x,
            list(self),
            split_dim=self.split_dim,
            exact=self.exact,
            grid_bits=self.grid_bits,
            preserve_rng_state=self.preserve_rng_state,
            reversible=self.reversible,
            sink=self._sink,
            stream_dtype=self.stream_dtype,
        )

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """Rebuild the chain input from its output (float mode; no RNG replay)."""
        for blk in reversed(list(self)):
            y = blk.inverse(y)
        return y

    @property
    def last_reconstruction(self) -> ReconstructionReport | None:
        """Reconstruction error of the last reversible backward (None before the first one)."""
        s = self._sink
        if s.errors is None:
            return None
        errs = [float(e) for e in s.errors]
        scales = [float(v) for v in s.scales]
        pad = [float("nan")] * s.first
        return ReconstructionReport(
            per_block_abs=tuple(pad + errs),
            per_block_scale=tuple(pad + scales),
            max_abs=max(errs),
            max_rel=float(_rel_errors(s.errors, s.scales).max()),
        )

    def check_invertible(self, x: torch.Tensor) -> float:
        """Max |rebuilt - original| over all block inputs for sample input ``x``."""
        return check_invertible(self, x)

    def extra_repr(self) -> str:
        return (
            f"exact={self.exact}, grid_bits={self.grid_bits}, stream_dtype={self.stream_dtype}, "
            f"warn_rel_error={self._sink.warn_rel_error}, "
            f"preserve_rng_state={self.preserve_rng_state}, reversible={self.reversible}"
        )


def check_invertible(block: nn.Module, x: torch.Tensor) -> float:
    """Max absolute reconstruction error of ``block`` (or a chain) on sample input ``x``.

    Runs the forward with each F/G's RNG state recorded, then the inverse with the same states, and
    compares every rebuilt block input with the real one. Nothing requires grad, BatchNorm running
    stats are not updated, and the caller's RNG state is restored.

    Args:
        block: a coupling, a module with ``inverse``, or a :class:`ReversibleSequential`.
        x: a sample input.

    Returns:
        The largest |x_rebuilt - x| (float64) over all block inputs; 0.0 for an exact rebuild.

    Raises:
        TypeError: ``block`` has no inverse.

    Example:
        >>> blk = AdditiveCoupling(nn.Linear(3, 3), nn.Linear(3, 3), split_dim=-1)
        >>> check_invertible(blk, torch.randn(4, 6)) < 1e-5
        True
    """
    if isinstance(block, ReversibleSequential):
        blocks, dim, exact, bits = list(block), block.split_dim, block.exact, block.grid_bits
        sdt = block.stream_dtype
    elif isinstance(block, _Coupling) or callable(getattr(block, "inverse", None)):
        blocks, dim, exact, bits = [block], getattr(block, "split_dim", 1), False, 20
        sdt = torch.int32
    else:
        raise TypeError(
            f"slimgrad.nn.check_invertible: block has no inverse; expected a coupling, "
            f"ReversibleSequential or module with inverse(), got {type(block).__name__}. Add "
            "inverse(y)."
        )
    if any(isinstance(b, _Coupling) for b in blocks):
        _check_input("check_invertible", x, dim)
    err = _ops.reconstruction_error(
        blocks, x, split_dim=dim, exact=exact, grid_bits=bits, stream_dtype=sdt
    )
    return float(err)
