"""`jaxinfer generate | info | buckets`: the command line.

Only argument parsing and printing live here; the work is in api.py (LLM), batch.py (JSONL jobs) and
buckets.py. Errors a user can fix (a missing file, a bad flag, an unfit memory budget) print one line
to stderr and exit with status 2, without a traceback.
"""

import argparse
import atexit
import contextlib
import dataclasses
import gc
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from jaxinfer.config import ATTENTION_IMPLS, KV_CACHE_DTYPES, MATMUL_IMPLS, POLICIES
from jaxinfer.batch.input import DEFAULT_MAX_LINE_BYTES
from jaxinfer.batch.openai import INPUT_FORMATS
from jaxinfer.options import DEFAULT_INT4_GROUP_SIZE, DTYPE_CHOICES, INT4_GROUP_SIZES, QUANTIZATIONS, LoadOptions
from jaxinfer.scheduling.request import TRUNCATE_SIDES, SamplingParams
from jaxinfer.validation import FieldError

_LOAD_DEFAULTS, _SAMPLING_DEFAULTS = LoadOptions(), SamplingParams()

_GENERATE_EPILOG = """\
input JSONL, one object a line:
  {"id": "q1", "prompt": "Once upon a time"}
  {"id": "q2", "messages": [{"role": "user", "content": "Hi!"}], "temperature": 0, "max_tokens": 64}
  optional per line: temperature, top_k, top_p, seed, max_tokens, stop, stop_token_ids, ignore_eos,
  priority (lower runs first), deadline_s (seconds after submission by which it must start, else an error record),
  cache_salt (prefix-cache pages are shared only between lines with the same salt)

output JSONL: exactly one line per input line, written as each finishes:
  {"id", "line", "key", "status": "ok"|"error", "text", "token_ids", "finish_reason", timings...} or {..., "error": reason}

resume: a line is identified by its id (1 and "1" differ; a repeated id is an error record
  for each repeat) or, without a valid id, by its bytes; it is done once --output holds a record
  with its "key". --resume first checks that every line of --output is a record (else it refuses
  and changes nothing), drops a torn last record and runs exactly the lines not done, so the
  output ends with one record per non-blank input line. Unseeded requests derive their seed from
  the key, so a resumed job draws from the same random keys as an uninterrupted one; its tokens
  are equal too only with --deterministic (otherwise other batch neighbours can round near-tied
  logits differently). FILE.meta.json holds the settings that
  decide the tokens (model, dtype, quantization, seeds, sampling defaults, ...); a resume under
  other settings is refused with the differences listed (--force-settings overrides). FILE.lock
  keeps a second job off the same --output while one runs. --input may be a pipe; a resume
  reads it again, so keep the input in a regular file.

examples:
  jaxinfer generate --prompt "What is the capital of France?" --chat --temperature 0
  jaxinfer generate --input prompts.jsonl --output results.jsonl
  jaxinfer generate --input prompts.jsonl --output results.jsonl --resume   # after a crash or Ctrl-C
  jaxinfer generate --input prompts.jsonl --output results.jsonl --ray --ray-actors 4   # a local Ray cluster
  jaxinfer generate --input prompts.jsonl --output results.jsonl --ray auto --ray-actors 8 --ray-gpus-per-actor 1

ray: --ray runs the lines on Ray Data actors, each holding one model (pip install 'jaxinfer[ray]').
  The output, summary and --resume are the local job's; a killed actor is restarted by Ray and its
  batch rerun, and a line is still written once. Without ADDRESS, Ray starts a local cluster or joins
  the one RAY_ADDRESS names; 'auto' joins the cluster `ray start` made on this machine."""


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="PATH", help="GGUF file or Hugging Face folder (default: embedded SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument(
        "--dtype", default=_LOAD_DEFAULTS.dtype, choices=DTYPE_CHOICES,
        help="compute dtype: auto measures float32 and bfloat16 here and keeps the faster that passes a numerics check "
        "against float32 (cached per machine; float32 with JAXINFER_TUNE=0); a value given is pinned (default: %(default)s)",
    )
    parser.add_argument(
        "--quantization", default=_LOAD_DEFAULTS.quantization, choices=("none", *QUANTIZATIONS),
        help="weights held quantized on the device: auto keeps a GGUF file's blocks where the tuner may multiply them "
        "W8A8 with the CPU quantized-matmul kernel (--matmul cpu_int8) and keeps them only if that measures fastest, "
        "else dense (dense with JAXINFER_TUNE=0); none is dense in --dtype; gguf keeps a GGUF file's own blocks, int8 is "
        "per output channel, int4 groups of --group-size (embedding and head int8) (default: %(default)s)",
    )
    parser.add_argument(
        "--group-size", type=int, default=_LOAD_DEFAULTS.group_size, choices=INT4_GROUP_SIZES,
        help=f"input elements per int4 scale, with --quantization int4 (default: {DEFAULT_INT4_GROUP_SIZE})",
    )


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (defaults for every request; JSONL lines may override)")
    group.add_argument("--temperature", type=float, default=_SAMPLING_DEFAULTS.temperature, help="0 = greedy (default: %(default)s)")
    group.add_argument("--top-k", type=int, default=_SAMPLING_DEFAULTS.top_k, help="keep the k most likely tokens, 0 = off (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=_SAMPLING_DEFAULTS.top_p, help="nucleus sampling mass, 1 = off (default: %(default)s)")
    group.add_argument("--seed", type=int, default=_SAMPLING_DEFAULTS.seed, help="seed of every request (default: derived per request from --engine-seed)")
    group.add_argument("--max-tokens", type=int, default=_SAMPLING_DEFAULTS.max_tokens, help="generated tokens at most (default: %(default)s)")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def _engine_default(name: str):
    from jaxinfer.config import EngineConfig

    return next(f.default for f in dataclasses.fields(EngineConfig) if f.name == name)


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--max-context", type=int, default=_engine_default("max_context"), help="tokens per sequence, prompt + output (default: %(default)s)")
    group.add_argument("--max-num-seqs", type=int, default=_engine_default("max_num_seqs"), help="sequences decoded together at most (default: %(default)s)")
    group.add_argument("--max-prefill-tokens", type=int, default=_engine_default("max_prefill_tokens"),
                       help="prompt tokens one step prefills at most, the largest chunk (vLLM's --max-num-batched-tokens for prefill; default: %(default)s)")
    group.add_argument("--num-pages", type=int, default=None, help="KV pool pages (default: a share of free memory)")
    group.add_argument("--page-size", type=int, default=_engine_default("page_size"), help="tokens per KV page (default: %(default)s)")
    group.add_argument(
        "--attention", default="auto", choices=ATTENTION_IMPLS,
        help="attention back end: auto (the Pallas kernel on a GPU for 16-bit models, the C++ CPU kernel for f32 "
        "models on a CPU, else reference), reference (pure jnp), pallas, cpu (default: %(default)s)",
    )
    group.add_argument(
        "--matmul", default=_engine_default("matmul_impl"), choices=MATMUL_IMPLS,
        help="layer matmuls: auto (tuned like --dtype; with JAXINFER_TUNE=0 the CPU kernel exactly when --attention is and the CPU has AVX-512, else xla), "
        "xla (XLA's dot), cpu (the C++ panel kernel, f32 on a CPU), int8 (W8A8 with --quantization int8, or a Q8_0 GGUF "
        "with --quantization gguf: activations quantized in blocks of 32, XLA's int8 dot), cpu_int8 (the C++ kernels, with int8, Q8_0, "
        "Q4_0 and Q4_1 weights multiplied W8A8 in blocks of 32 by the quantized-matmul kernel: --quantization int8 or gguf); "
        "auto also times int8 and cpu_int8 over such weights (default: %(default)s)",
    )
    group.add_argument(
        "--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES,
        help="store the KV cache quantized: int8 or fp8_e4m3 codes with one f32 scale per token and kv head, "
        "taken when the token is written (0.27x of an f32 pool's bytes at SmolLM2's head dim 64; default: the model's dtype)",
    )
    group.add_argument("--compile-cache", default=_engine_default("compilation_cache_dir"), metavar="DIR", help="persistent XLA cache directory, '' disables (default: %(default)s)")
    group.add_argument("--deterministic", action="store_true", help="bitwise-reproducible logits whatever else is in the batch (fixed program shapes; slower)")
    group.add_argument("--no-prefix-cache", action="store_true", help="recompute every prompt instead of sharing the KV pages of equal prefixes")
    group.add_argument(
        "--policy", default=_engine_default("policy"), choices=POLICIES,
        help="scheduling policy (docs/scheduling.md): fcfs (priority, deadline, arrival), shortest-prompt, edf (early timeouts "
        "for deadlines that cannot be met), prefix (shared prefixes together), adaptive (budgets steered to a step-latency target) (default: %(default)s)",
    )
    group.add_argument(
        "--policy-epoch", type=int, default=_engine_default("policy_epoch"), metavar="N",
        help="with --policy prefix or shortest-prompt: reorder a request only among the N arrivals of its epoch, so none waits "
        "behind later ones (default: one epoch, the most reordering; in a long stream a request may wait until the input ends)",
    )
    group.add_argument(
        "--tensor-parallel", type=int, default=_LOAD_DEFAULTS.tensor_parallel, metavar="N",
        help="shard the model over N devices (query/kv heads, MLP width and vocabulary where they divide N, "
        "replicated where not); on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N simulates devices (default: %(default)s)",
    )
    group.add_argument(
        "--data-parallel", type=int, default=_LOAD_DEFAULTS.data_parallel, metavar="M",
        help="M model replicas, each on its own --tensor-parallel devices with its own KV pool; requests are routed by load (default: %(default)s)",
    )
    group.add_argument("--engine-seed", type=int, default=_engine_default("seed"), help="base seed for requests without their own (default: %(default)s)")


def _add_ray_args(parser: argparse.ArgumentParser) -> None:
    from jaxinfer.batch.ray import DEFAULT_BATCH_SIZE, MAX_TASK_RETRIES

    group = parser.add_argument_group("Ray (jobs across machines; see 'ray' below)")
    group.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS", help="run an --input job on a Ray cluster (default address: a local cluster or RAY_ADDRESS)")
    group.add_argument("--ray-actors", type=int, default=1, metavar="N", help="LLM actors, one model replica each (default: %(default)s)")
    group.add_argument("--ray-batch-size", type=int, default=DEFAULT_BATCH_SIZE, metavar="B", help="lines per actor call (default: %(default)s)")
    group.add_argument("--ray-gpus-per-actor", type=float, default=0.0, metavar="G", help="GPUs each actor reserves, 1 on GPU machines (default: %(default)s)")
    group.add_argument("--ray-cpus-per-actor", type=float, default=1.0, metavar="C", help="CPUs each actor reserves (default: %(default)s)")
    group.add_argument("--ray-max-retries", type=int, default=MAX_TASK_RETRIES, metavar="R",
                       help="times a batch whose actor died (a crash, out of memory) runs again on the restarted actor, then each of its lines alone; "
                            "a line that still kills it gets an error record (default: %(default)s)")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxinfer", description="JAX/XLA batch inference for Llama-family LLMs.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log compile times and engine events")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_generate_parser(commands)
    info = commands.add_parser("info", help="print a model's configuration, parameter count and memory", description="Print a model's configuration, parameter count and memory.")
    _add_model_args(info)
    info.set_defaults(func=_run_info)
    _add_tune_parser(commands)
    from jaxinfer.bucketing import cli as cli_buckets

    cli_buckets.add_subparser(commands)
    from jaxinfer import whatif

    whatif.add_subparser(commands)
    return parser


def _add_generate_parser(commands) -> None:
    gen = commands.add_parser(
        "generate", help="generate for one prompt or a JSONL file of prompts",
        description="Generate text with the paged engine, for one --prompt or every line of an --input JSONL file.",
        epilog=_GENERATE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_generate_io_args(gen)
    _add_model_args(gen)
    _add_sampling_args(gen)
    _add_engine_args(gen)
    _add_ray_args(gen)
    gen.set_defaults(func=_run_generate)


def _add_generate_io_args(gen: argparse.ArgumentParser) -> None:
    """generate's input, output, resume and progress flags."""
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", metavar="TEXT", help="a single prompt; the reply is printed")
    source.add_argument("--input", type=Path, metavar="FILE", help="JSONL file of requests")
    gen.add_argument("--output", type=Path, metavar="FILE", help="JSONL results (required with --input)")
    gen.add_argument("--chat", action="store_true", help="wrap --prompt in the model's chat template as a user message (with --input, a line that gives 'messages' is a chat)")
    gen.add_argument(
        "--truncate", default=TRUNCATE_SIDES[0], choices=TRUNCATE_SIDES,
        help="cut prompts that do not fit --max-context (prompts that fit are never cut), keeping room for --max-tokens "
        "but at least half the context: left keeps the end, right the start (default: none, an error record)",
    )
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="append only the lines not yet in --output (see 'resume' below)")
    mode.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    gen.add_argument(
        "--force-settings", action="store_true",
        help="with --resume: continue even though the settings differ from those in --output's .meta.json (records made under both then mix)",
    )
    gen.add_argument(
        "--no-parse-special", action="store_true",
        help="treat control-token text in prompts (e.g. '<|im_start|>') as plain text; chat message content is always plain text",
    )
    gen.add_argument("--no-progress", action="store_true", help="no progress bars (the tuner's on a first start, warm-up's compiling and timing, the requests')")
    gen.add_argument(
        "--format", default="auto", choices=INPUT_FORMATS,
        help="--input format: jaxinfer's lines, or OpenAI Batch requests (custom_id, method, url, body) as vllm run-batch reads them, "
        "answered in OpenAI's batch output format; auto: from the lines that parse, a file whose lines disagree is refused (default: %(default)s)",
    )
    gen.add_argument(
        "--max-inflight", type=int, default=None, metavar="N",
        help="input lines read, checked and tokenized ahead of their results at most, so memory stays bounded on any input (default: 4 x --max-num-seqs per replica)",
    )
    gen.add_argument(
        "--max-line-bytes", type=int, default=DEFAULT_MAX_LINE_BYTES, metavar="N",
        help="an input line longer than this is its own error record, read past without being held (default: %(default)s, 16 MiB)",
    )
    gen.add_argument(
        "--strict-fields", action="store_true",
        help="an unknown field in a line is that line's error (default: counted and warned about before the model loads, and the line runs without it)",
    )
    gen.add_argument("--plan", action=argparse.BooleanOptionalAction, default=False, help="before warm-up, choose max_num_seqs, max_prefill_tokens, bucket tables and policy on the simulator from a sample of --input, and refit the prefill table on drift (docs/scheduling.md)")
    gen.add_argument("--plan-only", action="store_true", help="print the --plan and stop before warm-up")
    gen.add_argument("--profile", type=Path, default=None, metavar="DIR", help="write a jax.profiler trace of --profile-steps to DIR (opens in TensorBoard and Perfetto)")
    gen.add_argument("--profile-steps", default="1:10", metavar="A:B", help="engine steps A to B (1-based, inclusive) that --profile traces (default: %(default)s)")


def _add_tune_parser(commands) -> None:
    tune = commands.add_parser(
        "tune", help="measure which dtype, matmul and attention run fastest here, and cache the choice",
        description="Time the attention implementations alone on contexts of the engine's size, then every candidate "
        "(dtype, matmul path) with the fastest one on a prefill and a decode program on this machine, check each against "
        "float32, print both tables and cache the choice under the cache root ($JAXINFER_CACHE_DIR, else $XDG_CACHE_HOME/jaxinfer, else ~/.cache/jaxinfer), where LLM "
        "and `generate` read it. A candidate whose weight copies would not fit in memory is not built. Measures even where "
        "a choice is cached.",
    )
    _add_model_args(tune)
    _add_engine_args(tune)
    tune.set_defaults(func=_run_tune)


# Field names of SamplingParams / EngineConfig -> the flag that sets them, so errors use the user's words.
_SAMPLING_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed", "max_tokens": "--max-tokens", "stop": "--stop"}
_ENGINE_FLAGS = {
    "max_context": "--max-context", "max_num_seqs": "--max-num-seqs", "max_prefill_tokens": "--max-prefill-tokens", "policy_epoch": "--policy-epoch", "num_pages": "--num-pages", "page_size": "--page-size",
    "attention_impl": "--attention", "matmul_impl": "--matmul", "group_size": "--group-size", "quantization": "--quantization", "kv_cache_dtype": "--kv-cache-dtype", "compilation_cache_dir": "--compile-cache", "seed": "--engine-seed",
    "tensor_parallel": "--tensor-parallel", "data_parallel": "--data-parallel", "dtype": "--dtype", "parse_special": "--no-parse-special",
}


def _with_flag_names(error: ValueError, flags: dict[str, str]) -> ValueError:
    if isinstance(error, FieldError) and error.field in flags:
        return ValueError(f"{flags[error.field]} {error.problem}")
    return error


def _sampling_params(args):
    try:
        return SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
            max_tokens=args.max_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
        )
    except ValueError as e:
        raise _with_flag_names(e, _SAMPLING_FLAGS) from None


