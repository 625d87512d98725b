"""Peak host memory while a GGUF loads: does a model load in its file's size plus the KV pool plus 1 GiB?

Each file is loaded in a fresh child process (so one load's peak does not hide another's), in stages:
  - "load": `loading.load_for_engine` as `LLM(path)` calls it (quantization="auto", tuning on), the weights
    on the device;
  - "engine": that, then an Engine with the matmul the kernel path runs (attention 'cpu', matmul 'cpu_int8';
    K-quant panels are the loaded arrays) warmed up: the steady state of a served model;
  - "tune" (with --tune): that load, then the tuner measuring every candidate on a small engine config (no cache),
    as a first LLM(path) on a machine does;
  - "llm" (with --llm): `LLM(path)` whole, as a first start on a machine runs it: the load, the tuner (an empty
    tuning cache in a temporary folder), the choice applied and the engine warmed up.
  - "phases" (with --phases, or --only phases): `LLM(path)` whole, then a short generate, with the engine config
    experiments/bench_kquant.py uses (--bench-engine) or ENGINE; the peak RSS of each phase apart (VmHWM reset at
    every phase boundary: load, the tokenizer, the tuner's attention timing, its f32 reference, each candidate's engine build,
    warm-up (its compiles, then its timing runs apart) and probe runs, the chosen engine's build, its warm-up, the generate), so a spike names its phase.
The child reports its VmHWM (peak resident set, /proc/self/status) and VmRSS, the file's size and the pool's
bytes; the budget is file + pool + 1 GiB.

    .venv/bin/python experiments/bench_load_memory.py [--tune] [--llm] [--phases [--bench-engine]] [FILE.gguf ...]   (default: the K-quant test files and,
        where experiments/bench_kquant.py made them, its build/bench_kquant/ K-quant files but the 8B's)
Writes experiments/results/bench_load_memory.json; the last stdout line is one JSON document.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

from common import paths, report
from common.paths import REPO_ROOT

RESULTS = paths.RESULTS_DIR / "bench_load_memory.json"
SLACK_BYTES = 2**30
ENGINE = dict(max_context=256, page_size=16, max_num_seqs=4, max_prefill_tokens=256, prefill_chunk_buckets=(256,),
              prefill_seq_buckets=(1,), decode_batch_buckets=(4,), decode_page_buckets=(16,), num_pages=4 * 16 + 1)  # a small pool: the budget counts it
DEFAULT_FILES = sorted((REPO_ROOT / "tests" / "fixtures" / "kquant").glob("*.gguf")) + sorted(  # the K-quant files, not the F16 sources or the 8B
    p for p in (REPO_ROOT / "build" / "bench_kquant").glob("*-q[456]_k*.gguf") if "8b" not in p.name)

CHILD = r"""
import json, os, sys, tempfile, time
os.environ.setdefault("JAXINFER_TUNE", "1")
os.environ["JAXINFER_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_load_memory_")  # nothing cached: the tuner measures
import logging
logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
logging.getLogger("jaxinfer").setLevel(logging.INFO)  # progress, to the stage's log
def status(keys=("VmHWM", "VmRSS")):
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {key: int(fields[key].split()[0]) * 1024 for key in keys}
from jaxinfer.config import EngineConfig
from jaxinfer.options import LoadOptions
from jaxinfer.loading import loading
from jaxinfer.model import params as params_lib, quant
stage, path, engine = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
before = status()
start = time.perf_counter()
if stage == "llm":
    from jaxinfer.api import LLM
    llm = LLM(path, engine_config=EngineConfig(**engine))
    eng = llm.engine
    from jaxinfer.engine import tuning
    print(tuning.format_table(llm.tuning), file=sys.stderr)
    print(json.dumps({"llm_s": time.perf_counter() - start, "tune_s": llm.tuning.seconds, "before": before, "after_llm": status(), "choice": llm.tuning.choice.name,
                      "pool_bytes": quant.resident_bytes(eng.pool), "step_resident_bytes": quant.resident_bytes(eng.step_params)}))
    sys.exit()
if stage == "phases":
    exec(PHASES)
    sys.exit()
cfg, params = loading.load_for_engine(path, LoadOptions(), EngineConfig(**engine))
out = {"load_s": time.perf_counter() - start, "before": before, "after_load": status(), "resident_weight_bytes": quant.resident_bytes(params),
       "formats": sorted({fmt for _, fmt in params_lib.weight_bytes(params)})}
