"""The engine's step-cost table: every program timed at warm-up on plans that touch only the null page,
refined by every step, persisted per machine and model (tuning_cache), and read back on the next start."""

import numpy as np
import pytest

from jaxinfer.config import EngineConfig
from jaxinfer.engine import tuning_cache
from jaxinfer.engine.engine import CompileCounter, Engine
from jaxinfer.scheduling import runloop
from jaxinfer.scheduling.bucket_tables import BucketTables
from jaxinfer.scheduling.request import Request, SamplingParams
from jaxinfer.scheduling.scheduler import Scheduler
from jaxinfer.scheduling.stopping import OutputProcessor

ENGINE = dict(page_size=8, max_context=64, max_num_seqs=4, max_prefill_tokens=16, num_pages=20, prefill_chunk_buckets=(16,),
              decode_batch_buckets=(4,), decode_page_buckets=(2, 8))


@pytest.fixture
def cost_cache(tmp_path, monkeypatch):
    """The tuner's cache root in a temporary folder (only its step_costs part: the kernels' cache stays where it is)."""
    monkeypatch.setattr(tuning_cache, "cache_dir", lambda: tmp_path)
    monkeypatch.setenv(tuning_cache.STEP_TIMING_ENV, "2")
    return tmp_path


def test_warm_up_times_every_program_on_the_null_page_and_saves_the_table(tiny_llama, compile_cache, cost_cache):
    cfg, params = tiny_llama
    engine = Engine(cfg, params, EngineConfig(**ENGINE, compilation_cache_dir=compile_cache))
    before = np.asarray(engine.pool.k)[:, :, 1:].copy()  # every real page (k is [layers, kv heads, pages, K, L])
    engine.warmup()
    keys = engine.bucket_keys()
    assert [k for k, _, _ in engine.step_costs.table()] == sorted(keys)
    assert all(len(engine.step_costs.programs[k].warmup) == 2 and engine.step_costs.programs[k].count == 0 for k in keys)
    np.testing.assert_array_equal(np.asarray(engine.pool.k)[:, :, 1:], before)  # the timing runs wrote the null page only
    saved = list((cost_cache / "step_costs").glob("*.json"))
    assert len(saved) == 1 and saved[0].stem == engine.costs_key()

    # a second engine of the same model and settings reads the table instead of timing again
    again = Engine(cfg, params, EngineConfig(**ENGINE, compilation_cache_dir=compile_cache))
    again.time_programs()
    assert [k for k, _, _ in again.step_costs.table()] == [k for k, _, _ in engine.step_costs.table()]
    assert [s for _, _, s in again.step_costs.table()] == pytest.approx([s for _, _, s in engine.step_costs.table()], abs=1e-6)  # 7 decimals in the file

    # real steps refine it, and add no compile
    scheduler = Scheduler(engine.engine_cfg, engine.num_pages)
    for i in range(3):
        scheduler.add(Request(str(i), list(range(5 + 4 * i)), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), seed=i))
    with CompileCounter() as compiles:
        done = list(runloop.run(scheduler, engine.step, OutputProcessor(None, None, 64)))
    assert len(done) == 3 and compiles.count == 0
    assert sum(obs.count for obs in engine.step_costs.programs.values()) == scheduler.stats.num_steps


