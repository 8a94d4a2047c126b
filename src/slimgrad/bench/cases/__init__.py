"""Benchmark cases: one module per op stem (``cases/<stem>.py``), plus ``cases/models.py``.

Every module here (names starting with ``_`` excepted) is imported by ``slimgrad bench`` and
``slimgrad.bench.harness.list_cases()``. A module that fails to import is reported by ``slimgrad
bench --list`` and does not stop the other cases. A module registers its cases in one of three
ways, simplest first:

1. A module-level ``build`` function; the case is named after the module stem::

       # src/slimgrad/bench/cases/gelu.py
       '''gelu on 16x1024x768 (first docstring line: the description in `slimgrad bench --list`).'''

       def build(device, dtype, small=False):
           shape = (2, 5, 7) if small else (16, 1024, 768)
           eager = torch.nn.GELU()
           slim = slimgrad.nn.gelu.GELU()  # or slimgrad.convert_(copy.deepcopy(eager))

           def make_inputs():  # fresh tensors on every call; the harness seeds the RNG first
               return torch.randn(shape, device=device, dtype=dtype, requires_grad=True)

           return eager, slim, make_inputs

2. ``@register_case(name, description=..., requires=..., grad_check=..., repeat=..., warmup=...,
   provider=...)`` on any number of build functions (several cases per module, or options)::

       from slimgrad.bench.harness import register_case

       @register_case("gelu_bf16", description="gelu, bf16 inputs")
       def build_bf16(device, dtype, small=False): ...

3. A module-level ``CASES`` list of ``slimgrad.bench.harness.Case`` objects.

The contract of ``build(device, dtype, small=False) -> (eager, slim, make_inputs)``:

- ``eager`` and ``slim`` are callables (usually ``nn.Module``; their parameters are the ones whose
  gradients are checked, matched by name) computing the same function of ``*make_inputs()``, from
  the same initial weights. ``slim`` must not share Parameters with ``eager`` if it changes them.
- ``make_inputs()`` returns a tensor or a tuple of tensors, fresh on each call (ops may write in
  place into their input). Inputs that require grad get their gradients checked too.
- The output is a loss (scalar) or any tensor: the harness then backpropagates a fixed random
  gradient of the output's shape (NOTE [Benchmark step] in ``slimgrad/bench/harness.py``).
- ``small=True`` builds a variant that runs in well under a second on one CPU core (tests use it).
- Build only what the case needs; nothing is downloaded. Cases needing an optional package declare
  it with ``requires=("transformers",)`` and import it inside ``build``.

Run a case with ``slimgrad bench NAME [--small] [--repeat N] [--json]``; records go to
``benchmarks/results/NAME.jsonl``.
"""
