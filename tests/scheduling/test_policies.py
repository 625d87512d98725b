"""Scheduling policies (scheduling/policies.py) in the host scheduler, no jax: every policy finishes every
request with the right tokens under page pressure; each policy's own decision (order, shedding, page waits,
budgets); the prefix policy's prefill saving on a shared-preamble workload (dry run); choosing a policy by
name. The last test runs the real default model in deterministic mode: a policy changes which step computes
a token, never the token."""

import dataclasses
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.config import POLICIES, EngineConfig
from jaxinfer.scheduling import runloop
from jaxinfer.scheduling.bucket_tables import BucketTables
from jaxinfer.scheduling.plan import BucketKey
from jaxinfer.scheduling.policies import REGISTRY, AdaptiveBudgets, EarliestDeadlineFirst, PrefillRate, PrefixAware, SchedulingPolicy, make_policy
from jaxinfer.scheduling.request import Request, SamplingParams
from jaxinfer.scheduling.scheduler import Scheduler
from jaxinfer.scheduling.sim_scheduler import SketchPlan
from jaxinfer.scheduling.simulator import SimRequest, simulate
from jaxinfer.scheduling.step_costs import StepCosts
from jaxinfer.validation import FieldError

from fakes import FakePagedEngine, expected_output, request, run_to_completion, small_config


def prompt_request(rid: str, prompt: list[int], max_tokens: int, index: int, **fields) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(prompt), params, seed=0, arrival_index=index, **fields)


def preamble_workload(num_lines: int, num_preambles: int, preamble_len: int, seed: int = 0) -> list[list[int]]:
    """Shuffled lines, each one of `num_preambles` shared preambles followed by its own 5 to 20 tokens."""
    rng = random.Random(seed)
    preambles = [[rng.randrange(1, 1000) for _ in range(preamble_len)] for _ in range(num_preambles)]
    return [rng.choice(preambles) + [rng.randrange(1, 1000) for _ in range(rng.randrange(5, 21))] for _ in range(num_lines)]


def prefill_tokens(plans) -> int:
    return sum(sum(p.num_new_tokens) for p in plans if p.phase == "prefill")


# ------------------------------------------------------------ choosing a policy


def test_every_configured_policy_name_is_registered_in_order():
    assert tuple(REGISTRY) == POLICIES and POLICIES[0] == "fcfs"
    for name in POLICIES:
        policy = make_policy(name, EngineConfig(policy=name))
        assert policy.name == name and isinstance(policy, SchedulingPolicy)
        assert Scheduler(EngineConfig(policy=name, compilation_cache_dir=None), 8).policy.name == name


def test_an_unknown_policy_is_refused_naming_the_valid_ones():
    with pytest.raises(FieldError, match=r"policy must be one of fcfs, shortest-prompt, edf, prefix, adaptive; got 'lifo'"):
        EngineConfig(policy="lifo")
    with pytest.raises(FieldError, match=r"policy must be one of .*prefix.*; got 'Prefix'"):
        make_policy("Prefix", EngineConfig())
    with pytest.raises(FieldError, match="latency_target_s"):
        EngineConfig(latency_target_s=0)


@pytest.mark.parametrize("policy", ["fcfs", "edf", "adaptive"])
def test_an_epoch_for_a_policy_that_orders_no_epochs_is_refused(policy):
    with pytest.raises(FieldError, match=rf"policy_epoch applies to the shortest-prompt and prefix policies; policy '{policy}' orders no epochs"):
        EngineConfig(policy=policy, policy_epoch=4)
    assert EngineConfig(policy="prefix", policy_epoch=4).policy_epoch == 4


def test_the_cli_flag_reaches_the_engine_config():
    from jaxinfer.cli import _build_parser, _engine_config

    parser = _build_parser()
    assert _engine_config(parser.parse_args(["generate", "--input", "in.jsonl", "--policy", "prefix"])).policy == "prefix"
    assert _engine_config(parser.parse_args(["generate", "--input", "in.jsonl"])).policy == "fcfs"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--input", "in.jsonl", "--policy", "lifo"])


