"""A chat request made ready to generate: its prompt (chat template, tools) and its generate parameters (grammar).

TGI's `prepare_chat_input`: with tools, the tool grammar (tool_grammar.py) constrains the output and the tools
go into the template; without, the request's `response_format` is the grammar. Shared by /v1/chat/completions
(both modes) and /chat_tokenize.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from textgen_router import tool_grammar
from textgen_router.chat_template import ChatTemplate
from textgen_router.openai_schemas import ChatRequest
from textgen_router.schemas import GenerateParameters, GrammarParameters


@dataclass
class ChatInput:
    """A chat request made ready to generate (TGI's `prepare_chat_input`). With tools (its output is then a tool
    call), `without_tools()` makes the input to generate instead when the model chose `no_tool`."""

    prompt: str
    parameters: GenerateParameters
    without_tools: Callable[[], ChatInput] | None = None


def chat_input(body: ChatRequest, template: ChatTemplate, adapter_id: str | None = None) -> ChatInput:
    """The prompt and parameters of `body`: with tools, the tool grammar and the tools in the template; else
    its `response_format` as the grammar; `adapter_id` the LoRA adapter it runs with (None: the base model).
    Raises ToolError, TemplateError or ValidationError (all 422)."""
    if body.response_format is not None and body.tools is not None:
        raise tool_grammar.ToolError("Grammar and tools are mutually exclusive")
    tools = tool_grammar.select_tools(body.tools, body.tool_choice)
    messages = body.template_messages()
    if not tools:
        grammar = body.response_format.grammar() if body.response_format is not None else None
        return ChatInput(template.apply(messages), _with_adapter(body.parameters(grammar), adapter_id))
    prompt = template.apply(
        messages,
        [tool.model_dump() for tool in tools],
        tools_json=tool_grammar.tools_prompt(tools),
        tool_prompt=body.tool_prompt or tool_grammar.DEFAULT_TOOL_PROMPT,
    )
    grammar = GrammarParameters(type="json", value=tool_grammar.tool_schema(tools))
    parameters = _with_adapter(body.parameters(grammar), adapter_id)
    return ChatInput(prompt, parameters, lambda: chat_input(body.without_tools(), template, adapter_id))


def _with_adapter(parameters: GenerateParameters, adapter_id: str | None) -> GenerateParameters:
    parameters.adapter_id = adapter_id
    return parameters
