"""The package version, importable from anywhere below the public API (no cycle through
`tpu_inductor/__init__.py`)."""

__version__ = "0.1.0"
