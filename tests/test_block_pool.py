"""BlockPool: exact page ids, and invariants under random allocate/free sequences (hypothesis)."""

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.block_pool import NULL_PAGE, BlockPool, OutOfPagesError


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
    assert sorted(pool.free("a")) == [1, 2, 3]
    assert pool.allocate("b", 3) == [1, 2, 3]


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
def test_pool_invariants_hold_under_random_operations(num_pages, ops):
    pool = BlockPool(num_pages)
    owned: dict[str, list[int]] = {}
    for op, request, count in ops:
        rid = f"r{request}"
        if op == "alloc":
            if count > pool.num_free:
                with pytest.raises(OutOfPagesError):
                    pool.allocate(rid, count)
                continue
            owned.setdefault(rid, []).extend(pool.allocate(rid, count))
        else:
            assert sorted(pool.free(rid)) == sorted(owned.pop(rid, []))  # exactly what was allocated
        all_owned = [p for pages in owned.values() for p in pages]
        assert len(all_owned) == len(set(all_owned)), "a page is owned twice"
        assert NULL_PAGE not in all_owned
        assert pool.num_free + pool.num_used == num_pages - 1
        assert pool.num_used == len(all_owned)
        assert all(pool.ref_count(p) == 1 for p in all_owned)


@pytest.mark.parametrize("module", ["jaxinfer.block_pool", "jaxinfer.scheduler", "jaxinfer.request", "jaxinfer.buckets"])
def test_host_modules_do_not_import_jax(module):
    code = f"import {module}, sys; bad = [m for m in sys.modules if m == 'jax' or m.startswith('jax.')]; assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)
