"""jaxinfer: JAX/XLA batch inference for decoder-only LLMs.

The public API is re-exported lazily, so that importing a host-only module (`jaxinfer.scheduler`,
`jaxinfer.block_pool`, `jaxinfer.buckets`) does not import jax.
"""

import importlib

_EXPORTS = {
    "LLM": "jaxinfer.api",
    "RequestOutput": "jaxinfer.api",
    "SamplingParams": "jaxinfer.request",
    "EngineConfig": "jaxinfer.config",
    "ModelConfig": "jaxinfer.config",
    "load_model": "jaxinfer.loading",
    "load_tokenizer": "jaxinfer.tokenizer",
    "fit_buckets": "jaxinfer.buckets",
    "padding_metrics": "jaxinfer.buckets",
    "load_trace": "jaxinfer.traces",
    "synthetic_trace": "jaxinfer.traces",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
