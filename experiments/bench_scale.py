"""What do tensor and data parallelism, the router and Ray cost on this machine?

The scaling benchmark, on CPU with simulated devices (XLA_FLAGS=--xla_force_host_platform_device_count),
which share this machine's cores: every figure is an overhead, never a speed-up.
  1. layouts: LLM(tensor_parallel=TP, data_parallel=DP) for each of --layouts in its own subprocess: load,
     cold warm-up, then a greedy run of --requests trace requests. Correctness first: greedy tokens vs
     1x1's (the share before the first difference must be >= 0.9: sharded sums add in another order).
  2. router: the largest replica's routed load / the mean, the router against round-robin.
  3. ray: one JSONL job run by `jaxinfer generate` locally and with --ray (1 and 2 actors), after a local
     run that fills the persistent compile cache. Correctness first: records equal the local ones.
--sections picks what runs; the others are kept from the existing --out file.

    .venv/bin/python experiments/bench_scale.py [--quick] [--layouts 1x1,2x1,4x1,1x2] [--sections layouts,router,ray]
"""

import argparse
import functools
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

from common import engine_runs, paths, peers, report, timing, workloads
from common.paths import REPO_ROOT

RESULTS = paths.RESULTS_DIR / "bench_scale.json"
WORK_DIR = REPO_ROOT / "build" / "bench_scale"


log = functools.partial(report.log, "bench_scale")


def engine_config(max_context: int, cache_dir: str):
    from jaxinfer.config import EngineConfig

    return EngineConfig(max_context=max_context, max_num_seqs=8, page_size=16, max_prefill_tokens=256, attention_impl="reference",
                        compilation_cache_dir=cache_dir)


def trace_workload(num_requests: int, scale: float, max_context: int) -> dict:
    """The common scaled trace sample (seed 0), outputs capped at a quarter of the benchmark's context."""
    return workloads.build_workload(None, num_requests, scale, 0, max_context=max_context, max_output=max_context // 4)


def run_layout(tp: int, dp: int, workload: dict, max_context: int) -> dict:
    """One layout in this process (which has the simulated devices)."""
    from jaxinfer.api import LLM

    cfg = engine_config(max_context, tempfile.mkdtemp(prefix="bench_scale_xla_"))
    llm, load_s = timing.timed(LLM, None, tensor_parallel=tp, data_parallel=dp, engine_config=cfg, warmup=False)
    _, warmup_s = timing.timed(lambda: [replica.engine.warmup() for replica in llm.replicas])
    run = engine_runs.timed_generate(llm, workload["requests"])
    outputs, seconds = run["outputs"], run["wall_s"]
    steps = {phase: run["recorder"].phase_seconds(phase) for phase in ("prefill", "decode")}
    num_output = sum(o.num_generated_tokens for o in outputs)
    return {
        "tensor_parallel": tp, "data_parallel": dp, "load_s": load_s, "warmup_compile_s": warmup_s,
        "programs": sum(r.engine.num_compilations for r in llm.replicas), "compiles_after_warmup": run["compiles"],
        "seconds": seconds, "output_tokens": num_output, "output_tokens_per_s": num_output / seconds,
        "prefill_steps": len(steps["prefill"]), "median_prefill_step_ms": 1e3 * float(np.median(steps["prefill"])),
        "decode_steps": len(steps["decode"]), "median_decode_step_ms": 1e3 * float(np.median(steps["decode"])),
        "routes": llm.last_routes, "tokens": [o.token_ids for o in outputs],
    }


def layouts_worker(args) -> None:
    import jax

    workload = json.loads(pathlib.Path(args.workload).read_text())
    tp, dp = map(int, args.worker.split("x"))
    assert len(jax.devices()) >= tp * dp, jax.devices()
    print(json.dumps(run_layout(tp, dp, workload, args.max_context)))


def measure_layouts(args, workload_file: pathlib.Path) -> list[dict]:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices}", JAX_PLATFORMS="cpu")
    rows = []
    for layout in args.layouts.split(","):
        log(f"layout TP x DP = {layout} ...")
        cmd = [sys.executable, __file__, "--worker", layout, "--workload", str(workload_file), "--max-context", str(args.max_context)]
        row = peers.run_json(cmd, f"layout {layout}", env=env, timeout=1800)
        log(f"  compile {row['warmup_compile_s']:.1f}s ({row['programs']} programs), run {row['seconds']:.1f}s, decode step {row['median_decode_step_ms']:.0f} ms")
        rows.append(row)
    base = rows[0]
    assert (base["tensor_parallel"], base["data_parallel"]) == (1, 1), "the first layout must be 1x1, the reference"
    for row in rows:
        name = f"{row['tensor_parallel']}x{row['data_parallel']}"
        assert row["compiles_after_warmup"] == 0, f"{name}: {row['compiles_after_warmup']} compiles after warm-up"
        row["agreement_with_1x1"] = workloads.agreement(base["tokens"], row["tokens"])
        # Sharded sums add in another order: a near-tie may flip late in a long greedy run, so the share is
        # reported; a layout that is wrong (not reordered) disagrees from the first tokens on.
        assert row["agreement_with_1x1"]["mean_prefix_fraction"] >= 0.9, f"{name}: greedy tokens diverge from one device: {row['agreement_with_1x1']}"
        row["seconds_vs_1x1"] = row["seconds"] / base["seconds"]
        row["decode_step_vs_1x1"] = row["median_decode_step_ms"] / base["median_decode_step_ms"]
        row["compile_vs_1x1"] = row["warmup_compile_s"] / base["warmup_compile_s"]
    return rows


