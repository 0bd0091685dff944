"""Drafts for speculative decoding, with no draft model: n-gram continuations from the prefix cache's
sequences (``ngram.py``) and from the request's own prompt and output (prompt lookup, as vLLM's ``ngram``).

The scheduler asks ``Drafter.propose`` for each decoding request; the drafts it gets are verified in the
step's one forward (the request's newest token and its drafts as one short extend), and the accepted
prefix is taken (``Scheduler.process``). Of the two sources the longer matching n-gram wins (the tree on
a tie: its continuations include earlier answers). A request under a grammar (structured output) drafts the
tokens its grammar forces first (``GrammarState.forced_tokens``: certain), then the copy cut where the grammar
stops admitting it; where nothing of a copy fits, what followed its last token alone (``_grammar_lookup``).

Never slower: verify rows are not free on a CPU (measured on the embedded SmolLM2, bfloat16, 1 thread, 300 tokens
of context: 1, 2, 4, 6, 8 drafts cost 1.12-1.15x, 1.19-1.29x, 1.64-1.74x, 2.35-2.54x a decode step; float32 on an
AVX2 Zen 3: 8 drafts 2.88x) and nearly free on a GPU, so what a forward of n rows costs is measured where the engine
starts (``VerifyCosts``, ``engine/spec_costs.py``), or modelled from ``ROW_COST``. Each request keeps an estimate
of how likely its next draft token is accepted (``alpha``, recent steps weigh most) and drafts the k that
maximises expected accepted tokens minus their price (their rows' cost at the step's own tokens-per-cost, so
drafting stops where a large batch already makes many tokens per step); none where nothing gains, then it waits
(longer each time) before a one-token probe (at small batches only).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from radixserve.model.grammar import GrammarState
from radixserve.scheduler.ngram import NGRAM_SIZES, NgramIndex
from radixserve.scheduler.request import Request, SpecState

SPEC_SOURCES = ("both", "tree", "prompt")
# The modelled cost of a verify row, in one-row decode steps (above: 0.12-0.19; rounded up: a loss costs more than
# a miss), where the engine does not measure it (``Engine(speculative_row_cost=...)``, unit tests).
ROW_COST = 0.2
# Several CPU decode kernels share one decode of a weight block among up to ROW_TILE rows (kRowTile in
# csrc/gguf_rows_linear.cpp's AVX512 path, the K-quant row types): a row that opens a new tile decodes every weight
# again (SmolLM2 Q4_1 on 8-row tiles: 7 drafts 2.34x a decode step, 8 drafts 2.96x); the modelled costs price such a
# row TILE_ROWS rows more. A measured table needs neither.
ROW_TILE = 8
TILE_ROWS = 1.0
DECAY = 0.7  # per verify step: how much of the acceptance history is kept
MAX_COOLDOWN_STEPS = 32  # the longest a request waits before probing again after drafting stopped paying
# No probe where a row costs more than this many tokens (from 5 decodes on): there a probe's row costs a share of
# every decode's step (batch 16: ~5% for one row), and drafting resumes only if the estimate says it pays.
MAX_PROBE_PRICE = 0.5
GRAMMAR_CANDIDATES = 8  # a grammar request's own text's 1-gram continuations tried (Drafter._grammar_lookup)
TABLE_ROWS = 128  # VerifyCosts keeps every row count up to this one; past it each row costs the last one's


class VerifyCosts:
    """What one forward of n rows costs, in one-row decode steps: ``at(1) == 1``. Built from a few row counts'
    figures (``points``: ``(rows, cost)``, in any unit, rows 1 first), made non-decreasing, linear between them
    and past the last at the last slope; ``source`` says where they came from (measured at start, or modelled)."""

    def __init__(self, points: Sequence[tuple[int, float]], source: str = "modelled") -> None:
        rows = [n for n, _ in points]
        if not rows or rows[0] != 1 or rows != sorted(set(rows)):
            raise ValueError(f"VerifyCosts: row counts from 1, increasing (got {rows})")
        steps = np.maximum.accumulate([max(cost, 1e-9) for _, cost in points])  # more rows never cost less
        steps = steps / steps[0]
        grid = np.arange(1, TABLE_ROWS + 1)
        slope = (steps[-1] - steps[-2]) / (rows[-1] - rows[-2]) if len(rows) > 1 else 0.0
        table = np.where(grid <= rows[-1], np.interp(grid, rows, steps), steps[-1] + slope * (grid - rows[-1]))
        self.points = tuple((n, float(c)) for n, c in zip(rows, steps))
        self.source = source
        self._table: list[float] = [float(v) for v in table]
        self._slope = self._table[-1] - self._table[-2]

    @classmethod
    def modelled(cls, row_cost: float = ROW_COST) -> VerifyCosts:
        """Each row ``row_cost`` of a step, and TILE_ROWS rows more for each tile of ROW_TILE rows it opens."""
        rows = range(1, TABLE_ROWS + 1)
        return cls(tuple((n, 1 + row_cost * (n - 1 + TILE_ROWS * ((n - 1) // ROW_TILE))) for n in rows))

    def at(self, rows: int) -> float:
        """A forward of ``rows`` rows, in one-row decode steps."""
        if rows <= TABLE_ROWS:
            return self._table[max(rows, 1) - 1]
        return self._table[-1] + self._slope * (rows - TABLE_ROWS)

    def drafts(self, first_row: int, num: int) -> float:
        """What ``num`` drafts add to a forward, in steps, after the step's ``first_row`` rows and their
        request's own row."""
        return self.at(first_row + 1 + num) - self.at(first_row + 1)

    def row_cost(self, rows: int = 9) -> float:
        """The mean cost of a row, in steps, over a forward of ``rows`` (a summary for logs and /server_info)."""
        return (self.at(rows) - 1) / (rows - 1)


