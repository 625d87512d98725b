"""Resumable JSONL batch jobs: exactly one result record per non-blank input line, written as it finishes.

Input lines are JSON objects with an `id` and either `prompt` (text) or `messages` (a chat), plus
optional sampling fields (those of SamplingParams), `priority`, `deadline_s` and `cache_salt`. A line that cannot run
(bad bytes, malformed JSON, a bad field, a prompt over the context, a failed step) becomes an error
record naming its line and reason; the job goes on.

The resume contract (also in the README):

- Lines are split on b"\\n" only and decoded one by one, so a bad byte spoils only its own line. A UTF-8
  BOM at the start of the file is ignored. Blank lines get no record. A file every line of which would
  fail alike (UTF-16, CR-only line ends, a BOM in the middle) is refused whole, before the model loads.
- Each line is its own: whatever parsing or validating it raises (a 5000-digit number, a repeated key,
  nesting too deep) becomes that line's error record, with its id when its first JSON object has one.
- A line's identity is its `key`: `id:<the id as JSON>` (so 1 and "1" differ) for a line with a valid
  id, else `sha256:<hash of the line's bytes>`. The n-th repeat of a key (n >= 2) gets `#n` appended.
- A line is done when the output holds a record with its key. `resume=True` first checks the whole
  output: every line must be a record, else nothing is changed and the resume is refused. Only then is
  a torn last record (from a kill) cut off, or the lost newline of a whole last record restored. It
  then runs exactly the lines that are not done, appending their records.
- One job at a time per output: `<output>.lock` (flock) is held for the whole job; a second job fails
  at once, naming the first one's pid.
- `<output>.meta.json` records the settings that decide the tokens (model identity, dtype,
  quantization, seeds, sampling defaults, ...); a resume under other settings is refused with the
  differences listed (the CLI's --force-settings overrides).
- The input may be a pipe or /dev/stdin; a resume reads the input again, so it needs the same lines
  again (a regular file). The output must be a regular file.
- A repeated id is an error record for each repeat (key `...#2`, `#3`, ...); the first one runs.
- Edited inputs: a line whose key is already in the output is skipped, whatever else changed in it;
  records whose key is no longer in the input are left alone.
- A request without its own seed derives one from its key, so a resumed job draws the same tokens as
  an uninterrupted one.
"""

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from jaxinfer.api import LLM, Prompt, RequestOutput
from jaxinfer.batch_output import ResumeError  # noqa: F401 (re-exported: the job raises it)
from jaxinfer.batch_output import OutputLock, check_settings, repair_output, scan_output, write_settings
from jaxinfer.request import SAMPLING_FIELDS, SamplingParams
from jaxinfer.validation import check_text, unknown_field_error
from jaxinfer.scheduler import PromptTooLongError

_BOM = b"\xef\xbb\xbf"
_WIDE_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32LE"), (b"\x00\x00\xfe\xff", "UTF-32BE"), (b"\xff\xfe", "UTF-16LE"), (b"\xfe\xff", "UTF-16BE"))
_MIN_FREE_BYTES = 1 << 20  # an output directory with less free space is refused before the model loads
_REQUEST_FIELDS = frozenset({"id", "prompt", "messages", "priority", "deadline_s", "cache_salt"})
KNOWN_FIELDS = _REQUEST_FIELDS | SAMPLING_FIELDS


class LineError(ValueError):
    """A line that cannot run; the message is the reason recorded in its error record."""


class InputFileError(ValueError):
    """The input file as a whole cannot be read as JSONL (an encoding or line-end problem)."""


@dataclasses.dataclass(frozen=True)
class InputLine:
    """One non-blank input line: where it is, its key, and its parsed object (or why it has none)."""

    number: int  # 1-based, counting b"\n"
    key: str
    obj: dict | None
    request_id: str | int | None  # its valid id, else None
    problem: str | None  # the line's error, when it cannot run