# ------------------------------------------------------------ every policy is correct


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=15, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 12), st.integers(1, 8), st.integers(0, 2)), min_size=1, max_size=10),
    num_pages=st.integers(9, 20),
)
def test_every_policy_finishes_each_request_once_with_its_true_tokens(name, shapes, num_pages):
    """Shared prefixes (one of three), mixed priorities and a pool that forces preemption: each token must
    equal the hash chain of its true sequence, whichever request runs when."""
    cfg = small_config(policy=name, latency_target_s=1e-9)  # adaptive: every window shrinks the budgets
    scheduler = Scheduler(cfg, num_pages=num_pages)
    prefixes = [[100 + i for i in range(9)], [200 + i for i in range(6)], []]
    requests = []
    for i, (prefix, suffix, out, priority) in enumerate(shapes):
        prompt = (prefixes[prefix] + [(7 * i + 3 * j + 1) % 1000 for j in range(suffix)])[:20]
        requests.append(prompt_request(f"r{i}", prompt, out, i, priority=priority))
        scheduler.add(requests[-1])
    finished, plans = run_to_completion(scheduler, FakePagedEngine(num_pages, 4))
    assert sorted(r.request_id for r in finished) == sorted(r.request_id for r in requests)
    assert all(r.output_ids == expected_output(r) for r in requests)
    assert scheduler.block_pool.num_free == num_pages - 1
    keys = set(BucketTables.from_config(cfg).all_keys())
    assert all(plan.bucket in keys for plan in plans)  # no policy makes a shape the warm-up did not compile


# ------------------------------------------------------------ each policy's own decision


def test_shortest_prompt_first_within_a_priority():
    scheduler = Scheduler(small_config(policy="shortest-prompt", max_num_seqs=1), num_pages=20)
    for r in (request("long", 12, 2, 0), request("short", 3, 2, 1), request("urgent", 16, 2, 2, priority=-1), request("mid", 6, 2, 3)):
        scheduler.add(r)
    order = []
    while scheduler.has_work():
        for plan in scheduler.schedule():
            order += [rid for rid in plan.request_ids if rid not in order]
            for r in scheduler.update(plan, np.zeros(len(plan.request_ids), np.int32)):
                if len(r.output_ids) == r.params.max_tokens:
                    scheduler.finish(r, "length")
    assert order == ["urgent", "short", "mid", "long"]


def test_edf_sheds_a_request_whose_deadline_can_no_longer_be_met_so_the_next_meets_its_own():
    """10 tokens a second: 'first' (8 tokens) starts now; 'doomed' (deadline in 0.5 s) would start after
    0.8 s; 'fits' (deadline in 1.0 s) starts after 0.8 s only once 'doomed' is gone, and is kept."""
    cfg = small_config()
    scheduler = Scheduler(cfg, num_pages=30, policy=EarliestDeadlineFirst(cfg, tokens_per_second=10.0))
    first, doomed, fits, patient = (request(rid, 8, 2, i) for i, rid in enumerate(("first", "doomed", "fits", "patient")))
    first.deadline, doomed.deadline, fits.deadline = 100.5, 100.5, 101.0
    for r in (first, doomed, fits, patient):
        scheduler.add(r)
    assert scheduler.expire(now=100.0) == [doomed] and doomed.finish_reason == "timeout"
    assert [r.request_id for r in scheduler.waiting] == ["first", "fits", "patient"]
    assert scheduler.expire(now=100.0) == []


def test_edf_never_sheds_a_preempted_request_that_had_started():
    """A request that has started (admitted once, re-queued after a preemption before its first token, its prefill
    thrown away) is past its deadline's meaning, as in the queue's own expiry; one never admitted is shed."""
    cfg = small_config()
    scheduler = Scheduler(cfg, num_pages=30, policy=EarliestDeadlineFirst(cfg, tokens_per_second=1.0))
    scheduler.add(request("blocker", 8, 2, 0))
    scheduler.schedule()  # the blocker runs: its 8 prompt tokens take 8 s
    started, fresh = request("started", 8, 2, 1), request("fresh", 8, 2, 2)
    started.deadline, started.admit_index, fresh.deadline = 100.1, 7, 100.2  # its admission (the 8th), then a preemption
    scheduler.add(started)
    scheduler.add(fresh)
    assert scheduler.expire(now=100.0) == [fresh] and started.status == "waiting"


