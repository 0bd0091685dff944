"""One HTTP call's requests on the engine: tokenize, validate, submit, and collect their deltas.

``ServerState`` holds what every handler needs. ``Generation`` submits a call's
requests (prompts x choices) to the scheduler thread and yields their deltas on
the event loop; closing it early (client gone, handler cancelled) aborts what is
still running, so locks and slots come back at once. ``TextStream`` turns a
choice's token deltas into text deltas that never pass a stop string and never
split a character.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from radixserve.core import GenerateResult, SamplingParams
from radixserve.engine import Engine
from radixserve.model.tokenizer import IncrementalDecoder, Tokenizer, find_stop, partial_stop_len
from radixserve.scheduler.request import Request
from radixserve.server.args import ServerArgs
from radixserve.server.errors import APIError
from radixserve.server.metrics import ServerMetrics
from radixserve.server.tenancy import Tenancy
from radixserve.server.worker import Delta, EngineWorker, Overloaded

T = TypeVar("T")
MAX_REQUESTS_PER_CALL = 1024  # engine requests (prompts x choices) one HTTP call may make


@dataclass
class ServerState:
    engine: Engine
    args: ServerArgs
    worker: EngineWorker
    metrics: ServerMetrics | None
    tenancy: Tenancy
    # Allowlisted public prompt heads (token ids), longest first: shared across namespaces.
    shared_prefixes: list[list[int]] = field(default_factory=list)
    # Tokenization runs here: off the event loop and off the scheduler thread, one at a time
    # (a fast tokenizer shared between threads may raise "Already borrowed").
    tokenizer_pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="radixserve-tokenizer")
    )
    started: float = field(default_factory=time.time)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    async def tokenize(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn)

    def make_request(
        self, ids: Sequence[int], params: dict[str, Any], explicit_max: bool, extra_key: str | None, arrival: float
    ) -> Request:
        """Validate one prompt against the model and build its request; APIError(400) says why not."""
        context = self.engine.context_length
        if len(ids) == 0:
            raise APIError(400, "the prompt is empty", "empty_prompt", "prompt")
        if len(ids) >= context:
            raise APIError(
                400,
                f"This model's maximum context length is {context} tokens, but the prompt has {len(ids)} tokens.",
                "context_length_exceeded",
                "prompt",
            )
        wanted = params.get("max_new_tokens", SamplingParams.max_new_tokens)
        if explicit_max and type(wanted) is int and len(ids) + wanted > context:  # other types: SamplingParams says
            raise APIError(
                400,
                f"This model's maximum context length is {context} tokens, but you requested "
                f"{len(ids) + wanted} tokens ({len(ids)} in the prompt, {wanted} for the completion).",
                "context_length_exceeded",
                "max_tokens",
            )
        try:
            return self.engine.make_request(ids, params, extra_key, arrival, self.shared_len(ids, extra_key))
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    def shared_len(self, ids: Sequence[int], extra_key: str | None) -> int:
        return shared_head_len(self.shared_prefixes, ids, extra_key)


def shared_head_len(heads: Sequence[Sequence[int]], ids: Sequence[int], extra_key: str | None) -> int:
    """How many leading tokens of a namespaced prompt are an allowlisted public head (``heads`` longest first)."""
    if extra_key is None:
        return 0  # the shared namespace already
    for head in heads:
        if len(head) <= len(ids) and list(ids[: len(head)]) == list(head):
            return len(head)
    return 0


class Generation:
    """The engine requests of one HTTP call; iterate ``deltas()`` on the event loop."""

    def __init__(self, state: ServerState, requests: list[Request]) -> None:
        if len(requests) > MAX_REQUESTS_PER_CALL:
            raise APIError(
                400,
                f"one call may make at most {MAX_REQUESTS_PER_CALL} requests (prompts x n), "
                f"this one makes {len(requests)}",
                "too_many_requests_in_call",
            )
        self.worker = state.worker
        self.requests = requests
        self.results: list[GenerateResult | None] = [None] * len(requests)
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()
        self._pending = {req.rid for req in requests}
        loop = asyncio.get_running_loop()

        def sink(delta: Delta) -> None:
            loop.call_soon_threadsafe(self._queue.put_nowait, delta)

        try:
            self.worker.reserve(len(requests))
        except Overloaded as exc:
            raise APIError.overloaded(str(exc)) from None
        except RuntimeError as exc:  # shutting down, or the scheduler died (then /health says 503 too)
            raise APIError.overloaded(str(exc), "unavailable") from None
        for index, req in enumerate(requests):
            self.worker.submit(req, sink, index)

    async def deltas(self) -> AsyncIterator[Delta]:
        while self._pending:
            delta = await self._queue.get()
            if delta.result is not None:
                self._pending.discard(delta.rid)
                self.results[delta.index] = delta.result
            yield delta

    async def finish(self) -> list[GenerateResult]:
        """Wait for every request; their results in submission order."""
        async for _ in self.deltas():
            pass
        return [r for r in self.results if r is not None]

    def abort(self) -> None:
        """Abort every request still running (safe to call twice, or after they finished)."""
        for rid in self._pending:
            self.worker.abort(rid)


async def finish_unless_disconnected(
    generation: Generation, is_disconnected: Callable[[], Any], poll: float = 0.25
) -> list[GenerateResult]:
    """Non-streaming calls: wait for the results, aborting everything if the client goes away."""
    task = asyncio.ensure_future(generation.finish())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll)
            if done:
                return task.result()
            if await is_disconnected():
                generation.abort()
                raise APIError(499, "client disconnected")
    finally:
        if not task.done():
            generation.abort()
            task.cancel()


class TextStream:
    """Text deltas of one choice: complete characters only, held back while a stop string may form."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stops: Sequence[str]) -> None:
        self._decoder = IncrementalDecoder(tokenizer, prompt_ids)
        self._stops = tuple(s for s in stops if s)
        self.sent = ""

    def push(self, token_ids: Sequence[int]) -> str:
        self._decoder.push(token_ids)
        text = self._decoder.text
        if self._stops:
            match = find_stop(text, self._stops, len(self.sent) - max(map(len, self._stops)) + 1)
            text = match.text if match else text[: len(text) - partial_stop_len(text, self._stops)]
        return self._emit(text)

    def finish(self, final_text: str) -> str:
        """The rest of the choice's text, given the engine's final text (stop strings cut)."""
        return self._emit(final_text)

    def _emit(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta
