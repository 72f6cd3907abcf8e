"""Tool calls in a model's output (OpenAI's `tools` and `tool_choice`), as text pieces in, content and call deltas out.

- `ToolFormat`: how a model writes a call, read from its chat template (`tool_format`): Hermes, as Qwen 2.5 and later
  and most fine-tunes write it (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, several in a row for
  parallel calls); Llama 3.x JSON (`{"name": ..., "parameters": {...}}`, after a `<|python_tag|>` that the
  detokenizer drops as a special token); Mistral (`[TOOL_CALLS][{"name": ..., "arguments": {...}}]`). A template that
  knows no tools gets Hermes instructions (tool_prompt.py), so Hermes is the default.
- `tool_choice` "auto": `ParsedCalls` reads what the model writes. Text outside a call is content; a call whose JSON
  does not parse stays content, as written. The pieces and calls depend on the text only, never on how it was split
  into pieces, so a streamed response's deltas concatenate to exactly the non-streamed message.
- "required" and a named function constrain the output with a grammar (`forced_grammar`), as vLLM does: for a named
  function the output is its arguments (`NamedCall` streams them as they come); for "required" it is a JSON array of
  `{"name", "parameters"}` objects (`RequiredCalls`), read when it is complete.
"""

import json
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Protocol

from rbee_worker.chat.pieces import held_suffix
from rbee_worker.engine.grammar import GrammarSpec

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolFormat(Enum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"


def tool_format(chat_template: str | None) -> ToolFormat:
    """The format a chat template teaches its model to write calls in (Hermes when it names none)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return ToolFormat.HERMES
    if "[TOOL_CALLS]" in template:
        return ToolFormat.MISTRAL
    if "<|python_tag|>" in template:
        return ToolFormat.LLAMA3_JSON
    return ToolFormat.HERMES


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class CallDelta:
    """A piece of the call at `index` of the message: the first piece of a call has its id and name."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class Piece:
    """What a piece of output text becomes: content text and call deltas."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __iadd__(self, other: "Piece") -> "Piece":
        self.content += other.content
        self.calls += other.calls
        return self


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


def merge_calls(deltas: list[CallDelta]) -> list[ToolCall]:
    """The whole calls that a message's deltas make, in index order (what a client that concatenates them gets)."""
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
        call["id"] = delta.id or call["id"]
        call["name"] = delta.name or call["name"]
        call["arguments"] += delta.arguments
    return [ToolCall(**calls[index]) for index in sorted(calls)]


class ToolOutput(Protocol):
    """Turns a generation's text, fed piece by piece, into content and call deltas."""

    def feed(self, text: str) -> Piece: ...

    def finish(self) -> Piece: ...


def output_call(value: Any) -> CallDelta | None:
    """A whole call from one parsed JSON value of the model's output, or None when it is not a call."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as the API carries them
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return CallDelta(index=0, arguments=json.dumps(arguments, ensure_ascii=False), id=new_call_id(), name=value["name"])


class ParsedCalls:
    """tool_choice "auto": the calls a model writes in its template's format, the rest content."""

    HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
    # What starts a call in the JSON formats: the marker token's text (when the detokenizer keeps it), or the JSON.
    JSON_MARKERS: ClassVar = {
        ToolFormat.LLAMA3_JSON: ("<|python_tag|>", "{"),
        ToolFormat.MISTRAL: ("[TOOL_CALLS]", "["),
    }

    def __init__(self, fmt: ToolFormat) -> None:
        self._format = fmt
        self._held = ""  # text not yet decided: a possible marker's beginning, or an open call
        self._mode = "start"  # start (only whitespace so far), content, call (inside an open one), after (a call)
        self._count = 0

    def feed(self, text: str) -> Piece:
        if self._format is ToolFormat.HERMES:
            return self._feed_hermes(self._held + text)
        return self._feed_json(self._held + text)

    def finish(self) -> Piece:
        held, self._held = self._held, ""
        if self._format is not ToolFormat.HERMES:
            return self._json_calls(held) if self._mode == "call" else Piece(content=held)
        if self._mode == "call":
            return self._hermes_call(held, closed=False)
        return Piece() if self._mode == "after" and not held.strip() else Piece(content=held)

    def _feed_hermes(self, text: str) -> Piece:
        piece = Piece()
        while text:
            if self._mode == "call":
                end = text.find(self.HERMES_CLOSE)
                if end < 0:
                    break
                call = self._hermes_call(text[:end], closed=True)
                piece += call
                text = text[end + len(self.HERMES_CLOSE) :]
                self._mode = "after" if call.calls else "content"
                continue
            if self._mode == "after":  # whitespace between calls is not content
                text = text.lstrip()
                if not text:
                    break
            start = text.find(self.HERMES_OPEN)
            if start >= 0:
                piece.content += text[:start]
                text, self._mode = text[start + len(self.HERMES_OPEN) :], "call"
                continue
            keep = held_suffix(text, self.HERMES_OPEN)
            piece.content += text[: len(text) - keep]
            text = text[len(text) - keep :]
            if piece.content:
                self._mode = "content"
            break
        self._held = text
        return piece

    def _hermes_call(self, body: str, closed: bool) -> Piece:
        try:
            call = output_call(json.loads(body))
        except ValueError:
            call = None
        if call is None:
            return Piece(content=self.HERMES_OPEN + body + (self.HERMES_CLOSE if closed else ""))
        return Piece(calls=[self._numbered(call)])

    def _feed_json(self, text: str) -> Piece:
        """Llama 3 / Mistral: an output that starts with a call is all calls (read at the end); any other is text."""
        if self._mode == "start":
            stripped = text.lstrip()
            markers = self.JSON_MARKERS[self._format]
            if not stripped or any(m.startswith(stripped) for m in markers):
                self._held = text
                return Piece()
            self._mode = "call" if stripped.startswith(markers) else "content"
        if self._mode == "call":
            self._held = text
            return Piece()
        self._held = ""
        return Piece(content=text)

    def _json_calls(self, text: str) -> Piece:
        body = text.strip()
        marker = self.JSON_MARKERS[self._format][0]
        if body.startswith(marker):
            body = body[len(marker) :].lstrip()
        decoder, values, at = json.JSONDecoder(), [], 0
        try:
            while at < len(body):
                value, at = decoder.raw_decode(body, at)
                values.extend(value if isinstance(value, list) else [value])
                while at < len(body) and body[at] in " \t\r\n;,":
                    at += 1
        except ValueError:
            return Piece(content=text)
        calls = [output_call(value) for value in values]
        if not calls or None in calls:
            return Piece(content=text)
        return Piece(calls=[self._numbered(call) for call in calls if call is not None])

    def _numbered(self, call: CallDelta) -> CallDelta:
        self._count += 1
        return CallDelta(self._count - 1, call.arguments, call.id, call.name)


class NamedCall:
    """tool_choice naming a function: the whole output is its arguments (the grammar is its parameters' schema)."""

    def __init__(self, name: str) -> None:
        self._name: str | None = name

    def feed(self, text: str) -> Piece:
        return Piece(calls=[self._delta(text)]) if text or self._name else Piece()

    def finish(self) -> Piece:
        return Piece()

    def _delta(self, text: str) -> CallDelta:
        if self._name is None:
            return CallDelta(0, text)
        delta, self._name = CallDelta(0, text, new_call_id(), self._name), None
        return delta


class RequiredCalls:
    """tool_choice "required": the output is a JSON array of {"name", "parameters"} objects, read once it ends. When
    max_tokens cuts it short, its whole objects are the calls (the grammar has made each valid; finish_reason says
    `length`); an output with no whole object is content, as written."""

    def __init__(self) -> None:
        self._text = ""

    def feed(self, text: str) -> Piece:
        self._text += text
        return Piece()

    def finish(self) -> Piece:
        decoder, values, at = json.JSONDecoder(), [], 1
        if self._text.startswith("["):
            while at < len(self._text) and self._text[at] != "]":
                try:
                    value, at = decoder.raw_decode(self._text, at)
                except ValueError:
                    break
                values.append(value)
                while at < len(self._text) and self._text[at] in ", ":
                    at += 1
        calls = [output_call(value) for value in values]
        if not calls or None in calls:
            return Piece(content=self._text)
        return Piece(calls=[CallDelta(i, c.arguments, c.id, c.name) for i, c in enumerate(calls) if c is not None])


def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or NO_PARAMETERS


def forced_grammar(tools: list[dict[str, Any]], choice: str, parallel: bool) -> GrammarSpec:
    """The grammar of a forced call: `choice` names a function (its arguments), or is "required" (an array of one
    call, or of one or more when `parallel`)."""
    if choice != "required":
        tool = next(tool for tool in tools if tool["function"]["name"] == choice)
        return GrammarSpec.json_schema(parameters_of(tool))
    one_of = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool["function"]["name"]]},
                "parameters": parameters_of(tool),
            },
            "required": ["name", "parameters"],
        }
        for tool in tools
    ]
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": one_of}, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return GrammarSpec.json_schema(array)


def tool_output(tools: list[dict[str, Any]] | None, choice: str, fmt: ToolFormat) -> ToolOutput | None:
    """What reads a chat request's output for its tools (None: text only): `choice` is none, auto, required or a
    function's name."""
    if not tools or choice == "none":
        return None
    if choice == "auto":
        return ParsedCalls(fmt)
    if choice == "required":
        return RequiredCalls()
    return NamedCall(choice)
