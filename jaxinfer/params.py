"""Params pytrees: per-layer weights stacked on a leading layer axis for `lax.scan`.

Owns the parameter layout only; loading from files lives in loading.py. Weights are stored in the
layout the einsums in model.py consume, so no transposes happen inside the step. Q/K projections are in
Hugging Face's rotary layout (rotate-half pairs (i, i + K/2)); the GGUF loader undoes llama.cpp's permutation.

A matmul weight may instead be a `quant.QuantizedTensor` of the same logical shape (model.py's qeinsum and
take accept both). `weight_format` is the one owner of which tensors are quantized, and to what;
`quantize_arrays` applies it for int8/int4, loading.py for GGUF's own blocks.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import quant
from jaxinfer.config import ModelConfig

QUANTIZATIONS = ("gguf", "int8", "int4")  # besides None: dense weights in cfg.dtype
DEFAULT_INT4_GROUP_SIZE = 32  # SmolLM2's widths (576, 1536) allow 32 or 64, not 128
Weight = jax.Array | quant.QuantizedTensor

# Params field -> logical input axes (the contracted ones; the rest are output channels), for every
# matmul weight: the layer fields in their stacked layout without the leading N, the embedding [V, D]
# ("out_in": a row per vocabulary entry) and the untied head [D, V].
MATMUL_INPUT_AXES = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1, "embed": 1, "lm_head": 1}
WEIGHT_KINDS = {  # Params field -> the tensor kind `jaxinfer info` reports
    "embed": "embedding", "lm_head": "head", "final_norm": "head",
    "attn_norm": "attention", "wq": "attention", "wk": "attention", "wv": "attention", "wo": "attention",
    "bq": "attention", "bk": "attention", "bv": "attention", "q_norm": "attention", "k_norm": "attention",
    "mlp_norm": "mlp", "w_gate": "mlp", "w_up": "mlp", "w_down": "mlp",
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParams:
    """Weights of all layers, stacked: the leading axis is the layer index (N)."""

    attn_norm: jax.Array  # [N, D]
    wq: Weight  # [N, D, H, K]
    wk: Weight  # [N, D, G, K]
    wv: Weight  # [N, D, G, K]
    wo: Weight  # [N, H, K, D]
    mlp_norm: jax.Array  # [N, D]
    w_gate: Weight  # [N, D, F]
    w_up: Weight  # [N, D, F]
    w_down: Weight  # [N, F, D]
    bq: jax.Array | None = None  # [N, H, K], only with cfg.attention_bias
    bk: jax.Array | None = None  # [N, G, K]
    bv: jax.Array | None = None  # [N, G, K]
    q_norm: jax.Array | None = None  # [N, K], only with cfg.qk_norm
    k_norm: jax.Array | None = None  # [N, K]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Params:
    embed: Weight  # [V, D]
    layers: LayerParams
    final_norm: jax.Array  # [D]
    lm_head: Weight | None  # [D, V], None when tied to `embed`


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


def weight_format(field: str, quantization: str | None) -> str | None:
    """What `field` is stored as under `quantization`: None (dense, cfg.dtype), "gguf" (the file's
    blocks, where their type is kept), "int8" or "int4". The one owner of this choice.

    Norms and biases stay dense (tiny, and added rather than multiplied). The embedding and the head are
    int8 under both int8 and int4: the head's error lands on the logits unnormalized, and an int8 row per
    vocabulary entry keeps the tied [V, D] table at a quarter of f32 (SmolLM2: 28 of 135M parameters) with a
    per-row scale that serves both the lookup and the head. Under gguf they keep the file's own type.
    """
    if quantization is None or field not in MATMUL_INPUT_AXES:
        return None
    if quantization == "int4" and field in ("embed", "lm_head"):
        return "int8"
    return quantization


def _matmul_rows(field: str, w: np.ndarray) -> tuple[np.ndarray, dict]:
    """A weight in its Params layout -> [*lead, O, I] rows plus its logical factoring for QuantizedTensor."""
    if field == "embed":  # [V, D] is already rows of output channels
        return w, dict(layout="out_in")
    lead = 1 if field != "lm_head" else 0
    num_in = MATMUL_INPUT_AXES[field]
    in_shape, out_shape = w.shape[lead : lead + num_in], w.shape[lead + num_in :]
    rows = w.reshape(*w.shape[:lead], int(np.prod(in_shape)), int(np.prod(out_shape)))
    return np.swapaxes(rows, -1, -2), dict(in_shape=tuple(in_shape), out_shape=tuple(out_shape), layout="in_out")


def quantize_arrays(arrays: dict[str, object], quantization: str, *, group_size: int = DEFAULT_INT4_GROUP_SIZE) -> dict[str, object]:
    """int8 / int4: replace each host f32 matmul weight (Params layout) chosen by `weight_format` with a
    QuantizedTensor; everything else passes through. An int4 group that does not divide a weight's
    input width is a ValueError naming the weight."""
    out = dict(arrays)
    for field, w in arrays.items():
        fmt = weight_format(field, quantization)
        if fmt not in ("int8", "int4") or isinstance(w, quant.QuantizedTensor):
            continue
        rows, logical = _matmul_rows(field, np.asarray(w, np.float32))
        try:
            out[field] = quant.quantize_int8(rows, **logical) if fmt == "int8" else quant.quantize_int4(rows, group_size=group_size, **logical)
        except ValueError as e:
            raise ValueError(f"cannot quantize weight {field!r} {tuple(w.shape)} to int4 with group size {group_size}: {e}") from None
    return out


def _to_device(value, dtype) -> Weight:
    if isinstance(value, quant.QuantizedTensor):
        return jax.device_put(value)
    return jnp.asarray(value, dtype=dtype)


def _to_host(value, dtype) -> Weight:
    """The weight as host (numpy) leaves, dense ones cast to `dtype` (the same rounding as on a device)."""
    if isinstance(value, quant.QuantizedTensor):
        return jax.device_get(value)
    return np.asarray(jax.device_get(value)).astype(dtype, copy=False)


def weight_bytes(params: Params) -> dict[tuple[str, str], int]:
    """Resident device bytes per (tensor kind, storage format), e.g. ("attention", "q4_1"); formats are
    a QuantizedTensor's `format` or a dense array's dtype name. Measured with quant.resident_bytes."""
    fields = {"embed": params.embed, "lm_head": params.lm_head, "final_norm": params.final_norm}
    fields |= {f.name: getattr(params.layers, f.name) for f in dataclasses.fields(LayerParams)}
    totals: dict[tuple[str, str], int] = {}
    for field, value in fields.items():
        if value is None:
            continue
        fmt = value.format if isinstance(value, quant.QuantizedTensor) else jnp.dtype(value.dtype).name
        key = (WEIGHT_KINDS[field], fmt)
        totals[key] = totals.get(key, 0) + quant.resident_bytes(value)
    return totals


def from_numpy(cfg: ModelConfig, arrays: dict[str, object], *, on_host: bool = False) -> Params:
    """Build Params from host arrays keyed by field name (stacked layer fields, `embed`, `final_norm`,
    optional `lm_head`), checking every shape and casting dense ones to `cfg.dtype`. A value may be a
    QuantizedTensor (host or device leaves) of the expected logical shape; it is put on the device as is.
    `on_host`: keep every leaf in host memory (numpy), for sharding.shard_params to place shard by shard."""
    dtype = jnp.dtype(cfg.dtype)
    expected = dict(layer_shapes(cfg), embed=(cfg.vocab_size, cfg.embed_dim), final_norm=(cfg.embed_dim,))
    if not cfg.tie_embeddings:
        expected["lm_head"] = (cfg.embed_dim, cfg.vocab_size)
    for name, shape in expected.items():
        if name not in arrays:
            raise ValueError(f"missing weight {name!r}")
        if tuple(arrays[name].shape) != shape:
            raise ValueError(f"weight {name!r} has shape {tuple(arrays[name].shape)}, expected {shape}")
    place = _to_host if on_host else _to_device
    cast = {name: place(arrays[name], dtype) for name in expected}
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
