"""Request traces: arrival times and token counts, read from files or generated.

Owns the `Trace` dataclass, the reader and writer for the Azure LLM inference trace format (CSV with the
columns `TIMESTAMP,ContextTokens,GeneratedTokens`; extra columns are ignored), and a seeded synthetic
generator for users with no trace, where the shared traces live (`shared_trace`: the one reader of
$JAXINFER_TRACE_DIR; they are kept outside the repository), and the arrival-time replay (`replay`: an LLM admits each request at its
trace time, scaled by a rate; `replay_report`: TTFT, TPOT, throughput and goodput under an SLO). Must not
import jax; numpy, the stdlib and the host-only scheduling layer (its SLO rule, simulator.slo_met) only.
Invariants: a `Trace` holds three read-only arrays of equal length; timestamps are float64 seconds since
the first request; token counts are int64, the lengths column named at load time is positive, the other
is non-negative. Every malformed file raises `TraceError` naming the file and, where there is one, the
line, so the CLI can print one line instead of a traceback.
"""

import csv
import dataclasses
import math
import os
import pathlib
from typing import Literal

import numpy as np

from jaxinfer.scheduling.simulator import slo_met

TIMESTAMP, CONTEXT_TOKENS, GENERATED_TOKENS = "TIMESTAMP", "ContextTokens", "GeneratedTokens"
LENGTH_COLUMNS = (CONTEXT_TOKENS, GENERATED_TOKENS)
# Fitted to the Azure 2023 conversation trace (log of token counts; about 5.5 requests per second).
CONVERSATION_INPUT_LOG_MEAN, CONVERSATION_INPUT_LOG_SD = 6.63, 0.99
CONVERSATION_OUTPUT_LOG_MEAN, CONVERSATION_OUTPUT_LOG_SD = 5.02, 0.86
CONVERSATION_REQUESTS_PER_S = 5.5
TRACE_DIR_ENV = "JAXINFER_TRACE_DIR"  # the folder of the shared traces (the Makefile sets it)
CONVERSATION_TRACE = "azure_llm_trace_2023_conv.csv"  # the Azure 2023 conversation trace, 19,366 requests


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


@dataclasses.dataclass(frozen=True, eq=False)
class Trace:
    """A request trace: one entry per request, in file (arrival) order."""

    timestamps: np.ndarray  # float64[N], seconds since the first request
    context_tokens: np.ndarray  # int64[N], prompt tokens
    generated_tokens: np.ndarray  # int64[N], output tokens

    def __post_init__(self):
        arrays = {}
        for field, dtype in (("timestamps", np.float64), ("context_tokens", np.int64), ("generated_tokens", np.int64)):
            array = np.array(getattr(self, field), dtype=dtype)
            array.setflags(write=False)
            arrays[field] = array
            object.__setattr__(self, field, array)
        if len({a.shape for a in arrays.values()}) != 1 or self.timestamps.ndim != 1:
            raise ValueError(f"trace arrays must be 1-D and equal length: { {k: a.shape for k, a in arrays.items()} }")

    @property
    def num_requests(self) -> int:
        return int(self.timestamps.size)

    def lengths(self, column: str = CONTEXT_TOKENS) -> np.ndarray:
        """int64[N] token counts of a length column, by its Azure name."""
        if column not in LENGTH_COLUMNS:
            raise ValueError(f"column must be one of {LENGTH_COLUMNS}, got {column!r}")
        return self.context_tokens if column == CONTEXT_TOKENS else self.generated_tokens

    def take(self, indices) -> "Trace":
        """The sub-trace of the given request indices (in that order)."""
        return Trace(self.timestamps[indices], self.context_tokens[indices], self.generated_tokens[indices])

    def head(self, num_requests: int) -> "Trace":
        return self.take(slice(0, num_requests))

    def split_in_time(self, fraction: float = 0.5) -> tuple["Trace", "Trace"]:
        """(earlier, later): the first `fraction` of requests in time order, and the rest.

        Fitting on the earlier part and measuring on the later one is an out-of-sample test.
        """
        if not 0 < fraction < 1:
            raise ValueError(f"{fraction=} must be in (0, 1)")
        order = np.argsort(self.timestamps, kind="stable")
        cut = min(max(1, round(self.num_requests * fraction)), self.num_requests - 1)
        return self.take(order[:cut]), self.take(order[cut:])


