"""`pdserve bench kv`'s verdicts: a transport that beats a bound is reported loudly (the
bound is wrong), and each target is printed with its ratio; the raw TCP bound runs every
variant, each handoff acknowledged by the receiving process."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from pdserve.bench import netns
from pdserve.bench.kv_baselines import COPIES, VARIANTS, BoundSamples, RawTcp
from pdserve.bench.kv_report import MIB, Row, bound_checks, cross_host_targets, report, targets

pytestmark = pytest.mark.unit


def row(transport: str, gb_s: float, *, raw: float = 2.0, memcpy: float = 10.0,
        tokens: int = 1024, pages: int = 64, kv_bytes: int = 24 * MIB) -> Row:
    bound = "raw TCP" if transport.startswith("tcp") else "memcpy"
    return Row(transport, tokens, pages, kv_bytes, 1, kv_bytes / gb_s / 1e6, 1.0, gb_s, raw,
               "auto/all", memcpy, gb_s / raw, gb_s / memcpy, bound,
               gb_s / (raw if bound == "raw TCP" else memcpy), gb_s, raw, memcpy)


def test_a_transport_faster_than_its_bound_is_reported_loudly() -> None:
    lines = bound_checks([row("tcp", 3.0, raw=2.0), row("ucx", 4.0, raw=2.0)])
    assert len(lines) == 1  # ucx is held to memcpy only: faster than raw TCP is fine
    assert "BOUND VIOLATED" in lines[0] and "tcp" in lines[0] and "raw TCP" in lines[0]
    lines = bound_checks([row("shm", 12.0, memcpy=10.0)])
    assert "BOUND VIOLATED" in lines[0] and "memcpy" in lines[0]
    assert "bounds hold" in bound_checks([row("tcp", 2.05, raw=2.0)])[0]  # within the noise


def test_targets_name_the_ratio_and_the_verdict() -> None:
    lines = targets([row("ucx", 3.0), row("shm", 9.0), row("shm", 5.0, kv_bytes=MIB,
                                                                    pages=1)])
    assert lines[0] == "target one host >= 16 MiB: shm >= 0.80x memcpy at 1024 tokens: 0.90x ok"
    assert any("one-page handoff" in line for line in lines)
    assert "BELOW" in targets([row("shm", 7.0)])[0]
    table = report([row("tcp", 1.0)])
    assert "vs memcpy" in table and "bounds hold" in table


def test_first_handoffs_are_shown_beside_raw_tcps_first_and_not_held_to_the_bound() -> None:
    back_to_back = row("tcp", 4.0, raw=4.2)
    first = dataclasses.replace(back_to_back, first_ms=9.5, raw_first_ms=8.25)
    table = report([first, dataclasses.replace(row("ucx", 2.0, raw=4.2), first_ms=20.0,
                                               raw_first_ms=8.25)], cross_host=True)
    assert "first handoff of a round at 1024 tokens (ms): raw TCP 8.250, tcp 9.500, ucx 20.000" \
        in table
    # the ratio held to the bound is the back-to-back one, as the bound's variants run
    assert "tcp >= 0.90x raw TCP on the link at 1024 tokens: 0.95x ok" in table


def test_each_host_of_the_netns_rig_gets_its_own_half_of_the_cpus() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    a, b = netns.split_cpus()
    if len(cpus) < 2:
        assert (a, b) == ("", "")
        return
    half_a, half_b = ({int(c) for c in half.split("+")} for half in (a, b))
    assert half_a and half_b and not half_a & half_b and half_a | half_b == set(cpus)
    link = netns.Link("nsa", "nsb", "da", "db", "10.0.0.1", "10.0.0.2", a, b)
    assert link.on_b("python", "-V") == ["ip", "netns", "exec", "nsb", "taskset", "-c",
                                         b.replace("+", ","), "python", "-V"]
    assert netns.from_spec(f"{link.spec()},/tmp/x") == (link, "/tmp/x")
    assert netns.in_ns("nsa", "true") == ["ip", "netns", "exec", "nsa", "true"]


def test_tls_is_stated_against_plain_tcp_and_not_held_to_the_link_target() -> None:
    lines = cross_host_targets([row("tcp", 1.9, raw=2.0), row("tcp-tls", 0.95, raw=2.0)])
    assert lines == [
        "target cross-host >= 16 MiB: tcp >= 0.90x raw TCP on the link at 1024 tokens: 0.95x ok",
        "TLS on the TCP path at 1024 tokens: 0.95 GB/s = 0.50x plain tcp (1.90 GB/s)"]


def test_raw_tcp_baseline_moves_the_bytes() -> None:
    nbytes = 3 * MIB + 5
    src = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    raw = RawTcp(nbytes)
    try:
        samples = BoundSamples.empty()
        for _ in range(3):
            samples.measure(raw, src, np.zeros(nbytes, dtype=np.uint8))
        median, variant, fastest = samples.raw_tcp(nbytes)
        assert variant in {v.name for v in VARIANTS}
        # into anonymous memory and into a shared segment like a pool's (faster on some hosts)
        assert {v.shared_dst for v in VARIANTS} == {False, True}
        assert 0 < median <= fastest
        assert all(len(times) == 3 for times in samples.raw_ms.values())
    finally:
        raw.close()


def test_every_memcpy_variant_copies_the_bytes() -> None:
    nbytes = 17 * MIB + 3  # more than two 8 MiB slices, and a ragged end
    src = np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8)
    for name, copy in COPIES.items():
        dst = np.zeros(nbytes, dtype=np.uint8)
        copy(dst, src)
        assert np.array_equal(dst, src), name
    samples = BoundSamples.empty()
    for _ in range(2):
        samples.measure(None, src, np.zeros(nbytes, dtype=np.uint8))
    median, fastest = samples.memcpy(nbytes)
    assert 0 < median <= fastest
    assert samples.raw_tcp(nbytes) == (0.0, "", 0.0)  # not measured: no raw TCP


def test_the_held_out_bound_does_not_pick_a_variants_luck() -> None:
    """Two alike variants, each lucky on a different half of the reps: the best of their
    medians keeps both lucky halves' minimum, the held-out bound times each choice on the
    half it was not chosen on."""
    samples = BoundSamples.empty(warmup=0)
    samples.raw_ms = {name: [] for name in samples.raw_ms}
    lucky_even, lucky_odd = VARIANTS[0].name, VARIANTS[1].name
    samples.raw_ms[lucky_even] = [4.0, 6.0] * 5  # ms: fast on even reps, slow on odd ones
    samples.raw_ms[lucky_odd] = [6.0, 4.0] * 5
    nbytes = 24 * MIB
    best, _, _ = samples.raw_tcp(nbytes)
    held_out, own = samples.raw_tcp_held_out(nbytes)
    assert best == pytest.approx(nbytes / 5.0 / 1e6)  # the median of 4s and 6s
    assert held_out == pytest.approx(nbytes / 6.0 / 1e6)  # each choice timed where it is slow
    assert own == 0.0  # the transport's own variant did not run
    r = dataclasses.replace(row("tcp", nbytes / 6.0 / 1e6), raw_tcp_held_out_gb_s=held_out,
                            raw_tcp_own_gb_s=held_out)
    (line,) = [x for x in cross_host_targets([r]) if "held out" in x]
    assert "1.00x" in line and "tcp at 1024 tokens" in line
