"""OpenAI's JSON for the pieces of a choice: chat deltas and tool calls, and logprobs in the chat and the legacy
completions formats."""

from typing import Any

from rbee_worker.api.choices import Generation
from rbee_worker.api.state import WorkerState
from rbee_worker.chat.output import ChatDelta
from rbee_worker.chat.tools import ToolCall, coalesced
from rbee_worker.engine.types import TokenLogprob

# JSON has no -inf; a token the model rules out entirely gets this floor, as in vLLM.
LOGPROB_FLOOR = -9999.0


def delta_json(delta: ChatDelta) -> dict:
    """A chunk's delta: its content, and its tool-call pieces as OpenAI streams them (one per call; a call's first
    piece has its id, type and name; every piece a part of its arguments' text)."""
    payload: dict[str, Any] = {"content": delta.content} if delta.content else {}
    if delta.reasoning:
        payload["reasoning_content"] = delta.reasoning
    if delta.calls:
        payload["tool_calls"] = [
            {"index": c.index, "function": {"arguments": c.arguments}}
            if c.id is None
            else {
                "index": c.index,
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in coalesced(delta.calls)
        ]
    return payload


def call_json(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def floor(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def chat_logprob(state: WorkerState, lp: TokenLogprob) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = state.engine.token_text(token_id)
        return {"token": text, "logprob": floor(logprob), "bytes": list(text.encode())}

    return {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}


def completion_logprobs(state: WorkerState, piece: Generation) -> dict:
    """The legacy completions format: parallel lists, one entry per token."""
    text_of = state.engine.token_text
    tokens = [text_of(lp.token_id) for lp in piece.logprobs]
    offsets, offset = [], piece.offset
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [floor(lp.logprob) for lp in piece.logprobs],
        "top_logprobs": [{text_of(i): floor(v) for i, v in lp.top} for lp in piece.logprobs],
        "text_offset": offsets,
    }
