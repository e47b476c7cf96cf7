"""A real Triton beside a node, on the same work, driven by the same client.

Triton: the ``tritonserver`` 2.51 binary that the PyPI package ``nvidia-pytriton`` 0.7.0
bundles with its Python backend, run from the unpacked wheel (downloaded once with pip into
``--cache``, never installed), serving a model repository written here: for each model a
``backend: "python"`` model whose ``model.py`` runs the node's ONNX file with ONNX Runtime
(one intra-op thread, as the node), ``sequence_batching`` with the ``oldest`` strategy and
START/END/READY/CORRID control inputs, the recurrent state kept per CORRID, the steps of
one ``execute`` call run as one batch (as the node batches steps of different episodes),
two CPU instances. The node: ``--model demo --model vla-demo --devices cpu:2`` with a real
Redis, no access log (Triton logs no request by default).

Both are driven with ``tritonclient.http`` (binary tensors, every output), each step of a
sequence after a START, an END at the end:

1. lockstep: one sequence on each server, one step at a time, the two servers' steps
   taking turns (the machine's load changes by the second; both meet the same); p50 and
   p99;
2. load: 16 sequences in lockstep each, from ``--procs`` client processes, for
   ``--seconds``: steps/s, and the server's CPU per step (``/proc``: Triton with its
   Python backend stubs, the node's one process);
3. parity: one sequence's outputs from both, bit for bit; and PyTriton's own
   ``ModelClient`` (config first, then ``infer_sample``/``infer_batch``) against the node.

Rounds alternate the servers (and which goes first); every figure is the median over
``--rounds`` of the node / Triton ratio measured in the same round.

Usage: python -m bench.triton [--rounds 5] [--seconds 4] [--steps 300] [--procs 4]
       [--models demo_policy,vla_demo] [--cache ~/.cache/affinity-bench]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.common import (
    ROOT,
    Node,
    RedisServer,
    cpu_seconds,
    free_port,
    median,
    pct,
    report,
    tmpdir,
    wait_until,
)
from node.policy import load_contract

WHEEL = "nvidia-pytriton==0.7.0"
MODELS = {"demo_policy": "demo", "vla_demo": "vla-demo"}
"""Model name -> the node's --model for it (the ONNX file is node/models/<name>.onnx)."""
SEQUENCES = 16

MODEL_PY = '''
import json

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """One ONNX policy; the recurrent state (state_in.* <- state_out.*) kept per CORRID."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        path = config["parameters"]["onnx"]["string_value"]
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        inputs = self.session.get_inputs()
        self.observations = [i.name for i in inputs if not i.name.startswith("state_in.")]
        self.state = {i.name: ([d for d in i.shape[1:]], np.float32)
                      for i in inputs if i.name.startswith("state_in.")}
        self.names = [o.name for o in self.session.get_outputs()]
        self.returned = [n for n in self.names if not n.startswith("state_out.")]
        self.states = {}

    def execute(self, requests):
        corrids, ends, feeds = [], [], {n: [] for n in [*self.observations, *self.state]}
        for request in requests:
            get = lambda name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()
            corrid = int(get("CORRID").reshape(-1)[0])
            start = int(get("START").reshape(-1)[0])
            kept = None if start else self.states.get(corrid)
            for name in self.observations:
                feeds[name].append(get(name))
            for name, (shape, dtype) in self.state.items():
                feeds[name].append(kept[name] if kept else np.zeros([1, *shape], dtype))
            corrids.append(corrid)
            ends.append(int(get("END").reshape(-1)[0]))
        batch = {name: np.concatenate(parts) for name, parts in feeds.items()}
        outputs = dict(zip(self.names, self.session.run(None, batch)))
        responses = []
        for i, (corrid, end) in enumerate(zip(corrids, ends)):
            if end:
                self.states.pop(corrid, None)
            else:
                self.states[corrid] = {
                    name: outputs["state_out." + name[len("state_in."):]][i:i + 1]
                    for name in self.state
                }
            tensors = [pb_utils.Tensor(n, outputs[n][i:i + 1]) for n in self.returned]
            responses.append(pb_utils.InferenceResponse(tensors))
        return responses
'''

_TYPES = {"float32": "TYPE_FP32", "uint8": "TYPE_UINT8", "int64": "TYPE_INT64",
          "int32": "TYPE_INT32", "float64": "TYPE_FP64", "bool": "TYPE_BOOL"}  # fmt: skip


