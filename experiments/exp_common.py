"""Helpers the experiment scripts share that need no jax (so a parent process that only spawns workers
stays light): the agreement of two runs' greedy tokens."""

import numpy as np


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Exact-match share of requests, and the mean share of each request's tokens before the first difference."""
    prefix = []
    for a, b in zip(ours, theirs):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(same / max(len(a), 1))
    return {"exact_requests": float(np.mean([a == b for a, b in zip(ours, theirs)])), "mean_prefix_fraction": float(np.mean(prefix))}
