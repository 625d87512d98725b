"""Does an online refit bring a planned job's padding after a shift in its prompt lengths near a table fitted to the
second half alone, without any step slowing past 2x while the refit compiles?

The default model (`LLM()` with its defaults) runs one job file (build/bench_refit/lines.jsonl): real text
(experiments/data, bench_prefix_admission.sentences) cut to prompts of about 25 tokens for the first half, then
about 300 (log-normal, sigma 0.35: the shape of tests/batch/test_refit.py's shift), greedy, EOS ignored, 8 to 48
output tokens staggered, 8 sequences and a 512-token prefill budget (the test's: a prefill step holds about one
prompt, so its size follows the prompts; 32 packed sequences fill every step and nothing drifts). The job's
plan is made as `jaxinfer generate --plan` makes it (batch/planning.make_plan, applied, warmed up), but from the
first half's lines only, so its chunk table is one fitted before the shift. The job then runs twice through the
CLI's path (BatchJob.run with the hook of planning.refitting): first without refit (the planned tables kept; it
also pays the process's one-time costs), then with it (batch/refit.Refit). Correctness first: every line has its
record with exactly max_tokens tokens, and the share of lines whose greedy tokens agree between the two runs.

Every program compiles for real (a fresh XLA cache, removed at the end). Per step: its wall time (the on_step hook's seconds) and its program key. Refit records when its background
compile started and ended and when the swap happened (refit.Swap); a step that overlaps that window is inside it
(the compile runs in a child process that Refit stops while a step runs: engine/compile_worker.py).
Each step is compared to the median of its own program key's steps outside the window (the phase's median where
the key has none: its median in the run without refit, else the phase's), also per key; the noise without a compile
beside it: the slowest step outside the window, and in the run without refit, against its key's median. While the refit compiles, Refit lets the child run for --yield-share (refit.YIELD_SHARE) of each step's seconds
after the step: a step's seconds exclude that pause, and "max with sleep" counts it
(refit.Swap records the sleeps; a refit still compiling at the job's end is recorded as unfinished_refit). Padding after the shift: 1 - real / padded token slots of the prefill steps that hold a
second-half prompt, in the refit run, against a dry run (runloop.dry_run, host only) of the second half alone on
a chunk table fitted to it (refit.refit_chunk_table: the plan's bucket count and top).

--dry-run replaces both runs with the job's schedule alone (the real scheduler and the job's drift watch, host only,
seconds; no program compiles): the watch's proposal is swapped in --dry-delay prefill steps after it asks (the
measured compile windows spanned 10 to 14 prefill steps), and the padding after the shift is judged against the same
second-half table. It shows how the gap depends on the trace's length (--lines), which a real run takes minutes to.

    .venv/bin/python experiments/bench_refit.py [--quick] [--lines N] [--seed S] [--table reach|plan] [--ask-at STEPS] [--yield-share S]
    .venv/bin/python experiments/bench_refit.py --dry-run [--lines N] [--seed S] [--dry-delay PREFILL_STEPS]
"""

import dataclasses
import json
import os
import resource
import tempfile
import time

import numpy as np

from bench_prefix_admission import sentences
from common import paths, report
from common.paths import REPO_ROOT
from jaxinfer.api import LLM
from jaxinfer.batch import planning, refit
from jaxinfer.batch.job import BatchJob
from jaxinfer.engine import compile_worker  # host side: imports no jax
from jaxinfer.scheduling import runloop
from jaxinfer.scheduling.bucket_tables import BucketTables
from jaxinfer.scheduling.request import Request, SamplingParams
from jaxinfer.scheduling.scheduler import Scheduler
from jaxinfer.scheduling.stopping import OutputProcessor

RESULTS = paths.RESULTS_DIR / "bench_refit.json"
WORK_DIR = REPO_ROOT / "build" / "bench_refit"
SHORT_TOKENS, LONG_TOKENS, SIGMA = 25, 300, 0.35
MAX_NUM_SEQS, MAX_PREFILL_TOKENS = 8, 512  # the refit test's limits: few rows, so a prefill step holds about one prompt


def max_tokens_of(index: int) -> int:
    """8 to 48 output tokens, staggered (the refit test's), so that sequences finish apart and prompts enter one by one."""
    return 8 + (index * 7) % 41
GOALS = {"padding_gap": ("padding after the shift, refit run minus a second-half table's (dry run), points / 100", 0.02, "at_most"),
         "max_ratio_in_window": ("slowest step while the refit compiles / median of its program key outside the window", 2.0, "at_most"),
         "outputs_agree": ("share of lines whose greedy tokens equal the run without refit", 1.0, "at_least")}


def job_lines(tokenizer, count: int, rng: np.random.Generator) -> list[str]:
    """`count` short prompts, then `count` long ones: slices of the real text's tokens, decoded."""
    ids = tokenizer.encode(" ".join(sentences()))
    lengths = np.concatenate([rng.lognormal(np.log(SHORT_TOKENS), SIGMA, count), rng.lognormal(np.log(LONG_TOKENS), SIGMA, count)])
    starts = rng.integers(0, len(ids) - 800, lengths.size)
    return [tokenizer.decode(ids[s : s + n]) for s, n in zip(starts, np.clip(lengths.astype(int), 8, 700))]