def test_edf_counts_a_preempted_requests_whole_recompute_as_the_prefill_ahead():
    """A request preempted after 20 generated tokens recomputes its 8 prompt and 20 output tokens. At 1 token/s a
    queued request with a 5-s deadline cannot start in time behind that recompute, so EDF sheds it (counting only
    the prompt's remaining tokens, it saw nothing ahead and kept it)."""
    cfg = small_config(max_num_seqs=4, max_context=64, page_size=4, max_prefill_tokens=8, prefill_chunk_buckets=(4, 8), enable_prefix_caching=False)
    scheduler, engine = Scheduler(cfg, num_pages=40, policy=EarliestDeadlineFirst(cfg, tokens_per_second=1.0)), FakePagedEngine(40, 4)
    first = request("first", 8, 30, 0)
    scheduler.add(first)
    for _ in range(20):
        for plan in scheduler.schedule():
            scheduler.update(plan, engine.step(plan))
    scheduler._preempt(first)  # as _reserve_decode_pages does when pages run out
    for plan in scheduler.schedule():  # re-admitted: the first chunk of its recompute, past its prompt
        scheduler.update(plan, engine.step(plan))
    assert first.num_computed_tokens >= len(first.prompt_ids) and first.num_tokens - first.num_computed_tokens >= 10
    late = request("late", 4, 4, 1)
    late.deadline = 5.0
    scheduler.add(late)
    assert scheduler.policy.shed(scheduler, 0.0) == [late]


def test_edf_counts_no_prefill_ahead_for_decoding_rows():
    """Six requests all decoding (no prefill left anywhere): a queued request with a 5-s deadline at 1 token/s starts
    at once and is kept (each decoding row's one uncomputed token is a decode step's, not prefill ahead)."""
    cfg = small_config(max_num_seqs=8, max_context=64, page_size=4, max_prefill_tokens=32, prefill_chunk_buckets=(4, 8, 16, 32),
                       decode_batch_buckets=(1, 2, 4, 8), enable_prefix_caching=False)
    scheduler, engine = Scheduler(cfg, num_pages=60, policy=EarliestDeadlineFirst(cfg, tokens_per_second=1.0)), FakePagedEngine(60, 4)
    for i in range(6):
        scheduler.add(request(f"r{i}", 4, 30, i))
    for _ in range(3):
        for plan in scheduler.schedule():
            scheduler.update(plan, engine.step(plan))
    assert len(scheduler.running) == 6 and all(scheduler.in_decode(r) for r in scheduler.running)
    late = request("late", 4, 4, 99)
    late.deadline = 5.0
    scheduler.add(late)
    assert scheduler.policy.shed(scheduler, 0.0) == []


def test_edf_sheds_nothing_before_it_has_measured_a_prefill_then_uses_the_measured_rate():
    cfg = small_config()
    scheduler = Scheduler(cfg, num_pages=30, policy=make_policy("edf", cfg))
    a, b, c, d = (request(rid, 8, 2, i) for i, rid in enumerate("abcd"))
    c.deadline, d.deadline = 10.5, 11.0  # EDF order: a (admitted below), c, d, then b (no deadline)
    scheduler.add(a)
    (plan,) = scheduler.schedule()
    for r in (b, c, d):
        scheduler.add(r)
    assert scheduler.expire(now=10.0) == []  # no rate yet: nothing is known to be late
    scheduler.update(plan, np.zeros(1, np.int32))
    scheduler.observe(plan, 2.0)  # a's 8 tokens in 2 s: 4 prefill tokens a second
    # c starts now (10.0 <= 10.5); d behind c's 8 tokens starts at 12.0 > 11.0
    assert scheduler.expire(now=10.0) == [d] and d.finish_reason == "timeout" and c.status == "waiting"


def test_edf_measures_the_prefill_rate_of_iterations_that_prefill_so_an_idle_spell_neither_lowers_nor_forgets_it():
    window = PrefillRate(32)
    plan = lambda phase, ids, tokens: SketchPlan(phase, BucketKey(phase, len(ids), max(tokens), 1), ids, tokens, (True,) * len(ids))  # noqa: E731
    window.add(plan("decode", ("a", "b"), (1, 1)), 0.03)  # the iteration's decode step, then its prefill of 128 tokens
    window.add(plan("prefill", ("c",), (128,)), 0.05)
    assert window.tokens_per_second() == pytest.approx(128 / 0.08)
    for _ in range(40):  # decode only: the queue was empty, nothing says how fast a prefill would go
        window.add(plan("decode", ("a", "b", "c"), (1, 1, 1)), 0.05)
    assert window.tokens_per_second() == pytest.approx(128 / 0.08)


