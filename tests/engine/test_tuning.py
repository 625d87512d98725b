"""The runtime tuner (jaxinfer/tuning.py): its cache key, its cache, its pins and its numerics check.

Every measurement here is real: small engines of the random tiny Llama (real SmolLM2 vocabulary) run the probe
generation through the real scheduler and engine, and the check compares against model.forward in float32.
The suite runs with JAXINFER_TUNE=0 (conftest.py); these tests turn tuning on explicitly (`enabled=True`, or
the environment variable for LLM and the CLI) and keep the cache in a temporary directory.
"""

import dataclasses
import json
import pathlib
import re

import jax.numpy as jnp
import pytest

from jaxinfer.loading import loading
from jaxinfer.engine import backends, tuning
from jaxinfer.model.attention import CPU_IMPL
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.backends import Impls, resolve_matmul_impl
from jaxinfer.scheduling.bucket_tables import BucketTables
from kernels_cpu import build as kernel_build

SMALL_ENGINE = dict(max_context=128, page_size=16, max_num_seqs=4, max_prefill_tokens=64)
F32_XLA = tuning.Candidate("float32", "reference", "xla")
BF16_XLA = tuning.Candidate("bfloat16", "reference", "xla")
FINGERPRINT = {"backend": "cpu", "cpu": "Some CPU", "flags": "avx2 fma", "num_cpus": 2}


@pytest.fixture(scope="module")
def tiny(tiny_chat_model):
    """(ModelConfig, Params) of the tiny chat model, f32."""
    return loading.load_model(tiny_chat_model)


@pytest.fixture
def engine_cfg(compile_cache):
    return EngineConfig(compilation_cache_dir=compile_cache, **SMALL_ENGINE)


class CountingCandidate(tuning.Candidate):
    """A candidate that counts how often the tuner prepares (and so times) it."""

    prepared: list

    def __init__(self, *fields, prepared: list):
        super().__init__(*fields)
        object.__setattr__(self, "prepared", prepared)

    def prepare(self, cfg, params, **kwargs):
        self.prepared.append(self.name)
        return super().prepare(cfg, params, **kwargs)


class WrongCandidate(tuning.Candidate):
    """A deliberately wrong implementation: the (tied) embedding scaled by 1.5 (the lookup and the head)."""

    def prepare(self, cfg, params, **kwargs):
        cfg, params = super().prepare(cfg, params, **kwargs)
        return cfg, dataclasses.replace(params, embed=params.embed * 1.5)


def test_cache_key_changes_with_fingerprint_geometry_limits_pins_and_kernels(monkeypatch, tmp_path):
    cfg, engine = ModelConfig(vocab_size=64, num_layers=2, embed_dim=32, ffn_dim=64, num_heads=4, num_kv_heads=2, head_dim=8), EngineConfig(**SMALL_ENGINE)
    base = tuning.cache_key(FINGERPRINT, cfg, engine, Impls())
    assert base == tuning.cache_key(dict(FINGERPRINT), cfg, EngineConfig(**SMALL_ENGINE), Impls())  # stable
    changed = {
        "cpu model": tuning.cache_key({**FINGERPRINT, "cpu": "Other CPU"}, cfg, engine, Impls()),
        "cpu flags": tuning.cache_key({**FINGERPRINT, "flags": "avx2 avx512f fma"}, cfg, engine, Impls()),
        "geometry": tuning.cache_key(FINGERPRINT, dataclasses.replace(cfg, num_layers=3), engine, Impls()),
        "limits": tuning.cache_key(FINGERPRINT, cfg, EngineConfig(**{**SMALL_ENGINE, "max_num_seqs": 8}), Impls()),
        "prefill rows": tuning.cache_key(FINGERPRINT, cfg, EngineConfig(**SMALL_ENGINE, prefill_seq_buckets=(1, 2)), Impls()),  # the probe's programs
        "pins": tuning.cache_key(FINGERPRINT, cfg, engine, Impls(dtype="float32")),
        "quantization": tuning.cache_key(FINGERPRINT, cfg, engine, Impls(), "int8"),
        "weight formats": tuning.cache_key(FINGERPRINT, cfg, engine, Impls(), None, ("mlp:q4_k", "mlp:q6_k")),
    }
    # the dtype is a choice, not geometry: a bf16-loaded model shares the key of its f32 load
    assert tuning.cache_key(FINGERPRINT, dataclasses.replace(cfg, dtype="bfloat16"), engine, Impls()) == base
    for source in (*kernel_build.HERE.glob("*.cc"), *kernel_build.HERE.glob("*.h")):  # the kernels as they are, then one edited
        (tmp_path / source.name).write_bytes(source.read_bytes())
    monkeypatch.setattr(kernel_build, "HERE", tmp_path)
    assert tuning.cache_key(FINGERPRINT, cfg, engine, Impls()) == base
    with open(tmp_path / "quant_matmul.cc", "a") as f:
        f.write("// edited\n")
    changed["kernels"] = tuning.cache_key(FINGERPRINT, cfg, engine, Impls())
    assert base not in changed.values() and len(set(changed.values())) == len(changed), changed


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(tuning.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tuning.cache_dir() == tmp_path / "xdg" / "jaxinfer"
    monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path / "mine"))
    assert tuning.cache_dir() == tmp_path / "mine"