# ---------------------------------------------------------------------------------------------------------
# Reading and writing the Azure format


def _parse_timestamp(text: str) -> np.datetime64 | float:
    """A float (seconds) or an ISO date-time such as 2023-11-16 18:15:46.6805900."""
    try:
        return float(text)
    except ValueError:
        return np.datetime64(text.strip().replace(" ", "T"), "ns")


def _parse_count(text: str, column: str, where: str, minimum: int) -> int:
    try:
        value = float(text)
    except ValueError:
        raise TraceError(f"{where}: {column}={text!r} is not a number") from None
    if not math.isfinite(value) or value != int(value) or value >= 2**53:  # a float holds every count below 2**53 exactly
        raise TraceError(f"{where}: {column}={text!r} is not a whole number of tokens" + (" below 2**53" if math.isfinite(value) and value >= 2**53 else ""))
    if value < minimum:
        kind = "zero or negative" if minimum == 1 else "negative"
        raise TraceError(f"{where}: {column}={text!r} is {kind}; token counts must be >= {minimum}")
    return int(value)


def _header_positions(header: list[str], path: str) -> dict[str, int]:
    names = [name.strip() for name in header]
    missing = [c for c in (TIMESTAMP, *LENGTH_COLUMNS) if c not in names]
    if missing:
        raise TraceError(f"{path}: missing column {', '.join(missing)} (found: {', '.join(names) or 'nothing'})")
    return {name: names.index(name) for name in (TIMESTAMP, *LENGTH_COLUMNS)}


def _parse_row(row: list[str], positions: dict[str, int], where: str, column: str) -> tuple:
    if len(row) <= max(positions.values()):
        raise TraceError(f"{where}: expected at least {max(positions.values()) + 1} fields, got {len(row)}")
    try:
        timestamp = _parse_timestamp(row[positions[TIMESTAMP]])
        if np.isnan(timestamp) if isinstance(timestamp, np.datetime64) else not math.isfinite(timestamp):  # nan, inf, NaT
            raise ValueError
    except ValueError:
        raise TraceError(f"{where}: {TIMESTAMP}={row[positions[TIMESTAMP]]!r} is not a time") from None
    counts = tuple(
        _parse_count(row[positions[name]], name, where, minimum=1 if name == column else 0) for name in LENGTH_COLUMNS
    )
    return (timestamp, *counts)


def _seconds_since_first(timestamps: list) -> np.ndarray:
    kinds = {isinstance(t, float) for t in timestamps}
    if kinds == {True}:
        seconds = np.array(timestamps, dtype=np.float64)
    elif kinds == {False}:
        seconds = (np.array(timestamps) - min(timestamps)) / np.timedelta64(1, "ns") * 1e-9
    else:
        raise TraceError("timestamps mix numbers and date-times")
    return seconds - seconds.min()


def shared_trace(name: str = CONVERSATION_TRACE) -> pathlib.Path:
    """The path of the shared trace file `name` in the folder $JAXINFER_TRACE_DIR names.

    Raises:
      TraceError: naming the variable, when it is unset or empty or the file is not in that folder.
    """
    folder = os.environ.get(TRACE_DIR_ENV, "").strip()
    if not folder:
        raise TraceError(f"{TRACE_DIR_ENV} is not set: set it to the folder that holds {name} (the Makefile sets it)")
    path = pathlib.Path(folder).expanduser() / name
    if not path.is_file():
        raise TraceError(f"{path}: no such file ({TRACE_DIR_ENV}={folder!r} does not hold {name})")
    return path


