"""/act p50/p99 on CPU, CUDA and CUDA graph, for each policy; and the step with recurrent state
kept on the device vs copied through the host. Run by ``bench/gpu_check.sh``.

Each configuration is one real ``affinity-node`` process (the embedded store, no Redis needed:
a GPU host without network may have no redis-server) serving one device; one client sends
sequential ``/act`` calls of one episode (a sticky hit each time), inputs of the model's
contract (``GET /model``), msgpack when the node takes it, else JSON. Ratios are against the
CPU configuration of the same policy, measured in the same run. ``--dry-run`` (a CPU-only host)
measures the CPU configurations only and the state figure on the CPU.

Usage: python -m bench.gpu_act [--models a.onnx,b.onnx] [--requests 300] [--budget 20]
                               [--dry-run]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.common import RESULTS, ROOT, free_port, pct, tmpdir, wait_until

MODELS_DIR = ROOT / "node" / "models"
DEFAULT_MODELS = ("demo_policy.onnx", "vla_demo.onnx")  # the second once it exists
CONFIGS = {"cpu": ["--devices", "cpu:1"], "cuda": ["--devices", "0"]}
CONFIGS["cuda-graph"] = [*CONFIGS["cuda"], "--cuda-graph"]


def sample(spec: dict[str, Any], rng: np.random.Generator) -> np.ndarray[Any, Any]:
    shape = tuple(d if isinstance(d, int) else 1 for d in spec["shape"])
    dtype = np.dtype(spec["dtype"])
    if dtype.kind == "f":
        return rng.uniform(-1, 1, shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(dtype)
    return rng.integers(0, 100, shape).astype(dtype)


def bodies(contract: dict[str, Any]) -> tuple[bytes | None, bytes]:
    """(msgpack body in openpi's array encoding, or None without msgpack; JSON body)."""
    rng = np.random.default_rng(0)
    arrays = {spec["name"]: sample(spec, rng) for spec in contract["inputs"]}
    as_json = json.dumps(
        {"episode_id": "bench", "inputs": {k: v.tolist() for k, v in arrays.items()}}
    ).encode()
    try:
        import msgpack
    except ImportError:
        return None, as_json
    encoded = {
        k: {b"__ndarray__": True, b"data": v.tobytes(), b"dtype": v.dtype.str, b"shape": v.shape}
        for k, v in arrays.items()
    }
    return msgpack.packb({"episode_id": "bench", "inputs": encoded}), as_json


class NodeProcess:
    def __init__(self, name: str, model: Path, args: list[str], logs: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = logs / f"{name}.log"
        command = [
            sys.executable,
            "-m",
            "node.server",
            "--node-id",
            name,
            "--port",
            str(self.port),
            "--model",
            str(model),
            "--capacity",
            "16",
            "--max-body-bytes",
            str(64 << 20),  # a camera-sized observation as JSON is a few MiB
            *args,
        ]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"node exited with {self.proc.returncode}:\n{self.log.read_text()}")
        return httpx.get(self.url + "/readyz", timeout=1).status_code == 200

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def measure(url: str, requests: int, budget_s: float) -> tuple[list[float], str, str]:
    """Sequential /act of one episode; (latencies, wire used, provider really used)."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        contract = (await client.get("/model")).json()
        packed, as_json = bodies(contract)
        wire, body, headers = "json", as_json, {"content-type": "application/json"}
        if packed is not None:
            probe = await client.post(
                "/act",
                content=packed,
                headers={"content-type": "application/msgpack", "accept": "application/json"},
            )
            if probe.status_code == 200:
                wire, body = "msgpack", packed
                headers = {"content-type": "application/msgpack", "accept": "application/json"}
        for _ in range(3):  # warm: claim, first runs
            reply = await client.post("/act", content=body, headers=headers)
            reply.raise_for_status()
        listed = (await client.get("/devices")).json().get("devices", [])
        provider = next((d.get("provider", "") for d in listed if "local" in d), "")
        latencies: list[float] = []
        deadline = time.monotonic() + budget_s
        while len(latencies) < requests and time.monotonic() < deadline:
            t0 = time.perf_counter()
            reply = await client.post("/act", content=body, headers=headers)
            latencies.append(time.perf_counter() - t0)
            reply.raise_for_status()
        return latencies, wire, provider


def act_figures(
    models: list[Path], configs: list[str], requests: int, budget: float
) -> list[dict[str, Any]]:
    logs = tmpdir()
    rows = []
    for model in models:
        baseline: float | None = None
        for config in configs:
            node = NodeProcess(f"bench-{config}", model, CONFIGS[config], logs)
            try:
                wait_until(node.ready, 120, f"node {config} ready")
                latencies, wire, provider = asyncio.run(measure(node.url, requests, budget))
            finally:
                node.stop()
            p50, p99 = pct(latencies, 50), pct(latencies, 99)
            baseline = p50 if config == "cpu" else baseline
            rows.append(
                {
                    "model": model.name,
                    "config": config,
                    "provider": provider,
                    "wire": wire,
                    "n": len(latencies),
                    "p50_ms": p50 * 1e3,
                    "p99_ms": p99 * 1e3,
                    "p50_vs_cpu": p50 / baseline if baseline else None,
                }
            )
            r = rows[-1]
            vs = f"{r['p50_vs_cpu']:.2f}x" if r["p50_vs_cpu"] is not None else "-"
            print(
                f"{r['model']:<20} {config:<11} {provider or '?':<26} {wire:<8} n={r['n']:<5} "
                f"p50 {r['p50_ms']:8.2f} ms  p99 {r['p99_ms']:8.2f} ms  p50/cpu {vs}",
                flush=True,
            )
    return rows


def state_figure(device_type: str, steps: int) -> dict[str, Any]:
    """Dispatcher step p50 of the demo policy through BoundSession: state on the device vs
    through the host (the same session kind, the same run)."""
    from node.binding import BoundSession
    from node.contract import load_contract
    from node.devices import discover, pin_pci_bus_order
    from node.dispatcher import MultiGpuDispatcher
    from node.models import DEMO_MODEL
    from node.providers import ProviderSettings, build_session
    from tests.dispatch import dispatch

    pin_pci_bus_order(os.environ)  # before this process initialises CUDA
    contract = load_contract(DEMO_MODEL)
    spec = discover("cpu:1" if device_type == "cpu" else "auto")[0]
    settings = ProviderSettings(cuda_graph=device_type == "cuda")
    obs = {s.name: s.zeros() for s in contract.observation_inputs}
    p50 = {}
    for on_device in (False, True):
        session = build_session(DEMO_MODEL, spec, settings).session
        bound = BoundSession(
            session, contract, device_type, spec.ordinal or 0, state_on_device=on_device
        )
        dispatcher = MultiGpuDispatcher(["d"], {"d": bound}.__getitem__, contract)

        async def run(d: MultiGpuDispatcher = dispatcher) -> list[float]:
            await d.warm_up()
            latencies = []
            for i in range(steps):
                t0 = time.perf_counter()
                await dispatch(d, "d", "ep", 1, i == 0, obs)
                latencies.append(time.perf_counter() - t0)
            return latencies[10:]

        p50[on_device] = pct(asyncio.run(run()), 50)
        dispatcher.close()
    ratio = p50[True] / p50[False]
    print(
        f"step p50, state on the device / through the host ({device_type}): {ratio:.2f}x "
        f"({p50[True] * 1e6:.0f} us vs {p50[False] * 1e6:.0f} us)",
        flush=True,
    )
    return {"device": device_type, "on_device_us": p50[True] * 1e6, "host_us": p50[False] * 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="", help="comma-separated .onnx paths")
    p.add_argument("--requests", type=int, default=300, help="per configuration")
    p.add_argument("--budget", type=float, default=20, help="seconds per configuration, at most")
    p.add_argument("--dry-run", action="store_true", help="CPU configurations only")
    a = p.parse_args()
    if a.models:
        models = [Path(m).resolve() for m in a.models.split(",") if m]
    else:
        models = [MODELS_DIR / m for m in DEFAULT_MODELS if (MODELS_DIR / m).exists()]
    missing = [m for m in models if not m.exists()]
    if missing:
        p.error(f"no such model: {', '.join(map(str, missing))}")
    configs = ["cpu"] if a.dry_run else list(CONFIGS)
    print(f"/act, sequential, one episode per configuration; {a.requests} requests or {a.budget}s")
    rows = act_figures(models, configs, a.requests, a.budget)
    state = state_figure("cpu" if a.dry_run else "cuda", 500)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "gpu_check.json"
    payload = {
        "bench": "gpu_check",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dry_run": a.dry_run,
        "act": rows,
        "state": state,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
