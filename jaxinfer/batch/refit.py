"""Online bucket refit: a planned job (`--plan`) watches its prefill sizes, and when they drift from what the
chunk table was fitted to, compiles a refitted table's programs in a child process that is stopped while the job
steps, and swaps them in between two steps.

`DriftWatch` (host only, numpy) keeps the token counts of the last `window` prefill rows, and a sample of the
rows before them since its table was set (every 2**k-th row, k growing as the sample fills). Every `every`
prefill step it judges the window, once the sample holds half a window of rows (or `reference`). Drift is a
change, with evidence of two kinds, both needed:
- the window's newer half is not drawn from the rows before it: a two-sample Kolmogorov-Smirnov test
  (`ks_pvalue`) below `alpha`;
- the rows after the change (`change_point`: the split of the window whose later rows differ most from those
  before it, at least `least` of them) pad to fewer slots under a table fitted to half of them (`fit_table`, the
  exact fit, to the even rows, with the same number of buckets, the current largest bucket kept, so the chunk
  limit and with it the schedule's chunking stay as they were) than under the current table: out of sample (tested
  on the odd rows), so rows are not judged on their own fit. The slots saved per row, paired row by row, must
  exceed `threshold` of the current table's slots by `z` standard errors (`significant_saving`).
Then the table fitted to the rows after the change is proposed. The test proves the change, so the saving needs
only one standard error (z = 1); the saving alone, at three, mistook a window without a row of a long tail for
drift and dropped the table's tail buckets (one stream of an earlier set, in a script, padded 48% against 36% on
the table kept). On 480 streams of sizes from the distribution their table was fitted to (log-normal, means 20 to
150 tokens, sigmas 0.6 to 1.2, 20 seeds) the saving alone refitted 34 at three standard errors and 267 at one;
the watch refitted none (experiments/drift_watch_streams.py).

Judged from the rows after the change point, a large shift is proposed about a dozen rows after it; the watch
before (a table fitted to the window's older half, tested on its newer half) waited until the older half held
the new sizes, about 35 rows. A table fitted to a dozen rows is rough, so once `settle_rows` rows have run on a
drift's table the watch judges them once more, out of sample as above: if a table fitted to their even rows
saves `settle_threshold` of the slots on their odd rows, the table fitted to all of them is proposed (once per
drift; `reason` says which kind a proposal is). A table that never suited the job's sizes is the plan's to fit
(it samples the input); the watch refits on change.

`Refit` is the job's on_step hook. On drift it starts a child process that compiles the programs the new table
needs (engine/compile_worker.py's ChildCompile: the configs and the state's shapes, no weights; the programs come
back serialized and `Engine.load_program` loads them here). The child runs only inside the hook: after
every YIELD_EVERY steps the stepping thread lets it run (SIGCONT) for YIELD_SHARE of their seconds, loading what it
sent meanwhile, and stops it (SIGSTOP) before returning, so every step runs with the cores to itself. In the
job's own process a compile's native threads took the cores the step's threads wait for at a barrier, and its
lowering held the GIL, whatever their priorities: in-window decode steps up to 8.01x their key's median (loaded, same sitting; 2.21x in the child). The child
compiles the new buckets in the order that saves the most padded slots per program on the rows the table was
fitted to (`compile_order`), and each new bucket is used as soon as its programs are loaded: after a turn (and at
the start, for buckets the engine has already), the old table with the new buckets ready so far (an interim
table; every bucket of it has its programs) is swapped in, so the rows that fit a new bucket stop padding to the
old ones before the whole table is compiled. Once every program is loaded it swaps in the refitted table itself.
A child that fails (its exit and the tail of its stderr are logged) abandons the refit (`Refit.abandoned`), and
the job refits no more, on the table in use then; its outputs are unaffected. An interim table still in use at
the job's end gives way to the table before it (`close`). With a mesh the programs compile in this process, in a
background thread (`Engine.compile_programs`), with the same sleeps and no protection of the steps, and the whole
table is swapped in at once. Each swap, at one step boundary, changes the engine's config (which adds the programs
and drops none) and then the running schedulers' tables and the LLM's config, so a plan made on the old tables
still finds its program and every later plan is made on the new ones.

These are compiles after warm-up, on purpose: `Engine.refit_compilations` counts them (also in
num_compilations), each is logged as a refit compile, and `Refit.swaps` records each swap. A refit changes
which padded program a step runs, never a token's inputs; deterministic mode fixes its tables, so it never
refits.
Only one replica (data_parallel 1) is refitted. Host code only (numpy); never imports jaxinfer.bucketing.
"""

