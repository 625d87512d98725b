"""Resumable JSONL batch jobs: exactly one result record per non-blank input line, written as it finishes.

Two input formats: jaxinfer's own lines (below) and OpenAI Batch files (`custom_id`, `method`, `url`,
`body`; openai_batch.py translates them), detected from the first non-empty line unless `fmt` is given.
Lines are read, checked and tokenized lazily, with a bounded number in flight (`max_inflight`, default
LLM.stream's), so a job's memory does not grow with its input; only the keys are held, as 20-byte
digests (key_table.py: the resume's set of keys done, and the keys seen for numbering repeats). Before the model loads the whole input is
scanned once: its encoding, its count of lines and of lines to do, and its unknown fields (counted and
warned about; `strict_fields` makes them line errors). Fields vLLM or OpenAI define that jaxinfer does
not implement (validation.UNSUPPORTED_REQUEST_FIELDS) are always that line's error.

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
  id (`custom_id:<the custom_id as JSON>` in an OpenAI file), else `sha256:<hash of the line's bytes>`. The n-th repeat of a key (n >= 2) gets `#n` appended.
- A line is done when the output holds a record with its key. `resume=True` first checks the whole
  output: every line must be a record, else nothing is changed and the resume is refused. Only then is
  a torn last record (from a kill) cut off, or the lost newline of a whole last record restored. It
  then runs exactly the lines that are not done, appending their records.
- One job at a time per output: `<output>.lock` (flock) is held for the whole job; a second job fails
  at once, naming the first one's pid.
- `<output>.meta.json` records the settings that decide the tokens (model identity, dtype,
  quantization, seeds, sampling defaults, ...); a resume under other settings is refused with the
  differences listed (the CLI's --force-settings overrides).
- The input may be a pipe or /dev/stdin (copied to an unnamed temporary file as it is read, so the job
  can read it again after its scan); a resume reads the input again, so it needs the same lines again
  (a regular file). The output must be a regular file.
- A repeated id is an error record for each repeat (key `...#2`, `#3`, ...); the first one runs.
- Edited inputs: a line whose key is already in the output is skipped, whatever else changed in it;
  records whose key is no longer in the input are left alone.
- A request without its own seed derives one from its key, so a resumed job draws the same tokens as
  an uninterrupted one.
"""

import array
import dataclasses
import hashlib
import itertools
import json
import os
import shutil
import stat
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from jaxinfer.batch import openai as openai_batch
from jaxinfer.api import LLM, Prompt, RequestOutput
from jaxinfer.batch.output_file import ResumeError  # noqa: F401 (re-exported: the job raises it)
from jaxinfer.batch.output_file import OutputLock, check_settings, repair_output, scan_output, write_settings
from jaxinfer.batch.keys import KeyTable
from jaxinfer.scheduling.request import SAMPLING_FIELDS, SamplingParams
from jaxinfer.validation import FieldError, check_int, check_text, unknown_field_error, unsupported_field_error
from jaxinfer.scheduling.scheduler import PromptTooLongError

FORMATS = openai_batch.INPUT_FORMATS
_BOM = b"\xef\xbb\xbf"
_WIDE_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32LE"), (b"\x00\x00\xfe\xff", "UTF-32BE"), (b"\xff\xfe", "UTF-16LE"), (b"\xfe\xff", "UTF-16BE"))
_MIN_FREE_BYTES = 1 << 20  # an output directory with less free space is refused before the model loads
_BLOCK_BYTES = 1 << 20  # the input is read in blocks of this size
_MAX_PENDING_ERRORS = 1024  # error records held back while a run of bad lines is read (then the stream drains)
CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")  # LLM.encode_chat's options, with messages
_REQUEST_FIELDS = frozenset({"id", "prompt", "messages", "priority", "deadline_s", "cache_salt", *CHAT_FIELDS})
KNOWN_FIELDS = _REQUEST_FIELDS | SAMPLING_FIELDS


