"""Is the scheduler's host time per step flat in the number of waiting requests?

The scheduler benchmark, host only (no model, no jax). --max-num-seqs running sequences decode for ever
behind 1,000 / 10,000 / 100,000 waiting requests (priorities 0-3, half with a far deadline); in case
"full" a step admits nothing, in "admits" one running request is finished before each step. Per step it
times expire() and schedule() (with "queue ms", the waiting queue's own calls) for request_queue.py's
heap and for the sorted-list baseline it replaced. Correctness first: both plan the same steps.
Goal: schedule() <= 1 ms at 100,000 waiting.

    .venv/bin/python experiments/bench_scheduler.py [--sizes 1000,10000,100000] [--steps 30] [--quick]
"""

import statistics
import time

import numpy as np

from common import paths, report
from jaxinfer.config import EngineConfig
from jaxinfer.scheduling.request import Request, SamplingParams
from jaxinfer.scheduling.request_queue import RequestQueue
from jaxinfer.scheduling.scheduler import Scheduler

RESULTS = paths.RESULTS_DIR / "bench_scheduler.json"
GOAL_SCHEDULE_S = 1e-3  # schedule() at 100,000 waiting
GOAL_SIZE = 100_000
PROMPT_TOKENS = 4
PAGE_SIZE = 16
MAX_CONTEXT = 512
FAR_FUTURE = 1e12  # deadlines that never pass during the run (perf_counter seconds)


class SortedListBaseline(list):
    """The waiting list before request_queue.py: append, insert at the front, the whole list sorted at
    every step, and a scan of every request to expire."""

    def appendleft(self, request: Request) -> None:
        self.insert(0, request)

    def first(self, k: int) -> list[Request]:
        order = lambda r: (r.priority, r.deadline if r.deadline is not None else float("inf"), r.arrival_index)  # noqa: E731
        return sorted(self, key=order)[: max(k, 0)]

    def expire(self, now: float) -> list[Request]:
        expired = [r for r in self if r.deadline is not None and r.deadline < now and not r.output_ids]
        for r in expired:
            self.remove(r)
        return expired


class QueueTimer:
    """Mixin: adds the seconds spent in first (its iteration included), remove and appendleft to `seconds`."""

    def __init__(self):
        super().__init__()
        self.seconds = 0.0

    def _timed(self, method, *args):
        start = time.perf_counter()
        try:
            return method(*args)
        finally:
            self.seconds += time.perf_counter() - start

    def first(self, k: int):
        requests = iter(self._timed(super().first, k))
        while (request := self._timed(next, requests, None)) is not None:
            yield request

    def remove(self, request: Request) -> None:
        self._timed(super().remove, request)

    def appendleft(self, request: Request) -> None:
        self._timed(super().appendleft, request)


class TimedQueue(QueueTimer, RequestQueue):
    pass


class TimedBaseline(QueueTimer, SortedListBaseline):
    pass


def engine_config(max_num_seqs: int) -> EngineConfig:
    return EngineConfig(max_num_seqs=max_num_seqs, max_context=MAX_CONTEXT, page_size=PAGE_SIZE, compilation_cache_dir=None)


def make_requests(num: int, seed: int) -> list[Request]:
    """Tiny prompts that generate up to the context; priorities 0-3, half with a far deadline."""
    rng = np.random.default_rng(seed)
    priorities, has_deadline = rng.integers(0, 4, num), rng.random(num) < 0.5
    deadlines = FAR_FUTURE + rng.random(num)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_CONTEXT - PROMPT_TOKENS, ignore_eos=True)
    return [Request(str(i), [1 + i % 97] * PROMPT_TOKENS, params, seed=i, priority=int(priorities[i]),
                    deadline=float(deadlines[i]) if has_deadline[i] else None, arrival_index=i) for i in range(num)]


