"""The step loop: admit waiting requests (FCFS), prefill them, decode the running ones.

Each ``step`` is either one prefill (extend) batch, when something can be
admitted, or one decode batch over every running request. Admission matches
the request's longest cached prefix and locks it, so only the uncached suffix
is prefilled. When decode runs out of slots, the newest running request is
retracted: its computed K/V goes into the cache (insert before release), so on
resumption it recomputes only what was evicted meanwhile.

Policies beyond FCFS, chunked prefill and in-batch prefix dedup come with the
scheduler issue; this loop is the minimal continuous batching the engine needs.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

import numpy as np

from radixserve.cache.base import BasePrefixCache, CacheReq
from radixserve.model.runner import ModelRunner, StepInput
from radixserve.model.sampling import SamplingState, sample
from radixserve.scheduler.request import Request, Status

logger = logging.getLogger(__name__)

Detokenize = Callable[[list[int]], str]


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        cache: BasePrefixCache,
        detokenize: Detokenize,
        eos_token_ids: tuple[int, ...],
        max_running_requests: int = 64,
        max_prefill_tokens: int = 8192,
    ) -> None:
        self.runner = runner
        self.cache = cache
        self.detokenize = detokenize
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_retractions = 0

    def add(self, req: Request) -> None:
        req.sampling = SamplingState(req.params, req.prompt_ids.tolist())
        if req.params.max_new_tokens == 0:
            self._finish(req, "length")
            return
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Request]:
        """Run one model step; return the requests that finished in it."""
        admitted = self._admit()
        batch = admitted if admitted else self._prepare_decode()
        if not batch:
            return []
        mode = "extend" if admitted else "decode"
        inputs = [StepInput(self._new_tokens(req, mode), req.kv.kv_indices) for req in batch if req.kv is not None]
        states = [req.sampling for req in batch if req.sampling is not None]
        try:
            logits = self.runner.forward(inputs, mode)
            out = sample(logits, states)
        except Exception as exc:  # one bad batch must not take the engine down
            logger.exception("model step failed")
            for req in batch:
                self._finish(req, "abort", error=f"{type(exc).__name__}: {exc}", insert=False)
            return batch
        finished = []
        for i, req in enumerate(batch):
            if self._append_token(req, out.token_ids[i], out.logprobs[i] if out.logprobs else None):
                finished.append(req)
        self.running = [r for r in self.running if r.status is Status.RUNNING]
        return finished

    # ---- admission ------------------------------------------------------------------------------

    def _admit(self) -> list[Request]:
        admitted: list[Request] = []
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) + len(admitted) < self.max_running_requests:
            req = self.waiting[0]
            fill = req.fill_ids
            # Match at most len - 1 tokens: the last one must run to produce logits.
            kv = self.cache.open_request(fill[: len(fill) - 1], req.extra_key)
            new = fill[len(kv.token_ids) :]
            if admitted and len(new) > budget:
                self.cache.cache_finished_req(kv, is_insert=False)
                break
            if not self.cache.extend_request(kv, new):
                self.cache.cache_finished_req(kv, is_insert=False)
                if not admitted and not self.running:
                    self.waiting.popleft()
                    self._finish(req, "abort", error=f"{len(fill)} tokens do not fit in the KV pool", insert=False)
                    continue
                break
            self.waiting.popleft()
            if not req.output_ids:
                req.cached_tokens = kv.cache_protected_len
            req.kv, req.status = kv, Status.RUNNING
            req.prefill_len = len(new)
            budget -= len(new)
            admitted.append(req)
        self.running.extend(admitted)
        return admitted

    def _new_tokens(self, req: Request, mode: str) -> np.ndarray:
        assert req.kv is not None
        if mode == "decode":
            return req.kv.token_ids[-1:]
        return req.kv.token_ids[len(req.kv.token_ids) - req.prefill_len :]

    # ---- decode -----------------------------------------------------------------------------------

    def _prepare_decode(self) -> list[Request]:
        """Give every running request a slot for its newest token, retracting when short.

        Oldest first; when the pool is short even after eviction, the newest
        request not yet given its slot steps back (its K/V stays cached).
        """
        pending = sorted(self.running, key=lambda r: r.arrival_time)
        ready: list[Request] = []
        while pending:
            req = pending.pop(0)
            assert req.kv is not None
            while not self.cache.extend_request(req.kv, req.output_ids[-1:]):
                if pending:
                    self._retract(pending.pop())
                    continue
                if ready:
                    self._retract(req)
                else:
                    self._finish(req, "abort", error="the KV pool cannot hold this request alone")
                break
            else:
                ready.append(req)
        self.running = ready
        return ready

    def _retract(self, req: Request) -> None:
        """Put a running request back in the queue; its computed K/V goes into the cache."""
        assert req.kv is not None
        self._release(req.kv, insert=True)
        req.kv, req.status = None, Status.WAITING
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)
        logger.info("retracted request %d (%d tokens computed)", req.rid, len(req.fill_ids))

    # ---- finishing --------------------------------------------------------------------------------

    def _append_token(self, req: Request, token: int, logprob: float | None) -> bool:
        req.output_ids.append(token)
        if logprob is not None:
            req.output_logprobs.append(logprob)
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
        return req.status is Status.FINISHED

    def _hit_stop_string(self, req: Request) -> bool:
        text = self.detokenize(req.output_ids)
        hits = [(text.find(s), s) for s in req.params.stop if s in text]
        if not hits:
            return False
        position, stop = min(hits)
        req.text, req.matched_stop = text[:position], stop
        return True

    def _finish(self, req: Request, reason: str, *, error: str | None = None, insert: bool = True,
                decode: bool = True) -> None:  # fmt: skip
        if req.kv is not None:
            self._release(req.kv, insert=insert)
            req.kv = None
        if decode:
            req.text = self.detokenize(req.output_ids)
        req.finish_reason, req.error = reason, error  # type: ignore[assignment]  # reason: a FinishReason
        req.status, req.finish_time = Status.FINISHED, time.perf_counter()

    def _release(self, kv: CacheReq, insert: bool) -> None:
        """Hand the request's K/V to the cache (or free it) and unlock its prefix."""
        self.cache.cache_finished_req(kv, is_insert=insert)
