"""The paged engine: greedy outputs equal a dense forward's argmax, donation, compile count, memory."""

import dataclasses

import jax
import numpy as np
import pytest

from conftest import FIXTURES
from engine_runs import assert_greedy_is_dense_argmax, run_engine
from jaxinfer.model import kv_pool as kvp
from jaxinfer.api import Prompt
from jaxinfer.config import EngineConfig
from jaxinfer.engine.engine import CompileCounter, Engine
from jaxinfer.engine.pool_size import PoolTooLargeError
from jaxinfer.scheduling.request import SamplingParams
from jaxinfer.scheduling.scheduler import Scheduler

LONG_TEXT_IDS = np.load(FIXTURES / "smollm2_reference.npz")["p5_ids"].tolist()  # a real 601-token passage


def smollm2_engine_config(compile_cache, **overrides) -> EngineConfig:
    base = dict(
        page_size=16, max_context=256, max_num_seqs=8, max_prefill_tokens=32,
        prefill_chunk_buckets=(16, 32), prefill_seq_buckets=(1, 2), decode_batch_buckets=(4, 8),
        decode_page_buckets=(4, 16), compilation_cache_dir=compile_cache,  # 8 prefill + 4 decode programs
    )
    return EngineConfig(**(base | overrides))


@pytest.fixture(scope="module")
def smollm2_engine(smollm2, compile_cache):
    """One warmed SmolLM2 engine, a pool of 24 pages, shared by the tests below (its 12 programs compile once)."""
    cfg, params = smollm2
    engine = Engine(cfg, params, smollm2_engine_config(compile_cache, num_pages=24))
    engine.warmup()
    return engine


@pytest.mark.slow
def test_greedy_outputs_equal_dense_argmax_under_preemption_and_chunking(smollm2, smollm2_engine):
    cfg, params = smollm2
    lengths = [3, 15, 16, 17, 31, 33, 47, 64, 80, 5, 100, 9, 120, 40, 2, 70]  # page edges 16/32/64 crossed
    starts = [(7 * i) % 400 for i in range(16)]
    greedy = [SamplingParams(temperature=0, max_tokens=8 + (i % 4) * 6, ignore_eos=True) for i in range(16)]
    prompts = [Prompt(i, LONG_TEXT_IDS[s : s + n], greedy[i]) for i, (s, n) in enumerate(zip(starts, lengths))]
    outputs, stats, plans = run_engine(smollm2_engine, prompts, num_pages=24)  # 23 usable pages of 16 tokens
    assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert any(plan.phase == "prefill" and not all(plan.samples) for plan in plans), "no chunked prefill happened"
    assert_greedy_is_dense_argmax(cfg, params, prompts, outputs)


@pytest.mark.slow
def test_greedy_outputs_with_prefix_cache_equal_outputs_without_it_and_the_dense_argmax(smollm2, smollm2_engine):
    cfg, params = smollm2
    prefixes = [LONG_TEXT_IDS[:40], LONG_TEXT_IDS[200:237]]  # two shared preambles (2+ full pages of 16)
    prompts = [
        Prompt(i, prefixes[i % 2] + LONG_TEXT_IDS[300 + 9 * i : 300 + 9 * i + 3 + i], SamplingParams(temperature=0, max_tokens=6 + i % 3, ignore_eos=True))
        for i in range(12)
    ]
    outputs = {}
    for enabled in (True, False):  # the same programs; prefix caching is the scheduler's
        engine_cfg = dataclasses.replace(smollm2_engine.engine_cfg, enable_prefix_caching=enabled)
        outputs[enabled], stats, _ = run_engine(smollm2_engine, prompts, num_pages=20, engine_cfg=engine_cfg)  # 19 pages: evicts
        if enabled:
            assert stats.prefix_cache_hits >= 16 * 8, stats  # most requests reuse at least one page
        else:
            assert stats.prefix_cache_hits == 0, stats
    assert outputs[True] == outputs[False]
    assert_greedy_is_dense_argmax(cfg, params, prompts, outputs[True])


def tiny_engine_config(compile_cache, **overrides) -> EngineConfig:
    base = dict(
        page_size=8, max_context=128, max_num_seqs=8, max_prefill_tokens=32, num_pages=40,
        prefill_chunk_buckets=(8, 32), prefill_seq_buckets=(1, 4), decode_batch_buckets=(2, 8),
        decode_page_buckets=(4, 16), compilation_cache_dir=compile_cache,
    )
    return EngineConfig(**(base | overrides))


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama, compile_cache):
    cfg, params = tiny_llama
    engine = Engine(cfg, params, tiny_engine_config(compile_cache))
    engine.warmup()
    return engine


