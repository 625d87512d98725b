"""The KV manager between the scheduler (policy: who runs, who is preempted) and the block pool (mechanism).

It owns prefix naming (the hash chain over a request's full pages, kept on `Request.page_names` so that
the scheduler and the replica router share one chain), allocate-or-None (`try_allocate`: the scheduler
preempts on None; `BlockPool.allocate` raises), prefix lookup and sharing at admission, naming pages
once their KV is computed, and release. As vLLM v1's KVCacheManager sits between its Scheduler and
BlockPool. Host-only: imports the stdlib and scheduling/ only, never jax.
Invariants: a request's named pages are a prefix of its block table (`_num_named` counts them); a
request whose pages are released has nothing named (its next admission looks its prefix up again).

Sliding window (`window`, set only when every layer of the model is windowed: `page_release_window`): a
running request's pages wholly before the window of its next query go back to the pool
(`release_outside_window`); their table entries become the null page, which attention masks. A released
page keeps its prefix-cache name while it waits in the free queue (its KV is still that prefix's), and
the request's count of named pages still covers it, so a page is never named twice. Requests whose
sampling reads their whole token history through the pages (presence, frequency or repetition
penalties: engine.token_counts) keep every page.
"""

from jaxinfer.config import ModelConfig
from jaxinfer.scheduling.block_pool import NULL_PAGE, ROOT_HASH, BlockPool, OutOfPagesError, page_hash
from jaxinfer.scheduling.request import Request, SamplingParams


def page_release_window(cfg: ModelConfig) -> int | None:
    """The window after which pages may go back to the pool: the model's sliding window when every layer
    is windowed (Mistral; `layer_types` None or all "sliding_attention"), else None (Gemma's global layers
    read every page, so nothing is released)."""
    layer_types = getattr(cfg, "layer_types", None)
    if cfg.sliding_window is None or (layer_types is not None and any(t != "sliding_attention" for t in layer_types)):
        return None
    return cfg.sliding_window


def reads_token_history(params: SamplingParams) -> bool:
    """Whether sampling counts the tokens of the whole sequence through its pages (the penalties)."""
    return bool(params.presence_penalty or params.frequency_penalty) or params.repetition_penalty != 1.0


def name_pages(request: Request, num_pages: int, page_size: int) -> list[bytes]:
    """Names of the request's first `num_pages` full pages (prompt + output), extending the chain kept on
    the request (`Request.page_names`); a page is named by its parent's name, its tokens and the salt."""
    names = request.page_names
    while len(names) < num_pages:
        start = len(names) * page_size
        names.append(page_hash(names[-1] if names else ROOT_HASH, request.tokens_between(start, start + page_size), request.cache_salt))
    return names[:num_pages]


