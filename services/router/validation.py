"""A client's `GenerateInput` -> a validated `Generation` with every default filled in.

Each rejection is `InvalidArgument` whose message starts with the field name and its bad value,
e.g. `max_tokens=0: must be > 0`, or its size where that is what is wrong, e.g.
`prompt of 10001 tokens: the prompt must be shorter than ...`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace

from pdserve.common.errors import InvalidArgument
from pdserve.common.sampling import DEFAULT_MAX_TOKENS, SamplingError, SamplingParams
from pdserve.router.api import GenerateInput
from pdserve.router.tokenizer import ChatTemplateError, Tokenizer

MAX_REQUEST_ID_CHARS = 128
MAX_STOP_STRINGS = 16
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's
# Text is refused untokenized past this many times the characters the context's tokens can
# span at most (twice over: a normalizer may join characters): tokenizing megabytes takes
# seconds, and every other request waits for the tokenizer meanwhile.
TEXT_SLACK = 2


@dataclass(frozen=True)
class Generation:
    """One validated request: who it is, its prompt as token ids, how to sample, where to stop."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    stop: tuple[str, ...] = ()


def _invalid(name: str, value: object, rule: str) -> InvalidArgument:
    return InvalidArgument(f"{name}={value!r}: {rule}")


def _invalid_size(name: str, size: str, rule: str) -> InvalidArgument:
    """`prompt of 10001 tokens: ...`: a field refused for its size (`counted(10001, "token")`)."""
    return InvalidArgument(f"{name} of {size}: {rule}")


def counted(n: int, noun: str) -> str:
    """`counted(1, "token")` is `1 token`, `counted(2, "token")` is `2 tokens`."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _request_id(value: str) -> str:
    if not value:
        return uuid.uuid4().hex
    if len(value) > MAX_REQUEST_ID_CHARS or not value.isprintable() or not value.isascii():
        raise _invalid("request_id", value,
                       f"must be printable ASCII of at most {MAX_REQUEST_ID_CHARS} characters")
    return value


def _sampling(req: GenerateInput) -> SamplingParams:
    """Defaults for what the client left unset, then the one validation of every field."""
    try:
        return SamplingParams(
            max_tokens=DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            seed=req.seed, ignore_eos=req.ignore_eos)
    except SamplingError as exc:
        raise InvalidArgument(str(exc)) from None


def _stop(req: GenerateInput) -> tuple[str, ...]:
    if len(req.stop) > MAX_STOP_STRINGS:
        raise _invalid_size("stop", counted(len(req.stop), "string"),
                            f"at most {MAX_STOP_STRINGS}")
    for text in req.stop:
        if not text:
            raise _invalid("stop", text, "stop strings must not be empty")
    return tuple(req.stop)


def _check_length(field: str, chars: int, tokenizer: Tokenizer, context: int | None) -> None:
    """Refuse text too long to fit `context` tokens before spending time tokenizing it."""
    if context is not None and chars > context * tokenizer.max_token_chars * TEXT_SLACK:
        raise _invalid_size(field, counted(chars, "character"),
                            f"far longer than the model's context of {context} tokens can "
                            f"hold (no token spans more than {tokenizer.max_token_chars} "
                            "characters)")


def _chat_ids(req: GenerateInput, tokenizer: Tokenizer, context: int | None) -> list[int]:
    for i, message in enumerate(req.messages):
        if message.role not in CHAT_ROLES:
            raise _invalid(f"messages[{i}].role", message.role,
                           f"expected one of {', '.join(CHAT_ROLES)}")
    _check_length("messages", sum(len(m.content) for m in req.messages), tokenizer, context)
    try:
        return tokenizer.encode_chat([(m.role, m.content) for m in req.messages])
    except ChatTemplateError as exc:
        raise _invalid_size("messages", counted(len(req.messages), "message"), str(exc)) from None


def _prompt_ids(req: GenerateInput, tokenizer: Tokenizer, context: int | None
                ) -> tuple[str, list[int]]:
    given = [name for name in ("prompt", "token_ids", "messages") if getattr(req, name)]
    if len(given) > 1:
        rule = f"give only one of prompt, token_ids and messages, not {' and '.join(given)}"
        if given[0] == "prompt":
            raise _invalid("prompt", req.prompt[:40], rule)
        raise _invalid_size("token_ids", counted(len(req.token_ids), "id"), rule)
    if req.messages:
        return "messages", _chat_ids(req, tokenizer, context)
    if req.token_ids:
        ids = list(req.token_ids)
        bad = next((t for t in ids if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise _invalid(
                "token_ids", bad, f"token id outside the vocabulary [0, {tokenizer.vocab_size})"
            )
        return "token_ids", ids
    if not req.prompt:
        raise _invalid("prompt", req.prompt,
                       "a non-empty prompt, token_ids or messages is required")
    _check_length("prompt", len(req.prompt), tokenizer, context)
    ids = tokenizer.encode(req.prompt)
    if not ids:
        raise _invalid("prompt", req.prompt[:40], "the prompt encodes to no tokens")
    return "prompt", ids


def fit_context(field: str, prompt_tokens: int, max_tokens: int | None,
                context: int | None) -> int:
    """The request's max_tokens once checked against the context (`max_model_len`, prompt +
    output tokens): a prompt must leave room for one token; an explicit max_tokens must fit
    beside the prompt (else InvalidArgument naming the context); an omitted one is
    DEFAULT_MAX_TOKENS, lowered to the room left."""
    wanted = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if context is None:
        return wanted
    if prompt_tokens >= context:
        raise _invalid_size(field, counted(prompt_tokens, "token"),
                            f"the prompt must be shorter than the model's context of "
                            f"{counted(context, 'token')} (max_model_len)")
    total = prompt_tokens + wanted
    if max_tokens is not None and total > context:
        raise _invalid("max_tokens", max_tokens,
                       f"prompt ({counted(prompt_tokens, 'token')}) + max_tokens "
                       f"({max_tokens}) = {total} exceeds the model's context of "
                       f"{counted(context, 'token')} (max_model_len)")
    return min(wanted, context - prompt_tokens)


def validate(req: GenerateInput, tokenizer: Tokenizer, model_name: str, *,
             max_model_len: int | None = None) -> Generation:
    """Check `req` against the served model and return it with defaults applied.

    The context is `max_model_len` (default: the model's, from its config): prompt +
    max_tokens beyond it is refused (see `fit_context`), anything within it is admitted.
    """
    if req.model and req.model != model_name:
        raise _invalid("model", req.model, f"this router serves {model_name!r}")
    request_id = _request_id(req.request_id)
    sampling = _sampling(req)
    stop = _stop(req)
    context = tokenizer.max_context if max_model_len is None else max_model_len
    field, ids = _prompt_ids(req, tokenizer, context)
    max_tokens = fit_context(field, len(ids), req.max_tokens, context)
    if max_tokens != sampling.max_tokens:
        sampling = replace(sampling, max_tokens=max_tokens)
    return Generation(request_id=request_id, prompt_ids=tuple(ids), sampling=sampling, stop=stop)
