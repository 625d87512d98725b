"""The tuner's record and its cache: `Measurement` (one candidate's row), `AttentionMeasurement` (one attention implementation's), `TuneResult` (the choice, how it
was made, and the table), and the per-machine cache of results under the cache root.

A result is cached per machine fingerprint, jaxlib version, model geometry, engine limits, pins, weight
format, tuner version, the CPU kernels' sources and whether they build here now (`cache_key`); a cached start
reads one small JSON file. A cached file that cannot be read, holds a value outside the vocabularies, or
names an implementation that cannot run here now is no cache (with a warning naming the file): the choice is
measured again. Files are written to a temporary name, fsynced and renamed into place.

Imports jax (the backend and the fingerprint) and engine/backends.py; tuning.py, tune_attention.py and the engine
(its step-cost table) import this module.
"""

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import platform
import warnings
from pathlib import Path

import jax

from jaxinfer.config import ATTENTION_IMPLS, DTYPES, MATMUL_IMPLS, EngineConfig, ModelConfig
from jaxinfer.engine import backends
from jaxinfer.engine.backends import Impls
from jaxinfer.scheduling.bucket_tables import BucketTables
from kernels_cpu import build as kernel_build

TUNE_ENV = "JAXINFER_TUNE"  # "0": measure nothing; "auto" keeps the fixed rule
CACHE_ENV = "JAXINFER_CACHE_DIR"  # overrides $XDG_CACHE_HOME/jaxinfer and ~/.cache/jaxinfer
TUNER_VERSION = 11  # part of the cache key: a change of the candidates or the check invalidates old choices


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One candidate's row of the tuner's table (prefill ms: its fastest step; decode ms: the median step)."""

    impls: Impls
    prefill_ms: float | None = None
    decode_ms: float | None = None
    score: float | None = None  # ms per PROMPT_TOKENS_PER_OUTPUT_TOKEN prompt tokens + 1 output token
    relative_error: float | None = None
    greedy_agreement: float | None = None
    passed: bool = False
    f32_relative_error: float | None = None  # a W8A8 kernel's (checked against its exact reference): its error against f32
    matmul_error: float | None = None  # a W8A8 kernel's: its matmuls' largest relative error against the exact reference
    note: str = ""  # why it failed or could not run

    @property
    def candidate(self) -> str:
        return self.impls.name

    @property
    def status(self) -> str:
        return "pass" if self.passed else f"FAIL ({self.note})" if self.note else "FAIL"


@dataclasses.dataclass(frozen=True)
class AttentionMeasurement:
    """One attention implementation of one compute dtype over the workload: ms of all layers' attention per
    prompt token (prefill) and per output token (decode), and the score they make."""

    dtype: str
    attention_impl: str
    prefill_ms: float | None = None
    decode_ms: float | None = None
    score: float | None = None
    note: str = ""  # why it could not run

    @property
    def candidate(self) -> str:
        return f"attention {self.dtype}/{self.attention_impl}"

    @property
    def status(self) -> str:
        return self.note or "timed"


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """What the tuner chose (`choice`), how (`source`: 'tuned' measured now, 'cached' measured before and read
    from the cache, 'fixed' not measured), and its table."""

    choice: Impls
    measurements: list[Measurement]  # empty when nothing was measured now (cached or fixed)
    key: str | None = None
    path: Path | None = None
    seconds: float = 0.0  # time spent measuring (of the original run, for a cached result)
    from_cache: bool = False
    prefill_key: object = None
    decode_key: object = None
    reason: str = ""  # why nothing was measured, for a fixed choice
    attention: list = dataclasses.field(default_factory=list)  # AttentionMeasurement per impl timed alone (tune_attention.py)
    probe_prompts: tuple = ()  # (number of probe prompts, tokens each, cut for a big model) of a run measured now
    source: str = "fixed"

    def describe(self) -> str:
        return f"{self.choice.describe()} ({self.source})"




def tuning_enabled() -> bool:
    """Whether "auto" choices are measured (JAXINFER_TUNE unset or not '0')."""
    return os.environ.get(TUNE_ENV, "1").strip() != "0"


def cache_dir() -> Path:
    """The cache root (kernels_cpu.build.cache_root owns the rule: $JAXINFER_CACHE_DIR, else
    $XDG_CACHE_HOME/jaxinfer, else ~/.cache/jaxinfer)."""
    return kernel_build.cache_root()  # the kernels' module owns the root: it may not import jaxinfer


def machine_fingerprint() -> dict:
    """What decides which implementation is fastest here: the CPU model, flags and core count (from
    /proc/cpuinfo), or the accelerators' name and count."""
    backend = jax.default_backend()
    if backend != "cpu":
        devices = jax.devices()
        return {"backend": backend, "device": devices[0].device_kind, "num_devices": len(devices)}
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "flags") and key.strip() not in info:
                    info[key.strip()] = value.strip()
    except OSError:
        pass
    flags = " ".join(sorted(info.get("flags", "").split()))
    return {"backend": "cpu", "cpu": info.get("model name") or platform.processor() or platform.machine(), "flags": flags, "num_cpus": os.cpu_count()}


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _engine_limits(engine_cfg: EngineConfig) -> dict:
    """The engine fields a choice is timed under, and its bucket tables as derived (a bucket strategy's, the packed
    prefill's sequence buckets: the tuner's probe runs their programs)."""
    names = ("page_size", "max_num_seqs", "max_prefill_tokens", "max_context", "max_prefill_seqs", "kv_cache_dtype",
             "prefill_chunk_buckets", "decode_batch_buckets", "decode_page_buckets", "prefill_packing")
    return {name: getattr(engine_cfg, name) for name in names} | {"tables": dataclasses.asdict(BucketTables.from_config(engine_cfg))}


