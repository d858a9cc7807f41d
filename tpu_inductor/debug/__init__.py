"""Debugging: compile records and dumps, trace artifacts, recompile explanations, reproducers,
and the `tpu-inductor explain|report|repro` commands."""
