"""Online bucket refit: drift in the prefill sizes is detected and a refitted chunk table swapped in between
steps. The shift tests run the real scheduler on a fake step (runloop, host only); one test refits a real
engine in the background."""

import os

import numpy as np
import pytest

from jaxinfer.batch.refit import DriftWatch, padding, refit_chunk_table, with_chunk_table
from jaxinfer.bucketing.strategies import fit_buckets
from jaxinfer.config import EngineConfig
from jaxinfer.scheduling import runloop
from jaxinfer.scheduling.bucket_tables import BucketTables, cut_table
from jaxinfer.scheduling.plan import BucketKey, RowChunk, StepPlan
from jaxinfer.scheduling.request import Request, SamplingParams
from jaxinfer.scheduling.scheduler import Scheduler
from jaxinfer.scheduling.stopping import OutputProcessor

CONFIG = EngineConfig(num_pages=600, max_num_seqs=8, max_prefill_tokens=512, max_context=1024)
TOP = 512


def test_padding_counts_padded_slots_and_chunks_rows_over_the_top():
    # 10 -> 16, 30 -> 32, 70 = 64 + 6 -> 64 + 16: real 110 of 128 slots
    assert padding(np.array([10, 30, 70]), (16, 32, 64)) == pytest.approx(1 - 110 / 128)
    assert padding(np.array([16, 64]), (16, 32, 64)) == 0.0


def test_refit_keeps_the_bucket_count_and_the_largest_bucket():
    sizes = np.array([40] * 50 + [200] * 50 + [512] * 5)
    table = refit_chunk_table(sizes, (64, 128, 512))
    assert table == (48, 208, 512)  # fit_buckets of the sizes below the top, 2 buckets, multiples of 16; then the top
    assert padding(sizes, table) < padding(sizes, (64, 128, 512))


def _lengths(rng, count: int, mean: float) -> np.ndarray:
    return np.clip(rng.lognormal(np.log(mean), 0.35, count).astype(int), 8, 900)


def _run(lengths, table, *, watch=None, shift_at=None):
    """Dry run of prompts of these lengths (8 to 48 output tokens, staggered so that requests finish apart) on `table`; the watch may swap the table between
    steps. Returns (real, padded) prefill token slots of the steps that prefill a request from shift_at on."""
    cfg = with_chunk_table(CONFIG, table)
    scheduler = Scheduler(cfg, CONFIG.num_pages)
    for i, n in enumerate(lengths):
        scheduler.add(Request(str(i), [i + 2] + [1] * (int(n) - 1), SamplingParams(temperature=0.0, max_tokens=8 + (i * 7) % 41, ignore_eos=True), seed=0, arrival_index=i))
    slots = [0, 0]

    def on_step(plan, tokens, seconds):
        if plan.phase == "prefill" and any(int(r) >= (shift_at or 0) for r in plan.request_ids):
            slots[0] += sum(plan.num_new_tokens)
            slots[1] += plan.bucket.num_rows * plan.bucket.num_tokens
        new = watch.observe(plan) if watch is not None else None
        if new is not None:  # what Refit does once the programs are compiled: the scheduler takes the new tables
            scheduler.cfg = with_chunk_table(scheduler.cfg, new)
            scheduler.tables = BucketTables.from_config(scheduler.cfg)
            watch.reset(new)

    fake_step = lambda plan: np.zeros(plan.seeds.shape[0], np.int32)  # noqa: E731
    finished = list(runloop.run(scheduler, fake_step, OutputProcessor(None, None, CONFIG.max_context), on_step=on_step))
    assert len(finished) == len(lengths) and all(r.finish_reason == "length" for r in finished)
    return slots


