"""Build the camera-sized demo policies: ``vla_demo``, ``droid_demo`` and ``aloha_demo``
(``.onnx`` and ``.affinity.json`` each), one per robot of openpi's example client.

Shaped like a small vision-language-action policy as LIBERO clients of openpi feed it. Two
RGB cameras and the robot's 8-dim state go in, a chunk of 10 future 7-dim actions comes out.
It has a recurrent hidden state the server keeps per episode. Its cost on a CPU is that of a small
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

The same network, with openpi's observations of two more robots (:class:`Robot`):

- ``droid-demo``: ``observation/exterior_image_1_left`` and ``observation/wrist_image_left``
  uint8 [224, 224, 3], ``observation/joint_position`` [7] and
  ``observation/gripper_position`` [1] (concatenated into the 8-dim state); ``actions``
  [batch, 10, 8] (7 joint velocities and the gripper, as ``DroidOutputs`` returns).
- ``aloha-demo``: four channel-first cameras ``images/cam_high``, ``images/cam_low``,
  ``images/cam_left_wrist``, ``images/cam_right_wrist`` uint8 [3, 224, 224] (no transpose)
  and ``state`` [14]; ``actions`` [batch, 50, 14] (both arms, as ``AlohaOutputs`` returns).
  openpi's ``--env ALOHA`` and ``--env ALOHA_SIM`` send these same observations.
Needs the ``onnx`` package (a dev dependency); the server does not. Run once after changing
it::

    python -m node.models.build_vla [OUT_DIR]      # default: next to this file
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from node.models._build import Weights, recurrent_model, run, tensor, write

IMAGE, HIDDEN = 224, 128
# (name, in channels, out channels, kernel, stride, pad) of the camera encoder's layers
CONVS = (
    ("C1", 3, 32, 8, 4, 2),
    ("C2", 32, 64, 3, 2, 1),
    ("C3", 64, 64, 3, 2, 1),
    ("C4", 64, 32, 3, 2, 1),
)
GRID = 7  # the last feature map is GRID x GRID
FEATURES, STATE_FEATURES = 64, 32


@dataclass(frozen=True)
class Robot:
    """One demo policy: a robot's inputs and its action chunk, as openpi has them.

    The robot's cameras and state are as openpi's example client sends them
    (``examples/simple_client/main.py``). The action chunk is what its openpi policy
    returns (``droid_policy.py``: ``[:, :8]``; ``aloha_policy.py``: ``[:, :14]``)."""

    policy: str  # the packaged name (``--model``) and the sidecar's metadata.policy
    stem: str  # the files' name: <stem>.onnx, <stem>.affinity.json
    seed: int
    cameras: tuple[tuple[str, str], ...]  # (input, observation key), uint8 images
    channels_first: bool  # [3, 224, 224] (ALOHA) rather than [224, 224, 3]
    states: tuple[tuple[str, str, int], ...]  # (input, observation key, size), float32
    horizon: int
    action: int

    @property
    def state_size(self) -> int:
        return sum(size for _, _, size in self.states)

    def sidecar(self) -> dict[str, Any]:
        keys = [*self.cameras, *((name, key) for name, key, _ in self.states)]
        return {
            "state": {"state_in.hidden": "state_out.hidden"},
            "chunk": "actions",
            "batch": True,
            "observations": {key: name for name, key in keys},
            "metadata": {
                "policy": self.policy,
                "action_horizon": self.horizon,
                "action_dim": self.action,
            },
        }


LIBERO = Robot(
    "vla-demo",
    "vla_demo",
    20250311,
    (("image", "observation/image"), ("wrist_image", "observation/wrist_image")),
    False,
    (("state", "observation/state", 8),),
    10,
    7,
)
DROID = Robot(
    "droid-demo",
    "droid_demo",
    20251201,
    (
        ("exterior_image_1_left", "observation/exterior_image_1_left"),
        ("wrist_image_left", "observation/wrist_image_left"),
    ),
    False,
    (
        ("joint_position", "observation/joint_position", 7),
        ("gripper_position", "observation/gripper_position", 1),
    ),
    10,
    8,
)
ALOHA = Robot(
    "aloha-demo",
    "aloha_demo",
    20251202,
    tuple(
        (camera, f"images/{camera}")
        for camera in ("cam_high", "cam_low", "cam_left_wrist", "cam_right_wrist")
    ),
    True,
    (("state", "state", 14),),
    50,
    14,
)
ROBOTS = (LIBERO, DROID, ALOHA)
CAMERAS = tuple(name for name, _ in LIBERO.cameras)
"""vla-demo's camera inputs."""


