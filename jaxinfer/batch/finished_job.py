"""A finished batch job as the simulator replays it: its output records (either format) and its step log, read into
the requests it ran (`read_job`: prompt and output lengths, priorities and deadlines as the job read them from its
input, the lines that timed out) and the figures it measured (`FinishedJob.measured`). `jaxinfer whatif` (whatif.py)
replays it. Host only, no jax.
"""

import collections
import dataclasses
import json
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jaxinfer.batch import embed_lines
from jaxinfer.batch import input as input_lines
from jaxinfer.batch import openai as openai_batch
from jaxinfer.batch.step_log import StepLogContents, log_path, read_step_log
from jaxinfer.config import EPOCH_POLICIES, EngineConfig
from jaxinfer.scheduling import simulator
from jaxinfer.scheduling.request import SamplingParams, resolve_aliases
from jaxinfer.scheduling.simulator import SimRequest


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
        return {"wall_s": summary["wall_s"]} | line_figures(self.ttft_s, self.tpot_s, slo) | {"padding": summary.get("padding")}


def line_figures(ttft_s: np.ndarray, tpot_s: np.ndarray, slo: tuple[float, float] | None = None) -> dict:
    """TTFT p50 and p99 over the lines with a first token, and with `slo` the share of all of them (a timed-out one,
    NaN, meets none) within both SLOs: one rule for the measured figures and the simulator's."""
    figures = {"ttft_p50_s": simulator.finite_percentile(ttft_s, 50), "ttft_p99_s": simulator.finite_percentile(ttft_s, 99)}
    if slo is not None:
        figures["slo_attainment"] = round(simulator.slo_attainment(ttft_s, tpot_s, *slo), 4)
    return figures


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
    key: str | None  # the record's key (its input line's: batch/input.read_lines)


def read_job(output: Path, step_log: Path | None = None) -> FinishedJob:
    """The records of `output` (either format) of the run its step log describes, as SimRequests in input order, and
    its step log. A resumed run's log describes that run only: the records before it are left out. A line of n
    samples is n requests (each sample's tokens; the prompt they share in the job is computed by each). A line that
    timed out in the job is replayed with its deadline and its max_tokens; one that failed in a step is left out. The
    prefix every request shares (a chat template's pages) is _shared_prefix's."""
    output = Path(output)
    if output.is_dir():
        raise ValueError(f"{output}: a directory, not an output file")
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
    records, torn = _records(output, int(before))
    lines, left_out, keys = [], collections.Counter(), set()
    for number, record in records:
        line = _replayed(output, number, record, left_out)
        if line is not None and line.key is not None and line.key in keys:
            left_out["repeat an earlier record's key (one run writes each line's record once: outputs joined, or a record copied): left out of the replay"] += 1
        elif line is not None:
            lines.append(line)
            keys.add(line.key)
    if not lines:
        raise ValueError(f"{output}: no finished (ok) record to replay")
    openai = any(line.custom_id is not None for line in lines)
    input_path = Path(header.get("input", ""))
    found = _read_input(input_path, openai_batch.FORMAT if openai else "jaxinfer", {line.line for line in lines}, openai)
    notes = [f"{n} line{'s' * (n > 1)} {why}" for why, n in left_out.items()] + _other_output(path, header, output)
    if torn is not None:
        notes.append(f"the last record, {output}:{torn}, is torn (the job was killed while writing it): left out of the replay")
    if not input_path.is_file():
        notes.append(f"the job's input {input_path} is gone: its lines replay without their priorities and deadlines"
                     + (", in the order they finished" if openai else ""))
    else:
        notes += _input_changes(input_path, lines, found, openai)
    if openai:
        lines = [line._replace(line=found.lines_of.get(line.custom_id)) for line in lines]
    lines.sort(key=lambda line: (line.line is None, line.line or 0))
    return _job_of(lines, found.fields, log, header, tuple(notes))


def _other_output(path: Path, header: dict, output: Path) -> list[str]:
    """A note when the step log was written for another output path than this one: renamed or copied with its output,
    it is this job's; given with --step-log from another job, the replay is not this job's."""
    named = header.get("output")
    if not named or Path(named).resolve() == output.resolve():
        return []
    return [f"the step log {path} was written for {named}, not {output}: a log renamed or copied with its output is its job's, "
            "another job's replays that job's steps (its records_before, input and settings)"]


def _input_changes(path: Path, lines: list[_Line], found: "_Input", openai: bool) -> list[str]:
    """Notes on records the job's input no longer matches (it was edited since): a record's input line whose key is
    not the record's (the replay then takes none of that line's fields: `found.fields` loses it), a line past the
    input's end, an OpenAI record whose custom_id the input lacks."""
    if openai:
        missing = [line.custom_id for line in lines if line.custom_id not in found.lines_of]
        return [f"{len(missing)} record{'s' * (len(missing) > 1)}' custom_ids (first: {missing[0]!r}) are not in the input {path} (changed since the job): "
                "replayed in the order they finished, without priorities and deadlines"] if missing else []
    changed = sorted(line.line for line in lines if line.line in found.keys and line.key is not None and _base(found.keys[line.line]) != _base(line.key))
    for number in changed:
        found.fields.pop(number, None)
    past = [line.line for line in lines if line.line is not None and line.line > found.num_lines]
    notes = []
    if changed:
        notes.append(f"{len(changed)} input line{'s' * (len(changed) > 1)} (first: {path}:{changed[0]}) are not the line{'s' * (len(changed) > 1)} "
                     "the job ran (the input changed since: another key than the record's): replayed without their priorities and deadlines")
    if past:
        notes.append(f"{len(past)} record{'s' * (len(past) > 1)} answer lines past the end of {path} ({found.num_lines} lines; it changed since the job): "
                     "replayed without their priorities and deadlines")
    return notes