def _fitted(lengths, count: int) -> tuple[int, ...]:
    """The chunk table a plan fits: its packed-row sizes on a fine table, count - 1 buckets plus the top."""
    fine = tuple(range(16, TOP, 16)) + (TOP,)
    sizes = []
    watch = DriftWatch(fine, window=10**9, every=10**9)
    watch.observe = lambda plan, sizes=sizes: sizes.append(sum(plan.num_new_tokens)) if plan.phase == "prefill" else None
    _run(lengths, fine, watch=watch)
    return cut_table(fit_buckets(np.minimum(sizes, TOP - 1), count - 1, multiple_of=16), TOP, reach=True)


def test_after_a_shift_in_the_middle_the_refitted_padding_is_within_two_points_of_a_second_half_table():
    rng = np.random.default_rng(0)
    first, second = _lengths(rng, 600, 25), _lengths(rng, 600, 330)
    planned = _fitted(first, 6)  # what a plan made from the first half would compile
    watch = DriftWatch(planned)
    real, padded = _run(np.concatenate([first, second]), planned, watch=watch, shift_at=len(first))
    refitted = 1 - real / padded
    real, padded = _run(second, _fitted(second, 6))
    alone = 1 - real / padded
    real, padded = _run(np.concatenate([first, second]), planned, shift_at=len(first))
    stale = 1 - real / padded
    assert watch.table != planned  # it refitted
    assert refitted - alone < 0.02 < stale - alone  # and the stale table would have been over two points worse


