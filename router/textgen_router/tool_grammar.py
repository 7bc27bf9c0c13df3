"""Tool calling as TGI does it: the tools become one JSON grammar, the output one function call.

The model is made to write `{"function": {"_name": <tool name>, <its arguments>...}}`, held to that shape by a
JSON Schema (`tool_schema`) the shards enforce: each tool is an object whose `_name` is the tool's name as a
constant, followed by the tool's own parameters. `tool_choice` picks the tools (`select_tools`): one by name, all
of them (`required`), all of them plus `no_tool` (`auto`, the default when tools are given), or none (`none`).
Under `auto` the model may choose `no_tool`: the route then generates again without tools and answers with that
text as content (TGI 3.x).

`parse_call` reads a finished output; `CallStream` turns a streamed output into OpenAI's tool-call deltas (the
name once known, then the arguments' JSON text piece by piece).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from textgen_router.grammar import close_objects
from textgen_router.openai_schemas import FunctionDefinition, NamedToolChoice, Tool
from textgen_router.types import InferError

NO_TOOL = "no_tool"
NO_TOOL_DESCRIPTION = "Open ended response with no specific tool selected"

DEFAULT_TOOL_PROMPT = (
    "\nGiven the functions available, please respond with a JSON for a function call with its proper arguments "
    "that best answers the given prompt. Respond in the format {name: function name, parameters: dictionary of "
    "argument name and its value}.Do not use variables.\n"
)


class ToolError(InferError):
    status_code = 422
    error_type = "tool_error"

    def __init__(self, message: str) -> None:
        super().__init__(f"Tool error: {message}")


def select_tools(tools: list[Tool] | None, choice: str | NamedToolChoice | None) -> list[Tool]:
    """The tools the grammar offers; empty when the request is answered without tools."""
    if not tools or choice == "none":
        return []
    if choice is None or choice == "auto":
        no_tool = FunctionDefinition(name=NO_TOOL, description=NO_TOOL_DESCRIPTION, parameters={"type": "object"})
        return [*tools, Tool(type="function", function=no_tool)]
    if choice == "required":
        return list(tools)
    name = choice.function.name if isinstance(choice, NamedToolChoice) else choice
    for tool in tools:
        if tool.function.name == name:
            return [tool]
    raise ToolError(f"Tool with name {name} not found")


def tool_schema(tools: list[Tool]) -> dict[str, Any]:
    """The JSON Schema of one call to one of `tools` (see the module docstring)."""
    functions: dict[str, Any] = {}
    for tool in tools:
        function = tool.function
        parameters = function.parameters if isinstance(function.parameters, dict) else {}
        own_properties = parameters.get("properties")
        own_required = parameters.get("required")
        functions[function.name] = {
            "type": "object",
            "description": function.description or "",
            # `_name` first: it is written first, so a stream knows the tool before the arguments.
            "properties": {
                "_name": {"type": "string", "const": function.name},
                **(own_properties if isinstance(own_properties, dict) else {}),
            },
            "required": ["_name", *(own_required if isinstance(own_required, list) else [])],
            # Closed unless the tool opens it: a small model's output then stays within the declared arguments.
            "additionalProperties": parameters.get("additionalProperties") in (True, "true"),
        }
    refs = [{"$ref": "#/$functions/" + _pointer_token(tool.function.name)} for tool in tools]
    # Closed as every JSON grammar is (the arguments' own nested objects too): the schema returned is the one
    # the shards enforce.
    return close_objects(
        {"$functions": functions, "properties": {"function": {"anyOf": refs}}, "required": ["function"]}
    )


def _pointer_token(name: str) -> str:
    """`name` as one JSON Pointer reference token (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")


def tools_prompt(tools: list[Tool]) -> str:
    """The tools as TGI writes them into a prompt whose template has no `tools` variable."""
    return json.dumps([_tool_json(tool) for tool in tools], ensure_ascii=False, separators=(",", ":"))


def _tool_json(tool: Tool) -> dict[str, Any]:
    function = tool.function
    # TGI serializes a function's parameters under `arguments`, as a JSON string.
    arguments = json.dumps(function.parameters, ensure_ascii=False, separators=(",", ":"))
    return {"type": tool.type, "function": {"description": function.description, "name": function.name,
                                            "arguments": arguments}}  # fmt: skip


@dataclass
class Call:
    """One function call read from the output; `arguments` is its JSON object as text."""

    name: str
    arguments: str


def parse_call(text: str) -> Call | None:
    """The call a finished output makes, or None when the model chose `no_tool`."""
    try:
        call = json.loads(text)
        function = call["function"]
        name = function.pop("_name")
        if not isinstance(name, str):
            raise TypeError("`_name` is not a string")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ToolError(f"Failed to parse generated text: {err} {text!r}") from None
    if name == NO_TOOL:
        return None
    return Call(name, json.dumps(function, ensure_ascii=False, separators=(",", ":")))


def stream_call_id(history_ids: list[str]) -> str:
    """A streamed call's id: the integer after those of the conversation's earlier calls ("0" for the first),
    or a UUID when those are not integers (TGI's rule)."""
    if not history_ids:
        return "0"
    try:
        return str(max(int(i) for i in history_ids) + 1)
    except ValueError:
        return str(uuid.uuid4())


# The output's start up to the end of the tool's name: properties come in the schema's order, `_name` first.
_NAME = re.compile(r'\s*\{\s*"function"\s*:\s*\{\s*"_name"\s*:\s*("(?:[^"\\]|\\.)*")')
_CLOSERS = " \t\r\n}"


class CallStream:
    """A streamed tool-call output -> the name once known, then the pieces of the arguments' JSON text.

    The arguments are the call's object without `_name`: `{` + what follows the name, less the closing brace
    of the outer object. Trailing braces and blanks are held back until more text shows they are not the
    outer object's end; `finish` releases the rest. Everything sent is a prefix of the final arguments.
    """

    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None
        self._args_start = 0
        self._sent = ""

    def push(self, piece: str) -> str | None:
        """Add one token's text; the new piece of arguments (None while the name is not known yet)."""
        self.text += piece
        if self.name is None:
            match = _NAME.match(self.text)
            if match is None:
                return None
            self.name = json.loads(match.group(1))
            self._args_start = match.end()
        return self._advance(self._body().rstrip(_CLOSERS))

    def finish(self) -> str:
        """The last piece of the arguments once the output is complete."""
        body = self._body().rstrip()
        return self._advance(body[:-1] if body.endswith("}") else body)

    def _body(self) -> str:
        rest = self.text[self._args_start :].lstrip()
        return rest[1:].lstrip() if rest.startswith(",") else rest

    def _advance(self, body: str) -> str:
        arguments = "{" + body
        piece = arguments[len(self._sent) :]
        self._sent = arguments
        return piece
