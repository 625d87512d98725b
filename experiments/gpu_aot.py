"""Compile every GPU program for an H200 on this CPU machine: the Pallas kernel and the engine's programs.

Deviceless ahead-of-time compilation (jaxinfer/engine/aot.py): the CUDA plugin's topology of one compile-only
H200, XLA's GPU passes, the Mosaic GPU compiler and ptxas, nothing run. Reports per program the compile time,
the compiled memory (argument, output, aliased, temporary and code bytes), which parameters the executable
aliases (the donated pool must be among them) and, per kernel, the registers, spills and shared memory ptxas
and Mosaic report. Serializes every executable under --exe-dir for the GPU run to load first.

    make gpu-aot                                           # .venv-gpu with the plugin, then this script
    JAX_PLATFORMS=cpu .venv-gpu/bin/python experiments/gpu_aot.py --quick   # a few programs, a minute
"""

import concurrent.futures
import datetime
import functools
import json
import os
import pathlib
import pickle
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax starts: the plugin then registers without a driver

import jax
import jax.numpy as jnp

from common import report
from jaxinfer.config import EngineConfig
from jaxinfer.engine import aot
from kernels_pallas import paged_attention as pa

SCRIPT = "gpu_aot"
BATCHES, CONTEXTS = (1, 8, 64), (512, 4096, 32768)
HEAD_DIMS, PAGE_SIZES, GROUPS = (64, 128), (64, 128), (1, 4, 8)
NUM_KV_HEADS = 8
HEADLINE = dict(batch=64, context=4096, head_dim=128, page_size=64, group=4)  # the kernel goal's shape
OUT = pathlib.Path(__file__).parent / "results" / "gpu"


def parse_args(argv):
    parser = report.arg_parser(__doc__, out=OUT)
    parser.add_argument("--exe-dir", type=pathlib.Path, default=pathlib.Path("build/gpu-aot"), help="serialized executables (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="a few kernel shapes and programs (the test's run)")
    parser.add_argument("--geometries", default=",".join(aot.GEOMETRIES), help="comma list of %(default)s")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="programs compiled at once (default: %(default)s)")
    args = parser.parse_args(argv)
    args.geometries = report.comma_list(parser, args.geometries, aot.GEOMETRIES, "geometry")
    return args


# ------------------------------------------------------------------ the kernel


def kernel_shapes(quick: bool) -> list[dict]:
    """The headline sweep, or (quick) the goal's shape and one small one."""
    if quick:
        return [HEADLINE, dict(batch=1, context=512, head_dim=64, page_size=128, group=8)]
    return [dict(batch=b, context=c, head_dim=k, page_size=p, group=g)
            for b in BATCHES for c in CONTEXTS for k in HEAD_DIMS for p in PAGE_SIZES for g in GROUPS]


def kernel_program(shape: dict, mesh, *, config=None, kv_dtype=jnp.bfloat16):
    """(config, lower) of the kernel over a whole-batch pool of these sizes, on the compile-only device."""
    b, k, page, group = shape["batch"], shape["head_dim"], shape["page_size"], shape["group"]
    max_pages = shape["context"] // page
    num_pages = b * max_pages + 1
    config = config or pa.config_for(b, max_pages, NUM_KV_HEADS, group, k, page)
    rep = aot.replicated(mesh)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)  # noqa: E731
    args = [spec((b, NUM_KV_HEADS * group, k), jnp.bfloat16), spec((NUM_KV_HEADS, num_pages, k, page), kv_dtype),
            spec((NUM_KV_HEADS, num_pages, page, k), kv_dtype), spec((b, max_pages), jnp.int32), spec((b,), jnp.int32)]
    quantized = jnp.dtype(kv_dtype).itemsize == 1
    if quantized:
        args += [spec((NUM_KV_HEADS, num_pages, page), jnp.float32)] * 2

    def attend(q, kp, vp, tables, lengths, *scales):
        return pa.paged_attention(q, kp, vp, tables, lengths, config=config, **dict(zip(("k_scales", "v_scales"), scales)))

    return config, functools.partial(jax.jit(attend).lower, *args)


def table_entry(shape: dict) -> tuple:
    """The TUNED_TABLE row a shape falls in (its bucket), as (head_dim, page_size, max_rows, max_context)."""
    rows, context = shape["batch"] * NUM_KV_HEADS, shape["context"]
    entry = next(e for e in pa.TUNED_TABLE if (e.head_dim, e.page_size) == (shape["head_dim"], shape["page_size"])
                 and rows <= e.max_rows and context <= e.max_context)
    return entry.head_dim, entry.page_size, entry.max_rows, entry.max_context


