"""The baseline of the websocket figure: a minimal single-process openpi-style policy
server — openpi's own shape (one ``websockets`` server, metadata on connect, then
msgpack observation in, msgpack actions out, ``server_timing`` beside them) running the same
ONNX session on the same device, with the recurrent state kept per connection. No Redis,
no routing, no other hosts: what one GPU box with openpi's server costs per step.

Run: python -m bench.openpi_baseline PORT [MODEL]
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import websockets.asyncio.server

from affinity import wire
from node.contract import load_contract
from node.devices import discover
from node.inputs import from_observation, outputs_unbatched
from node.models import resolve_model
from node.providers import ProviderSettings, build_session


async def main(port: int, model: str) -> None:
    path = resolve_model(model)
    contract = load_contract(path)
    session = build_session(path, discover("cpu:1")[0], ProviderSettings()).session
    names = [o.name for o in contract.outputs]

    async def handler(ws: Any) -> None:
        await ws.send(wire.encode(dict(contract.metadata)))
        state = contract.initial_state()
        while True:
            try:
                data = await ws.recv()
            except websockets.ConnectionClosed:
                return
            started = time.monotonic()
            observation = wire.decode(data)
            feed = {**from_observation(contract, observation).inputs, **state}
            outputs = dict(zip(names, session.run(names, feed), strict=True))
            state = {name: outputs[out] for name, out in contract.state.items()}
            visible = {k: v for k, v in outputs.items() if k not in contract.state.values()}
            reply = {
                **outputs_unbatched(contract, visible),
                "server_timing": {"infer_ms": (time.monotonic() - started) * 1000},
            }
            await ws.send(wire.encode(reply))

    async with websockets.asyncio.server.serve(
        handler, "127.0.0.1", port, compression=None, max_size=None
    ):
        await asyncio.Future()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "vla-demo"))
