"""A device's worker process (``--device-workers process``, issue 43's third slice).

One process per device holds every model's ONNX Runtime session on that device (the live
models' and the shadow candidates'), its CUDA graphs and TensorRT engines, and runs them for
the node's core (``node/deviceprocs.py``). The core keeps the episodes, the batching and the
owner's rules; a run crosses to this process through the hop's shared memory
(``node/hop.py``: one slot per model, the feed written raw once, the outputs written back
raw), with an ``eventfd`` doorbell each way.

Each model is served by a thread of its own, which makes every run of that model: ONNX
Runtime keeps a captured CUDA graph per thread, so capture and replay happen on the same
thread, as on the core's device threads. A run that raises answers the error's text; the
core counts it as the device's failure, as for a session of its own.

Started by the core as ``python -m node.deviceproc`` with its spec in
``AFFINITY_DEVICE_SPEC`` (JSON: the device, the models, the provider settings, the
descriptors it inherits). It writes one JSON line to its hello descriptor: each model's
provider and batch sizes once every session is open, or the error that stopped it (the
core's start-up names it and exits). It dies with the core (``PR_SET_PDEATHSIG``), and
leaves on SIGUSR1 from the core. SIGINT and SIGTERM are the core's to act on, as for the
fronts (``node/front.py``): sent to the node's process group (a ^C, or a service manager
stopping the node), they must not end the runs of a node that stops gracefully.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from node.hop import ANSWERED, REPLY, Region, die_with_parent

__all__ = ["RUN", "main"]

log = logging.getLogger("affinity.node")

RUN = 10
"""A slot's request kind: one model run (its feed; the outputs asked in ``o``)."""
CUDA_GRAPH_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")


@dataclass
class _Model:
    """One model's session here and its end of the hop."""

    key: str
    session: Any
    provider: str
    slot: int
    ask: int
    answer: int


def _open(spec: dict[str, Any]) -> list[_Model]:
    """Every model's session on the device, in the spec's order. Raises what ONNX Runtime
    (or the provider plan) raised, with the model's key."""
    from node.binding import BoundSession
    from node.contract import load_contract
    from node.devices import DeviceSpec
    from node.providers import ProviderSettings, build_session

    device = DeviceSpec(**spec["device"])
    settings = ProviderSettings(**spec["providers"])
    models = []
    for k, m in enumerate(spec["models"]):
        path = Path(m["path"])
        try:
            built = build_session(path, device, settings, intra_op_threads=m["threads"])
            session: Any = built.session
            if m["graph"] and settings.cuda_graph and built.active in CUDA_GRAPH_PROVIDERS:
                # the state comes back to the core as host arrays: the core keeps it
                session = BoundSession(
                    session, load_contract(path), "cuda", device.ordinal or 0,
                    state_on_device=False,
                )  # fmt: skip
        except Exception as exc:
            raise RuntimeError(f"{m['key']}: {type(exc).__name__}: {exc}") from exc
        ask, answer = m["fds"]
        models.append(_Model(m["key"], session, built.active, k, ask, answer))
    return models


def _serve(model: _Model, region: Region, stopping: threading.Event) -> None:
    """Answer ``model``'s runs, one at a time, until the process leaves."""
    from node.warmup import run

    while not stopping.is_set():
        try:
            os.read(model.ask, 8)  # blocks (the GIL released) until the core rings
        except InterruptedError:
            continue
        if stopping.is_set():
            return
        try:
            _, meta, arrays = region.read(model.slot, copy=False)  # the feed, in place
            feed = dict(zip(meta["n"], arrays, strict=True))
            values = run(model.session, meta.get("o"), feed)
            outputs = [np.ascontiguousarray(np.asarray(v)) for v in values]
            del feed, arrays  # views of the slot, about to be overwritten
            region.write(model.slot, ANSWERED, REPLY, {}, outputs)
        except Exception as exc:  # the core counts it as the device's failure
            region.write(model.slot, ANSWERED, REPLY, {"e": f"{type(exc).__name__}: {exc}"}, [])
        os.write(model.answer, (1).to_bytes(8, "little"))


def main() -> None:
    spec = json.loads(os.environ["AFFINITY_DEVICE_SPEC"])
    die_with_parent(int(spec["parent"]))
    index = spec["device"]["index"]
    handler = logging.StreamHandler(sys.stderr)
    if spec.get("log_format") == "json":
        from node.accesslog import JsonFormatter

        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s %(name)s[device {index}]: %(message)s")
        )
    logging.basicConfig(level=getattr(logging, str(spec.get("log_level", "info")).upper(),
                                      logging.INFO), handlers=[handler])  # fmt: skip
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # the core's to act on (sent to the group)
        signal.signal(sig, signal.SIG_IGN)
    region = Region.open(int(spec["region"]))
    with os.fdopen(int(spec["hello"]), "w") as hello:
        try:
            models = _open(spec)
        except Exception as exc:
            hello.write(json.dumps({"error": " ".join(str(exc).split())}) + "\n")
            hello.flush()
            os._exit(3)
        said = [
            {"provider": m.provider, "batch_sizes": list(getattr(m.session, "batch_sizes", ()))}
            for m in models
        ]
        hello.write(json.dumps({"models": said}) + "\n")
    threads = [
        threading.Thread(
            target=_serve, args=(m, region, stopping), daemon=True, name=f"affinity-{m.key}"
        )
        for m in models
    ]
    for thread in threads:
        thread.start()
    signal.sigwait({signal.SIGUSR1})
    stopping.set()
    # the core stops asking first (its device threads have ended): no run is in progress
    os._exit(0)


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    main()
