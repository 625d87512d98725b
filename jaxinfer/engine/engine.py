"""The step loop's device half: one compiled program per bucket key, and the donated KV pool.

`Engine` owns the params, the KV pool and a table of ahead-of-time compiled programs, one per bucket key
(phase, rows, tokens per row, pages per row). `warmup()` compiles all of them before any traffic, with
JAX's persistent compilation cache enabled; afterwards `step(plan)` only looks programs up, so nothing
compiles after warm-up (calling a compiled program with another shape is an error, not a compile).
The pool is donated into every step and rebound on the same line. The engine knows nothing about text.

`params` is the model as it was loaded (on the mesh, with one); the compiled programs run over
`step_params`, which for the CPU kernels holds the layer matrices repacked into panels (panels.py) and is
`params` itself otherwise. References (generate.py) run over `params`, so they stay independent of the kernels.

With a `mesh` (tensor parallelism, sharding.py owns the layout) the params are put on it by the logical
axis rules, the pool is allocated sharded over kv heads, and every program is compiled with explicit
in/out shardings: params and pool as the rules say, the step's inputs and its tokens/logits replicated,
the pool out exactly as in so the donation aliases. Without one (the default) nothing changes: one
device, no shardings given.
"""

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import pickle
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model import kv_pool as kvp
from jaxinfer.scheduling import guided
from jaxinfer.model import forward as model, panels, quant, sampling
from jaxinfer.model import sharding as shd
from jaxinfer.engine import host_memory
from jaxinfer.engine.pool_size import resolve_num_pages
from jaxinfer.engine.backends import packer, resolve_impl, resolve_matmul_impl
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.model.params import Params
from jaxinfer.scheduling.bucket_tables import BucketTables
from jaxinfer.scheduling.kv_manager import page_release_window
from jaxinfer.scheduling.plan import BucketKey, Logprobs, StepPlan, StepResult
from jaxinfer.scheduling.step_costs import StepCosts
from jaxinfer.validation import FieldError

log = logging.getLogger(__name__)


_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")


class CompileCounter:
    """Counts JAX traces and backend compiles in the process while active (a context manager).

    Independent of the engine's own bookkeeping: it listens to jax.monitoring, so any compile anywhere
    (a stray jnp op on a new shape, a jit cache miss) is seen.
    """

    def __init__(self):
        self.count = 0
        self.events: list[str] = []

    def _listener(self, event: str, duration: float, **_) -> None:
        if event in _COMPILE_EVENTS:
            self.count += 1
            self.events.append(event)

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    token_ids: jax.Array  # i32[R, T]
    positions: jax.Array  # i32[R, T]
    pages: kvp.PageMeta
    logit_indices: jax.Array  # i32[R, J]; J sequences per row (1 unless the row is packed)
    sampling: sampling.SamplingArrays  # [R * J] each
    prompt_lens: jax.Array  # i32[R * J]; positions below are the slot's prompt (the penalties' split)
    targets: jax.Array  # i32[R, T]; prompt token after each token whose prompt logprobs are wanted, -1 else


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepLogits:
    """What a step's forward program leaves on the device for its draw program."""

    adjusted: jax.Array  # f32[R * J, V]; after the bias and the penalties (sampling.adjust), before the grammar's mask
    raw: jax.Array | None  # f32[R * J, V]; the model's logits, kept for raw log-probabilities and return_logits, else None
    prompt_logprobs: sampling.Logprobs  # [R * T]; zeros unless a token has a target
    pooled_last: jax.Array  # f32[R * J, D]; each slot's final hidden state (after the final norm) at its logit index
    pooled_sum: jax.Array  # f32[R * J, D]; the same summed over the slot's chunk (an embedding's, Request.keep_pooled)


def inputs_from_plan(plan: StepPlan) -> StepInputs:
    """The forward program's device inputs (the grammar's masks are the draw's: `token_masks`)."""
    pages = kvp.PageMeta(plan.block_tables, plan.slot_pages, plan.slot_offsets, plan.page_positions, plan.page_segments, plan.token_segments)
    arrays = sampling.SamplingArrays(
        plan.temperature, plan.top_k, plan.top_p, plan.seeds, plan.steps, plan.min_p, plan.presence, plan.frequency, plan.repetition,
        plan.bias_ids, plan.bias_values, plan.num_logprobs,
    )
    return StepInputs(plan.token_ids, plan.positions, pages, plan.logit_indices, arrays, plan.prompt_lens, plan.targets)


