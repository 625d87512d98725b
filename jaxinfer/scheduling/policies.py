"""Scheduling policies: the decisions the scheduler leaves open, behind one small protocol. Host only, no jax.

The scheduler (scheduler.py) owns the mechanism: the waiting queue, chunked prefill under a token budget,
pages and preemption by recompute. A `SchedulingPolicy` decides

- admission order: the waiting queue's sort key (`queue_key`, fixed while a request is queued), and which
  of the queued requests are offered this step (`admission_order`, lazily, at most one per free slot);
- early timeouts (`shed`): waiting requests to finish as 'timeout' now, before their deadline passes;
- the preemption victim (`victim`);
- the prefill token budget (`prefill_budget`, the chunk size) and the decode width (`decode_width`, the
  running sequences at most), each at most the configured limit: the bucket tables are fixed at start-up,
  so a policy changes budgets and never a program shape;
- what it learns from each step (`observe(plan, seconds)`, which the run loop calls after every step).

The base class is first-come-first-served, the scheduler's own behaviour: (priority, deadline, arrival)
order, the least urgent priority preempted first (the most recently admitted of it), the configured limits. Policies are chosen by name
(`EngineConfig.policy`, `make_policy`), so the same policy runs in a real job, a replay and a simulation
(a simulator passes its own clock to `shed` through `Scheduler.expire(now)` and its modelled step times to
`observe`). No policy changes a token in deterministic mode, only which step computes it.
"""

import collections
import math
from collections.abc import Iterator
from typing import Protocol

import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.scheduling.bucket_tables import BucketTables
from jaxinfer.scheduling.kv_manager import KVManager, name_pages
from jaxinfer.scheduling.plan import StepPlan
from jaxinfer.scheduling.request import Request
from jaxinfer.scheduling.request_queue import RequestQueue, admission_key
from jaxinfer.validation import FieldError, check_int, check_number


class SchedulerView(Protocol):
    """What a policy reads of the scheduler (read only)."""

    cfg: EngineConfig
    running: list[Request]  # in admission order
    waiting: RequestQueue
    kv: KVManager

    def prefill_end(self, request: Request) -> int:
        """Tokens a prefill of this request covers (Scheduler.prefill_end)."""

    def in_decode(self, request: Request) -> bool:
        """Whether its next step feeds one token through a decode step (Scheduler.in_decode)."""


class SchedulingPolicy:
    """The protocol, with first-come-first-served as every decision's default."""

    name = "fcfs"

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg

    def queue_key(self, request: Request) -> tuple:
        """The waiting queue's sort key, lower first; it must not change while the request is queued."""
        return admission_key(request)

    def admission_order(self, view: SchedulerView, free_slots: int) -> Iterator[Request]:
        """Lazily, the queued requests to offer for admission this step, at most `free_slots` of them; the
        scheduler admits them in this order and stops at the first that does not fit."""
        return view.waiting.first(free_slots)

    def shed(self, view: SchedulerView, now: float) -> list[Request]:
        """Queued requests to finish as 'timeout' now (beyond those whose deadline has passed)."""
        return []

    def victim(self, running: list[Request]) -> Request:
        """The running request to preempt when pages run out: of the least urgent priority (the largest value), the most
        recently admitted; a request of a more urgent priority keeps its pages, whenever it was admitted."""
        return max(running, key=_victim_order)

    def prefill_budget(self) -> int:
        """Prefill tokens one step may compute (summed over its chunks)."""
        return self.cfg.max_prefill_tokens

    def decode_width(self) -> int:
        """Running sequences at most: no admission while this many run."""
        return self.cfg.max_num_seqs

    def observe(self, plan: StepPlan, seconds: float) -> None:
        """One step ran: its plan and how long it took (wall clock, or a simulator's model)."""

    def new_iteration(self) -> None:
        """An iteration is planned (Scheduler.schedule): every step of the one before it was observed."""

    @classmethod
    def learns_from_steps(cls) -> bool:
        """Whether it overrides observe or new_iteration: each step may then change its decisions, so a simulator
        runs every iteration of it (no fast-forward)."""
        return cls.observe is not SchedulingPolicy.observe or cls.new_iteration is not SchedulingPolicy.new_iteration

    def use_config(self, cfg: EngineConfig) -> None:
        """The scheduler's config changed between steps (a refit's tables; the limits are the same): what the
        policy derives from it follows."""
        self.cfg = cfg