def test_a_second_warm_up_reads_the_cache_once_and_every_table_shares_one_file(tiny_llama, compile_cache, cost_cache):
    import dataclasses

    cfg, params = tiny_llama
    Engine(cfg, params, EngineConfig(**ENGINE, compilation_cache_dir=compile_cache)).warmup()  # fills the cache file
    engine = Engine(cfg, params, EngineConfig(**ENGINE, compilation_cache_dir=compile_cache))
    engine.time_programs()
    engine.time_programs()  # a second warm-up (another table swapped in and out) must not merge the file again
    assert all(len(obs.warmup) == 2 for obs in engine.step_costs.programs.values())
    first_key, costs = engine.costs_key(), engine.step_costs
    other = dataclasses.replace(engine.engine_cfg, prefill_chunk_buckets=(8, 16), max_num_seqs=2)  # a plan's or a refit's table and limits
    elsewhere = Engine(cfg, params, other)
    assert elsewhere.costs_key() == first_key  # a program key fixes its shapes: its seconds are the same under any table
    engine.use_config(other)
    engine.warmup()
    assert engine.costs_key() == first_key and engine.step_costs is costs  # the table llm.step_costs() gave is the one still refined
    new_keys = set(engine.bucket_keys()) - set(Engine(cfg, params, EngineConfig(**ENGINE)).bucket_keys())
    assert new_keys and all(len(engine.step_costs.programs[k].warmup) == 2 for k in new_keys)  # only the new table's keys were timed
    assert all(len(obs.warmup) == 2 for obs in engine.step_costs.programs.values())  # a key of both tables is not timed twice
    assert [p.stem for p in (cost_cache / "step_costs").glob("*.json")] == [first_key]
    saved = tuning_cache.read_step_costs(cost_cache, first_key)
    assert set(engine.bucket_keys()) | new_keys <= set(saved.programs)  # both tables' programs in the one file
    packed = Engine(cfg, params, dataclasses.replace(engine.engine_cfg, prefill_packing=not BucketTables.from_config(engine.engine_cfg).packed))
    assert packed.costs_key() != first_key  # a packed prefill program is another program under the same key
    with pytest.raises(ValueError, match="cannot change prefill_packing"):  # so a built engine's programs cannot swap it
        engine.use_config(packed.engine_cfg)


def test_under_jaxinfer_tune_0_nothing_is_timed_read_or_written(tiny_llama, compile_cache, cost_cache, monkeypatch):
    monkeypatch.delenv(tuning_cache.STEP_TIMING_ENV)
    monkeypatch.setenv(tuning_cache.TUNE_ENV, "0")
    cfg, params = tiny_llama
    engine = Engine(cfg, params, EngineConfig(**ENGINE, compilation_cache_dir=compile_cache))
    engine.warmup()
    assert engine.step_costs.table() == []
    engine.step_costs.observe(engine.bucket_keys()[0], 0.1)
    engine.save_step_costs()
    assert not (cost_cache / "step_costs").exists()


def test_a_bad_step_timing_setting_is_named(monkeypatch):
    monkeypatch.setenv(tuning_cache.STEP_TIMING_ENV, "two")
    with pytest.raises(ValueError, match="JAXINFER_STEP_TIMING_RUNS"):
        tuning_cache.step_timing_runs()


def test_measure_compiles_and_times_only_the_keys_asked_and_warm_up_adds_the_rest(tiny_llama, compile_cache, cost_cache):
    cfg, params = tiny_llama
    engine = Engine(cfg, params, EngineConfig(**ENGINE, compilation_cache_dir=compile_cache))
    keys = engine.bucket_keys()
    asked = [keys[0], keys[-1]]
    engine.measure(asked)
    assert set(engine._programs) == set(asked) and set(engine.step_costs.programs) == set(asked)
    assert all(len(engine.step_costs.programs[k].warmup) == 2 for k in asked)
    timed = {k: list(engine.step_costs.programs[k].warmup) for k in asked}
    engine.warmup()
    assert set(engine._programs) == set(keys) and set(engine.step_costs.programs) == set(keys)
    assert {k: engine.step_costs.programs[k].warmup for k in asked} == timed  # measured once, not again at warm-up
    with pytest.raises(ValueError, match="not in them"):
        engine.measure([keys[0]._replace(num_pages=7)])


