"""The tuner's numerics check: what a candidate must meet against the float32 reference of the probe.

`TOLERANCES` per compute dtype and per matmul that quantizes activations; `tolerance_for` picks a candidate's;
`Reference` holds the reference's greedy tokens and logits; `greedy_agreement` is the share of each request's
greedy tokens before its first difference from the reference's, a difference at a tie (within the tolerance's
logit error) forgiven. tuning.py measures and decides; this module only says what passes.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """What a candidate of one dtype must meet against the float32 reference."""

    max_relative_error: float  # ||logits - reference|| / ||reference||, at each probe prompt's last token
    min_greedy_agreement: float  # mean share of each request's greedy tokens before its first difference (ties aside)


TOLERANCES = {
    "float32": Tolerance(1e-3, 1.0),
    "bfloat16": Tolerance(8e-2, 0.5),  # 8 mantissa bits: 4.3% relative logit error measured on SmolLM2's probe
    "float16": Tolerance(2e-2, 0.5),
    # matmul 'int8' and 'cpu_int8' (W8A8): activations in int8 blocks of 64 gave 11% relative logit error on
    # SmolLM2's probe and +0.62% held-out perplexity (bench_quant), blocks of 32 (both paths now) +0.19%;
    # per-token scales gave 36% and +3.65%.
    "int8": Tolerance(0.15, 0.5),
    # matmul 'cpu_int8' on K-quant panels: llama.cpp's own arithmetic for these formats (activations in int8 blocks of
    # 256, Q8_K), whose cost is a property of the format: on real weights (SmolLM2 requantized by llama.cpp) perplexity
    # within 0.5% of llama.cpp's on the same files (kquant_perplexity). Against f32 activations it measured 0.055-0.08
    # relative logit error on those files and on random Llama-3.2-1B ones, 0.159 on random Gemma-3-1B and 0.161 on random
    # Llama-3.1-8B Q4_K_M (greedy 0.75 and 0.5), where 0.15 had left only candidates that dequantize every step (10-50x
    # slower: a 15-minute tuning at 8B). A wrong kernel gives errors near 1.
    "kquant": Tolerance(0.25, 0.5),
}


@dataclasses.dataclass(frozen=True)
class Reference:
    """The float32 reference of the probe (`reference_run`)."""

    tokens: np.ndarray  # i32[R, N]: the greedy continuation
    step_logits: np.ndarray  # f32[R, N, V]: the logits each greedy token was drawn from

    @property
    def logits(self) -> np.ndarray:
        """f32[R, V]: at each prompt's last token (what the first greedy token was drawn from)."""
        return self.step_logits[:, 0]

    def tie_at(self, row: int, step: int, token: int, tolerance: "Tolerance") -> bool:
        """Whether `token` is as good as the reference's own pick at (row, step) within the tolerance's
        logit error: its logit falls short of the top one by no more than max_relative_error times the
        logits' RMS (a perturbation within the tolerance can swap them)."""
        logits = self.step_logits[row, step]
        margin = tolerance.max_relative_error * float(np.sqrt(np.mean(np.square(logits))))
        return float(logits[self.tokens[row, step]] - logits[token]) <= margin


def greedy_agreement(ours: list[list[int]], reference: Reference, tolerance: Tolerance) -> float:
    """Mean share of each request's greedy tokens before its first difference from the reference's; a
    first difference at a tie (`Reference.tie_at`: random-weight models are full of them) is no
    difference, since from there either continuation is as right."""
    shares = []
    for row, (tokens, expected) in enumerate(zip(ours, reference.tokens.tolist())):
        same = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), min(len(tokens), len(expected)))
        if same < min(len(tokens), len(expected)) and reference.tie_at(row, same, tokens[same], tolerance):
            same = len(expected)
        shares.append(same / max(len(expected), 1))
    return float(np.mean(shares))


def tolerance_for(candidate, kquant_weights: bool) -> Tolerance:
    """The TOLERANCES entry `candidate` is checked against: its matmul's where it quantizes activations ('kquant' where
    it reads K-quant weights, `kquant_weights`: panels.has_kquant_weights), else its dtype's (bfloat16's for a dtype without one)."""
    if candidate.matmul_impl == "cpu_int8" and kquant_weights:
        return TOLERANCES["kquant"]
    if candidate.matmul_impl in ("int8", "cpu_int8"):
        return TOLERANCES["int8"]
    return TOLERANCES.get(candidate.dtype, TOLERANCES["bfloat16"])
