"""The OpenAI-compatible API (CONTRACT.md §4): /v1/models, /v1/completions, /v1/chat/completions, /tokenize and
/detokenize, on the same engine as the native API.

Bodies are validated by the pydantic models of openai_schema.py; every error has OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`: routes raise ApiError or a refusal of api/admission.py, and
`openai_error` answers both (the validation handler in server/worker.py answers invalid bodies). A `response_format`
grammar is compiled before the job is submitted (awaited, off the event loop: see ServedModel.grammars), so a schema
that does not compile is a 400 naming `response_format` before any work. Chat templates are rendered and prompts
tokenized off the event loop too (admission.off_loop), and a prompt text too long for the context whatever its tokens is
refused before it is tokenized (`check_fits`). A response's choices (`n`, `best_of`, batched prompts) are collected or
streamed by api/choices.py and written as OpenAI's JSON by api/openai_format.py.
"""

import dataclasses
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from rbee_worker.api.admission import (
    AdmissionError,
    AllSlotsBusy,
    Draining,
    DuplicateJob,
    Loading,
    Unhealthy,
    admit_all,
    ensure_open,
    off_loop,
    rendering_route,
)
from rbee_worker.api.api_error import ApiError
from rbee_worker.api.choices import Generation, collect, sse_response, stream_chunks, usage
from rbee_worker.api.native_schema import SSE_EVENT, UNAUTHORIZED
from rbee_worker.api.openai_format import (
    call_json,
    chat_logprob,
    completion_logprobs,
    delta_json,
    echo_logprobs,
    joined,
    prompt_logprobs_json,
)
from rbee_worker.api.openai_requests import (
    check_capacity,
    check_fits,
    check_model,
    check_token_ids,
    completion_prompt,
    engine_request,
    render_chat,
    response_grammar,
    start_chat,
)
from rbee_worker.api.openai_schema import (
    MAX_CHOICES,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from rbee_worker.api.state import WorkerState
from rbee_worker.engine.request_types import End, StopReason
from rbee_worker.engine.request_types import Request as EngineRequest

FINISH_REASONS = {StopReason.EOS: "stop", StopReason.STOP_SEQUENCE: "stop", StopReason.MAX_TOKENS: "length"}
ERRORS = {
    **UNAUTHORIZED,
    400: {"model": ErrorResponse, "description": "invalid request"},
    404: {"model": ErrorResponse, "description": "unknown model"},
    503: {"model": ErrorResponse, "description": "loading, draining, or all slots busy (see Retry-After)"},
}
GENERATION_ERRORS = {**ERRORS, 500: {"model": ErrorResponse, "description": "inference failed"}}


def openai_router(state: WorkerState) -> APIRouter:
    router = APIRouter(
        tags=["OpenAI-compatible"], route_class=rendering_route((AdmissionError, ApiError), openai_error)
    )

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, created=state.started_at, max_model_len=state.engine.model.context_length)

    @router.get("/v1/models", response_model=ModelList, responses={**UNAUTHORIZED, 503: ERRORS[503]})
    async def models() -> ModelList:
        if not state.engine.is_loaded:
            raise Loading()
        return ModelList(data=[card(name) for name in state.model_names])

    # `:path`: served names may hold slashes (`org/name`, `hf:org/name`)
    @router.get(
        "/v1/models/{model:path}",
        response_model=ModelCard,
        responses={**UNAUTHORIZED, 404: ERRORS[404], 503: ERRORS[503]},
    )
    async def model(model: str) -> ModelCard:
        """One served name's card, as GET /v1/models lists it (`client.models.retrieve`)."""
        if not state.engine.is_loaded:
            raise Loading()
        check_model(state, model)
        return card(model)

    @router.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses=with_stream(GENERATION_ERRORS, "CompletionResponse chunks, then data: [DONE]"),
    )
    async def completions(body: CompletionRequest, http_request: Request) -> Response:
        check_choices(body)
        grammar = await response_grammar(state, body.grammar, "response_format")
        # best_of ranks sequences by their tokens' logprobs, which the engine then returns (and these routes drop
        # where the request did not ask for them)
        logprobs = body.logprobs if body.samples == body.n else body.logprobs or 0
        # The prompt's logprobs: echoed with logprobs, and vLLM's prompt_logprobs; the engine gives the most asked.
        echo_top = body.logprobs if body.echo else None
        prompt_top = max((k for k in (echo_top, body.prompt_logprobs) if k is not None), default=None)
        prompts: list[tuple[int, ...]] = []
        echoes: list[str] = []  # each prompt's text, put before its choices' with echo

        def build() -> list[EngineRequest]:
            check_model(state, body.model)
            check_capacity(state, body.samples * len(body.prompts), "n" if body.samples > 1 else "prompt")
            prompts.extend(completion_prompt(state, prompt, body.max_tokens) for prompt in body.prompts)
            if body.echo:
                echoes.extend(p if isinstance(p, str) else state.engine.model.detokenize(ids)
                              for p, ids in zip(body.prompts, prompts, strict=True))  # fmt: skip
            return [
                dataclasses.replace(
                    engine_request(state, body, ids, body.max_tokens, logprobs, http_request, "cmpl", grammar, sample),
                    prompt_logprobs=prompt_top,
                )
                for ids in prompts
                for sample in range(body.samples)
            ]

        jobs = [job.events for job in await admit_all(state, build, http_request)]
        base = {"id": http_request.state.job_id, "created": int(time.time()), "model": state.model_name}

        def choice(index: int, piece: Generation, end: End | None, head: bool) -> dict:
            """A choice's piece; `head`: the piece that begins its text, after the prompt where echoed."""
            prompt = index // body.n  # best_of's choices are each prompt's n best, in order
            echo = echoes[prompt] if body.echo and head else ""
            text_logprobs = None
            if body.logprobs is not None:
                shift = len(echoes[prompt]) if body.echo else 0
                text_logprobs = completion_logprobs(state, piece.logprobs, piece.offset + shift)
                if echo_top is not None and head:
                    assert piece.prompt is not None
                    text_logprobs = joined(echo_logprobs(state, prompts[prompt], piece.prompt, echo_top), text_logprobs)
            finish = None if end is None else FINISH_REASONS[end.stop_reason]
            payload = {"index": index, "text": echo + "".join(piece.text), "logprobs": text_logprobs,
                       "finish_reason": finish}  # fmt: skip
            if body.prompt_logprobs is not None and piece.prompt is not None:
                payload["prompt_logprobs"] = prompt_logprobs_json(state, piece.prompt, body.prompt_logprobs)
            return payload

        def usage_of(ends: list[End]) -> dict:
            return usage(ends, per_prompt=body.samples)

        if body.stream:
            # An echoed prompt is a chunk of its own: with logprobs once the engine has them, else at once.
            def chunk(index: int, piece: Generation, end: End | None) -> dict:
                head = piece.prompt is not None
                return {**base, "object": "text_completion", "choices": [choice(index, piece, end, head)]}

            def echoed(index: int) -> dict:
                return {**base, "object": "text_completion", "choices": [choice(index, Generation(), None, True)]}

            first = echoed if body.echo and echo_top is None else None
            return sse_response(stream_chunks(jobs, chunk, usage_of if body.include_usage else None, first=first))
        generations = await collect(jobs, http_request)
        kept = best_of_each(generations, body.samples, body.n)
        choices = [choice(index, generation, generation.end, True) for index, generation in enumerate(kept)]
        ends = [generation.end for generation in generations if generation.end is not None]
        return JSONResponse({**base, "object": "text_completion", "choices": choices, "usage": usage_of(ends)})

    @router.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses=with_stream(GENERATION_ERRORS, "chat.completion.chunk objects, then data: [DONE]"),
    )
    async def chat_completions(body: ChatCompletionRequest, http_request: Request) -> Response:
        top = (body.top_logprobs or 0) if body.logprobs else None
        started = await start_chat(state, body, http_request, "chatcmpl")
        jobs, outputs = started.jobs, started.outputs
        base = {"id": http_request.state.job_id, "created": int(time.time()), "model": state.model_name}
        reasoning = state.engine.model.reasoning

        def usage_of(ends: list[End]) -> dict:
            return usage(ends, body.n, None if reasoning is None else sum(o.reasoning_tokens for o in outputs))

        def logprobs_of(piece: Generation) -> dict | None:
            if top is None:
                return None
            return {"content": [chat_logprob(state, lp) for lp in piece.logprobs]}

        def finish_reason(index: int, end: End) -> str:
            natural = end.stop_reason is not StopReason.MAX_TOKENS
            return "tool_calls" if outputs[index].called and natural else FINISH_REASONS[end.stop_reason]

        if body.stream:

            def chunk(index: int, piece: Generation, end: End | None) -> dict | None:
                output = outputs[index]
                delta = output.feed_pieces(list(zip(piece.text, piece.tokens, strict=True)))
                if end is not None:
                    delta = delta.merged(output.finish())
                if not delta and end is None and top is None:
                    return None
                choice = {
                    "index": index,
                    "delta": delta_json(delta),
                    "logprobs": logprobs_of(piece),
                    "finish_reason": None if end is None else finish_reason(index, end),
                }
                return {**base, "object": "chat.completion.chunk", "choices": [choice]}

            def opening(index: int) -> dict:
                delta = {"role": "assistant", "content": ""}
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
                return {**base, "object": "chat.completion.chunk", "choices": [choice]}

            return sse_response(stream_chunks(jobs, chunk, usage_of if body.include_usage else None, first=opening))
        generations = await collect(jobs, http_request)
        choices = []
        for index, generation in enumerate(generations):
            message = outputs[index].message(list(zip(generation.text, generation.tokens, strict=True)))
            reply: dict = {"role": "assistant", "content": message.content}
            if reasoning is not None:
                reply["reasoning_content"] = message.reasoning
            if message.tool_calls:
                reply["tool_calls"] = [call_json(call) for call in message.tool_calls]
            end = generation.end
            assert end is not None  # collect raised for a job without a result
            choices.append(
                {
                    "index": index,
                    "message": reply,
                    "logprobs": logprobs_of(generation),
                    "finish_reason": finish_reason(index, end),
                }
            )
        ends = [generation.end for generation in generations if generation.end is not None]
        response = {**base, "object": "chat.completion", "choices": choices, "usage": usage_of(ends)}
        if body.prompt_logprobs is not None and (scored := generations[0].prompt) is not None:
            response["prompt_logprobs"] = prompt_logprobs_json(state, scored, body.prompt_logprobs)
        return JSONResponse(response)

    @router.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        ensure_open(state)
        check_model(state, body.model)

        def tokens() -> tuple[int, ...]:
            if body.messages is not None:
                messages = [m.for_template() for m in body.messages]
                return render_chat(state, messages, body.add_generation_prompt, max_tokens=0)
            check_fits(state, body.prompt or "", 0, "prompt")
            return state.engine.model.tokenize(body.prompt or "", add_special_tokens=body.add_special_tokens)

        ids = await off_loop(state, tokens)
        return TokenizeResponse(count=len(ids), max_model_len=state.engine.model.context_length, tokens=list(ids))

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        ensure_open(state)
        check_model(state, body.model)
        ids = check_token_ids(state, body.tokens, "tokens", allow_empty=True)
        return DetokenizeResponse(prompt=await off_loop(state, lambda: state.engine.model.detokenize(ids)))

    return router


