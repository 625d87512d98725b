"""Runtime tuning: which compute dtype, matmul path and attention each engine runs, measured on this machine.

Owns the choice of `dtype`, `attention_impl` and `matmul_impl` where the user left them at "auto"; the
rules that resolve an unmeasured "auto" stay with their owners (attention.resolve_impl,
matmul_impl.resolve_matmul_impl). The user's explicit values are pins: the tuner never changes them (a
pinned float32 stays float32) and only fills the "auto" ones. With JAXINFER_TUNE=0 nothing is measured and
"auto" keeps the fixed rule: float32, attention.resolve_impl's attention, panels exactly with the CPU
attention kernel. A mesh, deterministic mode, or pins that leave one candidate are not measured either.

How a choice is made (`choose`): each candidate (a dtype, an attention impl, a matmul path) gets a small
engine whose only programs are one prefill key (a chunk bucket of the user's table, its sequences packed
in one row) and one decode key (a row bucket of the table); a short greedy generation runs through the real
scheduler and engine, timed per program. A candidate passes the numerics check when its prompt-end logits
are within its dtype's TOLERANCES of the float32 reference (model.forward with no cache, XLA dots and
jnp attention) and its greedy tokens agree with the reference's for the share TOLERANCES asks; a W8A8 kernel
candidate (matmul 'cpu_int8') is checked instead against its exact reference (the activations the kernels quantize
fake-quantized by their rule: model/w8a8_reference.py), whole and matmul by matmul (numerics_check.py). The attention
implementation is chosen first, per compute dtype, by timing each one alone on contexts of the engine's
own size (tune_attention.py: the probe's are too short to tell them apart); only the default candidates
with the winner are then timed whole. The passing candidate with the least `score` wins; one whose first steps
score above PRUNE_FACTOR times the best so far is not timed further and cannot win. Under quantization='auto' the
kernel's candidates are timed first (`backends.kernel_first`; without AVX-512 VNNI, whose int8 dots are then scalar
loops, last, or not at all where the dense copy fits), so that the others, which dequantize the kept blocks, stop after a prefill and a decode step. The choice is cached (tuning_cache.py) per machine fingerprint, jaxlib version, model
geometry and engine limits (`cache_key`), under `cache_dir()`; a cached start reads one small JSON file.

Weights under quantization='auto' (the default; backends.resolve_quantization): a GGUF's blocks are loaded kept where the
CPU quantized-matmul kernels may run (K-quants already packed into the K-quant kernel's panels); its candidates
(matmul 'cpu_int8') multiply them as they are. Every other candidate runs them dequantized, which is the dense
load bit for bit (params.dense_params), where that dense copy fits within EXPANSION_SLACK_BYTES (the memory rule:
a model loads in its file's size plus the KV pool plus 1 GiB); where it does not (Llama-1B and up), those
candidates run the kept blocks dequantized one layer at a time inside the step instead (`dense_fits`; logged once),
so no candidate ever materializes the whole model in f32; and once a kernel candidate (timed first) has passed,
those per-step dequantizing candidates are not built at all (`dequantizes_kept_blocks`: 8-46x slower, and
their engines alone broke the file + pool + 1 GiB rule). `apply_choice` follows the same rule.
For a big model (its dense f32 weights over EXPANSION_SLACK_BYTES) the probe prompts are cut to
BIG_MODEL_PROMPT_TOKENS tokens (`make_probe`): the same programs are timed (the packed row is padded to its
bucket), the same check is made at each prompt's end and over NUM_GENERATED greedy tokens, only the f32
reference's prefill (tokens x dequantized weights) is shorter; the table's "probe:" line says so.
The float32 reference itself reads the kept blocks as they are: each layer's matrices dequantized inside the
layer scan, and the head (tied or not, kept or packed) REFERENCE_HEAD_ROWS vocabulary entries at a time
(`reference_logits`): no dense or packed copy of any weight (Llama-3.2-1B Q4_K_M: 1.7 -> 0.3 GB above the load).
Imports jax and the engine (it builds one per candidate); api.py imports this module, never the reverse.
"""

import dataclasses
import logging
import math
import statistics
import time
import warnings
from pathlib import Path

import jax
import numpy as np

from jaxinfer.model import forward as model, kv_pool as kvp, panels, quant, w8a8_exact
from jaxinfer.scheduling import runloop
from jaxinfer.engine import backends, tune_attention
from jaxinfer.engine.host_memory import release_freed_memory
from jaxinfer.engine.pool_size import available_bytes
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.backends import Impls, packer
from jaxinfer.engine.numerics_check import TOLERANCES, W8A8_MATMUL_TOLERANCE, Reference, Tolerance, tolerance_for, uses_exact_reference  # noqa: F401  (Tolerance: read by tests)
from jaxinfer.engine.numerics_check import greedy_agreement as _greedy_agreement, logit_error
from jaxinfer.engine.tuning_cache import (  # noqa: F401  (TUNE_ENV, CACHE_ENV and cache_key: this module's settings)
    CACHE_ENV, TUNE_ENV, Measurement, TuneResult, cache_dir, cache_key, machine_fingerprint, read_cached, tuning_enabled,
    write_cached,
)
from jaxinfer.scheduling.stopping import OutputProcessor
from jaxinfer.model.params import Params, cast_model, dense_params, weight_bytes
from jaxinfer.scheduling.bucket_tables import BucketTables
from jaxinfer.scheduling.request import Request, SamplingParams
from jaxinfer.scheduling.scheduler import Scheduler

