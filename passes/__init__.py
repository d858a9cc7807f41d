"""FX graph passes over ATen graphs (imported as `tpu_inductor.passes`).

Each pass is a named, versioned `GraphModule -> GraphModule` function; `pipeline.run_passes`
applies them in order. Passes talk to lowering only through the graph and `node.meta`.
"""
