"""Resumable JSONL batch jobs: exactly one result record per non-blank input line, written as it finishes.

Input lines are JSON objects with an `id` and either `prompt` (text) or `messages` (a chat), plus
optional sampling fields (those of SamplingParams), `priority`, `deadline_s` and `cache_salt`. A line that cannot run
(bad bytes, malformed JSON, a bad field, a prompt over the context, a failed step) becomes an error
record naming its line and reason; the job goes on.

The resume contract (also in the README):

- Lines are split on b"\\n" only and decoded one by one, so a bad byte spoils only its own line. A UTF-8
  BOM at the start of the file is ignored. Blank lines get no record.
- A line's identity is its `key`: `id:<the id as JSON>` (so 1 and "1" differ) for a line with a valid
  id, else `sha256:<hash of the line's bytes>`. The n-th repeat of a key (n >= 2) gets `#n` appended.
- A line is done when the output holds a record with its key. `resume=True` first drops a torn last
  record (from a kill), then runs exactly the lines that are not done, appending their records.
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
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from jaxinfer.api import LLM, Prompt, RequestOutput
from jaxinfer.request import SAMPLING_FIELDS, SamplingParams, check_text, unknown_field_error
from jaxinfer.scheduler import PromptTooLongError

_BOM = b"\xef\xbb\xbf"
_REQUEST_FIELDS = frozenset({"id", "prompt", "messages", "priority", "deadline_s", "cache_salt"})
KNOWN_FIELDS = _REQUEST_FIELDS | SAMPLING_FIELDS


class LineError(ValueError):
    """A line that cannot run; the message is the reason recorded in its error record."""


class ResumeError(ValueError):
    """The existing output cannot be resumed (not a jaxinfer result file, or damaged in the middle)."""


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

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    def ttft_percentile(self, q: float) -> float:
        return float(np.percentile(self.ttfts, q)) if self.ttfts else float("nan")


# ---------------------------------------------------------------- reading lines


def split_lines(data: bytes) -> list[tuple[int, bytes]]:
    """(line number, bytes) of each non-blank line; b"\\n" is the only separator."""
    if data.startswith(_BOM):
        data = data[len(_BOM) :]
    return [(i, raw) for i, raw in enumerate(data.split(b"\n"), start=1) if raw.strip()]


def parse_line(text: str) -> dict:
    """A line's JSON object with a valid id and exactly one of prompt / messages; LineError otherwise."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise LineError(f"malformed JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:
        raise LineError("malformed JSON: nested too deeply") from None
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


def _id_of(text: str | None) -> str | int | None:
    """The line's id if it has a valid one, even when the rest of the line is bad."""
    try:
        obj = json.loads(text) if text is not None else None
    except (json.JSONDecodeError, RecursionError):
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
    """Keys already written to the output; a torn last line from a kill is cut off first."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
        data = data[: data.rfind(b"\n") + 1]
    return {_record_key(path, number, raw) for number, raw in split_lines(data)}


def _record_key(path: Path, number: int, raw: bytes) -> str:
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ResumeError(f"cannot resume: {path} line {number} is not a JSON record; fix or remove that line, or use --overwrite") from None
    if isinstance(record, dict) and isinstance(record.get("key"), str):
        return record["key"]
    raise ResumeError(f"cannot resume: {path} line {number} has no 'key' (it is not a jaxinfer result record); use --overwrite to start over")


# ---------------------------------------------------------------- the job


def check_paths(input_path: Path, output_path: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse, before any model is loaded, a job whose files cannot work."""
    if not input_path.is_file():
        raise ValueError(f"input file not found: {input_path}")
    if not output_path.parent.is_dir():
        raise ValueError(f"output directory does not exist: {output_path.parent}")
    if output_path.exists() and os.path.samefile(input_path, output_path) or output_path.resolve() == input_path.resolve():
        raise ValueError(f"--output {output_path} is the input file; write the results to another file")
    if output_path.exists() and not (resume or overwrite):
        raise ValueError(f"{output_path} exists; pass --resume to continue it or --overwrite to replace it")


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
    }


class BatchJob:
    """One run over an input file, appending to (or replacing) the output file.

    Construction reads the input and, on resume, the output's done keys, so that bad files fail before
    the model loads. `run(llm)` then writes one record for every line that is not done; `write(records)`
    is the one writer, which the Ray path (ray.py) feeds with records from its actors.
    """

    def __init__(self, input_path: Path, output: Path, defaults: SamplingParams, *, resume: bool = False, truncate: str = "none"):
        self.output, self.resume = output, resume
        self.runner = LineRunner(defaults, truncate)
        self.summary = JobSummary()
        self.lines = read_input(input_path.read_bytes())
        done = read_done(output) if resume else set()
        self.todo = [line for line in self.lines if line.key not in done]
        self.summary.num_skipped = len(self.lines) - len(self.todo)
        self._file = None

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
