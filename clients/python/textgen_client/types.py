"""Request and response models of the textgen HTTP API (TGI-compatible JSON shapes).

Requests are validated on the client before they are sent, with the same rules and messages as TGI's Python
client (which is slightly stricter than the server: e.g. `frequency_penalty` must be > 0). A refusal raises
`textgen_client.errors.ValidationError` itself (pydantic passes on any exception that is not a ValueError), as
TGI's validators do.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from textgen_client.errors import ValidationError


class _RequestModel(BaseModel):
    """A request body (or a piece of one): a misspelt or unknown key fails here instead of being dropped silently,
    which would send a different request from the one written."""

    model_config = ConfigDict(extra="forbid")


class GrammarType(str, Enum):
    # TGI's client names its members `Json` / `Regex`; textgen's lowercase names are aliases of the same
    # members, so code written for either works.
    Json = "json"
    Regex = "regex"
    json = "json"
    regex = "regex"
    # textgen's OpenAI-style types (TGI's server accepts them; its client has no member for them)
    json_object = "json_object"
    json_schema = "json_schema"


class Grammar(_RequestModel):
    type: GrammarType
    # A JSON schema (object or JSON string) for `json` / `json_object`, `{"name", "schema"}` for `json_schema`,
    # a pattern for `regex`.
    value: Any

    @model_validator(mode="after")
    def _non_empty(self) -> Grammar:
        if not self.value:
            raise ValidationError(f"`value` cannot be empty for `{self.type.value}` grammar")
        return self


def _strictly_positive(name: str, v: float | int | None) -> None:
    if v is not None and v <= 0:
        raise ValidationError(f"`{name}` must be strictly positive")


def _open_unit_interval(name: str, v: float | None) -> None:
    if v is not None and not 0 < v < 1:
        raise ValidationError(f"`{name}` must be > 0.0 and < 1.0")


class Parameters(_RequestModel):
    """The `parameters` object of a /generate request."""

    do_sample: bool = False
    max_new_tokens: int | None = 20
    best_of: int | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    return_full_text: bool = False
    seed: int | None = None
    stop: list[str] = []
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    truncate: int | None = None
    typical_p: float | None = None
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    top_n_tokens: int | None = None
    grammar: Grammar | None = None

    @model_validator(mode="after")
    def _check(self) -> Parameters:
        # In the order TGI's client checks its fields (so of two bad values the same one is reported);
        # `max_new_tokens` first, with the server's message, as the server would refuse it anyway.
        _strictly_positive("max_new_tokens", self.max_new_tokens)
        _strictly_positive("repetition_penalty", self.repetition_penalty)
        _strictly_positive("frequency_penalty", self.frequency_penalty)
        if self.seed is not None and self.seed < 0:
            raise ValidationError("`seed` must be positive")
        _strictly_positive("temperature", self.temperature)
        _strictly_positive("top_k", self.top_k)
        _open_unit_interval("top_p", self.top_p)
        _strictly_positive("truncate", self.truncate)
        _open_unit_interval("typical_p", self.typical_p)
        _strictly_positive("best_of", self.best_of)
        if self.best_of is not None and self.best_of > 1:
            if self.seed is not None:
                raise ValidationError("`seed` must not be set when `best_of` is > 1")
            sampling = (
                self.do_sample
                or self.temperature is not None
                or self.top_k is not None
                or self.top_p is not None
                or self.typical_p is not None
            )
            if not sampling:
                raise ValidationError("you must use sampling when `best_of` is > 1")
        _strictly_positive("top_n_tokens", self.top_n_tokens)
        return self


class Request(_RequestModel):
    """Body of POST / (the compat route the client uses for generate and generate_stream)."""

    inputs: str
    parameters: Parameters | None = None
    stream: bool = False

    @model_validator(mode="after")
    def _check(self) -> Request:
        if not self.inputs:
            raise ValidationError("`inputs` cannot be empty")
        p = self.parameters
        if self.stream and p is not None and p.best_of is not None and p.best_of > 1:
            raise ValidationError("`best_of` != 1 is not supported when `stream` == True")
        return self


class InputToken(BaseModel):
    id: int
    text: str
    # None for the first prompt token, which has no preceding context.
    logprob: float | None = None


class Token(BaseModel):
    id: int
    text: str
    logprob: float | None = None
    special: bool


class FinishReason(str, Enum):
    Length = "length"
    EndOfSequenceToken = "eos_token"
    StopSequence = "stop_sequence"


class BestOfSequence(BaseModel):
    generated_text: str
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None
    prefill: list[InputToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = None


class Details(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None
    prefill: list[InputToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = None
    best_of_sequences: list[BestOfSequence] | None = None


class Response(BaseModel):
    generated_text: str
    details: Details | None = None


class StreamDetails(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None
    input_length: int | None = None


class StreamResponse(BaseModel):
    """One SSE event of a generate stream; `generated_text`/`details` only on the last one."""

    index: int | None = None
    token: Token
    top_tokens: list[Token] | None = None
    generated_text: str | None = None
    details: StreamDetails | None = None


# ---- OpenAI-compatible routes ------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob]


class FunctionCall(BaseModel):
    # Streamed calls send the name in their first delta only, then pieces of `arguments` (a JSON object's text).
    name: str | None = None
    arguments: str = ""
    description: str | None = None


class ToolCall(BaseModel):
    index: int | None = None  # in stream deltas
    id: str | None = None
    type: str | None = None
    function: FunctionCall


# TGI's client names for the same shapes: a called function, and a tool call in a stream delta.
Function = FunctionCall
ChoiceDeltaToolCall = ToolCall


class Tool(_RequestModel):
    """A tool offered to the model (`chat(tools=...)`); `function` is `{"name", "description", "parameters"}`,
    `parameters` a JSON schema of its arguments."""

    type: Literal["function"] = "function"
    function: dict[str, Any]


class TextChunk(_RequestModel):
    type: Literal["text"] = "text"
    text: str


class ImageUrl(_RequestModel):
    url: str


class ImageChunk(_RequestModel):
    type: Literal["image_url"] = "image_url"
    image_url: ImageUrl


class MessageFunctionCall(_RequestModel):
    """The function an earlier assistant turn called; `arguments` its JSON object, as text or as an object."""

    # Read from the attributes of a reply's `FunctionCall` too (see `Message`).
    model_config = ConfigDict(from_attributes=True)

    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(_RequestModel):
    model_config = ConfigDict(from_attributes=True)

    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class Message(_RequestModel):
    """A chat turn: `content`, or (an assistant turn) `tool_calls`; a `tool` turn's result names its call in
    `tool_call_id`."""

    # A reply's `OutputMessage` is accepted as a turn by its attributes, so an assistant's answer, tool calls
    # included, can be sent back as it came (TGI's client uses one Message class for both).
    model_config = ConfigDict(from_attributes=True)

    role: str
    content: str | list[TextChunk | ImageChunk] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class OutputMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


ChatMessage = Message | OutputMessage | dict[str, Any]
"""What a chat call takes as a turn: a `Message`, its dict, or a reply's message sent back."""


