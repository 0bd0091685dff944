"""The step loop: admit waiting requests by policy, prefill them (in chunks), decode the rest.

A step is one model call: a prefill (extend) batch when there is prefill work,
else a decode batch over every running request; after a prefill step with
requests still decoding, the next step decodes, so a long chunked prompt does
not stall everyone else. After every prefill chunk the request's computed
prefix goes into the cache (``cache_unfinished_req``) and stays locked, so
requests held by in-batch dedup, or arriving later, hit it at once.

When decode runs out of slots, the running request that frees the most (with
the least decode progress) is retracted: its K/V goes into the cache first
(insert before release), so on resumption it recomputes only what was evicted.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
import torch

from radixserve.cache.base import BasePrefixCache
from radixserve.core import TopLogprobs
from radixserve.model.runner import ModelRunner, StepInput
from radixserve.model.sampling import SamplingState, sample
from radixserve.scheduler.admission import PrefillAdder, decode_reserve
from radixserve.scheduler.policy import BaseSchedulePolicy, create_schedule_policy
from radixserve.scheduler.request import Request, Status
from radixserve.scheduler.stats import SchedulerStats

logger = logging.getLogger(__name__)

# (output ids, prompt ids) -> the output's text as it reads after the prompt
Detokenize = Callable[[Sequence[int], Sequence[int]], str]


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        cache: BasePrefixCache,
        detokenize: Detokenize,
        eos_token_ids: tuple[int, ...],
        max_running_requests: int = 64,
        chunked_prefill_size: int = 8192,
        policy: BaseSchedulePolicy | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.runner = runner
        self.cache = cache
        self.detokenize = detokenize
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_running_requests = max_running_requests
        self.chunked_prefill_size = chunked_prefill_size
        self.policy = policy or create_schedule_policy("fcfs")
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted: prefilling (in chunks) or decoding
        self.stats = SchedulerStats()
        self._last_was_prefill = False

    def add(self, req: Request) -> None:
        req.sampling = SamplingState(req.params, req.prompt_ids.tolist())
        if req.params.max_new_tokens == 0:
            self._finish(req, "length")
            return
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def snapshot(self) -> dict[str, object]:
        """The figures the server exports each step (see SchedulerStats for the counters)."""
        allocator = self.cache.allocator
        held = allocator.size - allocator.free_size() - self.cache.evictable_size()
        return {
            **self.stats.snapshot(),
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "evicted_tokens": self.cache.evicted_tokens,
            "policy_fallbacks": getattr(self.policy, "fallbacks", 0),
            "token_usage": held / allocator.size,  # share of KV slots live requests hold (not reclaimable)
            "cache_tokens": self.cache.total_size(),
        }

    def abort(self, rid: int) -> bool:
        """Abort a request in any state: locks released, private slots freed, now. False: unknown."""
        for req in list(self.waiting) + self.running:
            if req.rid == rid:
                if req in self.waiting:
                    self.waiting.remove(req)
                self._finish(req, "abort", insert=False)
                self.running = [r for r in self.running if r is not req]
                return True
        return False

    def step(self) -> list[Request]:
        """Run one model step; return the requests that finished in it."""
        decoding = [r for r in self.running if r.prefill_done]
        prefill = [] if (self._last_was_prefill and decoding) else self._schedule_prefill()
        self._last_was_prefill = bool(prefill)
        if prefill:
            return self._run(prefill, "extend")
        batch = self._prepare_decode()
        if batch:
            return self._run(batch, "decode")
        return self._unstick()

    def _unstick(self) -> list[Request]:
        """Nothing could run: a half-prefilled request cannot get memory. Abort the newest one.

        Its computed chunks stay cached, so nothing else loses work; without this
        the loop would spin forever.
        """
        stuck = [r for r in self.running if not r.prefill_done]
        if not stuck:
            return []
        victim = max(stuck, key=lambda r: r.arrival_time)
        victim.retryable = True  # it fits alone: once the running requests finish, it will run
        self._finish(victim, "abort", error="the KV pool cannot hold this prompt next to the running requests")
        self.running = [r for r in self.running if r is not victim]
        return [victim]

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
        if not self.waiting or adder.slots_left <= 0 or adder.room() <= 0:
            return batch
        result = self.policy.order(list(self.waiting), self.cache, self.running, self.clock())
        for req in result.order:
            if adder.slots_left <= 0 or adder.room() <= 0 or not self._admit(req, adder):
                break
            batch.append(req)
        return batch

    def _admit(self, req: Request, adder: PrefillAdder) -> bool:
        fill = req.fill_ids
        # Match at most len - 1 tokens: the last one must run to produce logits.
        kv = self.cache.open_request(fill[: len(fill) - 1], req.extra_key, req.priority, req.shared_len)
        matched = len(kv.token_ids)
        if not adder.add(req, kv, len(fill)):
            self.cache.cache_finished_req(kv, is_insert=False)
            if not self.running and adder.budget == self.chunked_prefill_size:
                self.waiting.remove(req)  # alone and still no room: it can never fit
                self._finish(req, "abort", error=f"{len(fill)} tokens do not fit in the KV pool", insert=False)
            return False
        self.waiting.remove(req)
        if req.num_retractions == 0:
            req.cached_tokens = matched
            self.stats.cached_tokens += matched
        else:  # what it had computed before retraction and eviction took since
            self.stats.recomputed_tokens += max(req.computed_len - matched, 0)
        req.kv, req.status = kv, Status.RUNNING
        adder.slots_left -= 1
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
            assert req.kv is not None
            while not self.cache.extend_request(req.kv, req.output_ids[-1:]):
                prefilling = [r for r in self.running if not r.prefill_done]
                if prefilling or pending:  # half-prefilled requests step back first
                    self._retract(
                        max(prefilling, key=lambda r: r.arrival_time) if prefilling else max(pending, key=_retract_rank)
                    )
                    pending = [r for r in pending if r.status is Status.RUNNING]
                    continue
                if ready:
                    self._retract(req)
                else:
                    self._finish(req, "abort", error="the KV pool cannot hold this request alone")
                break
            else:
                ready.append(req)
        self.running = [r for r in self.running if r.status is Status.RUNNING]
        return ready

    def _retract(self, req: Request) -> None:
        """Put a running request back in the queue; its computed K/V goes into the cache."""
        assert req.kv is not None
        req.computed_len = len(req.kv.token_ids)
        self.cache.cache_finished_req(req.kv, is_insert=True)
        req.kv, req.status, req.prefill_done = None, Status.WAITING, False
        req.num_retractions += 1
        self.stats.retractions += 1
        self.stats.decode_retractions += bool(req.output_ids)
        self.waiting.appendleft(req)
        self.running = [r for r in self.running if r is not req]
        logger.info("retracted request %d (%d tokens computed)", req.rid, len(req.fill_ids))

    # ---- one model call -----------------------------------------------------------------------------

    def _run(self, batch: list[Request], mode: str) -> list[Request]:
        """One model step; a request that breaks it fails alone, the others go on.

        A failed batch is retried one request at a time; a row of NaN/inf logits
        or a sampling or detokenizing error fails only its request (its KV is
        freed, never cached: it may be garbage).
        """
        batch = [req for req in batch if req.kv is not None]
        batch, logits = self._forward(batch, mode)
        if logits is None:
            return self._after_step(batch, mode, [])
        if mode == "extend":
            self.stats.prefill_tokens += sum(len(self._new_tokens(req, mode)) for req in batch)
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        for req, ok in zip(batch, finite):
            if not ok:
                self._fail(req, "the model produced non-finite logits (NaN or inf)")
        rows = [i for i, req in enumerate(batch) if finite[i] and (mode == "decode" or _prefilled(req))]
        finished = []
        for i, (token, logprob, top) in zip(rows, self._sample(logits, [batch[i] for i in rows], rows)):
            req = batch[i]
            if req.status is not Status.RUNNING:
                continue  # its sampling failed
            req.prefill_done = True
            if logprob is not None:
                req.output_logprobs.append(logprob)
            if top is not None and req.params.top_logprobs:
                req.output_top_logprobs.append(top)
            try:
                if self._append_token(req, token):
                    finished.append(req)
            except Exception as exc:  # e.g. the detokenizer on a stop-string check
                self._fail(req, exc)
        return self._after_step(batch, mode, finished)

    def _after_step(self, batch: list[Request], mode: str, finished: list[Request]) -> list[Request]:
        for req in batch:  # share every computed prompt chunk at once (dedup-held requests hit it)
            if mode == "extend" and req.status is Status.RUNNING and req.kv is not None:
                self.cache.cache_unfinished_req(req.kv)
        failed = [req for req in batch if req.status is Status.ABORTED and req not in finished]
        self.running = [r for r in self.running if r.status is Status.RUNNING]
        return finished + failed

    def _forward(self, batch: list[Request], mode: str) -> tuple[list[Request], torch.Tensor | None]:
        """Logits for ``batch``; if the batched call fails, each request alone (the failing ones abort)."""
        try:
            return batch, self.runner.forward([self._step_input(req, mode) for req in batch], mode)
        except Exception as exc:
            if len(batch) == 1:
                logger.exception("model step failed for request %d", batch[0].rid)
                self._fail(batch[0], exc)
                return [], None
            logger.warning("a %d-request %s step failed (%s); retrying each request alone", len(batch), mode, exc)
        survivors, rows = [], []
        for req in batch:
            try:
                rows.append(self.runner.forward([self._step_input(req, mode)], mode))
                survivors.append(req)
            except Exception as exc:
                logger.exception("model step failed for request %d", req.rid)
                self._fail(req, exc)
        return survivors, (torch.cat(rows) if rows else None)

    def _sample(
        self, logits: torch.Tensor, reqs: list[Request], rows: list[int]
    ) -> list[tuple[int, float | None, TopLogprobs | None]]:
        """(token, logprob, top logprobs) per request; if batched sampling fails, row by row."""
        if not reqs:
            return []
        try:
            out = sample(logits[rows], [req.sampling for req in reqs])  # type: ignore[misc]
            return [
                (
                    out.token_ids[k],
                    out.logprobs[k] if out.logprobs else None,
                    out.top_logprobs[k] if out.top_logprobs else None,
                )
                for k in range(len(reqs))
            ]
        except Exception as exc:
            logger.warning("sampling a batch of %d failed (%s); sampling each request alone", len(reqs), exc)
        results: list[tuple[int, float | None, TopLogprobs | None]] = []
        for req, row in zip(reqs, rows):
            try:
                one = sample(logits[row : row + 1], [req.sampling])  # type: ignore[list-item]
                results.append(
                    (
                        one.token_ids[0],
                        one.logprobs[0] if one.logprobs else None,
                        one.top_logprobs[0] if one.top_logprobs else None,
                    )
                )
            except Exception as exc:
                logger.exception("sampling failed for request %d", req.rid)
                self._fail(req, exc)
                results.append((-1, None, None))
        return results

    def _fail(self, req: Request, error: BaseException | str) -> None:
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self._finish(req, "abort", error=message, insert=False, decode=False)

    def _step_input(self, req: Request, mode: str) -> StepInput:
        assert req.kv is not None
        return StepInput(self._new_tokens(req, mode), req.kv.kv_indices)

    def _new_tokens(self, req: Request, mode: str) -> np.ndarray:
        assert req.kv is not None
        if mode == "decode":
            return req.kv.token_ids[-1:]
        return req.kv.token_ids[req.chunk_start :]

    # ---- finishing --------------------------------------------------------------------------------

    def _append_token(self, req: Request, token: int) -> bool:
        req.output_ids.append(token)
        if req.sampling is not None:
            req.sampling.append(token)
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        params = req.params
        if token in self.eos_token_ids and not params.ignore_eos or token in params.stop_token_ids:
            req.matched_stop = token
            self._finish(req, "stop")
        elif params.stop and self._hit_stop_string(req):
            self._finish(req, "stop", decode=False)
        elif len(req.output_ids) >= params.max_new_tokens:
            self._finish(req, "length")
        return req.status is not Status.RUNNING

    def _hit_stop_string(self, req: Request) -> bool:
        text = self.detokenize(req.output_ids, req.prompt_ids[-16:].tolist())
        hits = [(text.find(s), s) for s in req.params.stop if s in text]
        if not hits:
            return False
        position, stop = min(hits)
        req.text, req.matched_stop = text[:position], stop
        return True

    def _finish(
        self, req: Request, reason: str, *, error: str | None = None, insert: bool = True, decode: bool = True
    ) -> None:
        if req.kv is not None:
            self.cache.cache_finished_req(req.kv, is_insert=insert)
            req.kv = None
        if decode:
            req.text = self.detokenize(req.output_ids, req.prompt_ids[-16:].tolist())
        req.finish_reason, req.error = reason, error  # type: ignore[assignment]  # reason: a FinishReason
        req.status = Status.ABORTED if reason == "abort" else Status.FINISHED
        req.finish_time = time.perf_counter()
        self.stats.count_finish(reason)


def _prefilled(req: Request) -> bool:
    return req.kv is not None and len(req.kv.token_ids) == len(req.fill_ids)


def _retract_rank(req: Request) -> tuple[int, int]:
    """Retract first: most private (uncached) tokens, then least decode progress."""
    assert req.kv is not None
    return len(req.kv.token_ids) - req.kv.cache_protected_len, -len(req.output_ids)
