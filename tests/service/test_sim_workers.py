"""`pdserve sim`: simulated workers speak the real protocols well enough for a real router.

A real router process in front of 8 simulated prefill and 8 simulated decode workers (one
`pdserve sim` process, each worker on its own loopback address): concurrent requests come back
with the tokens the simulation promises (the prompt's own, cycled), the profile's prefill time
in their Timing, over the prefill pool and the handoff or decode-first, spread over the pools;
every reservation's pages come back. The profile and the addresses are checked on their own.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from pdserve.router.mux import DecodeStreams
from pdserve.sim.host import SimConfig
from pdserve.sim.profile import SimProfile
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc

from tests.support import free_port, pdserve_argv, running, wait_for

pytestmark = pytest.mark.service
WORKERS = 8


def sim_pool(prefill: int, decode: int, third_octet: int
             ) -> tuple[list[str], list[str], list[str]]:
    """A `pdserve sim` command for `prefill` + `decode` workers from 127.X.third_octet.1 (X
    from the pid: tests running at once do not meet), and the two pools' addresses."""
    first = f"127.{os.getpid() % 200 + 20}.{third_octet}.1"
    pport, dport = free_port(), free_port()
    cfg = SimConfig(prefill=prefill, decode=decode, first_address=first, prefill_port=pport,
                    decode_port=dport)
    sim = pdserve_argv("sim", "--prefill", str(prefill), "--decode", str(decode),
                       "--first-address", first, "--prefill-port", str(pport),
                       "--decode-port", str(dport))
    return sim, cfg.addresses("prefill"), cfg.addresses("decode")


def test_profile_times_and_a_profile_file(tmp_path) -> None:
    p = SimProfile(prefill_base_ms=1.0, prefill_ms_per_token=0.5, decode_base_ms=2.0,
                   decode_ms_per_seq=0.25, handoff_base_ms=0.5, handoff_gb_s=2.0,
                   block_size=16)
    assert p.prefill_ms(10) == 6.0
    assert p.decode_step_ms(4) == 3.0
    assert p.handoff_ms(4_000_000) == 2.5  # 0.5 + 4 MB at 2 GB/s
    assert (p.pages(1), p.pages(16), p.pages(17)) == (1, 1, 2)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"prefill_ms_per_token": 0.1, "num_pages": 64}))
    loaded = SimProfile.load(path)
    assert (loaded.prefill_ms_per_token, loaded.num_pages) == (0.1, 64)
    assert loaded.decode_base_ms == SimProfile().decode_base_ms
    path.write_text(json.dumps({"prefill_ms": 3}))
    with pytest.raises(ValueError, match="unknown field.*prefill_ms"):
        SimProfile.load(path)
    with pytest.raises(ValueError, match="block_size=0"):
        SimProfile(block_size=0)


def test_addresses_and_refusals() -> None:
    cfg = SimConfig(prefill=2, decode=300, first_address="127.0.1.250", prefill_port=5,
                    decode_port=6)
    assert cfg.addresses("prefill") == ["127.0.1.250:5", "127.0.1.251:5"]
    assert cfg.addresses("decode")[6] == "127.0.2.0:6"  # on past the octet
    with pytest.raises(ValueError, match="loopback"):
        SimConfig(first_address="10.0.0.1")
    with pytest.raises(ValueError, match="loopback"):
        SimConfig(decode=10, first_address="127.255.255.250")
    with pytest.raises(ValueError, match="decode_port"):
        SimConfig(prefill_port=7, decode_port=7)


def _generate(stub: router_pb2_grpc.RouterStub, prompt: list[int], max_tokens: int
              ) -> tuple[list[int], dict]:
    tokens, timing = [], None
    for m in stub.Generate(router_pb2.GenerateRequest(token_ids=prompt, max_tokens=max_tokens,
                                                      temperature=0.0), timeout=60):
        if m.HasField("delta"):
            tokens += list(m.delta.token_ids)
        if m.HasField("timing"):
            timing = m.timing
    assert timing is not None
    return tokens, {"prefill_ms": timing.prefill_ms, "transport": timing.kv_transport,
                    "prefill": timing.prefill_worker, "decode": timing.decode_worker}


