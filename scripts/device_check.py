"""How close does the Mosaic GPU paged-attention decode kernel get to the memory-bandwidth floor?

One script for one H200 session, under a global time budget (--budget-s) and a watchdog:
  1. ceilings: device copy bandwidth ((read + write) bytes / time) and bf16 matmul rate;
  2. correctness: the kernel against paged_attention_reference once per distinct tuned config, with
     awkward lengths, plus int8 and fp8 (e4m3) pools quantized per token;
  3. timing: kernel and XLA reference over BATCHES x CONTEXTS plus the MILESTONE shape (timed first,
     also with int8 and fp8 pools); bandwidth = K+V bytes read / time, as a share of the copy rate;
  4. tuning: alternative configs at the milestone shape, so TUNED_TABLE can be re-seeded.
Each phase records its errors in the JSON instead of crashing; writes device_check.json under $OUT
(default experiments/results/gpu/). Needs only jax, numpy and absl-py (no jaxinfer install), and the
repository root on the path for kernels_pallas; it imports nothing from experiments/ or tests/:

    PYTHONPATH=. python3 scripts/device_check.py            # on the GPU box
    PYTHONPATH=. python3 scripts/device_check.py --dry-run  # CPU: tiny shapes, interpreter
"""

import argparse
import contextlib
import dataclasses
import io
import json
import os
import pathlib
import platform
import subprocess
import sys
import threading
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import paged_attention as pa

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
BATCHES = (1, 8, 32, 64, 128)
CONTEXTS = (512, 2048, 8192)
MILESTONE = (64, 4096)  # (batch, context tokens)
NUM_KV_HEADS, HEAD_DIM, GROUP_SIZES = 8, 128, (4, 8)
REL_ERR_LIMIT = 2e-2  # bf16/f16 relative error norm, as in tests/test_kernels.py
H200_HBM_TB_S = 4.8  # spec sheet, for reference only: the floor uses the measured copy rate


@dataclasses.dataclass
class Budget:
    """Global wall-clock budget: phases skip what no longer fits and say so in the JSON."""

    seconds: float
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:400]}"


