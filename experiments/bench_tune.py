"""What does the runtime tuner cost and choose on this machine, how faithful is bf16, and how fast is the default?

Runtime tuning, on SmolLM2-135M-Instruct. In one run:
  1. tuning from scratch: an empty tuner cache and an empty XLA compilation cache, for the engine config of
     the throughput run below; then the same start again, read from the cache (the cached start's cost);
  2. fidelity of bf16 against f32 on the HF fixture prompts (tests/fixtures/smollm2_reference.npz):
     teacher-forced perplexity of each dtype over the prompts' next tokens (no cache, model.forward), and
     greedy agreement of the dense reference generator (generate.generate) in bf16 against f32 (and f32
     against HF's own greedy ids, as a check of the f32 side);
     The same table over quantization='int8' weights;
  3. output tokens/s of the default configuration (dtype, attention and matmul "auto": the tuned choice)
     against the fixed f32 configuration (JAXINFER_TUNE=0: float32, the CPU kernels as before tuning), on
     --num-requests requests of the conversation trace scaled by --scale (workloads.build_workload), each
     checked against the dense reference first.
Writes experiments/results/bench_tune.json (with the machine block: CPU model and flags); the last stdout
line is one JSON document.

    .venv/bin/python experiments/bench_tune.py [--num-requests 16] [--scale 8] [--repeats 2]
"""

import functools
import math
import os
import tempfile
import time

import numpy as np

from common import engine_runs, paths, report, timing, workloads

RESULTS = paths.RESULTS_DIR / "bench_tune.json"
GREEDY_TOKENS = 32  # tokens of each fixture prompt's greedy continuation
MAX_PERPLEXITY_RATIO = 1.005  # the bf16 default within 0.5% of f32's perplexity


def parse_args():
    parser = report.arg_parser(__doc__, out=RESULTS, trace=True)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--scale", type=float, default=8.0, help="trace lengths are divided by this")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per configuration")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def engine_config(compile_dir: str, num_requests: int):
    return engine_runs.workload_engine_config(max_num_seqs=max(4, min(32, num_requests)), compilation_cache_dir=compile_dir)


def time_tuning(cfg, params, tokenizer, engine_cfg, cache_dir: str) -> dict:
    """Tuning from scratch into `cache_dir`, then the cached start: seconds of each and the table."""
    from jaxinfer.engine import tuning

    pins = tuning.Impls()  # what LLM(None) asks: everything auto
    kwargs = dict(tokenizer=tokenizer, enabled=True, directory=cache_dir)
    first, first_s = timing.timed(tuning.choose_for_model, cfg, params, engine_cfg, pins, **kwargs)
    cached, cached_s = timing.timed(tuning.choose_for_model, cfg, params, engine_cfg, pins, **kwargs)
    print(tuning.format_table(first), flush=True)
    report.log("bench_tune", f"first tuning {first_s:.1f}s, cached start {cached_s * 1e3:.1f} ms")
    return {"first_tuning_s": first_s, "cached_start_s": cached_s, "cached_from_cache": cached.from_cache, "choice": vars_of(first.choice),
            "prefill_key": str(first.prefill_key), "decode_key": str(first.decode_key), "table": [vars_of(m) for m in first.measurements],
            "table_text": tuning.format_table(first), "fingerprint": tuning.machine_fingerprint(), "cache_key": first.key}


def vars_of(obj) -> dict:
    import dataclasses

    return dataclasses.asdict(obj)


def fixture_prompts() -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, HF's greedy ids) of every fixture prompt with at least 2 tokens."""
    with np.load(paths.FIXTURES) as fixtures:
        count = int(fixtures["num_prompts"])
        pairs = [(fixtures[f"p{i}_ids"].astype(np.int32).tolist(), fixtures[f"p{i}_greedy_ids"].astype(np.int32).tolist()) for i in range(count)]
    pairs = [(ids, greedy) for ids, greedy in pairs if len(ids) >= 2]
    return [ids for ids, _ in pairs], [greedy for _, greedy in pairs]


PAD_WIDTH = 640  # fixture prompts (1 to 601 tokens) are right-padded to this: one compile per dtype, causal so inert


