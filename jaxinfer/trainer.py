"""`logprobs(params, tokens, cfg)`: each next token's log-probability, as a pure function a trainer can jit
and differentiate, equal bit for bit to what a deterministic engine reports for the tokens it sampled.

Why it mirrors the engine's program shapes instead of running one full-sequence forward: on XLA:CPU a
matmul row's bits depend on how many rows the dot has (measured: 1, 37, 64 and 128 rows round a row
differently from 8), so a token's logits depend on the program that computed it. Deterministic mode fixes
those programs (bucket_tables.py): a prompt goes through prefill chunks of `chunk_tokens` tokens in one
row, every later token through decode programs of `decode_rows` rows, one token per row, and attention
is `attention_over_page_blocks` (KV blocks of PAGES_PER_BLOCK pages, in position order, an online
softmax in f32). A row's result does not depend on the other rows, its position in the chunk, the page
width or which pages hold it (tests/engine/test_deterministic.py). So this function computes the prompt
in chunks from position 0 and each later token alone in row 0 of a `decode_rows`-row step, through the
same `forward.hidden_states` over a small paged pool of its own, the same logits and the same
`log_softmax`: the same arithmetic as the engine, whatever batch, chunking or prefix cache the engine had.

Owns: `StepShapes` (the deterministic programs' shapes) and `logprobs`. Imports model/ and the host-only
bucket tables; nothing imports it but the package's `__init__`.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.model import forward as model
from jaxinfer.model import kv_pool as kvp
from jaxinfer.model.attention import DETERMINISTIC_IMPL, PAGES_PER_BLOCK
from jaxinfer.model.params import Params

NULL_PAGE = 0  # the pool's reserved page: padding lanes write and read it


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepShapes:
    """The program shapes a deterministic engine computes a sequence with."""

    page_size: int = 64  # tokens per KV page (EngineConfig.page_size)
    chunk_tokens: int = 64  # tokens of every prefill chunk, one sequence per row
    decode_rows: int = 8  # rows of every decode program, one token per row

    def __post_init__(self):
        for name in ("page_size", "chunk_tokens", "decode_rows"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"StepShapes.{name} must be a positive int, got {getattr(self, name)!r}")

    @classmethod
    def of(cls, engine_config: EngineConfig) -> "StepShapes":
        """The shapes of a deterministic engine with `engine_config`'s limits (they pick the chunk and rows)."""
        from jaxinfer.scheduling.bucket_tables import BucketTables  # noqa: PLC0415  (host-only tables)

        limits = {name: getattr(engine_config, name) for name in ("page_size", "max_context", "max_num_seqs", "max_prefill_tokens")}
        tables = BucketTables.from_config(EngineConfig(**limits, deterministic=True, compilation_cache_dir=None))
        return cls(page_size=engine_config.page_size, chunk_tokens=tables.chunk_tokens[0], decode_rows=tables.decode_rows[0])


def logprobs(
    params: Params, tokens: Int[Array, "T"], cfg: ModelConfig, *, prompt_len: int | None = None,
    engine_config: EngineConfig | StepShapes | None = None,
) -> Float[Array, "T-1"]:
    """f32[T - 1]: entry i is log p(tokens[i + 1] | tokens[: i + 1]) under `params`, from the raw logits.

    Args:
      tokens: i32[T], T >= 2: a prompt and what was sampled after it.
      prompt_len: the prompt's tokens (static): they are computed as prefill chunks, every later one as a
        decode step. Entries from prompt_len - 1 on are then the engine's logprobs of the sampled tokens
        (deterministic mode, logprobs_mode='raw'), bit for bit; entries before are its prompt_logprobs.
        None: the whole sequence is a prompt (as LLM.score and prompt_logprobs compute it).
      engine_config: the engine's EngineConfig (or StepShapes) whose program shapes to follow; None:
        EngineConfig's defaults (page_size 64, chunks of 64 tokens, decode programs of 8 rows).
    Static: cfg, prompt_len, engine_config (jit with static_argnames=("cfg", "prompt_len", "engine_config")).
    Differentiable in params (jax.grad, jax.vjp).
    """
    num_tokens = tokens.shape[0]
    prompt_len = num_tokens if prompt_len is None else prompt_len
    if num_tokens < 2 or not 1 <= prompt_len <= num_tokens:
        raise ValueError(f"logprobs needs T >= 2 tokens and 1 <= prompt_len <= T, got T={num_tokens}, prompt_len={prompt_len}")
    shapes = engine_config if isinstance(engine_config, StepShapes) else StepShapes.of(engine_config or EngineConfig())
    tokens = tokens.astype(jnp.int32)
    layout = _Layout.of(num_tokens, shapes)
    pool = kvp.init_pool(cfg, layout.num_pages, shapes.page_size)
    prompt_part, pool = _prefill(params, pool, tokens, prompt_len, layout, cfg)
    if prompt_len >= num_tokens - 1:
        return prompt_part[: num_tokens - 1]
    decode_part = _decode(params, pool, tokens, prompt_len, layout, cfg)
    return jnp.concatenate([prompt_part, decode_part])


