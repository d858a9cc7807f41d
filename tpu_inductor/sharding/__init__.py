"""Sharding: meshes and specs, plans, placement of tensors on the mesh, the collectives report,
several hosts (jax.distributed). XLA's SPMD partitioner does the splitting."""
