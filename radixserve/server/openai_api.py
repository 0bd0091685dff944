"""``/v1/completions`` and ``/v1/chat/completions``: OpenAI request in, OpenAI response or SSE stream out.

One HTTP call becomes ``len(prompts) x n`` engine requests; choice ``index`` is
``prompt_i * n + j``. Choice 0 of a seeded call uses ``seed`` itself and choice
``j > 0`` ``choice_seed(seed, j)``, a hash of the pair, so the choices differ and
each is reproducible. Siblings share the prompt, so all but
the first hit the cache (in-batch dedup holds them until the first has
prefilled it).

Usage: ``prompt_tokens`` counts each prompt once, ``completion_tokens`` every
choice; ``prompt_tokens_details.cached_tokens`` is always filled: per prompt,
the fewest any of its choices read from the cache (what was cached before this
call; siblings' reuse of each other is not counted).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from radixserve.core import GenerateResult, is_texts, is_token_ids
from radixserve.engine.output import LogprobTokens, listed_tokens
from radixserve.model.chat_template import NoChatTemplate
from radixserve.server.errors import APIError, error_event, raise_first_error
from radixserve.server.generation import Generation, ServerState, finish_unless_disconnected
from radixserve.server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from radixserve.server.reasoning import ReasoningStream, after_reasoning, delta_fields, message_fields
from radixserve.server.structured import precompile, response_format_params
from radixserve.server.tools import (
    ToolPlan,
    ToolReplies,
    choice_finish_reason,
    plan_tools,
    render_kwargs,
    template_messages,
    tool_params,
)

logger = logging.getLogger(__name__)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a call seeded with ``seed``: ``seed`` itself for choice 0 (as with n=1),
    else a hash of the pair into [0, 2^63). ``seed + index`` would wrap: torch's CPU generator keeps a
    seed's low 32 bits, so seed 2^63-1's choices 1 and 2 were seed 0 and seed 1. Hashed, no choice
    repeats another seed's by construction (only by a 2^-32 chance of its low bits)."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def check_model(state: ServerState, model: str) -> None:
    """404 unless ``model`` names the served model (its served name or its path)."""
    if model not in {state.args.model_name(), state.engine.config.model_path}:
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves `{state.args.model_name()}`.",
            "model_not_found",
            "model",
        )


async def prompt_batch(
    state: ServerState, prompt: str | list[str] | list[int] | list[list[int]], param: str
) -> list[list[int]]:
    """OpenAI's prompt forms (a text, texts, token ids, lists of token ids) as token id lists; 400 when empty."""
    raw = [prompt] if isinstance(prompt, str) else prompt
    if is_texts(raw):
        texts = list(raw)
        if any(not t for t in texts):
            raise APIError(400, f"the {param} is empty", "empty_prompt", param)
        prompts = await state.tokenize(lambda tok: [tok.encode(t) for t in texts], texts, param)
    elif is_token_ids(raw):
        prompts = [list(raw)]
    else:
        prompts = [list(p) for p in raw]
    if not prompts:
        raise APIError(400, f"the {param} is empty", "empty_prompt", param)
    return prompts


