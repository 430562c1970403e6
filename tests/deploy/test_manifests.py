"""The Kubernetes manifests: every overlay renders and validates against the Kubernetes schemas
(offline, strict), and what the pods run matches the code: commands, flags, PDSERVE_* settings,
ports, probes, drain grace and the shared KV pool volume."""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

import pytest
from pdserve import cli
from pdserve.colocated.main import ColocatedConfig
from pdserve.common.config import env_name, parse_config
from pdserve.common.server import LIVENESS_SERVICE
from pdserve.decode.main import DecodeConfig
from pdserve.kvtransfer.config import AgentConfig
from pdserve.prefill.main import PrefillConfig
from pdserve.router.config import RouterConfig

from tests.deploy.manifests import (
    K8S,
    OVERLAYS,
    Container,
    config_maps,
    deployments,
    pdserve_containers,
    render,
    selects,
)

pytestmark = pytest.mark.deploy

CONFIGS: dict[str, type] = {"router": RouterConfig, "prefill": PrefillConfig,
                            "decode": DecodeConfig, "kvtransfer": AgentConfig,
                            "colocated": ColocatedConfig}
FILE_FIELDS = ("tls_cert", "tls_key", "tls_ca", "api_key_file")  # must exist to validate
# Kubernetes versions the manifests are validated against: the oldest supported (native
# sidecar containers are on by default from 1.29) and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.29.0", "latest")


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(K8S / "overlays" / name) for name in OVERLAYS}


def test_every_service_command_has_its_config_class():
    services = {name for name, (module, _) in cli.COMMANDS.items()
                if module.startswith("pdserve.") and module.endswith(".main")}
    assert services == set(CONFIGS)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_overlay_renders_and_validates_strictly(rendered, version):
    import jsonschema
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    version = latest_version() if version == "latest" else version
    assert set(OVERLAYS) >= {"cpu-demo", "gpu", "jaeger", "autoscaling", "tls"}
    for overlay, objects in rendered.items():
        assert objects, f"{overlay} renders nothing"
        for obj in objects:
            where = f"{overlay}: {obj['kind']}/{obj['metadata']['name']}"
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except jsonschema.ValidationError as exc:
                pytest.fail(f"{where} is invalid for Kubernetes {version}: {exc.message} "
                            f"at {'/'.join(map(str, exc.path))}")


def effective_config(container: Container) -> Any:
    """The container's config as its process would build it from its args and environment."""
    cls = CONFIGS[container.command]
    env = dict(container.env)
    with tempfile.NamedTemporaryFile("w", suffix=".pem") as placeholder:
        for f in FILE_FIELDS:  # files from Secrets: stand-ins, so validation can run
            if env.get(env_name(container.command, f)):
                env[env_name(container.command, f)] = placeholder.name
        try:
            return parse_config(cls, container.command, container.args[1:], env=env)
        except SystemExit:
            pytest.fail(f"{container.deployment}/{container.name}: `pdserve "
                        f"{' '.join(container.args)}` with its environment is refused (above)")


def test_flags_and_settings_exist_and_parse(rendered, capsys):
    names = {env_name(service, f.name): service for service, cls in CONFIGS.items()
             for f in dataclasses.fields(cls)}
    for overlay, objects in rendered.items():
        for name, data in config_maps(objects).items():
            unknown = [k for k in data if k.startswith("PDSERVE_") and k not in names]
            assert not unknown, f"{overlay}: ConfigMap {name} sets unknown settings {unknown}"
        containers = pdserve_containers(objects)
        assert containers, f"{overlay}: no container runs the pdserve image"
        for c in containers:
            where = f"{overlay}: {c.deployment}/{c.name}"
            assert c.command in CONFIGS, f"{where} runs `pdserve {c.command}`"
            fields = {f.name for f in dataclasses.fields(CONFIGS[c.command])}
            for arg in c.args[1:]:
                if arg.startswith("--"):
                    flag = arg[2:].split("=", 1)[0].replace("-", "_")
                    assert flag in fields or flag.removeprefix("no_") in fields, \
                        f"{where}: no flag {arg.split('=')[0]} in `pdserve {c.command}`"
            own = [v for v in c.spec.get("env", []) if v["name"].startswith("PDSERVE_")]
            for var in own:
                assert names.get(var["name"]) == c.command, \
                    f"{where}: {var['name']} is not a `pdserve {c.command}` setting"
            effective_config(c)


