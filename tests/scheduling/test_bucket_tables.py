"""BucketTables, the one owner of bucket geometry: every plan the scheduler builds has a key the engine
compiled, for any valid EngineConfig and any jaxinfer.bucketing.strategies strategy; a few such configs warm up and
run on the tiny model with greedy outputs equal to the dense argmax and no compile after warm-up."""

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from jaxinfer.scheduling import runloop
from jaxinfer.bucketing.strategies import STRATEGY_KINDS, EngineBuckets, FixedList, PowersOfTwo
from jaxinfer.scheduling.bucket_tables import BucketTables, cut_table
from jaxinfer.config import EngineConfig
from jaxinfer.scheduling.stopping import OutputProcessor
from jaxinfer.scheduling.plan import BucketKey
from jaxinfer.scheduling.request import Request, SamplingParams
from jaxinfer.validation import FieldError
from jaxinfer.scheduling.scheduler import Scheduler

from fakes import FakePagedEngine, expected_output

KINDS = sorted(STRATEGY_KINDS)


@st.composite
def engine_configs(draw, max_context_pages: int = 16):
    """Random limits; a random strategy kind and budget for each bucketed dimension (or the defaults)."""
    page_size = draw(st.sampled_from([2, 4, 8, 16]))
    max_context = page_size * draw(st.integers(1, max_context_pages))
    max_num_seqs = draw(st.integers(1, 80))
    limits = dict(
        page_size=page_size, max_context=max_context, max_num_seqs=max_num_seqs,
        max_prefill_tokens=draw(st.integers(1, 600)), compilation_cache_dir=None,
        prefill_packing=draw(st.sampled_from([None, True, False])), max_prefill_seqs=draw(st.integers(1, 10)),
    )
    if draw(st.booleans()):
        kind, budget = draw(st.sampled_from(KINDS)), draw(st.integers(1, 6))
        samples = lambda top: draw(st.lists(st.integers(1, top), min_size=1, max_size=30))  # noqa: E731
        limits["buckets"] = EngineBuckets.from_samples(
            kind, budget, chunk=samples(max(1, min(limits["max_prefill_tokens"], max_context))), rows=samples(max_num_seqs), pages=samples(max_context // page_size)
        )
    return EngineConfig(**limits)


def run_fake(cfg: EngineConfig, lengths: list[tuple[int, int]], num_pages: int):
    scheduler = Scheduler(cfg, num_pages)
    requests = []
    for i, (prompt, out) in enumerate(lengths):
        prompt = min(prompt, cfg.max_context - 1)
        out = min(out, cfg.max_context - prompt)
        requests.append(Request(str(i), [(7 * i + 3 * j + 1) % 1000 for j in range(prompt)], SamplingParams(max_tokens=out, ignore_eos=True), seed=0, arrival_index=i))
        scheduler.add(requests[-1])
    engine, plans = FakePagedEngine(num_pages, cfg.page_size), []
    list(runloop.run(scheduler, engine.step, OutputProcessor(None, None, cfg.max_context), on_step=lambda plan, *_: plans.append(plan)))
    return requests, plans


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=engine_configs(), lengths=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 40)), min_size=1, max_size=12), data=st.data())
def test_every_plan_of_any_config_has_a_compiled_key(cfg, lengths, data):
    num_pages = data.draw(st.integers(cfg.max_pages_per_seq + 1, cfg.max_pages_per_seq * 3 + 2))
    tables = BucketTables.from_config(cfg)
    keys = set(tables.all_keys())
    assert all(isinstance(k, BucketKey) for k in keys) and len(keys) == len(tables.all_keys())
    requests, plans = run_fake(cfg, lengths, num_pages)
    for plan in plans:
        assert plan.bucket in keys, (plan.bucket, tables)
        assert plan.logit_indices.shape == (plan.bucket.num_rows, tables.samples_per_row(plan.phase))
        assert len(plan.request_ids) <= plan.logit_indices.size
    for r in requests:  # the fake engine's tokens hash each sequence's whole context: layout errors show here
        assert r.error is None and r.output_ids == expected_output(r), r.request_id
    if tables.packed and any(p.phase == "prefill" and len(p.request_ids) > 1 for p in plans):
        assert tables.prefill_rows == (1,)


def test_strategies_cut_to_the_limits():
    assert cut_table((16, 64, 256, 1024), 512, reach=False) == (16, 64, 256, 512)
    assert cut_table((16, 64), 512, reach=False) == (16, 64)  # longer prompts are chunked at 64
    assert cut_table((16, 64), 512, reach=True) == (16, 64, 512)
    cfg = EngineConfig(max_num_seqs=24, max_context=512, page_size=16, buckets=EngineBuckets(chunk=FixedList((48, 100, 900)), rows=PowersOfTwo(8, 2), pages=FixedList((3,))))
    tables = BucketTables.from_config(cfg)
    assert (tables.chunk_tokens, tables.decode_rows, tables.pages) == ((48, 100, 512), (2, 4, 8, 24), (3, 32))