def with_stream(responses: dict, description: str) -> dict:
    """The 200 response of a generation route: JSON, or with `stream: true` an SSE stream."""
    return {
        **responses,
        200: {"content": {"text/event-stream": {"schema": {**SSE_EVENT, "description": description}}}},
    }


def openai_error(exc: AdmissionError | ApiError) -> JSONResponse:
    """OpenAI's error shape for whatever a route raises: an ApiError as it is, a refusal as its ApiError."""
    if isinstance(exc, Draining):
        exc = ApiError(503, "the worker is shutting down and takes no new requests", kind="server_error")
    elif isinstance(exc, Loading):
        exc = ApiError(503, "the model is still loading; retry shortly", kind="server_error", retry_after=1)
    elif isinstance(exc, Unhealthy):
        exc = ApiError(503, str(exc), kind="server_error")
    elif isinstance(exc, AllSlotsBusy):
        exc = ApiError(503, str(exc), kind="server_error", code="ALL_SLOTS_BUSY", retry_after=1)
    elif isinstance(exc, DuplicateJob):  # request ids are fresh UUIDs: only a bug gets here
        exc = ApiError(500, str(exc), kind="server_error")
    assert isinstance(exc, ApiError), exc
    return exc.response()


def check_choices(body: CompletionRequest) -> None:
    """A completion's choices: best_of at least n, not streamed where it leaves choices out, and at most
    MAX_CHOICES engine requests in all."""
    if body.samples < body.n:
        raise ApiError(400, f"best_of ({body.best_of}) must be at least n ({body.n})", param="best_of")
    if body.stream and body.samples > body.n:
        raise ApiError(400, "best_of cannot be streamed: the best choices are known once all have ended",
                       param="best_of")  # fmt: skip
    if (count := body.samples * len(body.prompts)) > MAX_CHOICES:
        raise ApiError(400, f"{len(body.prompts)} prompts x {body.samples} choices = {count} sequences; at most "
                       f"{MAX_CHOICES} per request", param="n")  # fmt: skip


def best_of_each(generations: list[Generation], samples: int, n: int) -> list[Generation]:
    """Of each prompt's `samples` consecutive generations, the `n` of the highest cumulative logprob, best first
    (best_of); all of them in order where samples is n."""
    if samples == n:
        return generations
    groups = [generations[i : i + samples] for i in range(0, len(generations), samples)]
    return [g for group in groups for g in sorted(group, key=lambda g: g.cumulative_logprob, reverse=True)[:n]]
