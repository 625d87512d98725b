"""The run loop's isolation rules, host only: a failing step fails only its own rows, and work that can
never be planned ends as errors instead of a spin."""

import pytest

from jaxinfer.scheduling import runloop
from jaxinfer.scheduling.stopping import OutputProcessor
from jaxinfer.scheduling.scheduler import Scheduler

from fakes import FakePagedEngine, expected_output, request, small_config


def test_a_step_that_raises_fails_only_the_requests_in_its_plan():
    # Unpacked one-row prefill, so each request's first step is its own plan (a packed row would hold all three).
    scheduler = Scheduler(small_config(prefill_seq_buckets=(1,), prefill_packing=False), num_pages=20)
    engine = FakePagedEngine(20, 4)
    requests = [request(f"r{i}", 5, 3, i) for i in range(3)]
    for r in requests:
        scheduler.add(r)

    def step(plan):
        if "r1" in plan.request_ids:
            raise RuntimeError("device fault")
        return engine.step(plan)

    finished = list(runloop.run(scheduler, step, OutputProcessor(None, None, 32)))
    assert sorted(r.request_id for r in finished) == ["r0", "r1", "r2"]
    r0, r1, r2 = requests
    assert r1.finish_reason == "error" and "RuntimeError: device fault" in r1.error
    assert r0.output_ids == expected_output(r0) and r2.output_ids == expected_output(r2)
    assert scheduler.block_pool.num_free == 19  # the failed request's pages came back too


def test_work_that_can_never_be_planned_ends_as_errors_not_a_spin():
    scheduler = Scheduler(small_config(), num_pages=3)
    too_big = request("big", 20, 4)  # needs 6 pages of 4; the pool has 2 (bypassing add's check)
    scheduler.waiting.append(too_big)
    finished = list(runloop.run(scheduler, FakePagedEngine(3, 4).step, OutputProcessor(None, None, 32)))
    assert finished == [too_big] and too_big.finish_reason == "error" and "no step could be planned" in too_big.error
    assert not scheduler.has_work()


def test_dry_run_plans_the_schedule_of_a_real_run():
    # The hashing fake engine draws data-dependent tokens; the dry run draws 0s. With length stops the
    # schedule is the same: same keys, same padding, same pages.
    cfg = small_config(prefill_seq_buckets=(1,))
    prompts = [request(f"r{i}", n, m, i) for i, (n, m) in enumerate([(5, 3), (11, 1), (2, 6), (9, 4), (7, 2)])]
    scheduler = Scheduler(cfg, num_pages=20)
    for r in prompts:
        scheduler.add(r)
    keys = []
    list(runloop.run(scheduler, FakePagedEngine(20, 4).step, OutputProcessor(None, None, 32), on_step=lambda plan, *_: keys.append(plan.bucket)))
    plans, stats = runloop.dry_run(cfg, [r.prompt_ids for r in prompts], [r.params.max_tokens for r in prompts], num_pages=20)
    assert [p.bucket for p in plans] == keys
    assert (stats.real_tokens, stats.padded_tokens) == (scheduler.stats.real_tokens, scheduler.stats.padded_tokens)
    assert stats.padded_tokens > stats.real_tokens  # the small tables pad: a test that could see a difference


def test_dry_run_names_requests_the_limits_cannot_hold():
    with pytest.raises(ValueError, match="needs 6 KV pages; the pool has 2"):  # Scheduler.add refuses it by name
        runloop.dry_run(small_config(), [[1] * 20], [4], num_pages=3)
