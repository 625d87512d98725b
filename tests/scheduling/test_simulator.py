"""The simulator: the real scheduler on a virtual clock, checked against timelines computed by hand. Host only."""

import collections
import math
import sys

import numpy as np
import pytest

from jaxinfer.config import POLICIES
from jaxinfer.scheduling import runloop
from jaxinfer.scheduling.bucket_tables import BucketTables
from jaxinfer.scheduling.simulator import SimRequest, SimResult, simulate, slo_met
from jaxinfer.scheduling.step_costs import StepCosts

from fakes import small_config

PREFILL_S, DECODE_S = 1.0, 0.1


def flat_costs(cfg, host: float = 0.0) -> StepCosts:
    """Every prefill program costs PREFILL_S, every decode program DECODE_S; the host `host` per step."""
    costs = StepCosts()
    for key in BucketTables.from_config(cfg).all_keys():
        costs.observe(key, PREFILL_S if key.phase == "prefill" else DECODE_S)
    for rows in (1, 2):
        costs.observe_host(rows, host)
    return costs


def test_two_requests_prefilled_together_then_decoded_together_have_exact_timings():
    cfg = small_config()  # prefill budget 8 tokens: both 4-token prompts share one step
    result = simulate(cfg, [SimRequest(4, 3, 0.0), SimRequest(4, 3, 0.0)], flat_costs(cfg))
    # t 0 -> 1.0 prefill (first tokens), 1.0 -> 1.1 -> 1.2 two decode steps (tokens 2 and 3)
    np.testing.assert_allclose(result.ttft_s, [1.0, 1.0])
    np.testing.assert_allclose(result.tpot_s, [0.1, 0.1])
    np.testing.assert_allclose(result.latency_s, [1.2, 1.2])
    np.testing.assert_allclose(result.queue_s, [0.0, 0.0])
    assert result.wall_s == pytest.approx(1.2)
    assert result.num_steps == 3 and result.finish_reasons == {"length": 2}
    assert result.generated_tokens == 6


def test_a_late_arrival_waits_on_an_idle_clock_and_counts_from_its_arrival():
    cfg = small_config()
    result = simulate(cfg, [SimRequest(4, 2, 0.0), SimRequest(4, 2, 5.0)], flat_costs(cfg))
    # first: 0 -> 1.0 prefill, 1.1 decode; idle until 5.0; second: 5.0 -> 6.0 prefill, 6.1 decode
    np.testing.assert_allclose(result.ttft_s, [1.0, 1.0])
    np.testing.assert_allclose(result.latency_s, [1.1, 1.1])
    assert result.wall_s == pytest.approx(6.1)


def test_a_request_over_the_sequence_limit_queues_until_a_slot_frees():
    cfg = small_config(max_num_seqs=2, decode_batch_buckets=(2,))
    result = simulate(cfg, [SimRequest(4, 3), SimRequest(4, 3), SimRequest(4, 3)], flat_costs(cfg))
    # the first two as above (finish at 1.2); the third's prefill runs 1.2 -> 2.2, then 2.3, 2.4
    np.testing.assert_allclose(result.ttft_s, [1.0, 1.0, 2.2])
    np.testing.assert_allclose(result.queue_s, [0.0, 0.0, 1.2])
    assert result.wall_s == pytest.approx(2.4)


def test_host_seconds_are_added_to_every_step():
    cfg = small_config()
    result = simulate(cfg, [SimRequest(4, 3, 0.0), SimRequest(4, 3, 0.0)], flat_costs(cfg, host=0.05))
    np.testing.assert_allclose(result.ttft_s, [1.05, 1.05])
    assert result.wall_s == pytest.approx(1.05 + 2 * 0.15)


def test_max_inflight_holds_back_pulled_requests_like_a_batch_job():
    cfg = small_config()
    result = simulate(cfg, [SimRequest(4, 2), SimRequest(4, 2)], flat_costs(cfg), max_inflight=1)
    # the second is pulled when the first finishes (1.1), so its TTFT counts from there: 1.1 -> 2.1
    np.testing.assert_allclose(result.ttft_s, [1.0, 1.0])
    assert result.wall_s == pytest.approx(2.2)


def test_the_simulated_schedule_is_the_real_schedulers():
    # The sketch plans carry no arrays; the keys, steps and padding must still be those of real plans.
    cfg = small_config(max_num_seqs=4)
    rng = np.random.default_rng(0)
    prompts, outputs = rng.integers(1, 20, 12).tolist(), rng.integers(1, 10, 12).tolist()
    plans, stats = runloop.dry_run(cfg, [[i + 1] * p for i, p in enumerate(prompts)], outputs, num_pages=40)
    result = simulate(cfg, [SimRequest(p, o) for p, o in zip(prompts, outputs)], flat_costs(cfg), num_pages=40, max_inflight=12)
    assert result.steps_by_key == dict(collections.Counter(plan.bucket for plan in plans))
    assert result.padding == pytest.approx(stats.padding_waste)
    assert result.num_preemptions == stats.num_preemptions


