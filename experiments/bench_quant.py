"""What do quantized weights and an int8 KV cache cost in accuracy, and what do they save in memory and time?

The quantization benchmark; what it reports, and the committed run, are in docs/benchmarks.md ("Quantization benchmark").
Every format of FORMATS, each also with the paged pool's int8 KV cache, runs in its own --worker subprocess
(so its peak RSS is its own): measure_row's correctness (f32 greedy tokens == HF's fixture tokens; gguf
logits == f32's within GGUF_LOGITS_TOLERANCE), accuracy over WINDOW-token windows of the held-out text,
prefill and decode speed through the paged pool, and (--e2e-requests) the common engine run (engine_runs.run_engine). Beside
them: llama.cpp on the same GGUF, windows and workload. The 1B-class GGUFs (resident bytes against the
file's, speed) are bench_1b.py's. GOALS print as met / not met; progress goes to stderr.

    .venv/bin/python experiments/bench_quant.py [--quick] [--formats f32,int8,gguf] [--kv-cache-dtypes none,int8]
"""

import argparse
import contextlib
import functools
import gc
import json
import math
import pathlib
import statistics
import subprocess
import sys
import time

import numpy as np

from common import engine_runs, machine, paths, peers, programs, report, timing, workloads
from common.paths import REPO_ROOT
from common.timing import peak_rss_bytes, reset_peak_rss
from jaxinfer.model import kv_pool, panels, params as params_lib, quant
from jaxinfer.loading import loading
from jaxinfer.api import LLM, SamplingParams
from jaxinfer.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.loading.tokenizer import load_tokenizer

HELDOUT_TEXT = REPO_ROOT / "experiments" / "data" / "heldout_python_docs.txt"
RESULTS = paths.RESULTS_DIR / "bench_quant.json"
WORK_DIR = REPO_ROOT / "build" / "bench_quant"  # plan, reference logits (git-ignored)
FORMATS = {  # name: (compute dtype, load_model quantization, int4 group size)
    "f32": ("float32", None, None),
    "bf16": ("bfloat16", None, None),
    "int8": ("float32", "int8", None),
    "int4_g32": ("float32", "int4", 32),
    "int4_g64": ("float32", "int4", 64),
    "int4_g128": ("float32", "int4", 128),
    "gguf": ("float32", "gguf", None),
    "int8_cpu_int8": ("float32", "int8", None),  # the int8 weights packed for the quantized-matmul kernel (W8A8, blocks of 32)
    "gguf_cpu_int8": ("float32", "gguf", None),  # the GGUF's Q4_1 / Q8_0 blocks packed for it
}
KERNEL_ROWS = ("int8_cpu_int8", "gguf_cpu_int8")  # packed with panels.pack_panels(quantized=True): matmul_impl 'cpu_int8'
REFERENCE = "f32"  # the baseline every other row is compared with; always run, and first
QUICK_FORMATS = ("f32", "int8", "gguf")
WINDOW = 512  # tokens per perplexity window
MAX_CONTEXT = engine_runs.WORKLOAD_MAX_CONTEXT  # context the model is loaded with (the e2e engine needs 2048)
PAGE_SIZE = 64  # tokens per page of the paged pool (the engine's default, as bench_forward.py)
GREEDY_PROMPTS = (0, 1, 3, 7)  # fixture prompts of 46-59 tokens (padded to GREEDY_PAD)
GREEDY_PAD, GREEDY_TOKENS = 64, 32  # the fixture holds HF's first 32 greedy tokens (--quick: 8)
GGUF_LOGITS_TOLERANCE = 1e-5  # gguf-kept vs f32 logits: tests/tolerances.py LOGITS_VS_FLOAT64 (same weights, other sum order)
GGUF_PPL_TOLERANCE = 1e-4  # "identical perplexity": |ppl_gguf / ppl_f32 - 1| at most this
PPL_PATHS_TOLERANCE = 1e-4  # prompt_logprobs' perplexity vs the forward's logits: |ratio - 1| at most this
GOALS = {  # name: (what, target, how the measured value must compare: |m| <= t, m <= t or m >= t)
    "int8_ppl": ("int8 perplexity within 0.5% of f32", 0.005, "within"),
    "int4_g32_ppl": ("int4 g32 perplexity within 3% of f32", 0.03, "within"),
    "gguf_ppl_identical": (f"gguf perplexity identical to f32 (|change| <= {GGUF_PPL_TOLERANCE:g})", GGUF_PPL_TOLERANCE, "within"),
    "int8_kv_ppl": ("f32 weights + int8 KV cache perplexity within 0.5% of f32", 0.005, "within"),
    "int8_weight_bytes": ("int8 resident weight bytes <= 0.3x f32's", 0.3, "at_most"),
    "gguf_weight_bytes": ("gguf resident weight bytes <= 1.15x the file's tensor bytes", 1.15, "at_most"),
    "int8_decode_b1": ("int8 decode at batch 1 >= 1.5x faster than f32", 1.5, "at_least"),
    "kernel_int8_decode_b1_vs_bf16": ("int8 through the quantized-matmul kernel: decode at batch 1 >= 1.6x bf16", 1.6, "at_least"),
    "kernel_w8a8_ppl": ("int8 W8A8 through the quantized-matmul kernel: perplexity within 1% of f32", 0.01, "within"),
    "none_slower_b32": ("no row slower than f32 at batch 32 decode", 1.0, "at_least"),
}


