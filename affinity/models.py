"""Model identity: a policy's name and version, as nodes register them and steps name them.

A model is ``name@version``: the name a client uses (KServe's model name, ``/act``'s
``model``, openpi's ``?model=``), the version an operator gives (``--model NAME@VERSION``)
or the first 12 hex digits of the SHA-256 of the model file. Both are 1-64 characters of
``A-Z a-z 0-9 . _ -`` starting with a letter or digit, so a model is one word in an episode's
value, a key suffix and a URL path segment.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from affinity.errors import InvalidArgument

__all__ = ["ModelId", "check_model_part"]

_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_model_part(what: str, value: object) -> str:
    """``value`` as a model name or version (``what`` says which), or raise
    :class:`InvalidArgument`."""
    if not isinstance(value, str) or not _PART.fullmatch(value):
        raise InvalidArgument(
            f"model {what}", value, "must be 1-64 of A-Z a-z 0-9 . _ - from a letter or digit"
        )
    return value


class ModelId(NamedTuple):
    """One (name, version) a node serves; ``str()`` is ``name@version``."""

    name: str
    version: str

    @classmethod
    def parse(cls, text: str) -> ModelId:
        """``"name@version"`` (as stored in Redis) -> ModelId; raises InvalidArgument."""
        name, sep, version = text.partition("@")
        if not sep:
            raise InvalidArgument("model", text, "must be name@version")
        return cls(check_model_part("name", name), check_model_part("version", version))

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"
