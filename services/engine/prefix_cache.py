"""The engine's side of the prefix cache: which leading pages of a prompt are cached, and
offering a sequence's newly completed pages. The allocator owns the pages, their reference
counts and keys (`engine/allocator.py`); the keys themselves are `common/prefix.py`'s."""

from __future__ import annotations

from pdserve.common.layout import LayoutFingerprint
from pdserve.common.prefix import page_keys, root_key
from pdserve.engine.allocator import PageAllocator
from pdserve.engine.sequence import Sequence


class PrefixCache:
    def __init__(self, allocator: PageAllocator, fingerprint: LayoutFingerprint, *,
                 enabled: bool):
        self.allocator = allocator
        self.enabled = enabled
        self.block_size = fingerprint.block_size
        self.root = root_key(fingerprint)

    def lookup(self, token_ids: list[int], keys: list[int]) -> list[int]:
        """Cached pages of the longest run of leading full pages of `token_ids`, leaving at
        least the last token to compute; `keys` (the sequence's known keys) is extended."""
        if not self.enabled:
            return []
        bs = self.block_size
        max_pages = (len(token_ids) - 1) // bs
        page_keys(self.root, token_ids, bs, max_pages, keys)
        return self.allocator.lookup(keys[:max_pages], token_ids, bs)

    @staticmethod
    def last_key(keys: list[int], num_pages: int) -> int:
        """The key of page `num_pages - 1` among a prompt's known keys (0 for none)."""
        return keys[num_pages - 1] if num_pages > 0 else 0

    def boundary_key(self, prompt_ids: list[int], num_pages: int) -> int:
        """The key of the prompt's page `num_pages - 1` (0 for none)."""
        if num_pages <= 0:
            return 0
        return page_keys(self.root, prompt_ids, self.block_size, num_pages)[-1]

    def offer(self, seq: Sequence) -> None:
        """Name the sequence's newly completed full pages in the cache."""
        bs = self.block_size
        full = seq.num_cached // bs
        if full <= seq.num_keyed or not self.enabled:
            return
        keys = page_keys(self.root, seq.token_ids, bs, full, seq.page_keys)
        pages = self.allocator.pages_of(seq.seq_id)
        for i in range(seq.num_keyed, min(full, len(pages))):
            self.allocator.cache(pages[i], keys[i], keys[i - 1] if i else 0,
                                 seq.token_ids[i * bs:(i + 1) * bs])
        seq.num_keyed = full