def test_tuning_off_keeps_the_fixed_rule(tiny, engine_cfg, tmp_path):
    assert not tuning.tuning_enabled()  # conftest.py sets JAXINFER_TUNE=0 for the whole suite
    result = tuning.choose(*tiny, engine_cfg, Impls(), directory=tmp_path)
    assert result.choice == Impls("float32", "auto", "auto") and result.source == "fixed" and result.measurements == []
    assert not (tmp_path / "tuning").exists()


def test_cached_choice_is_reused_without_timing(tiny, engine_cfg, tmp_path):
    prepared = []
    candidates = [CountingCandidate("float32", "reference", "xla", prepared=prepared)]
    first = tuning.choose(*tiny, engine_cfg, Impls(), enabled=True, directory=tmp_path, candidates=candidates)
    assert prepared == ["float32/reference/xla"] and not first.from_cache and first.source == "tuned"
    assert first.path.is_file() and json.loads(first.path.read_text())["choice"]["dtype"] == "float32"
    second = tuning.choose(*tiny, engine_cfg, Impls(), enabled=True, directory=tmp_path, candidates=candidates)
    assert prepared == ["float32/reference/xla"], "a cached choice was timed again"
    assert second.from_cache and second.choice == first.choice and second.source == "cached"
    assert [m.candidate for m in second.measurements] == ["float32/reference/xla"]  # the table travels with it
    other_limits = EngineConfig.with_overrides(engine_cfg, max_num_seqs=2)  # another key: measured again
    tuning.choose(*tiny, other_limits, Impls(), enabled=True, directory=tmp_path, candidates=candidates)
    assert len(prepared) == 2


def test_pinned_float32_is_never_changed_to_bfloat16(tiny, engine_cfg, tmp_path):
    assert {c.dtype for c in tuning.default_candidates(Impls(dtype="float32"), "cpu")} == {"float32"}
    assert {c.dtype for c in tuning.default_candidates(Impls(), "cpu")} == {"float32", "bfloat16"}
    result = tuning.choose(*tiny, engine_cfg, Impls(dtype="float32"), enabled=True, directory=tmp_path, candidates=[BF16_XLA, F32_XLA])
    assert result.choice.dtype == "float32"
    assert [m.candidate for m in result.measurements] == [F32_XLA.name]  # the bf16 candidate is not even timed


def test_a_candidate_failing_the_numerics_check_is_never_chosen(tiny, engine_cfg, tmp_path, cpu_kernels):
    wrong = WrongCandidate("float32", "cpu", "cpu")  # the CPU kernels: the faster path on the tiny model
    result = tuning.choose(*tiny, engine_cfg, Impls(), enabled=True, directory=tmp_path, candidates=[wrong, F32_XLA])
    by_name = {m.candidate: m for m in result.measurements}
    assert not by_name[wrong.name].passed and by_name[wrong.name].relative_error > 0.1  # far outside f32's 1e-3
    assert by_name[F32_XLA.name].passed and by_name[F32_XLA.name].relative_error < 1e-4
    assert result.choice.attention_impl == "reference" and result.choice.matmul_impl == "xla"
    with pytest.raises(tuning.NoCandidatePassed, match="no candidate passed"):
        tuning.choose(*tiny, engine_cfg, Impls(), enabled=True, directory=tmp_path / "other", candidates=[wrong])