@pytest.mark.parametrize("remote_min", ["0", "256"])
def test_a_real_router_drives_a_simulated_pool(tiny_model_dir, remote_min) -> None:
    sim, prefill, decode = sim_pool(WORKERS, WORKERS, int(remote_min) % 250)
    rport = free_port()
    router = pdserve_argv("router", "--model", str(tiny_model_dir), "--port", str(rport),
                          "--http-port", "-1", "--metrics-port", "-1", "--prefill",
                          ",".join(prefill), "--decode", ",".join(decode),
                          "--remote-prefill-min-tokens", remote_min)
    profile = SimProfile()
    prompts = [[5 + (i * 7 + j) % 200 for j in range(20 + i)] for i in range(32)]
    with running(sim, decode[-1]), running(router, f"127.0.0.1:{rport}"), \
            grpc.insecure_channel(f"127.0.0.1:{rport}") as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda p: _generate(stub, p, 6), prompts))
        for prompt, (tokens, timing) in zip(prompts, results):
            assert tokens == [prompt[k % len(prompt)] for k in range(6)]
            assert timing["prefill_ms"] == pytest.approx(profile.prefill_ms(len(prompt)))
            assert timing["transport"] == ("sim" if remote_min == "0" else "")
        used_decode = {t["decode"] for _, t in results}
        used_prefill = {t["prefill"] for _, t in results}
        assert len(used_decode) >= 4, used_decode  # spread, not one worker
        if remote_min == "0":
            assert len(used_prefill) >= 4 and all(w.startswith("prefill@") for w in used_prefill)
        else:  # decode-first: each prompt computed where it decodes
            assert all(t["prefill"] == t["decode"] for _, t in results)
        # A client that leaves mid-stream: the router aborts the sequence on the worker (its
        # 3,000 tokens would take >= 9 s of simulated steps; the pages are back well before).
        call = stub.Generate(router_pb2.GenerateRequest(token_ids=prompts[0], max_tokens=3000,
                                                        temperature=0.0), timeout=60)
        assert any(m.HasField("delta") for m in (next(call), next(call)))
        call.cancel()

        def idle(address: str) -> bool:
            with grpc.insecure_channel(address) as ch:
                stats = decode_pb2_grpc.DecodeStub(ch).Stats(common_pb2.StatsRequest(), timeout=5)
            assert stats.num_pages == profile.num_pages
            return (stats.free_pages == stats.num_pages
                    and stats.running_sequences == stats.reserved_tickets == 0)

        assert wait_for(lambda: all(idle(a) for a in decode), timeout_s=6)  # all pages back


def test_an_idle_shared_decode_stream_is_closed_and_the_next_sequence_opens_a_new_one() -> None:
    """The router's DecodeMany stream to a worker (`pdserve.router.mux.DecodeStreams`): while a
    sequence is on it, it stays; once none has been for `idle_s`, `close_idle` ends it (its
    reader thread ends: the threads an open stream holds come back) and the next sequence
    starts a new stream, with the same tokens."""
    first = f"127.{os.getpid() % 200 + 20}.251.1"
    dport = free_port()
    sim = pdserve_argv("sim", "--prefill", "0", "--decode", "1", "--first-address", first,
                       "--decode-port", str(dport), "--prefill-port", str(free_port()))
    address = f"{first}:{dport}"
    prompt = [7, 8, 9, 10]

    def readers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("router-decode-many-")]

    with running(sim, address), grpc.insecure_channel(address) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        streams = DecodeStreams(stub, address)
        before = set(readers())

        def one(rid: str) -> list[int]:
            reply = stub.Reserve(decode_pb2.ReserveRequest(request_id=rid, num_prompt_tokens=4,
                                                           lease_ms=10_000), timeout=5)
            seq = streams.open(decode_pb2.DecodeRequest(
                ticket=reply.ticket, prompt_token_ids=prompt, first_token=prompt[0],
                sampling=common_pb2.SamplingParams(max_tokens=4)), "", None)
            assert streams.close_idle(0.0) is False  # a sequence is on it
            return [t for m in seq for t in m.token_ids]

        assert one("a") == [8, 9, 10]
        (reader,) = set(readers()) - before
        assert streams.close_idle(60.0) is False  # idle, but not for long enough
        assert streams.close_idle(0.0) is True
        reader.join(timeout=5)
        assert not reader.is_alive()
        assert one("b") == [8, 9, 10]  # on a new stream
        assert len(set(readers()) - before) == 1
        streams.close()


