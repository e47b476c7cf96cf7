"""One log line per request: method, path, status, latency, and for steps the episode,
device and routing. Plain text by default; ``--log-format json`` makes every log line of
the node (this one included) a JSON object; ``--access-log off`` silences it.

The lines are written straight to the log stream (stderr) in batches, not through the
``logging`` module. A batch goes every 0.25 s, or sooner once 256 are waiting. A
``LogRecord``, its formatting and a write per request cost about a sixth of the node's
throughput on a CPU model. A request only records its facts (a tuple); the lines are
formatted when the batch is written, off the request's own path. They look exactly like
the node's other log lines (same timestamp, level and logger name ``affinity.access``).

In the plain format every field a client chose (method, path, episode id) is escaped
(:func:`escape`). So a request cannot write a line of its own, a NUL or a terminal escape
into the log. Lines that cannot be written (a log reader that went away: broken pipe) are
dropped and counted (``on_drop``), never kept. The batch is cleared either way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import orjson

from node.asgi import Receive, Scope, Send

__all__ = ["STEP_KEY", "AccessLog", "JsonFormatter", "escape"]

STEP_KEY = "affinity.step"
"""Scope key under which a step handler leaves ``(episode, device, routing)``."""

FLUSH_S = 0.25
MAX_WAITING = 256

_Entry = tuple[float, Any, str, str, int, float, Any]
"""What a request leaves for its line: time, client, method, path, status, seconds, step."""


_THOUSANDTHS = tuple(f"{n:03d}" for n in range(1000))
"""``000`` to ``999``: a timestamp's milliseconds, formatted once (a format a line cost
~0.3 µs)."""


def _millis(ms: float) -> str:
    """``str(round(ms, 3))``, as cheaply as it can be had: ``f"{ms:.3f}"`` rounds alike
    (correctly, half to even on the exact value), and its trailing zeros dropped is the
    shortest repr that the rounded float has, as long as it has at most 15 significant
    digits (below 10^12 ms: 31 years). Half the cost of ``round`` and ``repr`` (~0.6 µs a
    line)."""
    if not 0.0 <= ms < 1e12:  # (and NaN)
        return str(round(ms, 3))
    text = f"{ms:.3f}".rstrip("0")
    return text + "0" if text[-1] == "." else text


def _escaped(c: str) -> str:
    if c in '\\"':
        return "\\" + c
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def escape(text: str) -> str:
    """``text`` with backslash, double quote and every unprintable character (control
    characters, line and paragraph separators, ...) written as a Python-style escape:
    one physical line whatever a client sent."""
    if text.isprintable() and "\\" not in text and '"' not in text:
        return text
    return "".join(c if c.isprintable() and c not in '\\"' else _escaped(c) for c in text)


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
    """Wraps an ASGI app's ``send`` to see the status, and writes one line when the
    response ends (see the module doc). ``stream`` defaults to stderr; ``on_drop(n)`` is
    told of ``n`` lines that could not be written."""

    def __init__(
        self,
        enabled: bool = True,
        *,
        json: bool = False,
        stream: TextIO | None = None,
        on_drop: Callable[[int], None] = lambda n: None,
    ) -> None:
        self.enabled = enabled
        self.json = json
        self.stream = stream
        self.on_drop = on_drop
        self._waiting: list[_Entry] = []
        self._flush: asyncio.TimerHandle | None = None
        self._second = -1
        self._stamp = ""

    async def __call__(self, app: Any, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.enabled or scope["type"] != "http":
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

    def write(self, scope: Scope, status: int, seconds: float) -> None:
        """Queue the line of one request (formatted and written within ``FLUSH_S``)."""
        self._waiting.append(
            (time.time(), scope.get("client"), scope["method"], scope["path"], status, seconds,
             scope.get(STEP_KEY))
        )  # fmt: skip
        if len(self._waiting) >= MAX_WAITING:
            self.flush()
        elif self._flush is None:
            try:
                self._flush = asyncio.get_running_loop().call_later(FLUSH_S, self.flush)
            except RuntimeError:  # no loop (a direct call): write now
                self.flush()

    def _line(self, entry: _Entry) -> str:
        now, client, method, path, status, seconds, step = entry
        peer = f"{client[0]}:{client[1]}" if client else "-"
        if self.json:
            ms = round(seconds * 1000, 3)
            doc: dict[str, Any] = {
                "ts": round(now, 6),
                "level": "info",
                "logger": "affinity.access",
                "client": peer,
                "method": method,
                "path": path,
                "status": status,
                "ms": ms,
            }
            if step is not None:
                doc["episode"], doc["device"], doc["routing"] = step
            return orjson.dumps(doc).decode()
        request = escape(f"{method} {path}")
        millis = _millis(seconds * 1000)
        line = f'{self._time(now)} INFO affinity.access: {peer} "{request}" {status} {millis}ms'
        if step is not None:
            line += f" episode={escape(step[0])} device={step[1]} routing={step[2]}"
        return line

    def flush(self) -> None:
        """Write every waiting line now."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if not self._waiting:
            return
        entries = self._waiting
        self._waiting = []
        stream = self.stream or sys.stderr
        try:
            stream.write("\n".join(map(self._line, entries)) + "\n")
            stream.flush()
        except (OSError, ValueError):  # broken pipe, closed stream: drop, never pile up
            self.on_drop(len(entries))

    def _time(self, now: float) -> str:
        """``2026-11-30 16:40:02,113``, as the logging module writes it."""
        second = int(now)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        return f"{self._stamp},{_THOUSANDTHS[int((now - second) * 1000)]}"
