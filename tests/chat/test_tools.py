"""Tool calls (chat/tools.py, chat/call_stream.py, chat/tool_prompt.py, /v1/chat/completions): calls read from each
format in every split of the text, streamed as they are written (a call's header once it is decided, then its
arguments' text), broken calls under the header rule; tools, calls and tool results in prompts whose templates do or
do not render them; forced calls' grammars; request checks; and the demo model on both runtimes through the openai
client: named and required calls at temperature 1.0 whose arguments validate, a call read from what the model writes
(`auto`) after a conversation that shows one, a call cut by max_tokens after its header, streamed deltas (a call's
arguments in several chunks) that concatenate to the non-streamed message."""

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
from rbee_worker.chat.message_parts import ChatOutput
from rbee_worker.chat.tool_prompt import TemplateCaps, probe_caps, template_messages
from rbee_worker.chat.tools import (
    CallDelta,
    NamedCall,
    RequiredCalls,
    ToolFormat,
    ToolOutput,
    coalesced,
    forced_grammar,
    merge_calls,
    parsed_calls,
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
NAMES = frozenset({"get_weather", "add", "f", "g"})  # the tools of the texts read below
# Arguments written as a JSON string, with escapes of every kind: a quote, a newline, a two-byte character and an
# emoji (a surrogate pair in ASCII-only JSON); the string's text starts with whitespace.
STRING_ARGUMENTS = ' {"x": "say \\"hi\\"\\n", "e": "\u00e9\U0001f600"}'
WRITTEN_AS_STRING = '<tool_call>{"name": "f", "arguments": ' + json.dumps(STRING_ARGUMENTS) + "}</tool_call>"
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


def every_split(text: str) -> list[list[str]]:
    """The text whole, one character at a time, cut once at each place, and in 50 random splits."""
    rng = random.Random(text)
    halves = [[text[:cut], text[cut:]] for cut in range(1, len(text))]
    return [[text], list(text), *halves, *(splits(text, rng) for _ in range(50))]


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
        (ToolFormat.HERMES, WRITTEN_AS_STRING, "", [("f", STRING_ARGUMENTS)]),
        (  # the arguments as written: spacing, key order and escapes kept, not re-serialized
            ToolFormat.HERMES,
            '<tool_call>{"arguments":{ "b" :[1,{"c":"}\\"]"}],"a":"\\u00e9"}, "name":"f"}</tool_call>',
            "",
            [("f", '{ "b" :[1,{"c":"}\\"]"}],"a":"\\u00e9"}')],
        ),
        (  # a name that is not one of the tools: text
            ToolFormat.HERMES,
            '<tool_call>{"name": "h", "arguments": {}}</tool_call> and on',
            '<tool_call>{"name": "h", "arguments": {}}</tool_call> and on',
            [],
        ),
        (
            ToolFormat.HERMES,
            '<tool_call>{"id": 7, "name": "f", "extra": [{"}": 1}], "arguments": {"x": true}}</tool_call>',
            "",
            [("f", '{"x": true}')],
        ),
        (ToolFormat.HERMES, '<tool_call>{"name": "f"}</tool_call>', "", [("f", "{}")]),
        (
            ToolFormat.LLAMA3_JSON,
            ' {"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "f", "parameters": {}}',
            "",
            [("add", '{"a": 1, "b": 2}'), ("f", "{}")],
        ),
        (ToolFormat.LLAMA3_JSON, '<|python_tag|>{"name": "f", "parameters": {}}', "", [("f", "{}")]),
        (ToolFormat.LLAMA3_JSON, '{"answer": 42}', '{"answer": 42}', []),
        (ToolFormat.LLAMA3_JSON, 'The JSON {"name": "f"}', 'The JSON {"name": "f"}', []),
        (
            ToolFormat.LLAMA3_JSON,
            '{"name": "f", "parameters": {"x": 1}} That is the call.',
            "That is the call.",
            [("f", '{"x": 1}')],
        ),
        (ToolFormat.MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {"x": [1]}}]', "", [("f", '{"x": [1]}')]),
        (
            ToolFormat.MISTRAL,
            '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]',
            "",
            [("f", "{}"), ("g", "{}")],
        ),
        (ToolFormat.MISTRAL, "[1, 2]", "[1, 2]", []),
        (ToolFormat.MISTRAL, "[TOOL_CALLS]", "[TOOL_CALLS]", []),
    ],
)
def test_calls_read_from_each_format_in_every_split(
    fmt: ToolFormat, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    """Whole, a character at a time, or cut anywhere (inside a tag, a name, a string, an escape, between calls): the
    same content and calls, each call's arguments valid JSON, the text as the model wrote it."""
    for pieces in every_split(text):
        assert run(parsed_calls(fmt, NAMES), pieces) == (content, calls), pieces
    for _, arguments in calls:
        assert isinstance(json.loads(arguments), dict)


@pytest.mark.parametrize(
    ("fmt", "text", "content", "calls"),
    [
        # The output ends (max_tokens, or the model stops) inside the arguments: the call keeps what was written.
        (
            ToolFormat.HERMES,
            'Sure. <tool_call>{"name": "add", "arguments": {"a": 1, "b',
            "Sure. ",
            [("add", '{"a": 1, "b')],
        ),
        # Hermes' closing tag ends a call whose JSON has not closed; what follows the tag is content again.
        (
            ToolFormat.HERMES,
            '<tool_call>{"name": "f", "arguments": {"x": "a</tool_call> Done.',
            "Done.",
            [("f", '{"x": "a')],
        ),
        # The call object closes, its tag does not come: the text after it is content.
        (
            ToolFormat.HERMES,
            '<tool_call>{"name": "f", "arguments": {"x": 1}} It is sunny.',
            "It is sunny.",
            [("f", '{"x": 1}')],
        ),
        # Broken before the header: text, as written, tags included.
        (
            ToolFormat.HERMES,
            '<tool_call>{"name": "f", "arguments" {}}</tool_call>',
            '<tool_call>{"name": "f", "arguments" {}}</tool_call>',
            [],
        ),
        (
            ToolFormat.HERMES,
            '<tool_call>{"name": "f", "argu',
            '<tool_call>{"name": "f", "argu',
            [],
        ),
        (
            ToolFormat.HERMES,
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            [],
        ),
        # Arguments written as a string that does not begin an object: text.
        (
            ToolFormat.HERMES,
            '<tool_call>{"name": "f", "arguments": " [1]"}</tool_call>',
            '<tool_call>{"name": "f", "arguments": " [1]"}</tool_call>',
            [],
        ),
        (
            ToolFormat.HERMES,
            '<tool_call>{"name": "f", "arguments": " "}</tool_call>',
            '<tool_call>{"name": "f", "arguments": " "}</tool_call>',
            [],
        ),
        # Once a string's text has begun an object, the call is decided: its arguments are the text decoded.
        (
            ToolFormat.HERMES,
            '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1} and"}</tool_call>',
            "",
            [("f", '{"x": 1} and')],
        ),
        # A second call that breaks after its header: both calls stay, the second with its arguments as written.
        (
            ToolFormat.MISTRAL,
            '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"y": [',
            "",
            [("f", "{}"), ("g", '{"y": [')],
        ),
        (
            ToolFormat.LLAMA3_JSON,
            '{"name": "f", "parameters": {"x": 1}}; {"name": "nope", "parameters": {}}',
            '{"name": "nope", "parameters": {}}',
            [("f", '{"x": 1}')],
        ),
    ],
)
def test_broken_calls_follow_the_header_rule(
    fmt: ToolFormat, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    """A call is decided by its header (its name and the beginning of its arguments): after it, the call stays one,
    its arguments as written; before it, the text is content. The same in every split, so streamed or not."""
    for pieces in every_split(text):
        assert run(parsed_calls(fmt, NAMES), pieces) == (content, calls), pieces


def deltas(output: ToolOutput, pieces: list[str]) -> list[list[CallDelta]]:
    """The call deltas that each piece gives (the last entry: those of the output's end)."""
    given = [output.feed(piece).calls for piece in pieces]
    return [*given, output.finish().calls]


def test_a_call_streams_as_it_is_written() -> None:
    """The header (index, id, name) goes out once the name and the arguments' opening brace are read; then each piece
    of the arguments goes out as it comes, held back only where it may be the closing tag's beginning."""
    text = 'Checking.<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call><tool_call>{"name": "f",'
    text += ' "arguments": {"x": "</"}}</tool_call>'
    cut = text.index("<tool_call>", 20)  # a character at a time up to the second call, the rest in one piece
    pieces = [*text[:cut], text[cut:]]
    given = deltas(parsed_calls(ToolFormat.HERMES, NAMES), pieces)
    header = next(i for i, calls in enumerate(given) if calls)
    assert "".join(pieces[: header + 1]).endswith('"arguments": {')
    assert given[header] == [CallDelta(0, "{", given[header][0].id, "add")] and given[header][0].id.startswith("call_")
    arguments = [calls for calls in given[header + 1 : cut] if calls]
    assert [c.arguments for [c] in arguments] == list('"a": 12, "b": 30}')  # a character at a time, as fed
    assert all(c.index == 0 and c.id is None for [c] in arguments)
    second = given[cut]
    assert [(c.index, c.name, c.arguments) for c in second] == [(1, "f", '{"x": "</"}')] and second[0].id
    assert second[0].id != given[header][0].id and not given[-1]
    held = deltas(parsed_calls(ToolFormat.HERMES, NAMES), ['<tool_call>{"name": "f", "arguments": {"x": 1</to'])
    assert [c.arguments for c in held[0]] == ['{"x": 1'] and [c.arguments for c in held[1]] == ["</to"]


def test_arguments_written_as_a_string_stream_decoded_as_they_come() -> None:
    """A character at a time: the header goes out with the string's first brace (and the whitespace before it), each
    character of the arguments as its escape sequence completes, an emoji's surrogate pair as one."""
    cut = WRITTEN_AS_STRING.index('"arguments"')
    pieces = [WRITTEN_AS_STRING[:cut], *WRITTEN_AS_STRING[cut:]]
    given = deltas(parsed_calls(ToolFormat.HERMES, NAMES), pieces)
    header = next(i for i, calls in enumerate(given) if calls)
    assert "".join(pieces[: header + 1]).endswith('"arguments": " {') and given[header][0].arguments == " {"
    assert given[header][0].name == "f" and given[header][0].id
    streamed = [c.arguments for calls in given[header + 1 :] for c in calls]
    assert streamed == list(STRING_ARGUMENTS[2:])


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    """tool_choice "auto" with parallel_tool_calls false: the first call is the message's only one, streamed or not;
    later calls are dropped whole, the text around them read as without the limit."""
    text = f"Checking.\n{CALL}\n{CALL.replace('Paris', 'Rome')} Done."
    for pieces in every_split(text):
        assert run(parsed_calls(ToolFormat.HERMES, NAMES, most=1), pieces) == (
            "Checking.\nDone.",
            [("get_weather", '{"city": "Paris"}')],
        )
    assert len(run(parsed_calls(ToolFormat.HERMES, NAMES), [text])[1]) == 2
    mistral = '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"y": 1}}]'
    for pieces in every_split(mistral):
        assert run(parsed_calls(ToolFormat.MISTRAL, NAMES, most=1), pieces) == ("", [("f", "{}")])


def test_a_chunk_carries_one_entry_per_call() -> None:
    joined = coalesced([CallDelta(0, '{"a"', "call_1", "f"), CallDelta(0, ": 1}"), CallDelta(1, "{", "call_2", "g")])
    assert joined == [CallDelta(0, '{"a": 1}', "call_1", "f"), CallDelta(1, "{", "call_2", "g")]
    assert coalesced([CallDelta(1, "}"), CallDelta(1, "")]) == [CallDelta(1, "}")]


def test_forced_calls_read_their_output() -> None:
    named = NamedCall("add")
    first, rest = named.feed('{"a": 1,'), named.feed(' "b": 2}')
    assert first.calls[0].name == "add" and first.calls[0].id and first.calls[0].arguments == '{"a": 1,'
    assert rest.calls[0].id is None and rest.calls[0].arguments == ' "b": 2}'
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    for pieces in every_split(text):
        assert run(RequiredCalls(NAMES), pieces) == (
            "",
            [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "Oslo"}')],
        )
    streamed_calls = [c for calls in deltas(RequiredCalls(NAMES), list(text)) for c in calls]
    # a delta per character of the arguments, the first of each call (its header) with the opening brace
    assert [c.arguments for c in streamed_calls] == list('{"a": 1, "b": 2}{"city": "Oslo"}')
    assert [c.name for c in streamed_calls if c.id] == ["add", "get_weather"]
    # max_tokens came first: a call cut before its header is dropped, one cut after it keeps its arguments as written
    cut = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "add", "param'
    assert run(RequiredCalls(NAMES), splits(cut, random.Random(2))) == ("", [("add", '{"a": 1, "b": 2}')])
    assert run(RequiredCalls(NAMES), ['[{"name": "add", "param']) == ('[{"name": "add", "param', [])
    assert run(RequiredCalls(NAMES), ['[{"name": "add", "parameters": {"a": 1']) == ("", [("add", '{"a": 1')])


def test_a_message_of_only_calls_has_null_content() -> None:
    message = ChatOutput(parsed_calls(ToolFormat.HERMES, NAMES), None).message([("\n", 1), (CALL, 20), ("\n", 1)])
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


def streamed(
    client: openai.OpenAI, **asked: Any
) -> tuple[tuple[str | None, list[tuple[str, str]], str | None], list[int]]:
    """A streamed reply's content, its calls as a client concatenates their deltas, and its finish reason; and how
    many chunks carried each call's arguments."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**asked, stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        indexes = [delta.index for delta in choice.delta.tool_calls or []]
        assert len(set(indexes)) == len(indexes), chunk  # one entry per call in a chunk, as OpenAI sends them
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": "", "ids": [], "chunks": 0})
            call["ids"].append(delta.id)
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
            call["chunks"] += bool(delta.function.arguments)
    for call in calls.values():  # the id and the name come once, with the call's first delta
        assert call["ids"][0] and not any(call["ids"][1:])
    reply = content or None, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], finish
    return reply, [calls[i]["chunks"] for i in sorted(calls)]


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
        stream, chunks = streamed(client, **asked)
        assert stream == (None, calls, "tool_calls")
        assert chunks[0] > 1  # the arguments arrive as they are generated, not whole at the end


@pytest.mark.slow
def test_a_call_cut_by_max_tokens_keeps_its_arguments_as_written(client: openai.OpenAI) -> None:
    """tool_choice required, greedy, cut by max_tokens inside the call's arguments: the call stays, its arguments the
    text as far as it was written, finish_reason `length`; streamed, the same."""
    asked = {
        "model": DEMO_NAME,
        "messages": [{"role": "user", "content": "What will the weather be in Oslo for the next three days?"}],
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**asked, max_tokens=100)  # also puts the prompt in the prefix cache
    [(name, arguments)] = calls_of(whole)
    assert whole.usage is not None and whole.choices[0].finish_reason == "tool_calls"
    cut = {**asked, "max_tokens": whole.usage.completion_tokens - 3}
    reply = client.chat.completions.create(**cut)
    [(cut_name, cut_arguments)] = calls_of(reply)
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content is None
    assert cut_name == name and arguments.startswith(cut_arguments) and 0 < len(cut_arguments) < len(arguments)
    assert streamed(client, **cut)[0] == (None, calls_of(reply), "length")


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
    stream, chunks = streamed(client, **asked)
    assert stream == (None, calls_of(reply), "tool_calls") and chunks[0] > 1
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