def test_edf_counts_no_decode_step_of_an_iteration_before_in_a_prefill_alone_after_the_batch_finished():
    """a prefills (8 tokens, 1 s), decodes its last token alone (0.5 s) and finishes; then b's prefill runs alone in
    the next iteration (8 tokens, 1 s): the rate is 16 tokens over 2 s, with no decode step of the iteration before."""
    cfg = small_config()
    policy = make_policy("edf", cfg)
    scheduler = Scheduler(cfg, num_pages=30, policy=policy)
    a, b = request("a", 8, 2, 0), request("b", 8, 2, 1)
    scheduler.add(a)
    for seconds in (1.0, 0.5):  # a's prefill (its first token), then its last token in a decode step
        (plan,) = scheduler.schedule()
        scheduler.update(plan, np.zeros(1, np.int32))
        scheduler.observe(plan, seconds)
    scheduler.finish(a, "length")
    scheduler.add(b)
    (plan,) = scheduler.schedule()
    assert plan.phase == "prefill"
    scheduler.observe(plan, 1.0)
    assert policy.rate.tokens_per_second() == pytest.approx(16 / 2.0)


def test_edf_sheds_none_of_a_burst_that_arrives_after_a_decode_only_spell_and_starts_at_once():
    """One request decodes alone for a second; then 8 short requests arrive, each to start within about 1 s. Every
    one starts in the next step (as under fcfs), so none may be shed (the rate once counted the idle decode steps:
    6 of the 8 were)."""
    finishes = {}
    for name in ("fcfs", "edf"):
        cfg = EngineConfig(page_size=16, max_context=256, max_num_seqs=16, max_prefill_tokens=256, compilation_cache_dir=None, policy=name)
        costs = StepCosts.linear(BucketTables.from_config(cfg).all_keys(), program=(0.05, 0.0), host=(0.0, 0.0), max_rows=16)
        requests = [SimRequest(16, 200, arrival_s=0.0)] + [SimRequest(16, 4, arrival_s=1.0, deadline_s=1.0 + 0.01 * i) for i in range(8)]
        result = simulate(cfg, requests, costs, num_pages=200)
        finishes[name] = result.finish_reasons
        assert np.all(result.queue_s[1:] <= 0.05 + 1e-9), name
    assert finishes == {"fcfs": {"length": 9}, "edf": {"length": 9}}


@pytest.mark.parametrize("name", ["prefix", "shortest-prompt"])
def test_an_epoch_bounds_how_long_a_reordering_policy_keeps_a_request_waiting(name):
    """Request B (its own, longer prompt) arrives just after a family sharing a 48-token preamble, whose members keep
    arriving every 0.1 s for 30 s on 2 slots: under one epoch B waits for the whole family (the run's end), under
    epochs of 8 arrivals only for its own epoch and the one before."""
    waits = {}
    for epoch in (None, 8):
        cfg = EngineConfig(page_size=16, max_context=256, max_num_seqs=2, max_prefill_tokens=64, compilation_cache_dir=None, policy=name, policy_epoch=epoch)
        costs = StepCosts.linear(BucketTables.from_config(cfg).all_keys(), program=(0.05, 0.0), host=(0.0, 0.0), max_rows=2)
        requests = [SimRequest(64, 20, arrival_s=0.0, shared_prefix=48), SimRequest(80, 20, arrival_s=0.01)]
        requests += [SimRequest(64, 20, arrival_s=0.1 * i, shared_prefix=48) for i in range(300)]
        result = simulate(cfg, requests, costs, num_pages=64)
        waits[epoch] = float(result.queue_s[1])
        assert result.finish_reasons == {"length": 302}
    assert waits[None] > 100.0 and waits[8] < 10.0, waits


