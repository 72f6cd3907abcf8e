"""Tools, calls and tool results in a chat prompt: what the model's chat template renders itself, and what it does not.

A template's abilities are probed once by rendering (as llama.cpp's template capabilities are): whether it writes the
tools it is given, an assistant message's `tool_calls`, and a `tool` message. What it cannot write is rewritten into
messages it can, in the Hermes format (Qwen 2.5's words): the tools and how to call them at the end of the system
message, an assistant's calls as `<tool_call>` text, a tool's result as a user message in `<tool_response>` tags. So
a model whose template knows no tools (the demo's) still sees its tools and the calls made, and writes its calls in
the format chat/tools.py reads by default.
"""

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]

HERMES_TOOLS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

PROBE_TOOL = {"type": "function", "function": {"name": "rbee_probe_tool", "description": "", "parameters": {}}}
PROBE_CALL = {"id": "call_rbee_probe", "type": "function", "function": {"name": "rbee_probe_call", "arguments": {}}}


@dataclass(frozen=True)
class TemplateCaps:
    """What a chat template renders of its own: the tools given, assistant tool calls, tool results."""

    tools: bool
    tool_calls: bool
    tool_responses: bool


def probe_caps(render: Render) -> TemplateCaps:
    def shows(marker: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> bool:
        try:
            return marker in render(messages, tools)
        except Exception:  # any template error means the template cannot render this
            return False

    user = {"role": "user", "content": "hi"}
    calling = {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]}
    result = {"role": "tool", "content": "rbee_probe_result", "tool_call_id": PROBE_CALL["id"]}
    return TemplateCaps(
        tools=shows("rbee_probe_tool", [user], [PROBE_TOOL]),
        tool_calls=shows("rbee_probe_call", [user, calling]),
        tool_responses=shows("rbee_probe_result", [user, calling, result]),
    )


def hermes_call(call: dict[str, Any]) -> str:
    function = call["function"]
    return f"<tool_call>\n{json.dumps({'name': function['name'], 'arguments': function['arguments']})}\n</tool_call>"


def template_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, caps: TemplateCaps
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools to give the template: calls' JSON arguments as objects (templates write them with
    `tojson`), and in the Hermes format whatever the template does not render itself."""
    rewritten: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        if calls := message.get("tool_calls"):
            calls = [with_object_arguments(call) for call in calls]
            if caps.tool_calls:
                message["tool_calls"] = calls
            else:
                del message["tool_calls"]
                text = "\n".join(hermes_call(call) for call in calls)
                message["content"] = f"{message['content']}\n{text}" if message.get("content") else text
        if message["role"] == "tool" and not caps.tool_responses:
            message = {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
        if message.get("content") is None:
            message["content"] = ""
        rewritten.append(message)
    if not tools or caps.tools:
        return rewritten, tools or None
    listed = HERMES_TOOLS.format(tools="\n".join(json.dumps(tool) for tool in tools))
    if rewritten and rewritten[0]["role"] in ("system", "developer"):
        rewritten[0] = {**rewritten[0], "content": f"{rewritten[0]['content']}\n\n{listed}"}
    else:
        rewritten.insert(0, {"role": "system", "content": listed})
    return rewritten, None


def with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """A call whose `arguments` JSON text is parsed into the object it holds (text that is no JSON stays text)."""
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments)
    return {**call, "function": {**call["function"], "arguments": arguments}}