class LineError(ValueError):
    """A line that cannot run; the message is the reason recorded in its error record. `status_code`
    and `param` are what an OpenAI-format record reports (400 and the field at fault, by default)."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None):
        super().__init__(message)
        self.status_code, self.param = status_code, param


class InputFileError(ValueError):
    """The input file as a whole cannot be read as JSONL (an encoding or line-end problem)."""


@dataclasses.dataclass(frozen=True)
class InputLine:
    """One non-blank input line: where it is, its key, and its request (or why it has none)."""

    number: int  # 1-based, counting b"\n"
    key: str
    obj: dict | None  # its request fields (an OpenAI line: its body's, with messages or prompt)
    request_id: str | int | None  # its valid id (custom_id), else None
    problem: str | None  # the line's error, when it cannot run
    fmt: str = "jaxinfer"
    status_code: int = 400  # of its problem, in an OpenAI record
    param: str | None = None  # the field at fault, in an OpenAI record
    endpoint: dict | None = None  # an OpenAI line's {"url", "model"}
    ignored: tuple[str, ...] = ()  # its unknown fields, which it runs without


@dataclasses.dataclass
class JobSummary:
    num_ok: int = 0
    num_errors: int = 0
    num_skipped: int = 0  # already in the output (resume)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    # Per ok record, as float32 arrays (4 bytes a record, not a list's 32: a million-line job's summary stays small)
    ttfts: array.array = dataclasses.field(default_factory=lambda: array.array("f"))
    tpots: array.array = dataclasses.field(default_factory=lambda: array.array("f"))  # time per output token
    queue_times: array.array = dataclasses.field(default_factory=lambda: array.array("f"))
    ignored_fields: dict[str, int] = dataclasses.field(default_factory=dict)  # unknown field -> lines (to do) that hold it
    interrupted: bool = False

    def add(self, record: dict) -> None:
        """Count one written record (of either format)."""
        fields = openai_batch.summary_fields(record) if "custom_id" in record else record if record["status"] == "ok" else None
        if fields is None:
            self.num_errors += 1
            return
        self.num_ok += 1
        self.prompt_tokens += fields["num_prompt_tokens"]
        self.generated_tokens += fields["num_generated_tokens"]
        self.ttfts.append(fields["time_to_first_token_s"])
        self.tpots.append(fields["metrics"]["time_per_output_token_s"])
        self.queue_times.append(fields["metrics"]["queue_s"])

    def request_counts(self) -> dict:
        """The lines this run wrote, as OpenAI's batch request counts {"completed", "failed", "total"}."""
        return {"completed": self.num_ok, "failed": self.num_errors, "total": self.num_ok + self.num_errors}

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    def ttft_percentile(self, q: float) -> float:
        return _percentile(self.ttfts, q)

    def tpot_percentile(self, q: float) -> float:
        return _percentile(self.tpots, q)

    def queue_percentile(self, q: float) -> float:
        return _percentile(self.queue_times, q)


def _percentile(values: array.array, q: float) -> float:
    return float(np.percentile(np.frombuffer(values, np.float32), q)) if values else float("nan")


# ---------------------------------------------------------------- reading lines


