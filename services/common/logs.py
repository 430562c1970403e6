"""Logging for every pdserve service: `--log-format text|json`, `--log-level`.

One line per request outcome (`outcome(log, "generate", request_id=..., ttft_ms=...)`),
never one per token. In JSON each line is one object with the fields at top level.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from pdserve.common import requestids

_FIELDS = "pdserve_fields"
_EVENT = "pdserve_event"


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return getattr(record, _FIELDS, None) or {}


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    text = str(value)
    return json.dumps(text) if (not text or " " in text or '"' in text) else text


class TextFormatter(logging.Formatter):
    """`2025-01-01T12:00:00.123Z INFO pdserve.router: message key=value ...`."""

    def __init__(self, service: str = ""):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = (f"{ts}.{int(record.msecs):03d}Z {record.levelname} {record.name}: "
                f"{record.getMessage()}")
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, service, msg, then the outcome fields."""

    def __init__(self, service: str = ""):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname,
                               "logger": record.name, "service": self.service,
                               "msg": getattr(record, _EVENT, None) or record.getMessage()}
        obj.update(_fields(record))
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str)


def setup_logging(log_format: str = "text", level: str = "INFO", *, service: str = "") -> None:
    """Send every logger's records to stderr in the chosen format (replaces earlier setup)."""
    formatter: logging.Formatter = (JsonFormatter(service) if log_format == "json"
                                    else TextFormatter(service))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def outcome(logger: logging.Logger, message: str, *, level: int = logging.INFO,
            **fields: Any) -> None:
    """Log one request outcome as a single line: in text `message key=value ...`, in JSON
    `{"msg": message, "key": value, ...}`. An attempt id in `request_id` is logged as the
    client's id plus `attempt_id`."""
    fields = requestids.labelled(fields)
    text = " ".join([message, *(f"{k}={_text(v)}" for k, v in fields.items())])
    logger.log(level, "%s", text, extra={_FIELDS: fields, _EVENT: message})
