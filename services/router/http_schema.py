"""OpenAI request bodies -> `GenerateInput`, with strict types: each refusal names its field.

Pure parsing, no I/O. Types are checked here (a string where a number belongs, a float where
an integer belongs, `true` where a number belongs); value ranges (temperature >= 0, top_p in
(0, 1], ...) are left to the lifecycle's one validation (validation.py), so both APIs refuse
the same values with the same words. Fields pdserve does not implement are refused when set
to anything but their neutral value; fields it does not know are ignored, as OpenAI-compatible
servers commonly do.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.router.api import ChatMessage, GenerateInput
from pdserve.router.validation import CHAT_ROLES

MAX_BODY_BYTES = 4 * 1024 * 1024  # as the gRPC port's largest message
INT32 = (-(2**31), 2**31 - 1)  # integer fields travel between the services as int32,
FLOAT32_MAX = 3.4028234663852886e38  # numbers as float32
# Fields accepted only with a neutral value: anything else is a 400 naming the field.
UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
    "logprobs": (None, False), "top_logprobs": (None, 0),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


class BadRequest(Exception):
    """A request refused before it reached the lifecycle: HTTP `status` with a message,
    the offending `param` and an OpenAI error `code`."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 code: str = "invalid_argument"):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


@dataclass(frozen=True)
class OpenAIRequest:
    """One parsed request: what to generate and how to answer."""

    chat: bool
    input: GenerateInput
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False  # extension (as vLLM): each choice carries its token ids


def parse_json(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object."""
    try:
        doc = json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise BadRequest(f"the request body is not valid JSON: {_short(str(exc))}") from None
    if not isinstance(doc, dict):
        raise BadRequest(f"the request body must be a JSON object, not {_kind(doc)}")
    if _SURROGATE_ESCAPE.search(body):
        _refuse_lone_surrogates(doc)
    return doc


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(doc: Any) -> None:
    """A `\\ud800` escape without its pair decodes to a string that is not Unicode text (no
    tokenizer or UTF-8 encoder takes it): refuse it here, naming where it is."""
    stack: list[tuple[str, Any]] = [("", doc)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequest(f"{where or 'a key'}: a lone surrogate escape (\\ud800-\\udfff "
                                 "without its pair) is not text", where.split("[")[0].split(".")[0]
                                 or None) from None
        elif isinstance(value, dict):
            stack += [(where, key) for key in value]
            stack += [(f"{where}.{k}" if where else str(k), v) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(f"{where}[{i}]", v) for i, v in enumerate(value)]


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number in JSON")


def parse_completion(body: Mapping[str, Any], request_id: str = "") -> OpenAIRequest:
    """A /v1/completions body."""
    fields = _common(body, request_id)
    prompt, token_ids = _prompt(body.get("prompt"))
    return _request(body, False, GenerateInput(prompt=prompt, token_ids=token_ids, **fields))


def parse_chat(body: Mapping[str, Any], request_id: str = "") -> OpenAIRequest:
    """A /v1/chat/completions body."""
    fields = _common(body, request_id)
    messages = _messages(body.get("messages"))
    return _request(body, True, GenerateInput(messages=messages, **fields))


def _request(body: Mapping[str, Any], chat: bool, inp: GenerateInput) -> OpenAIRequest:
    stream = _typed(body, "stream", bool) or False
    options = _typed(body, "stream_options", dict)
    include_usage = False
    if options is not None:
        if not stream:
            raise BadRequest("stream_options: only allowed with stream=true", "stream_options")
        include_usage = _typed(options, "include_usage", bool, "stream_options.") or False
    return OpenAIRequest(chat=chat, input=inp, model=_typed(body, "model", str), stream=stream,
                         include_usage=include_usage,
                         return_token_ids=_typed(body, "return_token_ids", bool) or False)


def _common(body: Mapping[str, Any], request_id: str) -> dict[str, Any]:
    """The sampling fields both endpoints share, as GenerateInput keywords."""
    for name, neutral in UNSUPPORTED.items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v)
                                    for v in neutral):
            raise BadRequest(f"{name}={_short(repr(body[name]))}: not supported by pdserve "
                             f"(leave it unset)", name, code="unsupported_parameter")
    n = _integer(body, "n")
    if n is not None and n != 1:
        raise BadRequest(f"n={n}: only n=1 is supported (one choice per request; send "
                         "several requests for several choices)", "n")
    max_tokens = _integer(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens")
    top_k = _integer(body, "top_k")
    return dict(max_tokens=max_tokens, temperature=_number(body, "temperature"),
                top_p=_number(body, "top_p"), top_k=None if top_k == -1 else top_k,
                seed=_integer(body, "seed"), stop=_stop(body.get("stop")),
                ignore_eos=_typed(body, "ignore_eos", bool) or False,
                request_id=request_id, model=_typed(body, "model", str) or "")


def _prompt(value: Any) -> tuple[str, tuple[int, ...]]:
    """`prompt`: a string, a list of token ids, or a one-element list of either."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return value, ()
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool)
                                                 for v in value):
        return "", tuple(value)
    if value is None:
        raise BadRequest("prompt: required (a string or a list of token ids)", "prompt")
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, (str, list))
                                                          for v in value):
        raise BadRequest(f"prompt: a batch of {len(value)} prompts is not supported; send one "
                         "prompt per request", "prompt")
    if isinstance(value, list) and not value:
        raise BadRequest("prompt: an empty list; expected a string or token ids", "prompt")
    raise BadRequest(f"prompt: expected a string or a list of integer token ids, got "
                     f"{_kind(value)}", "prompt")


