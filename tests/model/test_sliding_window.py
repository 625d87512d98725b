"""Sliding-window attention past the window: every jnp path of attention.py against a float64 numpy
masked softmax, and a tiny Mistral (window 8) through LLM's paged engine against transformers.

Visibility is Hugging Face's (transformers 5.24, masking_utils.sliding_window_overlay and the causal
mask): key p is visible to query t iff t - W < p <= t. The fixture (tests/reference/make_fixtures.py,
tiny_mistral_window; make_window_fixtures.py for the greedy tokens) holds transformers' logits of 7, 33
and 100 tokens and 30 greedy tokens after a 10-token prompt: 4x to 12x the window. A control with the
window removed misses the logits, so the comparison can fail.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES
from jaxinfer.api import LLM
from jaxinfer.loading.loading import load_model
from jaxinfer.model import attention as at
from jaxinfer.model import kv_pool as kvp
from jaxinfer.model.forward import forward
from jaxinfer.scheduling.request import SamplingParams

WINDOW = 8
TOL = 1e-4  # f32 against transformers' f32 (and f32 against f64 for single attention calls: 1e-5)


def masked_attention_f64(q, keys, values, q_positions, k_positions, window, k_segments=None, q_segments=None):
    """[B, T, H, K] float64: GQA softmax over keys with q - window < k <= q (and equal segments)."""
    q, keys, values = (np.asarray(x, np.float64) for x in (q, keys, values))
    b, t, h, k = q.shape
    g = keys.shape[2]
    out = np.zeros((b, t, h, k))
    for row in range(b):
        kp = np.asarray(k_positions)[min(row, len(k_positions) - 1)]
        for i in range(t):
            qp = int(q_positions[row, i])
            visible = (kp <= qp) & (kp > qp - (window if window is not None else 10**9))
            if k_segments is not None:
                visible &= np.asarray(k_segments)[row] == int(q_segments[row, i])
            for head in range(h):
                scores = keys[row, visible, head // (h // g)] @ q[row, i, head] / np.sqrt(k)
                if scores.size:
                    p = np.exp(scores - scores.max())
                    out[row, i, head] = (p / p.sum()) @ values[row, visible, head // (h // g)]
    return out


def _rand(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("window", [1, 3, WINDOW])
def test_no_cache_and_dense_cache_mask_outside_the_window(window):
    rng = np.random.default_rng(window)
    b, t, h, g, k = 2, 24, 4, 2, 8
    q, keys, values = _rand(rng, b, t, h, k), _rand(rng, b, t, g, k), _rand(rng, b, t, g, k)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    expected = masked_attention_f64(q, keys, values, positions, np.asarray(positions), window)
    out, _ = at.attend(None, 0, q, keys, values, positions, window=jnp.int32(window))
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)
    cache = kvp.DenseKVCache(jnp.zeros((1, b, 32, g, k)), jnp.zeros((1, b, 32, g, k)))
    out, _ = at.attend(cache, jnp.int32(0), q, keys, values, positions, window=window)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)
    causal, _ = at.attend(None, 0, q, keys, values, positions)
    assert np.abs(np.asarray(causal) - expected).max() > 1e-2  # the window matters here


def _paged_case(rng, page_size=4, pages_per_row=8, null_before=None):
    """One layer's pool and per-row tables; rows hold one sequence each, query positions past the window.
    `null_before[b]`: that row's entries before it are the null page (released pages)."""
    b, h, g, k = 2, 4, 2, 8
    num_pages = 1 + b * pages_per_row
    pool = kvp.KVPool(_rand(rng, 1, g, num_pages, k, page_size), _rand(rng, 1, g, num_pages, page_size, k))
    tables = np.arange(1, num_pages, dtype=np.int32).reshape(b, pages_per_row)
    q_positions = np.array([[29, 30, 31], [20, 21, 22]], np.int32)  # 3 queries (a chunk) per row
    keys = np.asarray(pool.k[0]).transpose(0, 1, 3, 2)[:, tables].transpose(1, 2, 3, 0, 4).reshape(b, -1, g, k)  # [B, S, G, K]
    values = np.asarray(pool.v[0])[:, tables].transpose(1, 2, 3, 0, 4).reshape(b, -1, g, k)
    if null_before is not None:
        for row, n in enumerate(null_before):
            tables[row, :n] = 0
    return pool, jnp.asarray(tables), jnp.asarray(q_positions), keys, values, _rand(rng, b, 3, h, k)