def balance(loads: list[int]) -> float:
    return max(loads) / (sum(loads) / len(loads))


def route_loads(sizes: list[tuple[int, int]], replicas: int, policy: str) -> list[int]:
    """Token load per replica (prompt + output) after assigning each request in order."""
    from jaxinfer.scheduling.replicas import ReplicaLoad, route

    loads = [0] * replicas
    for i, (prompt, output) in enumerate(sizes):
        r = i % replicas if policy == "round_robin" else route([ReplicaLoad(load, 1000) for load in loads], prompt, output)
        loads[r] += prompt + output
    return loads


def measure_router(workload: dict, replicas: int) -> list[dict]:
    trace = [(len(r["prompt_ids"]), r["max_tokens"]) for r in workload["requests"]]
    rng = np.random.default_rng(0)
    skewed = [(int(n), 16) for n in rng.integers(10, 100, 60)]
    for slot in (0, 2, 4, 6):  # four long prompts, at the slots round-robin sends to one replica
        skewed.insert(slot, (2000, 16))
    rows = []
    for name, sizes in (("conversation trace, arrival order", trace), ("skewed: 4 long among 60 short", skewed)):
        row = {"workload": name, "requests": len(sizes), "replicas": replicas}
        for policy in ("router", "round_robin"):
            loads = route_loads(sizes, replicas, policy)
            row[policy] = {"loads": loads, "largest_over_mean": balance(loads)}
        rows.append(row)
    return rows


def write_job(workload: dict, path: pathlib.Path) -> None:
    from jaxinfer.loading.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    with open(path, "w") as f:
        for i, r in enumerate(workload["requests"]):
            text = tokenizer.decode(r["prompt_ids"], skip_special=True)
            f.write(json.dumps({"id": f"r{i}", "prompt": text, "max_tokens": r["max_tokens"], "ignore_eos": True}) + "\n")


def run_cli(job: pathlib.Path, output: pathlib.Path, cache: str, max_context: int, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "jaxinfer.cli", "generate", "--input", str(job), "--output", str(output), "--overwrite", "--temperature", "0",
           "--max-context", str(max_context), "--max-num-seqs", "8", "--page-size", "16", "--attention", "reference", "--compile-cache", cache,
           "--no-progress", *extra]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0"))
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(extra) or 'local'} job failed:\n{done.stderr[-3000:]}")
    job_s = float(re.search(r"wall time\s+([\d.]+) s", done.stderr)[1])
    records = {json.loads(line)["key"]: json.loads(line) for line in output.read_text().splitlines()}
    return {"process_wall_s": wall, "job_wall_s": job_s, "records": records}


def measure_ray(workload: dict, args) -> list[dict]:
    job = WORK_DIR / "ray_job.jsonl"
    write_job(workload, job)
    cache = tempfile.mkdtemp(prefix="bench_scale_ray_xla_")  # filled by the local run; the actors then load from it
    # The first run fills the persistent compile cache (its compile is cold); every later run, local or
    # an actor's, loads the same programs from it, so they compare like for like.
    runs = [("local, cold cache", []), ("local", []), ("ray, 1 actor", ["--ray", "--ray-actors", "1"]), ("ray, 2 actors", ["--ray", "--ray-actors", "2"])]
    rows, base = [], None
    for name, extra in runs:
        log(f"ray section: {name} ...")
        got = run_cli(job, WORK_DIR / f"out_{len(rows)}.jsonl", cache, args.max_context, extra)
        records = got.pop("records")
        base = base or records
        assert len(records) == len(workload["requests"]) and all(r["status"] == "ok" for r in records.values()), name
        assert {k: r["token_ids"] for k, r in records.items()} == {k: r["token_ids"] for k, r in base.items()}, f"{name}: records differ from the local job's"
        rows.append({"run": name, **got, "records_equal_local": True})
        log(f"  process {got['process_wall_s']:.1f}s, job {got['job_wall_s']:.1f}s")
    local = next(row for row in rows if row["run"] == "local")
    for row in rows:
        row["process_vs_local"] = row["process_wall_s"] / local["process_wall_s"]
        row["overhead_s"] = row["process_wall_s"] - local["process_wall_s"]
    return rows


