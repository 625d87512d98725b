"""A batch job's input: bytes to numbered lines, the whole-file encoding check, each line parsed and
hardened into its request (or its problem), and its key. Host only, no jax: imports the standard library,
jaxinfer.validation, jaxinfer.scheduling.request (the sampling field names) and batch.openai / batch.keys.

- Lines are split on b"\\n" only and decoded one by one, so a bad byte spoils only its own line. A UTF-8
  BOM at the start of the file is ignored. Blank lines get no record. A file every line of which would
  fail alike (UTF-16, CR-only line ends, a BOM in the middle) is refused whole (`EncodingCheck`).
- Each line is its own: whatever parsing or validating it raises (a 5000-digit number, a repeated key,
  nesting too deep) becomes that line's problem, with its id when its first JSON object has one.
- A line's identity is its `key`: `id:<the id as JSON>` (so 1 and "1" differ) for a line with a valid
  id (`custom_id:<the custom_id as JSON>` in an OpenAI file), else `sha256:<hash of the line's bytes>`.
  The n-th repeat of a key (n >= 2) gets `#n` appended.
- `read_lines` holds one entry per distinct key (to number repeats), never the lines; `SpooledInput`
  lets the job read its input again from the start (a pipe is copied to an unnamed temporary file).
"""

import dataclasses
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from jaxinfer.batch import openai as openai_batch
from jaxinfer.batch.keys import KeyTable
from jaxinfer.scheduling.request import GUIDED_ALIASES, SAMPLING_FIELDS
from jaxinfer.validation import check_text, unknown_field_error, unsupported_field_error

_BOM = b"\xef\xbb\xbf"
_WIDE_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32LE"), (b"\x00\x00\xfe\xff", "UTF-32BE"), (b"\xff\xfe", "UTF-16LE"), (b"\xfe\xff", "UTF-16BE"))
_BLOCK_BYTES = 1 << 20  # the input is read in blocks of this size
CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")  # LLM.encode_chat's options, with messages
_REQUEST_FIELDS = frozenset({"id", "prompt", "messages", "priority", "deadline_s", "cache_salt", "embed", *CHAT_FIELDS})  # embed: batch/embed_lines.py
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


# ---------------------------------------------------------------- bytes to lines


DEFAULT_MAX_LINE_BYTES = 16 << 20  # an input line longer than this is an error record, dropped as it is read


@dataclasses.dataclass(frozen=True)
class LongLine:
    """A line over the length limit, never held whole: its length and a hash of its bytes (its key)."""

    num_bytes: int
    sha256: str


def iter_lines(blocks: Iterable[bytes], max_line_bytes: int | None = None) -> Iterator[tuple[int, bytes | LongLine]]:
    """(line number, bytes) of each non-blank line of the data `blocks` hold in turn; b"\\n" is the only
    separator, and a UTF-8 BOM at the start is dropped. A line is held whole only once it is complete,
    and only up to `max_line_bytes`: a longer one comes as a LongLine (None: no limit)."""
    splitter = _LineSplitter(max_line_bytes)
    for block in _without_bom(blocks):
        yield from splitter.feed(block)
    yield from splitter.end_line()


def _without_bom(blocks: Iterable[bytes]) -> Iterator[bytes]:
    blocks, head = iter(blocks), b""
    for block in blocks:
        head += block
        if len(head) >= len(_BOM) or not _BOM.startswith(head):
            break  # long enough to tell whether it starts with a BOM
    yield head[len(_BOM) :] if head.startswith(_BOM) else head
    yield from blocks


class _LineSplitter:
    """Cuts blocks into numbered lines, holding the current line's pieces up to the limit, and past it
    only their running hash and length."""

    def __init__(self, limit: int | None):
        self.limit, self.number, self.pieces, self.held, self.long = limit, 0, [], 0, None

    def feed(self, block: bytes) -> Iterator[tuple[int, bytes | LongLine]]:
        *ended, rest = block.split(b"\n")
        for part in ended:
            self._add(part)
            yield from self.end_line()
        self._add(rest)

    def _add(self, part: bytes) -> None:
        if self.long is not None:
            self.long[0].update(part)
            self.long[1] += len(part)
            return
        self.pieces.append(part)
        self.held += len(part)
        if self.limit is not None and self.held > self.limit:
            digest = hashlib.sha256()
            for piece in self.pieces:
                digest.update(piece)
            self.long, self.pieces, self.held = [digest, self.held], [], 0

    def end_line(self) -> Iterator[tuple[int, bytes | LongLine]]:
        """The line ends here (a newline, or the end of the data): its entry, unless it is blank."""
        self.number += 1
        if self.long is not None:
            (digest, size), self.long = self.long, None
            yield self.number, LongLine(size, digest.hexdigest()[:32])
            return
        raw, self.pieces, self.held = b"".join(self.pieces), [], 0
        if raw.strip():
            yield self.number, raw


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