def test_prefix_policy_orders_the_queue_by_the_page_trie_so_siblings_are_adjacent():
    cfg = small_config(policy="prefix", max_context=64, page_size=4)
    scheduler = Scheduler(cfg, num_pages=60)
    a, b = list(range(100, 112)), list(range(200, 212))
    lines = [b + [1], a + [2], b + [3], a[:8] + [9, 9, 9, 9, 4], a + [5], [7, 7]]
    for i, line in enumerate(lines):
        scheduler.add(prompt_request(f"r{i}", line, 2, i))
    order = [r.request_id for r in scheduler.waiting.first(len(lines))]
    # no full page first, then b's family (seen first), then a's: the two with all 3 of a's pages, then the one sharing 2
    assert order == ["r5", "r0", "r2", "r1", "r4", "r3"]
    epochs = Scheduler(cfg, num_pages=60, policy=PrefixAware(cfg, epoch=3))  # arrivals 0-2, then 3-5, each in trie order
    for i, line in enumerate(lines):
        epochs.add(prompt_request(f"r{i}", line, 2, i))
    assert [r.request_id for r in epochs.waiting.first(len(lines))] == ["r0", "r2", "r1", "r5", "r4", "r3"]


def test_prefix_policy_holds_a_sibling_until_the_shared_pages_are_computed_then_it_shares_them():
    cfg = small_config(policy="prefix", max_context=64, max_prefill_tokens=32, prefill_chunk_buckets=(8, 16, 32), prefill_seq_buckets=(1,), max_prefill_seqs=4)
    scheduler = Scheduler(cfg, num_pages=60)
    preamble = list(range(100, 112))  # 3 full pages
    first, sibling, other = prompt_request("first", preamble + [1], 2, 0), prompt_request("sibling", preamble + [2], 2, 1), prompt_request("other", [5, 6], 2, 2)
    for r in (first, sibling, other):
        scheduler.add(r)
    (plan,) = scheduler.schedule()
    # the budget (32) has room for the sibling's 13 tokens, but it waits for first's pages; 'other' has no full page and goes first
    assert plan.request_ids == ("other", "first")
    scheduler.update(plan, np.zeros(2, np.int32))
    plans = scheduler.schedule()
    prefill = next(p for p in plans if p.phase == "prefill")
    assert prefill.request_ids == ("sibling",) and prefill.num_new_tokens == (1,)  # 12 tokens came from the cache
    assert sibling.num_cached_tokens == 12


def test_prefix_policy_does_not_hold_back_a_mean_pooled_request_for_pages_it_cannot_share():
    """A mean-pooled embedding reads every prompt token's hidden state, so no cached page may serve it: the prefix
    policy admits it while a running sibling still computes the preamble, instead of waiting for those pages. The
    other way round, the pooled request computes (and names) the preamble, so a sibling admitted behind it in the
    same step waits for those pages instead of computing them too."""
    cfg = small_config(policy="prefix", max_context=64, max_prefill_tokens=32, prefill_chunk_buckets=(8, 16, 32), prefill_seq_buckets=(1,),
                       max_prefill_seqs=4, enable_prefix_caching=True)
    preamble = list(range(100, 140))  # 10 full pages: the first prefill step computes 8 of them
    scheduler = Scheduler(cfg, num_pages=60)
    first = Request("first", preamble + [1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), seed=0, arrival_index=0)
    scheduler.add(first)
    (plan,) = scheduler.schedule()
    scheduler.update(plan, np.zeros(len(plan.request_ids), np.int32))
    pooled = Request("pooled", preamble + [2], SamplingParams(temperature=0, max_tokens=0, pooling="mean"), seed=0, arrival_index=1)
    scheduler.add(pooled)
    (plan,) = scheduler.schedule()
    assert plan.request_ids == ("first", "pooled")
    scheduler = Scheduler(cfg, num_pages=60)
    pooled = Request("pooled", preamble[:12] + [2], SamplingParams(temperature=0, max_tokens=0, pooling="mean"), seed=0, arrival_index=0)
    sibling = Request("sibling", preamble[:12] + [1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), seed=0, arrival_index=1)
    scheduler.add(pooled)
    scheduler.add(sibling)
    (plan,) = scheduler.schedule()
    assert plan.request_ids == ("pooled",)


