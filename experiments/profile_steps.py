"""Where does one engine step's time go? jax.profiler per HLO op, for chosen bucket programs of SmolLM2.

For each bucket key (phase/rows/tokens/pages, e.g. prefill/1/512/64 or decode/32/1/16) it compiles the
engine's own program (Engine._compile, the one warm-up compiles), builds inputs of that shape (a packed
prefill row: 8 sequences of tokens/8 each with pages/8 pages each; decode: every row at the table's last
position; page ids random and distinct), times it (median of --repeats after 2 untimed calls), then
records one call under jax.profiler and sums the trace's events by HLO op, named with the jax op that
made it (the HLO metadata). XLA's cost analysis is recorded too, but it counts the scanned layer body
once, not once per layer, so its flops and bytes are not the step's.

Prints a table per key; writes experiments/results/profile_steps.json (the top ops of every key).

    .venv/bin/python experiments/profile_steps.py [--keys prefill/1/512/64,decode/32/1/16] [--repeats 5]
"""

import collections
import glob
import gzip
import json
import re
import shutil
import statistics
import tempfile

import jax
import numpy as np

import harness
from jaxinfer import kv_pool as kvp
from jaxinfer import sampling
from jaxinfer.api import LLM
from jaxinfer.config import EngineConfig
from jaxinfer.engine import StepInputs
from jaxinfer.plan import BucketKey

RESULTS = harness.RESULTS_DIR / "profile_steps.json"
DEFAULT_KEYS = "prefill/1/512/64,prefill/1/512/32,prefill/1/160/16,decode/32/1/16,decode/8/1/16"
PAGE_SIZE = 16  # bench_engine's
PACKED_SEQS = 8  # sequences of a profiled packed prefill row
_RUNTIME_EVENTS = ("Thunk", "Slinky", "$", "Pjit", "Common", "end:", "while", "PjRt")


def parse_key(text: str) -> BucketKey:
    phase, rows, tokens, pages = text.split("/")
    return BucketKey(phase, int(rows), int(tokens), int(pages))


