"""Well-formed UTF-8 under a grammar: the token masks that xgrammar's leave out.

xgrammar matches a character class by decoding UTF-8, and its decoder takes sequences that RFC 3629
forbids: the encoded surrogates U+D800..U+DFFF (``ED A0 80``..``ED BF BF``) in every class, and
overlong three-byte forms (``E0 80 80``) in a JSON pattern's string. A byte-level model held to
``[^"]`` or a ``maxLength`` string could write them: CI caught a five-character name that decoded to
seven, three of them U+FFFD. The answer broke its own schema.

``Utf8Masks`` is the UTF-8 automaton over the vocabulary: eight live states (what the bytes so far
still owe a character: nothing, or 1-3 continuation bytes, the first of them in a range that rules out
overlong forms, surrogates and code points above U+10FFFF), and for each state the tokens whose bytes
keep the output well formed, packed as xgrammar's bitmask words, and the state each token leads to.
A constrained request ANDs its row of the grammar's bitmask with its state's words: one more
``&`` a step. Special and stop tokens carry no bytes of the output: they fit only between characters.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

BETWEEN = 0  # the output so far ends on a character boundary
_DEAD = 8  # not well-formed: no state of the automaton

# (lead bytes, the state after the lead): what each state owes, and the range its next byte must be in.
_LEADS = (
    (range(0x00, 0x80), BETWEEN),
    (range(0xC2, 0xE0), 1),  # one continuation byte owed
    (range(0xE1, 0xED), 2),
    (range(0xEE, 0xF0), 2),
    (range(0xE0, 0xE1), 3),  # E0 A0..BF: not overlong
    (range(0xED, 0xEE), 4),  # ED 80..9F: not a surrogate
    (range(0xF1, 0xF4), 5),
    (range(0xF0, 0xF1), 6),  # F0 90..BF: not overlong
    (range(0xF4, 0xF5), 7),  # F4 80..8F: not above U+10FFFF
)
# state -> (the range its next byte must be in, the state after it)
_OWED = {
    1: (range(0x80, 0xC0), BETWEEN),
    2: (range(0x80, 0xC0), 1),
    3: (range(0xA0, 0xC0), 1),
    4: (range(0x80, 0xA0), 1),
    5: (range(0x80, 0xC0), 2),
    6: (range(0x90, 0xC0), 2),
    7: (range(0x80, 0x90), 2),
}


def transitions() -> np.ndarray:
    """[9, 257] uint8: the state after a byte (column 256: no byte, the state stays); row 8 is the dead state."""
    table = np.full((_DEAD + 1, 257), _DEAD, dtype=np.uint8)
    table[:, 256] = np.arange(_DEAD + 1)
    for lead, state in _LEADS:
        table[BETWEEN, lead.start : lead.stop] = state
    for state, (owed, after) in _OWED.items():
        table[state, owed.start : owed.stop] = after
    return table


class Utf8Masks:
    """Which tokens keep a byte-level output well-formed UTF-8, from each state of the automaton."""

    STATES = _DEAD

    def __init__(self, token_bytes: Sequence[bytes], vocab_size: int, boundary_only: Sequence[int]) -> None:
        """``token_bytes``: each token's bytes in the output (xgrammar's ``decoded_vocab``); tokens past its end
        (a padded vocabulary) and ``boundary_only`` (special and stop tokens) write none, and fit only on a
        character boundary."""
        self.vocab_size = vocab_size
        self.after = _after_states(token_bytes, vocab_size)  # [V, 8]: the state after the token (8: refused)
        boundary = [t for t in boundary_only if 0 <= t < vocab_size]
        self.after[boundary, :] = _DEAD
        self.after[boundary, BETWEEN] = BETWEEN
        allowed = self.after.T != _DEAD  # [8, V]
        words = -(-vocab_size // 32)
        padded = np.zeros((self.STATES, words * 32), dtype=bool)
        padded[:, :vocab_size] = allowed
        # xgrammar's bitmask: bit i of int32 word w is token 32 w + i (little-endian words)
        packed = np.packbits(padded, axis=1, bitorder="little").view("<i4")
        self.words = torch.from_numpy(np.ascontiguousarray(packed))  # [8, ceil(V / 32)] int32
        self.words_np = self.words.numpy()

    def step(self, state: int, token: int) -> int:
        """The state after ``token``; ValueError where it would break UTF-8 (the mask refuses it)."""
        after = int(self.after[token, state]) if 0 <= token < self.vocab_size else _DEAD
        if after == _DEAD:
            raise ValueError(f"token {token} would make the output malformed UTF-8")
        return after

    def allows(self, state: int, token: int) -> bool:
        return 0 <= token < self.vocab_size and int(self.after[token, state]) != _DEAD


def _after_states(token_bytes: Sequence[bytes], vocab_size: int) -> np.ndarray:
    """[V, 8] uint8: each token's state after its bytes from each live state (8: it breaks UTF-8 there).

    The automaton runs on all tokens and start states at once, column by column of the bytes; tokens sorted
    by length so that column c touches only the tokens longer than c (the work is the vocabulary's bytes x 8).
    """
    table = transitions()
    tokens = [token_bytes[t] if t < len(token_bytes) else b"" for t in range(vocab_size)]
    lengths = np.array([len(data) for data in tokens], dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    sorted_lengths = lengths[order]
    flat = np.frombuffer(b"".join(tokens[t] for t in order), dtype=np.uint8)
    starts = np.concatenate(([0], np.cumsum(sorted_lengths)[:-1])).astype(np.int64)
    states = np.broadcast_to(np.arange(Utf8Masks.STATES, dtype=np.uint8), (vocab_size, Utf8Masks.STATES)).copy()
    for column in range(int(sorted_lengths.max(initial=0))):
        live = int(np.searchsorted(-sorted_lengths, -column, side="left"))  # the tokens longer than ``column``
        states[:live] = table[states[:live], flat[starts[:live] + column, None]]
    after = np.empty_like(states)
    after[order] = states
    return after
