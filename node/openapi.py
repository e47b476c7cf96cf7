"""The OpenAPI document (``/docs``): FastAPI's routes, plus the hot ``POST /act``.

``/act`` is a plain ASGI handler (``node/protocols/act.py``) that FastAPI never sees, so
its request and reply are described here by hand. Hazard: they must follow act.py's wire.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

from node.protocols import act

__all__ = ["ActReply", "ActRequest", "document_act"]


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

    model_config = {
        "extra": "forbid",
        "json_schema_extra": {
            "examples": [{"episode_id": "ep-42", "inputs": {"obs": [[0.1] * 8]}, "token": 17}]
        },
    }


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

    model_config = {
        "json_schema_extra": {
            "examples": [
                {
                    "outputs": {"actions": [[[0.06, -0.22], [0.1, 0.3], [0.0, 0.1], [0.2, 0.2]]]},
                    "episode_id": "ep-42",
                    "device": "gpu-a/0",
                    "node": "gpu-a",
                    "token": 1796000000000123,
                    "routing": "hit",
                    "state_reset": False,
                    "degraded": False,
                    "source": "model",
                }
            ]
        }
    }


def _schema(api: FastAPI) -> dict[str, Any]:
    """FastAPI's schema of ``api``'s routes, with ``POST /act`` and its two models."""
    schema = get_openapi(title=api.title, version=api.version, routes=api.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in (ActRequest, ActReply):
        components[model.__name__] = model.model_json_schema(
            ref_template="#/components/schemas/{model}"
        )
    error_ref = {"description": "Error", "content": {"application/json": {}}}
    schema["paths"]["/act"] = {
        "post": {
            "summary": "One step of an episode",
            "description": act.__doc__,
            "operationId": "act",
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ActRequest"}},
                    "application/msgpack": {"schema": {"type": "string", "format": "binary"}},
                },
            },
            "responses": {
                "200": {
                    "description": "The step's outputs and where it ran",
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/ActReply"}},
                        "application/msgpack": {"schema": {"type": "string", "format": "binary"}},
                    },
                },
                "400": error_ref,
                "413": error_ref,
                "422": error_ref,
                "500": error_ref,
                "503": error_ref,
            },
        }
    }
    return schema


def _cache(api: FastAPI, schema: dict[str, Any]) -> dict[str, Any]:
    api.openapi_schema = schema
    return schema