def token_masks(plan: StepPlan, vocab_size: int) -> np.ndarray:
    """i32[R * J, ceil(V / 32)]: each sampling slot's mask (its guide's, less min_tokens' bans: guided.fill_mask); all ones elsewhere."""
    masks = np.full((plan.seeds.shape[0], guided.mask_words(vocab_size)), -1, np.int32)
    bans = plan.bans or ((),) * len(plan.guides)
    for slot, (guide, banned, sample) in enumerate(zip(plan.guides, bans, plan.samples)):
        if sample and (guide is not None or banned):
            guided.fill_mask(masks[slot], guide, banned)
    return masks


def _forward_step(params: Params, pool: kvp.KVPool, history: jax.Array, inputs: StepInputs, *, cfg: ModelConfig, impl: str, num_top: int, keep_raw: bool):
    """A step's first program: the model, and the logit processing that reads the token history. Donates
    `pool` and `history` (i32[P, L], the token id in every pool slot, which the penalties count); returns
    (StepLogits, pool, history)."""
    history = history.at[inputs.pages.slot_pages, inputs.pages.slot_offsets].set(inputs.token_ids)
    x, pool = model.hidden_states(params, pool, inputs.token_ids, inputs.positions, cfg=cfg, pages=inputs.pages, attention_impl=impl)
    logits = model.logits_from_hidden(params, model.hidden_at(x, inputs.logit_indices), cfg)  # [R, J, V]
    raw = logits.reshape(-1, logits.shape[-1]).astype(jnp.float32)  # [R * J, V]
    counts = functools.partial(token_counts, history, inputs, cfg.vocab_size)
    adjusted = sampling.adjust(raw, inputs.sampling, counts)
    pooled = _pooled_hidden(params, x, inputs, cfg)
    return StepLogits(adjusted, raw if keep_raw else None, _prompt_logprobs(params, x, inputs.targets, cfg, num_top), *pooled), pool, history


