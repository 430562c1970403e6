"""The HTTP load of `pdserve bench router --api http` reads what the router's OpenAI API sends:
a chunked event stream (events split across chunks and chunks holding several events), an
error status with OpenAI's error body, and it keeps a connection only when the server does.
Against a real socket server on loopback that answers like the router."""

from __future__ import annotations

import asyncio
import json

from pdserve.bench.router_http import HttpLoad
from pdserve.bench.router_load import Shot


def _sse(message: object) -> bytes:
    return b"data: " + json.dumps(message).encode() + b"\n\n"


STREAM = (_sse({"choices": [{"index": 0, "text": "He", "finish_reason": None}]})
          + _sse({"choices": [{"index": 0, "text": "llo", "finish_reason": None}]})
          + _sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
          + _sse({"choices": [], "usage": {"completion_tokens": 3},
                  "pdserve": {"timing": {"prefill_worker": "p1", "decode_worker": "d1"}}})
          + b"data: [DONE]\n\n")
REFUSED = json.dumps({"error": {"message": "the router is serving its limit of 1 Generate "
                                           "streams (--max-streams)", "code": 429}}).encode()


async def _serve(seen: list[bytes], connections: list[int]) -> asyncio.base_events.Server:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            body = json.loads(await reader.readexactly(length))
            seen.append(head)
            if body["max_tokens"] == 99:  # refused, then the connection closed
                writer.write(b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json"
                             b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(REFUSED), REFUSED))
                await writer.drain()
                break
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            for part in (STREAM[:7], STREAM[7:90], STREAM[90:]):  # events cut anywhere
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            if body["max_tokens"] == 4:  # then gone, as an idle connection the server drops
                break
        writer.close()
    return await asyncio.start_server(answer, "127.0.0.1", 0)


def test_the_http_load_reads_streams_and_errors_and_reuses_connections() -> None:
    async def run() -> tuple[list[Shot], list[bytes], list[int]]:
        seen: list[bytes] = []
        connections: list[int] = []
        server = await _serve(seen, connections)
        port = server.sockets[0].getsockname()[1]
        load = HttpLoad(f"127.0.0.1:{port}")
        shots = [Shot(i, 0.0) for i in range(4)]
        await load.one(shots[0], [11, 12], 3, 5.0)
        await load.one(shots[1], [11, 12], 4, 5.0)  # on the same connection, then it closes
        await asyncio.sleep(0.05)
        await load.one(shots[2], [11, 12], 3, 5.0)  # finds it closed: sent again, anew
        await load.one(shots[3], [13], 99, 5.0)
        load.close()
        server.close()
        await server.wait_closed()
        return shots, seen, connections

    shots, seen, connections = asyncio.run(run())
    for shot in shots[:3]:
        assert shot.ok and shot.error == "" and shot.tokens == 3
        assert (shot.prefill, shot.decode) == ("p1", "d1")
        assert shot.ttft_ms is not None and shot.e2e_ms is not None
        assert 0 < shot.ttft_ms <= shot.e2e_ms
    assert [head.split(b"X-Request-Id: ")[1][:2] for head in seen] == [b"b0", b"b1", b"b2", b"b3"]
    assert len(connections) == 2  # kept alive for the second request, a new one for the third
    refused = shots[3]
    assert not refused.ok and refused.error.startswith("HTTP 429: the router is serving")
