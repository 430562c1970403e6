"""The least a Python gRPC router can do per request: the baseline `pdserve bench router
--floor` sets beside pdserve's router, in front of the same simulated workers.

    python -m pdserve.bench.router_floor --kind aio --port P --prefill A,B --decode C,D

It serves Router.Generate (token ids only) and does what every disaggregated request needs and
nothing more: Reserve on a decode worker, Prefill with its ticket on a prefill worker, the
Decode stream, its tokens relayed as they come (`--stream-interval`: N to a message), the
Timing and the Finish; with `--remote-prefill-min-tokens`, a shorter prompt is prefilled on
the decode worker (a Reserve and a Decode call, no Prefill) as pdserve's router does. Workers are
taken in turn (no placement, no health checks, no Stats, no retries, no tokenizer, no
metrics, no tracing, no logging). `--kind aio`: one asyncio loop (grpc.aio server and
clients); `--kind sync`: the thread-pool server and blocking client calls (the cheapest sync
calls: no `.future()`, so nothing can cancel them). What pdserve's router costs beyond this is
its own work; what this costs is Python gRPC's, the part no change inside a router removes.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)

LEASE_MS = 30_000.0
TIMEOUT_S = 30.0
MAX_STREAMS = 256  # in flight at once, beyond: RESOURCE_EXHAUSTED (pdserve's --max-streams)
BUSY = "the floor router is serving its limit of Generate streams"


@dataclass(frozen=True)
class Shape:
    """What a floor asks of the workers, as pdserve's router would be told."""

    interval: int = 1    # tokens a Decode message after the first (--stream-interval)
    here_below: int = 0  # prompts shorter prefill on the decode worker (0: none; pdserve's
                         # --remote-prefill-min-tokens): a Reserve and a Decode call, no Prefill


class _Request:
    """One Generate as both floors run it: the calls to make, and what to send back."""

    def __init__(self, request: router_pb2.GenerateRequest, index: int, shape: Shape):
        self.ids, self.rid = request.token_ids, request.request_id or f"floor{index}"
        self.interval = shape.interval  # DecodeRequest.stream_interval: tokens a message
        self.sampling = common_pb2.SamplingParams(temperature=0.0, ignore_eos=True,
                                                  max_tokens=request.max_tokens or 8)
        self.reserve = decode_pb2.ReserveRequest(
            request_id=self.rid, num_prompt_tokens=len(self.ids), lease_ms=LEASE_MS,
            prompt_token_ids=self.ids, prefill_here_below_tokens=shape.here_below,
            sampling=self.sampling)
        self.tokens, self.reason = 0, ""
        self.here = ""  # the decode worker prefilling the prompt, until its Timing went out

    def prefill(self, held: decode_pb2.ReserveResponse) -> prefill_pb2.PrefillRequest:
        return prefill_pb2.PrefillRequest(request_id=self.rid, token_ids=self.ids,
                                          sampling=self.sampling, ticket=held.ticket,
                                          destination=held.destination)

    def started(self, held: decode_pb2.ReserveResponse, reply: prefill_pb2.PrefillResponse
                ) -> tuple[list[router_pb2.GenerateResponse], decode_pb2.DecodeRequest | None]:
        """The first token and the Timing; the Decode call to open (None: nothing more)."""
        sent = [self._delta([reply.first_token]),
                self._timing(reply.worker_id, held.ticket.decode_worker, reply.prefill_ms)]
        if self.tokens >= self.sampling.max_tokens:
            return sent, None
        return sent, decode_pb2.DecodeRequest(ticket=held.ticket, prompt_token_ids=self.ids,
                                              first_token=reply.first_token,
                                              sampling=self.sampling,
                                              stream_interval=self.interval)

    def local(self, held: decode_pb2.ReserveResponse) -> decode_pb2.DecodeRequest:
        """The Decode call of a prompt the decode worker computes itself (it said so at
        Reserve): its first message brings the first token, then the Timing goes out."""
        self.here = held.ticket.decode_worker
        return decode_pb2.DecodeRequest(ticket=held.ticket, prompt_token_ids=self.ids,
                                        local_prefill=True, sampling=self.sampling,
                                        stream_interval=self.interval)

    def relay(self, message: decode_pb2.DecodeResponse) -> list[router_pb2.GenerateResponse]:
        """A Decode message's tokens as a delta (none: it had none), and after a local
        prefill's first token the Timing; `reason` set at the end."""
        self.reason = message.finish_reason
        out = [self._delta(message.token_ids)] if message.token_ids else []
        if out and self.here:
            out.append(self._timing(self.here, self.here, message.prefill_ms))
            self.here = ""
        return out

    def finish(self) -> router_pb2.GenerateResponse:
        return router_pb2.GenerateResponse(request_id=self.rid, finish=router_pb2.Finish(
            finish_reason=self.reason or "length", prompt_tokens=len(self.ids),
            completion_tokens=self.tokens))

    def _timing(self, prefill_worker: str, decode_worker: str, prefill_ms: float
                ) -> router_pb2.GenerateResponse:
        return router_pb2.GenerateResponse(request_id=self.rid, timing=router_pb2.Timing(
            prefill_worker=prefill_worker, decode_worker=decode_worker, prefill_ms=prefill_ms,
            attempts=1))

    def _delta(self, tokens: Any) -> router_pb2.GenerateResponse:
        self.tokens += len(tokens)
        return router_pb2.GenerateResponse(request_id=self.rid,
                                           delta=router_pb2.TokenDelta(token_ids=tokens))


