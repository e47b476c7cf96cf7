"""The baseline of the /act throughput figure: a minimal FastAPI app that runs the same
ONNX session on the same device with no affinity logic (no Redis, no routing, no state),
on the node's server stack (uvicorn with uvloop and httptools).

Run: python -m bench.baseline_app PORT [WORKERS] (WORKERS > 1: uvicorn's worker processes,
the stateless ceiling of Python HTTP on that many cores, beside ``--front-doors``)
"""

from __future__ import annotations

import sys

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from node.contract import load_contract
from node.devices import discover
from node.models import DEMO_MODEL
from node.providers import ProviderSettings, build_session

contract = load_contract(DEMO_MODEL)
session = build_session(DEMO_MODEL, discover("cpu:1")[0], ProviderSettings()).session
state = contract.initial_state()
names = [o.name for o in contract.outputs]
app = FastAPI()


@app.post("/act")
async def act(request: Request) -> JSONResponse:
    body = await request.json()
    obs = np.asarray(body["inputs"]["obs"], dtype=np.float32)
    actions, _ = session.run(names, {"obs": obs, **state})
    return JSONResponse({"outputs": {"actions": actions.tolist()}})


@app.get("/readyz")
async def readyz() -> JSONResponse:
    return JSONResponse({"ready": True})


if __name__ == "__main__":
    workers = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    uvicorn.run(
        app if workers == 1 else "bench.baseline_app:app",
        workers=workers,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
    )
