"""The experiments' shared harness: every script imports it, and no script imports another.

It owns the trace -> workload scaler, greedy params and token agreement; timers, machine peaks and peak
RSS; the one jitted paged (or dense, or cache-free) forward and its page tables; the engine config and
timed LLM run over a workload, with its reference check; the run loop's StepRecorder; peer subprocesses;
and reporting: common options, a table printer, and the "machine" block of every result JSON (commit,
CPU model and flags, device, peaks) that write_result attaches. Importing it needs only the stdlib and
numpy (device_check.py on the GPU box stays light): jax and jaxinfer are imported where they are used.
"""

import argparse
import collections
import dataclasses
import functools
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time

import numpy as np

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO_ROOT / "../shared/data/azure_llm_trace_2023_conv.csv"
TEXT_FILE = REPO_ROOT / "experiments" / "data" / "passages.txt"
RESULTS_DIR = REPO_ROOT / "experiments" / "results"
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "smollm2_reference.npz"
REF_PYTHON = REPO_ROOT / ".venv-ref" / "bin" / "python"
PEERS_DIR = REPO_ROOT / "experiments" / "peers"
MATMUL_SIZE = 2048  # the matmul peak is an f32 [n, n] @ [n, n] matmul
BANDWIDTH_BYTES = 512 * 2**20  # the read-bandwidth probe sums an f32 array of this size


# ------------------------------------------------------------------------------------------ workloads


def text_ids(tokenizer, path: pathlib.Path = TEXT_FILE) -> list[int]:
    """The real-text passages as token ids (no BOS)."""
    return tokenizer.encode(path.read_text(), add_bos=False)


