"""A job's step log, `<output>.steps.jsonl` beside its output: what every engine step ran and how long it took.

`StepLog` is an `on_step` hook (runloop.OnStep). Its lines, one JSON object each:

- `{"kind": "header", ...}`: the input's path, the engine's settings (EngineConfig's fields, as given), the
  pool's pages, the job's in-flight limit and replicas: what `jaxinfer whatif` needs to replay the job;
- `{"kind": "step", "t", "key", "rows", "real_tokens", "device_s", "host_s"}` for the first `full_steps`
  steps: seconds from the first step's start, the program key, real sequences, real tokens, the step's own
  seconds, and the host's seconds since the step before ended;
- `{"kind": "program", "key", "steps", "rows", "real_tokens", "device_s", "host_s"}` per program key at the
  end: totals over every step (the first ones too), so a million-line job's log stays bounded
  (`full_steps` lines plus one per compiled program);
- `{"kind": "summary", "wall_s", "num_steps", "real_tokens", "padded_tokens", "padding"}`: wall_s from
  the first step's start to the last one's end;
- `{"kind": "costs", "table": ...}`: the engine's step-cost table (StepCosts.to_json) at the end.

Host only (no jax): the job (job.py) opens it around its run and closes it at the end; each step's host
time also refines the step-cost table's host model.
"""

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from jaxinfer.scheduling.step_costs import StepCosts

FORMAT = "jaxinfer-step-log/1"
SUFFIX = ".steps.jsonl"
DEFAULT_FULL_STEPS = 10_000  # steps written one line each; the rest only in the per-program totals


def log_path(output: Path) -> Path:
    """`<output>.steps.jsonl` beside the output's real path."""
    real = Path(os.path.realpath(output))
    return real.with_name(real.name + SUFFIX)


def engine_settings(engine_cfg) -> dict:
    """EngineConfig's fields as JSON (a bucket strategy as its described tables): what replays the job."""
    fields = {f.name: getattr(engine_cfg, f.name) for f in dataclasses.fields(engine_cfg) if f.name != "buckets"}
    if engine_cfg.buckets is not None:
        from jaxinfer.scheduling.bucket_tables import BucketTables  # noqa: PLC0415

        tables = BucketTables.from_config(engine_cfg)
        fields |= {"prefill_chunk_buckets": tables.chunk_tokens, "decode_batch_buckets": tables.decode_rows, "decode_page_buckets": tables.pages}
    return json.loads(json.dumps(fields))


@dataclasses.dataclass
class _Totals:
    steps: int = 0
    rows: int = 0
    real_tokens: int = 0
    device_s: float = 0.0
    host_s: float = 0.0


class StepLog:
    """The on_step hook that writes a job's step log; `close()` writes the totals, summary and costs."""

    def __init__(self, path: Path, header: dict, *, costs: StepCosts | None = None, full_steps: int = DEFAULT_FULL_STEPS,
                 clock: Callable[[], float] = time.perf_counter, chain=None):
        self.path, self.costs, self.full_steps, self.clock, self.chain = Path(path), costs, full_steps, clock, chain
        self._file = open(self.path, "w", encoding="utf-8")
        self._write({"kind": "header", "format": FORMAT, **header})
        self.totals: dict[tuple, _Totals] = {}
        self.num_steps = self.real_tokens = self.padded_tokens = 0
        self.first_start: float | None = None
        self.last_end: float | None = None
        self._hook_s = 0.0  # seconds the chained hook took after the last step: not the next step's host work

    def _write(self, obj: dict) -> None:
        self._file.write(json.dumps(obj) + "\n")

    def __call__(self, plan, tokens, seconds: float) -> None:
        end = self.clock()
        start = end - seconds
        host = 0.0 if self.last_end is None else max(0.0, start - self.last_end - self._hook_s)
        self.first_start = start if self.first_start is None else self.first_start
        self.last_end = end
        key, rows, real = tuple(plan.bucket), len(plan.request_ids), int(plan.num_real_tokens)
        if self.num_steps < self.full_steps:
            self._write({"kind": "step", "t": round(start - self.first_start, 6), "key": list(key), "rows": rows, "real_tokens": real,
                         "device_s": round(seconds, 6), "host_s": round(host, 6)})
        totals = self.totals.setdefault(key, _Totals())
        totals.steps, totals.rows, totals.real_tokens = totals.steps + 1, totals.rows + rows, totals.real_tokens + real
        totals.device_s += seconds
        totals.host_s += host
        self.num_steps += 1
        self.real_tokens += real
        self.padded_tokens += key[1] * key[2]
        if self.costs is not None and self.num_steps > 1:
            self.costs.observe_host(rows, host)
        if self.chain is not None:  # a refit's compile turn, a profiler: their seconds count in the wall time, not as host time
            before = self.clock()
            self.chain(plan, tokens, seconds)
            self._hook_s = self.clock() - before

    def summary(self) -> dict:
        wall = 0.0 if self.first_start is None else self.last_end - self.first_start
        padding = 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0
        return {"kind": "summary", "wall_s": round(wall, 6), "num_steps": self.num_steps, "real_tokens": self.real_tokens,
                "padded_tokens": self.padded_tokens, "padding": round(padding, 6)}

    def close(self) -> None:
        if self._file.closed:
            return
        for key, t in sorted(self.totals.items()):
            self._write({"kind": "program", "key": list(key), "steps": t.steps, "rows": t.rows, "real_tokens": t.real_tokens,
                         "device_s": round(t.device_s, 6), "host_s": round(t.host_s, 6)})
        self._write(self.summary())
        if self.costs is not None:
            self._write({"kind": "costs", "table": self.costs.to_json()})
        self._file.close()

    def __enter__(self) -> "StepLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclasses.dataclass(frozen=True)