# ---- setting Triton up ------------------------------------------------------------------


def unpacked_triton(cache: Path) -> Path:
    """The ``tritonserver`` directory of the unpacked ``nvidia-pytriton`` wheel under
    ``cache`` (downloaded with pip and unzipped the first time), with the Python backend's
    stub for this interpreter's version (3.8 to 3.13) in place."""
    root = cache / "pytriton-0.7.0"
    server = root / "pytriton" / "tritonserver"
    if not (server / "bin" / "tritonserver").exists():
        wheels = cache / "wheels"
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "-d", str(wheels), WHEEL], check=True)  # fmt: skip
        (wheel,) = wheels.glob("nvidia_pytriton-0.7.0-*.whl")
        with zipfile.ZipFile(wheel) as z:
            z.extractall(root)
    binary = server / "bin" / "tritonserver"
    stub = server / "backends" / "python" / "triton_python_backend_stub"
    if not stub.exists():
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        shutil.copy(server / "python_backend_stubs" / version / stub.name, stub)
    for path in (binary, stub):
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return server


def model_repository(where: Path, models: list[str]) -> Path:
    """A Triton model repository under ``where`` serving ``models`` (see the module doc)."""
    repo = where / "repository"
    for name in models:
        contract = load_contract(ROOT / "node" / "models" / f"{name}.onnx")

        def tensor(spec: Any) -> str:
            dims = ", ".join(str(d) for d in spec.shape[1:])
            return f'{{ name: "{spec.name}" data_type: {_TYPES[spec.dtype]} dims: [ {dims} ] }}'

        inputs = ", ".join(tensor(s) for s in contract.observation_inputs)
        outputs = ", ".join(tensor(s) for s in contract.returned_outputs)
        flags = "\n".join(
            f'    {{ name: "{n}" control [ {{ kind: CONTROL_SEQUENCE_{k} '
            "int32_false_true: [ 0, 1 ] } ] },"
            for n, k in (("START", "START"), ("END", "END"), ("READY", "READY"))
        )
        onnx = ROOT / "node" / "models" / f"{name}.onnx"
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
        (repo / name / "1" / "model.py").write_text(MODEL_PY)
        (repo / name / "config.pbtxt").write_text(f"""name: "{name}"
backend: "python"
max_batch_size: 8
input [ {inputs} ]
output [ {outputs} ]
sequence_batching {{
  max_sequence_idle_microseconds: 300000000
  oldest {{
    max_candidate_sequences: 64 preferred_batch_size: [ 8 ] max_queue_delay_microseconds: 0
  }}
  control_input [
{flags}
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }} ] }}
  ]
}}
instance_group [ {{ count: 2 kind: KIND_CPU }} ]
parameters {{ key: "onnx" value: {{ string_value: "{onnx}" }} }}
""")
    return repo


class Triton:
    """A ``tritonserver`` process on loopback."""

    def __init__(self, server: Path, repo: Path, log: Path) -> None:
        self.http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
        self.url = f"127.0.0.1:{self.http_port}"
        # the Python backend's stub embeds Python 3.11 and finds numpy and onnxruntime through
        # the first python3 on PATH: this venv's
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        argv = [str(server / "bin" / "tritonserver"), f"--model-repository={repo}",
                f"--backend-directory={server / 'backends'}", f"--http-port={self.http_port}",
                f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}",
                "--allow-metrics=false", "--http-address=127.0.0.1",
                "--grpc-address=127.0.0.1"]  # fmt: skip
        self.log = log
        self.proc = subprocess.Popen(argv, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"tritonserver exited:\n{self.log.read_text()[-3000:]}")
        try:
            return httpx.get(f"http://{self.url}/v2/health/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def pids(self) -> list[int]:
        """The server and its children (the Python backend's stubs)."""
        children = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[1]) == self.proc.pid:
                    children.append(int(entry.name))
        return [self.proc.pid, *children]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ---- the load -----------------------------------------------------------------------------


