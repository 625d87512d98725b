"""Tensor parallelism (sharding.py + Engine(mesh=...)): TP = 1, 2, 3, 4 against one device.

The multi-device checks run in a subprocess with simulated CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=4), so this pytest process, and the rest of the suite,
keeps its one device. The subprocess is this file run as a script (`_worker`): for each TP it builds an
engine on a `model` mesh, warms it up, runs greedy requests through the run loop with the step's
logits copied out, and prints one JSON report; the tests compare every TP to TP = 1.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
TESTS = HERE.parent
ROOT = TESTS.parent
TINY = TESTS / "fixtures" / "tiny_llama"
DEVICES = 4


def _run_worker(model: str, tps: tuple[int, ...], extra: dict | None = None) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}", JAX_PLATFORMS="cpu")
    args = [sys.executable, str(Path(__file__)), model, ",".join(map(str, tps)), json.dumps(extra or {})]
    done = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check_against_one_device(report: dict, tps: tuple[int, ...]) -> None:
    import numpy as np

    from tolerances import assert_close

    base = report["1"]
    for tp in tps:
        got = report[str(tp)]
        assert got["compiles_after_warmup"] == 0, f"TP={tp}: {got['compiles_after_warmup']} compiles after warm-up"
        assert got["tokens"] == base["tokens"], f"TP={tp}: greedy tokens differ from one device"
        assert got["num_steps"] == base["num_steps"]
        assert_close(np.asarray(got["logits"]), np.asarray(base["logits"]), 1e-5, f"TP={tp} logits vs one device")
        assert got["max_abs_logit_diff"] <= 1e-3, got["max_abs_logit_diff"]
        # The pool, as the compiled programs take and return it: sharded over kv heads when they divide.
        expected = got["expected_pool_spec"]
        for key, (spec_in, spec_out) in got["pool_shardings"].items():
            assert spec_in == spec_out == expected, f"TP={tp} {key}: pool in {spec_in}, out {spec_out}, expected {expected}"
        assert got["pool_donated"], f"TP={tp}: the old pool buffer was not deleted (not donated)"
        assert got["pool_devices"] == tp


@pytest.mark.slow
def test_request_features_work_under_tensor_parallelism_and_deterministic_mode(tiny_chat_model):
    import re

    import numpy as np

    report = _run_worker(str(tiny_chat_model), (1, 2), {"features": True})
    one, two = report["1"], report["2"]
    assert two["tokens"] == one["tokens"] and two["texts"] == one["texts"]
    for name in ("logprobs", "prompt_logprobs"):
        for a, b in zip(one[name], two[name]):
            assert len(a) == len(b) and (not a or np.abs(np.subtract(a, b)).max() <= 1e-4), name
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", one["texts"][2]) and set(sum(one["tokens"][3], [])) <= {100, 200, 300, 400}
    alone, batch = report["deterministic_alone"], report["deterministic_batch"]
    assert alone["tokens"][0] == batch["tokens"][0] and alone["logprobs"][0] == batch["logprobs"][0]  # bitwise, whatever else runs
    assert alone["prompt_logprobs"][0] == batch["prompt_logprobs"][0]


@pytest.fixture(scope="module")
def tiny_report():
    return _run_worker(str(TINY), (1, 2, 3, 4))


@pytest.mark.slow
def test_tiny_llama_tp_1_2_3_4_equal_one_device(tiny_report):
    _check_against_one_device(tiny_report, (1, 2, 3, 4))
    # 4 heads, 2 kv heads, MLP 160, vocab 512: TP=2 splits everything; TP=4 the MLP and vocabulary (kv
    # heads do not divide, so attention is replicated); TP=3 nothing.
    assert tiny_report["2"]["rules"] == {"q_heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"}
    assert tiny_report["4"]["rules"] == {"q_heads": None, "kv_heads": None, "mlp": "model", "vocab": "model"}
    assert tiny_report["3"]["rules"] == {"q_heads": None, "kv_heads": None, "mlp": None, "vocab": None}
    assert tiny_report["2"]["expected_pool_spec"] == "P(None, 'model', None, None, None)"
    # The weights really are split: each device holds half of wq (and a quarter at TP = 4).
    assert tiny_report["2"]["wq_shard_shape"] == [3, 64, 2, 16]
    assert tiny_report["4"]["wq_shard_shape"] == [3, 64, 4, 16]
    assert tiny_report["4"]["w_up_shard_shape"] == [3, 64, 40]
    # One all-reduce of the [R, 1, D] activations per sharded block of the scanned layer (plus one after the
    # vocabulary-sharded embedding lookup), and no collective ever moves the pool.
    assert tiny_report["2"]["hlo"]["activation_all_reduces"] == 3
    assert tiny_report["4"]["hlo"]["activation_all_reduces"] == 2
    for tp in ("2", "3", "4"):
        assert tiny_report[tp]["hlo"]["pool_collectives"] == 0, tiny_report[tp]["hlo"]


@pytest.mark.slow
def test_smollm2_tp_1_2_3_4_equal_one_device():
    report = _run_worker("smollm2", (1, 2, 3, 4), {"llm_tp": 3})
    _check_against_one_device(report, (1, 2, 3, 4))
    assert report["llm"]["tokens"] == report["1"]["tokens"] and report["llm"]["mesh_devices"] == 3  # LLM(tensor_parallel=3)
    # 9 heads, 3 kv heads, MLP 1536, vocab 49152: heads split only at TP = 3; MLP and vocab always.
    assert report["3"]["rules"] == {"q_heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"}
    for tp in ("2", "4"):
        assert report[tp]["rules"] == {"q_heads": None, "kv_heads": None, "mlp": "model", "vocab": "model"}
        assert report[tp]["hlo"]["activation_all_reduces"] == 2  # embedding + MLP (attention replicated)
    assert report["3"]["hlo"]["activation_all_reduces"] == 3  # embedding + attention + MLP
    assert report["3"]["expected_pool_spec"] == "P(None, 'model', None, None, None)"
    assert all(report[tp]["hlo"]["pool_collectives"] == 0 for tp in ("2", "3", "4"))


@pytest.mark.slow
def test_int8_weights_and_int8_pool_shard_and_match_one_device():
    """QuantizedTensor params get shardings too (codes and scales), and a quantized pool's scales follow K/V."""
    report = _run_worker(str(TINY), (1, 2), {"quantization": "int8", "kv_cache_dtype": "int8"})
    _check_against_one_device(report, (1, 2))
    assert report["2"]["expected_scale_spec"] == "P(None, 'model', None, None)"
    assert report["2"]["scale_specs_ok"]
    # int8 codes of wo and w_down split on their input side: still one all-reduce per block (the
    # embedding's lookup all-reduces its int8 codes instead of activations), and no pool collective.
    assert report["2"]["hlo"]["activation_all_reduces"] == 2 and report["2"]["hlo"]["pool_collectives"] == 0


