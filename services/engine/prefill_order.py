"""The order in which a prefill worker's steps take the prompts waiting for them.

A prefill worker has no decodes to protect: each step gives waiting prompts chunks up to its
token budget. Taken in arrival order, with every prompt a chunk, two long prompts advanced
together and each finished as late as both would one after the other; a short prompt behind
them waited for their chunks at every step. Under a mixed load (every tenth prompt 2,048
tokens, the disaggregated stack on this 2-core machine) the long prompts' TTFT doubled
whenever two overlapped, and that set the TTFT p99.

So the prefill role takes prompts shortest remaining first (the least left to compute: a short
prompt passes a long one, a long prompt half done passes one not begun), and a step plans at
most one prompt it cannot finish: the others it takes are those that finish within it. A
prompt waiting longer than the ageing bound goes before all that have waited less, oldest
first, so a long prompt is not passed over for ever while short ones keep coming.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from pdserve.engine.sequence import Sequence


def prefill_order(waiting: Iterable[Sequence], age_s: float,
                  now: float | None = None) -> list[Sequence]:
    """`waiting` (in arrival order) as a prefill step should consider them."""
    now = time.perf_counter() if now is None else now
    aged: list[Sequence] = []
    fresh: list[Sequence] = []
    for seq in waiting:
        (aged if now - seq.queued_at >= age_s else fresh).append(seq)
    return aged + sorted(fresh, key=lambda s: s.num_uncomputed)  # stable: ties by arrival
