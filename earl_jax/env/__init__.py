"""earl_jax.env."""
