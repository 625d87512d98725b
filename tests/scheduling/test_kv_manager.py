"""The KV manager between scheduler and block pool (no jax): allocate-or-None leaves the pool untouched when
it refuses, the prefix names on the request are the block pool's hash chain, computed pages are named and
shared, release keeps names cached, and the replica router reads the same chain the scheduler wrote."""

from jaxinfer.scheduling.block_pool import BlockPool, page_hashes
from jaxinfer.scheduling.kv_manager import KVManager, name_pages
from jaxinfer.scheduling.replicas import Router
from jaxinfer.scheduling.request import Request, SamplingParams

PAGE = 4


def make_request(rid: str, tokens: list[int], salt: str | None = None, prompt_logprobs: int | None = None) -> Request:
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=prompt_logprobs)
    return Request(rid, list(tokens), params, seed=0, cache_salt=salt)


def manager(num_pages: int = 6, caching: bool = True) -> KVManager:
    return KVManager(BlockPool(num_pages), page_size=PAGE, enable_prefix_caching=caching)


def test_try_allocate_gives_the_head_of_the_free_queue_or_none_without_allocating():
    kv = manager(num_pages=6)  # pages 1..5
    a, b = make_request("a", range(10)), make_request("b", range(10))
    assert kv.try_allocate(a, 10) == [1, 2, 3]  # ceil(10 / 4) pages
    assert kv.try_allocate(a, 12) == []  # 12 tokens still fit in 3 pages
    assert kv.try_allocate(b, 9) is None  # 3 pages needed, 2 free: nothing taken
    assert kv.pages_of(b) == [] and kv.num_free_pages == 2
    assert kv.try_allocate(b, 8) == [4, 5]
    kv.block_pool.check_invariants()


def test_page_names_on_the_request_are_the_block_pools_hash_chain():
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    request = make_request("a", tokens, salt="s")
    assert name_pages(request, 1, PAGE) == page_hashes(tokens, PAGE, "s")[:1]
    assert name_pages(request, 2, PAGE) == page_hashes(tokens, PAGE, "s")  # extended, not recomputed
    assert request.page_names == page_hashes(tokens, PAGE, "s")
    assert name_pages(make_request("b", tokens), 2, PAGE) != request.page_names  # the salt is in every name


def test_computed_pages_are_named_shared_by_an_equal_prefix_and_stay_cached_after_release():
    kv = manager(num_pages=8)
    first = make_request("a", list(range(100, 110)))  # 10 tokens: 2 full pages
    kv.try_allocate(first, 10)
    first.num_computed_tokens = 10
    kv.cache_computed_pages(first)
    assert kv.block_pool.num_cached == 2
    kv.release(first)
    assert kv.num_free_pages == 7 and kv.block_pool.num_cached == 2  # freed, still named
    second = make_request("b", list(range(100, 108)) + [1, 2, 3, 4, 5])
    assert kv.share_cached_prefix(second, prefill_end=13) == 8  # pages 1 and 2 of the first
    assert kv.pages_of(second) == [1, 2] and second.num_computed_tokens == 8
    scoring = make_request("c", list(range(100, 110)), prompt_logprobs=0)
    assert kv.share_cached_prefix(scoring, prefill_end=10) == 0  # scoring computes every prompt token
    kv.block_pool.check_invariants()


def test_a_prompt_all_cached_keeps_its_last_page_to_compute():
    kv = manager(num_pages=8)
    first = make_request("a", list(range(8)))  # exactly 2 full pages
    kv.try_allocate(first, 8)
    first.num_computed_tokens = 8
    kv.cache_computed_pages(first)
    kv.release(first)
    assert kv.share_cached_prefix(make_request("b", list(range(8))), prefill_end=8) == 4  # (8 - 1) // 4 pages


def test_router_reads_the_chain_the_scheduler_named_and_prefers_the_replica_that_caches_it():
    pools = [BlockPool(8), BlockPool(8)]
    cached = KVManager(pools[1], page_size=PAGE, enable_prefix_caching=True)
    earlier = make_request("x", list(range(12)))
    cached.try_allocate(earlier, 12)
    earlier.num_computed_tokens = 12
    cached.cache_computed_pages(earlier)
    cached.release(earlier)
    router = Router(pools, page_size=PAGE, enable_prefix_caching=True)
    again = make_request("y", list(range(12)) + [99])
    assert router.assign([again]) == [1]  # 12 cached tokens on replica 1 outweigh equal loads
    assert again.page_names == earlier.page_names  # the router extended the request's own chain
    assert router.loads == [0, 13 - 12 + 4]  # prompt less its cached tokens, plus max_tokens
