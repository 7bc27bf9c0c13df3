"""Command-line values shared by the launcher, the router and the benchmark, read as clap reads TGI's flags.

TGI's flags are Rust unsigned integers (`usize`, `u32`, `u16`), so clap refuses a negative or oversized value
before anything starts (exit 2). Python's `int` took them, and the process failed later: `--port 70000`
with a traceback, `--max-concurrent-requests -1` by answering every request with 429.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable


def unsigned(bits: int) -> Callable[[str], int]:
    """An argparse `type` parsing a value like Rust's `u<bits>::from_str` (digits, an optional leading `+`),
    with Rust's messages for what it refuses."""

    def parse(value: str) -> int:
        if not value:
            raise argparse.ArgumentTypeError(f"invalid value '{value}': cannot parse integer from empty string")
        digits = value.removeprefix("+")
        # isdecimal alone accepts other scripts' digits, which Rust refuses; a lone "+" is no digit either.
        if not (digits.isascii() and digits.isdecimal()):
            raise argparse.ArgumentTypeError(f"invalid value '{value}': invalid digit found in string")
        number = int(digits)
        if number >= 1 << bits:
            raise argparse.ArgumentTypeError(f"invalid value '{value}': number too large to fit in target type")
        return number

    parse.__name__ = f"u{bits}"  # argparse names the type in some of its messages
    return parse


USIZE = unsigned(64)
U32 = unsigned(32)
U16 = unsigned(16)  # ports


def batch_sizes(value: str) -> list[int]:
    """CUDA graph batch sizes as TGI's launcher flag and its shard's CUDA_GRAPHS give them: comma-separated
    non-negative integers (0 disables them). ValueError says what was expected."""
    try:
        sizes = [int(part) for part in value.split(",")]
    except ValueError:
        raise ValueError("expected comma-separated integers") from None
    if any(size < 0 for size in sizes):
        raise ValueError("expected non-negative integers")
    return sizes


# clap's FalseyValueParser, which TGI's boolean flags use for their environment variables.
FALSE_WORDS = frozenset({"", "n", "no", "f", "false", "off", "0"})


def env_flag(name: str) -> bool:
    """A boolean flag's environment variable: absent, empty or a false word (any case) is false, anything else
    true (`JSON_OUTPUT=yes`, `WATERMARK=TRUE`)."""
    value = os.environ.get(name)
    return value is not None and value.strip().lower() not in FALSE_WORDS
