"""A RevNet-style CIFAR-size network trained on random data with reversible stages.

Three stages of additive couplings (F = G = BN-ReLU-conv3x3-BN-ReLU-conv3x3, RevNet's residual
function) joined by ordinary stride-2 downsampling convs (not invertible: they keep their inputs, as
in the RevNet paper). Each stage is a ``slimgrad.nn.reversible.ReversibleSequential``, so its
activations are rebuilt in backward instead of stored. Prints the loss per step and, when
``slimgrad.memory`` is available, saved and peak bytes of one step next to the same network with
``reversible=False``.

    PYTHONPATH=src python examples/revnet.py --steps 3
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from slimgrad.nn.reversible import AdditiveCoupling, ReversibleSequential


def residual_fn(c: int) -> nn.Module:
    return nn.Sequential(
        nn.BatchNorm2d(c),
        nn.ReLU(),
        nn.Conv2d(c, c, 3, padding=1, bias=False),
        nn.BatchNorm2d(c),
        nn.ReLU(),
        nn.Conv2d(c, c, 3, padding=1, bias=False),
    )


def revnet(widths=(32, 64, 128), blocks_per_stage=3, num_classes=10, exact=False) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, widths[0], 3, padding=1, bias=False)]
    for i, w in enumerate(widths):
        if i > 0:  # downsampling: not invertible, an ordinary layer between reversible stages
            layers += [nn.BatchNorm2d(widths[i - 1]), nn.ReLU()]
            layers.append(nn.Conv2d(widths[i - 1], w, 3, stride=2, padding=1, bias=False))
        stage = [
            AdditiveCoupling(residual_fn(w // 2), residual_fn(w // 2))
            for _ in range(blocks_per_stage)
        ]
        layers.append(ReversibleSequential(*stage, exact=exact))
    layers += [
        nn.BatchNorm2d(widths[-1]),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(widths[-1], num_classes),
    ]
    return nn.Sequential(*layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=3, help="couplings per stage")
    ap.add_argument("--exact", action="store_true", help="fixed-point stream: bit-exact rebuild")
    args = ap.parse_args()

    torch.manual_seed(0)
    model = revnet(blocks_per_stage=args.blocks, exact=args.exact)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(args.batch, 3, 32, 32)
    target = torch.randint(0, 10, (args.batch,))
    loss_fn = nn.CrossEntropyLoss()
    for step in range(args.steps):
        opt.zero_grad()
        loss = loss_fn(model(x), target)
        loss.backward()
        opt.step()
        errs = [m.last_reconstruction.max_abs for m in model if isinstance(m, ReversibleSequential)]
        print(f"step {step}: loss {loss.item():.4f}, max reconstruction error {max(errs):.2e}")

    try:
        from slimgrad.memory import measure
    except ImportError:
        return
    plain = copy.deepcopy(model)
    for m in plain:
        if isinstance(m, ReversibleSequential):
            m.reversible = False
    for name, net in (("plain", plain), ("reversible", model)):
        mem = measure(lambda net=net: loss_fn(net(x), target))
        print(
            f"{name:>10}: saved {mem.saved_bytes / 2**20:6.2f} MiB, "
            f"peak {mem.peak_bytes / 2**20:6.2f} MiB"
        )


if __name__ == "__main__":
    main()
