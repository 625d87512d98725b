"""Scheduler: scripted steps with exact page ids, and runs over the fake paged engine (tests/fakes.py),
which checks every plan: its tokens equal the hash chain of the true sequence only if every slot
mapping, block table, chunk and preemption was right.
"""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxinfer.scheduling import runloop
from jaxinfer.scheduling.stopping import OutputProcessor
from jaxinfer.scheduling.scheduler import Scheduler, split_decode_rows, split_sorted_rows

from fakes import FakePagedEngine, expected_output, request, run_to_completion, small_config


def test_first_step_prefills_under_token_budget_with_exact_slots():
    cfg = small_config()
    scheduler = Scheduler(cfg, num_pages=7)
    scheduler.add(request("a", 6, 4, 0))
    scheduler.add(request("b", 3, 4, 1))
    (plan,) = scheduler.schedule()
    assert plan.phase == "prefill" and plan.bucket == ("prefill", 2, 8, 2)  # first chunks read 2 pages
    assert plan.request_ids == ("a", "b") and plan.num_new_tokens == (6, 2) and plan.samples == (True, False)
    assert plan.slot_pages[0].tolist() == [1, 1, 1, 1, 2, 2, 0, 0]
    assert plan.slot_offsets[0, :6].tolist() == [0, 1, 2, 3, 0, 1]
    assert plan.slot_pages[1].tolist() == [3, 3, 0, 0, 0, 0, 0, 0]
    assert plan.block_tables.tolist() == [[1, 2], [3, 0]]
    assert plan.logit_indices.tolist() == [[5], [1]]


def test_second_step_decodes_a_and_continues_chunk_of_b():
    scheduler = Scheduler(small_config(), num_pages=7)
    scheduler.add(request("a", 6, 4, 0))
    scheduler.add(request("b", 3, 4, 1))
    scheduler.update(scheduler.schedule()[0], np.array([11, 12]))
    decode, prefill = scheduler.schedule()
    assert decode.request_ids == ("a",) and decode.token_ids[0, 0] == 11 and decode.positions[0, 0] == 6
    assert decode.bucket == ("decode", 2, 1, 2)
    assert prefill.request_ids == ("b",) and prefill.positions[0, 0] == 2 and prefill.samples == (True,)
    assert prefill.bucket == ("prefill", 1, 4, 1)  # a continuation reads the pages it holds, bucketed


def test_preemption_takes_most_recently_admitted_and_keeps_its_output():
    # Without the prefix cache: a re-admitted b would otherwise hit its own named page and wait for room.
    scheduler = Scheduler(small_config(max_prefill_tokens=8, enable_prefix_caching=False), num_pages=5)  # 4 usable pages
    engine = FakePagedEngine(5, 4)
    scheduler.add(request("a", 7, 6, 0))
    scheduler.add(request("b", 7, 6, 1))
    for _ in range(3):  # prefill a, prefill b, then decode until both need a third page
        for plan in scheduler.schedule():
            scheduler.update(plan, engine.step(plan))
    b = next(r for r in scheduler.running if r.request_id == "b")
    kept = list(b.output_ids)
    for plan in scheduler.schedule():
        scheduler.update(plan, engine.step(plan))
    assert b.num_preemptions >= 1 and scheduler.stats.num_preemptions >= 1
    assert b.output_ids[: len(kept)] == kept
    a = next(r for r in scheduler.running if r.request_id == "a")
    assert a.num_preemptions == 0


def test_preemption_spares_a_more_urgent_priority_admitted_later():
    """A priority-5 request runs first; a priority-0 one (more urgent) arrives after it. When the 6-page pool runs
    out, the less urgent one is preempted, though it was admitted first, and the urgent one never is."""
    cfg = small_config(max_num_seqs=4, max_context=32, page_size=4, max_prefill_tokens=8, prefill_chunk_buckets=(4, 8))
    scheduler, engine = Scheduler(cfg, num_pages=7), FakePagedEngine(7, 4)
    low = request("low", 8, 16, 0, priority=5)
    scheduler.add(low)
    for plan in scheduler.schedule():
        scheduler.update(plan, engine.step(plan))
    high = request("high", 8, 16, 1, priority=0)
    scheduler.add(high)
    for _ in range(12):
        for plan in scheduler.schedule():
            scheduler.update(plan, engine.step(plan))
    assert low.num_preemptions >= 1 and high.num_preemptions == 0
    assert len(high.output_ids) > len(low.output_ids)


