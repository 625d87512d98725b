"""Which bucket strategy wastes the least padding for a given number of compiled programs?

Every strategy of jaxinfer.bucketing.strategies at budgets BUDGETS on the Azure conversation trace and on a synthetic
trace of the same size: padding waste (tokens and the prefill cost model), out of sample (fitted on the
first half in time, measured on both halves), batch-level views, and the time of the exact fit. Prints
tables and the targets as the last stdout line; writes JSON and PNG plots. Host only: no jax.

    .venv/bin/python experiments/compare_buckets.py [--trace PATH] [--out DIR]
"""

import pathlib
import sys

import numpy as np
from matplotlib.figure import Figure

from common import paths, report, timing
from jaxinfer.bucketing.strategies import PREFILL, TOKENS, Fitted, batch_padding, fit_buckets, packing
from jaxinfer.bucketing.cli import compare_strategies, plot_length_cdf, plot_waste_curves
from jaxinfer.bucketing.traces import TraceError, load_trace, synthetic_trace

BUDGETS = (4, 8, 12, 16, 32)
COSTS = {"tokens": TOKENS, "prefill": PREFILL}
WASTE_FIELDS = {"tokens": "token_waste", "prefill": "cost_waste"}  # the waste each cost's fit optimises
WASTE_LABELS = {"tokens": "token waste", "prefill": "prefill cost waste"}
BATCH_SIZE = 32  # sequences per batch in the batch-level views
PACKING_TOKEN_BUDGET = 8192  # tokens per packed step
TARGET_BUDGET = 12  # the "at most 12 programs" comparison
TIMING_SIZES = (10_000, 30_000, 100_000, 300_000)
TIMING_BUDGET = 32


def _wastes(fit_on, evaluate_on, budget: int, cost_name: str) -> list[float]:
    """The waste each fit optimised (WASTE_FIELDS), in strategy order, of every strategy built from `fit_on`, measured on `evaluate_on`."""
    results = compare_strategies(fit_on, budget, COSTS[cost_name], evaluate_on=evaluate_on)
    return [getattr(metrics, WASTE_FIELDS[cost_name]) for _, metrics in results]


