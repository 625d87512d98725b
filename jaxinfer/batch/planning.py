"""A job that plans itself (`jaxinfer generate --plan`): before warm-up, a sample of the input chooses the
engine's limits, bucket tables and policy on the simulator.

`sample_job` draws a reservoir of about 2,000 of the lines still to do (read lazily, as the job reads them)
and prepares each exactly as the job will (LineRunner: chat template, truncation, its max_tokens), on an
LLM loaded without warm-up. `make_plan` then simulates (scheduling/simulator.py) a grid of `max_num_seqs` x
`max_prefill_tokens`; each grid point runs once with fine tables (every 16 tokens, every row count, every
page width), which gives the sizes its steps really have, and its bucket tables are fitted to those sizes
under a program budget (`fit_tables`: a greedy over the three tables, each an exact fit (`refit.fit_table`), that
adds the bucket which saves the most predicted seconds per program it adds). The grid is priced on the
step costs' monotone view (`StepCosts.monotone()`: every program on its phase's line in work), never on raw
medians, which on a loaded machine can make a wider bucket look cheaper than a narrower one. A sample whose prompts share
full KV pages (few-shot preambles, a long system prompt) turns on the `prefix` policy. `Plan.summary()`
prints the programs, the predicted wall time and the prefill tokens the prefix cache saves.

Outputs: the plan changes which step computes a token, never the pool (it keeps the engine's page count).
In deterministic mode the tables are fixed by the mode and the grid keeps max_num_seqs >= 8 and
max_prefill_tokens >= 64, so every program shape, and with it every token, is as without a plan.
Elsewhere batch composition changes the rounding of near-tied logits, as any other max_num_seqs does, so
planning is opt-in (`--plan`). Never imports
jaxinfer.bucketing (the runtime does not; a test checks it).
"""

import collections
import contextlib
import dataclasses
import random
import sys

import numpy as np

from jaxinfer.batch.refit import fit_table
from jaxinfer.config import EngineConfig
from jaxinfer.scheduling.bucket_tables import BucketTables, TableLimits, cut_table
from jaxinfer.scheduling.plan import BucketKey
from jaxinfer.scheduling.simulator import SimRequest, simulate
from jaxinfer.scheduling.step_costs import StepCosts, work

_CHUNK_STEP = 16  # tokens between the fine chunk table's buckets (and the multiple every fitted chunk bucket is)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """What a plan searches and how much it samples."""

    sample_lines: int = 2000  # lines in the reservoir sample of the input
    simulated_requests: int = 256  # requests each grid point simulates (the first of the shuffled sample)
    max_num_seqs: tuple[int, ...] = (8, 16, 32)  # grid; values over the given max_num_seqs are dropped
    max_prefill_tokens: tuple[int, ...] = (256, 512, 1024)  # grid; cut at max_context
    program_budget: int | None = None  # bucket keys compiled at most; None: as many as the given config's tables have
    prefix_share: float = 0.2  # share of sampled prompt tokens in shared full pages from which the plan uses 'prefix'
    seed: int = 0  # of the reservoir


