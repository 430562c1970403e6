"""Seeded workloads: how long each request's prompt and output are, and prompts of exactly
that many tokens of the target's tokenizer (random ids from its vocabulary, special tokens
excluded; sent as token ids, so no re-tokenization can change the count)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Shape:
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Vocabulary:
    size: int
    special_ids: frozenset[int]

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> Vocabulary:
        """The vocabulary of `model_dir/tokenizer.json` (read as JSON: no tokenizer library)."""
        data = json.loads((Path(model_dir) / "tokenizer.json").read_text())
        ids = list(data["model"]["vocab"].values()) if isinstance(
            data["model"].get("vocab"), dict) else list(range(len(data["model"]["vocab"])))
        added = [t["id"] for t in data.get("added_tokens", [])]
        special = frozenset(t["id"] for t in data.get("added_tokens", []) if t.get("special"))
        return cls(max([*ids, *added]) + 1, special)

    def prompt(self, num_tokens: int, rng: random.Random) -> list[int]:
        out: list[int] = []
        while len(out) < num_tokens:
            token = rng.randrange(self.size)
            if token not in self.special_ids:
                out.append(token)
        return out


def parse_workload(text: str) -> tuple[str, list[int]]:
    """`fixed:IN,OUT` | `uniform:IN_LO-IN_HI,OUT_LO-OUT_HI` | `chat[:IN_MEDIAN,OUT_MEDIAN]` |
    `mixed:SHORT,LONG,SHARE,OUT` (SHARE = fraction of long prompts, e.g. 0.1)."""
    kind, _, rest = text.partition(":")
    numbers: list[float] = []
    for part in filter(None, rest.replace("-", ",").split(",")):
        try:
            numbers.append(float(part))
        except ValueError:
            raise ValueError(f"--workload {text!r}: {part!r} is not a number") from None
    want = {"fixed": 2, "uniform": 4, "chat": (0, 2), "mixed": 4}.get(kind)
    if want is None:
        raise ValueError(f"--workload {text!r}: kind must be fixed, uniform, chat or mixed")
    allowed = want if isinstance(want, tuple) else (want,)
    if len(numbers) not in allowed:
        raise ValueError(f"--workload {text!r}: {kind} takes {' or '.join(map(str, allowed))} "
                         "numbers (see --help)")
    if any(n <= 0 for n in numbers) or (kind == "mixed" and not 0 <= numbers[2] <= 1):
        raise ValueError(f"--workload {text!r}: lengths must be > 0 and a share in [0, 1]")
    return kind, [int(n) if n >= 1 else n for n in numbers]  # type: ignore[misc]


def shapes(text: str, count: int, seed: int, max_context: int | None = None) -> list[Shape]:
    """`count` request shapes of workload `text`, the same for the same seed."""
    kind, n = parse_workload(text)
    rng = random.Random(seed)
    out: list[Shape] = []
    for _ in range(count):
        if kind == "fixed":
            shape = Shape(int(n[0]), int(n[1]))
        elif kind == "uniform":
            shape = Shape(rng.randint(int(n[0]), int(n[1])), rng.randint(int(n[2]), int(n[3])))
        elif kind == "chat":  # long-tailed, like chat traffic: log-normal around the medians
            med_in, med_out = (int(n[0]), int(n[1])) if n else (256, 128)
            shape = Shape(_lognormal(rng, med_in, 8, 8 * med_in),
                          _lognormal(rng, med_out, 4, 8 * med_out))
        else:  # mixed
            long = rng.random() < float(n[2])
            shape = Shape(int(n[1]) if long else int(n[0]), int(n[3]))
        if max_context is not None and shape.prompt_tokens + shape.output_tokens > max_context:
            shape = Shape(max(1, max_context - shape.output_tokens - 1), shape.output_tokens)
        out.append(shape)
    return out


def _lognormal(rng: random.Random, median: int, low: int, high: int, sigma: float = 0.8) -> int:
    return max(low, min(high, int(round(math.exp(rng.gauss(math.log(median), sigma))))))
