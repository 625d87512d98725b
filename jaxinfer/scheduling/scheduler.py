"""Host scheduler: continuous batching over a paged pool. Plain Python and numpy; never imports jax.

Each call to `schedule()` returns the plans of one engine iteration:

  1. decode: every running request whose prompt is fully in the pool gets one token. If its next token
     needs a new page and none is free, requests are preempted by recompute, the least urgent priority first,
     the most recently admitted of it (their pages are freed, their generated tokens kept, and they re-queue at the front).
  2. prefill: partially prefilled requests continue, then waiting requests are admitted in (priority,
     deadline, arrival) order (earliest deadline first within a priority; ties go to the front of the
     line, where preempted requests re-queue), under the per-step token budget, the sequence limit and
     the free pages. A prompt longer than the largest chunk bucket is split over several steps (chunked
     prefill). The waiting queue (request_queue.py) is a heap: a step costs O(log n) per admission and
     per expiry, and a step with no free sequence slot does not read it (under the default policy: EDF's shedding
     and the prefix policy's pruning read it).

`update(plan, tokens)` applies the sampled tokens; the output processor (stopping.py) decides which
requests are done and `finish` frees them. The run loop that joins the three is runloop.run.
Pages go through the KV manager (kv_manager.py: allocate-or-None, prefix cache, release), never the block
pool directly. Plans are shaped by `BucketTables.from_config(cfg)`, so the engine only sees known shapes.

The decisions above that are policy (admission order, early timeouts, the preemption victim, the prefill
budget and the decode width) are the scheduling policy's (policies.py, `EngineConfig.policy`); the
default, "fcfs", is the behaviour described here. The run loop reports each step to `observe`.
"""

import dataclasses
import itertools
import operator
import time
from collections.abc import Callable, Iterator

import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.scheduling.block_pool import BlockPool
from jaxinfer.scheduling.bucket_tables import BucketTables, pad_to_bucket
from jaxinfer.scheduling.kv_manager import KVManager
from jaxinfer.scheduling.plan import BucketKey, Logprobs, RowChunk, StepPlan, StepResult
from jaxinfer.scheduling.policies import SchedulingPolicy, make_policy
from jaxinfer.scheduling.request import Request, RequestStatus, SamplingParams
from jaxinfer.validation import FieldError
from jaxinfer.scheduling.request_queue import RequestQueue

_num_tokens = operator.attrgetter("num_tokens")  # a request's sort key by length
_MAX_SPLITS = 65536  # decode cuts remembered at most (Scheduler._split_point)


@dataclasses.dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    real_tokens: int = 0  # tokens computed by steps
    padded_tokens: int = 0  # token slots computed, padding included
    peak_kv_utilization: float = 0.0  # max over steps of tokens in pool / slots of allocated pages
    kv_utilization_sum: float = 0.0  # summed over the steps that hold pages (for the mean)
    kv_utilization_steps: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # of those, tokens whose KV came from cached pages

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def mean_kv_utilization(self) -> float:
        return self.kv_utilization_sum / self.kv_utilization_steps if self.kv_utilization_steps else 0.0

    @property
    def padding_waste(self) -> float:
        return 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0


