"""Drafts for speculative decoding, with no draft model: n-gram continuations from the prefix cache's
sequences (``ngram.py``) and from the request's own prompt and output (prompt lookup, as vLLM's ``ngram``).

The scheduler asks ``Drafter.propose`` for each decoding request; the drafts it gets are verified in the
step's one forward (the request's newest token and its drafts as one short extend), and the accepted
prefix is taken (``Scheduler.process``). Of the two sources the longer matching n-gram wins (the tree on
a tie: its continuations include earlier answers).

Never slower: a request's draft length follows its recent acceptance (``SpecState``), it stops drafting
for a while after drafts that were all rejected (longer each time), and a step drafts only while its rows
stay few (``max_step_rows``): at batch 1 a decode reads every weight for one row and a few more rows come
almost free; a step that already has many rows is compute-bound, where verified-but-rejected rows cost.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from radixserve.scheduler.ngram import NGRAM_SIZES, NgramIndex
from radixserve.scheduler.request import Request, SpecState

SPEC_SOURCES = ("both", "tree", "prompt")
MAX_COOLDOWN_STEPS = 32  # the longest a request waits to draft again after its drafts kept failing


class Drafter:
    def __init__(
        self, max_draft_tokens: int, index: NgramIndex | None, use_prompt: bool = True, max_step_rows: int = 16
    ) -> None:
        if max_draft_tokens < 1:
            raise ValueError("max_draft_tokens must be >= 1")
        self.max_draft_tokens = max_draft_tokens
        self.index = index
        self.use_prompt = use_prompt
        self.max_step_rows = max_step_rows

    def state(self, req: Request) -> SpecState:
        if req.spec is None:
            req.spec = SpecState(self.max_draft_tokens)
        return req.spec

    def propose(self, req: Request, room: int) -> list[int]:
        """Up to ``room`` tokens (and the request's own limits) likely to follow ``req``'s output; [] for none."""
        spec = self.state(req)
        if spec.cooldown > 0:
            spec.cooldown -= 1
            return []
        limit = min(spec.draft_len, room, req.params.max_new_tokens - len(req.output_ids) - 1)
        if limit <= 0 or req.sampling.grammar is not None and req.sampling.grammar.terminated:
            return []
        tokens = req.fill_ids
        best_n, best = 0, list[int]()
        if self.index is not None:
            best_n, best = self.index.lookup(req.extra_key, tokens[-max(self.index.sizes) :].tolist(), limit)
        if self.use_prompt:
            n, drafts = prompt_lookup(tokens, limit)
            if n > best_n:
                best = drafts
        return best

    def record(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        """Adapt to one verify step: all accepted, draft one more next time; some, that many plus one; none,
        back off (the cooldown doubles with each miss in a row)."""
        spec = self.state(req)
        spec.num_verify_steps += 1
        spec.num_draft_tokens += num_drafted
        spec.num_accepted_tokens += num_accepted
        if num_accepted == num_drafted:
            spec.draft_len = min(self.max_draft_tokens, spec.draft_len + 1)
        else:
            spec.draft_len = max(1, num_accepted + 1)
        if num_accepted == 0:
            spec.misses += 1
            spec.cooldown = min(MAX_COOLDOWN_STEPS, 2 ** (spec.misses - 1))
        else:
            spec.misses = 0


def prompt_lookup(tokens: np.ndarray, limit: int, sizes: tuple[int, ...] = NGRAM_SIZES) -> tuple[int, list[int]]:
    """(n, up to ``limit`` tokens) after the latest earlier occurrence of ``tokens``' last n tokens, the
    longest n first; (0, []) when none occurs."""
    for n in sizes:
        if len(tokens) <= n:
            continue
        windows = sliding_window_view(tokens[:-1], n)  # every earlier n-gram (not the suffix itself)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return n, tokens[start : start + limit].tolist()
    return 0, []
