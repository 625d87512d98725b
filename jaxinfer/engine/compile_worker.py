"""A bucket refit's compiles in a child process that the job stops while it steps.

XLA's compile runs native threads and its lowering holds the GIL, so a compile in the job's process takes the
cores and the GIL its steps wait for, whatever the priorities. `ChildCompile` runs
`python -m jaxinfer.engine.compile_worker` on `Engine.compile_request` (the configs and the state as shapes: no
weights); the child builds the same `step_functions`, jits them as the engine does, lowers and compiles each
missing key against the shapes, and sends each program back serialized (`jax.experimental.serialize_executable`),
which `Engine.load_program` loads in the pauses the job gives the child. The caller (batch/refit.py) stops the
child (SIGSTOP, `pause`) before every step and lets it run (SIGCONT, `work`) for a share of the step's seconds
after it, so the steps run with every core to themselves. The child never uses the persistent compilation
cache: on CPU an executable loaded from it serializes without its kernels.

The child dies with the thread that started it (PR_SET_PDEATHSIG, SIGKILL: also while stopped) and is killed by
`close`. Its stderr goes to a temporary file whose tail a failure reports (`error`). One device only (mesh
None): a mesh's programs compile in the job's process (Engine.compile_programs). This module's top imports no
jax: the parent's side is host code; the child's (`main`) imports the engine.

Protocol, child stdout: frames of an 8-byte length and a pickle: ("program", key, pickled serialize() output, CPU
seconds) per program, then ("done", peak RSS in bytes).
"""

import ctypes
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback

_PR_SET_PDEATHSIG = 1
_HEADER = struct.Struct("<Q")
_STOP_WAIT_S = 0.05  # the longest stop() waits for every thread of the child to show as stopped (each stops when it next enters the kernel)


def compile_all(req: dict):
    """Yields (key, compiled) for each key of `req`, lowered and compiled as the engine's own programs are."""
    import jax  # noqa: PLC0415

    from jaxinfer.engine import engine as eng  # noqa: PLC0415  (the model's modules register the CPU kernels' FFI targets)

    cfg, engine_cfg = req["cfg"], req["engine_cfg"]
    # Never the persistent cache: an executable it loads serializes without its kernels on CPU (running one
    # deserialized fails: "Function maximum_bitcast_fusion not found"), so every program here compiles for real.
    jax.config.update("jax_enable_compilation_cache", False)
    forward, draw = eng.step_functions(cfg, engine_cfg, req["impl"], keep_raw=req["keep_raw"])
    jitted, jitted_draw = jax.jit(forward, donate_argnames=("pool", "history")), jax.jit(draw)
    for key in req["keys"]:
        yield key, eng.lower_program(jitted, jitted_draw, key, engine_cfg, cfg.vocab_size, req["state"], keep_raw=req["keep_raw"]).compile()


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the thread that started this process ends (Linux; a stopped child too), or now if it already has."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: close() still kills it
        pass
    if os.getppid() != parent:
        os._exit(1)


def main() -> None:
    """The child: one request on stdin, frames on the stdout it was given (its own prints go to stderr)."""
    import resource  # noqa: PLC0415

    from jax.experimental import serialize_executable  # noqa: PLC0415

    _die_with_parent(int(sys.argv[1]))
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    req = pickle.load(sys.stdin.buffer)

    def send(message) -> None:
        data = pickle.dumps(message)
        out.write(_HEADER.pack(len(data)) + data)
        out.flush()

    from jaxinfer.engine import host_memory  # noqa: PLC0415

    cpu = time.process_time()
    for key, compiled in compile_all(req):
        send(("program", key, pickle.dumps(serialize_executable.serialize(compiled)), time.process_time() - cpu))
        del compiled
        host_memory.trim_heap()  # the compiler's freed working memory, before the next compile adds its own (as warm-up does)
        cpu = time.process_time()
    send(("done", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))


_STOPPED = ("T", "t")  # /proc state letters of a stopped thread (by a signal; traced)
_GONE = ("Z", "X")  # exited


def stop(proc: subprocess.Popen, wait_s: float = _STOP_WAIT_S) -> bool:
    """SIGSTOP `proc` and wait, at most `wait_s`, until every one of its threads has stopped; whether they all did.
    The signal stops each thread when it next enters the kernel: a thread computing on another core can run on for
    a scheduler tick (4 ms at 250 Hz) after the one that took the signal shows stopped, into the step that follows."""
    proc.send_signal(signal.SIGSTOP)
    end = time.perf_counter() + wait_s
    pending = None  # threads not seen stopped yet (a stopped one stays stopped until SIGCONT)
    while True:
        states = thread_states(proc.pid, pending)
        pending = [tid for tid, letter in states.items() if letter not in _STOPPED + _GONE]
        if not pending:
            return True
        if time.perf_counter() >= end:
            return False
        time.sleep(0.0002)


