"""`pdserve up`: the whole stack on this machine, every service its own process.

Default layout: two simulated hosts, each with its own kvtransfer agent: host A runs the
prefill workers, host B the decode workers, so every handoff goes between two agents. As they
really share this machine, the agents find so at their handshake and the receiving one copies
the pages straight out of the sender's pool (kv_transport `shm`); `--no-same-host-copy` makes
every handoff cross a real UCX (or TCP) connection instead. `--colocated` runs one engine doing
both phases behind the same router API, for comparison. Ctrl-C (or SIGTERM) stops every process.
`--otlp-endpoint HOST:PORT` sends every process's traces to an OpenTelemetry collector or Jaeger.
`--tls DIR` runs every hop over TLS with mutual TLS between the services (certificates from
DIR, made there by `pdserve certs create` when missing); `--api-key-file FILE` makes the
router's public API ask for one of FILE's keys (see docs/security.md).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from pdserve.certs import CertPaths, create
from pdserve.common.config import option, parse_config, require
from pdserve.common.cpus import Partition, format_cpu_list, parse_cpu_list, partition
from pdserve.common.models import DEFAULT_MODEL, builtin_models_help
from pdserve.common.ports import free_port
from pdserve.common.security import ChannelSecurity
from pdserve.processes import Proc, Stack, port_conflicts

OTLP_ENDPOINT = re.compile(r"(https?://)?(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}/?")


@dataclass(frozen=True)
class UpConfig:
    model: str = option(DEFAULT_MODEL, "a local Hugging Face directory, or a built-in "
                                       f"model: {builtin_models_help()}")
    prefill: int = option(1, "prefill workers")
    decode: int = option(1, "decode workers")
    transport: str = option("ucx", "KV transport between the agents", choices=("ucx", "tcp"))
    same_host_copy: bool = option(True, "the two agents find at their handshake that they share "
                                        "this host, and copy pages straight from the sender's "
                                        "pool (kv_transport shm); off: every handoff takes "
                                        "--transport")
    same_host_lane: bool = option(True, "with the same-host copy, the prefill worker hands "
                                        "its pages to the decode side's agent itself (off: "
                                        "through its own agent, two more process hops)")
    network_lane: bool = option(True, "with --transport tcp between the agents, the prefill "
                                      "worker sends its pages onto the decode side's agent's "
                                      "connection itself (off: through its own agent)")
    pipeline_handoff: bool = option(True, "prefill ships the pages each prompt chunk completes "
                                          "while the next chunk computes (off: all after the "
                                          "last chunk)")
    colocated: bool = option(False, "one co-located engine instead of prefill + decode workers")
    prefill_tp: int = option(1, "tensor-parallel ranks of each prefill worker (a process each, "
                                "on its share of the prefill cores)")
    decode_tp: int = option(1, "tensor-parallel ranks of each decode worker")
    colocated_tp: int = option(1, "tensor-parallel ranks of the co-located worker")
    prefix_cache: bool = option(True, "every worker keeps full KV pages for reuse by later "
                                      "prompts with the same prefix (--no-prefix-cache: off)")
    port: int = option(50051, "router port")
    http_port: int = option(8000, "router's OpenAI-compatible HTTP port (0 = any free port, "
                                  "-1 = off)")
    prefill_port: int = option(50061, "first prefill worker's port (the next ones count up)")
    decode_port: int = option(50071, "first decode worker's port")
    agent_port: int = option(50081, "first kvtransfer agent's port")
    colocated_port: int = option(50091, "the co-located worker's port")
    metrics_port: int = option(9051, "router's /metrics port; the others count up from it as the "
                                     "gRPC ports do: prefill +10, decode +20, agents +30, "
                                     "co-located +40 (0 = any free port, -1 = off)")
    kv_cache_mb: int = option(0, "KV pool per worker (MiB; 0: 512, grown to hold one "
                                 "full-context sequence; set, it must hold one)")
    cpu_partition: bool = option(True, "disaggregated mode: pin the prefill and the decode "
                                       "workers to cores of their own (as separate pods would "
                                       "be); each sizes its torch threads to its cores")
    prefill_cpus: str = option("", "cores for the prefill workers, e.g. 0-3 (default: half of "
                                   "this process's cores)")
    decode_cpus: str = option("", "cores for the decode workers (default: the other half)")
    demo: bool = option(False, "send one demo request, print it with its TTFT breakdown, stop "
                               "(the request goes through the prefill pool and the KV handoff)")
    demo_prompt: str = option("", "the demo request's text (default: 'What is the capital "
                                  "of France?' as a chat when the model has a chat template, "
                                  "else 'def fibonacci(n):')")
    log_dir: str = option("", "keep every process's log here (default: a temp dir, removed on "
                              "exit)")
    ready_timeout_s: float = option(300.0, "how long the stack may take to come up (s)")
    otlp_endpoint: str = option("", "send every process's traces over OTLP/gRPC to this "
                                    "collector or Jaeger, HOST:PORT (default: "
                                    "OTEL_EXPORTER_OTLP_ENDPOINT when set; none: tracing off)")
    trace_sample_ratio: float | None = option(None, "fraction of requests traced (default: "
                                                    "OTEL_TRACES_SAMPLER_ARG when set, else 1)")
    tls: str = option("", "TLS on every hop, mutual TLS between the services, with the "
                          "certificates in this directory (created by `pdserve certs create` "
                          "when missing); default: plaintext")
    api_key_file: str = option("", "the router's public API asks for one of this file's keys "
                                   "(one a line) as 'authorization: Bearer <key>'")

    def __post_init__(self) -> None:
        require(self.prefill >= 1, "prefill", self.prefill, ">= 1")
        require(self.decode >= 1, "decode", self.decode, ">= 1")
        for name in ("prefill_tp", "decode_tp", "colocated_tp"):
            require(getattr(self, name) >= 1, name, getattr(self, name), ">= 1")
        require(self.kv_cache_mb >= 0, "kv_cache_mb", self.kv_cache_mb, ">= 0")
        for name, count in (("port", 1), ("prefill_port", self.prefill),
                            ("decode_port", self.decode), ("agent_port", 2),
                            ("colocated_port", 1)):
            first = getattr(self, name)
            require(1 <= first <= 65536 - count, name, first,
                    f"1..{65536 - count}" + (f" ({count} ports count up from it)"
                                             if count > 1 else ""))
        require(-1 <= self.http_port <= 65535, "http_port", self.http_port,
                "0..65535, or -1 (off)")
        require(-1 <= self.metrics_port <= 65535 - 50, "metrics_port", self.metrics_port,
                "0..65485, or -1 (off)")
        require(not self.otlp_endpoint or bool(OTLP_ENDPOINT.fullmatch(self.otlp_endpoint)),
                "otlp_endpoint", self.otlp_endpoint, "HOST:PORT or http(s)://HOST:PORT")
        require(self.trace_sample_ratio is None or 0.0 <= self.trace_sample_ratio <= 1.0,
                "trace_sample_ratio", self.trace_sample_ratio, "a fraction in [0, 1]")
        require(not self.api_key_file or os.path.isfile(self.api_key_file), "api_key_file",
                self.api_key_file, "a readable file of API keys")
        for name in ("prefill_cpus", "decode_cpus"):
            text = getattr(self, name)
            if text:
                try:
                    parse_cpu_list(text)
                except ValueError as exc:
                    raise ValueError(f"{name}={text!r}: {exc}") from None

    def cpu_plan(self) -> Partition | None:
        """Cores per side in disaggregated mode (None: not partitioned)."""
        if self.colocated or not self.cpu_partition:
            return None
        split = partition(sorted(os.sched_getaffinity(0)))
        return Partition(parse_cpu_list(self.prefill_cpus) if self.prefill_cpus else split.prefill,
                         parse_cpu_list(self.decode_cpus) if self.decode_cpus else split.decode,
                         split.others)

    def trace_env(self) -> dict[str, str]:
        """The OTEL_* variables every process gets on top of this one's environment."""
        env: dict[str, str] = {}
        if self.otlp_endpoint:
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = (
                self.otlp_endpoint if "://" in self.otlp_endpoint
                else f"http://{self.otlp_endpoint}")
        if self.trace_sample_ratio is not None:
            env["OTEL_TRACES_SAMPLER_ARG"] = str(self.trace_sample_ratio)
        return env

    def metrics_port_of(self, offset: int) -> int:
        """A process's metrics port: base + offset (0 and -1 stay as they are)."""
        return self.metrics_port + offset if self.metrics_port > 0 else self.metrics_port