class OpenAICall:
    """What both endpoints share: validation, requests, usage, logprobs, stream framing."""

    kind: str  # "text_completion" | "chat.completion"

    def __init__(self, state: ServerState, body: _SamplingFields, namespace: str | None) -> None:
        self.state, self.body, self.namespace = state, body, namespace
        self.id = f"{'cmpl' if self.kind == 'text_completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.arrival = time.perf_counter()
        check_model(state, body.model)
        problem = body.unsupported()
        if problem:
            raise APIError(400, problem, "unsupported_parameter")
        ignored = sorted(set(body.model_extra or {}) - {"best_of"})
        if ignored:
            logger.info("ignoring unknown request fields %s", ignored)
        self.prompts: list[list[int]] = []
        self.num_choices = 0

    # ---- building ------------------------------------------------------------------------------

    def sampling(self, max_tokens: int | None, logprobs: bool, top_logprobs: int) -> dict[str, Any]:
        body = self.body
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        params: dict[str, Any] = dict(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            stop=tuple(stop),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            **response_format_params(body.response_format, body.regex),
        )
        if max_tokens is not None:
            params["max_new_tokens"] = max_tokens
        else:  # as much as the context leaves (the engine clips)
            params["max_new_tokens"] = self.state.engine.context_length
        return params

    async def start(self, prompts: list[list[int]], params: dict[str, Any], explicit_max: bool) -> Generation:
        await precompile(self.state, params)
        self.prompts = prompts
        n, seed = self.body.n, self.body.seed
        requests = []
        for ids in prompts:
            for j in range(n):
                choice = dict(params, seed=None if seed is None else choice_seed(seed, j))
                requests.append(self.state.make_request(ids, choice, explicit_max, self.namespace, self.arrival))
        self.num_choices = len(requests)
        return Generation(self.state, requests)

    # ---- shared response parts -------------------------------------------------------------------

    def usage(self, results: list[GenerateResult]) -> dict[str, Any]:
        n = self.body.n
        groups = [results[i : i + n] for i in range(0, len(results), n)]
        prompt = sum(group[0].prompt_tokens for group in groups)
        cached = sum(min(r.cached_tokens for r in group) for group in groups)
        completion = sum(len(r.output_ids) for r in results)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def token_text(self, token_id: int) -> str:
        return self.state.tokenizer.decode([token_id], skip_special_tokens=False)

    @staticmethod
    def check_errors(results: list[GenerateResult]) -> None:
        raise_first_error(results)

    async def run(self, generation: Generation, is_disconnected: Callable[[], Any]) -> dict[str, Any]:
        """The whole answer, built on a worker thread: n=64 choices with 20 top logprobs each are ~100 MB of
        Python objects, which built on the event loop stalled every other request (``/health`` for 14 s)."""
        results = await finish_unless_disconnected(generation, is_disconnected)
        self.check_errors(results)
        return await asyncio.to_thread(self.response, results)

    def response(self, results: list[GenerateResult]) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, index: int, delta_text: str, listed: LogprobTokens, finish_reason: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def wants_logprobs(self) -> bool:
        raise NotImplementedError

    def chunks(self, index: int, delta_text: str, listed: LogprobTokens, finish: str | None) -> list[dict[str, Any]]:
        """The stream chunks' choices for one delta: one, unless tool calls split it (ChatCall)."""
        return [self.chunk(index, delta_text, listed, finish)]

    def chunk_envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = "text_completion" if self.kind == "text_completion" else "chat.completion.chunk"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.state.args.model_name(),
            "choices": choices,
        }

    def first_chunks(self) -> list[dict[str, Any]]:
        return []

    async def stream(self, generation: Generation) -> AsyncIterator[str]:
        """SSE: one chunk per choice per step, a last chunk with finish_reason, optional usage, [DONE].

        Cancelled (client gone, server shutting down): the finally aborts what still runs.
        """
        try:
            for chunk in self.first_chunks():
                yield sse(chunk)
            async for delta in generation.deltas():
                result = delta.result
                if result is not None and result.error is not None:
                    yield sse(error_event(result))
                    continue
                if delta.text or delta.token_ids or result is not None:
                    finish = result.finish_reason if result is not None else None
                    for choice in self.chunks(delta.index, delta.text, delta.listed, finish):
                        yield sse(self.chunk_envelope([choice]))
            options = self.body.stream_options
            results = [r for r in generation.results if r is not None]
            if options is not None and options.include_usage and len(results) == len(generation.results):
                yield sse({**self.chunk_envelope([]), "usage": self.usage(results)})
            yield SSE_DONE
        finally:
            generation.abort()


