"""Workloads that repeat what earlier requests said, as real traffic does (prefix reuse):

- `prefix:PREFIX,SUFFIX,OUT[,GROUPS]`: every request is one of GROUPS (default 1) long common
  prefixes of PREFIX tokens plus a unique SUFFIX, OUT tokens out.
- `multiturn:TURNS,FIRST,ADD,OUT`: conversations of TURNS turns; the first prompt is FIRST
  tokens, every later one re-sends the whole history (each earlier prompt and the answer the
  server gave, as token ids) plus ADD new tokens; OUT tokens out. `--num-requests` / TURNS
  conversations, `--concurrency` of them at once, each one's turns strictly in order.

Each record carries its turn index and the cached prompt tokens the server reported (pdserve's
Timing, the OpenAI `usage.prompt_tokens_details.cached_tokens`), so a run reports TTFT per
turn and the server's cache hit rate.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

from pdserve.bench.loadgen.runner import closed_loop
from pdserve.bench.loadgen.stats import RequestRecord
from pdserve.bench.loadgen.targets import Target
from pdserve.bench.loadgen.workload import Vocabulary

KINDS = {"prefix": (3, 4), "multiturn": (4,)}
BLOCK = 16  # tokens per KV page, for what a perfect cache could skip


@dataclass(frozen=True)
class Turn:
    new_ids: list[int]  # appended to the conversation so far (earlier prompts and answers)
    output_tokens: int


@dataclass(frozen=True)
class Session:
    turns: list[Turn]


def is_session_workload(text: str) -> bool:
    return text.partition(":")[0] in KINDS


def parse(text: str) -> tuple[str, list[int]]:
    kind, _, rest = text.partition(":")
    if kind not in KINDS:
        raise ValueError(f"--workload {text!r}: not a prefix or multiturn workload")
    try:
        numbers = [int(x) for x in rest.split(",") if x]
    except ValueError:
        raise ValueError(f"--workload {text!r}: the numbers must be integers") from None
    if len(numbers) not in KINDS[kind] or any(n <= 0 for n in numbers):
        raise ValueError(f"--workload {text!r}: {kind} takes "
                         f"{' or '.join(map(str, KINDS[kind]))} numbers > 0 (see --help)")
    return kind, numbers


def sessions(text: str, count: int, seed: int, vocab: Vocabulary) -> list[Session]:
    """The sessions of workload `text` making `count` requests in all (the same for a seed)."""
    kind, n = parse(text)
    rng = random.Random(seed)
    if kind == "prefix":
        prefix_len, suffix_len, out = n[:3]
        groups = [vocab.prompt(prefix_len, rng) for _ in range(n[3] if len(n) > 3 else 1)]
        return [Session([Turn(groups[i % len(groups)] + vocab.prompt(suffix_len, rng), out)])
                for i in range(count)]
    turns, first, add, out = n
    return [Session([Turn(vocab.prompt(first if t == 0 else add, rng), out)
                     for t in range(turns)]) for _ in range(max(1, count // turns))]


def run_sessions(target: Target, plan: list[Session], concurrency: int, timeout_s: float,
                 max_duration_s: float) -> tuple[list[RequestRecord], float]:
    """Closed loop: `concurrency` sessions at once, each one's turns in order."""
    records: list[RequestRecord] = []
    lock = threading.Lock()
    start = time.perf_counter()
    deadline = time.monotonic() + max_duration_s

    def one(i: int) -> None:
        history: list[int] = []
        computed = 0  # tokens of the history whose KV the previous turn left
        for t, turn in enumerate(plan[i].turns):
            prompt = history + turn.new_ids
            record = RequestRecord(0, len(prompt), turn.output_tokens, turn=t)
            # A perfect cache (pages of BLOCK tokens, the last token always computed):
            record.reusable_tokens = min(computed, len(prompt) - 1) // BLOCK * BLOCK
            if time.monotonic() >= deadline:
                record.error = "not sent: --max-duration reached"
            else:
                record.sent_at_s = time.perf_counter() - start
                target.send(record, prompt, turn.output_tokens, timeout_s)
            with lock:
                record.index = len(records)
                records.append(record)
            if not record.ok:
                return  # the rest of the conversation has no history to send
            answer = record.output_ids or [turn.new_ids[-1]] * record.output_tokens
            history = prompt + answer
            computed = len(history) - 1  # the last answer token's KV is never computed

    closed_loop(one, len(plan), concurrency)
    return records, time.perf_counter() - start
