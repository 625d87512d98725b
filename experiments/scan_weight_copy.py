"""Does running the layers with lax.scan over stacked weights cost decode bandwidth on the CPU backend?

On XLA's CPU backend the scan body's dynamic-slice of each layer's matrices is materialized as a copy
before the dot (a `dynamic-slice_bitcast_fusion`), so each weight byte is read, written and read again.
On an MLP-shaped stack at batch 1 this times a scan, the scan unrolled, a Python loop indexing the stack,
and a loop over separate arrays (correctness first: all four agree), against the measured read bandwidth.

    .venv/bin/python experiments/scan_weight_copy.py [--layers 8] [--width 2048] [--ffn 8192]
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from common import machine, paths, report, timing

RESULTS = paths.RESULTS_DIR / "scan_weight_copy.json"


def _body(h, weights):
    up, down = weights  # [D, F], [F, D]
    return h + jnp.tanh(h @ up) @ down, None


def _loop(h, pairs):
    return functools.reduce(lambda acc, pair: _body(acc, pair)[0], pairs, h)


VARIANTS = {
    "scan over the stack": lambda x, up, down, ups, downs: jax.lax.scan(_body, x, (up, down))[0],
    "scan, unrolled": lambda x, up, down, ups, downs: jax.lax.scan(_body, x, (up, down), unroll=True)[0],
    "python loop, static index into the stack": lambda x, up, down, ups, downs: _loop(x, [(up[i], down[i]) for i in range(up.shape[0])]),
    "python loop, separate arrays": lambda x, up, down, ups, downs: _loop(x, list(zip(ups, downs))),
}


def main() -> None:
    parser = report.arg_parser(__doc__, out=RESULTS)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    up = jnp.asarray(rng.standard_normal((args.layers, args.width, args.ffn), np.float32) * 0.01)  # [N, D, F]
    down = jnp.asarray(rng.standard_normal((args.layers, args.ffn, args.width), np.float32) * 0.01)  # [N, F, D]
    ups, downs = [up[i] for i in range(args.layers)], [down[i] for i in range(args.layers)]
    x = jnp.asarray(rng.standard_normal((1, args.width), np.float32))  # [1, D]
    weight_bytes = up.nbytes + down.nbytes
    peaks = {"bandwidth": machine.measure_bandwidth_peak(7, num_bytes=1 << 30, warmup=1)}  # a full reduction over 1 GiB of f32
    bandwidth = peaks["bandwidth"]["best_bytes_per_s"]

    rows, outputs = [], {}
    for name, fn in VARIANTS.items():
        jitted = jax.jit(fn)
        hlo = jitted.lower(x, up, down, ups, downs).compile().as_text()
        outputs[name] = np.asarray(jitted(x, up, down, ups, downs))
        seconds = min(timing.time_calls(lambda: jitted(x, up, down, ups, downs).block_until_ready(), 7, warmup=1))  # the least of 7
        rows.append({"variant": name, "ms": seconds * 1e3, "weight_gb_per_s": weight_bytes / seconds / 1e9,
                     "share_of_bandwidth": weight_bytes / seconds / bandwidth,
                     "slice_fusions_in_hlo": len(re.findall(r"slice[\w.-]*fusion[\w.]* = ", hlo))})
    reference = outputs["python loop, separate arrays"]
    correct = all(np.allclose(out, reference, rtol=1e-5, atol=1e-5) for out in outputs.values())

    print(f"{args.layers} layers of [{args.width}, {args.ffn}] + [{args.ffn}, {args.width}] f32 ({weight_bytes / 1e9:.2f} GB), batch 1; "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s; outputs agree: {correct}")
    columns = [("variant", "<44"), ("ms", "8.1f"), ("GB/s", "6.1f"), ("share", "6.1%"), ("slice fusions", "14d")]
    print(report.format_table(columns, [[r["variant"], r["ms"], r["weight_gb_per_s"], r["share_of_bandwidth"], r["slice_fusions_in_hlo"]] for r in rows]))
    speedup = rows[0]["ms"] / rows[-1]["ms"]
    print(f"separate arrays vs scan over the stack: {speedup:.2f}x")
    result = {"question": "cost of lax.scan's per-layer weight slice on the CPU backend at batch 1",
              "settings": vars(args) | {"out": str(args.out)}, "correct": correct, "read_bandwidth_bytes_per_s": bandwidth,
              "weight_bytes": weight_bytes, "rows": rows, "separate_vs_scan_speedup": speedup}
    report.write_result(args.out, result, peaks=peaks)


if __name__ == "__main__":
    main()
