"""Structured output on the HTTP endpoints: which grammar a request asks for, compiled off the event loop.

OpenAI's ``response_format`` (chat and completions) becomes a JSON schema::

    {"type": "text"}                                   no constraint
    {"type": "json_object"}                            any JSON object: the schema {"type": "object"}
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}

``/generate`` takes SGLang's ``json_schema`` / ``regex`` / ``ebnf`` sampling parameters as they are.
``precompile`` compiles the request's grammar on a worker thread (memoised by the spec's hash, so
a repeated schema costs nothing) before the request is built: the event loop and the scheduler
thread never wait on a compile, and a spec that does not compile is a 400 naming the problem
before any request exists (nothing cached, no KV slot taken).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from radixserve.model.grammar import GRAMMAR_KINDS, GrammarError
from radixserve.server.errors import APIError
from radixserve.server.generation import ServerState
from radixserve.server.protocol import ResponseFormat

JSON_OBJECT_SCHEMA = '{"type": "object"}'


def response_format_params(response_format: ResponseFormat | None, regex: str | None = None) -> dict[str, str]:
    """The sampling parameters an OpenAI ``response_format`` (or SGLang's ``regex``) stands for (empty: none)."""
    if regex is not None:
        if response_format is not None and response_format.type != "text":
            raise APIError(400, "give response_format or regex, not both", "unsupported_parameter", "regex")
        return {"regex": regex}
    if response_format is None or response_format.type == "text":
        return {}
    if response_format.type == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if response_format.type != "json_schema":
        raise APIError(
            400,
            f"response_format type {response_format.type!r} is not supported (text, json_object, json_schema)",
            "unsupported_parameter",
            "response_format",
        )
    spec = (response_format.model_extra or {}).get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict | bool):
        raise APIError(
            400,
            "response_format json_schema needs json_schema.schema: a JSON Schema object",
            "invalid_json_schema",
            "response_format.json_schema.schema",
        )
    return {"json_schema": json.dumps(schema)}


async def precompile(state: ServerState, params: dict[str, Any]) -> None:
    """Compile the grammar ``params`` asks for on a worker thread; APIError(400) when it does not compile."""
    asked = [(kind, params[kind]) for kind in GRAMMAR_KINDS if params.get(kind) is not None]
    if len(asked) != 1 or not isinstance(asked[0][1], str):
        return  # none, or a malformed request that SamplingParams names
    kind, source = asked[0]
    loop = asyncio.get_running_loop()
    try:
        await loop.run_in_executor(None, state.engine.grammars.compile, kind, source)
    except GrammarError as exc:
        raise APIError(400, str(exc), f"invalid_{kind}", kind) from None
