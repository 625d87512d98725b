"""`LLM.embed`: one vector per prompt, pooled from the decoder's final hidden states (after the final norm).

Pooling: "last" takes the last prompt token's state (Qwen3-Embedding, E5-Mistral: decoder embedders),
"mean" averages the prompt's states; `normalize` divides by the L2 norm (max(norm, 1e-12), as torch's
F.normalize). An embedding needs no KV cache and no logits, so it runs the one `model.forward` chain
through its no-cache path (`model.hidden_states(params, None, ...)`, causal attention within each row)
on the engine's params (cast, quantized, sharded on the tensor-parallel mesh as generation has them),
never the paged pool: it takes no pages from running requests and writes none.

Shapes come from buckets: prompts are sorted by length and grouped into rows of a [B, T] program, T a
power of two from 16 up to max_context and B a power of two up to max_num_seqs, with B * T within the
engine's max_prefill_tokens (or one row of T). In deterministic mode B depends on T alone (plan_batches),
so a prompt's vector is bitwise the same alone or among others. Rows are right-padded: causal attention keeps the padding
out of every real position, and pooling masks it. Each (B, T) program compiles on first use (persistent
compile cache included), at most log2(max_num_seqs) * log2(max_context / 16) of them; `warmup` is not
extended. Imports model/ and validation, never api (LLM is passed in).
"""

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxinfer.config import ModelConfig
from jaxinfer.model import forward as model
from jaxinfer.validation import FieldError, check_bool

POOLINGS = ("last", "mean")
MIN_LENGTH_BUCKET = 16
_NORM_EPS = 1e-12  # torch.nn.functional.normalize's


@dataclasses.dataclass(frozen=True)
class EmbeddingOutput:
    index: int  # position in the input
    embedding: np.ndarray  # f32[D]
    num_prompt_tokens: int


@functools.partial(jax.jit, static_argnames=("cfg", "pooling", "normalize"))
def pooled_embeddings(
    params, tokens: Int[Array, "B T"], lengths: Int[Array, "B"], *, cfg: ModelConfig, pooling: str, normalize: bool
) -> Float[Array, "B D"]:
    """Each row's pooled final hidden state (f32); rows are right-padded to T, `lengths` >= 1."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32)[None], tokens.shape)  # [B, T]
    x, _ = model.hidden_states(params, None, tokens, positions, cfg=cfg)  # [B, T, D]
    x = model.rms_norm(x, params.final_norm, cfg.rms_norm_eps).astype(jnp.float32)  # [B, T, D]
    if pooling == "last":
        pooled = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, D]
    else:
        mask = (positions < lengths[:, None]).astype(jnp.float32)  # [B, T]
        pooled = jnp.einsum("btd,bt->bd", x, mask) / lengths[:, None].astype(jnp.float32)  # [B, D]
    if normalize:
        pooled = pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), _NORM_EPS)
    return pooled


def length_bucket(length: int, max_context: int) -> int:
    """The smallest power of two >= length (at least MIN_LENGTH_BUCKET), capped at max_context."""
    return min(max(MIN_LENGTH_BUCKET, 1 << math.ceil(math.log2(length))), max_context)


def plan_batches(lengths: Sequence[int], *, max_context: int, max_seqs: int, max_tokens: int, deterministic: bool = False) -> list[tuple[list[int], int, int]]:
    """Group prompt indices (shortest first) into (indices, B, T) batches: B a power of two >= the group's
    size and <= max_seqs, T the longest's length bucket, B * T <= max(max_tokens, T). `deterministic`: a
    group holds one length bucket and B is the most rows that bucket allows, so a prompt's program (B, T)
    depends on its own length alone and its vector is bitwise the same whatever else is embedded with it."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, group = [], []
    for i in order:
        width = length_bucket(lengths[i], max_context)  # the longest so far: sorted ascending
        rows = _max_rows(width, max_seqs, max_tokens)
        new_bucket = deterministic and group and length_bucket(lengths[group[-1]], max_context) != width
        if group and (new_bucket or len(group) + 1 > rows):
            batches.append(group)
            group = []
        group.append(i)
    if group:
        batches.append(group)
    plan = []
    for g in batches:
        width = length_bucket(lengths[g[-1]], max_context)
        plan.append((g, _max_rows(width, max_seqs, max_tokens) if deterministic else _pow2(len(g)), width))
    return plan


def _max_rows(width: int, max_seqs: int, max_tokens: int) -> int:
    """The most rows (a power of two, <= max_seqs) of `width` tokens within the token budget (at least one)."""
    rows = 1
    while rows * 2 <= max_seqs and rows * 2 * width <= max(max_tokens, width):
        rows *= 2
    return rows


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def embed(llm, prompts: list, *, pooling: str = "last", normalize: bool = True) -> list[EmbeddingOutput]:
    """One EmbeddingOutput per prompt of the list (text or token ids), in input order; see the module docstring.

    Every prompt is checked first (LLM.encode: a bad one raises naming its index), and one longer than
    max_context is an error (no silent truncation)."""
    if pooling not in POOLINGS:
        raise FieldError("pooling", f"must be one of {POOLINGS}, got {pooling!r}")
    check_bool("normalize", normalize)
    ids = [_encoded(llm, prompt, i) for i, prompt in enumerate(prompts)]
    engine_cfg, engine = llm.engine_config, llm.engine
    out: list[EmbeddingOutput | None] = [None] * len(ids)
    plan = plan_batches([len(x) for x in ids], max_context=engine_cfg.max_context, max_seqs=engine_cfg.max_num_seqs, max_tokens=engine_cfg.max_prefill_tokens,
                        deterministic=engine_cfg.deterministic)
    for group, rows, width in plan:
        tokens = np.zeros((rows, width), np.int32)  # [B, T]; padding rows and tails are token 0
        lengths = np.ones(rows, np.int32)  # [B]
        for row, i in enumerate(group):
            tokens[row, : len(ids[i])], lengths[row] = ids[i], len(ids[i])
        pooled = np.asarray(pooled_embeddings(engine.params, tokens, lengths, cfg=llm.model_config, pooling=pooling, normalize=normalize))
        for row, i in enumerate(group):
            out[i] = EmbeddingOutput(i, pooled[row], len(ids[i]))
    return out


def _encoded(llm, prompt, index: int) -> list[int]:
    try:
        ids = llm.encode(prompt)
        if not ids:
            raise FieldError("prompt", "has no tokens")
        if len(ids) > llm.engine_config.max_context:
            raise FieldError("prompt", f"has {len(ids)} tokens, more than max_context ({llm.engine_config.max_context})")
    except ValueError as e:
        raise ValueError(f"prompt {index}: {e}") from None
    return ids