class CompletionCall(OpenAICall):
    kind = "text_completion"
    body: CompletionRequest

    async def begin(self) -> Generation:
        body = self.body
        prompts = await prompt_batch(self.state, body.prompt, "prompt")
        if body.echo and body.logprobs:
            raise APIError(400, "echo with logprobs (prompt logprobs) is not supported", "unsupported_parameter")
        logprobs = body.logprobs is not None
        params = self.sampling(body.max_tokens, logprobs, body.logprobs or 0)
        return await self.start(prompts, params, explicit_max=body.max_tokens is not None)

    def wants_logprobs(self) -> bool:
        return self.body.logprobs is not None

    def echo_text(self, index: int) -> str:
        if not self.body.echo:
            return ""
        return self.state.tokenizer.decode(self.prompts[index // self.body.n])

    def logprobs_block(self, listed: LogprobTokens, echo_len: int) -> dict[str, Any]:
        top = listed.top
        return {
            "tokens": [self.token_text(t) for t in listed.token_ids],
            "token_logprobs": listed.logprobs,
            "top_logprobs": [{self.token_text(t): lp for t, lp in step} for step in top] if top else None,
            "text_offset": [echo_len + start for start in listed.starts],
        }

    def response(self, results: list[GenerateResult]) -> dict[str, Any]:
        choices = []
        for index, result in enumerate(results):
            echo = self.echo_text(index)
            logprobs = None
            if self.body.logprobs is not None:
                logprobs = self.logprobs_block(listed_tokens(result), len(echo))
            choices.append(
                {
                    "index": index,
                    "text": echo + result.text,
                    "logprobs": logprobs,
                    "finish_reason": result.finish_reason,
                    "matched_stop": result.matched_stop,
                }
            )
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.state.args.model_name(),
            "choices": choices,
            "usage": self.usage(results),
        }

    def first_chunks(self) -> list[dict[str, Any]]:
        if not self.body.echo:
            return []
        return [
            self.chunk_envelope([{"index": i, "text": self.echo_text(i), "logprobs": None, "finish_reason": None}])
            for i in range(self.num_choices)
        ]

    def chunk(self, index: int, delta_text: str, listed: LogprobTokens, finish_reason: str | None) -> dict[str, Any]:
        block = None
        if self.body.logprobs is not None:
            block = self.logprobs_block(listed, len(self.echo_text(index)))
        return {"index": index, "text": delta_text, "logprobs": block, "finish_reason": finish_reason}


class ChatCall(OpenAICall):
    kind = "chat.completion"
    body: ChatCompletionRequest
    tools: ToolPlan | None = None  # set by begin()
    replies: ToolReplies | None = None
    reasoning_streams: dict[int, ReasoningStream]  # per choice, when a reasoning parser is on

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reasoning_streams = {}

    async def begin(self) -> Generation:
        body = self.body
        self.tools = plan_tools(body, self.state.args.tool_call_parser, self.state.tokenizer.chat_template)
        messages = template_messages(body, self.tools)
        render = render_kwargs(self.tools)
        try:
            # the bound is on the whole conversation, tools included
            contents = ["".join(m["content"] for m in messages) + (json.dumps(render["tools"]) if render else "")]
            ids = await self.state.tokenize(
                lambda tok: tok.apply_chat_template(messages, **render), contents, "messages"
            )
        except APIError:
            raise
        except NoChatTemplate as exc:  # the model has none and no --chat-template was given
            raise APIError(400, str(exc), "no_chat_template", "messages") from None
        except Exception as exc:  # the template rejects the conversation (e.g. roles out of order)
            raise APIError(400, f"the chat template failed on these messages: {exc}", "invalid_messages") from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = self.sampling(max_tokens, body.logprobs, (body.top_logprobs or 0) if body.logprobs else 0)
        params = await asyncio.to_thread(tool_params, self.tools, params)  # builds a grammar from the schemas
        if self.tools is not None and self.tools.choice != "none":  # who reads calls out of the answers
            self.replies = ToolReplies(self.tools)
        if self.reasoning_parser is not None:  # a forced call's grammar too comes after the reasoning block
            params = await asyncio.to_thread(after_reasoning, self.reasoning_parser, params)
        return await self.start([ids], params, explicit_max=max_tokens is not None)

    @property
    def reasoning_parser(self) -> str | None:
        """The server's --reasoning-parser, unless the request says ``separate_reasoning: false`` (SGLang's)."""
        if (self.body.model_extra or {}).get("separate_reasoning") is False:
            return None
        return self.state.args.reasoning_parser

    def wants_logprobs(self) -> bool:
        return self.body.logprobs

    def logprobs_content(self, listed: LogprobTokens) -> list[dict[str, Any]]:
        token_ids, logprobs, top = listed.token_ids, listed.logprobs, listed.top

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = []
        for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
            alternatives = [entry(t, lp) for t, lp in top[i]] if i < len(top) else []
            content.append({**entry(token_id, logprob), "top_logprobs": alternatives})
        return content

    def response(self, results: list[GenerateResult]) -> dict[str, Any]:
        choices = []
        for index, result in enumerate(results):
            logprobs = None
            if self.body.logprobs:
                logprobs = {"content": self.logprobs_content(listed_tokens(result))}
            fields = message_fields(self.reasoning_parser, result.text)  # content after any reasoning
            message, called = {"role": "assistant", **fields}, False
            if self.replies is not None and fields["content"] is not None:
                message, called = self.replies.message(fields["content"])
                if "reasoning_content" in fields:
                    message["reasoning_content"] = fields["reasoning_content"]
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": choice_finish_reason(result.finish_reason, called),
                    "matched_stop": result.matched_stop,
                }
            )
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.state.args.model_name(),
            "choices": choices,
            "usage": self.usage(results),
        }

    def first_chunks(self) -> list[dict[str, Any]]:
        return [
            self.chunk_envelope(
                [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
            )
            for i in range(self.num_choices)
        ]

    def chunk_logprobs(self, listed: LogprobTokens) -> dict[str, Any] | None:
        return {"content": self.logprobs_content(listed)} if self.body.logprobs else None

    def chunk(self, index: int, delta_text: str, listed: LogprobTokens, finish_reason: str | None) -> dict[str, Any]:
        block = self.chunk_logprobs(listed)
        delta: dict[str, str] = {"content": delta_text} if delta_text or finish_reason is None else {}
        if self.reasoning_parser is not None:
            final = finish_reason is not None
            delta = delta_fields(self.reasoning_streams, self.reasoning_parser, index, delta_text, final)
        return {"index": index, "delta": delta, "logprobs": block, "finish_reason": finish_reason}

    def chunks(self, index: int, delta_text: str, listed: LogprobTokens, finish: str | None) -> list[dict[str, Any]]:
        """With tools: the delta cut into content and tool calls (logprobs on the first chunk, the finish
        reason on the last; a delta that completes nothing yet sends nothing)."""
        replies = self.replies
        if replies is None:
            return [self.chunk(index, delta_text, listed, finish)]
        deltas: list[dict[str, Any]] = []
        if self.reasoning_parser is not None:  # the reasoning as it is, calls only in the content after it
            split = delta_fields(self.reasoning_streams, self.reasoning_parser, index, delta_text, finish is not None)
            deltas = [{"reasoning_content": split["reasoning_content"]}] if "reasoning_content" in split else []
            delta_text = split.get("content", "")
        deltas += replies.deltas(index, delta_text, final=finish is not None)
        if finish is not None or (not deltas and self.body.logprobs):
            deltas.append({})
        if not deltas:
            return []
        # built here, not through chunk(): that would feed the reasoning stream a second time
        choices: list[dict[str, Any]] = [
            {"index": index, "delta": delta, "logprobs": None, "finish_reason": None} for delta in deltas
        ]
        choices[0]["logprobs"] = self.chunk_logprobs(listed)
        choices[-1]["finish_reason"] = choice_finish_reason(finish, replies.called(index))
        return choices