def iter_lines(blocks: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each non-blank line of the data `blocks` hold in turn; b"\\n" is the only
    separator, and a UTF-8 BOM at the start is dropped. A line is held whole only once it is complete."""
    number, pieces, started = 0, [], False
    for block in blocks:
        if not started:
            pieces.append(block)
            head = b"".join(pieces)
            if len(head) < len(_BOM) and _BOM.startswith(head):
                continue  # too short yet to tell whether it starts with a BOM
            block, pieces, started = head[len(_BOM) :] if head.startswith(_BOM) else head, [], True
        parts = block.split(b"\n")
        if len(parts) == 1:
            pieces.append(block)
            continue
        parts[0] = b"".join(pieces) + parts[0]
        pieces = [parts.pop()]
        for raw in parts:
            number += 1
            if raw.strip():
                yield number, raw
    last = b"".join(pieces)
    if not started and last.startswith(_BOM):
        last = last[len(_BOM) :]
    if last.strip():
        yield number + 1, last


def split_lines(data: bytes) -> list[tuple[int, bytes]]:
    """(line number, bytes) of each non-blank line; b"\\n" is the only separator."""
    return list(iter_lines([data]))


class EncodingCheck:
    """Refuse, with one error for the whole file, inputs whose every line would fail the same way:
    UTF-16 or UTF-32, CR-only line ends, and a byte-order mark in the middle (files concatenated).
    Fed the input block by block (`feed`), then `finish()`."""

    def __init__(self):
        self.head, self.tail, self.newlines, self.crs, self._head_checked = b"", b"", 0, 0, False

    def feed(self, block: bytes) -> None:
        if not self._head_checked:
            self.head += block[: 8 - len(self.head)]
            if len(self.head) >= 8:
                self._check_head()
        window = self.tail + block
        middle = window.find(b"\n" + _BOM + b"{")
        if middle >= 0:
            number = self.newlines - self.tail.count(b"\n") + window[: middle + 1].count(b"\n") + 1
            raise InputFileError(f"line {number} starts with a UTF-8 byte-order mark (files concatenated?); remove it (sed -i 's/^\\xEF\\xBB\\xBF//')")
        self.newlines += block.count(b"\n")
        self.crs += block.count(b"\r")
        self.tail = window[-(len(_BOM) + 1) :]

    def _check_head(self) -> None:
        self._head_checked = True
        for bom, name in _WIDE_BOMS:
            if self.head.startswith(bom):
                raise InputFileError(f"the input is {name}, not UTF-8; convert it first (iconv -f {name} -t UTF-8)")
        if _looks_like_utf16(self.head[:8]):
            raise InputFileError("the input alternates NUL bytes and ASCII: it looks like UTF-16 without a byte-order mark; convert it to UTF-8")

    def finish(self) -> None:
        if not self._head_checked:
            self._check_head()
        if not self.newlines and self.crs > 1:
            raise InputFileError("the input's lines end in CR only (old Mac line ends); convert them to LF (tr '\\r' '\\n')")


def check_encoding(data: bytes) -> None:
    """EncodingCheck over one bytes object."""
    check = EncodingCheck()
    check.feed(data)
    check.finish()


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


def parse_line(text: str, fmt: str = "jaxinfer") -> dict:
    """A line's request: its JSON object with a valid id and exactly one of prompt / messages (an OpenAI
    line: its body's fields, see openai_batch.parse_request); LineError otherwise (and nothing else: a
    fuzz test holds it to that)."""
    return _parse(text, fmt)[0]


def _parse(text: str, fmt: str) -> tuple[dict, dict | None]:
    """(the line's request fields, an OpenAI line's endpoint or None); LineError otherwise."""
    obj = _loads(text)
    if fmt == openai_batch.FORMAT:
        try:
            return openai_batch.parse_request(obj)
        except openai_batch.RequestError as e:
            raise LineError(str(e), status_code=e.status_code, param=e.param) from None
    if not isinstance(obj, dict):
        raise LineError(f"expected a JSON object, got {type(obj).__name__}")
    if not _valid_id(obj.get("id")):
        raise LineError("missing or invalid 'id' (a string or integer is required)")
    if ("prompt" in obj) == ("messages" in obj):
        raise LineError("exactly one of 'prompt' or 'messages' is required")
    if "prompt" in obj and (not isinstance(obj["prompt"], str) or not obj["prompt"]):
        raise LineError("'prompt' must be a non-empty string")
    return obj, None


def _valid_id(value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return False
    try:
        return isinstance(value, int) or bool(check_text("id", value))
    except ValueError:
        return False


_NO_ID = object()  # an integer too long to be an id


def _id_of(text: str | None, fmt: str = "jaxinfer") -> str | int | None:
    """The line's id (custom_id) if its first JSON object has a valid one, even when the rest of the line
    is bad (a bad field, trailing garbage, an over-long number elsewhere)."""
    if text is None:
        return None
    try:
        obj, _ = json.JSONDecoder(parse_int=lambda s: int(s) if len(s) <= _MAX_INT_DIGITS else _NO_ID).raw_decode(text.lstrip())
    except Exception:  # noqa: BLE001 -- any failure only means the line has no id to keep
        return None
    if not isinstance(obj, dict):
        return None
    if fmt == openai_batch.FORMAT:
        value = obj.get("custom_id")
        return value if openai_batch.valid_custom_id(value) and _valid_id(value) else None
    return obj["id"] if _valid_id(obj.get("id")) else None


def check_fields(obj: dict, *, strict: bool = False) -> list[str]:
    """The one check of a request's field names (both formats): a field vLLM or OpenAI define that jaxinfer
    does not implement, a misspelt known field (with its hint) and, when `strict`, any unknown field are
    LineErrors naming it; returns the other unknown fields, which the line runs without."""
    unknown = {name: value for name, value in obj.items() if name not in KNOWN_FIELDS}
    unsupported = unsupported_field_error(unknown, SAMPLING_FIELDS)
    if unsupported is not None:
        raise LineError(str(unsupported), param=unsupported.field)
    ignored = []
    for name in unknown:
        if unsupported_field_error({name: "set"}, SAMPLING_FIELDS) is not None:
            continue  # a field jaxinfer does not implement, at its no-op value (n=1, stream=false, ...)
        error = unknown_field_error(name, KNOWN_FIELDS)
        if "did you mean" in str(error):
            raise LineError(str(error), param=name)
        if strict:
            raise LineError(f"{name!r} is not a known field (--strict-fields makes unknown fields errors)", param=name)
        ignored.append(name)
    return ignored


def read_lines(numbered: Iterable[tuple[int, bytes]], fmt: str = "jaxinfer", *, strict_fields: bool = False) -> Iterator[InputLine]:
    """Each non-blank line with its key (repeats numbered), parsed or with its problem, as it is read.
    Holds one entry per distinct key (to number repeats), never the lines."""
    first_line = KeyTable()  # key -> its first line
    repeats: dict[str, int] = {}  # only the keys seen more than once
    prefix = "custom_id" if fmt == openai_batch.FORMAT else "id"
    for number, raw in numbered:
        text, problem, obj, status, param, endpoint, ignored = None, None, None, 400, None, None, ()
        try:
            text = raw.decode("utf-8")
            obj, endpoint = _parse(text, fmt)
            ignored = tuple(check_fields(obj, strict=strict_fields))
        except UnicodeDecodeError as e:
            problem = f"invalid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})"
            text = raw.decode("utf-8", "replace")  # only to recover the id, when the bad byte is elsewhere
        except LineError as e:
            problem, status, param = str(e), e.status_code, e.param
        request_id = _id_of(text, fmt)
        base = f"{prefix}:{json.dumps(request_id, ensure_ascii=False)}" if request_id is not None else f"sha256:{hashlib.sha256(raw.strip()).hexdigest()[:32]}"
        first = first_line.setdefault(base, number)
        repeat = 1 if first == number else repeats.setdefault(base, 1) + 1
        if repeat > 1:
            repeats[base] = repeat
        key = base if repeat == 1 else f"{base}#{repeat}"
        if repeat > 1 and request_id is not None and problem is None:
            problem, param = f"duplicate {prefix} {request_id!r} (first on line {first})", prefix
        if problem is not None:
            obj, ignored = None, ()
        yield InputLine(number, key, obj, request_id, problem, fmt, status, param, endpoint, ignored)


def read_input(data: bytes, fmt: str = "jaxinfer") -> list[InputLine]:
    """Every non-blank line of `data` with its key (repeats numbered), parsed or with its problem."""
    return list(read_lines(iter_lines([data]), fmt))


def detect_format(numbered: Iterable[tuple[int, bytes]]) -> str:
    """'openai' when the first non-empty line is an OpenAI batch request, else 'jaxinfer'."""
    for _, raw in numbered:
        try:
            return openai_batch.FORMAT if openai_batch.looks_like(json.loads(raw.decode("utf-8"))) else "jaxinfer"
        except (ValueError, RecursionError):  # a bad first line: that line's error, in jaxinfer's format
            return "jaxinfer"
    return "jaxinfer"


def read_done(path: Path) -> KeyTable:
    """Keys already written to the output. The whole file is checked first; only then is a torn last
    record (from a kill) cut off, or a whole last record's lost newline restored."""
    scan = scan_output(path, iter_lines)
    repair_output(path, scan)
    return scan.keys