def plan(cfg: UpConfig, model_dir: Path, model_name: str) -> list[Proc]:
    """The processes in start order (agents, workers, router), each with its metrics port
    (and its certificates, API keys)."""
    procs = _plan(cfg, model_dir, model_name)
    cores = cfg.cpu_plan()
    for p in procs:
        # "Any free port" is picked here, so the banner can say which.
        p.metrics_port = cfg.metrics_port_of(metrics_offset(p.name)) or free_port()
        p.ports = [int(p.address.rsplit(":", 1)[1]),
                   *([p.metrics_port] if p.metrics_port > 0 else []),
                   *([cfg.http_port] if p.name == "router" and cfg.http_port > 0 else [])]
        p.argv += ["--metrics-port", str(p.metrics_port)]
        if cfg.tls:
            certs = CertPaths(Path(cfg.tls))
            p.argv += ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
                       "--tls-ca", str(certs.ca)]
        if cfg.api_key_file and p.name == "router":
            p.argv += ["--api-key-file", cfg.api_key_file]
        if cores is not None:
            role = p.name.partition("-")[0]
            p.cpus = {"prefill": cores.prefill, "decode": cores.decode}.get(role, cores.others)
    return procs


def prepare_certs(cfg: UpConfig) -> ChannelSecurity | None:
    """With --tls: the directory's certificates (made there first when missing), and how
    `pdserve up` itself calls the services (as a service: the server certificate)."""
    if not cfg.tls:
        return None
    certs = CertPaths(Path(cfg.tls))
    if not certs.complete():
        create(certs.directory)
        print(f"wrote a throwaway CA and certificates to {certs.directory}", flush=True)
    return ChannelSecurity(ca=str(certs.ca), cert=str(certs.server_cert),
                           key=str(certs.server_key))


