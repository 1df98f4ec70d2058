"""klog-style structured logging to stderr.

Messages are constant strings; values travel as key=value pairs in ``extra={"kv": {...}}``,
so logs can be grepped by message and parsed by field, and the data path pays for
formatting only when a record is actually emitted. ``-v N`` maps to levels the way klog's
verbosity does: V(2) is routine detail, V(4) is per-connection debugging.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Mapping
from typing import Any

V2 = 18
V3 = 16
V4 = 14

logging.addLevelName(V2, "V2")
logging.addLevelName(V3, "V3")
logging.addLevelName(V4, "V4")

_VERBOSITY = {V2: 2, V3: 3, V4: 4}
_LEVEL_LETTER = {logging.ERROR: "E", logging.WARNING: "W", logging.CRITICAL: "F"}


def kv(**fields: Any) -> dict[str, Mapping[str, Any]]:
    """``extra=`` for a structured record: ``log.info("Opening proxy port", extra=kv(port=1))``."""
    return {"kv": fields}


def _quote(value: Any) -> str:
    if isinstance(value, (int, float, bool)):
        return str(value).lower() if isinstance(value, bool) else str(value)
    return json.dumps(str(value))


class TextFormatter(logging.Formatter):
    """``I1122 04:16:59.123456 uproxy.syncer] "Opening proxy port" service="ns/a:http" port=1``."""

    def format(self, record: logging.LogRecord) -> str:
        letter = _LEVEL_LETTER.get(record.levelno, "I")
        t = time.localtime(record.created)
        micros = int((record.created % 1) * 1_000_000)
        stamp = time.strftime("%m%d %H:%M:%S", t)
        parts = [f"{letter}{stamp}.{micros:06d} {record.name}] {json.dumps(record.getMessage())}"]
        fields = getattr(record, "kv", None)
        if fields:
            parts.extend(f"{k}={_quote(v)}" for k, v in fields.items())
        if record.exc_info and record.levelno >= logging.ERROR:
            parts.append(f"err={_quote(record.exc_info[1])}")
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "v": _VERBOSITY.get(record.levelno, 0),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "kv", None)
        if fields:
            out.update(
                {k: v if isinstance(v, (int, float, bool)) else str(v) for k, v in fields.items()}
            )
        if record.exc_info and record.levelno >= logging.ERROR:
            out["err"] = str(record.exc_info[1])
        return json.dumps(out)


def setup(*, verbosity: int = 0, fmt: str = "text") -> None:
    """Configure the ``uproxy`` logger tree; ``verbosity`` is klog's ``-v``."""
    level = logging.INFO
    if verbosity >= 4:
        level = V4
    elif verbosity == 3:
        level = V3
    elif verbosity == 2:
        level = V2
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("uproxy")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    # The Kubernetes client logs a failure (an exec plugin's, say) as a bare line and then
    # raises it; uproxy reports what it raises in its own line, in its own format.
    client = logging.getLogger("kubernetes_asyncio")
    client.handlers[:] = [logging.NullHandler()]
    client.propagate = False
    # The HTTP servers (/healthz, /metrics, health-check node ports) log through aiohttp's
    # loggers, to which nothing was attached: Python's last resort printed each request it
    # could not parse as an 11-line traceback, outside this format, and any client that
    # reaches a health-check node port could send them by the thousand. In this format now,
    # and a client's malformed request only at -v 3 (kube-proxy's servers say nothing).
    web_handler = logging.StreamHandler(sys.stderr)
    web_handler.setFormatter(handler.formatter)
    web_handler.addFilter(_ClientErrors(level))
    web = logging.getLogger("aiohttp")
    web.handlers[:] = [web_handler]
    web.setLevel(logging.INFO)
    web.propagate = False


class _ClientErrors(logging.Filter):
    """A request aiohttp could not parse (its ``http_exceptions``: a bad header, a line too
    long) is the client's doing: said at -v 3 without its traceback, or not at all."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self._level = level

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or not type(exc).__module__.startswith("aiohttp.http_exceptions"):
            return True
        if self._level > V3:
            return False
        record.levelno, record.levelname = V3, logging.getLevelName(V3)
        record.msg, record.args = "Bad HTTP request", ()
        record.exc_info, record.exc_text = None, None
        record.kv = {"error": str(exc).replace("\n", " ")}
        return True


class Held(logging.Handler):
    """Holds what the ``uproxy`` loggers say before ``setup`` (reading ``--config`` comes
    first, since it decides verbosity and format); ``replay`` then logs it as configured."""

    def __init__(self) -> None:
        super().__init__(1)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> Held:
        root = logging.getLogger("uproxy")
        self._saved = (root.handlers[:], root.level, root.propagate)
        root.handlers[:] = [self]
        root.setLevel(1)
        root.propagate = False
        return self

    def __exit__(self, *exc: object) -> None:
        root = logging.getLogger("uproxy")
        if root.handlers == [self]:  # setup() did not run: put things back
            root.handlers[:], level, root.propagate = self._saved
            root.setLevel(level)

    def replay(self) -> None:
        """Log the held records through the handlers ``setup`` installed, at its level."""
        held, self.records = self.records, []
        for record in held:
            logger = logging.getLogger(record.name)
            if logger.isEnabledFor(record.levelno):
                logger.handle(record)
