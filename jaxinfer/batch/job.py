"""Resumable JSONL batch jobs: exactly one result record per non-blank input line, written as it finishes.

Two input formats: jaxinfer's own lines (below) and OpenAI Batch files (`custom_id`, `method`, `url`,
`body`; batch/openai.py translates them), detected from the lines that parse unless `fmt` is given (lines
that disagree refuse the file before the model loads; a line that does not parse is an error record in
the file's format).
This module owns running the lines (`LineRunner`) and the job around them (`BatchJob`: its lock, its
resume, its fsynced writes); batch/input.py reads and keys the lines, batch/records.py builds the records,
batch/output_file.py owns the output's lock, settings and scan. Imports jaxinfer.api (and through it jax).
Lines are read, checked and tokenized lazily, with a bounded number in flight (`max_inflight`, default
LLM.stream's), so a job's memory does not grow with its input; only the keys are held, as 20-byte
digests (batch/keys.py: the resume's set of keys done, and the keys seen for numbering repeats). Before the model loads the whole input is
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
  A line over `max_line_bytes` (16 MiB) is its error record, never held whole.
- Each line is its own: whatever parsing or validating it raises (a 5000-digit number, a repeated key,
  nesting too deep) becomes that line's error record, with its id when its first JSON object has one.
- A line's identity is its `key`: `id:<the id as JSON>` (so 1 and "1" differ) for a line with a valid
  id (`custom_id:<the custom_id as JSON>` in an OpenAI file), else `sha256:<hash of the line's bytes>`. The n-th repeat of a key (n >= 2) gets `#n` appended.
- A line is done when the output holds a record with its key. `resume=True` first checks the whole
  output: every line must be a record, else nothing is changed and the resume is refused. Only then is
  a torn last record (from a kill) cut off, or the lost newline of a whole last record restored. It
  then runs exactly the lines that are not done, appending their records.
- One job at a time per output: an flock on the output file itself is held for the whole job, so a
  second job fails at once by whatever name (a symlink, a hard link) it reaches the file, naming the
  first one's pid (from `<output>.lock`, a note the job creates and never follows or truncates).
- `<output>.meta.json` (beside the output's real path) records the settings that decide the tokens
  (model identity, dtype, quantization, seeds, sampling defaults, ...); a resume under other settings is
  refused with the differences listed (the CLI's --force-settings overrides). A resume records them
  only with its first record, so one with nothing to do leaves them as they were.
- Ctrl-C and SIGTERM stop the job cleanly: the records written are kept and `summary.interrupted` set.
- The input may be a pipe or /dev/stdin (copied to an unnamed temporary file as it is read, so the job
  can read it again after its scan); a resume reads the input again, so it needs the same lines again
  (a regular file). The output must be a regular file.
- A repeated id is an error record for each repeat (key `...#2`, `#3`, ...); the first one runs.
- Edited inputs: a line whose key is already in the output is skipped, whatever else changed in it;
  records whose key is no longer in the input are left alone.
- A request without its own seed derives one from its key, so a resumed job draws the same tokens as
  an uninterrupted one.
"""

import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

from jaxinfer.api import LLM, Prompt
from jaxinfer.batch import embed_lines, step_log
from jaxinfer.batch import openai as openai_batch
from jaxinfer.batch.input import CHAT_FIELDS, DEFAULT_MAX_LINE_BYTES, EncodingCheck, InputLine, LineError, SpooledInput, detect_format, iter_lines, read_lines
from jaxinfer.batch.keys import KeyTable
from jaxinfer.batch.output_file import ResumeError  # noqa: F401 (re-exported: the job raises it)
from jaxinfer.batch.output_file import (
    RESOLVED, OutputLock, check_resolved, check_settings, check_settings_path, check_side_file_names, read_settings, repair_output, scan_output, write_settings,
)
from jaxinfer.batch.records import JobSummary, error_record, record_of, token_bytes_of
from jaxinfer.config import INFLIGHT_PER_SEQ
from jaxinfer.scheduling.request import SAMPLING_FIELDS, SamplingParams
from jaxinfer.scheduling.scheduler import PromptTooLongError
from jaxinfer.validation import FieldError, check_int