if stage == "tune":
    from jaxinfer.engine import backends, tuning
    start = time.perf_counter()
    result = tuning.tune(cfg, params, EngineConfig(**engine), backends.Impls(), quantization="auto")
    out |= {"choice": result.choice.name, "tune_s": time.perf_counter() - start, "after_tune": status(),
            "measurements": [[m.candidate, m.score, m.status] for m in result.measurements]}
if stage == "engine":
    from jaxinfer.engine.engine import Engine
    eng = Engine(cfg, params, EngineConfig(attention_impl="cpu", matmul_impl="cpu_int8", **engine))
    eng.warmup()
    out |= {"pool_bytes": quant.resident_bytes(eng.pool), "step_resident_bytes": quant.resident_bytes(eng.step_params), "after_engine": status()}
print(json.dumps(out))
"""

# The "phases" stage (exec'd by CHILD): each wrapped call is a phase; at every boundary the VmHWM since the last one
# is added to the phase then innermost, and reset (clear_refs 5), so each phase's peak is its own.
PHASES = r"""
import functools
from jaxinfer import api
from jaxinfer.api import LLM
from jaxinfer.engine import engine as engine_lib, tuning, tune_attention
from jaxinfer.model import quant
from jaxinfer.scheduling.request import SamplingParams
peaks, stack, order, ends = {}, ["start"], [], {}
def boundary():
    now = status(("VmHWM", "VmRSS", "RssAnon", "RssFile"))
    peak = now.pop("VmHWM")
    peaks[stack[-1]] = max(peaks.get(stack[-1], 0), peak)
    ends[stack[-1]] = now  # the RSS as the phase (or its latest stretch) ends: what stays resident, apart from the transient
    if stack[-1] not in order:
        order.append(stack[-1])
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
def phase(name_of):
    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            boundary()
            stack.append(name_of(*args, **kwargs))
            try:
                return fn(*args, **kwargs)
            finally:
                boundary()
                stack.pop()
        return run
    return wrap
inside = lambda name: (lambda *a, **k: "/".join(stack[1:] + [name]))
loading.load_for_engine = phase(lambda *a, **k: "load")(loading.load_for_engine)
api._load_tokenizer = phase(lambda *a, **k: "tokenizer")(api._load_tokenizer)
tune_attention.choose_attention = phase(inside("tune attention"))(tune_attention.choose_attention)
tuning.reference_run = phase(inside("tune f32 reference"))(tuning.reference_run)
tuning.measure = phase(lambda c, *a, **k: "tune " + c.name)(tuning.measure)
tuning.apply_choice = phase(inside("apply choice"))(tuning.apply_choice)
engine_lib.Engine.__init__ = phase(inside("engine build"))(engine_lib.Engine.__init__)
engine_lib.Engine.warmup = phase(inside("warm-up"))(engine_lib.Engine.warmup)
engine_lib.Engine.time_programs = phase(inside("timing runs"))(engine_lib.Engine.time_programs)  # warm-up's runs apart from its compiles
llm = LLM(path, engine_config=EngineConfig(**engine))
eng = llm.engine
stack.append("generate")
boundary()
prompts = [[(7 * i + j) % 1000 + 10 for j in range(48)] for i in range(4)]
llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
boundary()
stack.pop()
print(tuning.format_table(llm.tuning), file=sys.stderr)
print(json.dumps({"before": before, "after_phases": status(), "phase_peaks": {name: peaks[name] for name in order},
                  "phase_end_rss": {name: ends[name] for name in order},
                  "peak_rss_bytes_all": max(peaks.values()), "choice": llm.tuning.choice.name, "pool_bytes": quant.resident_bytes(eng.pool),
                  "step_resident_bytes": quant.resident_bytes(eng.step_params), "resident_weight_bytes": quant.resident_bytes(eng.params)}))
"""
BENCH_ENGINE = dict(max_context=1024, max_num_seqs=16, page_size=16, num_pages=16 * (1024 // 16) + 1,  # bench_kquant's engine config
                    compilation_cache_dir=None)  # (engine_runs.workload_engine_config): no persistent compilation cache, a cold warm-up


def measure(path: Path, stage: str, log: Path, engine: dict = ENGINE) -> dict:
    """One stage in a fresh child; its stderr (progress, the tuner's table) goes to `log` as it runs."""
    command = [sys.executable, "-c", CHILD.replace("exec(PHASES)", f"exec({PHASES!r})"), stage, str(path), json.dumps(engine)]
    with open(log, "w") as err:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO_ROOT)
    if done.returncode != 0:
        return {"error": log.read_text()[-2000:]}
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return out | ({"log_tail": log.read_text()[-4000:]} if stage in ("llm", "phases") else {})  # the tuner's table


