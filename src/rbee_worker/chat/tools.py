"""Tool calls in a model's output (OpenAI's `tools` and `tool_choice`), as text pieces in, content and call deltas out.

- `ToolFormat`: how a model writes a call, read from its chat template (`tool_format`): Hermes, as Qwen 2.5 and later
  and most fine-tunes write it (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, several in a row for
  parallel calls); Llama 3.x JSON (`{"name": ..., "parameters": {...}}`, after a `<|python_tag|>` that the
  detokenizer drops as a special token); Mistral (`[TOOL_CALLS][{"name": ..., "arguments": {...}}]`). A template that
  knows no tools gets Hermes instructions (tool_prompt.py), so Hermes is the default.
- Calls stream as OpenAI streams them: a call's first delta has its id and name, and goes out once the call is
  *decided*, that is once its name (one of the request's tools) and the beginning of its arguments are read; its
  arguments' text follows as it is written (chat/call_stream.py reads the call's JSON). Only what may still be a
  closing tag is held back. The deltas depend on the text only, never on how it was split into pieces, so a streamed
  response's deltas concatenate to exactly the non-streamed message, whose arguments are the text the model wrote.
- A call is decided by its header, the same streamed or not: text that breaks off before it (no JSON object, a name
  that is no tool, the output's end) is content, as written; once it is decided the call stays a call, and when its
  arguments do not close (max_tokens, the end of the output, Hermes' closing tag) they are the text as written up to
  there, with finish_reason as generated (`length` for max_tokens).
- `tool_choice` "auto" reads what the model writes (`parsed_calls`): Hermes (`HermesCalls`) reads the calls inside
  their tags, the rest content; Llama 3 JSON and Mistral (`JsonCalls`) read calls from an output that opens with one,
  up to the first text that is not a call. Parallel calls are numbered 0, 1, ... as they are decided; with
  `parallel_tool_calls` false the first is the only one, and later calls are dropped whole (as vLLM does; the
  generation runs on to its end).
- "required" and a named function constrain the output with a grammar (`forced_grammar`), as vLLM does: for a named
  function the output is its arguments (`NamedCall` streams them as they come); for "required" it is a JSON array of
  `{"name", "parameters"}` objects (`RequiredCalls`), read as Mistral's calls are.
"""

import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from rbee_worker.chat.call_stream import CallReader
from rbee_worker.chat.pieces import held_suffix
from rbee_worker.engine.structured.grammar import GrammarSpec

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


def coalesced(deltas: list[CallDelta]) -> list[CallDelta]:
    """The deltas of one chunk with each call's pieces joined into one (a call's first piece keeps its id and name),
    as OpenAI sends them: one entry per call."""
    joined: list[CallDelta] = []
    for delta in deltas:
        if joined and joined[-1].index == delta.index and delta.id is None:
            last = joined.pop()
            delta = CallDelta(last.index, last.arguments + delta.arguments, last.id, last.name)
        joined.append(delta)
    return joined


class ToolOutput(Protocol):
    """Turns a generation's text, fed piece by piece, into content and call deltas."""

    def feed(self, text: str) -> Piece: ...

    def finish(self) -> Piece: ...


