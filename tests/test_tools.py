"""Tool calls (chat/tools.py, chat/tool_prompt.py, /v1/chat/completions): calls read from each format in any split of
the text; tools, calls and tool results in prompts whose templates do or do not render them; forced calls' grammars;
request checks; and the demo model on both runtimes through the openai client: named and required calls at
temperature 1.0 whose arguments validate, a call read from what the model writes (`auto`) after a conversation that
shows one, streamed deltas that concatenate to the non-streamed message."""

import json
import random
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from conftest import AUTH, RUNTIMES, SHARED_TOKEN, SharedWorkers
from pydantic import ValidationError
from serving import DEMO_NAME
from transformers import PreTrainedTokenizerFast

from rbee_worker.api.openai_schema import ChatCompletionRequest
from rbee_worker.chat.output import ChatOutput
from rbee_worker.chat.tool_prompt import TemplateCaps, probe_caps, template_messages
from rbee_worker.chat.tools import (
    NamedCall,
    ParsedCalls,
    RequiredCalls,
    ToolFormat,
    ToolOutput,
    forced_grammar,
    merge_calls,
    tool_format,
)

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER_PARAMETERS},
}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ADD_PARAMETERS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD_PARAMETERS}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# A Qwen 2.5-like template: it renders tools, calls and tool results itself.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def run(output: ToolOutput, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """The content and the (name, arguments) calls a text fed in `pieces` gives, through ChatOutput's merge."""
    chat = ChatOutput(output, None)
    content, calls = "", []
    for piece in pieces:
        delta = chat.feed(piece, 1)
        content, calls = content + delta.content, calls + delta.calls
    last = chat.finish()
    return content + last.content, [(c.name, c.arguments) for c in merge_calls(calls + last.calls)]


def splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(24, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize(
    ("fmt", "text", "content", "calls"),
    [
        (ToolFormat.HERMES, f"Let me look.\n{CALL}", "Let me look.\n", [("get_weather", '{"city": "Paris"}')]),
        (
            ToolFormat.HERMES,
            f"{CALL}\n{CALL.replace('Paris', 'Rome')}\n",
            "",
            [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')],
        ),
        (
            ToolFormat.HERMES,
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}',
            "",
            [("add", '{"a": 1, "b": 2}')],
        ),
        (ToolFormat.HERMES, "a <tool_call>not json</tool_call> b", "a <tool_call>not json</tool_call> b", []),
        (ToolFormat.HERMES, "plain text, a < sign and <tool_ca", "plain text, a < sign and <tool_ca", []),
        (
            ToolFormat.HERMES,
            '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
            "",
            [("f", '{"x": 1}')],
        ),
        (
            ToolFormat.LLAMA3_JSON,
            ' {"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "f", "parameters": {}}',
            "",
            [("add", '{"a": 1, "b": 2}'), ("f", "{}")],
        ),
        (ToolFormat.LLAMA3_JSON, '<|python_tag|>{"name": "f", "parameters": {}}', "", [("f", "{}")]),
        (ToolFormat.LLAMA3_JSON, '{"answer": 42}', '{"answer": 42}', []),
        (ToolFormat.LLAMA3_JSON, 'The JSON {"name": "f"}', 'The JSON {"name": "f"}', []),
        (ToolFormat.MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {"x": [1]}}]', "", [("f", '{"x": [1]}')]),
        (
            ToolFormat.MISTRAL,
            '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]',
            "",
            [("f", "{}"), ("g", "{}")],
        ),
        (ToolFormat.MISTRAL, "[1, 2]", "[1, 2]", []),
    ],
)
def test_calls_read_from_each_format_in_any_split(
    fmt: ToolFormat, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    assert run(ParsedCalls(fmt), [text]) == (content, calls)
    rng = random.Random(text)
    for _ in range(50):  # a stream's pieces end anywhere: inside a marker, a call, or between calls
        assert run(ParsedCalls(fmt), splits(text, rng)) == (content, calls)


def test_each_call_of_a_stream_goes_out_once_it_closes() -> None:
    parser = ParsedCalls(ToolFormat.HERMES)
    assert parser.feed("Checking.<tool_").content == "Checking."
    first = parser.feed('call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g",')
    assert [(c.index, c.name) for c in first.calls] == [(0, "f")] and first.calls[0].id
    second = parser.feed(' "arguments": {}}</tool_call>')
    assert [(c.index, c.name) for c in second.calls] == [(1, "g")]
    assert second.calls[0].id != first.calls[0].id
    assert not parser.finish().calls


def test_forced_calls_read_their_output() -> None:
    named = NamedCall("add")
    first, rest = named.feed('{"a": 1,'), named.feed(' "b": 2}')
    assert first.calls[0].name == "add" and first.calls[0].id and first.calls[0].arguments == '{"a": 1,'
    assert rest.calls[0].id is None and rest.calls[0].arguments == ' "b": 2}'
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    assert run(RequiredCalls(), splits(text, random.Random(1))) == (
        "",
        [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "Oslo"}')],
    )
    cut = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "add", "param'  # max_tokens came first
    assert run(RequiredCalls(), splits(cut, random.Random(2))) == ("", [("add", '{"a": 1, "b": 2}')])
    assert run(RequiredCalls(), ['[{"name": "add", "param']) == ('[{"name": "add", "param', [])


def test_a_message_of_only_calls_has_null_content() -> None:
    message = ChatOutput(ParsedCalls(ToolFormat.HERMES), None).message([("\n", 1), (CALL, 20), ("\n", 1)])
    assert message.content is None and [c.name for c in message.tool_calls] == ["get_weather"]
    assert message.reasoning is None and message.reasoning_tokens == 0
    assert ChatOutput(None, None).message([(CALL, 20)]).content == CALL  # tool_choice none: text as written


def test_forced_grammars() -> None:
    assert json.loads(forced_grammar([WEATHER, ADD], "add", parallel=True).text) == ADD_PARAMETERS
    one = json.loads(forced_grammar([WEATHER, ADD], "required", parallel=False).text)
    assert one["minItems"] == 1 and one["maxItems"] == 1
    names = [option["properties"]["name"]["enum"] for option in one["items"]["anyOf"]]
    assert names == [["get_weather"], ["add"]]
    assert "maxItems" not in json.loads(forced_grammar([WEATHER], "required", parallel=True).text)
    bare = {"type": "function", "function": {"name": "now"}}
    assert json.loads(forced_grammar([bare], "now", parallel=True).text) == {"type": "object", "properties": {}}


def test_format_read_from_the_template() -> None:
    assert tool_format(TOOL_TEMPLATE) is ToolFormat.HERMES
    assert tool_format("{{ '[TOOL_CALLS]' }}{{ messages }}") is ToolFormat.MISTRAL
    assert tool_format("{{- '<|python_tag|>' + tool_call.name }}") is ToolFormat.LLAMA3_JSON
    assert tool_format(None) is ToolFormat.HERMES


@pytest.fixture(scope="module")
def demo_tokenizer(demo_hf_dir: Any) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(demo_hf_dir)


HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "content": "Sunny, 24 C", "tool_call_id": "c1"},
]


def test_a_template_without_tools_gets_them_in_the_hermes_format(demo_tokenizer: PreTrainedTokenizerFast) -> None:
    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return demo_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)

    caps = probe_caps(render)
    assert (caps.tools, caps.tool_calls, caps.tool_responses) == (False, False, True)
    messages, tools = template_messages(HISTORY, [WEATHER], caps)
    prompt = render(messages, tools)
    assert tools is None and prompt.startswith("<|im_start|>system\n# Tools")
    assert json.dumps(WEATHER) in prompt and '"arguments": <args-json-object>' in prompt
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in prompt
    )
    assert "<|im_start|>tool\nSunny, 24 C<|im_end|>" in prompt
    messages, _ = template_messages(HISTORY, None, TemplateCaps(tools=False, tool_calls=False, tool_responses=False))
    assert messages[-1] == {"role": "user", "content": "<tool_response>\nSunny, 24 C\n</tool_response>"}


