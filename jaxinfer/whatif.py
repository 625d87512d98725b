"""`jaxinfer whatif OUTPUT.jsonl [--policy P[,P...]] [--buckets KIND:K[,...]] [--max-num-seqs N[,N...]] [--max-prefill-tokens N[,N...]]
[--num-pages N[,N...]] [--trace TRACE.csv [--rate R] [--trace-requests N]] [--slo-ttft S] [--slo-tpot S] [--step-log FILE] [--json]`: a finished
job replayed on the simulator under other settings. No model is loaded, and this module imports no jax.

It reads the job's output records (each line's prompt and output lengths, its measured TTFT) and its step
log (`<output>.steps.jsonl`, batch/step_log.py: the engine's settings, the pool, the in-flight limit, the
step-cost table and the measured wall time and padding). The simulator (scheduling/simulator.py) first
replays the job as it ran, which gives the simulator's error on this job, then runs it under the new
settings. `--buckets KIND:K` fits a bucket strategy (bucketing/strategies.py: fitted, quantile, ...) with
K buckets per table to the job's own prompt lengths (with --trace, the trace's), decode batch sizes and pages per sequence; `default`
is the engine's default tables. A new limit (`--max-num-seqs`, `--max-prefill-tokens`) cuts the job's own table
of that dimension at it and adds it (bucket_tables.cut_table), as the default tables end at their limits;
`--num-pages` sizes the KV pool (pages, the null page included), where a smaller pool preempts. Each setting
takes several values separated by commas (`--max-num-seqs 8,16,32 --policy fcfs,prefix`): every combination is
predicted, a line each, the least predicted wall time marked. `--trace TRACE.csv` predicts a request trace (the
Azure format, arrivals as recorded or `--rate` times as fast) instead of the job's own requests, on the job's
engine settings and step costs: what this machine and model would do with that traffic. `--slo-ttft S` and
`--slo-tpot S` add the share of requests within that SLO to every figure set.
"""

import argparse
import collections
import dataclasses
import itertools
import json
import math
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm.auto import tqdm

from jaxinfer.batch import input as input_lines
from jaxinfer.batch import openai as openai_batch
from jaxinfer.batch.step_log import StepLogContents, log_path, read_step_log
from jaxinfer import config
from jaxinfer.config import EngineConfig
from jaxinfer.scheduling.bucket_tables import BucketTables, cut_table
from jaxinfer.scheduling import simulator
from jaxinfer.scheduling.request import SamplingParams
from jaxinfer.scheduling.simulator import SimRequest
from jaxinfer.validation import FieldError

FIGURES = ("wall_s", "ttft_p50_s", "ttft_p99_s", "padding")


@dataclasses.dataclass(frozen=True)
class FinishedJob:
    """What a finished job says of itself: its requests (in input order; a line of n samples is n of them), the
    measured TTFT and TPOT of each line they replay, and its step log."""

    requests: list[SimRequest]
    ttft_s: np.ndarray  # f64[L]: per line replayed (NaN: it timed out before it started)
    log: StepLogContents
    tpot_s: np.ndarray  # f64[L], NaN where a record has none
    has_samples: bool = False  # a line of n > 1 samples: replayed as n requests that each compute the prompt
    labels: tuple[str, ...] = ()  # each request's origin, for a message that names it ("input line 5", "trace request 12")
    line_starts: np.ndarray | None = None  # i64[L]: each line's first request, where a line has several (n > 1); None: one each
    left_out: tuple[str, ...] = ()  # notes on what the replay lacks: lines it leaves out and why, an input that is gone

    @property
    def engine_config(self) -> EngineConfig:
        return EngineConfig(**self.log.header["engine"])

    def measured(self, slo: tuple[float, float] | None = None) -> dict:
        """The job's figures (FIGURES), and with `slo` (TTFT, TPOT seconds) the share of its replayed lines within both."""
        summary = self.log.summary
        return {"wall_s": summary["wall_s"]} | line_figures(self.ttft_s, self.tpot_s, slo) | {"padding": summary["padding"]}


def line_figures(ttft_s: np.ndarray, tpot_s: np.ndarray, slo: tuple[float, float] | None = None) -> dict:
    """TTFT p50 and p99 over the lines with a first token, and with `slo` the share of all of them (a timed-out one,
    NaN, meets none) within both SLOs: one rule for the measured figures and the simulator's."""
    first = np.isfinite(ttft_s)
    figures = {"ttft_p50_s": _pct(ttft_s[first], 50), "ttft_p99_s": _pct(ttft_s[first], 99)}
    if slo is not None:
        figures["slo_attainment"] = round(float(np.mean(simulator.slo_met(ttft_s, tpot_s, first, *slo))), 4) if ttft_s.size else 0.0
    return figures


