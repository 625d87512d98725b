"""How fast is the CPU quantized-matmul kernel on a 1B model's matrices, with its weights out of the L3?

kernels_cpu/quant_matmul on Llama-3.2-1B's layer shapes (2,048 x 8,192 gate/up, 8,192 x 2,048 down,
2,048 x 2,048 q/o), Q4_0 and Q8_0 codes (symmetric form), at 1/4/8/16 rows (decode) and 512 (prefill).
Each shape is stacked over 16 layers, more than the L3 holds, and one jitted loop multiplies every layer
in turn, as a decode step does. Each format and shape is first checked against the kernel's jnp reference
on the same packed arrays (up to 17 rows). In the same run: XLA's f32 dot on f32 weights of the same shapes (the dense path
the kernel replaces), and the machine's read bandwidth (machine.measure_bandwidth_peak), against which the
kernel's bytes per second are reported. The codes are random bytes: every byte is a valid code.
Writes experiments/results/bench_quant_kernel.json; the last stdout line is one JSON document.

    .venv/bin/python experiments/bench_quant_kernel.py [--rows 1,4,8,16,512] [--repeats 5]
"""

import numpy as np

from common import machine, paths, report, timing

RESULTS = paths.RESULTS_DIR / "bench_quant_kernel.json"
LAYERS = 16
SHAPES = {"gate_up": (2048, 8192), "down": (8192, 2048), "q_o": (2048, 2048)}  # (inputs K, outputs N)
FORMATS = {"q4_0": (4, 8), "q8_0": (8, 128)}  # bits, zero point


