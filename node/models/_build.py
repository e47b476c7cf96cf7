"""What the demo-policy build scripts share: ONNX versions, seeded weights, reproducible files.

Needs the ``onnx`` package (a dev dependency); the server does not import this.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# onnx 1.23 writes IR 14 by default, newer than onnxruntime 1.31 accepts.
IR_VERSION = 10
OPSET = 17
BATCH = "batch"
"""The symbolic name of every tensor's first dimension: the batch axis."""


class Weights:
    """Initializers drawn from one seeded generator, in the order they are asked for."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.tensors: list[TensorProto] = []

    def normal(self, name: str, shape: tuple[int, ...], scale: float) -> str:
        """A float32 tensor of normal draws times ``scale``; returns its name."""
        values = (self.rng.standard_normal(shape) * scale).astype(np.float32)
        return self.constant(name, values)

    def constant(self, name: str, values: np.ndarray[Any, Any]) -> str:
        """A tensor of exactly ``values``; returns its name."""
        self.tensors.append(numpy_helper.from_array(values, name))
        return name


def tensor(name: str, elem_type: int, *dims: int) -> onnx.ValueInfoProto:
    """A graph input or output ``[batch, *dims]``."""
    return helper.make_tensor_value_info(name, elem_type, [BATCH, *dims])


def model(
    name: str,
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    weights: Weights,
    producer: str,
) -> onnx.ModelProto:
    """The checked model, with the IR version and opset onnxruntime takes."""
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=weights.tensors)
    built = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name=producer
    )
    built.ir_version = IR_VERSION
    onnx.checker.check_model(built, full_check=True)
    return built


def recurrent_model(
    name: str,
    nodes: Sequence[onnx.NodeProto],
    observations: Sequence[onnx.ValueInfoProto],
    hidden: int,
    actions: Sequence[int],
    weights: Weights,
    producer: str,
) -> onnx.ModelProto:
    """:func:`model` of a recurrent policy: ``observations``, then ``state_in.hidden``
    float32 [batch, hidden] in; ``actions`` float32 [batch, *actions] and
    ``state_out.hidden`` out."""
    return model(
        name,
        nodes,
        inputs=[*observations, tensor("state_in.hidden", TensorProto.FLOAT, hidden)],
        outputs=[
            tensor("actions", TensorProto.FLOAT, *actions),
            tensor("state_out.hidden", TensorProto.FLOAT, hidden),
        ],
        weights=weights,
        producer=producer,
    )


def write(
    out_dir: Path, model_name: str, built: onnx.ModelProto, sidecar: dict[str, Any]
) -> tuple[Path, Path]:
    """Write ``<model_name>`` and its sidecar ``<stem>.affinity.json`` into ``out_dir``,
    byte for byte the same on every run; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = out_dir / model_name
    model_path.write_bytes(built.SerializeToString(deterministic=True))
    sidecar_path = model_path.with_name(f"{model_path.stem}.affinity.json")
    sidecar_path.write_text(json.dumps(sidecar, indent=2) + "\n", encoding="utf-8")
    return model_path, sidecar_path


def run(build: Callable[[Path], tuple[Path, ...]]) -> None:
    """A build script's command line: ``build`` into the directory given (default: the
    package's ``node/models``), saying what was written."""
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    for path in build(out_dir):
        print(f"wrote {path} ({path.stat().st_size} bytes)")
