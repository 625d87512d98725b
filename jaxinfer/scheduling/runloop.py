"""The one run loop: scheduler -> step -> output processor, until no work is left. Host only, no jax.

`run` is used by `LLM`, the tests (with a fake step) and the benchmarks (through `on_step`). Each
iteration expires requests past their deadline, asks the scheduler for plans, runs each plan, and
hands every sampled token to the output processor, which decides who is done; the scheduler then
frees their pages. Two rules keep one request from taking others down, or the loop from spinning:

- a step that raises fails only the requests of its plan (finish reason 'error', with the reason);
- an iteration with work left but no plan and nothing expired fails the remaining requests, naming
  why, instead of looping forever.
"""

import time
from collections.abc import Callable, Iterator

import numpy as np

from jaxinfer.scheduling.stopping import OutputProcessor
from jaxinfer.scheduling.plan import StepPlan, StepResult
from jaxinfer.scheduling.request import Request, SamplingParams
from jaxinfer.scheduling.scheduler import Scheduler, SchedulerStats

StepFn = Callable[[StepPlan], StepResult | np.ndarray]  # plan -> sampled tokens int[R] (with log-probabilities)
OnStep = Callable[[StepPlan, np.ndarray, float], None]  # (plan, tokens, seconds the step took)


def run(
    scheduler: Scheduler, step: StepFn, processor: OutputProcessor, *, on_step: OnStep | None = None, admit: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[Request]:
    """Run until the scheduler has no work; yield each request as soon as it has finished.

    Args:
      scheduler: holds the submitted requests.
      step: runs one plan (Engine.step, or a fake in tests).
      processor: decides when a request is done.
      on_step: called with (plan, tokens, seconds) after every step (benchmarks time and count steps here).
      admit: called before every step, to add the requests that have arrived since (arrival-time replay).
      clock: seconds now; times the steps, the requests' timings and the deadlines (the scheduler reads it
        too). The simulator (simulator.py) passes a virtual clock that its fake step advances.
    """
    scheduler.clock = clock
    while scheduler.has_work():
        if admit is not None:
            admit()
        finished = scheduler.expire(clock())
        plans = scheduler.schedule()
        if not plans and not finished:
            finished = scheduler.abort_all("no step could be planned for this request (the pool or the limits are too small for it)")
        for plan in plans:
            finished += run_plan(scheduler, step, processor, plan, on_step, clock)
        yield from finished


def run_plan(
    scheduler: Scheduler, step: StepFn, processor: OutputProcessor, plan: StepPlan, on_step: OnStep | None = None, clock: Callable[[], float] = time.perf_counter,
) -> list[Request]:
    """Run one plan and apply its tokens; returns the requests it finished."""
    start = clock()
    _count_step(scheduler, plan, start)
    try:
        result = StepResult.of(step(plan))
    except Exception as e:  # one bad step fails its own rows, not the job
        return scheduler.abort(plan.request_ids, f"the step failed: {type(e).__name__}: {e}")
    scheduler.observe(plan, clock() - start)  # the policy learns from step times (policies.py)
    if on_step is not None:
        on_step(plan, result.tokens, clock() - start)
    finished = []
    for request in scheduler.update(plan, result):
        try:
            reason = processor.check(request)
        except Exception as e:  # a detokenizer failure is this request's error
            finished += scheduler.abort([request.request_id], f"output processing failed: {type(e).__name__}: {e}")
            continue
        if reason is not None:
            scheduler.finish(request, reason, request.error)  # check() names the cause of an 'error'
            finished.append(request)
    return finished


def _count_step(scheduler: Scheduler, plan: StepPlan, now: float) -> None:
    """Per-request timing: the first step that computes a request's tokens, and how many steps do."""
    running = scheduler.running_by_id
    for request_id in plan.request_ids:
        request = running.get(request_id)
        if request is not None:
            request.num_steps += 1
            if request.first_scheduled_time is None:  # a virtual clock may start at 0.0
                request.first_scheduled_time = now


def pool_pages(engine_cfg, num_pages: int | None = None) -> int:
    """The pages of a host-only run's pool (a dry run's, a simulation's): `num_pages`, else the engine config's, else
    enough for max_num_seqs full contexts and the null page."""
    return num_pages or engine_cfg.num_pages or engine_cfg.max_num_seqs * engine_cfg.max_pages_per_seq + 1


def dry_run(engine_cfg, prompts: list[list[int]], max_tokens: list[int], num_pages: int | None = None) -> tuple[list[StepPlan], SchedulerStats]:
    """The plans the real scheduler makes for these requests (greedy, EOS ignored, each generating exactly
    its max_tokens) when every step returns token 0: the schedule of an offline batch, host only, in
    milliseconds. Greedy tokens do not change a schedule whose stops are lengths, so the plans' keys,
    padding and page use are those of a real run (the prefix cache sees the same prompts). `num_pages`:
    the pool's pages (None: the engine config's, or enough for max_num_seqs full contexts)."""
    scheduler = Scheduler(engine_cfg, pool_pages(engine_cfg, num_pages))
    for i, (prompt, out) in enumerate(zip(prompts, max_tokens, strict=True)):
        scheduler.add(Request(str(i), list(prompt), SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True), seed=i, arrival_index=i))
    plans: list[StepPlan] = []
    fake_step = lambda plan: np.zeros(plan.seeds.shape[0], np.int32)  # noqa: E731
    finished = list(run(scheduler, fake_step, OutputProcessor(None, None, engine_cfg.max_context), on_step=lambda plan, *_: plans.append(plan)))
    lost = [r.request_id for r in finished if r.finish_reason != "length"]
    if len(finished) != len(prompts) or lost:
        raise ValueError(f"the dry run did not finish every request by length (not: {lost[:5]}); the limits are too small for them")
    return plans, scheduler.stats