class StreamedCalls:
    """What the readers of the calls a model writes share: the calls' numbering, and their deltas as each call's
    reader goes (a call's first delta, with its id and name, once the call is decided)."""

    def __init__(self, names: frozenset[str], most: int | None = None) -> None:
        self._names = names
        self._most = most  # the calls a message may hold (None: any number); the rest are dropped
        self._reader: CallReader | None = None
        self._count = 0  # the calls decided so far, and kept
        self._headed = False  # whether the open call has been decided (its first delta gone out, or dropped)
        self._dropped = False  # the open call is past `most`: no deltas
        self._held = ""  # text not yet read: what may still begin a tag or an opening

    def feed(self, text: str) -> Piece:
        return self._read(self._held + text, final=False)

    def _read(self, text: str, final: bool) -> Piece:
        """Read `text`; unless `final`, hold back (in `_held`) what may still begin a tag or an opening."""
        raise NotImplementedError

    def _open_call(self) -> None:
        self._reader, self._headed, self._dropped = CallReader(self._names), False, False

    def _read_call(self, text: str) -> tuple[int, Piece]:
        """Feed the open call `text`: how much of it the call read, and the deltas that makes."""
        assert self._reader is not None
        used = self._reader.feed(text)
        if not self._reader.decided:
            return used, Piece()
        arguments = self._reader.take()
        if not self._headed:
            self._headed = True
            self._dropped = self._most is not None and self._count >= self._most
            if not self._dropped:
                self._count += 1
                return used, Piece(calls=[CallDelta(self._count - 1, arguments, new_call_id(), self._reader.name)])
        if self._dropped or not arguments:
            return used, Piece()
        return used, Piece(calls=[CallDelta(self._count - 1, arguments)])

    def _end_call(self) -> str | None:
        """Close the open call: None when it is a call, else the text it read (content as written)."""
        assert self._reader is not None
        reader, self._reader = self._reader, None
        return None if reader.decided else reader.raw


