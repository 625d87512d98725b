"""Online bucket refit: a planned job (`--plan`) watches its prefill sizes, and when they drift from what the
chunk table was fitted to, compiles a refitted table's programs in a background thread and swaps them in
between two steps.

`DriftWatch` (host only, numpy) keeps the token counts of the last `window` prefill rows. Every `every`
prefill steps it fits a table to the older half of the window (`fit_table`, the exact fit, with the same number
of buckets, the current largest bucket kept, so the chunk limit and with it the schedule's chunking stay as
they were) and pads the newer half's rows under it and under the current table: out of sample, so a window
is not judged on its own fit. Drift needs evidence: the slots saved per row, paired row by row, must exceed
`threshold` of the current table's slots by `z` standard errors (`significant_saving`); then the table
fitted to the newer half (the rows the evidence is about) is proposed. The judge it replaces (a padding gap
over 8 points on 16 rows, no error margin) refitted 1 to 4 times in 2,000 prefill steps of sizes from the
very distribution its table was fitted to; this one, on 10 seeds of four such distributions, never did.
`Refit` is the job's on_step hook: on drift it asks each engine for the programs the new table needs
(`Engine.compile_programs`, in a thread at the lowest CPU priority, against shapes taken on the stepping
thread; XLA hands most of a compile to its own pools' threads, made at warm-up at the usual priority, so the
threads that spent no CPU while the job stepped get the lowest too until the swap, and the GIL switch interval is
shortened, so the stepping thread waits less for the GIL the compile thread's lowering holds). So that the compile
still progresses, after each step the stepping thread sleeps YIELD_SHARE of that step's seconds with the compile's
threads at their own priority and its Python let through a gate (sys.settrace in its thread), then lowers them
again and shuts the gate before the next step. Once they are compiled it swaps, at one step boundary, the
engine's config (which adds the programs and drops none) and then the running schedulers' tables and the LLM's
config, so a plan made on the old tables still finds its program and every later plan is made on the new ones.

These are compiles after warm-up, on purpose: `Engine.refit_compilations` counts them (also in
num_compilations), each is logged as a refit compile, and `Refit.swaps` records each swap. A refit changes
which padded program a step runs, never a token's inputs; deterministic mode fixes its tables, so it never
refits.
Only one replica (data_parallel 1) is refitted. Host code only (numpy); never imports jaxinfer.bucketing.
"""

import concurrent.futures
import dataclasses
import logging
import os
import sys
import threading
import time
from collections import deque

import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.scheduling.bucket_tables import BucketTables, cut_table

log = logging.getLogger(__name__)

_CHUNK_MULTIPLE = 16  # every refitted chunk bucket is a multiple of this (planning.py's fine table step)
_CPU_EVERY = 16  # steps between two snapshots of the threads' CPU time (which threads the steps use; the oldest of 4 is used)
_SWITCH_S = 0.0005  # the GIL switch interval while a refit compiles (CPython's default: 0.005)
# While a refit compiles, the stepping thread sleeps this share of each step's seconds after it (1.0: half the
# window's wall time is the compile's; the steps themselves run as before, a step and its sleep take 2x the step),
# with the compile's threads at their own priority and its Python through the gate meanwhile, and at the lowest
# (nice 19, SCHED_IDLE) while the steps run. Without it they got only what the steps left idle: on 2 cores
# bench_refit's compile (12 programs) never finished before the job ended (b982cae). The job pays about the
# compile's CPU seconds / cores whatever the share; a larger one ends the window sooner. Measured on 2 cores loaded
# by other sessions (indicative): a probe stepping a warm default-model LLM while 8 programs compile took 37.5 s and
# 47.4 s at 0.5, 117 s at 0 (load 8-10); bench_refit --quick --ask-at 10 (12 programs): at 0.5 the compile had not
# finished 455 steps later, when the job ended (load 9-10); at 1.0 it finished in 118 s and swapped 37 s before the
# end, the padding after the swap 7.0% against 6.8% for a second-half table (load 13-15).
YIELD_SHARE = 1.0
_GATE_HOLD_S = 1.0  # the longest the compile's Python waits for the steps' next pause (at least 4 steps' seconds)


