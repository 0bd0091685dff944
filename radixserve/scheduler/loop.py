"""The scheduler: admit waiting requests by policy, prefill them (in chunks), decode the rest.

``schedule()`` says what the next step computes, ``process()`` applies what it
produced; the engine step in between (``engine/step.py``) runs the model. A
step is one model call: a prefill (extend) batch when there is prefill work,
else a decode batch over every running request; after a prefill step with
requests still decoding, the next step decodes, so a long chunked prompt does
not stall everyone else. With ``enable_mixed_chunk`` a step is one mixed batch
instead: every running decode plus the next prefill chunk, so decoders wait for
at most one chunk's forward and never for a decode-less step. After every prefill chunk the request's computed
prefix goes into the cache (``cache_unfinished_req``) and stays locked, so
requests held by in-batch dedup, or arriving later, hit it at once.

With a ``drafter`` (speculative decoding, ``draft.py``) a decoding request may run as a "verify" entry:
its newest token and a few drafted ones in one short extend. ``process`` takes the accepted drafts and the
model's next token, and frees the rejected drafts' slots at once::

    kv before the step:   prompt + output[:-1]                     (K/V computed)
    scheduled:            ... + output[-1] + d1 .. dk               (slots for all; K/V written this step)
    after (a accepted):   ... + output[-1] + d1 .. da               d(a+1) .. dk freed; the model's next token
                                                                     is the newest output, with no K/V yet

When decode runs out of slots, the running request that frees the most (with
the least decode progress) is retracted: its K/V goes into the cache first
(insert before release), so on resumption it recomputes only what was evicted.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from radixserve.cache import BasePrefixCache
from radixserve.core import ErrorKind, FinishReason
from radixserve.scheduler.admission import PrefillAdder, decode_reserve
from radixserve.scheduler.batch import Mode, OutputStage, ScheduledBatch, ScheduledRequest, StepOutput
from radixserve.scheduler.draft import Drafter
from radixserve.scheduler.policy import BaseSchedulePolicy, create_schedule_policy
from radixserve.scheduler.request import Request, Status
from radixserve.scheduler.stats import RequestTiming, SchedulerStats

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        cache: BasePrefixCache,
        output: OutputStage,
        max_running_requests: int = 64,
        chunked_prefill_size: int = 8192,
        policy: BaseSchedulePolicy | None = None,
        clock: Callable[[], float] = time.perf_counter,
        enable_mixed_chunk: bool = False,
        drafter: Drafter | None = None,
    ) -> None:
        self.cache = cache
        self.output = output
        self.max_running_requests = max_running_requests
        self.chunked_prefill_size = chunked_prefill_size
        self.policy = policy or create_schedule_policy("fcfs")
        self.clock = clock
        self.enable_mixed_chunk = enable_mixed_chunk
        self.drafter = drafter
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted: prefilling (in chunks) or decoding
        self.stats = SchedulerStats()
        self._last_was_prefill = False
        self._ended: list[Request] = []  # finished while scheduling this step (no room, ever)

    def add(self, req: Request) -> None:
        """Queue ``req``. ``max_new_tokens == 0`` queues too: its prompt is prefilled into the cache (SGLang's
        frontend sends exactly this to cache a prefix before ``fork``) and it finishes "length" with no token."""
        self.waiting.append(req)
        self.cache.prefetch(req.rid, req.match_key)  # disk pages into host memory while it waits

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def snapshot(self) -> dict[str, object]:
        """The figures the server exports each step (see SchedulerStats for the counters)."""
        return {
            **self.stats.snapshot(),
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "evicted_tokens": self.cache.evicted_tokens,
            "policy_fallbacks": getattr(self.policy, "fallbacks", 0),
            "token_usage": self.token_usage(),
            "cache_tokens": self.cache.total_size(),
        }

    def token_usage(self) -> float:
        """The share of KV slots live requests hold (neither free nor reclaimable by eviction)."""
        allocator = self.cache.allocator
        held = allocator.size - allocator.free_size() - self.cache.evictable_size()
        return held / allocator.size

    def abort(self, req: Request, error: str | None = None, kind: ErrorKind = "engine") -> bool:
        """End ``req`` now, whatever its state: waiting, running, or not queued yet.

        Its locks are released and its private slots freed; nothing it computed is
        cached. False: it had already finished (nothing changes).
        """
        if req.finish_reason is not None:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
            self.cache.cancel_prefetch(req.rid)
        self._finish(req, "abort", error=error, kind=kind, insert=False)
        self.running = [r for r in self.running if r is not req]
        return True

    def schedule(self) -> ScheduledBatch:
        """What runs next: a prefill batch when there is prefill work, else every running decode.

        After a prefill step with requests still decoding, the next step decodes.
        Requests that ended while scheduling (they can never fit) come back in ``finished``.
        """
        self._ended = []
        if self.enable_mixed_chunk:
            return self._schedule_mixed()
        decoding = [r for r in self.running if r.prefill_done]
        prefill = [] if (self._last_was_prefill and decoding) else self._schedule_prefill()
        self._last_was_prefill = bool(prefill)
        if prefill:
            return self._batch(prefill, "extend")
        ready = self._prepare_decode()
        if ready:
            return self._batch(ready, "decode")
        self._unstick()
        return ScheduledBatch(finished=tuple(self._ended))

    def _schedule_mixed(self) -> ScheduledBatch:
        """Every running decode and the next prefill chunk(s) in one batch.

        Decode slots first: retraction may then only take requests whose K/V is all
        computed (a chunk allocated this step but not yet run must never be cached).
        Admission keeps the decoders' reserve as in a prefill step. A step that had to
        retract admits nothing: memory is short, and a re-admission would thrash.
        """
        retractions = self.stats.retractions
        ready = self._prepare_decode()
        prefill = self._schedule_prefill() if self.stats.retractions == retractions else []
        if not prefill and not ready:
            self._unstick()
            return ScheduledBatch(finished=tuple(self._ended))
        prefill_rows = sum(len(r.kv.token_ids) - r.chunk_start for r in prefill if r.kv is not None)
        entries = self._batch(prefill, "extend").entries + self._batch(ready, "decode", prefill_rows).entries
        return ScheduledBatch(entries, tuple(self._ended))

    def process(self, batch: ScheduledBatch, outputs: Sequence[StepOutput]) -> list[Request]:
        """Apply one step's outputs (one per entry); return the requests that finished.

        A failed entry aborts alone (its K/V is freed, never cached: it may be
        garbage); the others take their token (the output stage checks the stops).
        """
        entries = list(zip(batch.entries, outputs, strict=True))
        self.stats.prefill_tokens += sum(
            len(entry.new_token_ids) for entry, out in entries if entry.mode == "extend" and out.computed
        )
        for entry, out in entries:
            if out.error is not None:
                self._fail(entry.req, out.error)
            elif entry.num_draft_tokens:
                self._settle_drafts(entry, out)
            if out.hidden is not None:
                entry.req.hidden_state = out.hidden
            for position, logprob in out.prompt_logprobs:
                assert entry.req.input_logprobs is not None
                entry.req.input_logprobs[position - entry.req.logprob_start_len] = logprob
        finished = [entry.req for entry, out in entries if out.token is not None and self._take(entry.req, out)]
        for entry in batch.entries:  # share every computed prompt chunk at once (dedup-held requests hit it)
            req = entry.req
            if entry.mode == "extend" and req.status is Status.RUNNING and req.kv is not None:
                self.cache.cache_unfinished_req(req.kv)
        failed = [req for req in batch.reqs if req.status is Status.ABORTED and req not in finished]
        self.running = [r for r in self.running if r.status is Status.RUNNING]
        return [*batch.finished, *finished, *failed]

    def _take(self, req: Request, out: StepOutput) -> bool:
        """Give ``req`` its sampled token and finish it if that stopped it; True: it finished."""
        if req.status is not Status.RUNNING:
            return False
        req.prefill_done = True
        if req.params.max_new_tokens == 0:  # it ran to cache its prompt (or score it): the sampled token is dropped
            self._finish(req, "length")
            return True
        try:
            return any(self._append_token(req, one) for one in (out, *out.more))  # stops at the first that ends it
        except Exception as exc:  # its detokenizer or its grammar broke on it: it fails alone
            self._fail(req, exc)
            return False

    def _batch(self, reqs: list[Request], mode: Mode, rows: int = 0) -> ScheduledBatch:
        """The entries of ``reqs``; decodes may get drafts, priced for a step of ``rows`` other rows."""
        entries = []
        price = self.drafter.price(len(reqs), rows + len(reqs)) if self.drafter and mode == "decode" else 0.0
        drafted = 0
        for i, req in enumerate(reqs):
            if req.kv is None:
                continue
            num_drafts = self._draft(req, drafted, price, rows + i + drafted) if mode == "decode" else 0
            drafted += num_drafts
            new = req.kv.token_ids[-1 - num_drafts :] if mode == "decode" else req.kv.token_ids[req.chunk_start :]
            sample = mode == "decode" or len(req.kv.token_ids) == len(req.fill_ids)
            kind: Mode = "verify" if num_drafts else mode
            entries.append(ScheduledRequest(req, kind, new, req.kv.kv_indices, sample, num_drafts))
        return ScheduledBatch(tuple(entries), tuple(self._ended))

    def _draft(self, req: Request, drafted: int, price: float, first_row: int) -> int:
        """Append drafts to ``req``'s K/V request (slots for them, never by evicting); how many. ``first_row``:
        the step's rows before ``req``'s."""
        if self.drafter is None or req.kv is None:
            return 0
        allocator = self.cache.allocator
        room = min(self.drafter.max_step_drafts - drafted, allocator.free_size() - allocator.page_size)
        drafts = self.drafter.propose(req, room, price, first_row) if room > 0 else []
        if not drafts or not self.cache.extend_request(req.kv, drafts):
            return 0
        return len(drafts)

    def _settle_drafts(self, entry: ScheduledRequest, out: StepOutput) -> None:
        """Free the rejected drafts' slots (before any token is taken) and count the step."""
        req, num_drafts = entry.req, entry.num_draft_tokens
        num_accepted = len(out.more) if out.token is not None else 0
        if req.kv is not None and req.status is Status.RUNNING:
            self.cache.truncate_request(req.kv, len(req.kv.token_ids) - (num_drafts - num_accepted))
        assert self.drafter is not None
        self.drafter.record(req, num_drafts, num_accepted)
        self.stats.spec_draft_tokens += num_drafts
        self.stats.spec_accepted_tokens += num_accepted
        self.stats.spec_verify_steps += 1

    def _unstick(self) -> None:
        """Nothing could run: a half-prefilled request cannot get memory. Abort the newest one.

        Its computed chunks stay cached, so nothing else loses work; without this
        the loop would spin forever.
        """
        stuck = [r for r in self.running if not r.prefill_done]
        if not stuck:
            return
        victim = max(stuck, key=lambda r: r.arrival_time)
        # It fits alone: once the running requests finish, it will run (capacity: a server answers 503).
        error = "the KV pool cannot hold this prompt next to the running requests"
        self._finish(victim, "abort", error=error, kind="capacity")
        self._ended.append(victim)
        self.running = [r for r in self.running if r is not victim]

    # ---- prefill -------------------------------------------------------------------------------

    def _schedule_prefill(self) -> list[Request]:
        """Continue unfinished prefills, then admit waiting requests in policy order."""
        decoding = [r for r in self.running if r.prefill_done]  # a prefill must not be starved by its own reserve
        adder = PrefillAdder(
            self.cache,
            self.chunked_prefill_size,
            self.max_running_requests - len(self.running),
            decode_reserve(decoding),
        )
        batch = []
        for req in self.running:
            if not req.prefill_done and req.kv is not None and adder.add(req, req.kv, len(req.fill_ids)):
                batch.append(req)
        if not self.waiting or adder.requests_left <= 0 or adder.room() <= 0:
            return batch
        result = self.policy.order(list(self.waiting), self.cache, self.running, self.clock())
        for req in result.order:
            if adder.requests_left <= 0 or adder.room() <= 0 or not self._admit(req, adder):
                break
            batch.append(req)
        return batch

    def _admit(self, req: Request, adder: PrefillAdder) -> bool:
        fill = req.fill_ids
        kv = self.cache.open_request(req.match_key, req.priority)  # never the last token: it must run
        matched = len(kv.token_ids)
        if not adder.add(req, kv, len(fill)):
            self.cache.cache_finished_req(kv, is_insert=False)
            if not self.running and adder.budget == self.chunked_prefill_size:
                self.waiting.remove(req)  # alone and still no room: it can never fit
                self._finish(req, "abort", error=f"{len(fill)} tokens do not fit in the KV pool", insert=False)
                self._ended.append(req)
            return False
        self.waiting.remove(req)
        self.cache.cancel_prefetch(req.rid)
        if req.num_retractions == 0:
            req.cached_tokens = matched
            req.admit_time = time.perf_counter()
            self.stats.cached_tokens += matched
            self.stats.prompt_tokens += len(req.prompt_ids)
        else:  # what it had computed before retraction and eviction took since
            self.stats.recomputed_tokens += max(req.computed_len - matched, 0)
        req.kv = kv
        req.status = Status.RUNNING
        adder.requests_left -= 1
        self.running.append(req)
        return True

    # ---- decode -----------------------------------------------------------------------------------

    def _prepare_decode(self) -> list[Request]:
        """Give every decoding request a slot for its newest token, retracting when short.

        Oldest first; when the pool is short even after eviction, a request not
        yet given its slot steps back (its K/V stays cached).
        """
        pending = sorted((r for r in self.running if r.prefill_done), key=lambda r: r.arrival_time)
        ready: list[Request] = []
        while pending:
            req = pending.pop(0)
            if self._reserve_decode_slot(req, pending, bool(ready)):
                ready.append(req)
            pending = [r for r in pending if r.status is Status.RUNNING]
        self.running = [r for r in self.running if r.status is Status.RUNNING]
        return ready

    def _reserve_decode_slot(self, req: Request, pending: list[Request], others_ready: bool) -> bool:
        """A slot for ``req``'s newest token, retracting others while short; False: ``req`` stepped back."""
        assert req.kv is not None
        while not self.cache.extend_request(req.kv, req.output_ids[-1:]):
            victim = self._decode_victim(pending)
            if victim is not None:
                self._retract(victim)
            elif others_ready:
                self._retract(req)
                return False
            else:
                self._finish(req, "abort", error="the KV pool cannot hold this request alone")
                self._ended.append(req)
                return False
        return True

    def _decode_victim(self, pending: list[Request]) -> Request | None:
        """Who steps back first: the newest half-prefilled request, then the pending decode that frees most."""
        prefilling = [r for r in self.running if not r.prefill_done]
        if prefilling:
            return max(prefilling, key=lambda r: r.arrival_time)
        candidates = [r for r in pending if r.status is Status.RUNNING]
        return max(candidates, key=_retract_rank) if candidates else None

    def _retract(self, req: Request) -> None:
        """Put a running request back in the queue; its computed K/V goes into the cache."""
        assert req.kv is not None
        req.computed_len = len(req.kv.token_ids)
        self.cache.cache_finished_req(req.kv, is_insert=True)
        req.kv = None
        req.status = Status.WAITING
        req.prefill_done = False
        req.num_retractions += 1
        self.stats.retractions += 1
        self.stats.decode_retractions += bool(req.output_ids)
        self.waiting.appendleft(req)
        self.running = [r for r in self.running if r is not req]
        logger.info("retracted request %d (%d tokens computed)", req.rid, len(req.fill_ids))

    def _fail(self, req: Request, error: BaseException | str) -> None:
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self._finish(req, "abort", error=message, insert=False, keep_text=False)

    # ---- finishing --------------------------------------------------------------------------------

    def _append_token(self, req: Request, out: StepOutput) -> bool:
        self.stats.generated_tokens += 1  # taken even if its text then fails (output_ids keeps it)
        stop = self.output.append(req, out)
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        if stop is not None:  # a stop token, a stop string, or the grammar's end
            req.matched_stop = stop
            self._finish(req, "stop")
        elif len(req.output_ids) >= req.params.max_new_tokens:
            self._finish(req, "length")
        return req.status is not Status.RUNNING

    def _finish(
        self,
        req: Request,
        reason: FinishReason,
        *,
        error: str | None = None,
        kind: ErrorKind = "engine",
        insert: bool = True,
        keep_text: bool = True,
    ) -> None:
        if req.kv is not None:
            if insert and req.output_ids and len(req.kv.token_ids) >= len(req.prompt_ids) + len(req.output_ids):
                # It stopped inside a step's accepted drafts: the K/V past its output is not its own.
                self.cache.truncate_request(req.kv, len(req.prompt_ids) + len(req.output_ids) - 1)
            self.cache.cache_finished_req(req.kv, is_insert=insert)
            req.kv = None
        self.output.finish(req, keep_text)
        req.finish(reason, error, kind)
        self.stats.count_finish(_timing(req))


def _retract_rank(req: Request) -> tuple[int, int]:
    """Retract first: most private (uncached) tokens, then least decode progress."""
    assert req.kv is not None
    return len(req.kv.token_ids) - req.kv.cache_protected_len, -len(req.output_ids)


def _timing(req: Request) -> RequestTiming:
    assert req.finish_reason is not None and req.finish_time is not None
    return RequestTiming(
        req.rid,
        req.extra_key,
        req.arrival_time,
        req.admit_time,
        req.first_token_time,
        req.finish_time,
        len(req.prompt_ids),
        req.cached_tokens,
        len(req.output_ids),
        req.finish_reason,
    )
