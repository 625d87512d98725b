"""The model commands of the CLI, `jaxinfer info` and `jaxinfer tune`: load a model and print what it is, or
measure which implementation runs it fastest here. cli.py parses the flags and calls these (kept apart so the
CLI's --help imports no jax); they print to stdout and return the exit code.
"""

import dataclasses
import sys

from jaxinfer.config import KV_CACHE_DTYPES, EngineConfig
from jaxinfer.engine import tuning
from jaxinfer.loading import loading
from jaxinfer.loading.tokenizer import describe_tokenizer, load_tokenizer, missing_tokenizer
from jaxinfer.model import kv_pool
from jaxinfer.model import params as params_module
from jaxinfer.options import LoadOptions


def info(model, load_options: LoadOptions, *, quantization: str | None) -> int:
    """`jaxinfer info`: the model's configuration, features, tokenizer, parameters, weight bytes and KV bytes."""
    path = loading.resolve_model_path(model)
    if load_options.quantization == "auto":  # what the engine holds: a GGUF's blocks where its kernel may run them, F16/BF16 16-bit
        cfg, params = loading.load_for_engine(path, load_options, EngineConfig())
        quantization = "auto, as the engine loads it"
    else:
        cfg, params = loading.load_model(path, **load_options.load_kwargs)
    print(f"model file        {path} ({path.stat().st_size / 2**20:.1f} MiB on disk)" if path.is_file() else f"model folder      {path}")
    print(f"{'family':<17} {cfg.architecture}")
    for feature, value in cfg.features().items():
        print(f"{feature:<17} {value}")
    print(f"{'tokenizer':<17} {describe_tokenizer(path)}")
    for field in dataclasses.fields(cfg):
        print(f"{field.name:<17} {getattr(cfg, field.name)}")
    print(f"{'parameters':<17} {cfg.num_params():,}")
    print(weight_table(params_module.weight_bytes(params), quantization, tied=cfg.tie_embeddings))
    for kv_cache_dtype in (None, *KV_CACHE_DTYPES):
        per_token = kv_pool.token_bytes(cfg, kv_cache_dtype)
        kind = f"--kv-cache-dtype {kv_cache_dtype} (codes + f32 scales)" if kv_cache_dtype else f"{cfg.dtype} (default)"
        print(f"{'KV per token':<17} {per_token:>6} bytes = {per_token * 2048 / 2**20:5.1f} MiB per 2048-token sequence, {kind}")
    return 0


def tune(model, load_options: LoadOptions, engine_config: EngineConfig) -> int:
    """`jaxinfer tune`: measure the candidates now, print the tuner's table and write the cache."""
    cfg, params = loading.load_for_engine(model, load_options, engine_config)
    pins = tuning.Impls(load_options.dtype, engine_config.attention_impl, engine_config.matmul_impl)
    if pins.all_pinned:
        raise ValueError("--dtype, --attention and --matmul are all pinned: nothing to tune")
    print(f"tuning on {tuning.machine_fingerprint().get('cpu') or tuning.machine_fingerprint().get('device')}...", file=sys.stderr)
    progress = lambda m: print(f"  {m.candidate}: {m.status}", file=sys.stderr, flush=True)  # noqa: E731
    tokenizer = load_tokenizer(model) if missing_tokenizer(model) is None else None  # a model without one is tuned on token ids, as LLM runs it
    result = tuning.choose_for_model(cfg, params, engine_config, pins, tokenizer=tokenizer, enabled=True,
                                     quantization=load_options.quantization, on_mesh=load_options.on_mesh, progress=progress, refresh=True)
    if not result.measurements:
        raise ValueError(f"nothing to tune with {result.reason}: the fixed rule applies")
    print(tuning.format_table(result))
    print(f"tuned in {result.seconds:.1f} s; cached at {result.path}")
    return 0


def weight_table(by_kind_and_format: dict[tuple[str, str], int], quantization: str | None, *, tied: bool) -> str:
    """Resident weight bytes, one row per tensor kind, one column per storage format, with totals."""
    kinds = params_module.KINDS
    formats = sorted({fmt for _, fmt in by_kind_and_format})
    cell = lambda n: f"{n / 2**20:.2f} MiB" if n else "-"  # noqa: E731
    lines = [f"{'weights in memory':<17} quantization: {quantization or 'none (dense)'}", f"  {'kind':<11}" + "".join(f"{f:>13}" for f in formats) + f"{'total':>13}"]
    for kind in kinds:
        row = [by_kind_and_format.get((kind, f), 0) for f in formats]
        note = "  (tied: the embedding; final norm only)" if kind == "head" and tied else ""
        lines.append(f"  {kind:<11}" + "".join(f"{cell(n):>13}" for n in row) + f"{cell(sum(row)):>13}{note}")
    totals = [sum(n for (_, f), n in by_kind_and_format.items() if f == fmt) for fmt in formats]
    lines.append(f"  {'total':<11}" + "".join(f"{cell(n):>13}" for n in totals) + f"{cell(sum(totals)):>13}")
    return "\n".join(lines)
