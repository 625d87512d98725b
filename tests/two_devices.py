"""Run a test file as a script in a subprocess with 2 simulated CPU devices, so the suite keeps its one device."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_on_two_devices(script: str, *args: str, timeout: int = 900) -> dict:
    """The JSON object `script` prints on its last stdout line; fails the test with its stderr if it fails."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, script, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