FORMATS = openai_batch.INPUT_FORMATS
_MIN_FREE_BYTES = 1 << 20  # an output directory with less free space is refused before the model loads
_MAX_PENDING_ERRORS = 1024  # error records held back while a run of bad lines is read (then the stream drains)


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
    check_side_file_names(output_path)
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

    def records(self, llm: LLM | None, lines: Iterable[InputLine], *, progress: bool = False, total: int | None = None) -> Iterator[dict]:
        """`total`: the lines expected to run, for the progress bar (BatchJob.num_runnable)."""
        if llm is None:  # every line is an error (BatchJob.num_runnable == 0): no model is needed
            yield from (self._error_of(line) for line in lines)
            return
        lines, pending, token_bytes = iter(lines), deque(), token_bytes_of(llm.tokenizer)
        index_to_line: dict[int, InputLine] = {}
        counter, done, num_outputs = itertools.count(), [False], 0
        while not done[0]:
            prompts = self._prompts(llm, lines, index_to_line, pending, counter, done)
            left = None if total is None else max(total - num_outputs, 0)  # a stream after a long run of bad lines counts the rest
            for output in llm.stream(prompts, progress=progress, max_inflight=self.max_inflight, on_step=self.on_step, total=left):
                while pending:
                    yield pending.popleft()
                num_outputs += 1
                yield record_of(index_to_line.pop(output.index), output, llm.token_text, token_bytes)
            while pending:  # the stream ended: the input did, or a long run of bad lines filled `pending`
                yield pending.popleft()

    def _prompts(self, llm: LLM, lines: Iterator[InputLine], index_to_line: dict, pending: deque, counter, done: list) -> Iterator[Prompt]:
        """The prompts of the lines, as the stream asks for them; a line that cannot run leaves its error
        record in `pending`. Ends early (done[0] still False) when too many error records wait."""
        for line in lines:
            try:
                if line.problem is not None:
                    raise LineError(line.problem, line.status_code, line.param)
                prompt = self.prompt_of(llm, line, index=next(counter))
                if embed_lines.options_of(line) is None:
                    line = self._echo_as_scored(llm, line, prompt)
            except LineError as e:
                pending.append(error_record(line, str(e), e.status_code, e.param))
                if len(pending) >= _MAX_PENDING_ERRORS:
                    return
                continue
            index_to_line[prompt.index] = line
            yield prompt
        done[0] = True

    def prompt_of(self, llm: LLM, line: InputLine, *, index: int) -> Prompt:
        """The line's prompt as the job runs it: an embedding line's (prefilled, pooled, nothing generated), else
        a generation's; LineError for a line that cannot run."""
        if embed_lines.options_of(line) is not None:
            return embed_lines.prompt_of(llm, line, index=index)
        return self._prepare(llm, line, index=index)

    def host_error(self, line: InputLine) -> LineError | None:
        """The error a parsed line's sampling fields give before any model is needed (None: it may run)."""
        if line.problem is not None:
            return LineError(line.problem, line.status_code, line.param)
        try:
            self._sampling_params(line.obj)
        except FieldError as e:
            return LineError(str(e), param=e.field)
        except (TypeError, ValueError, OverflowError) as e:
            return LineError(str(e))
        return None

    def _error_of(self, line: InputLine) -> dict:
        if (error := self.host_error(line)) is None:
            raise ValueError(f"line {line.number} can run: a job with lines to run needs a model (llm=None only when num_runnable == 0)")
        return error_record(line, str(error), error.status_code, error.param)

    def _echo_as_scored(self, llm: LLM, line: InputLine, prompt: Prompt) -> InputLine:
        """A text completion's `echo` under --truncate: the text of the tokens kept (what was scored), not the
        whole prompt. A cut prompt holds exactly truncate_prompt's `keep` tokens; one of that length that was not
        cut is echoed as its tokens' text too (the same text, up to the tokenizer's normalization)."""
        echo = (line.endpoint or {}).get("echo")
        if self.truncate == "none" or not isinstance(echo, str):
            return line
        max_context = llm.engine_config.max_context
        if len(prompt.token_ids) != max_context - min(prompt.params.max_tokens, max_context // 2):  # truncate_prompt's keep
            return line
        return dataclasses.replace(line, endpoint=line.endpoint | {"echo": llm.tokenizer.decode(prompt.token_ids, skip_special=True)})

    def _sampling_params(self, obj: dict) -> SamplingParams:
        return SamplingParams.from_fields({name: obj[name] for name in SAMPLING_FIELDS if name in obj}, self.defaults)

    def _prepare(self, llm: LLM, line: InputLine, *, index: int) -> Prompt:
        obj = line.obj
        try:
            params = self._sampling_params(obj)
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
        except Exception as e:  # one odd value (an overflow, a nesting too deep, what a chat template raises) never stops the job
            raise LineError(f"{type(e).__name__}: {e}") from None


class JobLines:
    """A job's lines (or those still to do): a sized, re-iterable view, read again from the input each
    time it is iterated, never held; its length is the scan's count (so `not job.todo` costs nothing)."""

    def __init__(self, job: "BatchJob", done: KeyTable | None, length: int):
        self._job, self._done, self._length = job, done, length

    def __iter__(self) -> Iterator[InputLine]:
        job = self._job
        for line in job.read_lines():
            if self._done is None or line.key not in self._done:
                yield line

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        return f"JobLines({self._length} lines)"


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
    the format, `strict_fields` and `max_line_bytes` when not the defaults. A resume under other settings raises
    ResumeError listing them, unless `force_settings`. `fmt`: 'auto' (detected from the lines that
    parse), 'jaxinfer' or 'openai'. `max_inflight`: lines in flight at most (None: LLM.stream's default).
    `max_line_bytes`: a longer input line is its error record, never held whole.
    """

    def __init__(
        self, input_path: Path, output: Path, defaults: SamplingParams, *, resume: bool = False, truncate: str = "none",
        settings: dict | None = None, force_settings: bool = False, fmt: str = "auto", strict_fields: bool = False, max_inflight: int | None = None,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    ):
        if fmt not in FORMATS:
            raise FieldError("format", f"must be one of {', '.join(FORMATS)}, got {fmt!r}")
        if max_inflight is not None:
            check_int("max_inflight", max_inflight, low=1)  # here too, so that the CLI refuses it before the model loads
        check_int("max_line_bytes", max_line_bytes, low=1)
        self.output, self.resume, self.strict_fields, self.max_line_bytes = output, resume, strict_fields, max_line_bytes
        self.runner = LineRunner(defaults, truncate, max_inflight)
        self.summary = JobSummary()
        self._settings = {"sampling": dataclasses.asdict(defaults), "truncate": truncate} | (settings or {})
        check_settings_path(output)
        self._lock = OutputLock(output)
        self._input: SpooledInput | None = None
        self._input_path = input_path
        self._file = None
        try:
            self._read(input_path, fmt, force_settings)
        except BaseException:
            self.close()
            raise

    def _read(self, input_path: Path, fmt: str, force_settings: bool) -> None:
        self._input = SpooledInput(input_path)  # a pipe or /dev/stdin too: copied once
        check = EncodingCheck()
        for block in self._input.blocks():
            check.feed(block)
        check.finish()
        self.format = detect_format(iter_lines(self._input.blocks(), self.max_line_bytes)) if fmt == "auto" else fmt
        if self.format != "jaxinfer":
            self._settings["format"] = self.format
        if self.strict_fields:
            self._settings["strict_fields"] = True
        if self.max_line_bytes != DEFAULT_MAX_LINE_BYTES:  # it decides which lines are too long, and so their keys
            self._settings["max_line_bytes"] = self.max_line_bytes
        self.settings = json.loads(json.dumps(self._settings))  # as the settings file will hold them (tuples as lists)
        scan = scan_output(self.output, iter_lines) if self.resume else None
        if scan is not None and not force_settings:
            check_settings(self.output, self.settings, has_records=bool(scan.keys))
            if (resolved := (read_settings(self.output) or {}).get(RESOLVED)) is not None:  # kept until this run's engine says
                self.settings[RESOLVED] = resolved  # (record_resolved): a run that loads no model keeps it in the settings it writes
        if scan is not None:
            repair_output(self.output, scan)
        done = scan.keys if scan is not None else KeyTable()
        self.records_before = scan.num_records if scan is not None else 0  # the output's records before this run (whatif replays the ones after them)
        num_lines, num_todo, ignored = 0, 0, {}
        self.num_runnable = 0  # lines to do that parsed (the others are error records that need no model)
        for line in self.read_lines():
            num_lines += 1
            if line.key in done:
                continue
            num_todo += 1
            self.num_runnable += self.runner.host_error(line) is None
            for name in line.ignored:
                ignored[name] = ignored.get(name, 0) + 1
        self.lines, self.todo = JobLines(self, None, num_lines), JobLines(self, done, num_todo)
        self.summary.num_skipped = num_lines - num_todo
        self.summary.ignored_fields = ignored
        if ignored:
            names = ", ".join(f"{k!r} ({n} lines)" for k, n in sorted(ignored.items()))
            print(f"jaxinfer: warning: unknown fields, which those lines run without: {names}; --strict-fields makes them errors", file=sys.stderr)

    def read_lines(self) -> Iterator[InputLine]:
        """The input's lines, read again from its start, each keyed and parsed (batch/input.py)."""
        numbered = iter_lines(self._input.blocks(), self.max_line_bytes)
        return read_lines(numbered, self.format, strict_fields=self.strict_fields, max_line_bytes=self.max_line_bytes)

    def close(self) -> None:
        """Release the output's lock and close the input (idempotent). An output this job created is
        removed again when nothing was written to it (the job was refused or closed before it ran)."""
        self._lock.release(keep_output=self._file is not None)
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

    def record_resolved(self, resolved: dict, *, force: bool = False) -> None:
        """Add what the engine resolved "auto" to to the settings written with the records; a resume whose
        engine resolved otherwise is refused (ResumeError) unless `force`."""
        if self.resume and not force:
            check_resolved(self.output, resolved)
        self.settings[RESOLVED] = json.loads(json.dumps(resolved))

    def run(self, llm: LLM | None, *, progress: bool = True) -> JobSummary:
        """Write a record for every line not yet done; Ctrl-C or SIGTERM stops cleanly (summary.interrupted).
        The progress bar's total is the lines to do that parsed (`num_runnable`; the others' error records need no step).
        `llm` may be None when no line can run (`num_runnable == 0`): their error records need no model.
        With a model, every step is logged in `<output>.steps.jsonl` (batch/step_log.py), and the engine's
        step-cost table, refined by the job's steps, is saved with the tuner's cache at the end."""
        if llm is None:
            return self.write(self.runner.records(llm, self.todo, progress=progress, total=self.num_runnable))
        outer = self.runner.on_step
        log = step_log.StepLog(step_log.log_path(self.output), self._step_log_header(llm), costs=llm.engine.step_costs, chain=outer)
        self.runner.on_step = log
        try:
            return self.write(self.runner.records(llm, self.todo, progress=progress, total=self.num_runnable))
        finally:
            self.runner.on_step = outer
            log.close()
            llm.engine.save_step_costs()

    def _step_log_header(self, llm: LLM) -> dict:
        """What `jaxinfer whatif` needs to replay this run: the input, the engine's settings and pool, the in-flight limit, the
        output's records before this run and the sampling defaults' max_tokens (a timed-out line's, where it sets none)."""
        inflight = self.runner.max_inflight or INFLIGHT_PER_SEQ * llm.engine_config.max_num_seqs * len(llm.replicas)
        return {"input": str(Path(self._input_path).resolve()), "output": str(Path(self.output).resolve()), "engine": step_log.engine_settings(llm.engine_config),
                "num_pages": llm.engine.num_pages, "max_inflight": inflight, "max_inflight_given": self.runner.max_inflight,
                "replicas": len(llm.replicas), "resumed": self.resume, "num_skipped": self.summary.num_skipped, "records_before": self.records_before,
                "default_max_tokens": self.runner.defaults.max_tokens, "started": time.time()}

    def write(self, records: Iterable[dict]) -> JobSummary:
        """Append each record as it comes. A key already written in this run is dropped (a batch that a
        retry ran twice), so every line gets exactly one record. Ctrl-C or SIGTERM stops cleanly
        (summary.interrupted). A resume records its settings only with its first record, so one with
        nothing to do leaves the recorded settings as they were."""
        start, written = time.perf_counter(), KeyTable()
        try:
            with open(self.output, "ab" if self.resume else "wb") as self._file, _sigterm_interrupts():
                try:
                    if not self.resume:  # once the old output is emptied: a kill in between leaves no old record under new settings
                        write_settings(self.output, self.settings)
                    for record in records:
                        if record["key"] in written:
                            continue
                        if self.resume and not written:
                            write_settings(self.output, self.settings)
                        self._write(record)
                        written.add(record["key"])
                        self.summary.add(record)
                except KeyboardInterrupt:
                    self.summary.interrupted = True
        finally:
            self.close()
        self.summary.seconds = time.perf_counter() - start
        return self.summary


@contextlib.contextmanager
def _sigterm_interrupts():
    """SIGTERM, while the job writes, stops it as Ctrl-C does (the records so far kept, the summary
    printed); only the main thread can take a signal, elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
