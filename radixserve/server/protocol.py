"""Request schemas: OpenAI-compatible (``/v1/completions``, ``/v1/chat/completions``) and native (``/generate``).

Validation is strict: a field of the wrong type (``"max_tokens": "5"``, ``"n": true``)
is a 400, never coerced. Unknown fields in the OpenAI schemas are ignored (clients
send vendor fields; the server logs them), except the ones whose meaning we would
silently drop (``UNSUPPORTED``), which are a 400. The native schema rejects every
unknown field. Responses are built as plain dicts in ``openai_api``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from radixserve.core import MAX_TOP_LOGPROBS

MAX_N = 64  # choices per request
MAX_STOP = 16  # stop strings per request
MAX_SALT = 512  # characters of a cache_salt / extra_key
MAX_TOOLS = 128  # tools per chat request (OpenAI's limit)

# Fields a client may send that we do not implement; accepting them silently would
# return something other than what was asked for.
UNSUPPORTED = {
    "logit_bias": "logit_bias is not supported",
    "suffix": "suffix (insertion) is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
}


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields both OpenAI endpoints share; ``top_k`` and below are extensions (SGLang / vLLM names)."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = Field(None, max_length=MAX_STOP)
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(
        None, min_length=1, max_length=MAX_SALT, description="put this request in its own cache namespace"
    )
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP)
    response_format: ResponseFormat | None = None  # text, json_object, json_schema (see server/structured.py)
    regex: str | None = None  # SGLang's extension: the whole output matches this regex (not with response_format)

    def unsupported(self) -> str | None:
        """Why this request asks for something we cannot do, or None."""
        extra = self.model_extra or {}
        for name, message in UNSUPPORTED.items():
            if extra.get(name) not in (None, {}, [], ""):
                return message
        best_of = extra.get("best_of")
        if best_of is not None and best_of != self.n:
            return "best_of is not supported (use n)"
        return None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str
    arguments: str  # a JSON object, as the API returned it


class ToolCall(BaseModel):
    """A call in an assistant message of the history (see server/tools.py)."""

    model_config = ConfigDict(strict=True, extra="allow")
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: FunctionName


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)  # see server/tools.py
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def unsupported(self) -> str | None:
        for message in self.messages:
            for part in message.content if isinstance(message.content, list) else []:
                if part.type != "text" or part.text is None:
                    return f"message content of type {part.type!r} is not supported (only 'text')"
        return super().unsupported()

    def template_messages(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them: text content, ``developer`` read as ``system``."""
        messages = []
        for message in self.messages:
            content = message.content
            if isinstance(content, list):
                content = "\n".join(part.text or "" for part in content)
            messages.append(
                {"role": "system" if message.role == "developer" else message.role, "content": content or ""}
            )
        return messages


TopLogprobsNum = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]  # bounds per value: a union takes none


class GenerateRequest(BaseModel):
    """The native API: SGLang's ``/generate`` shape. ``text`` or ``input_ids``, one or a batch.

    The fields below are honoured; SGLang's other fields land in ``model_extra`` and
    ``sglang_fields.triage`` decides (ignored with a warning, or a 400).
    """

    model_config = ConfigDict(strict=True, extra="allow")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: str | list[str] | None = Field(None, description="request id(s), echoed in meta_info.id")
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = Field(None, description="-1: no prompt logprobs (the only choice)")
    top_logprobs_num: TopLogprobsNum | list[TopLogprobsNum] | None = None
    return_text_in_logprobs: bool = False
    routing_key: str | None = Field(None, max_length=MAX_SALT)
    priority: int | None = Field(None, ge=-(1 << 31), lt=1 << 31)
    extra_key: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_SALT,
        description="cache namespace: requests with different keys never share a prefix",
    )
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT, description="same as extra_key")
