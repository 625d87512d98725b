"""BlockPool: exact page ids, ref counts and free order in scripted sequences, and the same against a
hand-written LRU model under random allocate/free sequences (hypothesis)."""

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.scheduling.block_pool import NULL_PAGE, ROOT_HASH, BlockPool, OutOfPagesError, page_hash, page_hashes


def _ref_counts(pool: BlockPool) -> list[int]:
    return [pool.ref_count(page) for page in range(pool.num_pages)]


def _state(pool: BlockPool, request_ids) -> tuple:
    """Everything observable about the pool, for before/after comparisons."""
    tables = {rid: pool.pages_of(rid) for rid in request_ids}
    return pool.num_free, pool.num_used, _ref_counts(pool), tables


def test_allocate_hands_out_low_pages_first_and_never_page_zero():
    pool = BlockPool(5)
    assert pool.allocate("a", 2) == [1, 2]
    assert pool.allocate("b", 2) == [3, 4]
    assert (pool.num_free, pool.num_used) == (0, 4)
    with pytest.raises(OutOfPagesError, match="need 1 pages, 0 free"):
        pool.allocate("c", 1)


def test_freed_pages_join_the_tail_of_the_queue_last_page_first():
    pool = BlockPool(6)
    pool.allocate("a", 3)
    assert pool.free("a") == [3, 2, 1]  # released last page first
    assert pool.free_order() == [4, 5, 3, 2, 1]  # never-used pages go out before freed ones
    assert pool.allocate("b", 4) == [4, 5, 3, 2]


def test_scripted_allocate_free_sequence_hands_out_exact_page_ids():
    """Pages 1..7; the free queue is LRU: freed pages join its tail (each request's last page first)."""
    pool = BlockPool(8)
    assert pool.allocate("a", 2) == [1, 2]
    assert pool.allocate("b", 3) == [3, 4, 5]
    assert pool.allocate("a", 1) == [6]  # appended to a's table, not a new table
    assert pool.pages_of("a") == [1, 2, 6]
    assert (pool.num_free, pool.num_used) == (1, 6)
    assert pool.free("a") == [6, 2, 1]  # the queue is now [7, 6, 2, 1]
    assert (pool.num_free, pool.num_used) == (4, 3)
    assert pool.allocate("c", 2) == [7, 6]
    assert pool.allocate("d", 2) == [2, 1]
    assert pool.free("b") == [5, 4, 3]
    assert pool.allocate("e", 3) == [5, 4, 3]
    assert (pool.num_free, pool.num_used) == (0, 7)
    assert {rid: pool.pages_of(rid) for rid in "abcde"} == {"a": [], "b": [], "c": [7, 6], "d": [2, 1], "e": [5, 4, 3]}


def test_free_drops_ref_count_from_one_to_zero():
    pool = BlockPool(6)
    assert _ref_counts(pool) == [0, 0, 0, 0, 0, 0]
    pool.allocate("a", 2)
    pool.allocate("b", 1)
    assert _ref_counts(pool) == [0, 1, 1, 1, 0, 0]
    pool.free("a")
    assert _ref_counts(pool) == [0, 0, 0, 1, 0, 0]
    pool.free("b")
    assert _ref_counts(pool) == [0, 0, 0, 0, 0, 0]
    assert (pool.num_free, pool.num_used) == (5, 0)


def test_free_of_one_request_leaves_other_requests_untouched():
    pool = BlockPool(8)
    pool.allocate("a", 2)
    pool.allocate("b", 3)
    pool.allocate("a", 1)
    assert pool.free("a") == [6, 2, 1]
    assert pool.pages_of("b") == [3, 4, 5]
    assert [pool.ref_count(page) for page in (3, 4, 5)] == [1, 1, 1]
    before = _state(pool, "ab")
    assert pool.free("a") == [] and pool.free("never-allocated") == []  # a second free is a no-op
    assert _state(pool, "ab") == before


def test_null_page_is_never_handed_out_across_exhaust_and_recycle():
    pool = BlockPool(4)
    for cycle in range(3):
        assert sorted(pool.allocate(f"x{cycle}", 1) + pool.allocate(f"y{cycle}", 2)) == [1, 2, 3]
        assert pool.num_free == 0 and pool.ref_count(NULL_PAGE) == 0
        with pytest.raises(OutOfPagesError):
            pool.allocate("z", 1)  # page 0 is not a spare
        pool.free(f"y{cycle}")
        pool.free(f"x{cycle}")


def test_out_of_pages_leaves_state_unchanged():
    pool = BlockPool(6)
    pool.allocate("a", 2)
    pool.allocate("b", 1)
    pool.free("a")  # free queue [4, 5, 2, 1]
    before = _state(pool, "abc")
    with pytest.raises(OutOfPagesError, match="need 5 pages, 4 free"):
        pool.allocate("b", 5)  # an existing request: nothing may be appended to its table
    with pytest.raises(OutOfPagesError, match="need 5 pages, 4 free"):
        pool.allocate("c", 5)  # a new request: no partial table left behind
    assert _state(pool, "abc") == before
    assert pool.free("c") == []
    assert pool.allocate("c", 4) == [4, 5, 2, 1]  # the free order is intact too


