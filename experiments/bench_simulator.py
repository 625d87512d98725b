"""How fast is the simulator, and how close are its predictions to real runs?

Two parts (--part simulate|errors|all):

1. simulate: --num-requests (100,000) synthetic requests (conversation-fitted lengths, clipped to the
   context) simulated as one batch job on the default EngineConfig, priced by a made-up cost table
   (seconds linear in each program's work); the seconds it takes. Host only, no model. Goal: <= 10 s.
2. errors: real runs of the default model (one LLM with a small engine, loaded and tuned once) on a scaled
   sample of the conversation trace (jaxinfer.bucketing.traces.shared_trace, lengths and gaps divided by
   --scale) and on a synthetic trace, each replayed with its arrival times, under every policy
   (config.POLICIES) and three bucket tables (default, fitted:4 and powers-of-two:4, fitted to both traces'
   samples together): 2 x 5 x 3 = 30 runs of --requests (32) each. Every table's programs are compiled and
   timed before the first real run (the engine swaps tables as a refit does: Engine.use_config, warm-up
   compiling only what it lacks), so the step costs warm-up saves to the tuner cache hold no run's steps.
   Per table, a discarded warm-up run per trace (--warm-up requests, those just after the sample) pays the
   table's programs' first real steps and refreshes their costs. Before each measured run the simulator
   predicts it from a copy of the step-cost table as it stands (warm-up timings, this machine's cached ones
   included, and the runs before; never the run itself); then the requests run --repeats (3) times, and the
   prediction is compared with the median of their wall times (first step's start to last step's end, the
   step log's and the simulator's span) and of their TTFT p50s (arrival to first token in both): one run's wall
   time moves with the machine (on a 2-core AMD EPYC a 5-s run's steps took 0.90-1.31x the table's prices from
   one run to the next, with the same schedule), which no prediction made before it can know. `first_run`
   keeps each prediction's errors against its first run alone (the protocol of one run), reported beside.
   Each row also holds both schedules' steps per program key (`same_schedule`) and device seconds, with the
   run's own steps priced by the prediction's table (`device_s_priced`), which separate a schedule that differs
   from a cost that does, and `own_costs`: the run simulated again priced by
   its own mean seconds per key (step plus host gap), the simulator's error with the cost table's taken out
   (a diagnostic after the fact, never the goal's figure). Goals: wall within 10%, TTFT p50 within 15%,
   judged only when the runs cover both traces, every policy and the three tables.

Runtime of `--part errors` alone on a 2-core CPU: with one repeat about 4 to 6 minutes with warm caches (3 min
22 s and 4 min 54 s on an AMD EPYC), about 9 with cold ones; each further repeat adds about 3 minutes. Of a
repeat: 30 runs of 32 requests ~3 min (~5 s each; a prediction < 0.1 s); besides: six warm-up runs ~0.5 min, loading, tuning and warming up the default
tables ~15 s (~2 min when the tuner's cache misses, as after a kernel or tuner change, and its choice
needs every program compiled anew), the other two tables' programs ~20 s (~1 min cold).
`phase_seconds` in the result JSON has the real split. --quick: under a minute with warm caches.

    .venv/bin/python experiments/bench_simulator.py [--part all] [--num-requests 100000] [--quick]
    JAXINFER_TRACE_DIR=/work/shared/data .venv/bin/python experiments/bench_simulator.py --part errors [--policies fcfs] [--tables default]
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
from jaxinfer.scheduling.plan import BucketKey
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


def table_config(spec: str, rows: list[tuple[int, int, float]], base: EngineConfig | None = None) -> EngineConfig:
    """`base` (default: ENGINE's settings) with the bucket tables `spec` names, fitted to `rows` where fitted."""
    base = base or EngineConfig(**ENGINE)
    if spec == "default":
        return dataclasses.replace(base, buckets=None)
    kind, budget = spec.split(":")
    prompts = np.array([min(p, base.max_prefill_tokens) for p, _, _ in rows])
    pages = np.array([math.ceil((p + o) / base.page_size) for p, o, _ in rows])
    decode_rows = np.arange(1, base.max_num_seqs + 1)
    return dataclasses.replace(base, buckets=strategies.EngineBuckets.from_samples(kind, int(budget), chunk=prompts, rows=decode_rows, pages=pages))


def prepare_tables(llm, cfg: EngineConfig) -> float:
    """Compile and time the programs of `cfg`'s tables that the loaded LLM lacks (Engine.warmup does only those;
    the tuner's choice is kept); the seconds that took."""
    start = time.perf_counter()
    llm.engine.use_config(cfg)
    llm.engine.warmup()
    return time.perf_counter() - start


def use_tables(llm, cfg: EngineConfig) -> None:
    """Run `cfg`'s tables from now on (their programs already compiled and timed)."""
    llm.engine.use_config(cfg)
    llm.engine_config = cfg


def real_run(llm, rows: list[tuple[int, int, float]], costs: StepCosts | None) -> tuple[dict, float, dict]:
    """Replay `rows` (greedy, EOS ignored, random prompt ids); (what it measured, the seconds it took, the step
    log's totals per program key). Its steps' host gaps refine `costs` (the LLM's table), as a job's step log does."""
    from jaxinfer.batch.step_log import StepLog
    from jaxinfer.scheduling.request import SamplingParams

    rng = np.random.default_rng(len(rows))
    prompts = [rng.integers(100, 20000, p).tolist() for p, _, _ in rows]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o, _ in rows]
    llm.reset_prefix_cache()
    start = time.perf_counter()
    with tempfile.NamedTemporaryFile(suffix=".steps.jsonl") as f:
        log = StepLog(f.name, {}, costs=costs)
        outputs = llm.generate(prompts, params, arrival_times=[t for _, _, t in rows], on_step=log, progress=False)
        log.close()
    seconds = time.perf_counter() - start
    summary = log.summary()
    return {"wall_s": summary["wall_s"], "ttft_p50_s": float(np.percentile([o.time_to_first_token for o in outputs], 50)),
            "num_steps": summary["num_steps"], "padding": summary["padding"], "device_s": round(sum(t.device_s for t in log.totals.values()), 6),
            "steps_by_key": {":".join(map(str, key)): t.steps for key, t in sorted(log.totals.items())}}, seconds, log.totals


