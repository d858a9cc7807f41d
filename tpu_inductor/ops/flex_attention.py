"""FlexAttention's backward on the host's tensors: `tpu_inductor.enable_flex_attention_training()`.

Under tpu_inductor a model's tensors are CPU tensors while the compiled graphs run on the
devices. `torch.nn.attention.flex_attention` refuses a backward on CPU tensors before anything
is traced ("FlexAttention does not support backward on CPU"): Inductor's CPU kernel has none.
Our lowering has one (lowering/ops/flex_attention.py), so the refusal only stands in the way.
This call lifts it, once, for the process: it is torch's module-level check that it replaces,
keeping the check's other refusals (devices FlexAttention does not know). Eager torch then
runs such a backward with its own dense reference (`sdpa_dense_backward`), correct and slow.
The call is explicit because it changes torch's state: importing tpu_inductor changes none.
"""

from __future__ import annotations

_original = None


def enable_flex_attention_training() -> None:
    """Let FlexAttention take CPU tensors that require grad (compiled by tpu_inductor, its
    backward lowered like its forward). Idempotent."""
    global _original
    from torch.nn.attention import flex_attention as module

    if _original is not None:
        return
    _original = module._validate_device

    def validate_device(query, key, value) -> None:
        if query.device.type == "cpu":  # (the one refusal lifted: a backward on the host)
            return
        _original(query, key, value)

    module._validate_device = validate_device
