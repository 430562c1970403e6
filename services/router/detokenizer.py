"""Streaming text out of streamed token ids: incremental detokenization and stop strings.

`IncrementalDetokenizer` turns token ids into text deltas whose concatenation is exactly
`decode(all ids, skip_special_tokens=True)`. It decodes a short window of recent tokens and
emits only the new suffix (the method of vLLM and Hugging Face's TextStreamer), holding back
while the window ends in an incomplete UTF-8 sequence (U+FFFD) or in a byte-fallback token
(sentencepiece-style decoders turn a whole run of byte tokens, skipped special tokens
between them ignored, into U+FFFDs when the run is not valid UTF-8, so a later byte can
change earlier text), and while the window's older text changed. The
window starts where earlier text was complete, so decoders that strip the first token's
leading space see the same first token in both decodes. At the end one full decode settles
what is left. `StopMatcher` cuts the text at the first stop string, and holds back any tail
that could still become one. `OutputText` chains the two.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"

log = logging.getLogger("pdserve.router")


class Decoder(Protocol):
    """What the detokenizer needs of a tokenizer (`router.tokenizer.Tokenizer`)."""

    byte_token_ids: frozenset[int]     # byte-fallback tokens, grouped with their neighbours
    special_token_ids: frozenset[int]  # skipped by decode(skip_special_tokens=True)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Token ids in, text deltas out; `flush` at the end. The deltas joined equal
    `decoder.decode(ids, skip_special_tokens=True)`."""

    def __init__(self, decoder: Decoder):
        self._decoder = decoder
        self._in_bytes = False          # the last token that has text is a byte token
        self._ids: list[int] = []
        self._prefix = 0                # window start: a point where the text was complete
        self._read = 0                  # the text of ids[:read] was emitted
        self._base = ""                 # decode(ids[prefix:read])
        self._emitted: list[str] = []

    def _text(self, start: int, stop: int | None = None) -> str:
        return self._decoder.decode(self._ids[start:stop], skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it made stable ("" while held back)."""
        self._ids.append(token_id)
        if token_id in self._decoder.byte_token_ids:
            self._in_bytes = True
        elif token_id not in self._decoder.special_token_ids:
            self._in_bytes = False
        if self._in_bytes:  # the group's bytes, skipped tokens aside, are decoded together
            return ""
        text = self._text(self._prefix)
        if (len(text) <= len(self._base) or text.endswith(REPLACEMENT)
                or not text.startswith(self._base)):
            return ""
        delta = text[len(self._base):]
        self._prefix, self._read = self._read, len(self._ids)
        self._base = self._text(self._prefix, self._read)
        self._emitted.append(delta)
        return delta

    @property
    def settled(self) -> bool:
        """Every token's text was emitted: nothing is held back."""
        return self._read == len(self._ids) and not self._in_bytes

    def flush(self) -> str:
        """The text still held at the end of the stream: what one full decode has beyond the
        text already emitted (may contain U+FFFD if the model stopped inside a character)."""
        emitted = "".join(self._emitted)
        full = self._text(0)
        if full.startswith(emitted):
            rest = full[len(emitted):]
        else:  # not seen with the supported tokenizers; keep the stream going
            log.warning("incremental detokenization diverged from a full decode after %d "
                        "tokens", len(self._ids))
            rest = self._text(self._prefix)[len(self._base):]
        self._prefix = self._read = len(self._ids)
        self._base = ""
        self._emitted = [emitted + rest]
        return rest


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

    @property
    def held(self) -> str:
        """The text held back as a possible stop string's beginning."""
        return self._held

    def flush(self) -> str:
        """At the end of the stream, release text held back as a possible stop prefix."""
        held, self._held = ("" if self.stopped else self._held), ""
        return held


class OutputText:
    """Token ids in, the client's text deltas out: detokenize, then apply stop strings."""

    def __init__(self, decoder: Decoder, stops: Sequence[str]):
        self._detok = IncrementalDetokenizer(decoder)
        self._stops = StopMatcher(stops)

    @property
    def stopped(self) -> bool:
        """True once a stop string was seen; no more text will be emitted."""
        return self._stops.stopped

    def held_if_settled(self) -> str | None:
        """The text held back as a possible stop string where the detokenizer holds nothing
        (a point another relay can take the text on from), else None."""
        return self._stops.held if self._detok.settled and not self._stops.stopped else None

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text to send now (maybe "")."""
        return self._stops.push(self._detok.push(token_id))

    def finish(self) -> str:
        """End of stream: the remaining text (held partial characters and stop prefixes)."""
        text = self._stops.push(self._detok.flush())
        return text if self._stops.stopped else text + self._stops.flush()