def random_prompts(count: int, vocab: int, seed: int) -> list[Prompt]:
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(count):
        params = SamplingParams(
            temperature=float(rng.choice([0.0, 0.7, 1.3])), top_k=int(rng.choice([0, 5, 50])), top_p=float(rng.choice([1.0, 0.9, 0.5])),
            seed=int(rng.integers(0, 2**31 - 1)), max_tokens=int(rng.integers(1, 24)), ignore_eos=bool(rng.integers(0, 2)),
        )
        prompts.append(Prompt(i, rng.integers(0, vocab, int(rng.integers(1, 90))).tolist(), params))
    return prompts


def test_no_compilation_after_warmup_over_200_varied_requests(tiny_engine, tiny_llama):
    cfg, _ = tiny_llama
    with CompileCounter() as control:  # the listener sees a compile when one happens
        jax.jit(lambda x: x * 3 + 1)(np.arange(7 + cfg.vocab_size % 5))
    assert control.count > 0, "CompileCounter saw no compile: the check below could not fail"
    with CompileCounter() as counter:
        outputs, stats, plans = run_engine(tiny_engine, random_prompts(200, cfg.vocab_size, seed=1), eos_id=2)
    assert counter.count == 0, counter.events
    assert len(outputs) == 200 and {p.bucket for p in plans} <= set(tiny_engine.bucket_keys())
    assert len({p.bucket for p in plans}) > 4, "the workload was meant to use many programs"


def test_seeded_request_draws_same_tokens_whatever_the_batch(tiny_engine, tiny_llama):
    cfg, _ = tiny_llama
    probe = Prompt(0, list(range(5, 30)), SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True))
    alone, _, _ = run_engine(tiny_engine, [probe])
    crowd = [dataclasses.replace(p, index=p.index + 1) for p in random_prompts(7, cfg.vocab_size, seed=2)]
    together, _, _ = run_engine(tiny_engine, [probe] + crowd)
    assert alone[0] == together[0]


def test_pool_is_donated_and_memory_flat_over_200_steps(tiny_engine, tiny_llama):
    cfg, _ = tiny_llama
    old_pool = tiny_engine.pool
    run_engine(tiny_engine, [Prompt(0, [3, 4, 5], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))])
    assert old_pool.k.is_deleted() and old_pool.v.is_deleted(), "the step did not donate the pool"
    prompts = [Prompt(i, [1 + i, 2, 3], SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)) for i in range(8)]
    run_engine(tiny_engine, prompts)  # warm every path once
    before = sum(a.nbytes for a in jax.live_arrays())
    steps = 0
    while steps < 200:
        _, stats, _ = run_engine(tiny_engine, prompts)
        steps += stats.num_steps
    after = sum(a.nbytes for a in jax.live_arrays())
    assert after <= before, f"live device bytes grew from {before} to {after} over {steps} steps"


def test_pool_that_cannot_fit_fails_at_start_with_bytes(tiny_llama):
    cfg, params = tiny_llama
    with pytest.raises(PoolTooLargeError, match=r"needs \d+ bytes .* \d+ bytes .* available"):
        Engine(cfg, params, EngineConfig(num_pages=10**9, max_context=128, compilation_cache_dir=None))


def test_out_of_range_page_id_rejected_on_host(tiny_engine):
    scheduler = Scheduler(tiny_engine.engine_cfg, tiny_engine.num_pages)
    from jaxinfer.scheduling.request import Request

    scheduler.add(Request("x", [1, 2, 3], SamplingParams(max_tokens=1), seed=0))
    (plan,) = scheduler.schedule()
    bad = dataclasses.replace(plan, block_tables=plan.block_tables + tiny_engine.num_pages)
    with pytest.raises(ValueError, match="page ids outside"):
        tiny_engine.step(bad)


def test_pool_layout_matches_kernel_layout(tiny_engine, tiny_llama):
    cfg, _ = tiny_llama
    n, g, p, k, l = tiny_engine.pool.k.shape
    assert (n, g, p, k, l) == (cfg.num_layers, cfg.num_kv_heads, tiny_engine.num_pages, cfg.head_dim, 8)
    assert tiny_engine.pool.v.shape == (n, g, p, l, k)
    assert kvp.pool_bytes(cfg, p, l) == tiny_engine.pool.k.nbytes + tiny_engine.pool.v.nbytes
