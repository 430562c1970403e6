"""Ports pdserve picks for the stacks it starts come from below the ephemeral range (where an
outgoing connection could take one between the pick and the bind), bind, and never repeat."""

from __future__ import annotations

import socket
from pathlib import Path

from pdserve.common.ports import free_port, free_port_block


def _ephemeral() -> range:
    lo, hi = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return range(lo, hi + 1)


def test_ports_are_outside_the_ephemeral_range_distinct_and_bindable():
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert not set(ports) & set(_ephemeral())
    for port in ports[:20]:
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))


def test_a_block_is_consecutive_free_and_not_handed_out_again():
    base = free_port_block(40)
    block = set(range(base, base + 40))
    assert not block & set(_ephemeral())
    assert not block & {free_port() for _ in range(500)}


def test_the_test_stacks_ports_are_outside_the_ephemeral_range_too():
    # CI failed once when a stack's prefill port, picked in the ephemeral range, was taken by
    # an outgoing connection before the worker bound it.
    from tests.service.stack import _give_back, _port_block

    bases = [_port_block(85) for _ in range(20)]
    try:
        blocks = [set(range(b, b + 85)) for b in bases]
        assert not set().union(*blocks) & set(_ephemeral())
        assert sum(map(len, blocks)) == len(set().union(*blocks))  # none handed out twice
    finally:
        for b in bases:
            _give_back(b, 85)
