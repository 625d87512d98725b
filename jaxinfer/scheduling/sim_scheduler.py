"""The simulator's scheduler: the real `Scheduler`, every decision its own, whose plans are sketches without arrays
(`SketchPlan`: what the run loop and `Scheduler.update` read of a StepPlan), with the decode clock's bookkeeping
(sim_decode.py) and the simulator's page names (sim_pages.py). Host only, no jax. simulator.py drives it.
"""

from typing import NamedTuple

from jaxinfer.config import EngineConfig
from jaxinfer.scheduling.plan import BucketKey
from jaxinfer.scheduling.policies import SchedulingPolicy
from jaxinfer.scheduling.request import Request
from jaxinfer.scheduling.scheduler import Scheduler
from jaxinfer.scheduling.sim_decode import DecodeClock, DecodeRows
from jaxinfer.scheduling.sim_pages import SimKV


class SketchPlan(NamedTuple):
    """A plan without arrays: what the run loop and Scheduler.update read of a StepPlan."""

    phase: str
    bucket: BucketKey
    request_ids: tuple[str, ...]
    num_new_tokens: tuple[int, ...]
    samples: tuple[bool, ...]

    def chunk_starts(self) -> list[tuple[int, int]]:
        return [(i, 0) for i in range(len(self.request_ids))]

    @property
    def num_real_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_padded_tokens(self) -> int:
        return self.bucket.num_rows * self.bucket.num_tokens


