"""The simulator: the real scheduler, bucket tables and policy on a virtual clock. Host only, no jax, no model.

`simulate(engine_cfg, requests, costs)` submits each `SimRequest` (its prompt and output lengths, and when it
arrives) to a real `Scheduler` and drives it as the one run loop, `runloop.run`, does (in its own copy of that loop,
`_Run._iterations`), with a step that is a fake that
advances a virtual clock by the step-cost table's seconds for the plan (`StepCosts.step_seconds`: the host's
time for its rows, then its program's time) and draws token 0. Every request generates exactly its output
length (greedy, EOS ignored; fewer where prompt and output would pass max_context), as a finished job's records say it did, so the schedule (keys, padding,
preemptions, page use) is the one a real run of those lengths makes; only the clock is modelled.

Requests arrive at their `arrival_s` (trace replay, as LLM.generate(arrival_times=...)), or, without one, as
a batch job pulls its lines: whenever fewer than `max_inflight` are in flight (LLM.stream's rule). Timings
count from a request's arrival, as RequestOutput's do.

Speed: the scheduler (sim_scheduler.py) builds `SketchPlan`s, which carry what the run loop and `Scheduler.update` read
(ids, new tokens, samples, the key) but none of StepPlan's arrays, whose layout changes no decision. A
plan's rows are counted, updated and checked in one pass (`_Run._run_plan`, the run loop's `run_plan` for
these requests; in deterministic mode plans go through `runloop.run_plan` itself). With that one pass (outside
deterministic mode and sliding-window release), decoding rows are counted on the decode clock (sim_decode.py):
an iteration's decode tokens are one tick, and the scheduler's decode bookkeeping (`_reserve_decode_pages`,
`_split_decode`, the utilization statistic) visits only the rows with an event (a page to allocate, a page to
name, a last token), in the order and with the calls the real methods make.
Each prompt is `[g] * shared_prefix + [i + 2, 0, 0, ...]` (g: 1 for prefix group 0, -k for group k), so with prefix
caching on only the shared prefix's full pages are shared, among the requests of its group (as a chat template's are
in a real job, or a few-shot preamble's among the lines that use it). Its pages' names (sim_pages.py) are given by
that construction, equal exactly where the prefix cache's hashes would be, so nothing is hashed, and its own
pages (past the shared prefix) are named only if it is preempted.
"""

import collections
import dataclasses
import gc
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import numpy as np

from jaxinfer.config import INFLIGHT_PER_SEQ, EngineConfig
from jaxinfer.scheduling import runloop, sim_skip as skip
from jaxinfer.scheduling.plan import BucketKey, StepResult
from jaxinfer.scheduling.policies import SchedulingPolicy
from jaxinfer.scheduling.request import Request, SamplingParams
from jaxinfer.scheduling.sim_pages import MAX_PREFIX_GROUPS, group_token, page_names
from jaxinfer.scheduling.sim_decode import LazyRequest, end_plan, in_order
from jaxinfer.scheduling.sim_scheduler import SketchPlan, SketchScheduler
from jaxinfer.scheduling.step_costs import StepCosts
from jaxinfer.scheduling.stopping import OutputProcessor
from jaxinfer.validation import FieldError, check_int, check_number

@dataclasses.dataclass(frozen=True)
class SimRequest:
    """One request to simulate: token counts, and when it arrives (seconds from the start; None: when a
    batch job would pull it)."""

    prompt_tokens: int
    output_tokens: int
    arrival_s: float | None = None
    priority: int = 0
    deadline_s: float | None = None  # seconds after its arrival by which it must start
    shared_prefix: int = 0  # leading prompt tokens equal in every request of its prefix group that has them (a chat template's, a preamble)
    prefix_group: int = 0  # which shared prefix: a group's requests share theirs (up to the shorter), another group's differs from its first token