class StepLogContents:
    """What a step log holds: its header, the steps written in full, the per-program totals, the summary
    and the cost table (None where the log was cut short: a killed job)."""

    header: dict
    steps: list[dict]
    programs: list[dict]
    summary: dict | None
    costs: StepCosts | None


_STEP_FIELDS = {"t": float, "key": list, "rows": int, "real_tokens": int, "device_s": float, "host_s": float}  # what a replay reads of a step line


def read_step_log(path: Path) -> StepLogContents:
    """Read a step log; ValueError naming the file and line for anything that is not one."""
    try:
        return _read(path)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start} of a block read): not a step log") from None


def _read(path: Path) -> StepLogContents:
    header, steps, programs, summary, costs = None, [], [], None, None
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                kind = obj["kind"]
                if kind == "costs":
                    costs = StepCosts.from_json(obj["table"])
                elif kind == "step" and header is not None:  # a first line is the header's to judge
                    _check_step(obj)
                elif kind == "program" and header is not None:
                    _check_key(obj["key"])
                elif kind == "summary":
                    _check_summary(obj)
                elif kind == "header" and obj.get("format") == FORMAT:
                    _check_header(obj)
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                if number > 1 and not line.endswith("\n"):
                    break  # a torn last line (the job was killed while writing it)
                raise ValueError(f"{path}:{number}: not a step-log line ({type(e).__name__}: {e})") from None
            if header is None and kind == "header" and str(obj.get("format", "")).startswith("jaxinfer-step-log/") and obj["format"] != FORMAT:
                raise ValueError(f"{path}: a step log of another format ({obj['format']}; this jaxinfer reads {FORMAT})")
            if header is None and (kind != "header" or obj.get("format") != FORMAT):
                raise ValueError(f"{path}: not a jaxinfer step log (its first line is not a {FORMAT} header)")
            if header is not None and kind == "header":
                raise ValueError(f"{path}:{number}: a second header (a step log holds one job's run)")
            header = obj if kind == "header" else header
            steps += [obj] if kind == "step" else []
            programs += [obj] if kind == "program" else []
            summary = obj if kind == "summary" else summary
    if header is None:
        raise ValueError(f"{path}: empty step log")
    return StepLogContents(header, steps, programs, summary, costs)


_HEADER_COUNTS = {"num_pages": 1, "max_inflight": 1, "max_inflight_given": 1, "replicas": 1, "num_skipped": 0, "records_before": 0, "default_max_tokens": 0}  # a header's counts a replay reads, at least these
_HEADER_NULLS = ("max_inflight_given", "default_max_tokens")  # counts a job writes as null (none given)


def _check_header(obj: dict) -> None:
    """The header's paths are strings and its counts (_HEADER_COUNTS, where present) whole numbers in range, null only
    where a job writes null; TypeError naming one."""
    for name in ("input", "output"):
        if name in obj and not isinstance(obj[name], str):
            raise TypeError(f"its {name} is not a path: {obj[name]!r}")
    for name, low in _HEADER_COUNTS.items():
        if name not in obj or (obj[name] is None and name in _HEADER_NULLS):
            continue
        value = obj[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise TypeError(f"its {name} is not a count of at least {low}: {value!r}")


def _check_summary(obj: dict) -> None:
    """The summary's wall_s is a number of seconds and its padding, where given, a share from 0 to 1; TypeError naming one."""
    wall, padding = obj["wall_s"], obj.get("padding")
    if not _finite(wall) or wall < 0:
        raise TypeError(f"its wall_s is not a number of seconds: {wall!r}")
    if padding is not None and (not _finite(padding) or not 0 <= padding <= 1):
        raise TypeError(f"its padding is not a share from 0 to 1: {padding!r}")


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_step(obj: dict) -> None:
    """A step line's fields (_STEP_FIELDS): present, of their kind (an int is a float too); KeyError or TypeError naming one."""
    for name, kind in _STEP_FIELDS.items():
        value = obj[name]
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else kind):
            raise TypeError(f"its {name} is not a{'n' if kind is int else ''} {kind.__name__}: {value!r}")
    _check_key(obj["key"])


def _check_key(key) -> None:
    """A step's or a program's key: [phase, rows, tokens, pages] as BucketKey holds them; TypeError naming it."""
    if (not isinstance(key, list) or len(key) != 4 or key[0] not in ("prefill", "decode")
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in key[1:])):
        raise TypeError(f"its key is not [\"prefill\" or \"decode\", rows, tokens, pages] (counts of at least 1): {key!r}")
