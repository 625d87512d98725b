"""`jaxinfer whatif OUTPUT.jsonl [--policy P[,P...]] [--buckets KIND:K[,...]] [--max-num-seqs N[,N...]] [--max-prefill-tokens N[,N...]]
[--num-pages N[,N...]] [--trace TRACE.csv [--rate R] [--trace-requests N]] [--slo-ttft S] [--slo-tpot S] [--step-log FILE] [--json]`: a finished
job replayed on the simulator under other settings. No model is loaded, and this module imports no jax.

It reads the job's output records (each line's prompt and output lengths, its measured TTFT) and its step
log (`<output>.steps.jsonl`, batch/step_log.py: the engine's settings, the pool, the in-flight limit, the
step-cost table and the measured wall time and padding). The simulator (scheduling/simulator.py) first
replays the job as it ran, which gives the simulator's error on this job, then runs it under the new
settings. `--buckets KIND:K` fits a bucket strategy (bucketing/strategies.py: fitted, quantile, ...) with
K buckets per table to the job's own prompt lengths (with --trace, the trace's), decode batch sizes and pages per sequence; `default`
is the engine's default tables. A new limit (`--max-num-seqs`, `--max-prefill-tokens`) cuts the job's own table
of that dimension at it and adds it (bucket_tables.cut_table), as the default tables end at their limits;
`--num-pages` sizes the KV pool (pages, the null page included), where a smaller pool preempts. Each setting
takes several values separated by commas (`--max-num-seqs 8,16,32 --policy fcfs,prefix`): every combination is
predicted, a line each, the least predicted wall time marked. `--trace TRACE.csv` predicts a request trace (the
Azure format, arrivals as recorded or `--rate` times as fast) instead of the job's own requests, on the job's
engine settings and step costs: what this machine and model would do with that traffic. `--slo-ttft S` and
`--slo-tpot S` add the share of requests within that SLO to every figure set.
"""

import argparse
import dataclasses
import itertools
import json
import math
import sys
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from jaxinfer import config
from jaxinfer.batch.finished_job import FinishedJob, line_figures, read_job
from jaxinfer.config import EngineConfig
from jaxinfer.scheduling import simulator
from jaxinfer.scheduling.bucket_tables import BucketTables, cut_table
from jaxinfer.scheduling.simulator import SimRequest
from jaxinfer.validation import FieldError

FIGURES = ("wall_s", "ttft_p50_s", "ttft_p99_s", "padding")


def bucket_strategy(spec: str, job: FinishedJob, cfg: EngineConfig):
    """`KIND:K` as an EngineBuckets fitted to the job's prompt lengths, decode batch sizes and pages per
    sequence; None for 'default'. ValueError naming --buckets for anything else."""
    if spec == "default":
        return None
    from jaxinfer.bucketing import strategies  # noqa: PLC0415  (offline: only whatif and the buckets CLI use it)

    kind, _, budget = spec.partition(":")
    if kind not in strategies.STRATEGY_KINDS or not budget.isdigit() or int(budget) < 1:
        raise ValueError(f"--buckets must be 'default' or KIND:K with KIND one of {', '.join(strategies.STRATEGY_KINDS)} and K >= 1, got {spec!r}")
    max_chunk = min(cfg.max_prefill_tokens, cfg.max_context)
    prompts = np.array([min(r.prompt_tokens, max_chunk) for r in job.requests])
    pages = np.array([math.ceil(min(r.prompt_tokens + r.output_tokens, cfg.max_context) / cfg.page_size) for r in job.requests])
    decode_rows = np.array([s["rows"] for s in job.log.steps if s["key"][0] == "decode"] or [cfg.max_num_seqs])
    return strategies.EngineBuckets.from_samples(kind, int(budget), chunk=prompts, rows=np.minimum(decode_rows, cfg.max_num_seqs), pages=pages)


