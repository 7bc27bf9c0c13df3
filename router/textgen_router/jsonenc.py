"""Compact JSON bytes written the way TGI's Rust router (serde_json) writes them.

Clients compare our bodies and SSE events byte for byte with TGI's, so this encoder reproduces serde_json:
no spaces, UTF-8 (no \\u escapes for non-ASCII), and floats printed from their f32 value with the
shortest round-trip digits in ryu's layout (0.000012, 1.2e-7, 3.0). NaN / infinity become null, as
serde_json does for non-finite floats (the first prefill token's logprob is NaN).
Dict insertion order is the field order.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np

_F32 = struct.Struct("<f")
# Where numpy's str of a float32 (Dragon4, shortest unique digits, positional with at least one decimal) is
# exactly ryu's layout: numpy writes positional from 1e-4 below 1e6, ryu from 1e-6 below 1e13. The bounds
# keep a margin so that rounding a float64 argument to f32 never crosses a switch point.
_NUMPY_MIN, _NUMPY_END = 2e-4, 1e5


def _to_f32(value: float) -> float:
    return _F32.unpack(_F32.pack(value))[0]


def _shortest_f32_digits(value: float) -> tuple[str, int]:
    """The shortest decimal digits d1d2..dn and exponent e with value == 0.d1..dn x 10^e as an f32."""
    target = abs(_to_f32(value))
    # Whether p digits round-trip is monotone in p and 9 always do: drop one digit at a time while the
    # shorter text still round-trips. Logprobs mostly need 9 to 7 digits: two to four formats (a binary
    # search over 1..9 took four or five).
    text = f"{target:.8e}"
    for p in range(8, 0, -1):
        shorter = f"{target:.{p - 1}e}"
        if _to_f32(float(shorter)) != target:
            break
        text = shorter
    mantissa, exponent = text.split("e")
    digits = mantissa.replace(".", "").rstrip("0") or "0"
    return digits, int(exponent) + 1


def format_f32(value: float) -> str:
    """A float as serde_json prints an f32 (ryu's layout).

    Hot path (once per streamed token): logprobs nearly always fall where numpy's C formatter gives the same
    text, several times faster than the digit search below (figures: benchmark/README.md, "Router figures").
    """
    if _NUMPY_MIN <= abs(value) < _NUMPY_END:
        return str(np.float32(value))
    return _ryu_layout(value)


def _ryu_layout(value: float) -> str:
    if not math.isfinite(value):
        return "null"
    sign = "-" if math.copysign(1.0, value) < 0 else ""
    if value == 0:
        return f"{sign}0.0"
    digits, kk = _shortest_f32_digits(value)
    length = len(digits)
    if length <= kk <= 13:
        return f"{sign}{digits}{'0' * (kk - length)}.0"
    if 0 < kk <= 13:
        return f"{sign}{digits[:kk]}.{digits[kk:]}"
    if -6 < kk <= 0:
        return f"{sign}0.{'0' * -kk}{digits}"
    exponent = kk - 1
    if length == 1:
        return f"{sign}{digits}e{exponent}"
    return f"{sign}{digits[0]}.{digits[1:]}e{exponent}"


# Literals of short strings already written: streamed token texts come from a bounded vocabulary, and a dict
# lookup costs a fraction of json.dumps (benchmark/README.md, "Router figures"). Bounded, so arbitrary client
# text cannot grow it without limit.
_LITERALS: dict[str, str] = {}
_LITERALS_MAX = 1 << 16
_LITERAL_MAX_CHARS = 32


def string(value: str) -> str:
    """A JSON string literal as serde_json writes it (non-ASCII kept as UTF-8 text)."""
    literal = _LITERALS.get(value)
    if literal is None:
        literal = json.dumps(value, ensure_ascii=False)
        if len(value) <= _LITERAL_MAX_CHARS and len(_LITERALS) < _LITERALS_MAX:
            _LITERALS[value] = literal
    return literal


def _encode(value: Any, out: list[str]) -> None:
    if isinstance(value, str):
        out.append(string(value))
    elif value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, int):
        out.append(str(value))
    elif isinstance(value, float):
        out.append(format_f32(value))
    elif isinstance(value, dict):
        _encode_object(value, out)
    elif isinstance(value, (list, tuple)):
        _encode_array(value, out)
    else:
        raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def _encode_object(value: dict[str, Any], out: list[str]) -> None:
    out.append("{")
    for i, (key, item) in enumerate(value.items()):
        if i:
            out.append(",")
        out.append(string(key))
        out.append(":")
        _encode(item, out)
    out.append("}")


def _encode_array(value: list[Any] | tuple[Any, ...], out: list[str]) -> None:
    out.append("[")
    for i, item in enumerate(value):
        if i:
            out.append(",")
        _encode(item, out)
    out.append("]")


def dumps(value: Any) -> bytes:
    """`value` (dicts, lists, str, int, float, bool, None) as serde_json-compatible UTF-8 bytes."""
    out: list[str] = []
    _encode(value, out)
    return "".join(out).encode()
