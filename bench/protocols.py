"""The front doors compared on the camera-sized policy (``--model vla-demo``: two
``uint8[224,224,3]`` cameras and a ``float32[8]`` state per step), real processes on
loopback, one client in lockstep (the latency a robot sees), the same observations.

1. p50 of one step by protocol, each on its own sticky episode served locally (a Redis
   resolve and a model run per step): KServe v2 infer with binary inputs and binary
   outputs (Triton's rule, is the sequence live?, decided in the step's own resolve), the
   openpi websocket, msgpack ``POST /act``, JSON ``POST /act``, and v2 with JSON inputs. The
   bodies are encoded once before the clock starts (a raw keep-alive HTTP connection, a
   raw websocket), so the figures are the node's path and the transfer, not a client
   library's encoding. Ratios: v2 / msgpack ``/act``, v2 / websocket, JSON / msgpack
   ``/act`` (issue 11's figure), v2 with JSON inputs / JSON ``/act``, with the bytes each
   step puts on the wire.
2. The same step through the unmodified clients (``tritonclient.http``, openpi's
   ``WebsocketClientPolicy``), their own encoding and decoding included.
3. KServe v2 over gRPC (``--grpc-port``): ``ModelInfer`` (unary) and ``ModelStreamInfer``
   (one request, then its answer, on one long stream), each message serialized once before
   the clock starts (grpcio's own channel, no ``tritonclient``). Ratios: gRPC unary /
   msgpack ``/act``, streaming / unary.
4. The cost of Triton's unknown-sequence rule: a sequence owned by node A, stepped through
   node B (refuses unknown sequences, in its resolve) and through node C
   (``--kserve-claim-unknown``); both forward to A.

Within a round the protocols take turns step by step (so all meet the same load from
other processes on the machine); each figure is the median over ``--runs`` rounds of a
ratio (or difference) of the round's p50s.

Usage: python -m bench.protocols [--runs 5] [--steps 100]
"""

from __future__ import annotations

import argparse
import http.client
import queue
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import orjson
import tritonclient.http as th
import websockets.sync.client
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from affinity import wire
from bench.common import Node, RedisServer, free_port, median, pct, report, tmpdir
from node.protocols.kserve.pb import kserve_pb2 as pb

MODEL = "vla_demo"
INFER = f"/v2/models/{MODEL}/infer"
KINDS = ("v2", "ws", "msgpack", "json", "v2_json", "grpc", "grpc_stream")
SPARSE = {"json": 10, "v2_json": 10}
"""JSON bodies of camera observations take ~10-100x longer: they run every 10th cycle."""


def camera_steps(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``n`` observations in the model's shape for one step (batch axis of 1)."""
    rng = np.random.default_rng(seed)
    return [
        {
            "image": rng.integers(0, 256, (1, 224, 224, 3), dtype=np.uint8),
            "wrist_image": rng.integers(0, 256, (1, 224, 224, 3), dtype=np.uint8),
            "state": rng.standard_normal((1, 8)).astype(np.float32),
        }
        for _ in range(n)
    ]


def triton_inputs(obs: dict[str, np.ndarray], binary: bool = True) -> list[th.InferInput]:
    out = []
    for name, array in obs.items():
        tensor = th.InferInput(
            name, list(array.shape), "UINT8" if array.dtype == np.uint8 else "FP32"
        )
        out.append(tensor.set_data_from_numpy(array, binary_data=binary))
    return out


def openpi_observation(obs: dict[str, np.ndarray]) -> dict[str, Any]:
    """The observation as a LIBERO client sends it: unbatched, openpi's keys, a prompt."""
    return {
        "observation/image": obs["image"][0],
        "observation/wrist_image": obs["wrist_image"][0],
        "observation/state": obs["state"][0].astype(np.float64),
        "prompt": "put the bowl on the plate",
    }


class Http:
    """One keep-alive HTTP/1.1 connection (stdlib: no client-side cost worth measuring)."""

    def __init__(self, node: Node) -> None:
        self.conn = http.client.HTTPConnection(node.host, node.port, timeout=30)

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes, Any]:
        self.conn.request("POST", path, body, headers)
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{path}: {resp.status} {data[:300]!r}")
        return resp.status, data, resp.headers

    def close(self) -> None:
        self.conn.close()


Step = Callable[[int], tuple[int, int]]
"""Send step ``i``; return (request bytes, response bytes) on the wire (bodies/frames)."""