def test_cpu_attention_runs_with_xla_dots(tiny, engine_cfg, cpu_kernels):
    """matmul_impl is its own choice: attention 'cpu' over unpacked params, checked against the f32 reference."""
    from jaxinfer.engine.engine import Engine

    engine = Engine(*tiny, EngineConfig.with_overrides(engine_cfg, attention_impl="cpu", matmul_impl="xla"))
    assert engine.impl == "cpu" and engine.matmul_impl == "xla" and engine.step_params is engine.params
    probe = tuning.make_probe(engine_cfg, list(range(1, 200)))
    measurement = tuning.measure(tuning.Candidate("float32", "cpu", "xla"), *tiny, probe, tuning.reference_run(*tiny, probe.prompts))
    assert measurement.passed and measurement.relative_error < 1e-4 and measurement.greedy_agreement == 1.0


def test_explicit_cpu_matmul_that_cannot_run_is_refused():
    with pytest.raises(ValueError, match="matmul_impl='cpu'.*float32"):
        resolve_matmul_impl("cpu", "reference", dtype="bfloat16", on_mesh=False)
    assert resolve_matmul_impl("auto", "reference", dtype="float32", on_mesh=False) == "xla"


def test_the_untuned_matmul_is_the_cpu_kernel_only_beside_its_attention_on_a_cpu_with_its_wide_path():
    """Without AVX-512 the layer-matmul kernel's AVX2 tiles lose to XLA's dot (build.has_matmul_vector_path), so the fixed
    rule (JAXINFER_TUNE=0) keeps XLA's there, as the tuner chose on such a CPU."""
    for wide in (True, False):
        assert resolve_matmul_impl("auto", "cpu", dtype="float32", on_mesh=False, vector_path=wide) == ("cpu" if wide else "xla")
        assert resolve_matmul_impl("auto", "reference", dtype="float32", on_mesh=False, vector_path=wide) == "xla"
        assert resolve_matmul_impl("cpu", "cpu", dtype="float32", on_mesh=False, vector_path=wide) == "cpu"  # a pin is kept
    flags = pathlib.Path("/proc/cpuinfo").read_text() if pathlib.Path("/proc/cpuinfo").exists() else ""
    here = "cpu" if re.search(r"^flags\s*:.*\bavx512f\b", flags, re.M) else "xla"
    assert resolve_matmul_impl("auto", "cpu", dtype="float32", on_mesh=False) == here


def test_llm_applies_a_cached_bfloat16_choice_for_auto_dtype(tiny_chat_model, tiny, compile_cache, tmp_path, monkeypatch):
    from jaxinfer.api import LLM

    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path))
    engine_cfg = EngineConfig(compilation_cache_dir=compile_cache, **SMALL_ENGINE)
    seeded = tuning.choose(*tiny, engine_cfg, Impls(), candidates=[BF16_XLA])  # LLM's key: auto pins, no quantization
    assert seeded.choice.dtype == "bfloat16" and seeded.path.parent.parent == tmp_path
    llm = LLM(tiny_chat_model, engine_config=engine_cfg, warmup=False)
    assert llm.choices == Impls("bfloat16", "reference", "xla") and llm.tuning.source == "cached"
    assert llm.model_config.dtype == "bfloat16" and llm.engine.params.layers.wq.dtype == jnp.bfloat16


def test_tune_command_prints_the_table_and_writes_the_cache(tiny_chat_model, compile_cache, tmp_path, monkeypatch, capsys):
    from jaxinfer import cli

    monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path))
    argv = ["tune", "--model", str(tiny_chat_model), "--attention", "reference", "--max-context", "128",
            "--page-size", "16", "--max-num-seqs", "4", "--compile-cache", compile_cache]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "candidate" in out and "prefill ms" in out and "decode ms" in out and "check" in out
    offered = {c.name for c in tuning.default_candidates(Impls(attention_impl="reference"), "cpu")}  # f32 and bf16 through XLA (the kernel's matmul with AVX-512)
    rows = [line for line in out.splitlines() if line.split(" ")[0] in offered]
    assert len(rows) == len(offered) >= 2 and sum("<- chosen" in row for row in rows) == 1, out
    assert len(list((tmp_path / "tuning").glob("*.json"))) == 1


