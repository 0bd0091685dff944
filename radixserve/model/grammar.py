"""Grammars for constrained decoding (xgrammar): compile once per distinct spec, one matcher per request.

A spec is ``(kind, source)``: a JSON schema, a regex or an EBNF grammar, as the user wrote
it. ``GrammarCompiler.compile`` turns it into xgrammar's compiled form (token masks
precomputed over this tokenizer's vocabulary), memoised by the spec's hash: a thousand
requests with the same schema compile it once. Compiling can take tens of milliseconds, so
the server calls it on a worker thread before it submits the request; the scheduler thread
only builds a matcher (cheap) from the compiled grammar.

Per step, ``fill_masks`` writes each constrained row's allowed tokens into one bitmask
([batch, ceil(vocab / 32)] int32) and applies it to the whole batch's logits in one call:
a disallowed token's logit becomes -inf, an unconstrained row is left untouched.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from radixserve.model.grammar_checks import ConstraintError, check_source
from radixserve.model.grammar_utf8 import BETWEEN, Utf8Masks

if TYPE_CHECKING:
    import xgrammar as xgr  # imported where used: most servers never constrain a request (0.4 s of start-up)

GrammarKind = Literal["json_schema", "regex", "ebnf"]
GRAMMAR_KINDS: tuple[GrammarKind, ...] = ("json_schema", "regex", "ebnf")
CACHE_ENTRIES = 256  # distinct compiled grammars kept (each holds per-state token masks: ~KBs to MBs)


class GrammarError(ValueError):
    """The spec does not compile: the message names the kind and what is wrong with it."""


class GrammarCompiler:
    """Compiles specs for one tokenizer + vocabulary; thread-safe, memoised by the spec's hash."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        self.stop_token_ids = list(stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids)
        self.utf8 = Utf8Masks(info.decoded_vocab, vocab_size, [*info.special_token_ids, *self.stop_token_ids])
        # xgrammar's own cache would also do, but it keeps failures out of reach: ours says what failed.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.vocab_size = vocab_size
        self.compiles = 0  # how many specs were actually compiled (tests: once per distinct spec)

    def compile(self, kind: GrammarKind, source: str) -> xgr.CompiledGrammar:
        """The compiled grammar of ``source``; GrammarError (nothing cached) when it does not compile."""
        key = hashlib.sha256(f"{kind}\0{source}".encode()).hexdigest()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(kind, source)  # outside the lock: two threads may race, both get a valid grammar
        if not self._can_start(compiled):
            raise GrammarError(f"invalid {kind}: no token of this model's vocabulary can begin a match")
        with self._lock:
            self.compiles += 1
            self._cache[key] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, kind: GrammarKind, source: str) -> xgr.CompiledGrammar:
        if not isinstance(source, str) or not source.strip():
            raise GrammarError(f"{kind} must be a non-empty string")
        try:
            check_source(kind, source)  # refused before compiling: a "stop" answer must satisfy its constraint
        except ConstraintError as exc:
            raise GrammarError(str(exc)) from None
        try:
            if kind == "json_schema":
                # One layout (``{"a": 1, "b": [2, 3]}``): free whitespace lets a weak model spend every token on it.
                return self._compiler.compile_grammar(_json_schema_ebnf(source))
            if kind == "regex":
                return self._compiler.compile_regex(source)
            return self._compiler.compile_grammar(source)
        except Exception as exc:  # xgrammar raises RuntimeError with its C++ location first
            raise GrammarError(f"invalid {kind}: {_xgrammar_message(exc)}") from None

    def _can_start(self, compiled: xgr.CompiledGrammar) -> bool:
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids).fill_next_token_bitmask(bitmask, 0)
        return bool(bitmask.any())

    def matcher(self, compiled: xgr.CompiledGrammar) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids), self.utf8)


