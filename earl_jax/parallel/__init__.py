"""earl_jax.parallel."""
