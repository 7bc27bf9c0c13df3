"""Request bodies of the OpenAI-compatible routes (`/v1/chat/completions`, `/v1/completions`, `/chat_tokenize`).

Shapes follow TGI's `ChatRequest` / `CompletionRequest`: unknown fields are ignored, but fields TGI accepts
and textgen does not implement (logit_bias, n > 1, ...) are kept here so the handlers can reject them
with a 422 instead of ignoring them silently. Tools and `response_format` become a grammar (tool_grammar.py,
grammar.py).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from textgen_router.schemas import F32, GenerateParameters, GrammarParameters, check_regex_value
from textgen_router.types import InferError, ValidationError


class OpenAIError(InferError):
    """422 errors of /v1/completions whose message and error_type TGI sets directly (no prefix)."""

    status_code = 422

    def __init__(self, message: str, error_type: str) -> None:
        super().__init__(message)
        self.error_type = error_type


class TextChunk(BaseModel):
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    url: str


class ImageChunk(BaseModel):
    type: Literal["image_url"]
    image_url: ImageUrl


class FunctionDefinition(BaseModel):
    """A tool's function: its parameters are a JSON Schema of its arguments (TGI also reads `arguments`)."""

    name: str
    description: str | None = None
    parameters: Any = Field(default=None, validation_alias=AliasChoices("parameters", "arguments"))


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call that tool."""

    type: Literal["function"] = "function"
    function: FunctionName


class FunctionCall(BaseModel):
    """A call made in an earlier turn: `arguments` is its JSON object, as text (OpenAI) or as an object."""

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    name: str | None = None
    description: str | None = None
    json_schema: Any = Field(default=None, validation_alias="schema", serialization_alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """TGI's `{"type": "json" | "json_object" | "json_schema" | "regex", "value": ...}`, OpenAI's
    `{"type": "json_schema", "json_schema": {"name", "schema"}}`, `{"type": "json_object"}` (any JSON object)
    and `{"type": "text"}` (no constraint)."""

    type: Literal["json", "json_object", "json_schema", "regex", "text"]
    value: Any = None
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _regex_is_a_string(self) -> ResponseFormat:
        check_regex_value(self.type, self.value)
        return self

    def grammar(self) -> GrammarParameters | None:
        if self.type == "text":
            return None
        if self.type == "json_schema" and self.value is None and self.json_schema is not None:
            return GrammarParameters(type="json_schema", value={"name": self.json_schema.name,
                                                                "schema": self.json_schema.json_schema})  # fmt: skip
        if self.type == "json_object" and self.value is None:
            # OpenAI's JSON mode: any object (an empty `properties` keeps TGI's rule that one be present, and
            # opening it keeps grammar.close_objects from allowing only `{}`).
            return GrammarParameters(
                type="json", value={"type": "object", "properties": {}, "additionalProperties": True}
            )
        return GrammarParameters(type=self.type, value=self.value)


class Message(BaseModel):
    """Any role goes to the chat template, as in TGI (a plain string there; SDKs now send `developer`)."""

    role: str
    content: str | list[TextChunk | ImageChunk] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_or_tool_calls(self) -> Message:
        # TGI's message body is an untagged enum of {content} and {tool_calls}: with neither, serde matches no
        # variant and the body is a 422 deserialization error, where an empty prompt turn would be generated.
        if self.content is None and self.tool_calls is None:
            raise PydanticCustomError("untagged_enum", "data did not match any variant of untagged enum MessageBody")
        return self

    def has_image(self) -> bool:
        return isinstance(self.content, list) and any(isinstance(chunk, ImageChunk) for chunk in self.content)

    def text(self) -> str:
        """The content as one string: chunks joined, an image as the Markdown `![](url)` (TGI's flattening,
        which a vision-language model's validation turns back into an image; `ChatRequest.check_supported`
        refuses images for any other model)."""
        content = self.content
        if not isinstance(content, list):
            return content or ""
        return "".join(
            chunk.text if isinstance(chunk, TextChunk) else f"![]({chunk.image_url.url})" for chunk in content
        )


class StreamOptions(BaseModel):
    # Required, as in TGI: `stream_options: {}` is a 422 (missing field), not a silent false.
    include_usage: bool


class ChatRequest(BaseModel):
    model: str | None = None
    messages: list[Message]
    frequency_penalty: F32 | None = None
    logit_bias: Any = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    # TGI reads OpenAI's newer name as a serde alias of the same field (both given: see `_one_max_tokens`).
    max_tokens: int | None = Field(
        default=None, ge=0, validation_alias=AliasChoices("max_tokens", "max_completion_tokens")
    )
    n: int | None = None
    presence_penalty: F32 | None = None
    # TGI accepts an array only; a bare string is a deserialization error there too.
    stop: list[str] | None = None
    stream: bool = False
    seed: int | None = Field(default=None, ge=0)
    temperature: F32 | None = None
    top_p: F32 | None = None
    stream_options: StreamOptions | None = None
    tools: list[Tool] | None = None
    tool_prompt: str | None = None
    # "auto" (the default with tools), "none", "required", a tool's name, or {"type": "function", ...}.
    tool_choice: str | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_max_tokens(cls, data: Any) -> Any:
        """Both names of the alias given: serde refuses the field set twice (a 422 deserialization error)."""
        if isinstance(data, dict) and "max_tokens" in data and "max_completion_tokens" in data:
            raise PydanticCustomError("duplicate_field", "duplicate field `max_tokens`")
        return data

    def check_supported(self, multimodal: bool = False) -> None:
        """Reject what textgen does not implement rather than ignore it (422 `validation`); `multimodal`: the
        model reads images."""
        if self.n is not None and self.n != 1:
            raise ValidationError("`n` must be 1: one choice per request is supported")
        if self.logit_bias:
            raise ValidationError("`logit_bias` is not supported")
        if not self.messages:
            raise ValidationError("`messages` cannot be empty")
        if not multimodal and any(message.has_image() for message in self.messages):
            # TGI flattens the part into the text as `![](url)`, which a text model reads as the URL's characters:
            # the image would be silently ignored.
            raise ValidationError(
                "image modality is not supported: this model reads text only, and an `image_url` content part "
                "would reach it as the text of its URL"
            )

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template sees them: content as one string (`Message.text`); tool calls in
        transformers' shape (`arguments` as an object) and a tool result's `tool_call_id`."""
        out: list[dict[str, Any]] = []
        for message in self.messages:
            rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
            if message.tool_calls:
                rendered["tool_calls"] = [_template_call(call) for call in message.tool_calls]
            if message.tool_call_id is not None:
                rendered["tool_call_id"] = message.tool_call_id
            out.append(rendered)
        return out

    def without_tools(self) -> ChatRequest:
        """The same request answered without tools (what `no_tool` falls back to)."""
        return self.model_copy(update={"tools": None, "tool_choice": None, "tool_prompt": None})

    def parameters(self, grammar: GrammarParameters | None = None) -> GenerateParameters:
        """TGI's mapping of a chat request onto generate parameters."""
        do_sample, temperature = _sampling(self.temperature)
        return GenerateParameters(
            temperature=temperature,
            # OpenAI's presence penalty has no direct equivalent: TGI shifts it into a repetition penalty.
            repetition_penalty=None if self.presence_penalty is None else self.presence_penalty + 2.0,
            frequency_penalty=self.frequency_penalty,
            top_p=self.top_p,
            do_sample=do_sample,
            max_new_tokens=self.max_tokens,
            stop=self.stop or [],
            details=True,
            seed=self.seed,
            top_n_tokens=self.top_logprobs,
            grammar=grammar,
        )


