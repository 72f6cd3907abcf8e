"""OpenAI's JSON for the pieces of a choice: chat deltas and tool calls, and logprobs in the chat and the legacy
completions formats."""

from collections.abc import Sequence
from typing import Any

from rbee_worker.api.state import WorkerState
from rbee_worker.chat.message_parts import ChatDelta
from rbee_worker.chat.tools import ToolCall, coalesced
from rbee_worker.engine.request_types import TokenLogprob

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
        text = state.engine.model.token_text(token_id)
        return {"token": text, "logprob": floor(logprob), "bytes": list(text.encode())}

    return {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}


def completion_logprobs(state: WorkerState, logprobs: Sequence[TokenLogprob], offset: int) -> dict:
    """The legacy completions format: parallel lists, one entry per token; `offset`: where the first token's text
    starts in the choice's text."""
    text_of = state.engine.model.token_text
    tokens = [text_of(lp.token_id) for lp in logprobs]
    return {
        "tokens": tokens,
        "token_logprobs": [floor(lp.logprob) for lp in logprobs],
        "top_logprobs": [{text_of(i): floor(v) for i, v in lp.top} for lp in logprobs],
        "text_offset": offsets(tokens, offset),
    }


def echo_logprobs(state: WorkerState, prompt_ids: Sequence[int], scored: Sequence[TokenLogprob], top: int) -> dict:
    """An echoed prompt's part of the legacy completions format: its first token has no logprob (null, as OpenAI's);
    each other token its logprob given the tokens before it, with the `top` most likely there."""
    text_of = state.engine.model.token_text
    tokens = [text_of(token_id) for token_id in prompt_ids]
    return {
        "tokens": tokens,
        "token_logprobs": [None] + [floor(lp.logprob) for lp in scored],
        "top_logprobs": [None] + [{text_of(i): floor(v) for i, v in lp.top[:top]} for lp in scored],
        "text_offset": offsets(tokens, 0),
    }


def joined(first: dict, then: dict) -> dict:
    """Two runs of the legacy logprobs format, one after the other."""
    return {key: first[key] + then[key] for key in first}


def offsets(tokens: list[str], start: int) -> list[int]:
    """Where each token's text starts, the first at `start`."""
    starts = []
    for token in tokens:
        starts.append(start)
        start += len(token)
    return starts


def prompt_logprobs_json(state: WorkerState, scored: Sequence[TokenLogprob], top: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: null for the first token, then for each token a map from token id to its logprob,
    rank and text: the prompt's token and the `top` most likely there."""
    text_of = state.engine.model.token_text

    def entry(logprob: float, rank: int | None, token_id: int) -> dict:
        return {"logprob": floor(logprob), "rank": rank, "decoded_token": text_of(token_id)}

    positions: list[dict | None] = [None]
    for lp in scored:
        alternatives = {str(i): entry(v, rank, i) for rank, (i, v) in enumerate(lp.top[:top], start=1)}
        positions.append({str(lp.token_id): entry(lp.logprob, lp.rank, lp.token_id), **alternatives})
    return positions