import collections
import concurrent.futures
import dataclasses
import logging
import time
from collections import deque
from typing import Literal

import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.engine.compile_worker import ChildCompile  # host side: its module imports no jax
from jaxinfer.scheduling.bucket_tables import BucketTables, cut_table

log = logging.getLogger(__name__)

_CHUNK_MULTIPLE = 16  # every refitted chunk bucket is a multiple of this (planning.py's fine table step)
# While a refit compiles, the stepping thread gives the compile this share of each step's seconds after it (3.0: a
# step and its pause take 4x the step; the steps themselves run as before, the child stopped). The job pays about
# the compile's CPU seconds / cores whatever the share; a larger one ends the window sooner, so fewer steps run on
# the old table. bench_refit on a loaded 2-core Xeon (indicative): at 1.0 the 12 programs took 54.5 s, 201 steps;
# at 3.0 23.4 s, 47 steps, and the padding after the shift 16.7% against 18.6%.
YIELD_SHARE = 3.0
# The compile's turn comes after every YIELD_EVERY steps, for YIELD_SHARE of their seconds together: a quarter of the
# SIGCONT/SIGSTOP cycles. bench_refit --sched-stats, 160 lines a half, AMD EPYC, alone, one sitting: with a turn after
# every step the slowest in-window step was 2.49x, 2.08x, 1.58x, 1.61x and 1.57x its key's median outside the window
# (the window's steps at a median 1.00-1.14x their key's CPU time); with a turn every 4 steps 1.24x, 1.97x and 1.58x
# (1.00-1.03x), never above the slowest step outside the window in the same run (1.78-1.94x), and the compile window
# 11.5-11.7 s against 12.9-14.8 s. The child never ran during a step in either (its threads' CPU time, read per
# step), and a step right after a turn was no slower than the others (0.98-1.00x at the median).
YIELD_EVERY = 4
# Why a refit was asked for (DriftWatch.reason; None: a watch that sets none, as a benchmark's forced ask), for the log and the job's report
_WHY = {"drift": "prefill sizes drifted", "settle": "a table fitted to the rows since the last refit pads less", None: "a refit was asked for"}


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


