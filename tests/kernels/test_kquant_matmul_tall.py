"""The CPU K-quant kernel at prefill's many rows (32 and up), where a CPU with AMX runs its tile path
(kernels_cpu/kquant_matmul.cc: the codes times their sub-block scales unpacked once per panel, the integer sums
from tile dot products): the same bits as its VNNI tiles (`amx=False`), and the int64 numpy transcription of the
blocks' bytes (test_kquant_matmul.numpy_kquant_w8a8). On a CPU without AMX both calls run the VNNI tiles and the
transcription is what still checks them."""

import jax.numpy as jnp
import numpy as np
import pytest
from test_kquant_matmul import ULPS, _activations, _packed, kquant_kernel, numpy_kquant_w8a8, random_blocks, saturated_blocks  # noqa: F401  (a fixture)

from kernels_cpu import kquant_matmul

pytestmark = pytest.mark.usefixtures("cpu_kernels", "kquant_kernel")

K_QUANTS = ("q4_k", "q5_k", "q6_k")


def _both(x: np.ndarray, packed: dict, layer: int, fmt: str, num_in: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's outputs with the AMX tiles allowed and with the VNNI tiles only."""
    return tuple(np.asarray(kquant_matmul.kquant_matmul(jnp.asarray(x), packed, jnp.int32(layer), fmt=fmt, num_in=num_in, amx=amx)) for amx in (True, False))


@pytest.mark.parametrize("fmt", K_QUANTS)
def test_many_rows_are_the_vnni_tiles_bits_and_the_int64_transcription(fmt):
    """70 columns (96 padded: six panels), three super-blocks, three layers; rows 32 (two whole tiles of 16), 47
    (a last tile of 15) and 100 (of 4)."""
    blocks = random_blocks(fmt, 3, 70, 3, seed=ord(fmt[1]))
    q, packed = _packed(fmt, blocks)
    num_in = q.in_shape[0]
    rng = np.random.default_rng(7)
    for rows, layer in ((32, 0), (47, 2), (100, 1)):
        x = _activations(rng, rows, num_in)
        tiles, vnni = _both(x, packed, layer, fmt, num_in)
        np.testing.assert_array_equal(tiles, vnni, err_msg=f"{rows} rows")
        assert not tiles[:, 70:].any()  # padding columns are zero weights
        expected = numpy_kquant_w8a8(x, fmt, blocks[layer])
        err = np.abs(tiles[:, :70] - expected).max() / np.abs(expected).max()
        assert err <= ULPS * np.finfo(np.float32).eps, (rows, err)


@pytest.mark.parametrize(("fmt", "q6_scale"), [("q4_k", None), ("q5_k", None), ("q6_k", 127), ("q6_k", -128)])
def test_largest_scaled_codes_against_full_scale_activations_stay_exact(fmt, q6_scale):
    """Every code and sub-scale at its extreme (q4_k / q5_k 6-bit scales 63 and codes 15 / 31: sc q = 945 / 1953;
    q6_k scales 127 or -128 against codes 0 and 63: sc (q - 32) from -4064 to 4096), times activations all at
    +-127 in rows of mixed signs, 33 rows: the tiles' split sc q = 256 hi + lo at its widest, and a last tile of one
    row. A wrapped or mis-signed byte would move an output by far more than the tolerance."""
    blocks = saturated_blocks(fmt, seed=9, q6_scale=q6_scale or 127)
    if fmt == "q6_k":
        per_block = blocks.reshape(1, 32, 2, -1)  # a view: half the columns at code 0 (q - 32 = -32), half at 63 (+31)
        per_block[:, ::2, :, :192] = 0
    q, packed = _packed(fmt, blocks)
    num_in = q.in_shape[0]
    ones = np.ones(num_in, np.float32)
    patterns = [ones, -ones, np.where(np.arange(num_in) % 32 < 16, ones, -ones), np.where(np.arange(num_in) % 2 == 0, 3 * ones, -ones)]
    x = np.stack([patterns[r % 4] * (1 + r % 3) for r in range(33)])
    tiles, vnni = _both(x, packed, 0, fmt, num_in)
    np.testing.assert_array_equal(tiles, vnni)
    expected = numpy_kquant_w8a8(x, fmt, blocks[0])
    assert np.abs(tiles - expected).max() <= ULPS * np.finfo(np.float32).eps * np.abs(expected).max()
