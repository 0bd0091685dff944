"""Tool calls in model output text: one parser per format a model family was trained on (``--tool-call-parser``).

=============  ==========================================================================  =====================
parser         what the model writes                                                       template it follows
=============  ==========================================================================  =====================
hermes         ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`` (one or more)  Qwen 2.5/3, Hermes
llama3_json    ``{"name": "f", "parameters": {...}}`` as the whole answer (``;`` between several)  Llama 3.1/3.2/3.3
mistral        ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``                    Mistral v3 (Nemo ...)
=============  ==========================================================================  =====================

Every parser works on the text so far (``ToolStream``), so a stream and a whole answer are cut the same
way: text before the first call marker is content; after it, each complete call that parses (valid JSON,
a string ``name``, an object of arguments) is a tool call, in order; the first part that does not parse
ends the calls, and it and everything after it are returned as content (never an error). Arguments are
returned as the model wrote them when its call reads ``{"name": "f", "<arguments key>": {...}`` (the
layout a forced call has), else as ``json.dumps`` writes them.

A stream sends each call when it is complete: its id and name, then its arguments. With ``incremental``
(forced calls, whose grammar guarantees they complete) it sends the id and name as soon as the call's head
is written and then the arguments as they grow.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from radixserve.model.tokenizer import partial_stop_len

_WHITESPACE = re.compile(r"\s*")
# A call's head up to its arguments object: {"name": "f", "arguments": (the form of every format's forced call)
_CALL_HEAD = r'\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments object as JSON text


def call_from_object(value: Any, arguments_keys: tuple[str, ...]) -> tuple[str, dict[str, Any]] | None:
    """``{"name": str, <arguments key>: object}`` as (name, arguments); None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = next((k for k in arguments_keys if k in value), None)
    arguments = value.get(key) if key else {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict) or set(value) - {"name", "id", *arguments_keys}:  # Mistral writes an id
        return None
    return value["name"], arguments