def cache_key(fingerprint: dict, cfg: ModelConfig, engine_cfg: EngineConfig, pins: Impls, quantization: str | None = None,
              weight_formats: tuple[str, ...] = (), limits: dict | None = None) -> str:
    """A hex digest of everything a choice depends on: machine, jaxlib, model geometry (the ModelConfig
    but its dtype, which is a choice), engine limits and tables (`limits`: other engine fields instead), pins, the
    quantization option and the storage formats of the loaded weights ("kind:format", e.g. "mlp:q4_k": two files of
    one geometry, Q4_1 and Q4_K_M, are measured apart), the tuner and the CPU kernels' sources."""
    geometry = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "dtype"}
    limits = _engine_limits(engine_cfg) if limits is None else limits
    document = {"fingerprint": fingerprint, "jaxlib": _version("jaxlib"), "geometry": geometry, "limits": limits,
                "pins": dataclasses.asdict(pins), "quantization": quantization, "tuner": TUNER_VERSION,
                **({"weight_formats": sorted(weight_formats)} if weight_formats else {}),
                "kernels": kernel_build.sources_digest(), "cpu_kernels_built": _cpu_kernels_built()}
    return hashlib.sha256(json.dumps(document, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _cpu_kernels_built() -> bool | None:
    """Whether the CPU kernels can run here now (None off the CPU backend): a choice measured with them is not
    the answer where the compiler is gone, and one measured without them is not the answer once it is back."""
    return backends.cpu_kernel_obstacle("float32", quantized=True) is None if jax.default_backend() == "cpu" else None


def _cache_path(directory: Path, key: str) -> Path:
    return directory / "tuning" / f"{key}.json"


def read_cached(directory: Path, key: str) -> "TuneResult | None":
    """The cached result of `key`, or None when there is none (or it is unreadable: then it is measured again)."""
    path = _cache_path(directory, key)
    try:
        doc = json.loads(path.read_text())
        choice = Impls(**doc["choice"])
        measurements = [Measurement(**{**m, "impls": Impls(**m["impls"])}) for m in doc["measurements"]]
        attention = [AttentionMeasurement(**m) for m in doc.get("attention", [])]
        _check_numbers(doc.get("seconds", 0.0), *(getattr(m, f) for m in measurements for f in _MEASURED))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if (problem := unrunnable(choice)) is not None:
        warnings.warn(f"jaxinfer: the cached tuning choice in {path} ({choice.describe()}) cannot run here: {problem}; measuring again",
                      stacklevel=2)
        return None
    return TuneResult(choice, measurements, key=key, path=path, seconds=doc.get("seconds", 0.0), from_cache=True, attention=attention,
                      source="cached")


_MEASURED = ("prefill_ms", "decode_ms", "score", "relative_error", "greedy_agreement", "f32_relative_error", "matmul_error")


def _check_numbers(*values) -> None:
    """TypeError for a value of a cached result that is not a number or None (a damaged or hand-edited file)."""
    for value in values:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise TypeError(f"not a number: {value!r}")


def unrunnable(choice: Impls) -> str | None:
    """Why a choice read from the cache cannot run on this machine now, or None: a value outside the
    vocabularies (a damaged or hand-edited file), or a CPU kernel that cannot be built here any more (the
    compiler gone, the kernel cache unwritable)."""
    for field, allowed in (("dtype", DTYPES), ("attention_impl", ATTENTION_IMPLS), ("matmul_impl", MATMUL_IMPLS)):
        if getattr(choice, field) not in allowed or getattr(choice, field) == "auto":
            return f"{field} {getattr(choice, field)!r} is not one of {[a for a in allowed if a != 'auto']}"
    uses_kernels = choice.attention_impl == "cpu" or choice.matmul_impl in ("cpu", "cpu_int8")
    if uses_kernels and (obstacle := backends.cpu_kernel_obstacle(choice.dtype, quantized=choice.matmul_impl == "cpu_int8")):
        return f"the CPU kernels {obstacle}"
    if choice.attention_impl == "pallas" and jax.default_backend() != "gpu":
        return "the Pallas kernel runs on a GPU only"
    return None


def write_cached(directory: Path, result: "TuneResult", fingerprint: dict) -> Path:
    path = _cache_path(directory, result.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"choice": dataclasses.asdict(result.choice.impls()), "measurements": [dataclasses.asdict(m) for m in result.measurements],
           "attention": [dataclasses.asdict(m) for m in result.attention],
           "seconds": result.seconds, "fingerprint": fingerprint, "jaxlib": _version("jaxlib")}
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    with open(temporary, "w") as f:
        f.write(json.dumps(doc, indent=1))
        f.flush()
        os.fsync(f.fileno())  # a power cut leaves the old file or the new one, never an empty one
    temporary.replace(path)  # atomic: a concurrent start reads the old file or the new one, never half
    return path


# ---------------------------------------------------------------- the step-cost table (scheduling/step_costs.py)

STEP_TIMING_ENV = "JAXINFER_STEP_TIMING_RUNS"  # timed runs per program at warm-up; default 2, or 0 with JAXINFER_TUNE=0


def step_timing_runs() -> int:
    """Timed runs per program at warm-up: $JAXINFER_STEP_TIMING_RUNS, else 2 (0 when JAXINFER_TUNE=0 measures nothing)."""
    value = os.environ.get(STEP_TIMING_ENV, "").strip()
    if not value:
        return 2 if tuning_enabled() else 0
    if not value.isdigit():
        raise ValueError(f"{STEP_TIMING_ENV} must be a whole number of runs, got {value!r}")
    return int(value)


def step_costs_key(cfg: ModelConfig, engine_cfg: EngineConfig, impls: Impls, weights: str, program_fields: tuple[str, ...]) -> str:
    """The tuner's cache key (machine, jaxlib, model geometry, kernels) for what the engine runs (`impls`, resolved)
    over weights stored as `weights`, with the engine fields its programs take as inputs (`program_fields`, the
    ones a built engine keeps) and prefill packing, but not its bucket tables or batch limits: a program key fixes
    its program's shapes, so its seconds are the same whatever table or limits it runs under, and every table's
    programs (a plan's, a refit's) share one file."""
    limits = {name: getattr(engine_cfg, name) for name in (*program_fields, "prefill_packing")}
    return cache_key(machine_fingerprint(), cfg, engine_cfg, impls, weights, limits=limits)


def _step_costs_path(directory: Path, key: str) -> Path:
    return directory / "step_costs" / f"{key}.json"


def read_step_costs(directory: Path, key: str):
    """The cached step-cost table of `key` (a StepCosts), or None when there is none or it cannot be read."""
    from jaxinfer.scheduling.step_costs import StepCosts  # noqa: PLC0415

    try:
        return StepCosts.from_json(json.loads(_step_costs_path(directory, key).read_text()))
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def write_step_costs(directory: Path, key: str, costs) -> Path:
    """Write the table atomically (a temporary name, fsynced, renamed), as the tuner's results are."""
    path = _step_costs_path(directory, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    with open(temporary, "w") as f:
        f.write(json.dumps(costs.to_json()))
        f.flush()
        os.fsync(f.fileno())
    temporary.replace(path)
    return path