class ChatCompletionComplete(BaseModel):
    index: int
    message: OutputMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class OpenAIEnvelope(BaseModel):
    """The fields every OpenAI-style response and stream chunk carries."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str


class ChatComplete(OpenAIEnvelope):
    """Response of POST /v1/chat/completions (stream=false)."""

    choices: list[ChatCompletionComplete]
    usage: Usage


class ChoiceDelta(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str | None = None  # absent from a tool call's later deltas
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class Choice(BaseModel):
    index: int
    delta: ChoiceDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(OpenAIEnvelope):
    """One SSE event of POST /v1/chat/completions (stream=true); `choices` is empty in the usage chunk."""

    choices: list[Choice]
    usage: Usage | None = None


class ChatRequest(_RequestModel):
    model: str = "tgi"
    messages: list[Message]
    frequency_penalty: float | None = None
    logit_bias: list[float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None
    presence_penalty: float | None = None
    stream: bool = False
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] | None = None
    stream_options: dict[str, bool] | None = None
    tools: list[Tool] | None = None
    # "auto" | "none" | "required" | a tool's name | {"type": "function", "function": {"name": ...}}
    tool_choice: str | dict[str, Any] | None = None
    tool_prompt: str | None = None
    # {"type": "json_object" | "json_schema" | "regex" | "text", ...} (TGI's `value` or OpenAI's `json_schema`)
    response_format: dict[str, Any] | None = None


class CompletionComplete(BaseModel):
    index: int
    text: str
    logprobs: Any | None = None
    # Non-stream responses map eos to "stop"; stream chunks carry "" until the last one per prompt.
    finish_reason: str | None = None


class Completion(OpenAIEnvelope):
    """Response of POST /v1/completions, and also each of its stream chunks (then `usage` may be absent)."""

    choices: list[CompletionComplete]
    usage: Usage | None = None


class CompletionRequest(_RequestModel):
    model: str = "tgi"
    prompt: str | list[str]
    frequency_penalty: float | None = None
    max_tokens: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] | None = None


class DeployedModel(BaseModel):
    """A model of the Hugging Face Inference API's list, kept for code written against TGI's client; textgen's
    own `/info` says which model it serves."""

    model_id: str
    sha: str
