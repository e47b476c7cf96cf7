"""Build the camera-sized demo policy: ``vla_demo.onnx`` and ``vla_demo.affinity.json``.

Shaped like a small vision-language-action policy as LIBERO clients of openpi feed it: two
RGB cameras and the robot's 8-dim state in, a chunk of 10 future 7-dim actions out, with a
recurrent hidden state the server keeps per episode. Its cost on a CPU is that of a small
real policy (a few ms per run on one core; ``python -m node.models.cost``)::

    x = transpose(image * (2 / 255) - 1, NHWC -> NCHW)                # per camera, same weights
    x = relu(conv(x, C1, stride 4, pad 2) + c1)                        # [batch, 32, 56, 56]  8x8
    x = relu(conv(x, C2, stride 2, pad 1) + c2)                        # [batch, 64, 28, 28]  3x3
    x = relu(conv(x, C3, stride 2, pad 1) + c3)                        # [batch, 64, 14, 14]  3x3
    x = relu(conv(x, C4, stride 2, pad 1) + c4)                        # [batch, 32, 7, 7]    3x3
    f = relu(flatten(x) @ Wf + bf)                                     # [batch, 64]
    s = relu(state @ Ws + bs)                                          # [batch, 32]
    z = concat(f(image), f(wrist_image), s)                            # [batch, 160]
    state_out.hidden = tanh(z @ Wx + state_in.hidden @ Wh + b)         # [batch, 128]
    actions = reshape(tanh(state_out.hidden @ Wa + ba), [batch, 10, 7])

Inputs: ``image`` and ``wrist_image`` uint8 [batch, 224, 224, 3] (height, width, RGB, as
openpi clients send them), ``state`` float32 [batch, 8], ``state_in.hidden`` float32
[batch, 128]; outputs ``actions`` float32 [batch, 10, 7] and ``state_out.hidden``. The
sidecar maps LIBERO's observation keys (``observation/image``, ``observation/wrist_image``,
``observation/state``) to the inputs. Weights come from a fixed seed and the files are written
deterministically, so a rebuild gives the same bytes (a test checks the committed files).
Needs the ``onnx`` package (a dev dependency); the server does not. Run once after changing
it::

    python -m node.models.build_vla [OUT_DIR]      # default: next to this file
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from node.models._build import Weights, model, run, tensor, write

MODEL_NAME = "vla_demo.onnx"
SEED = 20250311
IMAGE, STATE, HIDDEN, HORIZON, ACTION = 224, 8, 128, 10, 7
CAMERAS = ("image", "wrist_image")
# (name, in channels, out channels, kernel, stride, pad) of the camera encoder's layers
CONVS = (
    ("C1", 3, 32, 8, 4, 2),
    ("C2", 32, 64, 3, 2, 1),
    ("C3", 64, 64, 3, 2, 1),
    ("C4", 64, 32, 3, 2, 1),
)
GRID = 7  # the last feature map is GRID x GRID
FEATURES, STATE_FEATURES = 64, 32
SIDECAR = {
    "state": {"state_in.hidden": "state_out.hidden"},
    "chunk": "actions",
    "batch": True,
    "observations": {
        "observation/image": "image",
        "observation/wrist_image": "wrist_image",
        "observation/state": "state",
    },
    "metadata": {"policy": "vla-demo", "action_horizon": HORIZON, "action_dim": ACTION},
}


def make_model() -> onnx.ModelProto:
    """Return the camera-sized demo policy graph with its seeded weights."""
    w = Weights(SEED)
    for name, cin, cout, kernel, _, _ in CONVS:
        # He initialisation keeps activations of the ReLU stack near unit scale.
        w.normal(name, (cout, cin, kernel, kernel), np.sqrt(2.0 / (cin * kernel * kernel)))
        w.normal(name.lower(), (cout,), 0.05)
    flat = CONVS[-1][2] * GRID * GRID
    w.normal("Wf", (flat, FEATURES), np.sqrt(2.0 / flat))
    w.normal("bf", (FEATURES,), 0.05)
    w.normal("Ws", (STATE, STATE_FEATURES), np.sqrt(2.0 / STATE))
    w.normal("bs", (STATE_FEATURES,), 0.05)
    mixed = len(CAMERAS) * FEATURES + STATE_FEATURES
    w.normal("Wx", (mixed, HIDDEN), 1.0 / np.sqrt(mixed))
    # Spectral radius near 0.9: the state remembers many steps without blowing up.
    w.normal("Wh", (HIDDEN, HIDDEN), 0.9 / np.sqrt(HIDDEN))
    w.normal("b", (HIDDEN,), 0.1)
    w.normal("Wa", (HIDDEN, HORIZON * ACTION), 1.0 / np.sqrt(HIDDEN))
    w.normal("ba", (HORIZON * ACTION,), 0.1)
    w.constant("pixel_scale", np.array(2.0 / 255.0, dtype=np.float32))
    w.constant("pixel_offset", np.array(-1.0, dtype=np.float32))
    w.constant("actions_shape", np.array([-1, HORIZON, ACTION], dtype=np.int64))

    node = helper.make_node
    nodes: list[onnx.NodeProto] = []
    for camera in CAMERAS:
        nodes += [
            node("Cast", [camera], [f"{camera}/float"], to=TensorProto.FLOAT),
            node("Mul", [f"{camera}/float", "pixel_scale"], [f"{camera}/scaled"]),
            node("Add", [f"{camera}/scaled", "pixel_offset"], [f"{camera}/pixels"]),
            node("Transpose", [f"{camera}/pixels"], [f"{camera}/x0"], perm=[0, 3, 1, 2]),
        ]
        for layer, (name, _, _, kernel, stride, pad) in enumerate(CONVS, start=1):
            nodes += [
                node(
                    "Conv",
                    [f"{camera}/x{layer - 1}", name, name.lower()],
                    [f"{camera}/conv{layer}"],
                    kernel_shape=[kernel, kernel],
                    strides=[stride, stride],
                    pads=[pad] * 4,
                ),
                node("Relu", [f"{camera}/conv{layer}"], [f"{camera}/x{layer}"]),
            ]
        nodes += [
            node("Flatten", [f"{camera}/x{len(CONVS)}"], [f"{camera}/flat"], axis=1),
            node("MatMul", [f"{camera}/flat", "Wf"], [f"{camera}/proj"]),
            node("Add", [f"{camera}/proj", "bf"], [f"{camera}/pre"]),
            node("Relu", [f"{camera}/pre"], [f"{camera}/features"]),
        ]
    nodes += [
        node("MatMul", ["state", "Ws"], ["state/proj"]),
        node("Add", ["state/proj", "bs"], ["state/pre"]),
        node("Relu", ["state/pre"], ["state/features"]),
        node("Concat", [*(f"{c}/features" for c in CAMERAS), "state/features"], ["z"], axis=1),
        node("MatMul", ["z", "Wx"], ["x_in"]),
        node("MatMul", ["state_in.hidden", "Wh"], ["h_in"]),
        node("Add", ["x_in", "h_in"], ["pre_sum"]),
        node("Add", ["pre_sum", "b"], ["pre"]),
        node("Tanh", ["pre"], ["state_out.hidden"]),
        node("MatMul", ["state_out.hidden", "Wa"], ["a_proj"]),
        node("Add", ["a_proj", "ba"], ["a_pre"]),
        node("Tanh", ["a_pre"], ["a_flat"]),
        node("Reshape", ["a_flat", "actions_shape"], ["actions"]),
    ]
    return model(
        "vla_demo",
        nodes,
        inputs=[
            *(tensor(c, TensorProto.UINT8, IMAGE, IMAGE, 3) for c in CAMERAS),
            tensor("state", TensorProto.FLOAT, STATE),
            tensor("state_in.hidden", TensorProto.FLOAT, HIDDEN),
        ],
        outputs=[
            tensor("actions", TensorProto.FLOAT, HORIZON, ACTION),
            tensor("state_out.hidden", TensorProto.FLOAT, HIDDEN),
        ],
        weights=w,
        producer="affinity node/models/build_vla.py",
    )


def build(out_dir: Path) -> tuple[Path, Path]:
    """Write the model and its sidecar into ``out_dir``; return their paths."""
    return write(out_dir, MODEL_NAME, make_model(), SIDECAR)


if __name__ == "__main__":
    run(build)