class KVManager:
    """A request's pages in one block pool: allocation, the prefix cache, release."""

    def __init__(self, block_pool: BlockPool, *, page_size: int, enable_prefix_caching: bool, deterministic: bool = False,
                 window: int | None = None):
        self.block_pool = block_pool
        self.page_size = page_size  # tokens per page
        self.window = window  # tokens every layer's queries see (page_release_window); None: no page is released early
        self.enable_prefix_caching = enable_prefix_caching
        self.deterministic = deterministic  # name only pages a prefill computed (decode-computed KV differs in its bits)
        self._num_named: dict[str, int] = {}  # request id -> how many of its pages are in the cache map
        self._tables = block_pool.tables  # request id -> block table (read only here)

    @property
    def num_pages(self) -> int:
        """Pages of the pool, the null page included."""
        return self.block_pool.num_pages

    @property
    def num_free_pages(self) -> int:
        """Pages with no owner, cached ones included (evicted on demand)."""
        return self.block_pool.num_free

    @property
    def num_used_pages(self) -> int:
        return self.block_pool.num_used

    def pages_of(self, request: Request) -> list[int]:
        return self.block_pool.pages_of(request.request_id)

    def num_pages_held(self, request: Request) -> int:
        """Entries of the request's block table (len(pages_of), without copying it)."""
        return len(self._tables.get(request.request_id, ()))

    def num_pages_held_by(self, requests: list[Request]) -> list[int]:
        """num_pages_held of each request, in order."""
        tables = self._tables
        return [len(tables.get(r.request_id, ())) for r in requests]

    def num_new_pages(self, request: Request, num_tokens: int) -> int:
        """Pages the request lacks to hold `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.page_size) - len(self._tables.get(request.request_id, ())))

    def try_allocate(self, request: Request, num_tokens: int) -> list[int] | None:
        """Grow the request's table to hold `num_tokens` tokens; the new pages ([] when none are needed),
        or None when the pool has too few free pages (nothing is allocated then)."""
        try:
            return self.block_pool.allocate(request.request_id, self.num_new_pages(request, num_tokens))
        except OutOfPagesError:
            return None

    def share_cached_prefix(self, request: Request, prefill_end: int) -> int:
        """Share the longest cached run of the request's full pages; returns the tokens it covers, which
        become its computed tokens. The last token a prefill covers (up to `prefill_end`) is always
        computed, as it needs logits, so at most (prefill_end - 1) // page_size pages; a request that
        scores its prompt (prompt_logprobs) from token i computes from position i - 1 on
        (Request.first_logits_position)."""
        if not self.enable_prefix_caching:
            return 0
        pages = self.block_pool.lookup(name_pages(request, request.first_logits_position(prefill_end) // self.page_size, self.page_size))
        if pages:
            self.block_pool.share(request.request_id, pages)
            self._num_named[request.request_id] = len(pages)
        request.num_computed_tokens = len(pages) * self.page_size
        return request.num_computed_tokens

    def num_cached_pages(self, names: list[bytes]) -> int:
        """How many of these page names, from the first, the prefix cache holds now (read only: nothing is
        shared or evicted); a scheduling policy's look at the cache (policies.PrefixAware)."""
        return len(self.block_pool.lookup(names))

    def cache_computed_pages(self, request: Request) -> None:
        """Name the request's pages that are now full of computed KV, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        computed = request.num_computed_tokens
        if self.deterministic:
            computed = min(computed, len(request.prompt_ids))
        num_full = computed // self.page_size
        first = self._num_named.get(request.request_id, 0)
        if num_full <= first:  # nothing new is full (most calls: one decode token)
            return
        pages, names = self.pages_of(request), name_pages(request, num_full, self.page_size)
        for i in range(first, num_full):
            if pages[i] != NULL_PAGE:  # released before it was named (deterministic mode names prompt pages only)
                self.block_pool.cache_page(pages[i], names[i])
        self._num_named[request.request_id] = num_full

    def cache_computed_pages_of(self, requests: list[Request]) -> None:
        """cache_computed_pages for each request, in order, calling it only where a page may have filled."""
        if not self.enable_prefix_caching:
            return
        named, size = self._num_named, self.page_size
        for request in requests:
            if request.num_computed_tokens // size > named.get(request.request_id, 0):  # deterministic mode names fewer: it rechecks
                self.cache_computed_pages(request)

    def num_outside_window(self, request: Request) -> int:
        """Leading pages of the request's table that no later query can see: every position of page i
        is < t - window + 1 for the next query position t = num_computed_tokens, i.e.
        (i + 1) * page_size <= t - window + 1. 0 without a window or for a request that reads its history."""
        if self.window is None or reads_token_history(request.params):
            return 0
        num = (request.num_computed_tokens - self.window + 1) // self.page_size
        return max(0, min(num, self.num_pages_held(request)))

    def release_outside_window(self, request: Request) -> list[int]:
        """Hand back the request's pages wholly before its next query's window (their entries become the
        null page); returns the pages that became free."""
        return self.block_pool.release_pages(request.request_id, self.num_outside_window(request))

    def release(self, request: Request) -> None:
        """Drop the request's pages (shared ones stay with their other owners; named ones stay cached
        until evicted). Its page names stay on the request: its tokens, and so their names, never change."""
        self.block_pool.free(request.request_id)
        self._num_named.pop(request.request_id, None)
