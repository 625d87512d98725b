"""The grammar check, run where a crash cannot take the job down: a child process. Host only, no jax.

llguidance checks a grammar by recursing over its rule references on the native stack, so a long chain
(1,000 JSON-schema `$defs` each naming the next, a Lark grammar of 4,000 chained rules) overflows it and
the process dies with SIGSEGV, which no `try` catches. Grammars are user input, so `check(fmt, text)`
hands each one to a worker process (`python -c _WORKER`, importing only llguidance) that compiles it on a
thread with a fixed `CHECK_STACK_BYTES` stack, builds a matcher over a 257-token byte vocabulary and
computes its first mask. It answers ok or the error text; a worker that dies (a signal) or takes over
`timeout_s` is that spec's error, and the next check starts a fresh worker. Results are cached by the
spec's digest, so a job's lines that share a schema cost one check.

Invariant: a spec that passed here compiles in the parent on a thread whose stack is `COMPILE_STACK_BYTES`
(8x the check's, `run_with_large_stack`), so the depth the check measured cannot overflow it.
Imports only the standard library (llguidance only inside the worker).
"""

import atexit
import collections
import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import threading

CHECK_STACK_BYTES = 8 << 20  # the worker's stack for a check: a common main-thread default
COMPILE_STACK_BYTES = 64 << 20  # the parent's stack for compiling a checked spec (8x the check's)
DEFAULT_TIMEOUT_S = 300.0  # a check that takes longer is refused (100,000 choices take about 30 s)
_MAX_CACHED = 4096  # distinct specs whose result is kept

# The worker: one JSON request per line on stdin ({"format", "text"}), one JSON answer per line on stdout
# ({"error": null | str}). EOF on stdin ends it.
_WORKER = r"""
import json, sys, threading
import llguidance

class _Bytes:
    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    def __call__(self, s):
        return list(s if isinstance(s, bytes) else s.encode())

def _first_line(text):
    return (text.strip().splitlines() or [""])[0][:300]

def _check(fmt, text, tokenizer):
    try:
        grammar = llguidance.grammar_from(fmt, text)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            return "cannot be compiled: " + "; ".join(messages)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return "cannot be compiled: " + _first_line(matcher.get_error())
        mask = bytes(matcher.compute_bitmask())
    except (ValueError, RuntimeError, TypeError) as e:
        return "cannot be compiled: " + _first_line(str(e))
    if matcher.is_error() or not any(mask):  # no first byte can start a string of the language
        return "allows no output: no string matches it (its language is empty)"
    return None

def _main(stack_bytes):
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
    threading.stack_size(stack_bytes)
    for line in sys.stdin:
        request, answer = json.loads(line), {}
        worker = threading.Thread(target=lambda: answer.update(error=_check(request["format"], request["text"], tokenizer)))
        worker.start()
        worker.join()
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()

_main(int(sys.argv[1]))
"""


class GrammarChecker:
    """A worker process that checks grammars, restarted after a crash; thread-safe, results cached by digest."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._owner_pid = 0  # the process that started the worker (a forked child starts its own)
        self._results: collections.OrderedDict[bytes, str | None] = collections.OrderedDict()
        self.num_checks = 0  # specs actually sent to a worker (cache misses)

    def check(self, fmt: str, text: str) -> str | None:
        """None when llguidance compiles `text` (a grammar of format `fmt`: "json_schema", "regex", "choice",
        "grammar") and its language has a first byte; else the error text, naming a crash as one."""
        digest = hashlib.sha256(f"{fmt}\x00{text}".encode("utf-8", "surrogatepass")).digest()
        with self._lock:
            if digest in self._results:
                self._results.move_to_end(digest)
                return self._results[digest]
            self.num_checks += 1
            error, cacheable = self._ask(fmt, text)
            if cacheable:
                self._results[digest] = error
                if len(self._results) > _MAX_CACHED:
                    self._results.popitem(last=False)
            return error

    def close(self) -> None:
        """End the worker (a later check starts a new one)."""
        with self._lock:
            self._stop_worker()

    def _ask(self, fmt: str, text: str) -> tuple[str | None, bool]:
        """(error or None, whether the answer belongs to the spec and may be cached)."""
        process = self._worker()
        try:
            process.stdin.write((json.dumps({"format": fmt, "text": text}) + "\n").encode())
            process.stdin.flush()
            line = _read_line(process.stdout.fileno(), self.timeout_s)
        except (BrokenPipeError, OSError):
            line = b""
        if line is None:
            self._stop_worker()
            return f"the grammar check took over {self.timeout_s:g} s (too large or too deep)", True
        if not line:
            return self._died()
        return json.loads(line)["error"], True

    def _died(self) -> tuple[str, bool]:
        """The worker ended without answering: a signal is the spec's doing; an exit is the environment's."""
        code = self._process.wait()
        self._process = None
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else "?"
            return f"too deep or too large: the grammar checker crashed (signal {-code}, {name})", True
        return f"could not be checked: the grammar checker exited with code {code}", False

    def _worker(self) -> subprocess.Popen:
        if self._process is not None and (self._owner_pid != os.getpid() or self._process.poll() is not None):
            self._process = None  # inherited across a fork, or gone: start our own
        if self._process is None:
            command = [sys.executable, "-c", _WORKER, str(CHECK_STACK_BYTES)]
            self._process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0)
            self._owner_pid = os.getpid()
        return self._process

    def _stop_worker(self) -> None:
        process, self._process = self._process, None
        if process is not None and self._owner_pid == os.getpid():
            process.kill()
            process.wait()


def _read_line(fd: int, timeout_s: float) -> bytes | None:
    """One line from `fd` (without waiting past `timeout_s`: None); b"" at EOF."""
    chunks = []
    while True:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        if not ready:
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b""
        chunks.append(chunk)
        if chunk.endswith(b"\n"):
            return b"".join(chunks)


def run_with_large_stack(function, *args):
    """`function(*args)` on a thread with a COMPILE_STACK_BYTES stack (llguidance's compile recurses on
    the native stack); returns its result or raises its exception."""
    outcome = {}

    def target():
        try:
            outcome["result"] = function(*args)
        except BaseException as e:  # handed to the caller's thread
            outcome["error"] = e

    with _STACK_LOCK:  # threading.stack_size is process-wide: set it only around our own thread's start
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=target, name="grammar-compile")
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


_STACK_LOCK = threading.Lock()
CHECKER = GrammarChecker()  # one worker per process, shared by every request's spec (guided.check_spec)
atexit.register(CHECKER.close)