@pytest.mark.parametrize("impl", ["reference", at.DETERMINISTIC_IMPL, at.CPU_IMPL])
def test_paged_paths_mask_outside_the_window_and_never_need_released_pages(impl):
    rng = np.random.default_rng(7)
    pool, tables, q_positions, keys, values, q = _paged_case(rng)
    expected = masked_attention_f64(q, keys, values, q_positions, np.arange(keys.shape[1])[None], WINDOW)
    # rows' first queries at 29 and 20 see from 22 and 13: pages before 22 // 4 = 5 and 13 // 4 = 3 are released
    _, released, *_ = _paged_case(np.random.default_rng(7), null_before=(5, 3))
    for table in (tables, released):
        pages = kvp.PageMeta(table, jnp.zeros(q_positions.shape, jnp.int32), jnp.zeros(q_positions.shape, jnp.int32))
        out = at._attend_cpu(q, pool, 0, q_positions, pages, WINDOW) if impl == at.CPU_IMPL else None
        if out is None:
            k_pages, v_pages = kvp.gather_pages(pool, 0, table)
            over = at.attention_over_page_blocks if impl == at.DETERMINISTIC_IMPL else at.attention_over_pages
            out = over(q, k_pages, v_pages, q_positions, at.key_layout(pages, pool.page_size), jnp.int32(WINDOW))
        np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)


def test_packed_row_masks_by_window_within_each_sequence():
    rng = np.random.default_rng(3)
    page_size, g, h, k = 4, 1, 2, 8
    pool = kvp.KVPool(_rand(rng, 1, g, 12, k, page_size), _rand(rng, 1, g, 12, page_size, k))
    # one row: sequence 0 on pages 1..4 (positions 0..15), sequence 1 on pages 5..7 (positions 0..11)
    tables = jnp.asarray([[1, 2, 3, 4, 5, 6, 7, 0]], jnp.int32)
    page_positions = jnp.asarray([[0, 4, 8, 12, 0, 4, 8, 0]], jnp.int32)
    page_segments = jnp.asarray([[0, 0, 0, 0, 1, 1, 1, 2]], jnp.int32)
    q_positions, q_segments = jnp.asarray([[14, 15, 10, 11]], jnp.int32), jnp.asarray([[0, 0, 1, 1]], jnp.int32)
    pages = kvp.PageMeta(tables, q_positions * 0, q_positions * 0, page_positions, page_segments, q_segments)
    q = _rand(rng, 1, 4, h, k)
    keys = np.asarray(pool.k[0]).transpose(0, 1, 3, 2)[:, tables].transpose(1, 2, 3, 0, 4).reshape(1, -1, g, k)
    values = np.asarray(pool.v[0])[:, tables].transpose(1, 2, 3, 0, 4).reshape(1, -1, g, k)
    slot_positions = (np.asarray(page_positions)[..., None] + np.arange(page_size)).reshape(1, -1)
    expected = masked_attention_f64(q, keys, values, q_positions, slot_positions, 5, np.repeat(np.asarray(page_segments), page_size, 1), q_segments)
    k_pages, v_pages = kvp.gather_pages(pool, 0, tables)
    out = at.attention_over_pages(q, k_pages, v_pages, q_positions, at.key_layout(pages, page_size), 5)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)
    out = at._attend_cpu(q, pool, 0, q_positions, pages, 5)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)


# ------------------------------------------------------------------ the tiny Mistral against transformers


@pytest.fixture(scope="module")
def mistral():
    return load_model(FIXTURES / "tiny_mistral_window", max_context=128)


def test_forward_matches_transformers_past_the_window_and_the_window_is_what_makes_it_match(mistral):
    cfg, params = mistral
    assert cfg.sliding_window == WINDOW and cfg.max_context == 128
    ref = np.load(FIXTURES / "tiny_mistral_window_reference.npz")
    ids = jnp.asarray(ref["s2_ids"])[None]  # 100 tokens
    positions = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    logits, _ = forward(params, None, ids, positions, cfg=cfg)
    np.testing.assert_allclose(np.asarray(logits[0]), ref["s2_logits"], atol=TOL, rtol=0)
    unwindowed, _ = forward(params, None, ids, positions, cfg=dataclasses.replace(cfg, sliding_window=None))
    assert np.abs(np.asarray(unwindowed[0]) - ref["s2_logits"]).max() > 100 * TOL


