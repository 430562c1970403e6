"""Start-up errors an operator makes: one ERROR line naming what is wrong, no traceback, a
non-zero exit (as the router and the kvtransfer agent already do)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from pdserve import certs, client

from tests.support import free_port, pdserve_argv

pytestmark = pytest.mark.service

WORKER_FLAGS = ("--port", "0", "--metrics-port", "-1", "--no-warmup")


def _run(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(pdserve_argv(*args), capture_output=True, text=True,
                          timeout=timeout_s)


def _assert_one_clean_error(done: subprocess.CompletedProcess[str], needle: str) -> None:
    assert done.returncode != 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()
              and "add_port.cc" not in line]  # grpc's own C++ log line before ours
    assert len(errors) == 1 and needle in errors[0], done.stderr


def _copy_model(src: Path, dst: Path, **config: object) -> Path:
    shutil.copytree(src, dst)
    data = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**data, **config}))
    return dst


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_worker_with_a_missing_model_names_it(role):
    done = _run(role, "--model", "/nonexistent", *WORKER_FLAGS)
    _assert_one_clean_error(done, "model '/nonexistent' is neither a built-in model")


def test_worker_with_a_malformed_config_names_the_file(tiny_model_dir, tmp_path):
    model = _copy_model(tiny_model_dir, tmp_path / "bad")
    (model / "config.json").write_text('{"architectures": [')
    done = _run("colocated", "--model", str(model), *WORKER_FLAGS)
    _assert_one_clean_error(done, f"{model / 'config.json'} is not valid JSON")


def test_worker_with_an_unsupported_architecture_says_so(tiny_model_dir, tmp_path):
    model = _copy_model(tiny_model_dir, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    done = _run("colocated", "--model", str(model), *WORKER_FLAGS)
    _assert_one_clean_error(done, "architecture 'GPT2LMHeadModel'")


def test_worker_on_a_port_in_use_names_the_port_before_loading_its_model():
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # No such model either: the port is what it says, so it never got to the model.
        done = _run("colocated", "--model", "/nonexistent", "--port", str(port),
                    "--metrics-port", "-1", "--no-warmup")
    _assert_one_clean_error(done, f"port {port} is in use")


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_worker_whose_agent_does_not_answer_says_so(role, tiny_model_dir):
    agent = f"127.0.0.1:{free_port()}"  # nothing listens there
    done = _run(role, "--model", str(tiny_model_dir), "--kv-agent", agent,
                "--kv-agent-wait-s", "1", *WORKER_FLAGS)
    _assert_one_clean_error(done, f"kvtransfer agent at {agent} not reachable after 1s")


def test_model_create_into_a_full_directory_names_it(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("mine")
    done = _run("model", "create", "tiny", str(tmp_path / "taken"), timeout_s=60)
    assert done.returncode == 2
    _assert_one_clean_error(done, f"{tmp_path / 'taken'} exists and is not empty")
    assert (tmp_path / "taken" / "file").read_text() == "mine"


def test_generate_in_plaintext_against_a_tls_router_hints_at_tls(tmp_path, capsys):
    paths = certs.create(tmp_path / "certs", hosts=["127.0.0.1"])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(paths.server_key.read_bytes(), paths.server_cert.read_bytes())]))
    server.start()
    try:
        assert client.main(["--address", f"127.0.0.1:{port}", "--timeout", "10", "hi"]) == 1
    finally:
        server.stop(0)
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err and "is the router serving TLS? try --tls / --tls-ca" in err