def _victim_order(request: Request) -> tuple[int, int]:
    return request.priority, request.admit_index


def epoch_of(request: Request, epoch: int | None) -> int:
    """The request's epoch of `epoch` arrivals (EngineConfig.policy_epoch; None: one epoch): a reordering policy's
    bound on how many later arrivals may go before it."""
    return request.arrival_index // epoch if epoch else 0


class ShortestPromptFirst(SchedulingPolicy):
    """Within a priority (and an epoch of `EngineConfig.policy_epoch` arrivals), the shortest prompt first, then
    arrival: short requests stop queueing behind long prefills. Without an epoch a long prompt waits while shorter
    ones keep arriving, in a stream until the input ends."""

    name = "shortest-prompt"

    def queue_key(self, request: Request) -> tuple:
        return (request.priority, epoch_of(request, self.cfg.policy_epoch), len(request.prompt_ids), request.arrival_index)


class DecodeStep:
    """An iteration's decode plans taken together, as one decode step: the scheduler may split its decoding rows into
    two programs (each observed on its own), and a sequence waits for both. The plans of one iteration hold disjoint
    rows and come before its prefill plan, so a decode plan holding a row already seen starts the next iteration;
    the scheduler says so too (`end` at SchedulingPolicy.new_iteration), which an iteration of a prefill alone after
    one whose rows all finished needs: no row of it is seen again."""

    def __init__(self):
        self._step: tuple[set[str], float] | None = None  # the iteration's decode plans so far: (their rows, their seconds)

    def add(self, plan: StepPlan, seconds: float) -> tuple[int, float] | None:
        """A decode plan; the decode step it ends, (rows, seconds), when it starts a new iteration, else None."""
        rows = set(plan.request_ids)
        ended = self.end() if self._step is not None and not rows.isdisjoint(self._step[0]) else None
        seen, spent = self._step or (set(), 0.0)
        self._step = (seen | rows, spent + float(seconds))
        return ended

    def end(self) -> tuple[int, float] | None:
        """The decode step under way, (rows, seconds), ended (a prefill plan came, or the iteration did); None if none."""
        if self._step is None:
            return None
        rows, seconds = self._step
        self._step = None
        return len(rows), seconds


class PrefillRate:
    """How fast the engine prefills while it does: the prefill tokens of the last `size` iterations that held a
    prefill step, over their seconds (the prefill step's and the same iteration's decode steps', which share the
    device). An iteration without a prefill (nothing waiting, or no slot free) says nothing of it, so a quiet spell
    neither lowers the rate nor forgets it."""

    def __init__(self, size: int):
        self.samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=check_int("window", size, low=1))  # (tokens, seconds)
        self._decode = DecodeStep()

    def add(self, plan: StepPlan, seconds: float) -> None:
        if plan.phase == "decode":
            self._decode.add(plan, seconds)
            return
        decode = self._decode.end()  # the same iteration's decode step, which shared the device with this prefill
        self.samples.append((sum(plan.num_new_tokens), float(seconds) + (decode[1] if decode else 0.0)))

    def new_iteration(self) -> None:
        """The last iteration's decode step, if it held no prefill, says nothing of the rate."""
        self._decode.end()

    def tokens_per_second(self) -> float | None:
        """None before a prefill step has been seen."""
        tokens, seconds = sum(s[0] for s in self.samples), sum(s[1] for s in self.samples)
        return tokens / seconds if tokens and seconds > 0 else None