@dataclasses.dataclass(frozen=True)
class SimResult:
    """What a simulated run measured, per request in submission order (seconds on the virtual clock)."""

    wall_s: float  # from the first step's start to the last step's end
    ttft_s: np.ndarray  # f64[N]; from arrival to first token (NaN: never got one)
    tpot_s: np.ndarray  # f64[N]; decode seconds per token after the first
    queue_s: np.ndarray  # f64[N]; from arrival to its first step (to its finish, a timeout, if it never ran)
    latency_s: np.ndarray  # f64[N]; from arrival to finish
    finish_reasons: dict[str, int]
    num_steps: int
    steps_by_key: dict[BucketKey, int]
    padding: float  # 1 - real tokens / token slots computed
    num_preemptions: int
    peak_kv_utilization: float
    mean_kv_utilization: float
    generated_tokens: int
    seconds: float = 0.0  # real seconds the simulation took

    def slo_attainment(self, slo_ttft_s: float = math.inf, slo_tpot_s: float = math.inf) -> float:
        """The share of requests that met both SLOs (slo_attainment); a simulated request with a first token finished by length."""
        return slo_attainment(self.ttft_s, self.tpot_s, slo_ttft_s, slo_tpot_s)

    def summary(self) -> dict:
        """The headline figures as JSON-ready numbers."""
        pct = finite_percentile
        return {
            "wall_s": round(self.wall_s, 6), "ttft_p50_s": pct(self.ttft_s, 50), "ttft_p99_s": pct(self.ttft_s, 99),
            "tpot_p50_s": pct(self.tpot_s[np.isfinite(self.ttft_s)], 50), "queue_p50_s": pct(self.queue_s, 50), "padding": round(self.padding, 6),
            "num_requests": int(self.ttft_s.size), "num_steps": self.num_steps, "num_preemptions": self.num_preemptions,
            "peak_kv_utilization": round(self.peak_kv_utilization, 6), "mean_kv_utilization": round(self.mean_kv_utilization, 6),
            "output_tokens_per_s": round(self.generated_tokens / self.wall_s, 3) if self.wall_s > 0 else None,
            "finish_reasons": dict(self.finish_reasons),
        }


def finite_percentile(values: np.ndarray, q: float) -> float | None:
    """The q-th percentile of the finite values (NaN: a request without a first token), to the microsecond; None if
    none: the one rule for the simulator's figures and a finished job's (batch/finished_job.line_figures)."""
    values = np.asarray(values, np.float64)
    values = values[np.isfinite(values)]
    return round(float(np.percentile(values, q)), 6) if values.size else None


def slo_attainment(ttft_s: np.ndarray, tpot_s: np.ndarray, slo_ttft_s: float = math.inf, slo_tpot_s: float = math.inf) -> float:
    """The share of requests (a NaN TTFT: one without a first token, which meets none) within both SLOs (slo_met); 0 for none."""
    ttft_s = np.asarray(ttft_s, np.float64)
    return float(np.mean(slo_met(ttft_s, tpot_s, np.isfinite(ttft_s), slo_ttft_s, slo_tpot_s))) if ttft_s.size else 0.0


def slo_met(ttft_s: np.ndarray, tpot_s: np.ndarray, finished: np.ndarray, slo_ttft_s: float = math.inf, slo_tpot_s: float = math.inf) -> np.ndarray:
    """bool[N]: the requests counted as served (`finished`; its callers count every request with a first token) with a
    TTFT and a TPOT within the SLOs, the ones DistServe's goodput counts; a NaN time (no first token) meets none."""
    return np.asarray(finished, bool) & (np.asarray(ttft_s, np.float64) <= slo_ttft_s) & (np.asarray(tpot_s, np.float64) <= slo_tpot_s)


class RequestRefused(ValueError):
    """A request the simulated engine refuses under these settings (Scheduler.check): `index` in submission order."""

    def __init__(self, index: int, reason: str):
        super().__init__(f"request {index} cannot run under these settings: {reason}")
        self.index, self.reason = index, reason


