"""Streaming text out of streamed token ids: incremental detokenization and stop strings.

`IncrementalDetokenizer` turns token ids into text deltas that are always whole characters:
it decodes a short window of recent tokens and emits only the new, stable suffix (the method
vLLM and Hugging Face's TextStreamer use), holding back while the window ends in an incomplete
UTF-8 sequence. `StopMatcher` cuts the text at the first stop string, and holds back any tail
that could still become one. `OutputText` chains the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded before the output, for correct leading spaces


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Token ids in, UTF-8-safe text deltas out."""

    def __init__(self, decoder: Decoder, prompt_ids: Sequence[int] = ()):
        self._decoder = decoder
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0               # window start: text before it was emitted
        self._read = len(self._ids)    # text of ids[prefix:read] was emitted (or is prompt)

    def _text(self, start: int, stop: int | None = None) -> str:
        return self._decoder.decode(self._ids[start:stop], skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it made stable ("" while a character is incomplete)."""
        self._ids.append(token_id)
        before = self._text(self._prefix, self._read)
        after = self._text(self._prefix)
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]

    def flush(self) -> str:
        """Text still held at the end of the stream (may contain U+FFFD if the model stopped
        inside a character)."""
        before = self._text(self._prefix, self._read)
        after = self._text(self._prefix)
        self._prefix = self._read = len(self._ids)
        return after[len(before):]


class StopMatcher:
    """Cuts a text stream at the first occurrence of any stop string (which is not emitted)."""

    def __init__(self, stops: Sequence[str]):
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best

    def push(self, text: str) -> str:
        """Add text; return what is safe to emit. After a stop string, `stopped` is True and
        the returned text is everything before it; later pushes return ""."""
        if self.stopped:
            return ""
        buffer = self._held + text
        hits = [i for i in (buffer.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buffer[:min(hits)]
        keep = self._held_back(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep]

    def flush(self) -> str:
        """At the end of the stream, release text held back as a possible stop prefix."""
        held, self._held = ("" if self.stopped else self._held), ""
        return held


class OutputText:
    """Token ids in, the client's text deltas out: detokenize, then apply stop strings."""

    def __init__(self, decoder: Decoder, prompt_ids: Sequence[int], stops: Sequence[str]):
        self._detok = IncrementalDetokenizer(decoder, prompt_ids)
        self._stops = StopMatcher(stops)

    @property
    def stopped(self) -> bool:
        """True once a stop string was seen; no more text will be emitted."""
        return self._stops.stopped

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text to send now (maybe "")."""
        return self._stops.push(self._detok.push(token_id))

    def finish(self) -> str:
        """End of stream: the remaining text (held partial characters and stop prefixes)."""
        text = self._stops.push(self._detok.flush())
        return text if self._stops.stopped else text + self._stops.flush()
