"""The KServe v2 HTTP infer body's decode and its reply's encoding, without the node's
service: what the node's own KServe door (``http.py``, with ``request.py``'s rules) and a
front door process (``node/front.py``, issue 43) both run, and how a decoded request and
its reply cross the shared-memory hop between them (:func:`request_meta`,
:func:`request_of`, :func:`reply_meta`, :func:`reply_of`). Imports nothing heavy (no ONNX
Runtime, no FastAPI, no service): a front's memory stays small.

The infer body is the JSON request, or the binary tensor extension (``tensors.py``):
``Inference-Header-Content-Length`` bytes of JSON followed by each binary input's raw
bytes, in input order. See ``http.py`` for the reply.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import orjson

from affinity import InvalidArgument, check_episode
from affinity.wire import MAX_ELEMENTS
from node.errors import BadRequest, Outcome, Refused
from node.hop import contiguous
from node.protocols.kserve.tensors import (
    DATATYPE_OF,
    MAX_TENSORS,
    STRINGS,
    Array,
    as_object,
    body_inputs,
    inflate,
    kind_of,
    tensor_bytes,
)

__all__ = [
    "HEADER_LENGTH",
    "INFER_PATH",
    "JSON",
    "MODEL_PATH",
    "REQUEST_PARAMETERS",
    "ROW_PARAMETERS",
    "InferRequest",
    "Row",
    "TensorChecks",
    "check_custom",
    "check_name",
    "decode_infer",
    "encode_reply",
    "episode_of",
    "reply_meta",
    "reply_of",
    "request_meta",
    "request_of",
    "rows_of",
    "shaped",
    "step_parameters",
]

JSON = b"application/json"
MODEL_PATH = r"/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?"
INFER_PATH = re.compile(MODEL_PATH + "/infer")
"""The infer path (matched whole, after its trailing ``/`` are stripped): the model's name
and, if given, its version."""
HEADER_LENGTH = b"inference-header-content-length"


@dataclass(slots=True)
class InferRequest:
    """One decoded infer request, before the policy's input rule.

    ``sequence`` is the client's ``sequence_id`` (None without a sequence) and ``episode``
    its affinity episode id. ``arrays`` holds each input as declared (its datatype and
    shape). ``outputs`` maps each requested output to whether it goes back binary (None:
    every output, binary when ``binary_output``). ``timeout_s`` is the client's
    ``timeout``, if any. ``execute_steps`` and ``ensemble`` are the client's action-chunk
    overrides (their ranges are the dispatcher's ``mode_for``'s to check)."""

    id: str | None
    sequence: int | str | None
    episode: str | None
    start: bool
    end: bool
    arrays: dict[str, Array]
    outputs: dict[str, bool] | None
    binary_output: bool
    timeout_s: float | None
    execute_steps: int | None = None
    ensemble: str | None = None
    seq: int | None = None
    executed: object = None  # real-time chunking (node/rtc.py), checked by rtc_for
    inference_delay: object = None
    control_hz: object = None
    pending: object = None  # JSON text of the robot's unexecuted actions [k][D]
    timing: bool = False  # the split of the step's time in the reply's parameters
    rows: list[Row] | None = None  # several episodes' steps (episode_ids), row by row


@dataclass(frozen=True, slots=True)
class Row:
    """One row of a request of rows (``episode_ids``): its sequence id, episode and
    flags."""

    sequence: int | str
    episode: str
    start: bool = False
    end: bool = False
    seq: int | None = None


ROW_PARAMETERS = (
    "episode_ids", "sequence_starts", "sequence_ends", "seqs", "sequence_start", "sequence_end"
)  # fmt: skip
"""The parameters of a request of rows: per row, JSON arrays in string parameters
(``tritonclient`` reserves ``sequence_start`` and ``sequence_end``, which apply to every
row)."""


def _json_list(params: dict[str, Any], key: str, count: int | None) -> list[Any] | None:
    value = params.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRequest(f"parameter {key} of a request of rows must be a JSON array in a string")
    try:
        got = json.loads(value)
    except ValueError:
        got = None
    if not isinstance(got, list) or (count is not None and len(got) != count):
        rows = "" if count is None else f" of {count} values (one per row)"
        raise BadRequest(f"parameter {key} must be a JSON array{rows}")
    return got


def rows_of(params: dict[str, Any], max_rows: int) -> list[Row] | None:
    """The rows ``episode_ids`` names (None: not a request of rows): ``sequence_starts``,
    ``sequence_ends`` (booleans) and ``seqs`` (step numbers or null) are JSON arrays of
    one value per row; ``sequence_start`` and ``sequence_end`` one boolean for every row.
    Raises
    :class:`Refused` 413 past ``max_rows`` and 400 for an id in two rows, and
    :class:`BadRequest`; before any input is decoded."""
    ids = _json_list(params, "episode_ids", None)
    if ids is None:
        return None
    if len(ids) > max_rows:
        limit = f"the limit is {max_rows} (--max-rows)"
        raise Refused(413, "too_many_rows", f"{len(ids)} rows in one request; {limit}")
    if params.get("sequence_id") not in (None, 0, ""):
        raise BadRequest("a request of rows names its sequences in episode_ids, not sequence_id")
    count = len(ids)
    flags: dict[str, list[Any]] = {}
    for key in ("sequence_start", "sequence_end"):
        every = params.get(key, False)
        if not isinstance(every, bool):
            raise BadRequest(f"{key} must be true or false (every row); per row: {key}s")
        got = _json_list(params, key + "s", count) or [every] * count
        if not all(isinstance(v, bool) for v in got):
            raise BadRequest(f"parameter {key}s must be a JSON array of true and false")
        flags[key] = got
    seqs = _json_list(params, "seqs", count) or [None] * count
    rows: list[Row] = []
    seen: set[str] = set()
    for i, sequence in enumerate(ids):
        episode = episode_of(sequence)
        if episode is None or isinstance(sequence, bool | float):
            raise BadRequest(f"episode_ids[{i}] {sequence!r:.40} must be a non-zero sequence id")
        if episode in seen:
            twice = f"sequence {str(sequence)[:64]!r} is in two rows of one request"
            raise Refused(400, "duplicate_episode", twice)
        seen.add(episode)
        seq = seqs[i]
        if seq is not None and (type(seq) is not int or not 1 <= seq < 2**63):
            raise BadRequest(f"seq[{i}] {seq!r:.40} must be a step number >= 1")
        start, end = flags["sequence_start"][i], flags["sequence_end"][i]
        rows.append(Row(sequence, episode, start, end, seq))
    return rows


def episode_of(sequence_id: object) -> str | None:
    """The episode id of a ``sequence_id``: ``kserve:i:<n>`` for a uint64 ``n``,
    ``kserve:s:<text>`` for a string, None for ``0``, ``""`` or no id (stateless). Raises
    :class:`BadRequest` for anything else (a bool, a negative or fractional number, a
    string over the episode id limit or with control characters)."""
    if sequence_id is None or sequence_id == 0 or sequence_id == "":
        if isinstance(sequence_id, bool | float):
            raise BadRequest(f"sequence_id {sequence_id!r} must be an unsigned integer or a string")
        return None
    if type(sequence_id) is int:
        if not 0 < sequence_id < 2**64:
            raise BadRequest(f"sequence_id {sequence_id} is not a uint64")
        return f"kserve:i:{sequence_id}"
    if isinstance(sequence_id, str):
        try:
            return check_episode(f"kserve:s:{sequence_id}")
        except InvalidArgument as exc:
            raise BadRequest(f"sequence_id {sequence_id[:64]!r}: {exc.limit}") from None
    raise BadRequest(
        f"sequence_id must be an unsigned integer or a string, not {kind_of(sequence_id)}"
    )


REQUEST_PARAMETERS = frozenset(
    {"sequence_id", "sequence_start", "sequence_end", "timeout", "priority",
     "binary_data_output", "execute_steps", "ensemble", "executed", "inference_delay",
     "control_hz", "pending", "timing", *ROW_PARAMETERS}
)  # fmt: skip
"""The request parameters the node reads (``priority`` only checked, as Triton does)."""


def check_custom(params: dict[str, Any]) -> None:
    """Refuse what Triton refuses among the parameters.

    That is a ``priority`` that is not a uint64, and a custom parameter (any other) whose
    value is not a boolean, a number or a string. Other custom parameters are accepted and
    unused, as a Triton backend that does not read them leaves them."""
    priority = params.get("priority")
    if priority is not None and (type(priority) is not int or not 0 <= priority < 2**64):
        raise BadRequest(f"priority {priority!r:.40} must be an unsigned integer")
    for key, value in params.items():
        if key not in REQUEST_PARAMETERS and (value is None or isinstance(value, list | dict)):
            raise BadRequest(
                f"parameter {key[:64]!r} must be a boolean, a number or a string, "
                f"not {kind_of(value)}"
            )


def step_parameters(params: dict[str, Any]) -> dict[str, Any]:
    """The :class:`InferRequest` fields Triton's parameters give as they are (each wire's
    decoder checked their types first, in its own words)."""
    timeout = params.get("timeout")
    return {
        "timeout_s": timeout / 1e6 if timeout else None,
        "execute_steps": params.get("execute_steps"),
        "ensemble": params.get("ensemble"),
        "seq": params.get("seq"),
        "executed": params.get("executed"),
        "inference_delay": params.get("inference_delay"),
        "control_hz": params.get("control_hz"),
        "pending": params.get("pending"),
    }


def decode_infer(
    body: bytes,
    header_length: str | None,
    *,
    content_encoding: str | None = None,
    max_bytes: int = 1 << 24,
    max_elements: int = MAX_ELEMENTS,
    max_rows: int = 256,
) -> InferRequest:
    """Decode one infer body (see the module doc). ``header_length`` is the
    ``Inference-Header-Content-Length`` header, if any; ``max_bytes`` bounds an inflated
    body. Raises :class:`BadRequest` (400) or ``BodyError`` (413, an inflated body past
    ``max_bytes``); allocates nothing from a declared size before checking it."""
    if content_encoding is not None:
        body = inflate(body, content_encoding.strip().lower(), max_bytes)
    if header_length is None:
        json_end = len(body)
    else:
        text = header_length.strip()
        if not text.isdigit() or len(text) > 20 or int(text) > len(body):
            raise BadRequest(
                f"Inference-Header-Content-Length {header_length[:24]!r} must be the length of "
                f"the JSON header within the {len(body)}-byte body",
                "malformed",
            )
        json_end = int(text)
    try:
        doc = orjson.loads(memoryview(body)[:json_end])
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request JSON is not valid: {exc}"[:300], "malformed") from None
    if not isinstance(doc, dict):
        raise BadRequest("the request must be a JSON object", "malformed")
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest(f"id must be a string, not {kind_of(request_id)}")
    params = as_object(doc.get("parameters"), "parameters")
    check_custom(params)
    rows = rows_of(params, max_rows)  # before any input is decoded
    if rows is not None:  # the per-row ones are in rows
        params = {k: v for k, v in params.items() if k not in ROW_PARAMETERS}
    sequence = params.get("sequence_id")
    episode = episode_of(sequence)
    start = _flag(params, "sequence_start")
    end = _flag(params, "sequence_end")
    if episode is None and (start or end):
        raise BadRequest("sequence_start and sequence_end need a non-zero sequence_id")
    timeout = params.get("timeout")
    if timeout is not None and (type(timeout) is not int or timeout < 0):
        raise BadRequest(f"timeout {timeout!r:.40} must be a whole number of microseconds")
    steps, ensemble = params.get("execute_steps"), params.get("ensemble")
    if steps is not None and type(steps) is not int:
        raise BadRequest(f"execute_steps must be an integer, not {kind_of(steps)}")
    if ensemble is not None and not isinstance(ensemble, str):
        raise BadRequest(f"ensemble must be a string, not {kind_of(ensemble)}")
    seq = params.get("seq")
    if seq is not None and (type(seq) is not int or seq < 1):
        raise BadRequest(f"seq {seq!r:.40} must be a step number >= 1")
    arrays = body_inputs(doc.get("inputs"), body, json_end, max_elements)
    binary_output = _flag(params, "binary_data_output")
    return InferRequest(
        id=request_id,
        sequence=None if episode is None else sequence,
        episode=episode,
        start=start,
        end=end,
        arrays=arrays,
        outputs=_requested(doc.get("outputs"), binary_output),
        binary_output=binary_output,
        timing=_flag(params, "timing"),
        rows=rows,
        **step_parameters(params),
    )


def _requested(raw: object, binary_output: bool) -> dict[str, bool] | None:
    if raw is None or raw == []:  # none named: every output
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TENSORS:
        raise BadRequest(f"outputs must be a list of at most {MAX_TENSORS} objects")
    requested: dict[str, bool] = {}
    for i, tensor in enumerate(raw):
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise BadRequest(f"outputs[{i}] must be an object with a name")
        name = tensor["name"]
        params = as_object(tensor.get("parameters"), f"output {name[:64]!r} parameters")
        for key in params:
            if key == "classification" or key.startswith("shared_memory"):
                raise BadRequest(f"output {name[:64]!r}: {key} is not supported")
        if name in requested:
            raise BadRequest(f"output {name[:64]!r} is requested twice")
        binary = params.get("binary_data", binary_output)
        if not isinstance(binary, bool):
            raise BadRequest(f"output {name[:64]!r}: binary_data must be true or false")
        requested[name] = binary
    return requested


def _flag(params: dict[str, Any], key: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false, not {kind_of(value)}")
    return value


def encode_reply(
    outputs: dict[str, Array],
    wanted: dict[str, bool],
    model_name: str,
    version: str,
    request_id: str | None,
    parameters: dict[str, Any],
) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """(body, headers: the content type first) of an infer reply: JSON, or a JSON header
    and the binary outputs with ``Inference-Header-Content-Length`` when any output goes
    back binary. ``wanted`` maps each output to send, in order, to whether it goes binary;
    ``outputs`` holds at least those."""
    entries: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, binary in wanted.items():
        array = outputs[name]
        entry: dict[str, Any] = {
            "name": name,
            "datatype": DATATYPE_OF[array.dtype],
            "shape": array.shape,
        }
        if binary:
            blob = tensor_bytes(array)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif array.dtype == STRINGS:
            entry["data"] = [str(v) for v in array.reshape(-1).tolist()]
        else:
            entry["data"] = np.ascontiguousarray(array).reshape(-1)
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": model_name, "model_version": version}
    if request_id is not None:
        doc["id"] = request_id
    doc["parameters"] = parameters
    doc["outputs"] = entries
    head = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return head, [(b"content-type", JSON)]
    return b"".join([head, *blobs]), [
        (b"content-type", b"application/octet-stream"),
        (HEADER_LENGTH, str(len(head)).encode()),
    ]


def shaped(o: Outcome, timeout_s: float | None = None) -> Outcome:
    """``o`` as a KServe door answers it: an invalid request is 400 (413 too large, 404 not
    served) with the bare message; a refused step keeps its status and prefixes its code.
    ``timeout_s``: the request's own timeout, when shorter than ``--act-deadline``, which a
    ``deadline`` names."""
    if o.invalid:
        return replace(o, status=400 if o.status == 422 else o.status)
    why = o.message
    if o.code == "deadline" and timeout_s is not None:
        why = f"no answer within the request's timeout of {round(timeout_s * 1e6)} µs"
    return replace(o, message=f"{o.code}: {why}")


# ---- across the hop (a front door process and the node's core) ------------------------------

_CARRIED = (
    "sequence", "episode", "start", "end", "binary_output", "timeout_s", "execute_steps",
    "ensemble", "seq", "executed", "inference_delay", "control_hz", "pending", "timing",
)  # fmt: skip
"""The :class:`InferRequest` fields that cross the hop as they are (``id`` stays in the
front, which encodes the reply; ``arrays``, ``outputs`` and ``rows`` have their own
forms)."""


def _carry(named: dict[str, Array]) -> tuple[list[list[Any]], list[Array]]:
    """Tensors for the hop: each numeric one raw into the slot (``["n", name]``), a BYTES
    one as its strings and shape (``["s", name, strings, shape]``)."""
    entries: list[list[Any]] = []
    arrays: list[Array] = []
    for name, array in named.items():
        if array.dtype == STRINGS:
            entries.append(["s", name, array.reshape(-1).tolist(), list(array.shape)])
        else:
            entries.append(["n", name])
            arrays.append(contiguous(array))
    return entries, arrays


def _carried(entries: object, arrays: list[Array]) -> dict[str, Array]:
    """The tensors :func:`_carry` sent. Raises ``ValueError`` for entries it did not write."""
    if not isinstance(entries, list):
        raise ValueError("tensors are not a list")
    named: dict[str, Array] = {}
    at = 0
    for entry in entries:
        if not isinstance(entry, list) or not entry or not isinstance(entry[1], str):
            raise ValueError("bad tensor entry")
        if entry[0] == "n" and len(entry) == 2:
            if at >= len(arrays):
                raise ValueError("fewer tensors than entries")
            named[entry[1]] = arrays[at]
            at += 1
        elif entry[0] == "s" and len(entry) == 4 and isinstance(entry[2], list):
            strings = np.empty(len(entry[2]), dtype=STRINGS)
            strings[:] = entry[2]
            named[entry[1]] = strings.reshape(entry[3])
        else:
            raise ValueError("bad tensor entry")
    if at != len(arrays):
        raise ValueError("more tensors than entries")
    return named


def check_name(model: str, version: str | None) -> str:
    """The name a front knows a KServe model's input check by (``node/checks.py``): the
    path's model, and its version as the path named it, if it did; the core teaches the
    check under the same name (a NUL apart: in no path, and two names that still meet only
    cost a second trip, since the core compares the check's key)."""
    return model if version is None else f"{model}\x00{version}"


class TensorChecks(Protocol):
    """A front's input checks (``node/checks.py``'s ``Checks``), as :func:`request_meta`
    asks them."""

    def tensors(
        self, model: str, arrays: dict[str, Array], rows: int | None
    ) -> tuple[dict[str, Array], dict[str, Any]] | None: ...


def request_meta(
    request: InferRequest, model: str, version: str | None, checks: TensorChecks | None = None
) -> tuple[dict[str, Any], list[Array]]:
    """A decoded request for model ``model`` (``version`` as the path named it) as the
    hop's meta and tensors; with ``checks``, its inputs checked and converted in the front
    where they know the model's check (its word, ``ok`` and ``ck``, in the meta)."""
    tensors, word = request.arrays, None
    if checks is not None:
        rows = None if request.rows is None else len(request.rows)
        checked = checks.tensors(check_name(model, version), request.arrays, rows)
        if checked is not None:
            tensors, word = checked
    entries, arrays = _carry(tensors)
    meta: dict[str, Any] = {f: getattr(request, f) for f in _CARRIED}
    meta["model"], meta["version"], meta["inputs"] = model, version, entries
    meta["outputs"] = None if request.outputs is None else list(request.outputs.items())
    if request.rows is not None:
        meta["rows"] = [[r.sequence, r.episode, r.start, r.end, r.seq] for r in request.rows]
    if word is not None:
        meta.update(word)
    return meta, arrays


def request_of(meta: dict[str, Any], arrays: list[Array]) -> tuple[InferRequest, str, str | None]:
    """The request, model and version :func:`request_meta` sent. Raises ``ValueError`` for
    a meta it did not write."""
    try:
        fields = {f: meta[f] for f in _CARRIED}
        model, version = meta["model"], meta["version"]
        outputs = meta["outputs"]
        rows = meta.get("rows")
        request = InferRequest(
            id=None,
            arrays=_carried(meta["inputs"], arrays),
            outputs=None if outputs is None else {str(n): bool(b) for n, b in outputs},
            rows=None if rows is None else [Row(*r) for r in rows],
            **fields,
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"bad infer request: {exc}") from None
    if not isinstance(model, str) or not (version is None or isinstance(version, str)):
        raise ValueError("bad model name or version")
    return request, model, version


def reply_meta(
    outputs: dict[str, Array],
    wanted: dict[str, bool],
    version: str,
    parameters: dict[str, Any],
) -> tuple[dict[str, Any], list[Array]]:
    """An infer reply's parts (what :func:`encode_reply` takes but the model's name and the
    request's id, which the front has) as the hop's meta and tensors: the wanted outputs
    only."""
    entries, arrays = _carry({n: outputs[n] for n in wanted})
    meta = {"wanted": list(wanted.items()), "version": version, "parameters": parameters,
            "outputs": entries}  # fmt: skip
    return meta, arrays


def reply_of(
    meta: dict[str, Any], views: list[Array]
) -> tuple[dict[str, Array], dict[str, bool], str, dict[str, Any]]:
    """(outputs, wanted, version, parameters) :func:`reply_meta` sent."""
    try:
        wanted = {str(n): bool(b) for n, b in meta["wanted"]}
        return _carried(meta["outputs"], views), wanted, meta["version"], meta["parameters"]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"bad infer reply: {exc}") from None
