"""Does a job that plans itself come within 10% of the best configuration a grid finds, measured in the same run?

Two workloads of the default model: the conversation trace's prompt lengths (`shared_trace`, else the
synthetic trace) as real text, and few-shot lines (bench_prefix_admission's preambles). One LLM is loaded
without warm-up and serves both workloads (the second compiles only the programs the first did not; the
prefix cache is emptied before every run); per workload, first the plan is made from the workload (batch/planning.py: the sample, the
simulated grid, the tables fitted under the program budget, the prefix policy), priced with this machine's
cached step costs or the prior, before anything runs. Then every configuration of the grid (max_num_seqs x
max_prefill_tokens x {the default tables, tables fitted under the budget}) and the plan's run for real on the
same engine and pool (`Engine.use_config`, warm-up compiles only the programs a configuration adds), each
timed from the first step to the last output, as a batch job pulls its lines (4 x max_num_seqs in flight),
after one untimed run of the plan's configuration; with --repeats N every configuration runs N times, round
robin, and keeps its fastest (a loaded machine's slow spells fall on all of them).
The plan and the grid's fitted tables are priced on the step costs' monotone view (StepCosts.monotone()).
Goal: the plan's wall time within 10% of the grid's best. Outputs: every run's greedy tokens compared (first repeat).
The plan's configuration is usually exactly one of the grid's (the grid's fitted tables are fitted as the plan's
are); a configuration equal to another is run once and its runs count for both (`same_as`), so the ratio
compares that configuration with the others rather than two noisy copies of it.

Sizes. Default: 32 lines a workload, 16 tokens each, max_context 512 (conversation prompts cut at 496 tokens), a
2 x 2 x 2 grid (max_num_seqs 8 or 16, max_prefill_tokens 256 or 512, default or fitted tables), 3 repeats. Compiles
dominate it: its configurations need ~70 programs between them (~130 at max_context 1024). --full: 400 lines, 32
tokens, max_context 1024, a 3 x 3 x 2 grid (8/16/32, 256/512/1024), 2 repeats (about 3 hours). --quick: 12 lines,
8 tokens, a 2 x 1 x 2 grid, 2 repeats. Each configuration prints a progress line with the time left (estimated
from the runs and compiles so far: early estimates are high, as later configurations share programs).

    .venv/bin/python experiments/bench_self_planning.py [--quick | --full] [--lines N] [--max-tokens N] [--repeats N]
"""

import dataclasses
import random
import time

import numpy as np

from bench_prefix_admission import build_lines, sentences
from common import paths, report
from jaxinfer.api import LLM
from jaxinfer.batch import planning
from jaxinfer.bucketing import traces
from jaxinfer.config import EngineConfig
from jaxinfer.loading.tokenizer import load_tokenizer
from jaxinfer.scheduling.request import SamplingParams

RESULTS = paths.RESULTS_DIR / "bench_self_planning.json"
GOALS = {"conversation_ratio": ("self-planned wall time / best grid wall time, conversation", 1.10, "at_most"),
         "few_shot_ratio": ("self-planned wall time / best grid wall time, few-shot", 1.10, "at_most")}


def conversation_lines(tokenizer, count: int, max_tokens: int, max_context: int, rng: random.Random) -> list[str]:
    """Real text cut to the conversation trace's prompt lengths (first `count` requests), at most 800 tokens and
    max_context - max_tokens."""
    try:
        lengths = traces.load_trace(traces.shared_trace()).context_tokens[:count]
    except traces.TraceError:
        lengths = traces.synthetic_trace(count, seed=0).context_tokens
    pool, lines = sentences(), []
    for n in np.clip(lengths, 8, min(800, max_context) - max_tokens):
        text = ""
        while len(tokenizer.encode(text)) < n:
            text += rng.choice(pool) + " "
        lines.append(tokenizer.decode(tokenizer.encode(text)[: int(n)]))
    return lines


