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

from typing import NamedTuple, Sequence

from radixserve.cache.base import BasePrefixCache, MatchResult
from radixserve.cache.key import RadixKey
from radixserve.scheduler.request import Request

# A request whose real cache match is shorter than this is checked for in-batch
# sharing, and held when it shares at least this many tokens with a request kept
# earlier in the round. One constant for both (SGLang's two are both 32): it makes
# the span set below decide exactly what a scratch radix tree would.
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
    fill = req.fill_ids
    result = cache.match_prefix(RadixKey(fill[: len(fill) - 1], req.extra_key))
    req.match_len = len(result.indices)
    return result


def hold_in_batch_duplicates(
    ordered: Sequence[Request],
    cache: BasePrefixCache,
    matches_fresh: bool,
    threshold_len: int = DEDUP_THRESHOLD_LEN,
) -> DedupResult:
    """Split ``ordered`` into kept and held, keeping the order of each.

    A request is held iff its real match is < ``threshold_len`` and a request
    kept before it (same ``extra_key``) shares >= ``threshold_len`` tokens with
    it, counted in whole pages of the cache. ``matches_fresh``: the policy
    already matched every request this round (``req.match_len`` is current);
    otherwise a request is matched only when it collides.

    Why spans and not a scratch radix tree (SGLang's ``create_simulated``): a
    scratch match is page-aligned, so it reaches ``threshold_len`` iff the first
    ``span`` tokens (threshold rounded up to a page) equal a kept request's. For
    the same reason a request's own match is long iff its span is cached, so the
    hold decision depends on the span alone: it is made once per distinct span
    (at most one ``match_prefix``) and costs a dict lookup for every other
    request, copying no prompt into a tree.
    """
    if threshold_len < 1:
        raise ValueError(f"threshold_len must be >= 1, got {threshold_len}")
    span = -(-threshold_len // cache.page_size) * cache.page_size
    # span -> None: one kept request starts with it; True/False: the span is cached / cold.
    spans: dict[tuple[str | None, bytes], bool | None] = {}
    kept: list[Request] = []
    held: list[Request] = []
    for req in ordered:
        fill = req.fill_ids
        if len(fill) - 1 < span:  # too short to share a span: nothing to wait for
            kept.append(req)
            continue
        key = (req.extra_key, fill[:span].tobytes())
        if key not in spans:
            spans[key] = None
        else:
            cached = spans[key]
            if cached is None:
                match_len = req.match_len if matches_fresh else len(match_request(req, cache).indices)
                cached = spans[key] = match_len >= threshold_len
            if not cached:
                held.append(req)
                continue
        kept.append(req)
    return DedupResult(kept, held)
