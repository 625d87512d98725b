"""KV caches as pytrees: the paged pool used by the engine and the dense cache of the reference path.

Owns the device arrays, their byte accounting and the per-token codes of a quantized pool; the host-side allocation of pages lives in
block_pool.py. Layout of the paged pool (see shared notes/pallas_gpu.md), so the GPU kernel reads it as is:

    k: [N, G, P, K, L]   K transposed per page
    v: [N, G, P, L, K]

N layers, G kv heads, P pages, K head dim, L page size. Page 0 is the null page: padding lanes write to it
and read from it, never from a real page. The pool is allocated once and donated into every step; the
step returns the updated pool and the caller rebinds it at once.

A quantized pool (`kv_cache_dtype` "int8" or "fp8_e4m3") holds codes in k and v and one f32 scale per
token and kv head beside them, in the same page layout less the head dim, so the kernel reads a page's
scales as one row of L:

    k_scale, v_scale: [N, G, P, L]

The scales are pool arrays: allocated, donated and counted with K and V. A token is quantized when it is
written (`quantize_per_token`, the one owner of the KV codes: `KV_CODE_FORMATS`) and its page
dequantized when it is read.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxinfer.config import ModelConfig

# kv_cache_dtype name -> (code dtype, largest code magnitude). One scale per token and kv head, taken when
# the token is written (dynamic: no calibration): scale = max|x| over the head dim / largest code.
KV_CODE_FORMATS = {"int8": (jnp.int8, 127.0), "fp8_e4m3": (jnp.float8_e4m3fn, 448.0)}
KV_SCALE_DTYPE = jnp.float32


def quantize_per_token(x: Float[Array, "*lead K"], kv_cache_dtype: str) -> tuple[Array, Float[Array, "*lead"]]:
    """Codes [*lead, K] (int8 or float8_e4m3fn) and scales f32 [*lead], so that codes * scale ≈ x.

    int8 rounds to nearest, so |x - codes * scale| <= scale / 2; fp8 e4m3 keeps 3 mantissa bits, a
    relative error of at most 2^-4 for normal codes. An all-zero vector gets scale 1 and zero codes."""
    code_dtype, largest = KV_CODE_FORMATS[kv_cache_dtype]
    x32 = x.astype(jnp.float32)
    amax = jnp.abs(x32).max(axis=-1)  # [*lead]
    scale = jnp.where(amax > 0, amax / largest, 1.0).astype(KV_SCALE_DTYPE)
    scaled = x32 / scale[..., None]
    if jnp.issubdtype(code_dtype, jnp.integer):
        scaled = jnp.clip(jnp.round(scaled), -largest, largest)
    return scaled.astype(code_dtype), scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseKVCache:
    """One contiguous slab per sequence; slot s holds the token at position s."""

    k: jax.Array  # [N, B, S, G, K]
    v: jax.Array  # [N, B, S, G, K]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
    k: jax.Array  # [N, G, P, K, L]; codes when quantized
    v: jax.Array  # [N, G, P, L, K]
    k_scale: jax.Array | None = None  # f32[N, G, P, L] when quantized, else None
    v_scale: jax.Array | None = None  # f32[N, G, P, L]

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def kv_cache_dtype(self) -> str | None:
        """The kv_cache_dtype name of the codes, None for an unquantized pool."""
        if not self.quantized:
            return None
        return next(name for name, (dtype, _) in KV_CODE_FORMATS.items() if jnp.dtype(dtype) == self.k.dtype)

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[4]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageMeta:
    """Where this step's tokens go and which pages each sequence reads. Built on the host."""

    block_tables: jax.Array  # i32[B, P_max]; unused entries are the null page
    slot_pages: jax.Array  # i32[B, T]; page that token (b, t) is written to; null page for padding
    slot_offsets: jax.Array  # i32[B, T]; offset within that page
    # A packed row (several sequences back to back, bucket_tables.py) says whose each table entry and token
    # is, and the position of each entry's first slot. None: one sequence per row, entry p starts at p * L.
    page_positions: jax.Array | None = None  # i32[B, P_max]; position of the entry's first slot
    page_segments: jax.Array | None = None  # i32[B, P_max]; sequence of the row the entry belongs to
    token_segments: jax.Array | None = None  # i32[B, T]; sequence of the row the token belongs to