class _Input:
    """The job's input, readable again from its start while the job runs: a regular file through the
    descriptor opened at the start (so a file replaced meanwhile does not mix in), anything else (a pipe,
    /dev/stdin) copied to an unnamed temporary file as it is read."""

    def __init__(self, path: Path):
        with open(path, "rb") as f:
            if stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                self._fd = os.dup(f.fileno())
            else:
                with tempfile.TemporaryFile() as copy:
                    shutil.copyfileobj(f, copy, _BLOCK_BYTES)
                    copy.flush()
                    self._fd = os.dup(copy.fileno())

    def blocks(self) -> Iterator[bytes]:
        if self._fd is None:
            raise ValueError("the job is closed: its input is no longer open")
        offset = 0
        while block := os.pread(self._fd, _BLOCK_BYTES, offset):
            yield block
            offset += len(block)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class JobLines:
    """A job's lines (or those still to do), read again from the input each time they are iterated;
    its length is the scan's count. Reads like a list where the tests and the CLI look (len, truth,
    slices, ==), without holding the lines."""

    def __init__(self, job: "BatchJob", done: KeyTable | None, length: int):
        self._job, self._done, self._length = job, done, length

    def __iter__(self) -> Iterator[InputLine]:
        job = self._job
        for line in read_lines(iter_lines(job._input.blocks()), job.format, strict_fields=job.strict_fields):
            if self._done is None or line.key not in self._done:
                yield line

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        if isinstance(index, slice) and (index.start or 0) >= 0 and (index.stop is None or index.stop >= 0) and (index.step or 1) > 0:
            return list(itertools.islice(self, index.start, index.stop, index.step))
        return list(self)[index]

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, (list, tuple, JobLines)) else NotImplemented

    def __repr__(self) -> str:
        return f"JobLines({self._length} lines)"


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
    """Runs input lines on an LLM: one record per line, ok or error, yielded as each is ready (in the
    order they finish; a bad line's error record comes with the next output). The lines are read,
    prepared and tokenized lazily, as LLM.stream asks for more (at most `max_inflight` in flight). The
    local job and the Ray actors (ray.py) both run lines through it, so a line means the same on one
    machine as across many."""

    def __init__(self, defaults: SamplingParams, truncate: str = "none", max_inflight: int | None = None):
        self.defaults, self.truncate, self.max_inflight = defaults, truncate, max_inflight
        self.on_step = None  # LLM.stream's on_step hook (benchmarks time the steps here)

    def records(self, llm: LLM, lines: Iterable[InputLine], *, progress: bool = False) -> Iterator[dict]:
        lines, pending = iter(lines), deque()
        index_to_line: dict[int, InputLine] = {}
        counter, done = itertools.count(), [False]
        while not done[0]:
            prompts = self._prompts(llm, lines, index_to_line, pending, counter, done)
            for output in llm.stream(prompts, progress=progress, max_inflight=self.max_inflight, on_step=self.on_step):
                while pending:
                    yield pending.popleft()
                yield record_of(index_to_line.pop(output.index), output, llm.token_text)
            while pending:  # the stream ended: the input did, or a long run of bad lines filled `pending`
                yield pending.popleft()

    def _prompts(self, llm: LLM, lines: Iterator[InputLine], index_to_line: dict, pending: deque, counter, done: list) -> Iterator[Prompt]:
        """The prompts of the lines, as the stream asks for them; a line that cannot run leaves its error
        record in `pending`. Ends early (done[0] still False) when too many error records wait."""
        for line in lines:
            try:
                if line.problem is not None:
                    raise LineError(line.problem, line.status_code, line.param)
                prompt = self._prepare(llm, line, index=next(counter))
            except LineError as e:
                pending.append(error_record(line, str(e), e.status_code, e.param))
                if len(pending) >= _MAX_PENDING_ERRORS:
                    return
                continue
            index_to_line[prompt.index] = line
            yield prompt
        done[0] = True

    def _prepare(self, llm: LLM, line: InputLine, *, index: int) -> Prompt:
        obj = line.obj
        sampling = {name: obj[name] for name in SAMPLING_FIELDS if name in obj}
        try:
            params = SamplingParams.from_fields(sampling, self.defaults)
            chat = "messages" in obj
            chat_options = {name: obj[name] for name in CHAT_FIELDS if name in obj}
            if chat_options and not chat:
                raise FieldError(next(iter(chat_options)), "applies to 'messages' (a chat), not to 'prompt'")
            return llm.prepare(
                obj["messages"] if chat else obj["prompt"], params, index=index, chat=chat, truncate=self.truncate, chat_options=chat_options,
                priority=obj.get("priority", 0), deadline_s=obj.get("deadline_s"), identity=line.key, cache_salt=obj.get("cache_salt"),
            )
        except PromptTooLongError as e:
            raise LineError(f"{e} (--truncate left|right cuts it)", param="messages" if "messages" in obj else "prompt") from None
        except FieldError as e:
            raise LineError(str(e), param=e.field) from None
        except (TypeError, ValueError) as e:
            raise LineError(str(e)) from None
        except (OverflowError, RecursionError, KeyError, AttributeError) as e:  # one odd value never stops the job
            raise LineError(f"{type(e).__name__}: {e}") from None