def print_tables(result: dict) -> None:
    if result.get("layouts"):
        columns = [("TP x DP", "<8"), ("compile s", "9.1f"), ("programs", "8d"), ("run s", "7.1f"), ("tok/s", "7.1f"), ("decode ms", "9.0f"),
                   ("prefill ms", "10.0f"), ("run/1x1", "8.2f"), ("decode/1x1", "10.2f"), ("compile/1x1", "11.2f"), ("same tokens", "11.1%")]
        print("\n" + report.format_table(columns, [[f"{r['tensor_parallel']}x{r['data_parallel']}", r["warmup_compile_s"], r["programs"], r["seconds"],
                                                     r["output_tokens_per_s"], r["median_decode_step_ms"], r["median_prefill_step_ms"], r["seconds_vs_1x1"],
                                                     r["decode_step_vs_1x1"], r["compile_vs_1x1"], r["agreement_with_1x1"]["mean_prefix_fraction"]]
                                                    for r in result["layouts"]]))
    if result.get("router"):
        columns = [("workload", "<36"), ("router max/mean", "15.3f"), ("round-robin", "11.3f")]
        print("\n" + report.format_table(columns, [[r["workload"], r["router"]["largest_over_mean"], r["round_robin"]["largest_over_mean"]]
                                                    for r in result["router"]]))
    if result.get("ray"):
        columns = [(f"job ({result['settings']['ray_requests']} requests)", "<20"), ("process s", "9.1f"), ("job s", "7.1f"), ("vs local", "8.2f"),
                   ("overhead s", "10.1f")]
        print("\n" + report.format_table(columns, [[r["run"], r["process_wall_s"], r["job_wall_s"], r["process_vs_local"], r["overhead_s"]]
                                                    for r in result["ray"]]))


def parse_args():
    parser = report.arg_parser(__doc__, out=RESULTS)
    parser.add_argument("--quick", action="store_true", help="smoke run: layouts 1x1,2x1,1x2, 4 requests, 8 Ray requests, 1 and 2 actors")
    parser.add_argument("--layouts", default="1x1,2x1,4x1,1x2", help="TP x DP layouts; the first must be 1x1 (default: %(default)s)")
    parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=16, help="trace requests per layout run (default: %(default)s)")
    parser.add_argument("--ray-requests", type=int, default=64, help="lines of the Ray job (default: %(default)s)")
    parser.add_argument("--scale", type=float, default=16.0, help="trace lengths divided by this (default: %(default)s)")
    parser.add_argument("--max-context", type=int, default=512, help="(default: %(default)s)")
    parser.add_argument("--sections", default="layouts,router,ray", help="comma list of layouts, router, ray; the rest is kept from --out (default: %(default)s)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one layout, in a process with simulated devices
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.layouts, args.requests, args.ray_requests = "1x1,2x1,1x2", 4, 8
        if args.out == RESULTS:
            args.out = WORK_DIR / "bench_scale_quick.json"
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        layouts_worker(args)
        return
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    load_before = timing.load_average()
    sections = set(args.sections.split(","))
    result = json.loads(args.out.read_text()) if args.out.exists() and sections != {"layouts", "router", "ray"} else {}
    result |= {
        "question": "what do TP, DP, the router and Ray cost on this machine (simulated devices: overheads, not speed-ups)",
        "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "workload", "out")} | {"out": str(args.out)},
        "machine": {"load_average_before": load_before},  # the rest of the block is report.write_result's
    }
    if "layouts" in sections:
        workload_file = WORK_DIR / "workload.json"
        workload_file.write_text(json.dumps(trace_workload(args.requests, args.scale, args.max_context)))
        result["layouts"] = measure_layouts(args, workload_file)
        for row in result["layouts"]:
            row.pop("tokens")
    if "router" in sections:
        result["router"] = measure_router(trace_workload(64, 8.0, 2048), 2)
    if "ray" in sections:
        result["ray"] = measure_ray(trace_workload(args.ray_requests, args.scale, args.max_context), args)
    result["machine"]["load_average_after"] = timing.load_average()
    result["runtime_s"] = time.perf_counter() - start
    result = report.write_result(args.out, result, indent=1)
    print_tables(result)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