def _pooled_hidden(params: Params, x, inputs: StepInputs, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Each sequence slot's final hidden states (after the final norm, f32, as logits_from_hidden norms them):
    at its logit index (the chunk's last token), and summed over its chunk's tokens (its segment, up to that
    index: a row's padding tail is left out). Embeddings pool these on the host (LLM.embed over the paged
    prefill); it is one norm and one [R, T] x [R, T, J] contraction per step, so every step computes them."""
    normed = model.rms_norm(x, params.final_norm, cfg.rms_norm_eps).astype(jnp.float32)  # [R, T, D]
    rows, slots = inputs.logit_indices.shape
    token = jnp.arange(x.shape[1], dtype=jnp.int32)[None, :, None]  # [1, T, 1]
    own = (inputs.pages.token_segments[:, :, None] == jnp.arange(slots, dtype=jnp.int32)) & (token <= inputs.logit_indices[:, None, :])  # [R, T, J]
    sums = jnp.einsum("rtd,rtj->rjd", normed, own.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)  # [R, J, D]
    last = model.hidden_at(normed, inputs.logit_indices)  # [R, J, D]
    return last.reshape(rows * slots, -1), sums.reshape(rows * slots, -1)


def _draw_step(adjusted: jax.Array, raw: jax.Array | None, arrays: sampling.SamplingArrays, *, num_top: int, mode: str):
    """A step's second program, over StepLogits' [R * J, V] arrays: the grammar's mask (arrays.token_mask),
    the tokens and their log-probabilities."""
    return sampling.draw(raw, adjusted, arrays, num_top=num_top, mode=mode)


_LOGIT_BLOCK = 64  # tokens whose vocabulary projection runs (or is skipped) together in a step's prompt logprobs


def _prompt_logprobs(params: Params, x, targets, cfg: ModelConfig, num_top: int) -> sampling.Logprobs:
    """Raw log-probabilities of each token's target (the next prompt token) and the top ones, [R * T].
    The tokens go in blocks of _LOGIT_BLOCK, and only a block holding a target runs the vocabulary
    projection: a scoring request (logprob_start) or a padded bucket computes the logits it needs, not
    the whole step's. Block shapes are fixed by the bucket, so nothing compiles per request."""
    num_tokens = targets.size
    block = np.gcd(num_tokens, _LOGIT_BLOCK)
    blocks = (num_tokens // block, block)
    hidden = x.reshape(*blocks, x.shape[-1])  # [N / b, b, D]
    flat_targets = jnp.maximum(targets, 0).reshape(blocks)  # [N / b, b]
    wanted = (targets >= 0).reshape(blocks).any(axis=1)  # [N / b]

    def scored(h, t):
        logits = model.logits_from_hidden(params, h[None], cfg)[0]  # [b, V]
        return sampling.top_logprobs(logits, t, num_top)

    def empty(h, t):
        zeros = lambda dtype, *shape: jnp.zeros((block, *shape), dtype)  # noqa: E731
        return sampling.Logprobs(zeros(jnp.float32), zeros(jnp.int32, num_top), zeros(jnp.float32, num_top))

    out = jax.lax.map(lambda args: jax.lax.cond(args[2], scored, empty, args[0], args[1]), (hidden, flat_targets, wanted))
    return jax.tree.map(lambda a: a.reshape(num_tokens, *a.shape[2:]), out)  # [N], [N, K]


def token_counts(history: jax.Array, inputs: StepInputs, vocab_size: int) -> sampling.TokenCounts:
    """Per sequence slot: how often each token was generated so far, and which tokens its prompt holds,
    read from `history` through the slot's pages (its own entries of a packed row), up to and with the
    token it samples after."""
    pages, (rows, slots) = inputs.pages, inputs.logit_indices.shape
    slot_row, segment = jnp.arange(rows * slots) // slots, jnp.arange(rows * slots) % slots  # [S]
    tokens = history[pages.block_tables[slot_row]]  # [S, P, L]
    positions = pages.page_positions[slot_row][:, :, None] + jnp.arange(history.shape[1])  # [S, P, L]
    last = jnp.take_along_axis(inputs.positions, inputs.logit_indices, axis=1).reshape(-1)  # [S]
    own = (pages.page_segments[slot_row] == segment[:, None])[:, :, None] & (positions <= last[:, None, None])
    generated = own & (positions >= inputs.prompt_lens[:, None, None])
    index = jnp.broadcast_to(jnp.arange(rows * slots)[:, None, None], tokens.shape)
    output = jnp.zeros((rows * slots, vocab_size), jnp.int32).at[index, tokens].add(generated.astype(jnp.int32))
    in_prompt = jnp.zeros((rows * slots, vocab_size), jnp.bool_).at[index, tokens].max(own & ~generated)
    return sampling.TokenCounts(output, in_prompt)


def enable_compilation_cache(directory: str | None) -> None:
    """Point JAX's persistent compilation cache at `directory`; None disables it. EngineConfig's default
    names `<cache root>/xla` (kernels_cpu.build.cache_root owns the root: $JAXINFER_CACHE_DIR, else
    $XDG_CACHE_HOME/jaxinfer, else ~/.cache/jaxinfer). A folder that cannot be made or written warns and
    leaves the cache as it was (off, unless an earlier engine enabled one): never an error."""
    import tempfile  # noqa: PLC0415  (this function's own needs; the module's imports belong to the step loop)
    import warnings  # noqa: PLC0415

    from kernels_cpu import build  # noqa: PLC0415

    if directory is None:
        return
    default = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "compilation_cache_dir")
    path = build.cache_root() / "xla" if directory == default else Path(os.path.expanduser(directory))
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):  # an existing read-only folder passes mkdir
            pass
    except OSError as err:
        warnings.warn(f"the XLA compilation cache {path} is not writable ({err}); compiling without it", stacklevel=3)
        return
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class Engine:
    """Compiled programs + donated pool. `step(plan)` runs one planned step and returns its tokens."""

    weight_version = 0  # params swaps so far (engine/weights.py rebinds params and step_params, bumps it)

    def __init__(self, cfg: ModelConfig, params: Params, engine_cfg: EngineConfig, *, mesh: jax.sharding.Mesh | None = None, return_logits: bool = False):
        """`mesh`: a sharding.make_mesh mesh for tensor parallelism (None: one device, as always).
        `return_logits`: every step also copies its rows' logits to the host (`last_logits`), for
        tests that compare logits bit for bit; it costs a [R, V] copy per step."""
        if engine_cfg.max_context > cfg.max_context:
            raise FieldError("max_context", f"({engine_cfg.max_context}) exceeds the model's context of {cfg.max_context} tokens")
        if engine_cfg.release_window not in (None, page_release_window(cfg)):  # pages a layer still reads must stay
            raise FieldError("release_window", f"({engine_cfg.release_window}) must be None or the window of every layer ({page_release_window(cfg)})")
        self.cfg, self.params, self.engine_cfg = cfg, params, engine_cfg
        # backends.resolve_impl owns the rule; in deterministic mode the kernel (16-bit decode on a GPU)
        # runs its fixed-split config, and everything else attention_over_page_blocks.
        self.impl = resolve_impl(
            engine_cfg.attention_impl, deterministic=engine_cfg.deterministic, dtype=cfg.dtype, kv_cache_dtype=engine_cfg.kv_cache_dtype,
            tensor_parallel=1 if mesh is None else shd.mesh_size(mesh),
            page_size=engine_cfg.page_size, head_dim=cfg.head_dim, group_size=cfg.num_heads // cfg.num_kv_heads,
        )
        # The CPU layer-matmul kernel reads the matrices in its own panel layout (one device only, so never with
        # a mesh); backends.resolve_matmul_impl owns whether it runs. The loaded params stay as they are. Packed
        # before the pool is sized, so free memory counts the panels.

        self.matmul_impl = resolve_matmul_impl(engine_cfg.matmul_impl, self.impl, dtype=cfg.dtype, on_mesh=mesh is not None,
                                               int8_weights=quant.has_int8_weights(params), affine_weights=panels.has_affine_weights(params))
        pack = packer(self.matmul_impl)
        self.step_params = params if pack is None else pack(params)
        enable_compilation_cache(engine_cfg.compilation_cache_dir)
        self.mesh = mesh
        device = jax.devices()[0] if mesh is None else next(d for d in mesh.devices.flat if d.process_index == jax.process_index())  # one of this process's
        self.num_pages = resolve_num_pages(cfg, engine_cfg, device, mesh=mesh)
        self.keep_raw = return_logits or engine_cfg.logprobs_mode == "raw"
        forward, draw = step_functions(cfg, engine_cfg, self.impl, keep_raw=self.keep_raw)
        init = functools.partial(kvp.init_pool, cfg, self.num_pages, engine_cfg.page_size, engine_cfg.kv_cache_dtype)
        self.history = jnp.zeros((self.num_pages, engine_cfg.page_size), jnp.int32)  # token id of every pool slot
        if mesh is None:
            self.pool = init()
            self._jitted = jax.jit(forward, donate_argnames=("pool", "history"))
            self._jitted_draw = jax.jit(draw)
        else:
            self.params = self.step_params = params = shd.shard_params(params, cfg, mesh)
            pool_sharding = shd.pool_shardings(jax.eval_shape(init), cfg, mesh)
            self.pool = jax.jit(init, out_shardings=pool_sharding)()  # allocated in place, never whole on one device
            rep = shd.replicated(mesh)
            self.history = jax.device_put(self.history, rep)
            in_shardings = (shd.param_shardings(params, cfg, mesh), pool_sharding, rep, rep)
            self._jitted = jax.jit(forward, in_shardings=in_shardings, out_shardings=(rep, pool_sharding, rep), donate_argnames=("pool", "history"))
            self._jitted_draw = jax.jit(draw, in_shardings=(rep, rep, rep), out_shardings=rep)
        self.return_logits = return_logits
        self.last_logits: np.ndarray | None = None  # f32[R, V] of the latest step, with return_logits
        self._programs: dict[tuple, jax.stages.Compiled] = {}  # bucket key -> its forward program
        self._draws: dict[int, jax.stages.Compiled] = {}  # sequence slots of a step -> its draw program
        self.overlap_masks = engine_cfg.overlap_masks
        self.num_compilations = 0
        self.refit_compilations = 0  # of num_compilations, those made after warm-up by a bucket refit (compile_programs)
        self.compile_seconds = 0.0
        self.step_costs = StepCosts()  # seconds per program key: timed at warm-up, refined by every step (step_costs.py)
        self._costs_key: str | None = None
        self._costs_read: set[str] = set()  # the step-cost cache files already read into step_costs (fill_from)

    def bucket_keys(self) -> list[BucketKey]:
        """Every key a plan can have (the engine config's BucketTables owns them)."""
        return BucketTables.from_config(self.engine_cfg).all_keys()

    def program_keys(self) -> list:
        """What warm-up compiles: every bucket key's forward program, and a draw program per sequence-slot count."""
        return program_keys(self.engine_cfg)

    def _compile(self, key) -> tuple[tuple, jax.stages.Compiled, float]:
        """A bucket key's forward program, or (an int: the step's sequence slots) its draw program."""
        start = time.perf_counter()
        with contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):  # the kernel's shard_map reads it
            state = (self.step_params, self.pool, self.history)
            compiled = lower_program(self._jitted, self._jitted_draw, key, self.engine_cfg, self.cfg.vocab_size, state, keep_raw=self.keep_raw).compile()
        return key, compiled, time.perf_counter() - start

    def warmup(self, progress=None) -> None:
        """Compile every bucket's forward program and every draw program (in parallel threads), then time those the
        step-cost table lacks (time_programs). `progress(desc=, total=)`: opens a bar (as tqdm does; `update(1)` per
        program, `close()`) for each phase with work to do; None: no bar."""
        missing = self.missing_programs(self.engine_cfg)
        self._compile_missing(missing, progress(desc="compiling programs", total=len(missing)) if progress and missing else None)
        self.time_programs(progress=progress)

    def measure(self, keys: list[BucketKey]) -> None:
        """Time these bucket keys' programs (of the current tables) as warm-up does, where neither this machine's
        cached table nor a run so far measured them, compiling those (and their draw programs) first: a plan made
        before warm-up prices its choices on them (batch/planning.engine_costs). Nothing under JAXINFER_TUNE=0."""
        from jaxinfer.engine import tuning_cache  # noqa: PLC0415

        outside = set(keys) - set(self.bucket_keys())
        if outside:
            raise ValueError(f"measure takes keys of the engine's tables; not in them: {sorted(outside)}")
        if not tuning_cache.step_timing_runs():
            return
        self.read_cached_costs()
        keys = [k for k in keys if not self.step_costs.measured(k)]
        slots = {_num_slots(k, self.engine_cfg) for k in keys}
        self._compile_missing([k for k in self.missing_programs(self.engine_cfg) if k in keys or k in slots])
        self.time_programs(keys=keys)

    def _compile_missing(self, missing: list, bar=None) -> None:
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max(1, self.engine_cfg.compile_threads)) as pool, _closing(bar):
            for key, compiled, seconds in pool.map(self._compile, missing):
                (self._draws if isinstance(key, int) else self._programs)[key] = compiled
                self.num_compilations += 1
                host_memory.trim_heap()  # the compiler's freed working memory, before the next compile adds its own
                log.info("compiled %s in %.2fs", key, seconds)
                if bar is not None:
                    bar.update(1)
        self.compile_seconds += time.perf_counter() - start

    # Fields a swapped-in config (use_config) must share with this engine's: they shape the pool or the programs' inputs.
    _KEPT_FIELDS = ("page_size", "max_context", "max_prefill_seqs", "prefill_seq_buckets", "max_logprobs", "max_logit_bias", "logprobs_mode",
                    "kv_cache_dtype", "attention_impl", "matmul_impl", "deterministic")

    def abstract_state(self) -> tuple:
        """(step params, pool, history) as shapes with their shardings: what a background compile lowers against,
        taken on the stepping thread (the pool is donated every step)."""
        spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) if isinstance(a, jax.Array) else a  # noqa: E731
        return jax.tree.map(spec, (self.step_params, self.pool, self.history))

    def compile_programs(self, engine_cfg: EngineConfig, state: tuple) -> dict:
        """The programs `engine_cfg`'s tables need that this engine lacks, compiled in the calling thread (a refit's
        background one, batch/refit.py) against `state` (abstract_state()). Compiles after warm-up: counted in
        num_compilations and refit_compilations, and logged as such. Returns them for use_config."""
        compiled = {}
        for key in self.missing_programs(engine_cfg):
            start = time.perf_counter()
            with contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
                compiled[key] = lower_program(self._jitted, self._jitted_draw, key, engine_cfg, self.cfg.vocab_size, state, keep_raw=self.keep_raw).compile()
            self.count_refit_compile(key, time.perf_counter() - start)
        return compiled

    def missing_programs(self, engine_cfg: EngineConfig) -> list:
        """The program keys `engine_cfg`'s tables need that this engine lacks."""
        return [k for k in program_keys(engine_cfg) if k not in (self._draws if isinstance(k, int) else self._programs)]

    def count_refit_compile(self, key, seconds: float) -> None:
        """One program compiled after warm-up for a bucket refit (here, or in a child process: compile_worker.py):
        counted in num_compilations and refit_compilations, and logged as such."""
        self.compile_seconds += seconds
        self.num_compilations += 1
        self.refit_compilations += 1
        log.info("compiled %s in %.2fs after warm-up (a bucket refit)", key, seconds)

    def compile_request(self, engine_cfg: EngineConfig) -> dict:
        """What a child process needs to compile the programs `engine_cfg`'s tables need that this engine lacks
        (compile_worker.py): picklable, the state as shapes without their device shardings. One device only."""
        if self.mesh is not None:
            raise ValueError("a mesh's programs compile in this process (compile_programs)")
        state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.abstract_state())
        return {"cfg": self.cfg, "engine_cfg": engine_cfg, "impl": self.impl, "keep_raw": self.keep_raw, "state": state, "keys": self.missing_programs(engine_cfg)}

    def load_program(self, key, serialized: bytes, cpu_s: float) -> jax.stages.Compiled:
        """A program a child process compiled (compile_worker.py: its serialize_executable output, pickled), loaded
        here; counted as a refit compile of `cpu_s` (the child's CPU seconds)."""
        from jax.experimental import serialize_executable  # noqa: PLC0415

        program = serialize_executable.deserialize_and_load(*pickle.loads(serialized))
        self.count_refit_compile(key, cpu_s)
        return program

    def use_config(self, engine_cfg: EngineConfig, programs: dict | None = None) -> None:
        """Swap in another config with the same pool and program inputs (_KEPT_FIELDS): a plan before warm-up, or a
        refit between steps with the `programs` compile_programs made (added to the table; none is dropped, so a
        plan already made on the old tables still runs). Its scheduler must take the new tables at the same moment."""
        changed = [name for name in self._KEPT_FIELDS if getattr(engine_cfg, name) != getattr(self.engine_cfg, name)]
        if BucketTables.from_config(engine_cfg).packed_seqs != BucketTables.from_config(self.engine_cfg).packed_seqs:
            changed.append("prefill_packing")  # a packed prefill program takes other inputs under the same bucket key
        if changed:
            raise ValueError(f"use_config cannot change {', '.join(changed)} of a built engine")
        for key, program in (programs or {}).items():
            (self._draws if isinstance(key, int) else self._programs)[key] = program
        self.engine_cfg = engine_cfg  # costs_key stays: tables and batch limits are not part of it (step_costs_key)

    def time_programs(self, runs: int | None = None, keys: list[BucketKey] | None = None, progress=None) -> None:
        """Fill the step-cost table: the cached one of this machine, model and engine (tuning_cache), then
        `runs` timed runs (after one untimed) of each program it lacks (of `keys`, compiled; None: every bucket key),
        on an all-padding plan (every slot on the null page). `runs` None: tuning_cache.step_timing_runs() (2; 0
        under JAXINFER_TUNE=0). `progress`: warmup's."""
        from jaxinfer.engine import tuning_cache  # noqa: PLC0415  (tuning_cache imports the tuner, which imports this module)

        runs = tuning_cache.step_timing_runs() if runs is None else runs
        if runs:
            self.read_cached_costs()
        tables = BucketTables.from_config(self.engine_cfg)
        missing = [key for key in (self.bucket_keys() if keys is None else keys) if not self.step_costs.measured(key)]  # real or warm-up runs
        bar = progress(desc="timing programs", total=len(missing)) if progress and missing and runs else None
        with _closing(bar):
            for key in missing if runs else []:
                plan = _timing_plan(key, self.engine_cfg, tables.packed_seqs)
                self.step(plan, observe=False)  # the first run of a program may pay one-time costs
                for _ in range(runs):
                    start = time.perf_counter()
                    self.step(plan, observe=False)
                    self.step_costs.observe(key, time.perf_counter() - start, warmup=True)
                host_memory.trim_heap()  # a first run's freed buffers, before the next program's
                if bar is not None:
                    bar.update(1)
        if missing and runs:
            self.save_step_costs()

    def read_cached_costs(self) -> None:
        """This machine's cached step-cost table for what the engine runs, into the table itself (llm.step_costs()
        keeps returning the one every step refines); read once per key: a second warm-up adds nothing."""
        from jaxinfer.engine import tuning_cache  # noqa: PLC0415

        if self.costs_key() not in self._costs_read:
            self._costs_read.add(self.costs_key())
            cached = tuning_cache.read_step_costs(tuning_cache.cache_dir(), self.costs_key())
            if cached is not None:
                self.step_costs.fill_from(cached)

    def costs_key(self) -> str:
        """The tuner's cache key of what this engine runs (its resolved implementations and weight formats)."""
        if self._costs_key is None:
            from jaxinfer.engine import backends, tuning_cache  # noqa: PLC0415

            formats = sorted({str(getattr(leaf, "dtype", type(leaf).__name__)) for leaf in jax.tree.leaves(self.params)})
            weights = f"{'+'.join(formats)} tp{1 if self.mesh is None else shd.mesh_size(self.mesh)}"
            impls = backends.Impls(self.cfg.dtype, self.impl, self.matmul_impl)
            self._costs_key = tuning_cache.step_costs_key(self.cfg, self.engine_cfg, impls, weights, self._KEPT_FIELDS)
        return self._costs_key

    def save_step_costs(self) -> None:
        """Persist the step-cost table with the tuner's cache (a folder that cannot be written only warns)."""
        import warnings  # noqa: PLC0415

        from jaxinfer.engine import tuning_cache  # noqa: PLC0415

        if not self.step_costs.programs or not tuning_cache.step_timing_runs():  # JAXINFER_TUNE=0 caches nothing
            return
        try:
            tuning_cache.write_step_costs(tuning_cache.cache_dir(), self.costs_key(), self.step_costs)
        except OSError as err:
            warnings.warn(f"jaxinfer: the step-cost table could not be saved: {err}", stacklevel=2)

    def step(self, plan: StepPlan, *, observe: bool = True) -> StepResult:
        """Run one planned step; donates and rebinds the pool; its seconds refine the step-cost table
        (unless `observe` is False). Returns the sampled tokens, int32[R * J]
        (one per sequence slot of the plan: `plan.request_ids[i]` drew token i), and the log-probabilities
        the plan asks for (only those are copied to the host).

        Two programs: the forward, then the draw. Dispatch is asynchronous, so with `overlap_masks` the host
        fills the grammar's masks while the device runs the forward; without, it fills them first."""
        start = time.perf_counter()
        program = self._programs.get(plan.bucket)
        if program is None:
            raise KeyError(f"no compiled program for bucket {plan.bucket}; warmup() compiles {len(self._programs)} keys")
        _check_pages(plan.block_tables, plan.slot_pages, self.num_pages)
        inputs = inputs_from_plan(plan)
        masks = None if self.overlap_masks else token_masks(plan, self.cfg.vocab_size)
        logits, self.pool, self.history = program(self.step_params, self.pool, self.history, inputs)
        if masks is None:
            masks = token_masks(plan, self.cfg.vocab_size)
        tokens, logprobs = self._draws[plan.seeds.shape[0]](logits.adjusted, logits.raw, dataclasses.replace(inputs.sampling, token_mask=masks))
        if self.return_logits:
            self.last_logits = np.asarray(logits.raw)
        result = StepResult(
            np.asarray(tokens),
            _to_host(logprobs) if plan.wants_logprobs else None,
            _to_host(logits.prompt_logprobs) if plan.wants_prompt_logprobs else None,
            *((np.asarray(logits.pooled_last), np.asarray(logits.pooled_sum)) if plan.wants_pooled else ()),
        )
        if observe:
            self.step_costs.observe(plan.bucket, time.perf_counter() - start)
        return result