@dataclasses.dataclass
class JobSummary:
    num_ok: int = 0
    num_errors: int = 0
    num_skipped: int = 0  # already in the output (resume)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    ttfts: list[float] = dataclasses.field(default_factory=list)
    tpots: list[float] = dataclasses.field(default_factory=list)  # time per output token of each ok record
    queue_times: list[float] = dataclasses.field(default_factory=list)
    ignored_fields: dict[str, int] = dataclasses.field(default_factory=dict)  # unknown field -> lines
    interrupted: bool = False

    def add(self, record: dict) -> None:
        """Count one written record."""
        if record["status"] != "ok":
            self.num_errors += 1
            return
        self.num_ok += 1
        self.prompt_tokens += record["num_prompt_tokens"]
        self.generated_tokens += record["num_generated_tokens"]
        self.ttfts.append(record["time_to_first_token_s"])
        self.tpots.append(record["metrics"]["time_per_output_token_s"])
        self.queue_times.append(record["metrics"]["queue_s"])

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    def ttft_percentile(self, q: float) -> float:
        return _percentile(self.ttfts, q)

    def tpot_percentile(self, q: float) -> float:
        return _percentile(self.tpots, q)

    def queue_percentile(self, q: float) -> float:
        return _percentile(self.queue_times, q)


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


# ---------------------------------------------------------------- reading lines


def split_lines(data: bytes) -> list[tuple[int, bytes]]:
    """(line number, bytes) of each non-blank line; b"\\n" is the only separator."""
    if data.startswith(_BOM):
        data = data[len(_BOM) :]
    return [(i, raw) for i, raw in enumerate(data.split(b"\n"), start=1) if raw.strip()]


def check_encoding(data: bytes) -> None:
    """Refuse, with one error for the whole file, inputs whose every line would fail the same way:
    UTF-16 or UTF-32, CR-only line ends, and a byte-order mark in the middle (files concatenated)."""
    for bom, name in _WIDE_BOMS:
        if data.startswith(bom):
            raise InputFileError(f"the input is {name}, not UTF-8; convert it first (iconv -f {name} -t UTF-8)")
    if _looks_like_utf16(data[:8]):
        raise InputFileError("the input alternates NUL bytes and ASCII: it looks like UTF-16 without a byte-order mark; convert it to UTF-8")
    if b"\n" not in data and data.count(b"\r") > 1:
        raise InputFileError("the input's lines end in CR only (old Mac line ends); convert them to LF (tr '\\r' '\\n')")
    middle = data.find(b"\n" + _BOM + b"{")
    if middle >= 0:
        number = data[: middle + 1].count(b"\n") + 1
        raise InputFileError(f"line {number} starts with a UTF-8 byte-order mark (files concatenated?); remove it (sed -i 's/^\\xEF\\xBB\\xBF//')")


def _looks_like_utf16(head: bytes) -> bool:
    """Eight bytes of ASCII text in UTF-16 (either byte order): every other byte NUL, the rest printable."""
    if len(head) < 8:
        return False
    for text, zeros in ((head[0::2], head[1::2]), (head[1::2], head[0::2])):
        if zeros == b"\x00" * 4 and all(32 <= byte < 127 for byte in text):
            return True
    return False


_MAX_INT_DIGITS = 4300  # Python's int-string limit (sys.get_int_max_str_digits); a longer literal is a line error


class _DuplicateKey(Exception):
    def __init__(self, name: str):
        self.name = name


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    obj = {}
    for name, value in pairs:
        if name in obj:
            raise _DuplicateKey(name)
        obj[name] = value
    return obj


def _parse_int(digits: str) -> int:
    if len(digits.lstrip("-")) > _MAX_INT_DIGITS:
        raise LineError(f"an integer of {len(digits.lstrip('-'))} digits is too long (at most {_MAX_INT_DIGITS})")
    return int(digits)