class _Turns:
    """Workers of each role taken in turn."""

    def __init__(self, prefill: list[Any], decode: list[Any], shape: Shape):
        self._prefill, self._decode, self._shape = prefill, decode, shape
        self._next = itertools.count()

    def pick(self, request: router_pb2.GenerateRequest) -> tuple[_Request, Any, Any]:
        i = next(self._next)
        return (_Request(request, i, self._shape), self._prefill[i % len(self._prefill)],
                self._decode[i % len(self._decode)])


class AioFloor(router_pb2_grpc.RouterServicer):
    def __init__(self, prefill: list[str], decode: list[str], max_streams: int,
                 shape: Shape = Shape()):
        self._turns = _Turns(
            [prefill_pb2_grpc.PrefillStub(grpc.aio.insecure_channel(a)) for a in prefill],
            [decode_pb2_grpc.DecodeStub(grpc.aio.insecure_channel(a)) for a in decode], shape)
        self._free = max_streams

    async def Generate(self, request: router_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[router_pb2.GenerateResponse]:
        if self._free <= 0:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, BUSY)
        self._free -= 1
        try:
            async for message in self._generate(request):
                yield message
        except grpc.aio.AioRpcError as exc:  # a worker's answer, passed on as pdserve's are
            await context.abort(exc.code(), exc.details() or "")
        finally:
            self._free += 1

    async def _generate(self, request: router_pb2.GenerateRequest
                        ) -> AsyncIterator[router_pb2.GenerateResponse]:
        r, p, d = self._turns.pick(request)
        held = await d.Reserve(r.reserve, timeout=TIMEOUT_S)
        if held.prefilling_here:
            decode: decode_pb2.DecodeRequest | None = r.local(held)
        else:
            sent, decode = r.started(held, await p.Prefill(r.prefill(held), timeout=TIMEOUT_S))
            for message in sent:
                yield message
        if decode is not None:
            async for update in d.Decode(decode, timeout=TIMEOUT_S):
                for message in r.relay(update):
                    yield message
                if r.reason:
                    break
        yield r.finish()


class SyncFloor(router_pb2_grpc.RouterServicer):
    def __init__(self, prefill: list[str], decode: list[str], max_streams: int,
                 shape: Shape = Shape()):
        self._turns = _Turns(
            [prefill_pb2_grpc.PrefillStub(grpc.insecure_channel(a)) for a in prefill],
            [decode_pb2_grpc.DecodeStub(grpc.insecure_channel(a)) for a in decode], shape)
        self._slots = threading.BoundedSemaphore(max_streams)

    def Generate(self, request: router_pb2.GenerateRequest, context: grpc.ServicerContext
                 ) -> Iterator[router_pb2.GenerateResponse]:
        if not self._slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, BUSY)
        try:
            r, p, d = self._turns.pick(request)
            held = d.Reserve(r.reserve, timeout=TIMEOUT_S)
            if held.prefilling_here:
                decode: decode_pb2.DecodeRequest | None = r.local(held)
            else:
                sent, decode = r.started(held, p.Prefill(r.prefill(held), timeout=TIMEOUT_S))
                yield from sent
            for update in d.Decode(decode, timeout=TIMEOUT_S) if decode is not None else ():
                yield from r.relay(update)
                if r.reason:
                    break
            yield r.finish()
        except grpc.RpcError as exc:
            context.abort(exc.code(), exc.details() or "")
        finally:
            self._slots.release()


async def _serve_aio(args: argparse.Namespace) -> None:
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(
        AioFloor(args.prefill.split(","), args.decode.split(","), args.max_streams,
                 Shape(args.stream_interval, args.remote_prefill_min_tokens)), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    await server.wait_for_termination()


def _serve_sync(args: argparse.Namespace) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=args.max_streams + 8))
    router_pb2_grpc.add_RouterServicer_to_server(
        SyncFloor(args.prefill.split(","), args.decode.split(","), args.max_streams,
                 Shape(args.stream_interval, args.remote_prefill_min_tokens)), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    server.wait_for_termination()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.router_floor",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=("aio", "sync"), default="aio")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True, help="prefill addresses, comma-separated")
    parser.add_argument("--decode", required=True, help="decode addresses, comma-separated")
    parser.add_argument("--max-streams", type=int, default=MAX_STREAMS,
                        help=f"Generate streams at once, more refused (default {MAX_STREAMS}, "
                             "as pdserve's router)")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="tokens per Decode message after the first (the workers hold "
                             "them; pdserve's router --stream-interval; default 1)")
    parser.add_argument("--remote-prefill-min-tokens", type=int, default=0,
                        help="shorter prompts are prefilled on the decode worker, with no "
                             "Prefill call (pdserve's router flag; default 0: none)")
    args = parser.parse_args(argv)
    try:
        if args.kind == "aio":
            asyncio.run(_serve_aio(args))
        else:
            _serve_sync(args)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
