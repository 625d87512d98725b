"""One model replica spanning two processes (jax.distributed, CPU collectives over gloo): the same tokens
as one process.

Two local processes each own one CPU device; `jax.distributed.initialize` joins them, so `jax.devices()`
lists both and `LLM(tensor_parallel=2)` builds one `model` mesh across the processes. Both run the same
deterministic scheduler on the same prompts (the pool size is fixed, so every step's plan is the same),
and every step is one SPMD program whose all-reduces cross the process boundary. Each process loads the
file itself and builds only its own device's shards (sharding.shard_params). The test compares both
processes' greedy tokens with a plain one-process, one-device run.

This file is also the worker: `python tests/test_distributed.py PROCESS_ID NUM_PROCESSES PORT MODEL`.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).parent
TESTS = HERE.parent
ROOT = TESTS.parent
PROMPT_LENGTHS = (5, 13, 21, 9, 30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(process_id: int, num_processes: int, port: int, model: str) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
    env.pop("XLA_FLAGS", None)  # one device per process
    args = [sys.executable, str(Path(__file__)), str(process_id), str(num_processes), str(port), model]
    return subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _report(process: subprocess.Popen) -> dict:
    try:
        stdout, stderr = process.communicate(timeout=600)
    finally:
        process.kill()
    assert process.returncode == 0, stderr[-4000:]
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_replica_across_two_processes_gives_one_process_tokens(tiny_chat_model):
    single = _report(_spawn(0, 1, _free_port(), str(tiny_chat_model)))
    port = _free_port()
    workers = [_spawn(i, 2, port, str(tiny_chat_model)) for i in range(2)]
    reports = [_report(w) for w in workers]
    assert single["num_devices"] == 1 and single["tensor_parallel"] == 1
    for i, report in enumerate(reports):
        assert report["process_index"] == i and report["num_devices"] == 2 and report["local_devices"] == 1
        assert report["mesh_processes"] == [0, 1], report  # the mesh spans both processes
        assert report["local_shard_fraction"] == 0.5, report  # MLP width (64) split: each process holds half of w_up
        assert report["compiles_after_warmup"] == 0
        assert report["tokens"] == single["tokens"], f"process {i}: tokens differ from one process"


def _worker(process_id: int, num_processes: int, port: int, model: str) -> dict:
    import jax

    if num_processes > 1:
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id, initialization_timeout=120)
    import numpy as np

    from jaxinfer.api import LLM
    from jaxinfer.engine.engine import CompileCounter
    from jaxinfer.scheduling.request import SamplingParams

    tp = len(jax.devices())
    llm = LLM(
        model, tensor_parallel=tp, attention_impl="reference", page_size=8, max_context=64, max_num_seqs=4, max_prefill_tokens=16,
        num_pages=32, enable_prefix_caching=False, compilation_cache_dir=tempfile.mkdtemp(prefix=f"jaxinfer_dist_{process_id}_"),
        decode_batch_buckets=(4,), decode_page_buckets=(8,),  # 2 programs, not 11: each process compiles them all
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, llm.model_config.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    with CompileCounter() as counter:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), progress=False)
    w_up = llm.engine.params.layers.w_up
    local = sum(shard.data.size for shard in w_up.addressable_shards)
    report = dict(
        process_index=jax.process_index(), num_devices=len(jax.devices()), local_devices=len(jax.local_devices()), tensor_parallel=tp,
        mesh_processes=sorted({d.process_index for d in llm.engine.mesh.devices.flat}) if llm.engine.mesh is not None else [0],
        local_shard_fraction=local / w_up.size, compiles_after_warmup=counter.count, tokens=[o.token_ids for o in outputs],
    )
    if num_processes > 1:
        jax.distributed.shutdown()
    return report


if __name__ == "__main__":
    print(json.dumps(_worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])))