def _pct(values: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(values, q)), 6) if values.size else None


class _Line(NamedTuple):
    """One output record as a replay reads it: the input line it answers (None: not known), its prompt, each sample's
    generated tokens (an empty list: timed out, replayed with the line's max_tokens), its TTFT (NaN: timed out), cached
    prompt tokens, TPOT (NaN where none) and its custom_id (an OpenAI record's)."""

    line: int | None
    prompt: int
    samples: list[int]
    ttft: float
    cached: int
    tpot: float
    custom_id: str | None


def read_job(output: Path, step_log: Path | None = None) -> FinishedJob:
    """The records of `output` (either format) of the run its step log describes, as SimRequests in input order, and
    its step log. A resumed run's log describes that run only: the records before it are left out. A line of n
    samples is n requests (each sample's tokens; the prompt they share in the job is computed by each). A line that
    timed out in the job is replayed with its deadline and its max_tokens; one that failed in a step is left out. The
    prefix every request shares (a chat template's pages) is _shared_prefix's."""
    output = Path(output)
    if not output.is_file():
        raise ValueError(f"{output}: no such output file")
    path = Path(step_log) if step_log is not None else log_path(output)
    if not path.is_file():
        raise ValueError(f"--step-log {path}: no such file" if step_log is not None else
                         f"{path}: no step log beside {output} (a job run in this process writes one; a --ray job or an older jaxinfer's writes none)")
    log = read_step_log(path)
    if log.summary is None or log.costs is None:
        raise ValueError(f"{path}: no summary and step-cost table at its end: the job is still running, or was killed before it ended "
                         "(whatif replays a run that ended; a resume writes a new log)")
    _check_engine(path, log.header)
    header = log.header
    if header.get("replicas", 1) != 1:
        raise ValueError(f"{path}: the job ran {header['replicas']} data-parallel replicas; the simulator runs one")
    before = header["records_before"] if "records_before" in header else int(header.get("num_skipped") or 0) if header.get("resumed") else 0
    lines, left_out = [], collections.Counter()
    for number, record in _records(output, int(before)):
        line = _replayed(output, number, record, left_out)
        if line is not None:
            lines.append(line)
    if not lines:
        raise ValueError(f"{output}: no finished (ok) record to replay")
    openai = any(line.custom_id is not None for line in lines)
    input_path = Path(header.get("input", ""))
    found = _read_input(input_path, openai_batch.FORMAT if openai else "jaxinfer", {line.line for line in lines}, openai)
    notes = [f"{n} line{'s' * (n > 1)} {why}" for why, n in left_out.items()]
    if not input_path.is_file():
        notes.append(f"the job's input {input_path} is gone: its lines replay without their priorities and deadlines"
                     + (", in the order they finished" if openai else ""))
    if openai:
        lines = [line._replace(line=found.lines_of.get(line.custom_id)) for line in lines]
    lines.sort(key=lambda line: (line.line is None, line.line or 0))
    return _job_of(lines, found.fields, log, header, tuple(notes))


def _job_of(lines: list[_Line], fields: dict[int, dict], log: StepLogContents, header: dict, notes: tuple[str, ...]) -> FinishedJob:
    """The FinishedJob of these lines (in input order), given their input fields (priority, deadline, max_tokens)."""
    shared = _shared_prefix([line.cached for line in lines])
    max_context = int(header["engine"].get("max_context") or EngineConfig().max_context)
    requests, labels, starts = [], [], []
    for line in lines:
        extra = fields.get(line.line, {})
        priority, deadline = extra.get("priority", 0), extra.get("deadline_s")
        samples = line.samples or [_max_tokens(extra, header, max_context - line.prompt)]  # a timed-out line: as it would have run
        starts.append(len(requests))
        label = f"input line {line.line}" if line.line is not None else f"custom_id {line.custom_id!r}"
        for tokens in samples:  # a line of no generated token (max_tokens 0: prompt logprobs only) ends after its prefill, as one of one token
            requests.append(SimRequest(line.prompt, max(tokens, 1), None, priority, deadline, shared_prefix=shared))
            labels.append(label)
    several = len(requests) > len(lines)
    return FinishedJob(requests, np.array([line.ttft for line in lines], np.float64), log, np.array([line.tpot for line in lines], np.float64), several,
                       tuple(labels), np.array(starts, np.int64) if several else None, notes)


def _max_tokens(fields: dict, header: dict, room: int) -> int:
    """A timed-out line's max_tokens: its own (max_tokens or OpenAI's max_completion_tokens, SamplingParams' rule) over
    the job's default, at most the room its prompt leaves (None: that room)."""
    default = SamplingParams(max_tokens=header.get("default_max_tokens", SamplingParams().max_tokens))
    try:
        asked = SamplingParams.from_fields({k: fields[k] for k in ("max_tokens", "max_completion_tokens") if k in fields}, default).max_tokens
    except (TypeError, ValueError):
        asked = default.max_tokens
    return max(1, room if asked is None else min(asked, room))


