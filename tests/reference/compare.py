"""Compare two reference-fixture directories (committed vs. freshly rebuilt).

Needs only numpy and safetensors (no torch): the main test env imports it.

Rules
  * integer / bool arrays (token ids, greedy ids, scalars): exactly equal;
    except ``*_indices`` arrays that sit beside a ``*_values`` array (top-k results): a slot may
    differ only where the committed top-k values are tied within tolerance (a near-tie can swap
    order between runs without anything being wrong);
  * float arrays: relative error norm ||a - b|| / ||b|| <= rtol (default 1e-4), b = committed,
    and no NaN/inf in the rebuilt one where the committed one is finite;
  * safetensors: same tensor names, dtypes, shapes, metadata and exactly equal values;
  * JSON: equal after parsing;
  * anything else: equal bytes.

Only files that make_fixtures.py writes are compared, so other fixtures that live in
tests/fixtures/ are ignored.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

RTOL = 1e-4

# What tests/reference/make_fixtures.py writes, relative to its --out directory.
# Its FAMILIES, GEMMA_FAMILIES and ROPE_SCALING_FAMILIES (tiny_qwen3_embed is make_embedding_fixtures.py's).
FAMILY_MODELS = (
    "tiny_llama", "tiny_llama3", "tiny_llama_linear", "tiny_llama_dynamic", "tiny_mistral", "tiny_mistral_window", "tiny_qwen2",
    "tiny_qwen3", "tiny_gemma2", "tiny_gemma2_softcap", "tiny_gemma3", "tiny_gemma4", "tiny_phi3", "tiny_qwen2_yarn",
    "tiny_qwen3_yarn",
)
FIXTURE_FILES = (
    "smollm2_reference.npz",
    "smollm2_reference.json",
    "chat_templates.json",
    *(f"{name}_reference.npz" for name in FAMILY_MODELS),
    *(f"{name}/{file}" for name in FAMILY_MODELS for file in ("config.json", "model.safetensors")),
)
FIXTURE_DIRS = FAMILY_MODELS


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a64 = a.astype(np.float64)
    b64 = b.astype(np.float64)
    num = float(np.linalg.norm((a64 - b64).ravel()))
    den = float(np.linalg.norm(b64.ravel()))
    return num / den if den > 0 else num


def _topk_indices_ok(
    idx_c: np.ndarray, idx_r: np.ndarray, val_c: np.ndarray, rtol: float
) -> list[int]:
    """Rows (flattened) whose index differences are not explained by near-ties."""
    k = idx_c.shape[-1]
    ic = idx_c.reshape(-1, k)
    ir = idx_r.reshape(-1, k)
    vc = val_c.reshape(-1, k).astype(np.float64)
    bad: list[int] = []
    for row in np.nonzero((ic != ir).any(axis=1))[0]:
        tol = rtol * max(1.0, float(np.abs(vc[row]).max()))
        for j in np.nonzero(ic[row] != ir[row])[0]:
            group = np.abs(vc[row] - vc[row, j]) <= tol  # slots tied with slot j
            in_group = ir[row, j] in set(ic[row][group].tolist())
            at_boundary = bool(group[k - 1])  # the tie may continue past the top-k cut
            if not (in_group or at_boundary):
                bad.append(int(row))
                break
    return bad


def _compare_npz(name: str, committed: Path, rebuilt: Path, rtol: float) -> list[str]:
    out: list[str] = []
    with np.load(committed, allow_pickle=False) as zc, np.load(rebuilt, allow_pickle=False) as zr:
        kc, kr = set(zc.files), set(zr.files)
        for key in sorted(kc - kr):
            out.append(f"{name}: key {key!r} missing from the rebuilt file")
        for key in sorted(kr - kc):
            out.append(f"{name}: key {key!r} is new in the rebuilt file (not committed)")
        arrays_c = {k: zc[k] for k in kc}
        arrays_r = {k: zr[k] for k in kr}
    for key in sorted(kc & kr):
        a, b = arrays_r[key], arrays_c[key]
        where = f"{name}[{key}]"
        if a.dtype != b.dtype:
            out.append(f"{where}: dtype {a.dtype} rebuilt vs {b.dtype} committed")
            continue
        if a.shape != b.shape:
            out.append(f"{where}: shape {a.shape} rebuilt vs {b.shape} committed")
            continue
        if np.issubdtype(b.dtype, np.floating):
            fin_b = np.isfinite(b)
            if not np.array_equal(np.isfinite(a), fin_b):
                out.append(f"{where}: non-finite values differ ({int((~np.isfinite(a)).sum())} rebuilt, "
                           f"{int((~fin_b).sum())} committed)")
                continue
            err = _rel_err(a[fin_b], b[fin_b])
            if err > rtol:
                out.append(f"{where}: relative error norm {err:.3e} > {rtol:.0e} "
                           f"(max abs diff {float(np.abs(a[fin_b] - b[fin_b]).max()):.3e})")
        elif np.array_equal(a, b):
            continue
        elif key.endswith("_indices") and key[: -len("_indices")] + "_values" in arrays_c:
            vals = arrays_c[key[: -len("_indices")] + "_values"]
            bad = _topk_indices_ok(b, a, vals, rtol) if vals.shape == b.shape else [-1]
            if bad:
                out.append(f"{where}: top-k indices differ beyond near-ties in {len(bad)} row(s), "
                           f"first at row {bad[0]}")
        else:
            diff = np.nonzero((a != b).ravel())[0]
            first = int(diff[0])
            out.append(f"{where}: {diff.size} of {b.size} entries differ; first at flat index {first}: "
                       f"rebuilt {a.ravel()[first]!r} vs committed {b.ravel()[first]!r}")
    return out


def _compare_safetensors(name: str, committed: Path, rebuilt: Path) -> list[str]:
    from safetensors import safe_open

    out: list[str] = []
    with safe_open(str(committed), framework="numpy") as fc, safe_open(str(rebuilt), framework="numpy") as fr:
        if (fc.metadata() or {}) != (fr.metadata() or {}):
            out.append(f"{name}: metadata {fr.metadata()!r} rebuilt vs {fc.metadata()!r} committed")
        kc, kr = set(fc.keys()), set(fr.keys())
        for key in sorted(kc - kr):
            out.append(f"{name}: tensor {key!r} missing from the rebuilt file")
        for key in sorted(kr - kc):
            out.append(f"{name}: tensor {key!r} is new in the rebuilt file")
        for key in sorted(kc & kr):
            a, b = fr.get_tensor(key), fc.get_tensor(key)
            if a.dtype != b.dtype or a.shape != b.shape:
                out.append(f"{name}[{key}]: {a.dtype}{a.shape} rebuilt vs {b.dtype}{b.shape} committed")
            elif not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
                out.append(f"{name}[{key}]: weights differ ({int((a != b).sum())} of {b.size} entries)")
    return out


def _json_diff(path: str, a, b, out: list[str], limit: int = 20) -> None:
    if len(out) >= limit:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a:
                out.append(f"{path}.{k}: missing from the rebuilt file")
            elif k not in b:
                out.append(f"{path}.{k}: new in the rebuilt file")
            else:
                _json_diff(f"{path}.{k}", a[k], b[k], out, limit)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _json_diff(f"{path}[{i}]", x, y, out, limit)
    elif a != b:
        ra, rb = repr(a), repr(b)
        out.append(f"{path}: rebuilt {ra[:80]}{'...' if len(ra) > 80 else ''} vs committed "
                   f"{rb[:80]}{'...' if len(rb) > 80 else ''}")


def _compare_file(rel: str, committed: Path, rebuilt: Path, rtol: float) -> list[str]:
    try:
        if rel.endswith(".npz"):
            return _compare_npz(rel, committed, rebuilt, rtol)
        if rel.endswith(".safetensors"):
            return _compare_safetensors(rel, committed, rebuilt)
        if rel.endswith(".json"):
            out: list[str] = []
            _json_diff(rel, json.loads(rebuilt.read_text()), json.loads(committed.read_text()), out)
            return out
        return [] if committed.read_bytes() == rebuilt.read_bytes() else [f"{rel}: bytes differ"]
    except Exception as exc:  # a corrupt or unreadable file is a difference, not a crash
        return [f"{rel}: could not compare ({type(exc).__name__}: {exc})"]


def compare_fixture_dirs(committed: Path, rebuilt: Path, rtol: float = RTOL) -> list[str]:
    """Human-readable differences between two fixture dirs; empty when they agree."""
    committed, rebuilt = Path(committed), Path(rebuilt)
    rels = set(FIXTURE_FILES)
    for d in FIXTURE_DIRS:  # files that appeared or vanished inside the fixture folders
        for root in (committed, rebuilt):
            if (root / d).is_dir():
                rels |= {p.relative_to(root).as_posix() for p in (root / d).rglob("*") if p.is_file()}
    out: list[str] = []
    for rel in sorted(rels):
        c, r = committed / rel, rebuilt / rel
        if not c.is_file() and not r.is_file():
            out.append(f"{rel}: missing from both {committed} and {rebuilt}")
        elif not c.is_file():
            out.append(f"{rel}: missing from the committed fixtures ({committed})")
        elif not r.is_file():
            out.append(f"{rel}: missing from the rebuilt fixtures ({rebuilt})")
        else:
            out.extend(_compare_file(rel, c, r, rtol))
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Compare two reference fixture dirs.")
    ap.add_argument("committed", type=Path)
    ap.add_argument("rebuilt", type=Path)
    ap.add_argument("--rtol", type=float, default=RTOL)
    args = ap.parse_args(argv)
    diffs = compare_fixture_dirs(args.committed, args.rebuilt, rtol=args.rtol)
    for d in diffs:
        print(d)
    print(f"{len(diffs)} difference(s)")
    return 1 if diffs else 0


if __name__ == "__main__":
    raise SystemExit(main())