class EarliestDeadlineFirst(SchedulingPolicy):
    """Earliest deadline first within a priority, with SLO admission: a queued request whose deadline (the
    time by which it must start) can no longer be met is finished as 'timeout' at once, so the prefill
    time it would take goes to the requests that can still meet theirs.

    A request's start is estimated as now + (prefill tokens ahead of it: what the running requests' prefills have
    left, a preempted one's recompute included, then the prompts before it in admission order that are kept) /
    prefill throughput. The throughput is
    `tokens_per_second` when given, else measured over the last `window` iterations that prefilled (`observe`,
    PrefillRate: an idle spell leaves it as it was); before any prefill has been measured nothing is shed.
    Cached prefixes are not subtracted, and waits for a free sequence slot are not added. A request the
    scheduler has admitted once has started (Request.has_started; so has a later sample of n once its first is
    admitted), and is never shed (nor expired) after a preemption.
    """

    name = "edf"

    def __init__(self, cfg: EngineConfig, *, tokens_per_second: float | None = None, window: int = 32):
        super().__init__(cfg)
        if tokens_per_second is not None:
            tokens_per_second = check_number("tokens_per_second", tokens_per_second, low=0.0, high=math.inf, low_open=True)
        self.tokens_per_second = tokens_per_second
        self.rate = PrefillRate(window)

    def observe(self, plan: StepPlan, seconds: float) -> None:
        self.rate.add(plan, seconds)

    def new_iteration(self) -> None:
        self.rate.new_iteration()

    def shed(self, view: SchedulerView, now: float) -> list[Request]:
        rate = self.tokens_per_second or self.rate.tokens_per_second()
        left = view.waiting.num_with_deadline  # the walk ends after the last of them
        if rate is None or not left:
            return []
        ahead = sum(max(0, view.prefill_end(r) - r.num_computed_tokens) for r in view.running if not view.in_decode(r))
        shed, shed_ids = [], set()
        for request in view.waiting.first(len(view.waiting)):
            first = request.fork_of  # a later sample of n follows its first: shed with it, kept with it, its prompt shared
            if request.deadline is not None:
                left -= 1
                late = id(first) in shed_ids if first is not None else now + ahead / rate > request.deadline
                if not request.has_started and late:
                    shed.append(request)
                    shed_ids.add(id(request))
                    continue
            if not left:
                break
            ahead += request.num_tokens if first is None else len(request.output_ids)
        return shed