log = functools.partial(report.log, "bench_quant")


# ------------------------------------------------------------------------------------------ memory and the paged pool


def weight_memory(params) -> dict:
    """Resident bytes of the weights, in total and per (kind, storage format) as `jaxinfer info` prints."""
    by_kind = params_lib.weight_bytes(params)
    return {"resident_bytes": quant.resident_bytes(params), "by_kind": {f"{kind}/{fmt}": n for (kind, fmt), n in sorted(by_kind.items())}}


def gguf_tensor_bytes(path: pathlib.Path) -> int:
    return sum(int(t.n_bytes) for t in loading.open_gguf(path).tensors)


def make_pool(cfg, params, num_pages: int, kv_cache_dtype: str | None) -> tuple[kv_pool.KVPool, str]:
    """(the pool of num_pages pages an Engine allocates for kv_cache_dtype, the attention impl it resolves)."""
    extra = {"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype else {}
    engine_cfg = EngineConfig(page_size=PAGE_SIZE, num_pages=num_pages, max_context=MAX_CONTEXT, max_num_seqs=1, compilation_cache_dir=None, **extra)
    engine = Engine(cfg, params, engine_cfg)
    return engine.pool, engine.impl


# ------------------------------------------------------------------------------------------ correctness and accuracy


def greedy_tokens(cfg, params, kv: str | None, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """num_tokens greedy tokens per prompt, all prompts as rows of one batch through the paged pool."""
    rows, pages_per_row = len(prompts), -(-(GREEDY_PAD + num_tokens) // PAGE_SIZE)
    pool, impl = make_pool(cfg, params, programs.num_pool_pages(rows, pages_per_row), kv)
    forward = functools.partial(programs.forward_program(), cfg=cfg, impl=impl, output="greedy")
    step_args = functools.partial(programs.step_args, pages_per_row=pages_per_row, page_size=PAGE_SIZE)
    token, pool = forward(params, pool, *step_args("prefill", [(p, 0) for p in prompts], num_tokens=GREEDY_PAD))  # donates the pool
    generated = [np.asarray(token)]
    for _ in range(1, num_tokens):
        sequences = [prompt + out for prompt, out in zip(prompts, np.stack(generated, axis=1).tolist())]
        _, positions, pages, last = step_args("decode", [(ids, len(ids) - 1) for ids in sequences], num_tokens=1)
        token, pool = forward(params, pool, token[:, None], positions, pages, last)  # the token stays on the device
        generated.append(np.asarray(token))
    return np.stack(generated, axis=1).tolist()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities along the last axis."""
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def score_window(logits: np.ndarray, window: list[int], reference: np.ndarray | None) -> dict:
    """Sums over the window's predicted positions (t predicts token t + 1): NLL, and vs the f32 reference
    logits the KL(p_f32 || p), argmax agreement and the logits' relative error norm."""
    log_probs = log_softmax(logits[:-1])  # [T - 1, V]
    scores = {"nll_sum": float(-log_probs[np.arange(len(window) - 1), window[1:]].sum()), "num_predicted": len(window) - 1}
    if reference is not None:
        ref_log_probs = log_softmax(reference[:-1])
        scores |= {"kl_sum": float((np.exp(ref_log_probs) * (ref_log_probs - log_probs)).sum()),
                   "argmax_equal": int((logits[:-1].argmax(-1) == reference[:-1].argmax(-1)).sum()),
                   "logits_relative_error": workloads.relative_error(logits, reference)}
    return scores


def aggregate_scores(per_window: list[dict], seconds: float) -> dict:
    """Perplexity over every predicted token of all windows, and the per-token means vs f32 if scored."""
    count = sum(w["num_predicted"] for w in per_window)
    result = {"num_windows": len(per_window), "num_predicted": count, "seconds": seconds, "mean_nll": sum(w["nll_sum"] for w in per_window) / count}
    result["perplexity"] = math.exp(result["mean_nll"])
    if "kl_sum" in per_window[0]:
        result |= {"mean_kl_vs_f32": sum(w["kl_sum"] for w in per_window) / count,
                   "argmax_agreement_vs_f32": sum(w["argmax_equal"] for w in per_window) / count,
                   "max_logits_relative_error_vs_f32": max(w["logits_relative_error"] for w in per_window)}
    return result


def perplexity(cfg, params, kv: str | None, windows: list[list[int]], reference_dir: pathlib.Path, write_reference: bool) -> dict:
    """Perplexity from LLM.generate's prompt_logprobs (the engine's chunked prefill); beside it each window
    as one forward through the paged pool for its full logits: the f32 row writes them to reference_dir,
    the others are scored against them (KL, argmax agreement), and the forward's own perplexity must
    equal the prompt_logprobs one (PPL_PATHS_TOLERANCE)."""
    pages = WINDOW // PAGE_SIZE
    pool, impl = make_pool(cfg, params, programs.num_pool_pages(1, pages), kv)
    start = time.perf_counter()
    nll = prompt_logprob_nll(cfg, params, kv, windows, impl)
    logprob_s = time.perf_counter() - start
    per_window = []
    for i, window in enumerate(windows):
        tokens, positions, meta, _ = programs.step_args("prefill", [(window, 0)], num_tokens=WINDOW, pages_per_row=pages, page_size=PAGE_SIZE)
        logits, pool = programs.forward_program()(params, pool, tokens, positions, meta, None, cfg=cfg, impl=impl, output="logits")
        logits = np.asarray(logits[0], np.float32)  # [T, V]
        if write_reference:
            np.save(reference_dir / f"w{i}.npy", logits)
        per_window.append(score_window(logits, window, None if write_reference else np.load(reference_dir / f"w{i}.npy")))
    forward = aggregate_scores(per_window, time.perf_counter() - start - logprob_s)
    result = aggregate_scores([w | {"nll_sum": n} for w, n in zip(per_window, nll)], logprob_s)
    result["perplexity_of_the_forward_logits"] = forward["perplexity"]
    if quant.has_int8_weights(params) and kv is None:  # W8A8 (matmul 'int8': activations quantized in blocks of 32) on the same weights
        w8a8 = prompt_logprob_nll(cfg, params, kv, windows, impl, matmul="int8")
        result["w8a8_perplexity"] = math.exp(math.fsum(w8a8) / result["num_predicted"])
    result["prompt_logprobs_vs_forward"] = result["perplexity"] / forward["perplexity"] - 1
    if abs(result["prompt_logprobs_vs_forward"]) > PPL_PATHS_TOLERANCE:
        raise SystemExit(f"prompt_logprobs perplexity {result['perplexity']:.6f} != the forward's {forward['perplexity']:.6f}")
    return result


def prompt_logprob_nll(cfg, params, kv: str | None, windows: list[list[int]], impl: str, matmul: str = "xla") -> list[float]:
    """Each window's summed negative log-likelihood from prompt_logprobs, through LLM.from_params on these
    params (the forward's attention, XLA's matmul unless `matmul` says else: pinned, so nothing is tuned)."""
    extra = {"kv_cache_dtype": kv} if kv else {}
    engine_cfg = EngineConfig(page_size=PAGE_SIZE, max_context=WINDOW + PAGE_SIZE, max_num_seqs=1, enable_prefix_caching=False,
                              attention_impl=impl, matmul_impl=matmul, compilation_cache_dir=None, **extra)
    llm = LLM.from_params(cfg, params, load_tokenizer(None), engine_config=engine_cfg)
    outputs = llm.generate(windows, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), progress=False)
    return [-math.fsum(entry[0] for entry in o.prompt_logprobs[1:]) for o in outputs]


def score_llamacpp(windows: list[list[int]], workdir: pathlib.Path, kv_type: str) -> dict:
    """llama.cpp's saved logits of each window (the peer's {kv_type}_w{i}.npy), scored as ours are."""
    per_window = [score_window(np.load(workdir / "llamacpp" / f"{kv_type}_w{i}.npy"), window, np.load(workdir / "reference" / f"w{i}.npy"))
                  for i, window in enumerate(windows)]
    return aggregate_scores(per_window, 0.0)


# ------------------------------------------------------------------------------------------ speed


def _timed_program(cfg, params, kv, paged_args: tuple[tuple, int], repeats: int) -> dict:
    """Compile the greedy paged forward for (arguments, num_pages) over a fresh pool, then the median of `repeats` calls."""
    args, num_pages = paged_args
    pool, impl = make_pool(cfg, params, num_pages, kv)
    kv_bytes_per_token = quant.resident_bytes(pool) / (num_pages * PAGE_SIZE)
    times, compile_s, _ = programs.time_forward(params, cfg, pool, args, impl=impl, output="greedy", repeats=repeats, warmup=2)
    return {"compile_s": compile_s, "median_s": statistics.median(times), "kv_bytes_per_token": kv_bytes_per_token}


def time_prefill(cfg, params, kv, ids: list[int], repeats: int) -> dict:
    timed = _timed_program(cfg, params, kv, programs.prefill_args(ids, PAGE_SIZE), repeats)
    flops = programs.forward_flops(cfg, len(ids), 1, len(ids) * (len(ids) + 1) // 2)
    return {"tokens": len(ids), **timed, "tokens_per_s": len(ids) / timed["median_s"], "flops_per_s": flops / timed["median_s"]}


def time_decode(cfg, params, kv, batch: int, context: int, token: int, repeats: int, weight_bytes: int) -> dict:
    """One token per row, every row at position context - 1 of its own pages (attends to `context` keys)."""
    timed = _timed_program(cfg, params, kv, programs.decode_args(batch, context, token, PAGE_SIZE), repeats)
    seconds = timed.pop("median_s")
    num_bytes = weight_bytes + batch * context * timed["kv_bytes_per_token"]  # weights once + the K/V read
    return {"batch": batch, "context": context, **timed, "median_step_s": seconds, "tokens_per_s": batch / seconds, "bytes": num_bytes}


# ------------------------------------------------------------------------------------------ one format (subprocess)


def _load_kwargs(name: str) -> dict:
    """load_model's keyword arguments for a format (group_size only where it has one)."""
    dtype, quantization, group_size = FORMATS[name]
    return {"dtype": dtype, "quantization": quantization, **({"group_size": group_size} if group_size else {})}


def measure_row(name: str, cfg, params, kv: str | None, plan: dict, workdir: pathlib.Path, weight_bytes: int) -> dict:
    """Correctness, accuracy and speed of one (format, KV cache) row."""
    label = f"{name} kv={kv or cfg.dtype}"
    tokens = greedy_tokens(cfg, params, kv, plan["greedy_prompts"], plan["greedy_tokens"])
    log(f"{label}: greedy tokens done")
    accuracy = perplexity(cfg, params, kv, plan["windows"], workdir / "reference", write_reference=(name == REFERENCE and kv is None))
    log(f"{label}: perplexity {accuracy['perplexity']:.4f} over {accuracy['num_predicted']} tokens ({accuracy['seconds']:.0f}s)"
        + (f"; W8A8 {accuracy['w8a8_perplexity']:.4f}" if "w8a8_perplexity" in accuracy else ""))
    repeats, ids = plan["repeats"], plan["prefill_ids"]
    speed = {"prefill": time_prefill(cfg, params, kv, ids, repeats),
             "decode": [time_decode(cfg, params, kv, b, plan["context"], ids[-1], repeats, weight_bytes) for b in plan["batch_sizes"]]}
    log(f"{label}: prefill {speed['prefill']['tokens_per_s']:.0f} tok/s, decode ms " + ", ".join(f"b{d['batch']} {d['median_step_s'] * 1e3:.1f}" for d in speed["decode"]))
    return {"status": "ok", "greedy_tokens": tokens, "accuracy": accuracy, "speed": speed, "kv_bytes_per_token": speed["prefill"]["kv_bytes_per_token"]}


def run_e2e(name: str, kv: str | None, plan: dict) -> dict:
    """The common engine run (page size 16, 32 sequences, packed prefill) on the workload, in this format."""
    extra = ({"kv_cache_dtype": kv} if kv else {}) | ({"matmul_impl": "cpu_int8"} if name in KERNEL_ROWS else {})
    engine_config = engine_runs.workload_engine_config(max_num_seqs=32, page_size=16, prefill_seq_buckets=(1,), **extra)
    workload = json.loads(pathlib.Path(plan["e2e_workload"]).read_text())
    with contextlib.redirect_stdout(sys.stderr):  # its progress lines; stdout carries the worker's JSON
        result, tokens, llm = engine_runs.run_engine(workload, engine_config, plan["e2e_repeats"], **_load_kwargs(name))
    del llm
    keep = ("load_s", "warmup_s", "num_compilations", "compiles_during_timed_run", "seconds", "seconds_per_repeat", "num_output_tokens",
            "output_tokens_per_s", "all_lengths_exact", "reference_check", "time_split")
    return {"status": "ok", **{k: result[k] for k in keep}, "tokens": tokens}


def run_worker(name: str, workdir: pathlib.Path) -> dict:
    """Everything measured for one weight format, in this process (so its peak RSS is the format's)."""
    plan = json.loads((workdir / "plan.json").read_text())
    result = {"format": name, "dtype": FORMATS[name][0], "quantization": FORMATS[name][1], "group_size": FORMATS[name][2],
              "peak_rss_reset_works": reset_peak_rss()}
    try:
        (cfg, params), load_s = timing.timed(loading.load_model, None, max_context=MAX_CONTEXT, **_load_kwargs(name))
    except ValueError as error:  # an int4 group that does not divide a width
        return result | {"status": "not available", "reason": str(error)}
    result |= {"status": "ok", "load_s": load_s, "memory": weight_memory(params), "peak_rss_bytes": {"load": peak_rss_bytes()}}
    if name in KERNEL_ROWS:  # the step reads the packed matrices (and gathers embedding rows from the loaded table)
        params = panels.pack_panels(params, quantized=True)
        result["memory"]["packed_resident_bytes"] = quant.resident_bytes(params)
    if name == "gguf":
        result["memory"]["file_tensor_bytes"] = gguf_tensor_bytes(loading.default_model_path())
    log(f"{name}: loaded in {result['load_s']:.1f}s, {result['memory']['resident_bytes'] / 2**20:.1f} MiB of weights")
    rows = {}
    for kv in plan["kv_cache_dtypes"] if name == REFERENCE or not plan["quick"] else [None]:  # --quick: KV variants on f32 only
        reset_peak_rss()
        weight_bytes = result["memory"].get("packed_resident_bytes", result["memory"]["resident_bytes"])
        rows[kv or "none"] = measure_row(name, cfg, params, kv, plan, workdir, weight_bytes)
        result["peak_rss_bytes"][f"row_kv_{kv or 'none'}"] = peak_rss_bytes()
    del params
    gc.collect()
    if plan["e2e_requests"]:
        for key, row in rows.items():
            if row["status"] != "ok":
                continue
            reset_peak_rss()
            row["e2e"] = run_e2e(name, None if key == "none" else key, plan)
            result["peak_rss_bytes"][f"e2e_kv_{key}"] = peak_rss_bytes()
            log(f"{name} kv={key}: end to end {row['e2e']['output_tokens_per_s']:.1f} output tokens/s")
    return result | {"rows": rows}


def run_worker_process(name: str, workdir: pathlib.Path) -> dict:
    """This script as `--worker name` in a fresh process; its last stdout line is its result."""
    command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", name, "--workdir", str(workdir)]
    completed = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)  # stderr: progress, passed through
    if completed.returncode != 0:
        return {"format": name, "status": "failed", "returncode": completed.returncode, "stdout_tail": completed.stdout[-2000:]}
    return peers.last_json(completed.stdout)


def run_llamacpp(args, workdir: pathlib.Path, plan: dict) -> dict:
    """experiments/peers/llamacpp_perplexity.py on the same windows, reference logits and prefill ids."""
    (workdir / "llamacpp").mkdir(exist_ok=True)
    try:
        raw = peers.run_peer("llamacpp_perplexity.py", "--windows", str(workdir / "windows.json"), "--logits-dir", str(workdir / "llamacpp"),
                               "--prefill-ids", str(workdir / "prefill_ids.json"), "--kv-types", args.llamacpp_kv_types,
                               "--batch-sizes", ",".join(map(str, plan["batch_sizes"])), "--context", str(plan["context"]), "--repeats", str(plan["repeats"]))
    except RuntimeError as error:
        return {"status": "failed", "error": str(error)}
    result = {"status": "ok", **raw}
    for kv_type, entry in result["kv_types"].items():
        entry["perplexity"] = score_llamacpp(plan["windows"], workdir, kv_type)
    return result


def run_llamacpp_e2e(plan: dict) -> dict:
    """bench_engine.py's llama.cpp peer (sequential and batched over 32 sequence ids) on the same workload."""
    raw, _ = peers.run_generate_peer("llamacpp_generate.py", plan["e2e_workload"], WORK_DIR / "llamacpp_generate_tokens.json",
                                       "--parallel", "32", "--repeats", str(plan["e2e_repeats"]))
    return {"status": "failed", "error": raw["error"][-3000:]} if "error" in raw else {"status": "ok", **raw}


# ------------------------------------------------------------------------------------------ the run and its subprocesses


def build_plan(args, workdir: pathlib.Path) -> dict:
    """Token ids every worker and peer uses, written once under workdir (plan.json and the peer's files)."""
    tokenizer = load_tokenizer(None)
    ids = tokenizer.encode(HELDOUT_TEXT.read_text(), add_bos=False)
    num_windows = len(ids) // WINDOW if not args.num_windows else min(args.num_windows, len(ids) // WINDOW)
    with np.load(paths.FIXTURES) as fixtures:
        prompts = [fixtures[f"p{i}_ids"].tolist() for i in GREEDY_PROMPTS]
        fixture_tokens = [fixtures[f"p{i}_greedy_ids"][: args.greedy_tokens].tolist() for i in GREEDY_PROMPTS]
    plan = {"heldout_text": str(HELDOUT_TEXT.relative_to(REPO_ROOT)), "heldout_tokens": len(ids), "window": WINDOW,
            "windows": [ids[i * WINDOW:(i + 1) * WINDOW] for i in range(num_windows)], "greedy_prompt_indices": list(GREEDY_PROMPTS),
            "greedy_prompts": prompts, "greedy_tokens": args.greedy_tokens, "fixture_greedy_tokens": fixture_tokens, "quick": args.quick,
            "prefill_ids": workloads.prefix_ids(tokenizer, args.prefill_tokens),
            "batch_sizes": args.batch_sizes, "context": args.context, "repeats": args.repeats, "page_size": PAGE_SIZE,
            "kv_cache_dtypes": [None if k == "none" else k for k in args.kv_cache_dtypes], "e2e_requests": args.e2e_requests,
            "e2e_scale": args.e2e_scale, "e2e_repeats": args.e2e_repeats, "e2e_workload": None}
    if args.e2e_requests:
        workload = workloads.build_workload(args.trace, args.e2e_requests, args.e2e_scale, 0, tokenizer, max_context=MAX_CONTEXT)
        plan["e2e_workload"] = str(workdir / "workload.json")
        pathlib.Path(plan["e2e_workload"]).write_text(json.dumps(workload))
        plan["e2e_summary"] = workloads.workload_summary(workload["requests"])
    (workdir / "reference").mkdir(parents=True, exist_ok=True)
    for stale in (workdir / "reference").glob("w*.npy"):
        stale.unlink()
    (workdir / "windows.json").write_text(json.dumps(plan["windows"]))
    (workdir / "prefill_ids.json").write_text(json.dumps(plan["prefill_ids"]))
    (workdir / "plan.json").write_text(json.dumps(plan))
    return plan


def _row_name(fmt: str, kv: str) -> str:
    return fmt if kv == "none" else f"{fmt}+kv_{kv}"


def summarize_row(fmt: str, kv: str, worker: dict, base: dict, base_bytes: int, bandwidth: float, peak: float) -> dict:
    """One row's figures, with ratios against the f32 row (`base`, model-dtype KV)."""
    row = worker["rows"][kv]
    if row["status"] != "ok":
        return {"row": _row_name(fmt, kv), "status": row["status"], "reason": row.get("reason")}
    accuracy, speed = row["accuracy"], row["speed"]
    base_decode = {d["batch"]: d["median_step_s"] for d in base["speed"]["decode"]}
    summary = {
        "row": _row_name(fmt, kv), "status": "ok", "weight_bytes": worker["memory"]["resident_bytes"],
        "weight_bytes_vs_f32": worker["memory"]["resident_bytes"] / base_bytes, "kv_bytes_per_token": row["kv_bytes_per_token"],
        "peak_rss_bytes": max(worker["peak_rss_bytes"]["load"], worker["peak_rss_bytes"][f"row_kv_{kv}"]),
        "perplexity": accuracy["perplexity"], "perplexity_change_vs_f32": accuracy["perplexity"] / base["accuracy"]["perplexity"] - 1,
        "mean_kl_vs_f32": accuracy.get("mean_kl_vs_f32", 0.0), "argmax_agreement_vs_f32": accuracy.get("argmax_agreement_vs_f32", 1.0),
        "max_logits_relative_error_vs_f32": accuracy.get("max_logits_relative_error_vs_f32", 0.0),
        "greedy_agreement_vs_f32": workloads.agreement(base["greedy_tokens"], row["greedy_tokens"]),
        "prefill_tokens_per_s": speed["prefill"]["tokens_per_s"], "prefill_fraction_of_peak": speed["prefill"]["flops_per_s"] / peak,
        "decode_ms": {d["batch"]: d["median_step_s"] * 1e3 for d in speed["decode"]},
        "decode_speedup_vs_f32": {d["batch"]: base_decode[d["batch"]] / d["median_step_s"] for d in speed["decode"]},
        "decode_mbu": {d["batch"]: d["bytes"] / d["median_step_s"] / bandwidth for d in speed["decode"]},
    }
    summary["perplexity_of_the_forward_logits"] = accuracy["perplexity_of_the_forward_logits"]
    if "w8a8_perplexity" in accuracy:
        summary["w8a8_perplexity"] = accuracy["w8a8_perplexity"]
        summary["w8a8_perplexity_change_vs_f32"] = accuracy["w8a8_perplexity"] / base["accuracy"]["perplexity"] - 1
    if "e2e" in row:
        summary["e2e_output_tokens_per_s"] = row["e2e"]["output_tokens_per_s"]
        if "e2e" in base:
            summary["e2e_tokens_vs_f32"] = workloads.agreement(base["e2e"]["tokens"], row["e2e"]["tokens"])
    return summary


def summarize(plan: dict, workers: dict, peaks: dict) -> list[dict]:
    base_worker = workers[REFERENCE]
    base, base_bytes = base_worker["rows"]["none"], base_worker["memory"]["resident_bytes"]
    bandwidth, peak = peaks["bandwidth"]["best_bytes_per_s"], peaks["matmul"]["best_flops_per_s"]
    rows = []
    for fmt, worker in workers.items():
        if worker["status"] != "ok":
            rows.append({"row": fmt, "status": worker["status"], "reason": worker.get("reason") or worker.get("stdout_tail")})
            continue
        rows += [summarize_row(fmt, kv, worker, base, base_bytes, bandwidth, peak) for kv in worker["rows"]]
    return rows


def goals(rows: list[dict], workers: dict) -> dict:
    by_name = {r["row"]: r for r in rows if r["status"] == "ok"}
    field = lambda row, key: by_name[row][key] if row in by_name else None  # noqa: E731
    gguf_memory = (workers.get("gguf") or {}).get("memory") or {}
    b32 = [(r["decode_speedup_vs_f32"][32], r["row"]) for r in by_name.values() if 32 in r["decode_speedup_vs_f32"] and r["row"] != REFERENCE]
    slowest = min(b32) if b32 else None
    measured = {name: field(row, "perplexity_change_vs_f32") for name, row in (
        ("int8_ppl", "int8"), ("int4_g32_ppl", "int4_g32"), ("gguf_ppl_identical", "gguf"), ("int8_kv_ppl", f"{REFERENCE}+kv_int8"))}
    measured |= {
        "int8_weight_bytes": field("int8", "weight_bytes_vs_f32"),
        "gguf_weight_bytes": gguf_memory["resident_bytes"] / gguf_memory["file_tensor_bytes"] if gguf_memory else None,
        "int8_decode_b1": (by_name.get("int8") or {}).get("decode_speedup_vs_f32", {}).get(1), "none_slower_b32": slowest[0] if slowest else None,
        "kernel_w8a8_ppl": field("int8_cpu_int8", "perplexity_change_vs_f32"),
    }
    b1 = {row: (by_name.get(row) or {}).get("decode_speedup_vs_f32", {}).get(1) for row in ("int8_cpu_int8", "bf16")}
    measured["kernel_int8_decode_b1_vs_bf16"] = b1["int8_cpu_int8"] / b1["bf16"] if None not in b1.values() else None
    result = report.judge(GOALS, measured)
    if slowest:
        result["none_slower_b32"] |= {"slowest_row": slowest[1], "rows_slower_than_f32": sorted(name for speedup, name in b32 if speedup < 1.0)}
    return result


def correctness(plan: dict, workers: dict, rows: list[dict]) -> dict:
    """f32 greedy tokens == HF's fixture tokens (required); gguf logits == f32's within tolerance (required)."""
    base = workers[REFERENCE]["rows"]["none"]
    fixture_equal = [a == b for a, b in zip(base["greedy_tokens"], plan["fixture_greedy_tokens"])]
    gguf = next((r for r in rows if r["row"] == "gguf" and r["status"] == "ok"), None)
    gguf_error = gguf["max_logits_relative_error_vs_f32"] if gguf else None
    passed = all(fixture_equal) and (gguf_error is None or gguf_error <= GGUF_LOGITS_TOLERANCE)
    return {"f32_greedy_equals_hf_fixture": fixture_equal, "gguf_max_logits_relative_error_vs_f32": gguf_error,
            "gguf_logits_tolerance": GGUF_LOGITS_TOLERANCE, "passed": passed,
            "greedy_agreement_vs_f32": {r["row"]: r["greedy_agreement_vs_f32"] for r in rows if r["status"] == "ok"}}


# ------------------------------------------------------------------------------------------ report


def print_accuracy_table(rows: list[dict], llamacpp: dict | None) -> None:
    columns = [("row", "<18"), ("weights MiB", "11.1f"), ("x f32", "6.3f"), ("KV B/tok", "9.0f"), ("peak RSS MiB", "12.1f"), ("perplexity", "10.4f"),
               ("change", "+8.3%"), ("KL nats", "9.2e"), ("argmax", "7.1%"), ("greedy", "7.0%"), ("prefix", "7.0%")]
    table = []
    for r in rows:
        agree = r.get("greedy_agreement_vs_f32") or {}
        table.append([r["row"], f"{r['status']}: {(r.get('reason') or '')[:110]}"] if r["status"] != "ok" else [
            r["row"], r["weight_bytes"] / 2**20, r["weight_bytes_vs_f32"], r["kv_bytes_per_token"], r["peak_rss_bytes"] / 2**20, r["perplexity"],
            r["perplexity_change_vs_f32"], r["mean_kl_vs_f32"], r["argmax_agreement_vs_f32"], agree["exact_requests"], agree["mean_prefix_fraction"]])
    base = next(r["perplexity"] for r in rows if r["row"] == REFERENCE)
    for kv, entry in ((llamacpp or {}).get("kv_types") or {}).items():
        ppl = entry["perplexity"]
        table.append(["llama.cpp kv " + kv, "", "", "", "", ppl["perplexity"], ppl["perplexity"] / base - 1, ppl["mean_kl_vs_f32"], ppl["argmax_agreement_vs_f32"]])
    print("\n" + report.format_table(columns, table))
    print("change: perplexity vs f32; KL: mean KL(p_f32 || p_row) per predicted token; argmax: positions whose top token is f32's;\n"
          "greedy / prefix: greedy generations identical to f32's / mean share of tokens before the first difference.")


def print_speed_table(rows: list[dict], llamacpp: dict | None, llamacpp_e2e: dict | None, batch_sizes: list[int]) -> None:
    columns = [("row", "<18"), ("prefill t/s", "11.0f"), ("%peak", "6.1%"), *((f"b{b} ms", "9.1f") for b in batch_sizes),
               *((f"x b{b}", "6.2f") for b in batch_sizes), ("MBU b1", "7.1%"), ("e2e t/s", "8.1f")]
    table = [[r["row"], r["prefill_tokens_per_s"], r["prefill_fraction_of_peak"], *(r["decode_ms"].get(b) for b in batch_sizes),
              *(r["decode_speedup_vs_f32"].get(b) for b in batch_sizes), r["decode_mbu"].get(1), r.get("e2e_output_tokens_per_s")] for r in rows if r["status"] == "ok"]
    for kv, entry in ((llamacpp or {}).get("kv_types") or {}).items():
        steps = {d["batch"]: d["median_step_s"] * 1e3 for d in entry["decode"]}
        table.append(["llama.cpp kv " + kv, entry["prefill"]["tokens_per_s"], "", *(steps.get(b) for b in batch_sizes)])
    print("\n" + report.format_table(columns, table))
    for mode, entry in ((llamacpp_e2e or {}).get("modes") or {}).items():
        print(f"{'llama.cpp e2e ' + mode:<32} output tokens/s {entry['output_tokens_per_s']:.1f}")
    print("x bN: f32's step time / the row's (>1: faster than f32). MBU: (resident weight bytes + K/V read) / step time / read bandwidth.")


def print_report(result: dict) -> None:
    peaks = result["machine"]["peaks"]
    print(f"\nmatmul peak {peaks['matmul']['best_flops_per_s'] / 1e9:.1f} GFLOP/s, read bandwidth {peaks['bandwidth']['best_bytes_per_s'] / 1e9:.1f} GB/s "
          f"(balance {peaks['flops_per_byte']:.1f} FLOP/byte); load average {result['machine']['load_average_start']} -> {result['machine']['load_average_end']}")
    print(f"held-out text: {result['settings']['heldout_tokens']} tokens, {result['settings']['num_windows']} windows of {WINDOW} "
          f"({result['settings']['num_predicted']} predicted tokens); correctness passed: {result['correctness']['passed']}")
    print_accuracy_table(result["rows"], result.get("llamacpp"))
    print_speed_table(result["rows"], result.get("llamacpp"), result.get("llamacpp_e2e"), result["settings"]["batch_sizes"])
    report.print_goals(result["goals"])
    if slowest := result["goals"]["none_slower_b32"].get("slowest_row"):
        print(f"  slowest row at batch-32 decode: {slowest}")


# ------------------------------------------------------------------------------------------ main


def parse_args():
    parser = report.arg_parser(__doc__, trace=True)
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {','.join(QUICK_FORMATS)} (KV variants on {REFERENCE} only), 1 window, "
                        "8 greedy tokens, batches 1,8, 1 repeat, llama.cpp f16 KV only, no e2e")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma list of {', '.join(FORMATS)} ({REFERENCE} is always run, first)")
    parser.add_argument("--kv-cache-dtypes", default="none,int8", help="KV pools per format: none (the model's dtype, always run), int8, fp8_e4m3")
    parser.add_argument("--num-windows", type=int, default=0, help="perplexity windows (0: every full window of the text)")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--context", type=int, default=512, help="keys each decode row attends to")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--greedy-tokens", type=int, default=GREEDY_TOKENS, help=f"greedy tokens per prompt in the correctness check (<= {GREEDY_TOKENS})")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per program (median reported)")
    parser.add_argument("--e2e-requests", type=int, default=64, help="bench_engine workload requests per row (0: skip the end-to-end runs)")
    parser.add_argument("--e2e-scale", type=float, default=8.0)
    parser.add_argument("--e2e-repeats", type=int, default=1)
    parser.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp peers")
    parser.add_argument("--llamacpp-kv-types", default="f16,q8_0")
    parser.add_argument("--workdir", type=pathlib.Path, default=WORK_DIR)
    parser.add_argument("--out", type=pathlib.Path, help=f"default: {RESULTS.relative_to(REPO_ROOT)} (--quick: build/bench_quant/bench_quant_quick.json)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: measure one format in this process
    args = parser.parse_args()
    if args.quick:
        args.num_windows, args.batch_sizes, args.repeats, args.e2e_requests = args.num_windows or 1, "1,8", 1, 0
        args.greedy_tokens, args.llamacpp_kv_types = 8, "f16"
        if "--formats" not in sys.argv:
            args.formats = ",".join(QUICK_FORMATS)
    args.out = args.out or (WORK_DIR / "bench_quant_quick.json" if args.quick else RESULTS)
    args.formats = [REFERENCE] + [f for f in report.comma_list(parser, args.formats, FORMATS, "formats") if f != REFERENCE]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.kv_cache_dtypes = ["none"] + [k for k in args.kv_cache_dtypes.split(",") if k and k != "none"]  # the model-dtype row is the baseline
    return args


def run_all(args) -> dict:
    start = time.perf_counter()
    args.workdir.mkdir(parents=True, exist_ok=True)
    machine_block = {"load_average_start": timing.load_average()}  # the rest of the block is report.write_result's
    plan = build_plan(args, args.workdir)
    log(f"plan: {len(plan['windows'])} windows, formats {args.formats}, KV {args.kv_cache_dtypes}, e2e requests {args.e2e_requests}")
    peaks = machine.measure_peaks(2 * args.repeats)
    workers = {}
    for name in args.formats:
        log(f"worker {name} ...")
        workers[name] = run_worker_process(name, args.workdir)
    if workers[REFERENCE]["status"] != "ok":
        raise SystemExit(f"the {REFERENCE} worker failed: {workers[REFERENCE]}")
    use_llamacpp = not args.no_llamacpp and paths.REF_PYTHON.exists()
    llamacpp = run_llamacpp(args, args.workdir, plan) if use_llamacpp else None
    llamacpp_e2e = run_llamacpp_e2e(plan) if use_llamacpp and args.e2e_requests else None
    rows = summarize(plan, workers, peaks)
    machine_block |= {"load_average_end": timing.load_average(), "peaks": peaks}
    settings = {k: v for k, v in plan.items() if k not in ("windows", "greedy_prompts", "fixture_greedy_tokens", "prefill_ids")}
    settings |= {"formats": args.formats, "num_windows": len(plan["windows"]), "num_predicted": len(plan["windows"]) * (WINDOW - 1), "quick": args.quick}
    return {"question": "accuracy, memory and speed of quantized weights and an int8 KV cache vs f32, and vs llama.cpp on the same GGUF",
            "model": loading.default_model_path().name, "machine": machine_block, "settings": settings,
            "correctness": correctness(plan, workers, rows), "rows": rows, "goals": goals(rows, workers), "llamacpp": llamacpp,
            "llamacpp_e2e": llamacpp_e2e, "workers": workers, "runtime_s": time.perf_counter() - start}


def main() -> None:
    args = parse_args()
    if args.worker:
        result = run_worker(args.worker, args.workdir)
        print(json.dumps(result))
        return
    result = run_all(args)
    print_report(result)
    report.finish(args.out, result, {"bench": "quant", "correct": result["correctness"]["passed"],
                                      "perplexity": {r["row"]: r["perplexity"] for r in result["rows"] if r["status"] == "ok"},
                                      "goals": {k: g["measured"] for k, g in result["goals"].items()}, "runtime_s": result["runtime_s"]},
                   correct=result["correctness"]["passed"], indent=1)


if __name__ == "__main__":
    main()