@dataclasses.dataclass
class StepRecord:
    ended: float  # perf_counter after the step
    seconds: float  # the step's wall time (on_step's)
    phase: str
    key: str  # the program key
    real_tokens: int  # prefill: new tokens; decode: rows
    slots: int  # the bucket's token slots (rows x tokens)
    second_half: bool  # holds a prompt of the second half
    cpu_ms: float | None = None  # --sched-stats: this process's threads' CPU time from just before the step to just after it
    wait_ms: float | None = None  # their time runnable but waiting for a core (run-queue wait)
    steal_ticks: int | None = None  # the machine's steal time meanwhile (1/100 s ticks: the hypervisor ran something else)
    minor_faults: int | None = None  # this process's minor page faults meanwhile (memory mapped or touched for the first time)
    threads_ran: int | None = None  # this process's threads that ran meanwhile
    most_waiting: str | None = None  # the thread that waited longest for a core meanwhile: "name ms"
    child_ms: float | None = None  # the refit's compile child's CPU time meanwhile (0: it was stopped, as it should be)


class SchedProbe:
    """--sched-stats: the CPU and run-queue-wait nanoseconds of this process's threads (/proc/self/task/*/schedstat),
    its minor page faults (getrusage) and the machine's steal ticks (/proc/stat), read just before each step (after every hook, the refit's turn
    included) and just after it, so a slow step shows whether its threads ran longer, waited for a core, or lost
    the virtual CPU to the hypervisor."""

    def __init__(self, child=None):
        self.names: dict[str, str] = {}  # thread id -> its name (/proc/self/task/ID/comm)
        self.child = child  # a callable: the refit's compile child's pid, or None while there is none
        self.before = self.read()

    def read(self) -> tuple[dict[str, tuple[int, int]], int, int, tuple[int | None, int]]:
        """({thread id: (CPU ns, wait ns)}, steal ticks, minor faults, (the compile child's pid, its threads' CPU ns))."""
        threads = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    on_cpu, waiting, _ = f.read().split()
                if tid not in self.names:
                    with open(f"/proc/self/task/{tid}/comm") as f:
                        self.names[tid] = f.read().strip()
            except (OSError, ValueError):  # a thread that just ended
                continue
            threads[tid] = (int(on_cpu), int(waiting))
        with open("/proc/stat") as f:
            steal = int(f.readline().split()[8])  # cpu user nice system idle iowait irq softirq steal ...
        return threads, steal, resource.getrusage(resource.RUSAGE_SELF).ru_minflt, self._child_cpu()

    def _child_cpu(self) -> tuple[int | None, int]:
        pid, cpu = self.child() if self.child is not None else None, 0
        if pid is not None:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                return None, 0
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                        cpu += int(f.read().split()[0])
                except (OSError, ValueError):
                    continue
        return pid, cpu

    def mark(self) -> None:
        self.before = self.read()

    def since(self) -> tuple[float, float, int, int, int, str, float | None]:
        """(CPU ms, wait ms, steal ticks, minor faults, threads that ran, the longest waiter) since the last mark, over
        the threads alive at both reads."""
        now = self.read()
        deltas = {tid: (cpu - self.before[0][tid][0], wait - self.before[0][tid][1]) for tid, (cpu, wait) in now[0].items() if tid in self.before[0]}
        waiter = max(deltas, key=lambda tid: deltas[tid][1], default=None)
        return (sum(d[0] for d in deltas.values()) / 1e6, sum(d[1] for d in deltas.values()) / 1e6, now[1] - self.before[1], now[2] - self.before[2],
                sum(d[0] > 0 for d in deltas.values()), "-" if waiter is None else f"{self.names.get(waiter, waiter)} {deltas[waiter][1] / 1e6:.2f}",
                (now[3][1] - self.before[3][1]) / 1e6 if now[3][0] is not None and now[3][0] == self.before[3][0] else None)


def recorder(steps: list[StepRecord], half: int, probe: SchedProbe | None = None):
    def on_step(plan, tokens, seconds):
        sched = probe.since() if probe is not None else (None,) * 7
        second = any(int(r.split(":")[0]) >= half for r in plan.request_ids)
        steps.append(StepRecord(time.perf_counter(), seconds, plan.phase, str(plan.bucket), int(sum(plan.num_new_tokens)),
                                plan.bucket.num_rows * plan.bucket.num_tokens, second, *sched))
    return on_step


def marking(hook, probe: SchedProbe):
    """`hook`, then the probe's mark: the next step's figures start after every hook (the refit's turn included)."""
    def on_step(plan, tokens, seconds):
        hook(plan, tokens, seconds)
        probe.mark()
    return on_step


def plan_first_half(llm, prompts) -> planning.Plan:
    """What `--plan` would choose from a sample of the first half's lines (planning.plan_job, its sample narrowed)."""
    ids = [p.token_ids for p in prompts]
    cfg = llm.engine_config
    sample = planning.WorkloadSample.of_prompts(ids, [p.params.max_tokens for p in prompts], cfg.page_size, cfg.enable_prefix_caching, 2 * len(ids))
    given = dataclasses.replace(llm.engine_config, num_pages=llm.engine.num_pages)
    options = planning.PlanOptions(max_num_seqs=(MAX_NUM_SEQS,), max_prefill_tokens=(MAX_PREFILL_TOKENS,))
    return planning.make_plan(sample, given, planning.engine_costs(llm), options)