METRICS_OFFSETS = {"router": 0, "prefill": 10, "decode": 20, "kvtransfer": 30, "colocated": 40}


def metrics_offset(name: str) -> int:
    """A process's metrics port above `--metrics-port`: `prefill-1` 11, `kvtransfer-b` 31."""
    role, _, index = name.partition("-")
    return METRICS_OFFSETS[role] + ("ab".index(index) if role == "kvtransfer" else int(index or 0))


def _plan(cfg: UpConfig, model_dir: Path, model_name: str) -> list[Proc]:
    py = [sys.executable, "-m"]
    worker_common = ["--model", cfg.model, "--kv-cache-mb", str(cfg.kv_cache_mb),
                     *([] if cfg.prefix_cache else ["--no-prefix-cache"])]
    procs: list[Proc] = []
    if cfg.colocated:
        addr = f"127.0.0.1:{cfg.colocated_port}"
        procs.append(Proc("colocated", addr, [*py, "pdserve.colocated.main", "--port",
                                              str(cfg.colocated_port), *worker_common,
                                              "--tp", str(cfg.colocated_tp)]))
        prefill_addrs = decode_addrs = [addr]
    else:
        agent_a, agent_b = (f"127.0.0.1:{cfg.agent_port + i}" for i in range(2))
        for i, addr in enumerate((agent_a, agent_b)):
            procs.append(Proc(f"kvtransfer-{'ab'[i]}", addr, [
                *py, "pdserve.kvtransfer.main", "--port", str(cfg.agent_port + i),
                "--transport", cfg.transport, "--agent-id", f"host-{'ab'[i]}",
                "--same-host-copy" if cfg.same_host_copy else "--no-same-host-copy"]))
        prefill_addrs = [f"127.0.0.1:{cfg.prefill_port + i}" for i in range(cfg.prefill)]
        decode_addrs = [f"127.0.0.1:{cfg.decode_port + i}" for i in range(cfg.decode)]
        for i, addr in enumerate(decode_addrs):
            procs.append(Proc(f"decode-{i}", addr, [*py, "pdserve.decode.main", "--port",
                                                    addr.rsplit(":", 1)[1], "--kv-agent", agent_b,
                                                    *worker_common, "--tp", str(cfg.decode_tp)]))
        for i, addr in enumerate(prefill_addrs):
            procs.append(Proc(f"prefill-{i}", addr, [
                *py, "pdserve.prefill.main", "--port", addr.rsplit(":", 1)[1], "--kv-agent",
                agent_a, *worker_common, "--tp", str(cfg.prefill_tp),
                "--pipeline-handoff" if cfg.pipeline_handoff else "--no-pipeline-handoff",
                "--same-host-lane" if cfg.same_host_lane else "--no-same-host-lane",
                "--network-lane" if cfg.network_lane else "--no-network-lane"]))
    procs.append(Proc("router", f"127.0.0.1:{cfg.port}", [
        *py, "pdserve.router.main", "--port", str(cfg.port), "--http-port", str(cfg.http_port),
        "--model", str(model_dir),
        "--model-name", model_name, "--prefill", ",".join(prefill_addrs),
        "--decode", ",".join(dict.fromkeys(decode_addrs)),
        # The demo shows the whole disaggregated path (prefill pool, KV handoff) whatever the
        # length of its prompt; served traffic prefills short uncached parts on decode.
        *(["--remote-prefill-min-tokens", "0"] if cfg.demo else [])]))
    return procs


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _banner(router: str, procs: list[Proc], cfg: UpConfig) -> str:
    body = '{"prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0}'
    grpcurl = gen = ""
    if cfg.tls:
        ca = shlex.quote(str(CertPaths(Path(cfg.tls)).ca))
        grpcurl, gen = f"-cacert {ca}", f" --tls-ca {ca}"
    else:
        grpcurl = "-plaintext"
    if cfg.api_key_file:
        grpcurl += " -H \"authorization: Bearer $PDSERVE_API_KEY\""
    metrics = [f"    {p.name:<12} http://127.0.0.1:{p.metrics_port}/metrics" for p in procs
               if p.metrics_port > 0]
    pinned = [f"    {p.name:<12} cores {format_cpu_list(p.cpus)}" for p in procs if p.cpus]
    return "\n".join([
        f"pdserve is up. Router: {router}",
        *_http_lines(router, cfg),
        *(["  CPU partition (--no-cpu-partition to turn off):", *pinned] if pinned else []),
        *(["  Prometheus metrics:", *metrics] if metrics else []),
        *([f"  export PDSERVE_API_KEY=<a key from {cfg.api_key_file}>"]
          if cfg.api_key_file else []),
        f"  grpcurl {grpcurl} -d {shlex.quote(body)} {router} pdserve.v1.Router/Generate",
        f"  pdserve generate --address {router}{gen} --max-tokens 32 --temperature 0 "
        "'def fibonacci(n):'",
        f"  pdserve generate --address {router}{gen} --temperature 0 --chat "
        "'What is the capital of France?'   (models with a chat template)",
        "Ctrl-C stops every process.",
    ])


