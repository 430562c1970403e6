"""What a benchmark sends requests to: a pdserve router over gRPC (its Timing message gives the
TTFT components) or any OpenAI-compatible server over HTTP (/v1/completions, streamed), so
pdserve's own HTTP API, vLLM and SGLang are measured by the same client.

Both record the same things: time to the first token, the gap before every later chunk that
carried tokens, the end, the output token count; greedy, EOS ignored, prompts as token ids.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from abc import ABC, abstractmethod

import grpc
from pdserve.bench.loadgen.stats import RequestRecord
from pdserve.common.security import AUTH_HEADER, ChannelSecurity, open_channel
from pdserve.v1 import router_pb2, router_pb2_grpc

COMPONENTS = ("queue_ms", "prefill_ms", "kv_transfer_ms", "decode_start_ms", "ttft_ms")


class Target(ABC):
    """Sends one request and records what the client saw. Thread-safe."""

    name: str

    @abstractmethod
    def send(self, record: RequestRecord, prompt_ids: list[int], max_tokens: int,
             timeout_s: float) -> None:
        """Fill `record` (ok, times, tokens; `error` on failure); never raises for a failed
        request."""

    def close(self) -> None:  # noqa: B027 (most targets hold nothing to close)
        """Release connections."""


class _Clock:
    def __init__(self, record: RequestRecord):
        self.record = record
        self.start = time.perf_counter()
        self.last: float | None = None

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.record.ttft_ms = (now - self.start) * 1e3
        else:
            self.record.itl_ms.append((now - self.last) * 1e3)
        self.last = now
        self.record.output_tokens += n

    def end(self) -> None:
        self.record.e2e_ms = (time.perf_counter() - self.start) * 1e3


class GrpcTarget(Target):
    """`grpc://host:port` or `host:port`: a pdserve router."""

    def __init__(self, address: str, security: ChannelSecurity | None = None,
                 api_key: str = ""):
        self.address = address.removeprefix("grpc://")
        self.name = f"grpc://{self.address}"
        self._metadata = [(AUTH_HEADER, f"Bearer {api_key}")] if api_key else None
        self._channel = open_channel(self.address, security)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def send(self, record: RequestRecord, prompt_ids: list[int], max_tokens: int,
             timeout_s: float) -> None:
        clock = _Clock(record)
        request = router_pb2.GenerateRequest(token_ids=prompt_ids, max_tokens=max_tokens,
                                             temperature=0.0, ignore_eos=True)
        try:
            for msg in self._stub.Generate(request, timeout=timeout_s, metadata=self._metadata):
                kind = msg.WhichOneof("kind")
                if kind == "delta":
                    clock.tokens(len(msg.delta.token_ids))
                    record.output_ids += msg.delta.token_ids
                elif kind == "timing":
                    record.components = {k: getattr(msg.timing, k) for k in COMPONENTS}
                    record.cached_tokens = msg.timing.cached_tokens
                    record.workers = f"{msg.timing.prefill_worker} -> {msg.timing.decode_worker}"
                elif kind == "finish":
                    record.ok = True
        except grpc.RpcError as exc:
            record.error = f"{exc.code().name}: {exc.details()}"
        clock.end()

    def close(self) -> None:
        self._channel.close()


class OpenAITarget(Target):
    """`http://host:port[/v1]`: any server with the OpenAI completions API."""

    def __init__(self, base_url: str, model: str | None = None,
                 security: ChannelSecurity | None = None, api_key: str = ""):
        url = urllib.parse.urlsplit(base_url.rstrip("/"))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"target {base_url!r}: expected http://HOST:PORT[/v1]")
        self._https = url.scheme == "https"
        self._host, self._port = url.hostname, url.port or (443 if self._https else 80)
        self._prefix = url.path if url.path.endswith("/v1") else url.path + "/v1"
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._tls = security.ssl_client_context() if security and self._https else None
        self.name = f"{url.scheme}://{url.netloc}{self._prefix}"
        self.model = model or self._first_model()

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(self._host, self._port, timeout=timeout_s,
                                               context=self._tls)
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)

    def _first_model(self) -> str:
        conn = self._connection(30.0)
        try:
            conn.request("GET", f"{self._prefix}/models", headers=self._headers)
            reply = conn.getresponse()
            body = reply.read()
            if reply.status != 200:
                raise ConnectionError(f"{self.name}/models: HTTP {reply.status} {body[:200]!r}")
            models = json.loads(body)["data"]
            if not models:
                raise ConnectionError(f"{self.name}/models lists no model")
            return str(models[0]["id"])
        finally:
            conn.close()

    def send(self, record: RequestRecord, prompt_ids: list[int], max_tokens: int,
             timeout_s: float) -> None:
        clock = _Clock(record)
        body = json.dumps({"model": self.model, "prompt": prompt_ids, "max_tokens": max_tokens,
                           "temperature": 0.0, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True},
                           "return_token_ids": True})  # pdserve, vLLM: tokens per chunk
        conn = self._connection(timeout_s)
        try:
            conn.request("POST", f"{self._prefix}/completions", body=body,
                         headers={"Content-Type": "application/json", **self._headers})
            reply = conn.getresponse()
            if reply.status != 200:
                record.error = f"HTTP {reply.status}: {reply.read()[:300].decode(errors='replace')}"
                return
            self._read_stream(reply, record, clock)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        finally:
            clock.end()
            conn.close()

    @staticmethod
    def _read_stream(reply: http.client.HTTPResponse, record: RequestRecord,
                     clock: _Clock) -> None:
        usage_tokens = None
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                record.ok = True
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                record.error = f"stream error: {chunk['error']}"
                return
            choices = chunk.get("choices") or []
            ids = [c["token_ids"] for c in choices if isinstance(c.get("token_ids"), list)]
            if ids:  # the server says which tokens a chunk carries (even with no text yet)
                clock.tokens(sum(map(len, ids)))
                record.output_ids += [t for chunk_ids in ids for t in chunk_ids]
            elif "".join(c.get("text") or "" for c in choices):
                clock.tokens(1)  # a chunk with text: one arrival (counted again from usage)
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
                details = chunk["usage"].get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    record.cached_tokens = int(details["cached_tokens"])
            extra = chunk.get("pdserve") or {}
            timing = extra.get("timing") if isinstance(extra, dict) else None
            if isinstance(timing, dict):
                record.components = {k: float(timing[k]) for k in COMPONENTS if k in timing}
                record.workers = f"{timing.get('prefill_worker', '')} -> " \
                                 f"{timing.get('decode_worker', '')}"
        if usage_tokens is not None:
            record.output_tokens = int(usage_tokens)


def make_target(spec: str, model: str | None = None, security: ChannelSecurity | None = None,
                api_key: str = "") -> Target:
    """`grpc://HOST:PORT` (or HOST:PORT) for a pdserve router, `http(s)://HOST:PORT[/v1]` for an
    OpenAI-compatible server; `security` (TLS) and `api_key` (a bearer token) for both."""
    if spec.startswith(("http://", "https://")):
        return OpenAITarget(spec, model, security, api_key)
    return GrpcTarget(spec, security, api_key)
