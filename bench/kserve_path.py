"""The node's KServe infer path in process: one sequence step as ``tritonclient.http`` sends
it (binary tensors, sequence parameters) through the node's ASGI app vs the same step as a
JSON ``POST /act`` through the same app, both called directly (no sockets, no HTTP
parsing, no client), taking turns step by step on uvloop, 64 sequences in turn.

What KServe adds over ``/act`` is the v2 wire (decoding the JSON header and the binary
tensors, Triton's parameters, the reply's JSON header and binary outputs); the step itself
(routing, the owner's record, the run) is the same. ``--profile`` prints cProfile's top
functions of the KServe steps instead.

Usage: python -m bench.kserve_path [--rounds 15] [--steps 1000] [--models demo,vla-demo]
       [--profile]
"""

from __future__ import annotations

import cProfile
import pstats
import time
from typing import Any

import numpy as np
import tritonclient.http as th
import uvloop

from bench.asgi import Connection, post, running_node
from bench.common import median, options, report
from node.catalog import parse_model_arg

SEQUENCES = 64
OBS = np.array([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]], np.float32)
ACT = (
    b'{"episode_id":"act-%d","model":"demo_policy",'
    b'"inputs":{"obs":[[0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8]]}}'
)
MODEL = "demo_policy"


def kserve_body(sequence: int, start: bool) -> tuple[bytes, int]:
    """The body ``tritonclient.http`` sends for one step, and its JSON header's length."""
    tensor = th.InferInput("obs", [1, 8], "FP32").set_data_from_numpy(OBS)
    body, length = th.InferenceServerClient.generate_request_body(
        [tensor], sequence_id=sequence, sequence_start=start
    )
    return body, length


class Steps:
    """Pre-built bodies of both kinds, for 64 sequences."""

    def __init__(self) -> None:
        self.kserve = []
        for n in range(SEQUENCES):
            body, length = kserve_body(n + 1, False)
            headers = [(b"content-type", b"application/octet-stream"),
                       (b"inference-header-content-length", str(length).encode())]  # fmt: skip
            self.kserve.append((body, headers))
        self.act = [(ACT % n, [(b"content-type", b"application/json")]) for n in range(SEQUENCES)]

    async def interleaved(self, app: Any, steps: int, connection: Connection) -> dict[str, float]:
        """``steps`` steps of each kind, taking turns step by step (both meet the same
        machine); the mean µs a step of each."""
        spent = {"kserve": 0.0, "act": 0.0}
        path = {"kserve": f"/v2/models/{MODEL}/infer", "act": "/act"}
        for n in range(steps):
            for kind in ("kserve", "act") if n % 2 else ("act", "kserve"):
                body, headers = (self.kserve if kind == "kserve" else self.act)[n % SEQUENCES]
                began = time.perf_counter()
                await post(app, path[kind], body, headers, connection)
                spent[kind] += time.perf_counter() - began
        return {f"{kind}_us": total / steps * 1e6 for kind, total in spent.items()}

    async def run(self, app: Any, kind: str, steps: int, connection: Connection) -> float:
        path = f"/v2/models/{MODEL}/infer" if kind == "kserve" else "/act"
        bodies = self.kserve if kind == "kserve" else self.act
        started = time.perf_counter()
        for n in range(steps):
            body, headers = bodies[n % SEQUENCES]
            await post(app, path, body, headers, connection)
        return (time.perf_counter() - started) / steps * 1e6


async def _measure(rounds: int, steps: int, models: list[str], profile: bool) -> list[Any]:
    served = tuple(parse_model_arg(m) for m in models)
    connection = Connection()
    work = Steps()
    results: list[Any] = []
    async with running_node(models=served) as app:
        for n in range(SEQUENCES):  # every sequence started
            body, length = kserve_body(n + 1, True)
            headers = [(b"inference-header-content-length", str(length).encode())]
            await post(app, f"/v2/models/{MODEL}/infer", body, headers, connection)
        await work.run(app, "act", 2 * SEQUENCES, connection)
        await work.run(app, "kserve", 2 * SEQUENCES, connection)
        if profile:
            profiler = cProfile.Profile()
            profiler.enable()
            await work.run(app, "kserve", steps, connection)
            profiler.disable()
            stats = pstats.Stats(profiler)
            stats.sort_stats("tottime").print_stats(30)
            shown = "kserve|catalog|service.py|asgi|orjson|numpy"
            stats.sort_stats("cumulative").print_stats(shown, 40)
            return results
        for _ in range(rounds):
            results.append(await work.interleaved(app, steps, connection))
    return results


def main() -> None:
    a = options(rounds=15, steps=1000, models="demo", profile=False)
    rounds = uvloop.run(_measure(a.rounds, a.steps, a.models.split(","), a.profile))
    if a.profile:
        return
    ratio = median([r["kserve_us"] / r["act_us"] for r in rounds])
    added = median([r["kserve_us"] - r["act_us"] for r in rounds])
    kserve, act = median([r["kserve_us"] for r in rounds]), median([r["act_us"] for r in rounds])
    report(
        "kserve_path",
        [
            {
                "figure": f"sticky KServe infer in process / sticky JSON /act, same node "
                f"(--model {a.models})",
                "value": ratio,
                "result": f"{ratio:.2f}x ({kserve:.0f} µs vs {act:.0f} µs a step; {added:+.0f} µs)",
                "goal": "reported",
                "ok": True,
            }
        ],
        {"rounds": rounds},
    )


if __name__ == "__main__":
    main()
