"""Prefix matching for the schedule policies, and in-batch prefix dedup.

In-batch dedup is the chapter's ``temporary_deprioritized``. Requests that
arrive together on a prefix no cache holds yet would each prefill all of it,
because none has finished to insert it. Admit the first, hold the rest until
its prompt is in the cache (the scheduler inserts right after each prefill);
then they match it::

    64 requests = 2,000 cold shared tokens + 40 own each
    all admitted together:  64 x 2,040 = 130,560 tokens prefilled
    one admitted, 63 held:  2,040 + 63 x 40 = 4,560 tokens prefilled
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from radixserve.cache import BasePrefixCache, MatchResult
from radixserve.scheduler.request import Request

# Held when a request kept earlier in the round shares at least this many tokens
# beyond the cached match (SGLang uses 32 too).
DEDUP_THRESHOLD_LEN = 32


class DedupResult(NamedTuple):
    kept: list[Request]  # admission order for this round
    held: list[Request]  # wait for a kept sibling to insert their shared prefix


def match_request(req: Request, cache: BasePrefixCache) -> MatchResult:
    """Match ``req`` against the cache as admission will, and record ``req.match_len``.

    At most ``len(fill_ids) - 1`` tokens: the last one is always prefilled (its
    logits give the next token). Mutates the cache as ``match_prefix`` does
    (may split a node, refreshes access times); locks nothing.
    """
    result = cache.match_prefix(req.match_key)
    req.match_len = len(result.indices)
    req.match_node = result.last_node
    return result


def hold_in_batch_duplicates(
    ordered: Sequence[Request],
    cache: BasePrefixCache,
    matches_fresh: bool,
    threshold_len: int = DEDUP_THRESHOLD_LEN,
) -> DedupResult:
    """Split ``ordered`` into kept and held, keeping the order of each.

    A request is held iff a request kept before it (same ``extra_key``) shares
    its real cached match *and* at least ``threshold_len`` more tokens (whole
    pages): a sibling is about to compute and insert those, so waiting one round
    turns them into a hit. That covers a cold burst (real match 0) and, beyond
    SGLang's rule, a burst on a cached system prompt followed by a cold shared
    block (real match 512, then 1,543 shared uncached tokens).

    Why a key and not a scratch radix tree: if two requests share their first
    ``m + span`` tokens and the cache holds only ``m`` of them, both match exactly
    ``m`` and end on the same cache node (the cache diverges inside the shared
    part for both). So "shares my match plus a span with a kept request" is the
    equality of one small key, (node the match ended on, the next ``span``
    tokens): one set lookup per request, no prompt copied or hashed whole. ``matches_fresh``: the policy
    already matched every request this round (``req.match_len`` is current); otherwise match here.
    """
    if threshold_len < 1:
        raise ValueError(f"threshold_len must be >= 1, got {threshold_len}")
    span = -(-threshold_len // cache.page_size) * cache.page_size
    seen: set[tuple[str | None, int, bytes]] = set()
    kept: list[Request] = []
    held: list[Request] = []
    for req in ordered:
        if not matches_fresh:
            match_request(req, cache)
        match_key = req.match_key
        end = req.match_len + span
        if len(match_key) < end:  # fewer than a span of uncached tokens: nothing worth waiting for
            kept.append(req)
            continue
        namespace = match_key.namespace_at(req.match_len)  # None while still in a shared head
        key = (namespace, id(req.match_node), match_key.token_ids[req.match_len : end].tobytes())
        if key in seen:
            held.append(req)
        else:
            seen.add(key)
            kept.append(req)
    return DedupResult(kept, held)
