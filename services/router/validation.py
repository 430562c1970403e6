"""A client's GenerateRequest -> a validated `Generation` with every default filled in.

Each rejection is `InvalidArgument` whose message starts with the field name and its bad value,
e.g. `max_tokens=0: must be > 0`.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, replace

from pdserve.common.errors import InvalidArgument
from pdserve.router.tokenizer import Tokenizer
from pdserve.v1 import common_pb2, router_pb2

DEFAULT_MAX_TOKENS = 128
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0
MAX_REQUEST_ID_CHARS = 128
MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one request, defaults applied."""

    max_tokens: int
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_TOP_K
    seed: int | None = None
    ignore_eos: bool = False

    def to_proto(self) -> common_pb2.SamplingParams:
        """The wire form sent to prefill and decode (max_tokens counts the first token too)."""
        params = common_pb2.SamplingParams(temperature=self.temperature, top_p=self.top_p,
                                           top_k=self.top_k, ignore_eos=self.ignore_eos,
                                           max_tokens=self.max_tokens)
        if self.seed is not None:
            params.seed = self.seed
        return params


@dataclass(frozen=True)
class Generation:
    """One validated request: who it is, its prompt as token ids, how to sample, where to stop."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: Sampling
    stop: tuple[str, ...] = ()
    requested_max_tokens: int = DEFAULT_MAX_TOKENS  # before clamping to the context


def _invalid(name: str, value: object, rule: str) -> InvalidArgument:
    return InvalidArgument(f"{name}={value!r}: {rule}")


def _request_id(value: str) -> str:
    if not value:
        return uuid.uuid4().hex
    if len(value) > MAX_REQUEST_ID_CHARS or not value.isprintable() or not value.isascii():
        raise _invalid("request_id", value,
                       f"must be printable ASCII of at most {MAX_REQUEST_ID_CHARS} characters")
    return value


def _sampling(req: router_pb2.GenerateRequest) -> Sampling:
    max_tokens = req.max_tokens if req.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if max_tokens <= 0:
        raise _invalid("max_tokens", max_tokens, "must be > 0")
    temperature = req.temperature if req.HasField("temperature") else DEFAULT_TEMPERATURE
    if not (math.isfinite(temperature) and temperature >= 0):
        raise _invalid("temperature", temperature, "must be >= 0 (0 = greedy)")
    top_p = req.top_p if req.HasField("top_p") else DEFAULT_TOP_P
    if not (0.0 < top_p <= 1.0):
        raise _invalid("top_p", top_p, "must be in (0, 1]")
    top_k = req.top_k if req.HasField("top_k") else DEFAULT_TOP_K
    if top_k < 0:
        raise _invalid("top_k", top_k, "must be >= 0 (0 = off)")
    return Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                    seed=req.seed if req.HasField("seed") else None, ignore_eos=req.ignore_eos)


def _stop(req: router_pb2.GenerateRequest) -> tuple[str, ...]:
    if len(req.stop) > MAX_STOP_STRINGS:
        raise _invalid("stop", f"{len(req.stop)} strings", f"at most {MAX_STOP_STRINGS}")
    for text in req.stop:
        if not text:
            raise _invalid("stop", text, "stop strings must not be empty")
    return tuple(req.stop)


def _prompt_ids(req: router_pb2.GenerateRequest, tokenizer: Tokenizer) -> tuple[str, list[int]]:
    if req.prompt and req.token_ids:
        raise _invalid("prompt", req.prompt[:40], "give prompt or token_ids, not both")
    if req.token_ids:
        ids = list(req.token_ids)
        bad = next((t for t in ids if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise _invalid("token_ids", bad, f"token id outside the vocabulary [0, {tokenizer.vocab_size})")
        return "token_ids", ids
    if not req.prompt:
        raise _invalid("prompt", req.prompt, "a non-empty prompt or token_ids is required")
    ids = tokenizer.encode(req.prompt)
    if not ids:
        raise _invalid("prompt", req.prompt[:40], "the prompt encodes to no tokens")
    return "prompt", ids


def validate(req: router_pb2.GenerateRequest, tokenizer: Tokenizer, model_name: str) -> Generation:
    """Check `req` against the served model and return it with defaults applied.

    When prompt + max_tokens exceeds the context, max_tokens is lowered to what fits (the
    stream then finishes with "length"); a prompt that alone fills the context is rejected.
    """
    if req.model and req.model != model_name:
        raise _invalid("model", req.model, f"this router serves {model_name!r}")
    request_id = _request_id(req.request_id)
    sampling = _sampling(req)
    stop = _stop(req)
    field, ids = _prompt_ids(req, tokenizer)
    context = tokenizer.max_context
    requested = sampling.max_tokens
    if context is not None:
        if len(ids) >= context:
            raise _invalid(field, f"{len(ids)} tokens",
                           f"the prompt must be shorter than the model's context of {context} tokens")
        if len(ids) + sampling.max_tokens > context:
            sampling = replace(sampling, max_tokens=context - len(ids))
    return Generation(request_id=request_id, prompt_ids=tuple(ids), sampling=sampling, stop=stop,
                      requested_max_tokens=requested)
