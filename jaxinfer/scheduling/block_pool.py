"""Host-side page allocator: an LRU free queue, per-request block tables, reference counts and the
prefix cache's hash -> page map. No jax.

Mechanism only: `allocate` raises when there are not enough free pages; the scheduler decides what to
preempt (policy). Page 0 is the null page and is never handed out.

Prefix caching (vLLM's design): a full page of computed KV is named by a hash chain over (the parent
page's hash, the page's token ids, the request's cache salt). `cache_page` records that name; `lookup`
finds the longest run of cached pages for a list of names, and `share` adds a request's reference to
them. A page whose count drops to zero goes to the tail of the free queue but keeps its name, so a
later request can still hit it; allocation takes the head of the queue (the least recently freed) and
only then forgets the page's name (eviction). Invariants: a page is in the free queue iff its count is
0; every named page maps back to its name; a shared page is never written (it is full, and a request
computes only positions past its cached pages).

Sliding-window release (`release_pages`): a running request may hand back the first pages of its table,
those wholly before every later query's window. Their entries become the null page, so the table keeps
its length and every later page its position; the request's references drop as in `free`, and a page
whose count reaches zero joins the free queue with its name kept: its KV is still the right content for
that prefix (a full page, never written again), so a later request may share it until it is evicted.
"""

import collections
import functools
import hashlib
import struct

NULL_PAGE = 0
ROOT_HASH = b""  # parent of a sequence's first page


class OutOfPagesError(RuntimeError):
    """Not enough free pages for an allocation."""