def _template_call(call: ToolCall) -> dict[str, Any]:
    arguments: Any = call.function.arguments
    if isinstance(arguments, str):
        # Templates index and `tojson` the arguments: an object, as transformers documents tool calls.
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ValidationError(f"tool call arguments are not JSON: {arguments!r}") from None
    out: dict[str, Any] = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
    if call.id is not None:
        out["id"] = call.id
    return out


def _sampling(temperature: float | None) -> tuple[bool, float | None]:
    """OpenAI semantics: temperature 0 means greedy; anything else (even unset) samples."""
    if temperature == 0.0:
        return False, None
    return True, temperature


class CompletionRequest(BaseModel):
    model: str | None = None
    prompt: str | list[str]
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: F32 | None = None
    top_p: F32 | None = None
    stream: bool = False
    seed: int | None = Field(default=None, ge=0)
    suffix: Any = None
    repetition_penalty: F32 | None = None
    frequency_penalty: F32 | None = None
    stop: list[str] | None = None
    # OpenAI fields TGI does not implement: rejected when set to anything but their no-op value.
    n: int | None = None
    best_of: int | None = None
    echo: bool | None = None
    logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: F32 | None = None

    def check_supported(self, max_client_batch_size: int) -> None:
        if self.suffix is not None:
            raise OpenAIError(
                "Suffix is not supported and can be achieved by preprocessing the prompt.", "suffix not supported"
            )
        if isinstance(self.prompt, list) and len(self.prompt) > max_client_batch_size:
            raise OpenAIError(
                f"Number of prompts exceeds the maximum allowed batch size of {max_client_batch_size}",
                "batch size exceeded",
            )
        if self.n is not None and self.n != 1:
            raise ValidationError("`n` must be 1: one choice per prompt is supported")
        if self.best_of is not None and self.best_of != 1:
            raise ValidationError("`best_of` is not supported on /v1/completions")
        if self.echo:
            raise ValidationError("`echo` is not supported")
        if self.logprobs is not None:
            raise ValidationError("`logprobs` is not supported on /v1/completions")
        if self.logit_bias:
            raise ValidationError("`logit_bias` is not supported")
        if self.presence_penalty is not None:
            raise ValidationError("`presence_penalty` is not supported on /v1/completions")

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def parameters(self) -> GenerateParameters:
        do_sample, temperature = _sampling(self.temperature)
        return GenerateParameters(
            temperature=temperature,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            top_p=self.top_p,
            do_sample=do_sample,
            max_new_tokens=self.max_tokens,
            stop=self.stop or [],
            details=True,
            seed=self.seed,
        )

    @field_validator("prompt")
    @classmethod
    def _non_empty_array(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and not v:
            raise ValueError("Empty array detected. Do not use an empty array for the prompt.")
        return v
