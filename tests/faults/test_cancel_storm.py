"""A cancel storm: hundreds of requests cancelled at random points of their path (before the
router has them, while queued, during prefill, the handoff or decoding), sixteen at a time,
on the shared stack with a canary streaming alongside.

Every stream ends OK (exact) or CANCELLED with a prefix of the reference tokens, never a
repeated or reordered one; afterwards (the `guarded` fixture) every page and reservation is
back, every process SERVING, and the canary's every output was exact.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import MAX_TOKENS, PROMPTS
from tests.faults.matrix import ROWS

pytestmark = pytest.mark.faults

REQUESTS = 300
CONCURRENCY = 16
SEED = 12


def test_cancel_storm(guarded, reference):
    fs = guarded
    rng = random.Random(SEED)
    # Cancel points from at once to well after the end (about 1 in 6 finishes first).
    plan = [(PROMPTS[i % len(PROMPTS)], rng.uniform(0.0, 1.2)) for i in range(REQUESTS)]

    def one(job: tuple[str, float]) -> tuple[str, int, bool]:
        prompt, delay_s = job
        expected = reference[1][prompt][1]
        stream = fs.stream(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0)
        time.sleep(delay_s)  # the random point of the request's path where it is cancelled
        stream.cancel()
        stream.join()
        assert stream.tokens == expected[:len(stream.tokens)], (prompt, stream.tokens)
        if stream.code == "OK":
            assert stream.tokens == expected
        else:
            assert stream.code == "CANCELLED", (stream.code, stream.details)
        return stream.code, len(stream.tokens), 0 < len(stream.tokens) < len(expected)

    started = time.monotonic()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(one, plan))
    took_s = time.monotonic() - started
    cancelled = [r for r in results if r[0] == "CANCELLED"]
    mid_stream = sum(r[2] for r in cancelled)
    before_first = sum(r[1] == 0 for r in cancelled)
    assert mid_stream and before_first, "the storm hit only one side of the first token"
    assert len(cancelled) < REQUESTS, "no request finished: the storm tested no completion"
    ROWS.append(("cancel storm", f"{REQUESTS} requests, {CONCURRENCY} at a time",
                 f"{len(cancelled)} cancelled ({before_first} before the first token, "
                 f"{mid_stream} mid-stream), {REQUESTS - len(cancelled)} OK exact, in "
                 f"{took_s:.1f} s; pages back, all SERVING"))