log = logging.getLogger(__name__)

NUM_GENERATED = 8  # greedy tokens of the probe generation (the numerics check's short generation)
NUM_TIMED_RUNS = 2  # timed probe generations per candidate (the programs are compiled ahead: no untimed run)
PRUNE_FACTOR = 2.0  # a candidate whose first generation scores above this times the best so far is not timed again
MEMORY_SHARE = 0.8  # a candidate whose new weight arrays need more than this share of the free memory is not built
BIG_MODEL_PROMPT_TOKENS = 16  # probe prompt length cap where the dense f32 weights exceed EXPANSION_SLACK_BYTES (`make_probe`)
REFERENCE_HEAD_ROWS = 8192  # vocabulary entries of the head the f32 reference dequantizes at a time (128 MiB of f32 at D = 4096)
EXPANSION_SLACK_BYTES = 2**30  # kept blocks are expanded to a dense f32 copy only when that copy fits in this (the load rule's 1 GiB)
PROMPT_TOKENS_PER_OUTPUT_TOKEN = 5  # weight of prefill against decode in `score`: the conversation trace has 1155 prompt tokens per 211 output on average
PROBE_TEXT = (
    "The river rose slowly through the night, and by morning the low fields were under water. Farmers moved "
    "their animals to the hills, while the children watched the boats drift past the church. Nobody in the "
    "village could remember a flood like it, although the old miller said his grandfather had spoken of one. "
    "By noon the rain had stopped, the clouds broke apart, and the sun came out over a shining, silent valley. "
)


# ------------------------------------------------------------------ candidates


class Candidate(Impls):
    """One implementation to time (backends.Impls), with how the model is prepared for it."""

    def prepare(self, cfg: ModelConfig, params: Params, *, auto_weights: bool = False) -> tuple[ModelConfig, Params]:
        """The (config, params) this candidate runs: the model in its dtype. `auto_weights`: the params are a
        GGUF's blocks kept for quantization='auto' (`keeps_blocks`), which only 'cpu_int8' multiplies as they
        are; every other candidate runs them dense (`dense_params`), as the dense load would give them, where
        that fits (`dense_fits`), else the kept blocks dequantized a layer at a time in the step."""
        if auto_weights and self.matmul_impl != "cpu_int8" and dense_fits(params):
            params = dense_params(params)
        elif auto_weights and self.matmul_impl != "cpu_int8":  # a tied K-quant head, dequantized a chunk at a time
            params = panels.with_packed_head(params)
        return cast_model(cfg, params, self.dtype)

    def extra_bytes(self, cfg: ModelConfig, params: Params, *, auto_weights: bool = False) -> int:
        """Bytes of the new weight arrays this candidate's engine makes beside `params`, from shapes only
        (jax.eval_shape): the dense copy (`prepare` on kept blocks), the cast to its dtype, and the matmul
        path's packed copy (Engine: panels for 'cpu' and 'cpu_int8'). Counted as if all lived at once."""
        def nbytes(tree) -> int:
            return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))

        total, stage = 0, params
        if auto_weights and self.matmul_impl != "cpu_int8" and dense_fits(params):
            stage = jax.eval_shape(dense_params, stage)
            total += nbytes(stage)
        if cfg.dtype != self.dtype:
            stage = jax.eval_shape(lambda p: cast_model(cfg, p, self.dtype)[1], stage)
            total += nbytes(stage)
        if self.matmul_impl in ("cpu", "cpu_int8"):  # 'int8' marks the same arrays
            total += _new_panel_bytes(jax.eval_shape(packer(self.matmul_impl), stage), stage)
        return total


def _new_panel_bytes(packed: Params, params: Params) -> int:
    """Bytes of the panels `packed` (pack_panels' output, shapes) holds beyond `params`: its panel tensors less the
    K-quant panels packed at load, which pack_panels hands through as they are (norms and biases are never repacked)."""
    def panel_bytes(tree, types) -> int:
        kept = [leaf for leaf in jax.tree.leaves(tree, is_leaf=panels.is_panel) if isinstance(leaf, types)]
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(kept))

    made = panel_bytes(packed, (panels.PanelTensor, panels.QuantPanelTensor, panels.KQuantPanelTensor))
    return made - panel_bytes(params, (panels.KQuantPanelTensor, panels.QuantPanelTensor))  # loaded params' are packed at load


def dense_bytes(params: Params) -> int:
    """Bytes of `params` with every quantized matrix dequantized to f32 (from shapes only)."""
    def size(leaf) -> int:
        if isinstance(leaf, jax.Array):
            return leaf.size * leaf.dtype.itemsize
        return 4 * math.prod(leaf.shape) if hasattr(leaf, "shape") else 0

    return sum(size(leaf) for leaf in jax.tree.leaves(params, is_leaf=panels.is_quantized_weight))


