"""Reading the JSONL records a batch job writes (jaxinfer.batch.job, the CLI, jaxinfer.batch.ray), for the tests.

Parsed here independently of jaxinfer.batch.job's own reader: one JSON object per b"\\n"-terminated line.
"""

import json
from pathlib import Path


def records(path: Path) -> list[dict]:
    """Every record of the output file, in file order; blank lines are skipped."""
    return [json.loads(line) for line in Path(path).read_bytes().split(b"\n") if line.strip()]


def by_key(path: Path) -> dict[str, dict]:
    """The records by their resume key; fails if a key was written twice."""
    out = {}
    for record in records(path):
        assert record["key"] not in out, f"{record['key']} written twice"
        out[record["key"]] = record
    return out
