"""Running the rendered Kubernetes pods as podman containers on this host.

Each Deployment becomes one "pod": its containers started with the command, flags, environment
(ConfigMap + downward API), user, read-only root file system and dropped capabilities the
manifests give them; a memory-backed `emptyDir` becomes one tmpfs podman volume shared by the
pod's containers at the same path; other `emptyDir`s a private tmpfs. Host networking: every
container port is mapped to a free host port, and addresses in the environment are rewritten
to match (`127.0.0.1:50081` of a pod → its agent's host port; `dns:///NAME:PORT` → the host
port of the pod behind Service NAME, with NAME resolving to 127.0.0.1 in the container).

Everything made carries the label `pdserve.smoke.run=<run>` (and the owning pid), and is
removed by label: `remove_run` at the end, `sweep_stale` for runs whose process died.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.deploy.manifests import ROOT, Container, config_maps, pod_containers, pod_fields
from tests.support import free_port

# These machines refuse the rlimits podman asks for by default; crun is not used.
LIMITS = ("--runtime", "runc", "--ulimit", "nofile=1024:4096", "--ulimit", "nproc=1024:2048")
RUN_LABEL = "pdserve.smoke.run"
PID_LABEL = "pdserve.smoke.pid"


def image_tag() -> str:
    """The test image's tag: one per checkout, so parallel checkouts do not share it."""
    return "localhost/pdserve:test-" + hashlib.sha1(str(ROOT).encode()).hexdigest()[:10]


def podman(*args: str, check: bool = True, timeout_s: float = 120) -> str:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout_s)
    if check and done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])} ... failed: {done.stderr.strip()}")
    return done.stdout.strip()


def _labelled(kind: str, label: str) -> list[str]:
    listing = ("ps", "-a", "-q") if kind == "container" else ("volume", "ls", "-q")
    return podman(*listing, "--filter", f"label={label}", check=False).split()


def remove_run(run: str) -> list[str]:
    """Remove every container and volume of the run; returns what was still there."""
    left = _labelled("container", f"{RUN_LABEL}={run}")
    if left:
        podman("rm", "-f", "-t", "0", *left, check=False)
    volumes = _labelled("volume", f"{RUN_LABEL}={run}")
    if volumes:
        podman("volume", "rm", "-f", *volumes, check=False)
    return left + volumes


def sweep_stale() -> None:
    """Remove what runs of test processes that no longer exist left behind (killed sessions)."""
    fmt = " ".join('{{index .Labels "' + label + '"}}' for label in (RUN_LABEL, PID_LABEL))
    found = [podman("inspect", "--format", fmt, i, check=False)
             for i in _labelled("container", PID_LABEL)]
    found += [podman("volume", "inspect", "--format", fmt, i, check=False)
              for i in _labelled("volume", PID_LABEL)]
    runs = {out.split()[0] for out in found
            if len(out.split()) == 2 and not _alive(int(out.split()[1]))}
    for run in runs:
        remove_run(run)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Pod:
    """A Deployment's pod on this host: its containers and the host ports of its ports."""

    name: str
    deployment: dict[str, Any]
    ports: dict[int, int] = field(default_factory=dict)  # container port -> host port
    containers: list[Container] = field(default_factory=list)

    def host_port(self, container_name: str, port_name: str) -> int:
        (c,) = [c for c in self.containers if c.name == container_name]
        port = c.port(port_name)
        assert port is not None, f"{self.name}/{container_name} has no port {port_name}"
        return self.ports[port]