def _loads(text: str):
    """json.loads, refusing repeated keys and over-long integers; every failure is a LineError."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_int=_parse_int)
    except json.JSONDecodeError as e:
        raise LineError(f"malformed JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:
        raise LineError("malformed JSON: nested too deeply") from None
    except _DuplicateKey as e:
        raise LineError(f"duplicate key {e.name!r} in one object (which value is meant is ambiguous)") from None
    except LineError:
        raise
    except Exception as e:  # whatever else the decoder can raise stays this line's problem
        raise LineError(f"malformed JSON: {e}") from None


def parse_line(text: str) -> dict:
    """A line's JSON object with a valid id and exactly one of prompt / messages; LineError otherwise
    (and nothing else: a fuzz test holds it to that)."""
    obj = _loads(text)
    if not isinstance(obj, dict):
        raise LineError(f"expected a JSON object, got {type(obj).__name__}")
    if not _valid_id(obj.get("id")):
        raise LineError("missing or invalid 'id' (a string or integer is required)")
    if ("prompt" in obj) == ("messages" in obj):
        raise LineError("exactly one of 'prompt' or 'messages' is required")
    if "prompt" in obj and (not isinstance(obj["prompt"], str) or not obj["prompt"]):
        raise LineError("'prompt' must be a non-empty string")
    return obj


def _valid_id(value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return False
    try:
        return isinstance(value, int) or bool(check_text("id", value))
    except ValueError:
        return False


_NO_ID = object()  # an integer too long to be an id


def _id_of(text: str | None) -> str | int | None:
    """The line's id if its first JSON object has a valid one, even when the rest of the line is bad
    (a bad field, trailing garbage, an over-long number elsewhere)."""
    if text is None:
        return None
    try:
        obj, _ = json.JSONDecoder(parse_int=lambda s: int(s) if len(s) <= _MAX_INT_DIGITS else _NO_ID).raw_decode(text.lstrip())
    except Exception:  # noqa: BLE001 -- any failure only means the line has no id to keep
        return None
    return obj["id"] if isinstance(obj, dict) and _valid_id(obj.get("id")) else None


def read_input(data: bytes) -> list[InputLine]:
    """Every non-blank line with its key (repeats numbered), parsed or with its problem."""
    lines, first_line, repeats = [], {}, {}
    for number, raw in split_lines(data):
        text, problem, obj = None, None, None
        try:
            text = raw.decode("utf-8")
            obj = parse_line(text)
        except UnicodeDecodeError as e:
            problem = f"invalid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})"
            text = raw.decode("utf-8", "replace")  # only to recover the id, when the bad byte is elsewhere
        except LineError as e:
            problem = str(e)
        request_id = _id_of(text)
        base = f"id:{json.dumps(request_id, ensure_ascii=False)}" if request_id is not None else f"sha256:{hashlib.sha256(raw.strip()).hexdigest()[:32]}"
        first = first_line.setdefault(base, number)
        repeat = repeats[base] = repeats.get(base, 0) + 1
        key = base if repeat == 1 else f"{base}#{repeat}"
        if repeat > 1 and request_id is not None and problem is None:
            problem = f"duplicate id {request_id!r} (first on line {first})"
        lines.append(InputLine(number, key, obj, request_id, problem))
    return lines


def read_done(path: Path) -> set[str]:
    """Keys already written to the output. The whole file is checked first; only then is a torn last
    record (from a kill) cut off, or a whole last record's lost newline restored."""
    scan = scan_output(path, split_lines)
    repair_output(path, scan)
    return scan.keys


# ---------------------------------------------------------------- the job


