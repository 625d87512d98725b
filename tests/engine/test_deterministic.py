"""Deterministic mode: a fixed request's logits are bitwise identical whatever else is in the batch,
its row, the padding, whether its prefix came from the cache, and whether it was preempted and
replayed. The control: outside deterministic mode the same comparison finds a difference, so the bitwise
test is able to fail on this backend."""

import numpy as np
import pytest

from jaxinfer.scheduling import runloop
from jaxinfer.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.scheduling.bucket_tables import BucketTables
from jaxinfer.scheduling.stopping import OutputProcessor
from jaxinfer.scheduling.request import Request, SamplingParams
from jaxinfer.scheduling.scheduler import Scheduler

NEEDLE = [(13 * i + 7) % 500 + 1 for i in range(37)]


def engine_for(tiny_llama, compile_cache, deterministic: bool) -> Engine:
    cfg, params = tiny_llama
    engine_cfg = EngineConfig(
        # 16 sequences: deterministic decode runs them as two 8-row programs. The scheduler may use fewer
        # pages than the pool holds (run_with_needle): 23 force preemption, 159 let 16 sequences decode.
        page_size=8, max_context=128, max_num_seqs=16, max_prefill_tokens=64, num_pages=160,
        compilation_cache_dir=compile_cache, deterministic=deterministic,
        # outside deterministic mode: rows of 1 / 2 (prefill) and 1 / 16 (decode) as batches vary, over the
        # page tables of deterministic mode (8 / 16 pages): 12 programs. The jnp path, whose XLA dots deterministic
        # mode also runs: on a CPU the needle's logits differ between a 1-row and a 16-row decode program (4 and
        # 16 rows were measured to round alike), and the CPU kernels' rows never depend on the batch.
        **({} if deterministic else dict(prefill_seq_buckets=(1, 2), decode_batch_buckets=(1, 16), decode_page_buckets=(8, 16),
                                         attention_impl="reference")),
    )
    engine = Engine(cfg, params, engine_cfg, return_logits=True)
    engine.warmup()
    return engine


def run_with_needle(engine: Engine, others: list[list[int]], position: int, params: SamplingParams, num_pages: int = 24):
    """The needle at `position` among `others`; returns (its tokens, its logits per drawn token, stats);
    stats gains `max_decoding`, the most requests in decode at once."""
    scheduler = Scheduler(engine.engine_cfg, num_pages)
    prompts = others[:position] + [NEEDLE] + others[position:]
    for i, prompt in enumerate(prompts):
        sp = params if i == position else SamplingParams(temperature=0.8, seed=i, max_tokens=8 + i % 13, ignore_eos=True)
        scheduler.add(Request(str(i), prompt, sp, seed=sp.seed if sp.seed is not None else i, arrival_index=i))
    drawn = []
    scheduler.stats.max_decoding = 0

    def on_step(plan, tokens, _):
        decoding = sum(scheduler.in_decode(r) for r in scheduler.running)
        scheduler.stats.max_decoding = max(scheduler.stats.max_decoding, decoding)
        for row, rid in enumerate(plan.request_ids):
            if rid == str(position) and plan.samples[row]:
                drawn.append(engine.last_logits[row].copy())

    finished = {r.request_id: r for r in runloop.run(scheduler, engine.step, OutputProcessor(None, None, 128), on_step=on_step)}
    assert len(finished) == len(prompts) and not any(r.error for r in finished.values())
    return finished[str(position)].output_ids, drawn, scheduler.stats


@pytest.fixture(scope="module")
def deterministic_engine(tiny_llama, compile_cache) -> Engine:
    return engine_for(tiny_llama, compile_cache, deterministic=True)  # warmed once for both parametrizations


def random_others(rng, count: int) -> list[list[int]]:
    others = []
    for _ in range(count):
        if rng.random() < 0.3:  # shares the needle's prefix: the needle may hit its pages
            others.append(NEEDLE[: int(rng.integers(9, 37))] + rng.integers(1, 500, int(rng.integers(1, 20))).tolist())
        else:
            others.append(rng.integers(1, 500, int(rng.integers(1, 70))).tolist())
    return others


def max_difference(alone, crowd) -> float:
    return max(float(np.abs(a - b).max()) for a, b in zip(alone, crowd))


@pytest.mark.slow
@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True), SamplingParams(temperature=1.0, seed=5, max_tokens=14, ignore_eos=True)], ids=["greedy", "seeded"])
def test_needle_logits_are_bitwise_equal_in_any_batch_in_deterministic_mode(deterministic_engine, params):
    engine = deterministic_engine
    tokens, alone, _ = run_with_needle(engine, [], 0, params)
    rng = np.random.default_rng(0)
    hits = preemptions = max_decoding = 0
    for trial in range(4):
        others = random_others(rng, int(rng.integers(2, 20)))
        position = int(rng.integers(0, len(others) + 1))
        crowd_tokens, crowd, stats = run_with_needle(engine, others, position, params, num_pages=(24, 160)[trial % 2])
        hits += stats.prefix_cache_hits
        preemptions += stats.num_preemptions
        max_decoding = max(max_decoding, stats.max_decoding)
        assert crowd_tokens == tokens, f"trial {trial}"
        assert len(crowd) == len(alone) and all(np.array_equal(a, b) for a, b in zip(alone, crowd)), f"trial {trial}: max |diff| {max_difference(alone, crowd)}"
    assert hits > 0 and preemptions > 0, "the trials were meant to include cache hits and preemptions"
    assert max_decoding > BucketTables.from_config(engine.engine_cfg).max_decode_rows, "the trials were meant to split a decode batch into programs"


