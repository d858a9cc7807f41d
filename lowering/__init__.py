"""ATen FX graphs → jax functions → StableHLO (imported as `tpu_inductor.lowering`).

Knows nothing of the backend, the cache or the runtime. Importing it is cheap: jax is imported
and the rules are registered the first time a rule table is needed (`registry.load_rules`).
"""