def _wall(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def time_chained(fn, args, *, calls: int = 8) -> float:
    """Seconds per call of `fn(q, *rest)`: one jitted, unrolled chain of `calls` dependent calls
    (one dispatch, no host sync in between), median of 3, compile excluded. Each call adds q + 0
    and sums its whole output (both tiny next to the KV reads), so XLA can neither hoist a call
    out nor compute only part of an output."""
    def run(q, *rest):
        carry = jnp.float32(0)
        for _ in range(calls):
            out = fn(q + carry.astype(q.dtype), *rest)
            carry = carry * 0 + jnp.sum(out.astype(jnp.float32)) * 0  # x * 0 is not folded
        return carry

    chain = jax.jit(run)
    _wall(chain, *args)  # compile
    return float(np.median([_wall(chain, *args) for _ in range(3)])) / calls


def time_back_to_back(fn, args, *, calls: int = 10) -> float:
    """Seconds per call for big ops (over ~1 ms): `calls` async dispatches, one sync at the end."""
    jax.block_until_ready(fn(*args))  # compile

    def run():
        out = None
        for _ in range(calls):
            out = fn(*args)
        return out

    return float(np.median([_wall(run) for _ in range(3)])) / calls


def measure_ceilings(dry_run: bool) -> dict:
    """Copy bandwidth ((read + write) bytes / s) and bf16 matmul FLOP/s."""
    def copy():
        x = jnp.ones(((1 << 24) if dry_run else (1 << 30),), jnp.bfloat16)  # 2 GiB of bf16 on the GPU
        seconds = time_back_to_back(jax.jit(lambda a: a + jnp.bfloat16(1)), (x,))
        return {"copy_bytes": 2 * x.nbytes, "copy_tb_s": 2 * x.nbytes / seconds / 1e12}

    def matmul():
        n = 1024 if dry_run else 8192
        a = jnp.ones((n, n), jnp.bfloat16)
        seconds = time_back_to_back(jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.float32)), (a, a))
        return {"matmul_n": n, "matmul_tflops": 2 * n**3 / seconds / 1e12}

    out = {}
    for name, measure in (("copy", copy), ("matmul", matmul)):
        try:
            out |= measure()
        except Exception as e:
            out[f"{name}_error"] = _error(e)
    return out


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    context: int  # tokens per sequence (max_pages * page_size)
    num_kv_heads: int
    group_size: int
    head_dim: int
    page_size: int
    dtype: str = "bfloat16"
    kv_dtype: str | None = None  # "int8" / "float8_e4m3fn": quantized pools, f32 scale per token

    @property
    def max_pages(self) -> int:
        return -(-self.context // self.page_size)

    def kv_bytes(self, lengths) -> int:
        """K and V bytes the kernel must read: valid tokens, whole pages."""
        pages = -(-np.asarray(lengths, np.int64) // self.page_size)
        itemsize = jnp.dtype(self.kv_dtype or self.dtype).itemsize
        per_token = self.head_dim * itemsize + (4 if self.kv_dtype else 0)  # codes + a scale
        per_page = 2 * self.num_kv_heads * self.page_size * per_token
        return int(pages.sum() * per_page)


def quantize_per_token(x, kv_dtype: str, head_dim_axis: int):
    """(codes, f32 scales [G, P, L]): scale = max |x| over the head dim / 127 (int8) or / 448
    (float8_e4m3fn)."""
    code_max = 127.0 if kv_dtype == "int8" else 448.0
    x = x.astype(jnp.float32)
    scales = jnp.abs(x).max(axis=head_dim_axis) / code_max
    y = jnp.clip(x / jnp.expand_dims(jnp.where(scales > 0, scales, 1.0), head_dim_axis),
                 -code_max, code_max)
    return (jnp.round(y) if kv_dtype == "int8" else y).astype(kv_dtype), scales


def make_inputs(shape: Shape, lengths, seed: int, q_scale: float = 1.0):
    """Random pool with a shuffled page assignment (page 0 is the null page). Returns
    (q, k, v, block_tables, lengths, scales): scales is {} or, for a quantized pool, the
    k_scales / v_scales keyword arguments."""
    rng = np.random.default_rng(seed)
    num_pages = shape.batch * shape.max_pages + 1
    tables = (rng.permutation(num_pages - 1) + 1).astype(np.int32)
    tables = tables.reshape(shape.batch, shape.max_pages)
    lengths = np.asarray(lengths, np.int32)
    tables[np.arange(shape.max_pages)[None, :] * shape.page_size >= lengths[:, None]] = 0
    key_q, key_k, key_v = jax.random.split(jax.random.key(seed), 3)
    dtype, heads = jnp.dtype(shape.dtype), shape.num_kv_heads
    q = jax.random.normal(key_q, (shape.batch, heads * shape.group_size, shape.head_dim)) * q_scale
    k = jax.random.normal(key_k, (heads, num_pages, shape.head_dim, shape.page_size), dtype)
    v = jax.random.normal(key_v, (heads, num_pages, shape.page_size, shape.head_dim), dtype)
    scales = {}
    if shape.kv_dtype:
        k, k_scales = quantize_per_token(k, shape.kv_dtype, head_dim_axis=2)
        v, v_scales = quantize_per_token(v, shape.kv_dtype, head_dim_axis=3)
        scales = dict(k_scales=k_scales, v_scales=v_scales)
    return q.astype(dtype), k, v, jnp.asarray(tables), jnp.asarray(lengths), scales


def awkward_lengths(shape: Shape, config: pa.PagedAttentionConfig, rng) -> np.ndarray:
    """1, L-1, L, L+1, a split boundary +-1, the max, then random; one per sequence."""
    page, context = shape.page_size, shape.context
    blocks = -(-shape.max_pages // config.pages_per_block)
    boundary = -(-blocks // config.num_splits) * config.pages_per_block * page
    picks = [1, page - 1, page, page + 1, boundary - 1, boundary, boundary + 1, context]
    picks = [min(max(n, 1), context) for n in picks]
    extra = rng.integers(1, context + 1, size=max(0, shape.batch - len(picks)))
    return np.concatenate([picks, extra])[: shape.batch].astype(np.int32)


def check_one(shape: Shape, config, seed: int, q_scale: float, interpret) -> dict:
    """The kernel against the reference on awkward lengths: relative error norm, finiteness, and (under
    the interpreter) whether its race detector reported a race while the kernel ran."""
    rng = np.random.default_rng(seed)
    lengths = awkward_lengths(shape, config, rng)
    q, k, v, bt, lens, scales = make_inputs(shape, lengths, seed, q_scale)
    pa.validate_block_tables(np.asarray(bt), k.shape[1], np.asarray(lens), shape.page_size)
    with _races_reported() as races:
        out = jax.block_until_ready(pa.paged_attention(q, k, v, bt, lens, **scales, config=config, interpret=interpret))
    ref = np.asarray(pa.paged_attention_reference(q, k, v, bt, lens, **scales), np.float64)
    err = float(np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref))  # relative error norm
    finite = bool(np.isfinite(np.asarray(out, np.float32)).all())
    row = dict(rel_err=err, finite=finite, ok=finite and err <= REL_ERR_LIMIT)
    if interpret:
        row.update(races=races["found"], ok=row["ok"] and not races["found"])
    return row


@contextlib.contextmanager
def _races_reported():
    """{"found": bool}, set on exit: whether the GPU interpreter's race detector printed "RACE DETECTED"
    while the block ran. That message is its public report (InterpretGPUParams(detect_races=True)); the
    flag behind it lives in a private module. What the block printed is passed on to stdout."""
    result, captured = {"found": False}, io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield result
    finally:
        text = captured.getvalue()
        result["found"] = "RACE DETECTED" in text
        sys.stdout.write(text)


def correctness_cases(dry_run: bool):
    """(Shape, config) per distinct tuned config, at a shape inside its bucket; plus the
    default model's GQA 3 at head_dim 64, an f16 run, and int8 / fp8 pools (tuned and
    deterministic configs). Dry run: two interpreter cases, bf16 and int8."""
    if dry_run:
        return [(Shape(2, 192, 2, 4, 64, 64), pa.PagedAttentionConfig(num_splits=2)),
                (Shape(2, 128, 1, 4, 64, 64, kv_dtype="int8"), pa.PagedAttentionConfig())]
    cases, seen = [], set()
    for e in pa.TUNED_TABLE:
        if (e.head_dim, e.page_size, e.config) in seen:
            continue
        seen.add((e.head_dim, e.page_size, e.config))
        heads = 8
        batch = max(8, min(e.max_rows, 256) // heads)  # >= 8 rows: all the awkward lengths
        context = min(e.max_context, 8192)
        cases.append((Shape(batch, context, heads, 4, e.head_dim, e.page_size), e.config))
    for dtype, group, head_dim in (("bfloat16", 3, 64), ("float16", 8, 128)):
        shape = Shape(8, 1024, 3, group, head_dim, 64, dtype)
        cases.append((shape, pa.config_for(8, 16, 3, group, head_dim, 64)))
    for kv_dtype, dtype, head_dim, page in (("int8", "bfloat16", 128, 64),
                                            ("float8_e4m3fn", "bfloat16", 64, 128),
                                            ("float8_e4m3fn", "float16", 128, 128)):
        shape = Shape(8, 2048, 4, 4, head_dim, page, dtype, kv_dtype)
        cases.append((shape, pa.config_for(8, shape.max_pages, 4, 4, head_dim, page)))
    shape = Shape(8, 2048, 4, 8, 128, 64, "bfloat16", "int8")
    cases.append((shape, pa.deterministic_config(128, 64, 8)))
    return cases


def run_correctness(rows: list, budget: Budget, reserve_s: float, dry_run: bool, interpret):
    for i, (shape, config) in enumerate(correctness_cases(dry_run)):
        row = dict(shape=dataclasses.asdict(shape), config=dataclasses.asdict(config))
        if budget.left() < reserve_s:
            rows.append(dict(row, skipped="time budget"))
            continue
        try:
            row.update(check_one(shape, config, seed=100 + i, q_scale=5.0 if i % 2 else 1.0,
                                 interpret=interpret))
        except Exception as e:  # the interpreter cleans its state up after a failed kernel
            row.update(ok=False, error=_error(e))
        rows.append(row)
        print(f"correctness {i:2d} {shape} {config}: "
              f"{row.get('rel_err', row.get('error', row.get('skipped')))}", flush=True)


def timing_shapes(dry_run: bool) -> list[Shape]:
    if dry_run:
        return [Shape(b, c, 2, g, 64, 64) for b in (1, 2) for c in (128, 256) for g in (2,)]
    pairs = [MILESTONE] + [(b, c) for c in CONTEXTS for b in BATCHES]
    shapes = [Shape(b, c, NUM_KV_HEADS, g, HEAD_DIM, 64) for b, c in pairs for g in GROUP_SIZES]
    quantized = [Shape(*MILESTONE, NUM_KV_HEADS, GROUP_SIZES[0], HEAD_DIM, 64, kv_dtype=kv)
                 for kv in ("int8", "float8_e4m3fn")]
    return shapes[:2] + quantized + shapes[2:]  # the milestone shape first, then quantized


def time_shape(shape: Shape, ceilings: dict, *, kernel: bool, reference: bool = True,
               config=None) -> dict:
    """Kernel and reference time at full length; bandwidth as a share of the copy rate."""
    lengths = np.full((shape.batch,), shape.context, np.int32)
    q, k, v, bt, lens, scales = make_inputs(shape, lengths, seed=7)
    if config is None:
        config = pa.config_for(shape.batch, shape.max_pages, shape.num_kv_heads, shape.group_size,
                               shape.head_dim, shape.page_size)
    kv_bytes = shape.kv_bytes(lengths)
    row = dict(dataclasses.asdict(shape), config=dataclasses.asdict(config), kv_bytes=kv_bytes)
    copy = ceilings.get("copy_tb_s")
    fns = {}
    if kernel:
        fns["kernel"] = lambda *a, **kw: pa.paged_attention(*a, **kw, config=config)
    if reference:
        fns["reference"] = pa.paged_attention_reference
    scale_args = (scales["k_scales"], scales["v_scales"]) if scales else ()
    for name, fn in fns.items():
        if scales:  # time_chained passes arrays positionally; the scales are keyword-only
            fn = (lambda f: lambda *a: f(*a[:5], k_scales=a[5], v_scales=a[6]))(fn)
        try:
            seconds = time_chained(fn, (q, k, v, bt, lens, *scale_args))
            row[f"{name}_us"] = seconds * 1e6
            row[f"{name}_tb_s"] = kv_bytes / seconds / 1e12
            if copy:
                row[f"{name}_frac_copy"] = row[f"{name}_tb_s"] / copy
        except Exception as e:
            row[f"{name}_error"] = _error(e)
    if "kernel_us" in row and "reference_us" in row:
        row["speedup_vs_reference"] = row["reference_us"] / row["kernel_us"]
    return row


def _timed_rows(rows: list, budget: Budget, reserve_s: float, items, ceilings: dict, **kwargs):
    """time_shape over (shape, config, row stub) items, a row per item: skipped past the reserve, or its error."""
    for shape, config, stub in items:
        if budget.left() < reserve_s:
            rows.append(dict(stub, skipped="time budget"))
            continue
        try:
            rows.append(time_shape(shape, ceilings, config=config, **kwargs))
        except Exception as e:
            rows.append(dict(stub, error=_error(e)))
        print_timing_row(rows[-1])


def run_timing(rows: list, budget: Budget, reserve_s: float, ceilings: dict, dry_run: bool):
    items = [(shape, None, dataclasses.asdict(shape)) for shape in timing_shapes(dry_run)]
    _timed_rows(rows, budget, reserve_s, items, ceilings, kernel=not dry_run)


def run_tuning(rows: list, budget: Budget, reserve_s: float, ceilings: dict, dry_run: bool):
    """Kernel-only timing of alternative configs at the milestone shape."""
    if dry_run:
        return
    alternatives = [pa.PagedAttentionConfig(num_splits=s, pages_per_block=b, pipeline_depth=d)
                    for b, d in ((1, 2), (1, 4), (2, 2), (2, 3)) for s in (1, 2)]
    items = [(Shape(*MILESTONE, NUM_KV_HEADS, group, HEAD_DIM, 64), config,
              dict(group_size=group, config=dataclasses.asdict(config))) for group in GROUP_SIZES for config in alternatives]
    _timed_rows(rows, budget, reserve_s, items, ceilings, kernel=True, reference=False)


def print_timing_row(row: dict) -> None:
    if "skipped" in row or "error" in row:
        print(f"  {row}", flush=True)
        return
    c = row["config"]
    knobs = f"s{c['num_splits']}/b{c['pages_per_block']}/d{c['pipeline_depth']}"
    cells = [f"{row['batch']:>5} {row['context']:>6} {row['group_size']:>3} {knobs:>10} "
             f"{row.get('kv_dtype') or row.get('dtype', ''):>13}"]
    for name in ("kernel", "reference"):
        if f"{name}_us" in row:
            frac = row.get(f"{name}_frac_copy", float("nan"))
            cells.append(f"{name} {row[f'{name}_us']:9.1f} us {row[f'{name}_tb_s']:5.2f} TB/s "
                         f"({100 * frac:5.1f}% of copy)")
        elif f"{name}_error" in row:
            cells.append(f"{name} ERROR {row[f'{name}_error'][:80]}")
    print("  ".join(cells), flush=True)


def load_aot(rows: list, aot_dir: str, budget: Budget, reserve_s: float) -> None:
    """Load the executables `make gpu-aot` compiled for an H200 without one (carry build/gpu-aot to the GPU
    machine): each one deserialized onto this device, or the error that says why it could not be. On a CPU
    (--dry-run) they cannot load, and the rows say so; nothing here fails the check."""
    import pickle  # noqa: PLC0415

    from jax.experimental import serialize_executable  # noqa: PLC0415

    for path in sorted(pathlib.Path(aot_dir).glob("*/*.pickle")):
        if budget.left() < reserve_s:
            rows.append({"file": str(path), "skipped": "budget"})
            continue
        start = time.perf_counter()
        try:
            serialize_executable.deserialize_and_load(*pickle.loads(path.read_bytes()))
            rows.append({"file": str(path), "ok": True, "load_s": time.perf_counter() - start})
        except Exception as e:
            rows.append({"file": str(path), "ok": False, "error": _error(e)})


def device_info() -> dict:
    """JAX's backend, the first device's kind, the device count and its peak bytes in use (where reported)."""
    devices = jax.devices()
    stats = (devices[0].memory_stats() or {}) if hasattr(devices[0], "memory_stats") else {}
    return {"backend": jax.default_backend(), "kind": devices[0].device_kind, "count": len(devices),
            "peak_bytes_in_use": stats.get("peak_bytes_in_use")}


def _commit() -> str | None:
    """The checked-out commit, or None where there is no git (the GPU box may have none)."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def write_doc(doc: dict, out_dir: str, dry_run: bool) -> pathlib.Path:
    """The document as JSON under `out_dir`, with a "machine" block (commit, platform, device and its
    peak bytes); the measured peaks stay under "ceilings"."""
    machine = {"commit": _commit(), "platform": platform.platform(), "python": platform.python_version(),
               "jax": jax.__version__, "device": device_info()}
    path = pathlib.Path(out_dir) / f"device_check{'_dry_run' if dry_run else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**doc, "machine": machine}, indent=1, default=str) + "\n")
    return path


def finish(doc: dict, budget: Budget, args) -> int:
    doc["elapsed_s"] = budget.seconds - budget.left()
    doc["ok"] = not doc["errors"] and all(r.get("ok", True) for r in doc.get("correctness", []))
    try:
        write_doc(doc, args.out, args.dry_run)
    except Exception as e:
        doc["errors"].append(f"write: {_error(e)}")
    print(json.dumps(doc, default=str), flush=True)
    return 0 if doc["ok"] else 1


def start_watchdog(doc: dict, budget: Budget, args) -> None:
    """If a phase hangs (say, a kernel deadlocks on a barrier), write what we have and exit."""
    def fire():
        doc["errors"].append(f"watchdog: still running {args.budget_s + 30:.0f} s after start")
        os._exit(finish(doc, budget, args) or 3)

    timer = threading.Timer(args.budget_s + 30, fire)
    timer.daemon = True
    timer.start()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU: tiny shapes, reference timing only, one interpreter case")
    parser.add_argument("--budget-s", type=float, default=420.0, help="global wall-clock budget")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO_ROOT / "experiments/results/gpu"))
    parser.add_argument("--aot-dir", default=str(REPO_ROOT / "build/gpu-aot"),
                        help="executables `make gpu-aot` compiled for an H200 (loaded first; absent: skipped)")
    args = parser.parse_args(argv)
    budget = Budget(args.budget_s)
    doc = dict(experiment="device_check", dry_run=args.dry_run, budget_s=args.budget_s, errors=[],
               ceilings={}, correctness=[], timing=[], tuning=[], aot=[])
    start_watchdog(doc, budget, args)
    try:
        doc["device"] = device_info()
    except Exception as e:
        doc["errors"].append(f"device: {_error(e)}")
    if doc.get("device", {}).get("backend") != "gpu" and not args.dry_run:
        doc["errors"].append("no GPU backend: run on the GPU box, or pass --dry-run on CPU")
        return finish(doc, budget, args)
    interpret = plgpu.InterpretGPUParams(detect_races=True) if args.dry_run else False
    total = args.budget_s
    phases = (  # (name, run); each run stops starting new items when its reserve is reached
        ("aot", lambda: load_aot(doc["aot"], args.aot_dir, budget, 0.9 * total)),
        ("ceilings", lambda: doc["ceilings"].update(measure_ceilings(args.dry_run))),
        ("correctness", lambda: run_correctness(
            doc["correctness"], budget, 0.6 * total, args.dry_run, interpret)),
        ("timing", lambda: run_timing(
            doc["timing"], budget, 0.12 * total, doc["ceilings"], args.dry_run)),
        ("tuning", lambda: run_tuning(doc["tuning"], budget, 20, doc["ceilings"], args.dry_run)),
    )
    for name, run in phases:
        print(f"== {name} ({budget.left():.0f} s left)", flush=True)
        try:
            run()
        except Exception as e:
            doc["errors"].append(f"{name}: {_error(e)}\n{traceback.format_exc()[-1500:]}")
        try:
            write_doc(doc, args.out, args.dry_run)  # partial results survive a later hang or kill
        except Exception as e:
            doc["errors"].append(f"write: {_error(e)}")
    print(f"ceilings: {doc['ceilings']}", flush=True)
    return finish(doc, budget, args)


if __name__ == "__main__":
    sys.exit(main())
