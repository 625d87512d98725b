"""`jaxinfer buckets fit`: fit a bucket table to a trace and compare it with every other strategy.

Owns the `buckets` command of the CLI (registered by `add_subparser`, wired in by cli.py) and the
presentation helpers that the experiment and the notebook share with it: `compare_strategies`, a text
table and two plots. The numbers all come from jaxinfer.bucketing.strategies; nothing here computes padding itself.
Must not import jax. matplotlib is imported only when a plot is asked for, and plots draw on a given
Axes or a `matplotlib.figure.Figure`, never on pyplot's global state.
Errors in the user's input (a bad trace, a missing file) print one line to stderr and return 2.
"""

import argparse
import sys
from collections.abc import Mapping, Sequence

import numpy as np

from jaxinfer.bucketing.strategies import (
    TOKENS,
    BucketStrategy,
    CostModel,
    MeanKSigma,
    PaddingMetrics,
    fit_buckets,
    padding_metrics,
    strategies_at_budget,
)
from jaxinfer.bucketing.traces import CONTEXT_TOKENS, LENGTH_COLUMNS, TraceError, load_trace

COST_NAMES = ("tokens", "prefill")
_EXIT_BAD_INPUT = 2


def cost_model(name: str, crossover_length: int = 8192) -> CostModel:
    """The cost model called `name` on the command line: "tokens" or "prefill"."""
    if name == "tokens":
        return TOKENS
    if name == "prefill":
        return CostModel.prefill(crossover_length)
    raise ValueError(f"cost must be one of {COST_NAMES}, got {name!r}")


def compare_strategies(
    lengths, budget: int, cost=TOKENS, *, evaluate_on=None, multiple_of: int = 1
) -> list[tuple[BucketStrategy, PaddingMetrics]]:
    """Every strategy fitted to `lengths` at `budget`, with its metrics on `evaluate_on` (default: `lengths`)."""
    strategies = strategies_at_budget(lengths, budget, cost, multiple_of=multiple_of)
    sample = lengths if evaluate_on is None else evaluate_on
    return [(strategy, padding_metrics(strategy, sample, cost)) for strategy in strategies]


def format_table(metrics: Sequence[PaddingMetrics]) -> str:
    """A fixed-width text table, one row per strategy."""
    header = (
        f"{'strategy':<14} {'programs':>8} {'token waste':>11} {'cost waste':>10} "
        f"{'mean pad':>9} {'max pad':>8} {'over top':>8}"
    )
    rows = [
        f"{m.strategy:<14} {m.num_programs:>8} {m.token_waste:>11.1%} {m.cost_waste:>10.1%} "
        f"{m.mean_padding:>9.1f} {m.max_padding:>8} {m.num_over_top:>8}"
        for m in metrics
    ]
    return "\n".join([header, "-" * len(header), *rows])


