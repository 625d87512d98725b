"""Bucket strategies measured on the real engine: what does each strategy cost and buy at a program budget?

What is reported, and the committed run, are in docs/benchmarks.md ("buckets_on_engine.py"). Per trace,
plan_trace fits every (strategy, budget) to the step sizes of a dry scheduling pass (identical tables run
once); one worker subprocess (run_trace) loads the model once, compiles every configuration, then times
--repeats rounds over all of them in alternating order and keeps each one's best run. Correctness first:
the first configuration's shortest requests must equal the dense reference (else exit 1 after writing the
results); every configuration's tokens are compared with the first one's. Defaults: on a shared 2-core
CPU the 6 x 4 grid compiles ~250 programs cold per trace (~25 minutes); --quick takes a few minutes.

    nice -n 10 .venv/bin/python experiments/buckets_on_engine.py [--quick] [--model PATH|tiny]
        [--strategies pad-to-max,fitted] [--budgets 4,8,16,32] [--traces conversation,synthetic]
        [--num-requests 12] [--scale 16] [--repeats 2] [--replay-loads 0.5,1,2] [--slo 2,0.2] [--out-dir DIR]

Then every configuration is replayed under arrivals (traces.replay): the conversation trace's real gaps
(consecutive rows) or a bursty synthetic process, at each --replay-loads times the first configuration's
offline request rate, reporting TTFT/TPOT p99, throughput and goodput; the tokens must equal offline.
"""

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import pathlib
import subprocess
import sys
import shutil
import tempfile
import time

import numpy as np

from common import engine_runs, report, timing, workloads
from common.paths import REPO_ROOT, RESULTS_DIR, trace_or_default
from common.workloads import agreement
from jaxinfer.scheduling import runloop
from jaxinfer.scheduling.bucket_tables import BucketTables
from jaxinfer.bucketing.strategies import STRATEGY_KINDS, EngineBuckets, strategy_from_sample
from jaxinfer.config import EngineConfig
from jaxinfer.bucketing.traces import load_trace, synthetic_trace

WORK_DIR = REPO_ROOT / "build" / "buckets_on_engine"  # worker specs, the tiny model (not committed)
NAME = "buckets_on_engine"
STRATEGIES = tuple(STRATEGY_KINDS)
BUDGETS = (4, 8, 16, 32)
REPLAY_LOADS = (0.5, 1.0, 2.0)  # offered load under arrivals, in units of the first configuration's offline requests/s
SLO = (2.0, 0.2)  # (TTFT s, TPOT s) that goodput counts against
TRACES = ("conversation", "synthetic")
DEFAULT_TRACES = ("conversation",)  # the default run; both traces take about twice as long (module docstring)
MAX_BUCKETS_PER_DIMENSION = 64  # k is searched up to this


@dataclasses.dataclass(frozen=True)
class Limits:
    """The engine limits every configuration shares (EngineConfig fields)."""

    max_context: int = 512  # tokens per sequence; covers --scale 16 of most of the trace (longer prompts are cut)
    page_size: int = 16  # tokens per KV page (small, so short scaled prompts do not fragment pages badly)
    max_num_seqs: int = 8  # largest decode batch
    max_prefill_tokens: int = 256  # prefill tokens per step (the chunk cap)

    @property
    def num_pages(self) -> int:
        """Enough pages for max_num_seqs full contexts (+ the null page): nothing is ever preempted."""
        return self.max_num_seqs * (self.max_context // self.page_size) + 1

    def config(self, **fields) -> EngineConfig:
        """An EngineConfig of these limits (no prefix cache) and `fields`."""
        return EngineConfig(**dataclasses.asdict(self), num_pages=self.num_pages, enable_prefix_caching=False, **fields)


# ------------------------------------------------------------------------------------------ workload


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]  # token ids, arrival order
    max_tokens: list[int]
    arrival_shape: list[float]  # the replay's arrival times at a mean rate of one request per second

    @property
    def requests(self) -> list[dict]:
        return [{"prompt_ids": p, "max_tokens": n} for p, n in zip(self.prompts, self.max_tokens)]