@functools.cache
def _token_nll():
    """Jitted next-token NLL [W - 1] of one right-padded row, from model.forward with no cache."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.model import forward as model

    @functools.partial(jax.jit, static_argnames=("cfg",))
    def nll(params, tokens, *, cfg):  # tokens: i32[1, W]
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        logits = model.forward(params, None, tokens, positions, cfg=cfg)[0][0]  # [W, V], f32
        log_probs = jax.nn.log_softmax(logits[:-1].astype(jnp.float32), axis=-1)  # position t predicts token t + 1
        return -jnp.take_along_axis(log_probs, tokens[0, 1:, None], axis=-1)[:, 0]  # [W - 1]

    return nll


def perplexity(cfg, params, prompts: list[list[int]]) -> dict:
    """exp(mean next-token NLL) over every prompt token after the first."""
    total, count = 0.0, 0
    for ids in prompts:
        tokens = np.zeros((1, PAD_WIDTH), np.int32)
        tokens[0, : len(ids)] = ids
        nll = np.asarray(_token_nll()(params, tokens, cfg=cfg), np.float64)[: len(ids) - 1]
        total, count = total + float(nll.sum()), count + len(ids) - 1
    return {"perplexity": math.exp(total / count), "mean_nll": total / count, "num_tokens": count}


def fidelity(cfg, params) -> dict:
    """bf16 against f32: perplexity on the fixture prompts and greedy agreement of the dense reference."""
    from jaxinfer.engine import generate
    from jaxinfer.model.params import cast_model

    prompts, hf_greedy = fixture_prompts()
    per_dtype, greedy = {}, {}
    for dtype in ("float32", "bfloat16"):
        dtype_cfg, dtype_params = cast_model(cfg, params, dtype)
        per_dtype[dtype] = perplexity(dtype_cfg, dtype_params, prompts)
        runs = generate.generate(dtype_params, dtype_cfg, prompts, workloads.greedy(GREEDY_TOKENS))
        greedy[dtype] = [run.token_ids for run in runs]
        report.log("bench_tune", f"{dtype}: perplexity {per_dtype[dtype]['perplexity']:.4f}")
    hf_steps = min(len(g) for g in hf_greedy)
    ratio = per_dtype["bfloat16"]["perplexity"] / per_dtype["float32"]["perplexity"]
    return {
        "prompts": len(prompts), "greedy_tokens": GREEDY_TOKENS, "perplexity": per_dtype, "bf16_perplexity_ratio": ratio,
        "bf16_within_0_5_percent": ratio <= MAX_PERPLEXITY_RATIO,
        "bf16_vs_f32_greedy": workloads.agreement(greedy["bfloat16"], greedy["float32"]),
        "f32_vs_hf_greedy": workloads.agreement([g[:hf_steps] for g in greedy["float32"]], [g[:hf_steps] for g in hf_greedy]),
        "hf_greedy_steps": hf_steps,
    }


def throughput(workload: dict, engine_cfg, repeats: int) -> dict:
    """The default configuration (tuned, read from the cache time_tuning wrote) and the fixed f32 one."""
    from jaxinfer.engine import tuning

    runs = {}
    for name, tune, load in (("default", "1", {}), ("fixed_f32", "0", {"dtype": "float32"})):
        os.environ[tuning.TUNE_ENV] = tune
        result, _, llm = engine_runs.run_engine(workload, engine_cfg, repeats, **load)
        runs[name] = {"choices": vars_of(llm.choices), "tuning_source": llm.tuning.source, **{k: result[k] for k in (
            "output_tokens_per_s", "seconds", "seconds_per_repeat", "num_output_tokens", "warmup_s", "load_s", "num_compilations", "reference_check",
            "all_lengths_exact", "compiles_during_timed_run")}}
        report.log("bench_tune", f"{name} ({llm.choices.describe()}): {result['output_tokens_per_s']:.1f} output tokens/s")
        del llm
    runs["default_over_fixed_f32"] = runs["default"]["output_tokens_per_s"] / runs["fixed_f32"]["output_tokens_per_s"]
    return runs


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    from jaxinfer.loading import loading
    from jaxinfer.engine import tuning
    from jaxinfer.loading.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    cfg, params = loading.load_model(None)
    with tempfile.TemporaryDirectory() as scratch:
        os.environ[tuning.CACHE_ENV] = os.path.join(scratch, "tuner")  # from scratch: nothing cached, nothing compiled
        engine_cfg = engine_config(os.path.join(scratch, "xla"), args.num_requests)
        tuned = time_tuning(cfg, params, tokenizer, engine_cfg, os.environ[tuning.CACHE_ENV])
        int8_cfg, int8_params = loading.load_model(None, quantization="int8")  # the same table over int8 weights (f32 activations)
        tuned_int8 = time_tuning(int8_cfg, int8_params, tokenizer, engine_cfg, os.path.join(scratch, "tuner_int8"))
        del int8_params
        faithful = fidelity(cfg, params)
        workload = workloads.build_workload(args.trace, args.num_requests, args.scale, args.seed, tokenizer, max_context=engine_runs.WORKLOAD_MAX_CONTEXT)
        speed = throughput(workload, engine_cfg, args.repeats)
    checks_ok = all(run["reference_check"]["num_equal"] == run["reference_check"]["num_checked"] for run in (speed["default"], speed["fixed_f32"]))
    doc = {
        "question": "runtime tuner: its cost (first and cached start), its choice, bf16 fidelity vs f32, default vs fixed f32 tokens/s",
        "model": loading.default_model_path().name, "tuning": tuned, "tuning_int8_weights": tuned_int8, "fidelity": faithful, "throughput": speed,
        "workload": {**workloads.workload_summary(workload["requests"]), "trace": workload["trace"], "scale": args.scale, "seed": args.seed},
        "targets": {"first_tuning_s_max": 60.0, "cached_start_s_max": 1.0, "bf16_perplexity_ratio_max": MAX_PERPLEXITY_RATIO},
        "runtime_s": time.perf_counter() - start,
    }
    report.finish(args.out, doc, {
        "bench": "tune", "choice": tuning.Impls(**tuned["choice"]).describe(), "choice_int8_weights": tuning.Impls(**tuned_int8["choice"]).describe(), "first_tuning_s": tuned["first_tuning_s"], "cached_start_s": tuned["cached_start_s"],
        "f32_perplexity": faithful["perplexity"]["float32"]["perplexity"], "bf16_perplexity": faithful["perplexity"]["bfloat16"]["perplexity"],
        "bf16_greedy_exact": faithful["bf16_vs_f32_greedy"]["exact_requests"], "bf16_greedy_prefix": faithful["bf16_vs_f32_greedy"]["mean_prefix_fraction"],
        "default_tokens_per_s": speed["default"]["output_tokens_per_s"], "fixed_f32_tokens_per_s": speed["fixed_f32"]["output_tokens_per_s"],
        "default_over_fixed_f32": speed["default_over_fixed_f32"], "reference_checks_ok": checks_ok,
    }, correct=checks_ok)


if __name__ == "__main__":
    main()
