"""slimgrad.kernels: optional Triton kernels, one file per op stem.

Same signatures as ``ops/<stem>.py``'s ``_fwd_torch`` / ``_bwd_torch``; the backend choice is in
``_backend.py`` (NOTE [Kernel backend choice]). Nothing here is imported by ``import slimgrad``.
"""
