"""Grammar checks: a request's `grammar` -> the (text, type) the shards enforce token by token.

The contract with the shards (generate.v3 `NextTokenChooserParameters.grammar` / `grammar_type`):
- `GRAMMAR_TYPE_JSON`: the grammar is a JSON Schema document, as compact JSON text;
- `GRAMMAR_TYPE_REGEX`: the grammar is a regular expression the whole output must match.
Each shard compiles it with llguidance; the router compiles it too, so that a grammar llguidance refuses is a
422 with llguidance's reason before the request is queued, not a failed batch.

Rules and messages follow TGI's `validation.rs`: a JSON grammar's value is an object or a string holding one
(anything else: `grammar is not supported`), it must be a valid JSON Schema (draft 2020-12 meta-schema) and have
a `properties` field (`grammar is not valid: ...`). TGI compiles the schema to a regex in the router and words
its failures `cannot compile regex from schema: ...`; a schema llguidance cannot enforce gets that message here.

What TGI's compiler (outlines-core's `json_schema`) makes of a schema is not plain JSON Schema: a (sub)schema
with `properties` is an object holding only those properties, whatever its `type` and `additionalProperties`.
llguidance follows JSON Schema, where `{"properties": {...}}` alone also admits a string and undeclared keys, so
`close_objects` states TGI's reading in the schema before llguidance sees it, where the schema does not say
otherwise itself.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jsonschema
import llguidance
import pydantic_core
from jsonschema import Draft202012Validator

from textgen_pb import generate_pb2
from textgen_router.schemas import GrammarParameters
from textgen_router.types import ValidationError

ShardGrammar = tuple[str, "generate_pb2.GrammarType"]
"""What a shard is sent: the grammar text and its generate.v3 GrammarType."""

# Agents send the same schemas (their tools) on every request: a checked grammar is remembered by its text.
_CACHE_SIZE = 1024


def to_shard(grammar: GrammarParameters) -> ShardGrammar:
    """The shard form of a request's grammar; raises ValidationError with TGI's message when it is refused."""
    if grammar.type == "regex":
        assert isinstance(grammar.value, str)  # GrammarParameters refuses any other regex value
        return _checked_regex(grammar.value), generate_pb2.GRAMMAR_TYPE_REGEX
    schema = close_objects(_json_value(grammar))
    # Canonical text: two requests with the same schema share one cache entry and one shard-side compile.
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    return _checked_schema(text), generate_pb2.GRAMMAR_TYPE_JSON


def _json_value(grammar: GrammarParameters) -> Any:
    """The schema of a `json` / `json_object` / `json_schema` grammar, parsed when it came as a string."""
    value = grammar.value
    if grammar.type == "json_schema":
        # {"name": ..., "schema": {...}}: the schema alone is enforced; the name only labels it.
        if not isinstance(value, dict) or "schema" not in value:
            raise ValidationError("grammar is not valid: `json_schema` must have a 'schema' field")
        value = value["schema"]
    if isinstance(value, str):
        try:
            # jiter, which words its errors as TGI's serde_json does (`expected value at line 1 column 1`).
            value = pydantic_core.from_json(value, allow_inf_nan=False)
        except ValueError as err:
            raise ValidationError(f"grammar is not valid: {err}") from None
    if not isinstance(value, dict):
        raise ValidationError("grammar is not supported")
    return value


# Keywords whose subschemas describe output on their own (2020-12 and the drafts before it), and `$functions`,
# where the tool grammar keeps its definitions (TGI's name): these are closed. Not closed: the members of `allOf`,
# each of which describes only some of an object's keys (closed one by one they would refuse each other's keys),
# and conditions that are read rather than written (`not`, `if`/`then`/`else`, `contains`, `propertyNames`,
# `dependentSchemas`), whose meaning closing would change.
_SUBSCHEMA = frozenset(
    {"items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties"}
)
_SUBSCHEMA_LISTS = frozenset({"anyOf", "oneOf", "prefixItems", "items"})
_SUBSCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "$functions"})


def close_objects(schema: Any) -> Any:
    """`schema` with TGI's reading of `properties` (module docstring) made explicit: where a (sub)schema has
    `properties`, a missing `type` is "object" and a missing `additionalProperties` is false.

    What a schema states itself is kept (an explicit `"additionalProperties": true` still admits other keys, an
    explicit `type` stays), and an object built from `allOf` members stays open: its members, and the
    definitions a member refers to, are left as they are (see `_SUBSCHEMA`)."""
    return _close(schema, _all_of_refs(schema))


def _close(schema: Any, open_refs: frozenset[str]) -> Any:
    if not isinstance(schema, dict):
        return schema  # a boolean schema, or a malformed one the meta-schema check refuses
    out = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA_LISTS and isinstance(value, list):
            value = [_close(sub, open_refs) for sub in value]
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            value = {
                name: sub if f"#/{key}/{name}" in open_refs else _close(sub, open_refs) for name, sub in value.items()
            }
        elif key in _SUBSCHEMA:
            value = _close(value, open_refs)
        out[key] = value
    if isinstance(schema.get("properties"), dict):
        out.setdefault("type", "object")
        if "allOf" not in schema:
            out.setdefault("additionalProperties", False)
    return out


def _all_of_refs(schema: Any) -> frozenset[str]:
    """The `$ref`s that are members of an `allOf` anywhere in `schema`."""
    found: set[str] = set()
    pending = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            members = node.get("allOf")
            if isinstance(members, list):
                found.update(m["$ref"] for m in members if isinstance(m, dict) and isinstance(m.get("$ref"), str))
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
    return frozenset(found)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _checked_schema(text: str) -> str:
    schema = json.loads(text)
    try:
        Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as err:
        raise ValidationError(f"grammar is not valid: {err.message}") from None
    if "properties" not in schema:
        raise ValidationError("grammar is not valid: Grammar must have a 'properties' field")
    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(text))
    if error:
        raise ValidationError(f"cannot compile regex from schema: {_first_line(error)}")
    return text


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _checked_regex(regex: str) -> str:
    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_regex(regex))
    if error:
        raise ValidationError(f"grammar is not valid: {_first_line(error)}")
    return regex


def _first_line(error: str) -> str:
    """llguidance's reason without the grammar listing it appends (which echoes llguidance internals)."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    reason = next((line[len("error:") :].strip() for line in lines if line.startswith("error:")), None)
    return reason or lines[0]