@pytest.mark.slow
def test_data_parallel_outputs_equal_one_replica_in_input_order(tiny_chat_model):
    report = _run_worker(str(tiny_chat_model), (), {"layouts": [[1, 1], [1, 2], [2, 2]]})
    base = report["1x1"]
    assert base["indices"] == list(range(10)) and base["devices"] == [0]
    for layout, devices in (("1x2", [0, 1]), ("2x2", [0, 1, 2, 3])):
        got = report[layout]
        assert got["indices"] == base["indices"] and got["tokens"] == base["tokens"], layout
        assert got["compiles_after_warmup"] == 0 and got["devices"] == devices
        assert sorted(set(got["routes"])) == [0, 1], got["routes"]  # both replicas served requests
        # The two long prompts (0 and 5) go to different replicas.
        assert got["routes"][0] != got["routes"][5], got["routes"]


def test_router_balances_a_skewed_workload_better_than_round_robin():
    from jaxinfer.scheduling.replicas import ReplicaLoad, route

    def balance(assign, lengths, replicas):
        loads = [0] * replicas
        for i, n in enumerate(lengths):
            r = assign(i, n, loads)
            loads[r] += n + 16
        return max(loads) / (sum(loads) / replicas)

    rng = __import__("numpy").random.default_rng(0)
    lengths = [2000] * 4 + [int(n) for n in rng.integers(10, 100, 60)]
    lengths = [lengths[i] for i in [0, 10, 1, 20, 2, 30, 3, 40] + [i for i in range(4, 64) if i not in (10, 20, 30, 40)]]  # long ones at even slots
    by_router = lambda i, n, loads: route([ReplicaLoad(l, 100) for l in loads], n, 16)  # noqa: E731
    round_robin = lambda i, n, loads: i % len(loads)  # noqa: E731
    router, rr = balance(by_router, lengths, 2), balance(round_robin, lengths, 2)
    print(f"largest replica load / mean: router {router:.3f}, round-robin {rr:.3f}")
    assert router <= 1.05 < 1.3 <= rr
    # Prefix-cache affinity: equal loads, the replica holding the prefix wins; a much busier one does not.
    assert route([ReplicaLoad(0, 10), ReplicaLoad(0, 10, cached_tokens=32)], 40, 8) == 1
    assert route([ReplicaLoad(0, 10), ReplicaLoad(500, 10, cached_tokens=32)], 40, 8) == 0
    assert route([ReplicaLoad(5, 3), ReplicaLoad(5, 9)], 40, 8) == 1  # ties: more free pages


