"""Which requests of a step share a leading run of KV slots: the groups the paged kernel reads once.

A radix hit hands every request that matched a prefix the very same slots for it,
so "shares a prefix" is a property of the slot arrays alone: no tokens, no tree.
The kernel reads a group's common slots once per step for all of its members
(cascade attention) and each member's own suffix apart::

    member a:  [ s0 s1 ... s2047 | a0 a1 ]        group: members (a, b, c), prefix_len 2048
    member b:  [ s0 s1 ... s2047 | b0 ]           the kernel reads s0 .. s2047 once, then
    member c:  [ s0 s1 ... s2047 | c0 c1 c2 ]     a0 a1, b0 and c0 .. c2 for each alone

A member's prefix stays within what all of its new tokens see (ctx_len - extend_len + 1
slots), so the shared pass needs no mask. The groups are per step, the same for every layer;
a layer with a sliding window reads a group's prefix once only while every member's context
fits the window, else its members read their own windows (csrc/paged_attention.h: a prefix
wholly out of a member's window is then not read at all). One level only: a request is in at
most one group. Cost per step: a sort of the first slots, then one vectorised compare of each
candidate run against its longest member (tens of microseconds at batch 16, 2k context).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# Below this a prefix is cheaper to read per request than to set up a shared pass for.
MIN_SHARED_PREFIX_LEN = 64


class SharedPrefixes(NamedTuple):
    """Groups in CSR form: group g's members are ``members[starts[g]:starts[g+1]]`` (request indices)."""

    members: np.ndarray  # int64
    starts: np.ndarray  # int64, one more than groups
    lens: np.ndarray  # int64: each group's prefix length, in slots

    @classmethod
    def none(cls) -> SharedPrefixes:
        return cls(np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(0, np.int64))


def find_shared_prefixes(
    slots: np.ndarray,
    ctx_starts: np.ndarray,
    extend_lens: np.ndarray,
    min_len: int = MIN_SHARED_PREFIX_LEN,
    solo: list[bool] | None = None,
) -> SharedPrefixes:
    """Groups of >= 2 requests whose contexts begin with the same >= ``min_len`` slots.

    Request b's context is ``slots[ctx_starts[b]:ctx_starts[b+1]]``. Reads only; the groups'
    prefixes are verified slot by slot, so the kernel may trust them. ``solo[b]``: b joins no group."""
    caps = np.diff(ctx_starts) - extend_lens + 1  # every new token of b sees its first caps[b] slots
    eligible = caps >= min_len
    if solo is not None:
        eligible &= ~np.asarray(solo, dtype=bool)
    candidates = np.flatnonzero(eligible)
    if candidates.size < 2:
        return SharedPrefixes.none()
    firsts = slots[ctx_starts[candidates]]
    order = np.argsort(firsts, kind="stable")
    runs = np.split(candidates[order], np.flatnonzero(np.diff(firsts[order])) + 1)
    groups: list[tuple[np.ndarray, int]] = []
    for run in runs:
        if run.size >= 2:
            groups.extend(_split_run(slots, ctx_starts, caps, run, min_len))
    if not groups:
        return SharedPrefixes.none()
    members = np.concatenate([m for m, _ in groups])
    starts = np.cumsum([0, *(m.size for m, _ in groups)], dtype=np.int64)
    return SharedPrefixes(members, starts, np.array([n for _, n in groups], dtype=np.int64))


def _split_run(
    slots: np.ndarray, ctx_starts: np.ndarray, caps: np.ndarray, run: np.ndarray, min_len: int
) -> list[tuple[np.ndarray, int]]:
    """Groups within a run of requests that start on the same slot.

    Ranks the run by how long each member agrees with the longest one, and takes the
    top k whose common length saves the most reads ((k - 1) x length); the rest may
    still share another prefix among themselves, so the loop goes on with them."""
    groups = []
    while run.size >= 2:
        lead = run[np.argmax(caps[run])]
        agree = _agreement(slots, ctx_starts, caps, run, lead)
        order = np.argsort(-agree, kind="stable")
        ranked = agree[order]
        saved = np.arange(run.size) * np.where(ranked >= min_len, ranked, 0)
        best = int(np.argmax(saved))
        if saved[best] == 0:  # the lead shares too little with anyone; the others may share more
            run = run[run != lead]
            continue
        groups.append((np.sort(run[order[: best + 1]]), int(ranked[best])))
        run = run[order[best + 1 :]]
    return groups


def _agreement(slots: np.ndarray, ctx_starts: np.ndarray, caps: np.ndarray, run: np.ndarray, lead: int) -> np.ndarray:
    """Per member of ``run``: how many leading slots it has in common with ``lead``, within both caps.

    Members of one radix prefix mostly agree on the same length, so the last length found is
    tried first as a byte compare plus the one slot after it (exact, and ~1 us for 2k slots);
    only a member that differs elsewhere pays for an element-wise compare."""
    lead_start, lead_cap = int(ctx_starts[lead]), int(caps[lead])
    lead_row = slots[lead_start : lead_start + lead_cap]
    found, guess = [], -1
    for member, start, cap in zip(run.tolist(), ctx_starts[run].tolist(), caps[run].tolist()):
        width = min(cap, lead_cap)
        row = slots[start : start + width]
        if member == lead:
            found.append(lead_cap)
            continue
        if 0 <= guess <= width and (guess == width or row[guess] != lead_row[guess]):
            if row[:guess].tobytes() == lead_row[:guess].tobytes():
                found.append(guess)
                continue
        differ = row != lead_row[:width]
        first = int(differ.argmax())
        guess = first if differ[first] else width
        found.append(guess)
    return np.array(found, dtype=np.int64)
