"""The lifecycle's events -> OpenAI response bodies and Server-Sent Events; errors -> OpenAI's
error shape with the HTTP status of their gRPC code.

Every response carries pdserve's figures as an extra object, `"pdserve"`: the TTFT breakdown
(`timing`, the same numbers as the gRPC `Timing` message) and the request's latencies, in
the body of a non-streamed response, in the last chunk before `data: [DONE]` of a stream.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Iterable, Iterator
from typing import Any

from pdserve.router.api import Delta, Finish, StreamEvent, Timing

DONE = b"data: [DONE]\n\n"
RETRY_AFTER_S = 1
HTTP_STATUS = {  # gRPC status name -> HTTP status (google.rpc's mapping)
    "INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400,
    "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404, "ABORTED": 409,
    "ALREADY_EXISTS": 409, "RESOURCE_EXHAUSTED": 429, "CANCELLED": 499, "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "invalid_request_error",
               409: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error"}
_FIELD = re.compile(r"^([a-z_]+)(?:=| of \d)")  # `max_tokens=0: ...`, `prompt of 9 tokens: ...`
_PARAMS = {"token_ids": "prompt"}  # lifecycle field -> the HTTP request's field


def http_status(code: str) -> int:
    """The HTTP status of a gRPC status name (500 for the rest)."""
    return HTTP_STATUS.get(code, 500)


def retry_headers(status: int) -> dict[str, str]:
    """Retry-After on the statuses a client should retry later (429, 503)."""
    return {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else {}


def error_body(status: int, message: str, *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": code}}


def error_type(status: int) -> str:
    """OpenAI's error type of an HTTP status: any other 4xx (405 a method not allowed, ...) is
    the client's request, a 5xx the server's."""
    return ERROR_TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500
                                       else "server_error")


def service_error_body(code: str, message: str) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) of a lifecycle error; `param` is the field its message names."""
    status = http_status(code)
    match = _FIELD.match(message) if status == 400 else None
    param = _PARAMS.get(match.group(1), match.group(1)) if match else None
    return status, error_body(status, message, param=param, code=code.lower())


def sse(obj: dict[str, Any]) -> bytes:
    """One Server-Sent Event carrying `obj` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def pdserve_extra(timing: Timing | None, finish: Finish) -> dict[str, Any]:
    """The `"pdserve"` object: the TTFT breakdown and the request's latencies."""
    extra: dict[str, Any] = {"request_id": finish.request_id}
    if timing is not None:
        parts = dataclasses.asdict(timing)
        parts.pop("request_id")
        extra["timing"] = parts
    extra["latency"] = {"e2e_ms": finish.e2e_ms, "tpot_ms": finish.tpot_ms,
                        "itl_mean_ms": finish.itl_mean_ms, "itl_max_ms": finish.itl_max_ms}
    return extra


def usage(finish: Finish, timing: Timing | None = None) -> dict[str, Any]:
    """OpenAI's usage object; prompt_tokens_details.cached_tokens: prompt tokens whose KV
    came from a prefix cache instead of being computed for this request."""
    return {"prompt_tokens": finish.prompt_tokens, "completion_tokens": finish.completion_tokens,
            "total_tokens": finish.prompt_tokens + finish.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": timing.cached_tokens if timing else 0}}


class Answer:
    """The response to one request, built from its events as they come.

    Streaming: `chunks(events)` gives the SSE bytes for a batch of events (consecutive deltas
    in one batch become one chunk), `end()` the closing ones once Finish was seen. Not
    streaming: `feed(events)` every batch, then `body()`.
    """

    def __init__(self, chat: bool, model: str, *, include_usage: bool = False,
                 return_token_ids: bool = False):
        self.chat, self.model = chat, model
        self.include_usage, self.return_token_ids = include_usage, return_token_ids
        self.created = int(time.time())
        self.request_id = ""
        self.timing: Timing | None = None
        self.finish: Finish | None = None
        self._texts: list[str] = []
        self._token_ids: list[int] = []
        self._first_chunk = True
        self._frame: tuple[bytes, bytes] | None = None  # a delta chunk's bytes around its choice

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{self.request_id}"

    def _take(self, events: Iterable[StreamEvent]) -> tuple[str, list[int]] | None:
        """Note Timing and Finish; return the text and tokens of the deltas among `events`."""
        texts: list[str] = []
        ids: list[int] = []
        seen = False
        for event in events:
            self.request_id = event.request_id
            if isinstance(event, Delta):
                seen = True
                texts.append(event.text)
                ids.extend(event.token_ids)
            elif isinstance(event, Timing):
                self.timing = event
            else:
                self.finish = event
        return ("".join(texts), ids) if seen else None

    # --- not streamed ----------------------------------------------------------------------

    def feed(self, events: Iterable[StreamEvent]) -> None:
        delta = self._take(events)
        if delta is not None:
            self._texts.append(delta[0])
            self._token_ids.extend(delta[1])

    def body(self) -> dict[str, Any]:
        assert self.finish is not None
        text = "".join(self._texts)
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=self.finish.finish_reason)
        if self.return_token_ids:
            choice["token_ids"] = self._token_ids
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": usage(self.finish, self.timing),
                "pdserve": pdserve_extra(self.timing, self.finish)}

    # --- streamed --------------------------------------------------------------------------

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if self.chat
                 else "text_completion", "created": self.created, "model": self.model,
                 "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _choice(self, text: str, ids: list[int] | None, finish_reason: str | None
                ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if self._first_chunk:
                delta = {"role": "assistant", **delta}
            choice["delta"] = delta
        else:
            choice["text"] = text
        self._first_chunk = False
        choice.update(logprobs=None, finish_reason=finish_reason)
        if self.return_token_ids and ids is not None:
            choice["token_ids"] = ids
        return choice

    def chunks(self, events: Iterable[StreamEvent]) -> Iterator[bytes]:
        delta = self._take(events)
        if delta is None:
            return
        if self._first_chunk:
            yield sse(self._chunk([self._choice(delta[0], delta[1], None)]))
            return
        yield self._delta_chunk(*delta)

    def _delta_chunk(self, text: str, ids: list[int]) -> bytes:
        """What `sse(self._chunk([self._choice(text, ids, None)]))` gives after the first
        chunk, without building and encoding the whole object per token (the hot path)."""
        if self._frame is None:
            whole = self._chunk([self._choice("\0", [], None)])
            before, _, after = json.dumps(whole, separators=(",", ":")).partition('"\\u0000"')
            ending = after.encode() + b"\n\n"
            if self.return_token_ids:
                ending = ending[:ending.index(b'"token_ids":[') + len(b'"token_ids":[')]
            self._frame = (b"data: " + before.encode(), ending)
        head, tail = self._frame
        body = json.dumps(text).encode()
        if self.return_token_ids:
            return b"".join((head, body, tail, ",".join(map(str, ids)).encode(),
                             b"]}]" + (b',"usage":null}' if self.include_usage else b"}") +
                             b"\n\n"))
        return head + body + tail

    def end(self) -> Iterator[bytes]:
        """After Finish: the chunk with finish_reason, the usage chunk when asked, [DONE];
        the `pdserve` object rides on the last chunk before [DONE]."""
        assert self.finish is not None
        last = self._chunk([self._choice("", [], self.finish.finish_reason)])
        if self.include_usage:
            yield sse(last)
            last = self._chunk([])
            last["usage"] = usage(self.finish, self.timing)
        last["pdserve"] = pdserve_extra(self.timing, self.finish)
        yield sse(last)
        yield DONE
