"""Small ONNX policies for tests and benchmarks, written with the ``onnx`` package.

``with_batch_axis`` turns a policy whose tensors have a fixed first dimension of 1 (the
packaged demo) into the same policy with a dynamic batch axis, so one run serves several
episodes. onnx 1.23 writes IR 14 by default, which onnxruntime 1.31 refuses: every model
here is written with ``IR_VERSION``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx
from onnx import numpy_helper

from node.policy import sidecar_path

__all__ = ["IR_VERSION", "with_batch_axis"]

IR_VERSION = 10


def with_batch_axis(model_path: Path, out_dir: Path, name: str = "batched") -> Path:
    """Write ``model_path`` with a dynamic first dimension ``batch`` on every graph input and
    output (and its sidecar, if any) into ``out_dir``; return the new model's path.

    Every ``Reshape`` whose target shape is a constant starting with 1 gets -1 there
    instead, so a reshape to ``[1, H, D]`` keeps the batch. Weights and operators are
    unchanged: row ``i`` of a batched run computes what a run of row ``i`` alone does.
    """
    model = onnx.load(str(model_path))
    graph = model.graph
    for value in (*graph.input, *graph.output):
        dims = value.type.tensor_type.shape.dim
        if dims:
            dims[0].ClearField("dim_value")
            dims[0].dim_param = "batch"
    shapes = {node.input[1] for node in graph.node if node.op_type == "Reshape"}
    for i, init in enumerate(graph.initializer):
        if init.name in shapes:
            target = numpy_helper.to_array(init).copy()
            if target.size and target[0] == 1:
                target[0] = -1
                graph.initializer[i].CopyFrom(numpy_helper.from_array(target, init.name))
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{name}.onnx"
    out.write_bytes(model.SerializeToString(deterministic=True))
    if sidecar_path(model_path).exists():
        shutil.copyfile(sidecar_path(model_path), sidecar_path(out))
    return out
