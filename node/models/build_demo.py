"""Build the demo policy: ``demo_policy.onnx`` and its sidecar ``demo_policy.affinity.json``.

A small recurrent policy, so that serving it wrong (an episode moved to a device that lacks its
state) shows in the actions::

    state_out.hidden = tanh(obs @ Wx + state_in.hidden @ Wh + b)          # [batch, 16]
    actions = reshape(tanh(state_out.hidden @ Wa + ba), [batch, 4, 2])   # 4 steps of 2-dim actions

Inputs ``obs`` float32 [batch, 8] and ``state_in.hidden`` float32 [batch, 16]; the first
dimension of every tensor is the symbolic batch axis (a client sends one sample, the server may
stack several episodes). Weights come from a fixed seed and the file is written
deterministically, so a rebuild gives the same bytes (a test checks the committed file). Needs
the ``onnx`` package (a dev dependency); the server does not. Run once after changing it::

    python -m node.models.build_demo [OUT_DIR]     # default: next to this file
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from node.models._build import Weights, recurrent_model, run, tensor, write

MODEL_NAME = "demo_policy.onnx"
SEED = 20240611
OBS, HIDDEN, STEPS, ACTION = 8, 16, 4, 2
SIDECAR = {
    "state": {"state_in.hidden": "state_out.hidden"},
    "chunk": "actions",
    "batch": True,
    "metadata": {"policy": "demo", "action_horizon": STEPS, "action_dim": ACTION},
}


def make_model() -> onnx.ModelProto:
    """Return the demo policy graph with its seeded weights."""
    w = Weights(SEED)
    w.normal("Wx", (OBS, HIDDEN), 1.0 / np.sqrt(OBS))
    # Spectral radius near 0.9: the state remembers many steps without blowing up.
    w.normal("Wh", (HIDDEN, HIDDEN), 0.9 / np.sqrt(HIDDEN))
    w.normal("b", (HIDDEN,), 0.1)
    w.normal("Wa", (HIDDEN, STEPS * ACTION), 1.0 / np.sqrt(HIDDEN))
    w.normal("ba", (STEPS * ACTION,), 0.1)
    w.constant("actions_shape", np.array([-1, STEPS, ACTION], dtype=np.int64))
    node = helper.make_node
    nodes = [
        node("MatMul", ["obs", "Wx"], ["x_in"], name="obs_proj"),
        node("MatMul", ["state_in.hidden", "Wh"], ["h_in"], name="state_proj"),
        node("Add", ["x_in", "h_in"], ["pre_sum"], name="mix"),
        node("Add", ["pre_sum", "b"], ["pre"], name="bias"),
        node("Tanh", ["pre"], ["state_out.hidden"], name="hidden"),
        node("MatMul", ["state_out.hidden", "Wa"], ["a_proj"], name="action_proj"),
        node("Add", ["a_proj", "ba"], ["a_pre"], name="action_bias"),
        node("Tanh", ["a_pre"], ["a_flat"], name="action_squash"),
        node("Reshape", ["a_flat", "actions_shape"], ["actions"], name="action_chunk"),
    ]
    observations = [tensor("obs", TensorProto.FLOAT, OBS)]
    return recurrent_model(
        "demo_policy", nodes, observations, HIDDEN, (STEPS, ACTION), w,
        "affinity node/models/build_demo.py",
    )  # fmt: skip


def build(out_dir: Path) -> tuple[Path, Path]:
    """Write the model and its sidecar into ``out_dir``; return their paths."""
    return write(out_dir, MODEL_NAME, make_model(), SIDECAR)


if __name__ == "__main__":
    run(build)
