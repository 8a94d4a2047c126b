"""Quick start: measure one training step of a model, eager and slimgrad side by side.

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
    eager = conv_chain(n_blocks=4, channels=32)
    slim = copy.deepcopy(eager)
    if hasattr(slimgrad, "convert_"):
        slim = slimgrad.convert_(slim) or slim  # in place; same weights, same gradients
    x = torch.randn(8, 32, 28, 28)
    grad = torch.randn(8, 32, 28, 28)  # d(loss)/d(output), the same for both

    for name, model in (("eager", eager), ("slimgrad", slim)):
        m = measure(lambda model=model: model(x), grad=grad, module=model)
        print(
            f"{name:9s} peak {m.peak_bytes / MiB:7.2f} MiB  saved {m.saved_bytes / MiB:7.2f} MiB"
            f"  floor {m.floor_bytes / MiB:6.2f} MiB"
        )
    for (n, p), q in zip(eager.named_parameters(), slim.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda s, n=n: f"{n}: {s}")
    print("gradients match eager PyTorch")


if __name__ == "__main__":
    main()
