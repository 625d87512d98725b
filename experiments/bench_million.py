"""Does a batch job's memory stay flat in its length, and does it survive kills? A --lines job vs a 1,000-line job.

Each job runs on the tiny real-vocabulary model (jaxinfer.loading.tiny_model: SmolLM2's tokenizer over a random 2-layer
Llama) in its own process (so each peak RSS is its own): a BatchJob over --lines short prompts (greedy,
--max-tokens each, one bad line in 100), with the run loop's StepRecorder timing every step. Reported per job:
peak RSS (VmHWM) and the RSS after the model loaded, records written, wall time, steps, and host time per step
(the job's wall time outside the engine's steps: reading, tokenizing, scheduling, writing). Goal: the --lines
job's peak RSS at most 1.5x the 1,000-line job's. Then the kill check: `jaxinfer generate` over --kill-lines
lines is SIGKILLed 3 times at random record counts and resumed each time, then resumed to the end: 0 lines
lost and 0 written twice is the goal.

    .venv/bin/python experiments/bench_million.py --lines 1000000            # the full question (hours on 2 CPU cores)
    .venv/bin/python experiments/bench_million.py --lines 20000 --kill-lines 400   # a quick check
"""

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time

from common import engine_runs, paths, peers, report, timing

RESULTS = paths.RESULTS_DIR / "bench_million.json"
BASELINE_LINES = 1000
RSS_GOAL = 1.5
NUM_KILLS = 3
ENGINE = {"max_context": 128, "page_size": 16, "max_num_seqs": 32, "max_prefill_tokens": 512}
CLI_ENGINE_FLAGS = ["--max-context", "128", "--page-size", "16", "--max-num-seqs", "32", "--temperature", "0", "--no-progress"]


def write_input(path: pathlib.Path, num_lines: int, max_tokens: int) -> None:
    """num_lines short requests; every 100th line is bad (a temperature of -1), an error record."""
    with open(path, "w") as f:
        for i in range(num_lines):
            line = {"id": f"r{i}", "prompt": f"Question {i}: what comes next?", "max_tokens": max_tokens}
            if i % 100 == 99:
                line["temperature"] = -1
            f.write(json.dumps(line) + "\n")


def child(model: str, num_lines: int, max_tokens: int, workdir: str, compile_cache: str) -> dict:
    """One job in this process: its figures as a dict (printed as the last stdout line)."""
    from jaxinfer.api import LLM
    from jaxinfer.batch.job import BatchJob
    from jaxinfer.scheduling.request import SamplingParams

    work = pathlib.Path(workdir)
    inp, out = work / f"in_{num_lines}.jsonl", work / f"out_{num_lines}.jsonl"
    write_input(inp, num_lines, max_tokens)
    llm = LLM(model, compilation_cache_dir=compile_cache, **ENGINE)
    rss_loaded = timing.rss_bytes()[0]
    recorder = engine_runs.StepRecorder(ENGINE["page_size"])
    start = time.perf_counter()
    with BatchJob(inp, out, SamplingParams(temperature=0, max_tokens=max_tokens)) as job:
        job.runner.on_step = recorder
        summary = job.run(llm, progress=False)
    seconds = time.perf_counter() - start
    steps = recorder.summary(seconds)
    num_steps = steps["prefill_steps"] + steps["decode_steps"]
    with open(out, "rb") as f:
        written = sum(1 for _ in f)
    return {
        "lines": num_lines, "records": written, "ok": summary.num_ok, "errors": summary.num_errors, "seconds": seconds,
        "peak_rss_bytes": timing.peak_rss_bytes(), "rss_after_load_bytes": rss_loaded, "steps": num_steps,
        "host_ms_per_step": 1e3 * steps["host_s"] / max(num_steps, 1), "step_ms_mean": 1e3 * (steps["prefill_s"] + steps["decode_s"]) / max(num_steps, 1),
        "lines_per_second": num_lines / seconds,
    }


def run_child(model: str, num_lines: int, max_tokens: int, workdir: pathlib.Path, compile_cache: str) -> dict:
    command = [sys.executable, __file__, "--child", model, str(num_lines), str(max_tokens), str(workdir), compile_cache]
    return peers.run_json(command, f"the {num_lines}-line job")