def _base(key: str) -> str:
    """A line's key without its repeat number (`#2`: read_lines numbers repeats over the lines it reads)."""
    head, _, repeat = key.rpartition("#")
    return head if head and repeat.isdigit() else key


def _key_of(record: dict) -> str | None:
    key = record.get("key")
    return key if isinstance(key, str) else None


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
    """A timed-out line's max_tokens: its own (max_tokens, else OpenAI's max_completion_tokens; 0 for an embedding line,
    which `_read_input` marks) over the job's default, at most the room its prompt leaves (None: that room). A value
    the job would have refused (not a count) gives the default."""
    default = header.get("default_max_tokens", SamplingParams().max_tokens)
    try:  # OpenAI's max_completion_tokens as the job read it (request.resolve_aliases, the one owner)
        asked = resolve_aliases({k: fields[k] for k in ("max_tokens", "max_completion_tokens") if k in fields}).get("max_tokens", default)
    except ValueError:  # both, disagreeing: the line was an error record
        asked = default
    if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 0):
        asked = default
    return max(1, room if asked is None else min(asked, room))


_REPLAY_FIELDS = ("priority", "deadline_s", "max_tokens", "max_completion_tokens")  # what a replay reads of an input line


@dataclasses.dataclass
class _Input:
    """What a replay reads of the job's input, where it is still there: the line of each custom_id (an OpenAI record
    carries none: results are written as they finish) and the replay's fields of each line that has any."""

    lines_of: dict[str, int]
    fields: dict[int, dict]
    keys: dict[int, str] = dataclasses.field(default_factory=dict)  # line number -> its key, for the lines read (a jaxinfer input's)
    num_lines: int = 0  # the input's last line number


def _read_input(path: Path, fmt: str, numbers: set[int | None], every_line: bool) -> _Input:
    """The input's custom_ids (an OpenAI file), and the keys and _REPLAY_FIELDS of the lines in `numbers` (`every_line`:
    of every line, whose number a custom_id gives), each line read as the job read it (batch/input.read_lines: an
    OpenAI line's fields are its body's); its last line number."""
    found = _Input({}, {})
    if not path.is_file():
        return found
    with open(path, "rb") as f:
        numbered = _counting(input_lines.iter_lines(iter(lambda: f.read(1 << 20), b"")), found)
        if not every_line:  # a jaxinfer record names its line: only those are read
            numbered = ((n, raw) for n, raw in numbered if n in numbers)
        for line in input_lines.read_lines(numbered, fmt):
            if not every_line:
                found.keys[line.number] = line.key
            if line.obj is None:  # an error record's line
                continue
            if every_line and isinstance(line.request_id, str):
                found.lines_of.setdefault(line.request_id, line.number)
            fields = {name: line.obj[name] for name in _REPLAY_FIELDS if name in line.obj}
            if embed_lines.options_of(line) is not None:  # prefilled and pooled, nothing generated (embed_lines.prompt_of)
                fields["max_tokens"] = 0
            if fields and _valid_fields(fields):
                found.fields[line.number] = fields
    return found


def _counting(numbered, found: _Input):
    """`numbered` as it is, its last line number kept in found.num_lines."""
    for number, raw in numbered:
        found.num_lines = number
        yield number, raw


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
    if engine.get("policy_epoch") is not None and engine.get("policy", "fcfs") not in EPOCH_POLICIES:
        engine["policy_epoch"] = None  # a log written before such an epoch was refused: it ordered nothing under that policy
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
            return _Line(_record_line(where, record), prompt, [], math.nan, 0, math.nan, record.get("custom_id"), _key_of(record))
        samples = [_count(where, sample, "num_generated_tokens") for sample in (fields.get("samples") or [fields])]
        ttft = fields["time_to_first_token_s"]
        if not isinstance(ttft, (int, float)) or isinstance(ttft, bool) or not math.isfinite(ttft) or ttft < 0:
            raise ValueError(f"{where}: the record's time_to_first_token_s is not a number of seconds: {ttft!r}")
        tpot = (fields.get("metrics") or {}).get("time_per_output_token_s")
        tpot = float(tpot) if isinstance(tpot, (int, float)) and not isinstance(tpot, bool) else math.nan
        cached = _count(where, fields, "num_cached_tokens") if fields.get("num_cached_tokens") is not None else 0
        return _Line(_record_line(where, record), prompt, samples, float(ttft), cached, tpot, record.get("custom_id"), _key_of(record))
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


def _records(output: Path, skip: int) -> tuple[list[tuple[int, dict]], int | None]:
    """(line number, record) of the output's records past its first `skip` (a resumed run's log leaves out the records
    before it), blank lines skipped; and the line number of a torn last line (a killed job's, dropped), else None.
    ValueError naming the line."""
    records, torn = [], None
    try:
        with open(output, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    if not line.endswith("\n"):
                        torn = number  # a torn last line: the job was killed while writing it
                        break
                    raise ValueError(f"{output}:{number}: not a JSON record") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{output}:{number}: not a JSON record (a JSON {type(record).__name__})")
                records.append((number, record))
    except UnicodeDecodeError as e:
        raise ValueError(f"{output}: not UTF-8 text ({e})") from None
    return records[skip:], torn
