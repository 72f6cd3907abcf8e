"""Client libraries, unmodified, against a real worker on the demo model: LangChain's ChatOpenAI with structured
output and with tools bound, invoked and streamed. Nothing but the worker may be reached: a client that needed the
network (tiktoken's encodings, tracing) would fail where the worker runs offline."""

import ipaddress
import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import SHARED_TOKEN, SharedWorkers
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from serving import DEMO_NAME, Worker
from test_structured_output import BEE_ASK, BEE_MAX_TOKENS, HOT, Bee


@pytest.fixture(scope="module")
def worker(shared_workers: SharedWorkers) -> Worker:
    """The session's shared torch worker (default flags, SHARED_TOKEN): torch's runtime only, since the grammar is the
    same on both runtimes (test_structured_output.py runs the openai client on each); what is tested here is the
    client's side."""
    return shared_workers.get("torch")


def is_loopback(host: Any) -> bool:
    if host in ("localhost", None):
        return True
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:  # a host name other than localhost
        return False


@pytest.fixture
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Refuse every name lookup and connection beyond this machine, and record them: a client that swallows the
    error in a background thread (LangSmith's tracing does) still fails the test. A developer's own tracing
    settings are dropped for the test, which is about what the client needs."""
    for name in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "LANGCHAIN_TRACING"):
        monkeypatch.delenv(name, raising=False)
    reached: list[Any] = []
    getaddrinfo, connect = socket.getaddrinfo, socket.socket.connect

    def guarded_getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_loopback(host.decode() if isinstance(host, bytes) else host):
            reached.append(host)
            raise OSError(f"the test refuses looking up {host!r}")
        return getaddrinfo(host, *args, **kwargs)

    def guarded_connect(sock: socket.socket, address: Any) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not is_loopback(address[0]):
            reached.append(address)
            raise OSError(f"the test refuses connecting to {address!r}")
        connect(sock, address)

    monkeypatch.setattr(socket, "getaddrinfo", guarded_getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    yield reached
    assert not reached, f"the client reached beyond the worker: {reached}"


def chat_model(worker: Worker, max_tokens: int) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=f"{worker.url}/v1",
        api_key=SHARED_TOKEN,
        model=DEMO_NAME,
        temperature=HOT,
        seed=5,
        max_tokens=max_tokens,
        max_retries=0,
        timeout=120,
    )


class GetWeather(BaseModel):
    """The weather forecast for a city."""

    city: str = Field(pattern=r"^[A-Z][a-z]{2,11}$")
    days: int = Field(ge=1, le=7)


class AddNumbers(BaseModel):
    """Add two integers."""

    a: int
    b: int


@pytest.mark.slow
def test_langchain_bound_tools_give_validated_tool_calls(worker: Worker, loopback_only: list[Any]) -> None:
    """bind_tools with a named tool_choice and with "any" (OpenAI's required): each reply is an AIMessage whose
    tool_calls LangChain has parsed, arguments that validate against the tool's model."""
    ask = "What is the weather in Oslo for the next two days?"
    for choice, expected in (("GetWeather", {"GetWeather"}), ("any", {"GetWeather", "AddNumbers"})):
        model = chat_model(worker, 100).bind_tools([GetWeather, AddNumbers], tool_choice=choice)
        reply = model.invoke(ask)
        assert isinstance(reply, AIMessage) and len(reply.tool_calls) >= 1, reply
        for call in reply.tool_calls:
            assert call["name"] in expected and call["id"], call
            {"GetWeather": GetWeather, "AddNumbers": AddNumbers}[call["name"]].model_validate(call["args"])


@pytest.mark.slow
def test_langchain_streams_tool_calls_as_they_are_generated(worker: Worker, loopback_only: list[Any]) -> None:
    """bind_tools with "any", streamed: LangChain's tool-call chunks carry the arguments in several pieces, and the
    chunks added up give the call that the same request gives unstreamed (the prompt cached by the first)."""
    model = chat_model(worker, 100).bind_tools([GetWeather, AddNumbers], tool_choice="any")
    ask = "Add 2 and 3."
    reply = model.invoke(ask)
    chunks = list(model.stream(ask))
    assert all(isinstance(chunk, AIMessageChunk) for chunk in chunks)
    pieces = [piece for chunk in chunks for piece in chunk.tool_call_chunks if piece["args"]]
    assert len(pieces) > 1, chunks
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == [(c["name"], c["args"]) for c in reply.tool_calls]
    assert whole.tool_calls and whole.tool_calls[0]["id"], whole
    for call in whole.tool_calls:
        {"GetWeather": GetWeather, "AddNumbers": AddNumbers}[call["name"]].model_validate(call["args"])


@pytest.mark.slow
def test_langchain_structured_output_is_a_validated_model(worker: Worker, loopback_only: list[Any]) -> None:
    bee = chat_model(worker, BEE_MAX_TOKENS).with_structured_output(Bee, method="json_schema").invoke(BEE_ASK)
    assert isinstance(bee, Bee)  # LangChain parses the reply into the model: pydantic has validated every field


WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
WEATHER = "The weather in Paris is sunny and 21 degrees."
# What makes the demo model answer from a tool's result instead of calling the tool again.
AFTER_TOOLS = "When a tool result is given, answer the user in one sentence and do not call tools again."


@pytest.mark.slow
def test_openai_responses_streamed_and_not_with_tools_and_json(worker: Worker, loopback_only: list[Any]) -> None:
    """The openai client's Responses API: a text answer (streamed: the events in order, the same text and usage), a
    required function call then its output sent back as a function_call_output item and a text answer, a JSON schema
    parsed into a model, and previous_response_id refused (nothing is stored)."""
    import openai

    client = openai.OpenAI(base_url=f"{worker.url}/v1", api_key=SHARED_TOKEN, max_retries=0, timeout=120)
    ask = {"model": DEMO_NAME, "input": "Name three colors.", "max_output_tokens": 24, "temperature": 0}
    whole = client.responses.create(**ask)
    assert whole.status in ("completed", "incomplete") and whole.output_text and whole.store is False
    with client.responses.stream(**ask) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]  # fmt: skip
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens

    ask = {"model": DEMO_NAME, "tools": [WEATHER_TOOL], "temperature": 0, "max_output_tokens": 60}
    called = client.responses.create(**ask, input="What is the weather in Paris?", tool_choice="required")
    call = called.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments)["city"]
    answer = client.responses.create(**ask, instructions=AFTER_TOOLS, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": WEATHER},
    ])  # fmt: skip
    assert answer.output[-1].type == "message" and "sunny" in answer.output_text

    parsed = client.responses.parse(model=DEMO_NAME, input=BEE_ASK, text_format=Bee, temperature=HOT,
                                    max_output_tokens=BEE_MAX_TOKENS, extra_body={"seed": 5})  # fmt: skip
    assert isinstance(parsed.output_parsed, Bee)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=DEMO_NAME, input="hi", previous_response_id=whole.id)
    assert refused.value.body["param"] == "previous_response_id"