def test_fcfs_admits_the_sibling_at_once_and_computes_the_preamble_twice():
    """Control for the test above: today's order gives the sibling the rest of the budget in the same
    step, before the first's pages exist."""
    cfg = small_config(max_context=64, max_prefill_tokens=32, prefill_chunk_buckets=(8, 16, 32), prefill_seq_buckets=(1,), max_prefill_seqs=4)
    scheduler = Scheduler(cfg, num_pages=60)
    preamble = list(range(100, 112))
    for i, r in enumerate((preamble + [1], preamble + [2])):
        scheduler.add(prompt_request(f"r{i}", r, 2, i))
    (plan,) = scheduler.schedule()
    assert plan.num_new_tokens == (13, 13)


def test_prefix_policy_computes_under_a_third_of_fcfs_prefill_on_a_shared_preamble_workload():
    """300 shuffled lines over 20 preambles of 100 tokens (page 16, 32 sequences). A pool of 64 pages holds
    the running requests but not the preambles too, so first-come-first-served evicts preambles and computes
    them again (0.29x measured); the prefix policy runs one family at a time while its pages are held.
    With a pool that holds everything, first-come-first-served shares them as well, and the prefix policy
    computes no more than it does."""
    prompts = preamble_workload(300, 20, 100)
    cfg = dict(page_size=16, max_context=256, max_num_seqs=32, max_prefill_tokens=256, compilation_cache_dir=None)
    counts = {}
    for pages in (64, 1000):
        for name in ("fcfs", "prefix"):
            plans, stats = runloop.dry_run(EngineConfig(policy=name, **cfg), prompts, [8] * len(prompts), num_pages=pages)
            counts[name, pages] = prefill_tokens(plans)
    assert counts["prefix", 64] * 3 <= counts["fcfs", 64], counts
    assert counts["prefix", 1000] <= counts["fcfs", 1000], counts
    assert counts["prefix", 64] <= counts["prefix", 1000] * 1.2, counts  # the small pool costs the prefix policy little


def test_prefix_policy_keeps_ranks_for_queued_requests_only_and_shares_as_much(monkeypatch):
    """A stream of 3,000 requests, each run before the next arrives, leaves no name ranked beyond the pruning
    bound (before it, every name ever seen was kept). 300 lines over 20 preambles arriving five a step: pruning
    as often as the bound allows, the prefix policy computes within 5% of the prefill tokens of never pruning (a family
    whose names were dropped ranks anew when it comes back, so the order may differ: 7,964 against 8,049 tokens)."""
    monkeypatch.setattr(PrefixAware, "prune_slack", 16)
    cfg = small_config(policy="prefix", max_context=64)
    scheduler, engine = Scheduler(cfg, num_pages=40), FakePagedEngine(40, 4)
    for i in range(3000):
        scheduler.add(prompt_request(f"r{i}", [(i * 13 + j) % 997 + 1 for j in range(16)], 1, i))
        run_to_completion(scheduler, engine)
    assert len(scheduler.policy._rank) <= 16 + 3  # the slack, and the last request's names (3 full pages that may be shared)
    prompts = preamble_workload(300, 20, 100)
    cfg = EngineConfig(page_size=16, max_context=256, max_num_seqs=32, max_prefill_tokens=256, compilation_cache_dir=None, policy="prefix")
    prunes, prune = [], PrefixAware._prune
    monkeypatch.setattr(PrefixAware, "_prune", lambda self, view: (prunes.append(len(self._rank)), prune(self, view)))

    def streamed() -> int:  # five requests arrive before each step; the prefill tokens computed
        scheduler, engine, plans, pending = Scheduler(cfg, num_pages=64), FakePagedEngine(64, 16), [], list(enumerate(prompts))

        def admit():
            for i, prompt in pending[:5]:
                scheduler.add(prompt_request(f"r{i}", prompt, 8, i))
            del pending[:5]
        admit()
        processor = runloop.OutputProcessor(None, None, cfg.max_context)
        finished = list(runloop.run(scheduler, engine.step, processor, admit=admit, on_step=lambda plan, *_: plans.append(plan)))
        assert len(finished) == len(prompts) and all(r.output_ids == expected_output(r) for r in finished)
        return prefill_tokens(plans)

    pruned = streamed()
    monkeypatch.setattr(PrefixAware, "prune_slack", 10**9)
    assert len(prunes) >= 3 and abs(streamed() - pruned) <= 0.05 * pruned, prunes


