"""The engine: sequences in, tokens out, one `step()` at a time.

A step is one forward over one token of every running sequence (continuous batching) and,
under the step's token budget (`max_prefill_tokens`, decode tokens included), chunks of
prompts whose KV is not in pages yet: chunked prefill rides along with decode (Sarathi, vLLM),
so a long prompt costs the running sequences one chunk per step, not a stall until it is done.
With tensor parallelism the model is rank 0's shard, driving the other `ranks` (tp.py), and
every rank's pool (`rank_pools`) shares the page ids of this one, rank 0's.
Roles: `colocated` does both phases; `prefill` stops each sequence after its first token and
keeps its pages for the handoff; `decode` admits sequences whose prompt KV was written into
reserved pages by someone else.

Out of pages: new sequences wait (FIFO). A running sequence that needs a page when none is
free preempts the most recently admitted running sequence: its pages are freed and it goes
back to the front of the waiting queue, to be recomputed (prefill over all its tokens) when
pages free up. The engine is not thread-safe: one thread owns it.

Prefix cache (on unless `prefix_caching=False`): every full page whose KV is computed (or,
on decode, has landed) is named by its chained key (`common/prefix.py`) and stays in the
pool after its sequence ends, unreferenced, until an allocation needs room (LRU). A new
sequence takes the longest cached run of its leading pages, shared and never written, and
computes from there; at least its last token is always computed (its logits give the next
token). A decode reservation likewise pins the leading pages it already holds, so only the
rest has to be shipped to it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import torch
from pdserve.common.layout import pages_for_tokens
from pdserve.engine.batch import Batch
from pdserve.engine.config import EngineConfig
from pdserve.engine.model import PagedCausalLM
from pdserve.engine.pool import KVPool, OutOfPages, PageAllocator
from pdserve.engine.preemption import ensure_decode_pages
from pdserve.engine.prefill_order import prefill_order
from pdserve.engine.prefix_cache import PrefixCache
from pdserve.engine.sampling import SamplingParams, make_generator, sample
from pdserve.engine.sequence import HandoffHooks, Sequence, Status, StepOutput
from pdserve.engine.tp import Ranks


@dataclass(frozen=True)
class StepShape:
    """What one step computed and how long it took (model, sampling), for `Engine.on_step`."""

    decodes: int        # sequences that decoded a token
    prompt_tokens: int  # prompt tokens computed (chunks of waiting sequences)
    seconds: float
    context_tokens: int = 0  # the decoding sequences' tokens (what their new tokens attended)
    prompt_pairs: int = 0    # (query, key) pairs the prompt chunks attended

    @property
    def kind(self) -> str:
        """decode (decodes only), prefill (prompt chunks only) or mixed."""
        if self.decodes and self.prompt_tokens:
            return "mixed"
        return "decode" if self.decodes else "prefill"


class Engine:
    def __init__(self, model: PagedCausalLM, config: EngineConfig, *, device: str = "cpu",
                 eos_token_ids: Iterable[int] = (), ranks: Ranks | None = None):
        self.model = model
        self.ranks = ranks
        self.config = config
        self.device = torch.device(device)
        self.pool = KVPool(model.fingerprint(config.block_size), config.num_pages, device)
        self.rank_pools = [self.pool, *(ranks.pools if ranks is not None else ())]
        self.allocator = PageAllocator(config.num_pages, caching=config.prefix_caching)
        self.prefix = PrefixCache(self.allocator, self.pool.fingerprint,
                                  enabled=config.prefix_caching)
        self.eos_token_ids = frozenset(eos_token_ids)
        # The context this engine serves: the model's, or less where the config lowers it.
        self.max_model_len = min(config.max_model_len or model.max_context, model.max_context)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}
        self.stalled = False  # the last step found work but could run none of it
        self.num_preemptions = 0  # running sequences sent back to be recomputed (out of pages)
        self.handoff: HandoffHooks | None = None  # prefill role: the handoff starts early
        self.on_step: Callable[[StepShape], None] | None = None  # after every step (metrics)

    # ---- admission -------------------------------------------------------------------
    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming what is wrong with a prompt this engine cannot serve."""
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the model's context is "
                             f"{self.max_model_len} (max_model_len)")
        bad = [t for t in prompt_ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary "
                             f"(size {self.model.vocab_size})")
        # A prefill worker holds only the prompt; the others also grow by the generated tokens.
        total = len(prompt_ids) if self.config.role == "prefill" else min(
            len(prompt_ids) + params.max_tokens, self.max_model_len)
        need = pages_for_tokens(total, self.config.block_size)
        if need > self.config.num_pages:
            what = "prompt" if self.config.role == "prefill" else "prompt + max_tokens"
            raise ValueError(f"{what} needs {need} pages; the pool has {self.config.num_pages}")

    def add_request(self, seq_id: str, prompt_ids: list[int], params: SamplingParams, *,
                    reservation: Hashable | None = None) -> Sequence:
        """Queue a prompt for prefill (colocated and prefill roles).

        With `reservation`, the prompt's KV is written into the pages reserved for it.
        """
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        self.check_prompt(prompt_ids, params)
        hits = self._adopt(reservation, seq_id, len(prompt_ids)) if reservation is not None \
            else 0
        seq = Sequence(seq_id, list(prompt_ids), len(prompt_ids), params,
                       make_generator(params, self.device))
        self._start_after(seq, hits)  # the reservation pinned cached leading pages
        self.seqs[seq_id] = seq
        self.waiting.append(seq)
        return seq

    def reserve(self, owner: Hashable, num_prompt_tokens: int) -> list[int]:
        """Decode role: pages for a prompt's KV before it is prefilled elsewhere, held under
        `owner` (a reservation key, never a sequence id) until `adopt`ed or freed. OutOfPages
        when the pages are not free, or `max_num_seqs` sequences run, wait or are reserved."""
        return self._take_reservation(owner, num_prompt_tokens, [])

    def reserve_prompt(self, owner: Hashable, prompt_ids: list[int], *,
                       uncached_below: int = 0) -> tuple[int, list[int], int] | None:
        """`reserve` for a known prompt: the leading full pages this pool already holds
        (never the page of the prompt's last token) are pinned under `owner` first, and only
        the rest is newly allocated. Returns (cached pages, the new page ids, the key of the
        last cached page or 0): the handoff has to fill only the new ones. With
        `uncached_below` > 0, None (nothing taken) when the pool lacks that many tokens or
        more."""
        keys: list[int] = []
        hits = self.prefix.lookup(prompt_ids, keys)
        if uncached_below and \
                len(prompt_ids) - len(hits) * self.config.block_size >= uncached_below:
            return None
        new = self._take_reservation(owner, len(prompt_ids), hits)
        return len(hits), new, self.prefix.last_key(keys, len(hits))

    def _take_reservation(self, owner: Hashable, num_prompt_tokens: int,
                          hits: list[int]) -> list[int]:
        if self.allocator.owns(owner):
            raise ValueError(f"{owner!r} already holds a reservation")
        live = len(self.running) + len(self.waiting) + self.num_reserved
        if live >= self.config.max_num_seqs:
            raise OutOfPages(f"{live} sequences running or reserved (max_num_seqs "
                             f"{self.config.max_num_seqs})")
        need = pages_for_tokens(num_prompt_tokens, self.config.block_size) - len(hits)
        if not self.allocator.can_take(hits, need):
            raise OutOfPages(f"need {need} pages, {self.allocator.num_free} of "
                             f"{self.allocator.num_pages} free")
        self.allocator.share(owner, hits)
        return self.allocator.allocate(owner, need)

    @property
    def num_reserved(self) -> int:
        """Reservations holding pages that no sequence owns yet."""
        return sum(1 for owner in self.allocator.owners() if owner not in self.seqs)

    def free_reservation(self, owner: Hashable) -> int:
        """Return the pages of a reservation that no sequence adopted; returns how many."""
        if owner in self.seqs:
            raise ValueError(f"{owner!r} is a sequence, not a reservation")
        return self.allocator.free(owner)

    def release_prefilled(self, seq_id: str) -> int:
        """Prefill role: free a prefilled sequence's pages once they were handed off (or the
        handoff was given up); returns how many (0 when it is not here any more)."""
        seq = self.seqs.get(seq_id)
        if seq is None or seq.status is not Status.PREFILLED:
            return 0
        num_pages = self.allocator.num_pages_of(seq_id)
        self._finish(seq, seq.finish_reason or "handoff")
        return num_pages

    def add_prefilled(self, seq_id: str, reservation: Hashable, prompt_ids: list[int],
                      first_token: int, params: SamplingParams) -> str | None:
        """Decode role: admit a sequence whose prompt KV already sits in `reservation`'s pages.

        Returns a finish reason when the first token already ends it (its pages are freed),
        else None and the sequence joins the next decode step.
        """
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        self.check_prompt(prompt_ids, params)  # it must be able to finish in this pool
        self._adopt(reservation, seq_id, len(prompt_ids))
        seq = Sequence(seq_id, [*prompt_ids, first_token], len(prompt_ids), params,
                       make_generator(params, self.device), num_cached=len(prompt_ids))
        self.seqs[seq_id] = seq
        self.prefix.offer(seq)  # the prompt's pages landed: reusable from now on
        reason = self._finish_reason(seq)
        if reason:
            self._finish(seq, reason)
            return reason
        seq.status = Status.RUNNING
        self.running.append(seq)
        return None

    def _adopt(self, reservation: Hashable, seq_id: str, num_prompt_tokens: int) -> int:
        """Move a reservation's pages to a sequence; returns the cached pages it pinned."""
        hits = self.allocator.num_leading_cached(reservation)
        expected = pages_for_tokens(num_prompt_tokens, self.config.block_size)
        held = len(self.allocator.pages_of(reservation))
        if held != expected:
            raise ValueError(f"reservation {reservation!r} holds {held} pages, "
                             f"the prompt needs {expected}")
        self.allocator.transfer(reservation, seq_id)
        return hits

    def abort(self, seq_id: str) -> bool:
        seq = self.seqs.get(seq_id)
        if seq is None:
            return False
        self._finish(seq, "abort")
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def queued_prompt_tokens(self) -> int:
        # A copy (one C call, atomic): other threads read this while the loop changes the queue.
        return sum(s.num_tokens - s.num_cached for s in self.waiting.copy())

    # ---- stepping --------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One forward: a token for every running sequence, plus prompt chunks of waiting
        sequences under the step's token budget (chunked prefill rides along with decode, so
        a long prompt never stalls the running sequences for more than a chunk per step)."""
        if self.running:
            # may preempt running sequences back to waiting
            ensure_decode_pages(self, self.config.block_size)
        decodes = list(self.running)
        # Chunks keep running sequences from stalling and let a prefill worker ship pages
        # early; with neither reason a prompt takes the step's whole budget.
        chunk = self.config.chunk_size if decodes or self.config.role == "prefill" \
            else self.config.max_prefill_tokens
        plan = self._plan_prefill(self.config.max_prefill_tokens - len(decodes), chunk)
        self.stalled = not plan and not decodes  # waiting on pages held elsewhere
        if not plan and not decodes:
            return []
        return self._run(decodes, plan)

    def _plan_prefill(self, budget: int, chunk_size: int) -> list[tuple[Sequence, int]]:
        plan: list[tuple[Sequence, int]] = []
        live = len(self.running)
        most = self.config.prompts_beside_decodes if self.running else 0
        prefill = self.config.role == "prefill"
        partial = False  # a prompt this step leaves unfinished is planned (prefill role)
        for seq in prefill_order(self.waiting, self.config.prefill_age_s) if prefill \
                else self.waiting:
            if budget <= 0 or (not prefill and live >= self.config.max_num_seqs):
                break
            if most and len(plan) == most:
                break
            if partial and seq.num_uncomputed > budget:
                continue  # one unfinished prompt per step: a second would only delay both
            # All pages of the sequence's tokens at its first chunk, or none: sequences that
            # each hold part of what they need could otherwise wait on each other forever.
            if not self.allocator.owns(seq.seq_id):
                if not self._admit(seq):
                    break  # FIFO: later prompts do not overtake the head of the queue
            else:
                need = max(0, pages_for_tokens(seq.num_tokens, self.config.block_size)
                           - self.allocator.num_pages_of(seq.seq_id))
                if not self.allocator.can_allocate(need):
                    break
                self.allocator.allocate(seq.seq_id, need)
            chunk = min(seq.num_uncomputed, chunk_size, budget)
            partial = prefill and (partial or chunk < seq.num_uncomputed)
            plan.append((seq, chunk))
            budget -= chunk
            live += 1
        return plan

    def _admit(self, seq: Sequence) -> bool:
        """Pages for a sequence that holds none: cached leading pages shared, the rest new.
        False (nothing taken) when they do not fit now."""
        hits = self.prefix.lookup(seq.token_ids, seq.page_keys)
        need = pages_for_tokens(seq.num_tokens, self.config.block_size) - len(hits)
        if not self.allocator.can_take(hits, need):
            return False
        self.allocator.share(seq.seq_id, hits)
        self.allocator.allocate(seq.seq_id, need)
        self._start_after(seq, len(hits))
        return True

    def _start_after(self, seq: Sequence, cached_pages: int) -> None:
        """The sequence's first `cached_pages` pages came from the cache: compute after them."""
        seq.num_cached = cached_pages * self.config.block_size
        seq.num_keyed = cached_pages
        if seq.num_generated == 0:  # not a recompute after preemption
            seq.num_prefix_hit = seq.num_cached

    def _run(self, decodes: list[Sequence], plan: list[tuple[Sequence, int]]
             ) -> list[StepOutput]:
        """One forward over the decode tokens and the prompt chunks; sample where a sequence's
        newest token is its last known one (every decode, and prompts whose chunk ends them)."""
        start = time.perf_counter()
        for seq, _ in plan:
            if seq.prefill_started_at is None:
                seq.prefill_started_at = start
        pages = self.allocator.pages_of
        batch = Batch.build(
            [[s.token_ids[-1]] for s in decodes]
            + [s.token_ids[s.num_cached: s.num_cached + n] for s, n in plan],
            [s.num_tokens - 1 for s in decodes] + [s.num_cached for s, _ in plan],
            [pages(s.seq_id) for s in decodes] + [pages(s.seq_id) for s, _ in plan],
            self.config.block_size, self.device)
        if self.handoff is not None:  # not where the first token surely ends it (no handoff)
            for seq in (s for s, n in plan if s.num_cached + n == s.num_tokens
                        and s.num_generated + 1 < s.params.max_tokens
                        and s.num_tokens + 1 < self.max_model_len):
                self.handoff.planned(seq.seq_id, list(pages(seq.seq_id)))
        logits = self.model(batch, self.pool.tensor)
        for seq, n in plan:
            seq.num_cached += n
            self.prefix.offer(seq)
        finished = [i for i, (seq, _) in enumerate(plan) if seq.num_cached == seq.num_tokens]
        rows = list(range(len(decodes))) + [len(decodes) + i for i in finished]
        seqs = decodes + [plan[i][0] for i in finished]
        if len(rows) < logits.shape[0]:
            logits = logits[rows]
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs]) \
            if seqs else []
        end = time.perf_counter()
        ms = (end - start) * 1e3
        if self.on_step is not None:
            self.on_step(StepShape(  # (each chunk's n tokens came after num_cached - n)
                len(decodes), sum(n for _, n in plan), end - start,
                sum(s.num_tokens for s in decodes),
                sum(n * (s.num_cached - n) + n * (n + 1) // 2 for s, n in plan)))
        outputs: list[StepOutput] = []
        for seq, token in zip(decodes, tokens):
            seq.num_cached = seq.num_tokens
            if seq.num_cached // self.config.block_size > seq.num_keyed:
                self.prefix.offer(seq)
            outputs.append(self._append(seq, token, ms, prefill=False))
        for seq, token in zip(seqs[len(decodes):], tokens[len(decodes):]):
            self.waiting.remove(seq)
            out = self._append(seq, token, ms, prefill=True)
            out.prefill_ms = (end - (seq.prefill_started_at or start)) * 1e3
            out.cached_tokens = seq.num_prefix_hit
            out.done_at = end
            seq.prefill_started_at = None  # a recompute after preemption measures anew
            if self.handoff is not None and not out.finish_reason:
                self.handoff.prefilled(seq.seq_id, list(pages(seq.seq_id)))
            outputs.append(out)
        if self.config.role == "prefill":  # the pages a chunk completed can ship already
            outputs += [StepOutput(s.seq_id, None, page_ids=pages(s.seq_id)[:n], done_at=end)
                        for s, _ in plan if s.status is Status.WAITING
                        and (n := s.num_cached // self.config.block_size)]
        return outputs

    def _append(self, seq: Sequence, token: int, ms: float, *, prefill: bool) -> StepOutput:
        seq.token_ids.append(token)
        reason = self._finish_reason(seq)
        if prefill and self.config.role == "prefill":
            seq.status = Status.PREFILLED
            seq.finish_reason = reason
            return StepOutput(seq.seq_id, token, reason, self.allocator.pages_of(seq.seq_id), ms)
        if reason:
            self._finish(seq, reason)
        elif seq.status is Status.WAITING:
            seq.status = Status.RUNNING
            self.running.append(seq)
        return StepOutput(seq.seq_id, token, reason, None, ms)

    def _finish_reason(self, seq: Sequence) -> str | None:
        if not seq.params.ignore_eos and seq.token_ids[-1] in self.eos_token_ids:
            return "stop"
        if seq.num_generated >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:  # (not when its prefill
            self.waiting.remove(seq)  # step just took it off the queue: it ends at its token)
        seq.status = Status.FINISHED
        self.allocator.free(seq.seq_id)
        self.seqs.pop(seq.seq_id, None)

    def close(self) -> None:
        for closing in (self.ranks, self.pool):
            if closing is not None:
                closing.close()
