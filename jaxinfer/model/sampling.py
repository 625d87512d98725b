"""Per-request sampling from arrays, so request parameters never cause a compile.

Each row carries its own temperature, top-k, top-p, seed and step counter. The random key of a row is
derived from (seed, step) only, so a seeded request draws the same tokens whatever else is in the batch.
Greedy rows (temperature 0) take the argmax. When no row samples, a `lax.cond` skips the sort.

Before sampling, `process` changes the logits as vLLM defines it, in this order: the sparse bias
(logit_bias), the repetition penalty (over prompt and output
tokens: a positive logit is divided by it, a negative one multiplied), then the frequency and presence
penalties (over output tokens: minus penalty x count, minus penalty if present). Temperature, then
min_p, top-k and top-p cut the distribution the draw uses. Each stage is skipped by a `lax.cond` when no
row uses it, so a step without them computes exactly what it did before they existed.

Log-probabilities (`top_logprobs`) come from the raw logits, or in "processed" mode from the logits after
the bias, the penalties and the temperature (before the top-k/top-p/min_p cuts), as vLLM's logprobs_mode.

The arrays are packed on the host by the one per-row packer, scheduling/plan.py's `place_sampling` (the
engine through StepPlan, the reference generator through `pack_sampling`). This module imports only jax
and jaxtyping: never scheduling/ or engine/.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

_MIN_TEMPERATURE = 1e-5


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    temperature: jax.Array  # f32[B]; 0 = greedy
    top_k: jax.Array  # i32[B]; 0 = off
    top_p: jax.Array  # f32[B]; 1 = off
    seed: jax.Array  # i32[B]
    step: jax.Array  # i32[B]; index of the token being drawn (0 for the first generated token)
    # The logit processing of `process` (None: none, as the benchmarks pack them).
    min_p: jax.Array | None = None  # f32[B]; 0 = off
    presence: jax.Array | None = None  # f32[B]
    frequency: jax.Array | None = None  # f32[B]
    repetition: jax.Array | None = None  # f32[B]; 1 = off
    bias_ids: jax.Array | None = None  # i32[B, NB]; padding entries are token 0 with bias 0
    bias_values: jax.Array | None = None  # f32[B, NB]
    num_logprobs: jax.Array | None = None  # i32[B]; -1: no log-probabilities wanted
    token_mask: jax.Array | None = None  # i32[B, ceil(V / 32)]; bit t % 32 of word t // 32: token t allowed (all ones: free)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Logprobs:
    """Per sampled row: the drawn token's log-probability and the top K (ids by decreasing log-probability)."""

    token: jax.Array  # f32[B]
    top_ids: jax.Array  # i32[B, K]
    top: jax.Array  # f32[B, K]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenCounts:
    """What each row has seen so far: how often each token was generated, and which the prompt holds."""

    output: jax.Array  # i32[B, V]
    in_prompt: jax.Array  # bool[B, V]


def argmax(x: Float[Array, "B V"]) -> Int[Array, "B"]:
    """`jnp.argmax(x, axis=-1)` exactly (the first maximum; the first NaN if a row has one), as a max and a
    min: XLA:CPU runs argmax's (value, index) reduce as a scalar loop, 5x slower at [32, 49152]."""
    top = x.max(axis=-1, keepdims=True)  # NaN if the row has a NaN
    hit = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)


def _scaled(logits: Float[Array, "B V"], s: SamplingArrays) -> Float[Array, "B V"]:
    return logits / jnp.maximum(s.temperature, _MIN_TEMPERATURE)[:, None]


