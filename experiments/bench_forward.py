"""How fast is jaxinfer's forward on this machine, as a fraction of its measured matmul peak, and vs HF?

The forward-pass benchmark; what it reports, and the committed runs, are in docs/benchmarks.md ("Forward pass"). On
SmolLM2-135M-Instruct or, with --geometry, random weights of a real shape written as a HF folder (about
3x the f32 weight bytes of memory). Correctness first: last-position logits vs the HF fixtures (SmolLM2)
and vs HF's on the prefill ids, within MAX_RELATIVE_ERROR. Prefill and decode run through the engine's
paged pool with the attention the Engine resolves for --attention; the FLOP and byte counts are stated
in the output (flops_formula, bytes_formula).

    .venv/bin/python experiments/bench_forward.py [--batch-sizes 1,8,32] [--context 512] [--no-hf] [--geometry NAME]
        [--attention auto|reference|cpu]
"""

import functools
import json
import pathlib
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from common import machine, models, paths, peers, programs, report, timing, workloads
from common.machine import MATMUL_SIZE
from common.models import GEOMETRIES
from common.paths import REPO_ROOT
from common.programs import forward_flops, matmul_params
from common.timing import time_calls
from common.workloads import relative_error
from jaxinfer.engine import backends
from jaxinfer.model import attention, kv_pool, forward as model, sampling
from jaxinfer.loading import loading
from jaxinfer.config import ATTENTION_IMPLS, ModelConfig, from_hf_config
from jaxinfer.loading.tokenizer import load_tokenizer

RESULTS = paths.RESULTS_DIR / "bench_forward.json"
MAX_RELATIVE_ERROR = 1e-3  # ||ours - HF|| / ||HF|| on last-position logits
FIXTURE_PAD = 640  # fixture prompts are right-padded to this; causal masking keeps the padding inert
PAGE_SIZE = 64  # tokens per page of the paged pool (the engine's default)


def decode_bytes(cfg: ModelConfig, batch: int, context: int) -> int:
    """Least bytes a decode step reads: every f32 weight once (embedding as LM head) and the K/V."""
    weights = 4 * (matmul_params(cfg) + cfg.vocab_size * cfg.embed_dim)
    return weights + batch * context * cfg.kv_bytes_per_token(4)


def check_fixtures(params, cfg: ModelConfig) -> dict:
    """Relative error of our last-position logits vs the committed HF fixtures, per prompt."""
    with np.load(paths.FIXTURES) as fixtures:
        count = int(fixtures["num_prompts"])
        ids = [fixtures[f"p{i}_ids"] for i in range(count)]
        expected = [fixtures[f"p{i}_last_logits"] for i in range(count)]
    tokens, lengths = programs.pad_rows(ids, FIXTURE_PAD)
    positions = np.broadcast_to(np.arange(FIXTURE_PAD, dtype=np.int32), tokens.shape)
    logits, _ = programs.forward_program()(params, None, tokens, positions, None, lengths - 1, cfg=cfg, impl="reference", output="last_logits")
    logits = np.asarray(logits)  # [prompts, V]: at each prompt's last token, no cache
    errors = [relative_error(logits[i], expected[i]) for i in range(count)]
    argmax_equal = [int(np.argmax(logits[i]) == np.argmax(expected[i])) for i in range(count)]
    return {"num_prompts": count, "max_relative_error": max(errors), "relative_errors": errors, "argmax_equal": sum(argmax_equal)}


