"""The library's model as timed programs: one jitted `jaxinfer.model.forward.forward` (donating its
cache), its inputs packed the way the engine packs them (`StepPlan.build`, then
`jaxinfer.engine.engine.inputs_from_plan`), the params as the engine holds them, and FLOP counts.
numpy at import; jax and jaxinfer where used.

Each row of a step is one sequence on its own pages, numbered from 1 (page 0 is the null page, where
padding tokens write). A row is (token ids, start): the ids are the sequence's tokens from position 0,
and the step computes positions start.. of it.
"""

import functools

import numpy as np

from common.timing import compile_timed, time_donating

FORWARD_ARGS = ("tokens", "positions", "pages", "last")  # what forward_program takes after (params, pool)


def _step_plan(phase: str, rows: list[tuple[list[int], int]], num_tokens: int, pages_per_row: int, page_size: int):
    """StepPlan.build of `rows` [(token ids, start)] in a (phase, len(rows), num_tokens, pages_per_row)
    bucket; row b owns pages 1 + b * pages_per_row .. and computes ids[start:] (greedy, seed 0)."""
    from jaxinfer import SamplingParams
    from jaxinfer.scheduling.plan import BucketKey, RowChunk, StepPlan
    from jaxinfer.scheduling.request import Request

    chunks = []
    for b, (ids, start) in enumerate(rows):
        request = Request(f"row{b}", list(ids), SamplingParams(temperature=0.0), seed=0)
        pages = list(range(1 + b * pages_per_row, 1 + (b + 1) * pages_per_row))
        chunks.append(RowChunk(request, start, len(ids) - start, pages, sample=True))
    return StepPlan.build(phase, chunks, BucketKey(phase, len(rows), num_tokens, pages_per_row), page_size)


def step_args(phase: str, rows: list[tuple[list[int], int]], *, num_tokens: int, pages_per_row: int, page_size: int) -> tuple:
    """forward_program's (tokens i32[B, T], positions i32[B, T], PageMeta, last i32[B, 1]) for `rows`, the
    library's packing: padding tokens write to the null page; last is each row's last real token."""
    from jaxinfer.engine.engine import inputs_from_plan

    inputs = inputs_from_plan(_step_plan(phase, rows, num_tokens, pages_per_row, page_size))
    return inputs.token_ids, inputs.positions, inputs.pages, inputs.logit_indices


def num_pool_pages(num_rows: int, pages_per_row: int) -> int:
    """Pages a pool needs for `num_rows` rows of their own pages, the null page included."""
    return num_rows * pages_per_row + 1


def prefill_args(ids: list[int], page_size: int) -> tuple[tuple, int]:
    """forward_program's arguments for one sequence of `ids` on its own pages, and the pool's page count."""
    pages = -(-len(ids) // page_size)
    return step_args("prefill", [(ids, 0)], num_tokens=len(ids), pages_per_row=pages, page_size=page_size), num_pool_pages(1, pages)


def decode_args(batch: int, context: int, token: int, page_size: int) -> tuple[tuple, int]:
    """forward_program's arguments for one `token` per row, every row at position context - 1 of its own
    pages (so it attends to `context` keys), and the pool's page count."""
    pages = -(-context // page_size)
    rows = [([token] * context, context - 1)] * batch
    return step_args("decode", rows, num_tokens=1, pages_per_row=pages, page_size=page_size), num_pool_pages(batch, pages)


def _forward(params, pool, tokens, positions, pages, last, *, cfg, impl: str, output: str):
    """model.forward of [B, T] tokens into `pool` (a paged KVPool with `pages`, a dense cache, or None) ->
    (output, pool). output "greedy": the argmax at index last[b] [B]; "last_logits": the logits there
    [B, V]; "logits": every position's [B, T, V] (last is None)."""
    from jaxinfer.model import forward as model, sampling

    logits, pool = model.forward(params, pool, tokens, positions, cfg=cfg, pages=pages, logit_indices=last, attention_impl=impl)
    if output == "logits":
        return logits, pool
    return (sampling.argmax(logits[:, 0]) if output == "greedy" else logits[:, 0]), pool  # the engine's greedy argmax


@functools.cache
def forward_program():
    """The jitted _forward (cfg, impl and output static; donates `pool`), built on first use."""
    import jax

    return jax.jit(_forward, static_argnames=("cfg", "impl", "output"), donate_argnames=("pool",))


def time_forward(params, cfg, pool, args: tuple, *, impl: str, output: str, repeats: int, warmup: int) -> tuple:
    """forward_program compiled for (params, pool, *args), then `repeats` timed calls after `warmup`, the
    donated pool rebound each call. Returns (seconds per call, compile seconds, the last call's output)."""
    program, compile_s = compile_timed(forward_program(), params, pool, *args, cfg=cfg, impl=impl, output=output)
    times, out = time_donating(lambda pool, *rest: program(params, pool, *rest), pool, *args, repeats=repeats, warmup=warmup)
    return times, compile_s, out


def engine_params(params, impl: str):
    """The params as the engine holds them for `impl`: packed into panels for the CPU kernels."""
    from jaxinfer.model import attention, panels

    return panels.pack_panels(params) if impl == attention.CPU_IMPL else params


def pad_rows(prompts: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int32 [B, width], right-padded with 0; lengths int32 [B]), for the dense and cache-free forwards."""
    tokens = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    return tokens, np.array([len(p) for p in prompts], np.int32)


def matmul_params(cfg) -> int:
    """Weights that take part in a matmul per token, excluding the LM head (embedding lookups are free)."""
    d, k = cfg.embed_dim, cfg.head_dim
    per_layer = d * k * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * d * cfg.ffn_dim
    return cfg.num_layers * per_layer


def forward_flops(cfg, num_tokens: int, num_logit_rows: int, num_keys_attended: int) -> int:
    """Useful FLOPs of a forward: layer matmuls, the LM head for rows with logits, and attention
    (QK^T and PV: 4 * K per query head per key, over `num_keys_attended` (query, key) pairs per layer)."""
    lm_head = 2 * cfg.vocab_size * cfg.embed_dim * num_logit_rows
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * num_keys_attended
    return 2 * matmul_params(cfg) * num_tokens + lm_head + attention
