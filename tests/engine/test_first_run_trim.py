"""Engine.step trims the C heap after each program's first run, once per bucket key (host_memory.trim_heap): where
warm-up runs no program (its step costs already cached, or JAXINFER_STEP_TIMING_RUNS=0), the first runs' one-time
transients would otherwise stay resident under the served steps' peak. Later runs of a key never trim (no cost per step)."""

from jaxinfer.config import EngineConfig
from jaxinfer.engine import host_memory, tuning_cache
from jaxinfer.engine.engine import Engine
from jaxinfer.scheduling import runloop
from jaxinfer.scheduling.request import Request, SamplingParams
from jaxinfer.scheduling.scheduler import Scheduler
from jaxinfer.scheduling.stopping import OutputProcessor

ENGINE = dict(page_size=8, max_context=64, max_num_seqs=4, max_prefill_tokens=16, num_pages=20, prefill_chunk_buckets=(16,),
              decode_batch_buckets=(4,), decode_page_buckets=(2, 8))


def _served(engine: Engine, seeds: range) -> list:
    """Run requests through the engine; returns the bucket keys of its steps, in order."""
    scheduler, keys = Scheduler(engine.engine_cfg, engine.num_pages), []
    for i in seeds:
        scheduler.add(Request(str(i), list(range(5 + 4 * i)), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), seed=i))
    done = list(runloop.run(scheduler, engine.step, OutputProcessor(None, None, 64), on_step=lambda plan, tokens, s: keys.append(plan.bucket)))
    assert len(done) == len(seeds)
    return keys


def test_each_programs_first_served_run_trims_the_heap_once(tiny_llama, compile_cache, monkeypatch):
    monkeypatch.setenv(tuning_cache.STEP_TIMING_ENV, "0")  # warm-up compiles but runs no program
    trims, real_trim = [], host_memory.trim_heap

    def counted():  # the real trim, counted
        trims.append(1)
        real_trim()

    monkeypatch.setattr(host_memory, "trim_heap", counted)
    cfg, params = tiny_llama
    engine = Engine(cfg, params, EngineConfig(**ENGINE, compilation_cache_dir=compile_cache))
    engine.warmup()
    trims.clear()  # warm-up's own trims (one per compiled program)
    keys = _served(engine, range(3))
    assert len(set(keys)) >= 2 and len(keys) > len(set(keys))  # several programs, some run more than once
    assert len(trims) == len(set(keys))
    trims.clear()
    again = _served(engine, range(3))
    assert set(again) <= set(keys) and trims == []  # programs already run: no trim