def plot_length_cdf(ax, lengths, strategies: Sequence[BucketStrategy]) -> None:
    """The empirical CDF of `lengths`, with each strategy's boundaries as a row of ticks beneath it."""
    sizes = np.sort(np.asarray(lengths))
    ax.step(sizes, np.arange(1, sizes.size + 1) / sizes.size, where="post", color="black", label="lengths")
    for row, strategy in enumerate(strategies, start=1):
        level = -0.1 * row
        ax.plot(strategy.buckets, [level] * len(strategy.buckets), "|", markersize=9, markeredgewidth=1.5)
        name = getattr(strategy, "name", type(strategy).__name__)
        ax.text(sizes[0], level, f"{name} ", ha="right", va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_ylim(-0.1 * len(strategies) - 0.08, 1.02)
    ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
    ax.set_xlabel("length (tokens)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, alpha=0.3)


def plot_waste_curves(ax, curves: Mapping[str, Sequence[tuple[int, float]]], ylabel: str = "padding waste") -> None:
    """One line per strategy: waste (a fraction) against its number of programs."""
    for name, points in curves.items():
        programs, waste = zip(*sorted(points))
        ax.plot(programs, [100 * w for w in waste], marker="o", markersize=3, label=name)
    ax.set_xscale("log", base=2)
    largest = max(max(p for p, _ in points) for points in curves.values())
    ticks = [2**e for e in range(largest.bit_length()) if 2**e <= largest]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("programs (buckets)")
    ax.set_ylabel(f"{ylabel} (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def waste_curves(lengths, budgets: Sequence[int], cost=TOKENS, field: str = "token_waste") -> dict[str, list]:
    """{strategy name: [(programs, waste)]} over several budgets, for `plot_waste_curves`."""
    curves: dict[str, list] = {}
    for budget in budgets:
        for _, metrics in compare_strategies(lengths, budget, cost):
            curves.setdefault(metrics.strategy, []).append((metrics.num_programs, getattr(metrics, field)))
    return curves


def _save_plot(path, lengths, budget: int, cost, strategies) -> None:
    from matplotlib.figure import Figure  # optional dependency: only when --plot is given

    figure = Figure(figsize=(12, 4.5), layout="constrained")
    cdf_axes, waste_axes = figure.subplots(1, 2)
    plot_length_cdf(cdf_axes, lengths, strategies)
    cdf_axes.set_title(f"length CDF and bucket boundaries (budget {budget})")
    field, label = ("token_waste", "token waste") if cost == TOKENS else ("cost_waste", f"{cost.name} cost waste")
    plot_waste_curves(waste_axes, waste_curves(lengths, range(1, budget + 1), cost, field), label)
    waste_axes.set_title("waste against number of programs")
    figure.savefig(path, dpi=110)


def run_fit(args: argparse.Namespace) -> int:
    """Runs `jaxinfer buckets fit`; returns the exit code."""
    try:
        trace = load_trace(args.trace, column=args.column)
    except (TraceError, OSError) as error:
        print(f"jaxinfer buckets fit: {error}", file=sys.stderr)
        return _EXIT_BAD_INPUT
    lengths = trace.lengths(args.column)
    cost = cost_model(args.cost, args.crossover)
    fitted = fit_buckets(lengths, args.budget, cost, multiple_of=args.multiple_of)
    print(f"{trace.num_requests} requests, {args.column} from {lengths.min()} to {lengths.max()}")
    print(f"fitted buckets (budget {args.budget}, cost {cost.name}): {', '.join(map(str, fitted))}")
    print()
    results = compare_strategies(lengths, args.budget, cost, multiple_of=args.multiple_of)
    print(format_table([metrics for _, metrics in results]))
    for strategy, _ in results:
        if isinstance(strategy, MeanKSigma):
            print(f"note: mean+k-sigma {strategy.describe_policy(lengths)}")
    if args.plot is not None:
        try:
            _save_plot(args.plot, lengths, args.budget, cost, [strategy for strategy, _ in results])
        except ImportError:
            print("jaxinfer buckets fit: --plot needs matplotlib (pip install 'jaxinfer[plot]')", file=sys.stderr)
            return _EXIT_BAD_INPUT
        print(f"plot written to {args.plot}")
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


_FIT_DESCRIPTION = """\
Fit the bucket table that minimises padded cost on a trace, with at most BUDGET programs, and compare it
with every other strategy (pad-to-max, powers of two, linear, quantile, mean+k-sigma) at the same budget.
The fit is exact: a dynamic programme over the distinct lengths, O(K * M log M) for M distinct lengths.

Waste is (padded - real) / padded, summed over requests; each request is padded on its own. Requests
longer than a strategy's top bucket are chunked and counted under "over top"."""

_FIT_EPILOG = """\
example:
  jaxinfer buckets fit --trace $JAXINFER_TRACE_DIR/azure_llm_trace_2023_conv.csv --budget 12 --plot buckets.png"""


def add_subparser(subparsers) -> argparse.ArgumentParser:
    """Registers `buckets` (with its `fit` sub-command) on the CLI's sub-parsers; returns its parser."""
    buckets = subparsers.add_parser(
        "buckets",
        help="fit and compare shape-bucket strategies on a request trace",
        description="Bucket strategies: which padded lengths get a compiled program, and what that costs.",
    )
    commands = buckets.add_subparsers(dest="buckets_command", metavar="COMMAND", required=True)
    fit = commands.add_parser(
        "fit",
        help="fit optimal buckets to a trace and compare all strategies at the same budget",
        description=_FIT_DESCRIPTION,
        epilog=_FIT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_fit_arguments(fit)
    fit.set_defaults(func=run_fit)
    return buckets


def _add_fit_arguments(fit: argparse.ArgumentParser) -> None:
    fit.add_argument(
        "--trace", required=True, metavar="FILE",
        help="CSV trace in the Azure LLM inference format (TIMESTAMP,ContextTokens,GeneratedTokens)",
    )
    fit.add_argument(
        "--budget", required=True, type=_positive_int, metavar="K",
        help="maximum number of buckets, i.e. of compiled programs",
    )
    fit.add_argument(
        "--column", default=CONTEXT_TOKENS, choices=LENGTH_COLUMNS,
        help="the lengths to bucket (default: %(default)s, the prompt)",
    )
    fit.add_argument(
        "--cost", default="tokens", choices=COST_NAMES,
        help="what padding costs: padded tokens, or prefill work a*n + b*n^2 (default: %(default)s)",
    )
    fit.add_argument(
        "--crossover", type=_positive_int, default=8192, metavar="N",
        help="--cost prefill only: the length at which attention costs as much as the matmuls (default: %(default)s)",
    )
    fit.add_argument(
        "--multiple-of", type=_positive_int, default=1, metavar="M",
        help="make every fitted bucket a multiple of M, e.g. the KV page size (default: %(default)s)",
    )
    fit.add_argument(
        "--plot", metavar="PNG",
        help="also write a PNG: the length CDF with every strategy's boundaries, and waste against programs",
    )
