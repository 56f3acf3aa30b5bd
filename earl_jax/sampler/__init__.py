"""earl_jax.sampler."""