class Stack:
    """The pods of rendered manifests, run as podman containers of one run."""

    def __init__(self, objects: list[dict[str, Any]], image: str, run: str):
        self.objects = objects
        self.image = image
        self.run = run
        self.maps = config_maps(objects)
        self.services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
        self.pods: dict[str, Pod] = {}
        for deployment in (o for o in objects if o["kind"] == "Deployment"):
            name = deployment["metadata"]["name"]
            pod = Pod(f"{run}-{name}", deployment)
            pod.containers = list(pod_containers(deployment, self.maps,
                                                 pod_fields("127.0.0.1", pod.name)))
            for c in pod.containers:
                for port in c.spec.get("ports", []):
                    pod.ports[int(port["containerPort"])] = free_port()
            self.pods[name] = pod
        self.hosts: set[str] = set()

    def labels(self) -> list[str]:
        return ["--label", f"{RUN_LABEL}={self.run}", "--label", f"{PID_LABEL}={os.getpid()}"]

    def _service_pod(self, name: str) -> Pod:
        service = self.services[name.split(".")[0]]
        selector = service["spec"]["selector"]
        (pod,) = [p for p in self.pods.values() if all(
            p.deployment["spec"]["template"]["metadata"]["labels"].get(k) == v
            for k, v in selector.items())]
        return pod

    def rewrite(self, pod: Pod, value: str) -> str:
        """An address in pod `pod`'s environment, as it reads on this host."""
        def one(match: re.Match[str]) -> str:
            scheme, host, port = match[1] or "", match[2], int(match[3])
            if scheme == "dns:///":
                self.hosts.add(host)
                return f"{scheme}{host}:{self._service_pod(host).ports[port]}"
            if host in ("127.0.0.1", "localhost") and port in pod.ports:
                return f"{host}:{pod.ports[port]}"
            return match[0]
        return re.sub(r"(dns:///)?([A-Za-z0-9.-]+):(\d+)", one, value)

    def env(self, pod: Pod, c: Container) -> dict[str, str]:
        env = {k: self.rewrite(pod, v) for k, v in c.env.items()}
        prefix = f"PDSERVE_{c.command.upper()}_"
        grpc = c.port("kv-grpc" if c.command == "kvtransfer" else "grpc")
        metrics = c.port("kv-metrics" if c.command == "kvtransfer" else "metrics")
        assert grpc is not None and metrics is not None, f"{pod.name}/{c.name} ports"
        env[prefix + "PORT"] = str(pod.ports[grpc])
        env[prefix + "METRICS_PORT"] = str(pod.ports[metrics])
        if c.port("http") is not None:
            env[prefix + "HTTP_PORT"] = str(pod.ports[c.port("http")])
        return env

    def create_volumes(self, pod: Pod) -> dict[str, str]:
        """The pod's memory-backed emptyDirs as tmpfs volumes: {volume name: podman volume}."""
        context = pod.deployment["spec"]["template"]["spec"].get("securityContext", {})
        owner = f"uid={context.get('runAsUser', 0)},gid={context.get('fsGroup', 0)}"
        made = {}
        for volume in pod.deployment["spec"]["template"]["spec"].get("volumes", []):
            if volume.get("emptyDir", {}).get("medium") == "Memory":
                name = f"{pod.name}-{volume['name']}"
                podman("volume", "create", *self.labels(), "--opt", "type=tmpfs", "--opt",
                       "device=tmpfs", "--opt", f"o={owner},mode=0700", name)
                made[volume["name"]] = name
        return made

    def run_argv(self, pod: Pod, c: Container, volumes: dict[str, str]) -> list[str]:
        context = {**pod.deployment["spec"]["template"]["spec"].get("securityContext", {}),
                   **c.spec.get("securityContext", {})}
        argv = ["run", "-d", "--name", f"{pod.name}-{c.name}", *self.labels(), *LIMITS,
                "--network", "host", "--hostname", pod.name,
                "--user", f"{context['runAsUser']}:{context['runAsGroup']}"]
        if context.get("readOnlyRootFilesystem"):
            argv += ["--read-only", "--read-only-tmpfs=false"]
        if "ALL" in context.get("capabilities", {}).get("drop", []):
            argv += ["--cap-drop", "ALL"]
        if context.get("allowPrivilegeEscalation") is False:
            argv += ["--security-opt", "no-new-privileges"]
        for mount in c.spec.get("volumeMounts", []):
            if mount["name"] in volumes:
                argv += ["-v", f"{volumes[mount['name']]}:{mount['mountPath']}"]
            else:  # a disk emptyDir: private to the container here
                argv += ["--mount", f"type=tmpfs,destination={mount['mountPath']},tmpfs-mode=1777"]
        env = self.env(pod, c)  # (notes the host names it rewrites)
        for host in sorted(self.hosts):  # DNS: every Service name is this host
            argv += ["--add-host", f"{host}:127.0.0.1"]
        for key, value in sorted(env.items()):
            argv += ["--env", f"{key}={value}"]
        return [*argv, self.image, *c.args]

    def start(self, pod: Pod, c: Container, volumes: dict[str, str]) -> str:
        name = f"{pod.name}-{c.name}"
        podman(*self.run_argv(pod, c, volumes))
        return name


def logs(name: str, lines: int = 40) -> str:
    """The container's last output lines (stdout and stderr)."""
    done = subprocess.run(["podman", "logs", "--tail", str(lines), name], capture_output=True,
                          text=True, timeout=30)
    return done.stdout + done.stderr


def state(name: str) -> tuple[str, int]:
    out = podman("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", name,
                 check=False).split()
    return (out[0], int(out[1])) if len(out) == 2 else ("gone", -1)


def stop(name: str, grace_s: float) -> int:
    """SIGTERM, up to `grace_s` to exit (as the kubelet would), then its exit status."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        podman("stop", "-t", str(int(grace_s)), name, check=False, timeout_s=grace_s + 30)
    return state(name)[1]


def tail_file(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""