class VirtualClock:
    """Seconds on the simulation's clock; only `advance` moves it."""

    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class _Done(NamedTuple):
    """What the results read of a finished request; the request itself is let go (its prompt and output
    lists, a few kilobytes each, would otherwise be most of a long run's memory)."""

    arrival_time: float
    finish_time: float
    first_token_time: float | None
    first_scheduled_time: float | None
    num_output_tokens: int
    finish_reason: str | None


class _LengthStops(OutputProcessor):
    """The run loop's output processor for the simulator's requests, which stop by length only: greedy,
    EOS ignored, no stop ids or strings, no guide or thinking budget, no tokenizer. `check` is
    OutputProcessor.check for them (max_tokens, then the context), without the steps they skip."""

    def check(self, request: Request) -> str | None:
        output = request.output_ids
        if not output or len(output) >= request.params.max_tokens or len(request.prompt_ids) + len(output) >= self.max_context:
            return "length"
        return None


class _Run:
    """One simulation's state: the clock, the scheduler, the requests not yet submitted and those done."""

    defer_names = True  # requests name their own pages only if preempted (sim_pages.SimKV); the results are the same either way (a test checks)

    def __init__(self, cfg: EngineConfig, requests: Sequence[SimRequest], costs: StepCosts, num_pages: int, max_inflight: int, fast_forward: bool = True,
                 one_pass_decode: bool = True):
        self.cfg, self.requests, self.costs, self.max_inflight = cfg, requests, costs, max_inflight
        self.one_pass_decode = one_pass_decode and not cfg.deterministic  # deterministic mode replays rows that keep no token: the run loop's path
        # Not with deadlines (expiry), deterministic mode (replayed decode rows) or a sliding window (pages released every step)
        self.fast_forward = fast_forward and not cfg.deterministic and cfg.release_window is None and all(r.deadline_s is None for r in requests)
        self.plans: list[SketchPlan] = []  # the plans of the iteration under way
        self.clock = VirtualClock()
        self.scheduler = SketchScheduler(cfg, num_pages)
        # Scheduler.expire finds nothing when no request has a deadline and the policy sheds none (the base's shed)
        self.expires = any(r.deadline_s is not None for r in requests) or type(self.scheduler.policy).shed is not SchedulingPolicy.shed
        # Scheduler.observe does nothing under a policy that learns nothing from a step (the base's observe)
        self.observes = self.scheduler.policy.learns_from_steps()
        # pages shared through the prefix cache: a shared prefix's full ones, and a whole-shared prompt's (equal prompts: their output
        # pages are named alike, so a preempted one's recompute shares a twin's)
        self.scheduler.shares_pages = cfg.enable_prefix_caching and any(0 < r.shared_prefix and r.shared_prefix >= min(r.prompt_tokens, cfg.page_size) for r in requests)
        self.lazy = self.one_pass_decode and cfg.release_window is None  # decoding rows counted on the decode clock (sim_decode.py)
        if self.lazy:
            self.scheduler.use_decode_clock()
        self.timed = sorted((r.arrival_s, i) for i, r in enumerate(requests) if r.arrival_s is not None)
        self.timed.reverse()  # popped from the end, earliest first
        self.pulled = [i for i, r in enumerate(requests) if r.arrival_s is None]
        self.pulled.reverse()
        self.inflight = 0
        self.params: dict[int, SamplingParams] = {}  # output tokens -> the requests' sampling parameters
        self.processor = _LengthStops(None, None, cfg.max_context)  # the run loop's; sim_skip checks the rows it finishes with it
        self.done: list[_Done | None] = [None] * len(requests)  # by submission order
        self.steps_by_key: dict[BucketKey, int] = {}
        self.results: dict[int, StepResult] = {}  # rows -> the fake step's result
        self._step_seconds: dict[tuple[BucketKey, int], float] = {}  # (key, rows) -> costs.step_seconds (the table is not changed during a run)
        self.first_step: float | None = None
        self.last_step = 0.0

    def submit(self, index: int, now: float) -> None:
        spec = self.requests[index]
        now = now if spec.arrival_s is None else spec.arrival_s  # a timed request counts from its arrival
        params = self.params.get(spec.output_tokens)
        if params is None:  # one frozen (immutable) SamplingParams per output length: validating one per request costs more than its steps
            params = self.params[spec.output_tokens] = SamplingParams(temperature=0.0, max_tokens=spec.output_tokens, ignore_eos=True)
        deadline = None if spec.deadline_s is None else now + spec.deadline_s
        shared = min(spec.shared_prefix, spec.prompt_tokens)
        prompt = [0] * spec.prompt_tokens  # [g] * shared + [index + 2] + [0, ...]
        if shared:
            prompt[:shared] = [group_token(spec.prefix_group)] * shared
        if shared < spec.prompt_tokens:
            prompt[shared] = index + 2
        request = LazyRequest.make(str(index), prompt, params, priority=spec.priority, deadline=deadline, arrival_index=index, arrival_time=now)
        request.page_names = page_names(index, spec.prompt_tokens, shared, spec.output_tokens, self.cfg.page_size, self.cfg.max_context, spec.prefix_group)
        if self.defer_names and shared < spec.prompt_tokens and not self.cfg.deterministic:  # its pages past the shared ones are its own (page_names)
            request.public_pages = shared // self.cfg.page_size
        try:
            self.scheduler.add(request)
        except ValueError as e:
            raise RequestRefused(index, str(e)) from None
        self.inflight += 1

    def admit(self) -> None:
        """Requests whose arrival time has come, and pulled ones up to max_inflight (between steps); then the
        iterations that must repeat the last one, after whose finishes the same again."""
        self._arrive()
        plans, self.plans = self.plans, []
        if self.fast_forward and plans:
            skip.fast_forward(self, plans)
            self._arrive()  # what arrived during the iterations it applied, and the places its finishes freed

    def _arrive(self) -> None:
        now = self.clock.now
        while self.timed and self.timed[-1][0] <= now:
            self.submit(self.timed.pop()[1], now)
        while self.pulled and self.inflight < self.max_inflight:
            self.submit(self.pulled.pop(), now)

    def step(self, plan: SketchPlan) -> np.ndarray:
        self.run_step(plan)
        rows = len(plan.request_ids)
        result = self.results.get(rows)
        if result is None:  # token 0 for every row; Scheduler.update only reads it, so one serves every step of its size
            result = self.results[rows] = StepResult(np.zeros(rows, np.int32))
        return result

    def run_step(self, plan: SketchPlan) -> None:
        """The plan's step on the clock (no result: the one-pass paths read none): its seconds, its count, the
        iteration's plans."""
        clock = self.clock
        if self.first_step is None:
            self.first_step = clock.now
        clock.now += self.step_seconds(plan)  # VirtualClock.advance
        self.last_step = clock.now
        steps = self.steps_by_key
        steps[plan.bucket] = steps.get(plan.bucket, 0) + 1
        self.plans.append(plan)

    def step_seconds(self, plan: SketchPlan) -> float:
        """costs.step_seconds of the plan's key and rows, memoised."""
        at = (plan.bucket, len(plan.request_ids))
        seconds = self._step_seconds.get(at)
        if seconds is None:
            seconds = self._step_seconds[at] = self.costs.step_seconds(*at)
        return seconds

    def run(self) -> None:
        while True:
            self.admit()
            if not self.scheduler.has_work():
                if not self.timed:
                    return
                self.clock.now = max(self.clock.now, self.timed[-1][0])  # idle until the next arrival
                continue
            for request in self._iterations():
                self.retire(request)

    def retire(self, request: Request) -> None:
        """A request finished: keep what the results read of it, and pull the next one's place."""
        self.done[request.arrival_index] = _Done(request.arrival_time, request.finish_time, request.first_token_time, request.first_scheduled_time,
                                                 len(request.output_ids), request.finish_reason)
        self.inflight -= 1

    def _iterations(self) -> Iterator[Request]:
        """runloop.run with this run's step, admission and clock, whose plans run as `_run_plan` (one pass over their rows)."""
        scheduler, clock, processor = self.scheduler, self.clock, self.processor
        one_pass = self.one_pass_decode
        scheduler.clock = clock
        while scheduler.has_work():
            self.admit()
            finished = scheduler.expire(clock.now) if self.expires else []
            plans = scheduler.schedule()
            if not plans and not finished:
                finished = scheduler.abort_all("no step could be planned for this request (the pool or the limits are too small for it)")
            if self.lazy and plans and plans[0].phase == "decode":  # the decode plans come first (Scheduler._plan_step)
                last = plans[-1].phase == "prefill"  # at most one prefill plan, the last
                finished += self._run_decode_plans(plans[:-1] if last else plans)
                plans = plans[-1:] if last else []
            for plan in plans:
                if one_pass:
                    finished += self._run_plan(plan)
                else:
                    finished += runloop.run_plan(scheduler, self.step, processor, plan, clock=clock)
            yield from finished

    def _run_decode_plans(self, plans: list[SketchPlan]) -> list[Request]:
        """`_run_plan` for each of an iteration's decode plans, on the decode clock: one tick gives every
        decoding row its token, and only the rows whose token fills a page (named, as cache_computed_pages_of
        would) or is their last (finished) are visited, per plan in its row order after its step."""
        scheduler, clock = self.scheduler, self.clock
        lazy = scheduler.lazy
        scheduler.decode_clock.ticks += 1
        filling, finishing = lazy.filling(), lazy.finishing()
        if not (filling or finishing or self.observes):  # no row to visit: the steps alone (most iterations)
            for plan in plans:
                self.run_step(plan)
            return []
        order = scheduler.decode_order
        filling, finishing = in_order(filling, order), in_order(finishing, order)
        done, first = [], 0
        for plan in plans:
            last = first + len(plan.request_ids)
            start = clock.now
            self.run_step(plan)
            if self.observes:
                scheduler.observe(plan, clock.now - start)
            done += end_plan(scheduler, filling, finishing, first, last)
            first = last
        return done

    def _run_plan(self, plan: SketchPlan) -> list[Request]:
        """runloop.run_plan for a plan of the simulator's (new token 0 for each sampled row, no log-probabilities,
        stops by length only): the same updates in the same order, in one pass over the rows; returns the
        requests it finished."""
        scheduler, clock = self.scheduler, self.clock
        by_id = scheduler.running_by_id
        rows = [(r, n, sample) for r, n, sample in zip(map(by_id.get, plan.request_ids), plan.num_new_tokens, plan.samples) if r is not None]
        start = clock.now
        self.run_step(plan)
        now = clock.now
        if self.observes:
            scheduler.observe(plan, now - start)
        max_context, done = self.cfg.max_context, []
        for r, n, sample in rows:
            r.num_steps += 1  # runloop._count_step
            if r.first_scheduled_time is None:
                r.first_scheduled_time = start
            r.num_computed_tokens += n  # Scheduler.update
            if not sample:
                continue
            output, max_tokens = r.output_ids, r.params.max_tokens
            if max_tokens:
                output.append(0)
                if r.first_token_time is None:  # as Scheduler.update
                    r.first_token_time = now
            if not output or len(output) >= max_tokens or len(r.prompt_ids) + len(output) >= max_context:  # _LengthStops.check
                done.append(r)
        scheduler.kv.cache_computed_pages_of([r for r, _, _ in rows])  # before any finish, as in Scheduler.update
        for r in done:
            scheduler.finish(r, "length", r.error)
        return done