def new_config(job: FinishedJob, *, policy: str | None = None, buckets: str | None = None, max_num_seqs: int | None = None,
               max_prefill_tokens: int | None = None, num_pages: int | None = None) -> EngineConfig:
    """The job's engine settings with the changes asked for (a bucket strategy replaces the tables it sets; a new
    limit cuts the job's table of its dimension at it, the limit added). ValueError naming the flag."""
    cfg, changes = job.engine_config, {}
    if policy is not None:
        if not any(f.name == "policy" for f in dataclasses.fields(EngineConfig)):
            raise ValueError("--policy: this jaxinfer has no scheduling policies (EngineConfig has no 'policy')")
        changes["policy"] = policy
        if cfg.policy_epoch is not None and policy not in config.EPOCH_POLICIES:  # the job's epoch orders nothing under this policy
            changes["policy_epoch"] = None
    limits = {"max_num_seqs": (max_num_seqs, "decode_batch_buckets"), "max_prefill_tokens": (max_prefill_tokens, "prefill_chunk_buckets")}
    asked = {name: table for name, (value, table) in limits.items() if value is not None}
    changes |= {name: limits[name][0] for name in asked} | ({"num_pages": num_pages} if num_pages is not None else {})
    try:
        checked = dataclasses.replace(cfg, **changes, **{table: None for table in asked.values()})  # the new limits checked (FieldError)
        cut = {table: cut_table(getattr(cfg, table), _table_top(checked, name), reach=True) for name, table in asked.items() if getattr(cfg, table) is not None}
        cfg = dataclasses.replace(checked, **cut)
        if buckets is not None:
            engine_buckets = bucket_strategy(buckets, job, cfg)
            tables = {"prefill_chunk_buckets": None, "decode_batch_buckets": None, "decode_page_buckets": None}
            cfg = dataclasses.replace(cfg, buckets=engine_buckets, **tables)
    except FieldError as e:
        raise ValueError(f"--{e.field.replace('_', '-')} {e.problem}") from None
    return cfg


def _table_top(cfg: EngineConfig, limit: str) -> int:
    """The largest size a table under this limit holds: max_num_seqs rows, or the largest chunk."""
    return cfg.max_num_seqs if limit == "max_num_seqs" else min(cfg.max_prefill_tokens, cfg.max_context)


def _inflight(job: FinishedJob, cfg: EngineConfig) -> int:
    header = job.log.header
    return header.get("max_inflight_given") or config.INFLIGHT_PER_SEQ * cfg.max_num_seqs * header.get("replicas", 1)


class Refused(ValueError):
    """Settings under which the simulated engine refuses a request (Scheduler.check), the request named by its origin."""


def predict(job: FinishedJob, cfg: EngineConfig, slo: tuple[float, float] | None = None) -> dict:
    """The simulator's figures for the job's requests under `cfg` (FIGURES, then the rest of its summary; with `slo`,
    (TTFT, TPOT) seconds, the share of requests within both: slo_attainment)."""
    costs = job.log.costs
    pages = cfg.num_pages or job.log.header.get("num_pages")  # a --num-pages asked for, else the job's pool
    try:
        result = simulator.simulate(cfg, job.requests, costs, num_pages=pages, max_inflight=_inflight(job, cfg))
    except simulator.RequestRefused as e:
        label = job.labels[e.index] if e.index < len(job.labels) else f"request {e.index}"
        raise Refused(f"{label} cannot run under these settings: {e.reason}") from None
    ttft, tpot = result.ttft_s, result.tpot_s
    if job.line_starts is not None:  # a line of n samples: its first token is its first sample's, its TPOT its slowest's
        ttft, tpot = np.fmin.reduceat(ttft, job.line_starts), np.fmax.reduceat(tpot, job.line_starts)
    summary = result.summary() | line_figures(ttft, tpot, slo)  # per line, as the measured figures
    return {name: summary[name] for name in FIGURES} | {k: v for k, v in summary.items() if k not in FIGURES} | {"simulated_in_s": round(result.seconds, 3)}