FITTED_BUCKETS = "fitted"  # a bucket strategy sets the tables (experiments/buckets_on_engine.py's configurations)


@pytest.mark.parametrize("limits", [SMALL_ENGINE, {}, dict(max_num_seqs=16, page_size=16), FITTED_BUCKETS])
def test_probe_prefills_every_prompt_in_one_step_of_a_table_key(limits):
    """The probe times one prefill program (all its prompts in one packed row) and then decode steps of all rows."""
    from jaxinfer.bucketing.strategies import EngineBuckets, strategy_from_sample
    from jaxinfer.scheduling.runloop import dry_run

    if limits == FITTED_BUCKETS:
        sample = [1, 2, 3, 5, 8, 8, 8, 13]
        limits = dict(max_num_seqs=8, buckets=EngineBuckets(**{d: strategy_from_sample("fitted", sample, 3) for d in ("chunk", "rows", "pages")}))
    engine_cfg = EngineConfig(**limits)
    probe = tuning.make_probe(engine_cfg, list(range(1, 300)))
    plans, _ = dry_run(probe.engine_cfg, probe.prompts, [tuning.NUM_GENERATED] * len(probe.prompts))
    assert plans[0].bucket.phase == "prefill" and len(plans[0].request_ids) == len(probe.prompts) > 1
    assert all(plan.bucket.phase == "decode" and len(plan.request_ids) == len(probe.prompts) for plan in plans[1:])
    tables = BucketTables.from_config(engine_cfg)
    assert plans[0].bucket.num_tokens in tables.chunk_tokens and plans[1].bucket.num_rows in tables.decode_rows


def test_the_tuner_times_the_dense_matmul_kernel_only_on_a_cpu_with_its_wide_path_or_where_it_is_pinned():
    """Without AVX-512 the layer-matmul kernel's AVX2 tiles lose to XLA's dot (its probe prefill 13x XLA's on an AMD EPYC
    with AVX2, docs/tuning.md): the tuner leaves it out there, as the untuned rule does, unless the matmul is pinned to it."""
    for wide in (True, False):
        offered = backends.candidates(Impls(), "cpu", vector_path=wide)
        assert ("cpu" in {c.matmul_impl for c in offered}) == wide and {c.attention_impl for c in offered if c.matmul_impl == "xla"} == {"reference", "cpu"}
        pinned = backends.candidates(Impls(matmul_impl="cpu"), "cpu", vector_path=wide)
        assert {(c.attention_impl, c.matmul_impl) for c in pinned} == {("reference", "cpu"), ("cpu", "cpu")}
        assert "cpu_int8" in {c.matmul_impl for c in backends.candidates(Impls(), "cpu", affine_weights=True, vector_path=wide)}
    flags = pathlib.Path("/proc/cpuinfo").read_text() if pathlib.Path("/proc/cpuinfo").exists() else ""
    wide_here = bool(re.search(r"^flags\s*:.*\bavx512f\b", flags, re.M))
    assert ("cpu" in {c.matmul_impl for c in tuning.default_candidates(Impls(), "cpu")}) == wide_here


def test_w8a8_is_a_candidate_exactly_where_the_weights_hold_int8_codes():
    """With activation blocks of 32 its perplexity cost (+0.19% on SmolLM2) is inside the 1% the tuner may
    trade for speed: auto offers it over int8 weights, never over others, and a pinned 'xla' keeps it out."""
    auto = tuning.default_candidates(Impls(), "cpu", int8_weights=True)
    assert "int8" in {c.matmul_impl for c in auto} and "xla" in {c.matmul_impl for c in auto}
    assert "int8" not in {c.matmul_impl for c in tuning.default_candidates(Impls(), "cpu", int8_weights=False)}
    assert "int8" not in {c.matmul_impl for c in tuning.default_candidates(Impls(matmul_impl="xla"), "cpu", int8_weights=True)}
    pinned = tuning.default_candidates(Impls(matmul_impl="int8"), "cpu", int8_weights=True)
    assert pinned and {c.matmul_impl for c in pinned} == {"int8"}
    assert not tuning.default_candidates(Impls(matmul_impl="int8"), "cpu", int8_weights=False)


