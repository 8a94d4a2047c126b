"""Fit a step into a memory budget with the least recompute: :func:`plan`.

A *plan* picks, for each repeated block of a model (HF decoder layers, GPT-2 blocks, a ResNet
stage's shape-preserving blocks), one of these choices:

- ``eager``: left as it is;
- ``lean``: slimgrad's lean ops (what ``convert_`` does);
- ``lean+recompute``: lean ops, and the whole block recomputed in backward
  (``torch.utils.checkpoint``, non-reentrant, RNG state restored);
- ``lean+recompute:<child>``: lean ops, and only that child (e.g. ``mlp``) recomputed;
- ``lean+recompute:attention-core``: lean ops, and only the attention core of the block's HF
  attention modules (``QK^T``, softmax, dropout, ``PV``; not the projections) recomputed,
  Megatron-style (NOTE [The attention core, recomputed] in ``attention_core.py``);
- ``lean+recompute:mlp-activation``: lean ops, and the activation of the block's gated MLPs
  (``act(g) * u``) always recomputed from the kept pre-activations, also where the lean op's
  backward peaks above eager's and ``lean`` runs eager's ops there (NOTE [The MLP's activation,
  recomputed]); no matmul recomputed;
- ``eager+recompute``: the block as it is, recomputed (plain activation checkpointing);
- ``lean+sac``: lean ops under torch's selective checkpointing that saves every matmul/attention
  output and recomputes the rest (no matmul FLOPs recomputed; the elementwise ops between the
  matmuls are): what SAC drops from what the lean ops keep (NOTE [Lean ops under selective
  checkpointing]);
- ``eager+sac``: the block as it is under that selective checkpointing: measured as the SAC
  baseline, chosen only when ``choices`` names it (``lean+sac`` keeps no more and gives the lean
  model's bits).

The rest of the model (embeddings, head, loss) is converted as ``convert_`` converts it. A plan
names blocks by their qualified module names, so it applies to any model built from the same
config (:func:`slimgrad.convert_` with ``plan=``). Recompute is exact: the recomputed forward runs
the same ops on the same inputs with the RNG state of the first forward, so it gives the bits of
the same choice without recompute (dropout masks included).

# NOTE [How plan chooses]
1. Measure. One forward under fake tensors finds the blocks (children of a ModuleList or
   Sequential with at least two children of one class, whose output has its input's shape; the
   outermost such) and the matmul FLOPs of every module (``FlopCounterMode``, with CPU's fused
   SDPA counted as its formula counts CUDA's: QK^T and PV; the attention core's are its module's
   less its children's): the forward's, the unit of ``recompute_fraction``; a choice's recompute
   is counted in the step that measures it (NOTE [Recompute is counted, not derived]). Blocks of
   the same
   class and parameter shapes are one *kind*, measured once whatever its number of blocks. Each
   choice runs as two adjacent real blocks in that choice; one
   :func:`slimgrad.memory.estimate` holds as many such pairs as the kind's blocks allow (a kind of
   ``n`` blocks: ``(n - 1) // 2`` pairs, its first blocks in order, the block after them passed
   through to close the last pair's forward, every other block passed through: its forward
   returns its input), so the head (embeddings, loss) runs once per ``(n - 1) // 2`` choices, not
   once per choice. Hooks that keep no tensor mark on the tracker's timeline where each real
   block's forward starts and ends and its backward starts (its output's gradient is ready) and
   ends (its input's is). From them, per kind and choice: ``r`` = bytes a block keeps from
   forward to backward (the live bytes its pair's second block added from its forward start to
   the next block's: that block's input is the output of a block in its own choice, as in a
   uniform run; the step's first block can differ, e.g. HF Llama's forward holds the first
   block's input, ``inputs_embeds``, until it returns, so a block that does not keep its input
   adds one hidden state more there, which halved over the pair over-counted every such block
   by half a hidden state), ``left`` = bytes a block leaves live once its backward ran (its
   parameters' gradients and what else outlives it, e.g. a checkpoint's leftovers: the live bytes
   when the pair's first block's backward starts less those when the second's does, plus ``r``),
   and the peak of each segment of the timeline (before the blocks, their forwards, the head from
   the last block's forward to its backward, their backwards, after them) less what the other
   real blocks keep or have left there. The head's segment is measured with the last pair's
   choice (``lean``, what late blocks mostly are) and taken for the others as that less its
   ``r`` plus theirs. Two real blocks per choice, not one: a block's backward transient depends
   on whether the gradient it receives comes from another block or from the head (ownership may
   write over one and not the other), and the leftovers of blocks already done only show with a
   block after them. The choices that recompute are measured in other steps than those that do
   not (``eager``, ``lean``): a recomputed block keeps what it was called with until its
   backward, and some of that every block shares (HF Llama's position ids); measured after a
   recomputed pair, a lean pair's head and backward segments carried those bytes, and every layer
   lean composed 1,024 B above its full estimate on a 5-layer Llama (64 wide, 1 x 128 tokens).
   Estimates: per kind, ``ceil(recomputing choices / ((n - 1) // 2))`` plus as many for the
   others; two for a 32-block model's 8 choices. A kind of two blocks (or a step whose marks
   cannot be read) is measured one choice per estimate against one more with every block passed
   through (``r`` = half the retained bytes above it), a kind of one block on one real block and
   the step's peak only.
2. Compose. Blocks run forward in order and backward in reverse; while block ``i`` runs its
   forward or backward, the blocks before it keep their ``r`` and (backward) the blocks after it
   have left their ``left``. The composed peak of a choice vector ``x`` is the largest of: before
   the blocks; ``fwd(x_i) + sum_{j<i} r_j``; the head's ``head(x_last) + sum_{j<last} r_j``;
   ``bwd(x_i) + sum_{j<i} r_j + sum_{j>i} left_j``; after them ``post + sum_j left_j``. For a
   plan with every block in one choice this was the full estimate's peak exactly on a 4-block
   GPT-2 (128 wide, fp32) and the toy MLP of tests/test_plan.py, and 0% (eager, lean+recompute)
   to 5.8% (eager+recompute) above it on a 4-layer Llama (128 wide, 4 x 256 tokens) under bf16
   autocast (the one-block model this replaces: up to 19% under). Where neighbours differ it is
   not exact (a block's backward transient depends on its neighbour's choice): on those three
   models, between 6.6% under and 3.9% over the full estimate over the greedy's walk and mixed
   plans (measured while recomputed HF layers still wrote their KV cache twice: NOTE [A
   recomputed block does not write the KV cache]). So the chosen plan is then estimated whole
   (``verify``, one full estimate of the applied model) and repaired greedily: while that peak is
   above the budget, the plan moves on along the curve (more recompute) to the first point whose
   composed peak is lower by at least the measured excess (at most four moves). Once one fits, the
   plan the measured slack allows is tried once (one more full estimate) and kept if it fits.
   ``Plan.peak_bytes`` is the full estimate of the returned plan: planned = estimated, exactly.
   The baselines a plan reports (``Plan.baselines``: every block ``eager``, ``lean``,
   ``eager+recompute``, ``lean+recompute``, ``eager+sac``) are composed the same way, so the rest
   of the model (embeddings, final norm, head, loss) is converted in all of them, as in every
   plan: they compare the blocks' choices, not slimgrad against the user's unconverted model.
   On HF Llama ~1B under bf16 autocast (4 x 2048 tokens, vocab 32000, device cuda) the composed
   eager, checkpoint-all and SAC baselines equal the full estimates of those models with the rest
   converted (19,309,543,692 / 4,736,753,688 / 9,684,644,088 vs 9,684,644,096 B) and sit 12.7%,
   16.6% and 21.5% under the unconverted models' full estimates: the two differ only in the
   modules outside the blocks (converted or not), so that gap is theirs, not the composition's.
   ``benchmarks/plan_targets.py`` records both.
3. Choose. Per kind, the choices' points (recompute FLOPs, kept bytes ``r``) are reduced to
   their lower convex hull: walking it, each step frees the most bytes per recomputed FLOP.
   Greedy: start with every block at the hull's first point (the least kept bytes among the
   choices that recompute nothing), then repeatedly move the one block whose next hull step frees
   the most bytes per FLOP (blocks are taken from the first block on: an early block's backward
   runs last, when the least is kept, so its recompute transient lands lowest), until the composed
   peak fits the budget. Every prefix of this walk is a point of the Pareto curve.
   Optimality: for the kept-bytes term alone (the sum, which sets the peak at the start of
   backward whenever activations outweigh a block's gradients) this is the greedy solution of a
   multiple-choice knapsack over convex hulls, which is optimal for the LP relaxation; the
   integral plan is at most one hull step of one block (that block's recompute FLOPs) above the
   optimum at its peak. The transient terms (the segments' peaks and what later blocks left) are
   not additive; where they set the peak the greedy is a heuristic: it keeps going while the
   composed peak falls.
4. Refuse. A budget below every composed peak of the curve, or one the repair could not reach,
   is refused only after a whole-model check: the curve's plan with the lowest composed peak and
   the most recomputed plan (every block at its hull's last point) are estimated whole; the first
   that fits is returned, else the error names the lowest peak those full estimates measured and
   its recompute. (The composition can over-count: on a 4-layer Llama, 64 wide, 4 x 256 tokens
   under bf16 autocast, every layer lean, lean+recompute or lean+recompute:self_attn composes to
   its full estimate within 28 B, every layer eager+recompute 3.0% above it; the curve's lowest
   point mixes choices, and a budget 1 B below its composed peak is planned by this check.)
5. What comes from ``convert_``'s stages (analyse -> decide -> apply -> record, ``convert.py``).
   The planner applies every choice through ``convert_`` (:func:`apply_choices`: a ``filter_fn``
   that leaves ``eager`` blocks out), so whether and how each module converts, its device rule
   (``ModelFacts.targets``), the HF facts and templates (``ModelFacts.hf``, ``decide_patterns``),
   the features this installation lacks and the reasons a module stays are ``convert_``'s, read
   from its stages as they run inside each measured model, and ``convert_(model, plan=)`` is the
   same call. The rest cannot come from them: ``ModelFacts`` holds model-wide facts (targets,
   HF or not, features off), none about repeated blocks, and a block here is defined by a run of
   the step (a child of a ModuleList or Sequential whose output has its input's shape and dtype,
   in the order the forward calls them, and its matmul FLOPs from ``FlopCounterMode``); each
   choice's bytes (``r``, ``left``, the segments' peaks) are the tracker's figures of a step of
   the converted model under fake tensors, and each estimate builds and converts its own model,
   since fake tensors do not move between ``FakeTensorMode`` instances: one converted model
   cannot serve two estimates.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

__all__ = ["CHOICES", "CHOICE_HELP", "Plan", "parse_bytes", "plan"]

_REPAIRS = 4  # full estimates the greedy repair spends before the whole-model check

#: block choices; ``lean+recompute:<child>`` names one child (see the module docstring)
CHOICES = ("eager", "lean", "lean+sac", "eager+sac", "lean+recompute", "eager+recompute")
#: ``lean+recompute:attention-core``: the attention core of the block's HF attention modules
CORE = "attention-core"
#: ``lean+recompute:mlp-activation``: the activation of the block's gated MLPs
ACT = "mlp-activation"

#: what each choice runs and recomputes, one line each (``slimgrad plan --help`` lists them)
CHOICE_HELP = {
    "eager": "the block as it is; nothing recomputed",
    "lean": "slimgrad's lean ops (what convert_ does); no matmul recomputed",
    "lean+sac": "lean ops under selective checkpointing saving every matmul/attention output; "
    "the elementwise ops between them recomputed",
    f"lean+recompute:{ACT}": "lean ops; the gated MLP's act(g) * u always recomputed from g and "
    "u (also where lean runs eager's ops); no matmul recomputed",
    f"lean+recompute:{CORE}": "lean ops; the attention core (QK^T, softmax, dropout, PV) "
    "recomputed, Megatron-style",
    "lean+recompute:<child>": "lean ops; that child (e.g. mlp, self_attn) recomputed",
    "lean+recompute": "lean ops; the whole block recomputed",
    "eager+recompute": "plain activation checkpointing of the block",
    "eager+sac": "selective checkpointing of the unconverted block (the SAC baseline; only when "
    "named)",
}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(budget: int | float | str, api: str = "slimgrad.plan") -> int:
    """``6GiB``, ``"512 MiB"``, ``1.5e9`` or an int: a byte count."""
    if isinstance(budget, bool) or not isinstance(budget, int | float | str):
        raise TypeError(
            f"{api}: budget must be bytes or a size string; expected an int or e.g. '6GiB', got "
            f"{type(budget).__name__}. Pass budget='6GiB'."
        )
    if isinstance(budget, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*", budget)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"{api}: budget must be a size; expected e.g. '6GiB', '512MiB' or '2e9', got "
                f"{budget!r}. Use a number with B, KiB, MiB, GiB (or KB, MB, GB)."
            )
        value = float(m.group(1)) * _UNITS[unit]
    else:
        value = float(budget)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"{api}: budget must be positive; expected a size above 0, got {budget!r}. "
            "Pass the bytes the step may use."
        )
    return int(value)


def _fmt(n: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


@dataclass
class CurvePoint:
    """One point of the budget -> recompute curve (composed peak; NOTE [How plan chooses])."""

    peak_bytes: int
    recompute_flops: int
    recompute_fraction: float
    label: str = ""


@dataclass
class Plan:
    """Per-block choices that fit a budget; apply with ``slimgrad.convert_(model, plan=plan)``."""

    budget_bytes: int
    peak_bytes: int
    predicted_peak_bytes: int
    verified: bool
    recompute_flops: int
    forward_flops: int
    choices: dict[str, str]
    device: str
    curve: list[CurvePoint] = field(default_factory=list)
    # composed, every block in one choice and the rest converted as in the plan (NOTE [How plan
    # chooses], 2): the unconverted model's own peaks are its full estimates
    baselines: dict[str, CurvePoint] = field(default_factory=dict)
    blocks: dict[str, dict] = field(default_factory=dict)  # per kind: what was measured
    seconds: float = 0.0
    # plans the search estimated whole (``verify``), including those found already estimated
    # (NOTE [Whole-model estimates are shared])
    full_estimates: int = 0

    @property
    def recompute_fraction(self) -> float:
        """Recomputed matmul FLOPs as a fraction of the eager forward's matmul FLOPs."""
        return self.recompute_flops / self.forward_flops if self.forward_flops else 0.0

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for c in self.choices.values():
            counts[c] = counts.get(c, 0) + 1
        lines = [
            f"budget    {_fmt(self.budget_bytes)}  ({self.device})",
            f"peak      {_fmt(self.peak_bytes)}"
            + ("  (full estimate)" if self.verified else "  (composed, not verified)"),
            f"recompute {self.recompute_flops:.4g} FLOPs = {self.recompute_fraction:.3f} x the "
            "forward's matmul FLOPs",
            "choices   " + ", ".join(f"{n} x {c}" for c, n in sorted(counts.items())),
        ]
        for name, c in self.choices.items():
            lines.append(f"  {name:40s} {c}")
        if self.baselines:
            lines.append("baselines (composed; every block in that choice, the rest converted):")
            for label, p in self.baselines.items():
                lines.append(
                    f"  {label:20s} peak {_fmt(p.peak_bytes):>12s}  recompute "
                    f"{p.recompute_fraction:.3f}"
                )
        return "\n".join(lines)

    def curve_text(self) -> str:
        lines = ["peak (composed)   recompute (x forward)"]
        for p in self.curve:
            lines.append(f"{_fmt(p.peak_bytes):>14s}   {p.recompute_fraction:.3f}")
        return "\n".join(lines)

    def plot(self, path: str) -> str:
        """Write the budget -> recompute curve and the baselines to a PNG (needs matplotlib)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError(
                "slimgrad.plan: plot needs matplotlib; expected it installed, got ImportError. "
                "Install the extra: pip install 'slimgrad[plot]'."
            ) from e
        top = max([self.peak_bytes] + [p.peak_bytes for p in self.curve])
        unit, gib = ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.step(
            [p.peak_bytes / gib for p in self.curve],
            [p.recompute_fraction for p in self.curve],
            where="post",
            marker=".",
            label="slimgrad.plan (composed)",
        )
        for label, p in self.baselines.items():
            ax.scatter([p.peak_bytes / gib], [p.recompute_fraction], marker="x")
            ax.annotate(label, (p.peak_bytes / gib, p.recompute_fraction), fontsize=8)
        ax.scatter(
            [self.peak_bytes / gib], [self.recompute_fraction], marker="o", color="k", zorder=3
        )
        ax.annotate("plan", (self.peak_bytes / gib, self.recompute_fraction), fontsize=8)
        ax.axvline(self.budget_bytes / gib, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xlabel(f"peak of the step ({unit}, {self.device})")
        ax.set_ylabel("recomputed matmul FLOPs / forward's")
        ax.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def to_dict(self) -> dict:
        # the dataclass fields only: ``_measured`` (what reuse= takes) is not part of the record
        skip = ("curve", "baselines")
        d = {k: v for k, v in self.__dict__.items() if k not in skip and not k.startswith("_")}
        d["recompute_fraction"] = self.recompute_fraction
        d["curve"] = [p.__dict__ for p in self.curve]
        d["baselines"] = {k: p.__dict__ for k, p in self.baselines.items()}
        d["blocks"] = _json_keys(d["blocks"])
        return d


def _json_keys(obj):
    # what was measured is keyed by tuples in places (a choice and its child): JSON needs str keys
    if isinstance(obj, dict):
        return {
            k
            if isinstance(k, (str, int, float, bool)) or k is None
            else ":".join(map(str, k))
            if isinstance(k, tuple)
            else str(k): _json_keys(v)
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [_json_keys(v) for v in obj]
    return obj


# --- applying choices to a model --------------------------------------------------------------


def _inner_forward(module: nn.Module):
    own = module.__dict__.get("_slimgrad_plan_inner")
    return own if own is not None else type(module).forward.__get__(module)


# NOTE [A recomputed block does not write the KV cache]
# An HF decoder layer called with a cache (``past_key_values``, ``layer_past``; HF models make a
# DynamicCache whenever ``use_cache`` is on, in training too) appends its keys and values to it.
# Recomputed in backward, it would append them a second time: the replayed attention then reads
# twice the keys (HF's SDPA slices them back, so plain checkpointing computes the same values
# with a cat and a slice more, and a cache kept alive through backward), and torch's selective
# checkpointing, which replays the recorded ops, fails ("aten.slice.Tensor ... not found in
# storage" on a 2-layer Llama, 64 wide). A recomputed block is therefore called without the cache,
# in forward and in recompute, exactly as HF's own ``gradient_checkpointing_enable`` calls a layer
# (transformers' GradientCheckpointingLayer: ``use_cache=False``, ``past_key_values=None``,
# ``layer_past=None`` unless the layer sets ``_can_checkpoint_with_cache``). The loss and the
# gradients are those of a call without the cache (``use_cache=False``; eager's differ from a call
# with one by rounding) when the cache starts empty (a training step); the returned cache lacks
# the recomputed blocks' keys, as under HF's checkpointing. HF GPT-2's model
# passes the cache by position (``block(hidden_states, past_key_values, ...)``), so the positions
# of these parameters in the block's forward are read from its signature, once per function.
_CACHE_KWARGS = ("past_key_values", "layer_past")
# forward function (or callable object) -> positions in *args of use_cache and the caches; weak
# keys: a converted block's forward object holds its block
_CACHE_POSITIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cache_positions(fn) -> tuple[int | None, tuple[int, ...]]:
    key = getattr(fn, "__func__", fn)
    try:
        got = _CACHE_POSITIONS.get(key)
    except TypeError:  # not weakly referenceable: read each call
        key, got = None, None
    if got is None:
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):  # no signature: only keywords are known
            params = []
        pos = {
            p.name: i
            for i, p in enumerate(params)
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        }
        got = (pos.get("use_cache"), tuple(pos[k] for k in _CACHE_KWARGS if k in pos))
        if key is not None:
            _CACHE_POSITIONS[key] = got
    return got


def _without_cache(module: nn.Module, fn, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if kwargs.get("use_cache"):
        kwargs = {**kwargs, "use_cache": False}
    keep = getattr(module, "_can_checkpoint_with_cache", False)
    if not keep:
        for k in _CACHE_KWARGS:
            if kwargs.get(k) is not None:
                kwargs = {**kwargs, k: None}
    if len(args) > 1:
        use, caches = _cache_positions(fn)
        drop = () if keep else tuple(i for i in caches if i < len(args) and args[i] is not None)
        if drop or (use is not None and use < len(args) and args[use]):
            args = list(args)
            for i in drop:
                args[i] = None
            if use is not None and use < len(args) and args[use]:
                args[use] = False
            args = tuple(args)
    return args, kwargs


# NOTE [Selective recompute inside a checkpoint]
# A block planned ``lean+sac`` (or ``eager+sac``) keeps its matmul outputs in the selective
# checkpoint's storage until its backward. Under the user's own non-reentrant checkpoint (torch's
# ``checkpoint(..., use_reentrant=False)`` around the block or around more than it) that
# storage lives as long as the outer checkpoint's graph, while the outer checkpoint keeps nothing
# else of the block: it recomputes the whole block in backward anyway. So the saved matmul outputs
# were bytes checkpointing alone does not keep (a 4-block MLP, bf16 autocast, mid budget: 293,232 B
# peak against eager + checkpoint's 255,024; 246,768 now; torch's own nested SAC keeps them too).
# Decided at each call from what is active: when the top saved-tensor hooks are a checkpoint's
# (its forward's pack hook or its recompute's, torch.utils.checkpoint's ``_checkpoint_hook`` and
# ``_recomputation_hook``), the block runs under plain recompute instead, in the outer forward
# and in its recompute alike (the replay must save what the forward saved), and keeps nothing.
# The gradients are the same bits: plain recompute replays the same ops on the same inputs with
# the RNG state restored, as the selective one does for the ops it does not save. Other hooks
# (offloading, a user's pack/unpack) recompute nothing, so the block keeps its plan there. A
# reentrant outer checkpoint runs its forward without grad (the block runs plainly) and its
# recompute with no hooks (the block's plan applies, for that block's backward only). The hooks'
# owner is read from the pack function's qualified name (a private torch detail, guarded: without
# it the plan applies unchanged). transformers 5 nests the other way round:
# ``gradient_checkpointing_enable`` wraps the class's ``forward`` of each
# GradientCheckpointingLayer, so the plan's checkpoint (set on the instance) would be the outer
# one, around HF's (a 3-layer Llama, bf16 autocast, all ``lean+sac``: 257,160 B peak against
# eager + HF checkpointing's 241,544). A block whose own forward checkpoints (training,
# ``gradient_checkpointing`` set, a GradientCheckpointingLayer) therefore runs that forward as it
# is, its lean ops inside HF's checkpoint: what the user asked recomputed is recomputed once, as
# plain ``convert_`` under HF's checkpointing (202,888 B there).
_CKPT_HOOKS = ("_checkpoint_hook.", "_recomputation_hook.")


def _hf_checkpoints(module: nn.Module) -> bool:
    # transformers is loaded wherever a GradientCheckpointingLayer exists; never imported here
    layers = sys.modules.get("transformers.modeling_layers")
    cls = getattr(layers, "GradientCheckpointingLayer", None)
    return cls is not None and isinstance(module, cls)


def _in_outer_checkpoint() -> bool:
    try:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, TypeError, RuntimeError):  # a torch without it: plan unchanged
        return False
    if not top:
        return False
    return getattr(top[0], "__qualname__", "").startswith(_CKPT_HOOKS)


def _recompute_forward(self, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint

    fn = _inner_forward(self)
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if self.training and getattr(self, "gradient_checkpointing", False) and _hf_checkpoints(self):
        return fn(*args, **kwargs)  # NOTE [Selective recompute inside a checkpoint]
    if kwargs or len(args) > 1:  # NOTE [A recomputed block does not write the KV cache]
        args, kwargs = _without_cache(self, fn, args, kwargs)
    ctx = self.__dict__.get("_slimgrad_plan_context")
    if ctx is not None and _in_outer_checkpoint():  # NOTE [Selective recompute inside a checkpoint]
        ctx = None
    extra = {"context_fn": ctx} if ctx is not None else {}
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)


def _pass_forward(self, *args, **kwargs):
    # a block passed through (measurement only): its output is its input
    return args[0] if args else next(iter(kwargs.values()))


def _set_forward(module: nn.Module, fn) -> None:
    if "_slimgrad_plan_inner" not in module.__dict__:
        module._slimgrad_plan_inner = module.__dict__.get("forward")
    module.forward = fn.__get__(module)


# NOTE [The MLP's activation, recomputed]
# Megatron's selective recompute of the MLP's activation keeps the first projection's output and
# recomputes the activation (and, gated, its product with up) in backward, before the second
# projection's backward. slimgrad's gated MLP op does exactly that (it keeps x, g and u and
# recomputes act(g) * u, the same bits: NOTE in ops/gated_mlp.py), but ``lean`` runs eager's ops
# (keeping act(g) and the product as well) where the op's backward peaks above eager's
# (NOTE [The gated MLP's peak against eager's]): a rule for one block alone. In a step the kept
# bytes of every block add up while one block's backward transient does not, so this choice sets
# ``GatedMLP.recompute_activation`` on the block's converted gated MLPs: the op wherever it can
# run (same bits as lean's op path; nothing else in the block changes), and the planner weighs
# the kept bytes it frees against the transient it adds on the step's timeline, as for every
# choice. It recomputes no matmul (0 FLOPs: like ``lean+sac``, a step from ``lean`` at no matmul
# cost, taken when it keeps fewer bytes); where ``lean`` already runs the op it is ``lean``
# (equal bytes: the hull drops it). It is offered for a block holding a gated MLP that convert_
# converts (an HF template MLP, or a GatedMLP); applied to a block without one after conversion
# it raises, and its measurement is refused with that reason. GPT-2's MLP (one node, ops/
# gpt2_mlp.py) keeps the GELU's input and rebuilds its output in backward in float32 already;
# it has no such switch, so the choice is not offered there.


def _gated_mlps(block: nn.Module) -> list:
    from slimgrad.nn.gated_mlp import GatedMLP

    return [m for m in block.modules() if isinstance(m, GatedMLP)]


def _has_gated_mlp(block: nn.Module) -> bool:
    # before conversion: a module convert_'s HF gated-MLP handler takes (its forward the template)
    from slimgrad.convert_handlers.hf_mlp import _match

    return bool(_gated_mlps(block)) or any(
        "forward" not in m.__dict__ and _match(type(m).forward) is not None for m in block.modules()
    )


# NOTE [Lean ops under selective checkpointing]
# ``lean+sac`` runs a block's lean ops under torch's selective checkpointing (non-reentrant, RNG
# state restored) with the policy of ``eager+sac``: every matmul/attention output is saved, every
# other op recomputed. The lean ops are autograd Functions whose forwards run aten ops; the
# checkpoint replays the block's forward in backward, the saved matmul outputs come from SAC's
# storage and the rest is recomputed with the same ops on the same inputs, so the gradients are
# the lean block's bits: the loss and every gradient torch.equal to ``lean`` on the toy MLP of
# tests/test_plan.py (dropout 0.2) and on a 3-layer Llama (sdpa and eager attention, fp32 and bf16
# autocast, attention dropout 0.1; tests/test_plan_budgets.py). It keeps what SAC keeps of the
# lean block, no matmul recomputed: on that toy 393,216 B a block, as ``eager+sac``, against
# ``lean``'s 610,304 and ``eager``'s 921,600. So it is a default choice and ``eager+sac`` (the SAC
# baseline) is not: at equal matmul FLOPs (none) it keeps no more. Where torch's selective
# checkpointing cannot replay the block (a 3-layer HF GPT-2 called with its cache on, the
# config's default: "aten.slice.Tensor encountered during backward but not found in storage",
# for ``eager+sac`` as for ``lean+sac``, in the estimate as in the real step; with
# ``use_cache=False`` both run) its measurement fails and it is not offered
# (``Plan.blocks[...]["refused"]`` names why).
_SAVE_OPS: tuple = ()


def _sac_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    global _SAVE_OPS
    if not _SAVE_OPS:
        aten = torch.ops.aten
        names = (
            "mm",
            "addmm",
            "bmm",
            "baddbmm",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_cudnn_attention",
            "convolution",
        )
        _SAVE_OPS = tuple(getattr(aten, n) for n in names if hasattr(aten, n))

    def policy(ctx, op, *args, **kwargs):
        packet = getattr(op, "overloadpacket", op)
        if packet in _SAVE_OPS:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _parse_choice(api: str, name: str, choice: str) -> tuple[bool, str | None, str | None]:
    # (lean, recompute what: None / "" (the block) / child name, "sac" or None)
    if choice == "eager":
        return False, None, None
    if choice == "lean":
        return True, None, None
    if choice == "eager+recompute":
        return False, "", None
    if choice == "lean+recompute":
        return True, "", None
    if choice == "eager+sac":
        return False, "", "sac"
    if choice == "lean+sac":
        return True, "", "sac"
    if choice.startswith("lean+recompute:") and choice.split(":", 1)[1]:
        return True, choice.split(":", 1)[1], None
    raise ValueError(
        f"{api}: block {name!r} has an unknown choice; expected one of {list(CHOICES)} or "
        f"'lean+recompute:' followed by a child's name, got {choice!r}. Use a plan made by "
        "slimgrad.plan."
    )


def apply_choices(
    model: nn.Module,
    choices: dict[str, str],
    *,
    convert: Callable[..., nn.Module] | None = None,
    passed: tuple[str, ...] = (),
    api: str = "slimgrad.convert_",
    **convert_kwargs: Any,
) -> nn.Module:
    """Apply per-block choices to ``model`` in place (``convert_(model, plan=...)`` calls this)."""
    from slimgrad.convert import convert_

    convert = convert or convert_
    mods = dict(model.named_modules())
    missing = [n for n in (*choices, *passed) if n not in mods]
    if missing:
        raise ValueError(
            f"{api}: the plan names modules this model does not have; expected every planned "
            f"block in the model, got missing {missing[:3]}. Apply a plan to a model built "
            "from the config it was made for."
        )
    parsed = {n: _parse_choice(api, n, c) for n, c in choices.items()}
    eager = tuple(n for n, (lean, _, _) in parsed.items() if not lean) + tuple(passed)
    user_filter = convert_kwargs.pop("filter_fn", None)

    def allowed(m: nn.Module, qual: str) -> bool:
        if any(qual == e or qual.startswith(e + ".") for e in eager):
            return False
        return user_filter(m, qual) if user_filter is not None else True

    convert(model, filter_fn=allowed, **convert_kwargs)
    mods = dict(model.named_modules())  # conversion may have swapped modules
    for n in passed:
        _set_forward(mods[n], _pass_forward)
    for n, (_, what, sac) in parsed.items():
        if what is None:
            continue
        if what == CORE:  # NOTE [The attention core, recomputed]
            from slimgrad.attention_core import wrap

            wrap(mods[n], api)
            continue
        if what == ACT:  # NOTE [The MLP's activation, recomputed]
            mlps = _gated_mlps(mods[n])
            if not mlps:
                raise ValueError(
                    f"{api}: block {n!r} has no gated MLP slimgrad converted; expected a "
                    f"slimgrad.nn.GatedMLP in a block planned {choices[n]!r}, got none. Plan "
                    "this model with slimgrad.plan, or convert the block's MLP (config "
                    "activations=True)."
                )
            for m in mlps:
                m.recompute_activation = True
            continue
        target = mods.get(n if what == "" else f"{n}.{what}")
        if target is None:
            raise ValueError(
                f"{api}: block {n!r} has no child {what!r}; expected a child module named in "
                f"the choice, got children {[c for c, _ in mods[n].named_children()]}. Apply a "
                "plan to a model built from the config it was made for."
            )
        if sac:
            target._slimgrad_plan_context = _sac_context
        _set_forward(target, _recompute_forward)
    model._slimgrad_plan = dict(choices)
    return model


# --- measuring --------------------------------------------------------------------------------


def _made(api: str, made: Any) -> tuple[Callable, nn.Module]:
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[1], nn.Module)):
        raise TypeError(
            f"{api}: make_forward must return (forward, model); expected a pair with the "
            f"nn.Module, got {type(made).__name__}. Return (forward, model) from make_forward."
        )
    return made


def _sdpa_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    # FlopCounterMode's count for SDPA's fused kernels (QK^T and PV: 2 FLOPs per multiply-add),
    # key and value heads broadcast to the query's (grouped-query attention)
    b, h, s_q, d_q = query
    s_k, d_v = key[-2], value[-1]
    return 2 * b * h * s_q * s_k * d_q + 2 * b * h * s_q * s_k * d_v


# CPU's fused SDPA kernel has no formula in FlopCounterMode (its CUDA kernels have one): without
# it an SDPA model's attention core counted 0 matmul FLOPs on CPU and under fake tensors, and an
# eager-attention model's (two bmm) did not
_SDPA_FLOPS = {
    getattr(torch.ops.aten, n): _sdpa_flops
    for n in ("_scaled_dot_product_flash_attention_for_cpu",)
    if hasattr(torch.ops.aten, n)
}


# NOTE [Recompute is counted, not derived]
# A choice's recompute is the matmul FLOPs its block's backward runs more than the same block's
# without recompute (``lean`` for the lean choices, ``eager`` for the eager ones), counted in the
# step that measures its bytes: the tracker sums FlopCounterMode's formulas (and CPU's fused SDPA,
# as _find_blocks counts it) over the ops it runs, and the hooks that mark a watched block's
# backward start and end read that sum. The recompute is not the block's (or child's) forward
# FLOPs: torch's non-reentrant checkpoint stops recomputing once every tensor the backward
# unpacks is back, so the block's last products that nothing saved are not run again (a
# transformer block's MLP down projection, whose output only the residual add takes; the toy of
# tests/test_plan.py's second Linear). Counted from the forward, checkpoint-all of the toy
# recomputed 33,554,432 FLOPs where its backward runs 16,777,216 more than lean's. Where the
# step's marks cannot be read the forward's count stands, an upper bound. ``lean`` and ``eager``
# are measured whatever ``choices`` allows (chosen only where it allows them): with
# ``choices=("lean+recompute",)`` the toy's checkpoint-all was the forward's 33,554,432 FLOPs.
@functools.cache
def _flop_formulas() -> dict:
    # the tracker's matmul FLOP formulas: FlopCounterMode's registry and CPU's fused SDPA, as
    # _find_blocks counts the forward (NOTE [Recompute is counted, not derived])
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    return {**flop_registry, **{k: shape_wrapper(f) for k, f in _SDPA_FLOPS.items()}}


def _find_blocks(model: nn.Module, forward: Callable) -> tuple[list[str], dict[str, int], int]:
    # (block names in forward order, forward matmul FLOPs per module name, total)
    from torch.utils.flop_counter import FlopCounterMode

    cands: dict[str, nn.Module] = {}
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList | nn.Sequential):
            continue
        kids = [(f"{name}.{k}" if name else k, c) for k, c in m.named_children()]
        by_cls: dict[type, list] = {}
        for k, c in kids:
            if any(True for _ in c.parameters()):
                by_cls.setdefault(type(c), []).append((k, c))
        for group in by_cls.values():
            if len(group) >= 2:
                cands.update(group)
    same_shape: dict[str, bool] = {}
    order: list[str] = []
    hooks = []
    for n, c in cands.items():

        def hook(mod, args, kwargs, out, n=n):
            x = args[0] if args else next(iter(kwargs.values()), None)
            ok = isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor)
            ok = ok and out.shape == x.shape and out.dtype == x.dtype
            same_shape[n] = same_shape.get(n, True) and ok
            if n not in order:
                order.append(n)

        hooks.append(c.register_forward_hook(hook, with_kwargs=True))
    try:
        with (
            torch.no_grad(),
            FlopCounterMode(display=False, depth=None, custom_mapping=_SDPA_FLOPS) as fc,
        ):
            forward()
    finally:
        for h in hooks:
            h.remove()
    root = type(model).__name__
    flops: dict[str, int] = {}
    for key, per_op in fc.get_flop_counts().items():
        total = int(sum(per_op.values()))
        if key == "Global":
            flops[""] = total
        elif key == root:
            flops.setdefault("", total)
        elif key.startswith(root + "."):
            flops[key[len(root) + 1 :]] = total
    blocks = [n for n in order if same_shape.get(n)]
    # outermost only: a block inside another block is part of it
    blocks = [n for n in blocks if not any(n.startswith(o + ".") for o in blocks if o != n)]
    return blocks, flops, flops.get("", 0)


def _kind_key(m: nn.Module) -> tuple:
    return (type(m).__qualname__, tuple((n, tuple(p.shape)) for n, p in m.named_parameters()))


def _child_choices(block: nn.Module, flops: dict[str, int], name: str) -> list[str]:
    # children worth recomputing alone: those with parameters and matmul FLOPs; and the
    # attention core where it has matmul FLOPs of its own
    out = []
    for k, c in block.named_children():
        if any(True for _ in c.parameters()) and flops.get(f"{name}.{k}", 0) > 0:
            out.append(f"lean+recompute:{k}")
    if _core_flops(block, flops, name) > 0:
        out.append(f"lean+recompute:{CORE}")
    if _has_gated_mlp(block):
        out.append(f"lean+recompute:{ACT}")
    return out


def _core_flops(block: nn.Module, flops: dict[str, int], name: str) -> int:
    # the attention core's matmul FLOPs as FlopCounterMode counts them: each HF attention
    # module's less its children's (NOTE [The attention core, recomputed])
    from slimgrad.attention_core import attention_modules

    total = 0
    for a, m in attention_modules(block):
        q = f"{name}.{a}" if a else name
        total += flops.get(q, 0) - sum(flops.get(f"{q}.{k}", 0) for k, _ in m.named_children())
    return total


def _grad_bytes(m: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters() if p.requires_grad)


@dataclass
class _Kind:
    names: list[str]
    g: int
    r: dict[str, int] = field(default_factory=dict)
    rb: dict[str, int] = field(default_factory=dict)  # of r, what is kept into backward
    p1: dict[str, int] = field(default_factory=dict)
    seg: dict[str, dict[str, int]] = field(default_factory=dict)  # segment peaks, per choice
    left: dict[str, int] = field(default_factory=dict)  # live after its backward, per choice
    flops: dict[str, int] = field(default_factory=dict)
    bwd: dict[str, int] = field(default_factory=dict)  # a block's backward's matmul FLOPs
    errors: dict[str, str] = field(default_factory=dict)


def _hull(kind: _Kind, allowed: list[str]) -> list[str]:
    # the lower convex hull of (flops, r) from the least-flops point with the least r on; a
    # choice another beats or ties in flops, r and one-block peak is left out. A choice that
    # recomputes anything ("+" in its name) counts above one that recomputes nothing at equal
    # flops: lean+sac recomputes no matmul but never starts the hull (at a budget everything
    # fits, nothing is recomputed); from lean it is the first step, at no matmul FLOPs
    def key(c):
        return (kind.flops[c], "+" in c, kind.r[c], kind.p1[c])

    pts = [
        c
        for c in allowed
        if c in kind.r
        and not any(
            d != c and all(a <= b for a, b in zip(key(d), key(c), strict=True)) and key(d) != key(c)
            for d in allowed
            if d in kind.r
        )
    ]
    pts = sorted(set(pts), key=key)
    start = min(pts, key=key)
    hull = [start]
    while True:
        cur = hull[-1]
        best, best_rate = None, 0.0
        for c in pts:
            df, dr = kind.flops[c] - kind.flops[cur], kind.r[cur] - kind.r[c]
            if dr <= 0:
                continue
            rate = math.inf if df <= 0 else dr / df
            if best is None or rate > best_rate:
                best, best_rate = c, rate
        if best is None:
            return hull
        hull.append(best)


class _Model:
    # the composed peak (NOTE [How plan chooses])
    def __init__(self, blocks, kind_of: dict[str, _Kind], p0: int, allowed: dict) -> None:
        self.blocks, self.kind_of, self.p0, self.allowed = blocks, kind_of, p0, allowed

    def peak(self, x: dict[str, str]) -> int:
        kinds = [self.kind_of[b] for b in self.blocks]
        rs = [k.r[x[b]] for k, b in zip(kinds, self.blocks, strict=True)]
        gs = [k.g for k in kinds]
        segs = [k.seg.get(x[b]) for k, b in zip(kinds, self.blocks, strict=True)]
        if any(s is None for s in segs):
            # no segments (a step whose block the hooks could not follow): the step's peaks
            best = self.p0 + sum(rs)
            before, after = 0, sum(gs)
            for i, k in enumerate(kinds):
                after -= gs[i]
                best = max(best, k.p1[x[self.blocks[i]]] + before + after)
                before += rs[i]
            return best
        # each segment of a one-block step, with the other blocks' kept bytes and gradients that
        # are live at that point of the whole step (NOTE [How plan chooses])
        # in backward, what each block keeps into it (NOTE [Autocast's cache is not kept for
        # backward])
        gs = [k.left[x[b]] for k, b in zip(kinds, self.blocks, strict=True)]
        rbs = [k.rb[x[b]] for k, b in zip(kinds, self.blocks, strict=True)]
        total_r, total_rb, total_g = sum(rs), sum(rbs), sum(gs)
        best = max(segs[0]["pre"], segs[-1]["head"] + total_r - rs[-1])
        best = max(best, segs[-1]["head_bwd"] + total_rb - rbs[-1], segs[0]["post"] + total_g)
        before, before_b, after = 0, 0, total_g
        for i, sg in enumerate(segs):
            after -= gs[i]
            best = max(best, sg["fwd"] + before, sg["bwd"] + before_b + after)
            before += rs[i]
            before_b += rbs[i]
        return best

    def flops(self, x: dict[str, str]) -> int:
        return sum(self.kind_of[b].flops[x[b]] for b in self.blocks)


def _walk(model: _Model) -> list[dict[str, str]]:
    # the greedy path from the least-recompute plan on (each step: one block, one hull step)
    hulls = {id(k): _hull(k, model.allowed[id(k)]) for k in model.kind_of.values()}
    level = {b: 0 for b in model.blocks}
    x = {b: hulls[id(model.kind_of[b])][0] for b in model.blocks}
    path = [dict(x)]
    while True:
        best, best_rate = None, -1.0
        for b in model.blocks:  # first blocks first at equal rate
            h = hulls[id(model.kind_of[b])]
            if level[b] + 1 >= len(h):
                continue
            k = model.kind_of[b]
            cur, nxt = h[level[b]], h[level[b] + 1]
            df, dr = k.flops[nxt] - k.flops[cur], k.r[cur] - k.r[nxt]
            rate = math.inf if df <= 0 else dr / df
            if rate > best_rate:
                best, best_rate = b, rate
        if best is None:
            return path
        level[best] += 1
        x[best] = hulls[id(model.kind_of[best])][level[best]]
        path.append(dict(x))


def _tracker():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from slimgrad.memory import _Tracker

    return next((m for m in _get_current_dispatch_mode_stack() if isinstance(m, _Tracker)), None)


def _watch(
    block: nn.Module, marks: dict[str, int], tag: str, ops: dict[str, int], flops: dict[str, int]
) -> None:
    # the timeline positions where ``block``'s forward starts and ends and its backward starts
    # (the gradient of its output is ready) and ends (the gradient of its input is), and the
    # tracker's op count (``ops``) and matmul FLOPs so far (``flops``) at each: hooks that keep no
    # tensor, so the step's bytes are those of the unwatched step
    def mark(name: str) -> None:
        t = _tracker()
        if t is not None and tag + name not in marks:
            marks[tag + name] = len(t.timeline)
            ops[tag + name] = t.n_ops
            flops[tag + name] = t.matmul_flops

    def grad_mark(name: str):
        def hook(grad):
            mark(name)

        return hook

    def pre(mod, args, kwargs):
        mark("fwd_start")
        x = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(x, torch.Tensor) and x.requires_grad and tag + "bwd_end" not in marks:
            x.register_hook(grad_mark("bwd_end"))

    def post(mod, args, kwargs, out):
        mark("fwd_end")
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(grad_mark("bwd_start"))

    block.register_forward_pre_hook(pre, with_kwargs=True)
    block.register_forward_hook(post, with_kwargs=True)


def _segments(m: Any, marks: dict[str, int], n: int) -> list[int] | None:
    # the peak live bytes between consecutive marks of ``n`` watched blocks (forward starts and
    # ends in order, the forward's return, backward starts and ends in reverse order): 4n + 2
    # segments, each from the state before its first event to its end
    tl = m.timeline
    order = [f"{i}fwd_{e}" for i in range(n) for e in ("start", "end")] + ["return"]
    order += [f"{i}bwd_{e}" for i in reversed(range(n)) for e in ("start", "end")]
    if set(marks) != set(order) or not tl:
        return None
    cuts = [0] + [marks[s] for s in order] + [len(tl)]
    if cuts != sorted(cuts):
        return None
    # (the "return" mark is after autocast's cache is gone: NOTE [A mark after a bulk free])
    out = [max([v for _, _, v in tl[max(a - 1, 0) : b]] or [0]) for a, b in zip(cuts, cuts[1:])]
    if max(out) != m.peak_bytes:
        return None
    # and the live bytes at each mark (the state before its event)
    return out + [tl[c - 1][2] if c > 0 else 0 for c in cuts[1:-1]]


def _pair_segments(m: Any, r0: int) -> tuple[int, int, dict[str, int], int] | None:
    # (r, left, segment peaks, rb) of one block from a step with two adjacent blocks a, b of one
    # kind in one choice: ``left`` is what a block leaves live once its backward ran (its
    # parameters' gradients and whatever else outlives it); each segment less what the other
    # block keeps or has left there, so that it composes as the NOTE [How plan chooses] says.
    # ``rb``: what a block keeps into backward (the retained bytes, after the forward returned),
    # ``r``: that and what autocast's cache held for it until then (NOTE [Autocast's cache is
    # not kept for backward])
    s = m.segments
    two_r = m.retained_bytes - r0
    if s is None or two_r % 2:
        return None
    rb = two_r // 2
    r = rb + m.cache_bytes[1]
    pre, a_f, gap_f, b_f, head, head_b, b_b, gap_b, a_b, post = s[:10]
    # the live bytes when b's backward starts and when a's does: a keeps rb at the first, b has
    # left ``left`` at the second (the incoming gradient is one hidden state at both)
    b_start, a_start = s[10 + 5], s[10 + 7]
    left = a_start - b_start + rb
    return (
        r,
        left,
        {
            "pre": pre,
            "fwd": max(a_f, gap_f - r, b_f - r),
            "head": head - r,
            "head_bwd": head_b - rb,
            "bwd": max(b_b - rb, gap_b - left, a_b - left),
            "post": post - 2 * left,
        },
        rb,
    )


def _estimate_pairs(
    make_forward, api, device, names: list[str], group: list[str], blocks, convert_kwargs
) -> list[tuple[int, int, dict[str, int], int]] | None:
    # (r, left, segment peaks, rb) of each choice in ``group`` from one step: the kind's first
    # 2 x len(group) blocks real, two adjacent ones per choice in ``group``'s order, the block
    # after them passed through (its forward's start closes the last pair's forward) and every
    # other block passed through. Each pair's segments less what the other pairs keep or have
    # left there (NOTE [How plan chooses], 1); None where the marks cannot be read.
    g = len(group)
    real = names[: 2 * g]
    choices = {b: group[i // 2] for i, b in enumerate(real)}
    passed = tuple(b for b in blocks if b not in choices)
    m, marks = _marked_estimate(
        make_forward, api, device, choices, passed, convert_kwargs, tuple(real), names[2 * g]
    )
    tl, n = m.timeline, 2 * g
    order = [f"{i}fwd_{e}" for i in range(n) for e in ("start", "end")]
    order += ["closefwd_start", "return"]
    order += [f"{i}bwd_{e}" for i in reversed(range(n)) for e in ("start", "end")]
    if set(marks) != set(order) or not tl:
        return None
    cuts = [marks[o] for o in order]
    if cuts != sorted(cuts) or cuts[0] == 0:
        return None
    vals = [v for _, _, v in tl]
    # the peak of each stretch between consecutive marks (from the state before the first's
    # event), one pass over the timeline; a segment spanning several stretches is their max (the
    # "return" mark is after autocast's cache is gone: NOTE [A mark after a bulk free])
    ends = [*cuts, len(vals) + 1]
    stretch = [max(vals[c - 1 : e]) for c, e in zip(ends, ends[1:])]
    at = {o: i for i, o in enumerate(order)}

    def live(o: str) -> int:
        return vals[marks[o] - 1]

    def seg(o1: str, o2: str) -> int:
        return max(stretch[at[o1] : at[o2]])

    pre_peak = max(vals[: cuts[0]])
    if max(pre_peak, *stretch) != m.peak_bytes:
        return None

    rs, rbs, lefts = [], [], []
    for j in range(g):
        a, b = 2 * j, 2 * j + 1
        nxt = f"{b + 1}fwd_start" if j < g - 1 else "closefwd_start"
        # the second block's: its input is the output of a block in its own choice, as in the
        # steady state (NOTE [How plan chooses], 1: the step's first block can differ); less
        # what autocast's cache held for it, what it keeps into backward (NOTE [Autocast's
        # cache is not kept for backward])
        r = live(nxt) - live(f"{b}fwd_start")
        rs.append(r)
        rbs.append(r - m.cache_bytes[b])
        lefts.append(live(f"{a}bwd_start") - live(f"{b}bwd_start") + rbs[-1])
    pre = pre_peak
    post = stretch[-1] - 2 * sum(lefts)
    last = n - 1
    # the head: from the last real block's forward end to the forward's return, and from there
    # to its backward start (what no block keeps)
    head = seg(f"{last}fwd_end", "return") - 2 * sum(rs)
    head_b = seg("return", f"{last}bwd_start") - 2 * sum(rbs)
    out = []
    for j in range(g):
        a, b, r, rb, left = 2 * j, 2 * j + 1, rs[j], rbs[j], lefts[j]
        before, before_b = 2 * sum(rs[:j]), 2 * sum(rbs[:j])
        after = 2 * sum(lefts[j + 1 :])
        fwd = max(
            seg(f"{a}fwd_start", f"{a}fwd_end"),
            seg(f"{a}fwd_end", f"{b}fwd_start") - r,
            seg(f"{b}fwd_start", f"{b}fwd_end") - r,
        )
        bwd = max(
            seg(f"{b}bwd_start", f"{b}bwd_end") - rb,
            seg(f"{b}bwd_end", f"{a}bwd_start") - left,
            seg(f"{a}bwd_start", f"{a}bwd_end") - left,
        )
        out.append(
            (
                r,
                left,
                {
                    "pre": pre,
                    "fwd": fwd - before,
                    "head": head + r,
                    "head_bwd": head_b + rb,
                    "bwd": bwd - before_b - after,
                    "post": post,
                },
                rb,
                m.bwd_flops[b],
            )
        )
    return out


# NOTE [Autocast's cache is not kept for backward]
# Under autocast, an op that casts a leaf tensor requiring grad (a parameter) to the autocast dtype
# keeps the cast in autocast's cache until the outermost autocast region exits, which in a training
# step is when the forward returns, before backward. A block that runs eager ops under autocast
# (``eager``, ``eager+recompute``, ``eager+sac``) therefore holds a low-precision copy of its
# weights from its forward to the forward's return: live bytes for every later block's forward
# and the head, not for any backward. slimgrad's lean ops cast each weight for its matmul and drop
# the cast (NOTE [Autocast weight casts] in ops/linear.py): their blocks hold none. So a block has
# two kept figures: ``r`` (forward, with the cache) and ``rb`` (into backward, without), and the
# composition adds ``r`` under the forwards and the head up to the forward's return and ``rb``
# under the head's backward and every block's backward; the measured ``left`` of a block (what
# its backward leaves) is taken against ``rb``. With both as ``r``, checkpoint-all on a 6-layer
# Llama (128 wide, 4 x 256 tokens) under bf16 autocast composed 10% above its full estimate
# (its ``r`` was the hidden state and 294,912 B of bf16 weights), and a lean+recompute pair
# measured in one step after an eager pair 11% under.
# The cache is measured, not derived: with watched blocks, the step's forward runs inside one more
# autocast level that enables nothing (``torch.autocast(enabled=False)``: autocast clears its
# cache when its nesting count returns to zero, so the cache now outlives the model's own region
# by no op), and the storages the step made that die when that level exits are the cache's; each
# is charged to the watched block whose forward made it (the tracker's op count at its birth).

# NOTE [A mark after a bulk free]
# Autocast clears its cache in one C++ call that empties a hash map keyed by the cast tensors'
# addresses, so the tracker sees the cache's frees one by one in an order set by where the
# allocator put the weights: it differs between identical steps, with fake tensors as with real
# ones. No op runs in between, so the step's peak and its live bytes at every op do not depend on
# it; a segment that starts inside that run of frees does. The "return" mark was taken before
# the clear and the segment after it skipped only the state at the mark, so it began at the live
# bytes after the first free, whichever that was: GPT-2 (4 blocks, 64 wide, 2 x 16 tokens) under
# bf16 autocast, ``eager+recompute``'s ``head_bwd`` measured 53,124, 59,268 and 61,252 B in
# three identical plans of one process, ``eager+sac``'s 73,860 to 81,988 B. The mark is taken
# once the clear is done: the segment before it (the head) holds the state at the return, with
# the cache, which is its largest, and the one after starts from the state with the cache gone;
# neither depends on the order of the frees. Every mark sits between ops or after such a run,
# never inside one.


def _marked_estimate(
    make_forward,
    api,
    device,
    choices,
    passed,
    convert_kwargs,
    watch: tuple[str, ...] = (),
    closing: str | None = None,
) -> tuple[Any, dict[str, int]]:
    # estimate of the model with ``choices`` applied, and the timeline positions of the watched
    # blocks' forward and backward starts and ends (_watch: "<i>fwd_start", ...), of the
    # ``closing`` block's forward start ("closefwd_start") and, with watched blocks, of the
    # forward's return ("return"); the timeline is kept when any is marked. With watched blocks,
    # ``m.cache_bytes[i]``: the bytes watched block i's forward made that autocast's cache held
    # until the forward returned (NOTE [Autocast's cache is not kept for backward])
    from slimgrad.memory import estimate

    marks: dict[str, int] = {}
    ops: dict[str, int] = {}
    flops: dict[str, int] = {}
    freed: list[tuple[int, int]] = []  # (op count at birth, bytes) of what the cache held

    def close(mod, args, kwargs):
        t = _tracker()
        if t is not None and "closefwd_start" not in marks:
            marks["closefwd_start"] = len(t.timeline)

    def make():
        forward, model = _made(api, make_forward())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            apply_choices(model, choices, passed=passed, api=api, **convert_kwargs)
        mods = dict(model.named_modules())
        for i, w in enumerate(watch):
            _watch(mods[w], marks, str(i), ops, flops)
        if closing is not None:
            mods[closing].register_forward_pre_hook(close, with_kwargs=True)
        if not watch:
            return forward, model

        def watched():
            # NOTE [Autocast's cache is not kept for backward]
            t = _tracker()
            if t is not None:  # NOTE [Recompute is counted, not derived]
                t.flop_formulas = _flop_formulas()
            with torch.autocast("cpu", enabled=False):  # one autocast level more: nothing on
                out = forward()
                if t is not None:
                    live = {k: (t.born.get(k, 0), t.sizes[k]) for k in t.created}
            if t is not None:  # leaving it cleared autocast's cache
                # NOTE [A mark after a bulk free]: the forward's return, once the cache is gone
                marks["return"] = len(t.timeline)
                freed.extend(v for k, v in live.items() if k not in t.created)
            return out

        return watched, model

    m = estimate(make, device=device, timeline=bool(watch) or closing is not None)
    m.cache_bytes = [
        sum(n for born, n in freed if ops.get(f"{i}fwd_start", 0) < born <= ops[f"{i}fwd_end"])
        if f"{i}fwd_end" in ops
        else 0
        for i in range(len(watch))
    ]
    # each watched block's backward's matmul FLOPs (NOTE [Recompute is counted, not derived])
    m.bwd_flops = [
        flops[f"{i}bwd_end"] - flops[f"{i}bwd_start"]
        if f"{i}bwd_end" in flops and f"{i}bwd_start" in flops
        else None
        for i in range(len(watch))
    ]
    return m, marks


# NOTE [Real tensors captured by make_forward]
# ``make_forward`` builds the model and its inputs under fake tensors. Inputs made before (a real
# ``ids`` the forward closes over or reads as a global) still run: fake tensors take real ones as
# inputs. But their values are real, and a converted step can branch on them where the
# unconverted one does not (HF's MLM loss head, converted, indexes ``flat[labels != -100]``: a
# value-dependent size), so every choice failed and plan said "This is a slimgrad bug" with an
# inner MoE message (adv25 F4). When no choice can be measured, plan runs the unconverted step
# once more under ``_Outside``, which notes every tensor the step's torch calls receive that is
# real, not made by make_forward or the forward (their results are recorded) and not held by the
# model (parameters, buffers, tensor attributes of a model built outside: NOTE [A model built
# outside the estimate]); the first one found is the user's contract breach, named in the error.
# Only on that failure path: a measured plan never pays for it.


def _tensors_in(obj: Any, depth: int = 0) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth > 2:
        return []
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors_in(o, depth + 1)]
    return []


class _Outside(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.made: set[int] = set()
        self.own: set[int] = set()
        self.found: str | None = None
        self.keep: list = []  # what ``made`` names stays alive (ids are not reused)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor

        kwargs = kwargs or {}
        if self.found is None and self.own:
            for t in _tensors_in(list(args) + list(kwargs.values())):
                if (
                    not isinstance(t, FakeTensor)
                    and id(t) not in self.made
                    and id(t) not in self.own
                    and t.numel() > 1
                ):
                    name = getattr(func, "__name__", str(func))
                    self.found = f"shape {tuple(t.shape)}, {t.dtype}, first used by {name}"
        out = func(*args, **kwargs)
        for t in _tensors_in(out):
            self.made.add(id(t))
            self.keep.append(t)
        return out


def _outside_tensor(make_forward, api, device) -> str | None:
    # NOTE [Real tensors captured by make_forward]: the first real tensor from outside, or None
    from slimgrad.memory import fake_tensors

    seen = _Outside()
    try:
        with fake_tensors(device), seen:
            forward, model = _made(api, make_forward())
            seen.own = {id(t) for t in [*model.parameters(), *model.buffers()]}
            seen.own |= {
                id(t) for m in model.modules() for v in vars(m).values() for t in _tensors_in(v)
            }
            forward()
    except Exception:  # noqa: BLE001 - a diagnosis only: the caller raises its own error
        pass
    return seen.found


def _estimate_with(
    make_forward, api, device, choices, passed, convert_kwargs, watch: tuple[str, ...] = ()
) -> Any:
    m, marks = _marked_estimate(make_forward, api, device, choices, passed, convert_kwargs, watch)
    if watch:
        m.segments = _segments(m, marks, len(watch))
        m.timeline = []
    return m


# NOTE [Whole-model estimates are shared]
# ``plan(..., reuse=p)`` takes ``p``'s measurements (the blocks' kinds, their kept bytes and
# segments: NOTE [How plan chooses], 1), so its greedy walk is ``p``'s walk, and the plans it
# estimates whole (the chosen one, the repair's moves, the lowest and most recomputed ones before a
# refusal) are often plans ``p``, or another plan made from the same measurements, estimated whole
# already: a sweep of budgets checks the curve's lowest and most recomputed plans once per budget
# below the curve. Those full estimates are kept with the measurements (``Plan._wholes``: one list
# shared by every plan made from them), keyed by the applied choices and the convert keyword
# arguments (equal values), and not estimated again where the plan is made from the same
# ``make_forward`` object and device: the same model and inputs, the same choices and conversion,
# the same estimate, whose result is deterministic (fake tensors, the same ops). A different
# callable may build another model or other inputs (a larger batch), which ``reuse=``'s block
# measurements cannot show and only a full estimate does, so its plans are estimated whole again.
# ``Plan.full_estimates`` still counts the plans the search estimated whole, found or run, so a
# plan's record does not depend on what ran before.


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot be compared are not the same
        return False


def _known_whole(wholes: list, choices: dict[str, str], convert_kwargs: dict) -> int | None:
    # NOTE [Whole-model estimates are shared]
    for x, kw, peak in wholes:
        if x == choices and kw.keys() == convert_kwargs.keys():
            if all(_same(kw[k], convert_kwargs[k]) for k in kw):
                return peak
    return None


def plan(
    make_forward: Callable[[], Any],
    budget: int | float | str,
    *,
    device: str = "cpu",
    choices: tuple[str, ...] | None = None,
    verify: bool = True,
    progress: Callable[[str], None] | None = None,
    reuse: Plan | None = None,
    **convert_kwargs: Any,
) -> Plan:
    """Choose, per repeated block, eager, lean or recomputed so the step fits ``budget``
    with the least recomputed matmul FLOPs (NOTE [How plan chooses]).

    Args:
        make_forward: as for :func:`slimgrad.memory.estimate`: builds the *unconverted* model and
            its inputs (on CPU, under fake tensors) and returns ``(forward, model)``; called once
            per measurement.
        budget: the step's peak as ``estimate`` counts it, in bytes or a string (``"6GiB"``).
        device: whose kernels to model (``"cpu"`` or ``"cuda"``), as ``estimate``.
        choices: the block choices to consider (default: all of :data:`CHOICES`,
            ``lean+recompute:<child>`` for each child with parameters and matmul FLOPs, and
            ``lean+recompute:attention-core`` for a block with HF attention modules).
        verify: estimate the chosen plan whole and report that peak, moving on along the
            curve while it is above the budget (a full estimate each). Without it a budget
            below every composed peak is still checked whole before it is refused.
        progress: called with a line of text as the search goes.
        reuse: a plan made for the same ``make_forward`` and device: its measurements are
            reused (only the choice and its full estimates run again, those not made already
            from the same measurements and the same ``make_forward`` object: NOTE [Whole-model
            estimates are shared]), e.g. to plan a second budget.
        **convert_kwargs: passed to ``convert_`` (``config``, ``dtype``).

    Returns:
        A :class:`Plan`.

    Raises:
        TypeError: ``make_forward`` does not return ``(forward, model)``.
        ValueError: a bad budget, no repeated blocks, a budget below the lowest peak the
            whole-model check measured (the message names that peak and its recompute), or no
            choice could be measured because the step uses a real tensor made outside
            ``make_forward`` (NOTE [Real tensors captured by make_forward]).

    Example:
        >>> p = slimgrad.plan(make_forward, "6GiB")  # doctest: +SKIP
        >>> slimgrad.convert_(model, plan=p)  # doctest: +SKIP
    """
    from slimgrad.memory import DEVICES, fake_tensors

    api = "slimgrad.plan"
    t0 = time.perf_counter()
    budget_bytes = parse_bytes(budget, api)
    if device not in DEVICES:
        raise ValueError(
            f"{api}: device must be one of {list(DEVICES)}; expected a modelled device, got "
            f"{device!r}. Pass device='cuda' or device='cpu'."
        )
    if choices is not None:
        bad = [
            c
            for c in choices
            if c not in CHOICES and not (c.startswith("lean+recompute:") and c.split(":", 1)[1])
        ]
        if bad:
            raise ValueError(
                f"{api}: unknown choices; expected names from {list(CHOICES)}, "
                f"'lean+recompute:{CORE}', 'lean+recompute:{ACT}' or 'lean+recompute:' followed "
                f"by a child's name, got {bad}. Name choices as `slimgrad plan --help` lists them."
            )
    say = progress or (lambda s: None)
    measured = getattr(reuse, "_measured", None) if reuse is not None else None
    # the full estimates of the plans estimated whole so far, shared with the plans reuse= makes
    # from these measurements (NOTE [Whole-model estimates are shared])
    wholes: list = []
    if measured is not None and reuse.device == device:
        blocks, kinds, kind_of, p0, allowed, fwd_flops = measured
        shared = getattr(reuse, "_wholes", None)
        if shared is not None and shared[0] is make_forward:
            wholes = shared[1]
    else:
        with fake_tensors(device):
            forward, model = _made(api, make_forward())
            blocks, flops, fwd_flops = _find_blocks(model, forward)
            if not blocks:
                raise ValueError(
                    f"{api}: found no repeated blocks to plan; expected a ModuleList or Sequential "
                    f"of at least two modules of one class that keep their input's shape, got none "
                    f"in {type(model).__name__}. Use slimgrad.convert_ alone for this model."
                )
            mods = dict(model.named_modules())
            kinds: dict[tuple, _Kind] = {}
            kind_of: dict[str, _Kind] = {}
            for b in blocks:
                k = kinds.setdefault(_kind_key(mods[b]), _Kind(names=[], g=_grad_bytes(mods[b])))
                k.names.append(b)
                kind_of[b] = k
            wanted: dict[int, list[str]] = {}
            chosen_from: dict[int, list[str]] = {}
            for k in kinds.values():
                first = k.names[0]
                options = list(CHOICES) + _child_choices(mods[first], flops, first)
                if choices is not None:
                    options = [c for c in options if c in choices or c.split(":")[0] in choices]
                # eager+sac is measured as a baseline and chosen only when asked for by name:
                # lean+sac recomputes no more and keeps no more (NOTE [Lean ops under selective
                # checkpointing])
                chosen_from[id(k)] = [c for c in options if c != "eager+sac" or choices is not None]
                # measured, chosen only where asked for: eager+sac as a baseline, lean and eager
                # as what a choice's recompute is counted against (NOTE [Recompute is counted,
                # not derived])
                options += [c for c in ("eager+sac", "lean", "eager") if c not in options]
                wanted[id(k)] = options
                for c in options:
                    lean, what, sac = _parse_choice(api, first, c)
                    if what is None or sac or what == ACT:
                        k.flops[c] = 0
                    elif what == CORE:
                        k.flops[c] = _core_flops(mods[first], flops, first)
                    else:
                        k.flops[c] = flops.get(first if what == "" else f"{first}.{what}", 0)
            del model, forward, mods
        say(f"{len(blocks)} blocks, {len(kinds)} kind(s); forward {fwd_flops:.4g} matmul FLOPs")
        base = None

        def r0_p0() -> tuple[int, int]:
            # the step with every block passed through (only for kinds with fewer than three
            # blocks, or a run whose marks cannot be read)
            nonlocal base
            if base is None:
                base = _estimate_with(make_forward, api, device, {}, tuple(blocks), convert_kwargs)
            return base.retained_bytes, base.peak_bytes

        for k in kinds.values():
            first, rest = k.names[0], tuple(b for b in blocks if b != k.names[0])
            pair = tuple(k.names[:2])
            two = tuple(b for b in blocks if b not in pair)
            # the choices that recompute and those that do not in separate steps (a recomputed
            # block keeps tensors every block shares, e.g. position ids, until its backward:
            # NOTE [How plan chooses], 1); "lean" last: the pair next to the head is measured
            # with what late blocks mostly are; the SAC choices last of their step: where they
            # fail, they fail early in the backward
            todo = sorted(wanted[id(k)], key=lambda c: (c == "lean", c.endswith("+sac")))
            per = (len(k.names) - 1) // 2  # pairs one estimate holds: 2 per pair, 1 to close
            groups = []
            for part in (
                [c for c in todo if _parse_choice(api, first, c)[1] not in (None, ACT)],
                [c for c in todo if _parse_choice(api, first, c)[1] in (None, ACT)],
            ):
                groups += [part[at : at + per] for at in range(0, len(part), per)] if per else []
            while groups:
                group = groups.pop(0)
                say(f"measuring {len(group)} choice(s) of {first} in one step: {', '.join(group)}")
                try:
                    segs = _estimate_pairs(make_forward, api, device, k.names, group, blocks,
                                           convert_kwargs)  # fmt: skip
                except Exception as e:  # noqa: BLE001 - a choice that cannot run is not offered
                    if len(group) == 1:
                        k.errors[group[0]] = f"{type(e).__name__}: {e}"
                        k.flops.pop(group[0], None)
                    elif any(c.endswith("+sac") for c in group):
                        # torch's selective checkpointing is the choice that fails on some
                        # models (a recomputed op not found in its storage): the rest without it
                        sac = [c for c in group if c.endswith("+sac")]
                        rest = [c for c in group if c not in sac]
                        groups[:0] = ([rest] if rest else []) + [[c] for c in sac]
                    continue  # any other: one by one below, with the reason
                if segs is None:
                    continue
                for c, seg in zip(group, segs, strict=True):
                    k.r[c], k.left[c], k.seg[c], k.rb[c], bwd = seg
                    k.p1[c] = max(seg[2].values())
                    if bwd is not None:
                        k.bwd[c] = bwd
            for c in wanted[id(k)]:
                if c in k.r or c in k.errors:
                    continue
                say(f"measuring {' and '.join(pair)} as {c}")
                try:
                    r0, _ = r0_p0()
                    m = None
                    if len(pair) == 2:
                        m = _estimate_with(
                            make_forward, api, device, dict.fromkeys(pair, c), two,
                            convert_kwargs, watch=pair,
                        )  # fmt: skip
                        seg = _pair_segments(m, r0)
                    if m is None or seg is None:
                        m = _estimate_with(
                            make_forward, api, device, {first: c}, rest, convert_kwargs
                        )
                        seg = None
                except Exception as e:  # noqa: BLE001 - a choice that cannot run is not offered
                    k.errors[c] = f"{type(e).__name__}: {e}"
                    k.flops.pop(c, None)
                    continue
                if seg is not None:
                    k.r[c], k.left[c], k.seg[c], k.rb[c] = seg
                    k.p1[c] = max(seg[2].values())
                    if m.bwd_flops[1] is not None:
                        k.bwd[c] = m.bwd_flops[1]
                else:
                    k.r[c] = k.rb[c] = m.retained_bytes - r0
                    k.p1[c] = m.peak_bytes
            for c in list(k.flops):
                if c not in k.r:
                    k.flops.pop(c)
                    continue
                # NOTE [Recompute is counted, not derived]
                plain = "lean" if _parse_choice(api, first, c)[0] else "eager"
                if c != plain and c in k.bwd and plain in k.bwd:
                    k.flops[c] = max(0, k.bwd[c] - k.bwd[plain])
        if any(not k.r for k in kinds.values()):
            errors = [k.errors for k in kinds.values() if not k.r][:1]
            first = next(iter(errors[0].values()), "") if errors else ""
            outside = _outside_tensor(make_forward, api, device)
            if outside is not None:  # NOTE [Real tensors captured by make_forward]
                raise ValueError(
                    f"{api}: the step uses a real tensor made outside make_forward ({outside}); "
                    "expected every input built inside make_forward, under the fake tensors the "
                    "estimate runs (a real tensor's values send the converted step down other "
                    f"paths; no choice could be measured, e.g. {first[:300]}). Build the inputs "
                    "inside "
                    "make_forward (e.g. ids = torch.randint(...) there) and return "
                    "(forward, model)."
                )
            raise RuntimeError(
                f"{api}: no choice could be measured for a block; expected at least 'eager', got "
                f"errors {[k.errors for k in kinds.values() if not k.r][:1]}. This is a slimgrad "
                "bug; please report it."
            )
        allowed = {
            id(k): [c for c in k.r if c in chosen_from[id(k)]] or list(k.r) for k in kinds.values()
        }
        p0 = base.peak_bytes if base is not None else None
    composed = _Model(blocks, kind_of, p0, allowed)
    path = _walk(composed)

    def point(x: dict[str, str], label: str = "") -> CurvePoint:
        f = composed.flops(x)
        return CurvePoint(composed.peak(x), f, f / fwd_flops if fwd_flops else 0.0, label)

    curve = [point(x) for x in path]
    pareto = [p for i, p in enumerate(curve) if all(q.peak_bytes > p.peak_bytes for q in curve[:i])]
    baselines = {}
    for label, c in (
        ("eager", "eager"),
        ("slimgrad", "lean"),
        ("checkpoint-all", "eager+recompute"),
        ("slimgrad+checkpoint", "lean+recompute"),
        ("sac", "eager+sac"),
    ):
        if all(c in kind_of[b].r for b in blocks):
            baselines[label] = point({b: c for b in blocks}, label)
    lowest = min(range(len(curve)), key=lambda i: (curve[i].peak_bytes, curve[i].recompute_flops))

    n_full = 0
    real: dict[int, int] = {}  # path index -> the applied plan's full estimate

    def whole(i: int) -> int:
        nonlocal n_full
        if i not in real:
            n_full += 1
            real[i] = _known_whole(wholes, path[i], convert_kwargs)
            if real[i] is None:
                say(f"estimating plan {i} of the curve whole")
                real[i] = _estimate_with(
                    make_forward, api, device, path[i], (), convert_kwargs
                ).peak_bytes
                wholes.append((dict(path[i]), dict(convert_kwargs), real[i]))
            else:
                say(f"plan {i} of the curve was estimated whole before: {real[i]:,} B")
        return real[i]

    def first_at_most(target: int, after: int = -1) -> int | None:
        return next((i for i in range(after + 1, len(path)) if curve[i].peak_bytes <= target), None)

    def refuse() -> ValueError:
        # the lowest peak a full estimate measured (NOTE [How plan chooses], 4)
        i = min(real, key=lambda j: (real[j], curve[j].recompute_flops))
        need, got = _fmt(real[i]), _fmt(budget_bytes)
        if need == got:  # a budget just below the peak: the rounded sizes read alike
            need, got = f"{need} ({real[i]:,} B)", f"{got} ({budget_bytes:,} B)"
        return ValueError(
            f"{api}: the budget is below the lowest peak this model can reach; expected a budget "
            f"of at least {need} (the applied plan's full estimate; recompute "
            f"{curve[i].recompute_fraction:.3f} x the forward's matmul FLOPs), got "
            f"{got}. Raise the budget or shrink the batch."
        )

    last = len(path) - 1
    i = first_at_most(budget_bytes)
    if i is None:
        # the composed peak can be above the real one: a whole-model check before refusing, of
        # the composed curve's lowest plan and of the most recomputed one
        for j in dict.fromkeys((lowest, last)):
            if whole(j) <= budget_bytes:
                i = j
                break
        if i is None:
            raise refuse()
    elif verify:
        # greedy repair: the applied plan above the budget moves on along the curve (more
        # recompute, fewer composed bytes) by at least the bytes it was over
        for _ in range(_REPAIRS):
            full = whole(i)
            if full <= budget_bytes:
                break
            nxt = first_at_most(curve[i].peak_bytes - (full - budget_bytes), after=i)
            if nxt is None:
                later = range(i + 1, len(path))
                nxt = min(later, key=lambda j: curve[j].peak_bytes) if later else None
            if nxt is None:
                break
            i = nxt
        if whole(i) > budget_bytes:
            for j in dict.fromkeys((lowest, last)):
                if whole(j) <= budget_bytes:
                    i = j
                    break
            else:
                raise refuse()
    if i in real:
        # the composed peak can over-count: one try at the plan the measured slack allows
        looser = first_at_most(curve[i].peak_bytes + (budget_bytes - real[i]))
        if looser is not None and curve[looser].recompute_flops < curve[i].recompute_flops:
            if whole(looser) <= budget_bytes:
                i = looser
    x = path[i]
    full = real.get(i)
    predicted = composed.peak(x)
    result = Plan(
        budget_bytes=budget_bytes,
        peak_bytes=full if full is not None else predicted,
        predicted_peak_bytes=predicted,
        verified=full is not None,
        recompute_flops=composed.flops(x),
        forward_flops=fwd_flops,
        choices=dict(x),
        device=device,
        curve=pareto,
        baselines=baselines,
        blocks={
            k.names[0]: {
                "blocks": len(k.names),
                "grad_bytes": k.g,
                "kept_bytes": dict(k.r),
                "kept_into_backward_bytes": dict(k.rb),
                "one_block_peak_bytes": dict(k.p1),
                "left_bytes": dict(k.left),
                "segment_peak_bytes": {c: dict(v) for c, v in k.seg.items()},
                "recompute_flops": dict(k.flops),
                "refused": dict(k.errors),
            }
            for k in kinds.values()
        },
        seconds=time.perf_counter() - t0,
        full_estimates=n_full,
    )
    result._measured = (blocks, kinds, kind_of, p0, allowed, fwd_flops)
    result._wholes = (make_forward, wholes)
    return result
