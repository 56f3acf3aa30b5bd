"""earl_jax.model."""
