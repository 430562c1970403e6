"""One throwaway request through a worker's engine before it reports SERVING, so the first
real request does not pay for first-call costs (allocator growth, kernel selection, lazy
imports): a short prefill, and for roles that decode, a few decode steps. The prefix cache
is emptied after it."""

from __future__ import annotations

import time

from pdserve.common.sampling import SamplingParams
from pdserve.common.tickets import TicketKey
from pdserve.engine.loop import EngineLoop
from pdserve.worker.streams import first_output, token_events

WARMUP_ID = "__pdserve_warmup__"


def warm_up(loop: EngineLoop, role: str, prompt_tokens: int = 32, decode_steps: int = 4,
            wait_s: float = 300.0) -> float:
    """Run the throwaway request for `role`; returns how long it took (ms). Frees everything."""
    started = time.perf_counter()
    engine = loop.engine
    vocab = engine.model.vocab_size
    length = min(prompt_tokens, engine.max_model_len // 2)
    prompt = [(7 + 31 * i) % vocab for i in range(length)]
    params = SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True)
    if role == "decode":  # a "handed-off" prompt: whatever the reserved pages hold is fine
        key = TicketKey(WARMUP_ID, 0)
        loop.submit(lambda e: e.reserve(key, len(prompt)))
        _, outputs = loop.start_sequence(WARMUP_ID, lambda e: e.add_prefilled(
            WARMUP_ID, key, prompt, prompt[-1], params))
    else:
        _, outputs = loop.start_sequence(WARMUP_ID, lambda e: e.add_request(
            WARMUP_ID, prompt, params))
    try:
        if role != "decode":
            first_output(outputs, WARMUP_ID, wait_s, lambda: None)
        if role != "prefill":
            for event in token_events(outputs, WARMUP_ID, wait_s, lambda reason: None):
                if event.finish_reason:
                    break
    finally:
        loop.unsubscribe(WARMUP_ID)
        loop.abort(WARMUP_ID)
        loop.submit(lambda e: e.release_prefilled(WARMUP_ID))
        if role == "decode":  # pages a failed adoption left with the reservation
            loop.submit(lambda e: e.free_reservation(key))
        # The throwaway pages must not be reused: a decode warm-up's KV is garbage, and no
        # worker should start with (or announce) a cache of made-up tokens.
        loop.submit(lambda e: e.allocator.clear())
    return (time.perf_counter() - started) * 1e3
