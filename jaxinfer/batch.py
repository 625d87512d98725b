"""Resumable JSONL batch jobs: one result line per input line, written as each request finishes.

Input lines are JSON objects with an `id` and either `prompt` (text) or `messages` (a chat), plus
optional sampling fields. A line that cannot run (malformed JSON, a bad field, a prompt over the
context) becomes an error record naming its line and reason; the job goes on. Results are appended and
flushed as they finish, so a job killed with SIGKILL loses only the work in flight: `resume=True` skips
every id (or line, for records without an id) already in the output, after dropping a torn last line.
"""

import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np

from jaxinfer.api import LLM, Prompt, RequestOutput
from jaxinfer.request import SamplingParams
from jaxinfer.scheduler import check_request

_SAMPLING_FIELDS = {  # JSONL field -> (accepted types, description)
    "temperature": ((int, float), "a number"),
    "top_k": ((int,), "an integer"),
    "top_p": ((int, float), "a number"),
    "seed": ((int,), "an integer"),
    "max_tokens": ((int,), "an integer"),
    "stop": ((list, str), "a string or a list of strings"),
    "stop_token_ids": ((list,), "a list of integers"),
    "ignore_eos": ((bool,), "true or false"),
}


class LineError(ValueError):
    """A line that cannot run; the message is the reason recorded in its error record."""


@dataclasses.dataclass
class JobSummary:
    num_ok: int = 0
    num_errors: int = 0
    num_skipped: int = 0  # already in the output (resume)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    ttfts: list[float] = dataclasses.field(default_factory=list)
    interrupted: bool = False

    def add(self, output: RequestOutput) -> None:
        self.num_ok += 1
        self.prompt_tokens += output.num_prompt_tokens
        self.generated_tokens += output.num_generated_tokens
        self.ttfts.append(output.time_to_first_token)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    def ttft_percentile(self, q: float) -> float:
        return float(np.percentile(self.ttfts, q)) if self.ttfts else float("nan")


def sampling_from_line(obj: dict, defaults: SamplingParams) -> SamplingParams:
    """The line's sampling fields over the job's defaults."""
    overrides = {}
    for name, (types, description) in _SAMPLING_FIELDS.items():
        if name not in obj:
            continue
        value = obj[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise LineError(f"field {name!r} must be {description}, got {value!r}")
        overrides[name] = tuple(value) if isinstance(value, list) else value
    try:
        return dataclasses.replace(defaults, **overrides)
    except (TypeError, ValueError) as e:
        raise LineError(str(e)) from None


def parse_line(text: str) -> dict:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise LineError(f"malformed JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(obj, dict):
        raise LineError(f"expected a JSON object, got {type(obj).__name__}")
    if "id" not in obj or not isinstance(obj["id"], (str, int)) or isinstance(obj["id"], bool):
        raise LineError("missing or invalid 'id' (a string or integer is required)")
    if ("prompt" in obj) == ("messages" in obj):
        raise LineError("exactly one of 'prompt' or 'messages' is required")
    if "prompt" in obj and (not isinstance(obj["prompt"], str) or not obj["prompt"]):
        raise LineError("'prompt' must be a non-empty string")
    return obj


def read_done(path: Path) -> set[str]:
    """Keys (`id:<id>` / `line:<n>`) already written; a torn last line from a kill is cut off first."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
        data = data[: data.rfind(b"\n") + 1]
    done = set()
    for line in data.decode().splitlines():
        record = json.loads(line)
        done.add(f"id:{record['id']}" if record.get("id") is not None else f"line:{record['line']}")
    return done


def _truncate(ids: list[int], keep: int, side: str) -> list[int]:
    if len(ids) <= keep or side == "none":
        return ids
    return ids[-keep:] if side == "left" else ids[:keep]


class BatchJob:
    """One run over an input file, appending to the output file."""

    def __init__(self, llm: LLM, output: Path, defaults: SamplingParams, truncate: str = "none"):
        self.llm, self.output, self.defaults, self.truncate = llm, output, defaults, truncate
        self.summary = JobSummary()
        self._index_to_line: dict[int, tuple[int, object]] = {}
        self._file = None

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def _error(self, line_number: int, request_id, reason: str) -> None:
        self.summary.num_errors += 1
        self._write({"id": request_id, "line": line_number, "status": "error", "error": reason})

    def _prepare(self, line_number: int, obj: dict) -> Prompt:
        params = sampling_from_line(obj, self.defaults)
        try:
            ids = self.llm.encode_chat(obj["messages"]) if "messages" in obj else self.llm.encode(obj["prompt"])
        except ValueError as e:
            raise LineError(str(e)) from None
        ids = _truncate(ids, self.llm.engine_config.max_context - params.max_tokens, self.truncate)
        try:
            check_request(self.llm.engine_config, self.llm.engine.num_pages, len(ids), params.max_tokens)
        except ValueError as e:
            raise LineError(str(e)) from None
        priority, deadline = obj.get("priority", 0), obj.get("deadline_s")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise LineError(f"field 'priority' must be an integer, got {priority!r}")
        if deadline is not None and (not isinstance(deadline, (int, float)) or isinstance(deadline, bool) or deadline <= 0):
            raise LineError(f"field 'deadline_s' must be a positive number of seconds, got {deadline!r}")
        return Prompt(len(self._index_to_line), ids, params, priority=priority, deadline_s=deadline)

    def _collect(self, input_path: Path, done: set[str]) -> list[Prompt]:
        prompts, seen = [], set()
        for line_number, text in enumerate(input_path.read_text().splitlines(), start=1):
            if not text.strip():
                continue
            request_id = None
            if f"line:{line_number}" in done:  # an error record without an id
                self.summary.num_skipped += 1
                continue
            try:
                obj = parse_line(text)
                request_id = obj["id"]
                if f"id:{request_id}" in done:
                    self.summary.num_skipped += 1
                    continue
                if request_id in seen:
                    raise LineError(f"duplicate id {request_id!r}")
                seen.add(request_id)
                prompt = self._prepare(line_number, obj)
            except LineError as e:
                self._error(line_number, request_id, f"line {line_number}: {e}")
                continue
            self._index_to_line[prompt.index] = (line_number, request_id)
            prompts.append(prompt)
        return prompts

    def _record(self, output: RequestOutput) -> dict:
        line_number, request_id = self._index_to_line[output.index]
        if output.finish_reason == "timeout":
            return {"id": request_id, "line": line_number, "status": "error", "error": f"line {line_number}: timed out: its deadline passed before it started"}
        return {
            "id": request_id, "line": line_number, "status": "ok", "text": output.text,
            "token_ids": output.token_ids, "finish_reason": output.finish_reason,
            "num_prompt_tokens": output.num_prompt_tokens, "num_generated_tokens": output.num_generated_tokens,
            "time_to_first_token_s": round(output.time_to_first_token, 4), "latency_s": round(output.latency, 4),
        }

    def run(self, input_path: Path, *, resume: bool, progress: bool = True) -> JobSummary:
        done = read_done(self.output) if resume else set()
        start = time.perf_counter()
        with open(self.output, "a" if resume else "w", encoding="utf-8") as self._file:
            prompts = self._collect(input_path, done)
            try:
                for output in self.llm.stream(prompts, progress=progress):
                    record = self._record(output)
                    self._write(record)
                    if record["status"] == "ok":
                        self.summary.add(output)
                    else:
                        self.summary.num_errors += 1
            except KeyboardInterrupt:
                self.summary.interrupted = True
        self.summary.seconds = time.perf_counter() - start
        return self.summary
