"""Per-request sampling from arrays, so request parameters never cause a compile.

Each row carries its own temperature, top-k, top-p, seed and step counter. The random key of a row is
derived from (seed, step) only, so a seeded request draws the same tokens whatever else is in the batch.
Greedy rows (temperature 0) take the argmax. When no row samples, a `lax.cond` skips the sort.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxinfer.request import SamplingParams

_MIN_TEMPERATURE = 1e-5


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    temperature: jax.Array  # f32[B]; 0 = greedy
    top_k: jax.Array  # i32[B]; 0 = off
    top_p: jax.Array  # f32[B]; 1 = off
    seed: jax.Array  # i32[B]
    step: jax.Array  # i32[B]; index of the token being drawn (0 for the first generated token)


def pack(params: list[SamplingParams], seeds: np.ndarray, steps: np.ndarray) -> SamplingArrays:
    """Host-side packing of per-request parameters into numpy arrays (one row each)."""
    return SamplingArrays(
        temperature=np.array([p.temperature for p in params], np.float32),
        top_k=np.array([p.top_k for p in params], np.int32),
        top_p=np.array([p.top_p for p in params], np.float32),
        seed=np.asarray(seeds, np.int32),
        step=np.asarray(steps, np.int32),
    )


def argmax(x: Float[Array, "B V"]) -> Int[Array, "B"]:
    """`jnp.argmax(x, axis=-1)` exactly (the first maximum; the first NaN if a row has one), as a max and a
    min: XLA:CPU runs argmax's (value, index) reduce as a scalar loop, 5x slower at [32, 49152]."""
    top = x.max(axis=-1, keepdims=True)  # NaN if the row has a NaN
    hit = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)


def _sample_rows(logits: Float[Array, "B V"], s: SamplingArrays) -> Int[Array, "B"]:
    scaled = logits / jnp.maximum(s.temperature, _MIN_TEMPERATURE)[:, None]
    order = jnp.argsort(-scaled, axis=-1)  # [B, V] token ids by decreasing logit
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(logits.shape[-1])[None, :]
    in_top_k = (s.top_k[:, None] <= 0) | (rank < s.top_k[:, None])
    sorted_logits = jnp.where(in_top_k, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
    in_top_p = (jnp.cumsum(probs, axis=-1) - probs) < s.top_p[:, None]
    kept = jnp.where(in_top_p & in_top_k, sorted_logits, -jnp.inf)
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(s.seed, s.step)
    noise = jax.vmap(lambda key: jax.random.gumbel(key, (logits.shape[-1],)))(keys)  # [B, V]
    choice = argmax(kept + noise)  # Gumbel-max draws from softmax(kept)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]


def next_tokens(logits: Float[Array, "B V"], s: SamplingArrays) -> Int[Array, "B"]:
    """One token per row: argmax where temperature is 0, a seeded draw elsewhere."""
    logits = logits.astype(jnp.float32)
    greedy = argmax(logits)
    any_sampled = jnp.any(s.temperature > 0)
    sampled = jax.lax.cond(any_sampled, _sample_rows, lambda l, _: greedy, logits, s).astype(jnp.int32)
    return jnp.where(s.temperature > 0, sampled, greedy)