_REPLAY_FIELDS = ("priority", "deadline_s", "max_tokens", "max_completion_tokens")  # what a replay reads of an input line


@dataclasses.dataclass
class _Input:
    """What a replay reads of the job's input, where it is still there: the line of each custom_id (an OpenAI record
    carries none: results are written as they finish) and the replay's fields of each line that has any."""

    lines_of: dict[str, int]
    fields: dict[int, dict]


def _read_input(path: Path, fmt: str, numbers: set[int | None], every_line: bool) -> _Input:
    """The input's custom_ids (an OpenAI file) and the _REPLAY_FIELDS of the lines in `numbers` (`every_line`: of every
    line, whose number a custom_id gives), each line read as the job read it (batch/input.read_lines: an OpenAI
    line's fields are its body's)."""
    found = _Input({}, {})
    if not path.is_file():
        return found
    names = [name.encode() for name in _REPLAY_FIELDS]
    with open(path, "rb") as f:
        numbered = input_lines.iter_lines(iter(lambda: f.read(1 << 20), b""))
        if not every_line:  # a jaxinfer record names its line: only those with a field to read are parsed
            numbered = ((n, raw) for n, raw in numbered if n in numbers and isinstance(raw, bytes) and any(name in raw for name in names))
        for line in input_lines.read_lines(numbered, fmt):
            if line.obj is None:  # an error record's line
                continue
            if every_line and isinstance(line.request_id, str):
                found.lines_of.setdefault(line.request_id, line.number)
            fields = {name: line.obj[name] for name in _REPLAY_FIELDS if name in line.obj}
            if fields and _valid_fields(fields):
                found.fields[line.number] = fields
    return found


def _valid_fields(fields: dict) -> bool:
    """Whether a line's priority and deadline are what the job ran it with (an int, a positive number; a line with
    others was an error record)."""
    priority, deadline = fields.get("priority", 0), fields.get("deadline_s")
    return (isinstance(priority, int) and not isinstance(priority, bool)
            and (deadline is None or (isinstance(deadline, (int, float)) and not isinstance(deadline, bool) and deadline > 0)))


def _shared_prefix(cached: list[int]) -> int:
    """The prefix every request shares (a chat template's or a system prompt's full pages), from the records' cached
    tokens: the most common count above 0 that at least 2 records and a tenth of them had (the first requests of a job
    run before any page is cached and have none); 0 when none has (a repeated line's hit is not everyone's prefix)."""
    counts = collections.Counter(c for c in cached if c > 0)
    if not counts:
        return 0
    value, times = max(counts.items(), key=lambda item: (item[1], item[0]))
    return value if times >= 2 and times >= 0.1 * len(cached) else 0


def _check_engine(path: Path, header: dict) -> None:
    """The step log's engine settings are this jaxinfer's EngineConfig fields (a log of another version may not be)."""
    engine = header.get("engine")
    if not isinstance(engine, dict):
        raise ValueError(f"{path}: the step log's header holds no engine settings")
    unknown = sorted(set(engine) - {f.name for f in dataclasses.fields(EngineConfig)})
    if unknown:
        raise ValueError(f"{path}: the step log's engine settings name fields this jaxinfer lacks: {', '.join(unknown)} (a log of another version)")
    try:
        EngineConfig(**engine)
    except (TypeError, ValueError) as e:  # FieldError is a ValueError
        raise ValueError(f"{path}: the step log's engine settings are not valid: {e}") from None


def _replayed(output: Path, number: int, record: dict, left_out: collections.Counter) -> _Line | None:
    """A record as its replay reads it: an ok one, or one that timed out in the engine's queue (its prompt counted); None
    for a line the job never queued (a bad line) or that failed in a step (counted in `left_out`). ValueError naming
    the record for a field a replay reads that is missing or not a count (a number for the TTFT)."""
    where = f"{output}:{number}"
    try:
        queued = record.get("finish_reason") if "num_prompt_tokens" in record and _is_error(record) else None
        if queued is None and _is_error(record):
            if _timed_out(record):
                left_out["timed out in the job, in records written before jaxinfer kept their prompts' sizes: left out of the replay"] += 1
            return None
        if queued == "error":
            left_out["failed in a step: left out of the replay"] += 1
            return None
        fields = record if queued is not None or "custom_id" not in record else openai_batch.summary_fields(record)
        prompt = _count(where, fields, "num_prompt_tokens", low=1)
        if queued == "timeout":
            return _Line(_record_line(where, record), prompt, [], math.nan, 0, math.nan, record.get("custom_id"))
        samples = [_count(where, sample, "num_generated_tokens") for sample in (fields.get("samples") or [fields])]
        ttft = fields["time_to_first_token_s"]
        if not isinstance(ttft, (int, float)) or isinstance(ttft, bool) or not math.isfinite(ttft) or ttft < 0:
            raise ValueError(f"{where}: the record's time_to_first_token_s is not a number of seconds: {ttft!r}")
        tpot = (fields.get("metrics") or {}).get("time_per_output_token_s")
        tpot = float(tpot) if isinstance(tpot, (int, float)) and not isinstance(tpot, bool) else math.nan
        cached = _count(where, fields, "num_cached_tokens") if fields.get("num_cached_tokens") is not None else 0
        return _Line(_record_line(where, record), prompt, samples, float(ttft), cached, tpot, record.get("custom_id"))
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{where}: not a jaxinfer or OpenAI batch result record (no {e})") from None