def test_a_request_that_cannot_run_is_named():
    cfg = small_config()
    with pytest.raises(ValueError, match="request 1 cannot run"):
        simulate(cfg, [SimRequest(4, 2), SimRequest(40, 2)], flat_costs(cfg))
    bad_requests = {  # a generation samples a token at least, from a prompt, once arrived; a deadline as Prompt's
        "prompt_tokens must be >= 1": [SimRequest(0, 2)], "output_tokens must be >= 1": [SimRequest(4, 0)],
        "prompt_tokens must be an integer": [SimRequest(8.5, 2), SimRequest(True, 2)],
        "shared_prefix must be >= 0": [SimRequest(12, 2, shared_prefix=-9)], "priority must be an integer": [SimRequest(4, 2, priority=None)],
        "arrival_s must be a finite number": [SimRequest(4, 2, -1.0), SimRequest(4, 2, math.inf), SimRequest(4, 2, math.nan)],
        "deadline_s must be a finite number > 0": [SimRequest(4, 2, deadline_s=math.nan), SimRequest(4, 2, deadline_s=0.0)],
    }
    for message, requests in bad_requests.items():
        for bad in requests:
            with pytest.raises(ValueError, match=f"request 1: {message}"):
                simulate(cfg, [SimRequest(4, 2), bad], flat_costs(cfg))
    for name in ("num_pages", "max_inflight"):
        for value, problem in ((0, "must be >= 1"), (-1, "must be >= 1"), (2.5, "must be an integer")):
            with pytest.raises(ValueError, match=f"{name} {problem}"):
                simulate(cfg, [SimRequest(4, 2)], flat_costs(cfg), **{name: value})


def test_tpot_p50_counts_the_requests_that_got_a_first_token():
    # most requests time out in the queue (no first token, TPOT 0.0); the p50 is that of those that ran
    cfg = small_config(max_num_seqs=2)
    requests = [SimRequest(4, 30)] * 2 + [SimRequest(4, 30, deadline_s=PREFILL_S / 2)] * 8  # every slot busy for 4 s
    result = simulate(cfg, requests, flat_costs(cfg), max_inflight=10)
    assert result.finish_reasons["timeout"] > 5 and np.median(result.tpot_s) == 0.0  # most never started: TPOT 0.0, no first token
    assert result.summary()["tpot_p50_s"] == pytest.approx(DECODE_S)  # every decode step costs DECODE_S


def test_fast_forward_gives_every_step_results_bit_for_bit_where_it_used_to_differ():
    # (a) Arrivals on the grid of the step time: k iterations of the clock added at once rounded an arrival to the
    # other side of an iteration. (b) A request arriving during a fast-forward that ends at a page bucket, before a
    # preemption frees a slot: it was left out of the next iteration's admission. (c) Without the decode clock, a
    # request still prefilling its last prompt token was taken for a decoding row (a KeyError).
    for step_s, gap in ((0.01, 5), (0.1, 3), (0.07, 7)):
        cfg = small_config(max_num_seqs=4, max_context=128, page_size=4, max_prefill_tokens=16, decode_batch_buckets=None, prefill_chunk_buckets=None,
                           prefill_seq_buckets=(1,))
        costs = StepCosts.linear(BucketTables.from_config(cfg).all_keys(), program=(step_s, 0.0), host=(0.0, 0.0), max_rows=4)
        rng = np.random.default_rng(gap)
        requests = [SimRequest(int(rng.integers(1, 16)), int(rng.integers(5, 60)), arrival_s=i * gap * step_s) for i in range(60)]
        _assert_same(simulate(cfg, requests, costs, num_pages=200), simulate(cfg, requests, costs, num_pages=200, fast_forward=False))
    cfg = small_config(max_num_seqs=2, max_context=64, page_size=4, max_prefill_tokens=16, policy="shortest-prompt", decode_batch_buckets=None,
                       prefill_chunk_buckets=None, prefill_seq_buckets=(1,))
    costs = StepCosts.linear(BucketTables.from_config(cfg).all_keys(), program=(1e-3, 0.0), host=(0.0, 0.0), max_rows=2)
    requests = [SimRequest(8, 24), SimRequest(8, 24), SimRequest(2, 2, arrival_s=0.0055)]
    fast, slow = simulate(cfg, requests, costs, num_pages=9), simulate(cfg, requests, costs, num_pages=9, fast_forward=False)
    assert slow.num_preemptions > 0  # the iteration after the fast-forward preempts, and admits the short request
    _assert_same(fast, slow)
    cfg = small_config(max_num_seqs=8, max_context=16, page_size=4, max_prefill_tokens=8, policy="shortest-prompt", decode_batch_buckets=None,
                       prefill_chunk_buckets=None, prefill_seq_buckets=(1,))  # EngineConfig's default tables
    costs = StepCosts.linear(BucketTables.from_config(cfg).all_keys(), program=(1e-3, 1e-5), host=(0.0, 0.0), max_rows=8)
    requests = [SimRequest(13, 13, shared_prefix=12), SimRequest(2, 13, shared_prefix=2), SimRequest(10, 3, shared_prefix=10)]
    runs = [simulate(cfg, requests, costs, num_pages=5, max_inflight=2, fast_forward=f, one_pass_decode=o) for f, o in ((True, False), (False, False), (True, True))]
    _assert_same(runs[0], runs[1])
    _assert_same(runs[2], runs[1])


