"""Prefix caching in the host scheduler (no jax): exact pages shared at admission, only the rest
computed, eviction under pressure, salts, preemption; and the fake paged engine proves every token of
every request equals the hash chain of its true sequence, hits or not."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.scheduling.request import Request, SamplingParams
from jaxinfer.scheduling.scheduler import Scheduler

from fakes import FakePagedEngine, expected_output, run_to_completion, small_config


def shared_request(rid: str, prefix: list[int], suffix_len: int, max_tokens: int, index: int = 0, salt=None) -> Request:
    suffix = [(11 * index + 5 * i + 3) % 1000 for i in range(suffix_len)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prefix + suffix, params, seed=0, arrival_index=index, cache_salt=salt)


PREFIX = list(range(100, 110))  # 10 tokens: two full pages of 4, plus 2


def run(scheduler, requests, engine):
    for r in requests:
        scheduler.add(r)
    return run_to_completion(scheduler, engine)


def test_second_request_shares_the_full_pages_of_the_first_and_computes_only_the_rest():
    scheduler = Scheduler(small_config(), num_pages=20)
    engine = FakePagedEngine(20, 4)
    a = shared_request("a", PREFIX, 3, 2, 0)  # 13 tokens: pages 1, 2, 3 full after prefill, 4 partial
    run(scheduler, [a], engine)
    b = shared_request("b", PREFIX, 5, 2, 1)
    scheduler.add(b)
    (plan,) = scheduler.schedule()
    assert plan.request_ids == ("b",) and plan.positions[0, 0] == 8  # pages of tokens 0..7 came from a
    assert scheduler.block_pool.pages_of("b")[:2] == [1, 2]
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert (scheduler.stats.prefix_cache_queries, scheduler.stats.prefix_cache_hits) == (13 + 15, 8)
    finished, _ = run_to_completion(scheduler, engine)
    assert b.output_ids == expected_output(b)


def test_a_prompt_that_is_all_cached_still_computes_its_last_token():
    scheduler = Scheduler(small_config(), num_pages=20)
    engine = FakePagedEngine(20, 4)
    a = shared_request("a", PREFIX[:8], 0, 3, 0)  # 8 tokens = 2 full pages
    run(scheduler, [a], engine)
    b = shared_request("b", PREFIX[:8], 0, 3, 1)
    scheduler.add(b)
    (plan,) = scheduler.schedule()
    assert plan.positions[0, 0] == 4 and plan.num_new_tokens == (4,)  # page 2 is recomputed: its last token needs logits
    assert b.num_cached_tokens == 4
    run_to_completion(scheduler, engine)
    assert b.output_ids == a.output_ids == expected_output(b)


def test_different_salts_do_not_share():
    scheduler = Scheduler(small_config(), num_pages=20)
    engine = FakePagedEngine(20, 4)
    run(scheduler, [shared_request("a", PREFIX, 3, 2, 0, salt="alice")], engine)
    b = shared_request("b", PREFIX, 3, 2, 1, salt="bob")
    c = shared_request("c", PREFIX, 3, 2, 2, salt="alice")
    run(scheduler, [b, c], engine)
    assert b.num_cached_tokens == 0 and c.num_cached_tokens == 8


def test_disabled_cache_computes_everything():
    scheduler = Scheduler(small_config(enable_prefix_caching=False), num_pages=20)
    engine = FakePagedEngine(20, 4)
    run(scheduler, [shared_request("a", PREFIX, 3, 2, 0)], engine)
    b = shared_request("b", PREFIX, 3, 2, 1)
    run(scheduler, [b], engine)
    assert b.num_cached_tokens == 0 and scheduler.stats.prefix_cache_queries == 0
    assert scheduler.block_pool.num_cached == 0


def test_generated_tokens_are_cached_too_for_the_next_turn():
    scheduler = Scheduler(small_config(), num_pages=20)
    engine = FakePagedEngine(20, 4)
    turn1 = shared_request("t1", PREFIX, 0, 6, 0)  # 10 prompt + 6 generated = 16 tokens
    run(scheduler, [turn1], engine)
    history = turn1.prompt_ids + turn1.output_ids  # the next turn resends the whole conversation
    turn2 = Request("t2", history + [7, 7, 7], dataclasses.replace(turn1.params, max_tokens=2), seed=0)
    run(scheduler, [turn2], engine)
    assert turn2.num_cached_tokens == 12  # 15 computed tokens of turn 1 fill 3 pages (the 16th was never fed back)
    assert turn2.output_ids == expected_output(turn2)


def test_preempted_request_keeps_nothing_and_its_shared_pages_stay_with_the_others():
    scheduler = Scheduler(small_config(max_prefill_tokens=8, prefill_chunk_buckets=(4, 8)), num_pages=8)
    engine = FakePagedEngine(8, 4)  # 7 usable pages; b and c need 5 each, 2 of them shared
    a = shared_request("a", PREFIX[:8], 0, 8, 0)
    run(scheduler, [a], engine)
    b, c = shared_request("b", PREFIX[:8], 1, 10, 1), shared_request("c", PREFIX[:8], 2, 10, 2)
    finished, _ = run(scheduler, [b, c], engine)
    assert b.output_ids == expected_output(b) and c.output_ids == expected_output(c)
    assert scheduler.stats.num_preemptions > 0, "the pool was meant to force preemption"
    scheduler.block_pool.check_invariants()
    assert scheduler.block_pool.num_free == 7


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 9), st.integers(1, 8)), min_size=1, max_size=10),
    num_pages=st.integers(7, 24),
    prefix_len=st.integers(1, 14),
)
def test_random_shared_prefix_workloads_complete_with_correct_tokens_and_sound_pages(groups, num_pages, prefix_len):
    """Random prefixes shared by random requests, random pool sizes (so preemption and eviction happen):
    every request completes with the tokens of its true sequence; no shared page is ever freed."""
    scheduler = Scheduler(small_config(max_context=32), num_pages=num_pages)
    engine = FakePagedEngine(num_pages, 4)
    prefixes = [[(37 * g + 13 * i) % 1000 for i in range(prefix_len)] for g in range(4)]
    requests = []
    for i, (group, suffix_len, max_tokens) in enumerate(groups):
        r = shared_request(f"r{i}", prefixes[group], suffix_len, max_tokens, i)
        if len(r.prompt_ids) + max_tokens <= 32 and -(-(len(r.prompt_ids) + max_tokens) // 4) <= num_pages - 1:
            requests.append(r)
    original_free = scheduler.block_pool.free

    def checked_free(request_id):
        released = original_free(request_id)
        owned = {p for rid, pages in scheduler.block_pool._req_to_pages.items() for p in pages}
        assert not set(released) & owned, "a page still shared was freed"
        scheduler.block_pool.check_invariants()
        return released

    scheduler.block_pool.free = checked_free
    finished, _ = run(scheduler, requests, engine)
    assert sorted(r.request_id for r in finished) == sorted(r.request_id for r in requests)
    for r in requests:
        assert r.output_ids == expected_output(r), r.request_id
    scheduler.block_pool.check_invariants()
    assert scheduler.block_pool.num_free == num_pages - 1
