"""The OpenAPI document (``/docs``): FastAPI's routes, plus the hot ``POST /act``.

``/act`` is a plain ASGI handler (``node/protocols/act.py``) that FastAPI never sees, so
its request and reply are described here by hand: one step (:class:`ActRequest`,
:class:`ActReply`) or many episodes' steps in one message (:class:`ActRows`,
:class:`ActRowsReply`, issue 44). Hazard: they must follow act.py's wire.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

from node.protocols import act

__all__ = ["ActReply", "ActRequest", "ActRowError", "ActRows", "ActRowsReply", "document_act"]


def document_act(api: FastAPI) -> None:
    """Make ``api``'s OpenAPI document (built once, on first use) describe ``POST /act``."""
    api.openapi = lambda: api.openapi_schema or _cache(api, _schema(api))  # type: ignore[method-assign]


class ActRequest(BaseModel):
    """One step of an episode."""

    episode_id: str | None = Field(
        None, max_length=512, description="Sticky key of the episode (UTF-8, no control chars)."
    )
    session_id: str | None = Field(
        None, max_length=512, description="Used when episode_id is missing (degraded routing)."
    )
    inputs: dict[str, Any] = Field(
        description="Observation input name -> nested list of the model's shape "
        "(GET /model); with Content-Type application/msgpack, arrays in openpi's encoding."
    )
    end: bool = Field(False, description="Release the episode after serving this step.")
    token: int | None = Field(
        None, ge=0, description="The token of the previous reply; a lost assignment is then "
        "reported as state_reset.",
    )  # fmt: skip
    claim: str | None = Field(
        None, max_length=64, description="The claim of the previous reply; a claim other than "
        "the one serving the step (even under the same token number) is reported as state_reset.",
    )  # fmt: skip
    execute_steps: int | None = Field(
        None, ge=1, description="Action-chunk execution: run the policy every k steps."
    )
    ensemble: str | None = Field(
        None, description="Action-chunk execution: exp (temporal ensembling) or none."
    )
    seq: int | None = Field(
        None, ge=1, description="The step number expected to be applied (the last reply's "
        "seq + 1): exactly once; a retry of the last gets its reply again.",
    )  # fmt: skip
    model: str | None = Field(
        None, description="The model, name or name@version (default: the node's first)."
    )
    executed: int | None = Field(
        None, ge=0, description="Real-time chunking: actions executed since the last reply."
    )
    inference_delay: int | None = Field(
        None, ge=0, description="Real-time chunking: control steps the step's run will take."
    )
    control_hz: float | None = Field(None, gt=0, description="The robot's control rate (Hz).")
    pending: list[Any] | None = Field(
        None, description="Real-time chunking: the robot's unexecuted actions (a prefix for "
        "a step that starts from clean state).",
    )  # fmt: skip

    model_config = {
        "extra": "forbid",
        "json_schema_extra": {
            "examples": [{"episode_id": "ep-42", "inputs": {"obs": [[0.1] * 8]}, "token": 17}]
        },
    }


class Rtc(BaseModel):
    """What a real-time-chunking step ran with."""

    executed: int = Field(description="Actions executed since the last reply.")
    delay: int = Field(description="Control steps the run was taken to last (d).")
    prefix_len: int = Field(description="Actions of the prefix the run was given.")


class Timing(BaseModel):
    """The split of a step's time at the node it came in by (milliseconds; 0 for a part
    the step did not have)."""

    total_ms: float = Field(description="From the request to the reply, at that node.")
    queue_ms: float = Field(description="The wait for the device.")
    run_ms: float = Field(description="The model run.")
    forward_ms: float = Field(description="What the forward to the owner added.")


_REPLY_EXAMPLE: dict[str, Any] = {
    "outputs": {"actions": [[[0.06, -0.22], [0.1, 0.3], [0.0, 0.1], [0.2, 0.2]]]},
    "episode_id": "ep-42",
    "device": "gpu-a/0",
    "node": "gpu-a",
    "token": 1796000000000123,
    "routing": "hit",
    "state_reset": False,
    "degraded": False,
    "source": "model",
    "seq": 7,
    "replayed": False,
}
"""A one-row reply, the example of both reply bodies."""