class SketchScheduler(Scheduler):
    """The real scheduler (every decision its own) whose plans are sketches (no arrays)."""

    def __init__(self, cfg: EngineConfig, num_pages: int):
        super().__init__(cfg, num_pages)
        self.kv = SimKV(self.kv.block_pool, page_size=cfg.page_size, enable_prefix_caching=cfg.enable_prefix_caching, deterministic=cfg.deterministic,
                         window=cfg.release_window)
        self._decode_keys: dict[tuple[int, int], BucketKey] = {}  # (rows, largest pages) -> tables.decode_key (the tables are fixed)
        self._prefill_keys: dict[tuple[int, int, int], BucketKey] = {}  # (rows, tokens, pages) -> tables.prefill_key
        self.shares_pages = False  # whether prompts share full pages through the prefix cache (_Run sets it)
        self.decode_clock = DecodeClock()
        self.lazy: DecodeRows | None = None  # the decoding rows counted on the clock (set by use_decode_clock)
        self._admitted: list[Request] = []  # with the clock: running requests not registered yet (prefilling), in running order
        self._split: tuple[int, list] | None = None  # (lazy.version, _split_decode's groups) while no row's page bucket changes
        self._plans: list[SketchPlan] = []  # the last decode plans, reused while their rows and key are the same
        self.decode_order: list[Request] = []  # with the clock: the decoding rows in the order of the decode plans (_split_decode)
        self._checked: set[tuple[int, int]] = set()  # (prompt tokens, max_tokens) that Scheduler.check passed
        self._group_plans: tuple[list, list[SketchPlan], tuple[int, int, int]] | None = None  # (_split_decode's groups, their plans, counts)
        # the policy's own admission_order (the prefix policy prunes its ranks there): called every iteration, arrivals pushed one by one (sim_skip)
        self.policy_orders = type(self.policy).admission_order is not SchedulingPolicy.admission_order

    def use_config(self, cfg: EngineConfig) -> None:
        """Scheduler.use_config, and the keys, plans and page buckets kept for the old tables forgotten."""
        super().use_config(cfg)
        self._decode_keys.clear()
        self._prefill_keys.clear()
        self._split, self._plans, self._group_plans = None, [], None
        if self.lazy is not None:
            self.lazy.use_page_buckets(self.tables.pages)

    def check(self, request: Request) -> None:
        """Scheduler.check, once per prompt length and max_tokens (all it reads of a request)."""
        at = (len(request.prompt_ids), request.params.max_tokens)
        if at not in self._checked:
            super().check(request)
            self._checked.add(at)

    def use_decode_clock(self) -> None:
        """Count decoding rows on the decode clock (sim_decode.py); the run loop then ticks it once per iteration."""
        self.lazy = DecodeRows(self.decode_clock, self.cfg.page_size, self.cfg.max_context, self.block_pool.tables, self.cfg.enable_prefix_caching)
        self.lazy.use_page_buckets(self.tables.pages)

    def _admit(self, request: Request, num_cached_tokens: int = 0) -> None:
        super()._admit(request, num_cached_tokens)
        if self.lazy is not None:
            self._admitted.append(request)

    def _leave(self, request: Request) -> None:
        """A request stops running (finish, preemption): off the clock, its fields settled."""
        if request._clock is not None:
            self.lazy.unregister(request)
        elif request in self._admitted:
            self._admitted.remove(request)

    def _preempt(self, request: Request) -> None:
        if self.lazy is not None:
            self._leave(request)
        self.kv.name_owed(request)
        super()._preempt(request)

    def finish(self, request: Request, reason: str, error: str | None = None) -> None:
        if self.lazy is not None:
            self._leave(request)
        super().finish(request, reason, error)

    def register_decoders(self) -> None:
        """Put the admitted requests that now decode on the clock."""
        admitted = self._admitted
        if admitted:
            decoding = [self.in_decode(r) for r in admitted]
            if any(decoding):
                self._admitted = [r for r, decodes in zip(admitted, decoding) if not decodes]
                for r, decodes in zip(admitted, decoding):
                    if decodes:
                        self.lazy.register(r)

    def note_allocated(self, request: Request) -> None:
        """A registered row's table grew: its next page need, and the split if its page bucket changed."""
        if self.lazy.push_need(request):
            self._split = None

    def _reserve_decode_pages(self) -> tuple[list[Request], list[Request]]:
        """Scheduler._reserve_decode_pages on the clock: only the rows whose next token needs a page are visited
        (in running order, with the same allocation and preemption loop); the rows in running order."""
        lazy = self.lazy
        if lazy is None:
            return super()._reserve_decode_pages()
        self.register_decoders()
        kv = self.kv
        for request in lazy.due_pages():
            if request._clock is None:  # preempted by an earlier row of this loop
                continue
            needed = request.num_computed_tokens + 1
            while kv.num_new_pages(request, needed) and kv.try_allocate(request, needed) is None:
                victim = self.policy.victim(self.running)
                self._preempt(victim)
                if victim is request:
                    break
            if request._clock is not None:
                self.note_allocated(request)
        return lazy.ordered(), list(self._admitted)

    def _decode_plans(self, groups: list[tuple[list[Request], list[int]]]) -> list[SketchPlan]:
        """Scheduler._decode_plans; for the groups of the last iteration again (the rows on the clock and their page
        buckets unchanged: _split_decode's memo), the same plans, counted in the statistics as _decode_plan counts them."""
        memo, stats = self._group_plans, self.stats
        if memo is not None and memo[0] is groups:
            steps, real, padded = memo[2]
            stats.num_steps += steps
            stats.real_tokens += real
            stats.padded_tokens += padded
            return list(memo[1])
        plans, size = [], self.tables.max_decode_rows
        for group, pages in groups:
            if len(group) <= size:  # one program (every group outside deterministic mode)
                plans.append(self._decode_plan(group, max(pages)))
            else:
                plans += [self._decode_plan(group[i : i + size], max(pages[i : i + size])) for i in range(0, len(group), size)]
        real = padded = 0
        for plan in plans:
            real += len(plan.request_ids)
            padded += plan.bucket.num_rows * plan.bucket.num_tokens
        self._group_plans = (groups, plans, (len(plans), real, padded))
        return list(plans)

    def _plan_prefill(self, partial: list[Request]) -> list[tuple[Request, int]]:
        """Scheduler._plan_prefill, which plans nothing when no request prefills and no sequence slot is free or nothing
        waits (every policy's admission_order offers no request then): of it, only the policy's admission_order is
        called then, where the policy keeps its own (the prefix policy prunes its ranks there)."""
        if not partial and (not self.waiting or self.policy.decode_width() <= len(self.running)):
            if self.policy_orders:
                self._waiting_in_order()
            return []
        return super()._plan_prefill(partial)

    def _split_decode(self, requests: list[Request]) -> list[tuple[list[Request], list[int]]]:
        """Scheduler._split_decode, kept while the rows and their page buckets are the same: every registered row
        gains a token per tick, so their order by length stays (ties in running order), kept as `decode_order`
        (the rows of the iteration's decode plans, one plan after the other)."""
        lazy = self.lazy
        if lazy is None or requests is not lazy._ordered:
            return super()._split_decode(requests)
        if self._split is not None and self._split[0] == lazy.version:
            return self._split[1]
        groups = []
        if requests:
            ordered, pages, buckets = lazy.by_length()
            split = self._cut(pages, buckets) if len(ordered) > 1 else 0
            groups = [(ordered[:split], pages[:split]), (ordered[split:], pages[split:])] if split else [(ordered, pages)]
            self.decode_order = ordered
        self._split = (lazy.version, groups)
        return groups

    def _cut(self, pages: list[int], buckets: tuple[int, ...]) -> int:
        """Scheduler._split_point(pages) read from its memo with the rows' page buckets (`buckets`, kept by the
        decode rows); the method itself on a miss (a bucket pattern it has not met, or new tables)."""
        split = self._splits.get(buckets) if self._splits_of is self.tables else None
        return self._split_point(pages) if split is None else split

    def _prefill_plan(self, pairs: list[tuple[Request, int]]) -> SketchPlan:
        """Scheduler._prefill_plan's sketch: the same key (memoised) and counts, without RowChunks (each copies
        its request's block table, whose length is all the key reads)."""
        held = self.kv.num_pages_held
        lengths, pages = tuple([n for _, n in pairs]), [held(r) for r, _ in pairs]
        at = (1, sum(lengths), sum(pages)) if self.tables.packed else (len(pairs), max(lengths), max(pages))
        key = self._prefill_keys.get(at)
        if key is None:
            key = self._prefill_keys[at] = self.tables.prefill_key(*at)
        stats = self.stats
        stats.num_steps += 1
        stats.real_tokens += sum(lengths)
        stats.padded_tokens += key.num_rows * key.num_tokens
        samples = tuple([r.num_computed_tokens + n == r.num_tokens for r, n in pairs])
        return SketchPlan("prefill", key, tuple([r.request_id for r, _ in pairs]), lengths, samples)

    def _decode_key(self, requests: list[Request], max_pages: int | None = None) -> BucketKey:
        """Scheduler._decode_key, memoised."""
        at = (len(requests), max(self.kv.num_pages_held_by(requests)) if max_pages is None else max_pages)
        key = self._decode_keys.get(at)
        if key is None:
            key = self._decode_keys[at] = self.tables.decode_key(*at)
        return key

    def _decode_plan(self, requests: list[Request], max_pages: int | None = None) -> SketchPlan:
        """The real decode plan's sketch, without RowChunks (each copies its request's block table)."""
        n = len(requests)
        shape = self._decode_keys.get((n, max_pages))  # _decode_key's memo (a miss when max_pages is None)
        if shape is None:
            shape = self._decode_key(requests, max_pages)
        stats = self.stats
        stats.num_steps += 1
        stats.real_tokens += n
        stats.padded_tokens += shape.num_rows * shape.num_tokens
        if self.cfg.deterministic:  # a replayed row keeps no token
            samples = tuple(r.num_computed_tokens == r.num_tokens - 1 for r in requests)
        else:  # every decoding row feeds its newest token (Scheduler.in_decode)
            samples = (True,) * n
            for plan, rows in self._plans:  # the same rows as a recent plan (their ids in the same order)
                if plan.bucket == shape and rows == requests:
                    return plan
        plan = SketchPlan("decode", shape, tuple([r.request_id for r in requests]), (1,) * n, samples)
        if self.lazy is not None:
            self._plans = [(plan, requests), *self._plans[:3]]
        return plan

    def shared_tokens_counted_twice(self) -> int:
        """Tokens that a sum of every running request's tokens counts more than once: a page shared through
        the prefix cache is full (it holds `page_size` tokens of a shared prefix) and counts once per owner.
        0 without shared prefixes (`shares_pages` False: the O(pages) count is skipped)."""
        return self.block_pool.num_extra_owners() * self.cfg.page_size if self.shares_pages else 0

    def _record_utilization(self) -> None:
        """The real statistic (Scheduler._record_utilization: a shared page counts once) in O(running), without a
        sliding window (its released pages: the real method): a request's pages hold its tokens, the prefix cache's shared pages are full, and past its shared prefix
        every simulated prompt has a token of its own, so no later page is shared."""
        if self.kv.window is not None:  # pages a sliding window released hold tokens no more: the real count, page by page
            return super()._record_utilization()
        pool, size = self.kv.block_pool, self.cfg.page_size
        used_pages = pool.num_used
        if used_pages:
            filled, tables = -self.shared_tokens_counted_twice() if self.shares_pages else 0, pool.tables  # request id -> block table (its length: kv.num_pages_held)
            lazy = self.lazy
            if lazy is not None:  # a registered row's pages hold its tokens (it was given room for its next one)
                filled += lazy.base_sum + len(lazy.rows) * self.decode_clock.ticks
            for r in self.running if lazy is None else self._admitted:
                tokens, room = len(r.prompt_ids) + len(r.output_ids), len(tables.get(r.request_id, ())) * size
                filled += tokens if tokens < room else room
            utilization = filled / (used_pages * size)
            self.stats.peak_kv_utilization = max(self.stats.peak_kv_utilization, utilization)
            self.stats.kv_utilization_sum += utilization
            self.stats.kv_utilization_steps += 1