def check_paths(input_path: Path, output_path: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse, before any model is loaded, a job whose files cannot work. The input may be anything
    readable (a file, a pipe, /dev/stdin); the output must be a regular file, or not exist yet."""
    if not input_path.exists():
        raise ValueError(f"input file not found: {input_path}")
    if input_path.is_dir():
        raise ValueError(f"input {input_path} is a directory; pass a JSONL file")
    if not os.access(input_path, os.R_OK):
        raise ValueError(f"input {input_path} cannot be read (permission denied)")
    if not output_path.parent.is_dir():
        raise ValueError(f"output directory does not exist: {output_path.parent}")
    if output_path.exists() and os.path.samefile(input_path, output_path) or output_path.resolve() == input_path.resolve():
        raise ValueError(f"--output {output_path} is the input file; write the results to another file")
    if output_path.exists() and not output_path.is_file():
        kind = "a directory" if output_path.is_dir() else "not a regular file"
        raise ValueError(f"--output {output_path} is {kind}; results (and --resume) need a regular file")
    if output_path.exists() and not (resume or overwrite):
        raise ValueError(f"{output_path} exists; pass --resume to continue it or --overwrite to replace it")
    _check_writable(output_path)


def _check_writable(output_path: Path) -> None:
    """Try it: append nothing to an existing output, or create and drop a temporary file beside a new one."""
    try:
        if output_path.exists():
            open(output_path, "ab").close()
        else:
            tempfile.TemporaryFile(dir=output_path.parent).close()
    except OSError as e:
        raise ValueError(f"--output {output_path} cannot be written: {e.strerror}") from None
    free = shutil.disk_usage(output_path.parent).free
    if free < _MIN_FREE_BYTES:
        raise ValueError(f"--output {output_path}: only {free} bytes free on its disk; free some space first")


class LineRunner:
    """Runs input lines on an LLM: one record per line, ok or error, yielded as each is ready (error
    records first, then results in the order they finish). The local job and the Ray actors (ray.py)
    both run lines through it, so a line means the same on one machine as across many."""

    def __init__(self, defaults: SamplingParams, truncate: str = "none"):
        self.defaults, self.truncate = defaults, truncate

    def records(self, llm: LLM, lines: list[InputLine], *, progress: bool = False) -> Iterator[dict]:
        index_to_line: dict[int, InputLine] = {}
        prompts = []
        for line in lines:
            try:
                if line.problem is not None:
                    raise LineError(line.problem)
                prompt = self._prepare(llm, line, index=len(prompts))
            except LineError as e:
                yield error_record(line, str(e))
                continue
            index_to_line[prompt.index] = line
            prompts.append(prompt)
        for output in llm.stream(prompts, progress=progress):
            yield _result_record(index_to_line[output.index], output)

    def _prepare(self, llm: LLM, line: InputLine, *, index: int) -> Prompt:
        obj = line.obj
        misspelt, _ = unknown_fields(obj)
        if misspelt is not None:
            raise LineError(misspelt)
        sampling = {name: obj[name] for name in SAMPLING_FIELDS if name in obj}
        try:
            params = SamplingParams.from_fields(sampling, self.defaults)
            chat = "messages" in obj
            return llm.prepare(
                obj["messages"] if chat else obj["prompt"], params, index=index, chat=chat, truncate=self.truncate,
                priority=obj.get("priority", 0), deadline_s=obj.get("deadline_s"), identity=line.key, cache_salt=obj.get("cache_salt"),
            )
        except PromptTooLongError as e:
            raise LineError(f"{e} (--truncate left|right cuts it)") from None
        except (TypeError, ValueError) as e:
            raise LineError(str(e)) from None
        except (OverflowError, RecursionError, KeyError, AttributeError) as e:  # one odd value never stops the job
            raise LineError(f"{type(e).__name__}: {e}") from None


def unknown_fields(obj: dict) -> tuple[str | None, list[str]]:
    """(the error for a misspelt known field, with its hint, or None; the other unknown fields, ignored)."""
    ignored = []
    for name in obj:
        if name in KNOWN_FIELDS:
            continue
        error = unknown_field_error(name, KNOWN_FIELDS)
        if "did you mean" in str(error):
            return str(error), ignored
        ignored.append(name)
    return None, ignored


def error_record(line: InputLine, reason: str) -> dict:
    return {"id": line.request_id, "line": line.number, "key": line.key, "status": "error", "error": f"line {line.number}: {reason}"}


def _result_record(line: InputLine, output: RequestOutput) -> dict:
    if output.finish_reason == "timeout":
        return error_record(line, "timed out: its deadline passed before it started")
    if output.finish_reason == "error":
        return error_record(line, output.error)
    return {
        "id": line.request_id, "line": line.number, "key": line.key,
        "status": "ok", "text": output.text, "token_ids": output.token_ids, "finish_reason": output.finish_reason,
        "num_prompt_tokens": output.num_prompt_tokens, "num_generated_tokens": output.num_generated_tokens,
        "num_cached_tokens": output.num_cached_tokens, "time_to_first_token_s": round(output.time_to_first_token, 4), "latency_s": round(output.latency, 4),
        "metrics": output.metrics.as_record(),
    }


class BatchJob:
    """One run over an input file, appending to (or replacing) the output file.

    Construction takes the output's lock (a second job on it fails at once), reads the input and, on
    resume, checks the whole output and its recorded settings, so that bad files fail before the model
    loads and before a byte of the output changes. `run(llm)` then writes one record for every line
    that is not done; `write(records)` is the one writer, which the Ray path (ray.py) feeds with
    records from its actors. The lock is released when `write` ends, or by `close()`.

    `settings` are what decide a line's tokens besides the line itself (the CLI passes the model's
    identity and the engine's numerics); the sampling defaults and `truncate` are always included.
    A resume under other settings raises ResumeError listing them, unless `force_settings`.
    """

    def __init__(
        self, input_path: Path, output: Path, defaults: SamplingParams, *, resume: bool = False, truncate: str = "none",
        settings: dict | None = None, force_settings: bool = False,
    ):
        self.output, self.resume = output, resume
        self.runner = LineRunner(defaults, truncate)
        self.summary = JobSummary()
        settings = {"sampling": dataclasses.asdict(defaults), "truncate": truncate} | (settings or {})
        self.settings = json.loads(json.dumps(settings))  # as the settings file will hold them (tuples as lists)
        self._lock = OutputLock(output)
        self._file = None
        try:
            self._read(input_path, force_settings)
        except BaseException:
            self.close()
            raise

    def _read(self, input_path: Path, force_settings: bool) -> None:
        with open(input_path, "rb") as f:  # a pipe or /dev/stdin too: read once
            data = f.read()
        check_encoding(data)
        self.lines = read_input(data)
        scan = scan_output(self.output, split_lines) if self.resume else None
        if scan is not None and not force_settings:
            check_settings(self.output, self.settings, has_records=bool(scan.keys))
        if scan is not None:
            repair_output(self.output, scan)
        done = scan.keys if scan is not None else set()
        self.todo = [line for line in self.lines if line.key not in done]
        self.summary.num_skipped = len(self.lines) - len(self.todo)

    def close(self) -> None:
        """Release the output's lock (idempotent)."""
        self._lock.release()

    def __enter__(self) -> "BatchJob":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write(self, record: dict) -> None:
        text = json.dumps(record, ensure_ascii=False)
        try:
            data = (text + "\n").encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate from the input: keep it as a JSON escape
            data = (json.dumps(record) + "\n").encode("ascii")
        self._file.write(data)
        self._file.flush()
        os.fsync(self._file.fileno())

    def run(self, llm: LLM, *, progress: bool = True) -> JobSummary:
        """Write a record for every line not yet done; Ctrl-C stops cleanly (summary.interrupted)."""
        return self.write(self.runner.records(llm, self.todo, progress=progress))

    def write(self, records: Iterable[dict]) -> JobSummary:
        """Append each record as it comes. A key already written in this run is dropped (a batch that a
        retry ran twice), so every line gets exactly one record."""
        start, written = time.perf_counter(), set()
        try:
            write_settings(self.output, self.settings)
            with open(self.output, "ab" if self.resume else "wb") as self._file:
                try:
                    for record in records:
                        if record["key"] in written:
                            continue
                        self._write(record)
                        written.add(record["key"])
                        self.summary.add(record)
                except KeyboardInterrupt:
                    self.summary.interrupted = True
        finally:
            self.close()
        self.summary.seconds = time.perf_counter() - start
        self._warn_ignored_fields()
        return self.summary

    def _warn_ignored_fields(self) -> None:
        counts: dict[str, int] = {}
        for line in self.todo:
            misspelt, ignored = unknown_fields(line.obj) if line.obj is not None and line.problem is None else (None, [])
            for name in ignored if misspelt is None else []:
                counts[name] = counts.get(name, 0) + 1
        self.summary.ignored_fields = counts
        if counts:
            names = ", ".join(f"{k!r} ({n} lines)" for k, n in sorted(counts.items()))
            print(f"jaxinfer: warning: ignored unknown fields: {names}", file=sys.stderr)
