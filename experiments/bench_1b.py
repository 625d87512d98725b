"""Llama-3.2-1B-shaped GGUFs in Q4_0 and Q8_0: jaxinfer's default against llama.cpp and HF on the same work.

The 1B-class benchmark. Each format's file holds random weights of the Llama-3.2-1B geometry
(models.GEOMETRIES["llama3-1b"], N(0, 0.02) quantized by gguf.quants.quantize) and the Llama 3 tokenizer
of llama.cpp's ggml-vocab-llama-bpe.gguf (`make llama-cpp-models`); the files are written once into
build/bench_1b/. On the same workload (--num-requests of the conversation trace scaled by --scale,
workloads.build_workload with the Llama 3 tokenizer), in one run:
  - jaxinfer "default": LLM(path), nothing set (dtype, attention and matmul left to the tuner);
  - jaxinfer "gguf": the file's blocks kept on the device (quantization="gguf"), and for Q8_0 also
    "gguf_int8": those blocks multiplied W8A8 (matmul_impl="int8");
  - llama.cpp sequential (one stream) and batched (--parallel sequence ids), experiments/peers/llamacpp_generate.py;
  - HF transformers generate (the GGUF dequantized to f32), experiments/peers/hf_generate.py.
Each jaxinfer runner is checked against the dense reference generator first (engine_runs.run_engine), and its
greedy tokens are compared with llama.cpp's. Beside throughput, the decode step at batch 1 is timed on one
request and its weight bytes (what the chosen format must read) are set against the measured read bandwidth.
Writes experiments/results/bench_1b.json (machine block: CPU model and flags, the llama.cpp build flags);
the last stdout line is one JSON document.

    .venv/bin/python experiments/bench_1b.py [--formats Q4_0,Q8_0] [--num-requests 16] [--scale 16] [--runners ...]
"""

import json
import time

import numpy as np

from common import engine_runs, machine, models, paths, peers, report, timing, workloads
from common.paths import REPO_ROOT

RESULTS = paths.RESULTS_DIR / "bench_1b.json"
WORK_DIR = REPO_ROOT / "build" / "bench_1b"
GEOMETRY = "llama3-1b"
VOCAB_GGUF = REPO_ROOT / "build" / "llama-cpp-python" / "models" / "ggml-vocab-llama-bpe.gguf"
FORMATS = ("Q4_0", "Q8_0")
RUNNERS = ("default", "gguf", "gguf_int8", "llamacpp", "hf")
JAXINFER_LOADS = {"default": {}, "gguf": {"quantization": "gguf"}, "gguf_int8": {"quantization": "gguf", "matmul_impl": "int8"}}
MAX_CONTEXT = 1024
MAX_OUTPUT = 32  # output tokens per request at most (the 1B runs at a few tokens/s on 2 cores)
DECODE_PROBE = (32, 24)  # the batch-1 probe: prompt tokens, output tokens
_GOALS_PER_FORMAT = {  # name: (what, target, how), each goal once per format
    "default_vs_llamacpp": ("default output tok/s >= 2x llama.cpp's best mode", 2.0, "at_least"),
    "default_mbu_b1": ("default decode at batch 1 reads >= 60% of the read bandwidth", 0.6, "at_least"),
    "default_vs_best": ("default within 10% of the best jaxinfer runner", 0.9, "at_least"),
    "gguf_resident": ("kept (quantization='gguf'): resident weight bytes within 15% of the file's tensor bytes", 0.15, "within"),
}
GOALS = {f"{name}_{fmt}": (f"{fmt}: {what}", target, how) for name, (what, target, how) in _GOALS_PER_FORMAT.items() for fmt in FORMATS}


def parse_args():
    parser = report.arg_parser(__doc__, out=RESULTS, trace=True)
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma list of {', '.join(FORMATS)}")
    parser.add_argument("--runners", default=",".join(RUNNERS), help=f"comma list of {', '.join(RUNNERS)} (gguf_int8: Q8_0 only)")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--scale", type=float, default=16.0, help="trace lengths are divided by this")
    parser.add_argument("--parallel", type=int, default=16, help="llama.cpp's sequence ids in batched mode")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per runner (the best is kept)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.formats = report.comma_list(parser, args.formats, FORMATS, "format")
    args.runners = report.comma_list(parser, args.runners, RUNNERS, "runner")
    return args


