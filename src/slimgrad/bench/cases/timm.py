"""timm vision models (issue 18): ``timm.create_model(name)`` + cross-entropy, eager vs convert_.

One case per model, ``timm_<model>``: the model as a new user builds it (random init, timm's
defaults, train mode) in ``WithLoss`` (cross-entropy against random labels), 8x3x224x224 at full
size. ``small=True`` builds the tiny sibling the timm conformance suite uses
(``tests/conformance/test_timm.py``): fewer blocks where timm takes the option, else the smallest
timm model of the same family built from the same layers, at 2x3x32x32 (odd sizes where the suite
uses them).

The cases need ``timm`` importable (``requires=("timm",)``); slimgrad itself never imports it. On
a CPU-only torch the matching torchvision wheel needs two op schemas defined before it imports:
``benchmarks/timm_models.py`` runs these cases through the tests' shim
(``tests/conformance/_timm_shim.py``), which explains why.
"""

from __future__ import annotations

import torch

from slimgrad.bench import models
from slimgrad.bench.cases.models import place, slim_copy
from slimgrad.bench.harness import register_case

# name: (tiny sibling, its create_model kwargs, tiny image HxW); the full size is 8x3x224x224
MODELS = {
    "resnet50": ("resnet50", dict(layers=(1, 1, 1, 1)), (32, 32)),
    "efficientnet_b0": ("test_efficientnet", {}, (33, 35)),
    "vit_small_patch16_224": ("vit_small_patch16_224", dict(depth=2, img_size=32), (32, 32)),
    "regnety_016": ("regnety_002", {}, (32, 32)),
    "convnext_tiny": ("convnext_tiny", dict(depths=(1, 1, 1, 1)), (35, 33)),
    "mobilenetv3_large_100": ("mobilenetv3_small_050", {}, (32, 32)),
}
FULL_BATCH, FULL_SIZE, SMALL_BATCH, CLASSES = 8, 224, 2, 1000


def eager_timm(name: str, device, dtype, small: bool = False):
    """The eager side of case ``timm_<name>``: ``(WithLoss(model), make_inputs)``.

    ``make_inputs()`` returns ``(images, labels)``; the network is ``model.model``.
    """
    import timm

    if small:
        tiny, kwargs, size = MODELS[name]
        net = timm.create_model(tiny, pretrained=False, **kwargs)
        batch = SMALL_BATCH
    else:
        net = timm.create_model(name, pretrained=False)
        batch, size = FULL_BATCH, (FULL_SIZE, FULL_SIZE)
    eager = place(models.WithLoss(net.train()), device, dtype)
    classes = net.num_classes

    def make_inputs():
        x = torch.randn(batch, 3, *size, device=device, dtype=dtype)
        return x, torch.randint(0, classes, (batch,), device=device)

    return eager, make_inputs


def _case(name: str) -> None:
    tiny, _, size = MODELS[name]

    @register_case(
        f"timm_{name}",
        description=f"timm.create_model({name!r}) + cross-entropy, train, 8x3x224x224 (small: "
        f"{tiny}, 2x3x{size[0]}x{size[1]}) [timm]",
        requires=("timm",),
        repeat=7,
    )
    def build(device, dtype, small=False):
        eager, make_inputs = eager_timm(name, device, dtype, small)
        return eager, slim_copy(eager), make_inputs


for _name in MODELS:
    _case(_name)
