"""The step-cost model: seconds per compiled program, and the host's seconds per step. Host only, no jax.

jaxinfer runs a finite set of compiled programs, one per bucket key, so the device cost of a step is close
to a lookup: `StepCosts` keeps, per `BucketKey`, the most recent measured seconds of that program (a few
timed runs at warm-up, `Engine.time_programs`, then every step a job runs, `Engine.step`) and answers with
their mean, each run counted at most CAP times their median. A wall time is the sum of its steps, so a key's
price is its expected step, which the median is not: a program's steps are not one size (in runs on the loaded
2-core CPU a decode step right after another program's ran a median 1.3x one right after its own, 1.04x to
1.13x in an A/B on the null page; attention reads only the pages its rows fill, 0.7x to 1x of a full table's),
and pricing at the median left the predicted device seconds low in 23 of 30 runs of bench_simulator. The cap
keeps one stall (a collection, a page-fault storm) from raising a key's price by more than (CAP - 1) / KEEP of
its median. The window is short on purpose: a window of 1,024 runs (about 17 five-second jobs of a busy decode
key) was tried against the carry of a slow spell into the next prediction, and on a 2-core AMD EPYC whose speed drifted
over minutes it lagged instead (24 of 30 bench_simulator predictions within both goals, a +5-9% bias in a faster
stretch, against 26 of 30 twice with 32). A key never measured is estimated from the measured keys of its phase, by a least-squares line in
the key's work (`work`: token slots computed plus page slots read). The host's time per step
(planning, sampling masks, detokenizing, writing records: the gap between one step's end and the next one's
start) is a line in the step's rows, fitted through the median gap at each row count (`HostModel`), so a
stray long gap (an idle wait, a fsync) moves it little.

`StepCosts.monotone()` is the view a plan prices with (batch/planning.py): every key on its phase's line in
work (`MonotoneCosts`), so a program's cost never falls as its rows, tokens or pages grow and noisy medians
(a loaded machine) cannot make a wider bucket look cheaper than a narrower one.

The table is plain data: `to_json` / `from_json` (tuning_cache.py persists it per machine and model,
batch/step_log.py writes it beside a job's output, the simulator reads it).
"""

import dataclasses
import math
import statistics

from jaxinfer.scheduling.plan import BucketKey

FORMAT = "jaxinfer-step-costs/1"
KEEP = 32  # most recent observations kept per program (and per host row count); the price is over these
CAP = 3.0  # a program run counts at most this many times its key's median in the key's mean
DEFAULT_STEP_S = 0.01  # seconds of a step when nothing at all was measured
MAX_HOST_GAP_S = 1.0  # host gaps longer than this are waits (an arrival, a new batch), not host work


@dataclasses.dataclass
class Observations:
    """The count of observations and the most recent KEEP of them (seconds); for a program, apart from
    them, its warm-up runs (on an all-padding plan, which can run faster than real rows)."""

    count: int = 0
    recent: list[float] = dataclasses.field(default_factory=list)
    warmup: list[float] = dataclasses.field(default_factory=list)

    def add(self, seconds: float, *, warmup: bool = False) -> None:
        kept = self.warmup if warmup else self.recent
        self.count += not warmup
        kept.append(float(seconds))
        if len(kept) > KEEP:
            del kept[0]

    @property
    def median(self) -> float:
        return statistics.median(self.recent or self.warmup)

    @property
    def expected(self) -> float:
        """The mean of the recent runs (else the warm-up ones), each counted at most CAP x their median; of two runs (the
        warm-up's default), at most CAP x the faster: their median is their mean, which a stall would raise past its cap."""
        kept = self.recent or self.warmup
        ceiling = CAP * (statistics.median(kept) if len(kept) > 2 else min(kept))
        return sum(min(s, ceiling) for s in kept) / len(kept)


def work(key: BucketKey) -> int:
    """What a program computes, in slots: rows x (tokens + pages read), the estimate's one variable."""
    return key.num_rows * (key.num_tokens + key.num_pages)


