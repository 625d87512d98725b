"""How fast is jaxinfer's forward on this machine, as a fraction of its measured matmul peak, and vs HF?

Issue 2's benchmark. In one run, on the default model (SmolLM2-135M-Instruct Q4_1 GGUF, dequantized to
float32):
  1. correctness first: last-position logits of `model.forward` vs the committed HF fixtures
     (tests/fixtures/smollm2_reference.npz, every prompt), and vs HF's logits on the benchmark's own
     prefill ids computed in this run; both must be within MAX_RELATIVE_ERROR (relative error norm);
  2. the machine's ceilings, measured here: f32 matmul FLOP/s (MATMUL_SIZE^3 jnp matmul) and read
     bandwidth (a reduction over BANDWIDTH_BYTES), best of several runs after a warm-up;
  3. prefill: one sequence of --prefill-tokens real-text tokens through the engine's paged pool (pages of
     PAGE_SIZE) with the engine's attention (--attention, resolved as the engine resolves it: on a CPU,
     the kernels_cpu kernels, with the weights packed into panels as the engine packs them), jitted,
     pool donated;
  4. decode: one token per row at each batch size over the paged pool holding --context tokens per row,
     every row at position context - 1 (so every row attends to the full context), same attention;
  5. compile time of each of those programs (lower + compile, persistent cache not used);
  6. HF transformers on the same ids and batch sizes, via experiments/peers/hf_forward.py in .venv-ref;
  7. where a decode step's time goes, per batch size: the forward without a cache (layer matmuls, norms,
     rope, LM head), the LM head + argmax alone, and the attention block alone (K/V write + attention,
     30 layers) over a dense cache, over the paged pool with the jnp path, and with --attention.

FLOPs counted (stated in the output): 2 * P_matmul * tokens + 2 * V * D * rows_with_logits
+ 4 * L * H * K * (sum over query tokens of keys attended), P_matmul = the layers' matmul weights.
Bytes counted for decode MBU: f32 weights read once (layers + embedding as LM head) + the K/V read.
Writes experiments/results/bench_forward.json; the last stdout line is one JSON document.

With --geometry NAME (llama3-1b: Llama 3.2 1B's shape with llama3 rope scaling; qwen2.5-0.5b: Qwen2.5
0.5B's shape with q/k/v biases), the same measurements run on random weights of that geometry instead:
they are written as a Hugging Face folder (config.json + safetensors), jaxinfer loads it with its HF
loader, HF transformers loads the same folder, and correctness is our last-position logits vs HF's on
the benchmark's (random) prompt ids. Results go to bench_forward_<NAME>.json. Those runs need about
3 x the f32 weight bytes of memory (1B: ~15 GB; 0.5B: ~6 GB).

    .venv/bin/python experiments/bench_forward.py [--batch-sizes 1,8,32] [--context 512] [--no-hf] [--geometry NAME]
        [--attention auto|reference|cpu]
"""

import argparse
import functools
import json
import pathlib
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import harness
from harness import GEOMETRIES, MATMUL_SIZE, REPO_ROOT, forward_flops, matmul_params, relative_error, time_calls
from jaxinfer import attention, kv_pool, loading, model, sampling
from jaxinfer.config import ATTENTION_IMPLS, ModelConfig, from_hf_config
from jaxinfer.tokenizer import load_tokenizer

RESULTS = harness.RESULTS_DIR / "bench_forward.json"
MAX_RELATIVE_ERROR = 1e-3  # ||ours - HF|| / ||HF|| on last-position logits
FIXTURE_PAD = 640  # fixture prompts are right-padded to this; causal masking keeps the padding inert
PAGE_SIZE = 64  # tokens per page of the paged pool (the engine's default)


# ------------------------------------------------------------------------------------------ cost model


def decode_bytes(cfg: ModelConfig, batch: int, context: int) -> int:
    """Least bytes a decode step reads: every f32 weight once (embedding as LM head) and the K/V."""
    weights = 4 * (matmul_params(cfg) + cfg.vocab_size * cfg.embed_dim)
    return weights + batch * context * cfg.kv_bytes_per_token(4)


