"""Chat template discovery and rendering, with transformers' own renderer (what `apply_chat_template` runs).

Where the template comes from follows TGI: `chat_template.json` > the `--tokenizer-config-path` file or the
model's tokenizer config (`tokenizer_config.json`, or `chat_template.jinja` beside it) > `processor_config.json`;
when a config holds a list of named templates, the one named `default` is used.

Tools (TGI's `chat_template.rs`): the template gets them as its `tools` variable, and the tool prompt is appended
to the last message after `\n---\n`; a template that never reads `tools` gets the tools' JSON there too. A
template that never reads `tool_calls` sees an earlier turn's tool calls as that message's content (their JSON).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.meta

from textgen_router.model_files import model_file
from textgen_router.types import InferError

if TYPE_CHECKING:
    from textgen_router.tokenizer import Tokenizer


class TemplateError(InferError):
    status_code = 422
    error_type = "template_error"

    def __init__(self, message: str) -> None:
        super().__init__(f"Template error: {message}")


_GENERATION_TAG = re.compile(r"\{%-?\s*(?:end)?generation\s*-?%\}")


def _variables(template: str) -> set[str]:
    """The variables `template` reads without setting them, as TGI asks minijinja (`undeclared_variables`): a
    name that only appears in the template's text (`Use tools wisely.`) is not one. The `generation` tags
    (transformers' extension) are dropped before parsing, as TGI drops them; a template Jinja cannot parse reads
    nothing (rendering it reports the error)."""
    source = _GENERATION_TAG.sub("", template)
    environment = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return jinja2.meta.find_undeclared_variables(environment.parse(source))
    except jinja2.TemplateSyntaxError:
        return set()


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _pick(template: Any) -> str | None:
    """A config's `chat_template`: a string, or a list of {name, template} where `default` wins."""
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        for entry in template:
            if isinstance(entry, dict) and entry.get("name") == "default":
                return entry.get("template")
    return None


def find_chat_template(
    model_id: str, tokenizer_config_path: str | None = None, revision: str | None = None
) -> str | None:
    """The chat template to use for `model_id`, or None when it has none."""
    chat_json = model_file(model_id, "chat_template.json", revision)
    if chat_json is not None:
        template = _pick((_read_json(chat_json) or {}).get("chat_template"))
        if template:
            return template
    if tokenizer_config_path:
        config_path: Path | None = Path(tokenizer_config_path)
    else:
        config_path = model_file(model_id, "tokenizer_config.json", revision)
    template = _pick((_read_json(config_path) or {}).get("chat_template")) if config_path else None
    if template:
        return template
    # transformers >= 4.43 saves the template as its own file next to the tokenizer config.
    jinja_file = model_file(model_id, "chat_template.jinja", revision)
    if jinja_file is not None:
        return jinja_file.read_text()
    processor = model_file(model_id, "processor_config.json", revision)
    return _pick((_read_json(processor) or {}).get("chat_template")) if processor else None


class ChatTemplate:
    """Renders OpenAI-style messages to the prompt text the model was trained on."""

    def __init__(self, special_tokens: dict[str, str], template: str | None) -> None:
        # transformers' renderer, without the rest of transformers (and torch): imported here, in the start-up
        # thread that loads the template, rather than by the first chat request (1.5 s of CPU on these machines).
        from transformers.utils.chat_template_utils import render_jinja_template

        self._render = render_jinja_template
        self.special_tokens = special_tokens  # bos_token, eos_token, ... as apply_chat_template passes them
        self.template = template
        self._reads_tools = template is not None and "tools" in _variables(template)
        # An attribute of a message (`message.tool_calls`), which no variable list shows: the text is searched.
        self._reads_tool_calls = template is not None and "tool_calls" in template

    @classmethod
    def load(
        cls,
        tokenizer: Tokenizer,
        model_id: str,
        tokenizer_config_path: str | None = None,
        revision: str | None = None,
    ) -> ChatTemplate:
        """The template of `model_id` (see the module docstring), given the tokenizer's special tokens."""
        return cls(tokenizer.special_tokens, find_chat_template(model_id, tokenizer_config_path, revision))

    def apply(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tools_json: str = "",
        tool_prompt: str = "",
    ) -> str:
        """Prompt text for `messages` ({role, content} with flat string content, optional `tool_calls`).

        `tools` (OpenAI's shape) go to the template; with them, `tool_prompt` (and `tools_json`, TGI's text of
        the tools, for a template that does not read `tools`) is appended to the last message. A trailing
        assistant message is continued rather than closed (TGI's continue-final-message). Raises `TemplateError`
        when there is no template or rendering fails (e.g. `raise_exception`).
        """
        if self.template is None:
            raise TemplateError("template not found")
        messages = [self._readable(m) for m in messages]
        if tools is not None and messages:
            note = f"\n---\n{tool_prompt}" if self._reads_tools else f"\n---\n{tools_json}\n{tool_prompt}"
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + note}
        template_tools: list[dict[Any, Any] | Callable[..., Any]] | None = None if tools is None else list(tools)
        variables: dict[str, Any] = dict(self.special_tokens)  # the template's bos_token, eos_token, ...
        try:
            # It returns (one text per conversation, generation indices), whatever its annotation says.
            rendered: Any = self._render(
                [messages],
                tools=template_tools,
                chat_template=self.template,
                add_generation_prompt=True,
                **variables,
            )
        except (jinja2.TemplateError, ValueError) as err:
            raise TemplateError(str(err)) from err
        text: str = rendered[0][0]
        if messages and messages[-1]["role"] == "assistant":
            # TGI's continue-final-message: the render is cut right after the last occurrence of the final
            # message's text, trailing whitespace dropped; kept whole when the template changed that text.
            final = messages[-1]["content"]
            index = text.rfind(final)
            if index >= 0:
                text = text[: index + len(final)].rstrip()
        return text

    def _readable(self, message: dict[str, Any]) -> dict[str, Any]:
        if "tool_calls" not in message or self._reads_tool_calls:
            return message
        calls = json.dumps(message["tool_calls"], ensure_ascii=False)
        return {**{k: v for k, v in message.items() if k != "tool_calls"}, "content": message["content"] + calls}