def by_command(objects: list[dict[str, Any]]) -> dict[str, list[Container]]:
    found: dict[str, list[Container]] = {}
    for c in pdserve_containers(objects):
        found.setdefault(c.command, []).append(c)
    return found


def check_probe(c: Container, kind: str, cfg: Any) -> None:
    """A gRPC health probe of the service's port: readiness asks the overall health, startup
    and liveness `pdserve.liveness`. With TLS on (the kubelet's gRPC probes are plaintext
    only): the router's readiness is its HTTPS /health, other probes check the port is open."""
    where = f"{c.deployment}/{c.name}"
    probe = c.spec.get(kind)
    assert probe, f"{where} has no {kind}"
    if "grpc" in probe:
        assert not cfg.tls, f"{where}: a gRPC {kind} cannot reach a TLS port"
        assert probe["grpc"]["port"] == cfg.port, f"{where}: {kind} port"
        want = "" if kind == "readinessProbe" else LIVENESS_SERVICE
        assert probe["grpc"].get("service", "") == want, f"{where}: {kind} service"
    elif "httpGet" in probe:
        get = probe["httpGet"]
        assert kind == "readinessProbe" and c.command == "router", f"{where}: {kind} over HTTP"
        assert (get["path"], get["port"]) == ("/health", "http"), f"{where}: {kind} {get}"
        assert c.port("http") == cfg.http_port, f"{where}: {kind} port"
        assert get.get("scheme", "HTTP") == ("HTTPS" if cfg.tls else "HTTP"), where
    else:
        assert cfg.tls and "tcpSocket" in probe, f"{where}: {kind} is not a gRPC health probe"
        assert probe["tcpSocket"]["port"] == cfg.port, f"{where}: {kind} port"


def test_every_service_has_deployment_service_probes_and_pdb(rendered):
    for overlay, objects in rendered.items():
        services = [o for o in objects if o["kind"] == "Service"]
        pdbs = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
        found = by_command(objects)
        assert {"router", "prefill", "decode", "kvtransfer"} <= set(found), overlay
        for command, containers in found.items():
            for c in containers:
                where = f"{overlay}: {c.deployment}/{c.name}"
                cfg = effective_config(c)
                labels = deployments(objects)[c.deployment]["spec"]["template"]["metadata"][
                    "labels"]
                assert c.port("grpc" if command != "kvtransfer" else "kv-grpc") == cfg.port, \
                    f"{where}: gRPC containerPort is not the port it serves ({cfg.port})"
                metrics = c.port("metrics" if command != "kvtransfer" else "kv-metrics")
                assert metrics == cfg.metrics_port, f"{where}: metrics containerPort"
                for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                    check_probe(c, kind, cfg)
                if command == "kvtransfer":
                    assert c.sidecar, f"{where}: the agent is not a native sidecar"
                    continue
                mine = [s for s in services if selects(s["spec"].get("selector", {}), labels)]
                assert mine, f"{where}: no Service selects its pods"
                service = mine[0]
                ports = {p["port"]: p for p in service["spec"]["ports"]}
                assert cfg.port in ports and ports[cfg.port]["targetPort"] == "grpc", \
                    f"{where}: Service {service['metadata']['name']} does not expose {cfg.port}"
                if command == "router":  # the OpenAI-compatible HTTP API
                    assert c.port("http") == cfg.http_port, f"{where}: http containerPort"
                    assert ports.get(cfg.http_port, {}).get("targetPort") == "http", \
                        f"{where}: Service {service['metadata']['name']} has no HTTP port"
                if command in ("prefill", "decode"):
                    assert service["spec"].get("clusterIP") == "None", \
                        f"{where}: a worker pool's Service must be headless (one record a pod)"
                assert any(selects(p["spec"]["selector"]["matchLabels"], labels) for p in pdbs), \
                    f"{where}: no PodDisruptionBudget"
                annotations = deployments(objects)[c.deployment]["spec"]["template"][
                    "metadata"].get("annotations", {})
                assert annotations.get("prometheus.io/port") == str(cfg.metrics_port), where
