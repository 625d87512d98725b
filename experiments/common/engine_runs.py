"""The engine on a workload: the run loop's StepRecorder hook, the engine config a scaled-trace workload
needs, a check of a few requests against the dense reference (jaxinfer.engine.generate), and timed runs
of LLM.generate with their best. numpy at import; jaxinfer where used.
"""

import collections
import dataclasses
import time

import numpy as np

from common import timing
from common.timing import timed
from common.workloads import agreement, generate, greedy


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
    ours = engine_tokens(chosen)
    equal = [e == r.token_ids for e, r in zip(ours, reference)]
    prefix = agreement(ours, [r.token_ids for r in reference])["mean_prefix_fraction"]  # tokens before the first difference
    return {"requests": chosen, "num_checked": len(chosen), "num_equal": sum(equal), "equal": equal, "mean_prefix_fraction": prefix}


def check_against_reference(llm, requests: list[dict]) -> dict:
    """reference_check of `llm`, the chosen requests generated on their own. An engine whose matmul is the W8A8
    kernels' ('cpu_int8') is checked against their exact reference (the dense forward with its activations
    fake-quantized by the kernels' rule: jaxinfer/model/w8a8_reference.py), so `num_equal` says whether the kernel
    computes what it claims, not how far its 8-bit activations are from f32; the result names the reference."""
    def engine_tokens(chosen):
        return [o.token_ids for o in generate(llm, [requests[i] for i in chosen])]

    params, reference = reference_params(llm)
    result = {**reference_check(params, llm.model_config, llm.tokenizer.eos_id, requests, engine_tokens), "reference": reference}
    if reference == "w8a8_exact":  # the tight check: whole greedy runs part at W8A8's discontinuities (docs/tuning.md)
        result |= kernel_matmul_check(llm)
    return result


def kernel_matmul_check(llm) -> dict:
    """Each W8A8 kernel matmul of `llm`'s engine against the exact reference on the same activations
    (w8a8_exact.kernel_matmul_error), and whether it is within the tuner's W8A8_MATMUL_TOLERANCE."""
    from jaxinfer.engine.numerics_check import W8A8_MATMUL_TOLERANCE
    from jaxinfer.model import w8a8_exact

    error = w8a8_exact.kernel_matmul_error(llm.engine.step_params, llm.engine.params)
    return {"kernel_matmul_error": error, "kernel_matmuls_exact": error <= W8A8_MATMUL_TOLERANCE}


def reference_params(llm) -> tuple[object, str]:
    """(the params the reference generator runs for `llm`'s engine, the reference's name): 'w8a8_exact' for the W8A8
    kernels (every K-quant panel read dense, the kernels' matrices with fake-quantized activations), else 'loaded'."""
    if llm.engine.matmul_impl != "cpu_int8":
        return llm.engine.params, "loaded"
    from jaxinfer.model import panels, w8a8_exact

    return w8a8_exact.with_fake_quant(panels.with_read(llm.engine.params, "dense")), "w8a8_exact"


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


def run_engine(workload: dict, engine_config, repeats: int, model=None, *, split_peaks: bool = False, **load) -> tuple[dict, list[list[int]], object]:
    """LLM(model, **load) over `engine_config`: load, warm up (timed apart), check a few requests against
    the dense reference, then time `repeats` runs and report the best. Returns (result, tokens, llm).
    `split_peaks`: the result also holds the peak RSS of the load and warm-up and, apart, of the timed runs
    (timing.reset_peak_rss after the reference check, whose dense generator is the benchmark's, not the
    product's); later timing.peak_rss_bytes() calls then see the runs' peak only."""
    from jaxinfer import LLM

    requests = workload["requests"]
    llm, load_s = timed(LLM, model, engine_config=engine_config, warmup=False, **load)
    _, warmup_s = timed(llm.engine.warmup)
    peaks = {"peak_rss_load_bytes": timing.peak_rss_bytes()} if split_peaks else {}
    reference = check_against_reference(llm, requests)
    if split_peaks:
        import jax

        from jaxinfer.engine import host_memory

        peaks["peak_rss_reference_check_bytes"] = timing.peak_rss_bytes()
        jax.clear_caches()  # the check's compiled programs too (Llama-3.2-1B Q4_K_M: the runs' peak 2842 -> 2686 MiB without them)
        host_memory.release_freed_memory()  # the check's dense generator is the benchmark's: its freed heap is not the runs'
        peaks["peak_rss_reset"] = timing.reset_peak_rss()
    print(f"jaxinfer: loaded {load_s:.1f}s, warm-up {warmup_s:.1f}s ({llm.engine.num_compilations} programs); "
          f"reference check {reference['num_equal']}/{reference['num_checked']} equal", flush=True)
    runs = [timed_generate(llm, requests) for _ in range(repeats)]
    if split_peaks:
        peaks["peak_rss_run_bytes"] = timing.peak_rss_bytes()
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
        **peaks,
    }, [o.token_ids for o in best["outputs"]], llm