class PrefixAware(SchedulingPolicy):
    """Longest shared prefix first, over the page-hash trie of the requests in flight.

    The queue key is (priority, trie path, arrival): a prompt's path is the rank of each of its full pages'
    names (the prefix cache's hash chain), a name ranked when first seen. Sorting by paths walks the trie
    depth first, so requests that share a prefix are adjacent and the deeper the shared prefix, the closer;
    siblings (requests with the same first pages) are admitted together, while their shared pages are
    cached and held. A queued request whose next uncached page is being computed by a running request (or by
    one admitted earlier in the same step) is not offered until that page is computed and named: it then
    shares it instead of computing it again.

    A newly seen prefix ranks after those seen before, so in a stream a family that keeps arriving goes
    before a later one, whose requests may wait until the input ends. `epoch` bounds that wait: requests
    are ordered by (arrival index // epoch) first, the trie only within an epoch of that many arrivals
    (None: `EngineConfig.policy_epoch`, whose None is one epoch, the most sharing).

    The ranks are kept for the names of queued requests only: once the names ranked are over twice those
    of the last prune plus `prune_slack`, the others are dropped (a queued request's key never changes;
    a name seen again later ranks after every name ranked so far), so a long job's memory stays bounded.
    """

    name = "prefix"
    prune_slack = 65536  # names ranked beyond twice those kept at the last prune before the next prune

    def __init__(self, cfg: EngineConfig, *, epoch: int | None = None):
        super().__init__(cfg)
        self.epoch = cfg.policy_epoch if epoch is None else check_int("epoch", epoch, low=1)
        self._rank: dict[bytes, int] = {}  # page name -> order first seen (names of queued requests, and those since the last prune)
        self._next_rank = 0
        self._kept = 0  # names kept at the last prune

    def _names(self, request: Request) -> list[bytes]:
        """Names of the prompt's full pages that a prefix-cache hit may serve (Request.first_logits_position's rule:
        none for a mean-pooled embedding, those before the first scored token with prompt_logprobs)."""
        return name_pages(request, request.first_logits_position(len(request.prompt_ids)) // self.cfg.page_size, self.cfg.page_size)

    def _computed_names(self, request: Request) -> list[bytes]:
        """Names of the full prompt pages before its last token (the pages _names counts for a plain request), which its
        prefill computes and names whether or not a hit may serve it."""
        return name_pages(request, (len(request.prompt_ids) - 1) // self.cfg.page_size, self.cfg.page_size)

    def queue_key(self, request: Request) -> tuple:
        rank, path = self._rank, []
        for name in self._names(request):
            place = rank.get(name)
            if place is None:
                place = rank[name] = self._next_rank
                self._next_rank += 1
            path.append(place)
        path = tuple(path)
        return (request.priority, epoch_of(request, self.epoch), path, request.arrival_index)

    def admission_order(self, view: SchedulerView, free_slots: int) -> Iterator[Request]:
        if len(self._rank) > 2 * self._kept + self.prune_slack:
            self._prune(view)
        if free_slots <= 0:
            return iter(())
        if not self.cfg.enable_prefix_caching:
            return view.waiting.first(free_slots)
        return self._not_waiting_for_pages(view, free_slots)

    def _prune(self, view: SchedulerView) -> None:
        """Drop the ranks of names no queued request holds (amortized: the ranked names at least doubled since the last)."""
        live = {name for request in view.waiting for name in self._names(request)}
        self._rank = {name: place for name, place in self._rank.items() if name in live}
        self._kept = len(self._rank)

    def _not_waiting_for_pages(self, view: SchedulerView, free_slots: int) -> Iterator[Request]:
        computing = set()  # names of prompt pages a running request is computing
        for request in view.running:
            computing.update(self._computed_names(request)[request.num_computed_tokens // self.cfg.page_size :])
        for request in view.waiting.first(len(view.waiting)):
            if free_slots <= 0:
                return
            names = self._names(request)
            cached = view.kv.num_cached_pages(names)
            if cached < len(names) and names[cached] in computing:
                continue  # its next page is on its way: take it from the cache next step
            computing.update(self._computed_names(request)[cached:])  # the pages it computes (a hit serves a prefix of them)
            free_slots -= 1
            yield request


class AdaptiveBudgets(SchedulingPolicy):
    """First-come-first-served order, with the prefill token budget (chunk size) and the decode width steered
    toward a step-latency target (`EngineConfig.latency_target_s`).

    Every `window` steps of a phase, the p99 of their latencies (a decode step's only where its rows were within the
    width: a narrower width takes effect as running rows finish) is compared with the target: over it, that phase's
    limit shrinks (x `shrink`, down to its floor); under `headroom` x the target while the limit was
    used (mean utilisation, tokens / budget or rows / width, at least `busy`), it grows (x `grow`, up to the
    configured maximum). Floors are the smallest chunk bucket and the smallest decode-row bucket, so every
    budget maps to programs compiled at warm-up. `changes` records (step, phase, p99, new limit).

    A decode step is an iteration's decode plans together (DecodeStep: their seconds and rows summed).
    """

    name = "adaptive"

    def __init__(self, cfg: EngineConfig, *, target_s: float | None = None, window: int = 32, shrink: float = 0.75, grow: float = 1.25,
                 headroom: float = 0.8, busy: float = 0.8):
        super().__init__(cfg)
        self.target_s = check_number("target_s", cfg.latency_target_s if target_s is None else target_s, low=0.0, high=math.inf, low_open=True)
        self.window = check_int("window", window, low=1)
        self.shrink, self.grow = check_number("shrink", shrink, low=0.0, high=1.0, low_open=True), check_number("grow", grow, low=1.0, high=math.inf)
        self.headroom, self.busy = check_number("headroom", headroom, low=0.0, high=1.0), check_number("busy", busy, low=0.0, high=1.0)
        self.limits = self._limits(cfg)
        self.current = {"prefill": cfg.max_prefill_tokens, "decode": cfg.max_num_seqs}
        self._seen: dict[str, list[tuple[float, float, int]]] = {"prefill": [], "decode": []}  # (seconds, utilisation, tokens or rows used)
        self._decode = DecodeStep()
        self.num_steps = 0
        self.changes: list[tuple[int, str, float, int]] = []

    @staticmethod
    def _limits(cfg: EngineConfig) -> dict[str, tuple[int, int]]:
        """Each phase's (floor, ceiling): the smallest bucket of its table, and its configured limit."""
        tables = BucketTables.from_config(cfg)
        return {"prefill": (min(tables.chunk_tokens[0], cfg.max_prefill_tokens), cfg.max_prefill_tokens),
                "decode": (min(tables.decode_rows[0], cfg.max_num_seqs), cfg.max_num_seqs)}

    def use_config(self, cfg: EngineConfig) -> None:
        """New tables (a refit): the floors are their smallest buckets, each limit in force kept within them."""
        super().use_config(cfg)
        self.limits = self._limits(cfg)
        for phase, (floor, ceiling) in self.limits.items():
            self.current[phase] = min(ceiling, max(floor, self.current[phase]))

    def prefill_budget(self) -> int:
        return self.current["prefill"]

    def decode_width(self) -> int:
        return self.current["decode"]

    def observe(self, plan: StepPlan, seconds: float) -> None:
        self.num_steps += 1
        ended = self._decode.add(plan, seconds) if plan.phase == "decode" else self._decode.end()
        if ended is not None:
            self._record("decode", ended[1], ended[0])
        if plan.phase == "prefill":
            self._record("prefill", float(seconds), sum(plan.num_new_tokens))

    def new_iteration(self) -> None:
        ended = self._decode.end()
        if ended is not None:
            self._record("decode", ended[1], ended[0])

    def _record(self, phase: str, seconds: float, used: int) -> None:
        seen = self._seen[phase]
        seen.append((seconds, min(1.0, used / self.current[phase]), used))
        if len(seen) >= self.window:
            self._steer(phase, seen)
            seen.clear()

    def _steer(self, phase: str, seen: list[tuple[float, float, int]]) -> None:
        value = self.current[phase]
        # A narrower decode width stops admissions and takes effect only as running rows finish: the latency it answers
        # for is that of the steps within it. Judged on every step, a narrowing not yet in force would be narrowed
        # again, window after window, down to the floor while the latency stays the same.
        seconds = [s for s, _, used in seen if phase != "decode" or used <= value]
        if not seconds:
            return
        p99 = float(np.percentile(seconds, 99))
        utilisation = sum(u for _, u, _ in seen) / len(seen)
        floor, ceiling = self.limits[phase]
        if p99 > self.target_s:
            value = max(floor, int(value * self.shrink))
        elif p99 < self.headroom * self.target_s and utilisation >= self.busy:
            value = min(ceiling, max(value + 1, int(value * self.grow)))
        if value != self.current[phase]:
            self.current[phase] = value
            self.changes.append((self.num_steps, phase, p99, value))


REGISTRY: dict[str, type[SchedulingPolicy]] = {
    cls.name: cls for cls in (SchedulingPolicy, ShortestPromptFirst, EarliestDeadlineFirst, PrefixAware, AdaptiveBudgets)
}


def make_policy(name: str, cfg: EngineConfig, **options) -> SchedulingPolicy:
    """The policy registered under `name` for an engine with this config; `options` go to its constructor
    (EarliestDeadlineFirst's tokens_per_second, AdaptiveBudgets' target_s and window, ...)."""
    if name not in REGISTRY:
        raise FieldError("policy", f"must be one of {', '.join(REGISTRY)}; got {name!r}")
    return REGISTRY[name](cfg, **options)

