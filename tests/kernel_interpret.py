"""Running Mosaic GPU kernels in the GPU interpreter on CPU, for tests only.

`interpret=True` does not work for Mosaic GPU kernels; the GPU interpreter does
(`plgpu.InterpretGPUParams`). Passing the params straight to the kernel needs no abstract
mesh in jax 0.11.2 (checked). Race reports and the reset after a failure live in a private
jax module, so that import is kept here, out of library code.
"""

import contextlib
from collections.abc import Iterator

from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as _mosaic_interpret
from jax.experimental.pallas import mosaic_gpu as plgpu


def interpret_params(*, detect_races: bool = True) -> plgpu.InterpretGPUParams:
    """Interpreter settings: uninitialized memory (outputs included) reads as NaN, and an
    out-of-bounds read of a buffer raises."""
    return plgpu.InterpretGPUParams(
        detect_races=detect_races, uninitialized_memory="nan", out_of_bounds_reads="raise")


def races_found() -> bool:
    """Whether the race detector flagged anything since the last reset."""
    return bool(_mosaic_interpret.get_races().races_found)


@contextlib.contextmanager
def gpu_interpreter(*, detect_races: bool = True) -> Iterator[plgpu.InterpretGPUParams]:
    """Yields interpreter params on a fresh interpreter state, and resets it again on exit
    (after an exception the interpreter must be reset before its next use)."""
    _mosaic_interpret.gpu_callbacks.reset_gpu_interpret_mode_state()
    try:
        yield interpret_params(detect_races=detect_races)
    except BaseException:
        _mosaic_interpret.gpu_callbacks.reset_gpu_interpret_mode_state()
        raise