@dataclasses.dataclass(frozen=True)
class WorkloadSample:
    """The sampled requests: token counts, and the prompt tokens in full pages an earlier sampled prompt holds."""

    prompt_tokens: np.ndarray  # i64[N]
    output_tokens: np.ndarray  # i64[N]; each request's max_tokens (a plan cannot know where EOS comes)
    shared_tokens: np.ndarray  # i64[N]; leading tokens in full pages equal to an earlier sampled prompt's
    num_lines: int  # lines the job has to do (the sample is drawn from these)
    num_requests: float | None = None  # requests the job will run, estimated from the sample (None: one per line to do)
    families: tuple[np.ndarray, np.ndarray] | None = None  # (i64[N] prefix group, i64[N] its shareable tokens): prefix_families; None: one group
    num_error_lines: int = 0  # lines to do that cannot run (their error records need no step)

    @classmethod
    def of_prompts(cls, prompts: list[list[int]], outputs, page_size: int, prefix_caching: bool, num_lines: int,
                   num_requests: float | None = None) -> "WorkloadSample":
        """The sample of these prompts' token ids and outputs (max_tokens), their shared pages counted as the prefix
        cache shares them (none without it)."""
        if prefix_caching:
            shared, families = shared_page_tokens(prompts, page_size), prefix_families(prompts, page_size)
        else:
            shared, families = np.zeros(len(prompts), np.int64), None
        return cls(np.array([len(p) for p in prompts]), np.asarray(outputs), shared, num_lines, num_requests, families)

    @property
    def requests_to_run(self) -> float:
        """The requests the job will run, whose work the sample's requests stand for."""
        return self.num_lines if self.num_requests is None else self.num_requests

    @property
    def shared_fraction(self) -> float:
        return float(self.shared_tokens.sum() / max(1, self.prompt_tokens.sum()))

    def requests(self, count: int) -> list[SimRequest]:
        """The first `count` sampled requests as the simulator's: each prompt's shareable prefix in its group (families),
        else its shared tokens in one group."""
        n = min(count, self.prompt_tokens.size)
        groups, shared = self.families if self.families is not None else (np.zeros(n, np.int64), self.shared_tokens)
        return [SimRequest(int(p), int(o), shared_prefix=int(s), prefix_group=int(g))
                for p, o, s, g in zip(self.prompt_tokens[:n], self.output_tokens[:n], shared[:n], groups[:n])]


def shared_page_tokens(prompts: list[list[int]], page_size: int) -> np.ndarray:
    """i64[N]: per prompt, the tokens of its leading full pages whose whole prefix an earlier prompt has
    (the prefix cache's rule: a page is named by its tokens and its parent's name, and a prompt's last token is
    always computed, so a prompt shares at most (its tokens - 1) // page_size pages; every full page of a prompt
    is named once it is computed)."""
    seen, shared = set(), np.zeros(len(prompts), np.int64)
    for i, (ids, chain) in enumerate(zip(prompts, _page_chains(prompts, page_size))):
        matching, shareable = True, (len(ids) - 1) // page_size
        for page, name in enumerate(chain):
            if matching and page < shareable and name in seen:
                shared[i] += page_size
            else:
                matching = False
                seen.add(name)
    return shared


