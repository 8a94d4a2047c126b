"""Math shared by ``slimgrad.ops`` and ``slimgrad.kernels``.

# NOTE [Kernels are leaves]
A kernel module (``slimgrad/kernels/*.py``) imports nothing from ``slimgrad.ops``,
``slimgrad.bench`` or ``slimgrad.convert`` (GUIDE.md, "The house"): an op picks its kernel, never
the other way round, so the kernels can be read, tested and benchmarked alone. What both need (the
bit layout of packed masks, the smooth activations' specs, f' tables and plain-PyTorch reference
of their side information) lives here, below both:

- :mod:`slimgrad._math.bits`: 1-bit-per-element masks (``pack_bits`` / ``unpack_bits``);
- :mod:`slimgrad._math.smooth`: SiLU / GELU / Mish specs, f' tables, ``smooth_fwd`` /
  ``smooth_grad``.

A kernel's fallback to eager calls torch itself (``torch.nn.functional.elu``, ``aten.*_backward``),
not the op module. ``tests/kernels/test_output_act.py`` reads the kernels' imports.
"""
