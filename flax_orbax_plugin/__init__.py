"""flax_orbax_plugin: fast, safe, sharded checkpointing for Flax/Optax training loops."""