def kernel_jobs(mesh, quick: bool) -> list[tuple[str, dict, object]]:
    """(name, facts, lower) for the sweep, the deterministic config at each (head_dim, page) and the quantized pools."""
    jobs = []
    for shape in kernel_shapes(quick):
        config, lower = kernel_program(shape, mesh)
        jobs.append((_shape_name(shape), {**shape, "config": repr(config), "table_entry": table_entry(shape)}, lower))
    if not quick:
        for shape in entry_shapes({tuple(job[1]["table_entry"]) for job in jobs}):
            config, lower = kernel_program(shape, mesh)
            jobs.append((_shape_name(shape) + " (table row)", {**shape, "config": repr(config), "table_entry": table_entry(shape)}, lower))
    for k in HEAD_DIMS[-1:] if quick else HEAD_DIMS:
        for page in PAGE_SIZES:
            shape = {**HEADLINE, "head_dim": k, "page_size": page}
            config, lower = kernel_program(shape, mesh, config=pa.deterministic_config(k, page, shape["group"]))
            jobs.append((_shape_name(shape) + " deterministic", {**shape, "config": repr(config)}, lower))
    for kv_dtype in (jnp.int8, jnp.float8_e4m3fn):
        config, lower = kernel_program(HEADLINE, mesh, kv_dtype=kv_dtype)
        jobs.append((_shape_name(HEADLINE) + f" {jnp.dtype(kv_dtype).name} pool", {**HEADLINE, "config": repr(config), "kv_dtype": jnp.dtype(kv_dtype).name}, lower))
    return jobs