def parse(text: str, fmt: str = "jaxinfer") -> tuple[dict, dict | None]:
    """(a line's request fields, an OpenAI line's endpoint or None): its JSON object with a valid id and
    exactly one of prompt / messages (an OpenAI line: its body's fields, see openai_batch.parse_request);
    LineError otherwise (and nothing else: a fuzz test holds it to that)."""
    obj = _loads(text)
    if fmt == openai_batch.FORMAT:
        try:
            fields, endpoint = openai_batch.parse_request(obj)
        except openai_batch.RequestError as e:
            raise LineError(str(e), status_code=e.status_code, param=e.param) from None
        return fields, endpoint
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
    _check_one_grammar(obj)
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


def _check_one_grammar(obj: dict) -> None:
    """A response_format that asks for a grammar beside structured_outputs (or a guided_* field) is an
    error: which of the two should win is ambiguous."""
    fmt = obj.get("response_format")
    if fmt is None or isinstance(fmt, dict) and fmt.get("type") == "text":
        return
    for name in ("structured_outputs", *GUIDED_ALIASES):
        if obj.get(name) is not None:
            raise LineError(f"response_format and {name} both ask for a grammar; give one of them", param="response_format")


def read_lines(
    numbered: Iterable[tuple[int, bytes | LongLine]], fmt: str = "jaxinfer", *, strict_fields: bool = False, max_line_bytes: int | None = None,
) -> Iterator[InputLine]:
    """Each non-blank line with its key (repeats numbered), parsed or with its problem, as it is read.
    Holds one entry per distinct key (to number repeats), never the lines. `max_line_bytes`: the limit
    iter_lines cut at, named in a LongLine's error."""
    numbering = _RepeatNumbering("custom_id" if fmt == openai_batch.FORMAT else "id")
    for number, raw in numbered:
        yield numbering.keyed(*_parse_line(number, raw, fmt, strict_fields, max_line_bytes))


def _parse_line(number: int, raw: bytes | LongLine, fmt: str, strict_fields: bool, limit: int | None) -> tuple[InputLine, str]:
    """The line parsed, or with its problem, and its key before repeats are numbered."""
    if isinstance(raw, LongLine):
        problem = f"the line is {raw.num_bytes} bytes, over the line-length limit of {limit} bytes (max_line_bytes); split the request or raise the limit"
        return InputLine(number, "", None, None, problem, fmt), f"sha256:{raw.sha256}"
    text, problem, obj, status, param, endpoint, ignored = None, None, None, 400, None, None, ()
    try:
        text = raw.decode("utf-8")
        obj, endpoint = parse(text, fmt)
        ignored = tuple(check_fields(obj, strict=strict_fields))
    except UnicodeDecodeError as e:
        problem = f"invalid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})"
        text = raw.decode("utf-8", "replace")  # only to recover the id, when the bad byte is elsewhere
    except LineError as e:
        problem, status, param = str(e), e.status_code, e.param
    request_id = _id_of(text, fmt)
    prefix = "custom_id" if fmt == openai_batch.FORMAT else "id"
    base = f"{prefix}:{json.dumps(request_id, ensure_ascii=False)}" if request_id is not None else f"sha256:{hashlib.sha256(raw.strip()).hexdigest()[:32]}"
    return InputLine(number, "", obj, request_id, problem, fmt, status, param, endpoint, ignored), base


class _RepeatNumbering:
    """Numbers the repeats of a key (`#2`, `#3`, ...); a repeated valid id is an error for each repeat."""

    def __init__(self, prefix: str):
        self.prefix, self.first_line, self.repeats = prefix, KeyTable(), {}  # key -> its first line; keys seen more than once

    def keyed(self, line: InputLine, base: str) -> InputLine:
        first = self.first_line.setdefault(base, line.number)
        repeat = 1 if first == line.number else self.repeats.setdefault(base, 1) + 1
        if repeat > 1:
            self.repeats[base] = repeat
        key = base if repeat == 1 else f"{base}#{repeat}"
        problem, param = line.problem, line.param
        if repeat > 1 and line.request_id is not None and problem is None:
            problem, param = f"duplicate {self.prefix} {line.request_id!r} (first on line {first})", self.prefix
        if problem is None:
            return dataclasses.replace(line, key=key)
        return dataclasses.replace(line, key=key, obj=None, problem=problem, param=param, ignored=())


def detect_format(numbered: Iterable[tuple[int, bytes | LongLine]]) -> str:
    """The format the lines that parse agree on: 'openai' when they are OpenAI batch requests, else
    'jaxinfer' (also when no line parses). A line that is not a JSON object, or names neither format's
    fields, has no say: it becomes an error record in the format of the others. Lines that disagree
    are an InputFileError naming one of each, raised before the model loads."""
    first: dict[str, int] = {}  # format -> the first line of it
    for number, raw in numbered:
        if isinstance(raw, LongLine):
            continue
        try:
            fmt = openai_batch.line_format(json.loads(raw.decode("utf-8")))
        except (ValueError, RecursionError):  # a bad line: its own error record, in the file's format
            continue
        if fmt is not None:
            first.setdefault(fmt, number)
        if len(first) > 1:
            raise InputFileError(
                f"line {first[openai_batch.FORMAT]} is an OpenAI batch request but line {first['jaxinfer']} is a jaxinfer line; "
                "a file holds one format (split it, or pass --format to make the other lines errors)"
            )
    return openai_batch.FORMAT if openai_batch.FORMAT in first else "jaxinfer"


class SpooledInput:
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