class HermesCalls(StreamedCalls):
    """tool_choice "auto", Hermes: calls inside `<tool_call>` tags, the rest content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, names: frozenset[str], most: int | None = None) -> None:
        super().__init__(names, most)
        # text; call (inside a call's tags); closing (its JSON has ended, its closing tag is still to come);
        # after (a call has ended: whitespace is not content)
        self._mode = "text"

    def finish(self) -> Piece:
        piece = self._read(self._held, final=True)
        if self._mode == "call":  # the output ended inside a call's tags
            piece += self._ended("after")
        return piece

    def _read(self, text: str, final: bool) -> Piece:
        piece = Piece()
        while text:
            if self._mode == "call":
                tag = text.find(self.CLOSE)  # the closing tag ends the call wherever it comes
                stop = tag if tag >= 0 else len(text) - (0 if final else held_suffix(text, self.CLOSE))
                used, read = self._read_call(text[:stop])
                piece += read
                text = text[used:]
                if self._reader is not None and self._reader.ended:  # its JSON has closed, or broken off
                    piece += self._ended("closing")
                elif tag >= 0:
                    decided = self._reader is not None and self._reader.decided
                    text = text[len(self.CLOSE) :] if decided else text
                    piece += self._ended("after")
                else:  # all read, but for a possible closing tag's beginning
                    break
            elif self._mode == "closing":
                text = text.lstrip()
                if text.startswith(self.CLOSE):
                    text, self._mode = text[len(self.CLOSE) :], "after"
                elif text and (final or not self.CLOSE.startswith(text)):
                    self._mode = "after"  # a call whose closing tag is missing
                else:
                    break
            elif self._mode == "after":
                text = text.lstrip()
                self._mode = "text" if text else "after"
            else:
                start = text.find(self.OPEN)
                if start >= 0:
                    piece.content += text[:start]
                    text, self._mode = text[start + len(self.OPEN) :], "call"
                    self._open_call()
                    continue
                keep = 0 if final else held_suffix(text, self.OPEN)
                piece.content += text[: len(text) - keep]
                text = text[len(text) - keep :]
                break
        self._held = text
        return piece

    def _ended(self, mode: str) -> Piece:
        """The open call has ended: a call stays one (what comes next is read in `mode`); text that never became
        one is content, its opening tag included."""
        raw = self._end_call()
        if raw is None:
            self._mode = mode
            return Piece()
        self._mode = "text"
        return Piece(content=self.OPEN + raw)


class JsonCalls(StreamedCalls):
    """tool_choice "auto", Llama 3 JSON and Mistral: an output that opens with a call (the format's marker, or the
    JSON that begins one) is calls, one after another (separated by `;`, `,` or whitespace, or in a JSON list); text
    that is not a call ends them, and the rest of the output is content as written. An output that never gets to a
    call is content, all of it."""

    SEPARATORS = " \t\r\n;,[]"

    def __init__(self, names: frozenset[str], openings: tuple[str, ...], most: int | None = None) -> None:
        super().__init__(names, most)
        self._openings = openings  # the marker token's text (when the detokenizer keeps it), and the JSON's opening
        self._mode = "start"  # start, between (calls), call (in one), text
        self._syntax = ""  # what was read as calls' syntax while no call is made: content if none comes

    def finish(self) -> Piece:
        piece = self._read(self._held, final=True)
        if self._mode == "call":  # the output ended inside a call
            piece += self._ended(at_end=True)
        elif self._mode == "between" and not self._count:
            piece.content += self._syntax
        return piece

    def _read(self, text: str, final: bool) -> Piece:
        piece = Piece()
        while text:
            if self._mode == "start":
                stripped = text.lstrip()
                if not final and any(m.startswith(stripped) and m != stripped for m in self._openings):
                    break  # the output's beginning, or of a marker
                if stripped.startswith(self._openings):
                    marker = self._openings[0] if stripped.startswith(self._openings[0]) else ""
                    cut = len(text) - len(stripped) + len(marker)
                    self._syntax, text, self._mode = text[:cut], text[cut:], "between"
                else:
                    self._mode = "text"
            elif self._mode == "between":
                rest = text.lstrip(self.SEPARATORS)
                self._syntax += text[: len(text) - len(rest)] if not self._count else ""
                text = rest
                if text.startswith("{"):
                    self._open_call()
                    self._mode = "call"
                elif text:
                    piece.content += "" if self._count else self._syntax
                    self._mode = "text"
            elif self._mode == "call":
                used, read = self._read_call(text)
                piece += read
                text = text[used:]
                if self._reader is not None and self._reader.ended:
                    piece += self._ended(at_end=False)
                else:
                    break
            else:
                piece.content += text
                text = ""
        self._held = text
        return piece

    def _ended(self, at_end: bool) -> Piece:
        raw = self._end_call()
        if raw is None:
            self._mode = "between"
            return Piece()
        self._mode = "text"
        return Piece(content=raw if self._count else self._syntax + raw)


class RequiredCalls(JsonCalls):
    """tool_choice "required": the output is a JSON array of {"name", "parameters"} objects (the grammar makes it
    one), read as a Mistral output is. An output with no call is content, as written; when max_tokens cuts a call
    short before it is decided, what it wrote of it is dropped (the output is nothing but calls: finish_reason says
    `length`)."""

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__(names, ("[",))

    def _ended(self, at_end: bool) -> Piece:
        piece = super()._ended(at_end)
        return Piece() if at_end and self._count else piece


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


def parsed_calls(fmt: ToolFormat, names: frozenset[str], most: int | None = None) -> ToolOutput:
    """What reads the calls a model writes in `fmt` to the tools `names` (tool_choice "auto"), keeping at most `most`
    of them."""
    if fmt is ToolFormat.HERMES:
        return HermesCalls(names, most)
    # The marker token's text (when the detokenizer keeps it), then what else opens an output of calls.
    openings = ("<|python_tag|>", "{") if fmt is ToolFormat.LLAMA3_JSON else ("[TOOL_CALLS]", "[")
    return JsonCalls(names, openings, most)


def tool_output(
    tools: list[dict[str, Any]] | None, choice: str, fmt: ToolFormat, parallel: bool = True
) -> ToolOutput | None:
    """What reads a chat request's output for its tools (None: text only): `choice` is none, auto, required or a
    function's name; without `parallel`, a message holds at most one call (required: its grammar says so)."""
    if not tools or choice == "none":
        return None
    names = frozenset(tool["function"]["name"] for tool in tools)
    if choice == "auto":
        return parsed_calls(fmt, names, None if parallel else 1)
    if choice == "required":
        return RequiredCalls(names)
    return NamedCall(choice)
