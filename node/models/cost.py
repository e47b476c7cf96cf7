"""Measure what one run of each packaged policy costs on this machine's CPU.

    python -m node.models.cost [--runs N] [--threads T] [MODEL ...]  # default: all packaged

For each model (a packaged name or a path) and batch size, runs the model ``--runs`` times.
The batch sizes are 1, and 8 where the batch axis is dynamic. The default is 200 runs, after
10 warm-up runs. It runs on ONNX Runtime's CPU provider with ``--threads`` intra-op threads
(default 1: one core), on random inputs of the model's shapes. It prints the median and p90
milliseconds per run.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import onnxruntime

from node.contract import PolicyContract, load_contract
from node.models import PACKAGED_MODELS, resolve_model


def random_feed(
    contract: PolicyContract, batch: int, seed: int = 0
) -> dict[str, np.ndarray[Any, Any]]:
    """Random inputs for every input of ``contract``, ``batch`` samples along the batch axis
    (other symbolic dimensions 1): integers over their full range, floats standard normal."""
    rng = np.random.default_rng(seed)
    feed: dict[str, np.ndarray[Any, Any]] = {}
    for spec in contract.inputs:
        shape = [d if isinstance(d, int) else 1 for d in spec.shape]
        if contract.batch_axis:
            shape[0] = batch
        dtype = np.dtype(spec.dtype)
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            feed[spec.name] = rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
        elif dtype.kind == "b":
            feed[spec.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            feed[spec.name] = rng.standard_normal(shape).astype(dtype)
    return feed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m node.models.cost", description=__doc__)
    p.add_argument("models", nargs="*", default=list(PACKAGED_MODELS))
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    print(f"onnxruntime {onnxruntime.__version__}, CPU provider, {a.threads} intra-op thread(s)")
    print(f"{'model':<12} {'batch':>5} {'p50 ms':>8} {'p90 ms':>8} {'p50 ms/sample':>14}")
    for name in a.models:
        path = resolve_model(name)
        contract = load_contract(path)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = a.threads
        options.inter_op_num_threads = 1
        session = onnxruntime.InferenceSession(
            str(path), options, providers=["CPUExecutionProvider"]
        )
        for batch in (1, 8) if contract.batchable else (1,):
            feed = random_feed(contract, batch)
            for _ in range(10):
                session.run(None, feed)
            times = []
            for _ in range(a.runs):
                start = time.perf_counter()
                session.run(None, feed)
                times.append(time.perf_counter() - start)
            p50, p90 = (float(np.percentile(times, q)) * 1e3 for q in (50, 90))
            print(f"{name:<12} {batch:>5} {p50:>8.3f} {p90:>8.3f} {p50 / batch:>14.3f}")


if __name__ == "__main__":
    main()