def test_simulated_workers_stream_n_tokens_to_a_message_as_real_ones_do() -> None:
    """DecodeRequest.stream_interval on a simulated worker, on a Decode call and on DecodeMany:
    the first message as it comes, then the tokens N at a time (what `pdserve bench router
    --router-arg=--stream-interval=N` measures)."""
    first = f"127.{os.getpid() % 200 + 20}.250.1"
    dport = free_port()
    sim = pdserve_argv("sim", "--prefill", "0", "--decode", "1", "--first-address", first,
                       "--decode-port", str(dport), "--prefill-port", str(free_port()))
    address = f"{first}:{dport}"
    prompt = [7, 8, 9, 10, 11, 12]

    def start(rid: str) -> decode_pb2.DecodeRequest:
        reply = stub.Reserve(decode_pb2.ReserveRequest(request_id=rid, num_prompt_tokens=6,
                                                       lease_ms=10_000), timeout=5)
        return decode_pb2.DecodeRequest(
            ticket=reply.ticket, prompt_token_ids=prompt, first_token=prompt[0],
            sampling=common_pb2.SamplingParams(max_tokens=6), stream_interval=2)

    with running(sim, address), grpc.insecure_channel(address) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        messages = list(stub.Decode(start("call"), timeout=10))
        assert [list(m.token_ids) for m in messages] == [[], [8, 9], [10, 11], [12]]
        assert messages[-1].finish_reason == "length"
        streams = DecodeStreams(stub, address)
        seq = streams.open(start("many"), "", None)
        assert [list(m.token_ids) for m in seq] == [[], [8, 9], [10, 11], [12]]
        streams.close()


def test_two_routers_share_one_pool(tiny_model_dir) -> None:
    """Routers are stateless replicas: two of them in front of the same 8 + 8 simulated
    workers, requests sent to both at once, each placing by what it sees (the workers' Stats
    and its own calls): every request comes back right, both spread over the pool, and every
    reservation of either is released on the workers."""
    sim, prefill, decode = sim_pool(WORKERS, WORKERS, 252)
    ports = [free_port(), free_port()]

    def router(port: int) -> list[str]:
        return pdserve_argv("router", "--model", str(tiny_model_dir), "--port", str(port),
                            "--http-port", "-1", "--metrics-port", "-1", "--prefill",
                            ",".join(prefill), "--decode", ",".join(decode),
                            "--remote-prefill-min-tokens", "0")

    prompts = [[5 + (i * 11 + j) % 200 for j in range(16 + i % 9)] for i in range(48)]
    with running(sim, decode[-1]), running(router(ports[0]), f"127.0.0.1:{ports[0]}"), \
            running(router(ports[1]), f"127.0.0.1:{ports[1]}"), \
            grpc.insecure_channel(f"127.0.0.1:{ports[0]}") as a, \
            grpc.insecure_channel(f"127.0.0.1:{ports[1]}") as b:
        stubs = [router_pb2_grpc.RouterStub(a), router_pb2_grpc.RouterStub(b)]
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda i: _generate(stubs[i % 2], prompts[i], 5),
                                    range(len(prompts))))
        for prompt, (tokens, _) in zip(prompts, results):
            assert tokens == [prompt[k % len(prompt)] for k in range(5)]
        for which in (0, 1):
            mine = results[which::2]
            assert len({t["decode"] for _, t in mine}) >= 6, which
            assert len({t["prefill"] for _, t in mine}) >= 6, which

        def idle(address: str) -> bool:
            with grpc.insecure_channel(address) as ch:
                stats = decode_pb2_grpc.DecodeStub(ch).Stats(common_pb2.StatsRequest(), timeout=5)
            return stats.free_pages == stats.num_pages and stats.reserved_tickets == 0

        assert wait_for(lambda: all(idle(d) for d in decode), timeout_s=6)


