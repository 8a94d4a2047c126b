"""slimgrad.kernels"""