def test_rules_replicate_what_does_not_divide(tiny_llama):
    import dataclasses

    from jaxinfer.model import sharding

    tiny, params = tiny_llama
    cfg = dataclasses.replace(tiny, num_heads=9, num_kv_heads=3, ffn_dim=1536, vocab_size=49152)  # SmolLM2's widths
    assert sharding.rules_for(cfg, 3) == {"q_heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"}
    assert sharding.rules_for(cfg, 2) == {"q_heads": None, "kv_heads": None, "mlp": "model", "vocab": "model"}
    assert sharding.rules_for(tiny, 4) == {"q_heads": None, "kv_heads": None, "mlp": "model", "vocab": "model"}  # q split only with kv
    assert sharding.kv_shards(cfg, 3) == 3 and sharding.kv_shards(cfg, 4) == 1
    specs = sharding.param_specs(params, cfg, 3)  # dense specs depend on the config's rules only
    assert tuple(specs.layers.wq) == (None, None, "model", None)
    assert tuple(specs.layers.wo) == (None, "model", None, None)  # input side: one all-reduce per block
    assert tuple(specs.layers.w_down) == (None, "model", None)
    assert tuple(specs.embed) == ("model", None)


def test_quantized_specs_split_whole_blocks_only(tiny_llama):
    import numpy as np

    from jaxinfer.model import params as params_module
    from jaxinfer.model import sharding

    cfg, params = tiny_llama
    host = {"w_down": np.asarray(params.layers.w_down), "wq": np.asarray(params.layers.wq)}
    q = params_module.quantize_arrays(host, "int4", group_size=32)
    rules = sharding.rules_for(cfg, 2)
    down = sharding._quantized_specs(q["w_down"], params_module.weight_spec("w_down").axes, rules, 2)  # I = 160: 5 groups
    assert tuple(down.codes) == (None, None, None) and tuple(down.scales) == (None, None, None)  # 5 groups: no split
    wq = sharding._quantized_specs(q["wq"], params_module.weight_spec("wq").axes, rules, 2)  # O = H*K: output side
    assert tuple(wq.codes) == (None, "model", None)
    q8 = params_module.quantize_arrays(host, "int8")
    down8 = sharding._quantized_specs(q8["w_down"], params_module.weight_spec("w_down").axes, rules, 2)
    assert tuple(down8.codes) == (None, None, "model") and tuple(down8.scales) == (None, None, None)  # one scale per row


