"""POST /v1/responses: OpenAI's Responses API, stateless (CONTRACT.md §4). The request runs as the chat completion it
describes (api/responses_schema.py) and its generation becomes the response's output items: the reasoning (where
the model has a reasoning format), the assistant's message and its function calls, in the order the model wrote
them. Streamed, each item is announced, grown and closed with the Responses events (`response.output_item.added`,
`response.output_text.delta`, `response.function_call_arguments.delta`, ... `response.completed`); the non-streamed
response is built by the same `OutputItems`, so both give the same items for the same text."""

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from rbee_worker.api.admission import AdmissionError, rendering_route
from rbee_worker.api.api_error import ApiError
from rbee_worker.api.choices import collect, merged, sse_response, terminal_error
from rbee_worker.api.openai import GENERATION_ERRORS, openai_error, with_stream
from rbee_worker.api.openai_format import chat_logprob
from rbee_worker.api.openai_requests import start_chat
from rbee_worker.api.responses_schema import NamedFunction, ResponsesRequest
from rbee_worker.api.state import WorkerState
from rbee_worker.chat.message_parts import ChatDelta, ChatOutput
from rbee_worker.engine.request_types import End, Error, StopReason, Token, TokenLogprob
from rbee_worker.engine.request_types import Event as EngineEvent

Event = dict[str, Any]