def thread_states(pid: int, tids: list[str] | None = None) -> dict[str, str]:
    """{thread id: /proc state letter} of `pid`'s threads (those of `tids`, where given) that can be read; {} when
    the process is gone."""
    try:
        tids = tids if tids is not None else os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    states = {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states[tid] = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # the thread exited
    return states


class ChildCompile:
    """The parent's side of one child compile of the programs `engine` lacks for `engine_cfg`, in the order of
    `sort_key` over the keys (a stable sort; None: the engine's order). `work(seconds)` lets it run and loads what
    it sent; `pause()` stops it. `programs` ({key: compiled}, growing as they load) in full once `finished`; `error`
    (a message) if it failed."""

    def __init__(self, engine, engine_cfg, sort_key=None):
        req = engine.compile_request(engine_cfg)
        if sort_key is not None:
            req["keys"] = sorted(req["keys"], key=sort_key)
        self.engine, self.keys = engine, list(req["keys"])
        self.programs: dict = {}
        self.cpu_s = 0.0  # the child's CPU seconds compiling (all its threads)
        self.peak_rss = 0  # bytes, the child's, reported when it finishes
        self.error: str | None = None
        self.finished = False
        self.finished_at = 0.0  # perf_counter when the last program was loaded
        self.loaded_at: list[float] = []  # perf_counter after each program's load here
        self.late_stops: list[tuple[float, str]] = []  # (perf_counter, the state letters of the threads not stopped) of each stop that timed out
        self._buffer = bytearray()
        self._stderr = tempfile.TemporaryFile()
        with tempfile.TemporaryFile() as stdin:  # a file, not a pipe: a large request never blocks the stepping thread
            stdin.write(pickle.dumps(req))
            stdin.seek(0)
            self.proc = subprocess.Popen([sys.executable, "-m", "jaxinfer.engine.compile_worker", str(os.getpid())], stdin=stdin,
                                         stdout=subprocess.PIPE, stderr=self._stderr)
        self._stopped = False
        os.set_blocking(self.proc.stdout.fileno(), False)

    def pause(self) -> None:
        """Stop the child (a step is next): `stop`, unless it is stopped or gone."""
        if self._stopped or self.proc.poll() is not None:
            return
        if not stop(self.proc):  # a thread still ran after _STOP_WAIT_S (in the kernel, say): the step goes on beside it
            running = [letter for letter in thread_states(self.proc.pid).values() if letter not in _STOPPED]
            self.late_stops.append((time.perf_counter(), "".join(sorted(running))))
        self._stopped = True

    def state(self) -> str | None:
        """The child's state over its threads, per /proc: 'T' when every one is stopped, else the letter of one that
        is not ('R' running, 'S' sleeping, 'Z' exited, ...); None where it cannot be read."""
        states = thread_states(self.proc.pid)
        if not states:
            return None
        return next((letter for letter in states.values() if letter not in _STOPPED), "T")

    def work(self, seconds: float) -> None:
        """Let the child run for `seconds` (or until it is done), loading each program it sends meanwhile."""
        end = time.perf_counter() + seconds
        if self._stopped:
            self.proc.send_signal(signal.SIGCONT)
            self._stopped = False
        while not self.finished and self.error is None and (left := end - time.perf_counter()) > 0:
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                self._read()

    def _read(self) -> None:
        chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
        if not chunk:  # EOF: it exited
            self.proc.wait()
            if not self.finished:
                self.error = self._failure()
            return
        self._buffer += chunk
        while len(self._buffer) >= _HEADER.size and len(self._buffer) >= _HEADER.size + (size := _HEADER.unpack_from(self._buffer)[0]):
            message = pickle.loads(bytes(self._buffer[_HEADER.size : _HEADER.size + size]))
            del self._buffer[: _HEADER.size + size]
            self._take(message)

    def _take(self, message) -> None:
        if message[0] == "program":
            _, key, serialized, cpu_s = message
            self.programs[key] = self.engine.load_program(key, serialized, cpu_s)
            self.loaded_at.append(time.perf_counter())
            self.cpu_s += cpu_s
        else:
            self.peak_rss = message[1]
            self.finished, self.finished_at = set(self.programs) == set(self.keys), time.perf_counter()
            if not self.finished:
                self.error = f"the compile child sent {len(self.programs)} of {len(self.keys)} programs"

    def _failure(self) -> str:
        code = self.proc.returncode
        self._stderr.seek(0)
        tail = self._stderr.read()[-4000:].decode(errors="replace").strip()
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return f"the compile child {how} after {len(self.programs)} of {len(self.keys)} programs" + (f"; its stderr ends:\n{tail}" if tail else "")

    def close(self) -> None:
        """Kill the child if it still runs (a stopped one too) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        self._stderr.close()


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