@dataclasses.dataclass
class AskAt(refit.DriftWatch):
    """--ask-at: a watch that proposes `proposal` once, `after` steps after the first prefill of a second-half line,
    whatever the sizes (the compile window and the swap measured at a chosen moment, not the drift judge's)."""

    half: int = 0
    after: int = 0
    proposal: tuple[int, ...] = ()

    def observe(self, plan) -> tuple[int, ...] | None:
        if not hasattr(self, "shifted_at") and plan.phase == "prefill" and any(int(r.split(":")[0]) >= self.half for r in plan.request_ids):
            self.shifted_at, self.calls = 0, 0
        if not hasattr(self, "shifted_at"):
            return None
        self.calls += 1
        return self.proposal if self.calls == self.after + 1 else None


def run_job(llm, input_path, output, defaults, half: int, *, refitting: bool, options: dict | None = None,
            sched_stats: bool = False) -> tuple[list[StepRecord], list, float, dict | None]:
    """The job run as cli._run_job runs it; (steps, the refit's swaps, wall seconds, a refit still compiling at the end
    (Refit.unfinished)). `options`: Refit attributes set after planning.refitting made it (watch, yield_share).
    `sched_stats`: each step's StepRecord holds its SchedProbe figures."""
    steps, swaps = [], []
    llm.reset_prefix_cache()
    hook: list = []
    pending = lambda: getattr(hook[0], "_pending", None) if hook else None  # noqa: E731  (the Refit's compile under way)
    probe = SchedProbe(lambda: pending().child.proc.pid if pending() is not None and pending().child is not None else None) if sched_stats else None
    with BatchJob(input_path, output, defaults) as job, planning.refitting(llm, recorder(steps, half, probe), refitting) as on_step:
        hook.append(on_step)
        for name, value in (options or {}).items():
            setattr(on_step, name, value)
        job.runner.on_step = on_step if probe is None else marking(on_step, probe)
        if probe is not None:
            probe.mark()
        start = time.perf_counter()
        job.run(llm, progress=False)
        wall = time.perf_counter() - start
        swaps = list(getattr(on_step, "swaps", []))
        unfinished = on_step.unfinished() if hasattr(on_step, "unfinished") else None
    if unfinished is not None:
        report.log("bench_refit", f"the refit asked for was still compiling when the job ended: {unfinished}")
    return steps, swaps, wall, unfinished


def read_records(output) -> dict[int, dict]:
    """{line id: record} of the output file's result records."""
    records = [json.loads(line) for line in output.read_text().splitlines() if line.strip()]
    return {r["id"]: r for r in records if "id" in r}


def check_outputs(records: dict, num_lines: int) -> bool:
    """One record per line, each finished with exactly its line's max_tokens."""
    return sorted(records) == list(range(num_lines)) and all(r.get("status") == "ok" and len(r["token_ids"]) == max_tokens_of(i) for i, r in records.items())


def padding_of(steps: list[StepRecord], after: float = 0.0) -> float | None:
    prefill = [s for s in steps if s.phase == "prefill" and s.second_half and s.ended > after]
    return None if not prefill else 1.0 - sum(s.real_tokens for s in prefill) / sum(s.slots for s in prefill)


def in_window(step: StepRecord, swap: refit.Swap) -> bool:
    """Whether the step overlaps the refit's compile window."""
    return step.ended > swap.compile_started and step.ended - step.seconds < swap.compile_ended


def window_stats(steps: list[StepRecord], swap: refit.Swap, baseline: list[StepRecord]) -> dict:
    """Per phase: median outside the compile window, max / p99 inside, each inside step against its key's median
    outside the window (a key with no step outside it: that key's median in `baseline`, the run without refit, else
    the phase's), also with the pause Refit took after it (yield_share of its seconds), and how many inside steps passed 2x."""
    inside = [in_window(s, swap) for s in steps]
    outside_by_key, outside_by_phase, baseline_by_key = {}, {}, {}
    for s, i in zip(steps, inside):
        if not i:
            outside_by_key.setdefault(s.key, []).append(s.seconds)
            outside_by_phase.setdefault(s.phase, []).append(s.seconds)
    for s in baseline:
        baseline_by_key.setdefault(s.key, []).append(s.seconds)
    out = {}
    for phase in ("prefill", "decode"):
        seconds = [s.seconds for s, i in zip(steps, inside) if i and s.phase == phase]
        ratios = [s.seconds / np.median(outside_by_key.get(s.key) or baseline_by_key.get(s.key) or outside_by_phase[phase]) for s, i in zip(steps, inside) if i and s.phase == phase]
        out[phase] = {"median_outside_s": float(np.median(outside_by_phase[phase])) if phase in outside_by_phase else None,
                      "num_inside": len(seconds), "max_inside_s": max(seconds, default=None),
                      "p99_inside_s": float(np.percentile(seconds, 99)) if seconds else None, "max_ratio_to_own_key": max(ratios, default=None),
                      "p50_ratio_to_own_key": float(np.median(ratios)) if ratios else None, "num_over_2x": sum(r > 2.0 for r in ratios),
                      "num_inside_keys_only_inside": sum(1 for s, i in zip(steps, inside) if i and s.phase == phase and s.key not in outside_by_key),
                      "max_ratio_with_yield": max(ratios, default=0.0) * (1.0 + swap.yield_share) if ratios else None}
    return out


def window_by_key(steps: list[StepRecord], swap: refit.Swap) -> dict:
    """Per program key with steps both inside and outside the compile window: how many inside, the median outside,
    the slowest inside / that median, how many inside passed 2x, and (the noise without a compile) how many outside did."""
    out = {}
    for key in sorted({s.key for s in steps}):
        mine = [(s.seconds, in_window(s, swap)) for s in steps if s.key == key]
        inside, outside = [t for t, i in mine if i], [t for t, i in mine if not i]
        if inside and outside:
            median = float(np.median(outside))
            out[key] = {"num_inside": len(inside), "median_outside_s": median, "max_ratio": max(inside) / median, "num_over_2x": sum(t > 2 * median for t in inside),
                        "num_outside": len(outside), "num_outside_over_2x": sum(t > 2 * median for t in outside)}
    return out


