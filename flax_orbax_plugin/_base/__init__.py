"""Base plumbing: pytree paths, host buffers, fault points, jax.distributed rounds."""