def _sample_rows(logits: Float[Array, "B V"], s: SamplingArrays) -> Int[Array, "B"]:
    scaled = _scaled(logits, s)
    order = jnp.argsort(-scaled, axis=-1)  # [B, V] token ids by decreasing logit
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(logits.shape[-1])[None, :]
    in_top_k = (s.top_k[:, None] <= 0) | (rank < s.top_k[:, None])
    if s.min_p is not None:  # p >= min_p * p_max, in logits: scaled >= max + log(min_p) (-inf when off)
        in_top_k &= sorted_logits >= sorted_logits[:, :1] + jnp.log(s.min_p)[:, None]
    sorted_logits = jnp.where(in_top_k, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
    in_top_p = (jnp.cumsum(probs, axis=-1) - probs) < s.top_p[:, None]
    kept = jnp.where(in_top_p & in_top_k, sorted_logits, -jnp.inf)
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(s.seed, s.step)
    noise = jax.vmap(lambda key: jax.random.gumbel(key, (logits.shape[-1],)))(keys)  # [B, V]
    choice = argmax(kept + noise)  # Gumbel-max draws from softmax(kept)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]


def process(logits: Float[Array, "B V"], s: SamplingArrays, counts: Callable[[], TokenCounts]) -> Float[Array, "B V"]:
    """The logits the draw uses: the grammar's mask, the bias, then the repetition, frequency and presence
    penalties (module docstring). `counts()` builds the rows' token counts; it runs only when some row has a penalty."""
    return apply_mask(adjust(logits, s, counts), s.token_mask)


def adjust(logits: Float[Array, "B V"], s: SamplingArrays, counts: Callable[[], TokenCounts]) -> Float[Array, "B V"]:
    """`process` but the grammar's mask: the bias, then the penalties. Each maps -inf to -inf, token by token,
    so masking before or after them gives the same logits bit for bit (the engine masks after, see `draw`)."""
    rows = jnp.arange(logits.shape[0])[:, None]
    biased = jnp.any(s.bias_values != 0)
    logits = jax.lax.cond(biased, lambda l: l.at[rows, s.bias_ids].add(s.bias_values), lambda l: l, logits)
    penalized = jnp.any(s.repetition != 1) | jnp.any(s.frequency != 0) | jnp.any(s.presence != 0)
    return jax.lax.cond(penalized, lambda l: _penalize(l, s, counts()), lambda l: l, logits)


def apply_mask(logits: Float[Array, "B V"], token_mask: Int[Array, "B W"] | None) -> Float[Array, "B V"]:
    """The token mask (None: none): a grammar's, allowed_token_ids, bad_words and min_tokens' bans on EOS and
    the stop ids, under a `lax.cond` taken only when some row is constrained."""
    if token_mask is None:
        return logits
    return jax.lax.cond(jnp.any(token_mask != -1), lambda l: _mask(l, token_mask), lambda l: l, logits)


def _mask(logits: Float[Array, "B V"], words: Int[Array, "B W"]) -> Float[Array, "B V"]:
    """-inf where a row's mask forbids the token (guided.fill_mask)."""
    token = jnp.arange(logits.shape[1])
    allowed = (words[:, token // 32] >> (token % 32)) & 1  # [B, V]; arithmetic shift, then the low bit
    return jnp.where(allowed == 1, logits, -jnp.inf)


def _penalize(logits: Float[Array, "B V"], s: SamplingArrays, counts: TokenCounts) -> Float[Array, "B V"]:
    seen = (counts.output > 0) | counts.in_prompt
    repetition = s.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
    output = counts.output.astype(jnp.float32)
    return logits - s.frequency[:, None] * output - s.presence[:, None] * (output > 0)


def top_logprobs(logits: Float[Array, "B V"], tokens: Int[Array, "B"], k: int) -> Logprobs:
    """log_softmax of the rows: the tokens' entries and the top k."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top, top_ids = jax.lax.top_k(logprobs, k)
    return Logprobs(jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top)


def sample(logits: Float[Array, "B V"], s: SamplingArrays, counts: Callable[[], TokenCounts], *, num_top: int, mode: str) -> tuple[Int[Array, "B"], Logprobs]:
    """The engine's draw: processed logits (`process`), one token per row (`next_tokens`), and its
    log-probabilities with the top `num_top` (zeros when no row asks for them)."""
    raw = logits.astype(jnp.float32)
    return draw(raw, adjust(raw, s, counts), s, num_top=num_top, mode=mode)


def draw(raw: Float[Array, "B V"] | None, adjusted: Float[Array, "B V"], s: SamplingArrays, *, num_top: int, mode: str) -> tuple[Int[Array, "B"], Logprobs]:
    """`sample` from the logits `adjust` made: the grammar's mask, the token, its log-probabilities (from
    `raw`, f32, in "raw" mode; unused otherwise, so it may be None). The engine's second program of a step:
    the mask is the one input the host computes while the device runs the forward."""
    processed = apply_mask(adjusted, s.token_mask)
    tokens = next_tokens(processed, s)

    def wanted():
        source = raw if mode == "raw" else jnp.where(s.temperature[:, None] > 0, _scaled(processed, s), processed)
        return top_logprobs(source, tokens, num_top)

    def empty():
        zeros = lambda dtype, *shape: jnp.zeros((*tokens.shape, *shape), dtype)  # noqa: E731
        return Logprobs(zeros(jnp.float32), zeros(jnp.int32, num_top), zeros(jnp.float32, num_top))

    return tokens, jax.lax.cond(jnp.any(s.num_logprobs >= 0), wanted, empty)


def next_tokens(logits: Float[Array, "B V"], s: SamplingArrays) -> Int[Array, "B"]:
    """One token per row: argmax where temperature is 0, a seeded draw elsewhere."""
    logits = logits.astype(jnp.float32)
    greedy = argmax(logits)
    any_sampled = jnp.any(s.temperature > 0)
    sampled = jax.lax.cond(any_sampled, _sample_rows, lambda l, _: greedy, logits, s).astype(jnp.int32)
    return jnp.where(s.temperature > 0, sampled, greedy)
