"""One forward's inputs: the new tokens of S sequences packed back to back, no padding.

A batch mixes freely: a decode sequence brings one token, a prefill chunk many, and both run
through the same GEMMs as one [N, hidden] matrix (N = all new tokens). Built with numpy and
converted once: a tensor op per sequence costs more than a small model's whole step.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import torch


@dataclasses.dataclass
class Batch:
    """Sequence s owns rows query_starts[s] .. query_starts[s+1]-1 of the N new tokens.

    input_ids, positions, slot_pages, slot_offsets: [N] (slot: the page and in-page offset
    where the token's K/V go); query_starts: [S+1]; context_lens: [S] (cached + new tokens);
    block_tables: [S, max_pages] page ids in token order (padded with 0); last_index: [S] the
    row of each sequence's newest token (the only rows the LM head sees).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_starts: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_pages: torch.Tensor
    slot_offsets: torch.Tensor
    last_index: torch.Tensor
    max_query_len: int
    max_context: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(cls, new_tokens: list[list[int]], start_positions: list[int],
              page_tables: list[list[int]], block_size: int, device: torch.device) -> Batch:
        """`new_tokens[s]` start at position `start_positions[s]` of sequence s, whose pages are
        `page_tables[s]` (enough for every one of its tokens)."""
        S = len(new_tokens)
        qlens = np.fromiter(map(len, new_tokens), dtype=np.int64, count=S)
        N = int(qlens.sum())
        ids = np.fromiter(itertools.chain.from_iterable(new_tokens), dtype=np.int64, count=N)
        starts = np.asarray(start_positions, dtype=np.int64)
        query_starts = np.zeros(S + 1, dtype=np.int64)
        np.cumsum(qlens, out=query_starts[1:])
        seq_of_row = np.repeat(np.arange(S, dtype=np.int64), qlens)
        positions = np.arange(N, dtype=np.int64) + np.repeat(starts - query_starts[:-1], qlens)
        max_pages = max(map(len, page_tables))
        tables = np.zeros((S, max_pages), dtype=np.int64)
        for i, pages in enumerate(page_tables):
            tables[i, :len(pages)] = pages
        context = starts + qlens
        slot_pages = tables[seq_of_row, positions // block_size]

        def put(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        return cls(put(ids), put(positions), put(query_starts), put(context), put(tables),
                   put(slot_pages), put(positions % block_size), put(query_starts[1:] - 1),
                   int(qlens.max()), int(context.max()), block_size)

    def padded_rows(self) -> torch.Tensor:
        """[N] the row of each token in a [S * max_query_len] padded layout (for SDPA)."""
        qs = self.query_starts
        seq = torch.repeat_interleave(torch.arange(self.num_seqs, device=qs.device),
                                      qs[1:] - qs[:-1])
        return seq * self.max_query_len + (torch.arange(self.num_tokens, device=qs.device)
                                           - qs[seq])
