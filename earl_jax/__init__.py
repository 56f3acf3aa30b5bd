"""earl_jax: JAX-native agentic RL for LLMs (after EARL, arXiv 2510.05943).

Public entry points live in the subpackages: ``earl_jax.model`` (decoder, HF import, tokenizers),
``earl_jax.config_lib`` (typed configs). See README.md for the data flow.
"""

__version__ = "0.1.0"
