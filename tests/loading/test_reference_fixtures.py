"""The committed HF reference fixtures (tests/fixtures) must match a fresh rebuild.

`make test` rebuilds them into build/reference with the reference env (.venv-ref, torch +
transformers) and sets JAXINFER_REF_REBUILT to that directory; this test then compares the two
with tests/reference/compare.py (numpy + safetensors only).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

TESTS = Path(__file__).resolve().parents[1]
FIXTURES = TESTS / "fixtures"


def _load_compare():
    name = "jaxinfer_tests_reference_compare"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TESTS / "reference" / "compare.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


compare = _load_compare()


def test_committed_fixtures_match_rebuild():
    rebuilt = os.environ.get("JAXINFER_REF_REBUILT")
    if not rebuilt:
        pytest.skip("JAXINFER_REF_REBUILT is unset; `make test` sets it after rebuilding the "
                    "references into build/reference (or run `make reference-check` and set it)")
    rebuilt_dir = Path(rebuilt)
    if not rebuilt_dir.is_absolute():
        # make runs pytest from the repository root; fall back to it if the cwd differs
        if not rebuilt_dir.is_dir():
            rebuilt_dir = TESTS.parent / rebuilt_dir
    assert rebuilt_dir.is_dir(), f"JAXINFER_REF_REBUILT={rebuilt} is not a directory"
    diffs = compare.compare_fixture_dirs(FIXTURES, rebuilt_dir)
    assert not diffs, (
        f"{len(diffs)} difference(s) between committed tests/fixtures and the rebuild in {rebuilt_dir}"
        " (if intended, run `make reference` and commit):\n  " + "\n  ".join(diffs)
    )


def _rewrite_npz(path: Path, key: str, fn) -> None:
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays[key] = fn(arrays[key].copy())
    path.unlink()
    np.savez(path, **arrays)


def test_compare_detects_perturbations(tmp_path):
    if not (FIXTURES / "smollm2_reference.npz").is_file():
        pytest.fail("tests/fixtures/smollm2_reference.npz is missing; run `make reference`")
    committed = tmp_path / "committed"
    rebuilt = tmp_path / "rebuilt"
    shutil.copytree(FIXTURES, committed)
    shutil.copytree(FIXTURES, rebuilt)
    assert compare.compare_fixture_dirs(committed, rebuilt) == []

    def bump_logits(a):
        a[123] += 0.05 * float(np.linalg.norm(a))  # relative error ~5e-2, far above 1e-4
        return a

    def bump_id(a):
        a[0] = (a[0] + 1) % 49152
        return a

    def tiny_noise(a):
        return (a * (1 + 1e-6)).astype(a.dtype)  # well within rtol: must not be reported

    _rewrite_npz(rebuilt / "smollm2_reference.npz", "p0_last_logits", bump_logits)
    _rewrite_npz(rebuilt / "smollm2_reference.npz", "p1_greedy_ids", bump_id)
    _rewrite_npz(rebuilt / "tiny_llama_reference.npz", "s0_logits", tiny_noise)
    diffs = compare.compare_fixture_dirs(committed, rebuilt)
    assert len(diffs) == 2, diffs
    assert any("p0_last_logits" in d and "relative error" in d for d in diffs), diffs
    assert any("p1_greedy_ids" in d for d in diffs), diffs

    # A changed weight in the safetensors file and a missing file are reported too.
    st = rebuilt / "tiny_llama" / "model.safetensors"
    data = bytearray(st.read_bytes())
    data[-1] ^= 0x01  # flip the last byte of the last tensor's data
    st.write_bytes(bytes(data))
    (rebuilt / "smollm2_reference.json").unlink()
    diffs = compare.compare_fixture_dirs(committed, rebuilt)
    assert any("model.safetensors" in d and "weights differ" in d for d in diffs), diffs
    assert any("smollm2_reference.json" in d and "missing" in d for d in diffs), diffs


def test_topk_near_tie_swap_is_tolerated(tmp_path):
    """Two near-equal top-k logits swapping places is not drift; a real index change is."""
    committed = tmp_path / "c"
    rebuilt = tmp_path / "r"
    for d in (committed, rebuilt):
        d.mkdir()
    vals = np.array([[5.0, 4.0, 3.0000001, 3.0, 1.0]], dtype=np.float32)
    idx = np.array([[10, 11, 12, 13, 14]], dtype=np.int32)
    np.savez(committed / "tiny_llama_reference.npz", x_values=vals, x_indices=idx)
    swapped = idx.copy()
    swapped[0, [2, 3]] = swapped[0, [3, 2]]
    np.savez(rebuilt / "tiny_llama_reference.npz", x_values=vals, x_indices=swapped)
    diffs = [d for d in compare.compare_fixture_dirs(committed, rebuilt) if "tiny_llama_reference" in d]
    assert diffs == []
    changed = idx.copy()
    changed[0, 1] = 99
    np.savez(rebuilt / "tiny_llama_reference.npz", x_values=vals, x_indices=changed)
    diffs = [d for d in compare.compare_fixture_dirs(committed, rebuilt) if "tiny_llama_reference" in d]
    assert len(diffs) == 1 and "x_indices" in diffs[0], diffs


def test_fixture_npz_layout():
    """The keys and dtypes that the jaxinfer tests rely on (documented in make_fixtures.py)."""
    path = FIXTURES / "smollm2_reference.npz"
    if not path.is_file():
        pytest.fail("tests/fixtures/smollm2_reference.npz is missing; run `make reference`")
    assert zipfile.is_zipfile(path)
    with np.load(path, allow_pickle=False) as z:
        n = int(z["num_prompts"])
        vocab, k, steps = int(z["vocab_size"]), int(z["top_k"]), int(z["greedy_steps"])
        assert (vocab, k, steps) == (49152, 20, 32) and n >= 8
        lengths = []
        for i in range(n):
            ids = z[f"p{i}_ids"]
            t = ids.shape[0]
            lengths.append(t)
            assert ids.dtype == np.int32 and ids.ndim == 1 and t >= 1
            assert z[f"p{i}_top20_values"].shape == (t, k) and z[f"p{i}_top20_values"].dtype == np.float32
            assert z[f"p{i}_top20_indices"].shape == (t, k) and z[f"p{i}_top20_indices"].dtype == np.int32
            assert z[f"p{i}_logsumexp"].shape == (t,)
            last = z[f"p{i}_last_logits"]
            assert last.shape == (vocab,) and last.dtype == np.float32
            np.testing.assert_array_equal(np.sort(last)[::-1][:k], z[f"p{i}_top20_values"][-1])
            assert z[f"p{i}_greedy_ids"].shape == (steps,) and z[f"p{i}_greedy_ids"].dtype == np.int32
            assert z[f"p{i}_greedy_top20_indices"][0, 0] == z[f"p{i}_greedy_ids"][0]
            assert z[f"p{i}_greedy_top20_values"].shape == (steps, k)
        assert max(lengths) > 512
    with np.load(FIXTURES / "tiny_llama_reference.npz", allow_pickle=False) as z:
        for i in range(int(z["num_sequences"])):
            t = z[f"s{i}_ids"].shape[0]
            assert z[f"s{i}_logits"].shape == (t, 512) and z[f"s{i}_logits"].dtype == np.float32
