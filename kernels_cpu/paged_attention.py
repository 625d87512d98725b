"""Paged attention on the CPU: a C++ XLA FFI kernel (paged_attention.cc), its jitted call and its jnp reference.

The jnp path of the engine (jaxinfer/model/attention.py) gathers every page of a step into a new array and
transposes it for XLA:CPU's dot; this kernel reads the pages where they lie, in the pool's layout, with an
online softmax per query, and skips the pages a query cannot see (later positions, other sequences of a
packed row, pages wholly before a sliding window); with `softcap` (Gemma 2) each scaled score s becomes
cap * tanh(s / cap) before the mask. `reference` is the same visibility rule and softmax in plain jnp, with the same signature:
the oracle the kernel is tested against. The kernel checks every page id of the block tables (an id
outside [0, P) is an error naming it); the reference, like any jnp gather, would clamp it silently.

Built on first use (kernels_cpu/build.py). Without a compiler, `available()` is False and the engine
keeps the jnp path. Axis letters: the table in kernels_cpu/__init__.py. Imports jax only.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kernels_cpu import build

SOURCE = "paged_attention.cc"
TARGET = "jaxinfer_paged_attention_cpu_f32"


def available() -> bool:
    """Build (once per machine and source) and register the kernel; False, with a warning, if it cannot."""
    return build.load(SOURCE, ((TARGET, "JaxinferPagedAttentionF32"),))


def _row_layout(block_tables, q_positions, page_size, page_positions, page_segments, token_segments):
    """The packed-row arrays, defaulted for one sequence per row: entry e of a table starts at e * L."""
    if page_positions is not None:
        return page_positions, page_segments, token_segments
    b, e = block_tables.shape
    page_positions = jnp.broadcast_to(jnp.arange(e, dtype=jnp.int32) * page_size, (b, e))
    return page_positions, jnp.zeros((b, e), jnp.int32), jnp.zeros(q_positions.shape, jnp.int32)


def paged_attention(
    q: Float[Array, "B T H K"],
    k_pool: Float[Array, "N G P K L"],
    v_pool: Float[Array, "N G P L K"],
    layer: Int[Array, ""],
    block_tables: Int[Array, "B E"],
    q_positions: Int[Array, "B T"],
    page_positions: Int[Array, "B E"] | None = None,
    page_segments: Int[Array, "B E"] | None = None,
    token_segments: Int[Array, "B T"] | None = None,
    *,
    window: Int[Array, ""] | int | None = None,
    softcap: float | None = None,
) -> Float[Array, "B T H K"]:
    """Causal GQA attention of `q` over `layer` of the pool, through each row's block table; f32 only.

    Without page_positions (one sequence per row), entry e of a table starts at position e * L. With a
    sliding `window` W (an int32 scalar >= 1, traced or not), a query at t sees only positions in
    (t - W, t]; pages wholly before that are not read (they may be the null page). A query
    that sees no key (a padding lane) gets zeros. `softcap` (a static float > 0, or None): scaled scores
    s become softcap * tanh(s / softcap) (a kernel attribute). Every page id must lie in [0, P): otherwise the call
    fails (an XLA runtime error naming the id, its row and entry, and P) and reads nothing."""
    if not available():
        raise RuntimeError("the CPU paged-attention kernel could not be built; see the warning above")
    page_positions, page_segments, token_segments = _row_layout(block_tables, q_positions, k_pool.shape[-1], page_positions, page_segments, token_segments)
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q.astype(jnp.float32), k_pool, v_pool, i32(layer), i32(block_tables), i32(page_positions), i32(page_segments),
        i32(q_positions), i32(token_segments), _window_array(window), softcap=np.float32(_check_softcap(softcap) or 0.0),
    )


def _check_softcap(softcap: float | None) -> float | None:
    """The soft-cap as a float, or None; a ValueError naming it unless finite and > 0."""
    if softcap is not None and not (np.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a finite float > 0 or None, got {softcap!r}")
    return None if softcap is None else float(softcap)


NO_WINDOW = 2**31 - 1  # the kernel's window when there is none


def _window_array(window) -> jax.Array:
    """int32[] window for the kernel: NO_WINDOW for None."""
    return jnp.asarray(NO_WINDOW if window is None else window, jnp.int32)


def reference(
    q: Float[Array, "B T H K"],
    k_pool: Float[Array, "N G P K L"],
    v_pool: Float[Array, "N G P L K"],
    layer: Int[Array, ""],
    block_tables: Int[Array, "B E"],
    q_positions: Int[Array, "B T"],
    page_positions: Int[Array, "B E"] | None = None,
    page_segments: Int[Array, "B E"] | None = None,
    token_segments: Int[Array, "B T"] | None = None,
    *,
    window: Int[Array, ""] | int | None = None,
    softcap: float | None = None,
) -> Float[Array, "B T H K"]:
    """`paged_attention` in jnp: the same arguments, visibility rule and result, with f32 scores and a
    plain (not online) softmax. Slot l of entry e is visible to query t iff page_segments[e] ==
    token_segments[t] and q_positions[t] - window < page_positions[e] + l <= q_positions[t] (no lower
    bound without a window); a query that sees nothing gets zeros. With `softcap`, the scaled scores
    are softcap * tanh(scores / softcap).
    Page ids are assumed in [0, P) (jnp clamps an id outside; the kernel refuses it)."""
    b, t, h, k = q.shape
    g, page_size = k_pool.shape[1], k_pool.shape[-1]
    page_positions, page_segments, token_segments = _row_layout(block_tables, q_positions, page_size, page_positions, page_segments, token_segments)
    keys = k_pool[layer][:, block_tables].astype(jnp.float32)  # [G, B, E, K, L]
    values = v_pool[layer][:, block_tables].astype(jnp.float32)  # [G, B, E, L, K]
    slot_positions = (page_positions[..., None] + jnp.arange(page_size, dtype=jnp.int32)).reshape(b, -1)  # [B, S], S = E L
    slot_segments = jnp.repeat(page_segments, page_size, axis=1)  # [B, S]
    visible = (slot_segments[:, None, :] == token_segments[..., None]) & (slot_positions[:, None, :] <= q_positions[..., None])  # [B, T, S]
    visible &= q_positions[..., None] - slot_positions[:, None, :] < _window_array(window)  # q - W < p, as a difference (no wrap)
    grouped = q.astype(jnp.float32).reshape(b, t, g, h // g, k)  # [B, T, G, Q, K]
    scores = jnp.einsum("btgqk,gbekl->btgqel", grouped, keys, precision="highest").reshape(b, t, g, h // g, -1) * k**-0.5  # [B, T, G, Q, S]
    softcap = _check_softcap(softcap)
    scores = scores if softcap is None else softcap * jnp.tanh(scores / softcap)
    mask = visible[:, :, None, None, :]
    top = jnp.max(jnp.where(mask, scores, -jnp.inf), axis=-1, keepdims=True)
    weights = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)  # [B, T, G, Q, S]
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(total > 0, total, 1.0)  # all zeros where nothing is visible
    out = jnp.einsum("btgqs,gbsk->btgqk", probs, values.reshape(g, b, -1, k), precision="highest")  # [B, T, G, Q, K]
    return out.reshape(b, t, h, k)