def _is_error(record: dict) -> bool:
    """An error record, in either format."""
    return (record.get("response") or {}).get("status_code") != 200 if "custom_id" in record else record.get("status") != "ok"


def _timed_out(record: dict) -> bool:
    """An error record of a line whose deadline passed (408), as a record written before finish_reason was kept says it."""
    if "custom_id" in record:
        return (record.get("response") or {}).get("status_code") == 408
    return ": timed out:" in str(record.get("error"))


def _count(where: str, fields: dict, name: str, low: int = 0) -> int:
    """A record's count `name` (a missing one is a KeyError); ValueError naming the record for one that is not a whole number >= low."""
    value = fields[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{where}: the record's {name} is not a count" + (f" of at least {low}" if low else "") + f": {value!r}")
    return value


def _record_line(where: str, record: dict) -> int | None:
    """The input line a record answers: its `line` (a jaxinfer record's); None for an OpenAI record (its custom_id says)."""
    if "custom_id" in record:
        return None
    return _count(where, record, "line", low=1)


def _records(output: Path, skip: int) -> list[tuple[int, dict]]:
    """(line number, record) of the output's records past its first `skip` (a resumed run's log leaves out the records
    before it); blank lines skipped, a torn last line (a killed job's) dropped. ValueError naming the line."""
    records = []
    try:
        with open(output, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    if not line.endswith("\n"):
                        break  # a torn last line: the job was killed while writing it
                    raise ValueError(f"{output}:{number}: not a JSON record") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{output}:{number}: not a JSON record (a JSON {type(record).__name__})")
                records.append((number, record))
    except UnicodeDecodeError as e:
        raise ValueError(f"{output}: not UTF-8 text ({e})") from None
    return records[skip:]


def bucket_strategy(spec: str, job: FinishedJob, cfg: EngineConfig):
    """`KIND:K` as an EngineBuckets fitted to the job's prompt lengths, decode batch sizes and pages per
    sequence; None for 'default'. ValueError naming --buckets for anything else."""
    if spec == "default":
        return None
    from jaxinfer.bucketing import strategies  # noqa: PLC0415  (offline: only whatif and the buckets CLI use it)

    kind, _, budget = spec.partition(":")
    if kind not in strategies.STRATEGY_KINDS or not budget.isdigit() or int(budget) < 1:
        raise ValueError(f"--buckets must be 'default' or KIND:K with KIND one of {', '.join(strategies.STRATEGY_KINDS)} and K >= 1, got {spec!r}")
    max_chunk = min(cfg.max_prefill_tokens, cfg.max_context)
    prompts = np.array([min(r.prompt_tokens, max_chunk) for r in job.requests])
    pages = np.array([math.ceil(min(r.prompt_tokens + r.output_tokens, cfg.max_context) / cfg.page_size) for r in job.requests])
    decode_rows = np.array([s["rows"] for s in job.log.steps if s["key"][0] == "decode"] or [cfg.max_num_seqs])
    return strategies.EngineBuckets.from_samples(kind, int(budget), chunk=prompts, rows=np.minimum(decode_rows, cfg.max_num_seqs), pages=pages)


def new_config(job: FinishedJob, *, policy: str | None = None, buckets: str | None = None, max_num_seqs: int | None = None,
               max_prefill_tokens: int | None = None, num_pages: int | None = None) -> EngineConfig:
    """The job's engine settings with the changes asked for (a bucket strategy replaces the tables it sets; a new
    limit cuts the job's table of its dimension at it, the limit added). ValueError naming the flag."""
    cfg, changes = job.engine_config, {}
    if policy is not None:
        if not any(f.name == "policy" for f in dataclasses.fields(EngineConfig)):
            raise ValueError("--policy: this jaxinfer has no scheduling policies (EngineConfig has no 'policy')")
        changes["policy"] = policy
    limits = {"max_num_seqs": (max_num_seqs, "decode_batch_buckets"), "max_prefill_tokens": (max_prefill_tokens, "prefill_chunk_buckets")}
    asked = {name: table for name, (value, table) in limits.items() if value is not None}
    changes |= {name: limits[name][0] for name in asked} | ({"num_pages": num_pages} if num_pages is not None else {})
    try:
        checked = dataclasses.replace(cfg, **changes, **{table: None for table in asked.values()})  # the new limits checked (FieldError)
        cut = {table: cut_table(getattr(cfg, table), _table_top(checked, name), reach=True) for name, table in asked.items() if getattr(cfg, table) is not None}
        cfg = dataclasses.replace(checked, **cut)
        if buckets is not None:
            engine_buckets = bucket_strategy(buckets, job, cfg)
            tables = {"prefill_chunk_buckets": None, "decode_batch_buckets": None, "decode_page_buckets": None}
            cfg = dataclasses.replace(cfg, buckets=engine_buckets, **tables)
    except FieldError as e:
        raise ValueError(f"--{e.field.replace('_', '-')} {e.problem}") from None
    return cfg


def _table_top(cfg: EngineConfig, limit: str) -> int:
    """The largest size a table under this limit holds: max_num_seqs rows, or the largest chunk."""
    return cfg.max_num_seqs if limit == "max_num_seqs" else min(cfg.max_prefill_tokens, cfg.max_context)


def _inflight(job: FinishedJob, cfg: EngineConfig) -> int:
    header = job.log.header
    return header.get("max_inflight_given") or config.INFLIGHT_PER_SEQ * cfg.max_num_seqs * header.get("replicas", 1)


class Refused(ValueError):
    """Settings under which the simulated engine refuses a request (Scheduler.check), the request named by its origin."""


def predict(job: FinishedJob, cfg: EngineConfig, slo: tuple[float, float] | None = None) -> dict:
    """The simulator's figures for the job's requests under `cfg` (FIGURES, then the rest of its summary; with `slo`,
    (TTFT, TPOT) seconds, the share of requests within both: slo_attainment)."""
    costs = job.log.costs
    pages = cfg.num_pages or job.log.header.get("num_pages")  # a --num-pages asked for, else the job's pool
    try:
        result = simulator.simulate(cfg, job.requests, costs, num_pages=pages, max_inflight=_inflight(job, cfg))
    except simulator.RequestRefused as e:
        label = job.labels[e.index] if e.index < len(job.labels) else f"request {e.index}"
        raise Refused(f"{label} cannot run under these settings: {e.reason}") from None
    ttft, tpot = result.ttft_s, result.tpot_s
    if job.line_starts is not None:  # a line of n samples: its first token is its first sample's, its TPOT its slowest's
        ttft, tpot = np.fmin.reduceat(ttft, job.line_starts), np.fmax.reduceat(tpot, job.line_starts)
    summary = result.summary() | line_figures(ttft, tpot, slo)  # per line, as the measured figures
    return {name: summary[name] for name in FIGURES} | {k: v for k, v in summary.items() if k not in FIGURES} | {"simulated_in_s": round(result.seconds, 3)}


def whatif(output: Path, *, step_log: Path | None = None, trace: Path | None = None, rate: float = 1.0, trace_requests: int | None = None,
           slo_ttft_s: float | None = None, slo_tpot_s: float | None = None, progress: bool | None = None, **settings) -> dict:
    """{"measured", "replay", "replay_error", "predicted", "changes"}: the job's figures, the simulator's replay
    of it as it ran and its relative error, and the prediction under the changes (the replay when none).

    `settings`: new_config's changes (policy, buckets, max_num_seqs, max_prefill_tokens, num_pages), each a value
    or a list of values; None keeps the job's. Lists make a grid, every combination predicted (in the order of
    the lists, the last varying fastest) into "grid" ([{"changes", "predicted", "best"}]); "predicted" and "changes"
    are then the combination of the least predicted wall time (the first of equals). `progress`: a bar over the
    grid (None: where stderr is a terminal).

    `trace`: predict a request trace (traces.load_trace's format; its first `trace_requests`, arrivals divided
    by `rate`) instead of the job's own requests, priced by the job's step costs on its engine settings. The
    grid's first line is then the trace under the job's own settings ("base"), and "trace" says what was read.

    `slo_ttft_s`, `slo_tpot_s`: an SLO (either alone leaves the other unbounded); every figure set then holds
    slo_attainment, the share of requests that finished within both, and "slo" says which."""
    slo = _slo(slo_ttft_s, slo_tpot_s)
    job = read_job(output, step_log)
    workload, read = (job, None) if trace is None else _with_trace(job, trace, rate, trace_requests)
    grid = _combinations(settings)
    if trace is not None:
        grid = [{}] + [changes for changes in grid if changes]
    targets = [new_config(workload, **changes) for changes in grid]  # a bad setting is refused before anything is simulated
    measured, replay = job.measured(slo), predict(job, job.engine_config, slo)
    runs = _predict_grid(workload, grid, targets, replay if trace is None else None, slo, progress)
    ran = [run for run in runs if run["predicted"] is not None]
    if not ran:  # every combination refused a request: the first's reason
        raise Refused(runs[0]["refused"])
    best = min(ran, key=lambda run: run["predicted"]["wall_s"])
    for run in runs:
        run["best"] = run is best
    error = {name: _relative(replay[name], measured[name]) for name in _figures(slo)}
    report = {"measured": measured, "replay": replay, "replay_error": error, "predicted": best["predicted"], "changes": best["changes"],
              "num_requests": len(job.requests), "resumed": bool(job.log.header.get("resumed")), "notes": _notes(job, replay),
              "slo": None if slo is None else {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s}}
    if read is not None:
        report |= {"trace": read, "base": runs[0]["predicted"]}
    return report | ({"grid": runs} if len(runs) > 1 or trace is not None else {})


def _notes(job: FinishedJob, replay: dict) -> list[str]:
    """What makes the replay's error more than the simulator's on this job: a resumed run's log, lines of n samples,
    lines left out, and a replay whose steps are not the job's (an interrupted job's unfinished lines, a step log of
    another job)."""
    notes = list(job.left_out)
    if job.log.header.get("resumed"):
        notes.append("the step log is of a resumed run: the measured figures and the replay cover that run's records only")
    if job.has_samples:
        notes.append("lines of n > 1 samples are replayed as n requests that each compute the prompt (the job shares it)")
    chunks = set(BucketTables.from_config(job.engine_config).chunk_tokens)
    refitted = sorted({p["key"][2] for p in job.log.programs if p["key"][0] == "prefill" and p["key"][2] not in chunks})
    if refitted:
        notes.append(f"the job's prefill steps ran chunk buckets its starting tables lack ({', '.join(map(str, refitted))}: a refit swapped its "
                     "tables during the job); the replay runs on the tables it started with")
    ran = (job.log.summary or {}).get("num_steps")
    if ran is not None and ran != replay["num_steps"]:
        notes.append(f"the replay ran {replay['num_steps']} steps where the job ran {ran} (an interrupted job's unfinished lines, n > 1 samples, "
                     "lines left out, a refit's tables, or the step log of another job): the error is not the simulator's alone")
    return notes


def _with_trace(job: FinishedJob, path: Path, rate: float, limit: int | None) -> tuple[FinishedJob, dict]:
    """The job with a trace's requests in place of its own, and what was read: a prompt with no room in the job's
    context for one generated token is left out (the engine refuses it), an output is the trace's (at least one
    token: a request the trace says generated none still ran its prefill, which samples one)."""
    from jaxinfer.bucketing import traces  # noqa: PLC0415  (only a trace's whatif reads one)

    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"--rate must be a positive number, got {rate}")
    if limit is not None and limit < 1:
        raise ValueError(f"--trace-requests must be >= 1, got {limit}")
    try:
        trace = traces.load_trace(path)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such trace file") from None
    trace = trace.head(limit) if limit is not None else trace
    max_context = job.engine_config.max_context
    fits = trace.context_tokens < max_context
    arrivals = trace.timestamps / rate
    if not np.isfinite(arrivals).all():
        row = int(np.flatnonzero(~np.isfinite(arrivals))[0])
        raise ValueError(f"{path}: request {row + 1}'s arrival is not a finite time ({trace.timestamps[row]} s" + (f" / --rate {rate:g})" if rate != 1.0 else ")"))
    requests = [SimRequest(int(p), max(int(o), 1), float(t)) for p, o, t, ok in zip(trace.context_tokens, trace.generated_tokens, arrivals, fits) if ok]
    labels = tuple(f"trace request {i + 1}" for i in np.flatnonzero(fits))
    if not requests:
        raise ValueError(f"{path}: no request of the trace fits the job's context ({max_context} tokens)")
    kept = arrivals[fits]
    read = {"path": str(path), "num_requests": len(requests), "num_left_out": int((~fits).sum()), "span_s": round(float(kept.max() - kept.min()), 3),
            "rate": rate, "max_context": max_context}
    return dataclasses.replace(job, requests=requests, labels=labels, line_starts=None, left_out=()), read


def _slo(ttft_s: float | None, tpot_s: float | None) -> tuple[float, float] | None:
    """(TTFT, TPOT) seconds, an unbounded one infinite; None when neither is given. ValueError naming the flag."""
    for flag, value in (("--slo-ttft", ttft_s), ("--slo-tpot", tpot_s)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{flag} must be a positive number of seconds, got {value}")
    return None if ttft_s is None and tpot_s is None else (ttft_s or math.inf, tpot_s or math.inf)


def _figures(slo) -> tuple[str, ...]:
    return FIGURES + (("slo_attainment",) if slo is not None else ())


def _predict_grid(job: FinishedJob, grid: list[dict], targets: list[EngineConfig], replay: dict | None, slo, progress: bool | None) -> list[dict]:
    """[{"changes", "predicted"}] of each combination (`replay`, where given, when nothing changes), with a bar over several;
    in a grid, a combination that refuses a request is kept with "predicted" None and "refused" naming it (one alone raises)."""
    show = len(grid) > 1 and (progress if progress is not None else sys.stderr.isatty())
    runs = []
    with tqdm(total=len(grid), desc="whatif", unit="setting", disable=not show) as bar:
        for changes, cfg in zip(grid, targets):
            try:
                runs.append({"changes": changes, "predicted": replay if not changes and replay is not None else predict(job, cfg, slo)})
            except Refused as e:
                if len(grid) == 1:
                    raise
                runs.append({"changes": changes, "predicted": None, "refused": str(e)})
            bar.update()
    return runs


def _combinations(settings: dict) -> list[dict]:
    """Every combination of the settings given (a list each, or one value), in order, the last varying fastest."""
    given = {name: value if isinstance(value, list) else [value] for name, value in settings.items() if value is not None}
    for name, values in given.items():
        if not values:
            raise ValueError(f"--{name.replace('_', '-')} needs at least one value")
    return [dict(zip(given, values)) for values in itertools.product(*given.values())]


def _relative(predicted, measured) -> float | None:
    if predicted is None or measured is None or measured == 0:
        return None
    return round((predicted - measured) / measured, 4)


def format_report(report: dict) -> str:
    """The three columns (measured, replay, predicted) and the replay's error, one figure a line; for a grid, the
    first two and the replay's error, then a line per combination; for a trace, what was read first."""
    grid, trace = report.get("grid"), report.get("trace")
    if trace is not None:
        head = (f"whatif: trace {trace['path']}: {trace['num_requests']} requests arriving over {trace['span_s']:.1f} s (rate {trace['rate']:g})"
                + (f", {trace['num_left_out']} left out (prompts of {trace['max_context']} tokens or more)" if trace["num_left_out"] else "")
                + f"; priced by the job's step costs. The simulator on the job itself ({report['num_requests']} requests):")
    else:
        head = f"whatif: {report['num_requests']} requests; " + (f"{len(grid)} settings" if grid else f"changes: {_flags(report['changes']) or 'none (the replay of the job itself)'}")
    lines = [head] + [f"note: {note}" for note in report["notes"]]
    lines.append(f"{'':<14} {'measured':>12} {'replay':>12} {'error':>8}" + ("" if grid else f" {'predicted':>12}"))
    for name in report["replay_error"]:  # FIGURES, and slo_attainment under an SLO
        err = report["replay_error"][name]
        lines.append(f"{name:<14} {_fmt(report['measured'][name]):>12} {_fmt(report['replay'][name]):>12} {'-' if err is None else f'{err:+.1%}':>8}"
                     + ("" if grid else f" {_fmt(report['predicted'][name]):>12}"))
    if "buckets" in report["changes"]:
        lines.append("(--buckets is whatif's: a job takes such tables from Python, EngineConfig(buckets=...) with bucketing.strategies.EngineBuckets, "
                     "or fits its own with jaxinfer generate --plan)")
    return "\n".join(lines + (_grid_lines(report) if grid else []))


def _grid_lines(report: dict) -> list[str]:
    """A line per combination: its flags, predicted figures and wall time over the job's own settings'; * marks the least."""
    base = report["base"] if "base" in report else report["replay"]  # the trace's base is None where those settings refuse a request
    names = [_flags(run["changes"]) or "(the job's settings)" for run in report["grid"]]
    width = max(map(len, names))
    slo = report["slo"] is not None
    lines = ["", f"  {'settings':<{width}} {'wall_s':>10} {'/ base':>7} {'ttft_p50_s':>11} {'ttft_p99_s':>11} {'padding':>8} {'preempted':>9}" + (f" {'SLO met':>8}" if slo else "")]
    for name, run in zip(names, report["grid"]):
        p, mark = run["predicted"], "*" if run["best"] else " "
        if p is None:
            lines.append(f"  {name:<{width}} refused: {run['refused']}")
            continue
        ratio = _fmt(p["wall_s"] / base["wall_s"] if base and base["wall_s"] else None, "{:.2f}x")
        lines.append(f"{mark} {name:<{width}} {_fmt(p['wall_s']):>10} {ratio:>7} {_fmt(p['ttft_p50_s']):>11} {_fmt(p['ttft_p99_s']):>11}"
                     f" {_fmt(p['padding']):>8} {p['num_preemptions']:>9}" + (f" {p['slo_attainment']:>8.1%}" if slo else ""))
    what = "the trace under the job's own settings" if "base" in report else "the replay, the job's own settings"
    return lines + [f"* the least predicted wall time; base: {what}"]


def _flags(changes: dict) -> str:
    return ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in changes.items())


def _fmt(value, spec: str = "{:.4f}") -> str:
    return "-" if value is None else spec.format(value)


def add_subparser(commands) -> argparse.ArgumentParser:
    """Registers `whatif` on the CLI's sub-parsers."""
    parser = commands.add_parser(
        "whatif", help="predict a finished job's wall time, TTFT and padding under other settings (no model)",
        description=__doc__.split("\n\n")[0] + " " + __doc__.split("\n\n")[1],
    )
    parser.add_argument("output", type=Path, metavar="OUTPUT.jsonl", help="a finished job's output (its step log lies beside it)")
    parser.add_argument("--policy", default=None, type=_values(str, getattr(config, "POLICIES", None)), metavar="P[,P...]",
                        help=f"scheduling policy to simulate: {', '.join(getattr(config, 'POLICIES', ()))} (default: the job's)")
    parser.add_argument("--buckets", default=None, type=_values(str), metavar="KIND:K[,...]",
                        help="bucket tables: a strategy fitted to the job (with --trace, to the trace) with K buckets each (e.g. fitted:16), or default")
    parser.add_argument("--max-num-seqs", type=_values(int), default=None, metavar="N[,N...]", help="sequences decoded together at most (default: the job's)")
    parser.add_argument("--max-prefill-tokens", type=_values(int), default=None, metavar="N[,N...]",
                        help="prefill tokens per step at most, the largest chunk (default: the job's)")
    parser.add_argument("--num-pages", type=_values(int), default=None, metavar="N[,N...]", help="KV pool pages, the null page included (default: the job's pool)")
    parser.add_argument("--trace", type=Path, default=None, metavar="TRACE.csv",
                        help="predict this request trace (TIMESTAMP,ContextTokens,GeneratedTokens, the Azure format) instead of the job's requests, "
                             "on the job's engine settings and step costs")
    parser.add_argument("--rate", type=float, default=1.0, metavar="R", help="with --trace: arrivals R times as fast (default 1: as recorded)")
    parser.add_argument("--trace-requests", type=int, default=None, metavar="N", help="with --trace: its first N requests (default: all)")
    parser.add_argument("--slo-ttft", type=float, default=None, metavar="S", help="an SLO's time to first token, seconds: every figure set gains the share "
                        "of requests within it and --slo-tpot (slo_attainment, DistServe's goodput share)")
    parser.add_argument("--slo-tpot", type=float, default=None, metavar="S", help="an SLO's time per output token after the first, seconds")
    parser.add_argument("--step-log", type=Path, default=None, metavar="FILE", help="the job's step log (default: OUTPUT.steps.jsonl)")
    parser.add_argument("--json", action="store_true", help="print one JSON object: measured, replay, replay_error, predicted (and grid)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="no progress bar over a grid of settings")
    parser.set_defaults(func=run)
    return parser


def _values(kind: type, choices=None):
    """An argparse type: one value, or several separated by commas (a list: the grid's axis)."""
    def parse(text: str):
        values = [part.strip() for part in text.split(",")]
        try:
            values = [kind(v) for v in values if v]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects {kind.__name__} values separated by commas, got {text!r}") from None
        if not values or (choices is not None and any(v not in choices for v in values)):
            raise argparse.ArgumentTypeError(f"expects one or more of {', '.join(choices)} separated by commas, got {text!r}" if choices else f"got no value in {text!r}")
        return values[0] if len(values) == 1 else values
    return parse


def run(args) -> int:
    if args.trace is None and (args.rate != 1.0 or args.trace_requests is not None):
        raise ValueError("--rate and --trace-requests work with --trace")
    report = whatif(args.output, step_log=args.step_log, trace=args.trace, rate=args.rate, trace_requests=args.trace_requests,
                    slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot, progress=args.progress, policy=args.policy, buckets=args.buckets, max_num_seqs=args.max_num_seqs,
                    max_prefill_tokens=args.max_prefill_tokens, num_pages=args.num_pages)
    print(json.dumps(report, allow_nan=False) if args.json else format_report(report))
    return 0
