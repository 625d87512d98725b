"""How fast is the CPU K-quant matmul kernel on a 1B model's matrices, with its weights out of the L3?

kernels_cpu/kquant_matmul on Llama-3.2-1B's layer shapes (2,048 x 8,192 gate/up, 8,192 x 2,048 down,
2,048 x 2,048 q/o) in Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1, beside kernels_cpu/quant_matmul's Q4_0 in the same run,
at 1/4/16 rows (decode) and 512 (prefill). Each shape is stacked over 16 layers, more than the L3 holds, and one
jitted loop multiplies every layer in turn, as a decode step does. Each format and shape is first checked
against the kernel's jnp reference (up to 33 rows). Blocks are random bytes with valid fp16 scales, packed by
kquant_matmul.pack. "read" is the bytes the GGUF format stores per second (not the panels' few more) against
the machine's read bandwidth (machine.measure_bandwidth_peak), measured in the same run.
--baseline REV also builds kquant_matmul.cc (with the headers beside it) as git holds it at REV and times it
in the same process, each repeat alternating the two builds, so a loaded machine slows both alike: the ratio
is the figure to keep ("speedup": baseline ms / this tree's ms; "speedup_cpu": the median of the per-repeat
ratios of CPU time, which a machine shared with other processes moves far less: +-3% between two copies of one
build at a load of 8 on 2 cores (9 repeats, 16 and 512 rows), where wall-time ratios moved +-30%). "GOP/cpu-s" is against one core's int8
VNNI peak: a Zen 4 core retires one 512-bit vpdpbusd (64 multiply-adds, 128 ops) a cycle, 467 GOP per
CPU-second measured (about 3.65 GHz); 2 cores, 934 GOP/s.
Writes experiments/results/bench_kquant_kernel.json; the last stdout line is one JSON document.

    .venv/bin/python experiments/bench_kquant_kernel.py [--rows 1,4,16,512] [--repeats 5] [--formats q4_k,...] [--shapes gate_up,...]
    .venv/bin/python experiments/bench_kquant_kernel.py --quick   # 4 layers, gate_up, rows 1 and 4: a smoke run
    .venv/bin/python experiments/bench_kquant_kernel.py --baseline HEAD --formats q4_k --rows 16,512 --layers 4
    .venv/bin/python experiments/bench_kquant_kernel.py --amx-ab --formats q4_k,q6_k --rows 32,512 --layers 4   # AMX tiles vs VNNI
"""

import ctypes
import resource
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from common import machine, paths, report, timing

