"""Request and response bodies of the OpenAI-compatible API (CONTRACT.md §4), as pydantic models: FastAPI validates
requests with them and publishes them in the OpenAPI document.

Types are strict (pydantic's strict mode): `false` is not the number 0 and "1" is not 1, as JSON Schema says; an
integer is still a valid float. Unknown request fields are ignored, as OpenAI-compatible servers do; fields that ask
for something this worker does not do (logit_bias, echo, suffix) are refused with a message that says so, never
ignored.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from rbee_worker.engine.sampling.sampling_params import MAX_LOGIT_BIAS
from rbee_worker.engine.structured.grammar import GrammarSpec

SEED_LIMIT = 2**64
MAX_STOP = 4
MAX_LOGPROBS = 20
MAX_CHOICES = 128  # n, best_of, and a completion's prompts times either: the engine requests one response makes


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["json_object"]


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="as OpenAI's: letters, digits, _ and -, up to 64")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON Schema the output follows")
    strict: bool | None = Field(None, description="accepted; the output always follows the schema")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class GenerationFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = Field(None, description="the served model's id (GET /v1/models); omitted: that model")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 is greedy")
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT, description="the same seed replays the same sample")
    stop: str | list[str] | None = Field(None, description=f"up to {MAX_STOP} non-empty strings")
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices to generate, each drawn on its own (seed + i)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(
        None,
        validate_default=True,
        description="token id -> bias in -100..100, added to the token's logit (-100 bans it, 100 forces it)",
    )
    # Extensions that vLLM and llama.cpp's server accept too.
    top_k: int = Field(0, ge=0, description="extension: 0 is off")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="extension")
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0, description="extension")
    ignore_eos: bool = Field(False, description="extension: generate max_tokens even past end-of-sequence")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="extension (vLLM's): each prompt token's logprob and the top N"
    )
    response_format: ResponseFormat | None = Field(
        None, description="json_object: a JSON object; json_schema: JSON that follows the schema (both on one line)"
    )

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        """As SamplingParams takes it: (token id, bias) pairs."""
        pairs = []
        for key, value in (bias or {}).items():
            if not key.strip().isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values are in -100..100, got {value}")
            pairs.append((int(key), float(value)))
        if len({token for token, _ in pairs}) < len(pairs):
            raise ValueError("logit_bias lists a token id twice")
        if len(pairs) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may list at most {MAX_LOGIT_BIAS} tokens")
        return tuple(pairs)

    @model_validator(mode="after")
    def _grammar_ends_the_output(self) -> "GenerationFields":
        if self.ignore_eos and self.grammar is not None:
            raise ValueError("ignore_eos cannot go with a JSON response_format, which ends where the JSON does")
        return self

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, prompt_logprobs: int | None, info: ValidationInfo) -> int | None:
        if prompt_logprobs is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs cannot go with stream (as in vLLM); echo with logprobs streams them")
        return prompt_logprobs

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ())  # the validator made it a list

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def grammar(self) -> GrammarSpec | None:
        """What response_format constrains the output to; None for text."""
        if isinstance(self.response_format, JsonObjectFormat):
            return GrammarSpec.json_object()
        if isinstance(self.response_format, JsonSchemaFormat):
            return GrammarSpec.json_schema(self.response_format.json_schema.schema_)
        return None


class CompletionRequest(GenerationFields):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)]
    ) = Field(description="a text, token ids, or a batch of either: one choice (n of them) per prompt, in order")
    max_tokens: int | None = Field(16, ge=0, description="default 16, as OpenAI's; 0: the prompt only (echo)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="also return the top N alternatives")
    echo: bool = Field(False, description="the prompt before the completion; with logprobs, its tokens' too")
    best_of: int | None = Field(
        None, ge=1, le=MAX_CHOICES, description="sequences drawn per prompt, of which the n most likely are returned"
    )
    suffix: str | None = Field(None, description="not supported: must be empty")

    # A field validator, so that the error's `param` names the field.
    @field_validator("suffix")
    @classmethod
    def _suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported")
        return suffix

    @property
    def samples(self) -> int:
        """Sequences drawn for each prompt: best_of, else n."""
        return self.best_of or self.n

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts of the batch: a single text or id list as a batch of one."""
        prompt = self.prompt
        return prompt if isinstance(prompt, list) and not isinstance(prompt[0], int) else [prompt]  # type: ignore[list-item]


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str
    arguments: str = Field(description="the arguments as JSON text")


class MessageToolCall(BaseModel):
    """A call an earlier assistant message made (tool messages answer it by its id)."""

    model_config = ConfigDict(extra="allow", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(None, description="an assistant message's calls")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it: text content, and calls and ids where it has them."""
        message: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="as OpenAI's: letters, digits, _ and -, up to 64")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of the arguments; omitted: none")
    strict: bool | None = Field(None, description="accepted; forced calls always follow the schema")


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["function"]
    function: ChosenFunction


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI: max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, description="default: the rest of the context")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="none: text only; auto (the default with tools): the model decides; required: at least one "
        "call; a named function: a call to it (required and named calls follow the parameters' schemas)",
    )
    parallel_tool_calls: bool = Field(True, description="false: at most one call")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='extension (as vLLM\'s): variables for the chat template, e.g. {"enable_thinking": false}'
    )

    @model_validator(mode="after")
    def _checked(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) < len(names):
            raise ValueError("tools: each function needs a name of its own")
        if self.tool_choice is not None and self.tool_choice != "none" and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names `{self.tool_choice.function.name}`, which is not one of the tools")
        if self.forced_tool is not None and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("a forced tool_choice cannot go with a JSON response_format: the call is the output")
        return self

    @property
    def tool_mode(self) -> str:
        """none, auto, required, or the name of the function the output must call."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        if not self.tools:
            return "none"
        return self.tool_choice or "auto"

    @property
    def forced_tool(self) -> str | None:
        """required, or the function named: the tool_choice that constrains the output; None otherwise."""
        return self.tool_mode if self.tool_mode not in ("none", "auto") else None

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template and the grammar take them; None when the output may call none."""
        if self.tool_mode == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools or ()]

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(
        description="prompt tokens found in the prefix cache (whole KV blocks), whose keys and values were not "
        "computed again; 0 with --no-prefix-cache"
    )


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = Field(description="the tokens of the reasoning (its tags included)")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int  # generated tokens, the end-of-sequence token excluded
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, description="a reasoning model's chat completions only"
    )


FinishReason = Literal["stop", "length"]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="with echo, null for the prompt's first token")
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int = Field(description="1 for the most likely token")
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    prompt_logprobs: PromptLogprobs | None = Field(
        None, description="with prompt_logprobs: null for the first token, then by token id (vLLM's format)"
    )


class CompletionResponse(BaseModel):
    """Also the shape of each streamed chunk (finish_reason null until the last one)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="null when the message is only tool calls")
    reasoning_content: str | None = Field(
        None, description="a reasoning model's thinking (its <think> part), apart from content; null when none"
    )
    tool_calls: list[ResponseToolCall] | None = Field(None, description="present when the model called tools")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | Literal["tool_calls"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(None, description="with prompt_logprobs: as a completion choice's")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rbee"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    """Either `prompt` (raw text) or `messages` (rendered with the model's chat template first)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