def dense_fits(params: Params) -> bool:
    """Whether kept blocks may be expanded to a dense f32 copy: the whole dense model within
    EXPANSION_SLACK_BYTES (beside the kept blocks it would exceed the file + pool + 1 GiB rule otherwise).
    Logs, once per model size, when it does not."""
    need = dense_bytes(params)
    fits = need <= EXPANSION_SLACK_BYTES
    if not fits and need not in _logged_expansions:
        _logged_expansions.add(need)
        log.info("tuning: a dense f32 copy of the kept weights would take %.2f GiB (> %.2f GiB over the file that loading may use); "
                 "candidates other than matmul 'cpu_int8' run the kept blocks dequantized a layer at a time", need / 2**30, EXPANSION_SLACK_BYTES / 2**30)
    return fits


_logged_expansions: set[int] = set()


def default_candidates(pins: Impls, backend: str | None = None, *, int8_weights: bool = False, affine_weights: bool = False) -> list[Candidate]:
    """backends.candidates as the tuner's Candidates."""
    found = backends.candidates(pins, backend, int8_weights=int8_weights, affine_weights=affine_weights)
    return [Candidate(c.dtype, c.attention_impl, c.matmul_impl) for c in found]


def weight_kinds(params: Params, *, auto_weights: bool = False) -> dict[str, bool]:
    """`default_candidates`' keywords for these params: which quantized matrices they hold (with
    `auto_weights`, only the kernel's candidates see them quantized: `Candidate.prepare`)."""
    return dict(int8_weights=not auto_weights and quant.has_int8_weights(params), affine_weights=panels.has_affine_weights(params))


def weight_formats(params: Params) -> tuple[str, ...]:
    """The loaded weights' quantized storage formats as "kind:format" (params.weight_bytes' keys), for the cache
    key; dense arrays are left out, as their dtype is the tuner's choice."""
    return tuple(sorted(f"{kind}:{fmt}" for kind, fmt in weight_bytes(params) if fmt not in ("float32", "bfloat16", "float16")))


def keeps_blocks(quantization: str | None, params: Params) -> bool:
    """Whether `params` are a GGUF's blocks kept for quantization='auto' (see backends.resolve_quantization)."""
    return quantization == "auto" and panels.has_affine_weights(params)


# ------------------------------------------------------------------ measuring

@dataclasses.dataclass(frozen=True)
class Probe:
    """The probe workload: its engine config (one prefill and one decode program) and its prompts."""

    engine_cfg: EngineConfig
    prompts: list[list[int]]


