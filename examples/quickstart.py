"""Quick start: convert a model, then measure one training step, eager and slimgrad side by side.

Run: ``python examples/quickstart.py`` (a few seconds on CPU).
"""

import copy

import torch

import slimgrad
from slimgrad.bench.models import conv_chain
from slimgrad.memory import measure

MiB = 2**20


def main() -> None:
    torch.manual_seed(0)
    eager = conv_chain(n_blocks=4, channels=32)  # 4 x Conv2d -> BatchNorm2d -> LeakyReLU
    slim = slimgrad.convert_(copy.deepcopy(eager))  # in place; same weights, same function
    print(slimgrad.report(slim))
    x = torch.randn(8, 32, 28, 28)
    grad = torch.randn(8, 32, 28, 28)  # d(loss)/d(output), the same for both

    for name, model in (("eager", eager), ("slimgrad", slim)):
        m = measure(lambda model=model: model(x), grad=grad, module=model)
        print(
            f"{name:9s} peak {m.peak_bytes / MiB:7.2f} MiB  saved {m.saved_bytes / MiB:7.2f} MiB"
            f"  floor {m.floor_bytes / MiB:6.2f} MiB"
        )
    # Loss and every gradient against a float64 copy: slimgrad's error must stay within twice
    # eager PyTorch's own float32 error (+ atol).
    check = slimgrad.verify(eager, slim, x)
    print(f"gradients within the rule: {check.ok}")


if __name__ == "__main__":
    main()