def bench_prefill(params, cfg: ModelConfig, ids: list[int], repeats: int, impl: str) -> dict:
    num_tokens = len(ids)
    args, num_pages = programs.prefill_args(ids, PAGE_SIZE)
    pool = kv_pool.init_pool(cfg, num_pages, PAGE_SIZE)
    times, compile_s, logits = programs.time_forward(params, cfg, pool, args, impl=impl, output="last_logits", repeats=repeats, warmup=1)
    seconds = statistics.median(times)
    flops = forward_flops(cfg, num_tokens, 1, num_tokens * (num_tokens + 1) // 2)
    return {
        "tokens": num_tokens, "attention_impl": impl, "compile_s": compile_s, "times_s": times, "median_s": seconds,
        "tokens_per_s": num_tokens / seconds, "flops": flops, "flops_per_s": flops / seconds, "last_logits": np.asarray(logits[0]),
    }


def bench_decode(params, cfg: ModelConfig, batch: int, context: int, token: int, repeats: int, impl: str) -> dict:
    args, num_pages = programs.decode_args(batch, context, token, PAGE_SIZE)  # every row attends to all `context` slots
    pool = kv_pool.init_pool(cfg, num_pages, PAGE_SIZE)
    times, compile_s, _ = programs.time_forward(params, cfg, pool, args, impl=impl, output="greedy", repeats=repeats, warmup=2)
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
    (_, _, meta, _), num_pages = programs.decode_args(batch, context, 0, PAGE_SIZE)
    paged_pool = lambda: kv_pool.init_pool(cfg, num_pages, PAGE_SIZE)  # noqa: E731
    donating = lambda program, state, pages: statistics.median(timing.time_donating(program, state, q, kv, kv, positions, pages, repeats=repeats)[0])  # noqa: E731
    seconds = {
        "forward_without_cache": statistics.median(time_calls(lambda: no_cache(params, tokens, positions).block_until_ready(), repeats, 2)),
        "lm_head_argmax": statistics.median(time_calls(lambda: lm_head(params, hidden).block_until_ready(), repeats, 2)),
        "attention_dense": donating(attend["reference"], kv_pool.init_dense_cache(cfg, batch, context), None),
        "attention_paged": donating(attend["reference"], paged_pool(), meta),
        "attention_paged_impl": donating(attend[impl], paged_pool(), meta),
    }
    return {"batch": batch, "context": context, "page_size": PAGE_SIZE, "attention_impl": impl, **{f"{k}_ms": v * 1e3 for k, v in seconds.items()}}


def print_table(result: dict) -> None:
    peaks, hf, impl = result["machine"]["peaks"], result.get("hf") or {}, result["attention_impl"]
    peak, bandwidth = peaks["matmul"]["best_flops_per_s"], peaks["bandwidth"]["best_bytes_per_s"]
    print(f"\nmatmul peak {peak / 1e9:.1f} GFLOP/s (f32 {MATMUL_SIZE}^3), read bandwidth {bandwidth / 1e9:.1f} GB/s; load avg {result['load_average']}")
    prefill = result["prefill"]
    table_rows = [(f"prefill T={prefill['tokens']}", prefill["median_s"], prefill["tokens_per_s"], prefill["flops_per_s"], None,
                 hf.get("prefill_median_s"), prefill["compile_s"])]
    table_rows += [(f"decode B={d['batch']} S={d['context']}", d["median_step_s"], d["tokens_per_s"], d["flops_per_s"], d["bytes_per_s"] / bandwidth,
                  (hf.get("decode_median_step_s") or {}).get(str(d["batch"])), d["compile_s"]) for d in result["decode"]]
    columns = [("program", "<18"), ("ms", "9.1f"), ("tokens/s", "10.1f"), ("GFLOP/s", "8.2f"), ("%peak", "7.1%"), ("MBU", "6.1%"),
               ("compile", "8.2f"), ("HF ms", "9.1f"), ("jax/HF", "6.2f")]
    print(report.format_table(columns, [[name, s * 1e3, rate, flops / 1e9, flops / peak, mbu, compile_s, hf_s and hf_s * 1e3, hf_s and hf_s / s]
                                         for name, s, rate, flops, mbu, hf_s, compile_s in table_rows]))
    print("jax/HF = HF time / jaxinfer time (>1: jaxinfer faster). MBU = least bytes read / step time / read bandwidth.")
    print(f"prefill and decode run through the paged pool (pages of {PAGE_SIZE}) with attention_impl={impl!r}, as the engine does.")
    print("\ndecode step breakdown, ms (each part jitted alone; the attention block = K/V write + attention, all layers)")
    columns = [("batch", "5d"), ("full step", "10.1f"), ("no-cache fwd", "13.1f"), ("LM head+argmax", "15.1f"), ("attn dense", "11.1f"),
               ("paged jnp", "10.1f"), ("paged " + impl, "12.1f")]
    print(report.format_table(columns, [[p["batch"], d["median_step_s"] * 1e3, p["forward_without_cache_ms"], p["lm_head_argmax_ms"], p["attention_dense_ms"],
                                          p["attention_paged_ms"], p["attention_paged_impl_ms"]] for d, p in zip(result["decode"], result["decode_breakdown"])]))


def parse_args():
    parser = report.arg_parser(__doc__)
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

    rng = np.random.default_rng(0)
    shapes = models.file_tensor_shapes(from_hf_config(config), "hf")
    weights = {name: np.ones(shape, np.float32) if name.endswith("norm.weight") else (rng.standard_normal(shape, np.float32) * 0.02)
               for name, shape in shapes.items()}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file(weights, str(folder / "model.safetensors"))


def hf_comparison(ids: list[int], ours_logits: np.ndarray, args, folder: pathlib.Path | None = None) -> dict:
    """peers/hf_forward.py (on the HF `folder` if given): HF's timings on the same ids and batch sizes, and
    how far our prefill logits are from its."""
    with tempfile.TemporaryDirectory() as workdir:
        ids_file, logits_file = pathlib.Path(workdir) / "ids.json", pathlib.Path(workdir) / "hf_logits.npy"
        ids_file.write_text(json.dumps(ids))
        folder_args = ["--folder", str(folder)] if folder else []
        hf_raw = peers.run_peer("hf_forward.py", "--ids", str(ids_file), "--batch-sizes", ",".join(map(str, args.batch_sizes)),
                                  "--steps", str(args.repeats), "--logits-out", str(logits_file), *folder_args)
        hf_logits = np.load(logits_file)
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
        "load_average": timing.load_average(), "load_s": parts["load_s"],
        "correctness": {"max_relative_error_allowed": MAX_RELATIVE_ERROR, "fixtures": fixtures, "hf_prefill_relative_error": hf_error, "passed": correct},
        "machine": {"peaks": peaks},  # the rest of the block is report.write_result's
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
        return cfg, params, workloads.prefix_ids(load_tokenizer(None), args.prefill_tokens), parts, None
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
    parts["peaks"] = machine.measure_peaks(args.repeats * 2)
    geometry = {"page_size": PAGE_SIZE, "head_dim": cfg.head_dim, "group_size": cfg.num_heads // cfg.num_kv_heads}  # as Engine asks
    impl = parts["attention_impl"] = backends.resolve_impl(args.attention, dtype=cfg.dtype, **geometry)
    engine_params = programs.engine_params(params, impl)
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
    report.finish(args.out, result, {
        "bench": "forward", "correct": result["correctness"]["passed"], "matmul_peak_gflops": result["machine"]["peaks"]["matmul"]["best_flops_per_s"] / 1e9,
        "prefill_tokens_per_s": result["prefill"]["tokens_per_s"], "prefill_fraction_of_peak": result["prefill"]["fraction_of_peak"],
        **{f"decode_b{d['batch']}_ms": d["median_step_s"] * 1e3 for d in result["decode"]},
        **{f"decode_b{d['batch']}_fraction_of_peak": d["fraction_of_peak"] for d in result["decode"]},
        **(result.get("ratios_vs_hf") or {}), "runtime_s": result["runtime_s"],
    }, correct=result["correctness"]["passed"])


if __name__ == "__main__":
    main()