def whatif(output: Path, *, step_log: Path | None = None, trace: Path | None = None, rate: float = 1.0, trace_requests: int | None = None,
           slo_ttft_s: float | None = None, slo_tpot_s: float | None = None, progress: bool | None = None, **settings) -> dict:
    """{"measured", "replay", "replay_error", "predicted", "changes"}: the job's figures, the simulator's replay
    of it as it ran and its relative error, and the prediction under the changes (the replay when none).

    `settings`: new_config's changes (policy, buckets, max_num_seqs, max_prefill_tokens, num_pages), each a value
    or a list of values; None keeps the job's. Lists make a grid, every combination predicted (in the order of
    the lists, the last varying fastest) into "grid" ([{"changes", "predicted", "best"}]); "predicted" and "changes"
    are then the combination of the least predicted wall time (the first of equals). `progress`: a bar over the
    grid (None: where stderr is a terminal).

    `trace`: predict a request trace (traces.load_trace's format; its first `trace_requests`, arrivals divided
    by `rate`) instead of the job's own requests, priced by the job's step costs on its engine settings. The
    grid's first line is then the trace under the job's own settings ("base"), and "trace" says what was read.

    `slo_ttft_s`, `slo_tpot_s`: an SLO (either alone leaves the other unbounded); every figure set then holds
    slo_attainment, the share of requests that finished within both, and "slo" says which."""
    slo = _slo(slo_ttft_s, slo_tpot_s)
    job = read_job(output, step_log)
    workload, read = (job, None) if trace is None else _with_trace(job, trace, rate, trace_requests)
    grid = _combinations(settings)
    if trace is not None:
        grid = [{}] + [changes for changes in grid if changes]
    targets = [new_config(workload, **changes) for changes in grid]  # a bad setting is refused before anything is simulated
    measured, replay = job.measured(slo), predict(job, job.engine_config, slo)
    runs = _predict_grid(workload, grid, targets, replay if trace is None else None, slo, progress)
    ran = [run for run in runs if run["predicted"] is not None]
    if not ran:  # every combination refused a request: the first's reason
        raise Refused(runs[0]["refused"])
    best = min(ran, key=lambda run: run["predicted"]["wall_s"])
    for run in runs:
        run["best"] = run is best
    error = {name: _relative(replay[name], measured[name]) for name in _figures(slo)}
    report = {"measured": measured, "replay": replay, "replay_error": error, "predicted": best["predicted"], "changes": best["changes"],
              "num_requests": len(job.requests), "resumed": bool(job.log.header.get("resumed")), "notes": _notes(job, replay),
              "slo": None if slo is None else {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s}}
    if read is not None:
        report |= {"trace": read, "base": runs[0]["predicted"]}
    return report | ({"grid": runs} if len(runs) > 1 or trace is not None else {})


def _notes(job: FinishedJob, replay: dict) -> list[str]:
    """What makes the replay's error more than the simulator's on this job: a resumed run's log, lines of n samples,
    lines left out, and a replay whose steps are not the job's (an interrupted job's unfinished lines, a step log of
    another job)."""
    notes = list(job.left_out)
    if job.log.header.get("resumed"):
        notes.append("the step log is of a resumed run: the measured figures and the replay cover that run's records only")
    if job.has_samples:
        notes.append("lines of n > 1 samples are replayed as n requests that each compute the prompt (the job shares it)")
    chunks = set(BucketTables.from_config(job.engine_config).chunk_tokens)
    refitted = sorted({p["key"][2] for p in job.log.programs if p["key"][0] == "prefill" and p["key"][2] not in chunks})
    if refitted:
        notes.append(f"the job's prefill steps ran chunk buckets its starting tables lack ({', '.join(map(str, refitted))}: a refit swapped its "
                     "tables during the job); the replay runs on the tables it started with")
    ran = (job.log.summary or {}).get("num_steps")
    if ran is not None and ran != replay["num_steps"]:
        notes.append(f"the replay ran {replay['num_steps']} steps where the job ran {ran} (an interrupted job's unfinished lines, n > 1 samples, "
                     "lines left out, a refit's tables, or the step log of another job): the error is not the simulator's alone")
    return notes