def after_load(steps: list[StepRecord], swap: refit.Swap) -> dict:
    """The window's steps split by whether a program was loaded here in the turn just before them (refit.Swap.loaded_at):
    per side, how many, and each step against its key's median outside the window (median, max, how many over 1.5x
    and 2x). A load maps a compiled program into this process between two steps."""
    outside: dict[str, list[float]] = {}
    for s in steps:
        if not in_window(s, swap):
            outside.setdefault(s.key, []).append(s.seconds)
    sides: dict[str, list[float]] = {"after_a_load": [], "after_no_load": []}
    previous_end = -np.inf
    for s in steps:
        if in_window(s, swap) and s.key in outside:
            loaded = any(previous_end < t <= s.ended - s.seconds for t in swap.loaded_at)
            sides["after_a_load" if loaded else "after_no_load"].append(s.seconds / float(np.median(outside[s.key])))
        previous_end = s.ended
    return {side: {"num_steps": len(r), "p50_ratio": float(np.median(r)) if r else None, "max_ratio": max(r, default=None),
                   "num_over_1_5x": sum(x > 1.5 for x in r), "num_over_2x": sum(x > 2.0 for x in r)} for side, r in sides.items()}


def sched_split(steps: list[StepRecord], swap: refit.Swap, slow: float = 1.5) -> dict | None:
    """--sched-stats: where a slow step's time went. The steps of keys with steps outside the compile window, in three
    groups: in the window over `slow` x their key's median outside it, the other window steps, and the steps outside.
    Per group: how many, and the median and max of each figure (CPU ms of this process's threads, their run-queue
    wait ms, the machine's steal ticks, minor page faults) and of CPU ms against the key's median CPU ms outside. Then each slow step."""
    if not steps or steps[0].cpu_ms is None:
        return None
    outside: dict[str, list[StepRecord]] = {}
    for s in steps:
        if not in_window(s, swap):
            outside.setdefault(s.key, []).append(s)
    med = {k: (float(np.median([t.seconds for t in v])), float(np.median([t.cpu_ms for t in v]))) for k, v in outside.items()}
    late, after_turn, previous_end = {}, set(), -np.inf  # step index -> the letters of the child's threads a stop just before it left running
    for i, s in enumerate(steps):
        letters = [letters for t, letters in swap.late_stops if previous_end < t <= s.ended - s.seconds]
        if letters:
            late[i] = ",".join(letters)
        if any(previous_end < t <= s.ended - s.seconds for t in swap.turn_ends):
            after_turn.add(i)
        previous_end = s.ended
    groups: dict[str, list[tuple[float, float, StepRecord, str | None]]] = {"window_slow": [], "window_other": [], "outside": [],
                                                                           "window_after_a_turn": [], "window_after_none": []}
    for i, s in enumerate(steps):
        if s.key in med:
            ratio, cpu_ratio = s.seconds / med[s.key][0], s.cpu_ms / med[s.key][1] if med[s.key][1] else float("nan")
            side = "outside" if not in_window(s, swap) else "window_slow" if ratio > slow else "window_other"
            groups[side].append((ratio, cpu_ratio, s, late.get(i)))
            if side != "outside":
                groups["window_after_a_turn" if i in after_turn else "window_after_none"].append((ratio, cpu_ratio, s, late.get(i)))
    stat = lambda values: {"p50": float(np.median(values)), "max": float(np.max(values))} if values else None  # noqa: E731
    out = {side: {"num_steps": len(rows), "cpu_ms": stat([s.cpu_ms for _, _, s, _ in rows]), "cpu_to_key_median": stat([c for _, c, _, _ in rows]),
                  "wait_ms": stat([s.wait_ms for _, _, s, _ in rows]), "steal_ticks": stat([s.steal_ticks for _, _, s, _ in rows]),
                  "minor_faults": stat([s.minor_faults for _, _, s, _ in rows]), "threads_ran": stat([s.threads_ran for _, _, s, _ in rows]),
                  "after_a_late_stop": sum(letters is not None for _, _, _, letters in rows),
                  "child_ms": stat([s.child_ms for _, _, s, _ in rows if s.child_ms is not None]),
                  "child_ran": sum(s.child_ms is not None and s.child_ms > 0.5 for _, _, s, _ in rows)}
           for side, rows in groups.items()}
    for side in ("window_after_a_turn", "window_after_none"):
        out[side]["ratio"] = stat([r for r, _, _, _ in groups[side]])
    out["late_stops"] = len(swap.late_stops)
    out["slow_steps"] = [{"key": s.key, "ratio": r, "seconds": s.seconds, "cpu_ms": s.cpu_ms, "key_median_cpu_ms": med[s.key][1], "wait_ms": s.wait_ms,
                          "steal_ticks": s.steal_ticks, "minor_faults": s.minor_faults, "threads_ran": s.threads_ran, "most_waiting": s.most_waiting,
                          "late_stop_before": letters, "child_ms": s.child_ms} for r, _, s, letters in sorted(groups["window_slow"], key=lambda row: -row[0])]
    return out


