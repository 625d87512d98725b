"""The simulator's page names: given by how each synthetic prompt is built, and a request's own ones named only if
it is preempted. Host only, no jax.

`page_names` names every page a simulated request may fill from its construction (`[g] * shared + [i + 2, 0, ...]`
then output 0s, g its prefix group's token), equal exactly where the prefix cache's hash chain would be, so nothing is hashed. `SimKV` is the
KV manager with one exact shortcut: a page past a request's shared prefix has a name no other request can have,
so it is named only when its request is preempted (the one case in which anyone looks it up).
"""

from jaxinfer.scheduling.block_pool import NULL_PAGE
from jaxinfer.scheduling.kv_manager import KVManager, name_pages
from jaxinfer.scheduling.request import Request


class SimKV(KVManager):
    """The KV manager, naming a request's own pages only if it is preempted.

    A page whose name no other request can have (past a simulated prompt's shared prefix: page_names) is
    looked up only by its own request, and only after a preemption; until then no one reads its name, and
    naming it evicts nothing (the request holds it). So a request with `public_pages` set names only those
    pages as they fill, and the rest at its first preemption (`name_owed`), before its pages go back: the pool
    is then as if each had been named as it filled. Its pages freed at its finish stay unnamed, which no
    lookup can tell."""

    def cache_computed_pages_of(self, requests: list[Request]) -> None:
        if not self.enable_prefix_caching:
            return
        named, size = self._num_named, self.page_size
        for request in requests:
            full, public = request.num_computed_tokens // size, request.public_pages
            if public is not None and full > public:
                full = public
            if full > named.get(request.request_id, 0):
                self._name(request, full)

    def _name(self, request: Request, num_full: int) -> None:
        """KVManager.cache_computed_pages up to page `num_full` (outside deterministic mode)."""
        first = self._num_named.get(request.request_id, 0)
        pages, names = self._tables[request.request_id], name_pages(request, num_full, self.page_size)
        for i in range(first, num_full):
            if pages[i] != NULL_PAGE:
                self.block_pool.cache_page(pages[i], names[i])
        self._num_named[request.request_id] = num_full

    def name_owed(self, request: Request) -> None:
        """Name the request's full pages not named yet (it is being preempted); from now on each as it fills."""
        if request.public_pages is not None:
            request.public_pages = None
            self.cache_computed_pages(request)


MAX_PREFIX_GROUPS = 1 << 20  # SimRequest.prefix_group < this (a shared page's name holds it above the page's place)


def group_token(group: int) -> int:
    """The token a simulated prompt of this prefix group repeats over its shared prefix: 1 for group 0, -group for the
    others (never a request's own token, index + 2, nor the 0s after it)."""
    return 1 if group == 0 else -group


def page_names(index: int, prompt_tokens: int, shared: int, output_tokens: int, page_size: int, max_context: int, group: int = 0) -> list:
    """Names for every page the simulated request `index` may fill (Request.page_names, which the KV manager
    extends by hashing, kv_manager.name_pages), equal exactly where two of its sequences are: page j covers
    tokens [0, (j + 1) * page_size) of `[g] * shared + [index + 2, 0, ...]` (its prompt; g = group_token(group)) then
    its output's 0s. A page inside the shared ones is the same in every request of its group (-1 - j - group * 2 ** 20);
    a page past the request's own token (index + 2) is its own ((index + 1) << 20 | j, as max_context // page_size
    < 2 ** 20); a prompt that is all shared (shared == prompt_tokens) continues with 0s, the same for every prompt of
    its group and length (("ones", group, prompt_tokens, j)). Names are ints and tuples, never a hash's bytes."""
    num_pages, num_shared = min(prompt_tokens + output_tokens, max_context) // page_size, shared // page_size
    own = (index + 1) << 20
    if not num_shared and shared < prompt_tokens:  # no shared page (most prompts)
        return list(range(own, own + num_pages))
    first = -1 - (group << 20)
    names = list(range(first, first - min(num_shared, num_pages), -1))
    if shared < prompt_tokens:
        return names + list(range(own + num_shared, own + num_pages))
    return names + [("ones", group, prompt_tokens, j) for j in range(num_shared, num_pages)]
