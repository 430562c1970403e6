"""How the manifests wire the services together: the router's worker pools, each worker's agent,
advertised addresses, drain grace, the shared KV pool volume, autoscaling metrics, the image's
user."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from pdserve.common.metrics import AgentMetrics, RouterMetrics, WorkerMetrics
from pdserve.worker.types import WorkerStats

from tests.deploy.manifests import (
    K8S,
    NAMESPACE,
    OVERLAYS,
    POD_IP,
    ROOT,
    config_maps,
    deployments,
    pod_containers,
    render,
)
from tests.deploy.test_manifests import by_command, effective_config

pytestmark = pytest.mark.deploy
PRESTOP_MARGIN_S = 5  # what terminationGracePeriodSeconds keeps beyond preStop + drain grace


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(K8S / "overlays" / name) for name in OVERLAYS}


def _service_target(target: str, what: str) -> tuple[str, str, int]:
    """A dns:/// target naming a Service in the cluster: its name, namespace and port."""
    match = re.fullmatch(r"dns:///([^.:]+)\.([^.:]+)\.svc\.cluster\.local:(\d+)", target)
    assert match, f"{what} {target!r} is not a dns:/// target"
    return match[1], match[2], int(match[3])


def test_router_discovers_each_pool_through_its_headless_service(rendered):
    for overlay, objects in rendered.items():
        found = by_command(objects)
        services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
        for router in found["router"]:
            cfg = effective_config(router)
            for role in ("prefill", "decode"):
                (target,) = getattr(cfg, role)
                name, namespace, port = _service_target(target, f"{overlay}: router --{role}")
                assert namespace == NAMESPACE and name in services, f"{overlay}: {target}"
                assert services[name]["spec"].get("clusterIP") == "None", target
                worker_ports = {effective_config(w).port for w in found[role]}
                assert worker_ports == {port}, f"{overlay}: {target} vs workers on {worker_ports}"


def test_routers_find_their_peers_through_their_headless_service(rendered):
    for overlay, objects in rendered.items():
        found = by_command(objects)
        services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
        for router in found["router"]:
            cfg = effective_config(router)
            (target,) = cfg.peers
            name, namespace, port = _service_target(target, f"{overlay}: router --peers")
            assert namespace == NAMESPACE, f"{overlay}: router --peers {target!r}"
            service = services[name]
            assert service["spec"].get("clusterIP") == "None", target
            assert service["spec"]["selector"]["app.kubernetes.io/component"] == "router"
            assert port == cfg.port, f"{overlay}: {target} vs the router's {cfg.port}"


def test_each_worker_uses_its_pods_agent_and_both_advertise_the_pod_ip(rendered):
    for overlay, objects in rendered.items():
        maps = config_maps(objects)
        for name, deployment in deployments(objects).items():
            containers = list(pod_containers(deployment, maps))
            workers = [c for c in containers if c.command in ("prefill", "decode")]
            agents = [c for c in containers if c.command == "kvtransfer"]
            if not workers:
                continue
            assert len(agents) == 1, f"{overlay}: {name} needs one kvtransfer sidecar"
            agent_cfg = effective_config(agents[0])
            assert agent_cfg.advertise_host == POD_IP, f"{overlay}: {name} agent advertises"
            for worker in workers:
                cfg = effective_config(worker)
                assert cfg.kv_agent == f"127.0.0.1:{agent_cfg.port}", \
                    f"{overlay}: {name} worker's --kv-agent {cfg.kv_agent}"
                assert cfg.advertise_host == POD_IP, f"{overlay}: {name} worker advertises"


def test_termination_grace_covers_prestop_and_drain(rendered):
    for overlay, objects in rendered.items():
        maps = config_maps(objects)
        for name, deployment in deployments(objects).items():
            pod = deployment["spec"]["template"]["spec"]
            containers = [c for c in pod_containers(deployment, maps)
                          if "pdserve" in c.spec.get("image", "")]
            if not containers:
                continue
            main = [c for c in containers if not c.sidecar]
            sidecars = [c for c in containers if c.sidecar]
            pause = max(prestop_s(c.spec) for c in main)
            # Sidecars are stopped only after the main containers have exited.
            needed = (pause + max(effective_config(c).grace_s for c in main)
                      + max((effective_config(c).grace_s for c in sidecars), default=0))
            grace = pod.get("terminationGracePeriodSeconds", 30)
            assert grace >= needed + PRESTOP_MARGIN_S, \
                f"{overlay}: {name} terminationGracePeriodSeconds {grace} < preStop {pause} + " \
                f"drain grace = {needed} (+{PRESTOP_MARGIN_S} margin)"
            assert all(prestop_s(c.spec) > 0 for c in main), f"{overlay}: {name} has no preStop"


