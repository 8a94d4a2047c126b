"""Built-in models for benchmarks, tests and the demo, in plain PyTorch (nothing downloaded).

- :func:`resnet50`: torchvision's ResNet-50 (v1.5: stride on the 3x3 conv), same module tree,
  state_dict keys, initialisation and parameter count (25,557,032 at 1000 classes).
  :func:`resnet_small` is a two-stage ResNet of the same blocks for tests and the demo.
- :class:`GPT`, :class:`GPTConfig`: a GPT-2-style decoder (pre-norm, GELU-tanh MLP, learned
  positions, tied LM head, dropout 0.1, fused causal attention through
  ``F.scaled_dot_product_attention``). ``GPTConfig.small()`` has GPT-2 small's sizes (124,439,808
  parameters); ``GPTConfig.tiny()`` is for tests.
- :func:`conv_chain`: ``n_blocks`` x ``Conv2d(64, 64, 3, padding=1) -> BatchNorm2d ->
  LeakyReLU(0.01, inplace)``.
- :class:`WithLoss`: ``model(x, target) -> loss``, so that a step is ``loss = model(*inputs);
  loss.backward()``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPT",
    "Bottleneck",
    "GPTConfig",
    "ResNet",
    "WithLoss",
    "conv_chain",
    "resnet50",
    "resnet_small",
]


# -------------------------------------------------------------------------------- ResNet
def _conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, 3, stride=stride, padding=1, bias=False)


def _conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False)


class Bottleneck(nn.Module):
    """torchvision's ``Bottleneck`` (expansion 4, stride on ``conv2``)."""

    expansion = 4

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.conv1 = _conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ``ResNet`` for bottleneck blocks (same module names and state_dict keys)."""

    def __init__(
        self,
        layers: tuple[int, ...] = (3, 4, 6, 3),
        num_classes: int = 1000,
        width: int = 64,
        zero_init_residual: bool = False,
    ) -> None:
        super().__init__()
        if not 1 <= len(layers) <= 4 or any(n < 1 for n in layers):
            raise ValueError(
                "slimgrad.bench.models.ResNet: layers must hold 1 to 4 positive block counts; "
                f"expected e.g. (3, 4, 6, 3), got {tuple(layers)}. Pass one count per stage."
            )
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        for i, n in enumerate(layers):
            stage = self._make_layer(width * 2**i, n, stride=1 if i == 0 else 2)
            setattr(self, f"layer{i + 1}", stage)
        self.n_stages = len(layers)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(self.inplanes, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.constant_(m.bn3.weight, 0)

    def _make_layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                _conv1x1(self.inplanes, planes * Bottleneck.expansion, stride),
                nn.BatchNorm2d(planes * Bottleneck.expansion),
            )
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(self.n_stages):
            x = getattr(self, f"layer{i + 1}")(x)
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def resnet50(num_classes: int = 1000) -> ResNet:
    """torchvision's ``resnet50(weights=None)``: 25,557,032 parameters at 1000 classes.

    Example:
        >>> sum(p.numel() for p in resnet50().parameters())
        25557032
    """
    return ResNet((3, 4, 6, 3), num_classes=num_classes)


def resnet_small(num_classes: int = 10, width: int = 16) -> ResNet:
    """A two-stage bottleneck ResNet (one block per stage) for tests and the demo."""
    return ResNet((1, 1), num_classes=num_classes, width=width)


# -------------------------------------------------------------------------------- GPT
@dataclass(frozen=True)
class GPTConfig:
    """Sizes of :class:`GPT`. Defaults are GPT-2 small's (``GPT2Config()``)."""

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    dropout: float = 0.1
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                "slimgrad.bench.models.GPTConfig: n_embd must be divisible by n_head; expected "
                f"a multiple of {self.n_head}, got {self.n_embd}. Change n_embd or n_head."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(
                "slimgrad.bench.models.GPTConfig: dropout must be in [0, 1); expected e.g. 0.1, "
                f"got {self.dropout}. Pass a probability."
            )

    @classmethod
    def small(cls, **overrides) -> GPTConfig:
        """GPT-2 small: 12 layers, 12 heads, 768 wide, 50257 tokens."""
        return replace(cls(), **overrides)

    @classmethod
    def tiny(cls, **overrides) -> GPTConfig:
        """2 layers, 2 heads, 32 wide, 97 tokens, 64 positions: for tests and the demo."""
        tiny = cls(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=2)
        return replace(tiny, **overrides)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        # Reads the module's p so that a converted or zeroed Dropout module controls attention
        # dropout too.
        p = self.attn_dropout.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2-style language model. ``forward(idx, targets=None)`` returns the logits, or the mean
    next-token cross-entropy when ``targets`` is given (targets are the inputs: shifted inside, as
    HF's ``labels=``).
    """

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = cfg if cfg is not None else GPTConfig()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.n_positions:
            raise ValueError(
                f"slimgrad.bench.models.GPT: sequence too long; expected at most "
                f"{self.config.n_positions} tokens, got {t}. Shorten the input or raise "
                "n_positions."
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), targets[:, 1:].reshape(-1)
        )


# -------------------------------------------------------------------------------- others
def conv_chain(n_blocks: int = 8, channels: int = 64) -> nn.Sequential:
    """``n_blocks`` x ``Conv2d(c, c, 3, padding=1) -> BatchNorm2d(c) -> LeakyReLU(0.01, True)``."""
    if n_blocks < 1:
        raise ValueError(
            f"slimgrad.bench.models.conv_chain: n_blocks must be positive; expected >= 1, got "
            f"{n_blocks}. Pass e.g. n_blocks=8."
        )
    layers: list[nn.Module] = []
    for _ in range(n_blocks):
        layers += [
            nn.Conv2d(channels, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.LeakyReLU(0.01, inplace=True),
        ]
    return nn.Sequential(*layers)


class WithLoss(nn.Module):
    """``WithLoss(model, loss_fn)(x, target) == loss_fn(model(x), target)``.

    ``model`` is a child, so conversion and ``module=`` attribution see it under the name ``model``.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
    ) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model(x), target)