def slowest_outside(steps: list[StepRecord], swap: refit.Swap | None) -> dict | None:
    """The noise without a compile: the slowest step outside the compile window (all of them without a swap) against
    its own key's median there, over keys with at least 5 such steps; None if none has."""
    by_key: dict[str, list[StepRecord]] = {}
    for s in steps:
        if swap is None or not in_window(s, swap):
            by_key.setdefault(s.key, []).append(s)
    ratios = [(s.seconds / float(np.median([t.seconds for t in mine])), s) for mine in by_key.values() if len(mine) >= 5 for s in mine]
    if not ratios:
        return None
    ratio, step = max(ratios, key=lambda pair: pair[0])
    return {"max_ratio": ratio, "key": step.key, "seconds": step.seconds, "num_over_2x": sum(r > 2.0 for r, _ in ratios), "num_steps": len(ratios)}


def fitted_table(llm, cfg, prompts, count: int, top: int) -> tuple[int, ...]:
    """A chunk table of `count` buckets, the largest `top`, fitted to the packed-row sizes of a dry run of these prompts
    on a fine table (refit.refit_chunk_table, as the refit fits)."""
    fine, _ = runloop.dry_run(refit.with_chunk_table(cfg, tuple(range(16, top, 16)) + (top,)), [p.token_ids for p in prompts], [p.params.max_tokens for p in prompts], llm.engine.num_pages)
    sizes = [sum(p.num_new_tokens) for p in fine if p.phase == "prefill"]
    return refit.refit_chunk_table(np.array(sizes), tuple(range(16, 16 * count, 16)) + (top,))


def dry_padding(llm, cfg, table, prompts) -> float:
    """Prefill padding of a dry run (runloop.dry_run, host only) of these prompts on `cfg` with this chunk table."""
    plans, _ = runloop.dry_run(refit.with_chunk_table(cfg, table), [p.token_ids for p in prompts], [p.params.max_tokens for p in prompts], llm.engine.num_pages)
    prefill = [p for p in plans if p.phase == "prefill"]
    return 1.0 - sum(sum(p.num_new_tokens) for p in prefill) / sum(p.bucket.num_rows * p.bucket.num_tokens for p in prefill)


def dry_refit(cfg, prompts, half: int, watch: refit.DriftWatch, delay: int, num_pages: int) -> dict:
    """The job's schedule alone (runloop.run with a step that returns token 0, as runloop.dry_run) on `cfg`, `watch`
    judging every step as Refit's does, each proposal swapped into the scheduler after `delay` more prefill steps
    (Refit's swap, without the compile); the prefill padding of the steps that hold a second-half prompt, and the
    steps at which it asked and swapped."""
    scheduler = Scheduler(cfg, num_pages)
    for i, p in enumerate(prompts):
        scheduler.add(Request(str(i), list(p.token_ids), dataclasses.replace(p.params, temperature=0.0, ignore_eos=True), seed=i, arrival_index=i))
    state = {"step": 0, "real": 0, "slots": 0, "rows": 0, "pending": None, "wait": 0, "asked_at": [], "swapped_at": [], "rows_at_ask": [], "rows_at_swap": [],
             "real_after_swap": 0, "slots_after_swap": 0}

    def on_step(plan, tokens, seconds):
        state["step"] += 1
        if plan.phase == "prefill" and any(int(r) >= half for r in plan.request_ids):
            state["real"] += sum(plan.num_new_tokens)
            state["slots"] += plan.bucket.num_rows * plan.bucket.num_tokens
            state["rows"] += sum(int(r) >= half for r in plan.request_ids)
            if state["swapped_at"]:
                state["real_after_swap"] += sum(plan.num_new_tokens)
                state["slots_after_swap"] += plan.bucket.num_rows * plan.bucket.num_tokens
        if state["pending"] is None and (table := watch.observe(plan)) is not None:
            state["pending"], state["wait"] = table, delay
            state["asked_at"].append(state["step"])
            state["rows_at_ask"].append(state["rows"])
        elif state["pending"] is not None and plan.phase == "prefill":
            state["wait"] -= 1
            if state["wait"] < 0:
                swap(state.pop("pending"))

    def swap(table):
        scheduler.use_config(refit.with_chunk_table(scheduler.cfg, table))
        watch.reset(table)
        state["pending"] = None
        state["swapped_at"].append(state["step"])
        state["rows_at_swap"].append(state["rows"])

    fake_step = lambda plan: np.zeros(plan.seeds.shape[0], np.int32)  # noqa: E731
    finished = list(runloop.run(scheduler, fake_step, OutputProcessor(None, None, cfg.max_context), on_step=on_step))
    complete = len(finished) == len(prompts) and all(r.finish_reason == "length" and len(r.output_ids) == r.params.max_tokens for r in finished)
    return {"padding_after_shift": 1.0 - state["real"] / max(1, state["slots"]), "asked_at_step": state["asked_at"], "swapped_at_step": state["swapped_at"],
            "second_half_rows_at_ask": state["rows_at_ask"], "second_half_rows_at_swap": state["rows_at_swap"],
            "padding_after_swap": 1.0 - state["real_after_swap"] / state["slots_after_swap"] if state["slots_after_swap"] else None, "new_table": list(watch.table), "num_steps": state["step"], "complete": complete}


