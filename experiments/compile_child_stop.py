"""How long after SIGSTOP does every thread of a refit's compile child stop, against the thread that took the signal?

A refit compiles its programs in a child process (engine/compile_worker.py) that the job stops before each step.
The signal stops each thread when it next enters the kernel, so a thread compiling on the other core runs on after
the one that took it. This starts a real ChildCompile of the default model (the programs of a chunk table, CHUNKS, that
the engine lacks: 10 of them), gives it --turn-ms turns, and after each turn sends SIGSTOP and reads every
thread's /proc state until all show stopped: when the thread that took the signal (the process's main thread, which
`stop` waited for until b0d652b) showed stopped, and when every thread did. Correctness first: every stop ends with
every thread stopped, and the child sends every program. A turn here is --turn-ms; in a job it is refit.YIELD_SHARE
of a step's seconds.

    .venv/bin/python experiments/compile_child_stop.py [--turn-ms 30] [--out experiments/results/compile_child_stop.json]
"""

import dataclasses
import signal
import time

import numpy as np

from common import paths, report
from jaxinfer.api import LLM
from jaxinfer.config import EngineConfig
from jaxinfer.engine import compile_worker

RESULTS = paths.RESULTS_DIR / "compile_child_stop.json"
ENGINE = dict(max_context=512, max_num_seqs=8, page_size=16, compilation_cache_dir=None)
CHUNKS = (40, 72, 136, 264, 512)  # none of the default table's but its top: every program of these compiles in the child


def one_stop(pid: int, limit_s: float = 1.0) -> tuple[float, float, int, bool]:
    """SIGSTOP `pid`; (seconds until its main thread showed stopped, until every thread did, threads, all stopped)."""
    start = time.perf_counter()
    signal_taken = None
    while True:
        states = compile_worker.thread_states(pid)
        now = time.perf_counter() - start
        if signal_taken is None and states.get(str(pid)) in ("T", "t", "Z"):
            signal_taken = now
        stopped = all(letter in "TtZX" for letter in states.values())
        if stopped or now > limit_s:
            return (now if signal_taken is None else signal_taken), now, len(states), stopped


def main() -> None:
    parser = report.arg_parser(__doc__, out=RESULTS)
    parser.add_argument("--turn-ms", type=float, default=30.0, help="the child's turn between two stops")
    args = parser.parse_args()
    llm = LLM(engine_config=EngineConfig(**ENGINE))
    child = compile_worker.ChildCompile(llm.engine, dataclasses.replace(llm.engine_config, prefill_chunk_buckets=CHUNKS))
    stops = []
    try:
        while not child.finished and child.error is None and child.proc.poll() is None:
            child.work(args.turn_ms / 1e3)
            child.proc.send_signal(signal.SIGSTOP)
            stops.append(one_stop(child.proc.pid))
            child._stopped = True  # the next work() sends SIGCONT
    finally:
        child.proc.kill()
    correct = child.finished and all(s[3] for s in stops)
    first, every = np.array([s[0] for s in stops]) * 1e3, np.array([s[1] for s in stops]) * 1e3
    rows = [["the thread that took the signal", *np.percentile(first, [50, 90]), first.max()], ["every thread", *np.percentile(every, [50, 90]), every.max()]]
    late = int(((every - first) > 1.0).sum())
    print(f"{len(stops)} stops of a child compiling {len(child.keys)} programs ({max(s[2] for s in stops)} threads), {args.turn_ms:g} ms turns; "
          f"every stop ended with every thread stopped and every program sent: {correct}")
    print(report.format_table([("stopped, ms after SIGSTOP", "<32"), ("median", "8.2f"), ("p90", "8.2f"), ("max", "8.2f")], rows))
    print(f"stops where a thread computed over 1 ms after the first showed stopped: {late} of {len(stops)}")
    result = {"question": "how long after SIGSTOP every thread of a refit's compile child stops, against the one that took the signal",
              "settings": vars(args) | {"out": str(args.out), "engine": ENGINE, "chunks": CHUNKS}, "correct": correct,
              "num_stops": len(stops), "num_programs": len(child.keys), "num_threads": max(s[2] for s in stops),
              "first_stopped_ms": {"p50": float(np.median(first)), "p90": float(np.percentile(first, 90)), "max": float(first.max())},
              "all_stopped_ms": {"p50": float(np.median(every)), "p90": float(np.percentile(every, 90)), "max": float(every.max())},
              "stops_with_a_thread_over_1ms_late": late}
    report.finish(args.out, result, {"bench": "compile_child_stop", "late_stops": late, "num_stops": len(stops)}, correct=correct)


if __name__ == "__main__":
    main()