def _engine_config(args):
    """The flags as EngineConfig fields; every other field (the bucket tables) keeps its default, derived
    from these limits exactly as `LLM(**fields)` derives it."""
    from jaxinfer.config import EngineConfig

    try:
        return EngineConfig(
            max_context=args.max_context, max_num_seqs=args.max_num_seqs, max_prefill_tokens=args.max_prefill_tokens, num_pages=args.num_pages, page_size=args.page_size,
            attention_impl=args.attention, matmul_impl=args.matmul, kv_cache_dtype=args.kv_cache_dtype, compilation_cache_dir=args.compile_cache or None, seed=args.engine_seed,
            enable_prefix_caching=not args.no_prefix_cache, deterministic=args.deterministic, policy=args.policy,
            policy_epoch=args.policy_epoch,
        )
    except ValueError as e:
        raise _with_flag_names(e, _ENGINE_FLAGS) from None


def _load_options(args) -> LoadOptions:
    """The model flags as one validated LoadOptions, for this process or for each Ray actor."""
    try:
        return LoadOptions(
            dtype=args.dtype, quantization=None if args.quantization == "none" else args.quantization, group_size=args.group_size, tensor_parallel=getattr(args, "tensor_parallel", 1),
            data_parallel=getattr(args, "data_parallel", 1), parse_special=False if getattr(args, "no_parse_special", False) else None,
        )
    except ValueError as e:
        raise _with_flag_names(e, _ENGINE_FLAGS) from None


