"""Math shared by ``slimgrad.ops`` and ``slimgrad.kernels``.

# NOTE [Kernels are leaves]
A kernel module (``slimgrad/kernels/*.py``) imports nothing from ``slimgrad.ops``,
``slimgrad.bench`` or ``slimgrad.convert`` (CONTRIBUTING.md): an op picks its kernel, never
the other way round, so the kernels can be read, tested and benchmarked alone. What both need (the
bit layout of packed masks, the smooth activations' specs, f' tables and plain-PyTorch reference
of their side information) lives here, below both:

- :mod:`slimgrad._math.bits`: 1-bit-per-element masks (``pack_bits`` / ``unpack_bits``);
- :mod:`slimgrad._math.smooth`: SiLU / GELU / Mish specs, f' tables, ``smooth_fwd`` /
  ``smooth_grad``;
- :mod:`slimgrad._math.abn`: In-Place ABN's plain-PyTorch statistics, side channels, forward and
  chunked backward;
- :mod:`slimgrad._math.layout`: an elementwise op's memory order, and eager's output on a strided
  input (the smooth activations' ops and Triton kernels);
- :mod:`slimgrad._math.linear_cross_entropy`: the fused LM loss's chunk loops (PyTorch path);
- :mod:`slimgrad._math.norms`: LayerNorm's and RMSNorm's fallback channels, xhat rebuilt from the
  output, forwards and chunked backwards (PyTorch path);
- :mod:`slimgrad._math.steps`: the optimizer-step count that the per-parameter-version caches
  also key on (fused steps skip the version counter);
- :mod:`slimgrad._math.tables`: side tables of data-dependent length under fake tensors and
  torch.compile (``dynamic_size``, ``index_table``, ``select_table``).

A kernel's fallback to eager calls torch itself (``torch.nn.functional.elu``, ``aten.*_backward``),
not the op module. ``tests/test_layout.py`` reads every kernel module's imports.
"""
