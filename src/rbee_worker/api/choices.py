"""A response's choices from their jobs' events, as OpenAI's bodies and SSE streams. One choice is one engine request;
`n`, `best_of` and a completion's batched prompts make several, which the engine runs side by side like any other
requests (a prompt's siblings read its blocks from the prefix cache once one of them has computed them).

A non-streamed response collects every choice (`collect`); a streamed one sends each choice's chunks as they come,
tagged with the choice's `index`, then one usage chunk and `[DONE]` (`stream_chunks`). A client that leaves, or one
choice that fails, cancels the others.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from rbee_worker.api.api_error import ApiError
from rbee_worker.api.native import SSE_HEADERS, sse_data
from rbee_worker.engine.request_types import (
    Embedding,
    End,
    Error,
    ErrorCode,
    Event,
    PromptLogprobs,
    StopReason,
    Token,
    TokenLogprob,
)

DISCONNECT_POLL_S = 0.25


@dataclass
class Generation:
    """What one choice's job has produced so far, for one response or chunk."""

    text: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # how many tokens made each piece of `text`
    logprobs: list[TokenLogprob] = field(default_factory=list)
    end: End | None = None
    offset: int = 0  # where `text` starts in the whole completion (characters): for text_offset
    prompt: tuple[TokenLogprob, ...] | None = None  # the prompt's logprobs, where asked for (Request.prompt_logprobs)
    embedding: tuple[float, ...] | None = None  # an embedding request's (Request.embed)

    def add(self, token: Token) -> None:
        self.text.append(token.text)
        self.tokens.append(len(token.token_ids))
        self.logprobs.extend(token.logprobs)

    @property
    def cumulative_logprob(self) -> float:
        """The sum of the chosen tokens' logprobs: how `best_of` ranks choices."""
        return sum(lp.logprob for lp in self.logprobs)


def terminal_error(event: Error | End) -> ApiError:
    """The error for a job that ended without a result (failed, or cancelled by a shutdown)."""
    if isinstance(event, End):  # cancelled
        return ApiError(503, "the request was cancelled (the worker is shutting down)", kind="server_error",
                        code=ErrorCode.CANCELLED.value)  # fmt: skip
    status = 400 if event.code is ErrorCode.INVALID_REQUEST else 500
    kind = "invalid_request_error" if status == 400 else "server_error"
    return ApiError(status, event.message, kind=kind, code=event.code.value)


async def collect(jobs: Sequence[AsyncIterator[Event]], http_request: Request) -> list[Generation]:
    """Run every choice's job to its end for a non-streamed response, in the jobs' order; a client that leaves
    meanwhile cancels them. Raises the ApiError of a job that ends without a result (the others cancelled)."""

    async def run(events: AsyncIterator[Event]) -> Generation:
        generation = Generation()
        async for event in events:
            if isinstance(event, Token):
                generation.add(event)
            elif isinstance(event, PromptLogprobs):
                generation.prompt = event.logprobs
            elif isinstance(event, Embedding):
                generation.embedding = event.values
            elif isinstance(event, End) and event.stop_reason is not StopReason.CANCELLED:
                generation.end = event
            elif isinstance(event, End | Error):
                raise terminal_error(event)
        return generation

    tasks = [asyncio.ensure_future(run(events)) for events in jobs]
    try:
        while not all(task.done() for task in tasks):
            await asyncio.wait(tasks, timeout=DISCONNECT_POLL_S, return_when=asyncio.FIRST_EXCEPTION)
            failed = any(task.done() and not task.cancelled() and task.exception() for task in tasks)
            if failed or await http_request.is_disconnected():
                for task in tasks:
                    task.cancel()
        for task in tasks:  # a failure first, else a cancellation, else every result
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [await task for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for events in jobs:
            await events.aclose()  # cancels a job in the engine if it has not ended


async def merged(jobs: Sequence[AsyncIterator[Event]]) -> AsyncIterator[tuple[int, Event]]:
    """Every job's events as they come, each with its job's index; one job's are read directly. Leaving early
    cancels the jobs that have not ended."""
    if len(jobs) == 1:
        try:
            async for event in jobs[0]:
                yield 0, event
        finally:
            await jobs[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()

    async def pump(index: int, events: AsyncIterator[Event]) -> None:
        async for event in events:
            queue.put_nowait((index, event))
        queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(index, events)) for index, events in enumerate(jobs)]
    try:
        running = len(tasks)
        while running:
            index, event = await queue.get()
            if event is None:
                running -= 1
            else:
                yield index, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for events in jobs:
            await events.aclose()