def run_config(llm, cfg: EngineConfig, prompts: list) -> dict:
    """The configuration swapped in (same pool), its programs compiled, then the prompts streamed as a job does."""
    for replica in llm.replicas:
        replica.engine.use_config(cfg)
    llm.engine_config = cfg
    compiled, start = llm.engine.num_compilations, time.perf_counter()
    llm.engine.warmup()
    compile_s = time.perf_counter() - start
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = sorted(llm.stream(iter(prompts), max_inflight=4 * cfg.max_num_seqs, progress=False), key=lambda o: o.index)
    return {"max_num_seqs": cfg.max_num_seqs, "max_prefill_tokens": cfg.max_prefill_tokens, "policy": cfg.policy, "programs": planning.num_programs(cfg),
            "new_compiles": llm.engine.num_compilations - compiled, "compile_s": round(compile_s, 2), "wall_s": round(time.perf_counter() - start, 3),
            "padding": round(llm.last_stats.padding_waste, 4), "tokens": [o.token_ids for o in outputs]}


class Progress:
    """Time left, estimated from what ran so far: each remaining run at the mean timed run, each configuration
    still to compile at the mean compile, each workload not begun at this one's estimated total."""

    def __init__(self, num_workloads: int):
        self.workloads_left, self.start = num_workloads, time.perf_counter()
        self.run_s, self.compile_s, self.runs_left, self.compiles_left = [], [], 0, 0

    def begin(self, num_runs: int, num_configs: int) -> None:
        self.workloads_left -= 1
        self.begun, self.runs_left, self.compiles_left = time.perf_counter(), num_runs, num_configs

    def done(self, run: dict, compiled: bool) -> str:
        self.run_s.append(run["wall_s"])
        self.runs_left -= 1
        if compiled:
            self.compile_s.append(run["compile_s"])
            self.compiles_left -= 1
        left = self.runs_left * float(np.mean(self.run_s)) + self.compiles_left * float(np.mean(self.compile_s or [0.0]))
        this = time.perf_counter() - self.begun + left
        total = left + self.workloads_left * this
        return f"{time.perf_counter() - self.start:.0f} s so far; about {left / 60:.1f} min left in this workload, {total / 60:.1f} min in all"


def run_workload(name: str, lines: list[str], args, llm, base: EngineConfig, progress: Progress) -> dict:
    """`base`: the LLM's config as loaded (the impls as the tuner resolved them), before any run swapped its own in."""
    report.log("bench_self_planning", f"{name}: {len(lines)} lines")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [llm.prepare(line, params, index=i) for i, line in enumerate(lines)]
    given = dataclasses.replace(base, num_pages=llm.engine.num_pages)  # the impls as the tuner resolved them
    ids = [p.token_ids for p in prompts]
    sample = planning.WorkloadSample.of_prompts(ids, np.full(len(ids), args.max_tokens), base.page_size, base.enable_prefix_caching, len(ids))
    options = planning.PlanOptions(max_num_seqs=tuple(args.seqs), max_prefill_tokens=tuple(args.tokens))
    costs, start = planning.engine_costs(llm), time.perf_counter()
    plan = planning.make_plan(sample, given, costs, options)
    plan_s = time.perf_counter() - start
    print(plan.summary())
    grid = []
    planned_policy = dataclasses.replace(given, policy=plan.config.policy)  # the grid varies the limits and tables, not the policy
    for s, t in planning.grid_values(given, options):
        grid.append(("default tables", planning._limited(planned_policy, s, t)))
        fitted = planning.evaluate(planned_policy, sample.requests(options.simulated_requests), costs, planning.num_programs(given), s, t)
        grid.append(("fitted", fitted.config))
    configs = [("plan", plan.config)] + [(f"grid {label}", cfg) for label, cfg in grid]
    same_as = [next(j for j, (_, other) in enumerate(configs) if other == cfg) for _, cfg in configs]  # the first equal one alone runs
    distinct = sorted(set(same_as))
    progress.begin(len(distinct) * args.repeats + 1, len(distinct))
    warm = run_config(llm, plan.config, prompts)  # untimed: the first run in a process pays one-time costs (measured 2.9x on the quick run)
    report.log("bench_self_planning", f"{name}: untimed first run of the plan's configuration: {warm['wall_s']} s (compiles {warm['compile_s']} s); "
               f"{len(distinct)} distinct configurations x {args.repeats} repeats; {progress.done(warm, compiled=True)}")
    runs = [None] * len(configs)
    for repeat in range(args.repeats):  # round robin, so that a slow spell of a loaded machine is shared; each keeps its fastest
        for i in distinct:
            label, cfg = configs[i]
            run = {"name": label} | run_config(llm, cfg, prompts)
            eta = progress.done(run, compiled=repeat == 0 and i != 0)
            report.log("bench_self_planning", f"{name} repeat {repeat + 1}/{args.repeats}, configuration {distinct.index(i) + 1}/{len(distinct)}: {label} "
                       f"s={cfg.max_num_seqs} t={cfg.max_prefill_tokens}: {run['wall_s']} s (compiles {run['compile_s']} s); {eta}")
            if runs[i] is None:
                runs[i] = run | {"wall_s_each": [run["wall_s"]]}
            else:
                runs[i]["wall_s_each"].append(run["wall_s"])
                runs[i]["wall_s"] = min(runs[i]["wall_s_each"])
    for i, j in enumerate(same_as):
        if j != i:
            runs[i] = runs[j] | {"name": configs[i][0], "same_as": configs[j][0]}
    best = min(runs[1:], key=lambda r: r["wall_s"])
    agree = float(np.mean([runs[i]["tokens"] == runs[0]["tokens"] for i in distinct[1:]]))  # of the configurations that ran
    for r in runs:
        r.pop("tokens", None)
    spread = [max(r["wall_s_each"]) / min(r["wall_s_each"]) - 1 for r in (runs[i] for i in distinct)]
    return {"plan": plan.to_json(), "plan_seconds": round(plan_s, 2), "runs": runs, "best_grid": best, "ratio": round(runs[0]["wall_s"] / best["wall_s"], 4),
            "outputs_equal_share": agree, "repeat_spread_median": round(float(np.median(spread)), 4)}


