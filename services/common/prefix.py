"""Page keys for the prefix cache: a chained hash over full pages of token ids (standard
library only: the engine names its pages with it, the router the pages a prompt would need).

Page i's key = H(key of page i-1, token ids of page i), and the chain's root is H(the layout
fingerprint), so pools of a different model, revision, dtype or block size never share a key.
The tensor-parallel split is left out: ranks of any TP size hold the same tokens' KV, only cut
by heads, and a handoff between different TP sizes checks its prefix boundary by these keys.
Keys are 64-bit (they travel in cache events and protobuf as `fixed64`); a collision cannot
give wrong output because a hit also compares the page's token ids (`PageAllocator.lookup`).
Only full pages have keys: the last, partly filled page of a prompt is always computed.
"""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
from collections.abc import Sequence

from pdserve.common.layout import LayoutFingerprint


def root_key(fingerprint: LayoutFingerprint) -> int:
    """The chain's seed: every field of the layout fingerprint but the tensor-parallel split
    (whose heads a pool holds of the tokens' KV, not which KV)."""
    text = "|".join(f"{f.name}={getattr(fingerprint, f.name)!r}"
                    for f in dataclasses.fields(fingerprint)
                    if f.name not in ("tp_rank", "tp_size", "num_kv_heads"))
    return _digest(b"pdserve-prefix-v1|" + text.encode())


def page_key(parent: int, tokens: Sequence[int]) -> int:
    return _digest(parent.to_bytes(8, "little") + array("q", tokens).tobytes())


def page_keys(root: int, token_ids: Sequence[int], block_size: int, num_pages: int,
              known: list[int] | None = None) -> list[int]:
    """Keys of the first `num_pages` full pages of `token_ids` (extending `known`, the keys of
    the leading pages already computed, in place when given)."""
    keys = known if known is not None else []
    parent = keys[-1] if keys else root
    for i in range(len(keys), num_pages):
        parent = page_key(parent, token_ids[i * block_size:(i + 1) * block_size])
        keys.append(parent)
    return keys


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