def model_file(fmt: str) -> str:
    """The format's random-weight GGUF, written on first use."""
    from jaxinfer.loading import loading

    path = WORK_DIR / f"{GEOMETRY}-random-{fmt.lower()}.gguf"
    if not path.exists():
        if not VOCAB_GGUF.exists():
            raise SystemExit(f"error: {VOCAB_GGUF} is missing; run `make llama-cpp-models`")
        WORK_DIR.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        _, seconds = timing.timed(models.write_random_gguf, partial, models.GEOMETRIES[GEOMETRY], fmt, loading.open_gguf(VOCAB_GGUF),
                                   max_context=MAX_CONTEXT)
        partial.rename(path)
        report.log("bench_1b", f"wrote {path.name} ({path.stat().st_size / 2**20:.0f} MiB) in {seconds:.0f}s")
    return str(path)


def decode_probe(llm, bandwidth: float) -> dict:
    """One request alone: the median decode step at batch 1, and the weight bytes it reads per step over the
    read bandwidth: quant.resident_bytes of the step's params (the chosen format's bytes), less the
    embedding table where the head is its own array (packed panels of a tied head): a step gathers one
    row of the table, and reads the head whole."""
    from jaxinfer.model import quant

    prompt, output = DECODE_PROBE
    recorder = engine_runs.StepRecorder(llm.engine_config.page_size)
    llm.generate([list(range(1000, 1000 + prompt))], workloads.greedy(output), progress=False, on_step=recorder)
    step_s = float(np.median(recorder.phase_seconds("decode")))
    params = llm.engine.step_params
    resident = quant.resident_bytes(params)
    lookup_only = quant.resident_bytes(params.embed) if params.lm_head is not None else 0
    weight_bytes = resident - lookup_only
    return {"decode_step_s": step_s, "resident_step_bytes": resident, "lookup_table_bytes": lookup_only, "weight_bytes": weight_bytes,
            "bytes_per_s": weight_bytes / step_s, "mbu": weight_bytes / step_s / bandwidth}


def run_jaxinfer(name: str, path: str, workload: dict, args, bandwidth: float) -> tuple[dict, list]:
    engine_cfg = engine_runs.workload_engine_config(max_num_seqs=max(1, min(16, args.num_requests)), max_context=MAX_CONTEXT)
    result, tokens, llm = engine_runs.run_engine(workload, engine_cfg, args.repeats, model=path, **JAXINFER_LOADS[name])
    from jaxinfer.loading import loading
    from jaxinfer.model import quant

    file_bytes = sum(int(t.n_bytes) for t in loading.open_gguf(loading.resolve_model_path(path)).tensors)
    result |= {"choices": str(llm.choices), "decode_b1": decode_probe(llm, bandwidth), "file_tensor_bytes": file_bytes,
               "resident_weight_bytes": quant.resident_bytes(llm.engine.params), "peak_rss_bytes": timing.peak_rss_bytes()}
    report.log("bench_1b", f"{name}: {result['output_tokens_per_s']:.2f} tok/s, {result['choices']}; decode b1 "
                f"{1e3 * result['decode_b1']['decode_step_s']:.0f} ms, MBU {result['decode_b1']['mbu']:.1%}")
    return result, tokens


def run_format(fmt: str, workload: dict, workload_file, args, bandwidth: float) -> dict:
    """Every runner on one format's file: {runner: result}; greedy agreement of each with llama.cpp batched."""
    path, results, tokens = model_file(fmt), {}, {}
    for name in [r for r in args.runners if r in JAXINFER_LOADS and (r != "gguf_int8" or fmt == "Q8_0")]:
        try:
            results[name], tokens[name] = run_jaxinfer(name, path, workload, args, bandwidth)
        except Exception as error:  # noqa: BLE001  (one runner's failure is recorded, the others still run)
            results[name] = {"error": f"{type(error).__name__}: {error}"}
            report.log("bench_1b", f"{name}: failed: {results[name]['error'][:300]}")
    peer_scripts = {"llamacpp": ("llamacpp_generate.py", "--parallel", str(args.parallel)), "hf": ("hf_generate.py", "--batch-size", "8")}
    for name in [r for r in args.runners if r in peer_scripts]:
        script, *extra = peer_scripts[name]
        raw, peer_tokens = peers.run_generate_peer(script, workload_file, WORK_DIR / f"{name}_{fmt}_tokens.json", "--gguf", path,
                                                     "--repeats", str(args.repeats), *extra)
        if "error" in raw:
            results[name] = raw
            report.log("bench_1b", f"{name}: failed: {raw['error'][-300:]}")
            continue
        for mode, entry in (raw.pop("modes") if "modes" in raw else {None: raw}).items():
            key = name if mode is None else f"{name}_{mode}"
            results[key], tokens[key] = {**entry, "load_s": raw["load_s"], **({"peer": raw} if mode else {})}, peer_tokens[mode] if mode else peer_tokens
            report.log("bench_1b", f"{key}: {entry['output_tokens_per_s']:.2f} tok/s")
    if (reference := tokens.get("llamacpp_batched")) is not None:
        for key, ids in tokens.items():
            results[key]["agreement_vs_llamacpp_batched"] = workloads.agreement(ids, reference)
    return results