def main() -> None:
    parser = report.arg_parser(__doc__, out=RESULTS)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="12 lines, 8 tokens, a 2 x 1 x 2 grid (minutes; a smoke test, too noisy for the goal)")
    size.add_argument("--full", action="store_true", help="400 lines, 32 tokens, context 1024, a 3 x 3 x 2 grid, 2 repeats (about 3 hours)")
    parser.add_argument("--max-context", type=int, default=None, help="the engine's max_context (default 512; --full 1024)")
    parser.add_argument("--lines", type=int, default=None, help="lines a workload (default 32; --quick 12, --full 400)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens each line generates (default 16; --quick 8, --full 32)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs of every configuration, round robin; each keeps its fastest (default 3; --quick and --full 2)")
    args = parser.parse_args()
    size = "quick" if args.quick else "full" if args.full else "default"
    lines, tokens, repeats, context, args.seqs, args.tokens = {"quick": (12, 8, 2, 512, (4, 8), (256,)), "default": (32, 16, 3, 512, (8, 16), (256, 512)),
                                                               "full": (400, 32, 2, 1024, (8, 16, 32), (256, 512, 1024))}[size]
    args.lines, args.max_tokens, args.repeats, args.max_context = args.lines or lines, args.max_tokens or tokens, args.repeats or repeats, args.max_context or context
    if size != "default":
        args.out = args.out.with_name(f"bench_self_planning_{size}.json")
    tokenizer = load_tokenizer(None)
    workloads = {"conversation": conversation_lines(tokenizer, args.lines, args.max_tokens, args.max_context, random.Random(0)),
                 "few_shot": build_lines(tokenizer, args.lines, 4, 300)}
    progress = Progress(len(workloads))
    llm = LLM(engine_config=EngineConfig(max_context=args.max_context, max_num_seqs=max(args.seqs)), warmup=False)  # one engine and pool for both
    loaded = llm.engine_config  # before any run swaps its own in
    results = {name: run_workload(name, lines, args, llm, loaded, progress) for name, lines in workloads.items()}
    columns = [("workload", "<13"), ("run", "<20"), ("seqs", "5d"), ("prefill", "8d"), ("policy", "<8"), ("programs", "9d"), ("wall s", "8.2f"), ("padding", "8.1%")]
    rows = [[w, r["name"], r["max_num_seqs"], r["max_prefill_tokens"], r["policy"], r["programs"], r["wall_s"], r["padding"]] for w, res in results.items() for r in res["runs"]]
    print("\n" + report.format_table(columns, rows))
    goals = report.judge(GOALS, {f"{w}_ratio": res["ratio"] for w, res in results.items()})
    report.print_goals(goals)
    doc = {"question": GOALS["conversation_ratio"][0], "settings": {k: str(v) for k, v in vars(args).items()}, "workloads": results, "goals": goals}
    report.finish(args.out, doc, {"bench": "self_planning", "goals": {k: g["measured"] for k, g in goals.items()}})


if __name__ == "__main__":
    main()