def prefix_ids(tokenizer, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens of the passages (repeated if the file is shorter)."""
    ids = text_ids(tokenizer)
    return (ids * -(-num_tokens // len(ids)))[:num_tokens]


def sample_rows(num_rows: int, num_requests: int, rng: np.random.Generator) -> np.ndarray:
    """`num_requests` distinct rows of a trace, drawn from `rng` and kept in arrival order."""
    return np.sort(rng.choice(num_rows, size=num_requests, replace=False))


def scaled_requests(trace, scale: float, rng: np.random.Generator, text: list[int], *, max_context: int,
                    max_output: int | None = None) -> list[dict]:
    """{"prompt_ids", "max_tokens"} per request of `trace`, lengths / `scale` (at least 1), the output capped at
    `max_output`, the prompt at max_context - output and cut from `text` at an offset drawn from `rng`."""
    requests = []
    for context, generated in zip(trace.context_tokens.tolist(), trace.generated_tokens.tolist()):
        max_tokens = max(1, round(generated / scale))
        max_tokens = max_tokens if max_output is None else min(max_tokens, max_output)
        num_prompt = min(max(1, round(context / scale)), max_context - max_tokens)
        offset = int(rng.integers(len(text)))
        requests.append({"prompt_ids": [text[(offset + i) % len(text)] for i in range(num_prompt)], "max_tokens": max_tokens})
    return requests


def build_workload(trace_path: pathlib.Path, num_requests: int, scale: float, seed: int, tokenizer=None, *,
                   max_context: int = 2048, max_output: int | None = None) -> dict:
    """A seeded sample of the trace's requests (arrival order) scaled by scaled_requests (text from
    `tokenizer`, default SmolLM2's); the seed's one generator draws the rows first, then the offsets."""
    from jaxinfer import load_trace
    from jaxinfer.loading.tokenizer import load_tokenizer

    trace, tokenizer = load_trace(trace_path), tokenizer or load_tokenizer(None)
    rng = np.random.default_rng(seed)
    rows = sample_rows(trace.num_requests, num_requests, rng)
    scaled = scaled_requests(trace.take(rows), scale, rng, text_ids(tokenizer), max_context=max_context, max_output=max_output)
    requests = [{"trace_row": int(row), "trace_context_tokens": int(trace.context_tokens[row]),
                 "trace_generated_tokens": int(trace.generated_tokens[row]), **request} for row, request in zip(rows, scaled)]
    return {"trace": os.path.basename(trace_path), "seed": seed, "scale": scale, "text": TEXT_FILE.name, "requests": requests}


def workload_summary(requests: list[dict]) -> dict:
    """Request count, token totals, and the largest and median prompt and output."""
    prompts, outputs = np.array([len(r["prompt_ids"]) for r in requests]), np.array([r["max_tokens"] for r in requests])
    return {"num_requests": len(prompts), "prompt_tokens": int(prompts.sum()), "output_tokens": int(outputs.sum()),
            "max_prompt": int(prompts.max()), "median_prompt": float(np.median(prompts)),
            "max_output": int(outputs.max()), "median_output": float(np.median(outputs))}


def greedy(max_tokens: int):
    """Greedy sampling of exactly `max_tokens` tokens (EOS ignored)."""
    from jaxinfer import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generate(llm, requests: list[dict], **kwargs) -> list:
    """llm.generate of {"prompt_ids", "max_tokens"} requests, greedy, with no progress bar."""
    return llm.generate([r["prompt_ids"] for r in requests], [greedy(r["max_tokens"]) for r in requests], progress=False, **kwargs)


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Exact-match share of requests, and the mean share of each request's tokens before the first difference."""
    prefix = []
    for a, b in zip(ours, theirs):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(same / max(len(a), 1))
    return {"exact_requests": float(np.mean([a == b for a, b in zip(ours, theirs)])), "mean_prefix_fraction": float(np.mean(prefix))}


def relative_error(actual, expected) -> float:
    """||actual - expected|| / ||expected||, in float64."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


# ------------------------------------------------------------------------------------------ timing and memory


def timed(fn, *args, **kwargs) -> tuple:
    """(fn(*args, **kwargs), its wall seconds)."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def time_calls(fn, repeats: int, warmup: int = 1) -> list[float]:
    """Wall seconds of each of `repeats` calls of fn() (which blocks), after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    return [timed(fn)[1] for _ in range(repeats)]


def time_donating(program, state, *args, repeats: int, warmup: int = 2) -> tuple[list[float], object]:
    """Seconds of each of `repeats` calls of program(state, *args) -> (out, state) after `warmup` untimed
    ones, the donated state rebound after every call; and the last call's output."""
    holder = {"state": state}

    def run():
        out, holder["state"] = program(holder["state"], *args)
        holder["out"] = out.block_until_ready()

    return time_calls(run, repeats, warmup), holder["out"]


def compile_timed(jitted, *args, **kwargs):
    """(jitted lowered and compiled for these arguments, the seconds that took)."""
    return timed(lambda: jitted.lower(*args, **kwargs).compile())


def measure_matmul_peak(repeats: int) -> dict:
    """f32 matmul FLOP/s of this machine: best and median of `repeats` timed runs after 2 untimed."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (MATMUL_SIZE, MATMUL_SIZE), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (MATMUL_SIZE, MATMUL_SIZE), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    times = time_calls(lambda: matmul(a, b).block_until_ready(), repeats, warmup=2)
    flops = 2 * MATMUL_SIZE**3
    return {"size": MATMUL_SIZE, "best_flops_per_s": flops / min(times), "median_flops_per_s": flops / statistics.median(times)}


def measure_bandwidth_peak(repeats: int, num_bytes: int = BANDWIDTH_BYTES, warmup: int = 2) -> dict:
    """Read bandwidth: bytes/s of the faster of two full reads of an f32 array of `num_bytes`, a jitted
    sum and numpy sums of one slice per usable core on threads (numpy drops the GIL): XLA:CPU's reduction
    alone left a kernel's decode step reading at 111% of it (bench_1b, Q8_0, 2026-12-04)."""
    import concurrent.futures

    import jax
    import jax.numpy as jnp

    x = jnp.ones((num_bytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    probes = {"xla_sum": time_calls(lambda: total(x).block_until_ready(), repeats, warmup=warmup)}
    host = np.ones((num_bytes // 4,), np.float32)
    slices = np.array_split(host, len(os.sched_getaffinity(0)))
    with concurrent.futures.ThreadPoolExecutor(len(slices)) as pool:
        probes["numpy_threads"] = time_calls(lambda: list(pool.map(np.sum, slices)), repeats, warmup=warmup)
    best = min(probes, key=lambda name: min(probes[name]))
    return {"bytes": num_bytes, "probe": best, "best_bytes_per_s": num_bytes / min(probes[best]),
            "median_bytes_per_s": num_bytes / statistics.median(probes[best]),
            "best_bytes_per_s_by_probe": {name: num_bytes / min(times) for name, times in probes.items()}}


def measure_peaks(repeats: int) -> dict:
    """The matmul and read-bandwidth peaks, and their balance (FLOP per byte)."""
    peaks = {"matmul": measure_matmul_peak(repeats), "bandwidth": measure_bandwidth_peak(repeats)}
    return peaks | {"flops_per_byte": peaks["matmul"]["best_flops_per_s"] / peaks["bandwidth"]["best_bytes_per_s"]}


def load_average() -> list[float]:
    """The 1/5/15-minute load averages (a shared machine: well above the core count inflates timings)."""
    return [round(x, 2) for x in os.getloadavg()]


def rss_bytes() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes; VmHWM is the high-water mark since the last reset_peak_rss()."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS:", "VmHWM:")):
                fields[line.split(":")[0]] = int(line.split()[1]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def peak_rss_bytes() -> int:
    return rss_bytes()[1]


def reset_peak_rss() -> bool:
    """Start a new VmHWM at the current RSS (Linux >= 4.0: writing 5 to clear_refs); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------------ paged forward programs


def pad_rows(prompts: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int32 [B, width], right-padded with 0; lengths int32 [B])."""
    tokens = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    return tokens, np.array([len(p) for p in prompts], np.int32)


def row_tables(num_rows: int, pages_per_row: int) -> np.ndarray:
    """Distinct pages 1.. for each row (page 0 is the null page): int32 [num_rows, pages_per_row]."""
    return (1 + np.arange(num_rows * pages_per_row, dtype=np.int32)).reshape(num_rows, pages_per_row)


def page_meta(block_tables: np.ndarray, positions: np.ndarray, page_size: int, valid: np.ndarray | None = None):
    """kv_pool.PageMeta for one sequence per row: tokens at `positions` [B, T] go to their slots of the
    rows' `block_tables` [B, W]; tokens not `valid` (padding) write to the null page 0."""
    import jax.numpy as jnp

    from jaxinfer.model import kv_pool

    pages = np.take_along_axis(block_tables, positions // page_size, axis=1)
    if valid is not None:
        pages = np.where(valid, pages, 0)
    return kv_pool.PageMeta(jnp.asarray(block_tables, jnp.int32), jnp.asarray(pages, jnp.int32), jnp.asarray(positions % page_size, jnp.int32))


def prefill_args(ids: list[int], page_size: int) -> tuple[tuple, int]:
    """forward_program's (tokens, positions, pages, last) for one sequence of `ids` on its own pages,
    and the pool's page count (the null page included)."""
    pages, positions = -(-len(ids) // page_size), np.arange(len(ids), dtype=np.int32)[None]
    meta = page_meta(row_tables(1, pages), positions, page_size)
    return (np.asarray([ids], np.int32), positions, meta, np.array([len(ids) - 1], np.int32)), pages + 1


def decode_args(batch: int, context: int, token: int, page_size: int) -> tuple[tuple, int]:
    """forward_program's arguments for one `token` per row, every row at position context - 1 of its own
    pages (so it attends to `context` keys), and the pool's page count."""
    pages, positions = -(-context // page_size), np.full((batch, 1), context - 1, np.int32)
    meta = page_meta(row_tables(batch, pages), positions, page_size)
    return (np.full((batch, 1), token, np.int32), positions, meta, np.zeros(batch, np.int32)), batch * pages + 1


def _forward(params, pool, tokens, positions, pages, last, *, cfg, impl: str, output: str):
    """model.forward of [B, T] tokens into `pool` (a paged KVPool with `pages`, a dense cache, or None) ->
    (output, pool). output "greedy": the argmax at index last[b] [B]; "last_logits": the logits there
    [B, V]; "logits": every position's [B, T, V] (last is None)."""
    from jaxinfer.model import forward as model, sampling

    logits, pool = model.forward(params, pool, tokens, positions, cfg=cfg, pages=pages, logit_indices=last, attention_impl=impl)
    if output == "logits":
        return logits, pool
    return (sampling.argmax(logits[:, 0]) if output == "greedy" else logits[:, 0]), pool  # the engine's greedy argmax


@functools.cache
def forward_program():
    """The jitted _forward (cfg, impl and output static; donates `pool`), built on first use."""
    import jax

    return jax.jit(_forward, static_argnames=("cfg", "impl", "output"), donate_argnames=("pool",))


def time_forward(params, cfg, pool, args: tuple, *, impl: str, output: str, repeats: int, warmup: int) -> tuple:
    """forward_program compiled for (params, pool, *args), then `repeats` timed calls after `warmup`, the
    donated pool rebound each call. Returns (seconds per call, compile seconds, the last call's output)."""
    program, compile_s = compile_timed(forward_program(), params, pool, *args, cfg=cfg, impl=impl, output=output)
    times, out = time_donating(lambda pool, *rest: program(params, pool, *rest), pool, *args, repeats=repeats, warmup=warmup)
    return times, compile_s, out


def engine_params(params, impl: str):
    """The params as the engine holds them for `impl`: packed into panels for the CPU kernels."""
    from jaxinfer.model import attention, panels

    return panels.pack_panels(params) if impl == attention.CPU_IMPL else params


def matmul_params(cfg) -> int:
    """Weights that take part in a matmul per token, excluding the LM head (embedding lookups are free)."""
    d, k = cfg.embed_dim, cfg.head_dim
    per_layer = d * k * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * d * cfg.ffn_dim
    return cfg.num_layers * per_layer


def forward_flops(cfg, num_tokens: int, num_logit_rows: int, num_keys_attended: int) -> int:
    """Useful FLOPs of a forward: layer matmuls, the LM head for rows with logits, and attention
    (QK^T and PV: 4 * K per query head per key, over `num_keys_attended` (query, key) pairs per layer)."""
    lm_head = 2 * cfg.vocab_size * cfg.embed_dim * num_logit_rows
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * num_keys_attended
    return 2 * matmul_params(cfg) * num_tokens + lm_head + attention


def file_tensor_shapes(cfg, fmt: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape in a "hf" or "gguf" file of the weights `cfg` has (jaxinfer.model.params.WEIGHTS):
    [out, in] for matmul weights, flat vectors otherwise."""
    from jaxinfer.model import params

    sizes = params.axis_sizes(cfg)
    size = lambda axes: math.prod(sizes[a] for a in axes)  # noqa: E731
    shapes = {}
    for spec in params.present(cfg):
        shape = (size(spec.out_axes), size(spec.in_axes)) if spec.num_in else (math.prod(spec.layer_shape(cfg)),)
        shapes |= dict.fromkeys(spec.file_names(cfg, fmt), shape)
    return shapes


# Hugging Face configs of the random-weight geometries (shapes of Llama 3.2 1B and Qwen2.5 0.5B).
GEOMETRIES = {
    "llama3-1b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "hidden_act": "silu", "architectures": ["LlamaForCausalLM"],
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    },
    "qwen2.5-0.5b": {
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "hidden_act": "silu", "use_sliding_window": False, "architectures": ["Qwen2ForCausalLM"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
}


_CONTROL_TOKEN = 3  # llama.cpp's token type for the padding tokens a copied vocabulary may need


def _copy_tokenizer(writer, reader, vocab_size: int) -> None:
    """The source GGUF's tokenizer.* metadata, its token list padded with CONTROL tokens to vocab_size."""
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = value + [f"<|bench_pad_{i}|>" for i in range(vocab_size - len(value))]
        elif key == "tokenizer.ggml.token_type":
            value = value + [_CONTROL_TOKEN] * (vocab_size - len(value))
        writer.add_key_value(key, value, field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)


def write_random_gguf(path: pathlib.Path, hf_config: dict, qtype: str, tokenizer_reader, *, max_context: int, seed: int = 0) -> None:
    """A GEOMETRIES model as a llama GGUF, one tensor at a time: matrices ~ N(0, 0.02) quantized by
    gguf.quants.quantize to `qtype` ("Q4_0", "Q8_0", ...), norms 1, the rope base without its llama3
    scaling (no weight byte depends on it), the tokenizer of `tokenizer_reader` (a GGUFReader)."""
    import gguf
    from jaxinfer.config import from_hf_config

    cfg, kind = from_hf_config(hf_config), gguf.GGMLQuantizationType[qtype]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"random {qtype} ({path.name})")
    for add, value in ((writer.add_block_count, cfg.num_layers), (writer.add_context_length, max_context), (writer.add_embedding_length, cfg.embed_dim),
                       (writer.add_feed_forward_length, cfg.ffn_dim), (writer.add_head_count, cfg.num_heads), (writer.add_head_count_kv, cfg.num_kv_heads),
                       (writer.add_layer_norm_rms_eps, cfg.rms_norm_eps), (writer.add_rope_freq_base, cfg.rope_theta), (writer.add_vocab_size, cfg.vocab_size)):
        add(value)
    _copy_tokenizer(writer, tokenizer_reader, cfg.vocab_size)
    shapes = file_tensor_shapes(cfg, "gguf")
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    for name, shape in shapes.items():
        if len(shape) == 1:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
        else:
            byte_shape = (shape[0], shape[1] // block * block_bytes)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape in shapes.items():
        weights = np.ones(shape, np.float32) if len(shape) == 1 else gguf.quants.quantize(rng.standard_normal(shape, np.float32) * 0.02, kind)
        writer.write_tensor_data(weights)
    writer.close()


# ------------------------------------------------------------------------------------------ the run loop's step hook


class StepRecorder:
    """The run loop's `on_step(plan, tokens, seconds)` hook: step seconds by bucket key, each decode step's
    KV use, padded page-table entries, and (given the block pool) the most pages held at once."""

    def __init__(self, page_size: int, block_pool=None):
        self.page_size, self.block_pool = page_size, block_pool
        self.seconds: dict[tuple, list[float]] = collections.defaultdict(list)
        self.decode_kv: list[tuple[int, int]] = []  # (tokens in the pool, slots of their pages) per decode step
        self.table_entries = self.real_entries = self.peak_pages = 0

    def __call__(self, plan, tokens, seconds: float) -> None:
        self.seconds[plan.bucket].append(seconds)
        rows = len(plan.request_ids)  # real rows come first; pages of a row are its non-null entries
        self.table_entries += plan.block_tables.size
        self.real_entries += int(np.count_nonzero(plan.block_tables))  # page 0 is the null page: padding
        if plan.phase == "decode":
            num_tokens = int((plan.positions[:rows, 0] + 1).sum())
            self.decode_kv.append((num_tokens, int(np.count_nonzero(plan.block_tables[:rows])) * self.page_size))
        if self.block_pool is not None:
            self.peak_pages = max(self.peak_pages, self.block_pool.num_used)

    def phase_seconds(self, phase: str) -> list[float]:
        return [t for key, ts in self.seconds.items() if key[0] == phase for t in ts]

    def table_padding(self) -> float:
        return 1.0 - self.real_entries / max(self.table_entries, 1)

    def kv_utilization(self) -> dict:
        """Decoding sequences' tokens / slots of their pages: mean over decode steps, and over all of them."""
        if not self.decode_kv:
            return {}
        return {"mean_over_decode_steps": float(np.mean([t / s for t, s in self.decode_kv])),
                "all_decode_steps": sum(t for t, _ in self.decode_kv) / sum(s for _, s in self.decode_kv)}

    def summary(self, total_seconds: float) -> dict:
        """Steps and seconds per phase, host time (the rest of `total_seconds`), and per bucket key."""
        in_steps = sum(sum(ts) for ts in self.seconds.values())
        prefill, decode = self.phase_seconds("prefill"), self.phase_seconds("decode")
        return {
            "prefill_steps": len(prefill), "prefill_s": sum(prefill), "decode_steps": len(decode), "decode_s": sum(decode),
            "host_s": total_seconds - in_steps,
            "by_bucket": {"/".join(map(str, key)): {"steps": len(ts), "median_ms": 1e3 * float(np.median(ts)), "total_s": sum(ts)}
                          for key, ts in sorted(self.seconds.items())},
        }


# ------------------------------------------------------------------------------------------ the engine on a workload

WORKLOAD_MAX_CONTEXT = 2048  # covers the trace scaled by 8: its longest prompt + generation (14050/8 + 1000/8 = 1882)
NUM_REFERENCE_CHECKS = 3  # requests checked against generate.generate before timing


def workload_engine_config(*, max_num_seqs: int = 32, page_size: int = 16, compilation_cache_dir: str | None = None,
                           max_context: int = WORKLOAD_MAX_CONTEXT, **knobs):
    """Pages for max_num_seqs sequences of max_context (the pool never forces a preemption on a
    scaled-trace workload); by default no persistent compilation cache, so a warm-up is a cold compile."""
    from jaxinfer import EngineConfig

    return EngineConfig(max_context=max_context, max_num_seqs=max_num_seqs, page_size=page_size, compilation_cache_dir=compilation_cache_dir,
                        num_pages=max_num_seqs * (max_context // page_size) + 1, **knobs)


def reference_check(params, cfg, eos_id: int, requests: list[dict], engine_tokens) -> dict:
    """The NUM_REFERENCE_CHECKS shortest requests: the engine's greedy tokens (`engine_tokens(chosen
    indices)`) == generate.generate's, the dense reference, over the engine's `params`."""
    from jaxinfer.engine import generate

    chosen = sorted(range(len(requests)), key=lambda i: len(requests[i]["prompt_ids"]) + requests[i]["max_tokens"])[:NUM_REFERENCE_CHECKS]
    reference = generate.generate(params, cfg, [requests[i]["prompt_ids"] for i in chosen],
                                  [greedy(requests[i]["max_tokens"]) for i in chosen], eos_id=eos_id)
    equal = [e == r.token_ids for e, r in zip(engine_tokens(chosen), reference)]
    return {"requests": chosen, "num_checked": len(chosen), "num_equal": sum(equal), "equal": equal}


def check_against_reference(llm, requests: list[dict]) -> dict:
    """reference_check of `llm`, the chosen requests generated on their own."""
    def engine_tokens(chosen):
        return [o.token_ids for o in generate(llm, [requests[i] for i in chosen])]

    return reference_check(llm.engine.params, llm.model_config, llm.tokenizer.eos_id, requests, engine_tokens)


def timed_generate(llm, requests: list[dict], block_pool=None) -> dict:
    """One greedy run of the requests from an empty prefix cache: wall and CPU seconds, outputs, the
    scheduler's stats, the StepRecorder (given `block_pool`, it tracks the pages held) and compiles."""
    from jaxinfer.engine.engine import CompileCounter

    llm.reset_prefix_cache()  # a run must not reuse the prompt pages of the reference check or the run before
    recorder = StepRecorder(llm.engine_config.page_size, block_pool)
    with CompileCounter() as compiles:
        wall, cpu = time.perf_counter(), time.process_time()
        outputs = generate(llm, requests, on_step=recorder)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"wall_s": wall, "cpu_s": cpu, "outputs": outputs, "stats": llm.last_stats, "recorder": recorder, "compiles": compiles.count}


def best_run(runs: list[dict], max_tokens: list[int]) -> dict:
    """The fastest of `runs` (timed_generate's) of one workload, with every run's seconds beside it."""
    best = min(runs, key=lambda run: run["wall_s"])
    seconds, outputs = best["wall_s"], best["outputs"]
    tokens = [o.token_ids for o in outputs]
    num_output = sum(len(t) for t in tokens)
    return {"seconds": seconds, "seconds_per_repeat": [run["wall_s"] for run in runs], "num_output_tokens": num_output,
            "repeats_identical_tokens": all([o.token_ids for o in run["outputs"]] == tokens for run in runs),
            "output_tokens_per_s": num_output / seconds, "all_lengths_exact": all(len(t) == n for t, n in zip(tokens, max_tokens)),
            "mean_latency_s": float(np.mean([o.latency for o in outputs])),
            "mean_time_to_first_token_s": float(np.mean([o.time_to_first_token for o in outputs]))}


def run_engine(workload: dict, engine_config, repeats: int, model=None, **load) -> tuple[dict, list[list[int]], object]:
    """LLM(model, **load) over `engine_config`: load, warm up (timed apart), check a few requests against
    the dense reference, then time `repeats` runs and report the best. Returns (result, tokens, llm)."""
    from jaxinfer import LLM

    requests = workload["requests"]
    llm, load_s = timed(LLM, model, engine_config=engine_config, warmup=False, **load)
    _, warmup_s = timed(llm.engine.warmup)
    reference = check_against_reference(llm, requests)
    print(f"jaxinfer: loaded {load_s:.1f}s, warm-up {warmup_s:.1f}s ({llm.engine.num_compilations} programs); "
          f"reference check {reference['num_equal']}/{reference['num_checked']} equal", flush=True)
    runs = [timed_generate(llm, requests) for _ in range(repeats)]
    best = min(runs, key=lambda run: run["wall_s"])
    stats, recorder = best["stats"], best["recorder"]  # the scheduler is deterministic: every repeat has the same stats
    return {
        "load_s": load_s, "warmup_s": warmup_s, "num_compilations": llm.engine.num_compilations,
        "compiles_during_timed_run": sum(run["compiles"] for run in runs),
        **best_run(runs, [r["max_tokens"] for r in requests]),
        "engine_config": dataclasses.asdict(engine_config), "num_pages": llm.engine.num_pages,
        "attention_impl": llm.engine.impl, "quantization": load.get("quantization"), "reference_check": reference,
        "stats": {**dataclasses.asdict(stats), "padding_waste": stats.padding_waste},
        "time_split": recorder.summary(best["wall_s"]),
        "decode_kv_utilization": recorder.kv_utilization(),  # from the plans, over decode steps only
    }, [o.token_ids for o in best["outputs"]], llm


# ------------------------------------------------------------------------------------------ subprocesses and peers


def last_json(stdout: str) -> dict:
    """The JSON document on the last line of a script's stdout."""
    return json.loads(stdout.strip().splitlines()[-1])


def run_json(command: list[str], what: str, **kwargs) -> dict:
    """Run `command` and return its last-line JSON; RuntimeError (with its stderr's tail) if it fails."""
    completed = subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)
    if completed.returncode != 0:
        raise RuntimeError(f"{what} failed ({completed.returncode}):\n{completed.stderr[-3000:]}")
    return last_json(completed.stdout)


def run_peer(script: str, *argv: str) -> dict:
    """experiments/peers/`script` in .venv-ref; its last-line JSON."""
    return run_json([str(REF_PYTHON), str(PEERS_DIR / script), *argv], script)


def run_generate_peer(script: str, workload_file, tokens_file, *argv: str) -> tuple[dict, object]:
    """A generate peer (hf_generate.py, llamacpp_generate.py) on a workload file: (its last-line JSON, the
    tokens it wrote to `tokens_file`), or ({"error": ...}, None) where it failed or is not installed."""
    try:
        raw = run_peer(script, "--workload", str(workload_file), "--out", str(tokens_file), *argv)
        return raw, json.loads(pathlib.Path(tokens_file).read_text())
    except (RuntimeError, json.JSONDecodeError, FileNotFoundError) as error:
        return {"error": str(error)}, None


# ------------------------------------------------------------------------------------------ reporting and metadata


def arg_parser(doc: str, *, out: pathlib.Path | None = None, trace: bool = False) -> argparse.ArgumentParser:
    """A parser described by the first line of `doc`, with the common --out (default `out`) and --trace."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    if out is not None:
        parser.add_argument("--out", type=pathlib.Path, default=out)
    if trace:
        parser.add_argument("--trace", type=pathlib.Path, default=DEFAULT_TRACE, help="an Azure-format trace CSV")
    return parser


def comma_list(parser: argparse.ArgumentParser, text: str, choices, what: str) -> list[str]:
    """The non-empty items of a comma list; a usage error naming `what` if one is not in `choices`."""
    items = [item for item in text.split(",") if item]
    unknown = sorted(set(items) - set(choices))
    if unknown:
        parser.error(f"unknown {what} {unknown}; choose from {', '.join(choices)}")
    return items


def log(script: str, message: str) -> None:
    """A timestamped progress line on stderr (stdout ends with the result JSON)."""
    print(f"[{script} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def format_table(columns: list[tuple[str, str]], rows: list[list]) -> str:
    """Columns of (header, format spec: "<14", ">8.1f", "7.1%", aligned right unless "<"); a header
    aligns as its cells, and a cell that is a string or None ("-") prints as text at the column's width."""
    def cell(value, spec: str) -> str:
        align, width = spec[0] if spec[0] in "<>" else ">", re.match(r"[<>]?[+ -]?(\d*)", spec)[1]
        if value is None or isinstance(value, str):
            return f"{'-' if value is None else value:{align}{width}}"
        return f"{value:{align}{spec.lstrip('<>')}}"

    return "\n".join(" ".join(cell(v, spec) for v, (_, spec) in zip(row, columns)) for row in [[h for h, _ in columns], *rows])


def judge(goals: dict[str, tuple[str, float, str]], measured: dict) -> dict:
    """{name: {what, target, how, measured, met}} for goals {name: (what, target, how)}, where how is "at_least",
    "at_most" or "within" (|measured| <= target); met is None where measured[name] is None (not measured)."""
    test = {"at_least": lambda m, t: m >= t, "at_most": lambda m, t: m <= t, "within": lambda m, t: abs(m) <= t}
    return {name: {"what": what, "target": target, "how": how, "measured": (m := measured.get(name)),
                   "met": None if m is None else bool(test[how](m, target))} for name, (what, target, how) in goals.items()}


def print_goals(judged: dict) -> None:
    print("\ngoals:")
    for goal in judged.values():
        state = "not measured" if goal["met"] is None else ("met" if goal["met"] else "NOT MET")
        measured = "-" if goal["measured"] is None else f"{goal['measured']:.4g}"
        print(f"  {state:<12} {goal['what']}: measured {measured} ({goal['how'].replace('_', ' ')} {goal['target']:g})")


def finish(path: pathlib.Path, doc: dict, summary: dict, *, correct: bool = True, **write) -> dict:
    """write_result(path, doc, **write), then `summary` as the last stdout line; exit 1 if not `correct`."""
    doc = write_result(path, doc, **write)
    print(json.dumps(summary))
    if not correct:
        sys.exit(1)
    return doc


def _git(*command: str) -> str | None:
    try:
        completed = subprocess.run(["git", *command], cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    except OSError:  # no git on this machine (the GPU box)
        return None
    return completed.stdout.rstrip() if completed.returncode == 0 else None  # porcelain lines may start with a space


_COMMIT_AT_START = _git("rev-parse", "HEAD")


def cpu_info() -> dict:
    """Model name and feature flags of the first CPU (/proc/cpuinfo), the core count and usable cores."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return {"model": fields.get("model name") or platform.processor() or None, "flags": fields.get("flags"),
            "count": os.cpu_count(), "usable": len(os.sched_getaffinity(0))}


def device_info() -> dict:
    """JAX's backend and devices, and the first device's peak bytes in use where it reports them. Only
    in a process that has imported jax (a parent that only spawns workers stays without it)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return {"backend": None, "note": "jax not imported in this process", "jax_platforms_env": os.environ.get("JAX_PLATFORMS")}
    devices = jax.devices()
    stats = (devices[0].memory_stats() or {}) if devices and hasattr(devices[0], "memory_stats") else {}
    return {"backend": jax.default_backend(), "kind": devices[0].device_kind if devices else None, "count": len(devices),
            "peak_bytes_in_use": stats.get("peak_bytes_in_use")}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def metadata(peaks: dict | None = None) -> dict:
    """The block every result JSON carries: commit (and uncommitted source files), platform, CPU model and
    flags, device, load average, and peak figures: this process's VmHWM and the measured `peaks`. The
    commit is read when the JSON is written; `commit_at_start`, when the script started (the code it ran,
    if a commit landed while a long benchmark was running)."""
    dirty = _git("status", "--porcelain", "--", "jaxinfer", "kernels_cpu", "kernels_pallas")
    return {"commit": _git("rev-parse", "HEAD"), "commit_at_start": _COMMIT_AT_START, "uncommitted_source_files": None if dirty is None else dirty.splitlines(),
            "platform": platform.platform(), "python": platform.python_version(), "jax": _version("jax"), "cpu": cpu_info(), "device": device_info(),
            "load_average": load_average(), "peak_rss_bytes": peak_rss_bytes(), "peaks": peaks or {}}


def write_result(path: pathlib.Path, doc: dict, *, indent: int | None = 2, peaks: dict | None = None) -> dict:
    """Write `doc` to `path` as JSON with the harness's metadata in its "machine" block; returns it."""
    doc = {**doc, "machine": {**metadata(peaks), **doc.get("machine", {})}}
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent, default=str) + "\n")
    return doc
