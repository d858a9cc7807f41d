"""Device-only state: a model placed on a mesh (device_state), built there from the meta device
(materialize), saved and restored shard by shard (checkpoint). Above runtime and sharding."""