def page_hash(parent: bytes, token_ids, cache_salt: str | None = None) -> bytes:
    """The name of a full page: a hash of its parent's name, its token ids and the salt."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(_int64_packer(len(token_ids)).pack(*token_ids))  # int64 in native order, as array.array("q", token_ids).tobytes()
    if cache_salt is not None:
        digest.update(b"\x00salt\x00" + cache_salt.encode("utf-8", "surrogatepass"))
    return digest.digest()


@functools.cache
def _int64_packer(count: int) -> struct.Struct:
    """Packs `count` ints as native int64s (array.array("q", ...).tobytes()'s bytes, in half its time for a page)."""
    return struct.Struct(f"{count}q")


def page_hashes(token_ids: list[int], page_size: int, cache_salt: str | None = None) -> list[bytes]:
    """Names of the full pages of a token sequence, in order."""
    hashes, parent = [], ROOT_HASH
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = page_hash(parent, token_ids[start : start + page_size], cache_salt)
        hashes.append(parent)
    return hashes


class BlockPool:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a pool needs at least 2 pages (page 0 is the null page), got {num_pages=}")
        self.num_pages = num_pages
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(1, num_pages))  # head = next out
        self._ref_counts = [0] * num_pages  # owners per page (a list: scalar updates are the hot path)
        self._req_to_pages: dict[str, list[int]] = {}  # request id -> its block table
        self._hash_to_page: dict[bytes, int] = {}
        self._page_to_hash: dict[int, bytes] = {}
        self.num_evictions = 0  # named pages reused for new content

    @property
    def num_free(self) -> int:
        """Pages with no owner, cached ones included (they are evicted on demand)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages owned by at least one request (the null page is neither free nor used)."""
        return self.num_pages - 1 - len(self._free)

    @property
    def tables(self) -> dict[str, list[int]]:
        """Request id -> its block table, the pool's own dict (read only outside the pool: the KV manager
        reads table lengths from it in its hot paths)."""
        return self._req_to_pages

    @property
    def num_cached(self) -> int:
        return len(self._hash_to_page)

    def pages_of(self, request_id: str) -> list[int]:
        return list(self._req_to_pages.get(request_id, ()))

    def num_pages_of(self, request_id: str) -> int:
        """Length of the request's block table (null entries included): len(pages_of) without the copy."""
        return len(self._req_to_pages.get(request_id, ()))

    def ref_count(self, page: int) -> int:
        return int(self._ref_counts[page])

    def num_extra_owners(self) -> int:
        """Owners past each page's first, summed over the pool: how many times a count of every request's
        pages counts a shared page again (0 when no page is shared). O(pages)."""
        return sum(count - 1 for count in self._ref_counts if count > 1)

    def free_order(self) -> list[int]:
        """The free queue, head (next allocated) first."""
        return list(self._free)

    def allocate(self, request_id: str, num_new_pages: int) -> list[int]:
        """Append `num_new_pages` pages from the head of the free queue to the request's block table,
        evicting their cached names, and return them."""
        if num_new_pages < 0:
            raise ValueError(f"{num_new_pages=} must be >= 0")
        if num_new_pages > len(self._free):
            raise OutOfPagesError(f"need {num_new_pages} pages, {len(self._free)} free")
        table = self._req_to_pages.setdefault(request_id, [])
        if not num_new_pages:
            return []
        popitem = self._free.popitem
        pages = [popitem(False)[0] for _ in range(num_new_pages)]
        if self._page_to_hash:  # no page is named without prefix caching, nor in a simulation until a preemption (sim_pages)
            for page in pages:
                self._evict(page)
        counts = self._ref_counts
        for page in pages:
            counts[page] += 1
        table.extend(pages)
        return pages

    def _evict(self, page: int) -> None:
        name = self._page_to_hash.pop(page, None)
        if name is not None:
            del self._hash_to_page[name]
            self.num_evictions += 1

    def free(self, request_id: str) -> list[int]:
        """Drop the request's references; pages whose count reaches zero join the free queue's tail,
        last page first, so a sequence's tail is evicted before its (more shareable) head. Null entries
        (pages already released by `release_pages`) are skipped."""
        return self._drop(reversed(self._req_to_pages.pop(request_id, [])))

    def release_pages(self, request_id: str, count: int) -> list[int]:
        """Hand back the request's first `count` table entries (a sliding window has passed them): each
        real page loses the request's reference and its entry becomes NULL_PAGE, so the table keeps its
        length. Returns the pages that became free (first page first)."""
        table = self._req_to_pages.get(request_id, [])
        if not 0 <= count <= len(table):
            raise ValueError(f"cannot release {count} pages of request {request_id!r}, which holds {len(table)}")
        pages = [page for page in table[:count] if page != NULL_PAGE]
        table[:count] = [NULL_PAGE] * count
        return self._drop(pages)

    def _drop(self, pages) -> list[int]:
        """Drop one reference from each page (null entries skipped); those reaching zero join the free queue."""
        released, counts, free = [], self._ref_counts, self._free
        for page in pages:
            if page == NULL_PAGE:
                continue
            counts[page] -= 1
            if not counts[page]:
                free[page] = None
                released.append(page)
        return released

    # ------------------------------------------------------------ prefix cache

    def cache_page(self, page: int, name: bytes) -> None:
        """Name a full, computed page. A name already held by another page keeps that page."""
        if name in self._hash_to_page or page in self._page_to_hash:
            return
        self._hash_to_page[name] = page
        self._page_to_hash[page] = name

    def lookup(self, names: list[bytes]) -> list[int]:
        """Pages of the longest cached run of these names, from the first."""
        pages = []
        for name in names:
            page = self._hash_to_page.get(name)
            if page is None:
                break
            pages.append(page)
        return pages

    def share(self, request_id: str, pages: list[int]) -> None:
        """Add the request's reference to cached pages (the start of its block table); a page with no
        other owner leaves the free queue."""
        if self._req_to_pages.get(request_id):
            raise ValueError(f"request {request_id!r} already holds pages; shared pages must come first")
        for page in pages:
            if self._ref_counts[page] == 0:
                del self._free[page]
            self._ref_counts[page] += 1
        self._req_to_pages[request_id] = list(pages)

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (tests call this)."""
        owners = collections.Counter(p for pages in self._req_to_pages.values() for p in pages if p != NULL_PAGE)
        for page in range(1, self.num_pages):
            assert self._ref_counts[page] == owners[page], f"page {page}: count {self._ref_counts[page]}, owners {owners[page]}"
            assert (page in self._free) == (owners[page] == 0), f"page {page}: free-queue membership is wrong"
        assert NULL_PAGE not in self._free and self._ref_counts[NULL_PAGE] == 0
        assert all(self._page_to_hash[p] == h for h, p in self._hash_to_page.items())
        assert len(self._page_to_hash) == len(self._hash_to_page)