def _messages(value: Any) -> tuple[ChatMessage, ...]:
    if value is None:
        raise BadRequest("messages: required (a list of {role, content} objects)", "messages")
    if not isinstance(value, list) or not value:
        raise BadRequest(f"messages: expected a non-empty list of {{role, content}} objects, "
                         f"got {_kind(value) if value != [] else 'an empty list'}", "messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"{where}: expected an object with role and content, got "
                             f"{_kind(message)}", "messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise BadRequest(f"{where}.role={_short(repr(role))}: expected one of "
                             f"{', '.join(CHAT_ROLES)}", "messages")
        out.append(ChatMessage(role, _content(message.get("content"), where)))
    return tuple(out)


def _content(value: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise BadRequest(f"{where}.content[{j}]: expected a text part "
                                 "{\"type\": \"text\", \"text\": \"...\"} (only text is "
                                 "supported)", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise BadRequest(f"{where}.content: expected a string or a list of text parts, got "
                     f"{_kind(value)}", "messages")


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise BadRequest(f"stop: expected a string or a list of strings, got {_kind(value)}", "stop")


def _typed(body: Mapping[str, Any], name: str, kind: type, prefix: str = "") -> Any:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not kind:  # bool is an int subclass: compare exact types
        raise BadRequest(f"{prefix}{name}: expected {_NAMES[kind]}, got {_kind(value)}",
                         prefix + name)
    return value


def _integer(body: Mapping[str, Any], name: str) -> int | None:
    """An integer field; within int32 (what the services' wire carries), but `seed` (uint64,
    its range checked by the lifecycle)."""
    value: int | None = _typed(body, name, int)
    if value is not None and name != "seed" and not INT32[0] <= value <= INT32[1]:
        raise BadRequest(f"{name}={_short(str(value))}: out of range (at most {INT32[1]})", name)
    return value


def _number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) not in (int, float):
        raise BadRequest(f"{name}: expected a number, got {_kind(value)}", name)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or abs(number) > FLOAT32_MAX:
        raise BadRequest(f"{name}={_short(repr(value))}: expected a finite number (at most "
                         f"{FLOAT32_MAX:.4g} in size)", name)
    return number


_NAMES: dict[type, str] = {bool: "true or false", int: "an integer", str: "a string",
                           dict: "an object", list: "a list", float: "a number"}
_KINDS: dict[type, str] = {bool: "a boolean", int: "an integer", float: "a number",
                           str: "a string", dict: "an object", list: "a list"}


def _kind(value: Any) -> str:
    """What a JSON value is, for a message: `a string ("abc")`."""
    if value is None:
        return "null"
    what = _KINDS.get(type(value), type(value).__name__)
    if isinstance(value, (str, int, float)):
        return f"{what} ({_short(json.dumps(value))})"
    return what


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."