def test_strategies_and_tables_are_one_or_the_other():
    with pytest.raises(FieldError, match="buckets.*leave prefill_chunk_buckets unset"):
        EngineConfig(buckets=EngineBuckets(chunk=FixedList((64,))), prefill_chunk_buckets=(32,))
    with pytest.raises(FieldError, match="buckets"):
        EngineConfig(buckets=(16, 32))
    with pytest.raises(FieldError, match="deterministic"):
        EngineConfig(buckets=EngineBuckets(rows=FixedList((4,))), deterministic=True)
    with pytest.raises(FieldError, match="prefill_packing"):
        EngineConfig(prefill_packing=True, deterministic=True)
    with pytest.raises(FieldError, match="prefill_seq_buckets"):
        EngineConfig(prefill_packing=True, prefill_seq_buckets=(1, 2))
    packed = lambda **fields: BucketTables.from_config(EngineConfig(**fields)).packed  # noqa: E731
    assert packed(prefill_seq_buckets=(1, 2)) is False  # several rows asked for: unpacked
    assert packed() is True and packed(deterministic=True) is False


def test_overrides_rederive_tables_from_the_strategies():
    base = EngineConfig(max_num_seqs=16, buckets=EngineBuckets(rows=FixedList((2, 8))))
    assert BucketTables.from_config(base).decode_rows == (2, 8, 16)
    assert BucketTables.from_config(EngineConfig.with_overrides(base, max_num_seqs=64)).decode_rows == (2, 8, 64)


@pytest.mark.slow
@settings(max_examples=3, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate), suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(cfg=engine_configs(max_context_pages=4), seed=st.integers(0, 2**16))
@example(cfg=EngineConfig(max_context=256, page_size=64, max_num_seqs=64, max_prefill_tokens=64), seed=0)  # review 2026-12: failed at warm-up / was rejected
def test_any_config_warms_up_and_runs_on_the_tiny_model(tiny_llama, compile_cache, cfg, seed):
    import dataclasses

    from jaxinfer.scheduling.request import Prompt
    from jaxinfer.engine.engine import CompileCounter, Engine
    from engine_runs import assert_greedy_is_dense_argmax, run_engine

    model_cfg, params = tiny_llama
    cfg = dataclasses.replace(cfg, compilation_cache_dir=compile_cache, num_pages=cfg.max_pages_per_seq * 4 + 1)
    engine = Engine(model_cfg, params, cfg)
    engine.warmup()
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(6):
        length = int(rng.integers(1, cfg.max_context))
        max_tokens = int(rng.integers(1, cfg.max_context - length + 1))
        prompts.append(Prompt(i, rng.integers(0, model_cfg.vocab_size, length).tolist(), SamplingParams(temperature=0.0, max_tokens=min(max_tokens, 12), ignore_eos=True)))
    with CompileCounter() as counter:
        outputs, _, plans = run_engine(engine, prompts)
    assert counter.count == 0, counter.events
    assert {p.bucket for p in plans} <= set(engine.bucket_keys())
    assert_greedy_is_dense_argmax(model_cfg, params, prompts, outputs)


def test_config_is_a_leaf_and_keeps_only_the_tables_given():
    """EngineConfig imports nothing of the package but validation, and holds what the user gave: tables
    left at None stay None there, and BucketTables.from_config derives them (one object per config)."""
    import subprocess
    import sys

    # What the import adds to what start-up loaded (jaxinfer_lm_eval.pth imports the package's lazy root at start-up).
    code = ("import sys; before = set(sys.modules); import jaxinfer.config; "
            "print(sorted(m for m in set(sys.modules) - before if m.startswith('jaxinfer.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "['jaxinfer.config', 'jaxinfer.validation']", loaded
    cfg = EngineConfig(max_num_seqs=6, max_context=256, page_size=16)
    assert (cfg.prefill_chunk_buckets, cfg.decode_batch_buckets, cfg.decode_page_buckets) == (None, None, None)
    tables = BucketTables.from_config(cfg)
    assert (tables.decode_rows, tables.pages) == ((1, 4, 6), (1, 2, 4, 8, 16))
    assert BucketTables.from_config(EngineConfig(max_num_seqs=6, max_context=256, page_size=16)) is tables
    assert EngineConfig(decode_batch_buckets=[4, 32]).decode_batch_buckets == (4, 32)  # a list given is kept as a tuple