def v2_step(
    node: Node,
    obs: list[dict[str, np.ndarray]],
    sequence: str,
    *,
    start: bool = True,
    binary: bool = True,
) -> tuple[Step, Http]:
    """Steps of ``sequence`` through ``node``, started first unless ``start`` is False;
    inputs binary, or JSON ``data`` lists (outputs binary either way)."""
    conn = Http(node)
    bodies = []
    for o in obs:
        body, size = th.InferenceServerClient.generate_request_body(
            triton_inputs(o, binary=binary), sequence_id=sequence
        )
        headers = {} if size is None else {"Inference-Header-Content-Length": str(size)}
        bodies.append((body, headers))
    if start:
        first, size = th.InferenceServerClient.generate_request_body(
            triton_inputs(obs[0]), sequence_id=sequence, sequence_start=True
        )
        conn.post(INFER, first, {"Inference-Header-Content-Length": str(size)})

    def step(i: int) -> tuple[int, int]:
        body, headers = bodies[i % len(bodies)]
        _, data, _ = conn.post(INFER, body, headers)
        return len(body), len(data)

    return step, conn


def act_step(
    node: Node, obs: list[dict[str, np.ndarray]], episode: str, binary: bool
) -> tuple[Step, Http]:
    conn = Http(node)
    if binary:
        bodies = [wire.encode({"episode_id": episode, "inputs": o}) for o in obs]
        headers = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}
    else:
        bodies = [
            orjson.dumps({"episode_id": episode, "inputs": {k: v.tolist() for k, v in o.items()}})
            for o in obs
        ]
        headers = {"Content-Type": "application/json"}

    def step(i: int) -> tuple[int, int]:
        body = bodies[i % len(bodies)]
        _, data, _ = conn.post("/act", body, headers)
        return len(body), len(data)

    return step, conn


class Ws:
    """One websocket connection (websockets' sync client, as openpi-client uses it)."""

    def __init__(self, node: Node, episode: str) -> None:
        url = f"ws://{node.host}:{node.port}/?episode_id={episode}"
        self._cm = websockets.sync.client.connect(url, compression=None, max_size=None)
        self.conn = self._cm.__enter__()
        self.conn.recv()  # the metadata

    def close(self) -> None:
        self._cm.__exit__(None, None, None)


def ws_step(node: Node, obs: list[dict[str, np.ndarray]], episode: str) -> tuple[Step, Ws]:
    ws = Ws(node, episode)
    frames = [msgpack_numpy.packb(openpi_observation(o)) for o in obs]

    def step(i: int) -> tuple[int, int]:
        frame = frames[i % len(frames)]
        ws.conn.send(frame)
        reply = ws.conn.recv()
        if isinstance(reply, str):
            raise RuntimeError(f"websocket: {reply[:300]}")
        return len(frame), len(reply)

    return step, ws


def grpc_messages(
    obs: list[dict[str, np.ndarray]], sequence: str, start: bool = False
) -> list[bytes]:
    """One serialized ``ModelInferRequest`` per observation (raw contents)."""
    out = []
    for o in obs:
        msg = pb.ModelInferRequest(model_name=MODEL)
        msg.parameters["sequence_id"].string_param = sequence
        if start:
            msg.parameters["sequence_start"].bool_param = True
        for name, array in o.items():
            datatype = "UINT8" if array.dtype == np.uint8 else "FP32"
            msg.inputs.add(name=name, datatype=datatype, shape=array.shape)
            msg.raw_input_contents.append(array.tobytes())
        out.append(msg.SerializeToString())
    return out


class Grpc:
    """One channel; ``unary`` sends one serialized request, ``stream`` one request on the
    long-lived stream and waits for its answer."""

    def __init__(self, address: str) -> None:
        limit = 1 << 26
        self.channel = grpc.insecure_channel(
            address, options=[("grpc.max_receive_message_length", limit),
                              ("grpc.max_send_message_length", limit)]
        )  # fmt: skip
        same: Callable[[bytes], bytes] = lambda b: b  # noqa: E731
        method = "/inference.GRPCInferenceService/"
        self.unary = self.channel.unary_unary(
            method + "ModelInfer", request_serializer=same, response_deserializer=same
        )
        self._sent: queue.Queue[bytes | None] = queue.Queue()
        stream = self.channel.stream_stream(
            method + "ModelStreamInfer", request_serializer=same, response_deserializer=same
        )
        self._answers = stream(iter(self._sent.get, None))

    def stream(self, body: bytes) -> bytes:
        self._sent.put(body)
        answer: bytes = next(self._answers)
        if pb.ModelStreamInferResponse.FromString(answer).error_message:
            raise RuntimeError(pb.ModelStreamInferResponse.FromString(answer).error_message)
        return answer

    def close(self) -> None:
        self._sent.put(None)
        self.channel.close()


def grpc_step(
    address: str, obs: list[dict[str, np.ndarray]], sequence: str, *, streaming: bool
) -> tuple[Step, Grpc]:
    conn = Grpc(address)
    send = conn.stream if streaming else conn.unary
    send(grpc_messages(obs[:1], sequence, start=True)[0])
    bodies = grpc_messages(obs, sequence)

    def step(i: int) -> tuple[int, int]:
        body = bodies[i % len(bodies)]
        return len(body), len(send(body))

    return step, conn


