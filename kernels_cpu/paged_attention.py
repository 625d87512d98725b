"""Paged attention on the CPU: a C++ XLA FFI kernel (paged_attention.cc) and its jitted call.

The jnp path (jaxinfer/attention.py) gathers every page of a step into a new array and transposes it for
XLA:CPU's dot; this kernel reads the pages where they lie, in the pool's layout, with an online softmax
per query, and skips the pages a query cannot see (later positions, other sequences of a packed row).
The math is jaxinfer.model.attention.attention_over_pages, which stays the reference.

Built on first use (kernels_cpu/build.py). Without a compiler, `available()` is False and the engine
keeps the jnp path.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels_cpu import build

SOURCE = "paged_attention.cc"
TARGET = "jaxinfer_paged_attention_cpu_f32"


def available() -> bool:
    """Build (once per machine and source) and register the kernel; False, with a warning, if it cannot."""
    return build.load(SOURCE, ((TARGET, "JaxinferPagedAttentionF32"),))


def paged_attention(
    q: Float[Array, "B T H K"],
    k_pool: Float[Array, "N G P K L"],
    v_pool: Float[Array, "N G P L K"],
    layer: Int[Array, ""],
    block_tables: Int[Array, "B M"],
    q_positions: Int[Array, "B T"],
    page_positions: Int[Array, "B M"] | None = None,
    page_segments: Int[Array, "B M"] | None = None,
    token_segments: Int[Array, "B T"] | None = None,
) -> Float[Array, "B T H K"]:
    """Causal GQA attention of `q` over `layer` of the pool, through each row's block table; f32 only.

    Without page_positions (one sequence per row), entry m of a table starts at position m * L. A query
    that sees no key (a padding lane) gets zeros."""
    if not available():
        raise RuntimeError("the CPU paged-attention kernel could not be built; see the warning above")
    b, m = block_tables.shape
    page_size = k_pool.shape[-1]
    if page_positions is None:
        page_positions = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32) * page_size, (b, m))
        page_segments = jnp.zeros((b, m), jnp.int32)
        token_segments = jnp.zeros(q_positions.shape, jnp.int32)
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q.astype(jnp.float32), k_pool, v_pool, i32(layer), i32(block_tables), i32(page_positions), i32(page_segments),
        i32(q_positions), i32(token_segments),
    )