def test_all_outputs_match_hash_chain_when_pool_forces_preemption():
    cfg = small_config()
    scheduler = Scheduler(cfg, num_pages=9)
    engine = FakePagedEngine(9, 4)
    requests = [request(f"r{i}", 3 + 5 * i % 17, 3 + i % 6, i) for i in range(10)]
    for r in requests:
        scheduler.add(r)
    finished, plans = run_to_completion(scheduler, engine)
    assert sorted(r.request_id for r in finished) == sorted(r.request_id for r in requests)
    for r in requests:
        assert r.output_ids == expected_output(r), r.request_id
    assert scheduler.stats.num_preemptions > 0
    assert scheduler.block_pool.num_free == 8  # every page returned
    assert any(p.phase == "prefill" and not all(p.samples) for p in plans)  # chunked prefill happened


def test_priority_orders_admission():
    scheduler = Scheduler(small_config(max_prefill_tokens=4, prefill_chunk_buckets=(4,)), num_pages=20)
    scheduler.add(request("low", 4, 2, 0, priority=5))
    scheduler.add(request("high", 4, 2, 1, priority=0))
    (plan,) = scheduler.schedule()
    assert plan.request_ids == ("high",)


def test_add_rejects_requests_that_can_never_fit():
    scheduler = Scheduler(small_config(), num_pages=3)
    with pytest.raises(ValueError, match="empty prompt"):
        scheduler.add(request("e", 0, 4))
    with pytest.raises(ValueError, match="the context is 32"):
        scheduler.add(request("long", 40, 4))
    with pytest.raises(ValueError, match="needs 4 KV pages; the pool has 2"):
        scheduler.add(request("big", 12, 4))


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 10)), min_size=1, max_size=8),
    num_pages=st.integers(9, 20),
)
def test_every_request_finishes_exactly_once_with_correct_tokens(lengths, num_pages):
    scheduler = Scheduler(small_config(), num_pages=num_pages)
    engine = FakePagedEngine(num_pages, 4)
    requests = [request(f"r{i}", p, m, i) for i, (p, m) in enumerate(lengths)]
    for r in requests:
        scheduler.add(r)
    finished, plans = run_to_completion(scheduler, engine)
    assert len(finished) == len(requests) == len({id(r) for r in finished})
    for r in requests:
        assert r.output_ids == expected_output(r)
    assert scheduler.block_pool.num_free == num_pages - 1
    cfg = scheduler.cfg
    for plan in plans:
        _, rows, tokens, width = plan.bucket
        buckets = cfg.decode_batch_buckets if plan.phase == "decode" else cfg.prefill_seq_buckets
        assert rows in buckets
        assert tokens == 1 if plan.phase == "decode" else tokens in cfg.prefill_chunk_buckets


def test_earliest_deadline_first_within_a_priority_and_expiry():
    scheduler = Scheduler(small_config(max_prefill_tokens=4, prefill_chunk_buckets=(4,)), num_pages=20)
    late, soon, stale = request("late", 4, 2, 0), request("soon", 4, 2, 1), request("stale", 4, 2, 2)
    late.deadline, soon.deadline, stale.deadline = 100.0, 50.0, 5.0
    for r in (late, soon, stale):
        scheduler.add(r)
    assert scheduler.expire(now=10.0) == [stale] and stale.finish_reason == "timeout"
    (plan,) = scheduler.schedule()
    assert plan.request_ids == ("soon",)


