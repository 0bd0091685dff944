"""Prefetch on queueing: a thread brings a waiting request's disk (L3) continuation into host memory (L2).

Reading and verifying a page file is the slow part of a load-back (a file read,
a blake2b, a copy); copying a host page into the pool is cheap. So when a
request enters the waiting queue, the pages after its L1 match that only the
disk holds are read here, off the scheduler thread, while the step loop runs
other requests (as SGLang's HiCache prefetches from storage into host memory).
Admission then finds them in L2. Nothing depends on a prefetch finishing: a page
not yet there, or evicted from L2 meanwhile, is read from disk at admission as
before, and a page that failed its check is recomputed.

A job is only a (key, start) pair: it holds no slot and no lock on the tree, so
cancelling it (the request was admitted or aborted) or losing it changes no
output. The tier index's lock keeps the host arena consistent between this
thread and the scheduler's.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable

from radixserve.cache.core.key import RadixKey

logger = logging.getLogger(__name__)

Job = tuple[Hashable, RadixKey, int]


class Prefetcher:
    def __init__(self, fetch: Callable[[RadixKey, int], int]) -> None:
        """``fetch(key, start)`` brings the pages of ``key`` after token ``start`` into L2 (the tier index's)."""
        self._fetch = fetch
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._live: set[Hashable] = set()  # submitted and neither run nor cancelled
        self._mutex = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="cache-prefetch", daemon=True)
        self._thread.start()

    def submit(self, token: Hashable, key: RadixKey, start: int) -> None:
        """Prefetch ``key`` after ``start`` (its L1 match) for the request named ``token``."""
        with self._mutex:
            self._live.add(token)
        self._queue.put((token, key, start))

    def cancel(self, token: Hashable) -> None:
        """The request no longer waits (admitted, aborted): skip its job if it has not started."""
        with self._mutex:
            self._live.discard(token)

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until every submitted job ran or was skipped; True if so."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return False
            time.sleep(0.002)
        return True

    def close(self, timeout: float = 5.0) -> None:
        with self._mutex:
            self._live.clear()  # queued jobs are skipped
        self._queue.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                token, key, start = job
                with self._mutex:
                    wanted = token in self._live
                    self._live.discard(token)
                if wanted:
                    self._fetch(key, start)
            except Exception:  # a prefetch is an optimisation: never let one kill the thread
                logger.exception("cache prefetch failed; admission loads the pages itself")
            finally:
                self._queue.task_done()