@pytest.mark.parametrize(("dtype", "quantization"), [("float32", None), ("bfloat16", None), ("float32", "int8"), ("float32", "int4")])
def test_weights_for_a_mesh_load_on_the_host_equal_to_the_device_path(dtype, quantization):
    """LLM(tensor_parallel > 1) loads with on_host=True, so the weights go from host memory straight to
    each device's shards and no one device holds the whole model; the values are the device path's."""
    import jax
    import numpy as np

    from jaxinfer.loading.loading import load_model

    _, on_device = load_model(str(TINY), dtype=dtype, quantization=quantization)
    _, on_host = load_model(str(TINY), dtype=dtype, quantization=quantization, on_host=True)
    device_leaves, host_leaves = jax.tree.leaves(on_device), jax.tree.leaves(on_host)
    assert len(host_leaves) == len(device_leaves) > 0
    assert all(isinstance(x, np.ndarray) for x in host_leaves), {type(x).__name__ for x in host_leaves}
    assert all(isinstance(x, jax.Array) for x in device_leaves)
    for d, h in zip(device_leaves, host_leaves):
        assert d.dtype == h.dtype and d.shape == h.shape
        np.testing.assert_array_equal(np.asarray(d), h)


def test_cli_tensor_parallel_flag_is_a_one_line_error_before_loading(capsys):
    from jaxinfer import cli

    cases = (
        (["--tensor-parallel", "0"], "--tensor-parallel must be a positive integer"),
        (["--tensor-parallel", "2"], "--tensor-parallel (2) exceeds the 1 available device"),
        (["--data-parallel", "0"], "--data-parallel must be a positive integer"),
        (["--data-parallel", "2"], "--data-parallel (2) x tensor_parallel (1) needs 2 devices"),
    )
    for flags, needle in cases:
        assert cli.main(["generate", "--prompt", "hi", *flags]) == 2
        err = capsys.readouterr().err
        assert needle in err and "loading" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("quantization", ["gguf"])  # the default model as stored: Q4_1 layers, Q8_0 embedding
def test_every_sharded_axis_of_smollm2_divides_the_mesh(quantization):
    """No spec would make device_put split an axis unevenly (int4 and int8 specs: test_quantized_specs_...)."""
    import jax
    from jax.sharding import PartitionSpec

    from jaxinfer.model import sharding
    from jaxinfer.loading.loading import load_model

    cfg, params = load_model(None, dtype="float32", max_context=256, quantization=quantization)
    leaves = jax.tree.leaves(params)
    for tp in (2, 3, 4):
        specs = jax.tree.leaves(sharding.param_specs(params, cfg, tp), is_leaf=lambda x: isinstance(x, PartitionSpec))
        assert len(specs) == len(leaves)
        split = 0
        for leaf, spec in zip(leaves, specs):
            for size, axis in zip(leaf.shape, tuple(spec)):
                if axis is not None:
                    split += 1
                    assert size % tp == 0, (tp, leaf.shape, spec)
        assert split >= 3, f"TP={tp}: only {split} axes split"  # at least the MLP's and the vocabulary's


def test_tensor_parallel_is_checked_at_the_boundary():
    from jaxinfer.options import check_tensor_parallel
    from jaxinfer.validation import FieldError

    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(FieldError) as e:
            check_tensor_parallel(bad)
        assert e.value.field == "tensor_parallel"
    with pytest.raises(FieldError, match="device"):
        check_tensor_parallel(2)  # this process has one device
    assert check_tensor_parallel(2, num_devices=4) == 2 and check_tensor_parallel(1) == 1