def _http_lines(router: str, cfg: UpConfig) -> list[str]:
    """The OpenAI-compatible API's address and a curl call (none with --http-port -1)."""
    if cfg.http_port == -1:
        return []
    host = router.rsplit(":", 1)[0]
    scheme, flags = ("https", f" --cacert {shlex.quote(str(CertPaths(Path(cfg.tls)).ca))}"
                     ) if cfg.tls else ("http", "")
    url = f"{scheme}://{host}:{cfg.http_port}/v1"
    if cfg.api_key_file:
        flags += ' -H "Authorization: Bearer $PDSERVE_API_KEY"'
    body = '{"prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0}'
    return [f"  OpenAI-compatible API: {url}",
            f"  curl{flags} {url}/completions -H 'Content-Type: application/json' "
            f"-d {shlex.quote(body)}"]


def demo_security(cfg: UpConfig) -> list[str]:
    """The demo client's flags: the CA with --tls, the file's first key with --api-key-file."""
    flags = ["--tls-ca", str(CertPaths(Path(cfg.tls)).ca)] if cfg.tls else []
    if cfg.api_key_file:
        keys = [k.strip() for k in Path(cfg.api_key_file).read_text().splitlines()]
        flags += ["--api-key", next(k for k in keys if k and not k.startswith("#"))]
    return flags


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(UpConfig, "up", argv, prog="pdserve up", description=__doc__)
    from pdserve.common.models import resolve_model_name
    from pdserve.engine.builtin import model_dir as ensure_model_dir

    try:
        ref = resolve_model_name(cfg.model)
    except FileNotFoundError as exc:
        print(f"pdserve up: --model: {exc}", file=sys.stderr)
        return 2
    if cfg.http_port == 0:  # picked here, so the banner can say which
        cfg = replace(cfg, http_port=free_port())
    conflicts = port_conflicts(plan(cfg, Path(cfg.model), ref.name))  # before any model work
    if conflicts:
        print(f"pdserve up: {'; '.join(conflicts)}. Is another pdserve up running? --port, "
              "--prefill-port, --decode-port, --agent-port, --http-port and --metrics-port "
              "move the ports.", file=sys.stderr)
        return 2
    model_dir = ensure_model_dir(ref, progress=lambda m: print(m, flush=True))
    model_name = ref.name
    log_dir = Path(cfg.log_dir) if cfg.log_dir else Path(tempfile.mkdtemp(prefix="pdserve-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    security = prepare_certs(cfg)
    stack = Stack(plan(cfg, model_dir, model_name), log_dir, cfg.trace_env(), security)
    router = stack.procs[-1].address
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    status = 0
    try:
        print(f"starting {len(stack.procs)} processes (model {model_name}, logs in {log_dir})",
              flush=True)
        if stack.env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            print(f"traces: OTLP to {stack.env['OTEL_EXPORTER_OTLP_ENDPOINT']} from every process",
                  flush=True)
        stack.start(cfg.ready_timeout_s)
        print(_banner(router, stack.procs, cfg), flush=True)
        if cfg.demo:
            from pdserve import demo

            status = demo.run(router, model_dir, ref.random_weights, cfg.demo_prompt,
                              demo_security(cfg))
        else:
            status = stack.watch()  # until Ctrl-C / SIGTERM, or the router exits
    except KeyboardInterrupt:
        pass
    except RuntimeError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        status = 1
    finally:
        print("stopping...", flush=True)
        for s in previous:  # a second Ctrl-C must not interrupt the clean-up
            signal.signal(s, signal.SIG_IGN)
        stack.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        if not cfg.log_dir and status == 0:
            shutil.rmtree(log_dir, ignore_errors=True)
        elif status:
            print(f"logs kept in {log_dir}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
