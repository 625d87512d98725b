"""Where does one engine step's time go? jax.profiler per HLO op, for chosen bucket programs of SmolLM2 (or --model).

Per bucket key (phase/rows/tokens/pages) it compiles the engine's own program (Engine._compile), builds
inputs of that shape (a packed prefill row of PACKED_SEQS sequences; decode rows at the table's last
position), times it, records one call under jax.profiler and sums the events by HLO op, named with the jax
op that made it. XLA's cost analysis counts the scanned layer body once, so its figures are not the step's.

    .venv/bin/python experiments/profile_steps.py [--keys prefill/1/512/64,decode/32/1/16] [--repeats 5]
        [--model build/bench_1b/llama3-1b-random-q4_0.gguf --attention cpu --matmul cpu_int8 --max-num-seqs 8 --max-context 1024]
"""

import collections
import dataclasses
import json
import re
import shutil
import statistics
import tempfile

import numpy as np

from common import engine_runs, paths, report, timing
from jaxinfer.model import kv_pool as kvp
from jaxinfer.scheduling import guided
from jaxinfer.engine import profiling
from jaxinfer.model import sampling
from jaxinfer.api import LLM
from jaxinfer.engine.engine import StepInputs
from jaxinfer.scheduling.bucket_tables import BucketTables
from jaxinfer.scheduling.plan import BucketKey

RESULTS = paths.RESULTS_DIR / "profile_steps.json"
DEFAULT_KEYS = "prefill/1/512/64,prefill/1/512/32,prefill/1/160/16,decode/32/1/16,decode/8/1/16"
PAGE_SIZE = 16  # bench_engine's
PACKED_SEQS = 8  # sequences of a profiled packed prefill row
_RUNTIME_EVENTS = ("Thunk", "Slinky", "$", "Pjit", "Common", "end:", "while", "PjRt")


def parse_key(text: str) -> BucketKey:
    phase, rows, tokens, pages = text.split("/")
    return BucketKey(phase, int(rows), int(tokens), int(pages))


def step_inputs(key: BucketKey, num_pages: int, samples_per_row: int, engine, seed: int = 0) -> StepInputs:
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
    floats = lambda value, *shape: np.full(shape or (n,), value, np.float32)  # noqa: E731
    bias, words = engine.engine_cfg.max_logit_bias, guided.mask_words(engine.cfg.vocab_size)
    arrays = sampling.SamplingArrays(  # greedy, nothing processed, no log-probabilities, no grammar
        floats(0), zeros(n), floats(1), zeros(n), zeros(n), floats(0), floats(0), floats(0), floats(1),
        zeros(n, bias), floats(0, n, bias), np.full(n, -1, np.int32), np.full((n, words), -1, np.int32),
    )
    return StepInputs(zeros(rows, tokens), positions, pages, zeros(rows, samples_per_row), arrays, zeros(n), np.full((rows, tokens), -1, np.int32))


def op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction -> the jax op that made it (its metadata op_name, without the jit prefix)."""
    names = {}
    for line in hlo_text.splitlines():
        match = re.match(r"\s*%?([\w.\-]+) = .*?metadata=\{op_name=\"([^\"]+)\"", line)
        if match:
            names[match.group(1)] = re.sub(r"^jit\([^)]*\)/", "", match.group(2))
    return names


def profile_call(run) -> collections.Counter:
    """Microseconds per HLO op of one call of `run`, from a jax.profiler trace (jaxinfer.engine.profiling, as LLM.start_profile)."""
    folder = tempfile.mkdtemp(prefix="jaxinfer_profile_")
    try:
        profiling.start(folder)
        run()
        profiling.stop()
        events = profiling.trace_events(folder)
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
    _, draw, _ = engine._compile(key.num_rows * BucketTables.from_config(engine.engine_cfg).samples_per_row(key.phase))  # the step's second program (Engine.step)
    inputs = step_inputs(key, engine.num_pages, BucketTables.from_config(engine.engine_cfg).samples_per_row(key.phase), engine)
    forward_inputs = dataclasses.replace(inputs, sampling=dataclasses.replace(inputs.sampling, token_mask=None))  # the mask is the draw's

    def run():
        logits, engine.pool, engine.history = program(engine.step_params, engine.pool, engine.history, forward_inputs)  # donated; rebound at once
        tokens, _ = draw(logits.adjusted, logits.raw, inputs.sampling)
        np.asarray(tokens)

    seconds = timing.time_calls(run, repeats, warmup=2)
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
    parser = report.arg_parser(__doc__, out=RESULTS)
    parser.add_argument("--keys", default=DEFAULT_KEYS, help="comma list of phase/rows/tokens/pages bucket keys")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=8, help="ops listed per key")
    parser.add_argument("--model", default=None, help="a model path or GGUF file (default: SmolLM2-135M-Instruct, the package's)")
    parser.add_argument("--attention", default="auto", help="attention_impl (auto: the tuner's choice, or the fixed rule with JAXINFER_TUNE=0)")
    parser.add_argument("--matmul", default="auto", help="matmul_impl, as --attention")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="the engine's rows (its pool holds this many full contexts)")
    parser.add_argument("--max-context", type=int, default=engine_runs.WORKLOAD_MAX_CONTEXT, help="the engine's context limit (bench_1b's files: 1024)")
    args = parser.parse_args()
    keys = [parse_key(k) for k in args.keys.split(",") if k]
    engine_cfg = engine_runs.workload_engine_config(max_num_seqs=args.max_num_seqs, max_context=args.max_context, page_size=PAGE_SIZE, attention_impl=args.attention, matmul_impl=args.matmul)
    llm = LLM(args.model, engine_config=engine_cfg, warmup=False)
    report.log("profile_steps", f"running {llm.choices.describe()}")
    results = []
    for key in keys:
        entry = profile_key(llm, key, args.repeats, args.top)
        results.append(entry)
        print(f"\n{entry['key']}: median {entry['median_ms']:.1f} ms (traced ops {entry['traced_op_ms']:.1f} ms, both cores summed); "
              f"XLA cost analysis {(entry['flops'] or 0) / 1e9:.1f} GFLOP, {(entry['bytes_accessed'] or 0) / 1e6:.0f} MB")
        print(report.format_table([("ms", "10.1f"), ("share", "6.1%"), ("HLO op", "<30"), ("jax op", "<")],
                                   [[op["ms"], op["share_of_traced"], op["op"], op["jax_op"][:80]] for op in entry["top_ops"]]))
        print(report.format_table([("ms", "10.1f"), ("share", "6.1%"), ("by jax op", "<")],
                                   [[op["ms"], op["share_of_traced"], op["jax_op"][:110]] for op in entry["top_jax_ops"]]))
    document = {"question": "where one engine step's time goes, per HLO op (jax.profiler)", "model": args.model or "SmolLM2-135M-Instruct", "choices": llm.choices.describe(),
                "page_size": PAGE_SIZE, "packed_seqs": PACKED_SEQS, "keys": results}
    report.write_result(args.out, document)
    print(json.dumps({"profile_steps": {r["key"]: round(r["median_ms"], 1) for r in results}}))


if __name__ == "__main__":
    main()