def test_adaptive_budgets_shrink_to_the_floors_when_slow_and_grow_back_when_fast_and_busy():
    """Steps take 0.5 s (target 0.1 s) for the first 30 steps, then 0.01 s: the prefill budget and the
    decode width fall to the smallest buckets (4 tokens, 2 rows), every step keeps to them, and both grow
    back to the configured limits once steps are fast and the limits are used."""
    cfg = small_config(policy="adaptive", latency_target_s=0.1, prefill_seq_buckets=(1,))
    policy = AdaptiveBudgets(cfg, window=4)
    scheduler = Scheduler(cfg, num_pages=80, policy=policy)
    for i in range(40):
        scheduler.add(request(f"r{i}", 12, 8, i))
    engine, now, steps = FakePagedEngine(80, 4), [0.0], []

    def step(plan):
        steps.append(plan.phase)
        if plan.phase == "prefill":  # planned under the budget in force (prefill plans run last in an iteration)
            assert sum(plan.num_new_tokens) <= policy.prefill_budget()
        assert len(scheduler.running) <= max(policy.decode_width(), 4)
        now[0] += 0.5 if len(steps) <= 30 else 0.01
        return engine.step(plan)

    finished = list(runloop.run(scheduler, step, runloop.OutputProcessor(None, None, 32), clock=lambda: now[0]))
    assert len(finished) == 40 and all(r.output_ids == expected_output(r) for r in finished)
    lowest = {phase: min(v for _, p, _, v in policy.changes if p == phase) for phase in ("prefill", "decode")}
    assert lowest == {"prefill": 4, "decode": 2}, policy.changes
    assert (policy.prefill_budget(), policy.decode_width()) == (8, 4), policy.changes


def test_adaptive_budgets_do_not_narrow_the_decode_width_again_before_the_last_narrowing_is_in_force():
    """Decode steps cost 10 ms + 10 ms a row against a 250 ms target: 24 rows at most. The 32 rows admitted at the
    start keep every step over the target until they finish; a narrower width only stops admissions, so the
    controller narrows once and waits (it once narrowed every window down to 1 row while the latency stayed)."""
    cfg = EngineConfig(page_size=16, max_context=512, max_num_seqs=32, max_prefill_tokens=512, compilation_cache_dir=None, policy="adaptive",
                       latency_target_s=0.25)
    policy = AdaptiveBudgets(cfg)
    scheduler = Scheduler(cfg, 32 * 32 + 1, policy=policy)
    for i in range(64):
        scheduler.add(prompt_request(str(i), [1 + (i * 7 + j) % 500 for j in range(32)], 200, i))
    now = [0.0]

    def step(plan):
        now[0] += 0.01 + 0.01 * len(plan.request_ids) if plan.phase == "decode" else 0.02 + 1e-4 * sum(plan.num_new_tokens)
        return np.zeros(plan.seeds.shape[0], np.int32)

    finished = list(runloop.run(scheduler, step, runloop.OutputProcessor(None, None, cfg.max_context), clock=lambda: now[0]))
    widths = [value for _, phase, _, value in policy.changes if phase == "decode"]
    assert len(finished) == 64 and widths and min(widths) >= 18, policy.changes


def test_a_refits_tables_reach_the_policy_whose_floors_follow_them():
    cfg = small_config(policy="adaptive", prefill_chunk_buckets=(4, 8), max_prefill_tokens=8)
    scheduler = Scheduler(cfg, 30)
    scheduler.policy.current["prefill"] = 4  # a slow spell left the budget at the old floor
    refitted = dataclasses.replace(cfg, prefill_chunk_buckets=(6, 8))
    scheduler.use_config(refitted)  # as batch/refit.py swaps a table in between steps
    assert scheduler.policy.cfg is refitted and scheduler.policy.limits["prefill"] == (6, 8) and scheduler.policy.prefill_budget() == 6