def _line(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the weighted least-squares line through (x, y, weight) points; flat when the
    points have one x. Never negative at x = 0 or in slope (a cost does not fall as work grows)."""
    total = sum(w for _, _, w in points)
    mean_x = sum(x * w for x, _, w in points) / total
    mean_y = sum(y * w for _, y, w in points) / total
    spread = sum(w * (x - mean_x) ** 2 for x, _, w in points)
    slope = max(0.0, sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points) / spread) if spread > 0 else 0.0
    return max(0.0, mean_y - slope * mean_x), slope


class HostModel:
    """Host seconds per step as a line in the step's rows, through the median gap at each row count."""

    def __init__(self):
        self.by_rows: dict[int, Observations] = {}
        self._fit: tuple[float, float] | None = None

    def add(self, rows: int, seconds: float) -> None:
        if not 0.0 <= seconds <= MAX_HOST_GAP_S:
            return
        self.by_rows.setdefault(int(rows), Observations()).add(seconds)
        self._fit = None

    def fill_from(self, cached: "HostModel") -> None:
        """The row counts this model has no observation of, as `cached` holds them (StepCosts.fill_from)."""
        for rows, obs in cached.by_rows.items():
            self.by_rows.setdefault(rows, obs)
        self._fit = None

    @property
    def line(self) -> tuple[float, float]:
        """(seconds at 0 rows, seconds per row); (0, 0) with no observation."""
        if self._fit is None:
            points = [(rows, obs.median, len(obs.recent)) for rows, obs in self.by_rows.items()]
            self._fit = _line(points) if points else (0.0, 0.0)
        return self._fit

    def seconds(self, rows: int) -> float:
        intercept, slope = self.line
        return intercept + slope * rows


class StepCosts:
    """Measured seconds per program key (the capped mean of the recent ones), an estimate for a key never
    measured, and the host's seconds per step (HostModel)."""

    def __init__(self):
        self.programs: dict[BucketKey, Observations] = {}
        self.host = HostModel()
        self._estimates: dict[str, tuple[float, float] | None] = {}
        self._cache: dict[BucketKey, float] = {}

    def observe(self, key: BucketKey, seconds: float, *, warmup: bool = False) -> None:
        """One run of the program `key` took `seconds` (device time as the step loop sees it); `warmup`: a
        timed run at warm-up, which counts only until the key has real runs (scaled by `calibration`)."""
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"step seconds must be finite and >= 0, got {seconds!r}")
        self.programs.setdefault(BucketKey(*key), Observations()).add(seconds, warmup=warmup)
        self._estimates.clear()
        self._cache.clear()

    def observe_host(self, rows: int, seconds: float) -> None:
        self.host.add(rows, seconds)

    def measured(self, key: BucketKey) -> bool:
        return BucketKey(*key) in self.programs

    def device_seconds(self, key: BucketKey) -> float:
        """The capped mean (Observations.expected) of the key's recent real runs, else of its warm-up runs times
        its phase's calibration, else the estimate from its phase's measured keys."""
        cached = self._cache.get(key)
        if cached is None:
            observed = self.programs.get(key)
            if observed is None:
                cached = self.estimate(key)
            else:
                cached = observed.expected * (1.0 if observed.recent else self.calibration(key.phase))
            self._cache[key] = cached
        return cached

    def calibration(self, phase: str) -> float:
        """Real runs over warm-up runs (the median over the phase's keys that have both of the ratio of their
        real runs' price, Observations.expected, to their warm-up runs' price, the same capped mean, which a
        warm-up-only key is priced at; 1 with none): a padding plan's run can be faster than real rows', or
        slower (it reads every page of its table)."""
        ratios = [o.expected / warm for k, o in self.programs.items()
                  if k.phase == phase and o.recent and o.warmup and (warm := Observations(warmup=o.warmup).expected) > 0]
        return statistics.median(ratios) if ratios else 1.0

    def host_seconds(self, rows: int) -> float:
        return self.host.seconds(rows)

    def step_seconds(self, key: BucketKey, rows: int) -> float:
        """Host and device seconds of a step of `rows` real sequences on program `key`."""
        return self.host_seconds(rows) + self.device_seconds(key)

    def estimate(self, key: BucketKey) -> float:
        """A key never measured: the line (seconds against `work`) through its phase's measured keys,
        else through every measured key, else DEFAULT_STEP_S."""
        fit = self._phase_line(key.phase) or self._phase_line(None)
        if fit is None:
            return DEFAULT_STEP_S
        return fit[0] + fit[1] * work(key)

    def _phase_line(self, phase: str | None) -> tuple[float, float] | None:
        name = phase or "*"
        if name not in self._estimates:
            points = [(work(k), self.device_seconds(k), 1.0) for k in self.programs if phase is None or k.phase == phase]
            self._estimates[name] = _line(points) if points else None
        return self._estimates[name]

    def monotone(self) -> "MonotoneCosts":
        """This table seen through a monotone estimate (MonotoneCosts), for choosing between tables."""
        return MonotoneCosts(self)

    def fill_from(self, cached: "StepCosts") -> None:
        """In place: the program keys and host row counts this table has no observation of, as `cached` holds them
        (a table read from the cache; what this table measured itself wins, so a table read again after a
        config swap never counts the same runs twice)."""
        for key, obs in cached.programs.items():
            self.programs.setdefault(key, obs)
        self.host.fill_from(cached.host)
        self._estimates.clear()
        self._cache.clear()

    def table(self) -> list[tuple[BucketKey, int, float]]:
        """(key, real runs observed, seconds it costs) per measured program, in key order."""
        return [(key, obs.count, self.device_seconds(key)) for key, obs in sorted(self.programs.items())]

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "programs": [{"key": list(key), "count": obs.count, "recent": [round(s, 7) for s in obs.recent], "warmup": [round(s, 7) for s in obs.warmup]}
                         for key, obs in sorted(self.programs.items())],
            "host": [{"rows": rows, "count": obs.count, "recent": [round(s, 7) for s in obs.recent]} for rows, obs in sorted(self.host.by_rows.items())],
        }

    @classmethod
    def linear(cls, keys, *, program: tuple[float, float], host: tuple[float, float], max_rows: int) -> "StepCosts":
        """A made-up table, for a simulation with nothing measured: each program of `keys` at program[0] s plus
        program[1] s per slot of `work`, the host at host[0] s plus host[1] s per row (observed at 1 and
        `max_rows` rows)."""
        costs = cls()
        for key in keys:
            costs.observe(key, program[0] + program[1] * work(key))
        for rows in (1, max_rows):
            costs.observe_host(rows, host[0] + host[1] * rows)
        return costs

    @classmethod
    def from_json(cls, doc: dict) -> "StepCosts":
        """The table `to_json` wrote; ValueError naming what is wrong with any other document."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"not a step-cost table (expected format {FORMAT!r})")
        costs = cls()
        for i, entry in enumerate(_entries(doc, "programs")):
            key = _key_of(entry.get("key"), f"programs[{i}].key")
            costs.programs[key] = _observations(entry, f"programs[{i}]")
        for i, entry in enumerate(_entries(doc, "host")):
            rows = entry.get("rows")
            if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
                raise ValueError(f"host[{i}].rows must be an int >= 0, got {rows!r}")
            if not entry.get("recent"):  # the host model weighs each row count by its recent seconds (to_json writes no warm-up ones)
                raise ValueError(f"host[{i}].recent must hold seconds")
            costs.host.by_rows[rows] = _observations(entry, f"host[{i}]")
        return costs


class MonotoneCosts(StepCosts):
    """A read-only view of a StepCosts whose device seconds never fall as a key's rows, tokens or pages grow:
    every key, measured or not, costs its phase's line in `work` through all the phase's measured keys (the
    estimate StepCosts gives a key never run; intercept and slope >= 0). One noisy median moves a line fitted
    through dozens of keys little, where priced alone it can make a wider bucket look cheaper than a
    narrower one. Measured against the median of three (that line, the largest cost of a key it covers, the
    smallest of a key covering it), which keeps consistent medians, the line alone fitted tables as good or
    better on average (five seeds), priced on linear and on step-shaped true costs, under noise of x0.95-1.05
    to x0.3-3: what steers a fit is which bucket saves the most, not any one key's level. Host seconds are
    the source's."""

    def __init__(self, source: StepCosts):
        super().__init__()
        self.source, self.programs, self.host = source, source.programs, source.host

    def observe(self, key: BucketKey, seconds: float, *, warmup: bool = False) -> None:
        raise TypeError("MonotoneCosts is a read-only view: observe on the StepCosts it was made from")

    def observe_host(self, rows: int, seconds: float) -> None:
        raise TypeError("MonotoneCosts is a read-only view: observe on the StepCosts it was made from")

    def monotone(self) -> "MonotoneCosts":
        return self

    def device_seconds(self, key: BucketKey) -> float:
        cached = self._cache.get(key)
        if cached is None:
            cached = self._cache[key] = self.source.estimate(key)
        return cached