def entry_shapes(covered: set) -> list[dict]:
    """One shape inside each TUNED_TABLE row the sweep left out, group 4: the row's widest batch and longest
    context, or just past the row's lower edge where it is unbounded (a batch of 65, 32,768 tokens), so the
    pool stays one an H200 could hold."""
    shapes, unbounded = [], 2**31 - 1
    for e in pa.TUNED_TABLE:
        if (e.head_dim, e.page_size, e.max_rows, e.max_context) in covered:
            continue
        batch = 65 if e.max_rows == unbounded else max(1, e.max_rows // NUM_KV_HEADS)
        context = 32768 if e.max_context == unbounded else e.max_context
        shape = dict(batch=batch, context=context, head_dim=e.head_dim, page_size=e.page_size, group=4)
        if table_entry(shape) == (e.head_dim, e.page_size, e.max_rows, e.max_context):
            shapes.append(shape)
    return shapes


def _shape_name(shape: dict) -> str:
    return f"B{shape['batch']} ctx{shape['context']} K{shape['head_dim']} page{shape['page_size']} group{shape['group']}"


# ------------------------------------------------------------------ the engine


def engine_jobs(geometry: str, mesh, quick: bool) -> tuple[dict, list[tuple[str, dict, object]]]:
    """The engine's warm-up programs at a geometry in bf16 with attention_impl='pallas' and the pool sized as the
    engine would size it on an H200; returns (facts, jobs)."""
    cfg = aot.model_config(geometry)
    engine_cfg = EngineConfig(attention_impl="pallas", compilation_cache_dir=None)
    num_pages = aot.pool_pages(cfg, engine_cfg)
    first, count = aot.pool_parameters(cfg, num_pages, engine_cfg)
    programs = aot.engine_programs(cfg, engine_cfg, mesh, num_pages=num_pages)
    if quick:
        programs = [p for p in programs if p[0].startswith("decode")][-1:] + [p for p in programs if p[0].startswith("prefill")][:1]
    facts = {"geometry": geometry, "num_pages": num_pages, "page_size": engine_cfg.page_size, "max_num_seqs": engine_cfg.max_num_seqs,
             "max_context": engine_cfg.max_context, "donated_parameters": list(range(first, first + count)), "num_programs": len(programs)}
    jobs = [(name, {"geometry": geometry, "forward": not name.startswith("draw"), "donated": facts["donated_parameters"]}, lower)
            for name, lower in programs]
    return facts, jobs


# ------------------------------------------------------------------ compile, serialize, judge


def compile_all(jobs, exe_dir: pathlib.Path, threads: int, progress, *, dump_kernels: bool = False) -> list[dict]:
    """Compile every job (in `threads` threads: XLA releases the GIL), serialize each executable, report each.
    `dump_kernels` reads each kernel's registers and shared memory from Mosaic's dumps, whose folder is a
    process-wide setting: one thread then."""
    threads = 1 if dump_kernels else threads

    def one(job):
        name, facts, lower = job
        program, compiled = aot.compile_program(name, lower, dump_kernels=dump_kernels)
        row = {**facts, **program.to_json()}
        if compiled is not None:
            row["executable"] = serialize(compiled, exe_dir / f"{_file_name(name)}.pickle")
        return row

    rows = []
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        for row in pool.map(one, jobs):
            rows.append(row)
            progress(row)
    return rows


def serialize(compiled, path: pathlib.Path) -> str | None:
    """The executable as jax.experimental.serialize_executable writes it (load: deserialize_and_load on the GPU)."""
    from jax.experimental import serialize_executable  # noqa: PLC0415

    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.write_bytes(pickle.dumps(serialize_executable.serialize(compiled)))
    except Exception as e:  # reported, not fatal: the compile itself is the finding
        return f"not serialized: {type(e).__name__}: {e}"
    return str(path)


def _file_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def judge_engine(rows: list[dict]) -> dict:
    """The issue's goals over the engine rows: all compiled, the pool aliased in every forward, every program within an H200."""
    forward = [r for r in rows if r.get("forward")]
    return {
        "failed": [r["name"] for r in rows if r["error"]],
        "pool_not_aliased": [r["name"] for r in forward if not r["error"] and not set(r["donated"]) <= set(r["aliased_params"])],
        "largest_peak_bytes": max((r["peak_bytes"] for r in rows if not r["error"]), default=0),
        "fits_h200": all(r["peak_bytes"] <= aot.H200_MEMORY_BYTES for r in rows if not r["error"]),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out / f"aot_h200_{datetime.date.today():%Y-%m-%d}{'_quick' if args.quick else ''}.json"
    doc = {"script": SCRIPT, "target": "NVIDIA H200 (sm_90, 132 SMs, 141 GB), compile-only", "jax": jax.__version__, "quick": args.quick,
           "kernel": [], "engine": {}}
    mesh = aot.topology_mesh()
    progress = lambda row: report.log(SCRIPT, _progress_line(row))  # noqa: E731
    doc["kernel"] = compile_all(kernel_jobs(mesh, args.quick), args.exe_dir / "kernel", args.threads, progress, dump_kernels=True)
    report.write_result(out, doc)
    for geometry in args.geometries:
        facts, jobs = engine_jobs(geometry, mesh, args.quick)
        rows = compile_all(jobs, args.exe_dir / geometry, args.threads, progress)
        doc["engine"][geometry] = {**facts, "programs": rows, "goals": judge_engine(rows)}
        report.write_result(out, doc)
    summary = summarize(doc)
    print_tables(doc)
    report.finish(out, doc, summary, correct=summary["all_compiled"] and summary["pool_aliased"])
    return 0


def summarize(doc: dict) -> dict:
    kernel_failed = [r["name"] for r in doc["kernel"] if r["error"]]
    engine = doc["engine"].values()
    return {
        "kernel_programs": len(doc["kernel"]), "kernel_failed": kernel_failed,
        "table_entries_compiled": len({tuple(r["table_entry"]) for r in doc["kernel"] if "table_entry" in r and not r["error"]}),
        "table_entries": len(pa.TUNED_TABLE),
        "engine_programs": sum(e["num_programs"] for e in engine),
        "all_compiled": not kernel_failed and all(not e["goals"]["failed"] for e in engine),
        "pool_aliased": all(not e["goals"]["pool_not_aliased"] for e in engine),
        "fits_h200": all(e["goals"]["fits_h200"] for e in engine),
        "compile_s": round(sum(r["compile_s"] for r in doc["kernel"]) + sum(p["compile_s"] for e in engine for p in e["programs"]), 1),
    }


def _progress_line(row: dict) -> str:
    if row["error"]:
        return f"FAILED {row['name']}: {row['error'][:300]}"
    kernels = ", ".join(f"{k['registers']} regs {k.get('smem_bytes')} B smem" for k in row["kernels"])
    return f"{row['name']}: {row['compile_s']:.1f} s, peak {row['peak_bytes'] / 2**30:.2f} GiB{', ' + kernels if kernels else ''}"


def print_tables(doc: dict) -> None:
    columns = [("kernel shape / config", "<60"), ("regs", ">5"), ("spill", ">5"), ("smem KiB", ">8.1f"), ("compile s", ">9.1f")]
    rows = [[r["name"], *_kernel_cells(r), r["compile_s"]] for r in doc["kernel"]]
    print(report.format_table(columns, rows))
    for geometry, e in doc["engine"].items():
        print(f"\n{geometry}: {e['num_programs']} programs, pool {e['num_pages']} pages of {e['page_size']}; goals {json.dumps(e['goals'])}")
        columns = [("program", "<44"), ("compile s", ">9.1f"), ("args GiB", ">9.3f"), ("aliased GiB", ">11.3f"), ("temp MiB", ">9.1f"), ("peak GiB", ">9.3f")]
        print(report.format_table(columns, [[p["name"], p["compile_s"], p["argument_bytes"] / 2**30, p["alias_bytes"] / 2**30, p["temp_bytes"] / 2**20,
                                             p["peak_bytes"] / 2**30] for p in e["programs"]]))


def _kernel_cells(row: dict) -> list:
    k = row["kernels"][0] if row["kernels"] else {}
    smem = k.get("smem_bytes")
    return [k.get("registers"), k.get("spill_store_bytes"), None if smem is None else smem / 1024]


if __name__ == "__main__":
    sys.exit(main())
