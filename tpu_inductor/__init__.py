"""tpu_inductor: a torch.compile backend that runs PyTorch programs on any PJRT device.

    torch.compile(model, backend="tpu_inductor")

Importing this package is cheap and changes no global state; jax is imported on first compile.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