def dry_main(args, llm, plan, prompts, start_table, alone_table) -> None:
    """--dry-run: the schedule alone, with the watch (swapped --dry-delay prefill steps after it asks) and without."""
    alone = dry_padding(llm, plan.config, alone_table, prompts[args.lines :])
    with_watch = dry_refit(plan.config, prompts, args.lines, refit.DriftWatch(start_table), args.dry_delay, llm.engine.num_pages)
    stale = dry_refit(plan.config, prompts, args.lines, refit.DriftWatch(start_table, window=10**9), 0, llm.engine.num_pages)
    result = {"lines_per_half": args.lines, "dry_delay_prefill_steps": args.dry_delay, "start_chunk_table": list(start_table), "second_half_table": list(alone_table),
              "padding_second_half_alone": alone, "refit": with_watch, "no_refit": stale, "padding_gap": with_watch["padding_after_shift"] - alone}
    rows = [["watch, swap after the delay", with_watch["padding_after_shift"], str(with_watch["asked_at_step"]), str(with_watch["swapped_at_step"])],
            ["no refit", stale["padding_after_shift"], "", ""], ["second half alone", alone, "", ""]]
    print(report.format_table([("dry run, prefill padding after the shift", "<42"), ("share", "7.1%"), ("asked at", "<12"), ("swapped at", "<12")], rows))
    goals = report.judge({"padding_gap": GOALS["padding_gap"]}, {"padding_gap": result["padding_gap"]})
    report.print_goals(goals)
    doc = {"question": __doc__.split("\n\n")[0].replace("\n", " "), "settings": {k: str(v) for k, v in vars(args).items()}, "result": result, "goals": goals}
    report.finish(args.out, doc, {"bench": "refit_dry_run", "padding_gap": result["padding_gap"]}, correct=with_watch["complete"] and stale["complete"])


def main() -> None:
    parser = report.arg_parser(__doc__, out=RESULTS)
    parser.add_argument("--quick", action="store_true", help="72 lines a half: a smoke test of the plumbing (a dry run of this trace asks for a refit "
                                                             "41 second-half rows after the shift at 72 lines a half, 20 at 160; 8e3587f); "
                                                             "with --ask-at 10 it measures a compile window and a swap whatever the watch judges")
    parser.add_argument("--lines", type=int, default=None, help="lines per half")
    parser.add_argument("--seed", type=int, default=0, help="the job file's random draw: prompt lengths and where each is cut from the text (default 0)")
    parser.add_argument("--table", choices=("reach", "plan"), default="reach",
                        help="the job's starting chunk table: the first half's fit reaching the chunk limit (as tests/batch/test_refit.py), or the plan's own")
    parser.add_argument("--ask-at", type=int, default=None, metavar="STEPS",
                        help="ask for the refit (the second-half table) this many steps after the first second-half prefill, instead of the drift "
                             "watch's judgement: measures the compile window and the swap under --quick, whose watch never asks")
    parser.add_argument("--yield-share", type=float, default=refit.YIELD_SHARE,
                        help=f"Refit's pause for the compile child after each step while it runs, as a share of the step's seconds (default {refit.YIELD_SHARE}; 0: none)")
    parser.add_argument("--yield-every", type=int, default=refit.YIELD_EVERY,
                        help=f"Refit gives the compile its turn after every this many steps (default {refit.YIELD_EVERY}; 1: after each)")
    parser.add_argument("--dry-run", action="store_true", help="the job's schedule alone (host only, seconds): the watch's padding gap, no program compiled")
    parser.add_argument("--dry-delay", type=int, default=12, metavar="PREFILL_STEPS", help="--dry-run: prefill steps between the watch's ask and the swap (default 12)")
    parser.add_argument("--sched-stats", action="store_true",
                        help="read each step's CPU and run-queue-wait time of the job's threads, its page faults and the machine's steal time (/proc) before and after it: "
                             "where a slow step in the compile window lost its time (about 1 ms of reads per step, outside its timing)")
    args = parser.parse_args()
    args.lines = args.lines or (72 if args.quick else 160)
    if args.quick:
        args.out = args.out.with_name("bench_refit_quick.json")
    if args.dry_run and args.out == RESULTS:
        args.out = args.out.with_name(f"bench_refit_dry_run_{args.lines}{f'_seed_{args.seed}' if args.seed else ''}.json")
    # a fresh XLA cache: the refit's programs must really compile (the default persistent cache would hold them after one run)
    cache = tempfile.TemporaryDirectory(prefix="bench_refit_xla_")
    llm = LLM(max_num_seqs=MAX_NUM_SEQS, max_prefill_tokens=MAX_PREFILL_TOKENS, compilation_cache_dir=cache.name, warmup=False)
    defaults = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    lines = job_lines(llm.tokenizer, args.lines, np.random.default_rng(args.seed))
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    input_path = WORK_DIR / "lines.jsonl"
    input_path.write_text("".join(json.dumps({"id": i, "prompt": line, "max_tokens": max_tokens_of(i)}) + "\n" for i, line in enumerate(lines)))
    prompts = [llm.prepare(line, dataclasses.replace(defaults, max_tokens=max_tokens_of(i)), index=i) for i, line in enumerate(lines)]
    report.log("bench_refit", f"{len(lines)} lines: prompt tokens median {np.median([len(p.token_ids) for p in prompts[: args.lines]]):.0f} then "
                              f"{np.median([len(p.token_ids) for p in prompts[args.lines :]]):.0f}")
    plan = plan_first_half(llm, prompts[: args.lines])
    print(plan.summary())
    plan_table, top = BucketTables.from_config(plan.config).chunk_tokens, BucketTables.from_config(llm.engine_config).chunk_tokens[-1]
    if args.table == "reach":  # the refit test's start: the first half's fit, its top the whole chunk limit (the plan's stops at its sizes)
        config = refit.with_chunk_table(plan.config, fitted_table(llm, plan.config, prompts[: args.lines], len(plan_table), top))
        plan = dataclasses.replace(plan, config=config)
    start_table = BucketTables.from_config(plan.config).chunk_tokens
    report.log("bench_refit", f"the job starts on chunk table {start_table} (the plan's: {plan_table})")
    alone_table = fitted_table(llm, plan.config, prompts[args.lines :], len(start_table), start_table[-1])
    if args.dry_run:
        return dry_main(args, llm, plan, prompts, start_table, alone_table)
    options = {"yield_share": args.yield_share, "yield_every": args.yield_every}
    if args.ask_at is not None:
        options["watch"] = AskAt(start_table, half=args.lines, after=args.ask_at, proposal=alone_table)
    planning.apply_plan(llm, plan)
    llm.engine.warmup()
    report.log("bench_refit", "run without refit (also the process's one-time costs)")
    stale_steps, _, stale_wall, _ = run_job(llm, input_path, WORK_DIR / "no_refit.jsonl", defaults, args.lines, refitting=False)
    report.log("bench_refit", "run with refit")
    steps, swaps, wall, unfinished = run_job(llm, input_path, WORK_DIR / "refit.jsonl", defaults, args.lines, refitting=True, options=options,
                                             sched_stats=args.sched_stats)
    records, stale_records = read_records(WORK_DIR / "refit.jsonl"), read_records(WORK_DIR / "no_refit.jsonl")
    complete = check_outputs(records, len(lines)) and check_outputs(stale_records, len(lines))
    agree = float(np.mean([records[n].get("token_ids") == stale_records[n].get("token_ids") for n in records if n in stale_records])) if records else 0.0
    alone = dry_padding(llm, plan.config, alone_table, prompts[args.lines :])
    result = summarize(steps, swaps, stale_steps, alone, alone_table, wall, stale_wall)
    result |= {"unfinished_refit": unfinished, "plan_chunk_table": list(plan_table), "start_chunk_table": list(start_table), "outputs_complete": complete, "outputs_agree": agree}
    print_result(result)
    goals = report.judge(GOALS, {"padding_gap": result["padding_gap"], "max_ratio_in_window": result["max_ratio_in_window"], "outputs_agree": agree})
    report.print_goals(goals)
    doc = {"question": __doc__.split("\n\n")[0].replace("\n", " "), "settings": {k: str(v) for k, v in vars(args).items()}, "result": result, "goals": goals}
    cache.cleanup()
    report.finish(args.out, doc, {"bench": "refit", "goals": {k: g["measured"] for k, g in goals.items()}}, correct=complete)


