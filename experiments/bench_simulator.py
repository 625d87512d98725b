"""How fast is the simulator, and how close are its predictions to real runs?

Two parts (--part simulate|errors|all):

1. simulate: --num-requests (100,000) synthetic requests (conversation-fitted lengths, clipped to the
   context) simulated as one batch job on the default EngineConfig, priced by a made-up cost table
   (seconds linear in each program's work); the seconds it takes. Host only, no model. Goal: <= 10 s.
2. errors: real runs of the default model (LLM() with a small engine) on a scaled sample of the
   conversation trace (jaxinfer.bucketing.traces.shared_trace, lengths and gaps divided by --scale) and on
   a synthetic trace, each replayed with its arrival times, under every policy (config.POLICIES) and three
   bucket tables (default, fitted:4 and powers-of-two:4 fitted to the sample). Before each run the
   simulator predicts it from the step-cost table as it stands (warm-up timings and the runs before);
   predicted vs measured wall time and TTFT p50. Goals: wall within 10%, TTFT p50 within 15%.

    .venv/bin/python experiments/bench_simulator.py [--part all] [--num-requests 100000] [--quick]
"""

import dataclasses
import math
import tempfile
import time

import numpy as np

from common import paths, report
from jaxinfer.bucketing import strategies, traces
from jaxinfer.config import EngineConfig
from jaxinfer.scheduling.bucket_tables import BucketTables
from jaxinfer.scheduling.simulator import SimRequest, simulate
from jaxinfer.scheduling.step_costs import StepCosts

RESULTS = paths.RESULTS_DIR / "bench_simulator.json"
GOALS = {
    "simulate_seconds": ("seconds to simulate the requests of part 1", 10.0, "at_most"),
    "worst_wall_error": ("largest |relative error| of predicted wall time", 0.10, "within"),
    "worst_ttft_p50_error": ("largest |relative error| of predicted TTFT p50", 0.15, "within"),
}
ENGINE = dict(max_context=512, page_size=16, max_num_seqs=8, max_prefill_tokens=256)
TABLES = ("default", "fitted:4", "powers-of-two:4")


def made_up_costs(cfg: EngineConfig) -> StepCosts:
    """Every program of `cfg` at 2 ms + 20 us per slot of work; host 0.5 ms + 20 us per row."""
    return StepCosts.linear(BucketTables.from_config(cfg).all_keys(), program=(2e-3, 2e-5), host=(5e-4, 2e-5), max_rows=32)


def part_simulate(num_requests: int) -> dict:
    cfg = EngineConfig()
    trace = traces.synthetic_trace(num_requests, 0, max_length=cfg.max_context // 2)
    requests = [SimRequest(int(p), int(o)) for p, o in zip(trace.context_tokens, trace.generated_tokens)]
    report.log("bench_simulator", f"simulating {num_requests} requests")
    start = time.perf_counter()
    result = simulate(cfg, requests, made_up_costs(cfg))
    seconds = time.perf_counter() - start
    report.log("bench_simulator", f"{num_requests} requests in {seconds:.2f} s ({num_requests / seconds:.0f} requests/s, {result.num_steps} steps)")
    return {"num_requests": num_requests, "seconds": round(seconds, 3), "requests_per_s": round(num_requests / seconds, 1), "summary": result.summary()}


def sample(trace: traces.Trace, n: int, scale: float, max_prompt: int, max_output: int, seed: int) -> list[tuple[int, int, float]]:
    """(prompt, output, arrival s) of n consecutive requests from a random start, lengths and gaps / scale."""
    start = np.random.default_rng(seed).integers(0, max(1, trace.num_requests - n))
    part = trace.take(slice(start, start + n))
    arrivals = (part.timestamps - part.timestamps[0]) / scale
    prompts = np.clip(np.ceil(part.context_tokens / scale), 1, max_prompt).astype(int)
    outputs = np.clip(np.ceil(part.generated_tokens / scale), 1, max_output).astype(int)
    return list(zip(prompts.tolist(), outputs.tolist(), arrivals.tolist()))


def table_config(spec: str, rows: list[tuple[int, int, float]]) -> EngineConfig:
    base = EngineConfig(**ENGINE)
    if spec == "default":
        return base
    kind, budget = spec.split(":")
    prompts = np.array([min(p, base.max_prefill_tokens) for p, _, _ in rows])
    pages = np.array([math.ceil((p + o) / base.page_size) for p, o, _ in rows])
    decode_rows = np.arange(1, base.max_num_seqs + 1)
    return dataclasses.replace(base, buckets=strategies.EngineBuckets.from_samples(kind, int(budget), chunk=prompts, rows=decode_rows, pages=pages))


def one_run(llm, cfg: EngineConfig, policy: str, rows: list[tuple[int, int, float]]) -> dict:
    """Predict with the cost table as it stands, then run for real and measure."""
    from jaxinfer.batch.step_log import StepLog
    from jaxinfer.scheduling.request import SamplingParams

    run_cfg = dataclasses.replace(llm.engine_config, policy=policy)
    llm.engine_config = run_cfg  # the programs do not depend on the policy; each stream's scheduler reads it
    costs = StepCosts.from_json(llm.step_costs().to_json())
    requests = [SimRequest(p, o, t) for p, o, t in rows]
    predicted = simulate(run_cfg, requests, costs, num_pages=llm.engine.num_pages).summary()
    rng = np.random.default_rng(len(rows))
    prompts = [rng.integers(100, 20000, p).tolist() for p, _, _ in rows]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o, _ in rows]
    llm.reset_prefix_cache()
    with tempfile.NamedTemporaryFile(suffix=".steps.jsonl") as f:
        log = StepLog(f.name, {}, costs=llm.step_costs())
        outputs = llm.generate(prompts, params, arrival_times=[t for _, _, t in rows], on_step=log, progress=False)
        log.close()
    measured = {"wall_s": log.summary()["wall_s"], "ttft_p50_s": float(np.percentile([o.time_to_first_token for o in outputs], 50))}
    errors = {name: (predicted[name] - measured[name]) / measured[name] for name in measured}
    return {"policy": policy, "measured": measured, "predicted": {k: predicted[k] for k in ("wall_s", "ttft_p50_s", "padding", "num_steps")},
            "wall_error": round(errors["wall_s"], 4), "ttft_p50_error": round(errors["ttft_p50_s"], 4)}


