"""Where the router's workers are: `host:port` addresses and gRPC-style DNS targets.

`--prefill` and `--decode` take a comma list mixing both forms:

    10.0.0.5:50061                   one worker (gRPC resolves a host name itself)
    dns:///prefill-headless:50061    every A/AAAA record of the name is a worker, looked up
                                     again every --discovery-interval-s (a Kubernetes headless
                                     Service: one record per ready pod)

A DNS target is resolved with the system resolver (`getaddrinfo`: /etc/hosts, then DNS, as
nsswitch says), so a name in a hosts file works too. A name with both an A and an AAAA record
for one server (`localhost`) counts as two workers, as gRPC's own round robin would.
`dns://AUTHORITY/...` (a DNS server of its own) is refused: point the system resolver at it.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("pdserve.router.discovery")

DNS_SCHEME = "dns:"
FORMS = "host:port or dns:///NAME:PORT"

# (name, port) -> the worker addresses it stands for, "ip:port" ("[ip6]:port"); raises OSError
Resolver = Callable[[str, int], list[str]]


@dataclass(frozen=True)
class Target:
    """One entry of --prefill / --decode."""

    text: str  # as given
    host: str  # without brackets for an IPv6 literal
    port: int
    dns: bool  # every address record of `host` is a worker

    @property
    def address(self) -> str:
        """A static target's worker address (as given)."""
        return self.text


def split_host_port(text: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); ValueError naming what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError("no port: expected " + FORMS)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError("an IPv6 address needs brackets: [ADDRESS]:PORT")
    if not host or any(c.isspace() or c in "/[]" for c in host):
        raise ValueError(f"bad host {host!r}: expected " + FORMS)
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad port {port!r}: expected 1..65535")
    return host, int(port)


def parse_target(text: str) -> Target:
    """Parse one --prefill / --decode entry; ValueError says what is wrong with it."""
    if not text.startswith(DNS_SCHEME):
        if "://" in text or text.split(":", 1)[0] in ("ipv4", "ipv6", "unix", "unix-abstract"):
            raise ValueError(f"unsupported scheme: expected {FORMS}")
        host, port = split_host_port(text)
        return Target(text, host, port, dns=False)
    rest = text[len(DNS_SCHEME):]
    if not rest.startswith("//"):
        raise ValueError("a DNS target is dns:///NAME:PORT (three slashes)")
    authority, slash, endpoint = rest[2:].partition("/")
    if not slash:
        raise ValueError("a DNS target is dns:///NAME:PORT (three slashes)")
    if authority:
        raise ValueError(f"a DNS server of its own (dns://{authority}/...) is not supported: "
                         "use dns:///NAME:PORT, resolved by the system resolver")
    host, port = split_host_port(endpoint)
    return Target(text, host, port, dns=True)


def format_address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def system_resolver(name: str, port: int) -> list[str]:
    """Every address record of `name` (getaddrinfo, TCP), in the resolver's order, once each.
    Raises OSError (socket.gaierror) when the name does not resolve."""
    infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    addresses = (format_address(str(info[4][0]), port) for info in infos
                 if info[0] in (socket.AF_INET, socket.AF_INET6))
    return list(dict.fromkeys(addresses))


class Lookups:
    """DNS targets looked up round after round. A lookup that fails (or finds no address)
    keeps the target's last good answer: logged once per new reason, counted in `failures`,
    never fatal (a DNS outage must not empty a pool that is serving)."""

    def __init__(self, resolve: Resolver = system_resolver):
        self._resolve = resolve
        self._known: dict[Target, list[str]] = {}  # last good answer per target
        self._failing: dict[Target, str] = {}  # targets whose last lookup failed: why
        self.failures = 0  # lookups that failed, since start

    def lookup(self, target: Target, kind: str, noun: str = "workers") -> list[str]:
        """The addresses of DNS `target` now (or as last known); `kind` and `noun` name
        them in the log ("prefill" target ... 3 "workers")."""
        try:
            addresses = self._resolve(target.host, target.port)
            if not addresses:
                raise OSError("no address records")
        except OSError as exc:
            self.failures += 1
            known = self._known.get(target, [])
            why = f"{type(exc).__name__}: {exc}"
            if self._failing.get(target) != why:  # once per new reason, not every round
                log.warning("%s target %s does not resolve (%s); keeping its last %d %s",
                            kind, target.text, why, len(known), noun)
            self._failing[target] = why
            return known
        if self._failing.pop(target, None) is not None:
            log.info("%s target %s resolves again: %d %s", kind, target.text, len(addresses),
                     noun)
        self._known[target] = addresses
        return addresses