def _with_trace(job: FinishedJob, path: Path, rate: float, limit: int | None) -> tuple[FinishedJob, dict]:
    """The job with a trace's requests in place of its own, and what was read: a prompt with no room in the job's
    context for one generated token is left out (the engine refuses it), an output is the trace's (at least one
    token: a request the trace says generated none still ran its prefill, which samples one)."""
    from jaxinfer.bucketing import traces  # noqa: PLC0415  (only a trace's whatif reads one)

    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"--rate must be a positive number, got {rate}")
    if limit is not None and limit < 1:
        raise ValueError(f"--trace-requests must be >= 1, got {limit}")
    try:
        trace = traces.load_trace(path)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such trace file") from None
    trace = trace.head(limit) if limit is not None else trace
    max_context = job.engine_config.max_context
    fits = trace.context_tokens < max_context
    with np.errstate(over="ignore"):  # a slow --rate may push an arrival past a float: named below
        arrivals = trace.timestamps / rate
    if not np.isfinite(arrivals).all():
        row = int(np.flatnonzero(~np.isfinite(arrivals))[0])
        raise ValueError(f"{path}: request {row + 1}'s arrival is not a finite time ({trace.timestamps[row]} s" + (f" / --rate {rate:g})" if rate != 1.0 else ")"))
    requests = [SimRequest(int(p), max(int(o), 1), float(t)) for p, o, t, ok in zip(trace.context_tokens, trace.generated_tokens, arrivals, fits) if ok]
    labels = tuple(f"trace request {i + 1}" for i in np.flatnonzero(fits))
    if not requests:
        raise ValueError(f"{path}: no request of the trace fits the job's context ({max_context} tokens)")
    kept = arrivals[fits]
    read = {"path": str(path), "num_requests": len(requests), "num_left_out": int((~fits).sum()), "span_s": round(float(kept.max() - kept.min()), 3),
            "rate": rate, "max_context": max_context}
    return dataclasses.replace(job, requests=requests, labels=labels, line_starts=None, left_out=()), read


