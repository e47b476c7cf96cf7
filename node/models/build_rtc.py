"""Build ``rtc_demo`` (``.onnx`` and ``.affinity.json``): a camera-sized policy with
real-time chunking's inputs (``node/rtc.py``), checkable with a few lines of numpy.

Its own chunk is a straight path from the observation (one RGB camera and the robot's 8-dim
state). It goes from a start action p towards p + v over the horizon, as a planner's smooth
trajectory does. Its actions are that chunk blended into the prefix the node fills from the
episode's last chunk. The blend is RTC's soft mask (Black et al. 2025, eq. 5; the overlap
``P = prefix_len``)::

    x = avgpool(transpose(image * (2 / 255) - 1, NHWC -> NCHW), 32x32, stride 32)  # [b, 3, 7, 7]
    z = concat(flatten(x), state)                                                   # [b, 155]
    p, v = tanh(z @ Wp + bp), tanh(z @ Wv + bv)                                     # [b, 7] each
    own_i = p + (i / (H - 1)) v                                                     # [b, 16, 7]
    c_i = (P - i) / (P - d + 1)                                                     # i = 0..H-1
    w_i = 1 for i < d;  c_i (e^c_i - 1) / (e - 1) for d <= i < P;  0 for i >= P
    actions = w * rtc.prefix + (1 - w) * own

so the first d rows are the prefix exactly, rows d..P-1 an exponentially decaying blend
and the rest the model's own. Inputs: ``image`` uint8 [batch, 224, 224, 3], ``state``
float32 [batch, 8] (openpi keys ``observation/image``, ``observation/state``),
``rtc.prefix`` float32 [batch, 16, 7], ``rtc.prefix_len`` and ``rtc.delay`` int64 [batch];
output ``actions`` float32 [batch, 16, 7]; no recurrent state (the chunk the node keeps is
the episode's only state). Weights come from a fixed seed and the file is written
deterministically, so a rebuild gives the same bytes (a test checks the committed files).
Needs the ``onnx`` package (a dev dependency); the server does not. Run once after
changing it::

    python -m node.models.build_rtc [OUT_DIR]      # default: next to this file
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from node.models._build import Weights, model, run, tensor, write

IMAGE, POOL, STATE = 224, 32, 8
HORIZON, ACTION = 16, 7
SEED = 20251203
GRID = IMAGE // POOL
FEATURES = 3 * GRID * GRID + STATE
SIDECAR: dict[str, Any] = {
    "state": {},
    "chunk": "actions",
    "batch": True,
    "observations": {"observation/image": "image", "observation/state": "state"},
    "metadata": {"policy": "rtc-demo", "action_horizon": HORIZON, "action_dim": ACTION},
}


def weights() -> dict[str, np.ndarray[Any, Any]]:
    """``Wp``, ``Wv`` [FEATURES, D] and ``bp``, ``bv`` [D], drawn from the fixed seed."""
    w = Weights(SEED)
    for name in ("p", "v"):
        w.normal(f"W{name}", (FEATURES, ACTION), 2.0 / math.sqrt(FEATURES))
        w.normal(f"b{name}", (ACTION,), 0.1)
    return {t.name: onnx.numpy_helper.to_array(t) for t in w.tensors}


def make_model() -> onnx.ModelProto:
    """The rtc-demo graph with its seeded weights."""
    w = Weights(SEED)
    for name, values in weights().items():
        w.constant(name, values)
    w.constant("pixel_scale", np.array(2.0 / 255.0, dtype=np.float32))
    w.constant("pixel_offset", np.array(-1.0, dtype=np.float32))
    w.constant("ramp", (np.arange(HORIZON, dtype=np.float32) / (HORIZON - 1))[None, :, None])
    w.constant("rows", np.arange(HORIZON, dtype=np.float32)[np.newaxis])
    w.constant("one", np.array(1.0, dtype=np.float32))
    w.constant("zero", np.array(0.0, dtype=np.float32))
    w.constant("e_minus_1", np.array(math.e - 1.0, dtype=np.float32))
    w.constant("axis1", np.array([1], dtype=np.int64))
    w.constant("axis2", np.array([2], dtype=np.int64))
    node = helper.make_node
    f = TensorProto.FLOAT
    nodes = [
        node("Cast", ["image"], ["image/float"], to=f),
        node("Mul", ["image/float", "pixel_scale"], ["image/scaled"]),
        node("Add", ["image/scaled", "pixel_offset"], ["image/pixels"]),
        node("Transpose", ["image/pixels"], ["image/nchw"], perm=[0, 3, 1, 2]),
        node("AveragePool", ["image/nchw"], ["image/pooled"],
             kernel_shape=[POOL, POOL], strides=[POOL, POOL]),
        node("Flatten", ["image/pooled"], ["image/flat"], axis=1),
        node("Concat", ["image/flat", "state"], ["z"], axis=1),
        node("MatMul", ["z", "Wp"], ["p/proj"]),
        node("Add", ["p/proj", "bp"], ["p/pre"]),
        node("Tanh", ["p/pre"], ["p/flat"]),
        node("Unsqueeze", ["p/flat", "axis1"], ["p"]),
        node("MatMul", ["z", "Wv"], ["v/proj"]),
        node("Add", ["v/proj", "bv"], ["v/pre"]),
        node("Tanh", ["v/pre"], ["v/flat"]),
        node("Unsqueeze", ["v/flat", "axis1"], ["v"]),
        node("Mul", ["ramp", "v"], ["path"]),
        node("Add", ["p", "path"], ["own"]),
        # the soft mask, [batch, H]: P and d per row against the row index i
        node("Cast", ["rtc.prefix_len"], ["P/flat"], to=f),
        node("Unsqueeze", ["P/flat", "axis1"], ["P"]),
        node("Cast", ["rtc.delay"], ["d/flat"], to=f),
        node("Unsqueeze", ["d/flat", "axis1"], ["d"]),
        node("Sub", ["P", "rows"], ["c/num"]),
        node("Sub", ["P", "d"], ["c/gap"]),
        node("Add", ["c/gap", "one"], ["c/den"]),
        node("Div", ["c/num", "c/den"], ["c"]),
        node("Exp", ["c"], ["c/exp"]),
        node("Sub", ["c/exp", "one"], ["c/expm1"]),
        node("Mul", ["c", "c/expm1"], ["c/grow"]),
        node("Div", ["c/grow", "e_minus_1"], ["soft"]),
        node("Less", ["rows", "P"], ["in_prefix"]),
        node("Where", ["in_prefix", "soft", "zero"], ["guided"]),
        node("Less", ["rows", "d"], ["frozen"]),
        node("Where", ["frozen", "one", "guided"], ["w/rows"]),
        node("Unsqueeze", ["w/rows", "axis2"], ["w"]),
        node("Sub", ["one", "w"], ["w/own"]),
        node("Mul", ["w", "rtc.prefix"], ["from_prefix"]),
        node("Mul", ["w/own", "own"], ["from_own"]),
        node("Add", ["from_prefix", "from_own"], ["actions"]),
    ]  # fmt: skip
    inputs = [
        tensor("image", TensorProto.UINT8, IMAGE, IMAGE, 3),
        tensor("state", f, STATE),
        tensor("rtc.prefix", f, HORIZON, ACTION),
        tensor("rtc.prefix_len", TensorProto.INT64),
        tensor("rtc.delay", TensorProto.INT64),
    ]
    outputs = [tensor("actions", f, HORIZON, ACTION)]
    return model("rtc_demo", nodes, inputs, outputs, w, "affinity node/models/build_rtc.py")


def build(out_dir: Path) -> tuple[Path, Path]:
    """Write the model and its sidecar into ``out_dir``; return their paths."""
    return write(out_dir, "rtc_demo.onnx", make_model(), SIDECAR)


if __name__ == "__main__":
    run(build)
