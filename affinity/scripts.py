"""The Lua scripts (``affinity/lua/*.lua``), registered once per client.

redis-py's ``Script`` objects call ``EVALSHA`` and fall back to ``SCRIPT LOAD`` on
``NOSCRIPT`` (after a Redis restart or ``SCRIPT FLUSH``), so nothing here caches state
beyond the client.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from typing import Any

from redis.commands.core import AsyncScript

__all__ = ["Scripts", "source"]

NAMES = ("resolve", "lookup", "release", "register", "renew", "deregister", "set_state")


@cache
def source(name: str) -> str:
    """The text of ``affinity/lua/<name>.lua``."""
    return (files("affinity") / "lua" / f"{name}.lua").read_text(encoding="utf-8")


@dataclass(frozen=True)
class Scripts:
    resolve: AsyncScript
    lookup: AsyncScript
    release: AsyncScript
    register: AsyncScript
    renew: AsyncScript
    deregister: AsyncScript
    set_state: AsyncScript

    @classmethod
    def bind(cls, redis: Any) -> Scripts:
        return cls(**{name: redis.register_script(source(name)) for name in NAMES})
