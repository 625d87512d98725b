"""Where the experiments' inputs and results live. Stdlib only.

The shared request traces live outside the repository: `jaxinfer.bucketing.traces.shared_trace` finds
them through $JAXINFER_TRACE_DIR, and `trace_or_default` is the scripts' one way to ask it.
"""

import pathlib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
TEXT_FILE = REPO_ROOT / "experiments" / "data" / "passages.txt"
RESULTS_DIR = REPO_ROOT / "experiments" / "results"
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "smollm2_reference.npz"
REF_PYTHON = REPO_ROOT / ".venv-ref" / "bin" / "python"
PEERS_DIR = REPO_ROOT / "experiments" / "peers"


def trace_or_default(path: pathlib.Path | str | None) -> pathlib.Path:
    """`path`, or when None the conversation trace in $JAXINFER_TRACE_DIR (a TraceError naming the
    variable when it is unset or lacks the file)."""
    if path is not None:
        return pathlib.Path(path)
    from jaxinfer.bucketing.traces import shared_trace

    return shared_trace()
