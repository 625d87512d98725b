"""The tuner's attention choice: each attention implementation timed alone, on the steps of a workload whose
contexts are the engine's, not the probe's.

The tuner's probe generation (tuning.make_probe) has contexts of a few dozen tokens, where every attention
costs next to nothing, so timing attention there picks noise (on a 1B Q4_0 GGUF it picked the jnp reference,
whose batch-8 decode steps then took 86 ms against the CPU kernel's 64, and packed prefills 1.2x as long).
Here the real scheduler plans a workload (`attention_workload`: a middle decode-row bucket of prompts, each
as long as a middle page bucket's context, then NUM_DECODE_STEPS decode steps), and each implementation runs
only the model's attention over those plans: every layer writes its keys and values into a pool of the
model's geometry and attends, in a scan over the layers as model.hidden_states runs it. Per phase, the plan
of most real tokens is compiled and timed; the score is tuning's (PROMPT_TOKENS_PER_OUTPUT_TOKEN x prefill
ms per prompt token + decode ms per output token). Attention's numerics are checked with the whole model,
in the probe of the winning candidate.

Imports jax; tuning.py imports this module, never the reverse.
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine import backends
from jaxinfer.engine.tuning_cache import AttentionMeasurement  # the tuner's record (tuning_cache owns it)
from jaxinfer.model import attention
from jaxinfer.scheduling import runloop
from jaxinfer.model import kv_pool as kvp
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.engine import inputs_from_plan
from jaxinfer.scheduling.bucket_tables import BucketTables
from jaxinfer.scheduling.plan import StepPlan

NUM_DECODE_STEPS = 4  # decode steps of the workload, after its prompts are prefilled
NUM_TIMED_CALLS = 2  # timed calls per program, compiled ahead; the fastest counts


def middle_bucket(table: tuple[int, ...]) -> int:
    """The middle entry of a bucket table (the upper one of an even count): the tuner's typical size."""
    return table[len(table) // 2]


def attention_workload(engine_cfg: EngineConfig) -> tuple[EngineConfig, list[StepPlan], int]:
    """(engine config, the real scheduler's plans, pool pages) of the workload: a middle decode-row bucket of
    prompts whose contexts end at a middle page bucket (at most max_context), prefilled in the engine's own
    chunks and packed rows, then NUM_DECODE_STEPS decode steps of all rows."""
    tables = BucketTables.from_config(engine_cfg)
    rows = middle_bucket(tables.decode_rows)
    page = engine_cfg.page_size
    context = min(middle_bucket(tables.pages) * page, engine_cfg.max_context)
    prompt_tokens = max(1, context - NUM_DECODE_STEPS)
    num_pages = rows * -(-context // page) + 1
    workload_cfg = EngineConfig.with_overrides(engine_cfg, max_num_seqs=rows, enable_prefix_caching=False, num_pages=num_pages)
    prompts = [[row + 1] * prompt_tokens for row in range(rows)]  # distinct, though the prefix cache is off
    plans, _ = runloop.dry_run(workload_cfg, prompts, [NUM_DECODE_STEPS] * rows, num_pages)
    return workload_cfg, plans, num_pages


def _attention_program(cfg: ModelConfig, impl: str):
    """jit of every layer's attend over a pool (donated), as model.hidden_states scans it: (pool, q, k, v,
    positions, pages) -> (output of the last layer, pool)."""
    def run(pool, q, k, v, positions, pages):
        def layer(carry, index):
            pool, _ = carry
            out, pool = attention.attend(pool, index, q, k, v, positions, pages, impl, window=cfg.sliding_window)  # a windowed model times its mask
            return (pool, out), None

        (pool, out), _ = jax.lax.scan(layer, (pool, jnp.zeros_like(q)), jnp.arange(cfg.num_layers, dtype=jnp.int32))
        return out, pool

    return jax.jit(run, donate_argnums=0)


def _plan_arrays(cfg: ModelConfig, plan: StepPlan, rng: np.random.Generator):
    """(q [R, T, H, K], k [R, T, G, K], v [R, T, G, K], positions [R, T], pages) of a plan, in cfg's dtype."""
    rows, tokens = plan.token_ids.shape
    draw = lambda heads: jnp.asarray(rng.standard_normal((rows, tokens, heads, cfg.head_dim)), cfg.dtype)  # noqa: E731
    pages = inputs_from_plan(plan).pages
    return draw(cfg.num_heads), draw(cfg.num_kv_heads), draw(cfg.num_kv_heads), jnp.asarray(plan.positions), pages


def _phase_plans(plans: list[StepPlan]) -> dict[str, StepPlan]:
    """{phase: the plan of that phase with the most real tokens} (the first such one)."""
    chosen = {}
    for plan in plans:
        if plan.bucket.phase not in chosen or plan.num_real_tokens > chosen[plan.bucket.phase].num_real_tokens:
            chosen[plan.bucket.phase] = plan
    return chosen


def time_attention(cfg: ModelConfig, engine_cfg: EngineConfig, impl: str, plans: list[StepPlan], num_pages: int) -> dict[str, float]:
    """{phase: ms of all layers' attention per real token}, from the phase's plan of most real tokens
    (`_phase_plans`), compiled first, then the fastest of NUM_TIMED_CALLS calls."""
    program, rng = _attention_program(cfg, impl), np.random.default_rng(0)
    pool = kvp.init_pool(cfg, num_pages, engine_cfg.page_size, engine_cfg.kv_cache_dtype)
    per_token = {}
    for phase, plan in _phase_plans(plans).items():
        arrays = _plan_arrays(cfg, plan, rng)
        compiled = program.lower(pool, *arrays).compile()
        best = float("inf")
        for _ in range(NUM_TIMED_CALLS):
            start = time.perf_counter()
            out, pool = compiled(pool, *arrays)
            out.block_until_ready()
            best = min(best, time.perf_counter() - start)
        per_token[phase] = 1e3 * best / plan.num_real_tokens
    return per_token


def measure_attention(cfg: ModelConfig, engine_cfg: EngineConfig, dtype: str, impl: str, prompt_weight: float) -> AttentionMeasurement:
    """`impl`'s attention in compute dtype `dtype` over attention_workload(engine_cfg); score = prompt_weight x
    prefill ms per prompt token + decode ms per output token. One that cannot run gets a note and no score."""
    cfg = dataclasses.replace(cfg, dtype=dtype)
    try:
        resolved = backends.resolve_impl(impl, dtype=dtype, kv_cache_dtype=engine_cfg.kv_cache_dtype, page_size=engine_cfg.page_size,
                                          head_dim=cfg.head_dim, group_size=cfg.num_heads // cfg.num_kv_heads)
        workload_cfg, plans, num_pages = attention_workload(engine_cfg)
        per_token = time_attention(cfg, workload_cfg, resolved, plans, num_pages)
    except (ValueError, RuntimeError) as e:
        return AttentionMeasurement(dtype, impl, note=f"cannot run: {e}")
    prefill, decode = per_token.get("prefill", 0.0), per_token.get("decode", 0.0)
    return AttentionMeasurement(dtype, impl, prefill, decode, prompt_weight * prefill + decode)


def choose_attention(cfg: ModelConfig, engine_cfg: EngineConfig, dtype: str, impls: list[str], prompt_weight: float) -> tuple[str, list[AttentionMeasurement]]:
    """(the impl of least score among `impls`, every measurement). One impl is returned unmeasured; if none
    can run, the first one is returned (the whole-model probe then reports why it cannot run)."""
    if len(impls) == 1:
        return impls[0], []
    measurements = [measure_attention(cfg, engine_cfg, dtype, impl, prompt_weight) for impl in impls]
    runnable = [m for m in measurements if m.score is not None]
    return (min(runnable, key=lambda m: m.score).attention_impl if runnable else impls[0]), measurements