def step_inputs(key: BucketKey, num_pages: int, samples_per_row: int, seed: int = 0) -> StepInputs:
    """Inputs of `key`'s shape: distinct random pages; a packed prefill row of PACKED_SEQS sequences."""
    rng = np.random.default_rng(seed)
    rows, tokens, width = key.num_rows, key.num_tokens, key.num_pages
    tables = rng.permutation(np.arange(1, num_pages))[: rows * width].reshape(rows, width).astype(np.int32)
    zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    if key.phase == "prefill":
        seqs = PACKED_SEQS if tokens % PACKED_SEQS == 0 and width % PACKED_SEQS == 0 else 1
        positions = np.tile(np.arange(tokens // seqs), seqs)[None].astype(np.int32)
        token_segments = np.repeat(np.arange(seqs), tokens // seqs)[None].astype(np.int32)
        page_positions = np.tile(np.arange(width // seqs) * PAGE_SIZE, seqs)[None].astype(np.int32)
        page_segments = np.repeat(np.arange(seqs), width // seqs)[None].astype(np.int32)
        slot_pages = np.take_along_axis(tables, token_segments * (width // seqs) + positions // PAGE_SIZE, axis=1)  # each sequence's own pages
        pages = kvp.PageMeta(tables, slot_pages, positions % PAGE_SIZE, page_positions, page_segments, token_segments)
    else:
        positions = np.full((rows, 1), width * PAGE_SIZE - 1, np.int32)
        pages = kvp.PageMeta(tables, tables[:, -1:], positions % PAGE_SIZE, zeros(rows, width), zeros(rows, width), zeros(rows, 1))
    n = rows * samples_per_row
    arrays = sampling.SamplingArrays(np.zeros(n, np.float32), zeros(n), np.ones(n, np.float32), zeros(n), zeros(n))
    return StepInputs(zeros(rows, tokens), positions, pages, zeros(rows, samples_per_row), arrays)


def op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction -> the jax op that made it (its metadata op_name, without the jit prefix)."""
    names = {}
    for line in hlo_text.splitlines():
        match = re.match(r"\s*%?([\w.\-]+) = .*?metadata=\{op_name=\"([^\"]+)\"", line)
        if match:
            names[match.group(1)] = re.sub(r"^jit\([^)]*\)/", "", match.group(2))
    return names


def profile_call(run) -> collections.Counter:
    """Microseconds per HLO op of one call of `run`, from a jax.profiler trace."""
    folder = tempfile.mkdtemp(prefix="jaxinfer_profile_")
    try:
        jax.profiler.start_trace(folder, create_perfetto_trace=True)
        run()
        jax.profiler.stop_trace()
        events = json.load(gzip.open(sorted(glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True))[-1]))["traceEvents"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    totals = collections.Counter()
    for event in events:
        if event.get("ph") == "X" and not event["name"].startswith(_RUNTIME_EVENTS):
            totals[event["name"]] += event.get("dur", 0)
    return totals


def profile_key(llm: LLM, key: BucketKey, repeats: int, top: int) -> dict:
    engine = llm.engine
    _, program, compile_s = engine._compile(key)
    inputs = step_inputs(key, engine.num_pages, engine.engine_cfg.tables.samples_per_row(key.phase))

    def run():
        tokens, engine.pool = program(engine.step_params, engine.pool, inputs)  # donates the pool; rebound at once
        np.asarray(tokens)

    seconds = harness.time_calls(run, repeats, warmup=2)
    totals = profile_call(run)
    names = op_names(program.as_text())
    cost = (program.cost_analysis() or {}) if hasattr(program, "cost_analysis") else {}
    cost = cost[0] if isinstance(cost, list) else cost
    traced = sum(totals.values())
    ops = [{"op": op, "jax_op": names.get(op, ""), "ms": us / 1e3, "share_of_traced": us / traced} for op, us in totals.most_common(top)]
    by_jax_op = collections.Counter()  # the HLO ops one jax op made, summed
    for op, us in totals.items():
        by_jax_op[re.sub(r"^while/body/", "", names.get(op, op))] += us
    return {"key": "/".join(map(str, key)), "compile_s": compile_s, "median_ms": 1e3 * statistics.median(seconds), "traced_op_ms": traced / 1e3,
            "flops": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed"), "top_ops": ops,
            "top_jax_ops": [{"jax_op": name, "ms": us / 1e3, "share_of_traced": us / traced} for name, us in by_jax_op.most_common(top)]}


def main() -> None:
    parser = harness.arg_parser(__doc__, out=RESULTS)
    parser.add_argument("--keys", default=DEFAULT_KEYS, help="comma list of phase/rows/tokens/pages bucket keys")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=8, help="ops listed per key")
    args = parser.parse_args()
    keys = [parse_key(k) for k in args.keys.split(",") if k]
    engine_config = EngineConfig(max_context=2048, max_num_seqs=32, page_size=PAGE_SIZE, num_pages=32 * 2048 // PAGE_SIZE + 1, compilation_cache_dir=None)
    llm = LLM(None, engine_config=engine_config, warmup=False)
    results = []
    for key in keys:
        entry = profile_key(llm, key, args.repeats, args.top)
        results.append(entry)
        print(f"\n{entry['key']}: median {entry['median_ms']:.1f} ms (traced ops {entry['traced_op_ms']:.1f} ms, both cores summed); "
              f"XLA cost analysis {(entry['flops'] or 0) / 1e9:.1f} GFLOP, {(entry['bytes_accessed'] or 0) / 1e6:.0f} MB")
        for op in entry["top_ops"]:
            print(f"  {op['ms']:8.1f} ms {op['share_of_traced']:6.1%}  {op['op']:<30} {op['jax_op'][:80]}")
        print("  by jax op:")
        for op in entry["top_jax_ops"]:
            print(f"  {op['ms']:8.1f} ms {op['share_of_traced']:6.1%}  {op['jax_op'][:110]}")
    document = {"question": "where one engine step's time goes, per HLO op (jax.profiler)", "model": "SmolLM2-135M-Instruct f32",
                "page_size": PAGE_SIZE, "packed_seqs": PACKED_SEQS, "keys": results}
    harness.write_result(args.out, document)
    print(json.dumps({"profile_steps": {r["key"]: round(r["median_ms"], 1) for r in results}}))


if __name__ == "__main__":
    main()