@dataclasses.dataclass(frozen=True)
class _Layout:
    """One sequence's pages in the function's own pool: entry e of its table is page e + 1 (page 0 null),
    the table padded with the null page to whole attention blocks."""

    shapes: StepShapes
    table: np.ndarray  # i32[W]
    num_pages: int  # of the pool, the null page included

    @classmethod
    def of(cls, num_tokens: int, shapes: StepShapes) -> "_Layout":
        used = -(-num_tokens // shapes.page_size)
        width = -(-used // PAGES_PER_BLOCK) * PAGES_PER_BLOCK
        table = np.full(width, NULL_PAGE, np.int32)
        table[:used] = np.arange(1, used + 1, dtype=np.int32)
        return cls(shapes, table, used + 1)

    def meta(self, positions: np.ndarray, real: np.ndarray) -> kvp.PageMeta:
        """PageMeta of a step whose rows hold `positions` [R, T] (`real`: bool[R, T], the rest padding,
        written to the null page) and whose first row is this sequence; laid out as StepPlan.build does."""
        rows = positions.shape[0]
        page_size, width = self.shapes.page_size, self.table.size
        tables = np.full((rows, width), NULL_PAGE, np.int32)
        tables[0] = self.table
        slot_pages = np.where(real, self.table[positions // page_size], NULL_PAGE).astype(np.int32)
        slot_offsets = np.where(real, positions % page_size, 0).astype(np.int32)
        page_positions = np.broadcast_to(np.arange(width, dtype=np.int32) * page_size, (rows, width)).copy()
        zeros = lambda shape: np.zeros(shape, np.int32)  # noqa: E731
        return kvp.PageMeta(*(jnp.asarray(a) for a in (tables, slot_pages, slot_offsets, page_positions, zeros((rows, width)), zeros(positions.shape))))


def _log_softmax_at(logits: Float[Array, "R V"], targets: Int[Array, "R"]) -> Float[Array, "R"]:
    """The engine's draw and prompt logprobs: log_softmax of f32 rows, each row's target entry."""
    logprobs_all = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logprobs_all, targets[:, None], axis=-1)[:, 0]


def _prefill(params: Params, pool: kvp.KVPool, tokens, prompt_len: int, layout: _Layout, cfg: ModelConfig):
    """The prompt as chunks of chunk_tokens in one row, from position 0: f32[prompt_len] (entry i scores
    token i + 1; the last is the first sampled token's, a zero when the sequence ends there) and the pool.

    Prompt entries come from the whole chunk's logits, as the engine's prompt logprobs (in blocks of its
    chunk); the last entry from the last token's hidden state alone, as the engine's sampling slot."""
    chunk, num_tokens = layout.shapes.chunk_tokens, tokens.shape[0]
    parts = []
    for start in range(0, prompt_len, chunk):
        end = min(start + chunk, prompt_len)
        positions = np.zeros((1, chunk), np.int32)
        positions[0, : end - start] = np.arange(start, end)
        real = np.arange(chunk)[None] < end - start
        ids = jnp.zeros((1, chunk), jnp.int32).at[0, : end - start].set(tokens[start:end])  # [1, C]
        x, pool = model.hidden_states(params, pool, ids, jnp.asarray(positions), cfg=cfg, pages=layout.meta(positions, real), attention_impl=DETERMINISTIC_IMPL)
        scored = min(end, num_tokens - 1) - start  # tokens of the chunk whose successor is a prompt token or the first sampled one
        targets = jnp.zeros(chunk, jnp.int32).at[: max(scored, 0)].set(tokens[start + 1 : start + 1 + max(scored, 0)])
        chunk_logits = model.logits_from_hidden(params, x, cfg)[0]  # [C, V]
        parts.append(_log_softmax_at(chunk_logits, targets)[: end - start])
    prompt_part = jnp.concatenate(parts)  # [prompt_len]
    if prompt_len < num_tokens:  # the first sampled token: the slot's own [1, 1, D] projection, as the engine draws it
        last = model.hidden_at(x, jnp.asarray([[prompt_len - 1 - (prompt_len - 1) // chunk * chunk]], jnp.int32))  # [1, 1, D]
        first = _log_softmax_at(model.logits_from_hidden(params, last, cfg)[:, 0], tokens[prompt_len][None])
        prompt_part = prompt_part.at[prompt_len - 1].set(first[0])
    return prompt_part, pool


def _decode(params: Params, pool: kvp.KVPool, tokens, prompt_len: int, layout: _Layout, cfg: ModelConfig) -> Float[Array, "S"]:
    """Every token from prompt_len to T - 2 fed alone in row 0 of a decode_rows-row step (lax.scan):
    f32[T - 1 - prompt_len], entry j the log-probability of token prompt_len + 1 + j."""
    rows = layout.shapes.decode_rows
    fed = np.arange(prompt_len, tokens.shape[0] - 1, dtype=np.int32)  # positions fed, static
    positions = np.zeros((fed.size, rows, 1), np.int32)
    positions[:, 0, 0] = fed
    real = np.zeros((rows, 1), bool)
    real[0, 0] = True
    metas = [layout.meta(p, real) for p in positions]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *metas)  # PageMeta, each [S, R, ...]

    def step(pool, xs):
        token, target, position, meta = xs
        ids = jnp.zeros((rows, 1), jnp.int32).at[0, 0].set(token)  # [R, 1]
        x, pool = model.hidden_states(params, pool, ids, position, cfg=cfg, pages=meta, attention_impl=DETERMINISTIC_IMPL)
        logits = model.logits_from_hidden(params, model.hidden_at(x, jnp.zeros((rows, 1), jnp.int32)), cfg)  # [R, 1, V]
        targets = jnp.zeros(rows, jnp.int32).at[0].set(target)
        return pool, _log_softmax_at(logits.reshape(rows, -1), targets)[0]

    xs = (tokens[prompt_len:-1], tokens[prompt_len + 1 :], jnp.asarray(positions), stacked)
    _, out = jax.lax.scan(step, pool, xs)
    return out


logprobs_jit = functools.partial(jax.jit, static_argnames=("cfg", "prompt_len", "engine_config"))(logprobs)
