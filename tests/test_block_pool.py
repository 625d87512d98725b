"""BlockPool: exact page ids, ref counts and free order in scripted sequences, and the same against a
hand-written LIFO model under random allocate/free sequences (hypothesis)."""

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.block_pool import NULL_PAGE, BlockPool, OutOfPagesError


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


def test_free_returns_pages_for_reuse_in_the_same_order():
    pool = BlockPool(6)
    pool.allocate("a", 3)
    assert pool.free("a") == [3, 2, 1]  # released last page first
    assert pool.allocate("b", 3) == [1, 2, 3]


def test_scripted_allocate_free_sequence_hands_out_exact_page_ids():
    """Pages 1..7; freed pages are reused most recently freed first (LIFO), each request's in order."""
    pool = BlockPool(8)
    assert pool.allocate("a", 2) == [1, 2]
    assert pool.allocate("b", 3) == [3, 4, 5]
    assert pool.allocate("a", 1) == [6]  # appended to a's table, not a new table
    assert pool.pages_of("a") == [1, 2, 6]
    assert (pool.num_free, pool.num_used) == (1, 6)
    assert pool.free("a") == [6, 2, 1]  # free list is now [7, 6, 2, 1], popped from the end
    assert (pool.num_free, pool.num_used) == (4, 3)
    assert pool.allocate("c", 2) == [1, 2]
    assert pool.allocate("d", 2) == [6, 7]  # 6 was freed after 7 was last free, so it comes first
    assert pool.free("b") == [5, 4, 3]
    assert pool.allocate("e", 3) == [3, 4, 5]
    assert (pool.num_free, pool.num_used) == (0, 7)
    assert {rid: pool.pages_of(rid) for rid in "abcde"} == {"a": [], "b": [], "c": [1, 2], "d": [6, 7], "e": [3, 4, 5]}


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
    b_table = pool.block_table("b", 4).tolist()
    assert pool.free("a") == [6, 2, 1]
    assert pool.pages_of("b") == [3, 4, 5]
    assert pool.block_table("b", 4).tolist() == b_table == [3, 4, 5, NULL_PAGE]
    assert [pool.ref_count(page) for page in (3, 4, 5)] == [1, 1, 1]
    before = _state(pool, "ab")
    assert pool.free("a") == [] and pool.free("never-allocated") == []  # a second free is a no-op
    assert _state(pool, "ab") == before


def test_null_page_is_never_handed_out_across_exhaust_and_recycle():
    pool = BlockPool(4)
    for cycle in range(3):
        assert pool.allocate(f"x{cycle}", 1) + pool.allocate(f"y{cycle}", 2) == [1, 2, 3]
        assert pool.num_free == 0 and pool.ref_count(NULL_PAGE) == 0
        with pytest.raises(OutOfPagesError):
            pool.allocate("z", 1)  # page 0 is not a spare
        pool.free(f"y{cycle}")
        pool.free(f"x{cycle}")


def test_out_of_pages_leaves_state_unchanged():
    pool = BlockPool(6)
    pool.allocate("a", 2)
    pool.allocate("b", 1)
    pool.free("a")  # free list [5, 4, 2, 1]: next allocation is [1, 2, 4, 5]
    before = _state(pool, "abc")
    with pytest.raises(OutOfPagesError, match="need 5 pages, 4 free"):
        pool.allocate("b", 5)  # an existing request: nothing may be appended to its table
    with pytest.raises(OutOfPagesError, match="need 5 pages, 4 free"):
        pool.allocate("c", 5)  # a new request: no partial table left behind
    assert _state(pool, "abc") == before
    assert pool.free("c") == []
    assert pool.allocate("c", 4) == [1, 2, 4, 5]  # the free order is intact too


def test_allocate_zero_pages_changes_nothing_and_negative_raises():
    pool = BlockPool(4)
    pool.allocate("a", 1)
    before = _state(pool, "ab")
    assert pool.allocate("b", 0) == []
    assert _state(pool, "ab") == before
    with pytest.raises(ValueError, match="must be >= 0"):
        pool.allocate("b", -1)
    assert _state(pool, "ab") == before


def test_block_table_pads_with_null_page():
    pool = BlockPool(8)
    pool.allocate("a", 2)
    assert pool.block_table("a", 4).tolist() == [1, 2, NULL_PAGE, NULL_PAGE]
    with pytest.raises(ValueError, match="more than the table width"):
        pool.block_table("a", 1)


def test_pool_rejects_fewer_than_two_pages():
    with pytest.raises(ValueError, match="null page"):
        BlockPool(1)


operations = st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 5), st.integers(0, 4)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(num_pages=st.integers(2, 20), ops=operations)
def test_pool_matches_lifo_model_under_random_operations(num_pages, ops):
    """The pool against a hand-written model: a stack of free pages, popped on allocate, and each freed
    table pushed last page first. Page ids, free order, ref counts and tables must all agree."""
    pool = BlockPool(num_pages)
    free_stack = list(range(num_pages - 1, 0, -1))
    owned: dict[str, list[int]] = {}
    for op, request, count in ops:
        rid = f"r{request}"
        if op == "alloc":
            if count > len(free_stack):
                with pytest.raises(OutOfPagesError):
                    pool.allocate(rid, count)
            else:
                expected = [free_stack.pop() for _ in range(count)]
                assert pool.allocate(rid, count) == expected
                owned.setdefault(rid, []).extend(expected)
        else:
            released = owned.pop(rid, [])[::-1]
            assert pool.free(rid) == released
            free_stack.extend(released)
        assert NULL_PAGE not in free_stack
        assert (pool.num_free, pool.num_used) == (len(free_stack), num_pages - 1 - len(free_stack))
        assert {r: pool.pages_of(r) for r in owned} == owned
        owners = [p for pages in owned.values() for p in pages]
        assert _ref_counts(pool) == [owners.count(page) for page in range(num_pages)]


@pytest.mark.parametrize("module", ["jaxinfer.block_pool", "jaxinfer.scheduler", "jaxinfer.request", "jaxinfer.buckets"])
def test_host_modules_do_not_import_jax(module):
    code = f"import {module}, sys; bad = [m for m in sys.modules if m == 'jax' or m.startswith('jax.')]; assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)
