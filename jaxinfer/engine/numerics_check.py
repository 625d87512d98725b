"""The tuner's numerics check: what a candidate must meet against its reference on the probe.

Two references: the float32 one (f32 activations), and for the W8A8 kernels (matmul 'cpu_int8') their exact one,
the same dense forward with each activation the kernels quantize fake-quantized by their rule
(model/w8a8_reference.py), so a kernel is held to its own arithmetic, tightly, instead of to f32 loosely;
`uses_exact_reference` says which a candidate meets. `TOLERANCES` per compute dtype, per matmul that quantizes
activations against f32, and for the exact check; `tolerance_for` picks a candidate's;
`Reference` holds a reference's greedy tokens and logits; `greedy_agreement` is the share of each request's
greedy tokens before its first difference from the reference's, a difference at a tie (within the tolerance's
logit error) forgiven. tuning.py measures and decides; this module only says what passes.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """What a candidate must meet against its reference."""

    max_relative_error: float  # ||logits - reference|| / ||reference||, at each probe prompt's last token
    min_greedy_agreement: float  # mean share of each request's greedy tokens before its first difference (ties aside)


TOLERANCES = {
    "float32": Tolerance(1e-3, 1.0),
    "bfloat16": Tolerance(8e-2, 0.5),  # 8 mantissa bits: 4.3% relative logit error measured on SmolLM2's probe
    "float16": Tolerance(2e-2, 0.5),
    # matmul 'int8' (W8A8 through XLA) against f32 activations: activations in int8 blocks of 64 gave 11% relative
    # logit error on SmolLM2's probe and +0.62% held-out perplexity (bench_quant), blocks of 32 +0.19%; per-token
    # scales gave 36% and +3.65%.
    "int8": Tolerance(0.15, 0.5),
    # matmul 'cpu_int8' against its exact reference (the same activations, fake-quantized by the kernels' rule): one matmul
    # of the kernel is that reference to 3e-7..5e-7 relative (tests/model/test_w8a8_reference.py), but a whole model is not:
    # W8A8 is discontinuous, and a last-bit difference (f32 sum order) that moves one activation code across a rounding
    # half moves the logits of that token and, through attention, of the later ones by about 1e-2 on these models. The
    # reference itself moves so under a 2-ulp change of one norm weight (SmolLM2 1e-2, random Llama-3.2-1B 2 layers 3e-2,
    # where f32 moves 1e-7..2e-6). Measured on the probe (loaded 2-core EPYC; greedy with ties within 0.1 forgiven):
    # SmolLM2 Q4_1 0.037 (f32 0.103), random Llama-3.2-1B Q4_K_M 2 layers 0.016 (f32 0.032), random Gemma-3-1B Q4_K_M
    # 0.034 (f32 0.037), greedy 1.0 on each; the tiny Q4_K_M / Q6_K fixtures 0.023 / 0.015 (f32 0.062 / 0.060). The
    # error grows with depth and width: random Llama-3.1-8B Q4_K_M (32 layers, D = 4,096) measured 0.097 (f32 0.155,
    # greedy 0.72; bench_kquant --8b alone at f85ca64), against a first bound of 0.1 that would have refused the kernel
    # there by a hair. 0.2 leaves room for such models; a wrong kernel gives errors near 1, and the tight check is
    # W8A8_MATMUL_TOLERANCE's, per matmul.
    "w8a8_exact": Tolerance(0.2, 0.5),
}
# The tight check of the W8A8 kernels: each matmul they run (the first layer of each format of every matrix they read),
# against the exact reference on the same activations (w8a8_exact.kernel_matmul_error). Measured 3.9e-7 (the tiny
# Q4_K_M fixture), 4.9e-7 (SmolLM2 Q4_1), 4.5e-7 and 5.4e-7 (random Llama-3.2-1B 2 layers and Gemma-3-1B Q4_K_M);
# activations in the wrong block size or f32 activations give 1e-2.
W8A8_MATMUL_TOLERANCE = 1e-4


@dataclasses.dataclass(frozen=True)
class Reference:
    """A reference run of the probe (`reference_run`: float32, or the W8A8 kernels' exact one)."""

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


def logit_error(logits: dict, reference: Reference) -> float:
    """The largest relative error of a candidate's prompt-end logits ({prompt index: f32[V]}) against `reference`'s."""
    return max(float(np.linalg.norm(logits[i] - reference.logits[i]) / np.linalg.norm(reference.logits[i])) for i in range(len(reference.logits)))


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


def uses_exact_reference(candidate) -> bool:
    """Whether `candidate` is checked against the W8A8 kernels' exact reference (matmul 'cpu_int8': every matrix a
    kernel reads has its activations quantized by the kernels' rule), not the float32 one."""
    return candidate.matmul_impl == "cpu_int8"


def tolerance_for(candidate) -> Tolerance:
    """The TOLERANCES entry `candidate` is checked against: the exact check's for the W8A8 kernels
    (`uses_exact_reference`), 'int8' for XLA's W8A8, else its dtype's (bfloat16's for a dtype without one)."""
    if uses_exact_reference(candidate):
        return TOLERANCES["w8a8_exact"]
    if candidate.matmul_impl == "int8":
        return TOLERANCES["int8"]
    return TOLERANCES.get(candidate.dtype, TOLERANCES["bfloat16"])
