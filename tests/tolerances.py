"""Numeric tolerances, in one place. Relative error norm = ||actual - expected|| / ||expected||."""

LOGITS_VS_HF_F32 = 1e-4  # our f32 forward vs transformers f32 on the same dequantized weights
LOGITS_VS_FLOAT64 = 1e-5  # our f32 forward vs a float64 numpy forward
PAGED_VS_DENSE_F32 = 1e-5  # the same forward through the paged pool vs a dense cache
CHUNKED_VS_ONESHOT_F32 = 1e-5  # chunked prefill vs one-shot prefill
KERNEL_BF16 = 2e-2
KERNEL_F32 = 1e-5


def relative_error(actual, expected) -> float:
    import numpy as np

    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def assert_close(actual, expected, tolerance: float, what: str = "values") -> None:
    """Relative error norm check whose message reports max and mean absolute differences."""
    import numpy as np

    error = relative_error(actual, expected)
    diff = np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64))
    assert error <= tolerance, f"{what}: relative error {error:.3g} > {tolerance:.1g} (max abs diff {diff.max():.3g}, mean {diff.mean():.3g})"
