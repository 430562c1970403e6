"""Pages handed to owners, and the prefix cache that keeps full pages for reuse.

The one owner of page ids, reference counts and page keys (see `common/prefix.py` for the
keys themselves). Its invariants, each tested alone:

- A page is in exactly one of three places: the free list (holds nothing anyone wants),
  held by one or more owners (its reference count is how many), or cached and unreferenced
  (it holds a key's KV and sits in the LRU, oldest first, until a hit takes it back or an
  allocation evicts it).
- A cached page is never written: only full pages get a key, and an owner that takes a cached
  page (`share`) starts computing after it.
- A page held by anyone (a running sequence, a reservation, a prefill whose pages an agent is
  shipping) is never evicted or handed out again: only the unreferenced ones are in the LRU.
- `free(owner)` returns each of its pages exactly once; after any mix of finished, aborted and
  failed requests `num_free` (pages an allocation can take: free plus evictable) is back at
  `num_pages`.

Evictions and new keys are recorded as events (`take_events`) for whoever publishes them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


class OutOfPages(RuntimeError):
    """Raised when an allocation needs more free pages than the pool has."""


@dataclass
class CacheEvents:
    """Keys stored into and removed from the cache since the last `take_events`."""

    stored: list[tuple[int, int]] = field(default_factory=list)  # (key, parent key or 0)
    removed: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed)


class PageAllocator:
    """Hands out page ids to owners (a sequence id or a reservation ticket), and keeps full
    pages that finished owners leave behind, by key, for the next prompt that starts the same.

    With `caching=False` it is a plain allocator: no page is ever kept.
    """

    def __init__(self, num_pages: int, *, caching: bool = False):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        self.caching = caching
        self._free: deque[int] = deque(range(num_pages))
        self._owned: dict[Hashable, list[int]] = {}
        self._refs = [0] * num_pages
        self._key_of: dict[int, int] = {}             # page -> key
        self._page_of: dict[int, int] = {}            # key -> page
        self._tokens_of: dict[int, tuple[int, ...]] = {}  # page -> its token ids (collisions)
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages
        self._events = CacheEvents()
        self.recording = False  # keep events for `take_events` (someone publishes them)
        self.num_evictions = 0

    # ---- counts ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages an allocation can take now: free ones plus unreferenced cached ones."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Pages holding a key (referenced or not)."""
        return len(self._key_of)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    # ---- owners ---------------------------------------------------------------------------
    def allocate(self, owner: Hashable, n: int) -> list[int]:
        """Give `owner` n more pages (appended to what it holds); returns the new ids.
        Evicts unreferenced cached pages, least recently used first, when the free list is
        short."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.num_free:
            raise OutOfPages(f"need {n} pages, {self.num_free} of {self.num_pages} free")
        pages = [self._take() for _ in range(n)]
        for page in pages:
            self._refs[page] = 1
        self._owned.setdefault(owner, []).extend(pages)
        return pages

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        page, _ = self._lru.popitem(last=False)
        self._forget_key(page)
        self.num_evictions += 1
        return page

    def share(self, owner: Hashable, pages: Sequence[int]) -> None:
        """Let `owner` read cached pages (appended to what it holds, in order)."""
        for page in pages:
            if page not in self._key_of:
                raise ValueError(f"page {page} holds no cached key")
            self._lru.pop(page, None)
            self._refs[page] += 1
        self._owned.setdefault(owner, []).extend(pages)

    def pages_of(self, owner: Hashable) -> list[int]:
        return list(self._owned.get(owner, ()))

    def num_pages_of(self, owner: Hashable) -> int:
        return len(self._owned.get(owner, ()))

    def owners(self) -> list[Hashable]:
        return list(self._owned)

    def owns(self, owner: Hashable) -> bool:
        return owner in self._owned

    def transfer(self, owner: Hashable, new_owner: Hashable) -> None:
        """Hand every page of `owner` to `new_owner` (a reservation becoming a sequence)."""
        if new_owner in self._owned:
            raise ValueError(f"{new_owner!r} already owns pages")
        self._owned[new_owner] = self._owned.pop(owner)

    def free(self, owner: Hashable) -> int:
        """Drop `owner`'s hold on each of its pages; a second call frees nothing. A page no
        one holds any more goes back to the free list, or, when it holds a key, to the LRU:
        deepest page first, so a chain's tail is evicted before its head."""
        pages = self._owned.pop(owner, [])
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._lru[page] = None
                else:
                    self._free.append(page)
        return len(pages)

    # ---- the cache ------------------------------------------------------------------------
    def cache(self, page: int, key: int, parent: int, tokens: Sequence[int]) -> bool:
        """Name a full page (held by someone) by its key; False when caching is off, the
        page already has a key, or another page holds the same key (that page stays the
        cached one; this one is freed as usual when its owner finishes)."""
        if not self.caching or page in self._key_of or key in self._page_of:
            return False
        self._key_of[page] = key
        self._page_of[key] = page
        self._tokens_of[page] = tuple(tokens)
        if self.recording:
            self._events.stored.append((key, parent))
        return True

    def lookup(self, keys: Sequence[int], tokens: Sequence[int], block_size: int) -> list[int]:
        """The cached pages of the longest run of leading `keys` (page i's tokens are
        `tokens[i*block_size:(i+1)*block_size]`, compared, so a key collision is a miss)."""
        hits: list[int] = []
        if not self.caching:
            return hits
        for i, key in enumerate(keys):
            page = self._page_of.get(key)
            if page is None or self._tokens_of[page] != tuple(
                    tokens[i * block_size:(i + 1) * block_size]):
                break
            hits.append(page)
        return hits

    def can_take(self, hits: Sequence[int], n: int) -> bool:
        """Whether `share(hits)` then `allocate(n)` fits (hits sitting in the LRU stop
        counting as evictable once shared)."""
        return n <= self.num_free - sum(1 for p in hits if p in self._lru)

    def num_leading_cached(self, owner: Hashable) -> int:
        """How many of `owner`'s first pages hold a key (a reservation's pinned hits: its new
        pages get keys only once their KV has landed and a sequence owns them)."""
        n = 0
        for page in self._owned.get(owner, ()):
            if page not in self._key_of:
                break
            n += 1
        return n

    def clear(self) -> int:
        """Forget every unreferenced cached page; returns how many."""
        n = len(self._lru)
        while self._lru:
            page, _ = self._lru.popitem(last=False)
            self._forget_key(page)
            self._free.append(page)
        return n

    def keys(self) -> list[int]:
        """Every key held now (a snapshot for a new subscriber)."""
        return list(self._page_of)

    def take_events(self) -> CacheEvents:
        events, self._events = self._events, CacheEvents()
        return events

    def _forget_key(self, page: int) -> None:
        key = self._key_of.pop(page)
        del self._page_of[key]
        del self._tokens_of[page]
        if self.recording:
            self._events.removed.append(key)
