"""Data-parallel replicas: one engine and block pool per replica, and the router that assigns each request
at admission (`route`, by load and prefix-cache affinity). Host-side; no jax at import.
"""

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxinfer.scheduling.block_pool import BlockPool

if TYPE_CHECKING:
    from jaxinfer.engine.engine import Engine


@dataclasses.dataclass(frozen=True)
class ReplicaLoad:
    """What the router knows of one replica when a request arrives."""

    load_tokens: int  # tokens of the work already routed to it: prompt tokens to compute + tokens to generate
    free_pages: int  # KV pages with no owner (cached ones included)
    cached_tokens: int = 0  # this prompt's leading tokens whose KV pages it holds or was just sent (prefix cache)


def route(replicas: Sequence[ReplicaLoad], prompt_tokens: int, max_tokens: int) -> int:
    """The replica a request goes to: the one where the work it adds lands on the least load, counting
    its prompt less what that replica already caches, plus its output (so a shared prefix pulls a
    request to the replica holding it, unless that replica is busier by more than the saving); ties go
    to more free KV pages, then to the lower index."""
    def key(i: int):
        r = replicas[i]
        return (r.load_tokens + prompt_tokens - r.cached_tokens + max_tokens, -r.free_pages, i)

    return min(range(len(replicas)), key=key)


@dataclasses.dataclass
class Replica:
    """One model replica: an engine on its own devices and the block pool of its KV pool."""

    engine: "Engine"
    block_pool: BlockPool