def padded_slots(sizes: np.ndarray, table: tuple[int, ...]) -> np.ndarray:
    """i64[N]: the token slots each row of these sizes takes on `table` (a size over its top is chunked at it)."""
    sizes = np.asarray(sizes, np.int64)
    top = table[-1]
    full, rest = np.divmod(sizes, top)
    index = np.searchsorted(np.array(table), rest)
    return full * top + np.where(rest > 0, np.array(table + (top,))[index], 0)


def padding(sizes: np.ndarray, table: tuple[int, ...]) -> float:
    """1 - real / padded token slots of rows of these sizes on `table` (sizes over its top are chunked at it)."""
    return float(1.0 - np.asarray(sizes, np.int64).sum() / max(1, padded_slots(sizes, table).sum()))


def significant_saving(sizes: np.ndarray, table: tuple[int, ...], trial: tuple[int, ...], threshold: float, z: float) -> bool:
    """Whether `trial` pads rows like these by more than `threshold` of the slots `table` pads them to, with
    evidence: the saving per row (slots on `table` - slots on `trial`, paired row by row) must stay over
    the threshold at `z` standard errors below its mean."""
    current, saved = padded_slots(sizes, table), padded_slots(sizes, table) - padded_slots(sizes, trial)
    if saved.size < 2:
        return False
    error = saved.std(ddof=1) / np.sqrt(saved.size)
    return bool(saved.mean() - z * error > threshold * current.mean())


