"""jaxinfer: JAX/XLA batch inference for decoder-only LLMs.

The public API is re-exported lazily, so that importing a host-only module (`jaxinfer.scheduling.scheduler`,
`jaxinfer.scheduling.block_pool`, `jaxinfer.bucketing.strategies`) does not import jax.
"""

import importlib

_EXPORTS = {
    "LLM": "jaxinfer.api",
    "RequestOutput": "jaxinfer.outputs",
    "SamplingParams": "jaxinfer.scheduling.request",
    "EngineConfig": "jaxinfer.config",
    "ModelConfig": "jaxinfer.config",
    "load_model": "jaxinfer.loading.loading",
    "load_tokenizer": "jaxinfer.loading.tokenizer",
    "fit_buckets": "jaxinfer.bucketing.strategies",
    "padding_metrics": "jaxinfer.bucketing.strategies",
    "load_trace": "jaxinfer.bucketing.traces",
    "synthetic_trace": "jaxinfer.bucketing.traces",
    "logprobs": "jaxinfer.trainer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
