"""The ``POST /act`` body's parse, and its reply's encoding, without the node's service: what
``node/protocols/act.py`` and a front door process (``node/front.py``) both run. Imports
nothing heavy (no ONNX Runtime, no FastAPI): a front's memory stays small."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from affinity import wire
from node.errors import BodyError, Refused

__all__ = ["MSGPACK", "count_rows", "encode_doc", "is_msgpack", "parse", "plain", "reply_headers"]

MSGPACK = "application/msgpack"


def is_msgpack(content_type: str | None) -> bool:
    return content_type is not None and content_type.split(";")[0].strip() in (
        MSGPACK,
        "application/x-msgpack",
    )


def parse(body: bytes, binary: bool, max_rows: int) -> Any:
    """The body's document; a message of rows past ``max_rows`` is refused (413) first:
    in msgpack before anything of it is decoded (from the list's header), in JSON right
    after the parse (one call), before any row's inputs become arrays."""
    if binary:
        count = count_rows(body)
        if count is not None and count > max_rows:
            raise _too_many(count, max_rows)
    try:
        doc = wire.decode(body) if binary else orjson.loads(body)
    except wire.WireError as exc:  # it says "body is not valid msgpack: ..." itself
        raise BodyError(400, "malformed", str(exc)) from None
    except (ValueError, RecursionError) as exc:  # orjson's errors
        raise BodyError(400, "malformed", f"body is not valid JSON: {exc}"[:300]) from None
    if not isinstance(doc, dict):
        raise BodyError(400, "malformed", "body must be a map (a JSON object)")
    rows = doc.get("steps")
    if isinstance(rows, list) and len(rows) > max_rows:
        raise _too_many(len(rows), max_rows)
    return doc


def _too_many(count: int, max_rows: int) -> Refused:
    return Refused(413, "too_many_rows", f"{count} rows in one message; the limit is {max_rows} "
                   "(--max-rows)")  # fmt: skip


def count_rows(body: bytes) -> int | None:
    """How many rows a msgpack body ``{"steps": [...]}`` declares, read from its first
    bytes alone: a map of one key, ``steps``, then the list's header (None: another body,
    which a one-row step's is; the full decode says what is wrong with it)."""
    if not body.startswith(_STEPS_HEAD):
        return None
    at = len(_STEPS_HEAD)
    kind = body[at : at + 1]
    if kind and 0x90 <= kind[0] <= 0x9F:  # fixarray
        return kind[0] & 0x0F
    width = {b"\xdc": 2, b"\xdd": 4}.get(kind)
    if width is None or len(body) < at + 1 + width:
        return None
    return int.from_bytes(body[at + 1 : at + 1 + width], "big")


_STEPS_HEAD = b"\x81\xa5steps"
"""msgpack of a map of one entry whose key is ``"steps"``: what a body of rows starts with."""


def plain(obj: Any) -> Any:
    """orjson's ``default``: numpy arrays and scalars as lists and numbers."""
    if isinstance(obj, np.ndarray | np.generic):
        return obj.tolist()
    raise TypeError(type(obj).__name__)


def encode_doc(doc: dict[str, Any], binary: bool) -> tuple[bytes, bytes]:
    """(body, content type) of a reply's document: msgpack (openpi's arrays) or JSON."""
    if binary:
        return wire.encode(doc), MSGPACK.encode()
    return orjson.dumps(doc, default=plain, option=orjson.OPT_SERIALIZE_NUMPY), b"application/json"


def reply_headers(facts: dict[str, Any], url: str | None) -> list[tuple[bytes, bytes]]:
    """The ``X-Affinity-*`` headers of a one-row reply, from its facts (``Reply.facts``)."""
    headers = [
        (b"x-affinity-device", str(facts["device"]).encode()),
        (b"x-affinity-node", str(facts["node"]).encode()),
        (b"x-affinity-token", str(facts["token"]).encode()),
        (b"x-affinity-routing", str(facts["routing"]).encode()),
        (b"x-affinity-state-reset", b"true" if facts["state_reset"] else b"false"),
        (b"x-affinity-degraded", b"true" if facts["degraded"] else b"false"),
        (b"x-affinity-source", str(facts["source"]).encode()),
        (b"x-affinity-seq", str(facts["seq"]).encode()),
    ]
    if url:
        headers.append((b"x-affinity-url", url.encode()))
    return headers
