"""Two-host stacks for `pdserve bench handoff --netns`: the prefill side (router, prefill worker,
its agent) in namespace a, the decode side (decode worker, its agent) in namespace b, joined by
the veth of `pdserve.bench.netns`. Every KV byte crosses that link over the stack's transport
(UCX over TCP on it, or the TCP transport); gRPC between the hosts crosses it too.

Runs inside namespace a (the benchmark re-runs itself there, as `pdserve bench kv --netns`
does); the decode side is started through `ip netns exec`. Each path gets its own ports, so
every stack can stay up while the requests go to them in turn.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from pdserve.bench.loadgen.procs import stop_group
from pdserve.bench.netns import Link
from pdserve.common.health import wait_serving

# The paths that cross hosts (the same-host ones do not apply) -> the agents' transport and the
# prefill worker's flags: "tcp-agent" is tcp with the worker sending through its own agent.
NETNS_PATHS = {"ucx": ("ucx", ()), "tcp": ("tcp", ()),
               "tcp-agent": ("tcp", ("--no-network-lane",))}
TRANSPORTS = tuple(NETNS_PATHS)
BASE_PORT = 50100  # the namespaces are new: nothing else listens in them


@contextmanager
def netns_stack(path: str, index: int, model: str, chunk_size: int, log_dir: str,
                link: Link) -> Iterator[str]:
    """The two-host stack for `path` (NETNS_PATHS); yields the router's address (in namespace a,
    where this process runs). Every process is stopped on exit, whatever happened."""
    from pdserve.common.models import resolve_model_name
    from pdserve.engine.builtin import model_dir

    base = BASE_PORT + 100 * index
    agent_port, prefill_port, decode_port, router_port = base, base + 10, base + 20, base + 30
    transport, prefill_flags = NETNS_PATHS[path]
    py = [sys.executable, "-m"]
    common = ["--model", model, "--metrics-port", "-1"]
    env = {**os.environ, "PDSERVE_PREFILL_CHUNK_SIZE": str(chunk_size), "UCX_TLS": "tcp"}
    side = {"a": (link.ip_a, link.dev_a), "b": (link.ip_b, link.dev_b)}
    procs: list[tuple[str, list[str], str]] = []
    for host, (ip, _) in side.items():
        procs.append((host, [*py, "pdserve.kvtransfer.main", "--port", str(agent_port),
                             "--metrics-port", "-1", "--transport", transport,
                             "--no-same-host-copy", "--advertise-host", ip,
                             "--agent-id", f"host-{host}"], f"kvtransfer-{host}"))
    procs.append(("a", [*py, "pdserve.prefill.main", "--port", str(prefill_port), "--kv-agent",
                        f"{link.ip_a}:{agent_port}", "--advertise-host", link.ip_a, *common,
                        *prefill_flags],
                  "prefill"))
    procs.append(("b", [*py, "pdserve.decode.main", "--port", str(decode_port), "--kv-agent",
                        f"{link.ip_b}:{agent_port}", "--advertise-host", link.ip_b, *common],
                  "decode"))
    router = f"{link.ip_a}:{router_port}"
    procs.append(("a", [*py, "pdserve.router.main", "--port", str(router_port),
                        "--http-port", "-1", "--metrics-port", "-1",
                        "--model", str(model_dir(resolve_model_name(model))),
                        "--prefill", f"{link.ip_a}:{prefill_port}",
                        "--decode", f"{link.ip_b}:{decode_port}",
                        # every prompt, however short, is prefilled on host a and handed off
                        "--remote-prefill-min-tokens", "0"], "router"))
    with ExitStack() as stack:
        started = []
        for host, argv, name in procs:
            dev = side[host][1]
            out = stack.enter_context(open(os.path.join(log_dir, f"{path}-{name}.out"), "wb"))
            proc = subprocess.Popen(argv if host == "a" else link.on_b(*argv),
                                    stdout=out, stderr=subprocess.STDOUT,
                                    env={**env, "UCX_NET_DEVICES": dev}, start_new_session=True)
            stack.callback(stop_group, proc)
            started.append((name, proc))
        try:
            wait_serving(router, 600, started[-1][1])
        except (RuntimeError, TimeoutError) as exc:
            logs = "".join(_tail(os.path.join(log_dir, f"{path}-{n}.out")) for n, _ in started)
            raise RuntimeError(f"the {path} stack across two hosts did not come up ({exc}):"
                               f"\n{logs}") from None
        yield router


def _tail(path: str, nbytes: int = 1500) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - nbytes))
        return f"--- {os.path.basename(path)}\n{f.read().decode(errors='replace')}\n"