def _key_of(value, where: str) -> BucketKey:
    ok = isinstance(value, list) and len(value) == 4 and value[0] in ("prefill", "decode")
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value[1:]):
        raise ValueError(f"{where} must be [phase, rows, tokens, pages], got {value!r}")
    return BucketKey(*value)


def _seconds(values, where: str) -> list[float]:
    if not isinstance(values, list) or not all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s >= 0 for s in values):
        raise ValueError(f"{where} must be a list of seconds >= 0, got {values!r}")
    return [float(s) for s in values[-KEEP:]]


def _entries(doc: dict, name: str) -> list[dict]:
    """doc[name]: a list of objects (empty if absent)."""
    entries = doc.get(name, [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{name} must be a list of objects, got {type(entries).__name__}")
    return entries


def _observations(entry: dict, where: str) -> Observations:
    recent, warmup, count = _seconds(entry.get("recent"), f"{where}.recent"), _seconds(entry.get("warmup", []), f"{where}.warmup"), entry.get("count")
    if not recent and not warmup:
        raise ValueError(f"{where} holds no seconds (recent and warmup are empty)")
    if isinstance(count, bool) or not isinstance(count, int) or count < len(recent):
        raise ValueError(f"{where}.count must be an int >= len(recent), got {count!r}")
    return Observations(count, recent, warmup)