def observations(model: str, seed: int) -> list[tuple[str, str, np.ndarray]]:
    """One step's inputs of ``model``: (name, datatype, array), batch axis of 1."""
    rng = np.random.default_rng(seed)
    contract = load_contract(ROOT / "node" / "models" / f"{model}.onnx")
    out = []
    for spec in contract.observation_inputs:
        shape = [1, *(d if isinstance(d, int) else 1 for d in spec.shape[1:])]
        if spec.dtype == "uint8":
            array = rng.integers(0, 256, shape).astype(np.uint8)
        else:
            array = rng.standard_normal(shape).astype(spec.dtype)
        out.append((spec.name, _TYPES[spec.dtype].removeprefix("TYPE_"), array))
    return out


def _sequence(url: str, model: str, sequence: int, until: float, steps: int,
              seed: int) -> list[float]:  # fmt: skip
    """Step one sequence in lockstep until ``until`` (monotonic) or ``steps`` steps, then
    END it; the latency of each step before the END, in seconds."""
    import tritonclient.http as th

    client = th.InferenceServerClient(url, connection_timeout=30, network_timeout=30)
    inputs = [th.InferInput(name, list(a.shape), datatype).set_data_from_numpy(a)
              for name, datatype, a in observations(model, seed)]  # fmt: skip
    latencies: list[float] = []
    try:
        while len(latencies) < steps and time.monotonic() < until:
            began = time.perf_counter()
            client.infer(model, inputs, sequence_id=sequence, sequence_start=not latencies)
            latencies.append(time.perf_counter() - began)
        client.infer(model, inputs, sequence_id=sequence, sequence_end=True)
    finally:
        client.close()
    return latencies


def lockstep(urls: dict[str, str], model: str, first_sequence: int, steps: int,
             seed: int) -> dict[str, list[float]]:  # fmt: skip
    """One sequence on each server, stepped in turn (which one first alternates each
    step), so that both meet the same machine; each step's latency in seconds, per server,
    the END of each sequence not counted."""
    import tritonclient.http as th

    clients = {who: th.InferenceServerClient(url) for who, url in urls.items()}
    inputs = [th.InferInput(name, list(a.shape), datatype).set_data_from_numpy(a)
              for name, datatype, a in observations(model, seed)]  # fmt: skip
    sequences = {who: first_sequence + i for i, who in enumerate(urls)}
    latencies: dict[str, list[float]] = {who: [] for who in urls}
    order = list(urls)
    try:
        for step in range(steps):
            for who in order if step % 2 else order[::-1]:
                began = time.perf_counter()
                clients[who].infer(model, inputs, sequence_id=sequences[who],
                                   sequence_start=step == 0)  # fmt: skip
                latencies[who].append(time.perf_counter() - began)
        for who, client in clients.items():
            client.infer(model, inputs, sequence_id=sequences[who], sequence_end=True)
    finally:
        for client in clients.values():
            client.close()
    return latencies


def _process(url: str, model: str, sequences: list[int], start_at: float, seconds: float,
             out: Any) -> None:  # fmt: skip
    """A client process: one thread per sequence, all starting at ``start_at`` (wall time)."""
    results: list[list[float]] = []
    time.sleep(max(0.0, start_at - time.time()))
    until = time.monotonic() + seconds
    cpu = time.process_time()

    def run(sequence: int) -> None:
        results.append(_sequence(url, model, sequence, until, 10**9, sequence))

    threads = [threading.Thread(target=run, args=(s,)) for s in sequences]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(([len(r) for r in results], time.process_time() - cpu))


