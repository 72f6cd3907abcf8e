"""The OpenAI-compatible API (CONTRACT.md §4): /v1/models, /v1/completions, /v1/chat/completions, /tokenize and
/detokenize, on the same engine as the native API.

Bodies are validated by the pydantic models of openai_schema.py; every error has OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`: routes raise ApiError or a refusal of api/admission.py, and
`openai_error` answers both (the validation handler in server.py answers invalid bodies). A `response_format` grammar
is compiled before the job is submitted (awaited, off the event loop: see Engine.grammars), so a schema that does not
compile is a 400 naming `response_format` before any work. Chat templates are rendered and prompts tokenized off the
event loop too (admission.off_loop), and a prompt text too long for the context whatever its tokens is refused before
it is tokenized (`check_fits`). A response's choices (`n`, `best_of`, batched prompts) are collected or streamed by
api/choices.py and written as OpenAI's JSON by api/openai_format.py.
"""

import dataclasses
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError

from rbee_worker.api.admission import (
    AdmissionError,
    AllSlotsBusy,
    Draining,
    DuplicateJob,
    Loading,
    Unhealthy,
    admit_all,
    compile_grammar,
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
from rbee_worker.api.openai_schema import (
    MAX_CHOICES,
    SEED_LIMIT,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    GenerationFields,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from rbee_worker.api.requests import sampling_params
from rbee_worker.api.state import WorkerState
from rbee_worker.chat.output import ChatOutput
from rbee_worker.chat.reasoning import ReasoningSplitter, opens_reasoning_ids
from rbee_worker.chat.tools import forced_grammar, tool_output
from rbee_worker.engine.grammar import CompiledGrammar, GrammarError, GrammarSpec
from rbee_worker.engine.types import End, StopReason
from rbee_worker.engine.types import Request as EngineRequest

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
        return ModelCard(id=name, created=state.started_at, max_model_len=state.engine.context_length)

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
            prompts.extend(completion_prompt(state, prompt, body.max_tokens) for prompt in body.prompts)
            if body.echo:
                echoes.extend(p if isinstance(p, str) else state.engine.detokenize(ids)
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
        tools = body.tool_dicts
        if body.forced_tool is not None:
            spec = forced_grammar(tools or [], body.forced_tool, body.parallel_tool_calls)
            grammar = await response_grammar(state, spec, "tools")
        else:
            grammar = await response_grammar(state, body.grammar, "response_format")

        prompt_ids: tuple[int, ...] = ()

        def build() -> list[EngineRequest]:
            nonlocal prompt_ids
            check_model(state, body.model)
            messages = [m.for_template() for m in body.messages]
            prompt_ids = render_chat(
                state, messages, tools=tools, template_kwargs=body.chat_template_kwargs, max_tokens=body.token_limit
            )
            return [
                dataclasses.replace(
                    engine_request(
                        state, body, prompt_ids, body.token_limit, top, http_request, "chatcmpl", grammar, sample
                    ),
                    reasoning=state.engine.reasoning,
                    prompt_logprobs=body.prompt_logprobs,
                )
                for sample in range(body.n)
            ]

        jobs = [job.events for job in await admit_all(state, build, http_request)]
        base = {"id": http_request.state.job_id, "created": int(time.time()), "model": state.model_name}
        reasoning = state.engine.reasoning  # admitted: the engine is loaded
        tool_format = state.engine.loaded.tool_format
        outputs = [
            ChatOutput(
                tool_output(tools, body.tool_mode, tool_format, body.parallel_tool_calls),
                None if reasoning is None else ReasoningSplitter(reasoning, opens_reasoning_ids(reasoning, prompt_ids)),
            )
            for _ in jobs
        ]

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
            return state.engine.tokenize(body.prompt or "", add_special_tokens=body.add_special_tokens)

        ids = await off_loop(state, tokens)
        return TokenizeResponse(count=len(ids), max_model_len=state.engine.context_length, tokens=list(ids))

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        ensure_open(state)
        check_model(state, body.model)
        ids = check_token_ids(state, body.tokens, "tokens", allow_empty=True)
        return DetokenizeResponse(prompt=await off_loop(state, lambda: state.engine.detokenize(ids)))

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


async def response_grammar(state: WorkerState, spec: GrammarSpec | None, param: str) -> CompiledGrammar | None:
    """The grammar of response_format or of a forced tool call compiled for the model (None: none); a schema that
    does not compile is a 400 naming `param`."""
    if spec is None:
        return None
    try:
        return await compile_grammar(state, spec)
    except GrammarError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param) from None


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


def check_model(state: WorkerState, model: str | None) -> None:
    """A named model must be one of this one's names (on a loaded engine: one of them is the model's own)."""
    if model is not None and model not in state.model_names:
        names = ", ".join(f"`{name}`" for name in state.model_names)
        raise ApiError(
            404,
            f"The model `{model}` does not exist: this worker serves {names} (see GET /v1/models)",
            kind="NotFoundError",
            param="model",
            code="model_not_found",
        )


def completion_prompt(state: WorkerState, prompt: str | list[int], max_tokens: int | None) -> tuple[int, ...]:
    """The token ids of one of a completion's prompts: a text, or ids."""
    if isinstance(prompt, list):
        return check_token_ids(state, prompt, "prompt")
    check_fits(state, prompt, max_tokens or 1, "prompt")
    return state.engine.tokenize(prompt)


def check_token_ids(state: WorkerState, ids: list[int], param: str, *, allow_empty: bool = False) -> tuple[int, ...]:
    vocab = state.engine.vocab_size
    if not ids and not allow_empty:
        raise ApiError(400, f"{param} must not be empty", param=param)
    if bad := [i for i in ids if not 0 <= i < vocab]:
        raise ApiError(400, f"token id {bad[0]} is outside this model's vocabulary (0..{vocab - 1})", param=param)
    return tuple(ids)


def render_chat(
    state: WorkerState,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    *,
    max_tokens: int | None,
) -> tuple[int, ...]:
    """The chat prompt's token ids; its text is refused before it is tokenized when it cannot leave room for
    `max_tokens` (None: one token)."""
    loaded = state.engine.loaded
    try:
        prompt = loaded.chat_prompt(messages, add_generation_prompt, tools, template_kwargs)
    # e.g. a template that demands alternating user/assistant turns, or adds text to a missing content (TypeError)
    except (TemplateError, ValueError, TypeError) as exc:
        raise ApiError(400, f"the model's chat template rejected the messages: {exc}", param="messages") from exc
    check_fits(state, prompt, 1 if max_tokens is None else max_tokens, "messages")
    return loaded.tokenize(prompt, add_special_tokens=False)  # the template writes BOS and the other special tokens


def check_fits(state: WorkerState, text: str, room: int, param: str) -> None:
    """Refuse, before tokenizing it, a prompt text too long to leave `room` tokens of the context whatever its tokens
    are (models/prompt_bound.py): a megabyte prompt is refused at once instead of after seconds of tokenizing."""
    bound = state.engine.loaded.prompt_bound
    if bound is None or (least := bound.least_tokens(text)) + room <= state.engine.context_length:
        return
    asked = f"at least {least} in the prompt" + (f" + {room} to generate" if room > 1 else "")
    asked += f": the prompt has {bound.size(text)} {bound.unit}, and no token stands for more than {bound.per_token}"
    raise context_exceeded(state.engine.context_length, asked, param)


def context_exceeded(context: int, asked: str, param: str) -> ApiError:
    return ApiError(
        400,
        f"This model's maximum context length is {context} tokens; the request needs more ({asked}). "
        "Shorten the prompt or lower max_tokens.",
        param=param,
    )


def engine_request(
    state: WorkerState,
    body: GenerationFields,
    prompt_ids: tuple[int, ...],
    max_tokens: int | None,
    logprobs: int | None,
    http_request: Request,
    prefix: str,
    grammar: CompiledGrammar | None,
    sample: int = 0,
) -> EngineRequest:
    """The engine request of one choice; `sample`: its place among its prompt's choices, which offsets a given seed
    (each choice draws on its own, and the first one's draws are those of a request for one choice)."""
    context = state.engine.context_length
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    check_token_ids(state, [token for token, _ in body.logit_bias or ()], "logit_bias", allow_empty=True)
    room = context - len(prompt_ids)
    if room < (1 if max_tokens is None else max_tokens):
        asked = f"{len(prompt_ids)} in the prompt" + (f" + {max_tokens} to generate" if max_tokens else "")
        raise context_exceeded(context, asked, "max_tokens" if max_tokens else "messages")
    return EngineRequest(
        prompt_ids=prompt_ids,
        max_tokens=room if max_tokens is None else max_tokens,
        sampling=sampling_params(body),
        seed=None if body.seed is None else (body.seed + sample) % SEED_LIMIT,
        stop=body.stops,
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        correlation_id=getattr(http_request.state, "correlation_id", None),
        logprobs=logprobs,
        ignore_eos=body.ignore_eos,
        grammar=grammar,
    )