def test_a_template_with_tools_renders_them_itself(demo_tokenizer: PreTrainedTokenizerFast) -> None:
    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return demo_tokenizer.apply_chat_template(messages, tools=tools, chat_template=TOOL_TEMPLATE, tokenize=False)

    caps = probe_caps(render)
    assert (caps.tools, caps.tool_calls, caps.tool_responses) == (True, True, True)
    messages, tools = template_messages(HISTORY, [WEATHER], caps)
    prompt = render(messages, tools)
    assert tools == [WEATHER] and "# Tools" not in prompt
    # The call's JSON arguments reach the template as an object: its tojson writes them once, not as a string.
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "`nope`"),
        ({"tools": [WEATHER, WEATHER]}, "a name of its own"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "pattern"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot go with a JSON response_format",
        ),
    ],
)
def test_tool_requests_that_are_refused(fields: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


# --- the demo model, through the openai client ----------------------------------------------------------------------


@pytest.fixture(scope="module", params=RUNTIMES)
def client(shared_workers: SharedWorkers, request: pytest.FixtureRequest) -> openai.OpenAI:
    """On the session's shared worker of each runtime (default flags)."""
    worker = shared_workers.get(request.param)
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key=SHARED_TOKEN, max_retries=0, timeout=120)


def streamed(client: openai.OpenAI, **asked: Any) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """A streamed reply's content, its calls as a client concatenates their deltas, and its finish reason."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**asked, stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": "", "ids": []})
            call["ids"].append(delta.id)
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    for call in calls.values():  # the id and the name come once, with the call's first delta
        assert call["ids"][0] and not any(call["ids"][1:])
    return content or None, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], finish


def calls_of(reply: Any) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in reply.choices[0].message.tool_calls or []]


@pytest.mark.slow
def test_forced_calls_validate_at_temperature_one(client: openai.OpenAI) -> None:
    """Each seed's call validates against its function's parameters; streamed, the same call. The prompt is computed
    once first, so that both compared requests find the same prefix cached (README, Determinism)."""
    common = {
        "model": DEMO_NAME,
        "messages": [{"role": "user", "content": "What will the weather be in Oslo for the next three days?"}],
        "tools": [WEATHER, ADD],
        "temperature": 1.0,
        "max_tokens": 100,
    }
    client.chat.completions.create(**{**common, "max_tokens": 1})
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, seed in ((named, 1), (named, 2), ("required", 1)):
        asked = {**common, "tool_choice": choice, "parallel_tool_calls": False, "seed": seed}
        reply = client.chat.completions.create(**asked)
        calls = calls_of(reply)
        assert reply.choices[0].finish_reason == "tool_calls", reply
        assert reply.choices[0].message.content is None and len(calls) == 1
        name, arguments = calls[0]
        assert name == "get_weather" or (choice == "required" and name == "add")
        jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS if name == "get_weather" else ADD_PARAMETERS)
        assert reply.choices[0].message.tool_calls[0].id.startswith("call_")
        assert streamed(client, **asked) == (None, calls, "tool_calls")


@pytest.mark.slow
def test_a_call_the_model_writes_is_read_as_a_call(client: openai.OpenAI) -> None:
    """`auto`: after a conversation that shows a call and its result, the demo model calls the tool again in the
    Hermes format its template-less prompt teaches; streamed, the same call."""
    asked = {
        "model": DEMO_NAME,
        "messages": [
            *HISTORY,
            {"role": "assistant", "content": "It is sunny in Paris, 24 C."},
            {"role": "user", "content": "What is the weather in Rome?"},
        ],
        "tools": [{**WEATHER, "function": {**WEATHER["function"], "parameters": CITY}}],
        "temperature": 0,
        "max_tokens": 60,
    }
    client.chat.completions.create(**{**asked, "max_tokens": 1})  # both compared requests then find it cached
    reply = client.chat.completions.create(**asked)
    assert reply.choices[0].finish_reason == "tool_calls", reply
    assert calls_of(reply) == [("get_weather", '{"city": "Rome"}')]
    assert streamed(client, **asked) == (None, calls_of(reply), "tool_calls")
    text_only = client.chat.completions.create(**{**asked, "tool_choice": "none"})
    assert not text_only.choices[0].message.tool_calls and text_only.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_a_tools_schema_that_does_not_compile_is_a_400_naming_tools(client: openai.OpenAI) -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=DEMO_NAME, messages=[{"role": "user", "content": "hi"}], tools=[bad], tool_choice="required"
        )
    assert caught.value.body["param"] == "tools", caught.value.body
    with httpx.Client(base_url=str(client.base_url).removesuffix("/v1/"), timeout=30, headers=AUTH) as http:
        refused = http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}
        )
    assert refused.status_code == 400 and "tool_choice needs tools" in refused.json()["error"]["message"]