def error_record(line: InputLine, reason: str, status_code: int = 400, param: str | None = None) -> dict:
    """The record of a line that could not run, in its format."""
    if line.fmt == openai_batch.FORMAT:
        return openai_batch.error_record(line.key, line.request_id, line.number, reason, status_code, param)
    return {"id": line.request_id, "line": line.number, "key": line.key, "status": "error", "error": f"line {line.number}: {reason}"}


def record_of(line: InputLine, output: RequestOutput, token_text=None) -> dict:
    """The record of a line that ran (or timed out, or failed in a step), in its format. `token_text`
    (token id -> its text) names the tokens of an OpenAI record's logprobs."""
    if output.finish_reason == "timeout":
        return error_record(line, "timed out: its deadline passed before it started", 408)
    if output.finish_reason == "error":
        return error_record(line, output.error, 500)
    if line.fmt == openai_batch.FORMAT:
        return openai_batch.result_record(line.key, line.request_id, line.endpoint, output, token_text)
    return _result_record(line, output)


def _result_record(line: InputLine, output: RequestOutput) -> dict:
    """The JSONL record of a line that finished, built from its RequestOutput (jaxinfer's format). With
    n > 1 its text and tokens are sample 0's and `samples` holds all n; with logprobs / prompt_logprobs,
    `logprobs` / `prompt_logprobs` list {"token_id", "logprob", "top": [[id, logprob], ...]} per token."""
    record = {
        "id": line.request_id, "line": line.number, "key": line.key, "status": "ok",
        **_sample_fields(output),
        "num_prompt_tokens": output.num_prompt_tokens, "num_cached_tokens": output.num_cached_tokens,
        "time_to_first_token_s": round(output.time_to_first_token, 4), "latency_s": round(output.latency, 4),
        "metrics": output.metrics.as_record(),
    }
    if output.prompt_logprobs is not None:
        record["prompt_logprobs"] = _logprob_records(output.prompt_token_ids, output.prompt_logprobs)
    if output.samples is not None:
        record["samples"] = [_sample_fields(sample) for sample in output.samples]
    return record