def part_errors(args) -> list[dict]:
    from jaxinfer.api import LLM
    from jaxinfer.config import POLICIES

    workloads = {"synthetic": traces.synthetic_trace(5000, 1, requests_per_s=traces.CONVERSATION_REQUESTS_PER_S)}
    try:
        workloads["conversation"] = traces.load_trace(traces.shared_trace())
    except traces.TraceError as e:
        report.log("bench_simulator", f"no conversation trace ({e}); synthetic only")
    policies = ["fcfs"] if args.quick else list(POLICIES)
    tables = TABLES[:1] if args.quick else TABLES
    names = ["synthetic"] if args.quick else list(workloads)
    n = 8 if args.quick else args.requests
    rows = []
    for spec in tables:
        samples = {name: sample(workloads[name], n, args.scale, ENGINE["max_context"] // 2, ENGINE["max_context"] // 4, seed=2) for name in names}
        cfg = table_config(spec, samples[names[0]])
        report.log("bench_simulator", f"loading the default model with tables {spec}")
        llm = LLM(None, engine_config=cfg)
        for name in names:
            for policy in policies:
                row = {"trace": name, "tables": spec, **one_run(llm, cfg, policy, samples[name])}
                report.log("bench_simulator", f"{name} {spec} {policy}: wall error {row['wall_error']:+.1%}, ttft p50 error {row['ttft_p50_error']:+.1%}")
                rows.append(row)
    return rows


def main() -> None:
    parser = report.arg_parser(__doc__, out=RESULTS)
    parser.add_argument("--part", default="all", choices=("simulate", "errors", "all"))
    parser.add_argument("--num-requests", type=int, default=100_000, help="requests of part 1")
    parser.add_argument("--requests", type=int, default=32, help="requests per real run of part 2")
    parser.add_argument("--scale", type=float, default=8.0, help="part 2's trace lengths and gaps are divided by this")
    parser.add_argument("--quick", action="store_true", help="part 1 on 2,000 requests; part 2: 8 requests, synthetic, fcfs, default tables")
    args = parser.parse_args()
    doc, measured = {"question": __doc__.split("\n")[0], "engine": ENGINE, "scale": args.scale}, {}
    if args.part in ("simulate", "all"):
        doc["simulate"] = part_simulate(2000 if args.quick else args.num_requests)
        measured["simulate_seconds"] = doc["simulate"]["seconds"] if doc["simulate"]["num_requests"] >= 100_000 else None
    if args.part in ("errors", "all"):
        doc["runs"] = part_errors(args)
        columns = [("trace", "<13"), ("tables", "<16"), ("policy", "<16"), ("wall s", ">8.3f"), ("pred", ">8.3f"), ("err", ">7.1%"),
                   ("ttft50", ">8.3f"), ("pred", ">8.3f"), ("err", ">7.1%")]
        print(report.format_table(columns, [[r["trace"], r["tables"], r["policy"], r["measured"]["wall_s"], r["predicted"]["wall_s"], r["wall_error"],
                                             r["measured"]["ttft_p50_s"], r["predicted"]["ttft_p50_s"], r["ttft_p50_error"]] for r in doc["runs"]]))
        measured["worst_wall_error"] = max(abs(r["wall_error"]) for r in doc["runs"])
        measured["worst_ttft_p50_error"] = max(abs(r["ttft_p50_error"]) for r in doc["runs"])
    doc["goals"] = report.judge(GOALS, measured)
    report.print_goals(doc["goals"])
    summary = {name: goal["measured"] for name, goal in doc["goals"].items()}
    report.finish(args.out.with_name(args.out.stem + "_quick.json") if args.quick else args.out, doc, summary)


if __name__ == "__main__":
    main()
