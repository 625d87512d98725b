"""Subprocesses that answer with a JSON last line: any script, and the peers in experiments/peers run in
.venv-ref (HF transformers, llama.cpp). Stdlib only.
"""

import json
import pathlib
import subprocess

from common.paths import PEERS_DIR, REF_PYTHON


def last_json(stdout: str) -> dict:
    """The JSON document on the last line of a script's stdout."""
    return json.loads(stdout.strip().splitlines()[-1])


def run_json(command: list[str], what: str, **kwargs) -> dict:
    """Run `command` and return its last-line JSON; RuntimeError (with its stderr's tail) if it fails."""
    completed = subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)
    if completed.returncode != 0:
        raise RuntimeError(f"{what} failed ({completed.returncode}):\n{completed.stderr[-3000:]}")
    return last_json(completed.stdout)


def run_peer(script: str, *argv: str) -> dict:
    """experiments/peers/`script` in .venv-ref; its last-line JSON."""
    return run_json([str(REF_PYTHON), str(PEERS_DIR / script), *argv], script)


def run_generate_peer(script: str, workload_file, tokens_file, *argv: str) -> tuple[dict, object]:
    """A generate peer (hf_generate.py, llamacpp_generate.py) on a workload file: (its last-line JSON, the
    tokens it wrote to `tokens_file`), or ({"error": ...}, None) where it failed or is not installed."""
    try:
        raw = run_peer(script, "--workload", str(workload_file), "--out", str(tokens_file), *argv)
        return raw, json.loads(pathlib.Path(tokens_file).read_text())
    except (RuntimeError, json.JSONDecodeError, FileNotFoundError) as error:
        return {"error": str(error)}, None