def test_simulated_workers_announce_their_prefix_cache_and_the_router_uses_it(tiny_model_dir):
    """Each simulated worker announces the pages of the prompts it computed on CacheEvents
    (a snapshot, then changes, keys as pdserve.common.prefix chains them), computes only what
    its cache lacks, and a real router places a prompt sharing a prefix where that prefix is."""
    from pdserve.common.prefix import page_keys, root_key
    from pdserve.sim.cache import fingerprint
    from pdserve.v1 import prefill_pb2, prefill_pb2_grpc

    sim, prefill, decode = sim_pool(4, 4, 253)
    rport = free_port()
    profile = SimProfile()
    prefix = [7 + j % 150 for j in range(64)]  # four full pages
    with running(sim, decode[-1]):
        with grpc.insecure_channel(prefill[0]) as ch:
            events = prefill_pb2_grpc.PrefillStub(ch).CacheEvents(
                common_pb2.CacheEventsRequest(heartbeat_ms=5000), timeout=30)
            snapshot = next(events)
            assert snapshot.snapshot and list(snapshot.stored) == []
            prompt = prefix + [1, 2, 3]
            reply = prefill_pb2_grpc.PrefillStub(ch).Prefill(prefill_pb2.PrefillRequest(
                request_id="p1", token_ids=prompt), timeout=10)
            change = next(events)
            root = root_key(fingerprint(profile))
            assert (change.snapshot, change.sequence) == (False, 1)
            assert list(change.stored) == page_keys(root, prompt, 16, 4)
            assert reply.cached_tokens == 0
            again = prefill_pb2_grpc.PrefillStub(ch).Prefill(prefill_pb2.PrefillRequest(
                request_id="p2", token_ids=prefix + [9]), timeout=10)
            assert again.cached_tokens == 64  # the four pages before its last token
            assert again.prefill_ms == pytest.approx(profile.prefill_ms(65 - 64))
            events.cancel()
        router = pdserve_argv("router", "--model", str(tiny_model_dir), "--port", str(rport),
                              "--http-port", "-1", "--metrics-port", "-1", "--prefill",
                              ",".join(prefill), "--decode", ",".join(decode),
                              "--remote-prefill-min-tokens", "0")
        with running(router, f"127.0.0.1:{rport}"), \
                grpc.insecure_channel(f"127.0.0.1:{rport}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            shared = [11 + j % 170 for j in range(96)]
            _, one = _generate(stub, shared + [4, 5], 3)
            for k in range(3):
                _, other = _generate(stub, shared + [6 + k], 3)
                assert other["prefill"] == one["prefill"], k  # where the prefix already is


def test_a_router_at_its_stream_limit_refuses_the_next_at_once(tiny_model_dir) -> None:
    """--max-streams bounds the Generate streams a router serves: one more is refused at once
    (RESOURCE_EXHAUSTED, naming the flag) instead of queueing until its deadline; health still
    answers; a freed slot serves again."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    first = f"127.{os.getpid() % 200 + 20}.254.1"
    pport, dport, rport = free_port(), free_port(), free_port()
    sim = pdserve_argv("sim", "--prefill", "1", "--decode", "1", "--first-address", first,
                       "--prefill-port", str(pport), "--decode-port", str(dport))
    router = pdserve_argv("router", "--model", str(tiny_model_dir), "--port", str(rport),
                          "--http-port", "-1", "--metrics-port", "-1", "--prefill",
                          f"{first}:{pport}", "--decode", f"{first}:{dport}",
                          "--remote-prefill-min-tokens", "0", "--max-streams", "2")
    long = router_pb2.GenerateRequest(token_ids=[5, 6, 7, 8], max_tokens=3000, temperature=0.0,
                                      ignore_eos=True)
    with running(sim, f"{first}:{dport}"), running(router, f"127.0.0.1:{rport}"), \
            grpc.insecure_channel(f"127.0.0.1:{rport}") as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        busy = [stub.Generate(long, timeout=60) for _ in range(2)]
        for call in busy:
            assert next(call).HasField("delta")  # both are streaming
        with pytest.raises(grpc.RpcError) as refused:
            next(stub.Generate(long, timeout=10))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit of 2 Generate streams (--max-streams)" in refused.value.details()
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=5)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        busy[0].cancel()

        def served() -> bool:
            try:
                return _generate(stub, [5, 6, 7, 8], 3)[0] == [5, 6, 7]
            except grpc.RpcError as exc:  # the cancelled stream's slot is not back yet
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                return False

        assert wait_for(served, timeout_s=10)
        busy[1].cancel()


def test_a_pool_past_the_stream_limit_has_its_cache_read_with_its_stats(tiny_model_dir) -> None:
    """Beyond FOLLOW_MAX_WORKERS a router follows the workers' caches through the Stats reads
    it makes anyway: the first read of a worker brings a snapshot, later ones the changes after
    the cursor sent (a wrong epoch or a cursor the log does not keep: a snapshot again). Two
    real routers in front of 200 + 200 simulated workers: a prefix one of them placed reaches
    the other's index within a read round and is then sent to the same prefill worker, which
    only the worker's events can have told it."""
    import re
    import urllib.request

    from pdserve.common.prefix import page_keys, root_key
    from pdserve.router.cache_feed import FOLLOW_MAX_WORKERS
    from pdserve.sim.cache import fingerprint
    from pdserve.v1 import prefill_pb2, prefill_pb2_grpc

    n = 200
    assert 2 * n > FOLLOW_MAX_WORKERS
    sim, prefill, decode = sim_pool(n, n, 248)
    metrics = free_port()
    ask = common_pb2.StatsRequest
    with running(sim, decode[-1]):
        with grpc.insecure_channel(prefill[7]) as ch:
            stub = prefill_pb2_grpc.PrefillStub(ch)
            snap = stub.Stats(ask(cache_events=True), timeout=5).cache
            assert snap.snapshot and list(snap.stored) == [] and snap.sequence >= 1
            assert not stub.Stats(ask(), timeout=5).HasField("cache")  # only when asked
            prompt = [3 + j % 190 for j in range(40)]  # two full pages before its last token
            stub.Prefill(prefill_pb2.PrefillRequest(request_id="p", token_ids=prompt),
                         timeout=10)
            change = stub.Stats(ask(cache_events=True, cache_epoch=snap.epoch,
                                    cache_sequence=snap.sequence), timeout=5).cache
            assert (change.snapshot, change.since) == (False, snap.sequence)
            assert list(change.stored) == page_keys(root_key(fingerprint(SimProfile())),
                                                    prompt, 16, 2)
            for epoch, seq in ((snap.epoch + 1, change.sequence), (snap.epoch, 10**9)):
                again = stub.Stats(ask(cache_events=True, cache_epoch=epoch,
                                       cache_sequence=seq), timeout=5).cache
                assert again.snapshot and list(again.stored) == list(change.stored)

        def router(port: int, metrics_port: int) -> list[str]:
            return pdserve_argv("router", "--model", str(tiny_model_dir), "--port", str(port),
                                "--http-port", "-1", "--metrics-port", str(metrics_port),
                                "--prefill", ",".join(prefill), "--decode", ",".join(decode),
                                "--remote-prefill-min-tokens", "0")

        def known_to_b(address: str) -> int:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as r:
                found = re.search(rf'^pdserve_router_cache_index_pages{{worker="{address}"}} '
                                  r"(\S+)$", r.read().decode(), re.M)
            return int(float(found.group(1))) if found else 0

        ports = [free_port(), free_port()]
        with running(router(ports[0], -1), f"127.0.0.1:{ports[0]}"), \
                running(router(ports[1], metrics), f"127.0.0.1:{ports[1]}"), \
                grpc.insecure_channel(f"127.0.0.1:{ports[0]}") as a, \
                grpc.insecure_channel(f"127.0.0.1:{ports[1]}") as b:
            one, other = router_pb2_grpc.RouterStub(a), router_pb2_grpc.RouterStub(b)
            for k in range(2):
                shared = [11 + (j * (k + 2)) % 170 for j in range(64)]
                where = _generate(one, shared + [4], 2)[1]["prefill"]
                address = where.split("@", 1)[1]
                # 400 workers read 100 a second: each within ~4 s, bounded here at 20
                assert wait_for(lambda a=address: known_to_b(a) >= 4, timeout_s=20), where
                assert _generate(other, shared + [5], 2)[1]["prefill"] == where, k
