"""Leases that follow the work, against real processes: the router renews the decode
reservations it holds, so a prefill far longer than the lease keeps its pages, and a router
killed with -9 in the middle of a prefill gives its pages back within about one lease (not
after the longest prefill it would have waited for, 130 s here).

A fail point (pdserve.common.failpoints) holds the victim request on the prefill worker: after
its first token is sampled and before its KV is shipped (`prefill.handoff`), while the decode
worker holds its reservation."""

from __future__ import annotations

import time

import pytest

from tests.conftest import MAX_TOKENS, PROMPTS
from tests.faults.stack import FaultStack
from tests.support import wait_for

pytestmark = pytest.mark.service

LEASE_S = 1.0


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    pause = tmp_path_factory.mktemp("failpoints") / "handoff"
    fs = FaultStack(tiny_model_dir, router_args=("--lease-ms", str(LEASE_S * 1e3)))
    try:
        fs.start({"prefill-0": f"prefill.handoff@victim=pause:{pause}"})
        fs.pause = pause  # type: ignore[attr-defined]
        yield fs
    finally:
        fs.close()


def _held(fs: FaultStack) -> int:
    return fs.stats("decode-0").reserved_tickets


def test_a_prefill_longer_than_the_lease_keeps_its_pages(stack, reference):
    start = stack.free_pages()
    prompt = PROMPTS[2]
    victim = stack.stream(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                          request_id="victim-long")
    hit = stack.pause.with_name("handoff.hit")
    assert wait_for(lambda: hit.exists() or victim.done(), 60) and hit.exists(), stack.logs()
    assert _held(stack) == 1
    # Four leases pass while the prefill is held: the router's renewals keep the pages.
    assert not wait_for(lambda: _held(stack) == 0, 4 * LEASE_S), "the reservation lapsed"
    assert stack.stats("decode-0").free_pages < start["decode-0"]
    stack.pause.with_name("handoff.go").touch()
    victim.join()
    assert victim.code == "OK", victim.details
    assert victim.tokens == reference[1][prompt][1]
    assert stack.pages_back(start, 10)
    hit.unlink()
    stack.pause.with_name("handoff.go").unlink()


def test_a_killed_routers_reservation_comes_back_within_the_lease(stack, reference):
    start = stack.free_pages()
    victim = stack.stream(prompt=PROMPTS[3], max_tokens=MAX_TOKENS, temperature=0.0,
                          request_id="victim-kill")
    hit = stack.pause.with_name("handoff.hit")
    assert wait_for(lambda: hit.exists() or victim.done(), 60) and hit.exists(), stack.logs()
    assert _held(stack) == 1
    stack.kill("router")
    killed = time.monotonic()
    # Without renewal the lease would be the router's prefill deadline + 10 s (130 s).
    assert wait_for(lambda: _held(stack) == 0, 10), "the dead router's reservation is held"
    back_s = time.monotonic() - killed
    assert stack.stats("decode-0").free_pages == start["decode-0"]
    victim.join()
    assert victim.code == "UNAVAILABLE"
    assert "lease expired for victim-kill" in stack.log("decode-0")
    stack.pause.with_name("handoff.go").touch()  # the prefill worker's send now fails cleanly
    assert stack.pages_back(start, 10), stack.logs()
    print(f"\nreservation of a killed router back after {back_s:.2f} s (lease {LEASE_S} s)")
    # A new router: the stack serves exact output again.
    stack.restart("router")
    ok = stack.stream(prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.0).join()
    assert ok.code == "OK" and ok.tokens == reference[1][PROMPTS[1]][1]