def _slo(ttft_s: float | None, tpot_s: float | None) -> tuple[float, float] | None:
    """(TTFT, TPOT) seconds, an unbounded one infinite; None when neither is given. ValueError naming the flag."""
    for flag, value in (("--slo-ttft", ttft_s), ("--slo-tpot", tpot_s)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{flag} must be a positive number of seconds, got {value}")
    return None if ttft_s is None and tpot_s is None else (ttft_s or math.inf, tpot_s or math.inf)


def _figures(slo) -> tuple[str, ...]:
    return FIGURES + (("slo_attainment",) if slo is not None else ())


def _predict_grid(job: FinishedJob, grid: list[dict], targets: list[EngineConfig], replay: dict | None, slo, progress: bool | None) -> list[dict]:
    """[{"changes", "predicted"}] of each combination (`replay`, where given, when nothing changes), with a bar over several;
    in a grid, a combination that refuses a request is kept with "predicted" None and "refused" naming it (one alone raises)."""
    show = len(grid) > 1 and (progress if progress is not None else sys.stderr.isatty())
    runs = []
    with tqdm(total=len(grid), desc="whatif", unit="setting", disable=not show) as bar:
        for changes, cfg in zip(grid, targets):
            try:
                runs.append({"changes": changes, "predicted": replay if not changes and replay is not None else predict(job, cfg, slo)})
            except Refused as e:
                if len(grid) == 1:
                    raise
                runs.append({"changes": changes, "predicted": None, "refused": str(e)})
            bar.update()
    return runs


def _combinations(settings: dict) -> list[dict]:
    """Every combination of the settings given (a list each, or one value), in order, the last varying fastest."""
    given = {name: value if isinstance(value, list) else [value] for name, value in settings.items() if value is not None}
    for name, values in given.items():
        if not values:
            raise ValueError(f"--{name.replace('_', '-')} needs at least one value")
    return [dict(zip(given, values)) for values in itertools.product(*given.values())]


def _relative(predicted, measured) -> float | None:
    if predicted is None or measured is None or measured == 0:
        return None
    return round((predicted - measured) / measured, 4)


def format_report(report: dict) -> str:
    """The three columns (measured, replay, predicted) and the replay's error, one figure a line; for a grid, the
    first two and the replay's error, then a line per combination; for a trace, what was read first."""
    grid, trace = report.get("grid"), report.get("trace")
    if trace is not None:
        head = (f"whatif: trace {trace['path']}: {trace['num_requests']} requests arriving over {trace['span_s']:.1f} s (rate {trace['rate']:g})"
                + (f", {trace['num_left_out']} left out (prompts of {trace['max_context']} tokens or more)" if trace["num_left_out"] else "")
                + f"; priced by the job's step costs. The simulator on the job itself ({report['num_requests']} requests):")
    else:
        head = f"whatif: {report['num_requests']} requests; " + (f"{len(grid)} settings" if grid else f"changes: {_flags(report['changes']) or 'none (the replay of the job itself)'}")
    lines = [head] + [f"note: {note}" for note in report["notes"]]
    lines.append(f"{'':<14} {'measured':>12} {'replay':>12} {'error':>8}" + ("" if grid else f" {'predicted':>12}"))
    for name in report["replay_error"]:  # FIGURES, and slo_attainment under an SLO
        err = report["replay_error"][name]
        lines.append(f"{name:<14} {_fmt(report['measured'][name]):>12} {_fmt(report['replay'][name]):>12} {'-' if err is None else f'{err:+.1%}':>8}"
                     + ("" if grid else f" {_fmt(report['predicted'][name]):>12}"))
    if "buckets" in report["changes"]:
        lines.append("(--buckets is whatif's: a job takes such tables from Python, EngineConfig(buckets=...) with bucketing.strategies.EngineBuckets, "
                     "or fits its own with jaxinfer generate --plan)")
    return "\n".join(lines + (_grid_lines(report) if grid else []))


def _grid_lines(report: dict) -> list[str]:
    """A line per combination: its flags, predicted figures and wall time over the job's own settings'; * marks the least."""
    base = report["base"] if "base" in report else report["replay"]  # the trace's base is None where those settings refuse a request
    names = [_flags(run["changes"]) or "(the job's settings)" for run in report["grid"]]
    width = max(map(len, names))
    slo = report["slo"] is not None
    lines = ["", f"  {'settings':<{width}} {'wall_s':>10} {'/ base':>7} {'ttft_p50_s':>11} {'ttft_p99_s':>11} {'padding':>8} {'preempted':>9}" + (f" {'SLO met':>8}" if slo else "")]
    for name, run in zip(names, report["grid"]):
        p, mark = run["predicted"], "*" if run["best"] else " "
        if p is None:
            lines.append(f"  {name:<{width}} refused: {run['refused']}")
            continue
        ratio = _fmt(p["wall_s"] / base["wall_s"] if base and base["wall_s"] else None, "{:.2f}x")
        lines.append(f"{mark} {name:<{width}} {_fmt(p['wall_s']):>10} {ratio:>7} {_fmt(p['ttft_p50_s']):>11} {_fmt(p['ttft_p99_s']):>11}"
                     f" {_fmt(p['padding']):>8} {p['num_preemptions']:>9}" + (f" {p['slo_attainment']:>8.1%}" if slo else ""))
    what = "the trace under the job's own settings" if "base" in report else "the replay, the job's own settings"
    return lines + [f"* the least predicted wall time; base: {what}"]


def _flags(changes: dict) -> str:
    return ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in changes.items())


def _fmt(value, spec: str = "{:.4f}") -> str:
    return "-" if value is None else spec.format(value)