def _assert_same(a, b) -> None:
    for name in ("ttft_s", "tpot_s", "queue_s", "latency_s"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert a.summary() == b.summary() and a.steps_by_key == b.steps_by_key and a.wall_s == b.wall_s


def test_slo_attainment_counts_requests_within_both_slos_and_never_one_without_a_first_token():
    nan = float("nan")
    result = SimResult(wall_s=1.0, ttft_s=np.array([0.1, 0.5, nan, 0.2, 0.3]), tpot_s=np.array([0.01, 0.01, 0.0, 0.5, 0.1]), queue_s=np.zeros(5),
                       latency_s=np.ones(5), finish_reasons={"length": 5}, num_steps=1, steps_by_key={}, padding=0.0, num_preemptions=0,
                       peak_kv_utilization=0.0, mean_kv_utilization=0.0, generated_tokens=5)
    assert result.slo_attainment(0.3, 0.1) == 2 / 5  # the first, and the last (both bounds inclusive); over TTFT, none, over TPOT
    assert result.slo_attainment(0.3) == 3 / 5 and result.slo_attainment() == 4 / 5  # an SLO not given bounds nothing
    assert slo_met([0.1, 0.1], [0.0, 0.0], [True, False], 1.0, 1.0).tolist() == [True, False]  # an error or a deadline never meets one


def test_the_simulator_imports_no_jax():
    import subprocess

    code = "import sys; import jaxinfer.scheduling.simulator, jaxinfer.whatif; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("arrivals", [False, True])
def test_fast_forward_gives_the_same_results_as_every_step_run(arrivals, policy):
    cfg = small_config(max_num_seqs=4, max_context=64, page_size=4, decode_page_buckets=(2, 4, 8, 16), policy=policy)
    rng = np.random.default_rng(1)
    n = 40
    times = np.cumsum(rng.exponential(0.8, n)) if arrivals else [None] * n
    requests = [SimRequest(int(p), int(o), None if t is None else float(t)) for p, o, t in zip(rng.integers(1, 30, n), rng.integers(1, 30, n), times)]
    costs = flat_costs(cfg, host=0.01)
    fast = simulate(cfg, requests, costs, num_pages=30)
    slow = simulate(cfg, requests, costs, num_pages=30, fast_forward=False)
    for name in ("ttft_s", "tpot_s", "queue_s", "latency_s"):
        np.testing.assert_array_equal(getattr(fast, name), getattr(slow, name))  # the clock moves plan by plan in both
    assert fast.steps_by_key == slow.steps_by_key and fast.num_steps == slow.num_steps
    assert fast.wall_s == slow.wall_s and fast.padding == slow.padding
    assert fast.num_preemptions == slow.num_preemptions
    assert fast.mean_kv_utilization == slow.mean_kv_utilization  # each iteration's figure, added in the same order
    assert fast.peak_kv_utilization == slow.peak_kv_utilization and fast.generated_tokens == slow.generated_tokens
    assert fast.finish_reasons == slow.finish_reasons


def work_costs(cfg) -> StepCosts:
    """Seconds linear in each program's work (as experiments/bench_simulator.py prices one), host time per row."""
    return StepCosts.linear(BucketTables.from_config(cfg).all_keys(), program=(1e-3, 1e-5), host=(1e-4, 1e-5), max_rows=8)


@pytest.mark.parametrize("num_pages", [200, 24])  # roomy; tight enough to preempt
def test_fast_forward_matches_every_step_on_a_varied_workload(num_pages):
    # Shared prefixes (prefix-cache hits), priorities, arrivals in bursts and gaps, short and long outputs,
    # split decode groups (eight rows over five page buckets) and, with the small pool, preemptions.
    cfg = small_config(max_num_seqs=8, max_context=96, page_size=4, max_prefill_tokens=16, prefill_chunk_buckets=(4, 8, 16),
                       decode_batch_buckets=(1, 2, 4, 8), decode_page_buckets=(1, 2, 4, 8, 16, 24))
    rng = np.random.default_rng(7)
    n = 120
    gaps = np.where(rng.random(n) < 0.2, rng.exponential(2.0, n), 0.0)
    requests = [SimRequest(int(p), int(o), float(t) if i % 3 else None, priority=int(rng.integers(0, 2)), shared_prefix=int(s))
                for i, (p, o, t, s) in enumerate(zip(rng.integers(1, 40, n), rng.integers(1, 50, n), np.cumsum(gaps), rng.choice([0, 0, 8, 12], n)))]
    costs = work_costs(cfg)
    fast = simulate(cfg, requests, costs, num_pages=num_pages, max_inflight=24)
    slow = simulate(cfg, requests, costs, num_pages=num_pages, max_inflight=24, fast_forward=False)
    assert fast.summary() == slow.summary()
    for name in ("ttft_s", "tpot_s", "queue_s", "latency_s"):
        np.testing.assert_array_equal(getattr(fast, name), getattr(slow, name))
    assert fast.steps_by_key == slow.steps_by_key
    assert (fast.num_preemptions > 0) == (num_pages == 24)  # the tight pool really preempts


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("num_pages", [200, 24])  # roomy; tight enough to preempt
def test_one_pass_decode_gives_the_run_loops_results_bit_for_bit(num_pages, policy):
    # Decode plans run in one pass over their rows instead of runloop.run_plan; every timing and statistic
    # must be exactly the run loop's, with and without the fast-forward, under deadlines, arrivals, shared
    # prefixes, priorities and preemptions.
    cfg = small_config(max_num_seqs=8, max_context=96, page_size=4, max_prefill_tokens=16, prefill_chunk_buckets=(4, 8, 16),
                       decode_batch_buckets=(1, 2, 4, 8), decode_page_buckets=(1, 2, 4, 8, 16, 24), policy=policy)
    rng = np.random.default_rng(11)
    n = 100
    arrivals = np.cumsum(np.where(rng.random(n) < 0.3, rng.exponential(1.0, n), 0.0))
    requests = [SimRequest(int(p), int(o), float(t) if i % 2 else None, priority=int(rng.integers(0, 2)), shared_prefix=int(s),
                           deadline_s=float(d) if i % 5 == 0 else None)
                for i, (p, o, t, s, d) in enumerate(zip(rng.integers(1, 40, n), rng.integers(1, 50, n), arrivals, rng.choice([0, 8, 12], n),
                                                        rng.uniform(0.5, 20.0, n)))]
    costs = work_costs(cfg)
    for fast_forward in (False, True):
        one_pass = simulate(cfg, requests, costs, num_pages=num_pages, max_inflight=24, fast_forward=fast_forward)
        run_loop = simulate(cfg, requests, costs, num_pages=num_pages, max_inflight=24, fast_forward=fast_forward, one_pass_decode=False)
        for name in ("ttft_s", "tpot_s", "queue_s", "latency_s"):
            np.testing.assert_array_equal(getattr(one_pass, name), getattr(run_loop, name))
        assert one_pass.summary() == run_loop.summary() and one_pass.steps_by_key == run_loop.steps_by_key
        assert (one_pass.wall_s, one_pass.mean_kv_utilization, one_pass.finish_reasons) == (run_loop.wall_s, run_loop.mean_kv_utilization, run_loop.finish_reasons)
    assert (one_pass.num_preemptions > 0) == (num_pages == 24)


@pytest.mark.parametrize("fast_forward", [False, True])
def test_kv_utilization_counts_a_page_shared_through_the_prefix_cache_once(monkeypatch, fast_forward):
    # The reference is the real scheduler's own statistic (Scheduler._record_utilization: every row's block
    # table read page by page, a shared page counted once), run on the same schedule step by step.
    from jaxinfer.scheduling import sim_scheduler
    from jaxinfer.scheduling.scheduler import Scheduler

    cfg = small_config(max_num_seqs=8, max_context=96, page_size=4, max_prefill_tokens=16, prefill_chunk_buckets=(4, 8, 16),
                       decode_batch_buckets=(1, 2, 4, 8), decode_page_buckets=(1, 2, 4, 8, 16, 24))
    rng = np.random.default_rng(5)
    requests = [SimRequest(int(p), int(o), shared_prefix=int(s)) for p, o, s in zip(rng.integers(20, 40, 60), rng.integers(1, 30, 60), rng.choice([0, 12, 16], 60))]
    costs = work_costs(cfg)
    fast = simulate(cfg, requests, costs, num_pages=200, max_inflight=24, fast_forward=fast_forward)
    monkeypatch.setattr(sim_scheduler.SketchScheduler, "_record_utilization", Scheduler._record_utilization)
    real = simulate(cfg, requests, costs, num_pages=200, max_inflight=24, fast_forward=False)
    assert fast.num_steps == real.num_steps and fast.padding == real.padding  # the same schedule
    assert fast.peak_kv_utilization == pytest.approx(real.peak_kv_utilization, rel=1e-12)
    assert fast.mean_kv_utilization == pytest.approx(real.mean_kv_utilization, rel=1e-12)
    assert real.peak_kv_utilization <= 1.0  # counted once per owner, the shared pages pushed it past 1


@pytest.mark.parametrize("fast_forward", [False, True])
def test_kv_utilization_counts_once_the_pages_equal_short_prompts_share_after_a_preemption(monkeypatch, fast_forward):
    # Equal 3-token prompts (pages of 4): their output pages are named alike, so a preempted one's recompute shares a
    # running twin's pages through the prefix cache, though no prompt holds a full shared page.
    from jaxinfer.scheduling import sim_scheduler
    from jaxinfer.scheduling.scheduler import Scheduler

    cfg = small_config(max_num_seqs=4, max_context=64, page_size=4, max_prefill_tokens=8, prefill_chunk_buckets=(4, 8),
                       decode_batch_buckets=(2, 4), enable_prefix_caching=True)
    costs = StepCosts.linear(BucketTables.from_config(cfg).all_keys(), program=(1e-3, 0.0), host=(0.0, 0.0), max_rows=4)
    requests = [SimRequest(3, 40, shared_prefix=3) for _ in range(12)]
    sketch = simulate(cfg, requests, costs, num_pages=24, fast_forward=fast_forward)
    monkeypatch.setattr(sim_scheduler.SketchScheduler, "_record_utilization", Scheduler._record_utilization)
    real = simulate(cfg, requests, costs, num_pages=24, fast_forward=False)
    assert sketch.num_preemptions > 0 and sketch.num_steps == real.num_steps
    assert sketch.peak_kv_utilization == pytest.approx(real.peak_kv_utilization, rel=1e-12) and real.peak_kv_utilization <= 1.0
    assert sketch.mean_kv_utilization == pytest.approx(real.mean_kv_utilization, rel=1e-12)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("num_pages", [400, 60])  # roomy; tight enough to preempt
def test_decode_clock_gives_the_run_loops_results_on_larger_batches(num_pages, policy):
    # Sixteen rows decoding on the clock (sim_decode.py) against the run loop step by step: pulled and timed
    # requests, priorities, shared prefixes, prompts that are all shared prefix (equal whole sequences, whose
    # output pages are named alike), long outputs crossing page buckets, and with the small pool preemptions.
    cfg = small_config(max_num_seqs=16, max_context=256, page_size=8, max_prefill_tokens=64, prefill_chunk_buckets=(16, 32, 64),
                       decode_batch_buckets=(4, 8, 16), decode_page_buckets=(1, 2, 4, 8, 16, 32), policy=policy)
    rng = np.random.default_rng(23)
    n = 160
    arrivals = np.cumsum(np.where(rng.random(n) < 0.3, rng.exponential(0.5, n), 0.0))
    prompts, outputs, shared = rng.integers(1, 120, n), rng.integers(1, 130, n), rng.choice([0, 0, 16, 40, 200], n)
    requests = [SimRequest(int(p), int(o), float(t) if i % 3 else None, priority=int(rng.integers(0, 2)), shared_prefix=int(s))
                for i, (p, o, t, s) in enumerate(zip(prompts, outputs, arrivals, shared))]
    costs = work_costs(cfg)
    clock = simulate(cfg, requests, costs, num_pages=num_pages, max_inflight=40)
    run_loop = simulate(cfg, requests, costs, num_pages=num_pages, max_inflight=40, fast_forward=False, one_pass_decode=False)
    assert clock.summary() == run_loop.summary() and clock.steps_by_key == run_loop.steps_by_key
    for name in ("ttft_s", "tpot_s", "queue_s", "latency_s"):
        np.testing.assert_array_equal(getattr(clock, name), getattr(run_loop, name))
    assert (clock.mean_kv_utilization, clock.peak_kv_utilization, clock.generated_tokens) == pytest.approx(
        (run_loop.mean_kv_utilization, run_loop.peak_kv_utilization, run_loop.generated_tokens), rel=1e-12)
    assert (clock.num_preemptions > 0) == (num_pages == 60)


def test_a_first_token_at_time_zero_counts_from_time_zero_on_every_path():
    # Prefills cost nothing, so the first prefills' tokens come at time 0.0 on the virtual clock: a TTFT of 0.0
    # (Scheduler.update once took a first token at 0.0 for none yet, and gave those rows their next decode step's end).
    cfg = small_config(max_num_seqs=8, max_context=64, page_size=4, max_prefill_tokens=16, prefill_chunk_buckets=(4, 8, 16),
                       decode_batch_buckets=(2, 4, 8), decode_page_buckets=(1, 2, 4, 8, 16))
    costs = StepCosts()
    for key in BucketTables.from_config(cfg).all_keys():
        costs.observe(key, 0.0 if key.phase == "prefill" else DECODE_S)
    costs.observe_host(1, 0.0)
    requests = [SimRequest(p, o) for p, o in [(3, 9), (5, 2), (9, 20), (2, 1), (4, 30), (7, 5), (6, 12)]]
    runs = [simulate(cfg, requests, costs, fast_forward=f, one_pass_decode=o) for f, o in ((False, False), (False, True), (True, True))]
    for run in runs[1:]:
        _assert_same(run, runs[0])
    # the first iteration's prefill ends the first two prompts (3 and 5 tokens) at time 0.0; each later iteration
    # runs a decode step (DECODE_S) before its prefill
    np.testing.assert_array_equal(runs[0].ttft_s[:2], [0.0, 0.0])
    np.testing.assert_allclose(runs[0].ttft_s / DECODE_S, np.round(runs[0].ttft_s / DECODE_S), atol=1e-9)
    assert runs[0].tpot_s[0] == pytest.approx(DECODE_S)  # its 8 decode steps after the first token at 0.0


def test_page_names_are_equal_exactly_where_the_hashed_pages_are():
    # The reference: the block pool's hash chain over each simulated sequence (prompt, then output 0s).
    from jaxinfer.scheduling.block_pool import page_hashes
    from jaxinfer.scheduling.sim_pages import group_token, page_names

    page_size, max_context = 4, 64
    specs = [(10, 0, 9), (10, 0, 3), (7, 7, 9), (7, 7, 9), (7, 9, 9), (12, 8, 20), (12, 8, 20), (13, 8, 6), (8, 8, 30), (9, 30, 5), (3, 1, 2), (16, 16, 60)]
    specs = [(*spec, 0) for spec in specs] + [(12, 8, 20, 1), (13, 8, 6, 1), (12, 12, 9, 1), (12, 12, 9, 0), (16, 16, 60, 2), (7, 7, 9, 3)]  # (.., prefix group)
    names, hashes = [], []
    for index, (prompt_tokens, shared, output_tokens, group) in enumerate(specs):
        shared = min(shared, prompt_tokens)
        mark = group_token(group)
        prompt = [mark] * shared + [index + 2] + [0] * (prompt_tokens - shared - 1) if shared < prompt_tokens else [mark] * shared
        sequence = (prompt + [0] * output_tokens)[:max_context]
        hashes.append(page_hashes(sequence, page_size))
        names.append(page_names(index, prompt_tokens, shared, output_tokens, page_size, max_context, group))
        assert len(names[-1]) == len(hashes[-1])
    pairs = [(a, b, j) for a in range(len(specs)) for b in range(len(specs)) for j in range(min(len(names[a]), len(names[b])))]
    assert all((names[a][j] == names[b][j]) == (hashes[a][j] == hashes[b][j]) for a, b, j in pairs)
    assert sum(hashes[a][j] == hashes[b][j] for a, b, j in pairs if a != b) > 10  # shared pages and equal all-shared sequences are there


@pytest.mark.parametrize("policy", ["fcfs", "prefix"])
def test_page_names_by_construction_give_the_results_of_hashed_names(monkeypatch, policy):
    from jaxinfer.scheduling import simulator

    cfg = small_config(max_num_seqs=8, max_context=96, page_size=4, max_prefill_tokens=16, prefill_chunk_buckets=(4, 8, 16),
                       decode_batch_buckets=(1, 2, 4, 8), decode_page_buckets=(1, 2, 4, 8, 16, 24), policy=policy)
    rng = np.random.default_rng(29)
    requests = [SimRequest(int(p), int(o), shared_prefix=int(s), prefix_group=int(g))
                for p, o, s, g in zip(rng.integers(1, 40, 120), rng.integers(1, 40, 120), rng.choice([0, 8, 12, 40], 120), rng.integers(0, 3, 120))]
    named = simulate(cfg, requests, work_costs(cfg), num_pages=30, max_inflight=24)
    monkeypatch.setattr(simulator, "page_names", lambda *args: [])  # the KV manager hashes every page
    hashed = simulate(cfg, requests, work_costs(cfg), num_pages=30, max_inflight=24)
    assert named.summary() == hashed.summary() and named.steps_by_key == hashed.steps_by_key
    np.testing.assert_array_equal(named.ttft_s, hashed.ttft_s)
    assert named.num_preemptions > 0


def varied_requests(seed: int, n: int = 160) -> list[SimRequest]:
    """Bursty arrivals, a third of them at time 0, two priorities, prompts of 1-119 tokens, outputs of 1-129, and
    shared prefixes of 0, 16, 40 or 200 tokens (longer than the prompt: the whole prompt shared)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(np.where(rng.random(n) < 0.3, rng.exponential(0.5, n), 0.0))
    return [SimRequest(int(p), int(o), float(t) if i % 3 else None, priority=int(rng.integers(0, 2)), shared_prefix=int(s))
            for i, (p, o, t, s) in enumerate(zip(rng.integers(1, 120, n), rng.integers(1, 130, n), arrivals, rng.choice([0, 0, 16, 40, 200], n)))]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("num_pages", [400, 40])  # roomy; tight enough to preempt (a preempted request finds its own named pages)
def test_own_pages_named_only_at_preemption_give_the_results_of_naming_each_as_it_fills(monkeypatch, num_pages, policy):
    from jaxinfer.scheduling import simulator

    cfg = small_config(max_num_seqs=16, max_context=256, page_size=8, max_prefill_tokens=64, prefill_chunk_buckets=(16, 32, 64),
                       decode_batch_buckets=(4, 8, 16), decode_page_buckets=(1, 2, 4, 8, 16, 32), policy=policy)
    requests = varied_requests(31)
    costs = work_costs(cfg)
    runs = {}
    for defer in (True, False):
        monkeypatch.setattr(simulator._Run, "defer_names", defer)
        for fast_forward in (True, False):
            runs[defer, fast_forward] = simulate(cfg, requests, costs, num_pages=num_pages, max_inflight=40, fast_forward=fast_forward)
    for fast_forward in (True, False):
        deferred, named = runs[True, fast_forward], runs[False, fast_forward]
        assert deferred.summary() == named.summary() and deferred.steps_by_key == named.steps_by_key
        for name in ("ttft_s", "tpot_s", "queue_s", "latency_s"):
            np.testing.assert_array_equal(getattr(deferred, name), getattr(named, name))
    assert (runs[True, True].num_preemptions > 0) == (num_pages == 40)


def test_a_request_made_from_the_prototype_equals_one_built_by_its_constructor():
    from jaxinfer.scheduling.request import SamplingParams
    from jaxinfer.scheduling.sim_decode import LazyRequest

    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    built = LazyRequest("3", [5, 0, 0], params, seed=0, priority=2, deadline=4.5, arrival_index=3, arrival_time=1.25)
    made, other = (LazyRequest.make("3", [5, 0, 0], params, priority=2, deadline=4.5, arrival_index=3, arrival_time=1.25) for _ in range(2))
    assert list(made.__dict__.items()) == list(built.__dict__.items())  # every field, in the constructor's order
    made.output_ids.append(0)
    made.page_names.append(1)
    assert other.output_ids == [] and other.page_names == [] and LazyRequest.make("4", [1], params).output_ids == []  # no list is shared


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("num_pages", [400, 40])  # roomy; tight enough to preempt
@pytest.mark.parametrize("packed", [False, True])
def test_the_sketch_schedulers_shortcuts_give_the_plain_schedulers_results(monkeypatch, num_pages, packed, policy):
    # The plain path: prefill plans built by Scheduler._prefill_plan (a real StepPlan, its arrays and key), prefill
    # planned by Scheduler._plan_prefill at every iteration, an expiry pass at every iteration, decoding rows sorted
    # by admission and by length at every change, the decode split by Scheduler._split_point, the fast-forward's
    # bound on page buckets from every row's table. Every timing and count must be the same, bit for bit.
    from jaxinfer.config import EngineConfig
    from jaxinfer.scheduling import sim_scheduler, simulator
    from jaxinfer.scheduling.scheduler import Scheduler
    from jaxinfer.scheduling.sim_decode import DecodeRows, total_base

    tables = dict(prefill_chunk_buckets=(16, 32, 64), decode_batch_buckets=(4, 8, 16), decode_page_buckets=(1, 2, 4, 8, 16, 32))
    cfg = (EngineConfig(max_num_seqs=16, max_context=256, page_size=8, max_prefill_tokens=64, policy=policy, **tables) if packed else
           small_config(max_num_seqs=16, max_context=256, page_size=8, max_prefill_tokens=64, policy=policy, **tables))
    requests = varied_requests(37)
    costs = work_costs(cfg)
    sketch = simulate(cfg, requests, costs, num_pages=num_pages, max_inflight=40)

    def real_prefill_plan(self, pairs):
        plan = Scheduler._prefill_plan(self, pairs)  # Scheduler._build_plan: a StepPlan, counted in the stats
        return sim_scheduler.SketchPlan("prefill", plan.bucket, plan.request_ids, tuple(plan.num_new_tokens), tuple(plan.samples))

    init = simulator._Run.__init__

    def expiring_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.expires = True

    def sorted_rows(self):
        self._in_admission_order = False
        return ordered(self)

    def by_length(self):  # sorted anew at every change, the pages read from the block tables
        rows = sorted(self.ordered(), key=total_base)
        pages = [len(self.tables.get(r.request_id, ())) for r in rows]
        return rows, pages, ()

    def min_top(self):  # every row's bucket end read from its block table
        tops = [self.page_bucket(len(self.tables.get(r.request_id, ()))) * self.page_size - r._total_base for r in self.rows.values()]
        return min(tops) if tops else None

    ordered = DecodeRows.ordered
    monkeypatch.setattr(DecodeRows, "by_length", by_length)
    monkeypatch.setattr(DecodeRows, "min_top", min_top)
    monkeypatch.setattr(sim_scheduler.SketchScheduler, "_cut", lambda self, pages, buckets: Scheduler._split_point(self, pages))
    monkeypatch.setattr(sim_scheduler.SketchScheduler, "_prefill_plan", real_prefill_plan)
    monkeypatch.setattr(sim_scheduler.SketchScheduler, "_plan_prefill", Scheduler._plan_prefill)
    monkeypatch.setattr(simulator._Run, "__init__", expiring_init)
    monkeypatch.setattr(DecodeRows, "ordered", sorted_rows)
    plain = simulate(cfg, requests, costs, num_pages=num_pages, max_inflight=40)
    assert sketch.summary() == plain.summary() and sketch.steps_by_key == plain.steps_by_key
    for name in ("ttft_s", "tpot_s", "queue_s", "latency_s"):
        np.testing.assert_array_equal(getattr(sketch, name), getattr(plain, name))
    assert (sketch.num_preemptions > 0) == (num_pages == 40)


def test_the_prefix_policys_pruning_runs_at_the_same_steps_in_the_sketch_as_in_the_plain_scheduler(monkeypatch):
    # The sketch's shortcut (no prefill to plan) still calls the policy's admission order, where the prefix policy
    # prunes its ranks; pruning at other steps would rank a returning name anew at another time, and reorder the queue.
    from jaxinfer.scheduling import sim_scheduler
    from jaxinfer.scheduling.policies import PrefixAware
    from jaxinfer.scheduling.scheduler import Scheduler

    cfg = small_config(max_num_seqs=2, max_context=128, page_size=4, max_prefill_tokens=16, prefill_chunk_buckets=(4, 8, 16),
                       decode_batch_buckets=(1, 2), decode_page_buckets=(1, 2, 4, 8, 16, 32), policy="prefix", enable_prefix_caching=True)
    costs = StepCosts.linear(BucketTables.from_config(cfg).all_keys(), program=(1e-3, 1e-5), host=(1e-4, 1e-5), max_rows=4)
    monkeypatch.setattr(PrefixAware, "prune_slack", 2)
    runs = []
    for seed in (20, 21, 22):
        rng = np.random.default_rng(seed)
        arrivals = np.cumsum(rng.exponential(0.05, 60))
        prompts, outputs, shared = rng.integers(5, 30, 60), rng.integers(1, 30, 60), rng.choice([0, 0, 0, 0, 12], 60)
        runs.append([SimRequest(int(p), int(o), float(t), shared_prefix=int(s)) for p, o, t, s in zip(prompts, outputs, arrivals, shared)])
    sketch = [simulate(cfg, requests, costs, num_pages=200) for requests in runs]
    monkeypatch.setattr(sim_scheduler.SketchScheduler, "_plan_prefill", Scheduler._plan_prefill)
    for requests, result in zip(runs, sketch):
        plain = simulate(cfg, requests, costs, num_pages=200)
        np.testing.assert_array_equal(result.ttft_s, plain.ttft_s)
        assert result.summary() == plain.summary()


def test_the_prefix_policys_pruning_falls_between_the_same_arrivals_with_the_fast_forward_as_without(monkeypatch):
    # Both slots decode through three arrivals; the third's push crosses the prune threshold, and a fourth returns to a
    # prefix group whose requests all ran. Step by step the prune falls before the fourth is pushed, which ranks its
    # names anew (last); a fast-forward that pushed all four after its run would keep their old rank (first).
    from jaxinfer.scheduling.policies import PrefixAware

    monkeypatch.setattr(PrefixAware, "prune_slack", 0)
    cfg = small_config(max_num_seqs=2, max_context=128, page_size=4, max_prefill_tokens=16, prefill_chunk_buckets=(4, 8, 16),
                       decode_batch_buckets=(1, 2), decode_page_buckets=(32,), policy="prefix", enable_prefix_caching=True)
    costs = StepCosts.linear(BucketTables.from_config(cfg).all_keys(), program=(1e-3, 0.0), host=(0.0, 0.0), max_rows=2)
    requests = [SimRequest(9, 1, 0.0, shared_prefix=8, prefix_group=1), SimRequest(5, 100, 0.0), SimRequest(5, 100, 0.0),
                SimRequest(9, 5, 0.020, shared_prefix=8, prefix_group=2), SimRequest(5, 5, 0.030),
                SimRequest(9, 5, 0.040, shared_prefix=8, prefix_group=3), SimRequest(9, 5, 0.050, shared_prefix=8, prefix_group=1)]
    fast, every_step = simulate(cfg, requests, costs, num_pages=200), simulate(cfg, requests, costs, num_pages=200, fast_forward=False)
    np.testing.assert_array_equal(fast.ttft_s, every_step.ttft_s)
    assert fast.summary() == every_step.summary()


@pytest.mark.parametrize("one_pass_decode", [True, False])
@pytest.mark.parametrize("seed", [24, 139, 169, 256])
def test_equal_whole_prompts_name_their_pages_in_the_order_they_fill_with_the_fast_forward_as_without(seed, one_pass_decode):
    # Prompts that are all shared prefix (equal whole prompts, of 1 to 5 tokens) name their output pages alike, and the
    # first to fill a page keeps the name; under preemption a twin ahead in length may have been admitted later. The
    # fast-forward used to name the pages of the iterations it applied in admission order (these seeds diverged).
    rng = np.random.default_rng(seed)
    page_size = int(rng.choice([4, 8]))
    cfg = small_config(page_size=page_size, max_context=128, max_num_seqs=int(rng.integers(2, 6)), max_prefill_tokens=16, prefill_chunk_buckets=(4, 8, 16),
                       prefill_seq_buckets=(1, 2), decode_batch_buckets=(2, 4, 8), decode_page_buckets=None, enable_prefix_caching=True)
    costs = StepCosts.linear(BucketTables.from_config(cfg).all_keys(), program=(1e-3, 1e-5), host=(1e-4, 0.0), max_rows=8)
    prompts, outputs, arrivals, priorities = rng.integers(1, 6, 30), rng.integers(1, 60, 30), np.cumsum(rng.exponential(0.01, 30)), rng.integers(0, 2, 30)
    requests = [SimRequest(int(p), int(o), float(t) if rng.random() < 0.5 else None, priority=int(pr), shared_prefix=int(p))
                for p, o, t, pr in zip(prompts, outputs, arrivals, priorities)]
    pages = int(rng.integers(12, 40))
    fast = simulate(cfg, requests, costs, num_pages=pages, one_pass_decode=one_pass_decode)
    every_step = simulate(cfg, requests, costs, num_pages=pages, fast_forward=False, one_pass_decode=one_pass_decode)
    assert fast.num_preemptions > 0 and fast.summary() == every_step.summary()
    np.testing.assert_array_equal(fast.ttft_s, every_step.ttft_s)


def test_kv_utilization_counts_no_page_a_sliding_window_released(monkeypatch):
    # (a sliding window turns the fast-forward and the decode clock off: the sketch's own path is the plain one)
    from jaxinfer.scheduling import sim_scheduler
    from jaxinfer.scheduling.scheduler import Scheduler

    cfg = small_config(max_num_seqs=4, max_context=64, page_size=4, max_prefill_tokens=8, prefill_chunk_buckets=(4, 8),
                       decode_batch_buckets=(2, 4), release_window=8)
    costs = StepCosts.linear(BucketTables.from_config(cfg).all_keys(), program=(1e-3, 0.0), host=(0.0, 0.0), max_rows=4)
    requests = [SimRequest(4, 50), SimRequest(10, 30), SimRequest(20, 12)]
    sketch = simulate(cfg, requests, costs)
    monkeypatch.setattr(sim_scheduler.SketchScheduler, "_record_utilization", Scheduler._record_utilization)
    real = simulate(cfg, requests, costs)
    assert sketch.num_steps == real.num_steps and sketch.peak_kv_utilization == real.peak_kv_utilization <= 1.0
    assert sketch.mean_kv_utilization == pytest.approx(real.mean_kv_utilization, rel=1e-12)


def test_the_sketch_scheduler_prices_the_new_tables_keys_after_a_swap():
    import dataclasses

    from jaxinfer.scheduling.sim_scheduler import SketchScheduler

    cfg = small_config(max_num_seqs=8, max_context=96, page_size=4, max_prefill_tokens=16, prefill_chunk_buckets=(4, 8, 16),
                       decode_batch_buckets=(1, 2, 4, 8), decode_page_buckets=(1, 2, 4, 8, 16, 24))
    scheduler = SketchScheduler(cfg, 100)
    scheduler.use_decode_clock()
    assert scheduler._decode_key([None] * 3, 3) == ("decode", 4, 1, 4)
    new = dataclasses.replace(cfg, decode_batch_buckets=(8,), decode_page_buckets=(24,))
    scheduler.use_config(new)
    assert scheduler._decode_key([None] * 3, 3) == BucketTables.from_config(new).decode_key(3, 3) == ("decode", 8, 1, 24)
    assert scheduler.lazy.page_bucket(3) == 24
