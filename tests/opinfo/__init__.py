"""PyTorch's OpInfo suite run through our lowering (see runner.py, expected.py)."""