def _page_chains(prompts: list[list[int]], page_size: int) -> list[list[int]]:
    """Per prompt, the names of its full pages as the prefix cache's chain names them (a page by its tokens and its
    parent's name; a hash of both here, within one process)."""
    chains = []
    for ids in prompts:
        name, chain = None, []
        for page in range(len(ids) // page_size):
            name = hash((name, tuple(ids[page * page_size : (page + 1) * page_size])))
            chain.append(name)
        chains.append(chain)
    return chains


def prefix_families(prompts: list[list[int]], page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(i64[N] group, i64[N] shareable tokens): per prompt, the tokens of its leading full pages that another sampled
    prompt also holds (named by the prefix cache's chain, at most (its tokens - 1) // page_size pages, as
    shared_page_tokens counts), whichever of them runs first, and its group: one per distinct chain of those pages
    (its last shared page's name; 0 for a prompt that shares none). The simulator gives each group one chain of
    shared pages (SimRequest.prefix_group), so a group's prompts share exactly that prefix: two preambles are two
    groups, each computed by its first prompt to run, also where a chat template's first page opens both. A prefix
    shorter than a prompt's own shared run (that template alone, shared with prompts of other groups) is modelled
    as not shared across groups: each group computes it once."""
    chains = _page_chains(prompts, page_size)
    holders = collections.Counter(name for chain in chains for name in set(chain))
    groups, shareable, firsts = np.zeros(len(prompts), np.int64), np.zeros(len(prompts), np.int64), {}
    for i, (ids, chain) in enumerate(zip(prompts, chains)):
        pages = 0
        while pages < (len(ids) - 1) // page_size and holders[chain[pages]] > 1:
            pages += 1
        if pages:
            groups[i] = firsts.setdefault(chain[pages - 1], len(firsts) + 1)
            shareable[i] = pages * page_size
    return groups, shareable


def reservoir(items, size: int, rng: random.Random) -> list:
    """A uniform sample of `size` of the items (all of them when fewer), read once (Algorithm R)."""
    kept = []
    for count, item in enumerate(items):
        if count < size:
            kept.append(item)
        elif (j := rng.randrange(count + 1)) < size:
            kept[j] = item
    return kept


def sample_job(job, llm, options: PlanOptions = PlanOptions()) -> WorkloadSample | None:
    """The lines still to do, sampled and prepared as the job prepares them (lines that cannot run left out), or None
    when no sampled line can run. Each of a line's n samples is a request; a scored prompt (max_tokens 0) is sampled
    as one of one generated token, the simulator's nearest to a prefill alone."""
    rng = random.Random(options.seed)
    lines = reservoir((line for line in job.todo if job.runner.host_error(line) is None), options.sample_lines, rng)
    rng.shuffle(lines)
    prompts, outputs = [], []
    for index, line in enumerate(lines):
        try:
            prompt = job.runner.prompt_of(llm, line, index=index)  # exactly as the job will prepare it (an embedding line: its prefill alone)
        except ValueError:  # a LineError: the line's own error record, not part of the workload
            continue
        for _ in range(prompt.params.n):
            prompts.append(prompt.token_ids)
            outputs.append(max(1, prompt.params.max_tokens))
    if not prompts:
        return None
    cfg = llm.engine_config  # the lines sampled stand for every line that parsed (num_runnable); their requests, for the requests those make
    sample = WorkloadSample.of_prompts(prompts, outputs, cfg.page_size, cfg.enable_prefix_caching, len(job.todo), job.num_runnable * len(prompts) / len(lines))
    return dataclasses.replace(sample, num_error_lines=len(job.todo) - job.num_runnable)


def prior_costs() -> StepCosts:
    """Step costs when none can be measured (JAXINFER_TUNE=0): lines in work (rows x (tokens + pages)) through
    SmolLM2-135M's measured programs on the 2-core development CPU (prefill about 3 ms a token past 50 ms; decode
    40 ms plus 0.2 ms a row-page). Only their ratios steer a plan, and on another machine or model they are wrong:
    a plan priced on them kept 2 programs on the conversation workload and ran 1.32x the grid's best."""
    costs = StepCosts()
    for key, seconds in ((BucketKey("prefill", 1, 32, 1), 0.15), (BucketKey("prefill", 1, 512, 8), 1.6),
                         (BucketKey("decode", 1, 1, 1), 0.04), (BucketKey("decode", 32, 1, 32), 0.25)):
        costs.observe(key, seconds, warmup=True)
    return costs


def anchor_keys(cfg: EngineConfig) -> list[BucketKey]:
    """The programs a plan times when this machine has no step costs for the model: per phase, the key of the
    least, the middle and the most work (step_costs.work) of `cfg`'s tables. The plan prices every key on its
    phase's line in work (StepCosts.monotone()), which three measured keys fix."""
    keys, chosen = BucketTables.from_config(cfg).all_keys(), {}
    for phase in ("prefill", "decode"):
        ranked = sorted((k for k in keys if k.phase == phase), key=lambda k: (work(k), k))
        if ranked:
            chosen |= dict.fromkeys([ranked[0], ranked[len(ranked) // 2], ranked[-1]])
    return list(chosen)


def _limits(cfg: EngineConfig) -> TableLimits:
    return TableLimits(page_size=cfg.page_size, max_num_seqs=cfg.max_num_seqs, max_prefill_tokens=cfg.max_prefill_tokens,
                       max_context=cfg.max_context, max_prefill_seqs=cfg.max_prefill_seqs)


def _fine_config(cfg: EngineConfig) -> EngineConfig:
    """`cfg` with a bucket at every 16 tokens, every row count and every page width: its steps' keys are their sizes."""
    top = min(cfg.max_prefill_tokens, cfg.max_context)
    chunks = tuple(range(_CHUNK_STEP, top, _CHUNK_STEP)) + (top,)
    return dataclasses.replace(cfg, buckets=None, prefill_chunk_buckets=chunks, decode_batch_buckets=tuple(range(1, cfg.max_num_seqs + 1)),
                               decode_page_buckets=tuple(range(1, cfg.max_pages_per_seq + 1)))


def num_programs(cfg: EngineConfig) -> int:
    """Bucket keys (forward programs) the config's tables compile."""
    return len(BucketTables.from_config(cfg).all_keys())


def step_sizes(steps_by_key: dict[BucketKey, int]) -> dict[str, np.ndarray]:
    """The sizes a fine-table run's steps had, one entry per step: prefill tokens per row, decode rows, pages per row."""
    sizes = {"chunk": [], "rows": [], "pages": []}
    for key, count in steps_by_key.items():
        if key.phase == "prefill":
            sizes["chunk"] += [key.num_tokens] * count
        else:
            sizes["rows"] += [key.num_rows] * count
        sizes["pages"] += [key.num_pages] * count
    return {name: np.array(values or [1], np.int64) for name, values in sizes.items()}


def repriced_seconds(steps_by_key: dict[BucketKey, int], tables: BucketTables, costs: StepCosts) -> float:
    """Device seconds of a fine-table run's steps, each run on the key `tables` pad it to."""
    total = 0.0
    for key, count in steps_by_key.items():
        if key.phase == "prefill":
            padded = tables.prefill_key(key.num_rows, key.num_tokens, key.num_pages)
        else:
            padded = tables.decode_key(key.num_rows, key.num_pages)
        total += count * costs.device_seconds(padded)
    return total


def _fitted_tables(cfg: EngineConfig, sizes: dict[str, np.ndarray], counts: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """EngineConfig's three tables, each the exact fit of `counts[dim]` buckets to its sizes, cut to the limits."""
    limits = _limits(cfg)
    fit = lambda dim, step=1: fit_table(sizes[dim], counts[dim], multiple_of=step)  # noqa: E731
    return {
        "prefill_chunk_buckets": cut_table(fit("chunk", _CHUNK_STEP), limits.max_chunk, reach=False),
        "decode_batch_buckets": cut_table(fit("rows"), limits.max_num_seqs, reach=True),
        "decode_page_buckets": cut_table(fit("pages"), limits.max_pages_per_seq, reach=True),
    }


def fit_tables(cfg: EngineConfig, steps_by_key: dict[BucketKey, int], costs: StepCosts, budget: int) -> tuple[EngineConfig, float]:
    """(cfg with fitted tables, their predicted device seconds): from one bucket per table, the bucket that
    saves the most predicted seconds per program it adds is added while the programs stay within `budget`. That
    start may itself be over a small budget (a table that must reach its limit holds two buckets): make_plan then
    keeps the given tables, or with none within a budget given smaller, the points of the fewest programs.
    Priced on `costs.monotone()`: on raw noisy medians a wider bucket can look cheaper than a narrower one,
    so that a bucket that cuts padding seems to save nothing and the greedy stops at sparse tables."""
    costs = costs.monotone()
    sizes = step_sizes(steps_by_key)
    distinct = {dim: np.unique(values).size for dim, values in sizes.items()}
    counts = {dim: 1 for dim in sizes}

    def priced(trial: dict[str, int]) -> tuple[EngineConfig, int, float]:
        trial_cfg = dataclasses.replace(cfg, buckets=None, **_fitted_tables(cfg, sizes, trial))
        tables = BucketTables.from_config(trial_cfg)
        return trial_cfg, len(tables.all_keys()), repriced_seconds(steps_by_key, tables, costs)

    best_cfg, programs, seconds = priced(counts)
    while True:
        options = []
        for dim in counts:
            if counts[dim] < distinct[dim]:
                trial = counts | {dim: counts[dim] + 1}
                trial_cfg, trial_programs, trial_seconds = priced(trial)
                if trial_programs <= budget and trial_seconds < seconds:
                    options.append(((seconds - trial_seconds) / max(1, trial_programs - programs), trial, trial_cfg, trial_programs, trial_seconds))
        if not options:
            return best_cfg, seconds
        _, counts, best_cfg, programs, seconds = max(options, key=lambda option: option[0])


@dataclasses.dataclass(frozen=True)
class GridPoint:
    """One simulated configuration: its limits, its programs and the wall time predicted for the sample."""

    max_num_seqs: int
    max_prefill_tokens: int
    programs: int
    wall_s: float  # predicted seconds for the simulated requests (fine-table run, steps repriced on the fitted tables)
    config: EngineConfig


def grid_values(base: EngineConfig, options: PlanOptions) -> list[tuple[int, int]]:
    """The (max_num_seqs, max_prefill_tokens) a plan tries: within the given max_num_seqs and the context; in
    deterministic mode only those whose tables are the given config's (so every program shape is kept)."""
    seqs = {s for s in options.max_num_seqs if s <= base.max_num_seqs} | {base.max_num_seqs}
    given = min(base.max_prefill_tokens, base.max_context)  # a budget over the context chunks as the context does
    tokens = {min(t, base.max_context) for t in options.max_prefill_tokens if min(t, base.max_context) != given} | {base.max_prefill_tokens}
    points = [(s, t) for s in sorted(seqs) for t in sorted(tokens)]
    if base.deterministic:
        tables = BucketTables.from_config(base)
        points = [(s, t) for s, t in points if BucketTables.from_config(_limited(base, s, t)) == tables]
    return points


def _limited(base: EngineConfig, max_num_seqs: int, max_prefill_tokens: int) -> EngineConfig:
    """`base` under other limits, its tables derived again from them."""
    return dataclasses.replace(base, max_num_seqs=max_num_seqs, max_prefill_tokens=max_prefill_tokens, buckets=None,
                               prefill_chunk_buckets=None, decode_batch_buckets=None, decode_page_buckets=None)


def evaluate(base: EngineConfig, requests: list[SimRequest], costs: StepCosts, budget: int, max_num_seqs: int, max_prefill_tokens: int) -> GridPoint:
    """One grid point: a fine-table simulation, then (unless deterministic) tables fitted under `budget`; priced
    on `costs.monotone()`."""
    costs = costs.monotone()
    cfg = _limited(base, max_num_seqs, max_prefill_tokens)
    if cfg.deterministic:
        result = simulate(cfg, requests, costs, num_pages=cfg.num_pages)
        return GridPoint(max_num_seqs, max_prefill_tokens, num_programs(cfg), result.wall_s, cfg)
    result = simulate(_fine_config(cfg), requests, costs, num_pages=cfg.num_pages)
    host = result.wall_s - repriced_seconds(result.steps_by_key, BucketTables.from_config(_fine_config(cfg)), costs)
    fitted, device = fit_tables(cfg, result.steps_by_key, costs, budget)
    return GridPoint(max_num_seqs, max_prefill_tokens, num_programs(fitted), host + device, fitted)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a plan chose, and what the simulator predicts for it and for the config as given."""

    config: EngineConfig  # the planned engine config (the given one's pool, policy as chosen)
    given: EngineConfig
    programs: int
    given_programs: int
    predicted_wall_s: float  # for every request to run (the simulated sample's wall time, scaled by requests: WorkloadSample.requests_to_run)
    given_wall_s: float
    prefill_tokens_saved: int  # prompt tokens of the requests to run that the prefix cache shares (estimated from the sample)
    prompt_tokens: int  # of the requests to run (estimated)
    sample: WorkloadSample
    grid: tuple[GridPoint, ...]

    def summary(self) -> str:
        """The plan in a few lines: what changes, the programs, the predicted wall time, the prefill tokens saved."""
        cfg, given = self.config, self.given
        errors = self.sample.num_error_lines
        noted = f"; lines to do that fail before tokenizing (error records): {errors:,}" if errors else ""
        lines = [f"plan: {self.sample.prompt_tokens.size} sampled requests of {self.sample.num_lines} lines to do (about {self.sample.requests_to_run:,.0f} "
                 f"requests to run{noted}); {len(self.grid)} configurations simulated"]
        tables = BucketTables.from_config(cfg)
        for name in ("max_num_seqs", "max_prefill_tokens", "policy", "prefill_chunk_buckets", "decode_batch_buckets", "decode_page_buckets"):
            before, after = _setting(given, name), _setting(cfg, name)
            lines.append(f"  {name:<22} {_short(before)} -> {_short(after)}" if after != before else f"  {name:<22} {_short(after)} (kept)")
            if name == "max_prefill_tokens" and tables.max_chunk < cfg.max_prefill_tokens:
                capped = tables.packed or tables.max_prefill_rows == 1  # a step prefills one row (packed: its chunks in it) of at most the largest chunk
                lines[-1] += f" (a step prefills at most the largest chunk, {tables.max_chunk})" if capped else f" (a step's tokens over its rows; the largest chunk {tables.max_chunk})"
        lines.append(f"  programs               {self.given_programs} -> {self.programs} (bucket keys compiled at warm-up)")
        lines.append(f"  predicted wall time    {self.given_wall_s:.1f} s -> {self.predicted_wall_s:.1f} s (simulated, outputs at their max_tokens)")
        share = self.prefill_tokens_saved / max(1, self.prompt_tokens)
        lines.append(f"  prefill tokens saved   {self.prefill_tokens_saved:,} of {self.prompt_tokens:,} ({share:.1%}, shared full KV pages)")
        return "\n".join(lines)

    def to_json(self) -> dict:
        tables = BucketTables.from_config(self.config)
        return {"max_num_seqs": self.config.max_num_seqs, "max_prefill_tokens": self.config.max_prefill_tokens, "policy": self.config.policy,
                "chunk_tokens": list(tables.chunk_tokens), "decode_rows": list(tables.decode_rows), "pages": list(tables.pages),
                "programs": self.programs, "given_programs": self.given_programs, "predicted_wall_s": round(self.predicted_wall_s, 3),
                "given_wall_s": round(self.given_wall_s, 3), "prefill_tokens_saved": self.prefill_tokens_saved, "prompt_tokens": self.prompt_tokens,
                "grid": [{"max_num_seqs": g.max_num_seqs, "max_prefill_tokens": g.max_prefill_tokens, "programs": g.programs, "wall_s": round(g.wall_s, 3)} for g in self.grid]}


_TABLE_ATTRS = {"prefill_chunk_buckets": "chunk_tokens", "decode_batch_buckets": "decode_rows", "decode_page_buckets": "pages"}


def _setting(cfg: EngineConfig, name: str):
    """A config's field, or for a table field the table its BucketTables derives (a field left at None is derived)."""
    return getattr(BucketTables.from_config(cfg), _TABLE_ATTRS[name]) if name in _TABLE_ATTRS else getattr(cfg, name)


def _short(value) -> str:
    return f"({', '.join(map(str, value))})" if isinstance(value, tuple) else str(value)


def make_plan(sample: WorkloadSample, given: EngineConfig, costs: StepCosts, options: PlanOptions = PlanOptions()) -> Plan:
    """The configuration with the least predicted wall time over the grid, with the prefix policy when the
    sample shares prefixes. `given.num_pages` must be the engine's pool (the plan keeps it). Priced on
    `costs.monotone()` (a program's cost never falls as its rows, tokens or pages grow)."""
    if given.num_pages is None:
        raise ValueError("make_plan needs the engine's pool: given.num_pages (Engine.num_pages)")
    costs = costs.monotone()
    # from the default policy only: a policy asked for (edf's deadlines, adaptive's latency target) is the user's to keep
    shares = given.enable_prefix_caching and sample.shared_fraction >= options.prefix_share
    base = dataclasses.replace(given, policy="prefix") if shares and given.policy == EngineConfig().policy else given
    requests = sample.requests(options.simulated_requests)
    budget = options.program_budget or num_programs(given)
    grid = tuple(evaluate(base, requests, costs, budget, s, t) for s, t in grid_values(base, options))
    best = min(_within(grid, budget) or _fewest((*grid, _as_given(base, requests, costs))), key=lambda point: point.wall_s)
    scale = sample.requests_to_run / len(requests)
    predicted = simulate(best.config, requests, costs, num_pages=given.num_pages).wall_s * scale
    as_given = simulate(given, requests, costs, num_pages=given.num_pages).wall_s * scale
    per_request = sample.requests_to_run / sample.prompt_tokens.size
    return Plan(best.config, given, best.programs, num_programs(given), predicted, as_given,
                int(sample.shared_tokens.sum() * per_request), int(sample.prompt_tokens.sum() * per_request), sample, grid)


def _within(grid: tuple[GridPoint, ...], budget: int) -> list[GridPoint]:
    """The grid points that compile at most `budget` programs: fit_tables starts from one bucket per table, and a table
    that must reach its limit holds two, so under a budget as small as the given tables' (one bucket each) none may."""
    return [point for point in grid if point.programs <= budget]


def _fewest(points: tuple[GridPoint, ...]) -> list[GridPoint]:
    """The points that compile the fewest programs: the plan's choice when none is within the budget."""
    least = min(point.programs for point in points)
    return [point for point in points if point.programs == least]


def _as_given(base: EngineConfig, requests: list[SimRequest], costs: StepCosts) -> GridPoint:
    """The given tables (and limits) as a grid point, which a default budget (theirs) always admits."""
    return GridPoint(base.max_num_seqs, base.max_prefill_tokens, num_programs(base), simulate(base, requests, costs, num_pages=base.num_pages).wall_s, base)


def engine_costs(llm) -> StepCosts:
    """The step costs a plan prices with, before warm-up: the engine's table (this machine's cached one for the
    model as loaded, tuning_cache) with `anchor_keys` of its tables timed where it lacks them (Engine.measure: a
    few compiles, kept for warm-up). A cached table can hold only the tuner's probe programs, whose narrow spread
    of work fixes no line. Under JAXINFER_TUNE=0, which times nothing: `prior_costs()`."""
    from jaxinfer.engine import tuning_cache  # noqa: PLC0415

    if not tuning_cache.step_timing_runs():
        return prior_costs()
    engine = llm.engine
    keys = anchor_keys(engine.engine_cfg)
    engine.read_cached_costs()
    missing = [k for k in keys if not engine.step_costs.measured(k)]
    if missing:
        print(f"plan: timing {len(missing)} programs this machine has no step costs of yet, to price the plan...", file=sys.stderr)
        engine.measure(missing)
    return engine.step_costs


def apply_plan(llm, plan: Plan) -> None:
    """Before warm-up: every replica's engine and the LLM take the planned config (same pool; costs_key kept,
    so the step-cost table of this machine and model gathers every plan's programs)."""
    for replica in llm.replicas:
        replica.engine.use_config(plan.config)
    llm.engine_config = plan.config


def plan_job(job, args, load_options, engine_config, options: PlanOptions = PlanOptions()):
    """`generate --plan` / `--plan-only`: the LLM loaded without warm-up, the plan made and printed (stdout with
    --plan-only, else stderr), then applied and warmed up. Returns the LLM (None: no --plan, --plan-only, or
    nothing to run)."""
    from jaxinfer.api import LLM  # noqa: PLC0415

    if not (args.plan or args.plan_only):
        return None
    if args.ray is not None:
        raise ValueError("--plan plans a job run in this process; it does not work with --ray")
    if not job.todo or job.num_runnable == 0:
        print("plan: no line to run, nothing to plan", file=sys.stderr)
        return None
    print(f"loading {args.model or 'the default model'} to plan the job (no compile yet)...", file=sys.stderr)
    llm = LLM(args.model, options=load_options, engine_config=engine_config, warmup=False, progress=not args.no_progress)
    given = dataclasses.replace(llm.engine_config, num_pages=llm.engine.num_pages)
    sample = sample_job(job, llm, options)
    if sample is None:  # every sampled line is an error record (a prompt over the context, ...): the job writes them
        print("plan: no sampled line can run (each is an error record), nothing to plan from; the job runs as given", file=sys.stderr)
        return None
    plan = make_plan(sample, given, engine_costs(llm), options)
    print(plan.summary(), file=sys.stdout if args.plan_only else sys.stderr)
    if args.plan_only:
        return None
    apply_plan(llm, plan)
    llm.warmup(progress=not args.no_progress)
    return llm


@contextlib.contextmanager
def refitting(llm, chain, planned: bool):
    """The job's on_step hook: `chain` as it is, or for a planned job a Refit wrapping it (batch/refit.py),
    whose swaps are printed when the job ends."""
    if not planned:
        yield chain
        return
    from jaxinfer.batch.refit import Refit  # noqa: PLC0415

    hook = Refit(llm, chain=chain)
    try:
        yield hook
    finally:
        hook.close()
        print(hook.report(), file=sys.stderr)