def goals(by_format: dict) -> dict:
    measured = {}
    for fmt, results in by_format.items():
        rate = lambda name: results.get(name, {}).get("output_tokens_per_s")  # noqa: E731
        ours, peer = rate("default"), max([r for r in (rate("llamacpp_sequential"), rate("llamacpp_batched")) if r] or [0.0]) or None
        best = max([rate(name) for name in JAXINFER_LOADS if rate(name)] or [0.0]) or None
        measured |= {f"default_vs_llamacpp_{fmt}": ours / peer if ours and peer else None,
                     f"default_mbu_b1_{fmt}": results.get("default", {}).get("decode_b1", {}).get("mbu"),
                     f"default_vs_best_{fmt}": ours / best if ours and best else None}
        if "resident_weight_bytes" in (kept := results.get("gguf", {})):
            measured[f"gguf_resident_{fmt}"] = kept["resident_weight_bytes"] / kept["file_tensor_bytes"] - 1
    return report.judge(GOALS, measured)


def print_table(by_format: dict) -> None:
    columns = [("format", "<6"), ("runner", "<22"), ("tok/s", "8.2f"), ("x llama.cpp b", "13.2f"), ("decode b1 ms", "12.0f"), ("MBU b1", "7.1%"),
               ("greedy = llama.cpp", "18.0%"), ("choices", "<60")]
    rows = []
    for fmt, results in by_format.items():
        peer = results.get("llamacpp_batched", {}).get("output_tokens_per_s")
        for name, r in results.items():
            rate, probe = r.get("output_tokens_per_s"), r.get("decode_b1") or {}
            rows.append([fmt, name, rate if rate else (r.get("error") or "")[:40], rate / peer if rate and peer else None,
                         1e3 * probe["decode_step_s"] if probe else None, probe.get("mbu"),
                         (r.get("agreement_vs_llamacpp_batched") or {}).get("exact_requests"), r.get("choices")])
    print("\n" + report.format_table(columns, rows))


def main() -> None:
    from jaxinfer.loading.tokenizer import load_tokenizer

    args = parse_args()
    start = time.perf_counter()
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    workload = workloads.build_workload(args.trace, args.num_requests, args.scale, args.seed, load_tokenizer(model_file(args.formats[0])),
                                      max_context=MAX_CONTEXT, max_output=MAX_OUTPUT)
    workload_file = WORK_DIR / "workload.json"
    workload_file.write_text(json.dumps(workload))
    summary = workloads.workload_summary(workload["requests"])
    report.log("bench_1b", f"workload: {summary}")
    peaks = {"bandwidth": machine.measure_bandwidth_peak(5)}
    bandwidth = peaks["bandwidth"]["best_bytes_per_s"]
    by_format = {fmt: run_format(fmt, workload, workload_file, args, bandwidth) for fmt in args.formats}
    print_table(by_format)
    result = {"question": "a 1B-class GGUF (Q4_0, Q8_0): jaxinfer's default vs its other runners, llama.cpp and HF on the same workload",
              "geometry": models.GEOMETRIES[GEOMETRY], "workload": {**{k: v for k, v in workload.items() if k != "requests"}, **summary},
              "settings": {k: str(v) for k, v in vars(args).items()}, "results": by_format, "goals": goals(by_format),
              "runtime_s": time.perf_counter() - start}
    report.print_goals(result["goals"])
    checks = [r["reference_check"] for results in by_format.values() for r in results.values() if "reference_check" in r]
    correct = all(c["num_equal"] == c["num_checked"] for c in checks)
    report.finish(args.out, result, {"bench": "1b", "correct": correct, "goals": {k: g["measured"] for k, g in result["goals"].items()},
                                      "runtime_s": result["runtime_s"]}, correct=correct, peaks=peaks)


if __name__ == "__main__":
    main()
