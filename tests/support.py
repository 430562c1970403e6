"""Helpers for tests that run real pdserve processes on loopback.

Every process is started in its own session and killed (the whole group) when the context
exits, also on failure; readiness is the gRPC health check reporting SERVING, polled with a
bounded deadline, never a sleep.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from pdserve.common.health import wait_serving
from pdserve.common.ports import free_port
from pdserve.common.security import ChannelSecurity
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["free_port", "wait_serving", "wait_for", "ServiceProcess", "running", "pdserve_argv"]


class ServiceProcess:
    """One `pdserve ...` (or any python -m) process, logs captured to a temp file that `stop`
    reads into memory and removes (its output stays readable after)."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None):
        self.log = tempfile.NamedTemporaryFile(prefix="pdserve-test-", suffix=".log", delete=False)
        self._final_output: str | None = None
        full_env = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen(list(argv), stdout=self.log, stderr=subprocess.STDOUT,
                                     env=full_env, start_new_session=True)

    def output(self) -> str:
        if self._final_output is not None:
            return self._final_output
        return Path(self.log.name).read_text(errors="replace")

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(timeout=timeout_s)
        # Reap anything else left in the group.
        self.signal(signal.SIGKILL)
        if self._final_output is None:
            self._final_output = self.output()
            self.log.close()
            Path(self.log.name).unlink(missing_ok=True)
        return self.proc.returncode


@contextlib.contextmanager
def running(argv: Sequence[str], address: str | None = None, env: dict[str, str] | None = None,
            timeout_s: float = 90.0, security: ChannelSecurity | None = None
            ) -> Iterator[ServiceProcess]:
    """Start a process, wait for it to be SERVING at `address` (over TLS with `security`), stop
    it (and its group) after."""
    sp = ServiceProcess(argv, env)
    try:
        if address is not None:
            try:
                wait_serving(address, timeout_s, sp.proc, security=security)
            except Exception as exc:
                raise RuntimeError(f"{' '.join(argv)} did not come up: {exc}\n--- log ---\n"
                                   f"{sp.output()[-4000:]}") from exc
        yield sp
    finally:
        sp.stop()


def cannot_run(why: str) -> None:
    """Skip with the reason where the machine lacks something (a system package, root for
    network namespaces, podman); in CI (CI=true) fail instead: .ci/run installs what the
    tests need, so there they always run."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{why}, and CI must run this test")
    pytest.skip(why)


def pdserve_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", *args]


def wait_for(predicate, timeout_s: float = 30.0, interval_s: float = 0.05) -> bool:
    """Poll `predicate` until true (True) or the deadline passes (False): a bounded poll."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False


# ---- Prometheus text --------------------------------------------------------------------

def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} of a Prometheus text exposition."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def exposition(registry: CollectorRegistry) -> dict[tuple[str, frozenset], float]:
    from prometheus_client import generate_latest
    return samples(generate_latest(registry).decode())


def value(found: dict, name: str, **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)