async def stream_chunks(
    jobs: Sequence[AsyncIterator[Event]],
    chunk: Callable[[int, Generation, End | None], dict | None],
    usage_of: Callable[[list[End]], dict] | None,
    first: Callable[[int], dict] | None,
) -> AsyncIterator[str]:
    """SSE chunks: `first(index)` for each choice if given, then a choice's prompt logprobs where asked for (a piece
    with `prompt`), then one per piece of a choice's text (with the logprobs of its tokens; `chunk` gives None for a
    piece with nothing to send yet), each choice's last one with its finish reason; once every choice has ended, the
    usage if asked for, then [DONE]. A failed choice ends the stream with its error; leaving early (the client
    disconnected) cancels the jobs."""

    def line(payload: dict) -> str:
        if usage_of is not None:  # then every chunk has `usage`: null but the last one, as OpenAI's
            payload = {**payload, "usage": payload.get("usage")}
        return sse_data(payload)

    pending = [Generation() for _ in jobs]  # tokens whose text is held back wait for the next piece
    ends: dict[int, End] = {}
    last: dict[str, Any] = {}
    events = merged(jobs)
    try:
        if first is not None:
            for index in range(len(jobs)):
                yield line(first(index))
        async for index, event in events:
            if isinstance(event, Token):
                piece = pending[index]
                piece.add(event)
                if text := "".join(piece.text):
                    if (payload := chunk(index, piece, None)) is not None:
                        yield line(payload)
                    pending[index] = Generation(offset=piece.offset + len(text))
            elif isinstance(event, PromptLogprobs):  # a piece of its own, before the choice's text
                if (payload := chunk(index, Generation(prompt=event.logprobs), None)) is not None:
                    yield line(payload)
            elif isinstance(event, End) and event.stop_reason is not StopReason.CANCELLED:
                last = chunk(index, pending[index], event) or {}
                assert last, "the last piece always goes out: it carries the finish reason"
                yield line(last)
                ends[index] = event
            elif isinstance(event, End | Error):
                yield f"data: {json.dumps(terminal_error(event).body())}\n\n"
                break
        else:
            if usage_of is not None:
                yield line({**last, "choices": [], "usage": usage_of([ends[index] for index in sorted(ends)])})
        yield "data: [DONE]\n\n"
    finally:
        await events.aclose()  # cancels the jobs that have not ended (a client that left, a failed choice)


def sse_response(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream", headers=SSE_HEADERS)


def usage(ends: Sequence[End], per_prompt: int = 1, reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage object over a response's choices, `per_prompt` consecutive ones for each prompt: each prompt's
    tokens once, every generated token (a best_of choice left out included); `prompt_tokens_details.cached_tokens`:
    the prompt tokens found in the prefix cache (of each prompt, its choice that found the most);
    `completion_tokens_details.reasoning_tokens` for a reasoning model's chat."""
    prompts = [ends[i : i + per_prompt] for i in range(0, len(ends), per_prompt)]
    prompt_tokens = sum(group[0].prompt_tokens for group in prompts)
    completion_tokens = sum(end.tokens_out for end in ends)
    counts: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(max(end.cached_tokens for end in group) for group in prompts)},
    }
    if reasoning_tokens is not None:
        counts["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return counts
