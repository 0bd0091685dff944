"""``/generate``: the native API, shaped like SGLang's (and like ``Engine.generate``'s results).

``{"text": "..." | [...], "input_ids": [...] | [[...]], "sampling_params": {...} | [...],
"stream": false, "return_logprob": false, "top_logprobs_num": 0, "extra_key": null}`` ->
one ``{"text", "output_ids", "meta_info"}`` per prompt (a list for a batch). A stream
sends, per step, each request's whole text so far (SGLang's convention), then ``[DONE]``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from radixserve.core import SamplingParams
from radixserve.server.errors import APIError, raise_first_error
from radixserve.server.generation import Generation, ServerState, TextStream, finish_unless_disconnected
from radixserve.server.openai_api import SSE_DONE, sse
from radixserve.server.protocol import GenerateRequest


class NativeCall:
    def __init__(self, state: ServerState, body: GenerateRequest, namespace: str | None) -> None:
        self.state, self.body, self.namespace = state, body, namespace
        self.arrival = time.perf_counter()
        self.single = True
        self.streams: list[TextStream] = []
        self.generation: Generation | None = None

    async def begin(self) -> Generation:
        body, tokenizer = self.body, self.state.tokenizer
        if (body.text is None) == (body.input_ids is None):
            raise APIError(400, "give exactly one of text and input_ids", param="text")
        if body.text is not None:
            texts = [body.text] if isinstance(body.text, str) else list(body.text)
            self.single = isinstance(body.text, str)
            if not texts or any(not t for t in texts):
                raise APIError(400, "the prompt is empty", "empty_prompt", "text")
            prompts = await self.state.tokenize(lambda: [tokenizer.encode(t) for t in texts])
        else:
            ids = body.input_ids or []
            self.single = not ids or isinstance(ids[0], int)
            prompts = [list(ids)] if self.single else [list(p) for p in ids]  # type: ignore[arg-type]
        raw = body.sampling_params
        per_prompt = raw if isinstance(raw, list) else [raw or {}] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise APIError(
                400, f"{len(per_prompt)} sampling_params for {len(prompts)} prompts", param="sampling_params"
            )
        requests = []
        for ids, params in zip(prompts, per_prompt):
            params = dict(params)
            if body.return_logprob or body.top_logprobs_num:
                params.setdefault("logprobs", True)
                params.setdefault("top_logprobs", body.top_logprobs_num)
            try:
                stops = SamplingParams.from_dict(params).stop
            except (TypeError, ValueError) as exc:
                raise APIError(400, f"sampling_params: {exc}", param="sampling_params") from None
            explicit = "max_new_tokens" in params
            requests.append(self.state.make_request(ids, params, explicit, self.namespace, self.arrival))
            self.streams.append(TextStream(tokenizer, ids, stops))
        return Generation(self.state, requests)

    async def run(self, generation: Generation, is_disconnected: Callable[[], Any]) -> Any:
        results = await finish_unless_disconnected(generation, is_disconnected)
        raise_first_error(results)
        outs = []
        for req, result in zip(generation.requests, results):
            out = result.to_dict()
            out["meta_info"]["id"] = str(req.rid)
            outs.append(out)
        return outs[0] if self.single else outs

    async def stream(self, generation: Generation) -> AsyncIterator[str]:
        try:
            output_ids: list[list[int]] = [[] for _ in generation.requests]
            async for delta in generation.deltas():
                stream = self.streams[delta.index]
                stream.push(delta.token_ids)
                output_ids[delta.index].extend(delta.token_ids)
                req = generation.requests[delta.index]
                meta: dict[str, Any] = {
                    "id": str(req.rid),
                    "prompt_tokens": len(req.prompt_ids),
                    "completion_tokens": len(output_ids[delta.index]),
                    "finish_reason": None,
                }
                if delta.result is not None:
                    stream.finish(delta.result.text)
                    meta = {**delta.result.to_dict()["meta_info"], "id": str(req.rid)}
                yield sse(
                    {
                        "text": stream.sent,
                        "output_ids": output_ids[delta.index],
                        "index": delta.index,
                        "meta_info": meta,
                    }
                )
            yield SSE_DONE
        finally:
            generation.abort()