class Scheduler:
    def __init__(self, cfg: EngineConfig, num_pages: int, *, block_pool: BlockPool | None = None, policy: SchedulingPolicy | None = None):
        """`block_pool` may be shared by successive schedulers over the same KV pool, so that cached
        prefixes outlive one batch; it must have no owners left when handed over. `policy`: a policy object
        (None: `make_policy(cfg.policy, cfg)`); a policy holds state, so one serves one scheduler."""
        self.cfg = cfg
        self.tables = BucketTables.from_config(cfg)
        block_pool = block_pool if block_pool is not None else BlockPool(num_pages)
        if block_pool.num_pages != num_pages or block_pool.num_used:
            raise ValueError("a shared block pool must match the KV pool and hold no pages")
        self.kv = KVManager(block_pool, page_size=cfg.page_size, enable_prefix_caching=cfg.enable_prefix_caching, deterministic=cfg.deterministic,
                            window=cfg.release_window)
        self.policy = policy if policy is not None else make_policy(cfg.policy, cfg)
        self.waiting = RequestQueue(self.policy.queue_key)  # in admission order; reads like a list (len, in, iteration)
        self.running: list[Request] = []  # in admission order
        self._running_ids: dict[str, Request] = {}  # request id -> its running request (kept with `running`)
        self.stats = SchedulerStats()
        self._admissions = 0
        self._program_costs: dict[tuple[int, int], float] = {}  # (rows, largest pages) -> _program_cost (cleared by use_config)
        self._splits: dict[tuple[int, ...], int] = {}  # decode rows' page buckets -> _split_point
        self._splits_of: BucketTables | None = None  # the tables _splits holds cuts for
        self._page_buckets: dict[int, int] = {}  # pages -> their bucket (pad_to_bucket)
        self.clock: Callable[[], float] = time.perf_counter  # read by expire, update and finish (runloop.run sets it; the simulator's is virtual)

    def use_config(self, cfg: EngineConfig) -> None:
        """Plan with `cfg`'s bucket tables from the next iteration on (batch/refit.py swaps a refitted chunk table in
        between steps); the pool, the policy (told of the new config: SchedulingPolicy.use_config) and the requests stay
        as they are."""
        self.cfg, self.tables = cfg, BucketTables.from_config(cfg)
        self._program_costs.clear()
        self.policy.use_config(cfg)

    @property
    def block_pool(self) -> BlockPool:
        """The pool under the KV manager (tests and the run loop's callers inspect it; policy goes through `kv`)."""
        return self.kv.block_pool

    # ------------------------------------------------------------ intake

    def check(self, request: Request) -> None:
        """Raise ValueError if the request can never run under this configuration."""
        check_request(self.cfg, self.kv.num_pages, len(request.prompt_ids), request.params.max_tokens)

    def add(self, request: Request) -> None:
        self.check(request)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def running_by_id(self) -> dict[str, Request]:
        """Request id -> its running request (read only: the scheduler keeps it with `running`)."""
        return self._running_ids

    # ------------------------------------------------------------ planning

    def expire(self, now: float | None = None) -> list[Request]:
        """Finish, with reason 'timeout', waiting requests whose deadline has passed before they started,
        and those the policy sheds (their deadline can no longer be met)."""
        now = self.clock() if now is None else now
        expired = self.waiting.expire(now)  # taken out of the queue, in its line order
        expired += self.policy.shed(self, now)
        for request in expired:
            self.finish(request, "timeout")
        return expired

    def observe(self, plan: StepPlan, seconds: float) -> None:
        """A step of this scheduler's plans ran in `seconds` (the run loop calls this after each step)."""
        self.policy.observe(plan, seconds)

    def schedule(self) -> list[StepPlan]:
        """The plans of one iteration; never empty while requests are running (see _plan_step)."""
        self.policy.new_iteration()
        plans = self._plan_step()
        while not plans and self.running:
            # Partial prefills can hold every page while none can grow: free the policy's victim.
            self._preempt(self.policy.victim(self.running))
            plans = self._plan_step()
        return plans

    def _plan_step(self) -> list[StepPlan]:
        if self.kv.window is not None:  # pages a sliding window has passed go back before anything is allocated
            for request in self.running:
                self.kv.release_outside_window(request)
        decode_rows, partial = self._reserve_decode_pages()
        prefill_rows = self._plan_prefill(partial)
        plans = self._decode_plans(self._split_decode(decode_rows))
        if prefill_rows:
            plans.append(self._prefill_plan(prefill_rows))
        self._record_utilization()
        return plans

    def _decode_plans(self, groups: list[tuple[list[Request], list[int]]]) -> list[StepPlan]:
        """The decode plans of these groups (_split_decode's): each group's programs (at most max_decode_rows rows each,
        several only in deterministic mode), each with its largest table."""
        plans, size = [], self.tables.max_decode_rows
        for group, pages in groups:
            plans += [self._decode_plan(group[i : i + size], max(pages[i : i + size])) for i in range(0, len(group), size)]
        return plans

    # ------------------------------------------------------------ phases of a running request

    def prefill_end(self, request: Request) -> int:
        """Tokens a prefill may cover. In deterministic mode only the prompt: generated tokens, when a
        preempted request recomputes them, are replayed through decode steps, as they were first computed."""
        return len(request.prompt_ids) if self.cfg.deterministic and request.output_ids else request.num_tokens

    def in_decode(self, request: Request) -> bool:
        """The next step feeds one token: the newest (normal decode) or a generated one being replayed."""
        output = request.output_ids
        if not output:
            return False
        computed, total = request.num_computed_tokens, len(request.prompt_ids) + len(output)
        # the newest token, or (deterministic mode: prefill_end is the prompt's end) a generated one replayed
        return computed == total - 1 or (self.cfg.deterministic and len(request.prompt_ids) <= computed < total)

    def _reserve_decode_pages(self) -> tuple[list[Request], list[Request]]:
        """Give every decoding request room for one more token, preempting when the pool is full; returns
        the decoding rows and the running requests still prefilling, each in running order."""
        rows, partial, preempted = [], [], False
        kv, page_size, in_decode = self.kv, self.cfg.page_size, self.in_decode
        running = list(self.running)
        # each entry read before its request's own allocation; a preempted request's is never read (it is not RUNNING)
        for request, held in zip(running, kv.num_pages_held_by(running)):
            if not in_decode(request):
                partial.append(request)
                continue
            rows.append(request)
            if request.status != RequestStatus.RUNNING:
                continue
            needed = request.num_computed_tokens + 1
            if -(-needed // page_size) <= held:  # its pages hold the token already (kv.num_new_pages == 0)
                continue
            while kv.num_new_pages(request, needed) and kv.try_allocate(request, needed) is None:
                victim = self.policy.victim(self.running)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
        if preempted:  # the rows still running, in their order
            return [r for r in self.running if in_decode(r)], [r for r in self.running if not in_decode(r)]
        return rows, partial

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: free the pages, keep the output, re-queue at the front."""
        self.kv.release(request)  # shared pages stay with their other owners
        self.running.remove(request)
        del self._running_ids[request.request_id]
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def _plan_prefill(self, partial: list[Request]) -> list[tuple[Request, int]]:
        """(request, chunk length) pairs under the token budget, the sequence limit and free pages; a
        packed row also under its largest chunk bucket and its widest table (pages summed over its sequences).
        `partial`: the running requests not decoding (partial prefills), in running order."""
        tables, kv, page_size = self.tables, self.kv, self.cfg.page_size
        budget = self.policy.prefill_budget()
        budget = min(budget, tables.max_chunk) if tables.packed else budget
        pages_left = tables.max_pages if tables.packed else None
        max_rows = tables.max_prefill_rows
        rows: list[tuple[Request, int]] = []
        for request in itertools.chain(partial, self._waiting_in_order()):
            if budget <= 0 or len(rows) == max_rows:
                break
            waiting = request.status == RequestStatus.WAITING  # until its admission below
            if waiting and not self._prompt_shared(request):
                break  # a sample of n waits for its first sample's prompt pages; the order is kept
            hit = kv.share_cached_prefix(request, self.prefill_end(request)) if waiting else 0
            limit = budget if pages_left is None else min(budget, pages_left * page_size - request.num_computed_tokens)
            chunk = self._fit_chunk(request, limit) if limit > 0 else 0
            if chunk == 0:
                if waiting:  # undo the prefix it shared
                    kv.release(request)
                    request.num_computed_tokens = 0
                    break  # no room to admit: keep the priority order, do not skip ahead
                continue
            if waiting:
                self._admit(request, hit)
            rows.append((request, chunk))
            budget -= chunk
            if pages_left is not None:
                pages_left -= kv.num_pages_held(request)
        return rows

    def _prompt_shared(self, request: Request) -> bool:
        """Whether a later sample of n (SamplingParams.n) may start: its first sample (`fork_of`) has
        computed its prompt, whose full pages the prefix cache now shares, or will never need to."""
        first = request.fork_of
        if first is None or first.status == RequestStatus.FINISHED or not self.cfg.enable_prefix_caching:
            return True
        return first.status == RequestStatus.RUNNING and first.num_computed_tokens >= len(first.prompt_ids) - 1

    def _waiting_in_order(self) -> Iterator[Request]:
        """The waiting requests that may be admitted now, lazily in the policy's admission order
        (request_queue.py): at most one per free sequence slot under the policy's decode width."""
        return self.policy.admission_order(self, self.policy.decode_width() - len(self.running))

    def _fit_chunk(self, request: Request, budget: int) -> int:
        """Longest chunk (<= budget, <= largest bucket) whose pages can be allocated now; 0 if none."""
        computed = request.num_computed_tokens  # allocation leaves it as it is
        chunk = min(self.prefill_end(request) - computed, budget, self.tables.max_chunk)
        while chunk > 0 and self.kv.try_allocate(request, computed + chunk) is None:
            free_tokens = self.kv.num_free_pages * self.cfg.page_size
            spare = self.kv.num_pages_held(request) * self.cfg.page_size - computed
            chunk = min(chunk - 1, spare + free_tokens)
        return chunk

    def _admit(self, request: Request, num_cached_tokens: int = 0) -> None:
        if self.cfg.enable_prefix_caching:
            self.stats.prefix_cache_queries += request.num_tokens
            self.stats.prefix_cache_hits += num_cached_tokens
        if request.admit_index < 0:  # its first admission
            request.num_cached_tokens = num_cached_tokens
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        request.admit_index = self._admissions
        self._admissions += 1
        self.running.append(request)
        self._running_ids[request.request_id] = request

    # ------------------------------------------------------------ plan arrays

    def _decode_key(self, requests: list[Request], max_pages: int | None = None) -> BucketKey:
        """The key of a decode step over these requests: rows and pages per row (`max_pages`: the largest
        table among them, when known), bucketed."""
        return self.tables.decode_key(len(requests), max(self.kv.num_pages_held_by(requests)) if max_pages is None else max_pages)

    def _split_decode(self, requests: list[Request]) -> list[tuple[list[Request], list[int]]]:
        """split_decode_rows(requests, cost), cost summing _program_cost over a group's programs, in O(rows)
        (split_sorted_rows): the groups, each
        with its rows' pages held."""
        if len(requests) < 2:
            return [(requests, self.kv.num_pages_held_by(requests))] if requests else []
        ordered = sorted(requests, key=_num_tokens)
        pages = self.kv.num_pages_held_by(ordered)
        split = self._split_point(pages)
        return [(ordered[:split], pages[:split]), (ordered[split:], pages[split:])] if split else [(ordered, pages)]

    def _split_point(self, pages: list[int]) -> int:
        """Where split_sorted_rows cuts rows holding `pages` (sorted by length; 0: no cut), memoised. A
        program's cost reads only its largest table's page bucket, and the bucket of a maximum is the
        maximum of the buckets, so the rows' buckets decide the cut."""
        if self._splits_of is not self.tables:  # new tables (batch/refit.py swaps them): forget the old cuts
            self._splits, self._splits_of, self._page_buckets = {}, self.tables, {}
        buckets = self._page_buckets
        for p in pages:
            if p not in buckets:
                buckets[p] = pad_to_bucket(p, self.tables.pages)
        key = tuple([buckets[p] for p in pages])
        split = self._splits.get(key)
        if split is None:
            if len(self._splits) >= _MAX_SPLITS:
                self._splits.clear()
            groups = split_sorted_rows(list(range(len(pages))), list(key), self._program_cost, self.tables.max_decode_rows)
            split = self._splits[key] = len(groups[0]) if len(groups) == 2 else 0
        return split

    def _program_cost(self, num_rows: int, max_pages: int) -> float:
        """Modelled cost of one decode program of `num_rows` rows whose longest table holds `max_pages` pages: a fixed
        part (decode_split_overhead: the weights read once) plus rows x (pages + 2), on the bucketed key."""
        cost = self._program_costs.get((num_rows, max_pages))
        if cost is None:
            key = self.tables.decode_key(num_rows, max_pages)
            cost = self._program_costs[num_rows, max_pages] = self.cfg.decode_split_overhead + key.num_rows * (key.num_pages + 2)
        return cost

    def _decode_plan(self, requests: list[Request], max_pages: int | None = None) -> StepPlan:
        chunks = [self._chunk(r, r.num_computed_tokens, 1, r.num_computed_tokens == r.num_tokens - 1) for r in requests]
        return self._build_plan("decode", chunks, self._decode_key(requests, max_pages))

    def _prefill_plan(self, pairs: list[tuple[Request, int]]) -> StepPlan:
        """Rows read only the pages they hold (after this chunk's allocation); a packed row holds every
        chunk, so its tokens and pages are the sums."""
        tables = self.tables
        chunks = [self._chunk(r, r.num_computed_tokens, n, r.num_computed_tokens + n == r.num_tokens) for r, n in pairs]
        lengths, pages = [c.length for c in chunks], [len(c.pages) for c in chunks]
        if tables.packed:
            key = tables.prefill_key(1, sum(lengths), sum(pages))
        else:
            key = tables.prefill_key(len(chunks), max(lengths), max(pages))
        return self._build_plan("prefill", chunks, key)

    def _chunk(self, request: Request, start: int, length: int, sample: bool) -> RowChunk:
        return RowChunk(request, start, length, self.kv.pages_of(request), sample)

    def _build_plan(self, phase: str, chunks: list[RowChunk], shape: BucketKey) -> StepPlan:
        self.stats.num_steps += 1
        self.stats.real_tokens += sum(c.length for c in chunks)
        self.stats.padded_tokens += shape.num_rows * shape.num_tokens
        packed = self.tables.packed_seqs if phase == "prefill" else 0
        return StepPlan.build(phase, chunks, shape, self.cfg.page_size, packed=packed, bias_width=self.cfg.max_logit_bias)

    def _record_utilization(self) -> None:
        used_pages = self.kv.num_used_pages
        if used_pages:
            size, filled = self.cfg.page_size, {}  # page -> tokens it holds (a shared page counts once)
            for r in self.running:
                for i, page in enumerate(self.kv.pages_of(r)):
                    if page:  # not a null entry a sliding window released
                        filled[page] = max(filled.get(page, 0), min(size, r.num_tokens - i * size))
            utilization = sum(filled.values()) / (used_pages * size)
            self.stats.peak_kv_utilization = max(self.stats.peak_kv_utilization, utilization)
            self.stats.kv_utilization_sum += utilization
            self.stats.kv_utilization_steps += 1

    # ------------------------------------------------------------ results

    def update(self, plan: StepPlan, result: StepResult | np.ndarray) -> list[Request]:
        """Apply one step's sampled tokens (int[R], or a StepResult with their log-probabilities); return
        the requests that got a new output token.

        Whether they are done is the output processor's decision (output.py); it calls `finish`.
        """
        result = StepResult.of(result)
        by_id, applied, sampled, now = self._running_ids, [], [], self.clock()
        extras = result.prompt_logprobs is not None or result.pooled_last is not None
        starts = plan.chunk_starts() if extras else None
        tokens, new_tokens, samples = result.tokens.tolist(), plan.num_new_tokens, plan.samples
        for row, request_id in enumerate(plan.request_ids):
            request = by_id.get(request_id)
            if request is None:  # preempted after planning: nothing to apply
                continue
            if extras:
                _keep_chunk_outputs(request, plan, result, row, starts[row])
            request.num_computed_tokens += new_tokens[row]
            applied.append(request)
            if not samples[row]:
                continue
            if request.params.max_tokens:  # else a scored prompt: done, nothing generated
                request.output_ids.append(int(tokens[row]))
                if result.logprobs is not None and request.params.logprobs is not None:
                    request.logprobs.append(result.logprobs.entry(row, request.params.logprobs))
                if request.first_token_time is None:  # a first token at time 0.0 (a virtual clock) is one too
                    request.first_token_time = now
            sampled.append(request)
        self.kv.cache_computed_pages_of(applied)  # each names only its own pages, from its own tokens: after the loop is the same
        return sampled

    def finish(self, request: Request, reason: str, error: str | None = None) -> None:
        """End a request (running or waiting) and free its pages (named ones stay cached until evicted)."""
        self.kv.release(request)
        if self._running_ids.get(request.request_id) is request:  # request in self.running, without the scan
            self.running.remove(request)
            del self._running_ids[request.request_id]
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status, request.finish_reason, request.error = RequestStatus.FINISHED, reason, error
        request.finish_time = self.clock()

    def abort(self, request_ids, error: str) -> list[Request]:
        """Finish these requests with reason 'error'; returns them."""
        wanted = set(request_ids)
        aborted = [r for r in [*self.running, *self.waiting] if r.request_id in wanted]
        for request in aborted:
            self.finish(request, "error", error)
        return aborted

    def abort_all(self, error: str) -> list[Request]:
        return self.abort([r.request_id for r in [*self.running, *self.waiting]], error)


def split_decode_rows(requests: list[Request], cost: Callable[[list[Request]], float]) -> list[list[Request]]:
    """Decode rows as one group, or two groups split by context length when that is cheaper.

    One long sequence would otherwise make every row of the step read as many pages as it does. Rows
    are sorted by length and every split point is costed; the cheapest of (no split, best split) wins.
    """
    if len(requests) < 2:
        return [requests] if requests else []
    ordered = sorted(requests, key=lambda r: r.num_tokens)
    best, groups = cost(ordered), [ordered]
    for split in range(1, len(ordered)):
        total = cost(ordered[:split]) + cost(ordered[split:])
        if total < best:
            best, groups = total, [ordered[:split], ordered[split:]]
    return groups


def split_sorted_rows(ordered: list, pages: list[int], program_cost: Callable[[int, int], float], program_rows: int) -> list[list]:
    """split_decode_rows's groups in O(rows) when a group's cost is a sum over its programs.

    `ordered`: rows sorted by length; `pages[i]`: pages row i holds. A group is cut into programs of at most
    `program_rows` rows from its first row; a program costs program_cost(its rows, its largest `pages`); a
    group's cost is sum() of its programs' costs. Every split point is costed from running and suffix maxima
    instead of re-reading the rows, with the same sum() over the same terms (Python's float sum is
    compensated, so the terms are summed as split_decode_rows's cost would, never carried over), so the
    groups are exactly split_decode_rows(ordered, cost)'s with that cost (a test checks).
    """
    n, m = len(ordered), program_rows
    if n <= m:  # one program per group (every decode batch but deterministic mode's): a sum of one term is that term
        return _split_one_program_each(ordered, pages, program_cost)
    head = [0.0] * (n + 1)  # head[s]: cost of ordered[:s]
    done: list[float] = []  # the costs of the whole programs before the current one
    peak = 0  # the current program's largest pages
    for s in range(1, n + 1):
        if (s - 1) % m == 0:
            if s > 1:
                done.append(program_cost(m, peak))
            peak = pages[s - 1]
        else:
            peak = max(peak, pages[s - 1])
        head[s] = sum([*done, program_cost(s - len(done) * m, peak)])
    tail_max = pages[:]  # tail_max[i]: largest pages of ordered[i:]
    for i in range(n - 2, -1, -1):
        tail_max[i] = max(tail_max[i], tail_max[i + 1])
    best, groups = head[n], [ordered]
    for split in range(1, n):
        terms = [program_cost(min(m, n - start), tail_max[start] if start + m >= n else max(pages[start : start + m])) for start in range(split, n, m)]
        total = head[split] + sum(terms)
        if total < best:
            best, groups = total, [ordered[:split], ordered[split:]]
    return groups


def _split_one_program_each(ordered: list, pages: list[int], program_cost: Callable[[int, int], float]) -> list[list]:
    """split_sorted_rows when every group is one program."""
    n = len(ordered)
    head, peak = [0.0] * n, 0  # head[s]: cost of ordered[:s]
    for s in range(1, n):
        if pages[s - 1] > peak:  # the running maximum
            peak = pages[s - 1]
        head[s] = program_cost(s, peak)
    peak = max(peak, pages[n - 1])
    best, best_split = program_cost(n, peak), 0
    peak = 0
    for split in range(n - 1, 0, -1):  # tail maxima from the end; the first cheapest split wins, as in split_decode_rows
        if pages[split] > peak:
            peak = pages[split]
        total = head[split] + program_cost(n - split, peak)
        if total < best or (total == best and best_split):  # a tie goes to the smaller split
            best, best_split = total, split
    return [ordered[:best_split], ordered[best_split:]] if best_split else [ordered]


def _keep_chunk_outputs(request: Request, plan: StepPlan, result: StepResult, row: int, start: tuple[int, int]) -> None:
    """A chunk's prompt log-probabilities and pooled hidden states (slot `row`), where the request wants them."""
    if result.prompt_logprobs is not None and request.params.prompt_logprobs is not None:
        _keep_prompt_logprobs(request, plan, start, plan.num_new_tokens[row], result.prompt_logprobs)
    if result.pooled_last is not None and request.params.pooling is not None:  # an embedding's chunk
        first = int(plan.positions[start])
        request.keep_pooled(first, result.pooled_last[row], result.pooled_sum[row].astype(np.float64), plan.num_new_tokens[row])


class PromptTooLongError(ValueError):
    """The prompt leaves no room in the context for a single generated token."""


def _keep_prompt_logprobs(request: Request, plan: StepPlan, start: tuple[int, int], length: int, logprobs: Logprobs) -> None:
    """Store the chunk's prompt log-probabilities by position (a recomputed chunk overwrites its own):
    entry p + 1 scores prompt token p + 1 from the logits at position p; entry 0 stays None."""
    row, token = start
    num_tokens = plan.token_ids.shape[1]
    if not request.prompt_logprobs:
        request.prompt_logprobs = [None] * len(request.prompt_ids)
    first = int(plan.positions[row, token])
    for offset in range(length):
        position = first + offset
        if position + 1 >= len(request.prompt_ids):
            break
        if position + 1 < request.params.logprob_start:  # before logprob_start: not scored, stays None
            continue
        request.prompt_logprobs[position + 1] = logprobs.entry(row * num_tokens + token + offset, request.params.prompt_logprobs)


def check_sampling_limits(cfg: EngineConfig, params: SamplingParams) -> None:
    """Raise FieldError if a request asks for more than the engine's static limits allow."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > cfg.max_logprobs:
            raise FieldError(name, f"({value}) exceeds the engine's max_logprobs ({cfg.max_logprobs})")
    if len(params.logit_bias) > cfg.max_logit_bias:  # min_tokens' bans on EOS and the stop ids are the token mask's, not these slots
        raise FieldError("logit_bias", f"holds {len(params.logit_bias)} tokens; the engine's max_logit_bias is {cfg.max_logit_bias}")


def check_request(cfg: EngineConfig, num_pages: int, num_prompt_tokens: int, max_tokens: int) -> None:
    """Raise ValueError if a prompt of this length can never run: empty, over the context, or needing
    more pages than the whole pool holds."""
    if num_prompt_tokens == 0:
        raise ValueError("empty prompt: at least one token is needed")
    if num_prompt_tokens + (max_tokens > 0) > cfg.max_context:  # room for one generated token, unless it generates none
        raise PromptTooLongError(f"prompt has {num_prompt_tokens} tokens; the context is {cfg.max_context} (prompt + output)")
    pages = -(-min(num_prompt_tokens + max_tokens, cfg.max_context) // cfg.page_size)
    if pages > num_pages - 1:
        raise ValueError(f"request needs {pages} KV pages; the pool has {num_pages - 1}")