def test_adaptive_budgets_take_an_iterations_split_decode_as_one_step():
    """One long prompt and three short ones: the scheduler splits the decoding rows into two programs by length.
    With the decode width shrunk to 2 and every step far under the target, the two programs of an iteration are
    one decode step using the whole width, so the width grows back to 4 and the waiting requests run."""
    cfg = small_config(policy="adaptive", max_context=256, page_size=4, max_num_seqs=4, decode_batch_buckets=(1, 2, 4),
                       decode_page_buckets=(1, 2, 4, 8, 16, 32, 64), latency_target_s=0.1, max_prefill_tokens=8, prefill_chunk_buckets=(4, 8))
    policy = AdaptiveBudgets(cfg, window=4)
    policy.current["decode"] = 2  # as a slow spell leaves it (its floor is 1)
    scheduler, engine, split = Scheduler(cfg, num_pages=200, policy=policy), FakePagedEngine(200, 4), False
    for i, n in enumerate((200, 3, 3, 3)):
        scheduler.add(prompt_request(f"r{i}", [(5 * i + j) % 900 + 1 for j in range(n)], 150, i))
    for _ in range(60):
        plans = scheduler.schedule()
        split |= sum(p.phase == "decode" for p in plans) == 2
        for plan in plans:
            scheduler.update(plan, engine.step(plan))
            scheduler.observe(plan, 0.001)
    assert split and policy.decode_width() == 4 and len(scheduler.running) == 4, policy.changes


# ------------------------------------------------------------ the real model, deterministic mode

FEW_SHOT = {
    "capitals": "Answer with the capital city.\nQ: France? A: Paris.\nQ: Japan? A: Tokyo.\nQ: Kenya? A: Nairobi.\nQ: Peru? A: Lima.\n",
    "antonyms": "Give the opposite word.\nhot -> cold\nup -> down\nearly -> late\nfull -> empty\nloud -> quiet\nsoft -> hard\n",
}
QUESTIONS = [("capitals", "Q: Chile? A:"), ("antonyms", "wide ->"), ("capitals", "Q: Egypt? A:"), (None, "Tell me a joke about"),
             ("antonyms", "bright ->"), ("capitals", "Q: Norway? A:")]


@pytest.mark.slow
def test_outputs_under_every_policy_equal_fcfs_in_deterministic_mode_on_the_real_model(smollm2, smollm2_tokenizer, compile_cache):
    """SmolLM2 (f32) in deterministic mode over six prompts, four sharing one of two few-shot preambles,
    greedy and sampled: each reordering policy runs them in another order (the schedules differ), and every request's
    tokens equal first-come-first-served's. The adaptive controller, steered every 2 steps toward an unreachable
    latency, has nothing to shrink here: deterministic mode keeps one bucket per table, its floors."""
    import dataclasses

    from jaxinfer.engine.engine import Engine

    model_cfg, params = smollm2
    engine_cfg = EngineConfig(page_size=16, max_context=256, max_num_seqs=4, max_prefill_tokens=64, num_pages=48,
                              compilation_cache_dir=compile_cache, deterministic=True)
    engine = Engine(model_cfg, params, engine_cfg)
    engine.warmup()
    prompts = [smollm2_tokenizer.encode((FEW_SHOT[shot] if shot else "") + text) for shot, text in QUESTIONS]
    results = {}
    for name in ("fcfs", "prefix", "shortest-prompt", "adaptive"):
        cfg = dataclasses.replace(engine_cfg, policy=name)
        policy = AdaptiveBudgets(cfg, window=2, target_s=1e-6) if name == "adaptive" else None
        scheduler = Scheduler(cfg, engine.num_pages, policy=policy)
        requests = []
        for i, prompt in enumerate(prompts):
            params_i = SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=6, ignore_eos=True)
            requests.append(Request(str(i), prompt, params_i, seed=i, arrival_index=i))
            scheduler.add(requests[-1])
        order = []
        finished = list(runloop.run(scheduler, engine.step, runloop.OutputProcessor(None, None, 256), on_step=lambda plan, *_: order.append(plan.request_ids)))
        assert len(finished) == len(prompts) and all(r.finish_reason == "length" for r in finished)
        results[name] = ([r.output_ids for r in requests], order)
    for name in ("prefix", "shortest-prompt", "adaptive"):
        assert (results[name][1] == results["fcfs"][1]) == (name == "adaptive"), name
        assert results[name][0] == results["fcfs"][0], name
    assert scheduler.policy.limits == {"prefill": (64, 64), "decode": (4, 4)}  # the adaptive run's: its floors are its limits
