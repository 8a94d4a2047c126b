"""slimgrad: train the same PyTorch model, with the same gradients, in less memory."""

__version__ = "0.1.0"