class ActReply(BaseModel):
    """What a step returns; X-Affinity-* headers repeat the facts."""

    outputs: dict[str, Any] = Field(description="Output name -> nested list (or msgpack array).")
    episode_id: str | None
    device: str = Field(description="The device that served the step, e.g. gpu-a/1.")
    node: str
    token: int = Field(description="Fencing token of the assignment; echo it in the next step.")
    claim: str | None = Field(
        None, description="The claim id issued with the token; echo it in the next step."
    )
    routing: str = Field(description="hit | claimed | reassigned | stateless")
    state_reset: bool = Field(description="The episode's state started over with this step.")
    degraded: bool = Field(description="Routed by session_id for lack of an episode_id.")
    source: str = Field(description="model, or buffer for an action from the chunk buffer.")
    seq: int = Field(
        description="The step's number under its claim (0 for a stateless step); send this "
        "+ 1 as the next step's seq."
    )
    replayed: bool = Field(
        description="The stored reply of a step already applied (a retry of the last seq)."
    )
    model: str | None = Field(
        None, description="The name@version that served the step (as registered)."
    )
    rtc: Rtc | None = Field(
        None, description="What a real-time-chunking step ran with (models with rtc.* inputs)."
    )
    timing: Timing | None = Field(
        None, description="The split of the step's time, when asked (X-Affinity-Timing: 1)."
    )

    model_config = {"json_schema_extra": {"examples": [_REPLY_EXAMPLE]}}


class ActRows(BaseModel):
    """Many episodes' steps in one message: each row as a one-step body."""

    steps: list[ActRequest] = Field(
        description="One row per episode (a one-step body each), at most --max-rows (413 "
        "too_many_rows, refused before any row is decoded); an episode in two rows is 400 "
        "duplicate_episode. Each row keeps every guarantee of a one-row step.",
    )

    model_config = {
        "extra": "forbid",
        "json_schema_extra": {
            "examples": [
                {
                    "steps": [
                        {"episode_id": "robot-1", "inputs": {"obs": [[0.1] * 8]}, "seq": 7},
                        {"episode_id": "robot-2", "inputs": {"obs": [[0.2] * 8]}, "seq": 3},
                    ]
                }
            ]
        },
    }


class RowError(BaseModel):
    """What a one-row request would have been answered, as a row's error."""

    status: int = Field(description="The HTTP status a one-row request would have got.")
    code: str = Field(description="e.g. seq_conflict, bad_input, owner_unreachable.")
    message: str
    field: str | None = Field(None, description="The row's field at fault, when one is.")
    retry_after: int | None = Field(None, description="Seconds before a retry (503s).")


class ActRowError(BaseModel):
    """A row that failed; it never fails the rows beside it."""

    error: RowError


class ActRowsReply(BaseModel):
    """The rows' answers in the order of the request's rows (200 whatever each row's
    outcome)."""

    steps: list[ActReply | ActRowError] = Field(
        description="Each row's one-row reply body, or its error."
    )

    model_config = {
        "json_schema_extra": {
            "examples": [
                {
                    "steps": [
                        {**_REPLY_EXAMPLE, "episode_id": "robot-1"},
                        {
                            "error": {
                                "status": 409,
                                "code": "seq_conflict",
                                "message": "episode 'robot-2' has applied step 5; seq 3 is "
                                "neither the next (6) nor the last (a retry)",
                            }
                        },
                    ]
                }
            ]
        }
    }


def _schema(api: FastAPI) -> dict[str, Any]:
    """FastAPI's schema of ``api``'s routes, with ``POST /act`` and its two models."""
    schema = get_openapi(title=api.title, version=api.version, routes=api.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in (ActRequest, ActReply, ActRows, ActRowsReply):
        one = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(one.pop("$defs", {}))  # the models it holds: components of their own
        components[model.__name__] = one
    error_ref = {"description": "Error", "content": {"application/json": {}}}
    schema["paths"]["/act"] = {
        "post": {
            "summary": "One step of an episode, or many episodes' steps in one message",
            "description": act.__doc__,
            "operationId": "act",
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": _either("ActRequest", "ActRows")},
                    "application/msgpack": {"schema": {"type": "string", "format": "binary"}},
                },
            },
            "responses": {
                "200": {
                    "description": "The step's outputs and where it ran (a message of rows: "
                    "each row's, or its error, in order)",
                    "content": {
                        "application/json": {"schema": _either("ActReply", "ActRowsReply")},
                        "application/msgpack": {"schema": {"type": "string", "format": "binary"}},
                    },
                },
                "400": error_ref,
                "404": error_ref,
                "409": error_ref,
                "413": error_ref,
                "422": error_ref,
                "500": error_ref,
                "503": error_ref,
            },
        }
    }
    return schema


def _either(*models: str) -> dict[str, Any]:
    return {"oneOf": [{"$ref": f"#/components/schemas/{m}"} for m in models]}


def _cache(api: FastAPI, schema: dict[str, Any]) -> dict[str, Any]:
    api.openapi_schema = schema
    return schema
