"""One HTTP call's requests on the engine: tokenize, validate, submit, and collect their deltas.

``ServerState`` holds what every handler needs. ``Generation`` submits a call's
requests (prompts x choices) to the scheduler thread and yields their deltas on
the event loop; closing it early (client gone, handler cancelled) aborts what is
still running, so locks and slots come back at once. Each delta carries its text
and the tokens whose logprobs it lists, made once by the engine's output stage
(``engine/output.py``): the server never detokenizes output.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import copy
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from radixserve.core import GenerateResult, SamplingParams
from radixserve.engine import Engine
from radixserve.engine.driver import Delta
from radixserve.model.tokenizer import Tokenizer
from radixserve.scheduler.request import Request
from radixserve.server.args import ServerArgs
from radixserve.server.errors import APIError
from radixserve.server.metrics import ServerMetrics
from radixserve.server.protocol import MAX_STOP
from radixserve.server.tenancy import Tenancy
from radixserve.server.worker import EngineWorker, Overloaded

if TYPE_CHECKING:  # OpenTelemetry is imported only when tracing is on
    from radixserve.server.tracing import RequestTracer

T = TypeVar("T")
MAX_REQUESTS_PER_CALL = 1024  # engine requests (prompts x choices) one HTTP call may make
BIG_TEXT_CHARS = 32_768  # a call with more text than this tokenizes on the big-prompt thread
MIN_CHARS_PER_TOKEN = 16  # the character bound's floor (tokenizers that drop whitespace between tokens)
# The headers of the HTTP call this task handles (``respond`` sets them): a traced request's parent
# comes from their ``traceparent``. Per task, as OpenTelemetry keeps its own current context.
CALL_HEADERS: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "radixserve_call_headers", default=None
)


def chars_per_token_bound(tokenizer: Tokenizer) -> int:
    """At least as many characters as any one token stands for.

    A vocabulary entry is written with one character per byte or character it covers
    (byte-level BPE's "Ġ", SentencePiece's "▁"), so its length bounds its text. A prompt
    longer than context x this many characters has more tokens than the context holds,
    and is refused before it is tokenized at all.
    """
    longest = max((len(token) for token in tokenizer.hf.get_vocab()), default=1)
    return max(MIN_CHARS_PER_TOKEN, longest)


@dataclass
class ServerState:
    engine: Engine
    args: ServerArgs
    worker: EngineWorker
    metrics: ServerMetrics | None
    tenancy: Tenancy
    # Allowlisted public prompt heads (token ids), longest first: shared across namespaces.
    shared_prefixes: list[list[int]] = field(default_factory=list)
    # Tokenization runs off the event loop and off the scheduler thread: small prompts on one
    # thread, big ones (over BIG_TEXT_CHARS) on another with its own copy of the tokenizer, so a
    # megabyte of text never holds up a two-word prompt (tokenizers releases the GIL while it works).
    tokenizer_pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="radixserve-tokenizer")
    )
    big_tokenizer_pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="radixserve-tokenizer-big")
    )
    started: float = field(default_factory=time.time)
    warned_fields: set[str] = field(default_factory=set)  # ignored request fields already logged once
    tracer: RequestTracer | None = None  # --otlp-traces-endpoint

    def __post_init__(self) -> None:
        self.max_prompt_chars = self.engine.context_length * chars_per_token_bound(self.tokenizer)
        self._big_tokenizer: Tokenizer | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    async def tokenize(self, fn: Callable[[Tokenizer], T], texts: Sequence[str], param: str) -> T:
        """``fn(tokenizer)`` on a tokenizer thread, once ``texts`` passed the character bound."""
        sizes = [len(text) for text in texts]
        longest = max(sizes, default=0)
        if longest > self.max_prompt_chars:
            raise APIError(
                400,
                f"the prompt has {longest} characters: more than this model's context of "
                f"{self.engine.context_length} tokens can hold (at most {self.max_prompt_chars} characters)",
                "context_length_exceeded",
                param,
            )
        loop = asyncio.get_running_loop()
        if sum(sizes) <= BIG_TEXT_CHARS:
            return await loop.run_in_executor(self.tokenizer_pool, fn, self.tokenizer)
        return await loop.run_in_executor(self.big_tokenizer_pool, lambda: fn(self.big_tokenizer()))

    def big_tokenizer(self) -> Tokenizer:
        """The big-prompt thread's own tokenizer (one Rust tokenizer per thread: no "Already borrowed")."""
        if self._big_tokenizer is None:
            self._big_tokenizer = copy.deepcopy(self.tokenizer)
        return self._big_tokenizer

    def shutdown_tokenizers(self) -> None:
        self.tokenizer_pool.shutdown(wait=False)
        self.big_tokenizer_pool.shutdown(wait=False)

    async def worker_call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the scheduler thread between two steps."""
        return await asyncio.wrap_future(self.worker.call(fn))

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
        if type(wanted) is int:  # other types: SamplingParams says what is wrong
            params = self.fit_max_tokens(len(ids), wanted, explicit_max, params)
        check_stops(params, self.tokenizer.vocab_size)
        try:
            return self.engine.make_request(ids, params, extra_key, arrival, self.shared_len(ids, extra_key))
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    def fit_max_tokens(self, prompt_len: int, wanted: int, explicit: bool, params: dict[str, Any]) -> dict[str, Any]:
        """400 when an explicit max_tokens cannot fit; else ``params`` with max_new_tokens the pool can hold.

        A request whose prompt + completion exceeds the context, or the whole KV pool, could
        only be decoded and then fail: refuse it now. A default max_tokens shrinks instead.
        """
        context, pool = self.engine.context_length, self.engine.allocator.size
        if explicit and prompt_len + wanted > context:
            raise APIError(
                400,
                f"This model's maximum context length is {context} tokens, but you requested "
                f"{prompt_len + wanted} tokens ({prompt_len} in the prompt, {wanted} for the completion).",
                "context_length_exceeded",
                "max_tokens",
            )
        if explicit and prompt_len + wanted > pool:
            raise APIError(
                400,
                f"The KV cache holds {pool} tokens (--max-total-tokens), but you requested "
                f"{prompt_len + wanted} tokens ({prompt_len} in the prompt, {wanted} for the completion).",
                "kv_pool_exceeded",
                "max_tokens",
            )
        if prompt_len + wanted > pool:
            return {**params, "max_new_tokens": max(0, pool - prompt_len)}
        return params

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


def check_stops(params: dict[str, Any], vocab_size: int) -> None:
    """At most MAX_STOP stop strings and stop token ids, each id in the vocabulary (every endpoint)."""
    stop, ids = params.get("stop"), params.get("stop_token_ids")
    for name, values in (("stop", stop), ("stop_token_ids", ids)):
        if isinstance(values, list | tuple) and len(values) > MAX_STOP:
            raise APIError(400, f"{name}: at most {MAX_STOP} values, got {len(values)}", param=name)
    for token in ids if isinstance(ids, list | tuple) else ():
        if type(token) is int and not 0 <= token < vocab_size:
            raise APIError(
                400, f"stop_token_ids: {token} is not a token id (0..{vocab_size - 1})", param="stop_token_ids"
            )


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
        if state.tracer is not None:
            state.tracer.begin(requests, CALL_HEADERS.get() or {})
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