@pytest.mark.parametrize("policy", ["fcfs", "edf"])
def test_a_later_sample_of_n_never_times_out_once_its_first_sample_started(policy):
    # Sample 1 waits for sample 0's prompt pages (Scheduler._prompt_shared); the line has started when sample 0 was
    # admitted, so its deadline passing leaves sample 1 queued, as it leaves a preempted request (a partial line used to
    # be written as an ok record holding a timed-out sample).
    import dataclasses

    from jaxinfer.scheduling.policies import make_policy

    cfg = small_config(max_prefill_tokens=4, prefill_chunk_buckets=(4,), enable_prefix_caching=True, policy=policy)
    scheduler = Scheduler(cfg, num_pages=20, policy=make_policy(policy, cfg))
    first = request("s0", 12, 2, 0)
    later = dataclasses.replace(request("s1", 12, 2, 0), prompt_ids=first.prompt_ids, fork_of=first)
    first.deadline = later.deadline = 5.0
    scheduler.add(first)
    scheduler.add(later)
    (plan,) = scheduler.schedule()  # the first chunk of sample 0; sample 1 waits for its prompt pages
    assert plan.request_ids == ("s0",) and later.status == "waiting"
    if policy == "edf":
        scheduler.observe(plan, 10.0)  # a rate slow enough that a request not started would be shed
    assert scheduler.expire(now=10.0) == [] and later.status == "waiting" and later.finish_reason is None


def test_edf_keeps_or_sheds_the_samples_of_n_of_a_line_together():
    # Measured rate: 4 prefill tokens a second. Sample 0 can start at once (10.0 <= 10.5); sample 1 only waits for its
    # prompt pages, so it is not estimated behind sample 0's 12 tokens (13.0 > 10.5), and is kept with it. A line
    # whose first sample is late is shed whole.
    import dataclasses

    from jaxinfer.scheduling.policies import make_policy

    cfg = small_config(max_prefill_tokens=8, prefill_chunk_buckets=(4, 8), enable_prefix_caching=True, policy="edf")
    for deadline, shed in ((10.5, False), (9.5, True)):
        scheduler = Scheduler(cfg, num_pages=30, policy=make_policy("edf", cfg))
        a = request("a", 8, 4, 0)
        scheduler.add(a)
        (plan,) = scheduler.schedule()
        scheduler.update(plan, np.zeros(1, np.int32))
        scheduler.observe(plan, 2.0)
        first = request("s0", 12, 2, 1)
        later = dataclasses.replace(request("s1", 12, 2, 1), prompt_ids=first.prompt_ids, fork_of=first)
        first.deadline = later.deadline = deadline
        scheduler.add(first)
        scheduler.add(later)
        assert scheduler.expire(now=10.0) == ([first, later] if shed else []), deadline


def test_decode_splits_off_a_long_sequence_when_cheaper():
    scheduler = Scheduler(small_config(max_context=64, decode_batch_buckets=(1, 2, 4), decode_split_overhead=2.0), num_pages=40)
    engine = FakePagedEngine(40, 4)
    for i, (prompt, gen) in enumerate([(3, 12), (4, 12), (5, 12), (50, 12)]):
        scheduler.add(request(f"r{i}", prompt, gen, i))
    finished, plans = run_to_completion(scheduler, engine)
    assert all(r.output_ids == expected_output(r) for r in finished)
    steps = {}
    for plan in plans:
        if plan.phase == "decode":
            steps.setdefault(plan.positions[0, 0] >= 50, []).append(plan.bucket)
    assert ("decode", 1, 1, 16) in steps[True]  # the long one decodes alone at full width
    assert all(width <= 8 for _, _, _, width in steps[False])  # the short ones stay narrow


def test_split_decode_rows_keeps_one_group_when_overhead_dominates():
    reqs = [request(f"r{i}", n, 1, i) for i, n in enumerate([3, 5, 40])]
    width = lambda group: max(r.num_tokens for r in group)  # noqa: E731
    assert len(split_decode_rows(reqs, lambda g: 1000 + len(g) * width(g))) == 1
    groups = split_decode_rows(reqs, lambda g: 1 + len(g) * width(g))
    assert [[r.request_id for r in g] for g in groups] == [["r0", "r1"], ["r2"]]


@settings(max_examples=200, deadline=None)
@given(pages=st.lists(st.integers(1, 40), min_size=1, max_size=24), program_rows=st.integers(1, 9),
       overhead=st.sampled_from([0.0, 0.1, 2.0, 44.0, 1e9 / 3]))
