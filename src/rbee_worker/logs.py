"""Log lines (CONTRACT.md §5): one line per event, JSON for machines or `pretty` for people.

Structured values travel in a record's `fields` (`log.info("job finished", extra={"fields": {...}})`): JSON lines carry
them as keys, pretty lines as key=value pairs after the message.
"""

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

LOG_FORMATS = ("json", "pretty")


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **fields_of(record),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


class PrettyFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s", datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if fields := fields_of(record):
            text += " " + " ".join(f"{key}={value}" for key, value in fields.items())
        return text


def configure_logging(level: str, log_format: str | None = None) -> None:
    """Log to stderr at `level`; `log_format` None picks JSON unless stderr is a terminal."""
    if log_format is None:
        log_format = "pretty" if sys.stderr.isatty() else "json"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else PrettyFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # A library's Python warning (a pydantic schema's, say) goes out as a log record, not as a raw line in a JSON log.
    logging.captureWarnings(True)
    # httpx logs each request it sends at info: every heartbeat, and the route-table request at start-up. The worker
    # logs what those mean itself (a failed callback or heartbeat); httpx's own lines stay for --log-level debug.
    logging.getLogger("httpx").setLevel(logging.NOTSET if level.lower() == "debug" else logging.WARNING)