def test_an_explicit_float32_dtype_means_float32_compute_and_offers_no_w8a8():
    """dtype="float32" asked for by name is f32 arithmetic for every matmul, as `dtype` is in vLLM: the W8A8
    paths (activations quantized to int8) are offered under dtype="auto", or where the matmul is pinned to one."""
    for backend in ("cpu", "gpu"):
        auto = {c.matmul_impl for c in tuning.default_candidates(Impls(), backend, int8_weights=True, affine_weights=True)}
        f32 = {c.matmul_impl for c in tuning.default_candidates(Impls(dtype="float32"), backend, int8_weights=True, affine_weights=True)}
        assert "int8" in auto and not f32 & {"int8", "cpu_int8"}, (backend, auto, f32)
    pinned = tuning.default_candidates(Impls(dtype="float32", matmul_impl="cpu_int8"), "cpu", affine_weights=True)
    assert pinned and {c.matmul_impl for c in pinned} == {"cpu_int8"}


@pytest.mark.parametrize("choice, why", [
    ({"dtype": "int8", "attention_impl": "reference", "matmul_impl": "xla"}, "dtype 'int8'"),
    ({"dtype": "float32", "attention_impl": "reference", "matmul_impl": "bogus"}, "matmul_impl 'bogus'"),
    ({"dtype": "float32", "attention_impl": "auto", "matmul_impl": "xla"}, "attention_impl 'auto'"),
    ({"dtype": "bfloat16", "attention_impl": "cpu", "matmul_impl": "xla"}, "needs a float32 model"),
    ({"dtype": "float32", "attention_impl": "pallas", "matmul_impl": "xla"}, "GPU only"),
])
def test_a_cached_choice_that_cannot_run_here_is_measured_again_with_a_warning(tiny, engine_cfg, tmp_path, choice, why):
    """A damaged or stale cache file never becomes a pin that kills the run: it is read as no cache, with a
    warning naming the file and the reason, and the choice is measured again."""
    candidates = [CountingCandidate("float32", "reference", "xla", prepared=[])]
    first = tuning.choose(*tiny, engine_cfg, Impls(), enabled=True, directory=tmp_path, candidates=candidates)
    doc = json.loads(first.path.read_text())
    first.path.write_text(json.dumps({**doc, "choice": choice}))
    with pytest.warns(UserWarning, match=why):
        again = tuning.choose(*tiny, engine_cfg, Impls(), enabled=True, directory=tmp_path, candidates=candidates)
    assert again.source == "tuned" and again.choice == Impls("float32", "reference", "xla")
    assert json.loads(first.path.read_text())["choice"] == dataclasses.asdict(again.choice)  # the file is repaired


def test_the_cache_key_changes_when_the_cpu_kernels_stop_building(tiny, engine_cfg, monkeypatch, cpu_kernels):
    """A choice measured where the kernels built is not applied where they cannot be (a runtime image
    without the compiler): the key differs, so the choice is measured again there."""
    from kernels_cpu import paged_attention

    built = tuning.cache_key(FINGERPRINT, tiny[0], engine_cfg, Impls())
    monkeypatch.setattr(paged_attention, "available", lambda: False)
    assert tuning.cache_key(FINGERPRINT, tiny[0], engine_cfg, Impls()) != built


def test_a_candidate_far_slower_than_the_best_so_far_is_pruned_after_one_generation(tiny, engine_cfg, cpu_kernels):
    """PRUNE_FACTOR: a candidate whose first timed generation scores above twice the best passing score is not
    timed again and cannot be chosen; at a best score it cannot exceed, it is timed fully and passes."""
    probe = tuning.make_probe(engine_cfg, list(range(1, 200)))
    reference = tuning.reference_run(*tiny, probe.prompts)
    pruned = tuning.measure(F32_XLA, *tiny, probe, reference, best_score=1e-9)
    assert not pruned.passed and pruned.note.startswith("pruned") and pruned.score > tuning.PRUNE_FACTOR * 1e-9
    kept = tuning.measure(F32_XLA, *tiny, probe, reference, best_score=1e9)
    assert kept.passed and kept.note == ""