def main() -> None:
    parser = report.arg_parser(__doc__, out=RESULTS)
    parser.add_argument("files", nargs="*", type=Path, default=DEFAULT_FILES)
    parser.add_argument("--tune", action="store_true", help="also the tuner's peak (minutes per file)")
    parser.add_argument("--llm", action="store_true", help="also LLM(path) whole: load, tune, engine warm-up (minutes per file)")
    parser.add_argument("--phases", action="store_true", help="also LLM(path) + a short generate, the peak RSS of each phase apart")
    parser.add_argument("--bench-engine", action="store_true", help="the phases stage with bench_kquant's engine config (its 1 GiB pool for a 1B)")
    parser.add_argument("--only", choices=("load", "engine", "tune", "llm", "phases"), help="that stage alone (an 8B: one load, not four)")
    args = parser.parse_args()
    start, rows, results = time.perf_counter(), [], {}
    for path in (p.resolve() for p in args.files):
        file_bytes = path.stat().st_size
        entry = {"file_bytes": file_bytes}
        stages = (args.only,) if args.only else ("load", "engine") + ("tune",) * args.tune + ("llm",) * args.llm + ("phases",) * args.phases
        for stage in stages:
            engine = BENCH_ENGINE if stage == "phases" and args.bench_engine else ENGINE
            entry[stage] = measure(path, stage, args.out.with_name(f"{args.out.stem}.{path.stem}.{stage}.log"), engine)
        pool = entry.get("engine", entry.get("llm", entry.get("phases", {}))).get("pool_bytes") or 0  # the tune stage alone: its pool is not counted
        budget = file_bytes + pool + SLACK_BYTES
        for stage in stages:
            last = next((entry[stage][k] for k in ("after_llm", "after_tune", "after_engine", "after_load") if k in entry[stage]), {})
            peak = entry[stage].get("peak_rss_bytes_all", last.get("VmHWM"))  # phases: VmHWM was reset at each boundary
            entry[stage]["peak_rss_bytes"] = peak
            entry[stage]["within_budget"] = None if peak is None else peak <= budget
        entry["budget_bytes"] = budget
        results[path.name] = entry
        report.log("bench_load_memory", f"{path.name}: file {file_bytes / 2**20:.0f} MiB, peak RSS load "
                   f"{(entry.get('load', {}).get('peak_rss_bytes') or 0) / 2**20:.0f} MiB, engine {(entry.get('engine', {}).get('peak_rss_bytes') or 0) / 2**20:.0f} MiB, "
                   f"tune {(entry.get('tune', {}).get('peak_rss_bytes') or 0) / 2**20:.0f} MiB, "
                   f"llm {(entry.get('llm', {}).get('peak_rss_bytes') or 0) / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB")
        for name, peak in entry.get("phases", {}).get("phase_peaks", {}).items():
            end = entry["phases"].get("phase_end_rss", {}).get(name, {})
            report.log("bench_load_memory", f"  phase {name:<48} peak {peak / 2**20:7.0f} MiB ({peak / budget:.3f}x the budget), at its end RSS "
                       f"{end.get('VmRSS', 0) / 2**20:.0f} MiB (anon {end.get('RssAnon', 0) / 2**20:.0f}, file {end.get('RssFile', 0) / 2**20:.0f})")
        peaks = [(entry.get(stage, {}).get("peak_rss_bytes") or 0) / 2**20 for stage in ("load", "engine", "tune", "llm", "phases")]
        rows.append([path.name, file_bytes / 2**20, *peaks, budget / 2**20, ", ".join(entry.get("load", {}).get("formats", [])),
                     all(entry[stage].get("within_budget") for stage in stages)])
    print("\n" + report.format_table([("file", "<22"), ("file MiB", "9.0f"), ("peak load MiB", "13.0f"), ("peak engine MiB", "15.0f"),
                                      ("peak tune MiB", "13.0f"), ("peak llm MiB", "12.0f"), ("peak phases MiB", "15.0f"), ("budget MiB", "10.0f"), ("formats", "<40"),
                                      ("within", "<6")], rows))
    doc = {"question": "peak host RSS while a GGUF loads (and its engine starts) against file + KV pool + 1 GiB",
           "results": results, "runtime_s": time.perf_counter() - start}
    within = all(e[stage].get("within_budget") for e in results.values() for stage in stages)
    report.finish(args.out, doc, {"bench": "load_memory", "within_budget": within, "runtime_s": doc["runtime_s"]}, correct=within)


if __name__ == "__main__":
    main()