def load(url: str, model: str, first_sequence: int, seconds: float, procs: int,
         pids: list[int]) -> tuple[float, float, float]:  # fmt: skip
    """Steps/s of :data:`SEQUENCES` sequences from ``procs`` processes, the CPU of ``pids``
    per step and the client processes' CPU per step (seconds)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ids = list(range(first_sequence, first_sequence + SEQUENCES))
    start_at = time.time() + 3.0  # the processes import tritonclient first
    workers = [
        ctx.Process(target=_process, args=(url, model, ids[i::procs], start_at, seconds, out))
        for i in range(procs)
    ]
    for w in workers:
        w.start()
    time.sleep(max(0.0, start_at - time.time()))
    cpu_before = sum(cpu_seconds(p) for p in pids)
    answers = [out.get(timeout=seconds + 120) for _ in workers]
    cpu = sum(cpu_seconds(p) for p in pids) - cpu_before
    for w in workers:
        w.join()
    steps = sum(n for counts, _ in answers for n in counts)
    client = sum(seconds for _, seconds in answers)
    return steps / seconds, cpu / max(steps, 1), client / max(steps, 1)


MODEL_CLIENT_NEEDS = ("typing_inspect", "wrapt", "sh", "pyzmq", "typer", "importlib_metadata")
"""What PyTriton's client package imports beside tritonclient (its wheel's Requires-Dist)."""


def model_client_check(cache: Path, url: str, models: list[str]) -> str:
    """PyTriton's own ``ModelClient`` (from the unpacked wheel; its other imports installed
    with pip under ``cache``, not into this environment) against ``url``: it reads the
    model configuration, then ``infer_sample`` and ``infer_batch``. A summary per model,
    or what failed. ``ModelClient`` sends no sequence parameters (``tritonclient`` refuses
    ``sequence_id`` among ``parameters``), so these are stateless steps."""
    deps = cache / "pytriton-client-deps"
    if not deps.exists():
        installed = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target",
                                    str(deps), *MODEL_CLIENT_NEEDS])  # fmt: skip
        if installed.returncode != 0:
            shutil.rmtree(deps, ignore_errors=True)
            return "FAILED: pip could not install " + ", ".join(MODEL_CLIENT_NEEDS)
    script = f"""
import sys
import numpy as np
sys.path[:0] = [{str(deps)!r}, {str(cache / "pytriton-0.7.0")!r}]
from pytriton.client import ModelClient
for model in {models!r}:
    with ModelClient({url!r}, model, init_timeout_s=60) as client:
        config = client.model_config
        sample = {{i.name: np.zeros(i.shape, i.dtype) for i in config.inputs}}
        one = client.infer_sample(**sample)
        batch = client.infer_batch(**{{k: v[np.newaxis] for k, v in sample.items()}})
        print(model, "max_batch_size", config.max_batch_size,
              {{k: v.shape for k, v in one.items()}}, {{k: v.shape for k, v in batch.items()}})
