"""The load of `pdserve bench router`: an open-loop stream of short requests on one asyncio
loop (grpc.aio), cheap enough per request that the router, not the client, is what saturates.

Requests arrive as a Poisson process at `rate`; each is greedy, EOS ignored, its own prompt
(no two share a first page, so placement spreads them as it would distinct users) given as
token ids and named `b<index>` so the simulated workers' ledger (pdserve.sim.workers.Ledger)
can be matched to it. A request is sent at its arrival time even when earlier ones have not
finished (open loop); `lag_ms` says how late the loop sent it, so a saturated client shows.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
from pdserve.v1 import router_pb2, router_pb2_grpc


@dataclass
class Shot:
    """One request as the client saw it; times in ms from its send, `at_s` from the start."""

    index: int
    at_s: float
    lag_ms: float = 0.0
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    tokens: int = 0
    deltas: int = 0  # the messages that carried them
    ok: bool = False
    error: str = ""
    prefill: str = ""
    decode: str = ""

    @property
    def request_id(self) -> str:
        return f"b{self.index}"


def prompt_ids(length: int, vocab: int, seed: int) -> list[int]:
    """A prompt of `length` ids drawn from [10, vocab) (clear of the special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(length)]


async def _one(stub: router_pb2_grpc.RouterStub, shot: Shot, prompt: list[int],
               max_tokens: int, timeout_s: float) -> None:
    request = router_pb2.GenerateRequest(token_ids=prompt, max_tokens=max_tokens,
                                         temperature=0.0, ignore_eos=True,
                                         request_id=shot.request_id)
    start = time.perf_counter()
    try:
        async for msg in stub.Generate(request, timeout=timeout_s):
            kind = msg.WhichOneof("kind")
            if kind == "delta":
                if shot.ttft_ms is None:
                    shot.ttft_ms = (time.perf_counter() - start) * 1e3
                shot.tokens += len(msg.delta.token_ids)
                shot.deltas += 1
            elif kind == "timing":
                shot.prefill, shot.decode = msg.timing.prefill_worker, msg.timing.decode_worker
            elif kind == "finish":
                shot.ok = True
    except grpc.RpcError as exc:
        shot.error = f"{exc.code().name}: {exc.details()}"
    shot.e2e_ms = (time.perf_counter() - start) * 1e3


class Sender(Protocol):
    """Another way to send the requests (router_http.HttpLoad: the OpenAI HTTP API)."""

    async def one(self, shot: Shot, prompt: list[int], max_tokens: int,
                  timeout_s: float) -> None: ...

    def close(self) -> None: ...


async def drive(address: str, *, rate: float, seconds: float, prompt: Callable[[int], list[int]],
                max_tokens: int, seed: int = 0, timeout_s: float = 30.0,
                at: list[tuple[float, Callable[[], None]]] | None = None,
                http: Sender | None = None) -> list[Shot]:
    """Send requests at `rate` per second for `seconds`, request i with `prompt(i)`; every one
    is awaited before this returns. `at`: (seconds from the start, callback) pairs run on the
    loop at those times (e.g. killing workers). `http`: a router_http.HttpLoad to send them
    with instead of gRPC to `address`."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    shots: list[Shot] = []
    tasks: list[asyncio.Task[None]] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        send = http.one if http is not None else functools.partial(_one, stub)
        start = loop.time()
        for offset, callback in at or []:
            loop.call_at(start + offset, callback)
        due = 0.0
        while due < seconds:
            wait = start + due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)  # pacing the arrival process
            shot = Shot(len(shots), due, lag_ms=max(0.0, loop.time() - start - due) * 1e3)
            shots.append(shot)
            tasks.append(asyncio.ensure_future(send(shot, prompt(shot.index), max_tokens,
                                                    timeout_s)))
            due += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        if http is not None:
            http.close()  # its kept connections, on this loop
    return shots