def test_attention_is_timed_on_the_engine_contexts_not_the_probe():
    """tune_attention's workload: decode rows of a middle row bucket at a middle page bucket's width (the
    probe's are a few pages), after packed prefill rows of the engine's own chunk buckets."""
    from jaxinfer.engine import tune_attention

    engine_cfg = EngineConfig(max_context=1024, page_size=16, max_num_seqs=16)
    _, plans, num_pages = tune_attention.attention_workload(engine_cfg)
    decode = [p.bucket for p in plans if p.bucket.phase == "decode"]
    prefill = [p.bucket for p in plans if p.bucket.phase == "prefill"]
    tables = BucketTables.from_config(engine_cfg)
    middle_pages = tune_attention.middle_bucket(tables.pages)
    assert decode and {key.num_pages for key in decode} == {middle_pages} and max(key.num_rows for key in decode) == 8
    assert prefill and all(key.num_tokens in tables.chunk_tokens for key in prefill)
    assert max(key.num_pages for key in prefill) > middle_pages  # a packed row reads several sequences' pages
    probe = tuning.make_probe(engine_cfg, list(range(1, 300)))
    context = max(int(p.positions.max()) + 1 for p in plans)
    assert max(len(prompt) for prompt in probe.prompts) + tuning.NUM_GENERATED < context // 2  # what the probe could not tell apart
    assert num_pages == 8 * middle_pages + 1


def test_the_tuner_times_attention_alone_then_only_the_winner_whole(tiny, engine_cfg, tmp_path, cpu_kernels):
    """Default candidates: both attentions of float32 are timed alone (tune_attention), and only the one of
    least score is timed with the whole model; the timings travel with the cache and print in the table."""
    pins = Impls(dtype="float32", matmul_impl="xla")  # candidates f32/reference/xla and f32/cpu/xla
    result = tuning.choose(*tiny, engine_cfg, pins, enabled=True, directory=tmp_path)
    assert [row.attention_impl for row in result.attention] == ["reference", CPU_IMPL]
    assert all(row.score > 0 and row.prefill_ms > 0 and row.decode_ms > 0 for row in result.attention)
    winner = min(result.attention, key=lambda row: row.score).attention_impl
    assert [m.candidate for m in result.measurements] == [f"float32/{winner}/xla"] and result.choice.attention_impl == winner
    cached = tuning.read_cached(tmp_path, result.key)
    assert cached.attention == result.attention
    table = tuning.format_table(result)
    assert "attention alone" in table and table.count("<- chosen") == 2, table
    path = cached.path  # damaged but parseable: a score that is not a number is measured again, never printed
    doc = json.loads(path.read_text())
    doc["measurements"][0]["score"] = "x"
    path.write_text(json.dumps(doc))
    assert tuning.read_cached(tmp_path, result.key) is None


def test_an_attention_that_cannot_run_is_noted_and_not_chosen(tiny, engine_cfg):
    from jaxinfer.engine import tune_attention

    impl, rows = tune_attention.choose_attention(tiny[0], engine_cfg, "float32", ["pallas", "reference"], 5.0)
    assert impl == "reference" and rows[0].note.startswith("cannot run") and rows[0].score is None and rows[1].score > 0