def stacked_weights(rng, bits: int, num_in: int, num_out: int) -> tuple:
    """Codes u8 [LAYERS, P, S, 64] and scales f16 [LAYERS, P, K/32, 16] of the kernel's packed layout."""
    import jax.numpy as jnp

    panels, steps = num_out // 16, num_in // (8 if bits == 4 else 4)
    codes = rng.integers(0, 256, (LAYERS, panels, steps, 64), dtype=np.uint8)
    scale = (rng.uniform(0.5, 1.5, (LAYERS, panels, num_in // 32, 16)) * 0.01).astype(np.float16)
    return jnp.asarray(codes), jnp.asarray(scale)


def check(x, codes, scale, zero_point: int) -> float:
    """Relative max error of the kernel against its jnp reference on layer 1, over at most 17 of x's rows
    (past 16 the kernel takes its many-row path; the reference's int32 einsum is slow at 512)."""
    x = x[:17]
    import jax.numpy as jnp

    from kernels_cpu import quant_matmul

    ours = np.asarray(quant_matmul.quant_matmul(x, codes, scale, None, jnp.int32(1), zero_point=zero_point))
    expected = np.asarray(quant_matmul.reference(x, codes, scale, None, jnp.int32(1), zero_point=zero_point))
    return float(np.abs(ours - expected).max() / np.abs(expected).max())


def every_layer(matmul):
    """A jitted loop over the LAYERS layers of `matmul(x, layer)`, keeping one output element per layer."""
    import jax
    import jax.numpy as jnp

    def body(layer, total):
        return total + matmul(layer)[0, 0]

    return jax.jit(lambda: jax.lax.fori_loop(0, LAYERS, body, jnp.float32(0)))


def seconds_per_layer(program, repeats: int) -> float:
    return min(timing.time_calls(lambda: program().block_until_ready(), repeats, warmup=1)) / LAYERS


def measure_shape(rng, name: str, rows_list: list[int], repeats: int) -> list[dict]:
    import jax.numpy as jnp

    from kernels_cpu import quant_matmul

    num_in, num_out = SHAPES[name]
    dense = jnp.asarray(rng.normal(0, 0.02, (LAYERS, num_in, num_out)).astype(np.float32))
    packed = {fmt: stacked_weights(rng, bits, num_in, num_out) for fmt, (bits, _) in FORMATS.items()}
    out = []
    for rows in rows_list:
        x = jnp.asarray(rng.standard_normal((rows, num_in)).astype(np.float32))
        row = {"shape": name, "inputs": num_in, "outputs": num_out, "rows": rows,
               "xla_f32_ms": 1e3 * seconds_per_layer(every_layer(lambda layer: x @ dense[layer]), repeats)}
        for fmt, (_, zero_point) in FORMATS.items():
            codes, scale = packed[fmt]
            error = check(x, codes, scale, zero_point)
            program = every_layer(lambda layer, codes=codes, scale=scale, zp=zero_point: quant_matmul.quant_matmul(x, codes, scale, None, layer, zero_point=zp))
            seconds = seconds_per_layer(program, repeats)
            row[fmt] = {"ms": 1e3 * seconds, "gop_per_s": 2 * rows * num_in * num_out / seconds / 1e9,
                        "bytes_per_s": (codes.nbytes + scale.nbytes) / LAYERS / seconds, "relative_error_vs_reference": error}
        report.log("bench_quant_kernel", f"{name} rows {rows}: " + ", ".join(f"{fmt} {row[fmt]['ms']:.3f} ms" for fmt in FORMATS) + f", XLA f32 {row['xla_f32_ms']:.3f} ms")
        out.append(row)
    return out


def print_table(rows: list[dict], bandwidth: float) -> None:
    columns = [("shape", "<8"), ("rows", ">5"), ("q4_0 ms", ">8.3f"), ("GOP/s", ">6.0f"), ("read", ">6.1%"),
               ("q8_0 ms", ">8.3f"), ("GOP/s", ">6.0f"), ("read", ">6.1%"), ("f32 ms", ">8.3f"), ("q4_0 x f32", ">10.2f")]
    print(report.format_table(columns, [
        [r["shape"], r["rows"], r["q4_0"]["ms"], r["q4_0"]["gop_per_s"], r["q4_0"]["bytes_per_s"] / bandwidth,
         r["q8_0"]["ms"], r["q8_0"]["gop_per_s"], r["q8_0"]["bytes_per_s"] / bandwidth, r["xla_f32_ms"], r["xla_f32_ms"] / r["q4_0"]["ms"]]
        for r in rows]))
    print(f"read: the kernel's codes and scales per second, against the measured read bandwidth {bandwidth / 1e9:.1f} GB/s")


def main():
    parser = report.arg_parser(__doc__, out=RESULTS)
    parser.add_argument("--rows", default="1,4,8,16,512", help="comma list of activation rows")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per case (the best is kept)")
    args = parser.parse_args()
    from kernels_cpu import quant_matmul

    if not quant_matmul.available():
        raise SystemExit("bench_quant_kernel: the CPU quantized-matmul kernel could not be built (see the warning above)")
    rows_list = [int(r) for r in args.rows.split(",") if r]
    rng = np.random.default_rng(0)
    bandwidth = machine.measure_bandwidth_peak(args.repeats)
    rows = [row for name in SHAPES for row in measure_shape(rng, name, rows_list, args.repeats)]
    print_table(rows, bandwidth["best_bytes_per_s"])
    worst = max(row[fmt]["relative_error_vs_reference"] for row in rows for fmt in FORMATS)
    doc = {"question": "the CPU quantized-matmul kernel on 1B shapes, weights out of the L3, against XLA's f32 dot",
           "layers": LAYERS, "results": rows, "worst_relative_error_vs_reference": worst}
    report.finish(args.out, doc, {"bench": "quant_kernel", "worst_relative_error_vs_reference": worst,
                                   "q4_0_ms": {f"{r['shape']}/{r['rows']}": round(r["q4_0"]["ms"], 3) for r in rows}},
                   correct=worst <= 1e-5, peaks={"bandwidth": bandwidth})


if __name__ == "__main__":
    main()
