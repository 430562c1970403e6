"""Fixtures of the service tier: a router (in this process) in front of scripted fake
workers on loopback gRPC; yields (script, router stub, lifecycle)."""

from __future__ import annotations

import grpc
import pytest
from pdserve.common import native_grpc, server
from pdserve.router.lifecycle import Lifecycle
from pdserve.router.native_relay import Relayer
from pdserve.router.pool import WorkerPool
from pdserve.router.servicer import RouterServicer
from pdserve.router.tokenizer import Tokenizer
from pdserve.v1 import decode_pb2_grpc, prefill_pb2_grpc, router_pb2_grpc

from tests.fakes import TEXT, FakeDecode, FakePrefill, Script, make_model_dir


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(make_model_dir(tmp_path_factory.mktemp("m"), max_context=256))


@pytest.fixture
def stack(request, tok):
    """Two prefill and one decode fake, and a router in front; yields (script, stub, lifecycle).

    Parametrized indirectly with "native": the router on gRPC's C++ core, a Decode call per
    sequence, its tokens relayed in C++ (router/native_relay.py); else grpcio and Python."""
    native = native_grpc.library() if getattr(request, "param", "") == "native" else None
    script = Script(tokens=tok.encode(TEXT))
    handles = [
        server.start("p0", 0, lambda s: prefill_pb2_grpc.add_PrefillServicer_to_server(
            FakePrefill(script, "p0"), s), host="127.0.0.1"),
        server.start("p1", 0, lambda s: prefill_pb2_grpc.add_PrefillServicer_to_server(
            FakePrefill(script, "p1"), s), host="127.0.0.1"),
        server.start("d0", 0, lambda s: decode_pb2_grpc.add_DecodeServicer_to_server(
            FakeDecode(script, "d0"), s), host="127.0.0.1"),
    ]
    addresses = [f"127.0.0.1:{h.port}" for h in handles]
    pool = WorkerPool(addresses[:2], addresses[2:], interval_s=60, native_calls=native,
                      shared_decode_stream=native is None)
    assert not pool.ready()
    pool.check_now()
    assert pool.ready()
    lifecycle = Lifecycle(pool, tok, "tiny-test", max_retries=1,
                          relayer=Relayer.create(native, tok))
    router = server.start("router", 0, lambda s: router_pb2_grpc.add_RouterServicer_to_server(
        RouterServicer(lifecycle), s), host="127.0.0.1", ready=pool.ready, native=native)
    channel = grpc.insecure_channel(f"127.0.0.1:{router.port}")
    yield script, router_pb2_grpc.RouterStub(channel), lifecycle
    channel.close()
    pool.close()
    for h in (router, *handles):
        h.server.stop(0)
