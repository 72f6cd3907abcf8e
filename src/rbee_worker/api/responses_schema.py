"""The body of POST /v1/responses (OpenAI's Responses API), stateless: nothing is stored, so a request carries its
whole conversation in `input`. It is served as the chat completion it describes (`as_chat`): the instructions as the
system message, input items as chat messages (a `function_call` item as an assistant message's tool call, a
`function_call_output` item as a tool message), function tools and tool_choice in chat's shape, `text.format` as
response_format, `reasoning.effort` as the chat template's `reasoning_effort`."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rbee_worker.api.api_error import ApiError
from rbee_worker.api.openai_schema import MAX_LOGPROBS, ChatCompletionRequest, StreamOptions

# The chat field a Responses field becomes, for naming the Responses field in an error about the chat one.
CHAT_FIELDS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
    "tools": "tools",
    "tool_choice": "tool_choice",
    "top_logprobs": "top_logprobs",
}
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class InputText(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str | None = None
    refusal: str | None = None


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or part.refusal or "" for part in self.content)


class FunctionCallItem(BaseModel):
    """A call the model made in an earlier turn."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    """The result of a call, sent back by the client."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text or "" for part in self.output)


class ReasoningItem(BaseModel):
    """An earlier turn's reasoning: dropped from the prompt, as chat templates drop earlier turns' reasoning."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["reasoning"]


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["function"]
    name: str


class TextFormatConfig(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    format: TextFormatConfig | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    effort: str | None = Field(None, description="the chat template's reasoning_effort, where it takes one")
    summary: str | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: str | list[InputItem] = Field(description="a user message's text, or the conversation's items")
    instructions: str | None = Field(None, description="the system message")
    tools: list[FunctionTool] | None = Field(None, description="function tools only")
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = Field(None, description=f"{LOGPROBS_INCLUDE!r}: the output text's logprobs")
    stream: bool = False
    store: bool | None = Field(None, description="accepted; nothing is stored (the response says store: false)")
    previous_response_id: str | None = Field(None, description="refused: nothing is stored")
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = Field(None, description="extension, as chat's")

    def as_chat(self) -> ChatCompletionRequest:
        """The chat completion this request describes; ApiError (400, naming the Responses field) where it has
        none."""
        if self.previous_response_id is not None:
            raise ApiError(400, "previous_response_id: this worker stores no responses; send the whole conversation "
                           "in input (store: false)", param="previous_response_id")  # fmt: skip
        if conversation := self.model_extra and self.model_extra.get("conversation"):
            raise ApiError(400, f"conversation: this worker stores no conversations (got {conversation!r})",
                           param="conversation")  # fmt: skip
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages(),
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        for name in ("temperature", "top_p", "seed", "user"):
            if (value := getattr(self, name)) is not None:
                chat[name] = value
        if self.max_output_tokens is not None:
            chat["max_completion_tokens"] = self.max_output_tokens
        if self.stream:
            chat["stream_options"] = StreamOptions(include_usage=True)
        if self.tools:
            chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]  # fmt: skip
        if isinstance(self.tool_choice, NamedFunction):
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice
        if (fmt := self.text and self.text.format) is not None and fmt.type != "text":
            chat["response_format"] = {"type": fmt.type}
            if fmt.type == "json_schema":
                chat["response_format"]["json_schema"] = fmt.model_dump(exclude={"type"}, exclude_none=True,
                                                                        by_alias=True)  # fmt: skip
        if self.wants_logprobs:
            chat["logprobs"], chat["top_logprobs"] = True, self.top_logprobs or 0
        if self.reasoning is not None and self.reasoning.effort is not None:
            chat["chat_template_kwargs"] = {"reasoning_effort": self.reasoning.effort}
        try:
            return ChatCompletionRequest.model_validate(chat, strict=False)
        except ValidationError as exc:
            error = exc.errors()[0]
            field = CHAT_FIELDS.get(str(error["loc"][0]) if error["loc"] else "")
            raise ApiError(400, f"{field or 'input'}: {error['msg']}", param=field) from None

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or self.top_logprobs is not None

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages: the instructions first; consecutive function calls as one assistant
        message's tool calls (after its text, where the turn had one)."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, InputMessage):
                messages.append({"role": item.role, "content": item.text})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
        if not messages:
            raise ApiError(400, "input: no messages", param="input")
        return messages