def make_model(robot: Robot = LIBERO) -> onnx.ModelProto:
    """Return ``robot``'s camera-sized demo policy graph with its seeded weights."""
    cameras = [name for name, _ in robot.cameras]
    state, horizon, action = robot.state_size, robot.horizon, robot.action
    w = Weights(robot.seed)
    for name, cin, cout, kernel, _, _ in CONVS:
        # He initialisation keeps activations of the ReLU stack near unit scale.
        w.normal(name, (cout, cin, kernel, kernel), np.sqrt(2.0 / (cin * kernel * kernel)))
        w.normal(name.lower(), (cout,), 0.05)
    flat = CONVS[-1][2] * GRID * GRID
    w.normal("Wf", (flat, FEATURES), np.sqrt(2.0 / flat))
    w.normal("bf", (FEATURES,), 0.05)
    w.normal("Ws", (state, STATE_FEATURES), np.sqrt(2.0 / state))
    w.normal("bs", (STATE_FEATURES,), 0.05)
    mixed = len(cameras) * FEATURES + STATE_FEATURES
    w.normal("Wx", (mixed, HIDDEN), 1.0 / np.sqrt(mixed))
    # Spectral radius near 0.9: the state remembers many steps without blowing up.
    w.normal("Wh", (HIDDEN, HIDDEN), 0.9 / np.sqrt(HIDDEN))
    w.normal("b", (HIDDEN,), 0.1)
    w.normal("Wa", (HIDDEN, horizon * action), 1.0 / np.sqrt(HIDDEN))
    w.normal("ba", (horizon * action,), 0.1)
    w.constant("pixel_scale", np.array(2.0 / 255.0, dtype=np.float32))
    w.constant("pixel_offset", np.array(-1.0, dtype=np.float32))
    w.constant("actions_shape", np.array([-1, horizon, action], dtype=np.int64))

    node = helper.make_node
    nodes: list[onnx.NodeProto] = []
    for camera in cameras:
        pixels = f"{camera}/x0" if robot.channels_first else f"{camera}/pixels"
        nodes += [
            node("Cast", [camera], [f"{camera}/float"], to=TensorProto.FLOAT),
            node("Mul", [f"{camera}/float", "pixel_scale"], [f"{camera}/scaled"]),
            node("Add", [f"{camera}/scaled", "pixel_offset"], [pixels]),
        ]
        if not robot.channels_first:
            nodes.append(node("Transpose", [pixels], [f"{camera}/x0"], perm=[0, 3, 1, 2]))
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
    if [name for name, _, _ in robot.states] != ["state"]:  # one state vector from several
        parts = [name for name, _, _ in robot.states]
        nodes.append(node("Concat", parts, ["state"], axis=1))
    nodes += [
        node("MatMul", ["state", "Ws"], ["state/proj"]),
        node("Add", ["state/proj", "bs"], ["state/pre"]),
        node("Relu", ["state/pre"], ["state/features"]),
        node("Concat", [*(f"{c}/features" for c in cameras), "state/features"], ["z"], axis=1),
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
    image = (3, IMAGE, IMAGE) if robot.channels_first else (IMAGE, IMAGE, 3)
    observations = [
        *(tensor(c, TensorProto.UINT8, *image) for c in cameras),
        *(tensor(name, TensorProto.FLOAT, size) for name, _, size in robot.states),
    ]
    return recurrent_model(
        robot.stem, nodes, observations, HIDDEN, (horizon, action), w,
        "affinity node/models/build_vla.py",
    )  # fmt: skip


def build(out_dir: Path, robot: Robot = LIBERO) -> tuple[Path, Path]:
    """Write ``robot``'s model and its sidecar into ``out_dir``; return their paths."""
    return write(out_dir, f"{robot.stem}.onnx", make_model(robot), robot.sidecar())


def build_all(out_dir: Path) -> tuple[Path, ...]:
    """Write every demo policy of :data:`ROBOTS` into ``out_dir``; return the paths."""
    return tuple(path for robot in ROBOTS for path in build(out_dir, robot))


if __name__ == "__main__":
    run(build_all)