@pytest.mark.parametrize("impl", ["cpu", pytest.param("reference", marks=pytest.mark.slow)])
def test_paged_engine_matches_transformers_and_hands_pages_back(mistral, smollm2_tokenizer, compile_cache, impl):
    cfg, params = mistral
    llm = LLM.from_params(
        cfg, params, smollm2_tokenizer, attention_impl=impl, matmul_impl="xla", compilation_cache_dir=compile_cache,
        max_context=128, page_size=4, max_num_seqs=2, max_prefill_tokens=32, prefill_chunk_buckets=(32,), max_prefill_seqs=1,
        prefill_seq_buckets=(1,), decode_batch_buckets=(2,), decode_page_buckets=(32,), max_logprobs=5,
    )
    assert llm.engine_config.release_window == WINDOW
    released = []
    on_step = lambda plan, *_: released.append(int((plan.block_tables[: len(plan.request_ids)] == 0).sum()))  # noqa: E731
    greedy = np.load(FIXTURES / "tiny_mistral_window_greedy.npz")
    ref = np.load(FIXTURES / "tiny_mistral_window_reference.npz")
    prompts = [greedy["prompt"].tolist(), ref["s2_ids"].tolist()]
    params_ = [SamplingParams(temperature=0, max_tokens=len(greedy["greedy"]), ignore_eos=True),
               SamplingParams(max_tokens=0, prompt_logprobs=5)]
    generated, scored = llm.generate(prompts, params_, on_step=on_step)
    assert generated.token_ids == greedy["greedy"].tolist()
    # Every scored position (chunks of 32 over 100 tokens: the later ones run with released pages) within
    # 1e-4 of transformers' log-softmax, for the prompt token and the top 5.
    hf = ref["s2_logits"].astype(np.float64)
    hf = hf - hf.max(-1, keepdims=True)
    hf = hf - np.log(np.exp(hf).sum(-1, keepdims=True))
    ids = ref["s2_ids"]
    for position, entry in enumerate(scored.prompt_logprobs[1:]):
        logprob, top = entry
        assert abs(logprob - hf[position, ids[position + 1]]) < TOL, position
        assert all(abs(value - hf[position, token]) < TOL for token, value in top.items()), position
    assert max(released) > 0, "no page was handed back"
    assert llm.block_pool.num_used == 0
    llm.block_pool.check_invariants()


def test_pallas_dispatch_hands_a_traced_window_to_the_kernel(monkeypatch):
    """Decode in bf16 with impl='pallas' inside jit: the kernel (here its reference, through a spy) gets
    the layer's window, and the result masks as the float64 rule says."""
    from kernels_pallas import paged_attention as pa

    windows = []

    def spy(q, k_pages, v_pages, block_tables, lengths, *, layer=None, config=None, window=None):
        windows.append(window)
        return pa.paged_attention_reference(q, k_pages, v_pages, block_tables, lengths, layer=layer, window=window)

    monkeypatch.setattr(pa, "paged_attention", spy)
    rng = np.random.default_rng(11)
    pool, tables, q_positions, keys, values, q = _paged_case(rng, page_size=64, pages_per_row=2)
    pool = kvp.KVPool(pool.k.astype(jnp.bfloat16), pool.v.astype(jnp.bfloat16))
    q, positions = q[:, :1].astype(jnp.bfloat16), jnp.asarray([[100], [70]], jnp.int32)
    meta = kvp.PageMeta(tables, jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32))
    k_new = v_new = jnp.zeros((2, 1, 2, 8), jnp.bfloat16)  # [B, 1, G, K], written to the null page, which no table names

    @jax.jit
    def run(pool, window):
        return at.attend(pool, jnp.int32(0), q, k_new, v_new, positions, meta, impl="pallas", window=window)[0]

    out = run(pool, jnp.int32(WINDOW))
    assert len(windows) == 1 and isinstance(windows[0], jax.core.Tracer)
    keys = np.asarray(pool.k[0].astype(jnp.float32)).transpose(0, 1, 3, 2)[:, tables].transpose(1, 2, 3, 0, 4).reshape(2, -1, 2, 8)
    values = np.asarray(pool.v[0].astype(jnp.float32))[:, tables].transpose(1, 2, 3, 0, 4).reshape(2, -1, 2, 8)
    expected = masked_attention_f64(q.astype(jnp.float32), keys, values, positions, np.arange(keys.shape[1])[None], WINDOW)
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=2e-2)
