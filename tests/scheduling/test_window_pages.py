"""Sliding-window page release in the host scheduler (no jax): a running request's pages wholly before
its next query's window go back to the pool (their table entries become the null page) and are reused;
nothing leaks; the prefix cache, preemption and penalties stay right.

A windowed fake engine reads, for each sampled row, only the last W positions of its sequence through
the block table (as sliding-window attention does) and returns a hash of them. It asserts that every
position it reads lies on a real page, so a page released too early (or a null entry inside the window)
fails the run; a wrong page or a page reused while still needed changes the tokens, which are compared
with the hash chain of the true sequence.
"""

import dataclasses

import numpy as np
import pytest

from jaxinfer.config import ModelConfig
from jaxinfer.scheduling.block_pool import NULL_PAGE, BlockPool
from jaxinfer.scheduling.kv_manager import page_release_window
from jaxinfer.scheduling.request import Request, SamplingParams
from jaxinfer.scheduling.scheduler import Scheduler

from fakes import FakePagedEngine, VOCAB, context_hash, run_to_completion, small_config

WINDOW = 6
PAGE = 4


class WindowedFakeEngine(FakePagedEngine):
    """FakePagedEngine whose rows see only their last `window` positions."""

    def __init__(self, num_pages: int, page_size: int, window: int):
        super().__init__(num_pages, page_size)
        self.window = window
        self.max_table_nulls = 0  # most null entries seen at the head of a sampled row's table

    def step(self, plan) -> np.ndarray:
        self.slots[plan.slot_pages, plan.slot_offsets] = plan.token_ids
        slots_per_row = plan.logit_indices.shape[1]
        out = np.zeros(plan.logit_indices.size, np.int32)
        for index in range(len(plan.request_ids)):
            row, slot = divmod(index, slots_per_row)
            last = plan.logit_indices[row, slot]
            segment = plan.token_segments[row, last]
            table = plan.block_tables[row, plan.page_segments[row] == segment]
            end = plan.positions[row, last] + 1
            positions = np.arange(max(0, end - self.window), end)
            pages = table[positions // self.page_size]
            assert (pages != NULL_PAGE).all(), f"a position inside the window reads the null page: {table}"
            self.max_table_nulls = max(self.max_table_nulls, int((table[: end // self.page_size] == NULL_PAGE).sum()))
            out[index] = context_hash(self.slots[pages, positions % self.page_size])
        return out


def windowed_output(req: Request, window: int) -> list[int]:
    tokens = list(req.prompt_ids)
    for _ in range(req.params.max_tokens):
        tokens.append(context_hash(tokens[-window:]))
    return tokens[len(req.prompt_ids):]


def make_request(rid: str, prompt: list[int], max_tokens: int, index: int = 0, **params) -> Request:
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
    return Request(rid, prompt, sampling, seed=0, arrival_index=index)


def prompt_of(index: int, length: int) -> list[int]:
    return [(13 * index + 7 * i + 2) % VOCAB for i in range(length)]


def windowed(num_pages: int, **overrides) -> tuple[Scheduler, WindowedFakeEngine]:
    cfg = small_config(max_context=64, release_window=WINDOW, **overrides)
    return Scheduler(cfg, num_pages), WindowedFakeEngine(num_pages, PAGE, WINDOW)


def run_all(scheduler, engine, requests):
    for r in requests:
        scheduler.add(r)
    finished, plans = run_to_completion(scheduler, engine)
    scheduler.block_pool.check_invariants()
    assert scheduler.block_pool.num_used == 0, "pages leaked"
    return finished, plans


def test_pages_outside_the_window_are_freed_and_reused_so_requests_fit_a_pool_too_small_for_them_whole():
    # Three requests of 5 + 35 tokens need 10 pages each, 30 in all, from a pool of 12: without release
    # they preempt one another; with it each holds at most 4 pages at a time and none is preempted.
    requests = [make_request(f"r{i}", prompt_of(i, 5), 35, i) for i in range(3)]
    scheduler, engine = windowed(num_pages=13)
    peak = []
    scheduler.observe = lambda plan, seconds: peak.append(scheduler.kv.num_used_pages)
    run_all(scheduler, engine, requests)
    for r in requests:
        assert r.output_ids == windowed_output(r, WINDOW), r.request_id
    assert scheduler.stats.num_preemptions == 0
    assert engine.max_table_nulls >= 7  # the head of a 40-token table is null entries by the end
    assert max(peak) <= 3 * 4  # (W - 1) / L rounded up, + 1 page being written, per request

    control = Scheduler(small_config(max_context=64), 13)  # no release: the same requests preempt
    run_all(control, WindowedFakeEngine(13, PAGE, WINDOW), [make_request(f"r{i}", prompt_of(i, 5), 35, i) for i in range(3)])
    assert control.stats.num_preemptions > 0


def test_release_keeps_the_table_aligned_and_frees_exactly_the_pages_before_the_window():
    scheduler, _ = windowed(num_pages=20)
    r = make_request("a", prompt_of(0, 3), 20)
    scheduler.add(r)
    pool = scheduler.block_pool
    pool.allocate("a", 4)  # positions 0..15
    r.num_computed_tokens = 13  # next query at 13 sees positions 8..13: pages 0 and 1 are wholly before it
    table = pool.pages_of("a")
    freed = scheduler.kv.release_outside_window(r)
    assert freed == table[:2] and pool.pages_of("a") == [NULL_PAGE, NULL_PAGE, *table[2:]]
    assert pool.free_order()[-2:] == table[:2]  # the tail: evicted after older free pages
    assert scheduler.kv.release_outside_window(r) == []  # idempotent
    r.num_computed_tokens = 14  # sees 9..14: page 2 (8..11) holds 9, 10 and 11, so it stays
    assert scheduler.kv.num_outside_window(r) == 2
    r.num_computed_tokens = 17  # sees 12..17: page 2 goes
    assert scheduler.kv.release_outside_window(r) == [table[2]]
    pool.free("a")
    pool.check_invariants()
    assert pool.num_used == 0


def test_a_released_page_keeps_its_prefix_name_until_evicted_and_a_later_request_shares_it():
    scheduler, engine = windowed(num_pages=30)
    prompt = prompt_of(5, 18)
    a = make_request("a", prompt, 10, 0)
    run_all(scheduler, engine, [a])
    b = make_request("b", prompt, 10, 1)
    finished, _ = run_all(scheduler, engine, [b])
    assert b.num_cached_tokens == 16  # the 4 full prompt pages, released while a ran, still named
    assert b.output_ids == a.output_ids == windowed_output(b, WINDOW)


def test_a_page_evicted_after_release_is_no_longer_named_and_the_prefix_is_recomputed():
    scheduler, engine = windowed(num_pages=14)
    prompt = prompt_of(6, 18)
    a = make_request("a", prompt, 10, 0)
    run_all(scheduler, engine, [a])
    others = [make_request(f"o{i}", prompt_of(20 + i, 9), 20, 1 + i) for i in range(3)]  # take every free page
    run_all(scheduler, engine, others)
    b = make_request("b", prompt, 10, 9)
    run_all(scheduler, engine, [b])
    assert scheduler.block_pool.num_evictions > 0
    assert b.num_cached_tokens < 16
    assert b.output_ids == windowed_output(b, WINDOW)
    assert all(o.output_ids == windowed_output(o, WINDOW) for o in others)


def test_preemption_with_released_pages_recomputes_and_nothing_leaks():
    # Four long requests in a pool that holds only about three windows: some are preempted mid-run
    # (their null entries and real pages both dropped) and recomputed from the start.
    requests = [make_request(f"p{i}", prompt_of(30 + i, 7), 17, i) for i in range(4)]
    scheduler, engine = windowed(num_pages=7)
    run_all(scheduler, engine, requests)
    assert scheduler.stats.num_preemptions > 0
    for r in requests:
        assert r.output_ids == windowed_output(r, WINDOW), r.request_id


def test_requests_with_penalties_keep_every_page():
    # Penalties count the whole sequence's tokens through its pages (engine.token_counts).
    scheduler, engine = windowed(num_pages=30)
    kept = make_request("k", prompt_of(1, 5), 20, 0, repetition_penalty=1.2)
    plain = make_request("p", prompt_of(2, 5), 20, 1)
    for r in (kept, plain):
        scheduler.add(r)
    for _ in range(12):
        for plan in scheduler.schedule():
            scheduler.update(plan, engine.step(plan))
    assert NULL_PAGE not in scheduler.block_pool.pages_of("k")
    assert NULL_PAGE in scheduler.block_pool.pages_of("p")


def test_the_release_window_comes_from_a_model_whose_every_layer_is_windowed():
    base = ModelConfig(vocab_size=32, num_layers=2, embed_dim=8, ffn_dim=16, num_heads=2, num_kv_heads=1, head_dim=4, max_context=64)
    assert page_release_window(base) is None
    assert page_release_window(dataclasses.replace(base, sliding_window=8)) == 8
    try:
        gemma = dataclasses.replace(base, sliding_window=8, layer_types=("sliding_attention", "full_attention"))
    except TypeError:
        pytest.skip("ModelConfig has no layer_types yet")
    assert page_release_window(gemma) is None  # a global layer reads every page
    assert page_release_window(dataclasses.replace(gemma, layer_types=("sliding_attention",) * 2)) == 8


def test_release_pages_refuses_more_entries_than_the_table_holds():
    pool = BlockPool(8)
    pool.allocate("a", 2)
    with pytest.raises(ValueError, match="cannot release 3 pages"):
        pool.release_pages("a", 3)