def simulate(
    engine_cfg: EngineConfig, requests: Iterable[SimRequest], costs: StepCosts, *, num_pages: int | None = None, max_inflight: int | None = None,
    fast_forward: bool = True, one_pass_decode: bool = True,
) -> SimResult:
    """Run `requests` through the real scheduler on a virtual clock priced by `costs`.

    Args:
      engine_cfg: the engine's settings (limits, bucket tables, policy) to simulate.
      requests: what to run, in submission order.
      costs: seconds per program key and host seconds per step.
      num_pages: the KV pool's pages (None: engine_cfg.num_pages, or enough for max_num_seqs full contexts).
      max_inflight: pulled requests (without an arrival time) are submitted while fewer than this many requests,
        timed ones included, are in flight (None: 4 x max_num_seqs, LLM.stream's
        default for a batch job).
      fast_forward: skip through runs of decode iterations that must repeat the one before (sim_skip.py);
        the results are the same either way, bit for bit (tests check), only faster.
      one_pass_decode: run each plan's rows (decode and prefill) in one pass (`_Run._run_plan`) instead of through
        runloop.run_plan, and (without a sliding-window release) count decoding rows on the decode clock
        (sim_decode.py); the results are the same bit for bit (tests check), only faster.

    Raises:
      ValueError: naming the request (its index) and its field, or the limit, that is not valid (`_check`; a
        FieldError for a limit), or a request the settings refuse (RequestRefused).
    """
    started = time.perf_counter()
    requests = list(requests)
    for i, r in enumerate(requests):
        try:
            _check(r)
        except FieldError as e:
            raise ValueError(f"request {i}: {e}") from None
    for name, value in (("num_pages", num_pages), ("max_inflight", max_inflight)):
        if value is not None:
            check_int(name, value, low=1)
    pages = runloop.pool_pages(engine_cfg, num_pages)
    run = _Run(engine_cfg, requests, costs, pages, max_inflight or INFLIGHT_PER_SEQ * engine_cfg.max_num_seqs, fast_forward, one_pass_decode)
    collecting = gc.isenabled()
    gc.disable()  # the run makes many objects and no garbage cycle: the cyclic collector's passes over them only cost time
    try:
        run.run()
        return _result(run, time.perf_counter() - started)
    finally:
        if collecting:
            gc.enable()


