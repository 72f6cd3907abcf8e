"""From an OpenAI body to engine requests: the model named, prompts and chat templates rendered and tokenized (a text
too long for the context refused before it is tokenized), grammars compiled, and each choice's engine request. A
chat's jobs (`start_chat`) serve both /v1/chat/completions and /v1/responses."""

import dataclasses
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from jinja2 import TemplateError

from rbee_worker.api.admission import admit_all, compile_grammar
from rbee_worker.api.api_error import ApiError
from rbee_worker.api.openai_schema import SEED_LIMIT, ChatCompletionRequest, GenerationFields
from rbee_worker.api.request_settings import sampling_params
from rbee_worker.api.state import WorkerState
from rbee_worker.chat.message_parts import ChatOutput
from rbee_worker.chat.reasoning import ReasoningSplitter, opens_reasoning_ids
from rbee_worker.chat.tools import forced_grammar, tool_output
from rbee_worker.engine.request_types import Event
from rbee_worker.engine.request_types import Request as EngineRequest
from rbee_worker.engine.structured.grammar import CompiledGrammar, GrammarError, GrammarSpec


@dataclass
class ChatJobs:
    """A chat's admitted choices: each one's events, and the parser of its text into reasoning, content and calls."""

    jobs: list[AsyncIterator[Event]]
    outputs: list[ChatOutput]


async def start_chat(state: WorkerState, body: ChatCompletionRequest, http_request: Request, prefix: str) -> ChatJobs:
    """Render, tokenize and admit a chat's `n` choices (all or none), their grammar (response_format's, or a forced
    tool call's) compiled first; request ids start with `prefix`."""
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
        check_capacity(state, body.n, "n")
        messages = [m.for_template() for m in body.messages]
        prompt_ids = render_chat(
            state, messages, tools=tools, template_kwargs=body.chat_template_kwargs, max_tokens=body.token_limit
        )
        return [
            dataclasses.replace(
                engine_request(state, body, prompt_ids, body.token_limit, top, http_request, prefix, grammar, sample),
                reasoning=state.engine.model.reasoning,
                prompt_logprobs=body.prompt_logprobs,
            )
            for sample in range(body.n)
        ]

    jobs = [job.events for job in await admit_all(state, build, http_request)]
    reasoning = state.engine.model.reasoning  # admitted: the engine is loaded
    tool_format = state.engine.loaded.tool_format
    outputs = [
        ChatOutput(
            tool_output(tools, body.tool_mode, tool_format, body.parallel_tool_calls),
            None if reasoning is None else ReasoningSplitter(reasoning, opens_reasoning_ids(reasoning, prompt_ids)),
        )
        for _ in jobs
    ]
    return ChatJobs(jobs, outputs)


async def response_grammar(state: WorkerState, spec: GrammarSpec | None, param: str) -> CompiledGrammar | None:
    """The grammar of response_format or of a forced tool call compiled for the model (None: none); a schema that
    does not compile is a 400 naming `param`."""
    if spec is None:
        return None
    try:
        return await compile_grammar(state, spec)
    except GrammarError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param) from None


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
    return state.engine.model.tokenize(prompt)


def check_token_ids(state: WorkerState, ids: list[int], param: str, *, allow_empty: bool = False) -> tuple[int, ...]:
    vocab = state.engine.model.vocab_size
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


def check_capacity(state: WorkerState, count: int, param: str) -> None:
    """Refuse a request of more sequences (choices, prompts, inputs) than the engine admits at once, running and
    queued: it would be refused as busy whatever waited before it."""
    engine = state.engine
    if count > (most := engine.max_batch + engine.max_queue):
        limits = f"--max-batch {engine.max_batch} + --max-queue {engine.max_queue}"
        message = f"{param}: the request makes {count} sequences, and this worker admits at most {most} at once"
        raise ApiError(400, f"{message} ({limits})", param=param)


def check_fits(state: WorkerState, text: str, room: int, param: str) -> None:
    """Refuse, before tokenizing it, a prompt text too long to leave `room` tokens of the context whatever its tokens
    are (loading/prompt_bound.py): a megabyte prompt is refused at once instead of after seconds of tokenizing."""
    bound = state.engine.loaded.prompt_bound
    if bound is None or (least := bound.least_tokens(text)) + room <= state.engine.model.context_length:
        return
    asked = f"at least {least} in the prompt" + (f" + {room} to generate" if room > 1 else "")
    asked += f": the prompt has {bound.size(text)} {bound.unit}, and no token stands for more than {bound.per_token}"
    raise context_exceeded(state.engine.model.context_length, asked, param)


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
    context = state.engine.model.context_length
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