def prestop_s(spec: dict[str, Any]) -> float:
    command = spec.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    return float(command[1]) if command[:1] == ["sleep"] else 0.0


MIB = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024 * 1024}


def mib(quantity: str) -> float:
    number, unit = re.fullmatch(r"(\d+)([KMGT]i)", quantity).groups()  # type: ignore[union-attr]
    return int(number) * MIB[unit]


def test_worker_and_agent_share_a_memory_directory_holding_the_agents_socket(rendered):
    for overlay, objects in rendered.items():
        maps = config_maps(objects)
        for name, deployment in deployments(objects).items():
            containers = list(pod_containers(deployment, maps))
            workers = [c for c in containers if c.command in ("prefill", "decode")]
            if not workers:
                continue
            (agent,) = [c for c in containers if c.command == "kvtransfer"]
            volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
            memory = {n for n, v in volumes.items() if v.get("emptyDir", {}).get("medium")
                      == "Memory"}
            socket = effective_config(agent).local_socket
            (directory,) = [m["mountPath"] for m in agent.spec["volumeMounts"]
                            if m["name"] in memory and socket.startswith(m["mountPath"] + "/")]
            for worker in workers:
                cfg = effective_config(worker)
                assert any(m["name"] in memory and m["mountPath"] == directory
                           for m in worker.spec["volumeMounts"]), \
                    f"{overlay}: {name}: the worker does not mount the agent's {directory}"
                assert cfg.kv_agent_socket == socket, \
                    f"{overlay}: {name}: worker's --kv-agent-socket {cfg.kv_agent_socket!r}"
                if cfg.device == "cpu":  # the pool is the worker's memory
                    memory_limit = mib(worker.spec["resources"]["limits"]["memory"])
                    assert memory_limit > cfg.kv_cache_mb, f"{overlay}: {name} memory limit"


def exposed_metric_names() -> set[str]:
    stats = WorkerStats("w", "decode", 8, 8, 0, 0, 0, None)  # type: ignore[arg-type]
    registries = [RouterMetrics().registry, WorkerMetrics("decode", lambda: stats).registry,
                  AgentMetrics().registry]
    names = set()
    for registry in registries:
        for family in registry.collect():
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
            names |= {family.name + s for s in suffixes.get(family.type, [""])}
    return names


def test_autoscaling_uses_pdserve_metrics():
    names = exposed_metric_names()
    rules = yaml.safe_load((K8S / "components" / "autoscaling" /
                            "prometheus-adapter-rules.yaml").read_text())["rules"]
    served = set()
    for kind in ("custom", "external"):
        for rule in rules[kind]:
            series = set(re.findall(r"\bpdserve_[a-z_]+", rule["seriesQuery"]
                                    + rule["metricsQuery"]))
            assert series <= names, f"adapter rule uses unknown metrics {series - names}"
            served.add((kind, re.sub(r"\$\{1\}", rule["seriesQuery"].split("{")[0],
                                     rule["name"]["as"])))
    hpas = [o for o in render(K8S / "overlays" / "autoscaling")
            if o["kind"] == "HorizontalPodAutoscaler"]
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas} == {"prefill", "decode"}
    for hpa in hpas:
        for metric in hpa["spec"]["metrics"]:
            kind = {"Pods": "custom", "External": "external"}[metric["type"]]
            name = metric[metric["type"].lower()]["metric"]["name"]
            assert (kind, name) in served, f"HPA {hpa['metadata']['name']}: {name} is served " \
                "by no prometheus-adapter rule"


def test_pods_run_as_the_images_user(rendered):
    containerfile = (ROOT / "deploy" / "Containerfile").read_text()
    (user,) = re.findall(r"^USER (\d+):(\d+)$", containerfile, re.M)
    for overlay, objects in rendered.items():
        for name, deployment in deployments(objects).items():
            pod = deployment["spec"]["template"]["spec"]
            if not any("pdserve" in c["image"] for c in pod["containers"]):
                continue
            context = pod["securityContext"]
            assert context["runAsNonRoot"] is True, f"{overlay}: {name}"
            assert (str(context["runAsUser"]), str(context["runAsGroup"])) == user, \
                f"{overlay}: {name} runs as {context['runAsUser']}, the image's user is {user}"


def test_tls_is_on_for_every_service_or_for_none(rendered):
    for overlay, objects in rendered.items():
        on = {f"{c.deployment}/{c.name}": effective_config(c).tls
              for c in by_command_all(objects)}
        assert len(set(on.values())) == 1, f"{overlay}: TLS on only for some services: {on}"
    assert all(effective_config(c).tls for c in by_command_all(rendered["tls"]))


def by_command_all(objects: list[dict[str, Any]]) -> list[Any]:
    return [c for containers in by_command(objects).values() for c in containers]
