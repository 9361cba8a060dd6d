"""Log records as one line each, whatever a request put in them.

Two formats: `text` (`TIME LEVEL LOGGER: message key=value ...`) for people, and
`json` (one object a line) for log pipelines. Neither lets a value forge a record:
text escapes control characters (newlines, ANSI escapes, NUL, ...) and indents the
lines of a traceback, and JSON escapes them as JSON does.

A record may carry structured fields (`extra={"fields": {...}}`): text appends them as
key=value, quoting a value that holds a space, a quote or '='; JSON adds them as keys.
"""

from __future__ import annotations

import json
import logging
import re
from datetime import datetime, timezone
from typing import Any

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# C0 and C1 controls, DEL, and the Unicode line separators and direction overrides that
# can make a terminal or a viewer show something other than the bytes.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_NEEDS_QUOTES = re.compile(r'[\s"=]')
_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match) -> str:
    char = match.group()
    return _SHORT_ESCAPES.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")


def escape_controls(text: str) -> str:
    """`text` with every control character written as a visible escape (\\n, \\x1b, ...)."""
    return _CONTROL.sub(_escape, text)


def format_fields(fields: dict[str, Any]) -> str:
    """key=value pairs, a value quoted (JSON string syntax) where it holds a space, a quote or '='."""
    parts = []
    for key, value in fields.items():
        text = escape_controls(str(value))
        parts.append(f"{key}={json.dumps(text) if _NEEDS_QUOTES.search(text) or not text else text}")
    return " ".join(parts)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        # (format() has just set record.message from the arguments, as it does for every handler)
        record.message = escape_controls(record.message)
        fields = getattr(record, "fields", None)
        if fields:
            record.message = " ".join(filter(None, (record.message, format_fields(fields))))
        return super().formatMessage(record)

    def formatException(self, ei) -> str:
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _indented(stack_info)


def _indented(text: str) -> str:
    """Continuation lines start with spaces: none can pass for the start of a record."""
    return "\n".join("    " + escape_controls(line) for line in text.splitlines())


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = record.stack_info
        return json.dumps(entry, ensure_ascii=False, default=str)


_format = "text"  # as last configured


def configure_logging(level: int | str, log_format: str = "text") -> None:
    """The server's logs on stderr, in `log_format` (the engine's process calls it too)."""
    global _format
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(TextFormatter() if log_format == "text" else JsonFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    _format = log_format


def logging_settings() -> tuple[int, str]:
    """The level and format this process logs with, for a child process to log alike."""
    return logging.getLogger().level, _format
