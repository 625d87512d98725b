"""Host-side page allocator: free list, per-request block tables, reference counts. No jax.

Mechanism only: `allocate` raises when there are not enough free pages; the scheduler decides what to
preempt (policy). Page 0 is the null page and is never handed out. Reference counts are kept so that
prefix sharing can later map one physical page into several block tables; a page returns to the free
list when its count drops to zero. Free pages are reused in LIFO order (the most recently freed first),
which keeps the working set of the pool small.
"""

import numpy as np

NULL_PAGE = 0


class OutOfPagesError(RuntimeError):
    """Not enough free pages for an allocation."""


class BlockPool:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a pool needs at least 2 pages (page 0 is the null page), got {num_pages=}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, 0, -1))  # pop() hands out page 1 first
        self._ref_counts = np.zeros(num_pages, np.int32)
        self._req_to_pages: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages owned by at least one request (the null page is neither free nor used)."""
        return self.num_pages - 1 - len(self._free)

    def pages_of(self, request_id: str) -> list[int]:
        return list(self._req_to_pages.get(request_id, ()))

    def ref_count(self, page: int) -> int:
        return int(self._ref_counts[page])

    def allocate(self, request_id: str, num_new_pages: int) -> list[int]:
        """Append `num_new_pages` fresh pages to the request's block table and return them."""
        if num_new_pages < 0:
            raise ValueError(f"{num_new_pages=} must be >= 0")
        if num_new_pages > len(self._free):
            raise OutOfPagesError(f"need {num_new_pages} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(num_new_pages)]
        self._ref_counts[pages] += 1
        self._req_to_pages.setdefault(request_id, []).extend(pages)
        return pages

    def free(self, request_id: str) -> list[int]:
        """Drop the request's references; pages whose count reaches zero return to the free list."""
        pages = self._req_to_pages.pop(request_id, [])
        released = []
        for page in reversed(pages):  # so that re-allocation hands them back in the same order
            self._ref_counts[page] -= 1
            if self._ref_counts[page] == 0:
                self._free.append(page)
                released.append(page)
        return released

    def block_table(self, request_id: str, width: int) -> np.ndarray:
        """int32[width]: the request's pages, padded with the null page."""
        pages = self._req_to_pages.get(request_id, [])
        if len(pages) > width:
            raise ValueError(f"request {request_id!r} owns {len(pages)} pages, more than the table width {width}")
        table = np.full(width, NULL_PAGE, np.int32)
        table[: len(pages)] = pages
        return table