def summarize(steps, swaps, stale_steps, alone, alone_table, wall, stale_wall) -> dict:
    out = {"wall_s": round(wall, 2), "no_refit_wall_s": round(stale_wall, 2), "wall_cost_s": round(wall - stale_wall, 2), "num_steps": len(steps), "second_half_table": list(alone_table),
           "padding_after_shift": padding_of(steps), "padding_after_shift_no_refit": padding_of(stale_steps), "padding_second_half_alone": alone,
           "swaps": [dataclasses.asdict(s) for s in swaps], "padding_after_swap": None, "window": None, "max_ratio_in_window": None,
           "window_s": None, "compile_window_s": None, "yield_share_of_window": None, "window_by_key": None}
    out["padding_gap"] = None if out["padding_after_shift"] is None else out["padding_after_shift"] - alone
    out["slowest_outside_window"] = slowest_outside(steps, swaps[0] if swaps else None)
    out["slowest_no_refit"] = slowest_outside(stale_steps, None)
    if swaps:
        swap = swaps[0]
        out["padding_after_swap"] = padding_of(steps, swap.swapped_at)
        out["window"] = window_stats(steps, swap, stale_steps)
        ratios = [w["max_ratio_to_own_key"] for w in out["window"].values() if w["max_ratio_to_own_key"] is not None]
        out["max_ratio_in_window"] = max(ratios, default=None)
        out["window_by_key"] = window_by_key(steps, swap)
        out["window_after_load"] = after_load(steps, swap)
        out["window_sched"] = sched_split(steps, swap)
        first = steps[0].ended - steps[0].seconds
        out["window_s"] = {"compile_started": swap.compile_started - first, "compile_ended": swap.compile_ended - first, "swapped_at": swap.swapped_at - first,
                           "job_ended": steps[-1].ended - first}
        out["compile_window_s"] = swap.compile_ended - swap.compile_started
        out["yield_share_of_window"] = swap.yield_s / out["compile_window_s"]
        # each interim table (the new buckets loaded so far, used before the whole table is compiled): seconds after the compile began
        out["interim"] = [{"at_step": step, "after_s": at - swap.compile_started, "table": list(table)} for step, at, table in swap.interim]
        out["padding_in_window"] = padding_of([s for s in steps if s.ended <= swap.swapped_at], swap.compile_started)
    return out


