"""`pdserve bench router --api http`: the load's requests over the router's OpenAI-compatible
HTTP API (POST /v1/completions, streamed as server-sent events) instead of gRPC.

The same requests as router_load.py's (token ids, greedy, EOS ignored, named `b<index>`
through `X-Request-Id` so the simulated workers' ledger matches them), on keep-alive
connections reused as an OpenAI client library reuses its pool, read on the same asyncio
loop with a small HTTP/1.1 reader (no client library: one would cost the harness more than
the router). A shot's TTFT is its first text, its tokens the usage chunk's, its workers the
`pdserve` object's; an error status is recorded as `HTTP <status>: <message>`.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from pdserve.bench.router_load import Shot

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]
# A connection idle this long is not reused: the router's HTTP server (uvicorn) closes one idle
# for 5 s, and a request sent as it does would fail for the client's reason, not the router's.
IDLE_REUSE_S = 4.0


class HttpLoad:
    """Requests to one router's HTTP port, `address` as host:port."""

    def __init__(self, address: str):
        self._host, port = address.rsplit(":", 1)
        self._port = int(port)
        self._idle: list[tuple[Connection, float]] = []  # with when it went idle

    async def one(self, shot: Shot, prompt: list[int], max_tokens: int,
                  timeout_s: float) -> None:
        """Send one request and read its stream into `shot`."""
        start = time.perf_counter()
        try:
            await asyncio.wait_for(self._send(shot, prompt, max_tokens, start), timeout_s)
        except asyncio.TimeoutError:
            shot.ok, shot.error = False, f"DEADLINE_EXCEEDED: no answer within {timeout_s:g} s"
        except (OSError, ValueError, asyncio.IncompleteReadError,
                asyncio.LimitOverrunError) as exc:
            shot.ok, shot.error = False, f"HTTP: {type(exc).__name__}: {exc}"
        shot.e2e_ms = (time.perf_counter() - start) * 1e3

    def close(self) -> None:
        for (_, writer), _ in self._idle:
            writer.close()
        self._idle.clear()

    async def _connection(self) -> tuple[Connection, bool]:
        """An idle connection young enough to reuse (True), else a new one (False)."""
        now = time.monotonic()
        while self._idle:
            connection, since = self._idle.pop()
            if now - since < IDLE_REUSE_S:
                return connection, True
            connection[1].close()
        return await asyncio.open_connection(self._host, self._port), False

    async def _send(self, shot: Shot, prompt: list[int], max_tokens: int,
                    start: float) -> None:
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens,  # the served model
                           "temperature": 0, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\n"
                   b"Content-Type: application/json\r\nX-Request-Id: %s\r\n"
                   b"Content-Length: %d\r\n\r\n%s"
                   % (self._host.encode(), shot.request_id.encode(), len(body), body))
        (reader, writer), reused = await self._connection()
        kept = False
        try:
            while True:
                try:
                    writer.write(request)
                    head = await reader.readuntil(b"\r\n\r\n")
                    break
                except (OSError, asyncio.IncompleteReadError):
                    if not reused:
                        raise
                    writer.close()  # closed by the server as it went idle: once more, anew
                    reader, writer = await asyncio.open_connection(self._host, self._port)
                    reused = False
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            headers = {k.strip().lower(): v.strip() for k, _, v in
                       (line.partition(":") for line in lines[1:] if line)}
            if headers.get("transfer-encoding", "").lower() == "chunked":
                await _read_events(reader, shot, start)
            else:
                payload = await reader.readexactly(int(headers.get("content-length", "0")))
                _event(shot, b"data: " + payload, start)
            if status != 200:
                shot.error = f"HTTP {status}" + (f": {shot.error}" if shot.error else "")
            kept = headers.get("connection", "").lower() != "close"
        finally:
            if kept:
                self._idle.append(((reader, writer), time.monotonic()))
            else:
                writer.close()


async def _read_events(reader: asyncio.StreamReader, shot: Shot, start: float) -> None:
    """A chunked body of server-sent events, each handed to `_event` as it completes."""
    pending = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
        if size == 0:
            await reader.readuntil(b"\r\n")  # no trailers are sent
            return
        pending += (await reader.readexactly(size + 2))[:-2]
        while b"\n\n" in pending:
            event, pending = pending.split(b"\n\n", 1)
            _event(shot, event, start)


def _event(shot: Shot, event: bytes, start: float) -> None:
    if not event.startswith(b"data: "):
        return
    payload = event[6:]
    if payload == b"[DONE]":
        shot.ok = not shot.error
        return
    message: dict[str, Any] = json.loads(payload)
    if "error" in message:
        shot.error = str(message["error"].get("message", message["error"]))
        return
    if message.get("choices"):
        shot.deltas += 1
        if shot.ttft_ms is None:  # the first token's chunk
            shot.ttft_ms = (time.perf_counter() - start) * 1e3
    if message.get("usage"):
        shot.tokens = message["usage"].get("completion_tokens", 0)
    timing = (message.get("pdserve") or {}).get("timing")
    if timing:
        shot.prefill = timing.get("prefill_worker", "")
        shot.decode = timing.get("decode_worker", "")
