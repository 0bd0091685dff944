"""Tool calling on ``/v1/chat/completions``: tools into the prompt, calls out of the answer.

In: the request's ``tools`` reach the model through its own chat template (``tools=`` in the template's
context) when the template renders tools; assistant ``tool_calls`` and ``role: "tool"`` results go to the
template as transformers' convention has them (arguments as objects). A template with no tools support
(SmolLM2's, most small models') gets ``FALLBACK_BLOCK``, Hermes' format, appended to the system prompt, and
past calls and results written in that format: the tools are never silently dropped.

Out: ``tool_parsers`` cuts the answer into content and calls (the parser from ``--tool-call-parser``, else
the one the template's format shows, Hermes for the fallback). ``tool_choice``:

- ``auto`` (the default with tools): the model chooses; a call that does not parse stays content.
- ``none``: the tools stay in the prompt (the same prefix as the turns that may call, for the cache), and
  the answer is content.
- ``required`` / a named function: constrained decoding with a grammar built from the tools' schemas in the
  model's own call format, so the answer is always calls whose arguments match their schema.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from radixserve.model.grammar import GrammarError, json_schema_rules
from radixserve.model.grammar_checks import ConstraintError, check_schema
from radixserve.server.errors import APIError
from radixserve.server.protocol import ChatCompletionRequest, ChatMessage
from radixserve.server.tool_parsers import PARSERS, BaseToolParser, HermesParser, ToolStream, detect_parser

FALLBACK_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolPlan:
    """How one request's tools are rendered and its answer read."""

    tools: list[dict[str, Any]]  # OpenAI's shape, unset fields left out
    choice: str  # "auto" | "none" | "required" | "function" (one named function: ``forced``)
    forced: str | None
    parallel: bool
    parser: BaseToolParser
    native: bool  # the chat template renders tools itself (else FALLBACK_BLOCK)

    def call_id(self, client_id: str) -> str:
        """The id the template writes for a client's call id: Mistral's templates take 9 letters and digits."""
        if self.parser.name != "mistral" or (len(client_id) == 9 and client_id.isalnum()):
            return client_id
        return hashlib.sha256(client_id.encode()).hexdigest()[:9]


def renders_tools(template: str | None) -> bool:
    return bool(template) and "tools" in (template or "")


def tool_format(flag: str | None, template: str | None) -> dict[str, Any]:
    """How this server renders tools and reads calls (``/server_info``): parser None = a request with tools is
    a 400 (the template renders tools in a format no parser knows)."""
    native = renders_tools(template)
    parser = flag or (detect_parser(template or "") if native else HermesParser.name)
    return {"parser": parser, "template_renders_tools": native, "fallback_block": not native}


def plan_tools(body: ChatCompletionRequest, flag: str | None, template: str | None) -> ToolPlan | None:
    """The request's tool plan (None: no tools and no tool messages); APIError(400) for bad tools."""
    has_history = any(m.tool_calls or m.role == "tool" for m in body.messages)
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools: this request has none", "invalid_tool_choice", "tool_choice")
        if not has_history:
            return None
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    names = [tool["function"]["name"] for tool in tools]
    check_tools(tools, names)
    forced = None if isinstance(choice, str) or choice is None else choice.function.name
    if forced is not None and forced not in names:
        raise APIError(
            400,
            f"tool_choice names the function {forced!r}, which is not in tools ({', '.join(names)})",
            "invalid_tool_choice",
            "tool_choice",
        )
    found = tool_format(flag, template)
    native, parser_name = found["template_renders_tools"], found["parser"]
    if parser_name is None:
        raise APIError(
            400,
            "this model's chat template renders tools in a format no tool-call parser knows: start the server with "
            f"--tool-call-parser ({', '.join(PARSERS)})",
            "unsupported_tool_format",
            "tools",
        )
    mode = "function" if forced else (choice if isinstance(choice, str) else "auto") if tools else "none"
    return ToolPlan(tools, mode, forced, body.parallel_tool_calls, PARSERS[parser_name](), native)


def check_tools(tools: list[dict[str, Any]], names: list[str]) -> None:
    """Unique names; each ``parameters`` a JSON schema of an object that constrained decoding can keep."""
    for i, tool in enumerate(tools):
        where = f"tools[{i}].function.parameters"
        if names.count(names[i]) > 1:
            raise APIError(400, f"tools: the function name {names[i]!r} appears twice", "invalid_tools", "tools")
        parameters = tool["function"].get("parameters", {"type": "object"})
        if parameters.get("type", "object") != "object":
            raise APIError(400, f"{where}: the schema must describe an object", "invalid_tool_schema", where)
        try:
            check_schema(json.dumps(parameters))
        except ConstraintError as exc:
            raise APIError(400, f"{where}: {exc}", "invalid_tool_schema", where) from None


def template_messages(body: ChatCompletionRequest, plan: ToolPlan | None) -> list[dict[str, Any]]:
    """The messages as the chat template takes them, with tool calls and results; 400 for a tool message
    whose tool_call_id no earlier assistant call has, or call arguments that are not a JSON object."""
    messages = body.template_messages()
    if plan is None:
        return messages
    names: dict[str, str] = {}  # call id -> function name
    out: list[dict[str, Any]] = []
    for i, (message, rendered) in enumerate(zip(body.messages, messages)):
        if message.tool_calls:
            rendered = assistant_call_message(i, message, rendered, plan, names)
        elif message.role == "tool":
            rendered = tool_result_message(i, message, rendered, plan, names)
        out.append(rendered)
    return out if plan.native else fallback_messages(out, plan)