def _check(r: SimRequest) -> None:
    """Raise FieldError naming a request's bad field: counts are integers (a generation samples a token at least),
    priority, arrival and deadline as Prompt's (scheduling/request.py)."""
    check_int("prompt_tokens", r.prompt_tokens, low=1)
    check_int("output_tokens", r.output_tokens, low=1)
    check_int("shared_prefix", r.shared_prefix, low=0)
    check_int("prefix_group", r.prefix_group, low=0, high=MAX_PREFIX_GROUPS - 1)
    check_int("priority", r.priority, low=-(2**62), high=2**62)
    if r.arrival_s is not None:
        check_number("arrival_s", r.arrival_s, low=0.0, high=1e9)
    if r.deadline_s is not None:
        check_number("deadline_s", r.deadline_s, low=0.0, high=math.inf, low_open=True)


def _result(run: _Run, seconds: float) -> SimResult:
    done = run.done
    arrival, finish = np.array([r.arrival_time for r in done]), np.array([r.finish_time for r in done], np.float64)
    first = np.array([np.nan if r.first_token_time is None else r.first_token_time for r in done], np.float64)
    started = np.array([r.finish_time if r.first_scheduled_time is None else r.first_scheduled_time for r in done], np.float64)
    tokens = np.array([r.num_output_tokens for r in done], np.int64)
    decoded = ~np.isnan(first) & (tokens > 1)  # a first token and more after it
    tpot = np.zeros(len(done))
    np.divide(finish - first, tokens - 1, out=tpot, where=decoded)  # the same IEEE division per element as Python's
    stats = run.scheduler.stats
    return SimResult(
        wall_s=run.last_step - (run.first_step or 0.0), ttft_s=first - arrival, tpot_s=tpot, queue_s=started - arrival, latency_s=finish - arrival,
        finish_reasons=dict(collections.Counter([r.finish_reason for r in done])), num_steps=stats.num_steps, steps_by_key=run.steps_by_key,
        padding=stats.padding_waste, num_preemptions=stats.num_preemptions, peak_kv_utilization=stats.peak_kv_utilization,
        mean_kv_utilization=stats.mean_kv_utilization, generated_tokens=int(tokens.sum()), seconds=seconds,
    )