def kill_and_resume(model: str, num_lines: int, max_tokens: int, workdir: pathlib.Path, compile_cache: str, seed: int) -> dict:
    """SIGKILL `jaxinfer generate` NUM_KILLS times at random record counts, resuming each time, then finish."""
    inp, out = workdir / "kill_in.jsonl", workdir / "kill_out.jsonl"
    write_input(inp, num_lines, max_tokens)
    rng = random.Random(seed)
    base = [sys.executable, "-m", "jaxinfer.cli", "generate", "--model", model, "--input", str(inp), "--output", str(out), "--compile-cache", compile_cache, *CLI_ENGINE_FLAGS]
    kills = []
    for attempt in range(NUM_KILLS + 1):
        command = base + (["--resume"] if out.exists() else [])
        before = _count(out)
        target = before + rng.randint(1, max(1, (num_lines - before) // (NUM_KILLS + 1 - attempt))) if attempt < NUM_KILLS else None
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        while target is not None and process.poll() is None and _count(out) < target:
            time.sleep(0.02)
        if target is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            kills.append(_count(out))
        _, stderr = process.communicate(timeout=3600)
        if target is None and process.returncode != 0:
            raise RuntimeError(f"the final resume failed ({process.returncode}): {stderr[-2000:]}")
    keys = [json.loads(line)["key"] for line in out.read_bytes().splitlines() if line.strip()]
    expected = {f'id:"r{i}"' for i in range(num_lines)}
    return {"lines": num_lines, "killed_at_records": kills, "records": len(keys), "lost": len(expected - set(keys)), "duplicated": len(keys) - len(set(keys))}


def _count(path: pathlib.Path) -> int:
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def main() -> int:
    parser = report.arg_parser(__doc__, out=RESULTS)
    parser.add_argument("--lines", type=int, default=1_000_000, help="lines of the large job (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=2, help="tokens generated per line (default: %(default)s)")
    parser.add_argument("--kill-lines", type=int, default=2000, help="lines of the kill-and-resume job (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.lines < 1 or args.kill_lines < NUM_KILLS + 1:
        parser.error("--lines must be >= 1 and --kill-lines >= 4")
    from jaxinfer.loading.tiny_model import save_tiny_llama
    from jaxinfer.loading.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory(prefix="bench_million_") as tmp:
        workdir = pathlib.Path(tmp)
        model = str(save_tiny_llama(workdir / "tiny_model", load_tokenizer(None)))
        compile_cache = str(workdir / "xla_cache")
        report.log("bench_million", "warming the compile cache (a 100-line job, not reported), so both jobs below read it")
        run_child(model, 100, args.max_tokens, workdir, compile_cache)
        jobs = []
        for num_lines in (BASELINE_LINES, args.lines):
            report.log("bench_million", f"running the {num_lines}-line job")
            jobs.append(run_child(model, num_lines, args.max_tokens, workdir, compile_cache))
        report.log("bench_million", f"killing a {args.kill_lines}-line CLI job {NUM_KILLS} times and resuming it")
        kill = kill_and_resume(model, args.kill_lines, args.max_tokens, workdir, compile_cache, args.seed)
    ratio = jobs[1]["peak_rss_bytes"] / jobs[0]["peak_rss_bytes"]
    columns = [("lines", ">9"), ("records", ">9"), ("peak RSS MiB", ">12.1f"), ("after load MiB", ">14.1f"), ("seconds", ">9.1f"),
               ("lines/s", ">9.0f"), ("steps", ">7"), ("host ms/step", ">12.3f"), ("step ms", ">8.3f")]
    rows = [[j["lines"], j["records"], j["peak_rss_bytes"] / 2**20, j["rss_after_load_bytes"] / 2**20, j["seconds"], j["lines_per_second"], j["steps"],
             j["host_ms_per_step"], j["step_ms_mean"]] for j in jobs]
    print(report.format_table(columns, rows))
    print(f"peak RSS ratio {args.lines} / {BASELINE_LINES} lines: {ratio:.3f} (goal <= {RSS_GOAL})")
    print(f"kill x{NUM_KILLS} and resume over {kill['lines']} lines: killed at {kill['killed_at_records']} records; "
          f"{kill['records']} records, {kill['lost']} lost, {kill['duplicated']} duplicated")
    met = ratio <= RSS_GOAL and kill["lost"] == 0 and kill["duplicated"] == 0 and all(j["records"] == j["lines"] for j in jobs)
    doc = {"question": __doc__.split("\n")[0], "args": vars(args) | {"out": str(args.out)}, "engine": ENGINE, "jobs": jobs, "peak_rss_ratio": ratio,
           "rss_goal": RSS_GOAL, "kill_and_resume": kill, "goal_met": met}
    report.finish(args.out, doc, {"peak_rss_ratio": round(ratio, 3), "lost": kill["lost"], "duplicated": kill["duplicated"], "goal_met": met}, correct=met)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _, _, model, num_lines, max_tokens, workdir, compile_cache = sys.argv
        print(json.dumps(child(model, int(num_lines), int(max_tokens), workdir, compile_cache)))
        sys.exit(0)
    sys.exit(main())
