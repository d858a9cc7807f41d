"""The custom torch ops that passes and lowering share (attention, norm, expert_mm, shard_as):
the bottom of the house. Each module defines its ops with torch.library when imported."""
