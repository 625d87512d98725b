"""Data-parallel routing: which replica (engine + block pool, held by api.py's `Replica`) each request goes
to at admission. `route` decides from per-replica loads (by load and prefix-cache affinity); `Router`
carries one stream's routing state (the load and the prefix pages sent to each replica so far) and reads
each request's prefix names from the one hash chain the scheduler uses (`Request.page_names`,
kv_manager.name_pages). Host-only: imports scheduling/ only, never jax and never engine/.
"""

import dataclasses
from collections.abc import Sequence

from jaxinfer.scheduling.block_pool import BlockPool
from jaxinfer.scheduling.kv_manager import name_pages
from jaxinfer.scheduling.request import Request

MAX_ROUTED_PAGES = 1 << 16  # prefix names a stream's router remembers before forgetting them (they are cached by then)


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


class Router:
    """One stream's routing over the replicas' block pools: `assign` gives each request its replica by
    `route`, counting what each replica caches of its prefix and the prefixes routed to it earlier in
    this stream (not yet computed, but they will be by the time it runs)."""

    def __init__(self, block_pools: Sequence[BlockPool], *, page_size: int, enable_prefix_caching: bool):
        self.block_pools = list(block_pools)
        self.page_size = page_size  # tokens per KV page
        self.enable_prefix_caching = enable_prefix_caching
        self.loads: list[int] = [0] * len(self.block_pools)  # tokens routed to each replica
        self.routed_pages: list[set[bytes]] = [set() for _ in self.block_pools]  # prefix names sent to each

    def assign(self, requests: Sequence[Request]) -> list[int]:
        """The replica of each request (a prompt's first sample: its other samples follow it)."""
        if len(self.block_pools) == 1:
            return [0] * len(requests)
        if sum(map(len, self.routed_pages)) > MAX_ROUTED_PAGES:  # a long stream: what ran is in the pools' caches by now
            for pages in self.routed_pages:
                pages.clear()
        return [self._assign_one(request) for request in requests]

    def _assign_one(self, request: Request) -> int:
        prompt_tokens, max_tokens = len(request.prompt_ids), request.params.max_tokens
        names = name_pages(request, prompt_tokens // self.page_size, self.page_size) if self.enable_prefix_caching else []
        states = []
        for pool, routed in zip(self.block_pools, self.routed_pages):
            cached = len(pool.lookup(names))
            while cached < len(names) and names[cached] in routed:
                cached += 1
            states.append(ReplicaLoad(self.loads[len(states)], pool.num_free, cached * self.page_size))
        i = route(states, prompt_tokens, max_tokens)
        self.loads[i] += prompt_tokens - states[i].cached_tokens + max_tokens
        self.routed_pages[i].update(names)
        return i