RESULTS = paths.RESULTS_DIR / "bench_kquant_kernel.json"
SHAPES = {"gate_up": (2048, 8192), "down": (8192, 2048), "q_o": (2048, 2048)}  # (inputs I, outputs O)
FORMATS = ("q4_k", "q5_k", "q6_k", "q5_0", "q5_1")
FP16_OFFSETS = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "q5_0": (0,), "q5_1": (0, 2), "q4_0": (0,)}
BLOCKS = {"q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210), "q5_0": (32, 22), "q5_1": (32, 24), "q4_0": (32, 18)}
GGUF_IDS = {"q4_k": 12, "q5_k": 13, "q6_k": 14, "q5_0": 6, "q5_1": 7, "q4_0": 2}


def random_blocks(rng, fmt: str, num_out: int, num_in: int) -> np.ndarray:
    """uint8 [O, row bytes] as a GGUF file holds a tensor: random bytes, fp16 scales ~ 0.01."""
    block, size = BLOCKS[fmt]
    blocks = rng.integers(0, 256, (num_out, num_in // block, size), dtype=np.uint8)
    for offset in FP16_OFFSETS[fmt]:
        scale = (rng.uniform(0.5, 1.5, blocks.shape[:2]) * 0.01).astype(np.float16)
        blocks[..., offset : offset + 2] = scale.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(num_out, -1)


def stacked(rng, fmt: str, num_in: int, num_out: int, layers: int) -> tuple[object, int]:
    """The packed stack [layers, ...] of `fmt` (kquant panels, or quant_matmul's for q4_0) and its GGUF bytes per layer."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.model import panels, quant
    from kernels_cpu import kquant_matmul

    packed = []
    for _ in range(layers):
        q = quant.from_gguf(random_blocks(rng, fmt, num_out, num_in), GGUF_IDS[fmt])
        if fmt == "q4_0":
            packed.append(panels.to_quant_panels(jax.tree.map(jnp.asarray, q)))
        else:
            packed.append(jax.jit(kquant_matmul.pack, static_argnums=0)(fmt, {k: jnp.asarray(v) for k, v in quant.array_fields(q).items()}))
    block, size = BLOCKS[fmt]
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *packed), num_out * num_in // block * size


BASELINE_TARGET = "jaxinfer_kquant_matmul_cpu_baseline"
KERNEL_ARGS = ("codes", "high", "scales", "mins", "super_scales", "super_mins")  # the handler's buffers, in order (absent: empty)


def build_baseline(rev: str) -> None:
    """Compile kernels_cpu/kquant_matmul.cc and its headers as of git revision `rev` (into a temporary folder,
    with kernels_cpu.build's flags) and register its handler as BASELINE_TARGET."""
    import jax

    from kernels_cpu import build

    folder = Path(tempfile.mkdtemp(prefix="kquant-baseline-"))
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, "kernels_cpu/"], capture_output=True, text=True, check=True, cwd=paths.REPO_ROOT).stdout.split()
    for name in [n for n in names if n.endswith(".h") or n.endswith("kquant_matmul.cc")]:
        text = subprocess.run(["git", "show", f"{rev}:{name}"], capture_output=True, check=True, cwd=paths.REPO_ROOT).stdout
        (folder / Path(name).name).write_bytes(text)
    library = folder / "baseline.so"
    subprocess.run([build._compiler(), *build.FLAGS, f"-I{folder}", f"-I{jax.ffi.include_dir()}", str(folder / "kquant_matmul.cc"),
                    *build.LINK_FLAGS, "-o", str(library)], check=True)
    handler = ctypes.CDLL(str(library)).JaxinferKquantMatmul
    jax.ffi.register_ffi_target(BASELINE_TARGET, jax.ffi.pycapsule(handler), platform="cpu")


def baseline_matmul(x, weights, layer, *, fmt: str):
    """kquant_matmul.kquant_matmul through the baseline build (same arguments, the vectorized tiles)."""
    import jax
    import jax.numpy as jnp

    from kernels_cpu import kquant_matmul

    result = jax.ShapeDtypeStruct((x.shape[0], weights["codes"].shape[1] * kquant_matmul.PANEL), jnp.float32)
    empty = jnp.zeros((0,), jnp.uint8)
    args = [weights[name] if name in kquant_matmul.PANEL_FIELDS[fmt] else empty for name in KERNEL_ARGS]
    return jax.ffi.ffi_call(BASELINE_TARGET, result)(x, *args, jnp.asarray(layer, jnp.int32), format=np.int32(kquant_matmul.FORMAT_IDS[fmt]),
                                                     vectorized=np.int32(1))


def matmul(fmt: str, weights, num_in: int, baseline: bool = False, amx: bool = True):
    from kernels_cpu import kquant_matmul, quant_matmul

    if fmt == "q4_0":
        return lambda x, layer: quant_matmul.quant_matmul(x, weights.codes, weights.scale, None, layer, zero_point=weights.zero_point)
    if baseline:
        return lambda x, layer: baseline_matmul(x, weights, layer, fmt=fmt)
    return lambda x, layer: kquant_matmul.kquant_matmul(x, weights, layer, fmt=fmt, num_in=num_in, amx=amx)


def check(fmt: str, weights, x, num_in: int) -> float:
    """Relative max error of the kernel against its jnp reference on layer 1, over at most 33 rows (the AMX tiles
    run from 32)."""
    import jax.numpy as jnp

    from kernels_cpu import kquant_matmul, quant_matmul

    x = x[:33]
    ours = np.asarray(matmul(fmt, weights, num_in)(x, jnp.int32(1)))
    if fmt == "q4_0":
        expected = quant_matmul.reference(x, weights.codes, weights.scale, None, jnp.int32(1), zero_point=weights.zero_point)
    else:
        expected = kquant_matmul.reference(x, weights, jnp.int32(1), fmt=fmt, num_in=num_in)
    expected = np.asarray(expected)
    return float(np.abs(ours - expected).max() / np.abs(expected).max())


def _cpu_seconds() -> float:
    """This process's CPU time, every thread's (user + system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def seconds_per_layer(fns: list, x, layers: int, repeats: int) -> tuple[list[float], np.ndarray]:
    """Per layer, for each of `fns`: the best wall seconds, and the CPU seconds of every repeat ([fns, repeats]).
    Their calls alternate repeat by repeat, in reversed order every other repeat. On a machine other processes
    share, CPU time (what the kernel's threads ran) moves far less than wall time, which also counts the time
    they waited for a core: compare builds by the per-repeat ratios of CPU time."""
    import jax
    import jax.numpy as jnp

    programs = [jax.jit(lambda fn=fn: jax.lax.fori_loop(0, layers, lambda layer, total: total + fn(x, layer)[0, 0], jnp.float32(0))) for fn in fns]
    for program in programs:
        program().block_until_ready()  # compiled and warm
    wall, cpu = np.zeros((len(programs), repeats)), np.zeros((len(programs), repeats))
    for repeat in range(repeats):
        order = range(len(programs)) if repeat % 2 == 0 else reversed(range(len(programs)))
        for i in order:
            start = _cpu_seconds()
            wall[i, repeat] = timing.timed(lambda: programs[i]().block_until_ready())[1]
            cpu[i, repeat] = _cpu_seconds() - start
    return list(wall.min(axis=1) / layers), cpu / layers


def measure_shape(rng, name: str, formats: list[str], rows_list: list[int], layers: int, repeats: int, baseline: bool, amx_ab: bool = False) -> list[dict]:
    """Each format's rows; with `baseline` (or `amx_ab`: this build's VNNI tiles, amx=False, as the baseline) timed beside it."""
    import jax.numpy as jnp

    num_in, num_out = SHAPES[name]
    out = []
    for fmt in ["q4_0", *formats]:
        weights, file_bytes = stacked(rng, fmt, num_in, num_out, layers)
        for rows in rows_list:
            x = jnp.asarray(rng.standard_normal((rows, num_in)).astype(np.float32))
            error = check(fmt, weights, x, num_in)
            fns = [matmul(fmt, weights, num_in)] + ([matmul(fmt, weights, num_in, baseline=True)] if baseline and fmt != "q4_0" else [])
            fns += [matmul(fmt, weights, num_in, amx=False)] if amx_ab and fmt != "q4_0" else []
            (seconds, *before), cpu = seconds_per_layer(fns, x, layers, repeats)
            ops = 2 * rows * num_in * num_out
            row = {"shape": name, "inputs": num_in, "outputs": num_out, "format": fmt, "rows": rows, "ms": 1e3 * seconds,
                   "gop_per_s": ops / seconds / 1e9, "file_bytes_per_s": file_bytes / seconds, "cpu_ms": 1e3 * float(np.median(cpu[0])),
                   "gop_per_cpu_s": ops / float(cpu[0].min()) / 1e9, "relative_error_vs_reference": error}
            if before:
                row |= {"baseline_ms": 1e3 * before[0], "speedup": before[0] / seconds, "baseline_cpu_ms": 1e3 * float(np.median(cpu[1])),
                        "speedup_cpu": float(np.median(cpu[1] / cpu[0]))}  # the median of the paired per-repeat ratios
            report.log("bench_kquant_kernel", f"{name} {fmt} rows {rows}: {row['ms']:.3f} ms" +
                       (f" (baseline {1e3 * before[0]:.3f} ms, {before[0] / seconds:.2f}x; CPU time {row['speedup_cpu']:.3f}x)" if before else ""))
            out.append(row)
        del weights
    return out


def main():
    parser = report.arg_parser(__doc__, out=RESULTS)
    parser.add_argument("--rows", default="1,4,16,512", help="comma list of activation rows")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per case (the best is kept)")
    parser.add_argument("--layers", type=int, default=16, help="layers stacked per shape (more than the L3 holds)")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ", ".join(SHAPES))
    parser.add_argument("--quick", action="store_true", help="4 layers, gate_up only, rows 1 and 4, 2 repeats: a smoke run")
    parser.add_argument("--baseline", default=None, help="a git revision whose kquant_matmul.cc is timed beside this tree's, alternating")
    parser.add_argument("--amx-ab", action="store_true", help="time this build's VNNI tiles (amx=False) as the baseline instead, alternating")
    args = parser.parse_args()
    from kernels_cpu import kquant_matmul

    if not kquant_matmul.available():
        raise SystemExit("bench_kquant_kernel: the CPU K-quant kernel could not be built (see the warning above)")
    formats = report.comma_list(parser, args.formats, FORMATS, "format")
    shapes = report.comma_list(parser, args.shapes, SHAPES, "shape")
    rows_list, layers, repeats = [int(r) for r in args.rows.split(",") if r], args.layers, args.repeats
    if args.quick:
        rows_list, layers, repeats, shapes = [1, 4], 4, 2, ["gate_up"]
    if args.baseline:
        build_baseline(args.baseline)
    rng = np.random.default_rng(0)
    bandwidth = machine.measure_bandwidth_peak(repeats)
    if args.baseline and args.amx_ab:
        parser.error("--baseline and --amx-ab each name the baseline; give one")
    rows = [row for name in shapes for row in measure_shape(rng, name, formats, rows_list, layers, repeats, bool(args.baseline), args.amx_ab)]
    peak = bandwidth["best_bytes_per_s"]
    print(report.format_table(
        [("shape", "<8"), ("format", "<5"), ("rows", ">5"), ("ms", ">8.3f"), ("GOP/s", ">6.0f"), ("GOP/cpu-s", ">9.0f"), ("read", ">6.1%")],
        [[r["shape"], r["format"], r["rows"], r["ms"], r["gop_per_s"], r["gop_per_cpu_s"], r["file_bytes_per_s"] / peak] for r in rows]))
    if args.baseline or args.amx_ab:
        print(report.format_table([("shape", "<8"), ("format", "<5"), ("rows", ">5"), ("before ms", ">9.3f"), ("ms", ">8.3f"), ("speedup", ">7.2f"), ("CPU-time speedup", ">16.3f")],
                                  [[r["shape"], r["format"], r["rows"], r["baseline_ms"], r["ms"], r["speedup"], r["speedup_cpu"]] for r in rows if "speedup" in r]))
    print("GOP/cpu-s: operations per second of CPU time summed over the kernel's threads (against one core's VNNI peak x cores)")
    print(f"read: the GGUF format's bytes per second against the measured read bandwidth {peak / 1e9:.1f} GB/s")
    worst = max(r["relative_error_vs_reference"] for r in rows)
    doc = {"question": "the CPU K-quant kernel on 1B shapes, weights out of the L3, beside quant_matmul's Q4_0",
           "layers": layers, "quick": args.quick, "baseline": "this build, amx=False (VNNI tiles)" if args.amx_ab else args.baseline, "results": rows, "worst_relative_error_vs_reference": worst}
    report.finish(args.out, doc, {"bench": "kquant_kernel", "worst_relative_error_vs_reference": worst,
                                   "read_fraction": {f"{r['shape']}/{r['format']}/{r['rows']}": round(r["file_bytes_per_s"] / peak, 3) for r in rows}},
                   correct=worst <= 1e-5, peaks={"bandwidth": bandwidth})


if __name__ == "__main__":
    main()