def build_scheduler(num_waiting: int, max_num_seqs: int, baseline: bool) -> Scheduler:
    """A scheduler with max_num_seqs requests running and decoding, num_waiting behind them."""
    cfg = engine_config(max_num_seqs)
    scheduler = Scheduler(cfg, num_pages=max_num_seqs * (MAX_CONTEXT // PAGE_SIZE) + 1)
    scheduler.waiting = TimedBaseline() if baseline else TimedQueue()
    for r in make_requests(num_waiting + max_num_seqs, seed=0):
        scheduler.add(r)
    while len(scheduler.running) < max_num_seqs or any(r.num_computed_tokens < r.num_tokens - 1 for r in scheduler.running):
        step(scheduler)  # admission and prefill of the first batch, untimed
    return scheduler


def step(scheduler: Scheduler) -> tuple[float, float, float, list]:
    """One iteration: expire, schedule, apply zero tokens. Returns (expire s, schedule s, of which in
    the queue s, plans)."""
    start = time.perf_counter()
    scheduler.expire()
    middle, in_queue = time.perf_counter(), scheduler.waiting.seconds
    plans = scheduler.schedule()
    end, in_queue = time.perf_counter(), scheduler.waiting.seconds - in_queue
    for plan in plans:
        scheduler.update(plan, np.zeros(len(plan.request_ids), np.int32))
    return middle - start, end - middle, in_queue, plans


def timed_steps(scheduler: Scheduler, num_steps: int, admits: bool) -> dict:
    """`num_steps` timed steps; with `admits`, the oldest running request is finished before each."""
    expire_s, schedule_s, queue_s, trace = [], [], [], []
    for _ in range(num_steps):
        if admits:
            scheduler.finish(scheduler.running[0], "length")
        e, s, q, plans = step(scheduler)
        expire_s.append(e)
        schedule_s.append(s)
        queue_s.append(q)
        trace.append([(p.phase, p.request_ids, p.bucket) for p in plans])
    host = [e + s for e, s in zip(expire_s, schedule_s)]
    return {"schedule_ms_median": 1e3 * statistics.median(schedule_s), "schedule_ms_min": 1e3 * min(schedule_s),
            "schedule_ms_max": 1e3 * max(schedule_s), "queue_ms_median": 1e3 * statistics.median(queue_s),
            "queue_ms_max": 1e3 * max(queue_s), "expire_ms_median": 1e3 * statistics.median(expire_s),
            "step_host_ms_median": 1e3 * statistics.median(host),
            "num_waiting_after": len(scheduler.waiting), "trace": trace}


def run_case(num_waiting: int, case: str, args) -> dict:
    """Queue and baseline on the same workload; their plans must be identical."""
    out = {}
    for name, baseline in (("queue", False), ("baseline", True)):
        scheduler = build_scheduler(num_waiting, args.max_num_seqs, baseline)
        out[name] = timed_steps(scheduler, args.steps, admits=case == "admits")
        report.log("bench_scheduler", f"{case} {num_waiting} {name}: schedule {out[name]['schedule_ms_median']:.3f} ms")
    same = out["queue"].pop("trace") == out["baseline"].pop("trace")
    return {"num_waiting": num_waiting, "case": case, "same_plans": same, **out,
            "speedup": out["baseline"]["schedule_ms_median"] / out["queue"]["schedule_ms_median"]}


def print_table(rows: list[dict]) -> None:
    columns = [("case", "<7"), ("waiting", ">8d"), ("old sched ms", ">12.3f"), ("new sched ms", ">12.3f"), ("new max ms", ">10.3f"),
               ("old queue ms", ">12.3f"), ("new queue ms", ">12.3f"), ("old expire ms", ">13.3f"), ("new expire ms", ">13.3f"),
               ("speedup", ">8.1f"), ("same plans", ">10")]
    print(report.format_table(columns, [[r["case"], r["num_waiting"], r["baseline"]["schedule_ms_median"], r["queue"]["schedule_ms_median"],
                                          r["queue"]["schedule_ms_max"], r["baseline"]["queue_ms_median"], r["queue"]["queue_ms_median"],
                                          r["baseline"]["expire_ms_median"], r["queue"]["expire_ms_median"],
                                          r["speedup"], str(r["same_plans"])] for r in rows]))


def main() -> None:
    parser = report.arg_parser(__doc__, out=RESULTS)
    parser.add_argument("--sizes", default="1000,10000,100000", help="waiting requests, comma-separated")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per case")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="sizes 1000,10000 and 10 steps")
    args = parser.parse_args()
    sizes = [1000, 10_000] if args.quick else [int(s) for s in args.sizes.split(",") if s]
    args.steps = 10 if args.quick else args.steps
    rows = [run_case(n, case, args) for n in sizes for case in ("full", "admits")]
    print_table(rows)
    at_goal = [r["queue"]["schedule_ms_median"] for r in rows if r["num_waiting"] == GOAL_SIZE]
    goal_met = bool(at_goal) and max(at_goal) <= 1e3 * GOAL_SCHEDULE_S
    correct = all(r["same_plans"] for r in rows)
    summary = {"goal_schedule_ms_at_100k": 1e3 * GOAL_SCHEDULE_S, "goal_met": goal_met if at_goal else None, "same_plans": correct,
               **{f"{r['case']}_{r['num_waiting']}": {"old_ms": round(r["baseline"]["schedule_ms_median"], 4),
                                                     "new_ms": round(r["queue"]["schedule_ms_median"], 4),
                                                     "new_queue_ms": round(r["queue"]["queue_ms_median"], 4)}
                  for r in rows}}
    doc = {"question": __doc__.split("\n")[0], "steps": args.steps, "max_num_seqs": args.max_num_seqs, "prompt_tokens": PROMPT_TOKENS,
           "page_size": PAGE_SIZE, "max_context": MAX_CONTEXT, "rows": rows, "summary": summary}
    report.finish(args.out, doc, summary, correct=correct)


if __name__ == "__main__":
    main()