"""
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    if done.returncode != 0:
        return "FAILED: " + done.stderr.strip().splitlines()[-1][:300]
    return "; ".join(done.stdout.strip().splitlines())


def parity(triton: str, node: str, model: str, steps: int = 20) -> bool:
    """Whether one sequence's outputs (``steps`` steps, new observations each) are the same,
    bit for bit, from both servers."""
    import tritonclient.http as th

    outputs = []
    for url in (triton, node):
        client = th.InferenceServerClient(url)
        got = []
        for i in range(steps):
            inputs = [th.InferInput(n, list(a.shape), d).set_data_from_numpy(a)
                      for n, d, a in observations(model, 1000 + i)]  # fmt: skip
            r = client.infer(model, inputs, sequence_id=424242, sequence_start=i == 0,
                             sequence_end=i == steps - 1)  # fmt: skip
            try:
                got.append({o["name"]: r.as_numpy(o["name"]).tobytes()
                            for o in r.get_response()["outputs"]})  # fmt: skip
            except ValueError as exc:  # the client could not read the reply
                print(f"{url}: {exc}: {r.get_response()}", flush=True)
                got.append({})
        client.close()
        outputs.append(got)
    return outputs[0] == outputs[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=300, help="lockstep steps per round")
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "affinity-bench")
    p.add_argument("--node-args", default="", help="extra flags for the node")
    p.add_argument("--embedded", action="store_true",
                   help="the node on its embedded store, no redis-server")  # fmt: skip
    a = p.parse_args()
    models = a.models.split(",")
    server = unpacked_triton(a.cache)
    tmp = tmpdir()
    triton = Triton(server, model_repository(tmp, models), tmp / "tritonserver.log")
    redis = None if a.embedded else RedisServer(tmp).start()
    extra = ["--lease-ttl", "30", "--capacity", "100"]
    for m in models:
        extra += ["--model", MODELS[m]]
    extra += a.node_args.split()
    node = Node(tmp, "bench", redis.url if redis else "", devices="cpu:2", extra=extra,
                env={"AFFINITY_ACCESS_LOG": "off"})  # fmt: skip
    if a.embedded:  # the node's argv without --redis URL
        at = node.proc.argv.index("--redis")
        del node.proc.argv[at : at + 2]
    rounds: dict[str, list[dict[str, float]]] = {m: [] for m in models}
    same: dict[str, bool] = {}
    try:
        node.start()
        wait_until(triton.ready, 120, "tritonserver ready")
        assert node.proc.popen is not None
        urls = {"triton": triton.url, "node": f"{node.host}:{node.port}"}
        pids = {"triton": triton.pids(), "node": [node.proc.popen.pid]}
        sequence = 1
        for m in models:
            same[m] = parity(urls["triton"], urls["node"], m)
        client_check = model_client_check(a.cache, f"http://{urls['node']}", models)
        print("PyTriton ModelClient against the node:", client_check, flush=True)
        for m in models:
            for url in urls.values():  # warm up both
                _sequence(url, m, sequence, time.monotonic() + 2, 50, 0)
                sequence += 1
        for r in range(a.rounds):
            for m in models:
                row: dict[str, float] = {}
                order = ("triton", "node") if r % 2 == 0 else ("node", "triton")
                steps = a.steps if m == "demo_policy" else max(50, a.steps // 4)
                for who, lat in lockstep(urls, m, sequence, steps, r).items():
                    row[f"p50_{who}"], row[f"p99_{who}"] = pct(lat, 50), pct(lat, 99)
                sequence += 2
                for who in order:
                    rate, cpu, client = load(urls[who], m, sequence, a.seconds, a.procs,
                                             pids[who])  # fmt: skip
                    sequence += SEQUENCES
                    row[f"rps_{who}"], row[f"cpu_{who}_us"] = rate, cpu * 1e6
                    row[f"client_{who}_us"] = client * 1e6
                rounds[m].append(row)
                print(m, {k: round(v, 6) for k, v in row.items()}, flush=True)
    finally:
        node.stop()
        triton.stop()
        if redis is not None:
            redis.stop()
    figures = []
    for m in models:
        rs = rounds[m]

        def ratio(key: str, rs: list[dict[str, float]] = rs) -> float:
            return median([r[f"{key}_node"] / r[f"{key}_triton"] for r in rs])

        def both(key: str, scale: float, unit: str, rs: list[dict[str, float]] = rs) -> str:
            n = median([r[f"{key}_node"] for r in rs]) * scale
            t = median([r[f"{key}_triton"] for r in rs]) * scale
            return f"{n:.3g} vs {t:.3g} {unit}"

        tp = median([r["rps_node"] / r["rps_triton"] for r in rs])
        cpu = median([r["cpu_node_us"] / r["cpu_triton_us"] for r in rs])
        figures += [
            {"figure": f"{m}: throughput, {SEQUENCES} sequences from {a.procs} processes, "
                       "node / Triton", "value": tp,
             "result": f"{tp:.2f}x ({both('rps', 1, 'steps/s')})", "goal": ">= 1.0x",
             "ok": tp >= 1.0},
            {"figure": f"{m}: server CPU per step under that load, node / Triton", "value": cpu,
             "result": f"{cpu:.2f}x ({median([r['cpu_node_us'] for r in rs]):.0f} vs "
                       f"{median([r['cpu_triton_us'] for r in rs]):.0f} µs)",
             "goal": "<= 1.0x", "ok": cpu <= 1.0},
            {"figure": f"{m}: lockstep p50, node / Triton", "value": ratio("p50"),
             "result": f"{ratio('p50'):.2f}x ({both('p50', 1e3, 'ms')})", "goal": "<= 1.0x",
             "ok": ratio("p50") <= 1.0},
            {"figure": f"{m}: lockstep p99, node / Triton", "value": ratio("p99"),
             "result": f"{ratio('p99'):.2f}x ({both('p99', 1e3, 'ms')})", "goal": "<= 1.2x",
             "ok": ratio("p99") <= 1.2},
            {"figure": f"{m}: outputs of one sequence, node vs Triton", "value": same[m],
             "result": "bit-identical" if same[m] else "DIFFERENT", "goal": "bit-identical",
             "ok": same[m]},
        ]  # fmt: skip
    figures.append(
        {"figure": "PyTriton's ModelClient against the node (config, infer_sample, infer_batch)",
         "value": not client_check.startswith("FAILED"), "result": client_check,
         "goal": "works", "ok": not client_check.startswith("FAILED")}
    )  # fmt: skip
    report("triton", figures, {"rounds": rounds})


if __name__ == "__main__":
    main()