@pytest.mark.slow
def test_pallas_kernel_call_runs_on_each_devices_heads_under_shard_map():
    """sharding.on_local_heads (the engine's kernel call under TP) on 2 and 4 simulated devices: kv heads
    that divide are split (each device's call sees its own heads), heads that do not divide (SmolLM2's
    3) are replicated, an int8 pool's scales split with it; bitwise equal to one device; and the real
    kernel under the mesh lowers for CUDA as one program over the mesh's devices (see _kernel_worker)."""
    report = _run_worker("kernel", ())
    assert len(report) == 4
    for name, got in report.items():
        assert got["local_q_heads"] == got["expected_local_q_heads"], (name, got)
        assert got["bitwise_equal_one_device"], name
        assert got["cuda_export_has_kernel"] and got["cuda_export_devices"] == got["out_devices"] > 1, (name, got)


# ---------------------------------------------------------------- the subprocess


def _kernel_worker() -> dict:
    """sharding.on_local_heads on 2- and 4-device meshes. The GPU interpreter cannot run the kernel
    under shard_map on CPU (its per-device barrier state clashes across concurrently running shards:
    "Barrier remains allocated"), so the wrapper's split is checked with the kernel's jnp reference,
    which has the kernel's contract (tested against the kernel in test_kernels.py), bit for bit against
    one device; and the real kernel under the mesh is lowered for CUDA with jax.export."""
    import jax
    import numpy as np
    from jax import export
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxinfer.model import sharding
    from kernels_pallas import paged_attention as pa
    from test_kernels import Case, quantized_arrays

    cases = {
        "gqa2_split_over_2": (Case(lengths=(70, 3), num_kv_heads=2, group_size=2, head_dim=64, page_size=64, seed=4), None, 2),
        "gqa4_split_over_4": (Case(lengths=(130, 64, 1), num_kv_heads=4, group_size=2, head_dim=64, page_size=64, seed=6), None, 4),
        "smollm2_heads_replicated_over_2": (Case(lengths=(90, 5), num_kv_heads=3, group_size=3, head_dim=64, page_size=64, seed=7), None, 2),
        "int8_split_over_2": (Case(lengths=(100, 20), num_kv_heads=2, group_size=4, head_dim=64, page_size=64, seed=8), "int8", 2),
    }
    report = {}
    for name, (case, kv, size) in cases.items():
        if kv is None:
            q, k, v, bt, lens = case.arrays()
            scales = {}
        else:
            q, k, v, bt, lens, k_scales, v_scales, _ = quantized_arrays(case, jax.numpy.int8)
            scales = {"k_scales": k_scales, "v_scales": v_scales}
        seen = []

        def recording(q, *args, **kwargs):
            seen.append(q.shape[1])  # at trace time: the query heads this kernel call sees
            return pa.paged_attention_reference(q, *args, **kwargs)

        one = jax.jit(pa.paged_attention_reference)(q, k, v, bt, lens, **scales)
        mesh = sharding.make_mesh(size)
        heads = "model" if sharding.heads_split(case.num_kv_heads, size) else None
        put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
        args = (put(q, PartitionSpec(None, heads)), put(k, PartitionSpec(heads)), put(v, PartitionSpec(heads)), put(bt, PartitionSpec()), put(lens, PartitionSpec()))
        kw = {n: put(x, PartitionSpec(heads)) for n, x in scales.items()}
        with jax.set_mesh(mesh):
            out = jax.jit(lambda *a, **k: sharding.on_local_heads(recording, *a, **k))(*args, **kw)
            # The real kernel under the same mesh, lowered for CUDA.
            shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in (*args, *kw.values())]
            kernel = lambda *a: sharding.on_local_heads(pa.paged_attention, *a[:5], **dict(zip(kw, a[5:])))  # noqa: E731
            exported = export.export(jax.jit(kernel), platforms=("cuda",), disabled_checks=[export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")])(*shapes)
        report[name] = dict(
            local_q_heads=seen[-1], expected_local_q_heads=q.shape[1] // (size if heads else 1),
            bitwise_equal_one_device=bool(np.array_equal(np.asarray(out, np.float32), np.asarray(one, np.float32))),
            out_devices=len(out.sharding.device_set), cuda_export_devices=exported.nr_devices,
            cuda_export_has_kernel="mosaic_gpu" in exported.mlir_module(),
        )
    return report


def _dp_worker(model: str, extra: dict) -> dict:
    """LLM(data_parallel=1) vs LLM(data_parallel=2) (and 2 x TP=2) on the same prompts, half of them sampled
    (temperature 1, top-k 50, no seed): outputs in input order, the same tokens whatever the replica."""
    import numpy as np

    from jaxinfer.api import LLM
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.engine import CompileCounter
    from jaxinfer.scheduling.request import SamplingParams

    engine_cfg = EngineConfig(
        page_size=8, max_context=64, max_num_seqs=4, max_prefill_tokens=16, num_pages=24, prefill_chunk_buckets=(16,),
        decode_batch_buckets=(4,), decode_page_buckets=(8,), attention_impl="reference",
        compilation_cache_dir=tempfile.mkdtemp(prefix="jaxinfer_dp_xla_"),
    )
    rng = np.random.default_rng(1)
    lengths = [40, 3, 4, 5, 3, 38, 6, 4, 3, 5]  # a few long prompts among short ones
    prompts = [rng.integers(3, 1000, n).tolist() for n in lengths]
    # Greedy and sampled requests: a sampled one without a seed derives it from its identity, so its
    # tokens must not depend on the replica it is routed to.
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, top_k=0 if i % 2 else 50, max_tokens=4 + i % 3, ignore_eos=True) for i in range(len(prompts))]
    report = {}
    for tp, dp in extra["layouts"]:
        llm = LLM(model, dtype="float32", tensor_parallel=tp, data_parallel=dp, engine_config=engine_cfg)
        with CompileCounter() as counter:
            outs = llm.generate(prompts, params, progress=False)
        report[f"{tp}x{dp}"] = dict(
            indices=[o.index for o in outs], tokens=[o.token_ids for o in outs], routes=llm.last_routes, compiles_after_warmup=counter.count,
            devices=sorted({d.id for r in llm.replicas for d in r.engine.pool.k.sharding.device_set}),
        )
    return report


