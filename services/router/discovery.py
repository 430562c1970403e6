"""Keeps the pool's members in step with the router's targets (see pdserve.router.targets).

Each round expands every target (a `host:port` is itself, a `dns:///NAME:PORT` is every
address record of NAME) and hands the union per role to `WorkerPool.set_members`, which adds
the new workers and retires the gone ones. Rounds run every `interval_s` on a background
thread, the first at once; while the pool is not ready, every `RESOLVE_UNREADY_S` (a
Kubernetes headless Service publishes a pod's record only once the pod is ready: a router
waiting for workers should not wait a whole interval to see one). A name that fails to
resolve keeps the addresses it had last (logged, counted in `failures`; never fatal): a DNS
outage must not empty a pool that is serving. A name that resolves to no address at all is
the same as one that fails.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from pdserve.router.pool import RECHECK_DOWN_S, ROLES, WorkerPool
from pdserve.router.targets import Lookups, Resolver, Target, system_resolver

log = logging.getLogger("pdserve.router.discovery")

RESOLVE_UNREADY_S = RECHECK_DOWN_S


class Discovery:
    """Re-resolves the DNS targets of both roles and updates the pool (thread-safe)."""

    def __init__(self, pool: WorkerPool, prefill: Sequence[Target], decode: Sequence[Target],
                 *, interval_s: float = 5.0, resolve: Resolver = system_resolver):
        self._pool = pool
        self._targets = dict(zip(ROLES, (tuple(prefill), tuple(decode))))
        self.interval_s = interval_s
        self._lookups = Lookups(resolve)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def failures(self) -> int:
        """DNS lookups that failed, since start."""
        return self._lookups.failures

    @property
    def dynamic(self) -> bool:
        """Some target is a DNS name (so rounds after the first can change anything)."""
        return any(t.dns for targets in self._targets.values() for t in targets)

    def refresh(self) -> None:
        """One round: resolve every DNS target and set both roles' members."""
        with self._lock:  # one round at a time
            for role, targets in self._targets.items():
                members: dict[str, str] = {}  # address -> the name its certificate carries
                for target in targets:
                    if not target.dns:
                        members.setdefault(target.address, "")
                        continue
                    for address in self._lookups.lookup(target, role):
                        members.setdefault(address, target.host)
                self._pool.set_members(role, members)

    def start(self) -> None:
        """Static targets become members now; DNS targets on a background thread, the first
        round at once and then every interval."""
        if not self.dynamic:
            self.refresh()
            return
        self._thread = threading.Thread(target=self._run, name="router-discovery", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception:  # never let a bug end discovery silently
                log.exception("discovery round failed")
            ready = self._pool.ready()
            self._stop.wait(self.interval_s if ready else min(self.interval_s, RESOLVE_UNREADY_S))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5.0)
