"""jax.profiler traces of chosen engine steps, for `LLM.start_profile`, `jaxinfer generate --profile` and
experiments/profile_steps.py.

A trace is a folder that TensorBoard's profile plugin (`*.xplane.pb`) and Perfetto (`*.trace.json.gz`)
open. `StepProfiler` is an on_step hook (runloop.OnStep) that traces steps `first` to `last` (1-based,
inclusive) of a run: it starts the trace when step `first - 1` has ended and stops it after step `last`.
"""

import dataclasses
import glob
import gzip
import json
from pathlib import Path

import jax


def start(directory: str | Path) -> None:
    """Start a trace written under `directory` when `stop()` is called (one trace at a time per process)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.profiler.start_trace(str(directory), create_perfetto_trace=True)


def stop() -> None:
    jax.profiler.stop_trace()


def trace_events(directory: str | Path) -> list[dict]:
    """The Chrome-trace events of the newest trace under `directory` (its Perfetto file)."""
    files = sorted(glob.glob(f"{directory}/**/*.trace.json.gz", recursive=True))
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {directory}: was the trace stopped?")
    with gzip.open(files[-1]) as f:
        return json.load(f)["traceEvents"]


def parse_steps(text: str) -> tuple[int, int]:
    """'a:b' (steps a to b, 1-based, inclusive) or 'a' (one step) -> (a, b); ValueError naming the problem."""
    parts = text.split(":")
    try:
        first, last = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
    except ValueError:
        raise ValueError(f"--profile-steps {text!r}: expected A:B, two step numbers (1-based, inclusive)") from None
    if len(parts) > 2 or not 1 <= first <= last:
        raise ValueError(f"--profile-steps {text!r}: expected A:B with 1 <= A <= B")
    return first, last


@dataclasses.dataclass
class StepProfiler:
    """An on_step hook tracing steps first..last into `directory`; `close()` stops a trace still open
    (a run that ended before step `last`). `then` is another on_step hook, called first."""

    directory: Path
    first: int = 1
    last: int = 10
    then: object = None
    steps: int = 0  # steps seen so far
    tracing: bool = False
    traced: tuple[int, int] | None = None  # (first, last) step traced, once the trace is closed

    def __post_init__(self):
        if self.first == 1:
            self._start()

    def __call__(self, plan, tokens, seconds) -> None:
        if self.then is not None:
            self.then(plan, tokens, seconds)
        self.steps += 1
        if self.tracing and self.steps >= self.last:
            self.close()
        elif not self.tracing and self.steps == self.first - 1:
            self._start()

    def _start(self) -> None:
        start(self.directory)
        self.tracing, self._began = True, self.steps + 1

    def close(self) -> None:
        if self.tracing:
            stop()
            self.tracing, self.traced = False, (self._began, self.steps)