class Drafter:
    def __init__(
        self,
        max_draft_tokens: int,
        index: NgramIndex | None,
        use_prompt: bool = True,
        max_step_drafts: int = 64,
        costs: VerifyCosts | None = None,
    ) -> None:
        """``max_step_drafts``: draft tokens one step verifies, over all its requests (a bound on its rows);
        ``costs``: what rows cost (None: ``VerifyCosts.modelled()``; the engine measures them)."""
        if max_draft_tokens < 1:
            raise ValueError("max_draft_tokens must be >= 1")
        self.max_draft_tokens = max_draft_tokens
        self.index = index
        self.use_prompt = use_prompt
        self.max_step_drafts = max_step_drafts
        self.costs = costs or MODELLED

    def state(self, req: Request) -> SpecState:
        if req.spec is None:
            req.spec = SpecState()
        return req.spec

    def price(self, num_decodes: int, num_rows: int) -> float:
        """What a one-row decode step's worth of time is worth in tokens, in a step of ``num_rows`` rows making
        ``num_decodes`` tokens (its tokens per cost)."""
        return num_decodes / self.costs.at(num_rows)

    def propose(self, req: Request, room: int, price: float, first_row: int = 0) -> list[int]:
        """Up to ``room`` tokens likely to follow ``req``'s output, as many as pay at ``price``; [] for none.
        ``first_row``: the step's rows before this request's (its drafts are rows first_row + 1 ...). Under a
        grammar the tokens it forces come first, whenever a row costs less than the token it brings (they are
        certain: no acceptance estimate, no cooldown holds them back)."""
        spec = self.state(req)
        limit = min(self.max_draft_tokens, room, req.params.max_new_tokens - len(req.output_ids) - 1)
        forced = self._forced(req, limit, price, first_row)
        spec.forced = len(forced)
        if spec.cooldown > 0:
            spec.cooldown -= 1
            return forced
        limit -= len(forced)
        if limit <= 0 or req.sampling.grammar is not None and req.sampling.grammar.terminated:
            return forced
        num = best_draft_len(spec.accepted / spec.trials, limit, price, first_row + len(forced), self.costs)
        probe_price = price * self.costs.drafts(first_row + len(forced), 1)
        if num == 0 and (not spec.probe or probe_price > MAX_PROBE_PRICE):
            spec.cooldown, spec.probe = min(MAX_COOLDOWN_STEPS, 2**spec.skips), True
            spec.skips += 1
            return forced
        if num:  # it pays again: the next time it does not, the cooldowns start short
            spec.skips = 0
        return forced + self._lookup(req, forced, max(num, 1))

    def _forced(self, req: Request, limit: int, price: float, first_row: int) -> list[int]:
        """The tokens ``req``'s grammar forces next (``GrammarState.forced_tokens``), as many as pay at ``price``
        when each is surely accepted; [] without a grammar."""
        grammar = req.sampling.grammar
        if grammar is None or grammar.terminated or limit <= 0:
            return []
        forced = grammar.forced_tokens(limit)
        return forced[: best_draft_len(1.0, len(forced), price, first_row, self.costs)]

    def _lookup(self, req: Request, forced: list[int], limit: int) -> list[int]:
        """Up to ``limit`` copied drafts to follow ``req``'s output and the ``forced`` tokens after it."""
        tokens, grammar = req.fill_ids, req.sampling.grammar
        if forced:  # the copies go on after them: look up, and check, from there
            assert grammar is not None
            tokens, grammar = np.concatenate([tokens, forced]), grammar.fork()
            for token in forced:
                grammar.accept(token)
        return self._copy(req, tokens, grammar, limit)

    def _copy(self, req: Request, tokens: np.ndarray, grammar: GrammarState | None, limit: int) -> list[int]:
        """What followed ``tokens``' longest matching n-gram in the tree or in ``tokens`` themselves; under a
        ``grammar`` (its state after ``tokens``) cut where it stops admitting it, and where nothing of it fits,
        the last token's continuations (``_grammar_lookup``)."""
        best_n, best = 0, list[int]()
        if self.index is not None:
            best_n, best = self.index.lookup(req.extra_key, tokens[-max(NGRAM_SIZES) :].tolist(), limit)
        if self.use_prompt:
            n, drafts = prompt_lookup(tokens, limit)
            if n > best_n:
                best = drafts
        if grammar is not None:  # a copy that does not fit costs rows for nothing: the last token's, if any fits
            best = best[: grammar.accepted_len(best)] or self._grammar_lookup(req, grammar, tokens, limit)
        return best

    def _grammar_lookup(self, req: Request, grammar: GrammarState, tokens: np.ndarray, limit: int) -> list[int]:
        """Where no n-gram's copy fits the grammar: what followed the last token alone, in the tree (its latest
        occurrence) then at its latest GRAMMAR_CANDIDATES earlier occurrences in the request's own text; the
        first continuation the grammar admits, cut where it stops admitting ([]: none).

        One token predicts free text badly (tried: a loss); under a grammar it finds the forced punctuation and
        keys after a value the model picked (``"Lima"`` -> ``, "unit": "``), spelt in the model's own pieces,
        which the grammar's canonical tokens (jump-forward) are not."""
        candidates = []
        if self.index is not None:
            candidates.append(self.index.lookup(req.extra_key, tokens[-1:].tolist(), limit, sizes=(1,))[1])
        if self.use_prompt:
            candidates += continuations(tokens, 1, limit, GRAMMAR_CANDIDATES)
        for drafts in candidates:
            num = grammar.accepted_len(drafts)
            if num:
                return drafts[:num]
        return []

    def record(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        """One verify step's outcome: the counters, and the acceptance estimate (each draft token a trial,
        up to the first rejected)."""
        spec = self.state(req)
        spec.num_verify_steps += 1
        spec.num_draft_tokens += num_drafted
        spec.num_accepted_tokens += num_accepted
        copied, taken = num_drafted - spec.forced, num_accepted - spec.forced
        if copied > 0 and taken >= 0:  # the estimate learns from copies only (a forced token is certain)
            spec.accepted = DECAY * spec.accepted + taken
            spec.trials = DECAY * spec.trials + taken + (taken < copied)
            spec.probe = False


MODELLED = VerifyCosts.modelled()


def expected_accepted(alpha: float, num: int) -> float:
    """Expected accepted tokens of ``num`` drafts, each accepted with probability ``alpha`` up to the first not."""
    return float(num) if alpha >= 1 else alpha * (1 - alpha**num) / (1 - alpha)


def best_draft_len(alpha: float, limit: int, price: float, first_row: int = 0, costs: VerifyCosts | None = None) -> int:
    """The draft length up to ``limit`` with the most expected accepted tokens net of their rows' cost (``costs``,
    default modelled) at ``price`` tokens a step, after the step's rows before the request's own (``first_row``);
    0: none gains."""
    costs = costs or MODELLED
    best, gain = 0, 0.0
    for num in range(1, limit + 1):
        net = expected_accepted(alpha, num) - price * costs.drafts(first_row, num)
        if net > gain:
            best, gain = num, net
    return best


def prompt_lookup(tokens: np.ndarray, limit: int, sizes: tuple[int, ...] = NGRAM_SIZES) -> tuple[int, list[int]]:
    """(n, up to ``limit`` tokens) after the latest earlier occurrence of ``tokens``' last n tokens, the
    longest n first; (0, []) when none occurs."""
    for n in sizes:
        found = continuations(tokens, n, limit)
        if found:
            return n, found[0]
    return 0, []


def continuations(tokens: np.ndarray, n: int, limit: int, count: int = 1) -> list[list[int]]:
    """Up to ``limit`` tokens after each of the latest ``count`` earlier occurrences of ``tokens``' last n
    tokens, the latest first."""
    if len(tokens) <= n:
        return []
    windows = sliding_window_view(tokens[:-1], n)  # every earlier n-gram (not the suffix itself)
    hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))[::-1][:count]
    return [tokens[start : start + limit].tolist() for start in hits + n]
