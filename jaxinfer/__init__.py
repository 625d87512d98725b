"""jaxinfer: JAX/XLA batch inference for decoder-only LLMs."""
