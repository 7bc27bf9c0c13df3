"""HTTP request and response bodies of TGI's native routes (/generate, /generate_stream, /, /tokenize, /info).

Request models are strict, like TGI's serde structs: `"max_new_tokens": "5"` or `1.5` is a type error (422),
unknown fields are ignored, numbers must fit TGI's unsigned types, and float parameters are read as TGI's f32
(`F32`), the precision the shards compute with. Response models document the OpenAPI
spec only; response bodies are written as ordered dicts by `responses.py` in TGI's field order.
"""

from __future__ import annotations

import math
import struct
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AllowInfNan, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

U32 = 2**32 - 1
U64 = 2**64 - 1

_F32 = struct.Struct("<f")


def to_f32(value: float) -> float:
    """`value` rounded to the nearest float32, as serde reads a JSON number into TGI's f32 fields.

    Validating the rounded value is validating what the shards will compute with: 1e-300 is 0.0 there (so
    "`temperature` must be strictly positive") and 0.99999999 is 1.0. A value beyond float32's range is
    refused rather than sent on as infinity, which no sampling parameter survives in a shard.
    """
    try:
        rounded: float = _F32.unpack(_F32.pack(value))[0]
    except OverflowError:  # struct refuses what rounds to infinity
        rounded = math.inf
    if not math.isfinite(rounded):
        raise PydanticCustomError("f32_range", "number out of range for a 32-bit float")
    return rounded


F32 = Annotated[float, AllowInfNan(False), AfterValidator(to_f32)]
"""A finite JSON number read as a float32 (NaN, infinities and numbers past float32's range are 422s)."""


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class GrammarParameters(_Strict):
    """A constraint every generated token keeps to (checked by grammar.py, enforced by the shards).

    `json` (alias `json_object`): `value` is a JSON Schema, as an object or a string holding one; `json_schema`:
    `value` is `{"name": ..., "schema": <JSON Schema>}`; `regex`: `value` is a pattern the whole output matches.
    """

    type: Literal["json", "json_object", "regex", "json_schema"]
    value: Any = Field(description="the JSON Schema, `{name, schema}` or the regex, by `type`")

    @model_validator(mode="after")
    def _regex_is_a_string(self) -> GrammarParameters:
        check_regex_value(self.type, self.value)
        return self


def check_regex_value(type_: str, value: Any) -> None:
    """A `regex` grammar's value is a string: TGI's `Regex(String)` fails to deserialize anything else, a 422
    deserialization error (a JSON grammar's value is any JSON value there, checked by grammar.py)."""
    if type_ == "regex" and not isinstance(value, str):
        raise PydanticCustomError(
            "invalid_type", "invalid type: {kind}, expected a string", {"kind": serde_kind(value)}
        )


def serde_kind(value: Any) -> str:
    """How serde_json names a JSON value that is not a string in `invalid type: ...` (scalars with their value)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    return "sequence" if isinstance(value, list) else "map"


class GenerateParameters(_Strict):
    """Generation parameters; each missing field takes its own default (do_sample: false)."""

    adapter_id: str | None = None
    best_of: int | None = Field(default=None, ge=0, le=U64)
    temperature: F32 | None = None
    repetition_penalty: F32 | None = None
    frequency_penalty: F32 | None = None
    top_k: int | None = Field(default=None, ge=-(2**31), le=2**31 - 1)
    top_p: F32 | None = None
    typical_p: F32 | None = None
    do_sample: bool = False
    max_new_tokens: int | None = Field(default=None, ge=0, le=U32)
    return_full_text: bool | None = None
    stop: list[str] = Field(default_factory=list)
    truncate: int | None = Field(default=None, ge=0, le=U64)
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    seed: int | None = Field(default=None, ge=0, le=U64)
    top_n_tokens: int | None = Field(default=None, ge=0, le=U32)
    grammar: GrammarParameters | None = None


def default_parameters() -> GenerateParameters:
    """The parameters used when a request has no `parameters` object at all: TGI then samples."""
    return GenerateParameters(do_sample=True)


class GenerateRequest(_Strict):
    inputs: str
    parameters: GenerateParameters = Field(default_factory=default_parameters)


class CompatGenerateRequest(GenerateRequest):
    """Body of POST / and /invocations: a GenerateRequest that may ask for a stream."""

    stream: bool = False


class PrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None


class Token(BaseModel):
    id: int
    text: str
    logprob: float | None
    special: bool


FinishReason = Literal["length", "eos_token", "stop_sequence"]


class BestOfSequence(BaseModel):
    generated_text: str
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] = Field(default_factory=list)


class Details(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    best_of_sequences: list[BestOfSequence] | None = None
    top_tokens: list[list[Token]] = Field(default_factory=list)


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None


class StreamDetails(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    input_length: int


class StreamResponse(BaseModel):
    index: int
    token: Token
    top_tokens: list[Token] = Field(default_factory=list)
    generated_text: str | None = None
    details: StreamDetails | None = None


class ErrorResponse(BaseModel):
    error: str
    error_type: str


class SimpleToken(BaseModel):
    id: int
    text: str
    start: int
    stop: int


class Info(BaseModel):
    model_id: str
    model_sha: str | None
    model_pipeline_tag: str | None
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_input_tokens: int
    max_total_tokens: int
    validation_workers: int
    max_client_batch_size: int
    router: str
    version: str
    sha: str | None
    docker_label: str | None
    # textgen's: the names `adapter_id` (or the OpenAI `model`) selects; absent when none is loaded.
    lora_adapters: list[str] | None = None