def _features_worker(model: str, tps: list[int]) -> dict:
    """The request surface (logprobs, prompt logprobs, penalties, bias, min_p, min_tokens, a
    grammar, n, allowed ids, bad words) through LLM at each tensor-parallel size, and in deterministic mode
    alone and inside a batch of other requests."""
    from jaxinfer.api import LLM
    from jaxinfer.scheduling.request import SamplingParams

    prompts = ["The cat sat on the mat", "One two three four five", "Write a code:", "Hello there", "Numbers: 1, 2, 3"]
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={100: 5.0}, min_p=0.1),
        SamplingParams(temperature=0.9, seed=3, max_tokens=12, structured_outputs={"regex": "[0-9]{3}-[a-z]{2}"}),
        SamplingParams(temperature=0.9, seed=4, max_tokens=5, n=2, ignore_eos=True, allowed_token_ids=(100, 200, 300, 400)),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, bad_words=("the",), min_tokens=3, logprobs=0),
    ]
    limits = dict(dtype="float32", max_context=128, page_size=16, max_num_seqs=4, max_prefill_tokens=32, attention_impl="reference",
                  compilation_cache_dir=tempfile.mkdtemp(prefix="jaxinfer_features_xla_"))
    narrow = dict(decode_batch_buckets=(4,), decode_page_buckets=(8,))  # 2 programs at each TP, not the full tables' 11

    def run(llm, which=range(len(prompts))):
        outs = llm.generate([prompts[i] for i in which], [params[i] for i in which], progress=False)
        return dict(
            tokens=[[s.token_ids for s in (o.samples or [o])] for o in outs], texts=[o.text for o in outs],
            logprobs=[[lp for lp, _ in o.logprobs] if o.logprobs else [] for o in outs],
            prompt_logprobs=[[e[0] for e in o.prompt_logprobs[1:]] if o.prompt_logprobs else [] for o in outs],
        )

    report = {str(tp): run(LLM(model, tensor_parallel=tp, **limits, **narrow)) for tp in tps}
    deterministic = LLM(model, deterministic=True, **limits)
    report["deterministic_batch"], report["deterministic_alone"] = run(deterministic), run(deterministic, [0])
    return report


