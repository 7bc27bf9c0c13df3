"""Logging set-up shared by the launcher, the router and the shards.

Contract with the launcher's log forwarding: with `--json-output`, every log record is one JSON object
per line on stdout: {"timestamp": ISO-8601, "level": "INFO", "target": logger name, "message": text}
plus any `extra={"fields": {...}}` under "fields". The launcher parses such lines from its children and
re-emits them with the child's rank added; lines that are not JSON are forwarded as plain text.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "timestamp": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
            "level": record.levelname,
            "target": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            line["fields"] = fields
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str = "INFO", json_output: bool = False) -> None:
    """Route every logger to stdout at `level` (a name such as "INFO"), as JSON lines or plain text."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter() if json_output else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