@pytest.mark.slow
def test_openai_agents_sdk_runs_a_tool_agent_on_the_responses_api(worker: Worker, loopback_only: list[Any]) -> None:
    """The openai-agents SDK with its default model class (OpenAIResponsesModel) and tracing off: an agent whose first
    turn must call its function tool runs it, sends its output back and gives a final answer from it; streamed too."""
    import asyncio

    import openai
    from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return WEATHER

    agent = Agent(name="weather", instructions=AFTER_TOOLS, tools=[get_weather], model=DEMO_NAME,
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60))  # fmt: skip
    ask = "What is the weather in Paris?"

    async def run() -> tuple[Any, Any, list[str]]:
        # The client of this event loop (an AsyncOpenAI keeps its connections to the loop that opened them).
        set_default_openai_client(openai.AsyncOpenAI(base_url=f"{worker.url}/v1", api_key=SHARED_TOKEN, max_retries=0))
        result = await Runner.run(agent, ask, max_turns=4)
        streamed = Runner.run_streamed(agent, ask, max_turns=4)
        deltas = [
            event.data.delta
            async for event in streamed.stream_events()
            if event.type == "raw_response_event" and event.data.type == "response.output_text.delta"
        ]
        return result, streamed, deltas

    result, streamed, deltas = asyncio.run(run())
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    assert "sunny" in result.final_output
    assert [item.type for item in streamed.new_items] == kinds and calls == ["Paris", "Paris"]
    assert streamed.final_output == result.final_output == "".join(deltas)


@pytest.mark.slow
def test_langchain_on_the_responses_api_invokes_and_streams(worker: Worker, loopback_only: list[Any]) -> None:
    """ChatOpenAI(use_responses_api=True): invoked, a text reply; streamed, the same text in several chunks; with a
    bound tool and tool_choice "any", a parsed tool call."""
    model = ChatOpenAI(base_url=f"{worker.url}/v1", api_key=SHARED_TOKEN, model=DEMO_NAME, temperature=0,
                       max_tokens=24, max_retries=0, timeout=120, use_responses_api=True)  # fmt: skip
    reply = model.invoke("Name three colors.")
    assert isinstance(reply, AIMessage) and reply.text
    chunks = list(model.stream("Name three colors."))
    assert len(chunks) > 2 and "".join(chunk.text for chunk in chunks) == reply.text
    tooled = model.model_copy(update={"max_tokens": 100}).bind_tools([GetWeather], tool_choice="any")
    called = tooled.invoke("What is the weather in Oslo for two days?")
    assert called.tool_calls and called.tool_calls[0]["name"] == "GetWeather"