def test_a_candidate_whose_weights_do_not_fit_the_memory_budget_is_not_built(tiny, engine_cfg):
    """Candidate.extra_bytes counts the new weight arrays (the bf16 cast: half the f32 bytes; the 'cpu'
    panels: a packed copy; f32 through XLA: none), and tune() does not build one above its budget."""
    import jax

    cfg, params = tiny
    f32_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))
    assert F32_XLA.extra_bytes(cfg, params) == 0
    assert BF16_XLA.extra_bytes(cfg, params) == f32_bytes // 2
    assert tuning.Candidate("float32", "reference", "cpu").extra_bytes(cfg, params) >= f32_bytes - params.embed.size * 4  # the matrices, repacked
    dense_kernel = tuning.Candidate("float32", "reference", "cpu")  # named: the defaults offer it only on a CPU with AVX-512
    result = tuning.tune(cfg, params, engine_cfg, Impls(attention_impl="reference"), candidates=[F32_XLA, BF16_XLA, dense_kernel], memory_budget=f32_bytes // 4)
    by_name = {m.candidate: m for m in result.measurements}
    assert by_name[F32_XLA.name].passed and result.choice.matmul_impl == "xla" and result.choice.dtype == "float32"
    for name in (BF16_XLA.name, "float32/reference/cpu"):
        assert not by_name[name].passed and by_name[name].note.startswith("not built") and by_name[name].prefill_ms is None


def test_greedy_agreement_forgives_a_first_difference_only_at_a_tie():
    """Hand-computed: a first difference where the reference's two logits lie within the tolerance's error
    (max_relative_error x the logits' RMS) counts as agreement; a clear one cuts the share there."""
    import numpy as np

    step_logits = np.array([[[5.0, 0.0, 0.0, 0.0], [0.0, 3.0, 2.99, 0.0], [0.0, 0.0, 4.0, 0.0]]], np.float32)  # [1, 3, 4]
    reference = tuning.Reference(np.array([[0, 1, 2]], np.int32), step_logits)
    int8 = tuning.TOLERANCES["int8"]  # margin at step 1: 0.15 x RMS(0, 3, 2.99, 0) = 0.32 > 0.01
    assert tuning._greedy_agreement([[0, 1, 2]], reference, int8) == 1.0
    assert tuning._greedy_agreement([[0, 2, 3]], reference, int8) == 1.0  # tie at step 1
    assert tuning._greedy_agreement([[0, 1, 0]], reference, int8) == 2 / 3  # a gap of 4 > 0.15 x 2 at step 2
    assert tuning._greedy_agreement([[1, 1, 2]], reference, int8) == 0.0  # a gap of 5 at step 0
    assert tuning._greedy_agreement([[0, 2, 3]], reference, tuning.TOLERANCES["float32"]) == 1 / 3  # f32's margin is 0.002


def test_the_reference_run_with_its_kv_cache_equals_whole_context_forwards(tiny):
    """reference_run prefills once and then steps one token per row through a dense KV cache; its greedy tokens
    and logits equal those of model.forward rerun with no cache over each row's whole context, for rows of
    different lengths (right padding is inert)."""
    import numpy as np
    from jaxinfer.model import forward as model

    cfg, params = tiny
    prompts = [list(range(5, 17)), list(range(40, 47)), [3, 9, 27, 81, 100, 7, 7, 7, 7, 1]]
    reference = tuning.reference_run(cfg, params, prompts, num_tokens=4)
    for row, prompt in enumerate(prompts):
        ids = list(prompt)
        for step in range(4):
            tokens = jnp.asarray([ids], jnp.int32)
            logits = np.asarray(model.forward(params, None, tokens, jnp.arange(len(ids), dtype=jnp.int32)[None], cfg=cfg)[0])[0, -1]
            np.testing.assert_allclose(reference.step_logits[row, step], logits, rtol=1e-4, atol=1e-4 * np.abs(logits).max())
            assert reference.tokens[row, step] == int(logits.argmax())
            ids.append(int(reference.tokens[row, step]))


def test_kept_block_candidates_time_the_kernel_first_and_keep_the_rest_in_order():
    """Under quantization='auto' the candidates that multiply kept blocks (matmul 'cpu_int8') are timed first, so
    that their score prunes the ones that dequantize the blocks after their first steps."""
    found = [tuning.Candidate("float32", "cpu", "xla"), tuning.Candidate("float32", "cpu", "cpu"), BF16_XLA,
             tuning.Candidate("float32", "reference", "cpu_int8"), tuning.Candidate("float32", "cpu", "cpu_int8")]
    assert [c.name for c in backends.kernel_first(found, vector_path=True)] == [found[3].name, found[4].name, found[0].name, found[1].name, BF16_XLA.name]


def test_without_the_kernels_vector_path_the_kept_block_candidates_are_timed_last():
    """On a CPU without AVX-512 VNNI the kernel's int8 dots are scalar loops (33x XLA's score on an AMD EPYC with AVX2):
    timed last, so the others' scores prune it after its first steps, and not at all where XLA can run the dense copy."""
    found = [tuning.Candidate("float32", "reference", "cpu_int8"), tuning.Candidate("float32", "cpu", "xla"), BF16_XLA,
             tuning.Candidate("float32", "cpu", "cpu_int8")]
    assert [c.name for c in backends.kernel_first(found, vector_path=False)] == [found[1].name, BF16_XLA.name, found[0].name, found[3].name]
    assert [c.name for c in backends.kernel_first(found, vector_path=False, dense_fits=True)] == [found[1].name, BF16_XLA.name]  # never the fastest then
    assert backends.kernel_first([found[0], found[3]], vector_path=False, dense_fits=True) == [found[0], found[3]]  # pinned to the kernel
    assert backends.kernel_first(found, vector_path=True, dense_fits=True)[:2] == [found[0], found[3]]


def test_the_vector_path_is_read_from_the_cpus_flags(monkeypatch):
    from kernels_cpu import build

    zen4 = "model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16"
    monkeypatch.setattr(build, "_cpu_identity", lambda: zen4)
    assert build.has_int8_vector_path()
    monkeypatch.setattr(build, "_cpu_identity", lambda: zen4.replace(" avx512_vnni", ""))  # Skylake-X: AVX-512 without VNNI
    assert not build.has_int8_vector_path()
    monkeypatch.setattr(build, "_cpu_identity", lambda: "model name\t: AMD EPYC\nflags\t\t: fpu avx avx2 fma")  # an AVX2 machine
    assert not build.has_int8_vector_path()


def test_kept_blocks_too_large_to_expand_build_only_the_kernel_once_it_passes(monkeypatch, cpu_kernels, engine_cfg):
    """On kept K-quant blocks that may not be expanded (EXPANSION_SLACK_BYTES 0 makes the tiny llama.cpp file
    such a model), the kernel candidate is measured and passes against the f32 reference; a candidate that would
    dequantize the blocks every step is then not built (and cannot win)."""
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "fixtures" / "kquant" / "q4_k_m.gguf"
    cfg, params = loading.load_model(path, quantization="gguf", kquant_panels=True)
    monkeypatch.setattr(tuning, "EXPANSION_SLACK_BYTES", 0)
    assert tuning.keeps_blocks("auto", params) and not tuning.dense_fits(params)
    probe = tuning.make_probe(engine_cfg, list(range(1, 200)))
    kernel, xla = tuning.Candidate("float32", CPU_IMPL, "cpu_int8"), tuning.Candidate("float32", CPU_IMPL, "xla")
    rows = tuning.measure_all([kernel, xla], cfg, params, probe, float("inf"), auto_weights=True)
    assert rows[0].passed, rows[0].note
    assert not rows[1].passed and rows[1].note.startswith("not built: it dequantizes kept blocks")


def test_the_w8a8_kernels_are_held_to_their_exact_reference_and_xla_s_w8a8_to_f32():
    """The W8A8 kernels ('cpu_int8', any weights) are checked against their exact reference with its tolerance (per
    matmul within 1e-4; the whole model well under the errors near 1 of a wrong kernel), XLA's W8A8 ('int8') against
    f32; every other candidate against its dtype's."""
    kernel, int8 = tuning.Candidate("float32", "cpu", "cpu_int8"), tuning.Candidate("float32", "reference", "int8")
    xla = tuning.Candidate("bfloat16", "reference", "xla")
    assert tuning.uses_exact_reference(kernel) and not tuning.uses_exact_reference(int8) and not tuning.uses_exact_reference(xla)
    assert tuning.tolerance_for(kernel) is tuning.TOLERANCES["w8a8_exact"]
    assert tuning.tolerance_for(int8) is tuning.TOLERANCES["int8"]
    assert tuning.tolerance_for(xla) is tuning.TOLERANCES["bfloat16"]
    assert tuning.W8A8_MATMUL_TOLERANCE <= 1e-4 and tuning.TOLERANCES["w8a8_exact"].max_relative_error <= 0.25