@example(pages=[1, 2, 1], program_rows=4, overhead=0.0)  # two splits tie (16 each, 18 unsplit): the first wins
@example(pages=[7, 1, 1], program_rows=1, overhead=0.1)  # sum() is compensated: adding 16.1, 4.1, 4.1 in turn would make the unsplit group dearer than 16.1 + 8.2
def test_the_linear_split_picks_the_groups_costing_every_split_picks(pages, program_rows, overhead):
    # The reference: split_decode_rows re-costing every split point from the rows, the programs of each
    # group cut from its first row; pages in any order (a shared or released table need not grow with length).
    rows = [f"r{i}" for i in range(len(pages))]
    held = dict(zip(rows, pages))
    program_cost = lambda n, top: overhead + n * (2 * top + 2)  # noqa: E731
    def group_cost(group):
        return sum(program_cost(len(group[i : i + program_rows]), max(held[r] for r in group[i : i + program_rows])) for i in range(0, len(group), program_rows))
    # rows are already in length order here; split_decode_rows sorts by num_tokens, so give it objects that keep it
    reference = split_decode_rows([request(r, i + 1, 1, i) for i, r in enumerate(rows)], lambda g: group_cost([r.request_id for r in g]))
    linear = split_sorted_rows(rows, pages, program_cost, program_rows)
    assert [[r.request_id for r in g] for g in reference] == linear


def decode_cost(scheduler: Scheduler, group: list) -> float:
    """A group's modelled decode cost, by hand: per program of at most max_decode_rows rows, the split overhead plus
    rows x (pages + 2) of its bucketed key."""
    size, total = scheduler.tables.max_decode_rows, 0.0
    for i in range(0, len(group), size):
        piece = group[i : i + size]
        key = scheduler.tables.decode_key(len(piece), max(scheduler.kv.num_pages_held_by(piece)))
        total += scheduler.cfg.decode_split_overhead + key.num_rows * (key.num_pages + 2)
    return total


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 63), min_size=1, max_size=12), grown=st.lists(st.integers(0, 3), min_size=12, max_size=12),
       overhead=st.sampled_from([0.0, 3.0, 44.0]))
def test_the_scheduler_cuts_decode_rows_where_every_split_costed_from_their_pages_cuts(lengths, grown, overhead):
    # The reference: split_decode_rows over the modelled cost of a group (decode_cost, which reads the pages each
    # request holds now). Some rows hold pages beyond their tokens (`grown`), so pages need not
    # follow length; asked twice, the second answer comes from the scheduler's memo of earlier cuts.
    cfg = small_config(max_context=64, max_num_seqs=16, decode_batch_buckets=(2, 4, 8, 16), decode_page_buckets=(1, 2, 4, 8, 16), decode_split_overhead=overhead)
    scheduler = Scheduler(cfg, num_pages=400)
    requests = [request(f"r{i}", n, 1, i) for i, n in enumerate(lengths)]
    for r, extra in zip(requests, grown):
        assert scheduler.kv.try_allocate(r, min(64, r.num_tokens + extra * cfg.page_size)) is not None
    reference = [[r.request_id for r in group] for group in split_decode_rows(requests, lambda group: decode_cost(scheduler, group))]
    for _ in range(2):
        groups = scheduler._split_decode(requests)
        assert [[r.request_id for r in group] for group, _ in groups] == reference
        assert [pages for _, pages in groups] == [scheduler.kv.num_pages_held_by(group) for group, _ in groups]


def test_kv_utilization_counts_tokens_over_allocated_slots():
    scheduler = Scheduler(small_config(), num_pages=10)
    scheduler.add(request("a", 6, 1, 0))  # 6 tokens in 2 pages of 4: 6 / 8
    scheduler.schedule()
    assert scheduler.stats.peak_kv_utilization == pytest.approx(6 / 8)
    assert scheduler.stats.mean_kv_utilization == pytest.approx(6 / 8)


def test_partial_prefills_that_fill_the_pool_do_not_deadlock():
    """Two prompts admitted together, each partly prefilled, hold every page: one must yield."""
    cfg = small_config(max_prefill_tokens=8, prefill_chunk_buckets=(4,), prefill_seq_buckets=(1, 2))
    scheduler = Scheduler(cfg, num_pages=5)  # 4 usable pages of 4 tokens
    engine = FakePagedEngine(5, 4)
    for r in (request("a", 14, 2, 0), request("b", 14, 2, 1)):
        scheduler.add(r)
    finished, _ = run_to_completion(scheduler, engine, max_steps=200)
    assert sorted(r.request_id for r in finished) == ["a", "b"]
    assert all(r.output_ids == expected_output(r) for r in finished)
    assert scheduler.stats.num_preemptions > 0