def interleaved(
    calls: dict[str, Step], cycles: int, sparse: dict[str, int] | None = None, warm: int = 3
) -> tuple[dict[str, float], dict[str, tuple[int, int]]]:
    """Time one step of each call in turn, ``cycles`` times, rotating which goes first, so
    every protocol meets the same load (a call named in ``sparse`` only runs every n-th
    cycle). Returns each call's p50 in seconds and its last step's bytes."""
    sparse = sparse or {}
    names = list(calls)
    for i in range(warm):
        for name in names:
            calls[name](i)
    times: dict[str, list[float]] = {name: [] for name in names}
    sizes: dict[str, tuple[int, int]] = {}
    for i in range(cycles):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            if i % sparse.get(name, 1):
                continue
            started = time.perf_counter()
            sizes[name] = calls[name](i)
            times[name].append(time.perf_counter() - started)
    return {name: pct(t, 50) for name, t in times.items()}, sizes


def owned_by(entry: Node, owner_id: str, prefix: str) -> str:
    """A sequence id (started through ``entry``) whose episode lives on ``owner_id``."""
    client = th.InferenceServerClient(f"{entry.host}:{entry.port}")
    obs = triton_inputs(camera_steps(1, seed=99)[0])
    try:
        for k in range(100):
            result = client.infer(MODEL, obs, sequence_id=f"{prefix}-{k}", sequence_start=True)
            if result.get_response()["parameters"]["node"] == owner_id:
                return f"{prefix}-{k}"
    finally:
        client.close()
    raise RuntimeError(f"no sequence landed on {owner_id}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=100, help="timed steps of each protocol a round")
    a = p.parse_args()
    tmp = tmpdir()
    redis = RedisServer(tmp).start()
    # --keep-alive: each connection idles while the other protocols run; --max-batch 1: the
    # protocols take turns on one device, and a batching wait for the other (lockstep)
    # episodes would add the same delay to each and hide what the protocols cost
    extra = ["--model", "vla-demo", "--capacity", "1000", "--lease-ttl", "30",
             "--act-deadline", "30", "--access-log", "off", "--keep-alive", "600",
             "--max-batch", "1"]  # fmt: skip
    grpc_port = free_port()
    node_a = Node(tmp, "pa", redis.url, devices="cpu:1",
                  extra=[*extra, "--grpc-port", str(grpc_port)])  # fmt: skip
    node_b = Node(tmp, "pb", redis.url, devices="cpu:1", extra=extra)
    node_c = Node(tmp, "pc", redis.url, devices="cpu:1", extra=[*extra, "--kserve-claim-unknown"])
    obs = camera_steps(8)
    rounds: list[dict[str, float]] = []
    sizes: dict[str, tuple[int, int]] = {}
    try:
        node_a.start()
        # ---- 1 and 2: one node, every protocol served locally ----------------------------
        steps: dict[str, tuple[Step, Any]] = {
            "v2": v2_step(node_a, obs, "bench-v2"),
            "ws": ws_step(node_a, obs, "bench-ws"),
            "msgpack": act_step(node_a, obs, "bench-msgpack", binary=True),
            "json": act_step(node_a, obs, "bench-json", binary=False),
            "v2_json": v2_step(node_a, obs, "bench-v2-json", binary=False),
            "grpc": grpc_step(f"{node_a.host}:{grpc_port}", obs, "bench-grpc", streaming=False),
            "grpc_stream": grpc_step(
                f"{node_a.host}:{grpc_port}", obs, "bench-grpc-stream", streaming=True
            ),
        }
        triton = th.InferenceServerClient(f"{node_a.host}:{node_a.port}")
        triton_obs = [triton_inputs(o) for o in obs]
        triton.infer(MODEL, triton_obs[0], sequence_id="bench-tc", sequence_start=True)
        policy = WebsocketClientPolicy(f"ws://{node_a.host}:{node_a.port}/?episode_id=bench-pi")
        pi_obs = [openpi_observation(o) for o in obs]

        def via_tritonclient(i: int) -> tuple[int, int]:
            triton.infer(MODEL, triton_obs[i % len(obs)], sequence_id="bench-tc")
            return 0, 0

        def via_openpi_client(i: int) -> tuple[int, int]:
            policy.infer(pi_obs[i % len(obs)])
            return 0, 0

        calls = {kind: steps[kind][0] for kind in KINDS}
        calls |= {"tritonclient": via_tritonclient, "openpi_client": via_openpi_client}
        for run in range(a.runs):
            row, sizes = interleaved(calls, a.steps, sparse=SPARSE)
            rounds.append(row)
            print(f"round {run + 1}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in row.items()))
        for _, conn in steps.values():
            conn.close()
        triton.close()
        policy._ws.close()
        # ---- 3: Triton's unknown-sequence rule, node B (strict) vs node C (claims) -------
        node_b.start()
        node_c.start()
        sequence = owned_by(node_b, "pa", "bench-own")
        via_b, conn_b = v2_step(node_b, obs, sequence, start=False)
        via_c, conn_c = v2_step(node_c, obs, sequence, start=False)
        for row in rounds:
            p50s, _ = interleaved({"forwarded_strict": via_b, "forwarded_claim": via_c}, a.steps)
            row |= p50s
        conn_b.close()
        conn_c.close()
    finally:
        for node in (node_a, node_b, node_c):
            node.stop()
        redis.stop()

    def med(key: str) -> float:
        return median([r[key] for r in rounds])

    def ratio(top: str, bottom: str) -> float:
        return median([r[top] / r[bottom] for r in rounds])

    def ms(key: str) -> str:
        return f"{med(key) * 1e3:.2f} ms"

    def wire_kb(kind: str) -> str:
        sent, got = sizes[kind]
        return f"{sent / 1024:,.0f} KiB up, {got / 1024:,.1f} KiB down"

    v2_act, v2_ws, json_act = ratio("v2", "msgpack"), ratio("v2", "ws"), ratio("json", "msgpack")
    v2_json = ratio("v2_json", "json")
    tc_pi = ratio("tritonclient", "openpi_client")
    grpc_act, stream_unary = ratio("grpc", "msgpack"), ratio("grpc_stream", "grpc")
    lookup = median([(r["forwarded_strict"] - r["forwarded_claim"]) * 1e3 for r in rounds])
    figures = [
        {
            "figure": "KServe v2 infer p50 (binary in and out) / msgpack /act p50, vla-demo",
            "value": v2_act,
            "result": f"{v2_act:.2f}x ({ms('v2')} vs {ms('msgpack')})",
            "goal": "<= 1.1x",
            "ok": v2_act <= 1.1,
        },
        {
            "figure": "KServe v2 infer p50 / openpi websocket p50, vla-demo",
            "value": v2_ws,
            "result": f"{v2_ws:.2f}x ({ms('v2')} vs {ms('ws')})",
            "goal": "reported",
            "ok": True,
        },
        {
            "figure": "KServe v2 gRPC ModelInfer p50 (raw contents) / msgpack /act p50, vla-demo",
            "value": grpc_act,
            "result": f"{grpc_act:.2f}x ({ms('grpc')} vs {ms('msgpack')})",
            "goal": "reported",
            "ok": True,
        },
        {
            "figure": "KServe v2 gRPC ModelStreamInfer p50 / ModelInfer p50, vla-demo",
            "value": stream_unary,
            "result": f"{stream_unary:.2f}x ({ms('grpc_stream')} vs {ms('grpc')})",
            "goal": "reported",
            "ok": True,
        },
        {
            "figure": "JSON /act p50 / msgpack /act p50, same camera observations",
            "value": json_act,
            "result": f"{json_act:.2f}x ({ms('json')} vs {ms('msgpack')}); on the wire per "
            f"step: JSON {wire_kb('json')}, msgpack {wire_kb('msgpack')}",
            "goal": "reported",
            "ok": True,
        },
        {
            "figure": "KServe v2 infer p50 with JSON inputs / JSON /act p50, same observations",
            "value": v2_json,
            "result": f"{v2_json:.2f}x ({ms('v2_json')} vs {ms('json')}); v2 JSON "
            f"{wire_kb('v2_json')}",
            "goal": "reported",
            "ok": True,
        },
        {
            "figure": "bytes on the wire per step (request body/frame up, reply down)",
            "value": sizes["v2"][0],
            "result": "; ".join(f"{k} {wire_kb(k)}" for k in KINDS),
            "goal": "reported",
            "ok": True,
        },
        {
            "figure": "tritonclient.infer p50 / openpi-client infer p50 (each client's own "
            "encoding included)",
            "value": tc_pi,
            "result": f"{tc_pi:.2f}x ({ms('tritonclient')} vs {ms('openpi_client')})",
            "goal": "reported",
            "ok": True,
        },
        {
            "figure": "Triton's unknown-sequence rule: forwarded v2 p50 through a node that "
            "asks Redis - through one with --kserve-claim-unknown",
            "value": lookup,
            "result": f"{lookup:+.2f} ms ({ms('forwarded_strict')} vs {ms('forwarded_claim')})",
            "goal": "reported",
            "ok": True,
        },
    ]
    report("protocols", figures, {"rounds": rounds, "bytes": sizes, "steps": a.steps})


if __name__ == "__main__":
    main()