def test_a_plan_without_cached_step_costs_times_three_programs_a_phase_and_then_reads_them_back(tiny_llama, compile_cache, cost_cache, monkeypatch):
    import types

    from jaxinfer.batch import planning
    from jaxinfer.scheduling.plan import BucketKey

    cfg, params = tiny_llama
    engine = Engine(cfg, params, EngineConfig(**ENGINE, compilation_cache_dir=compile_cache))
    llm = types.SimpleNamespace(engine=engine)
    # max_context 512 and 16 sequences: 14 prefill keys and 16 decode keys; least, middle (8th of 15, 9th of 16) and most work
    assert planning.anchor_keys(EngineConfig(max_context=512, max_num_seqs=16)) == [
        BucketKey("prefill", 1, 32, 1), BucketKey("prefill", 1, 160, 4), BucketKey("prefill", 1, 512, 8),
        BucketKey("decode", 1, 1, 1), BucketKey("decode", 8, 1, 2), BucketKey("decode", 16, 1, 8)]
    anchors = planning.anchor_keys(engine.engine_cfg)  # ENGINE's tables: two keys a phase (2 and 8 pages), each an anchor
    assert sorted(anchors) == sorted(engine.bucket_keys())
    costs = planning.engine_costs(llm)
    assert costs is engine.step_costs and set(costs.programs) == set(anchors) and set(engine._programs) == set(anchors)
    again = Engine(cfg, params, EngineConfig(**ENGINE, compilation_cache_dir=compile_cache))
    assert set(planning.engine_costs(types.SimpleNamespace(engine=again)).programs) == set(anchors)  # the cache file the timing saved
    assert again._programs == {}  # read, not compiled again
    monkeypatch.setenv(tuning_cache.STEP_TIMING_ENV, "0")  # nothing timed: the prior
    assert set(planning.engine_costs(llm).programs) == set(planning.prior_costs().programs)


def test_a_plan_times_the_anchor_programs_a_cached_table_lacks(tiny_llama, compile_cache, cost_cache):
    """The tuner's probe engines save their few programs' timings under the engine's key: the plan times the rest."""
    import types

    from jaxinfer.batch import planning

    cfg, params = tiny_llama
    probe = Engine(cfg, params, EngineConfig(**ENGINE, compilation_cache_dir=compile_cache))
    anchors = planning.anchor_keys(probe.engine_cfg)
    probe.measure(anchors[:1])  # the cache file now holds one anchor
    engine = Engine(cfg, params, EngineConfig(**ENGINE, compilation_cache_dir=compile_cache))
    costs = planning.engine_costs(types.SimpleNamespace(engine=engine))
    assert set(costs.programs) == set(anchors) and set(engine._programs) == set(anchors[1:])
    assert costs.programs[anchors[0]].warmup == pytest.approx(probe.step_costs.programs[anchors[0]].warmup, abs=1e-6)  # read from the file


class _Bars:
    """warmup's `progress`: records each bar's description, total and updates."""

    def __init__(self):
        self.opened: list[list] = []  # [desc, total, updates, closed]

    def __call__(self, desc: str, total: int):
        record = [desc, total, 0, False]
        self.opened.append(record)

        class Bar:
            def update(self, n: int) -> None:
                record[2] += n

            def close(self) -> None:
                record[3] = True

        return Bar()


def test_warm_up_shows_a_bar_per_phase_with_work_each_with_its_total(tiny_llama, compile_cache, cost_cache):
    """Compiling (every program, draws included) and timing (every bucket key the table lacks): each bar counts
    up to its total and is closed; a warm-up with nothing left to do opens none."""
    cfg, params = tiny_llama
    engine = Engine(cfg, params, EngineConfig(**ENGINE, compilation_cache_dir=compile_cache))
    bars = _Bars()
    engine.warmup(bars)
    programs = engine.num_compilations
    assert programs > len(engine.bucket_keys())  # the draw programs too
    assert bars.opened == [["compiling programs", programs, programs, True], ["timing programs", len(engine.bucket_keys()), len(engine.bucket_keys()), True]]
    again = _Bars()
    engine.warmup(again)
    assert again.opened == [] and engine.num_compilations == programs