class GrammarState:
    """One request's position in its grammar: which tokens may come next, and whether it has ended.

    Two automata in step: xgrammar's matcher, and the UTF-8 one (``grammar_utf8``: what the output's bytes
    still owe a character), whose mask narrows the matcher's to tokens that keep the output well formed."""

    def __init__(self, matcher: Any, utf8: Utf8Masks, utf8_state: int = BETWEEN) -> None:
        self._matcher = matcher
        self._utf8 = utf8
        self._utf8_state = utf8_state
        self.vocab_size = utf8.vocab_size

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: nothing more may be generated."""
        return bool(self._matcher.is_terminated())

    def fork(self) -> GrammarState:
        """An independent copy at the same position (to try draft tokens on)."""
        return GrammarState(self._matcher.fork(), self._utf8, self._utf8_state)

    def accepted_len(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids``, in order, fit the grammar from here (the tokens a draft may keep). Tried on
        a fork (~2 us, and ~0.5 us a token): this state is left as it was."""
        trial, state = self._matcher.fork(), self._utf8_state
        num = 0
        for token_id in token_ids:
            if trial.is_terminated() or not self._utf8.allows(state, token_id) or not trial.accept_token(token_id):
                break
            state = self._utf8.step(state, token_id)
            num += 1
        return num

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens that must come next, each the only token the grammar admits at its place (the
        quote after ``{``, a closing brace, EOS after the last one); [] where the next has a choice. A masked row
        can take nothing else, greedy or sampled: certain drafts. Walked on a fork (~15 us a token)."""
        import xgrammar as xgr

        trial, bitmask = self._matcher.fork(), xgr.allocate_token_bitmask(1, self.vocab_size)
        row = bitmask[0].numpy()  # the same memory: numpy reads 1.5k words faster than torch ops dispatch
        state, tokens = self._utf8_state, list[int]()
        while len(tokens) < limit and not trial.is_terminated():
            trial.fill_next_token_bitmask(bitmask, 0)
            row &= self._utf8.words_np[state]
            token = _only_token(row)
            if token is None or token >= self.vocab_size or not trial.accept_token(token):
                break
            state = self._utf8.step(state, token)
            tokens.append(token)
        return tokens

    def accept(self, token_id: int) -> None:
        if self._matcher.is_terminated():
            return
        state = self._utf8.step(self._utf8_state, token_id)  # ValueError where it breaks UTF-8: nothing changed
        if not self._matcher.accept_token(token_id):
            raise ValueError(f"token {token_id} does not fit the request's grammar")
        self._utf8_state = state

    def fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens that may come next into ``bitmask[row]`` (xgrammar's layout: bit i of word w is token
        32 w + i): the grammar's, less those that would break UTF-8."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        words = self._utf8.words[self._utf8_state]
        width = min(bitmask.shape[1], words.shape[0])  # logits may be wider than the vocabulary (padded)
        bitmask[row, :width] &= words[:width]


def apply_masks(logits: torch.Tensor, grammars: Sequence[GrammarState | None]) -> torch.Tensor:
    """``logits`` [B, V] with each constrained row's disallowed tokens at -inf (a new tensor; rows without a
    grammar, or whose grammar has ended, are unchanged). One bitmask and one apply call for the batch."""
    rows = [i for i, g in enumerate(grammars) if g is not None and not g.terminated]
    if not rows:
        return logits
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(grammars), logits.shape[1])
    for i in rows:
        grammar = grammars[i]
        assert grammar is not None
        grammar.fill_row(bitmask, i)
    out = logits.clone()
    xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device), indices=rows)
    if torch.isneginf(out[rows]).all(dim=-1).any():  # the engine then samples row by row: only that request fails
        raise GrammarError("the grammar allows no token of this model's vocabulary here (a dead end)")
    return out


def _only_token(row: np.ndarray) -> int | None:
    """The one token a bitmask row (int32 words, bit i of word w: token 32 w + i) admits; None: none or several."""
    words = np.flatnonzero(row)
    if len(words) != 1:
        return None
    word = int(row[words[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return int(words[0]) * 32 + word.bit_length() - 1


def _xgrammar_message(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location (``[time] /project/cpp/x.cc:83: ``)."""
    text = str(exc).strip()
    if text.startswith("[") and ": " in text:
        head, _, rest = text.partition("] ")
        location, sep, message = rest.partition(": ")
        if sep and (".cc:" in location or ".h:" in location):
            return message.strip()
    return text


def grammar_after_text(prefix_regex: str, kind: GrammarKind, source: str) -> str:
    """An EBNF grammar: text matching ``prefix_regex`` (e.g. a reasoning block), then ``source`` (a
    ``kind`` spec, held to the same checks, and a schema to the same layout, as when compiled alone);
    GrammarError when either does not compile."""
    import xgrammar as xgr

    try:
        check_source(kind, source)
    except ConstraintError as exc:
        raise GrammarError(str(exc)) from None
    try:
        prefix = xgr.Grammar.from_regex(prefix_regex)
        if kind == "json_schema":
            body = xgr.Grammar.from_ebnf(_json_schema_ebnf(source))
        else:
            body = xgr.Grammar.from_regex(source) if kind == "regex" else xgr.Grammar.from_ebnf(source)
        return str(xgr.Grammar.concat(prefix, body))
    except Exception as exc:  # xgrammar raises RuntimeError with its C++ location first
        raise GrammarError(f"invalid {kind}: {_xgrammar_message(exc)}") from None


# A string literal or a character class of xgrammar's EBNF, or the bare rule name ``root``.
_EBNF_ROOT = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|\broot\b')


def json_schema_rules(schema: str, rule: str, separators: tuple[str, str] = (", ", ": ")) -> str:
    """xgrammar's EBNF rules for a JSON schema, its root rule renamed ``rule``: a part of a larger grammar.

    One layout, no free whitespace, ``separators`` between items and after keys (Python's
    ``json.dumps`` default, what chat templates' ``tojson`` writes). The other rules keep their
    names (``root_prop_0``, ``basic_string`` ...): one schema per grammar, or prefix them apart.
    """
    try:
        ebnf = _json_schema_ebnf(schema, separators)
    except Exception as exc:
        raise GrammarError(f"invalid json_schema: {_xgrammar_message(exc)}") from None
    return _EBNF_ROOT.sub(lambda m: rule if m.group(0) == "root" else m.group(0), ebnf)


def _json_schema_ebnf(schema: str, separators: tuple[str, str] = (", ", ": ")) -> str:
    """xgrammar's EBNF for a JSON schema in one layout (no free whitespace: a weak model would spend every token
    on it), each string's characters held to what JSON allows unescaped. xgrammar's rule for a string with a
    length bound refuses only the quote, the backslash, CR and LF: a tab or a NUL would follow, and
    ``json.loads`` refuses the answer. A negated class is only ever a string's character here (whitespace
    classes are positive): each one also refuses U+0000..U+001F. xgrammar's own errors pass through."""
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=separators))
    return _EBNF_ROOT.sub(lambda m: _no_controls(m.group(0)), text)


_CONTROLS_REFUSED = r"[^\0-\x1f"  # how xgrammar prints a negated class that begins with U+0000..U+001F


def _no_controls(token: str) -> str:
    """A negated character class of xgrammar's EBNF, made to refuse U+0000..U+001F too; other tokens unchanged."""
    if not token.startswith("[^") or token.startswith(_CONTROLS_REFUSED):
        return token
    return _CONTROLS_REFUSED + token[2:]
