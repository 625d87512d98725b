"""The same forward through the paged pool, a dense cache and no cache gives the same logits."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model import kv_pool as kvp
from jaxinfer.model.forward import forward
from tolerances import CHUNKED_VS_ONESHOT_F32, PAGED_VS_DENSE_F32, assert_close

PAGE = 8


def page_meta(pages: list[int], start: int, length: int, width: int) -> kvp.PageMeta:
    positions = np.arange(start, start + length)
    table = np.zeros((1, width), np.int32)
    table[0, : len(pages)] = pages
    slot_pages = np.asarray(pages, np.int32)[positions // PAGE][None]
    return kvp.PageMeta(jnp.asarray(table), jnp.asarray(slot_pages), jnp.asarray(positions % PAGE, jnp.int32)[None])


def run_chunks(params, cfg, tokens, chunk_sizes, pages):
    """Prefill `tokens` through the pool in chunks; returns logits of every chunk concatenated."""
    pool = kvp.init_pool(cfg, 16, PAGE)
    start, logits = 0, []
    for size in chunk_sizes:
        ids = jnp.asarray(tokens[start : start + size], jnp.int32)[None]
        positions = jnp.arange(start, start + size, dtype=jnp.int32)[None]
        out, pool = forward(params, pool, ids, positions, cfg=cfg, pages=page_meta(pages, start, size, 8))
        logits.append(np.asarray(out[0]))
        start += size
    return np.concatenate(logits)


@pytest.fixture(scope="module")
def tokens(tiny_llama):
    cfg, _ = tiny_llama
    return np.random.default_rng(0).integers(0, cfg.vocab_size, 45)


def test_chunked_prefill_matches_one_shot_when_chunks_cross_pages(tiny_llama, tokens):
    cfg, params = tiny_llama
    pages = [5, 2, 9, 1, 7, 3]  # shuffled physical pages
    one_shot = run_chunks(params, cfg, tokens, [45], pages)
    chunked = run_chunks(params, cfg, tokens, [13, 8, 1, 23], pages)
    assert_close(chunked, one_shot, CHUNKED_VS_ONESHOT_F32, "chunked vs one-shot logits")


def test_paged_token_by_token_matches_no_cache_forward(tiny_llama, tokens):
    cfg, params = tiny_llama
    ids = jnp.asarray(tokens[:20], jnp.int32)[None]
    full, _ = forward(params, None, ids, jnp.arange(20, dtype=jnp.int32)[None], cfg=cfg)
    stepped = run_chunks(params, cfg, tokens[:20], [1] * 20, [4, 6, 8])
    assert_close(stepped, np.asarray(full[0]), PAGED_VS_DENSE_F32, "paged decode vs full forward")


def test_dense_cache_matches_no_cache_forward(tiny_llama, tokens):
    cfg, params = tiny_llama
    ids = jnp.asarray(tokens[:30], jnp.int32)[None]
    positions = jnp.arange(30, dtype=jnp.int32)[None]
    full, _ = forward(params, None, ids, positions, cfg=cfg)
    cache = kvp.init_dense_cache(cfg, 1, 64)
    first, cache = forward(params, cache, ids[:, :17], positions[:, :17], cfg=cfg)
    rest, _ = forward(params, cache, ids[:, 17:], positions[:, 17:], cfg=cfg)
    assert_close(np.concatenate([first[0], rest[0]]), np.asarray(full[0]), PAGED_VS_DENSE_F32, "dense cache vs full forward")


def test_padding_lanes_do_not_touch_real_pages(tiny_llama, tokens):
    """A padded row writes only to the null page: the real pages are bit-identical afterwards."""
    cfg, params = tiny_llama
    pool = kvp.init_pool(cfg, 8, PAGE)
    ids = jnp.asarray(tokens[:8], jnp.int32)[None]
    _, pool = forward(params, pool, ids, jnp.arange(8, dtype=jnp.int32)[None], cfg=cfg, pages=page_meta([3], 0, 8, 4))
    before = np.asarray(pool.k[:, :, 1:]), np.asarray(pool.v[:, :, 1:])
    padding = kvp.PageMeta(jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 4), jnp.int32), jnp.arange(8, dtype=jnp.int32).reshape(2, 4) % PAGE)
    _, pool = forward(params, pool, jnp.ones((2, 4), jnp.int32), jnp.zeros((2, 4), jnp.int32), cfg=cfg, pages=padding)
    np.testing.assert_array_equal(np.asarray(pool.k[:, :, 1:]), before[0])
    np.testing.assert_array_equal(np.asarray(pool.v[:, :, 1:]), before[1])


def test_packed_row_gives_each_sequence_its_own_logits(tiny_llama, tokens):
    """Three sequences in one packed prefill row (StepPlan.build's layout: back-to-back chunks, the row's
    table the concatenation of their pages), one of them continuing a chunk computed earlier, give each
    sequence the logits of its own no-cache forward; padding tokens and entries change nothing."""
    from jaxinfer.engine.engine import inputs_from_plan
    from jaxinfer.scheduling.plan import BucketKey, RowChunk, StepPlan
    from jaxinfer.scheduling.request import Request, SamplingParams

    cfg, params = tiny_llama
    seqs = {"a": tokens[:13].tolist(), "b": tokens[13:34].tolist(), "c": tokens[34:39].tolist()}
    pages = {"a": [3, 4], "b": [7, 1, 9], "c": [5]}
    requests = {k: Request(k, ids, SamplingParams(max_tokens=1), seed=0) for k, ids in seqs.items()}
    pool = kvp.init_pool(cfg, 16, PAGE)
    # b's first 11 tokens were computed by an earlier one-sequence step.
    first = StepPlan.build("prefill", [RowChunk(requests["b"], 0, 11, pages["b"][:2], False)], BucketKey("prefill", 1, 16, 4), PAGE)
    step = inputs_from_plan(first)
    _, pool = forward(params, pool, step.token_ids, step.positions, cfg=cfg, pages=step.pages, logit_indices=step.logit_indices)
    chunks = [RowChunk(requests["a"], 0, 13, pages["a"], True), RowChunk(requests["b"], 11, 10, pages["b"], True), RowChunk(requests["c"], 0, 5, pages["c"], True)]
    plan = StepPlan.build("prefill", chunks, BucketKey("prefill", 1, 32, 8), PAGE, packed=4)
    step = inputs_from_plan(plan)
    logits, _ = forward(params, pool, step.token_ids, step.positions, cfg=cfg, pages=step.pages)  # [1, 32, V]
    starts = {"a": (0, 0), "b": (13, 11), "c": (23, 0)}  # (index in the row, first position)
    for name, (index, start) in starts.items():
        (expected,), _ = forward(params, None, jnp.asarray(seqs[name])[None], jnp.arange(len(seqs[name]))[None], cfg=cfg)
        length = len(seqs[name]) - start
        assert_close(np.asarray(logits[0, index : index + length]), np.asarray(expected[start:]), PAGED_VS_DENSE_F32, what=f"packed sequence {name}")
    assert plan.logit_indices.tolist() == [[12, 22, 27, 0]] and plan.page_segments[0, :7].tolist() == [0, 0, 1, 1, 1, 2, -1]
