"""One cache root for the kernels, the tuner and the XLA programs (kernels_cpu.build.cache_root owns the
rule): $JAXINFER_CACHE_DIR, else $XDG_CACHE_HOME/jaxinfer, else ~/.cache/jaxinfer. An XLA cache folder that
cannot be written warns and compiles without it; an engine whose CPU kernels are unavailable runs the jnp
path and generates what the reference generator does."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxinfer.config import EngineConfig
from jaxinfer.engine import tuning
from jaxinfer.engine.engine import enable_compilation_cache
from kernels_cpu import build

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def environ(monkeypatch, tmp_path) -> Path:
    """No cache variable set, and a home of the test's own; returns that home."""
    for name in (build.CACHE_ROOT_ENV, build.CACHE_ENV, "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def xla_config():
    """The process's XLA cache setting, restored after the test (nothing is compiled under the test's)."""
    before = jax.config.jax_compilation_cache_dir
    yield
    jax.config.update("jax_compilation_cache_dir", before)


def test_cache_root_is_jaxinfer_cache_dir_else_xdg_else_home(environ, monkeypatch, tmp_path):
    assert build.cache_root() == environ / ".cache" / "jaxinfer"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.cache_root() == tmp_path / "xdg" / "jaxinfer"
    monkeypatch.setenv(build.CACHE_ROOT_ENV, str(tmp_path / "mine"))
    assert build.cache_root() == tmp_path / "mine"


def test_kernels_and_tuning_cache_follow_the_root(environ, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    source = build.HERE / "paged_attention.cc"
    assert build.library_path(source).parent == tmp_path / "xdg" / "jaxinfer" / "kernels"
    assert tuning.cache_dir() == tmp_path / "xdg" / "jaxinfer"
    monkeypatch.setenv(build.CACHE_ROOT_ENV, str(tmp_path / "mine"))
    assert build.library_path(source).parent == tmp_path / "mine" / "kernels"
    assert tuning.cache_dir() == tmp_path / "mine"


def test_kernel_cache_variable_names_the_kernels_folder_alone(environ, monkeypatch, tmp_path):
    monkeypatch.setenv(build.CACHE_ROOT_ENV, str(tmp_path / "root"))
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "kernels_here"))
    assert build.library_path(build.HERE / "paged_attention.cc").parent == tmp_path / "kernels_here"
    assert tuning.cache_dir() == tmp_path / "root"


def test_default_xla_cache_is_under_the_root(environ, monkeypatch, tmp_path, xla_config):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    enable_compilation_cache(EngineConfig().compilation_cache_dir)
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xdg" / "jaxinfer" / "xla")
    assert (tmp_path / "xdg" / "jaxinfer" / "xla").is_dir()
    assert not (environ / ".cache").exists()


def test_xla_cache_dir_given_is_used_as_it_is(environ, monkeypatch, tmp_path, xla_config):
    monkeypatch.setenv(build.CACHE_ROOT_ENV, str(tmp_path / "root"))
    enable_compilation_cache(str(tmp_path / "programs"))
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "programs")


def test_xla_cache_that_cannot_be_made_warns_and_is_not_used(tmp_path, xla_config):
    """Below a regular file: refused even to root."""
    jax.config.update("jax_compilation_cache_dir", None)
    (tmp_path / "a_file").write_text("")
    with pytest.warns(UserWarning, match="not writable.*compiling without it"):
        enable_compilation_cache(str(tmp_path / "a_file" / "xla"))
    assert jax.config.jax_compilation_cache_dir is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o500 folder")
def test_read_only_xla_cache_warns_and_is_not_used(tmp_path, xla_config):
    jax.config.update("jax_compilation_cache_dir", None)
    (tmp_path / "xla").mkdir(mode=0o500)
    with pytest.warns(UserWarning, match="not writable"):
        enable_compilation_cache(str(tmp_path / "xla"))
    assert jax.config.jax_compilation_cache_dir is None


FALLBACK = """
import json, sys, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    from jaxinfer.api import LLM
    from jaxinfer.engine.generate import generate
    from jaxinfer.scheduling.request import SamplingParams
    llm = LLM(sys.argv[1], max_context=128, page_size=8, max_num_seqs=2, max_prefill_tokens=64, prefill_chunk_buckets=(64,),
              decode_batch_buckets=(2,), decode_page_buckets=(16,))
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate([[5, 17, 42, 9, 300]], greedy)
    (ref,) = generate(llm.engine.params, llm.model_config, [[5, 17, 42, 9, 300]], greedy)
print(json.dumps({"attention": llm.engine.impl, "matmul": llm.engine.matmul_impl, "tokens": out.token_ids, "reference": ref.token_ids,
                  "warnings": [str(w.message) for w in caught]}))
"""


def test_engine_without_cpu_kernels_runs_the_jnp_path_and_caches_programs_under_the_root(tiny_chat_model, tmp_path):
    """No compiler (CXX names none) and an empty cache root: attention_impl and matmul_impl left at "auto"
    resolve to the jnp attention and XLA's dot, the greedy tokens are the reference generator's, and the
    compiled programs land in <root>/xla."""
    root = tmp_path / "root"
    environ = {k: v for k, v in os.environ.items() if k not in (build.CACHE_ENV, "XDG_CACHE_HOME")}
    environ.update(JAXINFER_CACHE_DIR=str(root), CXX=str(tmp_path / "no-such-compiler"), JAXINFER_TUNE="0", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", FALLBACK, str(tiny_chat_model)], cwd=REPO, env=environ, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert (out["attention"], out["matmul"]) == ("reference", "xla")
    assert out["tokens"] == out["reference"] and len(out["tokens"]) == 8
    assert any("unavailable" in w and "no-such-compiler" in w for w in out["warnings"])
    assert any((root / "xla").iterdir())  # the default compilation cache, under the root
    assert not list(root.glob("kernels/*.so"))