def init_dense_cache(cfg: ModelConfig, batch_size: int, max_len: int) -> DenseKVCache:
    shape = (cfg.num_layers, batch_size, max_len, cfg.num_kv_heads, cfg.head_dim)
    return DenseKVCache(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))


def token_bytes(cfg: ModelConfig, kv_cache_dtype: str | None = None) -> int:
    """Pool bytes one token occupies across all layers: K and V, and their scales when quantized."""
    if kv_cache_dtype is None:
        return cfg.kv_bytes_per_token(jnp.dtype(cfg.dtype).itemsize)
    code_dtype, _ = KV_CODE_FORMATS[kv_cache_dtype]
    scale_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * jnp.dtype(KV_SCALE_DTYPE).itemsize
    return cfg.kv_bytes_per_token(jnp.dtype(code_dtype).itemsize) + scale_bytes


def pool_bytes(cfg: ModelConfig, num_pages: int, page_size: int, kv_cache_dtype: str | None = None) -> int:
    """Device bytes of a pool with `num_pages` pages (K, V and any scales, all layers)."""
    return num_pages * page_size * token_bytes(cfg, kv_cache_dtype)


def init_pool(cfg: ModelConfig, num_pages: int, page_size: int, kv_cache_dtype: str | None = None) -> KVPool:
    """Allocate the pool once (zeros, so the null page holds finite values; scales of 1 when quantized)."""
    n, g, k = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    dtype = cfg.dtype if kv_cache_dtype is None else KV_CODE_FORMATS[kv_cache_dtype][0]
    k_pages = jnp.zeros((n, g, num_pages, k, page_size), dtype)
    v_pages = jnp.zeros((n, g, num_pages, page_size, k), dtype)
    if kv_cache_dtype is None:
        return KVPool(k_pages, v_pages)
    scales = lambda: jnp.ones((n, g, num_pages, page_size), KV_SCALE_DTYPE)  # noqa: E731
    return KVPool(k_pages, v_pages, scales(), scales())


def write_dense(cache: DenseKVCache, layer: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array) -> DenseKVCache:
    """Write k, v [B, T, G, K] at slots `positions` [B, T] of `layer`."""
    rows = jnp.arange(k.shape[0])[:, None]  # [B, 1]
    return DenseKVCache(cache.k.at[layer, rows, positions].set(k), cache.v.at[layer, rows, positions].set(v))


def write_paged(pool: KVPool, layer: jax.Array, k: jax.Array, v: jax.Array, meta: PageMeta) -> KVPool:
    """Scatter k, v [B, T, G, K] into their (page, offset) slots of `layer`."""
    pages, offsets = meta.slot_pages, meta.slot_offsets  # [B, T]
    # Advanced indices separated by a slice move to the front: the indexed view is [B, T, G, K] for both
    # (and [B, T, G] for the scales).
    if not pool.quantized:
        return KVPool(pool.k.at[layer, :, pages, :, offsets].set(k), pool.v.at[layer, :, pages, offsets, :].set(v))
    name = pool.kv_cache_dtype
    (k_codes, k_scale), (v_codes, v_scale) = quantize_per_token(k, name), quantize_per_token(v, name)
    return KVPool(
        pool.k.at[layer, :, pages, :, offsets].set(k_codes), pool.v.at[layer, :, pages, offsets, :].set(v_codes),
        pool.k_scale.at[layer, :, pages, offsets].set(k_scale), pool.v_scale.at[layer, :, pages, offsets].set(v_scale),
    )


def gather_pages(pool: KVPool, layer: jax.Array, block_tables: jax.Array, dtype=None) -> tuple[jax.Array, jax.Array]:
    """Each sequence's pages of `layer`, kept in the pool's layout: K [G, B, P_max, K, L], V [G, B, P_max, L, K].

    A quantized pool's pages are dequantized on read, into `dtype` (f32 if None)."""
    k_pages, v_pages = pool.k[layer][:, block_tables], pool.v[layer][:, block_tables]
    if not pool.quantized:
        return k_pages, v_pages
    dtype = dtype or jnp.float32
    k_scale, v_scale = pool.k_scale[layer][:, block_tables], pool.v_scale[layer][:, block_tables]  # [G, B, P_max, L]
    k_pages = (k_pages.astype(jnp.float32) * k_scale[..., None, :]).astype(dtype)
    v_pages = (v_pages.astype(jnp.float32) * v_scale[..., None]).astype(dtype)
    return k_pages, v_pages