def _sample_fields(output: RequestOutput) -> dict:
    fields = {"text": output.text, "token_ids": output.token_ids, "finish_reason": output.finish_reason, "num_generated_tokens": output.num_generated_tokens}
    if output.logprobs is not None:
        fields["logprobs"] = _logprob_records(output.token_ids, output.logprobs)
    return fields


def _logprob_records(token_ids: list[int], entries: list) -> list:
    """RequestOutput's (logprob, {id: logprob}) per token as JSON-ready records (None stays None)."""
    return [
        None if entry is None else {"token_id": token, "logprob": round(entry[0], 6), "top": [[t, round(lp, 6)] for t, lp in entry[1].items()]}
        for token, entry in zip(token_ids, entries)
    ]


class BatchJob:
    """One run over an input file, appending to (or replacing) the output file.

    Construction takes the output's lock (a second job on it fails at once), scans the input (its
    encoding, its format, its lines and their unknown fields) and, on resume, checks the whole output
    and its recorded settings, so that bad files fail before the model loads and before a byte of the
    output changes. `run(llm)` then writes one record for every line that is not done, reading the
    input again as it goes; `write(records)` is the one writer, which the Ray path (ray.py) feeds with
    records from its actors. The lock is released (and the input closed) when `write` ends, or by `close()`.

    `settings` are what decide a line's tokens besides the line itself (the CLI passes the model's
    identity and the engine's numerics); the sampling defaults and `truncate` are always included, and
    the format and `strict_fields` when not the defaults. A resume under other settings raises
    ResumeError listing them, unless `force_settings`. `fmt`: 'auto' (detected from the first non-empty
    line), 'jaxinfer' or 'openai'. `max_inflight`: lines in flight at most (None: LLM.stream's default).
    """

    def __init__(
        self, input_path: Path, output: Path, defaults: SamplingParams, *, resume: bool = False, truncate: str = "none",
        settings: dict | None = None, force_settings: bool = False, fmt: str = "auto", strict_fields: bool = False, max_inflight: int | None = None,
    ):
        if fmt not in FORMATS:
            raise FieldError("format", f"must be one of {', '.join(FORMATS)}, got {fmt!r}")
        if max_inflight is not None:
            check_int("max_inflight", max_inflight, low=1)  # here too, so that the CLI refuses it before the model loads
        self.output, self.resume, self.strict_fields = output, resume, strict_fields
        self.runner = LineRunner(defaults, truncate, max_inflight)
        self.summary = JobSummary()
        self._settings = {"sampling": dataclasses.asdict(defaults), "truncate": truncate} | (settings or {})
        self._lock = OutputLock(output)
        self._input: _Input | None = None
        self._file = None
        try:
            self._read(input_path, fmt, force_settings)
        except BaseException:
            self.close()
            raise

    def _read(self, input_path: Path, fmt: str, force_settings: bool) -> None:
        self._input = _Input(input_path)  # a pipe or /dev/stdin too: copied once
        check = EncodingCheck()
        for block in self._input.blocks():
            check.feed(block)
        check.finish()
        self.format = detect_format(iter_lines(self._input.blocks())) if fmt == "auto" else fmt
        if self.format != "jaxinfer":
            self._settings["format"] = self.format
        if self.strict_fields:
            self._settings["strict_fields"] = True
        self.settings = json.loads(json.dumps(self._settings))  # as the settings file will hold them (tuples as lists)
        scan = scan_output(self.output, iter_lines) if self.resume else None
        if scan is not None and not force_settings:
            check_settings(self.output, self.settings, has_records=bool(scan.keys))
        if scan is not None:
            repair_output(self.output, scan)
        done = scan.keys if scan is not None else KeyTable()
        num_lines, num_todo, ignored = 0, 0, {}
        for line in read_lines(iter_lines(self._input.blocks()), self.format, strict_fields=self.strict_fields):
            num_lines += 1
            if line.key in done:
                continue
            num_todo += 1
            for name in line.ignored:
                ignored[name] = ignored.get(name, 0) + 1
        self.lines, self.todo = JobLines(self, None, num_lines), JobLines(self, done, num_todo)
        self.summary.num_skipped = num_lines - num_todo
        self.summary.ignored_fields = ignored
        if ignored:
            names = ", ".join(f"{k!r} ({n} lines)" for k, n in sorted(ignored.items()))
            print(f"jaxinfer: warning: unknown fields, which those lines run without: {names}; --strict-fields makes them errors", file=sys.stderr)

    def close(self) -> None:
        """Release the output's lock and close the input (idempotent)."""
        self._lock.release()
        if self._input is not None:
            self._input.close()

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
        start, written = time.perf_counter(), KeyTable()
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
        return self.summary