# ------------------------------------------------------------------------------------------ programs


def paged_meta(batch: int, context: int, positions: np.ndarray) -> kv_pool.PageMeta:
    """Row b owns pages b * n + 1 .. (b + 1) * n of a pool of batch * n + 1 pages (n = context / PAGE_SIZE);
    tokens at `positions` [B, T] are written to their slots."""
    return harness.page_meta(harness.row_tables(batch, -(-context // PAGE_SIZE)), positions, PAGE_SIZE)


def paged_pool(cfg: ModelConfig, batch: int, context: int) -> kv_pool.KVPool:
    return kv_pool.init_pool(cfg, batch * -(-context // PAGE_SIZE) + 1, PAGE_SIZE)


def check_fixtures(params, cfg: ModelConfig) -> dict:
    """Relative error of our last-position logits vs the committed HF fixtures, per prompt."""
    with np.load(harness.FIXTURES) as fixtures:
        count = int(fixtures["num_prompts"])
        ids = [fixtures[f"p{i}_ids"] for i in range(count)]
        expected = [fixtures[f"p{i}_last_logits"] for i in range(count)]
    tokens = np.zeros((count, FIXTURE_PAD), np.int32)
    for row, prompt in enumerate(ids):
        tokens[row, : len(prompt)] = prompt
    last = np.array([len(p) - 1 for p in ids], np.int32)
    positions = np.broadcast_to(np.arange(FIXTURE_PAD, dtype=np.int32), tokens.shape)
    logits, _ = harness.forward_program()(params, None, tokens, positions, None, last, cfg=cfg, impl="reference", output="last_logits")
    logits = np.asarray(logits)  # [prompts, V]: at each prompt's last token, no cache
    errors = [relative_error(logits[i], expected[i]) for i in range(count)]
    argmax_equal = [int(np.argmax(logits[i]) == np.argmax(expected[i])) for i in range(count)]
    return {"num_prompts": count, "max_relative_error": max(errors), "relative_errors": errors, "argmax_equal": sum(argmax_equal)}


# ------------------------------------------------------------------------------------------ timing


def bench_prefill(params, cfg: ModelConfig, ids: list[int], repeats: int, impl: str) -> dict:
    num_tokens = len(ids)
    positions = np.arange(num_tokens, dtype=np.int32)[None]
    args = (jnp.asarray([ids], jnp.int32), positions, paged_meta(1, num_tokens, positions), np.array([num_tokens - 1], np.int32))
    times, compile_s, logits = harness.time_forward(params, cfg, paged_pool(cfg, 1, num_tokens), args, impl=impl, output="last_logits", repeats=repeats, warmup=1)
    seconds = statistics.median(times)
    flops = forward_flops(cfg, num_tokens, 1, num_tokens * (num_tokens + 1) // 2)
    return {
        "tokens": num_tokens, "attention_impl": impl, "compile_s": compile_s, "times_s": times, "median_s": seconds,
        "tokens_per_s": num_tokens / seconds, "flops": flops, "flops_per_s": flops / seconds, "last_logits": np.asarray(logits[0]),
    }


def bench_decode(params, cfg: ModelConfig, batch: int, context: int, token: int, repeats: int, impl: str) -> dict:
    positions = np.full((batch, 1), context - 1, np.int32)  # every row attends to all `context` slots
    args = (jnp.full((batch, 1), token, jnp.int32), positions, paged_meta(batch, context, positions), np.zeros(batch, np.int32))
    times, compile_s, _ = harness.time_forward(params, cfg, paged_pool(cfg, batch, context), args, impl=impl, output="greedy", repeats=repeats, warmup=2)
    seconds = statistics.median(times)
    flops = forward_flops(cfg, batch, batch, batch * context)
    num_bytes = decode_bytes(cfg, batch, context)
    return {
        "batch": batch, "context": context, "attention_impl": impl, "compile_s": compile_s, "times_s": times, "median_step_s": seconds,
        "tokens_per_s": batch / seconds, "flops": flops, "flops_per_s": flops / seconds,
        "bytes": num_bytes, "bytes_per_s": num_bytes / seconds,
    }


def _attention_only(cache, q, k, v, positions, pages, *, num_layers: int, impl: str):
    """The attention block of every layer (write this step's K/V, attend); donates `cache`."""
    def body(carry, layer):
        out, cache = carry
        new_out, cache = attention.attend(cache, layer, q, k, v, positions, pages, impl)
        return (out + new_out, cache), None

    (out, cache), _ = jax.lax.scan(body, (jnp.zeros_like(q), cache), jnp.arange(num_layers, dtype=jnp.int32))
    return out, cache


def decode_breakdown(params, cfg: ModelConfig, batch: int, context: int, repeats: int, impl: str) -> dict:
    """Milliseconds of the parts of a decode step at this batch size and context (each jitted alone)."""
    tokens = jnp.zeros((batch, 1), jnp.int32)
    positions = jnp.full((batch, 1), context - 1, jnp.int32)
    no_cache = jax.jit(lambda p, t, pos: sampling.argmax(model.forward(p, None, t, pos, cfg=cfg)[0][:, -1]))
    hidden = jax.random.normal(jax.random.key(2), (batch, 1, cfg.embed_dim), jnp.float32)
    lm_head = jax.jit(lambda p, x: sampling.argmax(model.logits_from_hidden(p, x, cfg)[:, -1]))
    q = jax.random.normal(jax.random.key(3), (batch, 1, cfg.num_heads, cfg.head_dim), jnp.float32)
    kv = jax.random.normal(jax.random.key(4), (batch, 1, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    attend = {name: jax.jit(functools.partial(_attention_only, num_layers=cfg.num_layers, impl=name), donate_argnums=0) for name in ("reference", impl)}
    meta = paged_meta(batch, context, np.full((batch, 1), context - 1, np.int32))
    seconds = {
        "forward_without_cache": statistics.median(time_calls(lambda: no_cache(params, tokens, positions).block_until_ready(), repeats, 2)),
        "lm_head_argmax": statistics.median(time_calls(lambda: lm_head(params, hidden).block_until_ready(), repeats, 2)),
        "attention_dense": harness.time_donating(attend["reference"], kv_pool.init_dense_cache(cfg, batch, context), q, kv, kv, positions, None, repeats=repeats),
        "attention_paged": harness.time_donating(attend["reference"], paged_pool(cfg, batch, context), q, kv, kv, positions, meta, repeats=repeats),
        "attention_paged_impl": harness.time_donating(attend[impl], paged_pool(cfg, batch, context), q, kv, kv, positions, meta, repeats=repeats),
    }
    return {"batch": batch, "context": context, "page_size": PAGE_SIZE, "attention_impl": impl, **{f"{k}_ms": v * 1e3 for k, v in seconds.items()}}


def run_hf_peer(ids: list[int], batch_sizes: list[int], steps: int, workdir: pathlib.Path, folder: pathlib.Path | None = None) -> tuple[dict, np.ndarray]:
    """Run experiments/peers/hf_forward.py in .venv-ref (on the HF `folder` if given); returns (its JSON,
    its last-position logits)."""
    ids_file, logits_file = workdir / "ids.json", workdir / "hf_logits.npy"
    ids_file.write_text(json.dumps(ids))
    argv = ["--ids", str(ids_file), "--batch-sizes", ",".join(map(str, batch_sizes)), "--steps", str(steps), "--logits-out", str(logits_file)]
    return harness.run_peer("hf_forward.py", *argv, *(["--folder", str(folder)] if folder else [])), np.load(logits_file)


# ------------------------------------------------------------------------------------------ report


def _row(name, seconds, tokens_per_s, flops_per_s, peak, mbu, hf_seconds, compile_s):
    ratio = f"{hf_seconds / seconds:6.2f}x" if hf_seconds else "     -"
    hf = f"{hf_seconds * 1e3:9.1f}" if hf_seconds else "        -"
    mbu_text = f"{mbu:6.1%}" if mbu is not None else "     -"
    return (f"{name:<18} {seconds * 1e3:9.1f} {tokens_per_s:10.1f} {flops_per_s / 1e9:8.2f} {flops_per_s / peak:7.1%} "
            f"{mbu_text} {compile_s:8.2f} {hf} {ratio}")


def print_table(result: dict) -> None:
    peaks = result["machine"]["peaks"]
    peak = peaks["matmul"]["best_flops_per_s"]
    hf = result.get("hf") or {}
    print(f"\nmatmul peak {peak / 1e9:.1f} GFLOP/s (f32 {MATMUL_SIZE}^3), read bandwidth "
          f"{peaks['bandwidth']['best_bytes_per_s'] / 1e9:.1f} GB/s; load avg {result['load_average']}")
    print(f"{'program':<18} {'ms':>9} {'tokens/s':>10} {'GFLOP/s':>8} {'%peak':>7} {'MBU':>6} {'compile':>8} {'HF ms':>9} {'jax/HF':>7}")
    prefill = result["prefill"]
    print(_row(f"prefill T={prefill['tokens']}", prefill["median_s"], prefill["tokens_per_s"], prefill["flops_per_s"], peak,
               None, hf.get("prefill_median_s"), prefill["compile_s"]))
    bandwidth = peaks["bandwidth"]["best_bytes_per_s"]
    for entry in result["decode"]:
        hf_step = (hf.get("decode_median_step_s") or {}).get(str(entry["batch"]))
        print(_row(f"decode B={entry['batch']} S={entry['context']}", entry["median_step_s"], entry["tokens_per_s"],
                   entry["flops_per_s"], peak, entry["bytes_per_s"] / bandwidth, hf_step, entry["compile_s"]))
    print("jax/HF = HF time / jaxinfer time (>1: jaxinfer faster). MBU = least bytes read / step time / read bandwidth.")
    impl = result["attention_impl"]
    print(f"prefill and decode run through the paged pool (pages of {PAGE_SIZE}) with attention_impl={impl!r}, as the engine does.")
    print("\ndecode step breakdown, ms (each part jitted alone; the attention block = K/V write + attention, all layers)")
    print(f"{'batch':>5} {'full step':>10} {'no-cache fwd':>13} {'LM head+argmax':>15} {'attn dense':>11} {'paged jnp':>10} {'paged ' + impl:>12}")
    for entry, parts in zip(result["decode"], result["decode_breakdown"]):
        print(f"{parts['batch']:>5} {entry['median_step_s'] * 1e3:10.1f} {parts['forward_without_cache_ms']:13.1f} "
              f"{parts['lm_head_argmax_ms']:15.1f} {parts['attention_dense_ms']:11.1f} {parts['attention_paged_ms']:10.1f} {parts['attention_paged_impl_ms']:12.1f}")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--context", type=int, default=512, help="tokens each decode row attends to")
    parser.add_argument("--attention", choices=ATTENTION_IMPLS, default="auto", help="attention_impl, resolved as the engine does (default: %(default)s)")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per program")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), help="random weights of this geometry instead of SmolLM2")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="default: experiments/results/bench_forward[_GEOMETRY].json")
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.out = args.out or (RESULTS.with_name(f"bench_forward_{args.geometry}.json") if args.geometry else RESULTS)
    return args


def write_random_folder(config: dict, folder: pathlib.Path) -> None:
    """A HF folder of `config` with seeded random weights: matrices and biases ~ N(0, 0.02), norms 1."""
    from safetensors.numpy import save_file

    cfg = from_hf_config(config)
    rng = np.random.default_rng(0)
    d, q_width, kv_width = cfg.embed_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    for i in range(cfg.num_layers):
        layer = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,), "self_attn.q_proj.weight": (q_width, d),
                 "self_attn.k_proj.weight": (kv_width, d), "self_attn.v_proj.weight": (kv_width, d), "self_attn.o_proj.weight": (d, q_width),
                 "mlp.gate_proj.weight": (cfg.ffn_dim, d), "mlp.up_proj.weight": (cfg.ffn_dim, d), "mlp.down_proj.weight": (d, cfg.ffn_dim)}
        if cfg.attention_bias:
            layer |= {"self_attn.q_proj.bias": (q_width,), "self_attn.k_proj.bias": (kv_width,), "self_attn.v_proj.bias": (kv_width,)}
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    weights = {name: np.ones(shape, np.float32) if name.endswith("norm.weight") else (rng.standard_normal(shape, np.float32) * 0.02)
               for name, shape in shapes.items()}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file(weights, str(folder / "model.safetensors"))


def hf_comparison(ids: list[int], ours_logits: np.ndarray, args, folder: pathlib.Path | None = None) -> dict:
    """HF's timings on the same ids and batch sizes, and how far our prefill logits are from its."""
    with tempfile.TemporaryDirectory() as workdir:
        hf_raw, hf_logits = run_hf_peer(ids, args.batch_sizes, args.repeats, pathlib.Path(workdir), folder)
    return {
        "peer": hf_raw, "prefill_median_s": statistics.median(hf_raw["prefill_s"]),
        "decode_median_step_s": {b: d["median_step_s"] for b, d in hf_raw["decode"].items()},
        "prefill_logits_relative_error": relative_error(ours_logits, hf_logits),
        "prefill_argmax_equal": bool(np.argmax(ours_logits) == np.argmax(hf_logits)),
    }


def assemble(cfg: ModelConfig, parts: dict) -> dict:
    """The results document from the measured parts."""
    peaks, prefill, decode, hf = parts["peaks"], parts["prefill"], parts["decode"], parts["hf"]
    peak, bandwidth = peaks["matmul"]["best_flops_per_s"], peaks["bandwidth"]["best_bytes_per_s"]
    hf_error = hf["prefill_logits_relative_error"] if hf else None
    fixtures = parts["fixtures"] or {"max_relative_error": 0.0, "note": "random weights: checked against HF on the prefill ids only"}
    correct = fixtures["max_relative_error"] <= MAX_RELATIVE_ERROR and (hf_error is None or hf_error <= MAX_RELATIVE_ERROR)
    result = {
        "question": "jaxinfer forward speed on this machine: fraction of measured f32 matmul peak, and vs HF transformers",
        "model": parts.get("model") or loading.default_model_path().name, "features": cfg.features(), "dtype": cfg.dtype, "num_params": cfg.num_params(), "matmul_params": matmul_params(cfg),
        "flops_formula": "2*P_matmul*tokens + 2*V*D*rows_with_logits + 4*L*H*K*(query,key) pairs; decode: rows attend to `context` keys; prefill: causal T(T+1)/2",
        "bytes_formula": "decode: 4*(P_matmul + V*D) + B*context*kv_bytes_per_token(f32)",
        "load_average": harness.load_average(), "load_s": parts["load_s"],
        "correctness": {"max_relative_error_allowed": MAX_RELATIVE_ERROR, "fixtures": fixtures, "hf_prefill_relative_error": hf_error, "passed": correct},
        "machine": {"peaks": peaks},  # the rest of the block is the harness's (write_result)
        "prefill": {**prefill, "fraction_of_peak": prefill["flops_per_s"] / peak},
        "decode": [{**d, "fraction_of_peak": d["flops_per_s"] / peak, "mbu": d["bytes_per_s"] / bandwidth} for d in decode],
        "attention_impl": parts["attention_impl"], "decode_breakdown": parts["breakdown"], "hf": hf, "runtime_s": parts["runtime_s"],
    }
    if hf:
        result["ratios_vs_hf"] = {
            "prefill_speedup": hf["prefill_median_s"] / prefill["median_s"],
            **{f"decode_b{d['batch']}_speedup": hf["decode_median_step_s"][str(d["batch"])] / d["median_step_s"] for d in decode},
        }
    return result


def _load(args, workdir: pathlib.Path) -> tuple:
    """(cfg, params, prefill ids, parts so far, HF folder or None): SmolLM2 with its fixture check, or a
    random-weight geometry written as a HF folder (random prompt ids; the check against HF comes later)."""
    start = time.perf_counter()
    if args.geometry is None:
        cfg, params = loading.load_model(None)
        parts = {"load_s": time.perf_counter() - start}
        fixtures = parts["fixtures"] = check_fixtures(params, cfg)
        print(f"loaded in {parts['load_s']:.1f}s; fixtures: max relative error {fixtures['max_relative_error']:.2e} over "
              f"{fixtures['num_prompts']} prompts, argmax equal {fixtures['argmax_equal']}/{fixtures['num_prompts']}", flush=True)
        return cfg, params, harness.prefix_ids(load_tokenizer(None), args.prefill_tokens), parts, None
    folder = workdir / args.geometry
    write_random_folder(GEOMETRIES[args.geometry], folder)
    cfg, params = loading.load_model(folder, max_context=max(args.context, args.prefill_tokens))
    parts = {"load_s": time.perf_counter() - start, "fixtures": None, "model": f"{args.geometry} (random weights, {cfg.num_params():,} parameters)"}
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, args.prefill_tokens).tolist()
    print(f"wrote and loaded {parts['model']} in {parts['load_s']:.1f}s; features {cfg.features()}", flush=True)
    return cfg, params, ids, parts, folder


def main() -> None:
    args = parse_args()
    total_start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=REPO_ROOT / "build" if (REPO_ROOT / "build").is_dir() else None) as workdir:
        cfg, params, ids, parts, folder = _load(args, pathlib.Path(workdir))
        _measure(cfg, params, ids, parts, folder, args, total_start)


def _measure(cfg, params, ids, parts, folder, args, total_start) -> None:
    parts["peaks"] = {"matmul": harness.measure_matmul_peak(args.repeats * 2), "bandwidth": harness.measure_bandwidth_peak(args.repeats * 2)}
    geometry = {"page_size": PAGE_SIZE, "head_dim": cfg.head_dim, "group_size": cfg.num_heads // cfg.num_kv_heads}  # as Engine asks
    impl = parts["attention_impl"] = attention.resolve_impl(args.attention, dtype=cfg.dtype, **geometry)
    engine_params = harness.engine_params(params, impl)
    parts["prefill"] = bench_prefill(engine_params, cfg, ids, args.repeats, impl)
    ours_logits = parts["prefill"].pop("last_logits")
    parts["decode"] = [bench_decode(engine_params, cfg, b, args.context, ids[-1], args.repeats, impl) for b in args.batch_sizes]
    del engine_params
    parts["breakdown"] = [decode_breakdown(params, cfg, b, args.context, args.repeats, impl) for b in args.batch_sizes]
    print(f"jaxinfer timed in {time.perf_counter() - total_start:.0f}s so far", flush=True)
    parts["hf"] = None if args.no_hf else hf_comparison(ids, ours_logits, args, folder)
    parts["runtime_s"] = time.perf_counter() - total_start

    result = assemble(cfg, parts)
    print_table(result)
    harness.write_result(args.out, result)
    peak = result["machine"]["peaks"]["matmul"]["best_flops_per_s"]
    print(json.dumps({
        "bench": "forward", "correct": result["correctness"]["passed"], "matmul_peak_gflops": peak / 1e9,
        "prefill_tokens_per_s": result["prefill"]["tokens_per_s"], "prefill_fraction_of_peak": result["prefill"]["fraction_of_peak"],
        **{f"decode_b{d['batch']}_ms": d["median_step_s"] * 1e3 for d in result["decode"]},
        **{f"decode_b{d['batch']}_fraction_of_peak": d["fraction_of_peak"] for d in result["decode"]},
        **(result.get("ratios_vs_hf") or {}), "runtime_s": result["runtime_s"],
    }))
    if not result["correctness"]["passed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