def _collectives(engine, cfg) -> dict:
    """Collectives in the compiled decode program's HLO (the scanned layer body appears once): all-reduces
    of the [R, 1, D] activations, and any collective whose result has the shape of a pool array."""
    import re

    key = next(k for k in engine._programs if k[0] == "decode")
    text = engine._programs[key].as_text()
    ops = re.findall(r"= (\w+)\[([\d,]*)\]\S* (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(", text)
    pool_shapes = {",".join(map(str, a.shape)) for a in (engine.pool.k, engine.pool.v)}
    activation = sorted((key[1], 1, cfg.embed_dim))  # any layout: a quantized weight's dot puts D first
    dims = lambda shape: sorted(int(d) for d in shape.split(",") if d)  # noqa: E731
    return dict(
        activation_all_reduces=sum(1 for dtype, shape, op in ops if op == "all-reduce" and dtype == "f32" and dims(shape) == activation),
        pool_collectives=sum(1 for _, shape, _ in ops if shape in pool_shapes),
        total=len(ops),
    )



def _worker(model: str, tps: list[int], extra: dict) -> dict:
    import jax
    import numpy as np

    from jaxinfer.scheduling import runloop
    from jaxinfer.model import sharding
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.engine import CompileCounter, Engine
    from jaxinfer.loading.loading import load_model
    from jaxinfer.scheduling.stopping import OutputProcessor
    from jaxinfer.scheduling.request import Request, SamplingParams
    from jaxinfer.scheduling.scheduler import Scheduler

    assert len(jax.devices()) >= max(tps), jax.devices()
    quantization, kv_cache_dtype = extra.get("quantization"), extra.get("kv_cache_dtype")
    if model == "smollm2":
        cfg, params = load_model(None, dtype="float32", max_context=2048, quantization=quantization)
    else:
        cfg, params = load_model(model, dtype="float32", quantization=quantization)
    engine_cfg = EngineConfig(
        page_size=8, max_context=64, max_num_seqs=4, max_prefill_tokens=16, num_pages=24, prefill_chunk_buckets=(16,),
        decode_batch_buckets=(4,), decode_page_buckets=(8,), attention_impl="reference", kv_cache_dtype=kv_cache_dtype,
        compilation_cache_dir=tempfile.mkdtemp(prefix="jaxinfer_tp_xla_"),  # fresh: every TP compiles; LLM below hits it
    )
    rng = np.random.default_rng(0)
    lengths = (5, 13, 21, 9)  # 21: a chunked prefill (16 + 5)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in lengths]
    greedy = SamplingParams(temperature=0, max_tokens=6 if model == "smollm2" else 12, ignore_eos=True)  # SmolLM2 steps cost ~0.3 s here
    report = {}
    for tp in tps:
        mesh = None if tp == 1 else sharding.make_mesh(tp)
        start = time.perf_counter()
        engine = Engine(cfg, params, engine_cfg, mesh=mesh, return_logits=True)
        engine.warmup()
        compile_s = time.perf_counter() - start
        scheduler = Scheduler(engine_cfg, engine.num_pages)
        for i, ids in enumerate(prompts):
            scheduler.add(Request(str(i), ids, greedy, seed=i, arrival_index=i))
        logits, seconds, old_pool = [], [], engine.pool

        def on_step(plan, tokens, s, engine=engine):
            logits.append(engine.last_logits[: len(plan.request_ids)])
            seconds.append(s)

        with CompileCounter() as counter:
            finished = list(runloop.run(scheduler, engine.step, OutputProcessor(None, None, engine_cfg.max_context), on_step=on_step))
        assert len(finished) == len(prompts) and not [r.error for r in finished if r.error]
        all_logits = np.concatenate(logits)
        rules = sharding.rules_for(cfg, tp)
        pool_spec = str(sharding.spec_of(sharding.POOL_AXES["k"], rules))
        shardings = {}
        for key, compiled in engine._programs.items():
            pool_in, pool_out = compiled.input_shardings[0][1], compiled.output_shardings[-2]
            spec = lambda s: str(s.spec) if hasattr(s, "spec") else "P(None, None, None, None, None)"  # noqa: E731
            shardings[str(key)] = (spec(pool_in.k), spec(pool_out.k))
        entry = dict(
            tokens={r.request_id: r.output_ids for r in finished}, num_steps=len(logits), logits=all_logits.tolist(),
            compiles_after_warmup=counter.count, compile_s=compile_s, step_s=float(np.mean(seconds)),
            rules=rules if tp > 1 else {}, expected_pool_spec=pool_spec if tp > 1 else "P(None, None, None, None, None)",
            pool_shardings=shardings, pool_donated=old_pool.k.is_deleted(), pool_devices=len(engine.pool.k.sharding.device_set),
            wq_shard_shape=list(engine.params.layers.wq.addressable_shards[0].data.shape) if quantization is None else None,
            w_up_shard_shape=list(engine.params.layers.w_up.addressable_shards[0].data.shape) if quantization is None else None,
            hlo=_collectives(engine, cfg),
        )
        if kv_cache_dtype is not None and tp > 1:
            expected_scale = str(sharding.spec_of(sharding.POOL_AXES["k_scale"], rules))
            entry["expected_scale_spec"] = expected_scale
            entry["scale_specs_ok"] = all(
                str(c.input_shardings[0][1].k_scale.spec) == str(c.output_shardings[-2].v_scale.spec) == expected_scale for c in engine._programs.values()
            )
        report[str(tp)] = entry
        del engine
    if extra.get("llm_tp"):  # the public path: LLM(tensor_parallel=N) on the same engine config
        from jaxinfer.api import LLM

        tp = extra["llm_tp"]
        llm = LLM(None if model == "smollm2" else model, dtype="float32", tensor_parallel=tp, engine_config=engine_cfg)
        outs = llm.generate(prompts, greedy, progress=False)
        report["llm"] = dict(tp=tp, tokens={str(o.index): o.token_ids for o in outs}, mesh_devices=len(llm.engine.pool.k.sharding.device_set))
    base = np.asarray(report["1"]["logits"])
    for tp in tps:
        entry = report[str(tp)]
        entry["max_abs_logit_diff"] = float(np.abs(np.asarray(entry["logits"]) - base).max())
    return report


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(TESTS), str(TESTS / "kernels")]  # the package, the shared helpers, test_kernels' cases
    extra = json.loads(sys.argv[3])
    if sys.argv[1] == "kernel":
        print(json.dumps(_kernel_worker()))
        sys.exit(0)
    if "layouts" in extra:
        print(json.dumps(_dp_worker(sys.argv[1], extra)))
        sys.exit(0)
    if extra.get("features"):
        print(json.dumps(_features_worker(sys.argv[1], [int(t) for t in sys.argv[2].split(",")])))
        sys.exit(0)
    result = _worker(sys.argv[1], [int(t) for t in sys.argv[2].split(",")], extra)
    for tp, entry in ((tp, e) for tp, e in result.items() if tp.isdigit()):
        print(f"TP={tp}: compile {entry['compile_s']:.2f} s, step {entry['step_s'] * 1e3:.1f} ms, max |dlogit| {entry['max_abs_logit_diff']:.2e}", file=sys.stderr)
    print(json.dumps(result))
