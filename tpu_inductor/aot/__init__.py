"""Ahead-of-time compilation: artifacts compiled through compile_fx's stages, their buckets,
loading and running them without Dynamo, and the `tpu-inductor compile|inspect|run` commands."""


def load(directory, device: str = "auto", *, pad_with: str = "zeros"):
    """Load an artifact directory to run without Dynamo or tracing (aot.loader.load)."""
    from tpu_inductor.aot.loader import load as load_artifact

    return load_artifact(directory, device, pad_with=pad_with)