def _prefill(size: int) -> StepPlan:
    """A real packed prefill plan of one sequence's `size`-token chunk (what the watch reads: phase, tokens, rows)."""
    size = min(size, TOP)  # a longer prompt is chunked at the top
    request = Request("0", [1] * size, SamplingParams(), seed=0)
    return StepPlan.build("prefill", [RowChunk(request, 0, size, [1] * (-(-size // 64)), True)], BucketKey("prefill", 1, TOP, 8), 64, packed=8)


def test_a_shift_is_proposed_within_two_windows_keeping_the_bucket_count_and_the_top():
    rng = np.random.default_rng(1)
    table = cut_table(fit_buckets(_lengths(rng, 5000, 60), 5, multiple_of=16), TOP, reach=True)
    watch = DriftWatch(table)
    for n in _lengths(rng, watch.window, 60):
        watch.observe(_prefill(int(n)))
    proposals = [watch.observe(_prefill(int(n))) for n in _lengths(rng, 2 * watch.window, 330)]
    new = next(p for p in proposals if p is not None)
    assert len(new) == len(table) and new[-1] == TOP and new[0] > table[0]
    assert padding(_lengths(rng, 2000, 330), new) < padding(_lengths(rng, 2000, 330), table) - 0.1


def _proposals(watch: DriftWatch, sizes) -> list[int]:
    """The prefill steps at which the watch proposed a table, fed one row of each size (swapped in at once)."""
    plans, steps = {}, []
    for step, n in enumerate(np.minimum(sizes, TOP)):
        plan = plans.setdefault(int(n), _prefill(int(n)))
        new = watch.observe(plan)
        if new is not None:
            steps.append(step)
            watch.reset(new)
    return steps


@pytest.mark.parametrize("sigma", [0.35, 0.8])
def test_sizes_from_the_distribution_the_table_was_fitted_to_never_refit_and_a_shift_does_within_a_window(sigma):
    for seed in range(3):
        rng = np.random.default_rng(seed)
        table = cut_table(fit_buckets(np.minimum(_lengths_of(rng, 5000, 60, sigma), TOP - 1), 5, multiple_of=16), TOP, reach=True)
        assert _proposals(DriftWatch(table), _lengths_of(rng, 2000, 60, sigma)) == []  # heavy tails are noise, not drift
    shifted = np.concatenate([_lengths_of(rng, 1000, 60, 0.35), _lengths_of(rng, 1000, 300, 0.35)])
    table = cut_table(fit_buckets(np.minimum(_lengths_of(rng, 5000, 60, 0.35), TOP - 1), 5, multiple_of=16), TOP, reach=True)
    watch = DriftWatch(table)
    (step,) = _proposals(watch, shifted)  # once, and not again on the new sizes
    assert 1000 < step <= 1000 + watch.window and padding(shifted[1000:], watch.table) < padding(shifted[1000:], table) - 0.1


def _lengths_of(rng, count: int, mean: float, sigma: float) -> np.ndarray:
    return np.clip(rng.lognormal(np.log(mean), sigma, count).astype(int), 8, 900)


@pytest.mark.slow
def test_a_real_engine_compiles_the_refitted_programs_in_the_background_and_every_plan_finds_its_program(tiny_chat_model, compile_cache):
    from jaxinfer.api import LLM
    from jaxinfer.batch.refit import YIELD_SHARE, Refit

    # one sequence at a time, so that each prefill step holds one prompt (packed rows would fill the 512 top)
    # (no prefix cache: each prompt prefills whole, not the few tokens past the previous prompt's pages)
    llm = LLM(str(tiny_chat_model), compilation_cache_dir=compile_cache, num_pages=96, max_num_seqs=1, max_context=512,
              prefill_chunk_buckets=(16, 32, 512), enable_prefix_caching=False)  # a table fitted to short prompts; these are ~150 tokens
    warm = llm.engine.num_compilations
    seconds = []  # each step's, in order (Refit counts steps from 1)
    hook = Refit(llm, watch=DriftWatch((16, 32, 512), window=4, every=2), chain=lambda plan, tokens, s: seconds.append(s))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # Sizes in the same range in every 4-row window (120, 147, 138, 129, ...): the drift judge fits a table to a
    # window's older half and needs it to save on the newer half, so that half must lie within the older's sizes.
    prompts = [llm.prepare("word " * (120 + 9 * (3 * i % 4)), params, index=i) for i in range(16)]
    first = list(llm.stream(prompts[:8], on_step=hook))
    assert hook._pending is not None or hook.swaps  # drift seen: the compile is under way (or done and swapped)
    if hook._pending is not None:
        assert "still compiling" in hook.report() and "no drift" not in hook.report()  # a job ending now says its refit went unused
        hook._pending[0].result()  # let it finish; the next stream's first step swaps it in
    second = list(llm.stream(prompts[8:], on_step=hook))
    hook.close()
    (swap,) = hook.swaps
    assert swap.old_table == (16, 32, 512) and swap.new_table != swap.old_table and swap.new_table[-1] == 512
    assert swap.compile_started < swap.compile_ended <= swap.swapped_at and swap.compile_s == swap.compile_ended - swap.compile_started
    assert swap.compile_nice in (19, None)  # the lowest priority, or a platform that cannot set a thread's
    assert swap.quieted_threads > 0 or not os.path.isdir("/proc/self/task")  # XLA's compile pools, idle while it stepped
    # every step between the ask and the swap slept yield_share of its seconds for the compile, with the compile's threads
    # at their own priority meanwhile where raising a priority is allowed (root)
    assert swap.yield_share == YIELD_SHARE and swap.num_yields == swap.swapped_at_step - swap.asked_at_step - 1
    assert swap.yield_s >= YIELD_SHARE * sum(seconds[swap.asked_at_step : swap.swapped_at_step - 1])
    assert swap.yield_raised == (swap.num_yields > 0 and os.geteuid() == 0) or not os.path.isdir("/proc/self/task")
    assert llm.engine.refit_compilations == swap.num_programs > 0 and llm.engine.num_compilations == warm + swap.num_programs
    tables = BucketTables.from_config(llm.engine_config)
    assert tables.chunk_tokens == swap.new_table and llm.engine.engine_cfg == llm.engine_config
    assert all(s.tables == tables for s in llm.stream_run.schedulers)
    assert set(tables.all_keys()) <= set(llm.engine._programs)
    assert [o.finish_reason for o in first + second] == ["length"] * 16  # no step lacked its program


def test_the_runtimes_exact_fit_equals_the_offline_fit_buckets():
    from jaxinfer.batch.refit import fit_table

    rng = np.random.default_rng(0)
    for _ in range(200):
        sizes = rng.integers(1, 700, rng.integers(1, 300))
        count, multiple = int(rng.integers(1, 12)), int(rng.choice([1, 16]))
        assert fit_table(sizes, count, multiple_of=multiple) == fit_buckets(sizes, count, multiple_of=multiple)
    assert fit_table([10, 10, 30, 80], 2) == (30, 80)  # by hand: {10, 10, 30} to 30 and {80}: 170 slots; {10, 10} and {30, 80}: 180


def test_quieting_lowers_only_the_threads_idle_between_two_snapshots_and_restoring_gives_their_priority_back():
    import os
    import threading
    import time

    from jaxinfer.batch.refit import quiet_idle_threads, restore_threads, thread_cpu

    if not os.path.isdir("/proc/self/task"):
        pytest.skip("thread CPU times come from Linux /proc")
    stop, ids = threading.Event(), {}

    def spin():
        ids["busy"] = threading.get_native_id()
        while not stop.is_set():
            sum(range(1000))

    def wait():
        ids["idle"] = threading.get_native_id()
        stop.wait()

    threads = [threading.Thread(target=spin), threading.Thread(target=wait)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    before = thread_cpu()
    while thread_cpu()[ids["busy"]] <= before[ids["busy"]]:  # a clock tick of the busy thread's CPU
        time.sleep(0.01)
    quieted = quiet_idle_threads(before, thread_cpu(), {threading.get_native_id()})
    try:
        assert ids["idle"] in quieted and os.getpriority(os.PRIO_PROCESS, ids["idle"]) == 19
        if hasattr(os, "SCHED_IDLE"):
            assert os.sched_getscheduler(ids["idle"]) == os.SCHED_IDLE and os.sched_getscheduler(ids["busy"]) != os.SCHED_IDLE
        assert ids["busy"] not in quieted and threading.get_native_id() not in quieted
        failed = restore_threads(quieted)
        if failed == 0:  # with CAP_SYS_NICE (or a nice value it may raise back to)
            assert os.getpriority(os.PRIO_PROCESS, ids["idle"]) == quieted[ids["idle"]]
            assert not hasattr(os, "SCHED_IDLE") or os.sched_getscheduler(ids["idle"]) == os.SCHED_OTHER
        else:  # without, none can be raised back
            assert failed == len(quieted)
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_the_gate_holds_a_compile_threads_python_while_shut_until_opened_or_its_deadline():
    import sys
    import threading
    import time

    from jaxinfer.batch.refit import _Gate

    gate, calls, stop = _Gate(), [0], threading.Event()

    def count():
        calls[0] += 1

    def run():
        sys.settrace(gate.trace)  # this thread only, as Refit's compile thread
        while not stop.is_set():
            count()
        sys.settrace(None)

    def held(seconds: float) -> bool:
        start = calls[0]
        time.sleep(seconds)
        return calls[0] == start

    def resumes() -> float:
        """perf_counter when the thread next made a call (it may wait for a core on a loaded machine)."""
        start, until = calls[0], time.perf_counter() + 10
        while calls[0] == start and time.perf_counter() < until:
            time.sleep(0.001)
        assert calls[0] > start
        return time.perf_counter()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        resumes()  # open: runs
        gate.shut(60.0)
        time.sleep(0.05)  # it may finish the call it is in
        assert held(0.3)  # shut: no Python call passes
        gate.open()
        resumes()
        gate.shut(1.0)
        deadline = time.perf_counter() + 1.0
        time.sleep(0.05)
        assert held(0.2)
        assert resumes() >= deadline - 0.06  # past the deadline it goes on by itself (a job that ended with the gate shut)
    finally:
        gate.open()
        stop.set()
        thread.join()
