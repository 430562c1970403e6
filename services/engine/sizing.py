"""How big a worker's KV pool is, and the context (`max_model_len`) it serves: decided once at
start, so a legal request is never refused later for want of pages.

Rule: the pool holds at least one full-context sequence. A decode or co-located worker holds
a sequence's prompt and its output, `max_model_len` tokens at most; a prefill worker holds only
the prompt, `max_model_len - 1` tokens at most (the router refuses a longer one).

- `max_model_len`: the model's context (`max_position_embeddings`) unless `--max-model-len`
  lowers it (never raises it).
- Pool from `--num-pages` or `--kv-cache-mb` given explicitly: one too small for a
  full-context sequence is an error at start naming both numbers (and the way out: a bigger
  pool, or a lower `--max-model-len`).
- Neither given (`--kv-cache-mb 0`, the default): `DEFAULT_KV_CACHE_MB`, grown to hold one
  full-context sequence when that is more (the plan says so; the worker logs it).

Standard library only: pure arithmetic, tested alone (tests/unit/test_pool_sizing.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.layout import pages_for_tokens

DEFAULT_KV_CACHE_MB = 512
MIB = 2**20


class SizingError(ValueError):
    """The flags cannot give a pool and a context that serve one full-context sequence."""


class PoolTooSmall(SizingError):
    """An explicit pool that cannot hold one full-context sequence."""


@dataclass(frozen=True)
class PoolPlan:
    """The pool and context a worker starts with."""

    num_pages: int
    max_model_len: int
    grown_to_mb: int = 0  # the automatic pool was grown past DEFAULT_KV_CACHE_MB to this

    def describe(self, block_size: int, page_bytes: int) -> str:
        """One log line's worth: the pool, and why it has this size."""
        size = f"{self.num_pages} pages ({self.num_pages * page_bytes / MIB:.0f} MiB, " \
               f"{self.num_pages * block_size} tokens)"
        if self.grown_to_mb:
            return (f"KV pool {size}: grown from the default {DEFAULT_KV_CACHE_MB} MiB to hold "
                    f"one full-context sequence (max_model_len {self.max_model_len})")
        return f"KV pool {size}; max_model_len {self.max_model_len}"


def tokens_per_sequence(role: str, max_model_len: int) -> int:
    """The most tokens one sequence keeps in this role's pool."""
    return max_model_len - 1 if role == "prefill" else max_model_len


def longest_context(role: str, num_pages: int, block_size: int) -> int:
    """The largest max_model_len whose full-context sequence fits in `num_pages` pages."""
    held = num_pages * block_size
    return held + 1 if role == "prefill" else held


def plan_pool(*, role: str, page_bytes: int, block_size: int, model_context: int,
              max_model_len: int = 0, num_pages: int = 0, kv_cache_mb: int = 0) -> PoolPlan:
    """The pool (pages) and context of a worker; raises SizingError (PoolTooSmall for a pool)
    naming the flags and numbers when they cannot serve one full-context sequence."""
    if max_model_len > model_context:
        raise SizingError(f"--max-model-len {max_model_len} exceeds the model's context of "
                          f"{model_context} tokens (max_position_embeddings)")
    context = max_model_len or model_context
    if context < 2:
        raise SizingError(f"max_model_len {context}: must be at least 2 (a prompt token and "
                          "an output token)")
    need = pages_for_tokens(tokens_per_sequence(role, context), block_size)
    need_mb = -(-need * page_bytes // MIB)
    if num_pages:
        if num_pages < need:
            fit = min(longest_context(role, num_pages, block_size), model_context)
            raise PoolTooSmall(
                f"--num-pages {num_pages} is too small for the context: one full-context "
                f"sequence (max_model_len {context} tokens) needs {need} pages of {block_size} "
                f"tokens on a {role} worker; raise --num-pages to at least {need} or lower "
                f"--max-model-len to at most {fit}")
        return PoolPlan(num_pages, context)
    if kv_cache_mb:
        pages = kv_cache_mb * MIB // page_bytes
        if pages < need:
            fit = min(longest_context(role, pages, block_size), model_context)
            raise PoolTooSmall(
                f"--kv-cache-mb {kv_cache_mb} is too small for the context: one full-context "
                f"sequence (max_model_len {context} tokens) needs {need_mb} MiB ({need} pages of "
                f"{page_bytes} bytes) on a {role} worker, the pool holds {pages} pages; raise "
                f"--kv-cache-mb to at least {need_mb}, lower --max-model-len to at most {fit}, "
                "or leave --kv-cache-mb unset (0) to size the pool for the context")
        return PoolPlan(pages, context)
    pages = DEFAULT_KV_CACHE_MB * MIB // page_bytes
    if pages >= need:
        return PoolPlan(pages, context)
    return PoolPlan(need, context, grown_to_mb=need_mb)