def predict(llm, cfg: EngineConfig, rows: list[tuple[int, int, float]], costs: StepCosts | None = None) -> tuple[dict, float]:
    """The simulator's run of `rows` under `cfg`, priced by `costs` (default: a copy of the LLM's step-cost table
    as it stands now); (its figures, the seconds it took)."""
    start = time.perf_counter()
    costs = costs or StepCosts.from_json(llm.step_costs().to_json())  # a copy: a run after this refines the LLM's own table
    result = simulate(cfg, [SimRequest(p, o, t) for p, o, t in rows], costs, num_pages=llm.engine.num_pages)
    predicted = {k: result.summary()[k] for k in ("wall_s", "ttft_p50_s", "num_steps", "padding")}
    predicted["device_s"] = round(sum(n * costs.device_seconds(key) for key, n in result.steps_by_key.items()), 6)  # the wall less host time and idle waits
    predicted["steps_by_key"] = {":".join(map(str, key)): n for key, n in sorted(result.steps_by_key.items())}
    return predicted, time.perf_counter() - start


def relative_errors(predicted: dict, measured: dict) -> dict:
    return {f"{name[:-2]}_error": round((predicted[name] - measured[name]) / measured[name], 4) for name in ("wall_s", "ttft_p50_s")}


def own_costs(totals: dict) -> StepCosts:
    """A run's own seconds per program key as a cost table: each key's mean step plus host gap (step log totals),
    no host model; with the run's schedule, the simulator's wall is then the run's by construction."""
    costs = StepCosts()
    for key, t in totals.items():
        costs.observe(BucketKey(*key), (t.device_s + t.host_s) / t.steps)
    return costs


