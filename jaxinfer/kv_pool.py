"""KV caches as pytrees: the paged pool used by the engine and the dense cache of the reference path.

Owns the device arrays and their byte accounting; the host-side allocation of pages lives in
block_pool.py. Layout of the paged pool (see shared notes/pallas_gpu.md), so the GPU kernel reads it as is:

    k: [N, G, P, K, L]   K transposed per page
    v: [N, G, P, L, K]

N layers, G kv heads, P pages, K head dim, L page size. Page 0 is the null page: padding lanes write to it
and read from it, never from a real page. The pool is allocated once and donated into every step; the
step returns the updated pool and the caller rebinds it at once.
"""

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseKVCache:
    """One contiguous slab per sequence; slot s holds the token at position s."""

    k: jax.Array  # [N, B, S, G, K]
    v: jax.Array  # [N, B, S, G, K]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
    k: jax.Array  # [N, G, P, K, L]
    v: jax.Array  # [N, G, P, L, K]

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


def init_dense_cache(cfg: ModelConfig, batch_size: int, max_len: int) -> DenseKVCache:
    shape = (cfg.num_layers, batch_size, max_len, cfg.num_kv_heads, cfg.head_dim)
    return DenseKVCache(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))


def pool_bytes(cfg: ModelConfig, num_pages: int, page_size: int) -> int:
    """Device bytes of a pool with `num_pages` pages (K and V, all layers)."""
    return num_pages * page_size * cfg.kv_bytes_per_token(jnp.dtype(cfg.dtype).itemsize)


def init_pool(cfg: ModelConfig, num_pages: int, page_size: int) -> KVPool:
    """Allocate the pool once (zeros, so the null page holds finite values)."""
    n, g, k = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    k_pages = jnp.zeros((n, g, num_pages, k, page_size), cfg.dtype)
    v_pages = jnp.zeros((n, g, num_pages, page_size, k), cfg.dtype)
    return KVPool(k_pages, v_pages)


def write_dense(cache: DenseKVCache, layer: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array) -> DenseKVCache:
    """Write k, v [B, T, G, K] at slots `positions` [B, T] of `layer`."""
    rows = jnp.arange(k.shape[0])[:, None]  # [B, 1]
    return DenseKVCache(cache.k.at[layer, rows, positions].set(k), cache.v.at[layer, rows, positions].set(v))


def write_paged(pool: KVPool, layer: jax.Array, k: jax.Array, v: jax.Array, meta: PageMeta) -> KVPool:
    """Scatter k, v [B, T, G, K] into their (page, offset) slots of `layer`."""
    pages, offsets = meta.slot_pages, meta.slot_offsets  # [B, T]
    # Advanced indices separated by a slice move to the front: the indexed view is [B, T, G, K] for both.
    new_k = pool.k.at[layer, :, pages, :, offsets].set(k)
    new_v = pool.v.at[layer, :, pages, offsets, :].set(v)
    return KVPool(new_k, new_v)


def gather_pages(pool: KVPool, layer: jax.Array, block_tables: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each sequence's pages of `layer`, kept in the pool's layout: K [G, B, P_max, K, L], V [G, B, P_max, L, K]."""
    return pool.k[layer][:, block_tables], pool.v[layer][:, block_tables]