def assistant_call_message(
    i: int, message: ChatMessage, rendered: dict[str, Any], plan: ToolPlan, names: dict[str, str]
) -> dict[str, Any]:
    calls = []
    for j, call in enumerate(message.tool_calls or []):
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            where = f"messages[{i}].tool_calls[{j}].function.arguments"
            raise APIError(400, f"{where}: not a JSON object", "invalid_tool_call", where)
        names[call.id] = call.function.name
        function = {"name": call.function.name, "arguments": arguments}
        calls.append({"id": plan.call_id(call.id), "type": "function", "function": function})
    return {**rendered, "tool_calls": calls}


def tool_result_message(
    i: int, message: ChatMessage, rendered: dict[str, Any], plan: ToolPlan, names: dict[str, str]
) -> dict[str, Any]:
    call_id = message.tool_call_id
    if call_id is None or call_id not in names:
        where = f"messages[{i}].tool_call_id"
        said = "has no tool_call_id" if call_id is None else f"answers {call_id!r}"
        raise APIError(
            400,
            f"{where}: this tool message {said}, which matches no tool call of an earlier assistant message",
            "invalid_tool_message",
            where,
        )
    return {**rendered, "tool_call_id": plan.call_id(call_id), "name": names[call_id]}


def fallback_messages(messages: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
    """For a template without tools: FALLBACK_BLOCK in the system prompt, calls and results as Hermes text
    (results as user turns, consecutive ones joined, as Qwen's template writes them)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if "tool_calls" in message:
            calls = [hermes_call(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
            text = "\n".join(([message["content"]] if message["content"] else []) + calls)
            out.append({"role": "assistant", "content": text})
        elif message["role"] == "tool":
            result = f"<tool_response>\n{message['content']}\n</tool_response>"
            if out and out[-1].get("tool_result"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "tool_result": True})
        else:
            out.append(dict(message))
    for message in out:
        message.pop("tool_result", None)
    if plan.tools:
        block = FALLBACK_BLOCK.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in plan.tools))
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def hermes_call(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def render_kwargs(plan: ToolPlan | None) -> dict[str, Any]:
    """What the chat template's context gets besides the messages."""
    return {"tools": plan.tools} if plan is not None and plan.native and plan.tools else {}


def forced_grammar(plan: ToolPlan) -> str:
    """EBNF for ``required`` / a named function: one call (or more, with parallel_tool_calls) in the
    parser's format, each ``{"name": <a tool's name>, <arguments key>: <an object of its schema>}``."""
    key = plan.parser.arguments_keys[0]
    cases = []
    for tool in plan.tools:
        function = tool["function"]
        if plan.forced is None or function["name"] == plan.forced:
            cases.append(
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": function["name"]},
                        key: function.get("parameters", {"type": "object"}),
                    },
                    "required": ["name", key],
                    "additionalProperties": False,
                }
            )
    schema = cases[0] if len(cases) == 1 else {"anyOf": cases}
    parallel = plan.parallel and plan.forced is None and not plan.parser.single_call
    return plan.parser.grammar_root("tool_call", parallel) + "\n" + json_schema_rules(json.dumps(schema), "tool_call")


def tool_params(plan: ToolPlan | None, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with the forced-call grammar when tool_choice asks for one (a 400 beside response_format)."""
    if plan is None or plan.choice not in ("required", "function"):
        return params
    if not plan.tools:
        raise APIError(400, "tool_choice needs tools: this request has none", "invalid_tool_choice", "tool_choice")
    if any(params.get(kind) is not None for kind in ("json_schema", "regex", "ebnf")):
        raise APIError(
            400,
            "tool_choice 'required' or a named function cannot be combined with response_format",
            "unsupported_parameter",
            "tool_choice",
        )
    try:
        return {**params, "ebnf": forced_grammar(plan)}
    except GrammarError as exc:
        raise APIError(400, f"tools: {exc}", "invalid_tool_schema", "tools") from None


class ToolReplies:
    """The answer of each choice of a call with tools: its message, or its stream's deltas."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.streams: dict[int, ToolStream] = {}
        self.num_calls: dict[int, int] = {}

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant message for a whole answer, and whether it holds calls."""
        step = ToolStream(self.plan.parser).push(text, final=True)
        if not step.calls:
            return {"role": "assistant", "content": text}, False
        calls = [tool_call_json(call_id, call.name, call.arguments) for call_id, call in step.calls]
        return {"role": "assistant", "content": step.content or None, "tool_calls": calls}, True

    def deltas(self, index: int, text: str, final: bool) -> list[dict[str, Any]]:
        """Stream deltas for new text of choice ``index``: content, then each call's id and name (arguments "")
        and its arguments' fragments, as the openai client assembles them. Forced calls stream their arguments
        as they are written (their grammar guarantees they complete); others are sent once complete."""
        incremental = self.plan.choice in ("required", "function")
        stream = self.streams.setdefault(index, ToolStream(self.plan.parser, incremental))
        step = stream.push(text, final)
        out: list[dict[str, Any]] = [{"content": step.content}] if step.content else []
        for piece in step.deltas:
            if piece.id is not None:
                self.num_calls[index] = self.num_calls.get(index, 0) + 1
                call = tool_call_json(piece.id, piece.name or "", "")
            elif not piece.arguments:
                continue
            else:
                call = {"function": {"arguments": piece.arguments}}
            out.append({"tool_calls": [{"index": self.num_calls[index] - 1, **call}]})
        return out

    def called(self, index: int) -> bool:
        return self.num_calls.get(index, 0) > 0


def tool_call_json(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def choice_finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for an answer that ended with calls (a cut one keeps "length")."""
    return "tool_calls" if called and reason == "stop" else reason
