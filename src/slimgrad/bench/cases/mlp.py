"""GPT-2 MLP block: Linear(768, 3072) -> GELU(tanh) -> Linear(3072, 768) -> dropout 0.1, 4x256.

Eager keeps fc1's input, GELU's input (fc1's output), fc2's input (GELU's output) and a float32
dropout mask (CPU); slimgrad keeps fc1's input, GELU's output (shared with fc2) + 1 bit per
element + a sparse table, and a 1-bit dropout mask (``slimgrad.nn.dropout``). On CPU float32 the
GELU and dropout passes run as compiled C (NOTE [CPU C kernels]); the record's ``kernel_backend``
says which backend was asked for.

Floor accounting: the input x exists before the step, so fc1's copy of it is in both sides'
``saved_input_bytes`` (it is the only pre-existing input kept), not in ``saved_bytes`` nor
``floor_bytes``; the eager floor is fc2's input. The saved/floor ratio with x counted is
``(saved_bytes + saved_input_bytes) / (eager floor_bytes + eager saved_input_bytes)``.
Dropout: the harness seeds the RNG before making the inputs of every step, and slimgrad's dropout
draws its mask like eager's, so both sides drop the same elements.

Run: ``slimgrad bench mlp [--small] [--repeat N]`` (appends to ``benchmarks/results/mlp.jsonl``).
"""

from __future__ import annotations

import copy

import torch

from slimgrad.nn.dropout import Dropout
from slimgrad.nn.gelu import GELU

_DROPOUT_P = 0.1


def build(device="cpu", dtype=torch.float32, small: bool = False):
    """(eager_model, slim_model, make_inputs) for the MLP block; same initial weights, no
    sharing."""
    d, h, tokens = (64, 256, (2, 16)) if small else (768, 3072, (4, 256))
    torch.manual_seed(0)
    eager = torch.nn.Sequential(
        torch.nn.Linear(d, h),
        torch.nn.GELU("tanh"),
        torch.nn.Linear(h, d),
        torch.nn.Dropout(_DROPOUT_P),
    ).to(device=device, dtype=dtype)
    slim = copy.deepcopy(eager)
    slim[1] = GELU.from_torch(slim[1])
    slim[3] = Dropout.from_torch(slim[3])

    def make_inputs():
        return torch.randn(*tokens, d, device=device, dtype=dtype)

    return eager, slim, make_inputs