def decode_json(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting at ``pos`` (after whitespace) and where it ends; None when there is none yet."""
    pos = _WHITESPACE.match(text, pos).end()  # type: ignore[union-attr]
    try:
        return json.JSONDecoder().raw_decode(text, pos)
    except ValueError:
        return None


class BaseToolParser:
    """Where calls begin in a text and which complete calls follow; the forced-call grammar's outer rule."""

    name: ClassVar[str]
    marker: ClassVar[str]  # what begins the calls
    head: ClassVar[re.Pattern[str]]  # from the end of the previous call (or the marker) to a call's arguments
    arguments_keys: ClassVar[tuple[str, ...]] = ("arguments",)
    single_call: ClassVar[bool] = False  # the template writes one call per turn

    def find_start(self, text: str) -> int | None:
        """Where the calls begin in ``text`` (the whole output so far), or None."""
        pos = text.find(self.marker)
        return None if pos < 0 else pos

    def held(self, text: str) -> int:
        """How many characters at the end of ``text`` may still begin a call: a stream holds them back."""
        return partial_stop_len(text, [self.marker])

    def split(self, region: str) -> tuple[list[ParsedCall], int]:
        """The complete calls at the head of ``region`` (which starts where the calls begin) and the
        characters they take; the rest is a call still being written, or (at the end) content."""
        raise NotImplementedError

    def grammar_root(self, call_rule: str, parallel: bool) -> str:
        """The EBNF root rule of a forced answer, with ``call_rule`` one call's JSON object."""
        raise NotImplementedError

    def new_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def make_call(self, region: str, start: int, found: tuple[str, dict[str, Any]]) -> ParsedCall:
        """The call ``found`` whose text begins at ``start``: its arguments as written when its head is ours."""
        name, arguments = found
        head = self.head.match(region, start)
        if head is not None and head["name"] == name:
            decoded = decode_json(region, head.end())
            if decoded is not None and decoded[0] == arguments:
                return ParsedCall(name, region[head.end() : decoded[1]])
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


class HermesParser(BaseToolParser):
    name = "hermes"
    marker = "<tool_call>"
    head = re.compile(r"\s*<tool_call>" + _CALL_HEAD)
    _BLOCK = re.compile(r"\s*<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def split(self, region: str) -> tuple[list[ParsedCall], int]:
        calls, pos = [], 0
        while (match := self._BLOCK.match(region, pos)) is not None:
            body = match.group(1)
            decoded = decode_json(body, 0)
            found = call_from_object(decoded[0], self.arguments_keys) if decoded and decoded[1] == len(body) else None
            if found is None:
                break
            calls.append(self.make_call(region, pos, found))
            pos = match.end()
        return calls, pos

    def grammar_root(self, call_rule: str, parallel: bool) -> str:
        one = f'"<tool_call>\\n" {call_rule} "\\n</tool_call>"'
        return f'root ::= {one} ("\\n" {one})*' if parallel else f"root ::= {one}"


class Llama3JsonParser(BaseToolParser):
    """Llama 3's JSON calls: the answer *is* the call, so a call can only begin the output."""

    name = "llama3_json"
    marker = "<|python_tag|>"
    arguments_keys = ("parameters", "arguments")
    head = re.compile(r"\s*(?:<\|python_tag\|>|;)?" + _CALL_HEAD)
    single_call = True  # Llama 3's templates raise on more than one call in a message

    def find_start(self, text: str) -> int | None:
        head = text.lstrip()
        if head.startswith("{") or head.startswith(self.marker):
            return len(text) - len(head)
        return None

    def held(self, text: str) -> int:
        head = text.lstrip()
        return len(text) if self.marker.startswith(head) else 0  # blank, or a part of <|python_tag|>

    def split(self, region: str) -> tuple[list[ParsedCall], int]:
        pos = _WHITESPACE.match(region).end()  # type: ignore[union-attr]
        pos += len(self.marker) if region.startswith(self.marker, pos) else 0
        calls, end = [], 0
        while (decoded := decode_json(region, pos)) is not None:
            found = call_from_object(decoded[0], self.arguments_keys)
            if found is None:
                break
            calls.append(self.make_call(region, end, found))
            end = decoded[1]
            after = _WHITESPACE.match(region, end).end()  # type: ignore[union-attr]
            if not region.startswith(";", after):
                break
            pos = after + 1
        return calls, end

    def grammar_root(self, call_rule: str, parallel: bool) -> str:
        return f"root ::= {call_rule}"


class MistralParser(BaseToolParser):
    """Mistral v3: ``[TOOL_CALLS]`` then one JSON list of calls; ids are 9 letters and digits, as its
    templates require of the ids they write back."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    head = re.compile(r"(?:\s*\[TOOL_CALLS\]\s*\[|\s*,)" + _CALL_HEAD)
    _OPEN = re.compile(r"\[TOOL_CALLS\]\s*\[")

    def split(self, region: str) -> tuple[list[ParsedCall], int]:
        """Element by element: a list cut short still gives the calls it completed."""
        opened = self._OPEN.match(region)
        calls: list[ParsedCall] = []
        used, pos = 0, opened.end() if opened else -1
        while opened and (decoded := decode_json(region, pos)) is not None:
            found = call_from_object(decoded[0], self.arguments_keys)
            if found is None:
                break
            calls.append(self.make_call(region, used, found))
            used = decoded[1]
            after = _WHITESPACE.match(region, used).end()  # type: ignore[union-attr]
            if region.startswith("]", after):
                return calls, after + 1
            if not region.startswith(",", after):
                break
            pos = after + 1
        return calls, used

    def grammar_root(self, call_rule: str, parallel: bool) -> str:
        more = f' (", " {call_rule})*' if parallel else ""
        return f'root ::= "[TOOL_CALLS][" {call_rule}{more} "]"'

    def new_call_id(self) -> str:
        return uuid.uuid4().hex[:9]


PARSERS: dict[str, type[BaseToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def detect_parser(template: str) -> str | None:
    """The parser a chat template's own tool format calls for; None when the template shows none we know."""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|start_header_id|>" in template and "parameters" in template:
        return "llama3_json"
    return None


@dataclass(frozen=True)
class CallDelta:
    """A piece of a streamed call: its id and name first (``arguments`` ""), then fragments of its arguments."""

    id: str | None
    name: str | None
    arguments: str


@dataclass
class StreamStep:
    """What one push adds: content text, the calls that completed, and the call pieces to send."""

    content: str = ""
    calls: list[tuple[str, ParsedCall]] = field(default_factory=list)  # (id, call)
    deltas: list[CallDelta] = field(default_factory=list)


class ToolStream:
    """One choice's output cut into content and tool calls as it grows (``push``; ``final`` at the end)."""

    def __init__(self, parser: BaseToolParser, incremental: bool = False) -> None:
        self.parser, self.incremental = parser, incremental
        self.text = ""
        self.sent = 0  # characters of text already given out as content
        self.start: int | None = None
        self.num_calls = 0
        self.open_id: str | None = None  # a call whose head (and some arguments) went out before it completed
        self.open_sent = 0  # characters of its arguments sent

    def push(self, delta: str, final: bool = False) -> StreamStep:
        self.text += delta
        text, step = self.text, StreamStep()
        if self.start is None:
            self.start = self.parser.find_start(text)
        if self.start is None:
            safe = len(text) if final else len(text) - self.parser.held(text)
            if self.sent == 0 and not text[:safe].strip() and not final:
                safe = 0  # blank so far: held, as a blank before the calls is dropped
            step.content, self.sent = text[self.sent : safe], max(self.sent, safe)
            return step
        before = text[self.sent : self.start]
        step.content = before if before.strip() or self.sent else ""  # a blank answer before the calls: none
        self.sent = max(self.sent, self.start)
        region = text[self.start :]
        calls, used = self.parser.split(region)
        for call in calls[self.num_calls :]:
            self.complete(call, step)
        self.num_calls = len(calls)
        if self.incremental and not final:
            self.send_open_call(region[used:], step)
        rest = region[used:]
        if final and rest.strip() and self.open_id is None:  # a call that does not parse, text after the calls
            step.content += rest  # (a call cut short whose head went out stays a call: the client has it)
        return step

    def complete(self, call: ParsedCall, step: StreamStep) -> None:
        """A call completed: the rest of it (all of it, unless its head already went out)."""
        if self.open_id is None:
            call_id = self.parser.new_call_id()
            step.deltas += [CallDelta(call_id, call.name, ""), CallDelta(None, None, call.arguments)]
        else:
            call_id, self.open_id = self.open_id, None
            step.deltas.append(CallDelta(None, None, call.arguments[self.open_sent :]))
        step.calls.append((call_id, call))

    def send_open_call(self, pending: str, step: StreamStep) -> None:
        """The call being written: its id and name once its head is out, then its arguments so far (up to where
        the arguments object closes, once it has: what went out is always a prefix of its arguments)."""
        head = self.parser.head.match(pending)
        if head is None:
            return
        if self.open_id is None:
            self.open_id, self.open_sent = self.parser.new_call_id(), 0
            step.deltas.append(CallDelta(self.open_id, head["name"], ""))
        arguments = pending[head.end() :]
        closed = decode_json(arguments, 0)
        safe = len(arguments) if closed is None else closed[1]
        if safe > self.open_sent:
            step.deltas.append(CallDelta(None, None, arguments[self.open_sent : safe]))
            self.open_sent = safe


def parse_tool_calls(parser: BaseToolParser, text: str) -> StreamStep:
    """A whole answer's content and calls (as a stream of it would give them)."""
    return ToolStream(parser).push(text, final=True)
