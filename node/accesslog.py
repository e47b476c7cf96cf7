"""One log line per request: method, path, status, latency, and for steps the episode,
device and routing. Plain text by default; ``--log-format json`` makes every log line of
the node (this one included) a JSON object.

Lines go to the ``affinity.access`` logger at INFO; ``--access-log off`` silences it.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from node.asgi import Receive, Scope, Send

__all__ = ["STEP_KEY", "AccessLog", "JsonFormatter"]

STEP_KEY = "affinity.step"
"""Scope key under which a step handler leaves ``(episode, device, routing)``."""

_log = logging.getLogger("affinity.access")


class JsonFormatter(logging.Formatter):
    """A log record as one JSON object: ts, level, logger, message and any ``fields``."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            doc.update(fields)
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class AccessLog:
    """Wraps an ASGI app's ``send`` to see the status, and logs when the response ends."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    async def __call__(self, app: Any, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.enabled or scope["type"] != "http" or not _log.isEnabledFor(logging.INFO):
            await app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0

        async def watch(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await app(scope, receive, watch)
        finally:
            self.write(scope, status or 500, time.perf_counter() - started)

    @staticmethod
    def write(scope: Scope, status: int, seconds: float) -> None:
        client = scope.get("client")
        fields: dict[str, Any] = {
            "client": f"{client[0]}:{client[1]}" if client else "-",
            "method": scope["method"],
            "path": scope["path"],
            "status": status,
            "ms": round(seconds * 1000, 3),
        }
        step = scope.get(STEP_KEY)
        if step is not None:
            fields["episode"], fields["device"], fields["routing"] = step
        text = " ".join(
            [
                f'{fields["client"]} "{fields["method"]} {fields["path"]}" {status}',
                f"{fields['ms']}ms",
            ]
            + [f"{k}={fields[k]}" for k in ("episode", "device", "routing") if k in fields]
        )
        _log.info("%s", text, extra={"fields": fields})
