"""jsonenc writes what TGI's serde_json writes: compact, UTF-8, f32 floats in ryu's shortest layout."""

from __future__ import annotations

import json
import struct

import pytest

from textgen_router import jsonenc
from textgen_router.jsonenc import _ryu_layout, dumps, format_f32, string
from textgen_router.responses import stream_response, stream_token_event
from textgen_router.types import Token


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


# Expected strings are serde_json's output for these f32 values.
@pytest.mark.parametrize(
    ("value", "text"),
    [
        (-0.5432, "-0.5432"),
        (-10.57, "-10.57"),
        (3.0, "3.0"),
        (-0.0, "-0.0"),
        (0.0, "0.0"),
        (1.2e-5, "0.000012"),
        (1e-6, "0.000001"),
        (1.2e-7, "1.2e-7"),
        (-2.3841858e-7, "-2.3841858e-7"),
        (1e30, "1e30"),
        (12345678.0, "12345678.0"),
        (0.1, "0.1"),
        (float("nan"), "null"),
        (float("-inf"), "null"),
    ],
)
def test_f32_layout(value: float, text: str) -> None:
    assert format_f32(f32(value)) == text


def test_shortest_digits_round_trip_to_the_same_f32() -> None:
    for bits in range(0x3A000000, 0x3F800000, 0x00123457):
        value = struct.unpack("<f", struct.pack("<I", bits))[0]
        assert f32(float(format_f32(value))) == value
        # ... and no shorter decimal does.
        digits = len(format_f32(value).split("e")[0].replace(".", "").lstrip("0").rstrip("0"))
        if digits > 1:
            assert f32(float(f"{value:.{digits - 2}e}")) != value


def test_fast_path_is_the_ryu_layout() -> None:
    # Every binade from 1e-7 to 1e14, both signs: numpy's formatter (where format_f32 uses it) and the
    # digit search agree, and so do both sides of the switch points.
    for bits in range(0x33D6BF95, 0x56B5E620, 0x0000B3A1):
        value = struct.unpack("<f", struct.pack("<I", bits))[0]
        assert format_f32(value) == _ryu_layout(value)
        assert format_f32(-value) == _ryu_layout(-value)
    for edge in (1e-4, 2e-4, 1e5, 1e6, 1e7, 1e13, 1e16):
        for value in (edge, f32(edge), edge * (1 - 1e-9), edge * (1 + 1e-9)):
            assert format_f32(value) == _ryu_layout(value)


@pytest.mark.parametrize(
    "tok",
    [
        Token(5, "abc", -0.25),
        Token(0, 'é "\n', float("nan"), True),
        Token(1023, "", -12.345678),
    ],
)
def test_stream_token_event_is_the_generic_encoding(tok: Token) -> None:
    assert stream_token_event(7, tok) == dumps(stream_response(7, tok, []))


def test_compact_utf8_and_field_order() -> None:
    body = {"b": [1, None, True, False], "a": 'é\n\x01"', "c": {"logprob": -0.25}}
    assert dumps(body) == '{"b":[1,null,true,false],"a":"é\\n\\u0001\\"","c":{"logprob":-0.25}}'.encode()
    assert json.loads(dumps(body)) == body


def test_unknown_types_are_refused() -> None:
    with pytest.raises(TypeError):
        dumps({"x": object()})


def test_short_string_literals_are_remembered_long_ones_not() -> None:
    short, long = 'tok é\n"', "x" * 33
    assert string(short) == string(short) == json.dumps(short, ensure_ascii=False)
    assert string(long) == json.dumps(long)
    assert short in jsonenc._LITERALS
    assert long not in jsonenc._LITERALS
