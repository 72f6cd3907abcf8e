"""A chat generation's text, fed piece by piece, as the parts of an assistant message: reasoning, content and tool
calls.

A reasoning model's `<think>` part is split off first (chat/reasoning.py); what follows it is the answer, where tool
calls are read (chat/tools.py). The same object serves a streamed response (each piece's delta) and a non-streamed
one (every piece fed, the deltas merged), so the two give the same message for the same text.
"""

from dataclasses import dataclass, field

from rbee_worker.chat.reasoning import ReasoningSplitter
from rbee_worker.chat.tools import CallDelta, Piece, ToolCall, ToolOutput, merge_calls


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def merged(self, later: "ChatDelta") -> "ChatDelta":
        return ChatDelta(self.reasoning + later.reasoning, self.content + later.content, self.calls + later.calls)


@dataclass
class ChatMessage:
    reasoning: str | None  # None: the model has no reasoning format, or its output none
    content: str | None  # None: only tool calls
    tool_calls: list[ToolCall]
    reasoning_tokens: int


class ChatOutput:
    """Splits a chat generation's text into reasoning (`reasoning`: None for a model without it), content and tool
    calls (`tools`: None for text only), and counts the tokens of the reasoning."""

    def __init__(self, tools: ToolOutput | None, reasoning: ReasoningSplitter | None) -> None:
        self._tools, self._reasoning = tools, reasoning
        self.called = False  # whether any call has been given out
        self.reasoning_tokens = 0

    def feed(self, text: str, tokens: int) -> ChatDelta:
        """The next piece of text, made of `tokens` generated tokens."""
        reasoning, content = self._reasoning.feed(text) if self._reasoning else ("", text)
        if self._reasoning and self._reasoning.in_reasoning:
            self.reasoning_tokens += tokens
        return self._delta(reasoning, self._tools.feed(content) if self._tools else Piece(content=content))

    def feed_pieces(self, pieces: list[tuple[str, int]]) -> ChatDelta:
        """`feed` for each (text, tokens) piece, the deltas merged."""
        merged = ChatDelta()
        for text, tokens in pieces:
            merged = merged.merged(self.feed(text, tokens))
        return merged

    def finish(self) -> ChatDelta:
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        if self._tools is None:
            return self._delta(reasoning, Piece(content=content))
        piece = self._tools.feed(content)
        piece += self._tools.finish()
        return self._delta(reasoning, piece)

    def message(self, pieces: list[tuple[str, int]]) -> ChatMessage:
        """The whole message of a generation's (text, tokens) pieces: content null when there is none beside the
        calls, reasoning null when there is none."""
        whole = self.feed_pieces(pieces).merged(self.finish())
        calls = merge_calls(whole.calls)
        content = None if calls and not whole.content.strip() else whole.content
        return ChatMessage(whole.reasoning or None, content, calls, self.reasoning_tokens)

    def _delta(self, reasoning: str, piece: Piece) -> ChatDelta:
        self.called = self.called or bool(piece.calls)
        return ChatDelta(reasoning, piece.content, piece.calls)