class OldWaitingList(list):
    """The waiting list as the scheduler kept it before request_queue.py: new requests appended, preempted
    ones inserted at the front, a scan to expire, and the whole list sorted by the old key at every step."""

    def append(self, r) -> None:
        assert r.num_preemptions == 0, f"{r.request_id} was preempted: the old scheduler put it at the front"
        super().append(r)

    def appendleft(self, r) -> None:
        assert r.num_preemptions > 0, f"{r.request_id} is new: the old scheduler put it at the back"
        self.insert(0, r)

    def first(self, k: int):
        order = lambda r: (r.priority, r.deadline if r.deadline is not None else float("inf"), r.arrival_index)  # noqa: E731
        return sorted(self, key=order)[: max(k, 0)]

    def expire(self, now: float):
        expired = [r for r in self if r.deadline is not None and r.deadline < now and r.admit_index < 0]  # never admitted: not started
        for r in expired:
            self.remove(r)
        return expired


def mixed_workload(seed: int, arrivals_per_index: int) -> list[tuple[int, object]]:
    """(arrival step, request): priorities 0-1, some deadlines (in steps), and arrival indices shared by
    `arrivals_per_index` requests, so that many keys tie and the line decides (preempted ones first)."""
    rng = np.random.default_rng(seed)
    workload = []
    for i in range(28):
        r = request(f"r{i}", int(rng.integers(1, 20)), int(rng.integers(1, 9)), i // arrivals_per_index, priority=int(rng.integers(0, 2)))
        arrival = int(rng.integers(0, 25))
        r.deadline = None if rng.random() < 0.7 else float(arrival + rng.integers(2, 30))
        workload.append((arrival, r))
    return sorted(workload, key=lambda pair: pair[0])


def scripted_trace(scheduler, workload, num_pages: int) -> list[tuple]:
    """Per step (fake clock = step index): arrivals, then expiry, then the plans, run on the fake engine."""
    engine, processor = FakePagedEngine(num_pages, 4), OutputProcessor(None, None, scheduler.cfg.max_context)
    pending, trace, step = list(workload), [], 0
    while pending or scheduler.has_work():
        while pending and pending[0][0] <= step:
            scheduler.add(pending.pop(0)[1])
        expired = scheduler.expire(now=float(step))
        plans = scheduler.schedule()
        for plan in plans:
            runloop.run_plan(scheduler, engine.step, processor, plan)
        trace.append((step, [r.request_id for r in expired], [(p.phase, p.request_ids, p.bucket) for p in plans]))
        step += 1
        assert step < 2000, "did not finish"
    return trace


def new_and_old_runs(seed: int, arrivals_per_index: int, num_pages: int = 10) -> list[tuple]:
    """(trace, scheduler, requests) of the same workload with the waiting queue, then with the old list."""
    runs = []
    for waiting in (None, OldWaitingList()):
        scheduler = Scheduler(small_config(), num_pages=num_pages)
        if waiting is not None:
            scheduler.waiting = waiting
        workload = mixed_workload(seed, arrivals_per_index)
        runs.append((scripted_trace(scheduler, workload, num_pages), scheduler, [r for _, r in workload]))
    return runs


def test_admission_order_is_unchanged_from_the_sorted_list():
    num_preemptions = num_expired = num_reordered = 0
    for seed in range(6):
        for arrivals_per_index in (4, 28):  # 28: one arrival index for all, so only priority, deadline and the line order
            (new_trace, new, requests), (old_trace, old, _) = new_and_old_runs(seed, arrivals_per_index)
            assert new_trace == old_trace, (seed, arrivals_per_index)
            assert new.stats.num_preemptions == old.stats.num_preemptions
            for r in requests:
                assert r.finish_reason == "timeout" or r.output_ids == expected_output(r), r.request_id
            admitted = [rid for _, _, plans in new_trace for phase, ids, _ in plans if phase == "prefill" for rid in ids]
            first_admission = list(dict.fromkeys(admitted))
            num_reordered += first_admission != sorted(first_admission, key=lambda rid: int(rid[1:]))
            num_preemptions += new.stats.num_preemptions
            num_expired += sum(len(expired) for _, expired, _ in new_trace)
    assert num_preemptions > 0 and num_expired > 0 and num_reordered > 0  # the workloads exercise each rule
