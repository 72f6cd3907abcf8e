"""Client libraries, unmodified, against a real worker on the demo model: LangChain's ChatOpenAI with structured
output and with tools bound, invoked and streamed. Nothing but the worker may be reached: a client that needed the
network (tiktoken's encodings, tracing) would fail where the worker runs offline."""

import ipaddress
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
