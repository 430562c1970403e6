"""The router's OpenAI-compatible HTTP API as an ASGI app (Starlette): the only place HTTP is
read or written. Protobuf never enters here; the lifecycle never sees HTTP.

    POST /v1/completions, POST /v1/chat/completions   streamed (SSE) or not
    GET  /v1/models, /v1/models/{model}               503 (as /health) until ready
    GET  /health                                      200 while the router is ready, else 503
    GET  /metrics                                     the router's Prometheus text

A request body becomes a `GenerateInput` (http_schema.py), runs through
`Lifecycle.generate` on a worker thread (http_bridge.py) in the caller's trace (its
`traceparent` header), and its events become OpenAI responses (http_format.py). Errors before
the first token are HTTP statuses in OpenAI's error shape; after it, an error chunk ends the
stream. A client that disconnects (during prefill or mid-stream) cancels the request through
its `CallScope`, which frees its pages on both workers. With API keys, every endpoint but
/health and /metrics needs `Authorization: Bearer <key>`.

Readiness: the model list answers 200 only when /health does (a healthy prefill and decode
worker, not draining), else 503 with /health's reason, so a client that waits for
/v1/models before its first request never meets "no healthy decode worker".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import Any

from pdserve.common import tracing
from pdserve.common.errors import ServiceError
from pdserve.common.security import ApiKeys
from pdserve.router.cancel import CallScope
from pdserve.router.http_bridge import EventStream
from pdserve.router.http_format import (
    Answer,
    error_body,
    retry_headers,
    service_error_body,
    sse,
)
from pdserve.router.http_schema import (
    MAX_BODY_BYTES,
    BadRequest,
    OpenAIRequest,
    parse_chat,
    parse_completion,
    parse_json,
)
from pdserve.router.lifecycle import Lifecycle
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

log = logging.getLogger("pdserve.router")

API = "http"  # the label of this front door in metrics and logs
TRACE_HEADERS = ("traceparent", "tracestate")


def error_response(status: int, message: str, *, param: str | None = None,
                   code: str | None = None, headers: Mapping[str, str] | None = None
                   ) -> JSONResponse:
    return JSONResponse(error_body(status, message, param=param, code=code), status,
                        headers={**retry_headers(status), **(headers or {})})


class HttpApi:
    """The endpoints, bound to one router's lifecycle."""

    def __init__(self, lifecycle: Lifecycle, executor: Executor, *, ready: Callable[[], bool],
                 api_keys: ApiKeys | None = None, unready_reason: Callable[[], str] | None = None):
        self._lifecycle = lifecycle
        self._executor = executor
        self._ready = ready
        self._unready_reason = unready_reason
        self._keys = api_keys
        self._started = int(time.time())

    def app(self) -> Starlette:
        routes = [Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.metrics, methods=["GET"])]
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_exception,
                                                            Exception: _internal_error})

    # --- open endpoints ----------------------------------------------------------------------

    def _unready(self) -> str:
        """Why the router cannot serve a request now ("" when it can): /health's status."""
        if self._lifecycle.draining:
            return "draining"
        if self._ready():
            return ""
        why = self._unready_reason() if self._unready_reason is not None else ""
        return f"not ready: {why or 'no healthy prefill and decode worker'}"

    async def health(self, request: Request) -> Response:
        why = self._unready()
        if why:
            return JSONResponse({"status": why}, 503, headers=retry_headers(503))
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self._lifecycle.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    # --- endpoints behind API keys -----------------------------------------------------------

    def _refusal(self, request: Request) -> Response | None:
        if self._keys is None:
            return None
        why = self._keys.check(request.headers.get("authorization"))
        if why is None:
            return None
        return error_response(401, why, code="invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})

    def _model_card(self) -> dict[str, Any]:
        """OpenAI's model object, with vLLM's `max_model_len`: the context served, prompt +
        max_tokens (longer requests are refused with a 400)."""
        card: dict[str, Any] = {"id": self._lifecycle.model_name, "object": "model",
                                "created": self._started, "owned_by": "pdserve"}
        if self._lifecycle.max_model_len is not None:
            card["max_model_len"] = self._lifecycle.max_model_len
        return card

    def _refusal_or_unready(self, request: Request) -> Response | None:
        """A missing key's 401, else /health's 503 while the router cannot serve."""
        refused = self._refusal(request)
        if refused is not None:
            return refused
        why = self._unready()
        return error_response(503, why, code="unavailable") if why else None

    async def models(self, request: Request) -> Response:
        return self._refusal_or_unready(request) or JSONResponse(
            {"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        refused = self._refusal_or_unready(request)
        if refused is not None:
            return refused
        name = request.path_params["model"]
        if name != self._lifecycle.model_name:
            return self._unknown_model(name)
        return JSONResponse(self._model_card())

    def _unknown_model(self, name: str) -> Response:
        return error_response(404, f"The model {name!r} does not exist: this server serves "
                              f"{self._lifecycle.model_name!r} (see /v1/models)",
                              param="model", code="model_not_found")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, parse_chat)

    async def _generate(self, request: Request,
                        parse: Callable[[Mapping[str, Any], str], OpenAIRequest]) -> Response:
        received = time.monotonic()  # the lifecycle's TTFT clock starts here
        refused = self._refusal(request)
        if refused is not None:
            return refused
        try:
            parsed = parse(parse_json(await _body(request)),
                           request.headers.get("x-request-id", ""))
        except BadRequest as exc:
            self._lifecycle.metrics.refused("INVALID_ARGUMENT", API)
            return error_response(exc.status, exc.message, param=exc.param, code=exc.code)
        if parsed.model and parsed.model != self._lifecycle.model_name:
            self._lifecycle.metrics.refused("NOT_FOUND", API)
            return self._unknown_model(parsed.model)
        scope = CallScope()
        stream = EventStream(lambda: self._lifecycle.generate(parsed.input, scope, received,
                                                              api=API, parking=True),
                             scope, asyncio.get_running_loop())
        context = tracing.caller_context({k: request.headers[k] for k in TRACE_HEADERS
                                          if k in request.headers})
        try:
            stream.start(self._executor, context)
        except RuntimeError:  # the executor is shut down: the router is stopping
            return error_response(503, "the router is stopping; send the request to another "
                                  "replica", code="unavailable")
        watcher = asyncio.ensure_future(_cancel_on_disconnect(request.receive, stream))
        answer = Answer(parsed.chat, self._lifecycle.model_name,
                        include_usage=parsed.include_usage,
                        return_token_ids=parsed.return_token_ids)
        try:
            first = await stream.batch()
            if not first:  # cancelled before anything was produced: the client is gone
                watcher.cancel()
                return Response(status_code=499)
            if parsed.stream:
                return EventSource(stream, first, answer, watcher)  # it owns the watcher now
            answer.feed(first)
            while events := await stream.batch():
                answer.feed(events)
            watcher.cancel()
            if answer.finish is None:  # cancelled
                return Response(status_code=499)
            return JSONResponse(answer.body())
        except ServiceError as exc:
            watcher.cancel()
            status, body = service_error_body(exc.code, exc.message)
            return JSONResponse(body, status, headers=retry_headers(status))
        except BaseException:
            watcher.cancel()
            stream.cancel()
            raise


class EventSource(Response):
    """A streamed answer: Server-Sent Events, one per batch of deltas, then the closing ones.
    Whatever ends it (the stream's end, an error, the client leaving, a server shutdown)
    cancels the request's work if it has not finished."""

    media_type = "text/event-stream"

    def __init__(self, stream: EventStream, first: list[Any], answer: Answer,
                 watcher: asyncio.Future[None]):
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._stream, self._first, self._answer, self._watcher = stream, first, answer, watcher

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = "http.response.body"
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            events = self._first
            while events:
                for data in self._answer.chunks(events):
                    await send({"type": body, "body": data, "more_body": True})
                events = await self._stream.batch()
            if self._answer.finish is not None:
                for data in self._answer.end():
                    await send({"type": body, "body": data, "more_body": True})
        except ServiceError as exc:  # after the first token: the stream ends with the error
            _, error = service_error_body(exc.code, exc.message)
            await send({"type": body, "body": sse(error), "more_body": True})
        except Exception as exc:  # a bug: named in the log and in the stream's last event
            log.exception("HTTP stream of request %s failed", self._answer.request_id)
            error = error_body(500, f"internal error: {type(exc).__name__}", code="internal")
            await send({"type": body, "body": sse(error), "more_body": True})
        finally:
            self._watcher.cancel()
            self._stream.cancel()
        await send({"type": body, "body": b"", "more_body": False})


async def _body(request: Request) -> bytes:
    """The request body, refused (413) past MAX_BODY_BYTES."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _too_large()
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large() -> BadRequest:
    return BadRequest(f"the request body is larger than {MAX_BODY_BYTES} bytes", status=413,
                      code="request_too_large")


async def _cancel_on_disconnect(receive: Receive, stream: EventStream) -> None:
    """Wait for the client to go away (the body is read: the next message is the disconnect),
    then cancel its request."""
    while (await receive())["type"] != "http.disconnect":
        pass
    stream.cancel()


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: f"no route {request.url.path}: see /v1/completions, /v1/chat/completions, "
                    "/v1/models, /health",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(
        exc.status_code, str(exc.detail))
    return error_response(exc.status_code, message, headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("HTTP %s %s failed: %r", request.method, request.url.path, exc, exc_info=exc)
    return error_response(500, f"internal error: {type(exc).__name__}", code="internal")