class OutputItems:
    """A response's output items, built from a chat generation's deltas as they come, with the stream events that
    announce, grow and close them. One item is open at a time: a new kind of output (reasoning, text, another call)
    closes it. Text that is only whitespace waits for more: before a call it is no message of its own."""

    def __init__(self, state: WorkerState, logprobs: bool) -> None:
        self.state, self.logprobs = state, logprobs
        self.items: list[dict] = []
        self._open: dict | None = None
        self._calls: dict[int, dict] = {}  # call index -> its item
        self._blank = ""  # whitespace text not given out yet

    def feed(self, delta: ChatDelta, logprobs: tuple[TokenLogprob, ...] | list[TokenLogprob] = ()) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning:
            if self._kind != "reasoning":
                events += self._start({"type": "reasoning", "summary": [], "content": []}, "rs")
                events.append(self._part_event("added", {"type": "reasoning_text", "text": ""}))
            events.append(self._delta("response.reasoning_text.delta", delta.reasoning))
        if delta.content:
            text = self._blank + delta.content
            if self._kind != "message" and not text.strip():
                self._blank = text
            else:
                self._blank = ""
                if self._kind != "message":
                    events += self._start({"type": "message", "role": "assistant", "content": []}, "msg")
                    events.append(self._part_event("added", self._text_part("", [])))
                entries = [chat_logprob(self.state, lp) for lp in logprobs] if self.logprobs else []
                self._open_text_logprobs().extend(entries)
                events.append({**self._delta("response.output_text.delta", text), "logprobs": entries})
        for call in delta.calls:
            if call.id is not None:
                item = {"type": "function_call", "call_id": call.id, "name": call.name, "arguments": ""}
                events += self._start(item, "fc")
                self._calls[call.index] = self._open  # type: ignore[assignment]
            item = self._calls[call.index]
            if call.arguments:
                item["arguments"] += call.arguments
                events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                               "output_index": item["_index"], "delta": call.arguments})  # fmt: skip
        return events

    def close(self) -> list[Event]:
        """Close the open item (at the end: a response without any output gets an empty message)."""
        if self._open is None and not self.items:
            events = self._start({"type": "message", "role": "assistant", "content": []}, "msg")
            events.append(self._part_event("added", self._text_part("", [])))
            return events + self.close()
        item, self._open = self._open, None
        if item is None:
            return []
        base = {"item_id": item["id"], "output_index": item["_index"]}
        events: list[Event] = []
        if item["type"] == "reasoning":
            text = "".join(item.pop("_text"))
            part = {"type": "reasoning_text", "text": text}
            events += [{"type": "response.reasoning_text.done", **base, "content_index": 0, "text": text},
                       {"type": "response.content_part.done", **base, "content_index": 0, "part": part}]  # fmt: skip
            item["content"] = [part]
        elif item["type"] == "message":
            part = self._text_part("".join(item.pop("_text")), item.pop("_logprobs"))
            events += [{"type": "response.output_text.done", **base, "content_index": 0, "text": part["text"],
                        "logprobs": part["logprobs"]},
                       {"type": "response.content_part.done", **base, "content_index": 0, "part": part}]  # fmt: skip
            item["content"] = [part]
        else:
            events.append({"type": "response.function_call_arguments.done", **base, "name": item["name"],
                           "arguments": item["arguments"]})  # fmt: skip
        del item["_index"]
        item["status"] = "completed"
        events.append({"type": "response.output_item.done", "output_index": base["output_index"], "item": item})
        return events

    @property
    def _kind(self) -> str | None:
        return None if self._open is None else self._open["type"]

    def _start(self, item: dict, prefix: str) -> list[Event]:
        events = self.close() if self._open is not None else []
        item = {"id": f"{prefix}_{uuid.uuid4().hex}", **item, "status": "in_progress", "_index": len(self.items)}
        if item["type"] != "function_call":
            item["_text"] = []
        if item["type"] == "message":
            item["_logprobs"] = []
        self.items.append(item)
        self._open = item
        public = {k: v for k, v in item.items() if not k.startswith("_")}
        return [*events, {"type": "response.output_item.added", "output_index": item["_index"], "item": public}]

    def _delta(self, kind: str, text: str) -> Event:
        assert self._open is not None
        self._open["_text"].append(text)
        return {"type": kind, "item_id": self._open["id"], "output_index": self._open["_index"], "content_index": 0,
                "delta": text}  # fmt: skip

    def _part_event(self, what: str, part: dict) -> Event:
        assert self._open is not None
        return {"type": f"response.content_part.{what}", "item_id": self._open["id"],
                "output_index": self._open["_index"], "content_index": 0, "part": part}  # fmt: skip

    def _open_text_logprobs(self) -> list:
        assert self._open is not None
        return self._open["_logprobs"]

    def _text_part(self, text: str, logprobs: list) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def responses_router(state: WorkerState) -> APIRouter:
    router = APIRouter(
        tags=["OpenAI-compatible"], route_class=rendering_route((AdmissionError, ApiError), openai_error)
    )

    @router.post(
        "/v1/responses",
        responses=with_stream(GENERATION_ERRORS, "Responses API events (event: <type>), the last response.completed"),
    )
    async def responses(body: ResponsesRequest, http_request: Request) -> Response:
        chat = body.as_chat()
        started = await start_chat(state, chat, http_request, "resp")
        [job], [output] = started.jobs, started.outputs
        items = OutputItems(state, body.wants_logprobs)
        response = {
            "id": f"resp_{uuid.uuid4().hex}",
            "object": "response",
            "created_at": int(time.time()),
            "model": state.model_name,
            "status": "in_progress",
            "output": [],
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            "tool_choice": (
                body.tool_choice.model_dump()
                if isinstance(body.tool_choice, NamedFunction)
                else body.tool_choice or "auto"
            ),
            "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens,
            "text": (
                body.text.model_dump(exclude_none=True, by_alias=True)
                if body.text and body.text.format
                else {"format": {"type": "text"}}
            ),
            "reasoning": None if body.reasoning is None else body.reasoning.model_dump(),
            "previous_response_id": None,
            "store": False,
            "metadata": body.metadata or {},
            "user": body.user,
            "truncation": "disabled",
            "usage": None,
        }

        def finished(end: End) -> dict:
            incomplete = end.stop_reason is StopReason.MAX_TOKENS
            return {
                **response,
                "status": "incomplete" if incomplete else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "output": items.items,
                "usage": {
                    "input_tokens": end.prompt_tokens,
                    "input_tokens_details": {"cached_tokens": end.cached_tokens},
                    "output_tokens": end.tokens_out,
                    "output_tokens_details": {"reasoning_tokens": output.reasoning_tokens},
                    "total_tokens": end.prompt_tokens + end.tokens_out,
                },
            }

        if body.stream:
            return sse_response(stream_events(job, output, items, response, finished))
        [generation] = await collect([job], http_request)
        items.feed(output.feed_pieces(list(zip(generation.text, generation.tokens, strict=True))), generation.logprobs)
        items.feed(output.finish())
        items.close()
        assert generation.end is not None  # collect raised for a job without a result
        return JSONResponse(finished(generation.end))

    return router


async def stream_events(
    job: AsyncIterator[EngineEvent],
    output: ChatOutput,
    items: OutputItems,
    response: dict,
    finished: Callable[[End], dict],
) -> AsyncIterator[str]:
    """The Responses events of one generation: created and in_progress, each item's events as its text comes, then
    completed (incomplete where max_output_tokens ended it); a failure ends the stream with an `error` event."""
    sequence = 0

    def line(event: Event) -> str:
        nonlocal sequence
        event = {**event, "sequence_number": sequence}
        sequence += 1
        return f"event: {event['type']}\ndata: {orjson.dumps(event).decode()}\n\n"

    yield line({"type": "response.created", "response": response})
    yield line({"type": "response.in_progress", "response": response})
    async for _, event in merged([job]):
        if isinstance(event, Token):
            for item_event in items.feed(output.feed(event.text, len(event.token_ids)), event.logprobs):
                yield line(item_event)
        elif isinstance(event, End) and event.stop_reason is not StopReason.CANCELLED:
            for item_event in items.feed(output.finish()) + items.close():
                yield line(item_event)
            final = finished(event)
            kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
            yield line({"type": kind, "response": final})
        elif isinstance(event, End | Error):
            error = terminal_error(event)
            yield line({"type": "error", "code": error.code, "message": error.message, "param": None})
            break