def _ks_gap(sample: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """(D, sqrt(n m / (n + m))): the largest gap between two sorted samples' empirical CDFs, and its scale."""
    values = np.concatenate([sample, reference])
    gap = np.abs(np.searchsorted(sample, values, "right") / sample.size - np.searchsorted(reference, values, "right") / reference.size).max()
    return float(gap), float(np.sqrt(sample.size * reference.size / (sample.size + reference.size)))


def ks_pvalue(sample, reference) -> float:
    """The p-value of the two-sample Kolmogorov-Smirnov test that two samples are drawn from one distribution.

    The largest gap D between their empirical CDFs, against the Kolmogorov distribution's tail at Stephens'
    scaled (sqrt(ne) + 0.12 + 0.11 / sqrt(ne)) * D, ne = n * m / (n + m). Asymptotic: ties make it
    conservative, and at 32 rows against 32 it runs slightly low (about 0.7 of the exact p for continuous data).

    Args:
      sample: i64[N] or f64[N]; the sizes to judge.
      reference: i64[M] or f64[M]; the sizes they are compared with.

    Returns:
      The p-value in [0, 1]; 1.0 when either sample is empty.
    """
    sample, reference = np.sort(np.asarray(sample, np.float64)), np.sort(np.asarray(reference, np.float64))
    if sample.size == 0 or reference.size == 0:
        return 1.0
    gap, root = _ks_gap(sample, reference)
    scaled = (root + 0.12 + 0.11 / root) * gap
    if scaled < 0.2:  # the tail is 1 there to 12 digits, and the series slow to converge
        return 1.0
    terms = np.arange(1, 101)
    return float(np.clip(2.0 * np.sum((-1.0) ** (terms - 1) * np.exp(-2.0 * (terms * scaled) ** 2)), 0.0, 1.0))


def change_point(window, before, least: int) -> int:
    """Where the rows of `window` (oldest first) start to differ most from those before them: the split c whose
    later rows window[c:] (at least `least` of them) are farthest, by the scaled two-sample Kolmogorov-Smirnov
    gap sqrt(ne) * D, from `before` and window[:c] together; the earliest such c on an exact tie.

    Args:
      window: i64[W]; the sizes, oldest first.
      before: i64[B]; the sizes before them (a sample).
      least: the fewest rows after the split (1 to W).

    Returns:
      c in [0, W - least].
    """
    window, before = np.asarray(window, np.float64), np.asarray(before, np.float64)
    if not 1 <= least <= window.size:
        raise ValueError(f"change_point needs 1 <= least <= {window.size} (the window's rows), got {least=}")
    grid = np.unique(np.concatenate([window, before]))  # every CDF step
    below = window[:, None] <= grid[None, :]  # bool[W, V]: row i at or under grid value v
    head = np.concatenate([np.zeros((1, grid.size)), np.cumsum(below, axis=0)])  # f64[W + 1, V]: rows of window[:c] at or under v
    splits = np.arange(window.size - least + 1)  # i64[C]
    later_n, earlier_n = window.size - splits, before.size + splits
    later = (head[-1] - head[splits]) / later_n[:, None]  # f64[C, V]: window[c:]'s CDF
    earlier = (np.searchsorted(np.sort(before), grid, "right")[None, :] + head[splits]) / np.maximum(earlier_n, 1)[:, None]  # f64[C, V]
    scaled = np.abs(later - earlier).max(axis=1) * np.sqrt(later_n * earlier_n / (later_n + earlier_n))  # f64[C]
    scaled[earlier_n == 0] = -1.0  # nothing before the split to differ from
    return int(np.argmax(scaled))  # the first maximum: the earliest split on a tie


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


def _chunk_of(key) -> int | None:
    """A prefill program's chunk bucket (its tokens per row); None for a decode or a draw program (an int)."""
    return key.num_tokens if not isinstance(key, int) and key.phase == "prefill" else None


def compile_order(rows, table: tuple[int, ...], new_table: tuple[int, ...], programs: dict[int, int] | None = None) -> tuple[int, ...]:
    """`new_table`'s buckets that `table` lacks, in the order a refit compiles them: each next the one that, added to
    `table` and those before it, saves the most token slots on `rows` per program it needs (`programs`: bucket ->
    programs to compile; None or a bucket missing: 1), the smaller on a tie. No rows: ascending."""
    rows, programs = np.asarray(rows, np.int64), programs or {}
    left, now, order = [b for b in new_table if b not in table], set(table), []
    slots = lambda buckets: int(padded_slots(rows, tuple(sorted(buckets))).sum()) if rows.size else 0  # noqa: E731
    while left:
        base = slots(now)
        best = max(left, key=lambda b: ((base - slots(now | {b})) / max(1, programs.get(b, 1)), -b))
        order.append(best)
        left.remove(best)
        now.add(best)
    return tuple(order)


@dataclasses.dataclass
class DriftWatch:
    """The token counts per row of recent prefill steps, a sample of those before them, and whether they have
    drifted from the chunk table (the module's docstring)."""

    table: tuple[int, ...]
    window: int = 64  # rows of prefill steps judged (a packed step's rows count one each)
    every: int = 1  # prefill steps between two judgements
    strikes_needed: int = 1  # judgements in a row that must see drift
    threshold: float = 0.08  # share of the current table's slots a refitted table must save to count as drift
    z: float = 1.0  # standard errors of the per-row saving that must lie above the threshold (the change is the test's to prove)
    alpha: float = 1e-4  # the newer half must differ from the rows before the window at this level (ks_pvalue)
    reference: int = 512  # rows before the window kept: every 2**k-th, `reference` to 2 x reference - 1 once halved
    least: int = 8  # fewest rows after a change point (change_point; at most half the window)
    settle_rows: int = 256  # rows after a drift's swap at which the table is judged once more (0: never)
    settle_threshold: float = 0.02  # share of slots a table fitted to those rows must save to replace it

    def __post_init__(self):
        if self.window < 2 or self.every < 1 or self.reference < 1 or self.least < 1 or self.settle_rows < 0:
            raise ValueError(f"DriftWatch needs window >= 2, every >= 1, reference >= 1, least >= 1 and settle_rows >= 0, got window={self.window}, "
                             f"every={self.every}, reference={self.reference}, least={self.least}, settle_rows={self.settle_rows}")
        self.sizes: deque[int] = deque(maxlen=self.window)
        self.seen = 0
        self.count = len(self.table)  # buckets of every refitted table: the plan's, whatever a fit returns
        self.strikes = 0  # judgements in a row that saw drift; `strikes_needed` of them refit (noise rarely repeats)
        self.reason: Literal["drift", "settle"] | None = None  # why the last table was proposed
        self.proposed_rows = np.zeros(0, np.int64)  # i64[N]: the sizes the last proposal was fitted to (compile_order reads them)
        self.settle_sizes: list[int] | None = None  # rows since a drift's table was swapped in, while its settle is due
        self._clear_before()

    def _clear_before(self) -> None:
        self.before: list[int] = []  # rows that left the window since the table was set: every `stride`-th
        self.stride, self.left = 1, 0

    def _push(self, size: int) -> None:
        """A row into the window; the one it pushes out, if its turn, into the sample before it."""
        if len(self.sizes) == self.window:
            if self.left % self.stride == 0:
                self.before.append(self.sizes[0])
                if len(self.before) >= 2 * self.reference:  # keep every other one, and from now on every 2 * stride-th
                    self.before, self.stride = self.before[::2], 2 * self.stride
            self.left += 1
        self.sizes.append(size)

    def observe(self, plan) -> tuple[int, ...] | None:
        """A step's plan; the refitted chunk table when the window shows drift (or a drift's settle refits), else None."""
        if plan.phase != "prefill":
            return None
        rows = [sum(plan.num_new_tokens)] if plan.bucket.num_rows == 1 else list(plan.num_new_tokens)
        for size in rows:
            self._push(size)
        self.seen += 1
        proposal = self._drift()
        if proposal is None and self.settle_sizes is not None:
            self.settle_sizes += rows
            proposal = self._settle()
        return proposal

    def _drift(self) -> tuple[int, ...] | None:
        """The judgement of the window (the module's docstring): a table fitted to the rows after its change point, or None."""
        # after a swap, a whole window of the new table's steps and half a window before it (or `reference` rows)
        if self.seen % self.every or len(self.sizes) < self.window or len(self.before) < min(self.window // 2, self.reference):
            return None
        sizes = np.array(self.sizes)
        if ks_pvalue(sizes[sizes.size // 2 :], self.before) >= self.alpha:
            self.strikes = 0
            return None
        later = sizes[change_point(sizes, self.before, min(self.least, sizes.size // 2)) :]
        self.strikes = self.strikes + 1 if self._saves(later, self.threshold) else 0
        return self._propose(later, "drift") if self.strikes >= self.strikes_needed else None

    def _settle(self) -> tuple[int, ...] | None:
        """Once `settle_rows` rows ran on a drift's table (fitted to a few dozen rows): a table fitted to them, if it
        saves `settle_threshold` of the slots, or None. Once per drift."""
        if len(self.settle_sizes) < self.settle_rows:
            return None
        rows, self.settle_sizes = np.array(self.settle_sizes), None
        return self._propose(rows, "settle") if self._saves(rows, self.settle_threshold) else None

    def _saves(self, rows: np.ndarray, threshold: float) -> bool:
        """Whether a table fitted to the even rows saves `threshold` of the slots on the odd ones (out of sample)."""
        trial = refit_chunk_table(rows[0::2], self.table, self.count)
        return significant_saving(rows[1::2], self.table, trial, threshold, self.z)

    def _propose(self, rows: np.ndarray, reason: Literal["drift", "settle"]) -> tuple[int, ...]:
        """The table fitted to `rows`, proposed for `reason`."""
        self.reason, self.proposed_rows = reason, np.asarray(rows, np.int64)
        return refit_chunk_table(rows, self.table, self.count)

    def reset(self, table: tuple[int, ...]) -> None:
        """`table` is swapped in (the last proposal, or another): the judgements start over; after a drift's, its settle is due."""
        self.settle_sizes = [] if self.reason == "drift" and self.settle_rows else None
        self.table, self.seen, self.strikes, self.reason = table, 0, 0, None
        self.sizes.clear()
        self._clear_before()


@dataclasses.dataclass(frozen=True)
class Swap:
    """One refit: the tables, when it was asked for and swapped in (steps), and its compiles."""

    old_table: tuple[int, ...]
    new_table: tuple[int, ...]
    asked_at_step: int
    swapped_at_step: int
    num_programs: int
    compile_s: float
    compile_started: float = 0.0  # perf_counter when the compile began (the window a step may slow in)
    compile_ended: float = 0.0  # perf_counter when its last program was loaded here
    swapped_at: float = 0.0  # perf_counter at the swap (the step boundary at or after compile_ended)
    in_child: bool = False  # compiled in a child process stopped while the job stepped (False: in a thread here, a mesh)
    child_cpu_s: float = 0.0  # the child's CPU seconds compiling (all its threads)
    child_peak_rss: int = 0  # the child's peak resident memory, bytes
    yield_share: float = 0.0  # the stepping thread gave the compile this share of the steps' seconds
    yield_s: float = 0.0  # seconds it gave so, in all (the job's wall time given to the compile)
    num_yields: int = 0  # steps after which it gave them
    loaded_at: tuple[float, ...] = ()  # perf_counter after each program's load in this process (a child's)
    late_stops: tuple[tuple[float, str], ...] = ()  # a child's stops that timed out: (perf_counter, the letters of its threads still not stopped)
    yield_every: int = 1  # the compile's turn came after every this many steps
    turn_ends: tuple[float, ...] = ()  # perf_counter at the end of each of the compile's turns
    interim: tuple[tuple[int, float, tuple[int, ...]], ...] = ()  # (step, perf_counter, chunk table) of each interim table swapped in before it


@dataclasses.dataclass(frozen=True)
class Abandoned:
    """A refit whose compile failed: the job ran its remaining steps on the table in use then (the last interim one,
    if any; `Refit.close` puts the table before it back at the job's end)."""

    old_table: tuple[int, ...]
    new_table: tuple[int, ...]
    asked_at_step: int
    failed_at_step: int
    num_loaded: int  # programs the child sent and this process loaded
    num_programs: int  # programs it had to compile
    interim: tuple[tuple[int, float, tuple[int, ...]], ...]  # as Swap.interim
    error: str

    @property
    def kept_table(self) -> tuple[int, ...]:
        """The table the job ran on after the failure: the last interim one, else the old one."""
        return self.interim[-1][2] if self.interim else self.old_table


def with_chunk_table(cfg: EngineConfig, table: tuple[int, ...]) -> EngineConfig:
    """`cfg` with this chunk table and its other two tables as they are now (given explicitly)."""
    tables = BucketTables.from_config(cfg)
    return dataclasses.replace(cfg, buckets=None, prefill_chunk_buckets=table, decode_batch_buckets=tables.decode_rows, decode_page_buckets=tables.pages)




@dataclasses.dataclass
class _Compile:
    """A refit under way: a child process (compile_worker.ChildCompile) or, with a mesh, a thread's future."""

    cfg: EngineConfig
    asked_at: int  # step
    started: float  # perf_counter
    child: ChildCompile | None = None
    future: concurrent.futures.Future | None = None
    yield_s: float = 0.0
    num_yields: int = 0
    turn_ends: list[float] = dataclasses.field(default_factory=list)  # perf_counter at the end of each turn given
    old_table: tuple[int, ...] = ()  # the chunk table when it was asked for
    interim: list[tuple[int, float, tuple[int, ...]]] = dataclasses.field(default_factory=list)  # (step, perf_counter, chunk table) swapped in

    def done(self) -> bool:
        return self.child.finished if self.child is not None else self.future.done()

    def error(self) -> str | None:
        if self.child is not None:
            return self.child.error
        return None if not self.future.done() or self.future.exception() is None else repr(self.future.exception())

    def hold(self) -> None:
        """No turn now: a child is stopped (it is, after a turn; a new one runs until this)."""
        if self.child is not None:
            self.child.pause()

    def give(self, seconds: float) -> None:
        """The compile's turn after a step: the child runs (then stops before the next step); a thread gets a sleep."""
        start = time.perf_counter()
        if self.child is not None:
            self.child.work(seconds)
            self.child.pause()
        else:
            concurrent.futures.wait([self.future], timeout=seconds)  # a sleep that ends when the compile does
        self.turn_ends.append(time.perf_counter())
        self.yield_s += self.turn_ends[-1] - start
        self.num_yields += 1


def _compile_here(engine, cfg: EngineConfig, state: tuple) -> tuple[dict, float]:
    """A mesh's programs, compiled in this process's refit thread; returns (programs, perf_counter at the end)."""
    return engine.compile_programs(cfg, state), time.perf_counter()


class Refit:
    """The on_step hook of a planned job: watches prefill sizes (DriftWatch), compiles a refitted chunk table's
    programs in a child process it stops while the job steps, and swaps them in between steps. `chain`: the
    hook it wraps (called first). `yield_share`, `yield_every`: while the compile runs, after every `yield_every` steps it
    gets this share of their seconds (0: none, a child never progresses: it stays stopped)."""

    def __init__(self, llm, *, chain=None, watch: DriftWatch | None = None, yield_share: float = YIELD_SHARE, yield_every: int = YIELD_EVERY):
        self.llm, self.chain, self.yield_share, self.yield_every = llm, chain, yield_share, yield_every
        self._owed: tuple[int, float] = (0, 0.0)  # steps since the compile's last turn, and their seconds
        self.enabled = not llm.engine_config.deterministic and len(llm.replicas) == 1
        self.watch = watch or DriftWatch(BucketTables.from_config(llm.engine_config).chunk_tokens)
        self.swaps: list[Swap] = []
        self.abandoned: list[Abandoned] = []
        self._restore: tuple[int, ...] | None = None  # the table before an interim one still in use (close() puts it back)
        self.step = 0
        # Starts each child (it dies with the thread that started it: this one lives as long as the Refit), or
        # compiles a mesh's programs.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxinfer-refit")
        self._pending: _Compile | None = None

    def __call__(self, plan, tokens, seconds) -> None:
        if self.chain is not None:
            self.chain(plan, tokens, seconds)
        self.step += 1
        if not self.enabled:
            return
        if self._pending is None:
            table = self.watch.observe(plan)
            if table is None:
                return
            self._start(with_chunk_table(self.llm.engine_config, table))
            if self._pending is None:  # its child did not start: abandoned
                return
        self._advance(seconds)

    def _start(self, cfg: EngineConfig) -> None:
        engine, started = self.llm.engine, time.perf_counter()
        missing = collections.Counter(_chunk_of(key) for key in engine.missing_programs(cfg))
        old = BucketTables.from_config(self.llm.engine_config).chunk_tokens
        new = BucketTables.from_config(cfg).chunk_tokens
        have = tuple(size for size in new if not missing[size])  # compiled already (warm-up, an earlier refit): free to use now
        order = compile_order(self.watch.proposed_rows, tuple(sorted({*old, *have})), new, dict(missing))
        first = {size: i for i, size in enumerate(order)}
        # the prefill programs of the new buckets in that order, then the others as the engine lists them (a stable sort)
        rank = lambda key: first.get(_chunk_of(key), len(first))  # noqa: E731
        try:
            child = self._executor.submit(ChildCompile, engine, cfg, rank).result() if engine.mesh is None else None
        except Exception as e:  # a child that cannot start (fork, a full temporary folder): the refit ends as a failed one does
            self._pending = _Compile(cfg, self.step, started, old_table=old)
            self._abandon(f"the compile child did not start: {e!r}")
            return
        future = None if child is not None else self._executor.submit(_compile_here, engine, cfg, engine.abstract_state())
        self._pending = _Compile(cfg, self.step, started, child, future, old_table=old)
        self._owed = (0, 0.0)
        log.info("refit: %s; compiling chunk table %s %s", _WHY[self.watch.reason], new, "in a child process" if child is not None else "in the background")
        self._use_loaded()  # the new buckets the engine has already, at once

    def _advance(self, seconds: float) -> None:
        """After a step: the compile's turn, then the swap if it is done, or the end of the refit if it failed."""
        pending = self._pending
        if not pending.done() and pending.error() is None:
            steps, owed = self._owed[0] + 1, self._owed[1] + seconds
            self._owed = (steps, owed)
            if self.yield_share > 0 and steps >= self.yield_every:
                pending.give(self.yield_share * owed)
                self._owed = (0, 0.0)
                if not pending.done() and pending.error() is None:
                    self._use_loaded()
            else:
                pending.hold()  # a child starts running: stopped until its turn
        if (error := pending.error()) is not None:
            self._abandon(error)
        elif pending.done():
            self._swap()

    def _abandon(self, error: str) -> None:
        pending, new = self._pending, BucketTables.from_config(self._pending.cfg).chunk_tokens
        loaded, needed = (len(pending.child.programs), len(pending.child.keys)) if pending.child is not None else (0, 0)
        self.abandoned.append(Abandoned(pending.old_table, new, pending.asked_at, self.step, loaded, needed, tuple(pending.interim), error))
        log.warning("refit: the compile of chunk table %s failed; the job keeps %s and refits no more: %s", new, self.abandoned[-1].kept_table, error)
        self._close_pending()
        self.enabled = False

    def _use_loaded(self) -> None:
        """While a child compiles: the table in use with every new bucket whose programs it has all sent, if that
        adds one (an interim table, its other buckets the old table's, compiled at warm-up or by an earlier refit)."""
        pending = self._pending
        child, now = pending.child, BucketTables.from_config(self.llm.engine_config).chunk_tokens
        if child is None:
            return
        waiting = {_chunk_of(key) for key in child.keys if key not in child.programs}
        ready = [size for size in BucketTables.from_config(pending.cfg).chunk_tokens if size not in now and size not in waiting]
        if ready:
            cfg = with_chunk_table(self.llm.engine_config, tuple(sorted({*now, *ready})))
            self._use(cfg, child.programs)
            if self._restore is None:
                self._restore = pending.old_table
            pending.interim.append((self.step, time.perf_counter(), BucketTables.from_config(cfg).chunk_tokens))
            log.info("refit: interim chunk table %s at step %d (%d of %d programs loaded)", pending.interim[-1][2], self.step, len(child.programs), len(child.keys))

    def _use(self, cfg: EngineConfig, programs: dict) -> None:
        """Between two steps: the engine first (it gains the programs), then the schedulers and the LLM's config."""
        self.llm.engine.use_config(cfg, programs)
        for scheduler in getattr(getattr(self.llm, "stream_run", None), "schedulers", []):
            scheduler.use_config(cfg)
        self.llm.engine_config = cfg

    def _swap(self) -> None:
        """The refitted table swapped in, every program loaded; the watch starts over on it."""
        pending, child = self._pending, self._pending.child
        programs, ended = (child.programs, child.finished_at) if child is not None else pending.future.result()
        self._close_pending()
        old, self._restore = pending.old_table, None
        self._use(pending.cfg, programs)
        tables = BucketTables.from_config(pending.cfg)
        self.watch.reset(tables.chunk_tokens)
        self.swaps.append(Swap(old, tables.chunk_tokens, pending.asked_at, self.step, len(programs), ended - pending.started, pending.started, ended,
                               time.perf_counter(), child is not None, child.cpu_s if child else 0.0, child.peak_rss if child else 0,
                               self.yield_share, pending.yield_s, pending.num_yields, tuple(child.loaded_at) if child else (),
                               tuple(child.late_stops) if child else (), self.yield_every, tuple(pending.turn_ends), tuple(pending.interim)))
        log.info("refit: chunk table %s -> %s swapped in at step %d (%d programs compiled after warm-up in %.1f s)", old, tables.chunk_tokens, self.step, len(programs), ended - pending.started)

    def _close_pending(self) -> None:
        if self._pending is not None and self._pending.child is not None:
            self._pending.child.close()
        self._pending = None

    def close(self) -> None:
        """The job's end: kill a child still compiling (its programs are not used); wait for a mesh's compile thread
        and stop it; an interim table still in use (the refit unfinished or failed) gives way to the table before it,
        so the LLM leaves the job on the table it was planned with."""
        if self._pending is not None and self._pending.child is not None:
            self._pending.child.close()
        self._executor.shutdown(wait=True)
        if self._restore is not None:
            self._use(with_chunk_table(self.llm.engine_config, self._restore), {})
            log.info("refit: chunk table %s restored at the job's end (the refit did not finish)", self._restore)
            self._restore = None

    def unfinished(self) -> dict | None:
        """The refit under way (asked for, not swapped in): the step it was asked at, the time given to it and its
        interim tables so far; None if none."""
        if self._pending is None:
            return None
        return {"asked_at_step": self._pending.asked_at, "at_step": self.step, "yield_s": self._pending.yield_s, "num_yields": self._pending.num_yields,
                "interim": list(self._pending.interim)}

    def report(self) -> str:
        """One line per swap, per failed compile, and for a refit asked for but not swapped in (its compile outlasted
        the job), for the job's end."""
        lines = [f"refit: chunk table {s.old_table} -> {s.new_table} at step {s.swapped_at_step} (asked at {s.asked_at_step}); "
                 f"{s.num_programs} programs compiled after warm-up in {s.compile_s:.1f} s, "
                 + (f"in a child process stopped while the job stepped ({s.child_cpu_s:.1f} s CPU, peak {s.child_peak_rss / 2**20:.0f} MiB)" if s.in_child else "in the background")
                 + (f"; new buckets used as they loaded from step {s.interim[0][0]} ({len(s.interim)} interim tables)" if s.interim else "")
                 for s in self.swaps]
        lines += [f"refit: the compile of chunk table {a.new_table} (asked at step {a.asked_at_step}) failed at step {a.failed_at_step} after "
                  f"{a.num_loaded} of {a.num_programs} programs; the job kept {a.kept_table}"
                  + (f" (the old table with the new buckets loaded, from step {a.interim[-1][0]}; {a.old_table} put back at the end)" if a.interim else "")
                  + f": {a.error.splitlines()[0]}"
                  for a in self.abandoned]
        if (pending := self._pending) is not None:
            used = (f"; the buckets loaded were used from step {pending.interim[0][0]} (last {pending.interim[-1][2]}), and {pending.old_table} put back at the end"
                    if pending.interim else ", and were not used")
            lines.append(f"refit: {_WHY[self.watch.reason]} at step {pending.asked_at}; the refitted programs were still compiling at step {self.step}, "
                         f"the job's last (the steps gave it {pending.yield_s:.1f} s after {pending.num_yields})" + used)
        return "\n".join(lines) or "refit: no drift, no program compiled after warm-up"
