"""FX graph passes over whole ATen graphs (imported as `tpu_inductor.passes`).

`pipeline.run_passes(gm, ctx)` applies the named passes in order, once per graph, before it is
partitioned; each pass is `fn(gm, ctx) -> gm` with a `context.PassContext`. Passes talk to the
lowering only through the graph, `node.meta` and the context's one question.
"""