def _timing_plan(key: BucketKey, engine_cfg: EngineConfig, packed_seqs: int) -> StepPlan:
    """A plan of `key` that works like full rows but touches only the null page: every row one sequence whose
    last token sits at the end of its table (so attention reads every table entry, all of them page 0), and
    every token written to page 0. Warm-up times each program on it (Engine.time_programs)."""
    page_size = engine_cfg.page_size
    plan = StepPlan.build(key.phase, [], key, page_size, packed=packed_seqs if key.phase == "prefill" else 0, bias_width=engine_cfg.max_logit_bias)
    end = key.num_pages * page_size  # positions the table covers
    first = max(0, end - key.num_tokens)
    positions = np.broadcast_to(np.arange(first, first + key.num_tokens, dtype=np.int32), plan.positions.shape).copy()
    return dataclasses.replace(plan, positions=positions, token_segments=np.zeros_like(plan.token_segments), page_segments=np.zeros_like(plan.page_segments))


def _spec(*shape: int, dtype=jnp.int32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


# ------------------------------------------------------------------ the programs, without an engine
# Engine and the deviceless GPU compile (engine/aot.py) build the same programs from these.


def step_functions(cfg: ModelConfig, engine_cfg: EngineConfig, impl: str, *, keep_raw: bool) -> tuple:
    """(forward, draw): the two functions every step runs, before jit (`impl` resolved already)."""
    num_top = max(engine_cfg.max_logprobs, 1)
    forward = functools.partial(_forward_step, cfg=cfg, impl=impl, num_top=num_top, keep_raw=keep_raw)
    return forward, functools.partial(_draw_step, num_top=num_top, mode=engine_cfg.logprobs_mode)


def program_keys(engine_cfg: EngineConfig) -> list:
    """What warm-up compiles: every bucket key's forward program, and a draw program per sequence-slot count (an int)."""
    keys = BucketTables.from_config(engine_cfg).all_keys()
    return keys + sorted({_num_slots(k, engine_cfg) for k in keys})


def _num_slots(key: BucketKey, engine_cfg: EngineConfig) -> int:
    return key.num_rows * BucketTables.from_config(engine_cfg).samples_per_row(key.phase)


def lower_program(jitted, jitted_draw, key, engine_cfg: EngineConfig, vocab_size: int, state: tuple, *, keep_raw: bool) -> jax.stages.Lowered:
    """One program lowered: a draw program for `key` sequence slots (an int), else a bucket key's forward program
    against `state` (params, pool, history: arrays or shapes). Warm-up, a refit here and a refit's child
    (compile_worker.py) lower through this."""
    if isinstance(key, int):
        return jitted_draw.lower(*abstract_draw_inputs(key, engine_cfg, vocab_size, keep_raw=keep_raw))
    return jitted.lower(*state, abstract_step_inputs(key, engine_cfg, vocab_size))


def abstract_step_inputs(key: BucketKey, engine_cfg: EngineConfig, vocab_size: int) -> StepInputs:
    """The forward program's inputs for one bucket key, as shapes."""
    rows, tokens, width, samples = key.num_rows, key.num_tokens, key.num_pages, _num_slots(key, engine_cfg)
    pages = kvp.PageMeta(_spec(rows, width), _spec(rows, tokens), _spec(rows, tokens), _spec(rows, width), _spec(rows, width), _spec(rows, tokens))
    arrays = _abstract_arrays(samples, engine_cfg, vocab_size)
    return StepInputs(_spec(rows, tokens), _spec(rows, tokens), pages, _spec(rows, samples // rows), arrays, _spec(samples), _spec(rows, tokens))


def abstract_draw_inputs(samples: int, engine_cfg: EngineConfig, vocab_size: int, *, keep_raw: bool) -> tuple:
    """The draw program's inputs for a step of `samples` sequence slots, as shapes: (adjusted, raw, arrays)."""
    logits = _spec(samples, vocab_size, dtype=jnp.float32)
    return logits, logits if keep_raw else None, _abstract_arrays(samples, engine_cfg, vocab_size, masked=True)


def _abstract_arrays(samples: int, engine_cfg: EngineConfig, vocab_size: int, *, masked: bool = False) -> sampling.SamplingArrays:
    floats, bias = lambda: _spec(samples, dtype=jnp.float32), engine_cfg.max_logit_bias  # noqa: E731
    return sampling.SamplingArrays(
        floats(), _spec(samples), floats(), _spec(samples), _spec(samples), floats(), floats(), floats(), floats(),
        _spec(samples, bias), _spec(samples, bias, dtype=jnp.float32), _spec(samples),
        _spec(samples, guided.mask_words(vocab_size)) if masked else None,
    )


def _to_host(logprobs: sampling.Logprobs) -> Logprobs:
    return Logprobs(np.asarray(logprobs.token), np.asarray(logprobs.top_ids), np.asarray(logprobs.top))


def _check_pages(block_tables: np.ndarray, slot_pages: np.ndarray, num_pages: int) -> None:
    """JAX clamps out-of-range indices silently, so page ids are checked on the host."""
    for name, pages in (("block_tables", block_tables), ("slot_pages", slot_pages)):
        if pages.size and (pages.min() < 0 or pages.max() >= num_pages):
            raise ValueError(f"{name} holds page ids outside [0, {num_pages}): min {pages.min()}, max {pages.max()}")


def _closing(bar):
    """A progress bar closed when its phase ends, however it ends; a null context for no bar."""
    return contextlib.nullcontext() if bar is None else contextlib.closing(bar)
