"""``/tokenize`` and ``/detokenize``: vLLM's shapes, served under SGLang's ``/v1/...`` names too.

    POST /tokenize    {"prompt": "Hi", "add_special_tokens": true, "return_token_strs": false}
                      {"messages": [...], "add_generation_prompt": true}          (through the chat template)
                   -> {"count": 2, "max_model_len": 2048, "tokens": [...], "token_strs": null}
    POST /detokenize  {"tokens": [...]}  ->  {"prompt": "Hi", "text": "Hi"}

``prompt`` may also be a list of strings (SGLang's batch form: ``tokens`` and ``count`` are then lists), and
``/detokenize`` takes a list of token lists likewise. ``add_special_tokens`` defaults as in vLLM: true for a
prompt, false for messages (the template writes its own). Messages render exactly as ``/v1/chat/completions``
renders them (no ``chat_template_kwargs``: that endpoint takes none either). The detokenized text is under
both vLLM's name (``prompt``) and SGLang's (``text``). Nothing here touches the engine's loop: it runs on the
tokenizer thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, params
from pydantic import BaseModel, ConfigDict, Field

from radixserve.core import is_token_ids
from radixserve.model.chat_template import NoChatTemplate
from radixserve.model.tokenizer import Tokenizer
from radixserve.server.errors import APIError
from radixserve.server.generation import ServerState
from radixserve.server.openai_api import check_model
from radixserve.server.protocol import ChatCompletionRequest, ChatMessage


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (vLLM's defaults)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = False


def chat_ids(tokenizer: Tokenizer, body: TokenizeRequest, add_special_tokens: bool) -> list[int]:
    """The conversation through the model's chat template, as ``/v1/chat/completions`` renders it."""
    assert body.messages is not None
    messages = ChatCompletionRequest.model_construct(messages=body.messages).template_messages()
    text = tokenizer.render_chat(
        messages, body.add_generation_prompt, continue_final_message=body.continue_final_message
    )
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


async def tokenize(state: ServerState, body: TokenizeRequest) -> dict[str, Any]:
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", "invalid_request", "prompt")
    if body.messages is not None:
        problem = ChatCompletionRequest.model_construct(messages=body.messages).unsupported()
        if problem:
            raise APIError(400, problem, "unsupported_parameter", "messages")
        special = bool(body.add_special_tokens)
        contents = ["".join(str(m.content or "") for m in body.messages)]
        try:
            ids = await state.tokenize(lambda tok: [chat_ids(tok, body, special)], contents, "messages")
        except NoChatTemplate as exc:
            raise APIError(400, str(exc), "no_chat_template", "messages") from None
        except APIError:
            raise
        except Exception as exc:  # the template rejects the conversation
            raise APIError(400, f"the chat template failed on these messages: {exc}", "invalid_messages") from None
    else:
        texts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt or [])
        special = body.add_special_tokens is not False
        ids = await state.tokenize(lambda tok: [tok.encode(t, special) for t in texts], texts, "prompt")
    token_strs = [state.tokenizer.hf.convert_ids_to_tokens(one) for one in ids] if body.return_token_strs else None
    single = not isinstance(body.prompt, list)
    return {
        "count": len(ids[0]) if single else [len(one) for one in ids],
        "max_model_len": state.engine.context_length,
        "tokens": ids[0] if single else ids,
        "token_strs": (token_strs[0] if single else token_strs) if token_strs is not None else None,
    }


def check_token_ids(batch: Sequence[Sequence[int]], vocab_size: int, param: str) -> None:
    """400 naming the first id outside the tokenizer's vocabulary."""
    for ids in batch:
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(400, f"{param}: {bad} is not a token id (0..{vocab_size - 1})", "invalid_token_id", param)


async def detokenize(state: ServerState, body: DetokenizeRequest) -> dict[str, Any]:
    raw = body.tokens
    single = is_token_ids(raw)
    batch = [list(raw)] if is_token_ids(raw) else [list(ids) for ids in raw]
    check_token_ids(batch, state.tokenizer.vocab_size, "tokens")
    skip = body.skip_special_tokens
    texts = await state.tokenize(lambda tok: [tok.decode(ids, skip) for ids in batch], [], "tokens")
    text: str | list[str] = texts[0] if single else texts
    return {"prompt": text, "text": text}


def tokenize_router(state: ServerState, auth: Sequence[params.Depends]) -> APIRouter:
    router = APIRouter(dependencies=auth)

    @router.post("/tokenize")
    @router.post("/v1/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            check_model(state, body.model)
        return await tokenize(state, body)

    @router.post("/detokenize")
    @router.post("/v1/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            check_model(state, body.model)
        return await detokenize(state, body)

    return router