def print_result(result: dict) -> None:
    print(f"\nplan's chunk table {tuple(result['plan_chunk_table'])}; the job's start {tuple(result['start_chunk_table'])}; "
          f"second half alone {tuple(result['second_half_table'])}")
    for s in result["swaps"]:
        print(f"swap: {tuple(s['old_table'])} -> {tuple(s['new_table'])} asked at step {s['asked_at_step']}, swapped at {s['swapped_at_step']}; "
              f"{s['num_programs']} programs in {s['compile_s']:.1f} s ({'in a child process' if s['in_child'] else 'in a thread'}: {s['child_cpu_s']:.1f} s CPU, "
              f"peak RSS {s['child_peak_rss'] / 2**20:.0f} MiB; the steps gave it {s['yield_s']:.1f} s after {s['num_yields']} steps, {s['yield_share']} of each)")
    pad = [["refit run, after the shift", result["padding_after_shift"]], ["refit run, after the swap", result["padding_after_swap"]],
           ["no refit, after the shift", result["padding_after_shift_no_refit"]], ["second half alone (dry run)", result["padding_second_half_alone"]]]
    print("\n" + report.format_table([("prefill padding", "<30"), ("share", "7.1%")], pad))
    if result["window"]:
        columns = [("phase", "<8"), ("median out s", "13.3f"), ("steps in", "9d"), ("max in s", "9.3f"), ("p99 in s", "9.3f"), ("max / own key", "14.2f"),
                   ("p50 / own key", "14.2f"), ("over 2x", "8d"), ("max with sleep", "15.2f")]
        rows = [[p, w["median_outside_s"], w["num_inside"], w["max_inside_s"], w["p99_inside_s"], w["max_ratio_to_own_key"], w["p50_ratio_to_own_key"],
                 w["num_over_2x"], w["max_ratio_with_yield"]] for p, w in result["window"].items()]
        print("\n" + report.format_table(columns, rows))
        keys = [[k, w["num_inside"], w["median_outside_s"], w["max_ratio"], w["num_over_2x"], w["num_outside"], w["num_outside_over_2x"]] for k, w in result["window_by_key"].items()]
        print("\n" + report.format_table([("program key (in window)", "<60"), ("steps in", "9d"), ("median out s", "13.3f"), ("max / median", "13.2f"), ("over 2x", "8d"),
                                           ("steps out", "10d"), ("out over 2x", "12d")], keys))
    print(f"outputs complete: {result['outputs_complete']}; agree with the run without refit: {result['outputs_agree']:.1%}; wall {result['wall_s']} s (no refit {result['no_refit_wall_s']} s)")
    for name, slow in (("outside the window", result["slowest_outside_window"]), ("in the run without refit", result["slowest_no_refit"])):
        if slow:
            print(f"slowest step {name}: {slow['max_ratio']:.2f}x its key's median ({slow['key']}, {slow['seconds']:.3f} s); "
                  f"{slow['num_over_2x']} of {slow['num_steps']} steps over 2x")
    if result["window_s"]:
        print(f"compile window {result['compile_window_s']:.1f} s ({result['yield_share_of_window']:.0%} of it the steps' sleep), from {result['window_s']['compile_started']:.1f} s "
              f"to {result['window_s']['compile_ended']:.1f} s; swap at {result['window_s']['swapped_at']:.1f} s; the job's last step ended at {result['window_s']['job_ended']:.1f} s")
        for i in result["interim"]:
            print(f"interim table {tuple(i['table'])} from step {i['at_step']}, {i['after_s']:.1f} s after the compile began")
        for side, w in result["window_after_load"].items():
            print(f"window steps {side.replace('_', ' ')}: {w['num_steps']}, median {w['p50_ratio'] or 0:.2f}x and max {w['max_ratio'] or 0:.2f}x their key's median outside, "
                  f"{w['num_over_1_5x']} over 1.5x, {w['num_over_2x']} over 2x")
    sched = result.get("window_sched")
    if sched:
        fmt = lambda figure: "-" if figure is None else f"{figure['p50']:.2f} / {figure['max']:.2f}"  # noqa: E731
        rows = [[side.replace("_", " "), g["num_steps"], fmt(g["cpu_ms"]), fmt(g["cpu_to_key_median"]), fmt(g["wait_ms"]), fmt(g["steal_ticks"]), fmt(g["minor_faults"])]
                for side, g in sched.items() if side not in ("slow_steps", "late_stops")]
        print("\n" + report.format_table([("steps (p50 / max)", "<14"), ("steps", "6d"), ("CPU ms", ">14"), ("CPU / key's", ">14"), ("run-queue wait ms", ">18"),
                                           ("steal ticks", ">12"), ("minor faults", ">16")], rows))
        for s in sched["slow_steps"]:
            print(f"slow window step {s['ratio']:.2f}x ({s['key']}, {s['seconds'] * 1e3:.1f} ms): CPU {s['cpu_ms']:.1f} ms (key's median {s['key_median_cpu_ms']:.1f}), "
                  f"wait {s['wait_ms']:.2f} ms (longest: {s['most_waiting']} ms), steal {s['steal_ticks']} ticks, {s['minor_faults']} minor faults, "
                  f"{s['threads_ran']} threads ran, the child ran {s['child_ms'] if s['child_ms'] is not None else '-'} ms" + (f"; the stop before it timed out with the child's threads {s['late_stop_before']} running" if s["late_stop_before"] else ""))
        print(f"the child's stops that timed out (after {compile_worker._STOP_WAIT_S * 1e3:.0f} ms): {sched['late_stops']}; window steps after one: "
              f"{sched['window_slow']['after_a_late_stop']} slow, {sched['window_other']['after_a_late_stop']} others; the child ran over 0.5 ms during "
              f"{sched['window_slow']['child_ran']} slow and {sched['window_other']['child_ran']} other window steps")
        for side in ("window_after_a_turn", "window_after_none"):
            g = sched[side]
            print(f"{side.replace('_', ' ')} of the compile: {g['num_steps']} steps, {fmt(g['ratio'])} their key's median outside, CPU {fmt(g['cpu_to_key_median'])} its median")


if __name__ == "__main__":
    main()