def load_trace(path: str | os.PathLike, column: str = CONTEXT_TOKENS) -> Trace:
    """Reads a trace in the Azure LLM inference format.

    Args:
        path: CSV file with a header holding TIMESTAMP, ContextTokens and GeneratedTokens.
        column: the lengths column that will be bucketed; its values must be positive. The other length
            column may hold zeros (e.g. requests that generated nothing).

    Returns:
        The trace, in file order.

    Raises:
        TraceError: empty file, missing column, bytes that are not UTF-8, or a non-numeric, fractional, zero or
            negative count or an unreadable time, naming the line. FileNotFoundError if the file does not exist.
    """
    if column not in LENGTH_COLUMNS:
        raise ValueError(f"column must be one of {LENGTH_COLUMNS}, got {column!r}")
    path = os.fspath(path)
    try:
        return _read_trace(path, column)
    except UnicodeDecodeError:  # decoded a block at a time: the block's offset names no line
        raise TraceError(f"{path}:{_first_undecodable_line(path)}: not UTF-8 text (a trace is a UTF-8 CSV file)") from None


def _first_undecodable_line(path: str) -> int:
    """The number of the first line of the file that is not UTF-8 (0 if every line is)."""
    with open(path, "rb") as file:
        for number, line in enumerate(file, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return 0


def _read_trace(path: str, column: str) -> Trace:
    with open(path, newline="", encoding="utf-8-sig") as file:  # a byte-order mark (a spreadsheet's "CSV UTF-8") is not the header's
        reader = csv.reader(file)
        header = next((row for row in reader if any(field.strip() for field in row)), None)  # blank lines before it skipped
        if header is None or not any(field.strip() for field in header):
            raise TraceError(f"{path}: empty file (expected a header {TIMESTAMP},{CONTEXT_TOKENS},{GENERATED_TOKENS})")
        positions = _header_positions(header, path)
        rows = [_parse_row(row, positions, f"{path}:{reader.line_num}", column) for row in reader if any(row)]
    if not rows:
        raise TraceError(f"{path}: no requests after the header")
    timestamps, context_tokens, generated_tokens = zip(*rows)
    return Trace(_seconds_since_first(list(timestamps)), context_tokens, generated_tokens)


def save_trace(trace: Trace, path: str | os.PathLike, start: str = "2023-11-16T00:00:00") -> None:
    """Writes a trace in the Azure format, times as date-times counted from `start`."""
    offsets = np.round(trace.timestamps * 1e9).astype("timedelta64[ns]")
    times = np.datetime_as_string(np.datetime64(start, "ns") + offsets, unit="us")
    with open(path, "w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow([TIMESTAMP, CONTEXT_TOKENS, GENERATED_TOKENS])
        for row in zip(times, trace.context_tokens.tolist(), trace.generated_tokens.tolist()):
            writer.writerow([row[0].replace("T", " "), row[1], row[2]])


# ---------------------------------------------------------------------------------------------------------
# Synthetic traces


def _arrival_gaps(rng, num_requests: int, arrival: str, requests_per_s: float, burstiness: float) -> np.ndarray:
    """Inter-arrival gaps with mean 1/rate: exponential (Poisson) or gamma with squared CV `burstiness`."""
    mean_gap = 1.0 / requests_per_s
    if arrival == "poisson":
        return rng.exponential(mean_gap, num_requests)
    if arrival == "bursty":
        # A gamma renewal process with shape 1/burstiness: the same rate, clumped arrivals.
        return rng.gamma(1.0 / burstiness, mean_gap * burstiness, num_requests)
    raise ValueError(f"arrival must be 'poisson' or 'bursty', got {arrival!r}")


def _lognormal_counts(rng, num_requests: int, log_mean: float, log_sd: float, max_length: int | None):
    counts = np.maximum(1, np.rint(rng.lognormal(log_mean, log_sd, num_requests))).astype(np.int64)
    return counts if max_length is None else np.minimum(counts, max_length)


def synthetic_trace(
    num_requests: int,
    seed: int,
    *,
    input_log_mean: float = CONVERSATION_INPUT_LOG_MEAN,
    input_log_sd: float = CONVERSATION_INPUT_LOG_SD,
    output_log_mean: float = CONVERSATION_OUTPUT_LOG_MEAN,
    output_log_sd: float = CONVERSATION_OUTPUT_LOG_SD,
    arrival: Literal["poisson", "bursty"] = "poisson",
    requests_per_s: float = CONVERSATION_REQUESTS_PER_S,
    burstiness: float = 4.0,
    max_length: int | None = 16384,
) -> Trace:
    """A reproducible trace with lognormal input and output lengths.

    Defaults are fitted to the Azure 2023 conversation trace. Lengths are rounded, at least 1, and
    clipped to `max_length` (a context window; None for no clip).

    Args:
        num_requests: number of requests.
        seed: seed of the numpy generator; the same seed gives the same trace.
        input_log_mean, input_log_sd: mean and sd of log(prompt tokens).
        output_log_mean, output_log_sd: mean and sd of log(generated tokens).
        arrival: "poisson" (exponential gaps) or "bursty" (gamma gaps, same mean rate).
        requests_per_s: mean arrival rate.
        burstiness: squared coefficient of variation of the gaps for "bursty" (1 is Poisson).
        max_length: clip for both length columns.
    """
    if num_requests < 1 or requests_per_s <= 0 or burstiness <= 0:
        raise ValueError(f"need {num_requests=} >= 1, {requests_per_s=} > 0 and {burstiness=} > 0")
    rng = np.random.default_rng(seed)
    gaps = _arrival_gaps(rng, num_requests, arrival, requests_per_s, burstiness)
    timestamps = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    context_tokens = _lognormal_counts(rng, num_requests, input_log_mean, input_log_sd, max_length)
    generated_tokens = _lognormal_counts(rng, num_requests, output_log_mean, output_log_sd, max_length)
    return Trace(timestamps, context_tokens, generated_tokens)


# ---------------------------------------------------------------- arrival-time replay

DEFAULT_SLO_TTFT_S, DEFAULT_SLO_TPOT_S = 2.0, 0.2  # the SLO goodput counts against, unless given


def replay(llm, prompts: list, sampling_params, arrival_s, *, rate: float = 1.0, slo_ttft_s: float = DEFAULT_SLO_TTFT_S,
           slo_tpot_s: float = DEFAULT_SLO_TPOT_S, progress: bool | None = False) -> tuple[list, dict]:
    """Run `prompts` on `llm` with each admitted at its arrival time (seconds since the first, e.g. a
    Trace's timestamps) divided by `rate` (2.0 replays twice as fast), between engine steps. Returns
    (the outputs in input order, replay_report of them)."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate!r}")
    arrivals = np.asarray(arrival_s, np.float64) / rate
    outputs = llm.generate(prompts, sampling_params, arrival_times=arrivals.tolist(), progress=progress)
    return outputs, replay_report(outputs, arrivals, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)


def replay_report(outputs: list, arrivals, *, slo_ttft_s: float = DEFAULT_SLO_TTFT_S, slo_tpot_s: float = DEFAULT_SLO_TPOT_S) -> dict:
    """TTFT and TPOT percentiles over the requests that finished (stop or length: one that timed out or failed has no
    first token, as the simulator's NaN says), throughput and goodput (requests per second meeting both SLOs, as
    DistServe counts it) of a replay; its duration runs from the first arrival to the last finish."""
    arrivals = np.asarray(arrivals, np.float64)
    finished = np.array([o.finish_reason in ("stop", "length") for o in outputs], bool)
    ttft = np.array([o.time_to_first_token for o in outputs], np.float64)
    tpot = np.array([o.metrics.time_per_output_token_s for o in outputs], np.float64)
    duration = float(max(arrivals[o.index] + o.latency for o in outputs) - arrivals.min())
    met = int(np.sum(slo_met(ttft, tpot, finished, slo_ttft_s, slo_tpot_s)))
    pct = lambda values, q, digits: round(float(np.percentile(values[finished], q)), digits) if finished.any() else None  # noqa: E731
    tokens = sum(o.num_generated_tokens for o in outputs)
    return {
        "num_requests": len(outputs), "duration_s": round(duration, 4), "output_tokens_per_s": round(tokens / duration, 3),
        "requests_per_s": round(len(outputs) / duration, 4), "goodput_requests_per_s": round(met / duration, 4), "slo_attainment": round(met / len(outputs), 4),
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s},
        "num_finished": int(finished.sum()), **{f"ttft_p{q}_s": pct(ttft, q, 4) for q in (50, 99)}, **{f"tpot_p{q}_s": pct(tpot, q, 5) for q in (50, 99)},
    }