def make_probe(engine_cfg: EngineConfig, prompt_ids: list[int], max_prompt_tokens: int | None = None) -> Probe:
    """One packed prefill row of a middle chunk bucket holding the prompts of a middle decode-row bucket,
    then NUM_GENERATED decode steps of those rows: each a key of the user's tables but for its page width
    (a context of one chunk plus the generation, or of the pages the packed row's table needs: it holds
    every sequence's pages). `max_prompt_tokens`: each prompt cut to at most that many tokens (`tune` gives
    BIG_MODEL_PROMPT_TOKENS for a big model); the programs, and so the timed shapes, stay the same (the row is
    padded to its bucket); only the f32 reference, whose prefill costs tokens x weights, gets cheaper."""
    tables = BucketTables.from_config(engine_cfg)
    packed = tables.packed
    rows = min(tune_attention.middle_bucket(tables.decode_rows), engine_cfg.max_prefill_seqs if packed else 1)
    chunk = tune_attention.middle_bucket(tables.chunk_tokens)
    page = engine_cfg.page_size
    longest = chunk // rows if packed else chunk
    context = page * max(-(-(chunk + NUM_GENERATED) // page), rows * -(-longest // page) if packed else 0)
    probe_cfg = EngineConfig.with_overrides(
        engine_cfg, max_context=context, max_num_seqs=rows, max_prefill_tokens=chunk, prefill_chunk_buckets=(chunk,),
        decode_batch_buckets=(rows,), decode_page_buckets=(context // page,), buckets=None, num_pages=rows * (context // page) * 2 + 1,
        enable_prefix_caching=False, max_prefill_seqs=rows if packed else engine_cfg.max_prefill_seqs,
        compile_threads=1,  # its two programs compiled one after the other: XLA's compile memory once, not twice, at the peak
    )
    per_prompt = min(_prompt_length(probe_cfg, rows, longest), max_prompt_tokens or longest)
    ids = list(prompt_ids) * (-(-per_prompt * rows // max(len(prompt_ids), 1)) + 1)
    return Probe(probe_cfg, [ids[i * per_prompt: (i + 1) * per_prompt] for i in range(rows)])


def _prompt_length(probe_cfg: EngineConfig, rows: int, longest: int) -> int:
    """The longest prompt length <= `longest` whose `rows` prompts the scheduler prefills in one step (a
    packed row's page table bounds it too), found by dry runs (host only, milliseconds)."""
    for length in range(longest, 1, -1):
        plans, _ = runloop.dry_run(probe_cfg, [[row + 1] * length for row in range(rows)], [NUM_GENERATED] * rows)
        if plans[0].bucket.phase == "prefill" and len(plans[0].request_ids) == rows:
            return length
    return 1


def reference_run(cfg: ModelConfig, params: Params, prompts: list[list[int]], num_tokens: int = NUM_GENERATED, *, w8a8: bool = False) -> Reference:
    """The float32 reference, by model.forward's parts (XLA dots, jnp attention) over right-padded rows with a dense KV
    cache: one prefill of every prompt (causal: the padding is inert, and each row's first generated token
    overwrites the padding slot at its position), then one-token steps, so the model runs num_tokens times on
    one token per row, not on the whole context again. K-quant panels packed at load are dequantized a layer at
    a time (read="dense"), never through the W8A8 kernel; the head's logits come from `reference_logits`,
    REFERENCE_HEAD_ROWS vocabulary entries at a time, so no f32 copy of the whole head (1 GiB for Llama-3.2-1B's
    tied table, 2 GiB for Llama-3.1-8B's) and no second packed copy of it is ever made. `w8a8`: the W8A8 kernels'
    exact reference instead (w8a8_exact.with_fake_quant: the activations of every matrix they read quantized
    by their rule; a tied head they read is packed once more, as the kernel's engine packs it)."""
    cfg32, params32 = cast_model(cfg, panels.with_read(params, "dense"), "float32")
    if w8a8:
        params32 = w8a8_exact.with_fake_quant(params32)
    lengths = np.array([len(p) for p in prompts], np.int32)
    ids = np.zeros((len(prompts), int(lengths.max())), np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = prompt
    cache = kvp.init_dense_cache(cfg32, len(prompts), ids.shape[1] + num_tokens)
    step = jax.jit(lambda p, cache, tokens, positions, last: _reference_step(p, cache, tokens, positions, last, cfg32), donate_argnums=1)
    positions, last = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape), lengths - 1
    steps, tokens = [], []
    for _ in range(num_tokens):
        hidden, cache = step(params32, cache, ids, positions, last)  # [R, 1, D]
        logits = reference_logits(params32, hidden, cfg32)  # [R, V]
        next_ids = logits.argmax(axis=-1).astype(np.int32)
        steps.append(logits)
        tokens.append(next_ids)
        ids, positions, last = next_ids[:, None], lengths[:, None].copy(), np.zeros_like(lengths)
        lengths = lengths + 1
    return Reference(np.stack(tokens, axis=1), np.stack(steps, axis=1))


def _reference_step(params: Params, cache, tokens, positions, last, cfg: ModelConfig):
    """(f32[R, 1, D] hidden states, before the final norm, at token index `last` of each row; the dense cache):
    tokens, positions [R, T]. model.forward without its head (`reference_logits` applies it)."""
    x, cache = model.hidden_states(params, cache, tokens, positions, cfg=cfg)  # [R, T, D]
    return model.hidden_at(x, last), cache


def reference_logits(params: Params, hidden: jax.Array, cfg: ModelConfig, rows: int = REFERENCE_HEAD_ROWS) -> np.ndarray:
    """f32[R, V]: model.logits_from_hidden (final norm, head, softcap) of `hidden` [R, 1, D], `rows` vocabulary
    entries at a time (panels.vocab_slice: the head's own format, dequantized one slice at a time by the model's
    own matmul), so at most [D, rows] of the head exists in f32. Each logit is the same dot over D as in the whole
    head's matmul; `rows` is a multiple of the K-quant panel width."""
    tied = params.lm_head is None
    head = params.embed if tied else params.lm_head
    out = np.empty((hidden.shape[0], cfg.vocab_size), np.float32)
    for start in range(0, cfg.vocab_size, rows):
        stop = min(start + rows, cfg.vocab_size)
        part = panels.vocab_slice(head, start, stop, tied=tied)
        sliced = dataclasses.replace(params, **{"embed" if tied else "lm_head": part})
        out[:, start:stop] = np.asarray(_head_logits(sliced, hidden, cfg))[:, 0]  # [R, stop - start]
    return out


_head_logits = jax.jit(model.logits_from_hidden, static_argnames="cfg")  # one program per slice width (two at most)


class _Pruned(Exception):
    """A probe generation stopped early: its steps so far already score above the bound it was given."""

    def __init__(self, seconds: dict):
        super().__init__("pruned")
        self.seconds = seconds


def _probe_generation(engine, probe: Probe, prune_above: float | None = None) -> tuple[list[list[int]], dict, dict]:
    """One greedy generation of the probe prompts through the real scheduler and engine. Returns (tokens per
    prompt, {phase: [step seconds]}, {prompt index: logits f32[V] at its prompt's last token}). With
    `prune_above`, raises _Pruned as soon as the fastest prefill step and the fastest decode step so far score
    above it (a candidate that dequantizes a 1B model every step is known slow after two steps, not ten)."""
    scheduler = Scheduler(probe.engine_cfg, engine.num_pages)
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_GENERATED, ignore_eos=True)
    for i, prompt in enumerate(probe.prompts):
        scheduler.add(Request(str(i), list(prompt), greedy, seed=i, arrival_index=i))
    seconds, logits = {"prefill": [], "decode": []}, {}

    def on_step(plan, tokens, step_seconds):
        seconds[plan.bucket.phase].append(step_seconds)
        if plan.bucket.phase == "prefill":  # a prompt's last prefill step (the one it ends in) is the one kept
            for slot, request_id in enumerate(plan.request_ids):
                logits[int(request_id)] = engine.last_logits[slot].copy()
        if prune_above is not None and seconds["decode"] and _score(probe, 1e3 * min(seconds["prefill"]), 1e3 * min(seconds["decode"])) > prune_above:
            raise _Pruned(seconds)

    finished = list(runloop.run(scheduler, engine.step, OutputProcessor(None, None, probe.engine_cfg.max_context), on_step=on_step))
    errors = [r.error for r in finished if r.finish_reason == "error"]
    if errors:
        raise RuntimeError(f"the probe generation failed: {errors[0]}")
    by_index = sorted(finished, key=lambda r: int(r.request_id))
    return [list(r.output_ids) for r in by_index], seconds, logits


def measure(candidate: Candidate, cfg: ModelConfig, params: Params, probe: Probe, reference: Reference,
            best_score: float | None = None, *, auto_weights: bool = False, exact_reference: Reference | None = None) -> Measurement:
    """Time `candidate` on the probe over NUM_TIMED_RUNS generations (prefill: the fastest of its steps, so a
    first call or a busy neighbour does not count; decode: the median of its steps) and check its numerics
    against `reference` (reference_run's float32 one) or, for a W8A8 kernel candidate (`uses_exact_reference`), against
    `exact_reference` (reference_run's w8a8 one), its error against f32 kept beside it. With `best_score` (the best passing score so far), a candidate whose
    first steps (or first generation) score above PRUNE_FACTOR times it is not timed further and does not pass
    (note 'pruned'). Its engine is freed before this returns."""
    row, engine, cand_params, matmul_error = dict(impls=candidate.impls()), None, None, None
    try:
        cand_cfg, cand_params = candidate.prepare(cfg, params, auto_weights=auto_weights)
        engine_cfg = EngineConfig.with_overrides(probe.engine_cfg, attention_impl=candidate.attention_impl, matmul_impl=candidate.matmul_impl)
        engine = Engine(cand_cfg, cand_params, engine_cfg, return_logits=True)
        engine.warmup()
        if uses_exact_reference(candidate):  # each kernel matmul against the exact reference, on the same activations
            matmul_error = w8a8_exact.kernel_matmul_error(engine.step_params, cand_params)
        bound = None if best_score is None else PRUNE_FACTOR * best_score
        runs = [_probe_generation(engine, probe, prune_above=bound)]
        if bound is None or _score(probe, *_timings(runs)) <= bound:
            runs += [_probe_generation(engine, probe) for _ in range(NUM_TIMED_RUNS - 1)]
    except _Pruned as pruned:  # its first steps were enough
        runs = [([], pruned.seconds, {})]
    except (ValueError, RuntimeError) as e:
        return Measurement(**row, note=f"cannot run: {e}")
    finally:
        engine = cand_params = None  # noqa: F841
        release_freed_memory()  # this candidate's engine (its pool, packed or dense copies, programs) is gone before the next is built
    tokens, _, logits = runs[0]
    prefill, decode = _timings(runs)
    score = _score(probe, prefill, decode)
    if len(runs) < NUM_TIMED_RUNS:
        return Measurement(**row, prefill_ms=prefill, decode_ms=decode, score=score, note=f"pruned: {score / best_score:.1f}x the best score")
    f32_error = logit_error(logits, reference)
    if uses_exact_reference(candidate):
        reference = exact_reference if exact_reference is not None else reference_run(cfg, params, probe.prompts, w8a8=True)
    error = logit_error(logits, reference)
    tolerance = tolerance_for(candidate)
    agreement = _greedy_agreement(tokens, reference, tolerance)
    matmul_ok = matmul_error is None or matmul_error <= W8A8_MATMUL_TOLERANCE
    passed = error <= tolerance.max_relative_error and agreement >= tolerance.min_greedy_agreement and matmul_ok
    note = ("" if passed else f"a kernel matmul's error {matmul_error:.2e} > {W8A8_MATMUL_TOLERANCE:g}" if not matmul_ok
            else f"error {error:.2e} > {tolerance.max_relative_error:g}" if error > tolerance.max_relative_error else f"greedy {agreement:.2f} < {tolerance.min_greedy_agreement:g}")
    return Measurement(**row, prefill_ms=prefill, decode_ms=decode, score=score, relative_error=error, greedy_agreement=agreement, passed=passed, note=note,
                       f32_relative_error=f32_error if uses_exact_reference(candidate) else None, matmul_error=matmul_error)


def measure_all(candidates: list[Candidate], cfg: ModelConfig, params: Params, probe: Probe, budget: float, *, progress=None,
                auto_weights: bool = False) -> list[Measurement]:
    """Every candidate measured on the probe against the float32 reference, in order (each pruned against
    the best passing score so far), except those whose new weights exceed `budget` bytes (`too_large`), and,
    on kept blocks too large to expand (`dense_fits`), those that would dequantize them every step once a
    kernel candidate has passed (`dequantizes_kept_blocks`)."""
    start = time.perf_counter()
    reference = reference_run(cfg, params, probe.prompts)
    log.info("tuning: the float32 reference of %d prompts of %d tokens took %.1f s", len(probe.prompts), len(probe.prompts[0]), time.perf_counter() - start)
    exact = None
    if any(uses_exact_reference(c) for c in candidates):
        start = time.perf_counter()
        exact = reference_run(cfg, params, probe.prompts, w8a8=True)
        log.info("tuning: the W8A8 kernels' exact reference took %.1f s", time.perf_counter() - start)
    release_freed_memory()  # the references' transients, before the first candidate's engine
    measurements = []
    expands = auto_weights and dense_fits(params)
    for candidate in candidates:
        best = min((m.score for m in measurements if m.passed), default=None)
        kernel_passed = any(m.passed and m.impls.matmul_impl == "cpu_int8" for m in measurements)
        if auto_weights and not expands and candidate.matmul_impl != "cpu_int8" and kernel_passed:
            measurements.append(dequantizes_kept_blocks(candidate))
        elif (need := candidate.extra_bytes(cfg, params, auto_weights=auto_weights)) > budget:
            measurements.append(too_large(candidate, need, budget))
        else:
            measurements.append(measure(candidate, cfg, params, probe, reference, best_score=best, auto_weights=auto_weights, exact_reference=exact))
        log.info("tuning: %s: %s (score %s)", measurements[-1].candidate, measurements[-1].status, measurements[-1].score)  # a killed run still shows its rows
        if progress is not None:
            progress(measurements[-1])
    return measurements


def dequantizes_kept_blocks(candidate: Candidate) -> Measurement:
    """The row of a candidate not built because it would dequantize kept blocks, too large to expand, in every
    step where a kernel candidate that reads them as they are has passed. Measured on the 2-layer Llama-3.2-1B
    Q4_K_M (loaded 2-core EPYC): such candidates scored 8-46x the kernel's and their engines peaked 1.4-1.5 GB
    above it, past the file + pool + 1 GiB rule; on the 1B files 9-60x in the tuning cache."""
    return Measurement(candidate.impls(), note="not built: it dequantizes kept blocks every step, and the kernel candidate passed")


def too_large(candidate: Candidate, need: int, budget: float) -> Measurement:
    """The row of a candidate not built for want of memory (it does not pass)."""
    return Measurement(candidate.impls(), note=f"not built: its weights need {need / 2**30:.2f} GiB, the budget is {budget / 2**30:.2f} GiB")


def _timings(runs: list) -> tuple[float, float]:
    """(prefill ms, decode ms) of `runs` (_probe_generation's): the fastest prefill step, the median decode step."""
    prefill = 1e3 * min(s for _, seconds, _ in runs for s in seconds["prefill"])
    return prefill, 1e3 * statistics.median(s for _, seconds, _ in runs for s in seconds["decode"])


def _score(probe: Probe, prefill: float, decode: float) -> float:
    """ms per PROMPT_TOKENS_PER_OUTPUT_TOKEN prompt tokens and one output token."""
    chunk, rows = probe.engine_cfg.prefill_chunk_buckets[0], probe.engine_cfg.decode_batch_buckets[0]  # make_probe gives both
    return PROMPT_TOKENS_PER_OUTPUT_TOKEN * prefill / chunk + decode / rows


class NoCandidatePassed(ValueError):
    """Every candidate failed its numerics check (or could not run): nothing can be chosen."""


def pick(measurements: list[Measurement]) -> Measurement:
    """The passing measurement of least score; raises NoCandidatePassed if none passed."""
    passing = [m for m in measurements if m.passed]
    if not passing:
        raise NoCandidatePassed("no candidate passed the numerics check: " + "; ".join(f"{m.candidate}: {m.status}" for m in measurements))
    return min(passing, key=lambda m: m.score)


# ------------------------------------------------------------------ the entry point


def narrow_attention(cfg: ModelConfig, engine_cfg: EngineConfig, candidates: list[Candidate]) -> tuple[list[Candidate], list]:
    """(the candidates with, per compute dtype, only the attention impl that tune_attention.choose_attention
    times fastest on the engine's contexts; those timings)."""
    chosen, rows = {}, []
    for dtype in dict.fromkeys(c.dtype for c in candidates):
        impls = list(dict.fromkeys(c.attention_impl for c in candidates if c.dtype == dtype))
        chosen[dtype], timed = tune_attention.choose_attention(cfg, engine_cfg, dtype, impls, PROMPT_TOKENS_PER_OUTPUT_TOKEN)
        rows += timed
    return [c for c in candidates if c.attention_impl == chosen[c.dtype]], rows


def fixed_choice(pins: Impls) -> Impls:
    """The choice without measuring: float32 for an auto dtype, the engine's fixed rules for the rest."""
    return Impls("float32" if pins.dtype == "auto" else pins.dtype, pins.attention_impl, pins.matmul_impl)


def tune(cfg: ModelConfig, params: Params, engine_cfg: EngineConfig, pins: Impls, *, prompt_ids: list[int] | None = None,
         candidates: list[Candidate] | None = None, progress=None, quantization: str | None = None, memory_budget: float | None = None) -> TuneResult:
    """Measure every candidate now (nothing cached is read or written). `progress(measurement)` is called
    after each. The pins are filled in from the winner; the result's choice has source 'tuned'.
    `quantization`: the LoadOptions value the params were loaded for ('auto': see `keeps_blocks`).
    `memory_budget`: bytes a candidate's new weight arrays may take (`Candidate.extra_bytes`; None:
    MEMORY_SHARE of the device's free memory now); a larger one is not built and cannot win, so a model
    whose f32 copies do not fit (a 3B GGUF on 24 GiB) keeps the candidates that do."""
    start = time.perf_counter()
    auto_weights = keeps_blocks(quantization, params)
    attention = []
    if candidates is None:
        candidates, attention = narrow_attention(cfg, engine_cfg, default_candidates(pins, **weight_kinds(params, auto_weights=auto_weights)))
        if progress is not None:
            for row in attention:
                progress(row)
    candidates = [c for c in candidates if c.fits(pins)]  # pins hold
    if auto_weights:
        candidates = backends.kernel_first(candidates, dense_fits=dense_fits(params))
    if not candidates:
        raise ValueError(f"no candidate keeps the pins {pins}")
    if prompt_ids is None:
        prompt_ids = np.random.default_rng(0).integers(1, cfg.vocab_size, 256).tolist()
    big = dense_bytes(params) > EXPANSION_SLACK_BYTES  # its f32 reference dequantizes every weight per forward
    probe = make_probe(engine_cfg, prompt_ids, max_prompt_tokens=BIG_MODEL_PROMPT_TOKENS if big else None)
    budget = MEMORY_SHARE * available_bytes(jax.devices()[0]) if memory_budget is None else memory_budget
    measurements = measure_all(candidates, cfg, params, probe, budget, progress=progress, auto_weights=auto_weights)
    best = pick(measurements)
    # jax's caches still held the references', the attention timings' and the candidate engines' programs and traces (Gemma-3-1B-shaped
    # Q4_K_M: the tuner left 121 MiB resident, 17 MiB with them cleared); the chosen engine compiles ahead of time after this: no step recompiles
    jax.clear_caches()
    release_freed_memory()  # before the chosen engine is built
    keys = BucketTables.from_config(probe.engine_cfg).all_keys()
    return TuneResult(best.impls, measurements, source="tuned", seconds=time.perf_counter() - start, attention=attention,
                      prefill_key=next(k for k in keys if k.phase == "prefill"), decode_key=next(k for k in keys if k.phase == "decode"),
                      probe_prompts=(len(probe.prompts), len(probe.prompts[0]), big))


def choose(cfg: ModelConfig, params: Params, engine_cfg: EngineConfig, pins: Impls, *, quantization: str | None = None,
           on_mesh: bool = False, prompt_ids: list[int] | None = None, enabled: bool | None = None, directory: Path | None = None,
           candidates: list[Candidate] | None = None, use_cache: bool = True, refresh: bool = False, progress=None) -> TuneResult:
    """The choice for an engine: the fixed rule (tuning off, everything pinned, a mesh or deterministic mode,
    whose layouts the tuner does not measure), else the cached choice for this machine, model and limits, else
    measured now (`tune`) and cached. `enabled`: None reads JAXINFER_TUNE. `use_cache`: read and write the
    cache; `refresh`: measure even where a choice is cached (and overwrite it)."""
    enabled = tuning_enabled() if enabled is None else enabled
    reason = (f"{TUNE_ENV}=0" if not enabled else "every choice is pinned" if pins.all_pinned
              else "a mesh (tensor or data parallelism)" if on_mesh else "deterministic mode" if engine_cfg.deterministic else "")
    if reason:
        return TuneResult(fixed_choice(pins), [], reason=reason)
    if candidates is None and len(only := default_candidates(pins, **weight_kinds(params, auto_weights=keeps_blocks(quantization, params)))) == 1:  # nothing to compare
        return TuneResult(only[0].impls(), [], reason="one candidate keeps the pins")
    directory = cache_dir() if directory is None else Path(directory)
    fingerprint = machine_fingerprint()
    loaded = None if quantization == "auto" and not keeps_blocks(quantization, params) else quantization  # 'auto' loaded dense is None
    key = cache_key(fingerprint, cfg, engine_cfg, pins, loaded, weight_formats(params))
    if use_cache and not refresh and (cached := read_cached(directory, key)) is not None:
        return cached
    result = dataclasses.replace(tune(cfg, params, engine_cfg, pins, prompt_ids=prompt_ids, candidates=candidates, progress=progress, quantization=quantization), key=key)
    if use_cache:
        try:
            result = dataclasses.replace(result, path=write_cached(directory, result, fingerprint))
        except OSError as e:  # a read-only home: the choice holds for this run, uncached
            warnings.warn(f"jaxinfer: the tuning cache {directory} is not writable ({e}); the choice is not cached", stacklevel=2)
    return result


def format_table(result: TuneResult) -> str:
    """The tuner's table: candidate, ms per program, the numerics check, and which one was chosen."""
    header = f"{'candidate':<28} {'prefill ms':>10} {'decode ms':>10} {'score':>8} {'rel. error':>10} {'greedy':>7}  check"
    lines = []
    if result.prefill_key is not None:
        lines.append(f"programs: prefill {result.prefill_key}, decode {result.decode_key}")
    if result.probe_prompts:
        count, length, big = result.probe_prompts
        lines.append(f"probe: {count} prompts of {length} tokens, {NUM_GENERATED} greedy tokens each" + (
            f" (prompts cut to {BIG_MODEL_PROMPT_TOKENS} tokens: the dense f32 weights exceed {EXPANSION_SLACK_BYTES / 2**30:g} GiB, "
            "and the f32 reference dequantizes them for every token; the timed programs are the same buckets)" if big else ""))
    lines += [header, "-" * len(header)]
    chosen = result.choice.name
    cell = lambda value, fmt: format(value, fmt) if value is not None else "-"  # noqa: E731
    for m in result.measurements:
        mark = "  <- chosen" if m.candidate == chosen else ""
        lines.append(f"{m.candidate:<28} {cell(m.prefill_ms, '10.1f')} {cell(m.decode_ms, '10.1f')} {cell(m.score, '8.3f')} "
                     f"{cell(m.relative_error, '10.2e')} {cell(m.greedy_agreement, '7.2f')}  {m.status}{_against(m)}{mark}")
    lines.append(f"score = {PROMPT_TOKENS_PER_OUTPUT_TOKEN} x prefill ms per token + decode ms per token; chosen: {result.describe()}")
    return "\n".join(_attention_lines(result.attention) + lines)


def _against(m: Measurement) -> str:
    """What a W8A8 kernel's row was checked against (its exact reference), with its error against f32 beside it."""
    if m.f32_relative_error is None:
        return ""
    matmul = "" if m.matmul_error is None else f"; kernel matmuls {m.matmul_error:.1e}"
    return f" (exact W8A8 reference{matmul}; vs f32 {m.f32_relative_error:.2e})"


def _attention_lines(rows: list) -> list[str]:
    """The attention section of the tuner's table (tune_attention.py's timings, all layers, ms per token),
    the least score of each dtype marked."""
    if not rows:
        return []
    header = f"{'attention alone':<28} {'prefill ms':>10} {'decode ms':>10} {'score':>8}  (per token, all layers, the engine's contexts)"
    cell = lambda value, width: f"{value:{width}.4f}" if value is not None else f"{'-':>{width}}"  # noqa: E731
    best = {}
    for r in rows:
        if r.score is not None and r.score < best.get(r.dtype, float("inf")):
            best[r.dtype] = r.score
    lines = [header, "-" * len(header)]
    for r in rows:
        mark = "  <- chosen" if r.score is not None and r.score == best[r.dtype] else f"  {r.note}" if r.note else ""
        lines.append(f"{r.dtype + '/' + r.attention_impl:<28} {cell(r.prefill_ms, 10)} {cell(r.decode_ms, 10)} {cell(r.score, 8)}{mark}")
    return lines + [""]


def choose_for_model(cfg: ModelConfig, params: Params, engine_cfg: EngineConfig, pins: Impls, *, tokenizer=None, **kwargs) -> TuneResult:
    """`choose` with the probe prompts cut from PROBE_TEXT in the model's own tokenizer (random ids without one)."""
    prompt_ids = None if tokenizer is None else tokenizer.encode(PROBE_TEXT, add_bos=False, parse_special=False)
    return choose(cfg, params, engine_cfg, pins, prompt_ids=prompt_ids, **kwargs)


def apply_choice(choice: Impls, cfg: ModelConfig, params: Params, engine_cfg: EngineConfig, quantization: str | None = None) -> tuple[ModelConfig, Params, EngineConfig]:
    """(cfg, params, engine_cfg) as `choice` says: the model cast to its dtype (and, for blocks kept under
    quantization='auto', dense unless the choice multiplies them: `Candidate.prepare`), its impls set on the
    engine config (left as it is when they already are, so a fixed choice changes nothing)."""
    candidate = Candidate(*dataclasses.astuple(choice.impls()))
    cfg, params = candidate.prepare(cfg, params, auto_weights=keeps_blocks(quantization, params))
    impls = {"attention_impl": choice.attention_impl, "matmul_impl": choice.matmul_impl}
    if any(getattr(engine_cfg, name) != value for name, value in impls.items()):
        engine_cfg = EngineConfig.with_overrides(engine_cfg, **impls)
    return cfg, params, engine_cfg
