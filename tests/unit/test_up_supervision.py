"""`pdserve up` refuses ports it cannot have before it starts anything (a second `pdserve up`
used to report itself up on the first one's answers while all its own processes died), and
stops once its router exits instead of supervising nothing."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pdserve.processes import Proc, Stack, port_conflicts
from pdserve.up import UpConfig, plan

from tests.support import free_port, pdserve_argv

pytestmark = pytest.mark.unit


@pytest.fixture
def taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_port_something_listens_on_or_planned_twice_is_named(taken_port):
    free = free_port()
    procs = [Proc("router", f"127.0.0.1:{taken_port}", [], ports=[taken_port, free]),
             Proc("decode-0", "127.0.0.1:1", [], ports=[free])]
    assert port_conflicts(procs) == [
        f"port {taken_port} (router) is already in use",
        f"port {free} is planned for both router and decode-0"]
    assert port_conflicts([Proc("router", "127.0.0.1:1", [], ports=[free])]) == []


def test_up_plans_every_fixed_port_and_catches_pools_that_overlap():
    procs = plan(UpConfig(prefill=12), Path("model"), "m")
    ports = {p.name: p.ports for p in procs}
    assert ports["router"] == [50051, 9051, 8000]  # gRPC, metrics, HTTP
    assert ports["prefill-10"] == [50071, 9071]
    assert "port 50071 is planned for both decode-0 and prefill-10" in port_conflicts(procs)
    assert port_conflicts(plan(UpConfig(http_port=0, metrics_port=-1), Path("m"), "m")) == []


def test_any_free_metrics_port_is_picked_by_up_so_its_banner_names_it():
    from pdserve.up import _banner

    procs = plan(UpConfig(metrics_port=0, http_port=free_port()), Path("m"), "m")
    assert all(p.metrics_port > 0 and p.metrics_port in p.ports for p in procs)
    banner = _banner("127.0.0.1:50051", procs, UpConfig(metrics_port=0))
    for p in procs:
        assert f"{p.name:<12} http://127.0.0.1:{p.metrics_port}/metrics" in banner


def test_ports_out_of_range_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"port=70000: expected 1\.\.65535"):
        UpConfig(port=70000)
    with pytest.raises(ValueError, match=r"decode_port=65535: expected 1\.\.65534 \(2 ports"):
        UpConfig(decode=2, decode_port=65535)


def test_a_second_up_on_taken_ports_exits_at_once_naming_them(taken_port):
    done = subprocess.run(pdserve_argv("up", "--model", "tiny", "--port", str(taken_port)),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"port {taken_port} (router) is already in use" in done.stderr
    assert "waiting for" not in done.stdout  # nothing was started


def _sleeper(name: str) -> Proc:
    proc = Proc(name, "127.0.0.1:1", [])
    proc.popen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                  start_new_session=True)
    return proc


def test_up_keeps_serving_without_a_worker_and_stops_without_its_router(tmp_path, capsys):
    procs = [_sleeper("kvtransfer-a"), _sleeper("prefill-0"), _sleeper("router")]
    stack = Stack(procs, tmp_path)
    result: list[int] = []
    watcher = threading.Thread(target=lambda: result.append(stack.watch(poll_s=0.05)))
    watcher.start()
    try:
        procs[1].popen.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        said, deadline = "", time.monotonic() + 30
        while "prefill-0 exited" not in said and time.monotonic() < deadline:
            said += capsys.readouterr().err
            watcher.join(0.05)
        assert "prefill-0 exited with status -9; the other processes keep serving" in said
        assert watcher.is_alive() and not result
        procs[2].popen.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        watcher.join(30)
        assert result == [1]
        assert "router exited with status -9; stopping the stack" in capsys.readouterr().err
    finally:
        stack.stop(timeout_s=5)
        watcher.join(5)
    assert all(p.popen is not None and p.popen.poll() is not None for p in procs)