def add_subparser(commands) -> argparse.ArgumentParser:
    """Registers `whatif` on the CLI's sub-parsers."""
    parser = commands.add_parser(
        "whatif", help="predict a finished job's wall time, TTFT and padding under other settings (no model)",
        description=__doc__.split("\n\n")[0] + " " + __doc__.split("\n\n")[1],
    )
    parser.add_argument("output", type=Path, metavar="OUTPUT.jsonl", help="a finished job's output (its step log lies beside it)")
    parser.add_argument("--policy", default=None, type=_values(str, getattr(config, "POLICIES", None)), metavar="P[,P...]",
                        help=f"scheduling policy to simulate: {', '.join(getattr(config, 'POLICIES', ()))} (default: the job's)")
    parser.add_argument("--buckets", default=None, type=_values(str), metavar="KIND:K[,...]",
                        help="bucket tables: a strategy fitted to the job (with --trace, to the trace) with K buckets each (e.g. fitted:16), or default")
    parser.add_argument("--max-num-seqs", type=_values(int), default=None, metavar="N[,N...]", help="sequences decoded together at most (default: the job's)")
    parser.add_argument("--max-prefill-tokens", type=_values(int), default=None, metavar="N[,N...]",
                        help="prefill tokens per step at most, the largest chunk (default: the job's)")
    parser.add_argument("--num-pages", type=_values(int), default=None, metavar="N[,N...]", help="KV pool pages, the null page included (default: the job's pool)")
    parser.add_argument("--trace", type=Path, default=None, metavar="TRACE.csv",
                        help="predict this request trace (TIMESTAMP,ContextTokens,GeneratedTokens, the Azure format) instead of the job's requests, "
                             "on the job's engine settings and step costs")
    parser.add_argument("--rate", type=float, default=1.0, metavar="R", help="with --trace: arrivals R times as fast (default 1: as recorded)")
    parser.add_argument("--trace-requests", type=int, default=None, metavar="N", help="with --trace: its first N requests (default: all)")
    parser.add_argument("--slo-ttft", type=float, default=None, metavar="S", help="an SLO's time to first token, seconds: every figure set gains the share "
                        "of requests within it and --slo-tpot (slo_attainment, DistServe's goodput share)")
    parser.add_argument("--slo-tpot", type=float, default=None, metavar="S", help="an SLO's time per output token after the first, seconds")
    parser.add_argument("--step-log", type=Path, default=None, metavar="FILE", help="the job's step log (default: OUTPUT.steps.jsonl)")
    parser.add_argument("--json", action="store_true", help="print one JSON object: measured, replay, replay_error, predicted (and grid)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="no progress bar over a grid of settings")
    parser.set_defaults(func=run)
    return parser


def _values(kind: type, choices=None):
    """An argparse type: one value, or several separated by commas (a list: the grid's axis)."""
    def parse(text: str):
        values = [part.strip() for part in text.split(",")]
        if len(values) > 1 and not all(values):
            raise argparse.ArgumentTypeError(f"has an empty value in its comma-separated list: {text!r}")
        try:
            values = [kind(v) for v in values if v]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects {kind.__name__} values separated by commas, got {text!r}") from None
        if not values or (choices is not None and any(v not in choices for v in values)):
            raise argparse.ArgumentTypeError(f"expects one or more of {', '.join(choices)} separated by commas, got {text!r}" if choices else f"got no value in {text!r}")
        return values[0] if len(values) == 1 else values
    return parse


def run(args) -> int:
    if args.trace is None and (args.rate != 1.0 or args.trace_requests is not None):
        raise ValueError("--rate and --trace-requests work with --trace")
    report = whatif(args.output, step_log=args.step_log, trace=args.trace, rate=args.rate, trace_requests=args.trace_requests,
                    slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot, progress=args.progress, policy=args.policy, buckets=args.buckets, max_num_seqs=args.max_num_seqs,
                    max_prefill_tokens=args.max_prefill_tokens, num_pages=args.num_pages)
    print(json.dumps(report, allow_nan=False) if args.json else format_report(report))
    return 0
