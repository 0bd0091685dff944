"""``/generate``: the native API, shaped like SGLang's (and like ``Engine.generate``'s results).

``{"text": "..." | [...], "input_ids": [...] | [[...]], "sampling_params": {...} | [...],
"stream": false, "rid", "return_logprob", "top_logprobs_num", "return_text_in_logprobs",
"extra_key", "routing_key", "priority", ...}`` -> one ``{"text", "output_ids", "meta_info"}``
per prompt (a list for a batch). A stream sends, per step, each request's whole text so far
(SGLang's convention), then ``[DONE]``; a request that fails mid-stream sends an error event.
SGLang's other request fields: see ``sglang_fields``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from radixserve.core import GenerateResult, SamplingParams, is_token_ids
from radixserve.scheduler.request import Request
from radixserve.server.errors import APIError, error_event, raise_first_error
from radixserve.server.generation import Generation, ServerState, finish_unless_disconnected
from radixserve.server.openai_api import SSE_DONE, sse
from radixserve.server.protocol import GenerateRequest
from radixserve.server.sglang_fields import native_sampling, triage
from radixserve.server.structured import precompile

logger = logging.getLogger(__name__)


def per_prompt(value: Any, count: int, name: str) -> list[Any]:
    """A field given once or per prompt, as one value per prompt."""
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise APIError(400, f"{len(value)} {name} for {count} prompts", param=name)
    return value


class NativeCall:
    def __init__(self, state: ServerState, body: GenerateRequest, namespace: str | None) -> None:
        self.state, self.body, self.namespace = state, body, namespace
        self.arrival = time.perf_counter()
        self.single = True
        self.rids: list[str | None] = []
        self.return_logprob: list[bool] = []
        ignored, problem = triage(dict(body.model_extra or {}))
        if problem is not None:
            raise APIError(400, problem, "unsupported_parameter")
        for name in ignored:
            if name not in state.warned_fields:
                state.warned_fields.add(name)
                logger.warning("/generate: ignoring SGLang field %r (this server does not implement it)", name)

    async def prompts(self) -> list[list[int]]:
        body = self.body
        if (body.text is None) == (body.input_ids is None):
            raise APIError(400, "give exactly one of text and input_ids", param="text")
        if body.text is not None:
            texts = [body.text] if isinstance(body.text, str) else list(body.text)
            self.single = isinstance(body.text, str)
            if not texts or any(not t for t in texts):
                raise APIError(400, "the prompt is empty", "empty_prompt", "text")
            return await self.state.tokenize(lambda tok: [tok.encode(t) for t in texts], texts, "text")
        ids = body.input_ids or []
        self.single = is_token_ids(ids)
        return [list(ids)] if is_token_ids(ids) else [list(p) for p in ids]

    async def begin(self) -> Generation:
        body = self.body
        prompts = await self.prompts()
        count = len(prompts)
        raw = body.sampling_params
        per_params = per_prompt(raw if raw is not None else {}, count, "sampling_params")
        logprob = per_prompt(body.return_logprob, count, "return_logprob")
        top = per_prompt(body.top_logprobs_num, count, "top_logprobs_num")
        start = per_prompt(body.logprob_start_len, count, "logprob_start_len")
        self.rids = per_prompt(body.rid, count, "rid")
        requests = []
        for i, ids in enumerate(prompts):
            params = self.sampling(per_params[i])
            await precompile(self.state, params)
            req = self.request(ids, params, bool(logprob[i]), top[i] or 0)
            if logprob[i] and start[i] is not None:
                req.ask_prompt_logprobs(start[i])  # SGLang's select ranks choices by these
            requests.append(req)
        self.return_logprob = [bool(lp or k) for lp, k in zip(logprob, top)]
        return Generation(self.state, requests)

    @staticmethod
    def sampling(raw: Any) -> dict[str, Any]:
        if not isinstance(raw, dict):
            raise APIError(400, "sampling_params must be an object", param="sampling_params")
        params, problem = native_sampling(raw)
        if problem is not None:
            raise APIError(400, problem, "unsupported_parameter", "sampling_params")
        return params

    def request(self, ids: list[int], params: dict[str, Any], logprob: bool, top: int) -> Request:
        if logprob or top:
            params.setdefault("logprobs", True)
            params.setdefault("top_logprobs", top)
        try:
            SamplingParams.from_dict(params)  # say which field is wrong, in SGLang's terms
        except (TypeError, ValueError) as exc:
            raise APIError(400, f"sampling_params: {exc}", param="sampling_params") from None
        explicit = "max_new_tokens" in params
        req = self.state.make_request(ids, params, explicit, self.namespace, self.arrival)
        req.priority = self.body.priority or 0
        req.routing_key = self.body.routing_key
        return req

    def answer(self, index: int, req: Request, result: GenerateResult) -> dict[str, Any]:
        """SGLang's shape; with return_logprob each logprob is ``[logprob, token id, text or None]``."""
        out = result.to_dict()
        meta = out["meta_info"]
        meta["id"] = self.rids[index] if self.rids[index] is not None else str(req.rid)
        if not self.return_logprob[index]:
            return out
        meta["output_token_logprobs"] = [self.triple(lp, t) for lp, t in zip(result.output_logprobs, result.output_ids)]
        if result.output_top_logprobs:
            meta["output_top_logprobs"] = [
                [self.triple(lp, t) for t, lp in step] for step in result.output_top_logprobs
            ]
        scored = result.input_logprobs or []
        prompt = req.prompt_ids[len(req.prompt_ids) - len(scored) :].tolist()
        meta["input_token_logprobs"] = [self.triple(lp, t) for lp, t in zip(scored, prompt)]
        return out

    def triple(self, logprob: float | None, token_id: int) -> list[Any]:
        text = self.token_text(token_id) if self.body.return_text_in_logprobs else None
        return [logprob, token_id, text]

    def token_text(self, token_id: int) -> str:
        return self.state.tokenizer.decode([token_id], skip_special_tokens=False)

    async def run(self, generation: Generation, is_disconnected: Callable[[], Any]) -> Any:
        results = await finish_unless_disconnected(generation, is_disconnected)
        raise_first_error(results)

        def answers() -> Any:  # on a worker thread, as OpenAICall.run builds its answer
            outs = [self.answer(i, req, res) for i, (req, res) in enumerate(zip(generation.requests, results))]
            return outs[0] if self.single else outs

        return await asyncio.to_thread(answers)

    async def stream(self, generation: Generation) -> AsyncIterator[str]:
        try:
            output_ids: list[list[int]] = [[] for _ in generation.requests]
            texts = ["" for _ in generation.requests]
            async for delta in generation.deltas():
                i, req = delta.index, generation.requests[delta.index]
                texts[i] += delta.text
                output_ids[i].extend(delta.token_ids)
                if delta.result is not None and delta.result.error is not None:
                    yield sse(error_event(delta.result))
                    continue
                meta: dict[str, Any] = {
                    "id": self.rids[i] if self.rids[i] is not None else str(req.rid),
                    "prompt_tokens": len(req.prompt_ids),
                    "completion_tokens": len(output_ids[i]),
                    "finish_reason": None,
                }
                if delta.result is not None:
                    meta = self.answer(i, req, delta.result)["meta_info"]
                yield sse({"text": texts[i], "output_ids": output_ids[i], "index": i, "meta_info": meta})
            yield SSE_DONE
        finally:
            generation.abort()