@pytest.mark.slow
def test_outside_deterministic_mode_the_needle_logits_differ_across_batches(tiny_llama, compile_cache, record_property):
    """The control of the bitwise test: the same comparison, which must find a difference here."""
    engine = engine_for(tiny_llama, compile_cache, deterministic=False)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    _, alone, _ = run_with_needle(engine, [], 0, params)
    rng = np.random.default_rng(0)
    differences = []
    for _ in range(3):
        others = random_others(rng, int(rng.integers(2, 20)))
        _, crowd, _ = run_with_needle(engine, others, int(rng.integers(0, len(others) + 1)), params)
        differences.append(max_difference(alone, crowd))
    record_property("max_abs_logit_difference_outside_deterministic_mode", max(differences))
    assert max(differences) > 0, "batching never changed the needle's logits: the bitwise test could not fail here"


def test_deterministic_mode_fixes_the_tables_and_refuses_given_ones():
    cfg = EngineConfig(max_context=128, page_size=8, max_num_seqs=8, deterministic=True, compilation_cache_dir=None)
    tables = BucketTables.from_config(cfg)
    assert (tables.chunk_tokens, tables.prefill_rows, tables.decode_rows, tables.pages) == ((64,), (1,), (8,), (8, 16))
    assert BucketTables.from_config(EngineConfig(max_context=128, page_size=8, max_num_seqs=32, deterministic=True)).max_decode_rows == 8
    with pytest.raises(ValueError, match="deterministic fixes the bucket tables"):
        EngineConfig(deterministic=True, decode_batch_buckets=(4, 32))


def test_blockwise_attention_matches_attention_over_pages_and_ignores_extra_masked_blocks():
    import jax.numpy as jnp

    from jaxinfer.model.attention import attention_over_page_blocks, attention_over_pages

    rng = np.random.default_rng(3)
    b, t, h, g, k, l, p = 3, 4, 6, 2, 16, 4, 16
    q = jnp.asarray(rng.normal(size=(b, t, h, k)), jnp.float32)
    k_pages = jnp.asarray(rng.normal(size=(g, b, p, k, l)), jnp.float32)
    v_pages = jnp.asarray(rng.normal(size=(g, b, p, l, k)), jnp.float32)
    positions = jnp.asarray([[0, 1, 2, 3], [10, 11, 12, 13], [27, 28, 29, 30]], jnp.int32)  # all within 8 pages
    blocked = np.asarray(attention_over_page_blocks(q, k_pages, v_pages, positions))
    np.testing.assert_allclose(blocked, np.asarray(attention_over_pages(q, k_pages, v_pages, positions)), rtol=2e-5, atol=2e-6)
    narrow = np.asarray(attention_over_page_blocks(q, k_pages[:, :, :8], v_pages[:, :, :8], positions))
    assert np.array_equal(blocked, narrow), "a wholly masked block changed the output"


class IterationRecorder(Scheduler):
    """A Scheduler that keeps the plans of each iteration (each `schedule` call) for a test to inspect."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.iterations: list[list] = []

    def schedule(self):
        plans = super().schedule()
        self.iterations.append(plans)
        return plans


def test_deterministic_decode_batches_run_as_programs_of_eight_rows():
    """20 decoding requests: every iteration plans each of them once, in decode programs of 8 rows."""
    from jaxinfer.scheduling.block_pool import BlockPool

    cfg = EngineConfig(max_context=128, page_size=8, max_num_seqs=32, deterministic=True, compilation_cache_dir=None)
    scheduler = IterationRecorder(cfg, 200, block_pool=BlockPool(200))
    for i in range(20):
        scheduler.add(Request(str(i), list(range(1, 4 + i)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), seed=i, arrival_index=i))
    step = lambda plan: np.ones(plan.bucket.num_rows, np.int32)  # noqa: E731
    finished = list(runloop.run(scheduler, step, OutputProcessor(None, None, cfg.max_context)))
    assert sorted(r.finish_reason for r in finished) == ["length"] * 20
    decode_iterations = 0
    for plans in scheduler.iterations:
        decode_ids = [rid for plan in plans if plan.phase == "decode" for rid, n in zip(plan.request_ids, plan.num_new_tokens) if n]
        assert len(decode_ids) == len(set(decode_ids))
        assert all(plan.bucket.num_rows == 8 for plan in plans if plan.phase == "decode")
        if len(decode_ids) == 20:
            decode_iterations += 1
            assert sum(plan.phase == "decode" for plan in plans) == 3
    assert decode_iterations > 0