def build_workloads(traces: tuple[str, ...], trace_path: pathlib.Path | None, num_requests: int, scale: float, seed: int, tokenizer, limits: Limits) -> list[Workload]:
    """The conversation trace (a seeded sample of rows, kept in trace order) and/or a synthetic trace."""
    text_ids = workloads.text_ids(tokenizer)
    built = []
    for name in traces:
        if name == "conversation":
            full = load_trace(trace_or_default(trace_path))
            trace = full.take(workloads.sample_rows(full.num_requests, num_requests, np.random.default_rng(seed)))
            start = int(np.random.default_rng(seed).integers(0, full.num_requests - num_requests))
            arrivals = full.timestamps[start : start + num_requests]  # real gaps: consecutive rows of the trace
        elif name == "synthetic":
            trace = synthetic_trace(num_requests, seed=seed)
            arrivals = synthetic_trace(num_requests, seed=seed, arrival="bursty").timestamps
        else:
            raise ValueError(f"unknown trace {name!r}; known: {', '.join(TRACES)}")
        # outputs capped at half the context; the prompt offsets come from a generator of their own
        requests = workloads.scaled_requests(trace, scale, np.random.default_rng(seed), text_ids, max_context=limits.max_context,
                                           max_output=limits.max_context // 2)
        built.append(Workload(name, [r["prompt_ids"] for r in requests], [r["max_tokens"] for r in requests], unit_rate(arrivals)))
    return built


def unit_rate(timestamps: np.ndarray) -> list[float]:
    """Arrival times from 0 with their gaps rescaled to a mean of one second (the replay then sets the rate)."""
    offsets = np.asarray(timestamps, np.float64) - timestamps[0]
    mean_gap = offsets[-1] / max(len(offsets) - 1, 1)
    return (offsets / mean_gap if mean_gap > 0 else offsets).tolist()


# ------------------------------------------------------------------------------------------ tables


def schedule_samples(workload: Workload, limits: Limits) -> dict[str, list[int]]:
    """Prefill tokens, decode rows and pages per row of every step of runloop.dry_run at the finest tables
    (every size a bucket): greedy tokens do not change the schedule when EOS is ignored, no prefix cache."""
    finest = limits.config(
        prefill_chunk_buckets=tuple(range(1, limits.max_prefill_tokens + 1)), decode_batch_buckets=tuple(range(1, limits.max_num_seqs + 1)),
        decode_page_buckets=tuple(range(1, limits.max_context // limits.page_size + 1)),
    )
    plans, _ = runloop.dry_run(finest, workload.prompts, workload.max_tokens, limits.num_pages)
    prefill = [plan.bucket for plan in plans if plan.phase == "prefill"]  # with every size a bucket, a key is the step's real size
    decode = [plan.bucket for plan in plans if plan.phase != "prefill"]
    return {"chunk": [key.num_tokens for key in prefill], "rows": [key.num_rows for key in decode] or [1],  # [1]: no decode step at all
            "pages": [plan.bucket.num_pages for plan in plans]}


DIMENSIONS = ("chunk", "rows", "pages")  # EngineBuckets fields, in the order leftover budget is spent on them
_TABLE_FIELDS = {"chunk": "prefill_chunk_buckets", "rows": "decode_batch_buckets", "pages": "decode_page_buckets"}  # EngineConfig's
_TABLE_ATTRS = {"chunk": "chunk_tokens", "rows": "decode_rows", "pages": "pages"}  # the same tables in BucketTables


def engine_config(limits: Limits, kind: str, counts: dict[str, int], samples: dict, **fields) -> EngineConfig:
    """One strategy kind per dimension, dimension d with counts[d] buckets fitted to samples[d]."""
    buckets = EngineBuckets(**{d: strategy_from_sample(kind, samples[d], counts[d]) for d in DIMENSIONS})
    return limits.config(buckets=buckets, **fields)


def tables_of(cfg: EngineConfig) -> dict[str, list[int]]:
    tables = BucketTables.from_config(cfg)  # the engine's tables: what cfg gave, and what it derives
    return {d: list(getattr(tables, _TABLE_ATTRS[d])) for d in DIMENSIONS}


def choose_counts(kind: str, budget: int, samples: dict, limits: Limits) -> dict:
    """Buckets per dimension for a total program budget: the largest uniform count whose tables compile at
    most `budget` programs, then the leftover spent one table step at a time on chunk, rows, pages in turn.
    Returns {"counts", "programs", "tables", "fits"}; fits is False when one bucket each is over budget."""
    tables = {(d, k): tables_of(limits.config(buckets=EngineBuckets(**{d: strategy_from_sample(kind, samples[d], k)})))[d]
              for d in DIMENSIONS for k in range(1, MAX_BUCKETS_PER_DIMENSION + 1)}  # (dimension, count) -> its cut table, only it set

    def programs(counts):
        return len(BucketTables.from_config(limits.config(**{_TABLE_FIELDS[d]: tables[d, counts[d]] for d in DIMENSIONS})).all_keys())

    uniform = [k for k in range(1, MAX_BUCKETS_PER_DIMENSION + 1) if programs(dict.fromkeys(DIMENSIONS, k)) <= budget]
    counts = dict.fromkeys(DIMENSIONS, uniform[-1] if uniform else 1)
    improved = bool(uniform)
    while improved:
        improved = False
        for d in DIMENSIONS:
            bigger = next((k for k in range(counts[d] + 1, MAX_BUCKETS_PER_DIMENSION + 1) if tables[d, k] != tables[d, counts[d]]), None)
            if bigger is not None and programs({**counts, d: bigger}) <= budget:
                counts[d], improved = bigger, True
    counts = {d: next(k for k in range(1, counts[d] + 1) if tables[d, k] == tables[d, counts[d]]) for d in DIMENSIONS}  # saturated: the least k
    cfg = engine_config(limits, kind, counts, samples)
    found = len(BucketTables.from_config(cfg).all_keys())
    return {"counts": counts, "programs": found, "tables": tables_of(cfg), "fits": found <= budget}


# ------------------------------------------------------------------------------------------ the configurations of one trace (a subprocess)


def fresh_compilation_cache() -> str:
    """A new, empty persistent-cache directory for the engines built next. JAX reads the cache dir once;
    the public `jax.experimental.compilation_cache.compilation_cache.reset_cache` makes it read the new one."""
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()
    return tempfile.mkdtemp(prefix="jaxinfer_xla_")


@contextlib.contextmanager
def cache_events():
    """{"hits", "misses"}: JAX persistent-cache events counted while active (jax.monitoring)."""
    import jax

    counts = {"hits": 0, "misses": 0}

    def listener(event: str, **_) -> None:
        for name in counts:
            counts[name] += event == f"/jax/compilation_cache/cache_{name}"

    jax.monitoring.register_event_listener(listener)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_listener(listener)


def compile_config(model, config: dict, limits: Limits, samples: dict, **impls) -> tuple[object, dict]:
    """A cold warm-up (an LLM over `model` = (model_cfg, params, tokenizer), a fresh cache dir) and a warm
    one (a second Engine over that dir). Returns (the cold LLM, its compile and peak-RSS measurements).
    `impls`: attention_impl / matmul_impl pinned (the first configuration's tuned choice), else tuned."""
    from jaxinfer.api import LLM
    from jaxinfer.engine.engine import Engine

    cache_dir = fresh_compilation_cache()
    cfg = engine_config(limits, config["kind"], config["counts"], samples, compilation_cache_dir=cache_dir, **impls)
    if tables_of(cfg) != config["tables"]:
        raise RuntimeError(f"tables differ from the planned ones: {tables_of(cfg)} != {config['tables']}")
    gc.collect()
    timing.reset_peak_rss()
    before, _ = timing.rss_bytes()
    llm = LLM.from_params(*model, engine_config=cfg, warmup=False)
    with cache_events() as cold_cache:
        llm.engine.warmup()
    programs = len(llm.engine.bucket_keys())  # forward programs (each bucket's); the draws are a few small ones beside them
    assert llm.engine.num_compilations == len(llm.engine.program_keys())
    warm_engine = Engine(llm.model_config, llm.engine.params, cfg)  # a second engine over the same cache dir
    with cache_events() as warm_cache:
        warm_engine.warmup()
    warm_s = warm_engine.compile_seconds
    del warm_engine
    gc.collect()
    _, peak = timing.rss_bytes()
    shutil.rmtree(cache_dir, ignore_errors=True)
    return llm, {
        "programs": programs, "compile_cold_s": llm.engine.compile_seconds, "compile_warm_s": warm_s,
        "cache_cold": cold_cache, "cache_warm": warm_cache,
        "peak_resident_bytes": peak, "resident_bytes_before": before, "attention_impl": llm.engine.impl,
    }


def summarize_runs(runs: list[dict], llm, workload: Workload, limits: Limits) -> dict:
    """The best (least wall time) of a configuration's runs, with every run's seconds beside it."""
    from jaxinfer.model.kv_pool import pool_bytes

    best = min(runs, key=lambda run: run["wall_s"])
    outputs, stats, recorder, engine = best["outputs"], best["stats"], best["recorder"], llm.engine
    summary = engine_runs.best_run(runs, workload.max_tokens)
    ttft = np.array([o.time_to_first_token for o in outputs])
    token_bytes = pool_bytes(llm.model_config, 1, 1, engine.engine_cfg.kv_cache_dtype)
    return {
        **summary, "cpu_seconds_per_repeat": [run["cpu_s"] for run in runs], "compiles_during_runs": sum(run["compiles"] for run in runs),
        "output_tokens_per_cpu_s": summary["num_output_tokens"] / min(run["cpu_s"] for run in runs),
        "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
        "padding_waste": stats.padding_waste, "table_padding": recorder.table_padding(),
        "num_steps": stats.num_steps, "num_preemptions": stats.num_preemptions,
        "steps": {phase: len(recorder.phase_seconds(phase)) for phase in ("prefill", "decode")},
        "step_seconds": {phase: sum(recorder.phase_seconds(phase)) for phase in ("prefill", "decode")},
        "mean_kv_utilization": stats.mean_kv_utilization, "peak_kv_utilization": stats.peak_kv_utilization,
        "fragmentation_mean": 1.0 - stats.mean_kv_utilization, "fragmentation_at_peak_utilization": 1.0 - stats.peak_kv_utilization,
        "pool_pages": engine.num_pages, "pool_bytes_allocated": engine.num_pages * limits.page_size * token_bytes,
        "pool_peak_pages_held": recorder.peak_pages, "pool_bytes_peak_held": recorder.peak_pages * limits.page_size * token_bytes,
        "kv_bytes_per_token": llm.model_config.kv_bytes_per_token(), "tokens": [o.token_ids for o in outputs],
    }


def _compile_all(spec: dict, limits: Limits, progress_line) -> tuple[dict, dict, tuple]:
    """compile_config over every configuration, the model loaded once and every later LLM built over the
    first engine's params: ({id: LLM}, {id: measurements or error}, the model as the engines hold it)."""
    from jaxinfer.loading import loading
    from jaxinfer.loading.tokenizer import load_tokenizer

    model_cfg, params = loading.load_model(spec["model"])
    model = (model_cfg, params, load_tokenizer(spec["model"]))
    llms, results, impls = {}, {}, {}
    for config in spec["configs"]:
        try:  # the first configuration's LLM tunes the impls (the default); the others run that choice, untuned
            llms[config["id"]], results[config["id"]] = compile_config(model, config, limits, spec["samples"], **impls)
            model = (model_cfg, llms[config["id"]].engine.params, model[2])
            choice = llms[config["id"]].choices
            impls = impls or {"attention_impl": choice.attention_impl, "matmul_impl": choice.matmul_impl}
        except Exception as error:  # one failing configuration is reported, the others still run
            results[config["id"]] = {"error": f"{type(error).__name__}: {error}"}
        r = results[config["id"]]
        progress_line(f"compiled {config['id']}: " + (r["error"] if "error" in r else f"{r['programs']} programs, cold {r['compile_cold_s']:.1f} s, warm {r['compile_warm_s']:.1f} s"))
    return llms, results, model


def run_trace(spec: dict, progress_line=print) -> list[dict]:
    """Every configuration of one trace: compile all, then `repeats` rounds of runs in alternating order (so
    other load on the machine falls on all alike), then the first one's tokens against the dense reference.
    progress_line(text) is called once per compile, timed run and replay."""
    limits, workload = Limits(**spec["limits"]), Workload(**spec["workload"])
    llms, results, model = _compile_all(spec, limits, progress_line)
    runs = {config_id: [] for config_id in llms}
    for round_index in range(spec["repeats"]):
        for config_id in list(llms) if round_index % 2 == 0 else list(reversed(llms)):
            try:
                runs[config_id].append(engine_runs.timed_generate(llms[config_id], workload.requests, llms[config_id].block_pool))
                line = f"run {round_index + 1} {config_id}: {runs[config_id][-1]['wall_s']:.1f} s"
            except Exception as error:
                results[config_id] = {**results[config_id], "error": f"{type(error).__name__}: {error}"}
                line = f"run {round_index + 1} {config_id}: {results[config_id]['error']}"
            progress_line(line)
    for config_id, llm in llms.items():
        if "error" not in results[config_id]:
            results[config_id] |= summarize_runs(runs[config_id], llm, workload, limits)
    first = spec["configs"][0]["id"]
    if spec.get("replay_loads") and "output_tokens_per_s" in results[first]:
        replay_all(spec, llms, results, workload, capacity=len(workload.prompts) / results[first]["seconds"], progress_line=progress_line)
    if "tokens" in results[first]:
        model_cfg, params, tokenizer = model  # the shortest requests' tokens as the engine computed them inside the full batch
        results[first]["reference_check"] = engine_runs.reference_check(params, model_cfg, tokenizer.eos_id, workload.requests,
                                                                    lambda chosen: [results[first]["tokens"][i] for i in chosen])
    return [{"id": c["id"], **results[c["id"]]} for c in spec["configs"]]


def replay_all(spec: dict, llms: dict, results: dict, workload: Workload, *, capacity: float, progress_line) -> None:
    """Each configuration under arrivals: the workload's arrival shape at each load x `capacity` (the first
    configuration's offline requests per second), by traces.replay; rows gain {"replay": {load: report}}."""
    from jaxinfer.bucketing.traces import replay

    params = [workloads.greedy(n) for n in workload.max_tokens]
    for config_id, llm in llms.items():
        if "error" in results[config_id]:
            continue
        results[config_id]["replay"] = {}
        for load in spec["replay_loads"]:
            llm.reset_prefix_cache()
            outputs, summary = replay(llm, workload.prompts, params, workload.arrival_shape, rate=load * capacity, slo_ttft_s=spec["slo_ttft_s"], slo_tpot_s=spec["slo_tpot_s"])
            summary |= {"tokens_as_offline": [o.token_ids for o in outputs] == results[config_id]["tokens"], "offered_requests_per_s": load * capacity}
            results[config_id]["replay"][str(load)] = summary
            progress_line(f"replay {config_id} load {load}: {summary['output_tokens_per_s']:.1f} tok/s, TTFT p99 {summary['ttft_p99_s']:.2f} s, goodput {summary['goodput_requests_per_s']:.2f} req/s")


def run_trace_in_subprocess(spec: dict, work_dir: pathlib.Path, on_line) -> list[dict]:
    """run_trace(spec) in a fresh process (its own JAX, cache and VmHWM); on_line(dict) per progress line."""
    work_dir.mkdir(parents=True, exist_ok=True)
    spec_file, out_file = work_dir / f"{spec['name']}.spec.json", work_dir / f"{spec['name']}.result.json"
    spec_file.write_text(json.dumps(spec))
    out_file.unlink(missing_ok=True)
    with open(work_dir / f"{spec['name']}.stderr.txt", "w+") as stderr:
        process = subprocess.Popen([sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", str(spec_file), str(out_file)],
                                   stdout=subprocess.PIPE, stderr=stderr, text=True)
        for line in process.stdout:
            if line.startswith("{"):
                on_line(json.loads(line))
        process.wait()
        stderr.seek(0)
        tail = stderr.read()[-2000:]
    if process.returncode or not out_file.exists():
        return [{"id": c["id"], "error": f"worker exited {process.returncode}: {tail}"} for c in spec["configs"]]
    return json.loads(out_file.read_text())


# ------------------------------------------------------------------------------------------ baselines (computed, not run) and the Pareto frontier


def memory_baselines(workload: Workload, limits: Limits, kv_bytes_per_token: int) -> dict:
    """KV bytes of the naive dense cache and of HF's growing cache on these requests (computed, not run)."""
    lengths = [(len(p), n) for p, n in zip(workload.prompts, workload.max_tokens)]
    batches = [lengths[i : i + limits.max_num_seqs] for i in range(0, len(lengths), limits.max_num_seqs)]
    hf = []
    for batch in batches:
        row = max(p for p, _ in batch) + max(n for _, n in batch)
        hf.append({"rows": len(batch), "row_tokens": row, "bytes": len(batch) * row * kv_bytes_per_token,
                   "utilization": sum(p + n for p, n in batch) / (len(batch) * row)})
    peak = max(hf, key=lambda b: b["bytes"])
    return {
        "computed_not_run": True, "kv_bytes_per_token": kv_bytes_per_token,
        "naive_dense": {"slots": limits.max_num_seqs * limits.max_context, "bytes": limits.max_num_seqs * limits.max_context * kv_bytes_per_token,
                        "what": "max_num_seqs x max_context slots, allocated for the whole run"},
        "hf_growing": {"peak_bytes": peak["bytes"], "peak_batch_utilization": peak["utilization"],
                       "mean_bytes": float(np.mean([b["bytes"] for b in hf])), "batches": hf,
                       "what": "static batches of max_num_seqs in arrival order; each row grows to the batch's longest prompt + longest output"},
    }


def pareto_frontier(rows: list[dict]) -> list[dict]:
    """Rows not dominated in (higher output tokens/s, lower TTFT p99), by throughput."""
    ok = [r for r in rows if "error" not in r]
    frontier = [r for r in ok if not any(
        o["output_tokens_per_s"] >= r["output_tokens_per_s"] and o["ttft_p99_s"] <= r["ttft_p99_s"]
        and (o["output_tokens_per_s"] > r["output_tokens_per_s"] or o["ttft_p99_s"] < r["ttft_p99_s"]) for o in ok)]
    return sorted(frontier, key=lambda r: r["output_tokens_per_s"])


# ------------------------------------------------------------------------------------------ report


TABLE_COLUMNS = [("strategy", "<14"), ("B", "2d"), ("c/r/p", "6"), ("progs", "5d"), ("cold s", "6.1f"), ("warm s", "6.1f"), ("pad", "6.1%"),
                 ("tbl pad", "7.1%"), ("tok/s", "6.1f"), ("tok/cpu-s", "9.2f"), ("ttft p50", "8.2f"), ("ttft p99", "8.2f"), ("kv mean", "7.1%"),
                 ("kv peak", "7.1%"), ("frag", "5.1%"), ("held MiB", "8.1f"), ("rss MiB", "7.0f"), ("+MiB", "5.0f"), ("agree", "5.0%"), ("", "<")]
TABLE_LEGEND = ("c/r/p: buckets in the chunk / decode rows / pages tables; pad: padded-token share (SchedulerStats.padding_waste); "
                "tbl pad: padded page-table entries; tok/s: output tokens per wall second (best run); tok/cpu-s: per CPU second of the "
                "worker (less sensitive to other load); ttft in s; kv mean/peak: tokens / slots of held pages; frag: 1 - kv mean "
                "(allocated-but-unused slots); held MiB: KV pool bytes held at the peak; rss MiB: process VmHWM over this "
                "configuration's warm-ups (process-wide: runtime, weights, compiler, and the engines of the configurations before it); "
                "+MiB: that peak over the RSS before it; agree: requests with the same greedy tokens as the first row")


REPLAY_COLUMNS = [("strategy", "<14"), ("B", "2d"), ("load", "4.1f"), ("tok/s", "6.1f"), ("ttft p99", "8.2f"), ("tpot p99", "8.3f"), ("goodput", "7.2f")]


def format_table(rows: list[dict]) -> str:
    table = []
    for r in rows:
        head = [r["strategy"], r["budget"], "/".join(str(len(r["tables"][d])) for d in DIMENSIONS)]  # buckets in the chunk, rows and pages tables
        note = ("" if r.get("fits", True) else "over budget ") + ("" if r["same_tables_as"] == f"{r['strategy']} B={r['budget']}" else f"= {r['same_tables_as']}")
        table.append(head + [f"error: {r['error'][-200:]!r}"] if "error" in r else head + [
            r["programs"], r["compile_cold_s"], r["compile_warm_s"], r["padding_waste"], r["table_padding"], r["output_tokens_per_s"],
            r["output_tokens_per_cpu_s"], r["ttft_p50_s"], r["ttft_p99_s"], r["mean_kv_utilization"], r["peak_kv_utilization"], r["fragmentation_mean"],
            r["pool_bytes_peak_held"] / 2**20, r["peak_resident_bytes"] / 2**20, (r["peak_resident_bytes"] - r["resident_bytes_before"]) / 2**20,
            r["agreement"]["exact_requests"], note])
    return report.format_table(TABLE_COLUMNS, table)


def format_baselines(trace: dict) -> str:
    b, rows = trace["baselines"], [r for r in trace["rows"] if "error" not in r]
    mib = lambda x: f"{x / 2**20:.2f} MiB"  # noqa: E731
    held = [r["pool_bytes_peak_held"] for r in rows]
    lines = ["KV memory on these requests (paged pool measured; dense and HF computed, not run):",
             f"  naive dense cache, {b['naive_dense']['slots']} slots: {mib(b['naive_dense']['bytes'])}",
             f"  HF growing cache, peak batch: {mib(b['hf_growing']['peak_bytes'])} ({b['hf_growing']['peak_batch_utilization']:.0%} of its slots hold tokens)"]
    if held:
        lines.append(f"  paged pool: held at peak {mib(min(held))} to {mib(max(held))} across configurations, "
                     f"mean fragmentation {min(r['fragmentation_mean'] for r in rows):.1%} to {max(r['fragmentation_mean'] for r in rows):.1%} "
                     f"(allocated up front: {mib(rows[0]['pool_bytes_allocated'])}, sized so nothing is preempted)")
    return "\n".join(lines)


PLOTS = {  # name: (x, y (solid), dashed y or None, x label, y label)
    "throughput_vs_programs": ("programs", "output_tokens_per_s", "output_tokens_per_cpu_s", "programs compiled",
                               "output tokens/s (solid per wall s, dashed per CPU s)"),  # CPU seconds: less sensitive to other load
    "compile_vs_programs": ("programs", "compile_cold_s", "compile_warm_s", "programs compiled", "warm-up compile seconds (solid cold, dashed warm)"),
    "padding_vs_throughput": ("padding_waste", "output_tokens_per_s", None, "padded-token share", "output tokens/s"),
    "pareto_ttft_throughput": ("output_tokens_per_s", "ttft_p99_s", None, "output tokens/s", "TTFT p99 (s)"),
}


def _plot_panel(axes, trace: dict, name: str) -> None:
    """PLOTS[name] of one trace: a line per strategy; on the Pareto plot each point's budgets and the frontier."""
    from matplotlib.ticker import PercentFormatter

    x, y, dashed, xlabel, ylabel = PLOTS[name]
    pareto, ok = name == "pareto_ttft_throughput", [r for r in trace["rows"] if "error" not in r]
    for strategy in dict.fromkeys(r["strategy"] for r in ok):
        rows = sorted((r for r in ok if r["strategy"] == strategy), key=lambda r: (r["budget"], r[x]) if pareto else (r[x], r["budget"]))
        line, = axes.plot([r[x] for r in rows], [r[y] for r in rows], "o-", label=strategy, alpha=0.8)
        if dashed:
            axes.plot([r[x] for r in rows], [r[dashed] for r in rows], "s--", color=line.get_color(), alpha=0.6)
        labels: dict[tuple, list[str]] = {}  # identical tables share a point and a label
        for r in rows if pareto else []:
            labels.setdefault((r[x], r[y]), []).append(str(r["budget"]))
        for point, budgets in labels.items():
            axes.annotate("B=" + ",".join(budgets), point, textcoords="offset points", xytext=(4, 3), fontsize=7)
    if pareto:
        frontier = pareto_frontier(trace["rows"])
        axes.step([r[x] for r in frontier], [r[y] for r in frontier], "k:", where="post", linewidth=2)
        axes.plot([r[x] for r in frontier], [r[y] for r in frontier], "D", markersize=11, markerfacecolor="none",
                  markeredgecolor="k", linestyle=":", color="k", label="Pareto frontier")
    axes.set(xlabel=xlabel, ylabel=ylabel, title=f"{trace['workload']['name']} trace")
    if x == "padding_waste":
        axes.xaxis.set_major_formatter(PercentFormatter(1.0))


def _plot_replay_panel(axes, trace: dict) -> None:
    """Under arrivals: every (budget, load) point of each strategy, and its frontier as a line."""
    markers = {0: "o", 1: "s", 2: "^", 3: "v"}
    points = replay_points(distinct_rows(trace["rows"]))
    loads = sorted({p["load"] for p in points})
    for strategy, frontier in trace["replay_frontier"].items():
        line, = axes.plot([p["output_tokens_per_s"] for p in frontier], [p["ttft_p99_s"] for p in frontier], "-", label=strategy, alpha=0.8)
        for p in (p for p in points if p["strategy"] == strategy):
            axes.plot(p["output_tokens_per_s"], p["ttft_p99_s"], markers.get(loads.index(p["load"]), "x"), color=line.get_color(), alpha=0.7)
    for i, load in enumerate(loads):
        axes.plot([], [], markers.get(i, "x"), color="gray", label=f"load {load:g}")
    axes.set(xlabel="output tokens/s under arrivals", ylabel="TTFT p99 (s)", title=f"{trace['workload']['name']} trace, replayed", yscale="log")


def _save_panels(traces: list[dict], draw, title: str, path: pathlib.Path, legend_size: int) -> str:
    """A figure of one panel per trace, each draw(axes, trace) then a grid and a legend, saved to `path`."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6 * len(traces), 4.5), layout="constrained")
    for axes, trace in zip(np.atleast_1d(figure.subplots(1, len(traces))), traces):
        draw(axes, trace)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=legend_size)
    figure.suptitle(title, fontsize=10)
    figure.savefig(path, dpi=110)
    return str(path)


def plot_all(traces: list[dict], out_dir: pathlib.Path, model_name: str = "") -> dict[str, str]:
    """The PLOTS and, where there were replays, the replay frontiers, one panel per trace; returns {plot name: path}."""
    import matplotlib

    matplotlib.use("Agg")
    paths = {name: _save_panels(traces, functools.partial(_plot_panel, name=name), f"bucket strategies on the engine ({model_name})",
                                out_dir / f"{NAME}_{name}.png", legend_size=8) for name in PLOTS}
    if any(t["replay_frontier"] for t in traces):
        title = f"TTFT p99 / throughput frontier of each strategy under arrivals ({model_name})"
        paths["replay_frontier"] = _save_panels(traces, _plot_replay_panel, title, out_dir / f"{NAME}_replay_frontier.png", legend_size=7)
    return paths


# ------------------------------------------------------------------------------------------ the experiment


def resolve_model(model: str | None) -> str | None:
    """None (SmolLM2-135M), a path, or "tiny": a random tiny Llama with SmolLM2's tokenizer under build/."""
    from jaxinfer.loading.tiny_model import save_tiny_llama
    from jaxinfer.loading.tokenizer import load_tokenizer

    folder = WORK_DIR / "tiny_model"
    if model == "tiny" and not (folder / "config.json").exists():
        save_tiny_llama(folder, load_tokenizer(None), max_position=2048)
    return str(folder) if model == "tiny" else model


def plan_trace(workload: Workload, strategies, budgets, limits: Limits) -> tuple[dict, list[dict], list[dict]]:
    """(step-size samples, rows: one per strategy x budget, configs: one per distinct set of tables)."""
    samples = schedule_samples(workload, limits)
    rows, configs = [], {}
    for strategy in strategies:
        for budget in budgets:
            fit = choose_counts(strategy, budget, samples, limits)
            key = json.dumps(fit["tables"])  # identical tables run once
            if key not in configs:
                configs[key] = {"id": f"{strategy} B={budget}", "kind": strategy, "counts": fit["counts"], "tables": fit["tables"]}
            rows.append({"strategy": strategy, "budget": budget, **fit, "same_tables_as": configs[key]["id"]})
    return samples, rows, list(configs.values())


def trace_result(workload: Workload, samples: dict, rows: list[dict], configs: list[dict], by_id: dict, limits: Limits) -> dict:
    """One trace's document: rows filled from the worker's `by_id`, agreement, baselines, Pareto frontier."""
    for row in rows:
        row.update({k: v for k, v in by_id[row["same_tables_as"]].items() if k != "id"})
    first_tokens = by_id[configs[0]["id"]].get("tokens")
    ok = [r for r in rows if "error" not in r]
    for r in ok:
        r["agreement"] = agreement(r["tokens"], first_tokens) if first_tokens else {"exact_requests": float("nan"), "mean_prefix_fraction": float("nan")}
    all_same = [all(r["tokens"][i] == first_tokens[i] for r in ok) for i in range(len(workload.prompts))] if ok and first_tokens else []
    distinct = distinct_rows(rows)
    points = replay_points(distinct)  # under arrivals; replay_frontier is each strategy's TTFT p99 / throughput frontier of them
    return {
        "workload": {"name": workload.name, **workloads.workload_summary(workload.requests)}, "samples": {k: {"count": len(v), "min": min(v), "max": max(v), "median": float(np.median(v))} for k, v in samples.items()},
        "reference_check": by_id[configs[0]["id"]].get("reference_check"), "rows": rows,
        "agreement_all_configurations": {"exact_requests": float(np.mean(all_same)) if all_same else None, "against": configs[0]["id"]},
        "baselines": memory_baselines(workload, limits, ok[0]["kv_bytes_per_token"]) if ok else None,
        "pareto_frontier": [{"strategy": r["strategy"], "budget": r["budget"], "programs": r["programs"], "output_tokens_per_s": r["output_tokens_per_s"],
                             "ttft_p99_s": r["ttft_p99_s"], "same_tables": [f"{o['strategy']} B={o['budget']}" for o in rows if o["same_tables_as"] == r["same_tables_as"]]}
                            for r in pareto_frontier(distinct)],
        "replay_frontier": {s: pareto_frontier([p for p in points if p["strategy"] == s]) for s in dict.fromkeys(p["strategy"] for p in points)},
    }


def distinct_rows(rows: list[dict]) -> list[dict]:
    """The rows whose tables no earlier row has (the others repeat its figures)."""
    return [r for r in rows if r["same_tables_as"] == f"{r['strategy']} B={r['budget']}"]


def replay_points(rows: list[dict]) -> list[dict]:
    """One point per (row, load) of the replays: throughput, TTFT p99, goodput."""
    return [{"strategy": r["strategy"], "budget": r["budget"], "load": float(load), "output_tokens_per_s": rep["output_tokens_per_s"],
             "ttft_p99_s": rep["ttft_p99_s"], "tpot_p99_s": rep["tpot_p99_s"], "goodput_requests_per_s": rep["goodput_requests_per_s"]}
            for r in rows if "error" not in r for load, rep in r.get("replay", {}).items()]


def run_experiment(*, model: str | None = None, strategies=STRATEGIES, budgets=BUDGETS, traces=DEFAULT_TRACES, num_requests: int = 12,
                   scale: float = 16.0, seed: int = 0, limits: Limits = Limits(), repeats: int = 2, trace_path=None,
                   out_dir: pathlib.Path = RESULTS_DIR, progress: bool = True, replay_loads=REPLAY_LOADS, slo=SLO) -> dict:
    """The whole experiment: returns the result document (also written to out_dir with the plots)."""
    from tqdm import tqdm  # text bars (tqdm.auto wants ipywidgets in a notebook)

    from jaxinfer.loading.tokenizer import load_tokenizer

    start_time = time.perf_counter()
    label = {None: "SmolLM2-135M-Instruct (default)", "tiny": "tiny random Llama, SmolLM2's tokenizer"}.get(model) or pathlib.Path(model).name
    model = resolve_model(model)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    built = build_workloads(tuple(traces), trace_path, num_requests, scale, seed, load_tokenizer(model), limits)
    plans = [(workload, *plan_trace(workload, strategies, budgets, limits)) for workload in built]
    bar = tqdm(total=sum(len(p[3]) for p in plans) * (1 + repeats + len(replay_loads)), unit="step", disable=not progress, desc="compile + timed runs + replays")
    traces_out = []
    for workload, samples, rows, configs in plans:
        spec = {"name": workload.name, "model": model, "limits": dataclasses.asdict(limits), "workload": dataclasses.asdict(workload),
                "samples": samples, "configs": configs, "repeats": repeats, "replay_loads": list(replay_loads), "slo_ttft_s": slo[0], "slo_tpot_s": slo[1]}

        def on_line(line, name=workload.name):
            bar.update(1)
            bar.write(f"{name} {line['line']}")

        by_id = {r["id"]: r for r in run_trace_in_subprocess(spec, WORK_DIR / "workers", on_line)}
        traces_out.append(trace_result(workload, samples, rows, configs, by_id, limits))
    bar.close()
    plots = plot_all(traces_out, out_dir, label)
    correct = all(t["reference_check"] is not None and t["reference_check"]["num_equal"] == t["reference_check"]["num_checked"] for t in traces_out)
    correct = correct and all(rep["tokens_as_offline"] for t in traces_out for r in t["rows"] for rep in r.get("replay", {}).values())
    for trace in traces_out:
        for r in trace["rows"]:
            r.pop("tokens", None)  # compared above; too bulky to keep
    return {
        "question": "what each bucket strategy costs (programs, compile time, memory) and buys (padding, throughput, TTFT) on the real engine at a total program budget",
        "model": label, "model_path": model, "limits": {**dataclasses.asdict(limits), "num_pages": limits.num_pages},
        "settings": {"strategies": list(strategies), "budgets": list(budgets), "num_requests": num_requests, "scale": scale, "seed": seed,
                     "repeats": repeats, "mode": "offline (all requests submitted at once), then replayed under arrivals at each load",
                     "replay_loads": list(replay_loads), "replay_load_unit": "the first configuration's offline requests per second",
                     "slo": {"ttft_s": slo[0], "tpot_s": slo[1]}, "prefill_packing": True, "prefix_caching": False},
        "correct": correct, "traces": traces_out, "plots": plots, "runtime_s": time.perf_counter() - start_time,
    }


def summary_line(result: dict) -> dict:
    """The last stdout line: correctness, agreement, and the best configurations per trace."""
    per_trace = {}
    for trace in result["traces"]:
        ok = [r for r in trace["rows"] if "error" not in r]
        best = max(ok, key=lambda r: r["output_tokens_per_s"]) if ok else None
        per_trace[trace["workload"]["name"]] = {
            "best_throughput": best and {"strategy": best["strategy"], "budget": best["budget"], "programs": best["programs"], "output_tokens_per_s": round(best["output_tokens_per_s"], 1)},
            "pareto": [f"{p['strategy']} B={p['budget']}" for p in trace["pareto_frontier"]],
            "agreement_exact_requests": trace["agreement_all_configurations"]["exact_requests"],
            "errors": len(trace["rows"]) - len(ok),
        }
    return {"bench": NAME, "correct": result["correct"], "traces": per_trace, "runtime_s": round(result["runtime_s"], 1)}


def print_report(result: dict) -> None:
    for trace in result["traces"]:
        w = trace["workload"]
        print(f"\n{w['name']} trace: {w['num_requests']} requests, prompts median {w['median_prompt']:.0f} / max {w['max_prompt']}, "
              f"outputs median {w['median_output']:.0f} / max {w['max_output']} tokens ({result['model']})")
        check = trace["reference_check"]
        if check:
            print(f"reference check (dense generate.generate): {check['num_equal']}/{check['num_checked']} requests equal")
        print(format_table(trace["rows"]))
        print(TABLE_LEGEND)
        agree = trace["agreement_all_configurations"]
        print(f"greedy tokens identical across every configuration: {agree['exact_requests']:.0%} of requests (vs {agree['against']})")
        if trace["baselines"]:
            print(format_baselines(trace))
        print("Pareto frontier (tok/s up, TTFT p99 down): " + ", ".join(
            f"{p['strategy']} B={p['budget']} ({p['output_tokens_per_s']:.1f} tok/s, {p['ttft_p99_s']:.2f} s)" for p in trace["pareto_frontier"]))
        points = replay_points(distinct_rows(trace["rows"]))
        if points:
            slo = result["settings"]["slo"]
            print(f"\nreplayed under arrivals (load x the first configuration's offline requests/s; goodput: requests/s within TTFT {slo['ttft_s']} s and TPOT {slo['tpot_s']} s):")
            rows = [[p["strategy"], p["budget"], p["load"], p["output_tokens_per_s"], p["ttft_p99_s"], p["tpot_p99_s"], p["goodput_requests_per_s"]] for p in points]
            print(report.format_table(REPLAY_COLUMNS, rows))
            for strategy, frontier in trace["replay_frontier"].items():
                print(f"  {strategy} frontier: " + ", ".join(f"B={p['budget']} load {p['load']:g} ({p['output_tokens_per_s']:.1f} tok/s, {p['ttft_p99_s']:.2f} s)" for p in frontier))


def parse_args(argv=None) -> argparse.Namespace:
    parser = report.arg_parser(__doc__, trace=True)
    parser.add_argument("--model", default=None, help="a GGUF file or HF folder; 'tiny' builds a random tiny Llama; default SmolLM2-135M")
    parser.add_argument("--quick", action="store_true", help="tiny model, 8 requests, pad-to-max and fitted at budgets 4 and 16")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    parser.add_argument("--traces", default=",".join(DEFAULT_TRACES), help=f"comma-separated, of {', '.join(TRACES)}")
    parser.add_argument("--num-requests", type=int, default=12)
    parser.add_argument("--scale", type=float, default=16.0, help="trace token counts are divided by this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of timed runs over every configuration; the best run of each is reported")
    parser.add_argument("--out-dir", type=pathlib.Path, default=RESULTS_DIR)
    parser.add_argument("--replay-loads", default=",".join(map(str, REPLAY_LOADS)),
                        help="offered loads of the arrival replay, in units of the first configuration's offline requests/s; '' skips it (default: %(default)s)")
    parser.add_argument("--slo", default=",".join(map(str, SLO)), metavar="TTFT,TPOT", help="seconds: the SLO goodput counts against (default: %(default)s)")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:  # the quick settings replace only options left at their defaults
        args.model, args.num_requests = args.model or "tiny", min(args.num_requests, 8)
        quick = {"strategies": "pad-to-max,fitted", "budgets": "4,16", "replay_loads": "1.0"}
        vars(args).update({name: value for name, value in quick.items() if getattr(args, name) == parser.get_default(name)})
    try:
        args.replay_loads = tuple(float(x) for x in args.replay_loads.split(",") if x.strip())
        args.slo = tuple(float(x) for x in args.slo.split(","))
    except ValueError:
        parser.error("--replay-loads and --slo take comma-separated numbers")
    if len(args.slo) != 2 or any(x <= 0 for x in (*args.replay_loads, *args.slo)):
        parser.error("--slo takes TTFT,TPOT seconds and --replay-loads positive numbers")
    args.strategies = report.comma_list(parser, args.strategies, STRATEGY_KINDS, "strategies")
    args.traces = report.comma_list(parser, args.traces, TRACES, "traces")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        spec_file, out_file = args.worker
        results = run_trace(json.loads(pathlib.Path(spec_file).read_text()), progress_line=lambda line: print(json.dumps({"line": line}), flush=True))
        pathlib.Path(out_file).write_text(json.dumps(results))
        return
    result = run_experiment(model=args.model, strategies=tuple(args.strategies), budgets=tuple(int(b) for b in args.budgets.split(",")),
                            traces=tuple(args.traces), num_requests=args.num_requests, scale=args.scale, seed=args.seed,
                            repeats=args.repeats, trace_path=args.trace, out_dir=args.out_dir, replay_loads=args.replay_loads, slo=args.slo)
    print_report(result)
    print(f"\nresults: {args.out_dir / f'{NAME}.json'} and {len(result['plots'])} plots")
    report.finish(args.out_dir / f"{NAME}.json", result, summary_line(result), correct=result["correct"])


if __name__ == "__main__":
    main()