def one_run(llm, policy: str, rows: list[tuple[int, int, float]], repeats: int = 1) -> dict:
    """Predict with the cost table as it stands (before this run), then run for real `repeats` times and measure.
    The errors are against the median of the repeats' wall times and of their TTFT p50s (one run's wall time moves
    with the machine: on a 2-core AMD EPYC a run's steps took 0.90-1.31x the table's prices from one 5-s run to
    the next); `first_run` keeps the errors against the first repeat alone, the protocol of one run. `measured`
    is the repeat whose wall time is the median, `own_costs` a diagnostic only, never the goal's figure: that
    run simulated again priced by its own mean seconds per key, whose TTFT error (and wall error, where the
    schedule differs) is the simulator's alone, the cost table's left out."""
    run_cfg = dataclasses.replace(llm.engine_config, policy=policy)
    llm.engine_config = run_cfg  # the programs do not depend on the policy; each stream's scheduler reads it
    table = StepCosts.from_json(llm.step_costs().to_json())  # a copy: the runs refine the LLM's own table
    predicted, predict_s = predict(llm, run_cfg, rows, table)
    runs = [real_run(llm, rows, llm.step_costs()) for _ in range(repeats)]
    for measured, _, totals in runs:  # each run's own steps priced by the table the prediction used: its error is the cost table's alone
        measured["device_s_priced"] = round(sum(t.steps * table.device_seconds(BucketKey(*key)) for key, t in totals.items()), 6)
    measured, _, totals = sorted(runs, key=lambda run: run[0]["wall_s"])[(repeats - 1) // 2]  # the median run (the lower of two)
    median = {name: float(np.median([run[0][name] for run in runs])) for name in ("wall_s", "ttft_p50_s")}
    replay = predict(llm, run_cfg, rows, own_costs(totals))[0]
    return {"policy": policy, "measured": measured, "predicted": predicted, "median": median, **relative_errors(predicted, median),
            "first_run": relative_errors(predicted, runs[0][0]),
            "repeats": [{k: run[0][k] for k in ("wall_s", "ttft_p50_s", "device_s", "device_s_priced")} for run in runs],
            "same_schedule": predicted["steps_by_key"] == measured["steps_by_key"],
            "own_costs": {k: replay[k] for k in ("wall_s", "ttft_p50_s")} | relative_errors(replay, measured),
            "seconds": {"predict": round(predict_s, 3), "run": round(sum(run[1] for run in runs), 3)}}


def part_errors(args) -> tuple[list[dict], dict]:
    """The runs' rows and the seconds each phase took (construct, per table: tables, warm_up, runs)."""
    from jaxinfer.api import LLM

    workloads = {"synthetic": traces.synthetic_trace(5000, 1, requests_per_s=traces.CONVERSATION_REQUESTS_PER_S)}
    try:
        workloads["conversation"] = traces.load_trace(traces.shared_trace())
    except traces.TraceError as e:
        report.log("bench_simulator", f"no conversation trace ({e}); synthetic only")
    names = ["synthetic"] if args.quick else list(workloads)
    n = 8 if args.quick else args.requests
    lengths = dict(max_prompt=ENGINE["max_context"] // 2, max_output=args.max_output)
    windows = {name: sample(workloads[name], n + args.warm_up, args.scale, **lengths, seed=2) for name in names}
    samples = {name: rows[:n] for name, rows in windows.items()}
    warm_ups = {name: [(p, o, t - rows[n][2]) for p, o, t in rows[n:]] for name, rows in windows.items()}  # the requests after the sample's
    fit_rows = [row for name in names for row in samples[name]]  # fitted tables: to every run's requests
    phases = {"tables": {}}
    start = time.perf_counter()
    llm = LLM(None, engine_config=EngineConfig(**ENGINE))
    phases["construct"] = round(time.perf_counter() - start, 2)
    report.log("bench_simulator", f"loaded, tuned and warmed up the default model in {phases['construct']:.1f} s ({llm.choices})")
    configs = {spec: table_config(spec, fit_rows, llm.engine_config) for spec in args.tables}
    for spec, cfg in configs.items():  # all before any real run: the step costs warm-up saves (tuning_cache) hold no run's steps
        phases["tables"][spec] = {"tables": round(prepare_tables(llm, cfg), 2), "warm_up": 0.0, "runs": 0.0}
    rows = []
    for spec, cfg in configs.items():
        use_tables(llm, cfg)
        times = phases["tables"][spec]
        for name in names if args.warm_up else []:  # discarded: the table's programs' first real steps and the host model's first gaps
            times["warm_up"] += round(real_run(llm, warm_ups[name], llm.step_costs())[1], 2)
        report.log("bench_simulator", f"tables {spec}: programs compiled and timed in {times['tables']:.1f} s, warm-up runs {times['warm_up']:.1f} s")
        for name in names:
            for policy in args.policies:
                row = {"trace": name, "tables": spec, **one_run(llm, policy, samples[name], args.repeats)}
                times["runs"] += row["seconds"]["run"] + row["seconds"]["predict"]
                walls = ", ".join(f"{r['wall_s']:.2f}" for r in row["repeats"])
                report.log("bench_simulator", f"{name} {spec} {policy}: wall error {row['wall_error']:+.1%}, ttft p50 error {row['ttft_p50_error']:+.1%} "
                           f"(first run alone {row['first_run']['wall_error']:+.1%}, {row['first_run']['ttft_p50_error']:+.1%}; the runs' walls {walls} s) "
                           f"(own costs {row['own_costs']['wall_error']:+.1%}, {row['own_costs']['ttft_p50_error']:+.1%}; steps {row['predicted']['num_steps']} predicted, {row['measured']['num_steps']} run{'' if row['same_schedule'] else ', other keys'}; "
                           f"device s {row['predicted']['device_s']:.2f} predicted, {row['measured']['device_s']:.2f} run, {row['measured']['device_s_priced']:.2f} its steps at the table's prices; run {row['seconds']['run']:.1f} s)")
                rows.append(row)
        times["runs"] = round(times["runs"], 2)
    return rows, phases


def main() -> None:
    from jaxinfer.config import POLICIES

    parser = report.arg_parser(__doc__, out=RESULTS)
    parser.epilog = "--part errors takes about 10 minutes alone on a 2-core CPU with warm caches at 3 repeats (see the module docstring); --quick under 1 warm."
    parser.add_argument("--part", default="all", choices=("simulate", "errors", "all"))
    parser.add_argument("--num-requests", type=int, default=100_000, help="requests of part 1")
    parser.add_argument("--requests", type=int, default=32, help="requests per real run of part 2")
    parser.add_argument("--scale", type=float, default=8.0, help="part 2's trace lengths and gaps are divided by this")
    parser.add_argument("--max-output", type=int, default=ENGINE["max_context"] // 4, help="part 2's output lengths are clipped to this")
    parser.add_argument("--repeats", type=int, default=3, help="real runs of each prediction; its errors are against their medians (default: %(default)s)")
    parser.add_argument("--warm-up", type=int, default=None, help="requests of the discarded warm-up run per table and trace (default: --requests; 0: none)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="part 2's policies, comma separated (the goals need every one)")
    parser.add_argument("--tables", default=",".join(TABLES), help=f"part 2's bucket tables, comma separated, of {', '.join(TABLES)} (the goals need three)")
    parser.add_argument("--quick", action="store_true", help="part 1 on 2,000 requests; part 2: 8 requests, synthetic, fcfs, default tables")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    args.warm_up = (8 if args.quick else args.requests) if args.warm_up is None else args.warm_up
    args.policies = ["fcfs"] if args.quick else report.comma_list(parser, args.policies, POLICIES, "policies")
    args.tables = ["default"] if args.quick else report.comma_list(parser, args.tables, TABLES, "tables")
    doc, measured = {"question": __doc__.split("\n")[0], "engine": ENGINE, "scale": args.scale, "max_output": args.max_output, "warm_up": args.warm_up}, {}
    if args.part in ("simulate", "all"):
        doc["simulate"] = part_simulate(2000 if args.quick else args.num_requests)
        measured["simulate_seconds"] = doc["simulate"]["seconds"] if doc["simulate"]["num_requests"] >= 100_000 else None
    if args.part in ("errors", "all"):
        doc["runs"], doc["phase_seconds"] = part_errors(args)
        columns = [("trace", "<13"), ("tables", "<16"), ("policy", "<16"), ("wall s", ">8.3f"), ("pred", ">8.3f"), ("err", ">7.1%"), ("1 run", ">7.1%"),
                   ("ttft50", ">8.3f"), ("pred", ">8.3f"), ("err", ">7.1%"), ("1 run", ">7.1%")]
        print(report.format_table(columns, [[r["trace"], r["tables"], r["policy"], r["median"]["wall_s"], r["predicted"]["wall_s"], r["wall_error"], r["first_run"]["wall_error"],
                                             r["median"]["ttft_p50_s"], r["predicted"]["ttft_p50_s"], r["ttft_p50_error"], r["first_run"]["ttft_p50_error"]]
                                            for r in doc["runs"]]))
        worst = lambda errors: {"wall": max(abs(e["wall_error"]) for e in errors), "ttft_p50": max(abs(e["ttft_p50_error"]) for e in errors)}  # noqa: E731
        doc["worst_errors"], doc["worst_first_run_errors"] = worst(doc["runs"]), worst([r["first_run"] for r in doc["runs"]])
        doc["repeats"] = args.repeats
        missing = coverage_gaps(doc["runs"], POLICIES)
        if missing:  # the goals are over every policy, both traces and three tables: a subset is no measurement of them
            report.log("bench_simulator", f"the goals' errors are not measured: the runs lack {'; '.join(missing)}")
        doc["coverage_gaps"] = missing
        measured["worst_wall_error"] = None if missing else doc["worst_errors"]["wall"]
        measured["worst_ttft_p50_error"] = None if missing else doc["worst_errors"]["ttft_p50"]
    doc["goals"] = report.judge(GOALS, measured)
    report.print_goals(doc["goals"])
    summary = {name: goal["measured"] for name, goal in doc["goals"].items()}
    report.finish(args.out.with_name(args.out.stem + "_quick.json") if args.quick else args.out, doc, summary)


def coverage_gaps(runs: list[dict], policies) -> list[str]:
    """What the runs lack of the goals' dimensions: both traces, every policy, three tables (empty: none)."""
    gaps = []
    for name, have, need in (("traces", {r["trace"] for r in runs}, {"synthetic", "conversation"}), ("policies", {r["policy"] for r in runs}, set(policies)),
                             ("tables", {r["tables"] for r in runs}, set(TABLES))):
        if have != need:
            gaps.append(f"{name} {sorted(need - have)}")
    return gaps


if __name__ == "__main__":
    main()
