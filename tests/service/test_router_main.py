"""The router's entry point: flags and env twins, model resolution, a real router process."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from pdserve.common import server
from pdserve.common.config import parse_config
from pdserve.common.models import resolve_model_name
from pdserve.router.config import RouterConfig
from pdserve.router.main import main, model_dir
from pdserve.router.tokenizer import Tokenizer
from pdserve.v1 import decode_pb2_grpc, prefill_pb2_grpc, router_pb2, router_pb2_grpc

from tests.fakes import FakeDecode, FakePrefill, Script, make_model_dir
from tests.support import ServiceProcess, free_port, wait_serving

pytestmark = pytest.mark.service


def test_help_lists_every_flag_with_its_env_twin(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("port", "host", "prefill", "decode", "model", "model_name", "max_retries",
                 "log_format", "grace_s"):
        assert f"--{flag.replace('_', '-')}" in text
        assert f"PDSERVE_ROUTER_{flag.upper()}" in text


def test_env_twins_fill_the_config():
    env = {"PDSERVE_ROUTER_PREFILL": "a:1,b:2", "PDSERVE_ROUTER_DECODE": "c:3",
           "PDSERVE_ROUTER_PORT": "6000", "PDSERVE_ROUTER_MAX_RETRIES": "2"}
    cfg = parse_config(RouterConfig, "router", [], env=env)
    assert (cfg.prefill, cfg.decode, cfg.port, cfg.max_retries) == \
        (("a:1", "b:2"), ("c:3",), 6000, 2)
    cfg = parse_config(RouterConfig, "router", ["--decode", "a:1"], env=env)  # co-located worker
    assert cfg.decode == ("a:1",)


@pytest.mark.parametrize("argv, needle", [
    (["--decode", "d:1"], "prefill=()"),
    (["--prefill", "p:1", "--decode", "nohost"], "decode='nohost'"),
    (["--prefill", "p:1", "--decode", "d:1", "--max-retries", "-1"], "max_retries=-1"),
])
def test_bad_flags_exit_2_naming_the_field(capsys, argv, needle):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert needle in capsys.readouterr().err


def test_model_directory_named_after_itself(tmp_path):
    ref = resolve_model_name(str(make_model_dir(tmp_path / "my-model")))
    assert ref.name == "my-model" and (model_dir(ref) / "tokenizer.json").is_file()
    with pytest.raises(FileNotFoundError, match="'no/such/dir' is neither"):
        resolve_model_name("no/such/dir")


def test_builtin_model_from_a_child_process():
    ref = resolve_model_name("tiny")
    assert ref.name == "builtin-tiny" and (model_dir(ref) / "tokenizer.json").is_file()


UNBUILDABLE = {"CXX": "/bin/false"}  # with a fresh cache: gRPC's C++ library cannot be built


@pytest.mark.parametrize("library, env, says", [
    ("auto", {}, "gRPC on its C++ core (native)"),
    ("grpcio", {}, "gRPC on grpcio"),
    ("auto", UNBUILDABLE, "serving on grpcio: gRPC's C++ library cannot be built here"),
])
def test_router_process_serves_reflects_and_drains(tmp_path, library, env, says):
    """Fake co-located worker (Prefill and Decode on one address) + a real router process, on
    gRPC's C++ core or on grpcio (the same answers either way)."""
    script = Script()
    worker = server.start("worker", 0, lambda s: (
        prefill_pb2_grpc.add_PrefillServicer_to_server(FakePrefill(script, "w"), s),
        decode_pb2_grpc.add_DecodeServicer_to_server(FakeDecode(script, "w"), s)),
        host="127.0.0.1")
    model_dir = make_model_dir(tmp_path / "m")
    port = free_port()
    address = f"127.0.0.1:{port}"
    worker_address = f"127.0.0.1:{worker.port}"
    proc = ServiceProcess([sys.executable, "-m", "pdserve.router.main", "--model", str(model_dir),
                           "--host", "127.0.0.1", "--prefill", worker_address],
                          env={"PDSERVE_ROUTER_PORT": str(port),
                               "PDSERVE_ROUTER_DECODE": worker_address,
                               "PDSERVE_ROUTER_LOG_FORMAT": "json",
                               "PDSERVE_ROUTER_GRPC_LIBRARY": library, **env,
                               **({"PDSERVE_CACHE_DIR": str(tmp_path / "cache")} if env else {})})
    try:
        wait_serving(address, timeout_s=30, proc=proc.proc)
        maps = Path(f"/proc/{proc.proc.pid}/maps").read_text()
        assert "libtorch" not in maps and "/torch/" not in maps  # tokenizer loaded, no torch
        with grpc.insecure_channel(address) as channel:
            assert "pdserve.v1.Router" in ProtoReflectionDescriptorDatabase(channel).get_services()
            script.tokens = Tokenizer.from_dir(model_dir).encode("hello world")
            out = list(router_pb2_grpc.RouterStub(channel).Generate(
                router_pb2.GenerateRequest(prompt="hi", model="m"), timeout=20))
        assert "".join(r.delta.text for r in out) == "hello world"
        assert out[-1].finish.finish_reason == "length"
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(timeout=20) == 0, proc.output()
        assert '"msg": "generate"' in proc.output() and '"status": "OK"' in proc.output()
        assert says in proc.output()
        assert ("native_grpc-" in maps) == (says.endswith("(native)"))
    finally:
        proc.stop()
        worker.server.stop(0)


def test_a_native_router_that_cannot_have_its_library_says_why_and_exits_1(tmp_path):
    proc = ServiceProcess([sys.executable, "-m", "pdserve.router.main", "--model",
                           str(make_model_dir(tmp_path / "m")), "--prefill", "127.0.0.1:1",
                           "--decode", "127.0.0.1:1", "--grpc-library", "native",
                           "--port", str(free_port())],
                          env={**UNBUILDABLE, "PDSERVE_CACHE_DIR": str(tmp_path / "cache")})
    try:
        assert proc.proc.wait(timeout=60) == 1, proc.output()
        assert "--grpc-library native: gRPC's C++ library cannot be built here: false failed" \
            in proc.output()
        assert "libgrpc++-dev" in proc.output()  # what to install
    finally:
        proc.stop()
