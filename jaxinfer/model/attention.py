"""One attention signature for every cache kind and back end.

`attend` writes this step's keys and values into the cache (dense slab, paged pool, or none) and
attends over everything the sequence has so far. The math is `attention_reference`, pure jnp in f32;
on a GPU, single-token 16-bit decode over the paged pool goes to the Pallas Mosaic GPU kernel in
kernels_pallas/ instead (where that module's `supports` says it serves the geometry), and on a CPU every
paged step (prefill, packed rows, decode) of an f32 model goes to the C++ kernel in kernels_cpu/. Both
kernels take the whole pool and the layer index and read the layer's pages in place (under tensor
parallelism too, on each device's own kv heads). The model never imports a kernel directly.

Deterministic mode (the two DETERMINISTIC_* impls, from `engine/backends.resolve_impl(..., deterministic=True)`)
keeps a sequence's output bitwise the same in any batch, at any row and under any page width: the
jnp paths become `attention_over_page_blocks`, and the kernel runs its fixed-split config.

A quantized pool (int8 or fp8 codes with per-token scales, kv_pool.py) is dequantized on read by the jnp
paths; the kernel takes the codes and the scales as they are.

Masking is causal by position: key slot s is visible to a query at position p iff s <= p, and with a
sliding window W (`window`, an int32 scalar, traced or not: one per layer inside the layer scan) also
iff s > p - W (Hugging Face transformers' rule, masking_utils.sliding_window_overlay: W keys, the query's
own included). `window=None` is plain causal. A packed row
(PageMeta with page_positions, page_segments and token_segments) holds several sequences: a key is
visible iff it belongs to the query's sequence and its position is <= the query's (`key_layout`). Masked
scores take a large finite negative value, never -inf, so rows with nothing visible stay finite.

Soft-capping (`softcap`, a static float per model: Gemma 2's attn_logit_softcapping) turns each scaled
score s into cap * tanh(s / cap) before the mask, as transformers' Gemma 2 eager attention does; every
path here and both kernels apply it, so masked scores stay MASK_VALUE.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxinfer.model import kv_pool as kvp
from kernels_cpu import paged_attention as cpu_kernel

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


DETERMINISTIC_IMPL = "deterministic"  # deterministic mode, jnp only: attention_over_page_blocks
DETERMINISTIC_PALLAS_IMPL = "deterministic_pallas"  # ... with the kernel's deterministic config in decode
_KERNEL_IMPLS = ("pallas", DETERMINISTIC_PALLAS_IMPL)
CPU_IMPL = "cpu"  # kernels_cpu/paged_attention: every step on a CPU, prefill and decode
_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def attention_reference(
    q: Float[Array, "B T H K"],
    keys: Float[Array, "B S G K"],
    values: Float[Array, "B S G K"],
    q_positions: Int[Array, "B T"],
    k_positions: Int[Array, "#B S"],
    window: Int[Array, ""] | int | None = None,
    softcap: float | None = None,
) -> Float[Array, "B T H K"]:
    """Causal grouped-query attention; f32 scores and softmax, output in q's dtype.

    `k_positions` may be [1, S], shared by every row (a dense slab, whose slot s is position s).
    `window`: None (causal), or the sliding window W (a key is visible iff q - W < k <= q)."""
    b, t, h, k = q.shape
    g = keys.shape[2]
    grouped = q.reshape(b, t, g, h // g, k)  # [B, T, G, Q, K]
    scores = jnp.einsum("btgqk,bsgk->bgqts", grouped, keys, preferred_element_type=jnp.float32)
    scores = cap_scores(scores * (k**-0.5), softcap)
    visible = in_window(k_positions[:, None, :], q_positions[:, :, None], window)  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, MASK_VALUE)  # [B, G, Q, T, S]
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bgqts,bsgk->btgqk", probs, values.astype(jnp.float32))  # [B, T, G, Q, K]
    return out.reshape(b, t, h, k).astype(q.dtype)


def cap_scores(scores: Float[Array, "..."], softcap: float | None) -> Float[Array, "..."]:
    """Scaled scores soft-capped: cap * tanh(scores / cap), or as they are without a cap."""
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def in_window(key_positions: Int[Array, "..."], query_positions: Int[Array, "..."], window: Int[Array, ""] | int | None) -> jax.Array:
    """bool (broadcast shape): key visible to query, causal and, with a window W, within the last W
    positions: q - W < k <= q. The one visibility rule of the jnp paths."""
    visible = key_positions <= query_positions
    if window is not None:
        visible &= query_positions - key_positions < jnp.asarray(window, jnp.int32)  # k > q - W, as a difference (no wrap)
    return visible


def attend(
    cache: kvp.DenseKVCache | kvp.KVPool | None,
    layer: Int[Array, ""],
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T G K"],
    v: Float[Array, "B T G K"],
    positions: Int[Array, "B T"],
    pages: kvp.PageMeta | None = None,
    impl: str = "reference",
    window: Int[Array, ""] | int | None = None,
    softcap: float | None = None,
) -> tuple[Float[Array, "B T H K"], kvp.DenseKVCache | kvp.KVPool | None]:
    """Write k, v for `layer` into `cache`, then attend. Returns (output, updated cache).

    `window`: None (causal attention over everything written), or this layer's sliding window W, an
    int32 scalar that may be traced: a key at position p is visible to a query at t iff t - W < p <= t.
    `softcap`: None, or the model's attention soft-cap (a static float): scores = cap * tanh(scores / cap).
    Pages wholly before the window may have been handed back to the pool (the host keeps the null
    page in their table entries); they are masked here, so what they hold is never read into a result."""
    if cache is None:
        return attention_reference(q, k, v, positions, positions, window, softcap), None
    if isinstance(cache, kvp.DenseKVCache):
        cache = kvp.write_dense(cache, layer, k, v, positions)
        return _attend_slots(q, cache.k[layer], cache.v[layer], positions, window, softcap), cache
    if pages is None:
        raise ValueError("a paged KV pool needs PageMeta (block tables and slot mapping)")
    cache = kvp.write_paged(cache, layer, k, v, pages)
    deterministic = impl in (DETERMINISTIC_IMPL, DETERMINISTIC_PALLAS_IMPL)
    if impl == CPU_IMPL:
        return _attend_cpu(q, cache, layer, positions, pages, window, softcap), cache
    if _use_kernel(impl, q):
        return _attend_pallas(q, cache, layer, positions, pages, window, softcap, deterministic=deterministic), cache
    k_pages, v_pages = kvp.gather_pages(cache, layer, pages.block_tables, dtype=q.dtype)  # dequantized if quantized
    over_pages = attention_over_page_blocks if deterministic else attention_over_pages
    return over_pages(q, k_pages, v_pages, positions, key_layout(pages, cache.page_size), window, softcap), cache


class KeyLayout(NamedTuple):
    """Position [#B, S] and, in a packed row, sequence [B, S] of every key slot, and each query's
    sequence [B, T] (None when every row is one sequence)."""

    positions: Int[Array, "#B S"]
    segments: Int[Array, "B S"] | None = None
    query_segments: Int[Array, "B T"] | None = None


def key_layout(pages: kvp.PageMeta, page_size: int) -> KeyLayout:
    """Slot p * L + l of a row's table holds position page_positions[p] + l of sequence page_segments[p];
    without them (one sequence per row) it holds position p * L + l."""
    b, p = pages.block_tables.shape
    offsets = jnp.arange(page_size, dtype=jnp.int32)
    if pages.page_positions is None:
        return KeyLayout(jnp.arange(p * page_size, dtype=jnp.int32)[None])
    positions = (pages.page_positions[:, :, None] + offsets).reshape(b, p * page_size)
    segments = jnp.repeat(pages.page_segments, page_size, axis=1)  # [B, S]
    return KeyLayout(positions, segments, pages.token_segments)


def _visible(layout: KeyLayout, q_positions: Int[Array, "B T"], start: int | jax.Array = 0, size: int | None = None, window=None) -> jax.Array:
    """bool[B, T, S] (or the slots [start, start + size)): which keys each query sees (`in_window`)."""
    positions, segments = layout.positions, layout.segments
    if size is not None:
        positions = jax.lax.dynamic_slice_in_dim(positions, start, size, axis=1)
        segments = None if segments is None else jax.lax.dynamic_slice_in_dim(segments, start, size, axis=1)
    visible = in_window(positions[:, None, :], q_positions[:, :, None], window)
    if segments is not None:
        visible &= segments[:, None, :] == layout.query_segments[:, :, None]
    return visible


def attention_over_pages(
    q: Float[Array, "B T H K"],
    k_pages: Float[Array, "G B P K L"],
    v_pages: Float[Array, "G B P L K"],
    q_positions: Int[Array, "B T"],
    layout: KeyLayout | None = None,
    window: Int[Array, ""] | int | None = None,
    softcap: float | None = None,
) -> Float[Array, "B T H K"]:
    """Causal (and, with `window`, sliding-window) GQA attention straight over gathered pages in the pool's layout; slot p * L + l holds
    position p * L + l, or what `layout` says (a packed row). f32 scores and softmax, output in q's dtype.

    The scores of several query tokens (prefill) are kept keys-major, [B, G, S, T, Q], with the softmax
    over S: that is the layout XLA:CPU's dot (YNNPACK) returns them in, so no [T, S]-sized transpose
    runs before the mask and softmax (it took ~45% of a packed 512-token step's attention, measured in
    experiments/profile_steps.py). A single query token (decode) keeps [B, G, Q, T, S], faster there."""
    b, t, h, k = q.shape
    g, _, p, _, l = k_pages.shape
    grouped = q.reshape(b, t, g, h // g, k)  # [B, T, G, Q, K]
    layout = layout or KeyLayout(jnp.arange(p * l, dtype=jnp.int32)[None])
    visible = _visible(layout, q_positions, window=window)  # [B, T, S]
    values = v_pages.reshape(g, b, p * l, k).astype(jnp.float32)  # [G, B, S, K]
    if t == 1:
        scores = jnp.einsum("btgqk,gbpkl->bgqtpl", grouped, k_pages, preferred_element_type=jnp.float32)
        scores = cap_scores(scores.reshape(b, g, h // g, t, p * l) * (k**-0.5), softcap)  # [B, G, Q, T, S]
        probs = jax.nn.softmax(jnp.where(visible[:, None, None], scores, MASK_VALUE), axis=-1)
        out = jnp.einsum("bgqts,gbsk->btgqk", probs, values)  # [B, T, G, Q, K]
    else:
        scores = jnp.einsum("gbpkl,btgqk->bgpltq", k_pages, grouped, preferred_element_type=jnp.float32)
        scores = cap_scores(scores.reshape(b, g, p * l, t, h // g) * (k**-0.5), softcap)  # [B, G, S, T, Q]
        probs = jax.nn.softmax(jnp.where(visible.transpose(0, 2, 1)[:, None, :, :, None], scores, MASK_VALUE), axis=2)
        out = jnp.einsum("bgstq,gbsk->btgqk", probs, values)  # [B, T, G, Q, K]
    return out.reshape(b, t, h, k).astype(q.dtype)


PAGES_PER_BLOCK = 8  # pages per online-softmax block of attention_over_page_blocks


def attention_over_page_blocks(
    q: Float[Array, "B T H K"],
    k_pages: Float[Array, "G B P K L"],
    v_pages: Float[Array, "G B P L K"],
    q_positions: Int[Array, "B T"],
    layout: KeyLayout | None = None,
    window: Int[Array, ""] | int | None = None,
    softcap: float | None = None,
) -> Float[Array, "B T H K"]:
    """attention_over_pages as an online softmax over fixed blocks of pages, in order (a lax.scan).

    Every block has the same shape, and a block wholly past a query's position changes nothing, bit for
    bit: its scores are MASK_VALUE, so the running max stays, the rescale is exp(0) = 1 and it adds exact
    zeros. So a query's output does not depend on how many pages the step's table holds, which lets
    deterministic mode keep bucketed page widths. With a window, blocks wholly before it come first and
    are all MASK_VALUE too: they add garbage only while the running max is MASK_VALUE, and the first
    visible block rescales it by exp(MASK_VALUE - max) = 0 exactly. P must be a multiple of the block (or smaller than it).
    """
    b, t, h, k = q.shape
    g, _, p, _, l = k_pages.shape
    block = min(PAGES_PER_BLOCK, p)
    grouped = q.reshape(b, t, g, h // g, k).astype(jnp.float32) * (k**-0.5)  # [B, T, G, Q, K]
    k_blocks = k_pages.reshape(g, b, p // block, block, k, l).transpose(2, 0, 1, 3, 4, 5)  # [N, G, B, p, K, L]
    v_blocks = v_pages.reshape(g, b, p // block, block, l, k).transpose(2, 0, 1, 3, 4, 5)  # [N, G, B, p, L, K]
    layout = layout or KeyLayout(jnp.arange(p * l, dtype=jnp.int32)[None])

    def step(carry, xs):
        m, denom, acc = carry  # [B, G, Q, T], [B, G, Q, T], [B, G, Q, T, K]
        index, kb, vb = xs
        scores = jnp.einsum("btgqk,gbpkl->bgqtpl", grouped, kb, preferred_element_type=jnp.float32).reshape(b, g, h // g, t, block * l)
        visible = _visible(layout, q_positions, index * block * l, block * l, window)  # [B, T, S_block]
        scores = jnp.where(visible[:, None, None], cap_scores(scores, softcap), MASK_VALUE)
        m_new = jnp.maximum(m, scores.max(axis=-1))
        scale, probs = jnp.exp(m - m_new), jnp.exp(scores - m_new[..., None])
        values = vb.reshape(g, b, block * l, k).astype(jnp.float32)  # [G, B, S_block, K]
        acc = acc * scale[..., None] + jnp.einsum("bgqts,gbsk->bgqtk", probs, values)
        return (m_new, denom * scale + probs.sum(axis=-1), acc), None

    init = (jnp.full((b, g, h // g, t), MASK_VALUE, jnp.float32), jnp.zeros((b, g, h // g, t), jnp.float32), jnp.zeros((b, g, h // g, t, k), jnp.float32))
    (_, denom, acc), _ = jax.lax.scan(step, init, (jnp.arange(p // block, dtype=jnp.int32), k_blocks, v_blocks))
    out = acc / denom[..., None]  # [B, G, Q, T, K]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, k).astype(q.dtype)


def _use_kernel(impl: str, q: jax.Array) -> bool:
    """The kernel serves single-token decode in 16-bit dtypes (in deterministic mode too: prefill stays
    on attention_over_page_blocks). `impl` is resolved already (backends.resolve_impl refuses f32 for 'pallas'
    when it knows the dtype; the kernel's tensor-core matmuls would round f32 to tf32); a 'pallas' that
    reaches an f32 model here refuses too."""
    if impl not in _KERNEL_IMPLS or q.shape[1] != 1:
        return False
    if q.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"the Pallas decode kernel needs bfloat16 or float16, got {q.dtype}; use dtype='bfloat16' or attention_impl='reference'")
    return True


def _attend_slots(q, keys, values, positions, window=None, softcap=None):
    """Attention over slabs whose slot index equals the token position."""
    slots = jnp.arange(keys.shape[1], dtype=jnp.int32)[None, :]  # [1, S]
    return attention_reference(q, keys, values, positions, slots, window, softcap)


def _attend_cpu(q, pool, layer, positions, pages, window=None, softcap=None):
    """Any step through the CPU kernel, which reads the pool in place (packed rows too)."""
    out = cpu_kernel.paged_attention(
        q, pool.k, pool.v, layer, pages.block_tables, positions, pages.page_positions, pages.page_segments, pages.token_segments,
        window=window, softcap=softcap,
    )
    return out.astype(q.dtype)


def _attend_pallas(q, pool, layer, positions, pages, window=None, softcap=None, *, deterministic: bool):
    """Single-token decode through the Mosaic GPU kernel; lengths count the token just written. The kernel
    gets the whole pool and the layer index and reads the layer's pages in place, as the CPU kernel does
    (a `pool.k[layer]` slice may be copied every layer of every step); under tensor parallelism
    `sharding.on_local_heads` hands each device its own kv heads of the whole pool, in place too. In
    deterministic mode the kernel's splits have a fixed size (its tuned split count follows the batch)."""
    from jaxinfer.model import sharding
    from kernels_pallas import paged_attention as kernel  # GPU only; keeps CPU imports light

    config = None  # the tuned table's, for this batch and page width
    if deterministic:
        group_size = q.shape[2] // pool.k.shape[1]  # pool.k: [layers, G, P, K, L]
        config = kernel.deterministic_config(q.shape[-1], pool.page_size, group_size)
    scales = dict(k_scales=pool.k_scale, v_scales=pool.v_scale) if pool.quantized else {}
    out = sharding.on_local_heads(  # under tensor parallelism, a shard_map over each device's heads
        functools.partial(kernel.paged_attention, config=config, **_given(window=window, softcap=softcap)), q[:, 0], pool.k, pool.v, pages.block_tables,
        positions[:, 0] + 1, layer=layer, **scales,
    )  # [B, H, K]  (a traced window is closed over: replicated, as the layer index is)
    return out[:, None]


def _given(**kwargs) -> dict:
    """The keyword arguments that are not None (the kernel's defaults stand for the rest)."""
    return {name: value for name, value in kwargs.items() if value is not None}