def test_allocate_zero_pages_changes_nothing_and_negative_raises():
    pool = BlockPool(4)
    pool.allocate("a", 1)
    before = _state(pool, "ab")
    assert pool.allocate("b", 0) == []
    assert _state(pool, "ab") == before
    with pytest.raises(ValueError, match="must be >= 0"):
        pool.allocate("b", -1)
    assert _state(pool, "ab") == before


def test_pool_rejects_fewer_than_two_pages():
    with pytest.raises(ValueError, match="null page"):
        BlockPool(1)


operations = st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 5), st.integers(0, 4)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(num_pages=st.integers(2, 20), ops=operations)
def test_pool_matches_lru_model_under_random_operations(num_pages, ops):
    """The pool against a hand-written model: a queue of free pages, taken from the head on allocate,
    each freed table appended last page first. Page ids, free order, ref counts and tables must agree."""
    pool = BlockPool(num_pages)
    free_queue = list(range(1, num_pages))  # head first
    owned: dict[str, list[int]] = {}
    for op, request, count in ops:
        rid = f"r{request}"
        if op == "alloc":
            if count > len(free_queue):
                with pytest.raises(OutOfPagesError):
                    pool.allocate(rid, count)
            else:
                expected = [free_queue.pop(0) for _ in range(count)]
                assert pool.allocate(rid, count) == expected
                owned.setdefault(rid, []).extend(expected)
        else:
            released = owned.pop(rid, [])[::-1]
            assert pool.free(rid) == released
            free_queue.extend(released)
        assert NULL_PAGE not in free_queue and pool.free_order() == free_queue
        pool.check_invariants()
        assert (pool.num_free, pool.num_used) == (len(free_queue), num_pages - 1 - len(free_queue))
        assert {r: pool.pages_of(r) for r in owned} == owned
        owners = [p for pages in owned.values() for p in pages]
        assert _ref_counts(pool) == [owners.count(page) for page in range(num_pages)]


# ------------------------------------------------------------------ prefix cache (vLLM-style, exact ids)


def test_page_hashes_chain_over_parent_tokens_and_salt():
    a = page_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2  # the partial third page has no name
    assert a[0] == page_hash(ROOT_HASH, [1, 2, 3, 4]) and a[1] == page_hash(a[0], [5, 6, 7, 8])
    assert page_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)[1] != a[1]  # same page tokens, other parent
    assert page_hashes([1, 2, 3, 4], 4, "tenant-a") != page_hashes([1, 2, 3, 4], 4) != page_hashes([1, 2, 3, 4], 4, "tenant-b")


def test_page_hash_is_blake2b_of_parent_and_native_int64_tokens():
    tokens = [0, 1, -2, 2**40, 151_935, 7]
    expected = hashlib.blake2b(b"parent", digest_size=16)
    expected.update(np.asarray(tokens, np.int64).tobytes())
    assert page_hash(b"parent", tokens) == expected.digest()
    assert page_hash(b"parent", np.asarray(tokens[:2], np.int32)) == page_hash(b"parent", [0, 1])  # numpy ids too


def test_cached_pages_are_shared_with_ref_counts_and_leave_the_free_queue():
    pool = BlockPool(8)
    names = page_hashes(list(range(12)), 4)
    pages = pool.allocate("a", 3)  # [1, 2, 3]
    for page, name in zip(pages, names):
        pool.cache_page(page, name)
    assert pool.lookup(names) == [1, 2, 3] and pool.lookup(names[:1] + [b"other"]) == [1]
    pool.share("b", pool.lookup(names[:2]))
    assert [pool.ref_count(p) for p in (1, 2, 3)] == [2, 2, 1]
    assert pool.free("a") == [3]  # 1 and 2 still belong to b
    assert pool.free_order() == [4, 5, 6, 7, 3]
    pool.share("c", pool.lookup(names))  # a hit on a freed page takes it out of the queue
    assert pool.pages_of("c") == [1, 2, 3] and pool.free_order() == [4, 5, 6, 7]
    assert [pool.ref_count(p) for p in (1, 2, 3)] == [2, 2, 1]
    pool.check_invariants()


def test_eviction_takes_the_least_recently_freed_page_and_forgets_its_name():
    pool = BlockPool(4)  # pages 1..3
    names = page_hashes(list(range(12)), 4)
    for page, name in zip(pool.allocate("a", 3), names):
        pool.cache_page(page, name)
    pool.free("a")  # queue [3, 2, 1]: the tail page of a's sequence is evicted first
    assert pool.allocate("x", 1) == [3] and pool.num_evictions == 1
    assert pool.lookup(names) == [1, 2]  # page 3's name is gone; the prefix [1, 2] still hits
    assert pool.num_cached == 2
    pool.check_invariants()


def test_a_name_held_by_one_page_is_not_moved_to_another():
    pool = BlockPool(4)
    (name,) = page_hashes([1, 2, 3, 4], 4)
    p, q = pool.allocate("a", 1)[0], pool.allocate("b", 1)[0]
    pool.cache_page(p, name)
    pool.cache_page(q, name)  # b computed the same prefix concurrently: its copy stays unnamed
    assert pool.lookup([name]) == [p] and pool.num_cached == 1
    pool.check_invariants()


def test_share_must_come_before_any_allocation():
    pool = BlockPool(4)
    pool.allocate("a", 1)
    with pytest.raises(ValueError, match="shared pages must come first"):
        pool.share("a", [2])
