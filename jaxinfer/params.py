"""Params pytrees: per-layer weights stacked on a leading layer axis for `lax.scan`.

Owns the parameter layout only; loading from files lives in loading.py. Weights are stored in the
layout the einsums in model.py consume, so no transposes happen inside the step. Q/K projections are in
Hugging Face's rotary layout (rotate-half pairs (i, i + K/2)); the GGUF loader undoes llama.cpp's permutation.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParams:
    """Weights of all layers, stacked: the leading axis is the layer index (N)."""

    attn_norm: jax.Array  # [N, D]
    wq: jax.Array  # [N, D, H, K]
    wk: jax.Array  # [N, D, G, K]
    wv: jax.Array  # [N, D, G, K]
    wo: jax.Array  # [N, H, K, D]
    mlp_norm: jax.Array  # [N, D]
    w_gate: jax.Array  # [N, D, F]
    w_up: jax.Array  # [N, D, F]
    w_down: jax.Array  # [N, F, D]
    bq: jax.Array | None = None  # [N, H, K], only with cfg.attention_bias
    bk: jax.Array | None = None  # [N, G, K]
    bv: jax.Array | None = None  # [N, G, K]
    q_norm: jax.Array | None = None  # [N, K], only with cfg.qk_norm
    k_norm: jax.Array | None = None  # [N, K]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Params:
    embed: jax.Array  # [V, D]
    layers: LayerParams
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None  # [D, V], None when tied to `embed`


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of each stacked layer weight the config has (biases and q/k norms only with their feature)."""
    n, d, h, g, k, f = cfg.num_layers, cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim
    shapes = {
        "attn_norm": (n, d),
        "wq": (n, d, h, k),
        "wk": (n, d, g, k),
        "wv": (n, d, g, k),
        "wo": (n, h, k, d),
        "mlp_norm": (n, d),
        "w_gate": (n, d, f),
        "w_up": (n, d, f),
        "w_down": (n, f, d),
    }
    if cfg.attention_bias:
        shapes.update(bq=(n, h, k), bk=(n, g, k), bv=(n, g, k))
    if cfg.qk_norm:
        shapes.update(q_norm=(n, k), k_norm=(n, k))
    return shapes


def from_numpy(cfg: ModelConfig, arrays: dict[str, np.ndarray]) -> Params:
    """Build Params from host arrays keyed by field name (stacked layer fields, `embed`, `final_norm`,
    optional `lm_head`), checking every shape and casting to `cfg.dtype`."""
    dtype = jnp.dtype(cfg.dtype)
    expected = dict(layer_shapes(cfg), embed=(cfg.vocab_size, cfg.embed_dim), final_norm=(cfg.embed_dim,))
    if not cfg.tie_embeddings:
        expected["lm_head"] = (cfg.embed_dim, cfg.vocab_size)
    for name, shape in expected.items():
        if name not in arrays:
            raise ValueError(f"missing weight {name!r}")
        if tuple(arrays[name].shape) != shape:
            raise ValueError(f"weight {name!r} has shape {tuple(arrays[name].shape)}, expected {shape}")
    cast = {name: jnp.asarray(arrays[name], dtype=dtype) for name in expected}
    layers = LayerParams(**{name: cast[name] for name in layer_shapes(cfg)})
    return Params(cast["embed"], layers, cast["final_norm"], cast.get("lm_head"))


def init_random(key: jax.Array, cfg: ModelConfig, scale: float = 0.02) -> Params:
    """Random weights of the given geometry (benchmarks and tests of shapes, never numerics claims)."""
    shapes = dict(layer_shapes(cfg), embed=(cfg.vocab_size, cfg.embed_dim), final_norm=(cfg.embed_dim,))
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (cfg.embed_dim, cfg.vocab_size)
    keys = jax.random.split(key, len(shapes))
    arrays = {}
    for sub, (name, shape) in zip(keys, shapes.items()):
        is_norm = name.endswith("norm")
        arrays[name] = np.ones(shape, np.float32) if is_norm else np.asarray(jax.random.normal(sub, shape) * scale)
    return from_numpy(cfg, arrays)