def fit_table(sizes, count: int, *, multiple_of: int = 1) -> tuple[int, ...]:
    """The table of at most `count` buckets (multiples of `multiple_of`, the largest the largest size) that pads
    `sizes` to the fewest token slots: an exact dynamic programme over the distinct sizes, O(count x M^2) in
    numpy, for the few dozen distinct sizes a job's steps have. The runtime never imports jaxinfer.bucketing
    (a test checks it), whose fit_buckets solves the same problem in O(count x M log M) for traces; a test
    checks that the two agree."""
    values, counts = np.unique(-(-np.asarray(sizes, np.int64) // multiple_of) * multiple_of, return_counts=True)
    if values.size <= count:
        return tuple(int(v) for v in values)
    weight = np.concatenate([[0.0], np.cumsum(counts, dtype=np.float64)])  # W[j]: sizes at or below values[j - 1]
    group = (weight[None, 1:] - weight[:-1, None]) * values[None, :]  # group[a, b]: values a .. b padded to values[b]
    group[np.tril_indices(values.size, -1)] = np.inf  # a > b is no group
    best, choices = group[0].copy(), []  # best[b]: values 0 .. b in the buckets so far, the last ending at b
    for _ in range(count - 1):
        totals = np.concatenate([[np.inf], best[:-1]])[:, None] + group  # the buckets before end at a - 1
        choices.append(np.argmin(totals, axis=0))  # the leftmost minimum, as fit_buckets
        best = totals[choices[-1], np.arange(values.size)]
    table, end = [], values.size - 1
    for choice in reversed(choices):
        table.append(int(values[end]))
        end = int(choice[end]) - 1
    return tuple(reversed(table + [int(values[end])]))


def refit_chunk_table(sizes: np.ndarray, table: tuple[int, ...], count: int | None = None) -> tuple[int, ...]:
    """A chunk table of `count` buckets (None: as many as `table`) fitted to `sizes`, `table`'s largest bucket kept."""
    top = table[-1]
    sizes = np.minimum(np.asarray(sizes, np.int64), top)
    below = sizes[-(-sizes // _CHUNK_MULTIPLE) * _CHUNK_MULTIPLE < top]  # a size that rounds up to the top is the top's
    count = len(table) if count is None else count
    if count == 1 or below.size == 0:
        return table
    fitted = fit_table(below, count - 1, multiple_of=_CHUNK_MULTIPLE)
    return cut_table(fitted, top, reach=True)


@dataclasses.dataclass
class DriftWatch:
    """The token counts per row of recent prefill steps, and whether they have drifted from the chunk table."""

    table: tuple[int, ...]
    window: int = 64  # rows of prefill steps judged (a packed step's rows count one each)
    every: int = 4  # prefill steps between two judgements
    strikes_needed: int = 1  # judgements in a row that must see drift
    threshold: float = 0.08  # share of the current table's slots a refitted table must save to count as drift
    z: float = 3.0  # standard errors of the per-row saving that must lie above the threshold

    def __post_init__(self):
        self.sizes: deque[int] = deque(maxlen=self.window)
        self.seen = 0
        self.count = len(self.table)  # buckets of every refitted table: the plan's, whatever a fit returns
        self.strikes = 0  # judgements in a row that saw drift; `strikes_needed` of them refit (noise rarely repeats)

    def observe(self, plan) -> tuple[int, ...] | None:
        """A step's plan; the refitted chunk table when the window shows drift, else None."""
        if plan.phase != "prefill":
            return None
        self.sizes.extend([sum(plan.num_new_tokens)] if plan.bucket.num_rows == 1 else plan.num_new_tokens)
        self.seen += 1
        if self.seen % self.every or len(self.sizes) < self.window:  # after a swap, a whole window of the new table's steps
            return None
        sizes = np.array(self.sizes)
        older, newer = sizes[: sizes.size // 2], sizes[sizes.size // 2 :]
        trial = refit_chunk_table(older, self.table, self.count)  # judged out of sample: a table fitted to a window always wins on it
        drifted = significant_saving(newer, self.table, trial, self.threshold, self.z)
        self.strikes = self.strikes + 1 if drifted else 0
        return refit_chunk_table(newer, self.table, self.count) if self.strikes >= self.strikes_needed else None

    def reset(self, table: tuple[int, ...]) -> None:
        self.table, self.seen, self.strikes = table, 0, 0
        self.sizes.clear()


@dataclasses.dataclass(frozen=True)
class Swap:
    """One refit: the tables, when it was asked for and swapped in (steps), and its compiles."""

    old_table: tuple[int, ...]
    new_table: tuple[int, ...]
    asked_at_step: int
    swapped_at_step: int
    num_programs: int
    compile_s: float
    compile_started: float = 0.0  # perf_counter when the background compile began (the window a step may slow in)
    compile_ended: float = 0.0  # perf_counter when it ended
    swapped_at: float = 0.0  # perf_counter at the swap (the first step boundary after compile_ended)
    compile_nice: int | None = None  # the compile thread's nice value (19 asked; None: it could not be read)
    quieted_threads: int = 0  # threads set to nice 19 for the compile: those idle while the job stepped (XLA's compile pools) and the compile thread
    yield_share: float = 0.0  # the stepping thread slept this share of each step's seconds while the compile ran
    yield_s: float = 0.0  # seconds it slept so, in all (the job's wall time given to the compile)
    num_yields: int = 0  # steps after which it slept
    yield_raised: bool = False  # the compile's threads ran at their own priority during those sleeps (False: the lowest throughout)


def with_chunk_table(cfg: EngineConfig, table: tuple[int, ...]) -> EngineConfig:
    """`cfg` with this chunk table and its other two tables as they are now (given explicitly)."""
    tables = BucketTables.from_config(cfg)
    return dataclasses.replace(cfg, buckets=None, prefill_chunk_buckets=table, decode_batch_buckets=tables.decode_rows, decode_page_buckets=tables.pages)


def thread_cpu() -> dict[int, float]:
    """{native thread id: CPU seconds} of this process's threads (Linux /proc; {} elsewhere)."""
    out, tick = {}, os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread has exited
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def quiet_idle_threads(before: dict[int, float], after: dict[int, float], keep: set[int], *, idle: bool = True) -> dict[int, int]:
    """Sets nice 19 (and SCHED_IDLE, unless not `idle`) on every thread of this process that spent no CPU between two thread_cpu() snapshots taken while
    the job stepped (and is not in `keep`): XLA compiles on its own pools' threads (nice 0, made at warm-up), not only
    on the thread that asks, so a nice-19 compile thread alone leaves most of the compile at the steps' priority. The
    threads the steps use (the stepping thread, XLA's intra-op pool) spent CPU, so they keep theirs. Returns {thread
    id: the nice value it had} for restore_threads."""
    quieted = {}
    for tid in after:
        if tid in keep or after[tid] > before.get(tid, after[tid]):
            continue
        try:
            old = os.getpriority(os.PRIO_PROCESS, tid)
            if old < 19:
                os.setpriority(os.PRIO_PROCESS, tid, 19)
                quieted[tid] = old
                if idle:
                    _set_idle_policy(tid, True)
        except OSError:  # exited, or not allowed
            continue
    return quieted


def _set_idle_policy(tid: int, idle: bool) -> None:
    """SCHED_IDLE for a thread (0: the calling one), or back to SCHED_OTHER, where Linux has it: a waking thread of
    the usual policy preempts a SCHED_IDLE one at once, where a nice-19 one may run on to the end of its slice (a
    quiet probe: in-window decode steps 1.2x their median, against 1.7x at nice 19 alone). OSError: not allowed."""
    if hasattr(os, "SCHED_IDLE") and hasattr(os, "sched_setscheduler"):
        os.sched_setscheduler(tid, os.SCHED_IDLE if idle else os.SCHED_OTHER, os.sched_param(0))


def _raise_threads(quieted: dict[int, int]) -> int:
    """SCHED_OTHER and their own nice value back for these threads; returns how many could not be (EPERM)."""
    failed = 0
    for tid, nice in list(quieted.items()):  # a copy: the compile thread adds itself to Refit's dict as it starts
        try:
            _set_idle_policy(tid, False)
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            continue
        except OSError:
            failed += 1
    return failed


def _lower_threads(tids, idle: bool) -> None:
    """nice 19 (and SCHED_IDLE if `idle`) for these threads again (ones that exited are skipped)."""
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 19)
            if idle:
                _set_idle_policy(tid, True)
        except OSError:
            continue


def _new_idle_threads(known: dict[int, int], nice: int) -> dict[int, int]:
    """{thread id: `nice`} for this process's SCHED_IDLE threads not in `known`: threads the compile made (they inherit
    its lowest priority; XLA and LLVM start some lazily), to be raised with the others while the steps sleep."""
    if not hasattr(os, "SCHED_IDLE"):
        return {}
    found = {}
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        try:
            if tid not in known and os.sched_getscheduler(tid) == os.SCHED_IDLE:
                found[tid] = nice
        except OSError:  # exited
            continue
    return found


def restore_threads(quieted: dict[int, int]) -> int:
    """Gives the threads quiet_idle_threads lowered their policy and nice values back; returns how many could not be (raising a
    priority needs CAP_SYS_NICE: those stay at 19, compile-only threads, so only later compiles are slower)."""
    failed = _raise_threads(quieted)
    if failed:
        log.info("refit: %d compile threads keep nice 19 (raising a priority needs CAP_SYS_NICE)", failed)
    return failed


class _Gate:
    """Holds the compile thread's Python back while the job steps: the GIL has no priorities, so a compile thread that
    lowers (Python) takes it from the stepping thread at every switch interval, whatever its nice value. The compile
    thread runs `trace` (sys.settrace, its own thread only), which waits at each Python call while the gate is shut,
    at most until the deadline `shut` set (a job that ends with the gate shut lets the compile on by itself)."""

    def __init__(self):
        self._open = threading.Event()
        self._open.set()
        self._deadline = 0.0

    def shut(self, hold_s: float) -> None:
        self._deadline = time.perf_counter() + hold_s
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def trace(self, frame, event, arg):
        if not self._open.is_set() and (left := self._deadline - time.perf_counter()) > 0:
            self._open.wait(left)  # releases the GIL
        return None  # no line events


def _compile_quietly(engine, cfg: EngineConfig, state: tuple, idle: bool = True, gate: _Gate | None = None,
                     threads: dict[int, int] | None = None) -> tuple[dict, float, float, int | None]:
    """The engine's compiles for `cfg` at the lowest CPU priority of this thread (Linux: a thread's nice value and
    policy are its own; nice 19 and, if `idle`, SCHED_IDLE), its Python behind `gate` if given; its id and nice value
    before are added to `threads` (the threads Refit raises while it yields). Returns (programs, start, end
    perf_counter, the nice value the thread ran at or None)."""
    nice, tid = None, threading.get_native_id()
    try:
        old = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, 19)
        nice = os.getpriority(os.PRIO_PROCESS, tid)
        if idle:
            _set_idle_policy(0, True)
        if threads is not None:
            threads[tid] = old
    except (AttributeError, OSError):  # not Linux, or not allowed: compile at the usual priority
        pass
    previous = sys.gettrace()
    if gate is not None:
        sys.settrace(gate.trace)
    try:
        start = time.perf_counter()
        programs = engine.compile_programs(cfg, state)
        return programs, start, time.perf_counter(), nice
    finally:
        sys.settrace(previous)


class Refit:
    """The on_step hook of a planned job: watches prefill sizes (DriftWatch), compiles a refitted chunk table's
    programs in the background and swaps them in between steps. `chain`: the hook it wraps (called first).
    `yield_share`: while the compile runs, the stepping thread sleeps this share of each step's seconds after the
    step, so that the compile's lowest-priority threads get the cores then (0: never). `idle`: the compile's threads
    run SCHED_IDLE as well as at nice 19 (False: nice 19 alone)."""

    def __init__(self, llm, *, chain=None, watch: DriftWatch | None = None, yield_share: float = YIELD_SHARE, idle: bool = True):
        self.llm, self.chain = llm, chain
        self.yield_share, self.idle = yield_share, idle
        self.enabled = not llm.engine_config.deterministic and len(llm.replicas) == 1
        self.watch = watch or DriftWatch(BucketTables.from_config(llm.engine_config).chunk_tokens)
        self.swaps: list[Swap] = []
        self.step = 0
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxinfer-refit")
        self._pending: tuple | None = None  # (future, new config, asked at step)
        self._cpu: deque[tuple[int, dict]] = deque(maxlen=4)  # (step, thread_cpu()) every _CPU_EVERY steps while none compiles
        self._quieted: dict[int, int] = {}  # thread id -> its nice value before the compile (quiet_idle_threads)
        self._switch: float | None = None  # the GIL switch interval before the compile
        self._yielded = [0.0, 0]  # seconds slept for the compile under way, and after how many steps
        self._raise = True  # whether the compile's threads may be given their own priority while the steps sleep
        self._gate = _Gate()

    def __call__(self, plan, tokens, seconds) -> None:
        if self.chain is not None:
            self.chain(plan, tokens, seconds)
        self.step += 1
        if not self.enabled:
            return
        if self._pending is not None:
            if self._pending[0].done():
                self._swap()
            elif self.yield_share > 0:
                self._yield(seconds)
            return
        if self.step % _CPU_EVERY == 1:
            self._cpu.append((self.step, thread_cpu()))
        table = self.watch.observe(plan)
        if table is not None:
            cfg = with_chunk_table(self.llm.engine_config, table)
            self._quiet_compile_pools()
            self._gate.shut(_GATE_HOLD_S)  # until the first sleep: the compile's Python waits for the steps' pauses
            future = self._executor.submit(_compile_quietly, self.llm.engine, cfg, self.llm.engine.abstract_state(), self.idle,
                                           self._gate if self.yield_share > 0 else None, self._quieted)
            self._pending = (future, cfg, self.step)
            log.info("refit: prefill sizes drifted; compiling chunk table %s in the background", table)

    def _quiet_compile_pools(self) -> None:
        """For the compile: nice 19 for the threads that spent no CPU since the oldest snapshot, up to 4 x _CPU_EVERY
        steps back (/proc counts CPU in 10 ms ticks: a pool thread the steps use little must have time to show; not
        the stepping thread), and a short GIL switch interval, so that the stepping thread waits _SWITCH_S, not the 5 ms
        default, for the GIL while the compile thread lowers (Python) at nice 19."""
        before = next((cpu for step, cpu in self._cpu if step <= self.step - _CPU_EVERY // 2), None)
        if before is not None:
            self._quieted = quiet_idle_threads(before, thread_cpu(), {threading.get_native_id()}, idle=self.idle)
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch, _SWITCH_S))

    def _yield(self, seconds: float) -> None:
        """Sleeps yield_share of the step's `seconds`, bounded by the step it follows, with the compile's threads at
        their own priority and its Python let through the gate meanwhile; then puts them back at the lowest (the next
        step preempts them at once) and shuts the gate. So the compile gets half the window's wall time at the default
        share on a machine of its own, and a fair share of it beside other processes."""
        start = time.perf_counter()
        if self._raise:
            self._quieted |= _new_idle_threads(self._quieted, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        if self._raise and _raise_threads(self._quieted):
            self._raise = False  # raising a priority needs CAP_SYS_NICE: the compile gets only the CPU left idle
            log.info("refit: the compile's threads keep nice 19 while the steps sleep (raising a priority needs CAP_SYS_NICE)")
        self._gate.open()
        time.sleep(self.yield_share * seconds)
        self._gate.shut(max(_GATE_HOLD_S, 4 * seconds))
        if self._raise:
            _lower_threads(list(self._quieted), self.idle)
        self._yielded[0] += time.perf_counter() - start
        self._yielded[1] += 1

    def _unquiet(self) -> int:
        """Undoes _quiet_compile_pools; returns how many threads it had quieted."""
        quieted = len(self._quieted)
        restore_threads(self._quieted)
        self._quieted = {}
        if self._switch is not None:
            sys.setswitchinterval(self._switch)
            self._switch = None
        return quieted

    def _swap(self) -> None:
        """Between two steps: the engine first (it gains the programs), then the schedulers and the LLM's config."""
        future, cfg, asked = self._pending
        self._pending = None
        programs, started, ended, nice = future.result()
        quieted = self._unquiet()
        self._cpu.clear()  # its steps ran beside the compile: the next refit's idle threads are judged on later ones
        old = BucketTables.from_config(self.llm.engine_config).chunk_tokens
        self.llm.engine.use_config(cfg, programs)
        tables = BucketTables.from_config(cfg)
        for scheduler in getattr(getattr(self.llm, "stream_run", None), "schedulers", []):
            scheduler.cfg, scheduler.tables = cfg, tables
        self.llm.engine_config = cfg
        self.watch.reset(tables.chunk_tokens)
        self.swaps.append(Swap(old, tables.chunk_tokens, asked, self.step, len(programs), ended - started, started, ended, time.perf_counter(), nice, quieted,
                               self.yield_share, *self._yielded, self._raise and self._yielded[1] > 0))
        self._yielded = [0.0, 0]
        log.info("refit: chunk table %s -> %s swapped in at step %d (%d programs compiled after warm-up in %.1f s)", old, tables.chunk_tokens, self.step, len(programs), ended - started)

    def close(self) -> None:
        """Wait for a compile under way (its programs are kept unused) and stop the thread."""
        self._gate.open()
        self._executor.shutdown(wait=True)
        self._unquiet()

    def unfinished(self) -> dict | None:
        """The refit under way (asked for, not swapped in): the step it was asked at and the sleeps given to it; None if none."""
        if self._pending is None:
            return None
        return {"asked_at_step": self._pending[2], "at_step": self.step, "yield_s": self._yielded[0], "num_yields": self._yielded[1]}

    def report(self) -> str:
        """One line per swap, and one for a refit asked for but not swapped in (its compile outlasted the job), for the job's end."""
        lines = [f"refit: chunk table {s.old_table} -> {s.new_table} at step {s.swapped_at_step} (asked at {s.asked_at_step}); "
                 f"{s.num_programs} programs compiled after warm-up in {s.compile_s:.1f} s, in the background" for s in self.swaps]
        if self._pending is not None:
            lines.append(f"refit: prefill sizes drifted at step {self._pending[2]}; the refitted programs were still compiling at step {self.step}, "
                         f"the job's last (the steps slept {self._yielded[0]:.1f} s for it after {self._yielded[1]}), and were not used")
        return "\n".join(lines) or "refit: no drift, no program compiled after warm-up"