def _strategy_rows(name: str, trace, cost_name: str, seed: int) -> list[dict]:
    """One row per (budget, strategy): whole-trace waste, then built from the first half in time and measured
    on it ("in") and on the second half ("out"); "oracle" is built from the second half (out - oracle: the
    cost of a stale fit). A random split into halves is the control with no drift in time."""
    lengths = trace.context_tokens
    earlier, later = (part.context_tokens for part in trace.split_in_time(0.5))
    shuffled = np.random.default_rng(seed).permutation(lengths)
    first, second = shuffled[: lengths.size // 2], shuffled[lengths.size // 2 :]
    views = {  # row key: (built from, measured on)
        "in_sample_waste": (earlier, earlier), "out_of_sample_waste": (earlier, later), "oracle_second_half_waste": (later, later),
        "random_split_in_waste": (first, first), "random_split_out_waste": (first, second),
    }  # fmt: skip
    rows = []
    for budget in BUDGETS:
        whole = compare_strategies(lengths, budget, COSTS[cost_name])
        wastes = {view: _wastes(fit_on, evaluate_on, budget, cost_name) for view, (fit_on, evaluate_on) in views.items()}
        for i, (strategy, full) in enumerate(whole):
            rows.append({
                "trace": name, "cost": cost_name, "budget": budget, "strategy": full.strategy,
                "programs": full.num_programs, "buckets": list(strategy.buckets),
                "token_waste": full.token_waste, "cost_waste": full.cost_waste,
                "mean_padding": full.mean_padding, "max_padding": full.max_padding, "over_top": full.num_over_top,
                **{view: waste[i] for view, waste in wastes.items()},
            })  # fmt: skip
    return rows


def _batching_rows(name: str, trace) -> dict:
    """Batch-level views on the prompt lengths; waste in tokens."""
    lengths = trace.context_tokens
    fitted = Fitted.from_sample(lengths, TARGET_BUDGET)
    views = {
        "arrival_batches_pad_to_longest": batch_padding(lengths, BATCH_SIZE),
        "sorted_batches_pad_to_longest": batch_padding(lengths, BATCH_SIZE, sort=True),
        "sorted_batches_pad_to_fitted_bucket": batch_padding(lengths, BATCH_SIZE, fitted, sort=True),
        "packing": packing(lengths, PACKING_TOKEN_BUDGET),
    }
    return {view: {"waste": m.waste, "steps": m.num_steps} for view, m in views.items()} | {"trace": name}


def _fit_timings() -> list[dict]:
    """The least seconds of exact fits at K = 32 on synthetic prompt lengths of growing size (3 fits), and
    on all-distinct lengths (1 fit)."""
    samples = [(synthetic_trace(size, seed=1).context_tokens, "synthetic", 3) for size in TIMING_SIZES]
    samples.append((np.random.default_rng(1).permutation(100_000) + 1, "all distinct (worst case)", 1))
    return [{"lengths": lengths.size, "distinct": int(np.unique(lengths).size), "kind": kind,
             "seconds": min(timing.time_calls(lambda: fit_buckets(lengths, TIMING_BUDGET), repeats, warmup=0))}
            for lengths, kind, repeats in samples]  # fmt: skip


def _print_tables(rows: list[dict], trace: str, cost: str) -> None:
    """Waste (programs used) of strategies fitted to the whole trace, then the out-of-sample views."""
    selected = _select(rows, trace=trace, cost=cost)
    by_strategy = {name: [r for r in selected if r["strategy"] == name] for name in dict.fromkeys(r["strategy"] for r in selected)}
    print(f"\n{trace} trace, {cost} waste (programs used), strategies fitted to the whole trace")
    columns = [("strategy", "<14"), *((f"K={b}", "14") for b in BUDGETS), ("over top", "10d")]
    print(report.format_table(columns, [[s, *(f"{r[WASTE_FIELDS[cost]]:.1%} ({r['programs']:>2})" for r in cells), max(r["over_top"] for r in cells)]
                                         for s, cells in by_strategy.items()]))
    print(f"\n{trace} trace, {cost} waste, built from the first half in time: in sample / out of sample"
          " (second half) / oracle (built from the second half); random halves: in / out")  # fmt: skip
    views = ("in_sample_waste", "out_of_sample_waste", "oracle_second_half_waste")
    control = {s: next(r for r in cells if r["budget"] == TARGET_BUDGET) for s, cells in by_strategy.items()}
    columns = [("strategy", "<14"), *((f"K={b}", "22") for b in BUDGETS), (f"random K={TARGET_BUDGET}", "16")]
    print(report.format_table(columns, [[s, *("/".join(f"{100 * r[v]:.1f}" for v in views) for r in cells),
                                          f"{control[s]['random_split_in_waste']:.1%}/{control[s]['random_split_out_waste']:.1%}"]
                                         for s, cells in by_strategy.items()]))


def _plot_waste(rows: list[dict], trace: str, path: pathlib.Path) -> None:
    figure = Figure(figsize=(12, 4.5), layout="constrained")
    for axes, cost in zip(figure.subplots(1, 2), COSTS):
        curves: dict[str, list] = {}
        for row in _select(rows, trace=trace, cost=cost):
            curves.setdefault(row["strategy"], []).append((row["programs"], row[WASTE_FIELDS[cost]]))
        plot_waste_curves(axes, curves, WASTE_LABELS[cost])
        axes.set_title(f"{trace} trace: {WASTE_LABELS[cost]} against programs")
    figure.savefig(path, dpi=110)


def _plot_cdf(trace_name: str, lengths: np.ndarray, path: pathlib.Path) -> None:
    figure = Figure(figsize=(8, 5), layout="constrained")
    axes = figure.subplots()
    plot_length_cdf(axes, lengths, [s for s, _ in compare_strategies(lengths, TARGET_BUDGET)])
    axes.set_title(f"{trace_name}: prompt length CDF and bucket boundaries at {TARGET_BUDGET} programs")
    figure.savefig(path, dpi=110)


def _select(rows: list[dict], **match) -> list[dict]:
    return [r for r in rows if all(r[k] == v for k, v in match.items())]


def _out_of_sample(rows: list[dict], trace: str) -> dict:
    """The fitted strategy's in- and out-of-sample token waste at every budget, with its decomposition."""
    return {
        str(r["budget"]): {
            "in": r["in_sample_waste"], "out": r["out_of_sample_waste"], "oracle": r["oracle_second_half_waste"],
            "gap": r["out_of_sample_waste"] - r["in_sample_waste"],
            "stale_fit_regret": r["out_of_sample_waste"] - r["oracle_second_half_waste"],
            "random_split_gap": r["random_split_out_waste"] - r["random_split_in_waste"],
        }
        for r in _select(rows, trace=trace, cost="tokens", strategy="fitted")
    }  # fmt: skip


def _targets(rows: list[dict], batching: list[dict], timings: list[dict]) -> dict:
    """The bucket targets, measured on the conversation trace (prompt lengths, token waste)."""
    conversation = dict(trace="conversation", cost="tokens")
    fitted_12 = _select(rows, **conversation, budget=TARGET_BUDGET, strategy="fitted")[0]
    powers_12 = _select(rows, **conversation, budget=TARGET_BUDGET, strategy="powers-of-two")[0]
    gap_12 = fitted_12["out_of_sample_waste"] - fitted_12["in_sample_waste"]
    sorted_waste = _select(batching, trace="conversation")[0]["sorted_batches_pad_to_longest"]["waste"]
    fit_seconds = _select(timings, lengths=100_000, kind="synthetic")[0]["seconds"]
    return {
        "fitted_token_waste_at_12": fitted_12["token_waste"], "fitted_target": 0.10,
        "powers_of_two_token_waste_at_12": powers_12["token_waste"], "powers_of_two_programs": powers_12["programs"],
        "sorted_batching_waste": sorted_waste, "sorted_batching_target": 0.02,
        "fitted_out_of_sample_gap_at_12": gap_12, "out_of_sample_gap_target": 0.02,
        "fitted_out_of_sample": {name: _out_of_sample(rows, name) for name in ("conversation", "synthetic")},
        "fit_seconds_100k_k32": fit_seconds, "fit_seconds_target": 5.0,
        "met": {
            "fitted_waste": fitted_12["token_waste"] <= 0.10, "sorted_batching": sorted_waste <= 0.02,
            "out_of_sample_gap_at_12": abs(gap_12) <= 0.02, "fit_time": fit_seconds < 5.0,
        },
    }  # fmt: skip


def _print_batching_and_timings(batching: list[dict], timings: list[dict]) -> None:
    print(f"\nbatch-level token waste (batches of {BATCH_SIZE}; packing into {PACKING_TOKEN_BUDGET}-token steps)")
    for entry in batching:
        views = ", ".join(f"{k} {v['waste']:.1%}" for k, v in entry.items() if k != "trace")
        print(f"  {entry['trace']}: {views}")
    print(f"\nfit_buckets time at K={TIMING_BUDGET} (O(K·M·log M), M distinct lengths)")
    for t in timings:
        print(f"  {t['lengths']:>7} lengths, {t['distinct']:>6} distinct ({t['kind']}): {t['seconds']:.3f} s")


def _write_plots(out: pathlib.Path, traces: dict, rows: list[dict]) -> list[pathlib.Path]:
    out.mkdir(parents=True, exist_ok=True)
    plots = []
    for name, trace in traces.items():
        plots += [out / f"buckets_waste_vs_programs_{name}.png", out / f"buckets_length_cdf_{name}.png"]
        _plot_waste(rows, name, plots[-2])
        _plot_cdf(name, trace.context_tokens, plots[-1])
    return plots


def main(argv=None) -> int:
    parser = report.arg_parser(__doc__, out=paths.RESULTS_DIR, trace=True)  # --out: a folder
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic trace")
    args = parser.parse_args(argv)
    try:
        trace_path = paths.trace_or_default(args.trace)
        conversation = load_trace(trace_path)
    except (TraceError, OSError) as error:
        print(f"compare_buckets: {error}", file=sys.stderr)
        return 2
    traces = {"conversation": conversation, "synthetic": synthetic_trace(conversation.num_requests, seed=args.seed)}
    rows = [r for name, trace in traces.items() for cost in COSTS for r in _strategy_rows(name, trace, cost, args.seed)]
    batching = [_batching_rows(name, trace) for name, trace in traces.items()]
    timings = _fit_timings()
    for name in traces:
        for cost in COSTS:
            _print_tables(rows, name, cost)
    _print_batching_and_timings(batching, timings)
    plots = _write_plots(args.out, traces, rows)
    targets = _targets(rows, batching, timings)
    results = {"trace": trace_path.name, "synthetic_seed": args.seed, "budgets": list(BUDGETS),
               "rows": rows, "batching": batching, "fit_timings": timings, "targets": targets}  # fmt: skip
    summary = {k: v for k, v in targets.items() if k != "fitted_out_of_sample"}  # the details are in the file
    summary["fitted_stale_fit_regret_at_12"] = targets["fitted_out_of_sample"]["conversation"]["12"]["stale_fit_regret"]
    last_line = {"experiment": "compare_buckets", "targets": summary, "plots": [p.name for p in plots]}
    report.finish(args.out / "compare_buckets.json", results, last_line, indent=1)  # the JSON, then the last stdout line
    return 0


if __name__ == "__main__":
    sys.exit(main())
