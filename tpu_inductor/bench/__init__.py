"""The benchmark harness (`tpu-inductor bench`) and its models."""