def _make_llm(args, load_options: LoadOptions, engine_config):
    from jaxinfer.api import LLM

    print(f"loading {args.model or 'the default model (SmolLM2-135M-Instruct Q4_1)'} and compiling the engine's programs...", file=sys.stderr)
    try:
        return LLM(args.model, options=load_options, engine_config=engine_config, progress=not getattr(args, "no_progress", False))
    except ValueError as e:
        raise _with_flag_names(e, _ENGINE_FLAGS) from None


class _CtrlC:
    """main's SIGINT handler. The first Ctrl-C is a KeyboardInterrupt, which stops the run cleanly (a batch
    job keeps its records and prints its summary), except inside a gc callback (jax registers one), where
    Python would print the exception as ignored and drop it: there the signal is sent again a moment later.
    A second one, while that clean stop or the interpreter's exit runs, leaves at once with 130 and no
    traceback (the records written so far are fsynced one by one; --resume continues)."""

    def __init__(self):
        self.taken = False  # a KeyboardInterrupt was raised: the clean stop is under way

    def __call__(self, signum, frame):
        if self.taken:
            _exit_now(130)
        if frame is not None and any(frame.f_code is getattr(callback, "__code__", None) for callback in gc.callbacks):
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
            return
        self.taken = True
        raise KeyboardInterrupt


