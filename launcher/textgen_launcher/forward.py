"""Re-emitting children's log lines through the launcher's own logging (contract in `logs.py`).

A child's JSON line keeps its level, target and message and gains the child's identity (`rank` for a
shard, `step` for the download) under "fields"; in plain-text mode the identity prefixes the message.
Lines that are not JSON are written through unchanged.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

LEVELS = {
    "TRACE": logging.DEBUG,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "SUCCESS": logging.INFO,
    "WARNING": logging.WARNING,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
}


def parse_line(line: str) -> dict[str, Any] | None:
    """The JSON log record on `line`, or None if it is not one."""
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "message" in record else None


class LineForwarder:
    """Forwards one child stream; remembers the child's last error message for a one-line failure report."""

    def __init__(self, label: str, fields: dict[str, Any], json_output: bool) -> None:
        self.label = label
        self.fields = fields
        self.json_output = json_output
        self.last_error: str | None = None

    def emit(self, line: str) -> None:
        record = parse_line(line)
        if record is None:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
            return
        level = LEVELS.get(str(record.get("level", "INFO")).upper(), logging.INFO)
        message = str(record["message"]).rstrip()
        if level >= logging.ERROR:
            self.last_error = message
        if record.get("exception"):
            message = f"{message}\n{record['exception']}"
        if not self.json_output:
            message = f"[{self.label}] {message}"
        fields = {**(record.get("fields") or {}), **self.fields}
        logging.getLogger(str(record.get("target") or "textgen")).log(level, "%s", message, extra={"fields": fields})
