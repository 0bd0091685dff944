"""KV events for the lower cache tiers: what L2 (host, medium ``cpu``) and L3 (disk, ``disk``) gain and lose.

A tier page changes on three threads (the step loop copies pages down, the disk
writer evicts and fails, the prefetcher brings disk pages into L2), and the event
log is the step loop's alone. So a change only enters a thread-safe inbox
(``stored`` / ``dropped``: deque appends are atomic), and at every drain of the
log, on the step loop, ``announce`` reconciles: for each page touched since the
last drain, a store if its tier holds it now and it was not announced, a removal
if its tier lacks it now and it was announced. What a consumer rebuilds per
medium is then exactly each tier's contents at the drain, however the changes
raced in between (a page dropped and stored again announces nothing), and it
never sees a page stored twice or removed twice.

A page a tier held before events were attached (the disk directory's pages at a
warm restart) is ``restored``: announced at the next drain with the label its file
keeps, parents before children, so a router that chains pages by their parent
(Dynamo's) can index the whole disk at once. A page without a label (a version 1
file) goes out by hash alone; the first store of it with a label (a request read
it, so its parent and tokens are known) announces it once more, in full: the one
page ever stored twice in a row.

The cost, with events on only: one set of announced page hashes per tier (16
bytes a page, next to pages of tens of KiB) and a ``PageLabel`` per stored page
in flight to the drain.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Literal

from radixserve.cache.events import KVEventLog, PageLabel

Medium = Literal["cpu", "disk"]  # our tier names; on the wire they are kv_events.wire.WIRE_MEDIA's
Touch = tuple[bool, PageLabel | None]  # (stored, label) of a page since the last drain; stored without label: bare


class TierAnnouncer:
    def __init__(self, log: KVEventLog, page_tokens: int, holds: Callable[[bytes, Medium], bool]) -> None:
        """``holds(page_hash, medium)``: whether that tier holds the page now (thread-safe)."""
        self.log = log
        self.page_tokens = page_tokens
        self._holds = holds
        self._inbox: deque[tuple[bytes, Medium, bool, PageLabel | None]] = deque()
        self._announced: dict[Medium, set[bytes]] = {"cpu": set(), "disk": set()}
        self._bare: dict[Medium, set[bytes]] = {"cpu": set(), "disk": set()}  # announced by hash alone
        log.add_source(self.announce)

    def stored(self, page_hash: bytes, medium: Medium, label: PageLabel) -> None:
        """The tier ``medium`` took the page (any thread): announce it at the next drain if it still holds it."""
        self._inbox.append((page_hash, medium, True, label))

    def restored(self, pages: Sequence[tuple[bytes, PageLabel | None]], medium: Medium) -> None:
        """The tier ``medium`` held these pages before events began (a warm restart's), with their labels (None:
        unknown): announce them at the next drain, each after its parent where that is among them."""
        self._inbox.extend((page_hash, medium, True, label) for page_hash, label in parents_first(pages))

    def dropped(self, page_hash: bytes, medium: Medium) -> None:
        """The tier ``medium`` let the page go (any thread): announce it at the next drain if it still lacks it."""
        self._inbox.append((page_hash, medium, False, None))

    def announced(self, medium: Medium) -> set[bytes]:
        """The pages announced as held by ``medium`` (a copy): what an exact subscriber holds."""
        return set(self._announced[medium])

    def announce(self) -> None:
        """At a drain (step loop): record the difference between each touched page's tier and what was announced."""
        touched: dict[tuple[bytes, Medium], Touch] = {}  # first touch first: parents before children
        while self._inbox:
            page_hash, medium, stored, label = self._inbox.popleft()
            was_stored, known = touched.get((page_hash, medium), (False, None))
            touched[page_hash, medium] = (stored or was_stored, label or known)  # a drop forgets no label
        for (page_hash, medium), (stored, label) in touched.items():
            self._reconcile(page_hash, medium, stored, label)

    def _reconcile(self, page_hash: bytes, medium: Medium, stored: bool, label: PageLabel | None) -> None:
        held, announced, bare = self._holds(page_hash, medium), self._announced[medium], self._bare[medium]
        if held and stored and (page_hash not in announced or (page_hash in bare and label is not None)):
            announced.add(page_hash)
            if label is None:
                bare.add(page_hash)
            else:
                bare.discard(page_hash)
            self.log.record_page(page_hash, self.page_tokens, medium, label)
        elif not held and page_hash in announced:
            announced.discard(page_hash)
            bare.discard(page_hash)
            self.log.record_drop(page_hash, self.page_tokens, medium)


def parents_first(pages: Sequence[tuple[bytes, PageLabel | None]]) -> list[tuple[bytes, PageLabel | None]]:
    """``pages`` (hash, label) reordered so that each comes after its parent where that is among them, else in
    their order: a subscriber reading them in turn always knows a page's parent before the page."""
    labels, placed = dict(pages), set()
    ordered: list[tuple[bytes, PageLabel | None]] = []
    for page_hash, _ in pages:
        chain: list[bytes] = []  # this page and its ancestors not placed yet, child first
        step: bytes | None = page_hash
        while step is not None and step in labels and step not in placed:
            chain.append(step)
            placed.add(step)
            label = labels[step]
            step = label.parent_hash if label is not None else None
        ordered.extend((h, labels[h]) for h in reversed(chain))
    return ordered