def _exit_now(code: int) -> None:
    """Leave the process at once (no atexit handlers, no traceback), after one line and the streams' buffers."""
    with contextlib.suppress(Exception):
        print("jaxinfer: interrupted again: exiting now", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


_RAY_FLAGS = {"num_actors": "--ray-actors", "batch_size": "--ray-batch-size", "num_gpus": "--ray-gpus-per-actor", "num_cpus": "--ray-cpus-per-actor",
              "max_retries": "--ray-max-retries"}


def _ray_options(args):
    """RayOptions from the --ray flags, or None for a job in this process."""
    from jaxinfer.batch.ray import RayOptions

    values = {field: getattr(args, flag[2:].replace("-", "_")) for field, flag in _RAY_FLAGS.items()}
    if args.ray is None:
        defaults = RayOptions()
        for field, flag in _RAY_FLAGS.items():
            if values[field] != getattr(defaults, field):
                raise ValueError(f"{flag} works with --ray")
        return None
    if args.input is None:
        raise ValueError("--ray runs an --input FILE job; --prompt runs in this process")
    try:
        return RayOptions(address=args.ray or None, **values)
    except ValueError as e:
        raise _with_flag_names(e, _RAY_FLAGS) from None


@contextlib.contextmanager
def _profiler(args):
    """The on_step hook tracing --profile-steps into --profile (None without --profile); closed at the end."""
    if args.profile is None:
        yield None
        return
    from jaxinfer.engine import profiling

    profiler = profiling.StepProfiler(args.profile, *profiling.parse_steps(args.profile_steps))
    try:
        yield profiler
    finally:
        profiler.close()
        traced = f"steps {profiler.traced[0]}..{profiler.traced[1]}" if profiler.traced else f"nothing (the run had {profiler.steps} steps)"
        print(f"profile: {traced} traced under {args.profile}", file=sys.stderr)


def _run_generate(args) -> int:
    if args.profile is not None:
        from jaxinfer.engine.profiling import parse_steps

        parse_steps(args.profile_steps)  # a bad A:B fails before the model loads
        if args.ray is not None:
            raise ValueError("--profile traces this process; it does not work with --ray")
    defaults = _sampling_params(args)
    load_options, engine_config = _load_options(args), _engine_config(args)
    ray_options = _ray_options(args)
    if args.input is None:
        return _generate_one(args, defaults, load_options, engine_config)
    if args.chat:
        raise ValueError("--chat works with --prompt; an --input line is a chat when it gives 'messages' instead of 'prompt'")
    if args.output is None:
        raise ValueError("--output FILE is required with --input")
    if args.force_settings and not args.resume:
        raise ValueError("--force-settings works with --resume")
    from jaxinfer.batch.job import BatchJob, check_paths

    check_paths(args.input, args.output, resume=args.resume, overwrite=args.overwrite or args.plan_only)  # --plan-only writes nothing
    try:
        job = BatchJob(
            args.input, args.output, defaults, resume=args.resume, truncate=args.truncate, settings=_job_settings(args), force_settings=args.force_settings,
            fmt=args.format, strict_fields=args.strict_fields, max_inflight=args.max_inflight, max_line_bytes=args.max_line_bytes,
        )
    except FieldError as e:
        raise _with_flag_names(e, {"max_inflight": "--max-inflight", "format": "--format", "max_line_bytes": "--max-line-bytes"}) from None
    with job:
        from jaxinfer.batch import planning

        planned = planning.plan_job(job, args, load_options, engine_config)
        if args.plan_only:
            return 0
        summary, llm = _run_job(job, args, load_options, engine_config, ray_options, planned)
    print(_summary_table(summary, llm), file=sys.stderr)
    print(f"results: {args.output}")
    print(
        f"summary: {summary.num_ok + summary.num_errors} requests ({summary.num_ok} ok, {summary.num_errors} errors), "
        f"{summary.generated_tokens} generated tokens, {summary.tokens_per_second:.1f} tokens/s"
    )
    if summary.interrupted:
        print("interrupted: rerun with --resume to finish the remaining requests", file=sys.stderr)
        return 130
    return 0


def _run_job(job, args, load_options, engine_config, ray_options, planned=None):
    """(summary, the LLM or None): the job's lines run here or on Ray; nothing loads when none is left."""
    if not job.todo:
        why = f"{args.input} has no lines" if not job.lines else f"every line of {args.input} has its record in {args.output}"
        print(f"nothing to do: {why}", file=sys.stderr)
        return job.write([]), None
    if job.num_runnable == 0:  # every line left is an error record: no model is needed to write them
        print(f"no line of {args.input} can run: writing their error records without loading the model", file=sys.stderr)
        return job.run(None, progress=not args.no_progress), None
    if ray_options is None:
        llm = planned or _make_llm(args, load_options, engine_config)
        job.record_resolved(_resolved(llm), force=args.force_settings)
        from jaxinfer.batch.planning import refitting

        with _profiler(args) as profiler, refitting(llm, profiler, planned is not None) as on_step:
            job.runner.on_step = on_step
            return job.run(llm, progress=not args.no_progress), llm
    from jaxinfer.batch import ray as ray_jobs

    print(f"running on Ray: {ray_options.num_actors} actor(s), each loading {args.model or 'the default model'} and compiling its programs...", file=sys.stderr)
    summary = ray_jobs.run_job(job, ray_options, model=args.model, load_options=load_options, engine_config=engine_config, progress=not args.no_progress)
    return summary, None


def _resolved(llm) -> dict:
    """What the engine made of "auto": compute dtype, attention and matmul, and the weights' stored formats."""
    from jaxinfer.model.params import weight_bytes

    formats = sorted({str(fmt) for _, fmt in weight_bytes(llm.engine.params)})
    return {"dtype": llm.choices.dtype, "attention_impl": llm.choices.attention_impl, "matmul_impl": llm.choices.matmul_impl, "weights": formats}


# The flags that decide a line's tokens besides the line itself; a resume must keep them (--force-settings).
_TOKEN_SETTINGS = ("dtype", "quantization", "group_size", "kv_cache_dtype", "engine_seed", "max_context", "deterministic", "no_parse_special")


def _job_settings(args) -> dict:
    from jaxinfer.batch.output_file import model_identity
    from jaxinfer.loading.loading import resolve_model_path

    return {"model": model_identity(resolve_model_path(args.model))} | {name: getattr(args, name) for name in _TOKEN_SETTINGS}


def _generate_one(args, defaults, load_options, engine_config) -> int:
    batch_only = (("--output", args.output), ("--resume", args.resume), ("--overwrite", args.overwrite), ("--force-settings", args.force_settings))
    batch_only += (("--format", args.format != "auto"), ("--max-inflight", args.max_inflight is not None), ("--strict-fields", args.strict_fields))
    batch_only += (("--max-line-bytes", args.max_line_bytes != DEFAULT_MAX_LINE_BYTES), ("--plan", args.plan or args.plan_only))
    for flag, value in batch_only:
        if value:
            raise ValueError(f"{flag} works with --input FILE; --prompt prints its reply")
    if not args.prompt:
        raise ValueError("empty prompt: --prompt needs some text")
    llm = _make_llm(args, load_options, engine_config)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    from jaxinfer.scheduling.scheduler import PromptTooLongError

    try:
        work = llm.prepare(prompt, defaults, index=0, chat=args.chat, truncate=args.truncate)
    except PromptTooLongError as e:
        raise ValueError(f"--prompt: {e} (--truncate left|right cuts it)") from None
    except ValueError as e:
        raise ValueError(f"--prompt: {e}") from None
    with _profiler(args) as profiler:
        (output,) = llm.stream([work], progress=False, on_step=profiler)
    if output.finish_reason == "error":
        raise ValueError(f"--prompt failed: {output.error}")
    print(output.text)
    print(f"[{output.num_prompt_tokens} prompt tokens, {output.num_generated_tokens} generated, finish: {output.finish_reason}, {output.latency:.2f}s; {llm.choices.describe()} ({llm.tuning.source})]", file=sys.stderr)
    return 0


def _summary_table(summary, llm) -> str:
    """The job's figures; the engine's (padding, compiles, KV, ...) when it ran here (llm), '-' on Ray."""
    stats = llm.last_stats if llm is not None else None
    rows = [
        ("requests ok / error / skipped", f"{summary.num_ok} / {summary.num_errors} / {summary.num_skipped}"),
        ("prompt tokens", f"{summary.prompt_tokens}"),
        ("generated tokens", f"{summary.generated_tokens}"),
        ("wall time", f"{summary.seconds:.2f} s"),
        ("generated tokens/s", f"{summary.tokens_per_second:.1f}"),
        ("time to first token p50 / p99", f"{summary.ttft_percentile(50):.3f} / {summary.ttft_percentile(99):.3f} s"),
        ("time per output token p50 / p99", f"{summary.tpot_percentile(50) * 1e3:.1f} / {summary.tpot_percentile(99) * 1e3:.1f} ms"),
        ("queue time p50 / p99", f"{summary.queue_percentile(50):.3f} / {summary.queue_percentile(99):.3f} s"),
        ("padding waste (token slots)", f"{stats.padding_waste:.1%}" if stats else "-"),
        ("choices (dtype, attention, matmul)", f"{llm.choices.describe()} ({llm.tuning.source})" if llm is not None else "- (in each Ray actor)"),
        ("compilations (all at warm-up)", f"{sum(r.engine.num_compilations for r in llm.replicas)} in {sum(r.engine.compile_seconds for r in llm.replicas):.1f} s" if llm is not None else "- (in each Ray actor)"),
        ("KV utilization peak / mean", f"{stats.peak_kv_utilization:.1%} / {stats.mean_kv_utilization:.1%}" if stats else "-"),
        ("preemptions", f"{stats.num_preemptions}" if stats else "-"),
        ("prefix cache hit tokens / queried", f"{stats.prefix_cache_hits} / {stats.prefix_cache_queries} ({stats.prefix_cache_hit_rate:.1%})" if stats else "-"),
    ]
    if llm is not None and len(llm.replicas) > 1:  # the scheduler rows above are replica 0's
        rows.append(("replicas: requests each (rows above: replica 0)", " / ".join(str(llm.last_routes.count(i)) for i in range(len(llm.replicas)))))
    width = max(len(name) for name, _ in rows)
    return "\n".join(["", "summary", "-" * (width + 20)] + [f"{name:<{width}}  {value}" for name, value in rows])


def _run_info(args) -> int:
    from jaxinfer import model_commands

    return model_commands.info(args.model, _load_options(args), quantization=args.quantization)


def _run_tune(args) -> int:
    from jaxinfer import model_commands

    return model_commands.tune(args.model, _load_options(args), _engine_config(args))


def main(argv: list[str] | None = None) -> int:
    """The `jaxinfer` command. Without `argv` it is the process's entry point, and a run stopped by Ctrl-C
    ends in `_leave_after_interrupt`, so that a second Ctrl-C exits 130 quietly however late it comes; an
    in-process caller (argv given) gets its own SIGINT handler back and the code returned."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    ctrl_c = _CtrlC()
    previous = signal.signal(signal.SIGINT, ctrl_c) if in_main_thread else None
    entry = in_main_thread and argv is None
    try:
        code = _main(argv)
    finally:
        if in_main_thread and not (ctrl_c.taken and entry):
            signal.signal(signal.SIGINT, previous)
    if ctrl_c.taken and entry:
        _leave_after_interrupt(code)
    return code


def _leave_after_interrupt(code: int) -> None:
    """The end of a process whose run Ctrl-C stopped: the atexit handlers (jax's, Ray's) run under the Ctrl-C
    handler, then the process leaves without the interpreter's teardown, where Python puts SIGINT back to
    its default and a second Ctrl-C would kill it (exit -2) or print a traceback from a cleanup."""
    atexit._run_exitfuncs()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _main(argv: list[str] | None) -> int:
    try:
        args = _build_parser().parse_args(argv)
    except KeyboardInterrupt:
        return 130
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # ModelLoadError and PoolTooLargeError among them (ValueErrors: no engine import, so whatif imports no jax)
        print(f"jaxinfer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # during load or compile; a running batch job stops cleanly by itself
        print("jaxinfer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
