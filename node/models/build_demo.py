"""Build the demo policy: ``demo_policy.onnx`` and its sidecar ``demo_policy.affinity.json``.

A small recurrent policy, so that serving it wrong (an episode moved to a device that lacks its
state) shows in the actions::

    state_out.hidden = tanh(obs @ Wx + state_in.hidden @ Wh + b)        # [1, 16]
    actions = reshape(tanh(state_out.hidden @ Wa + ba), [1, 4, 2])      # 4 steps of 2-dim actions

Inputs ``obs`` float32 [1, 8] and ``state_in.hidden`` float32 [1, 16]. Weights come from a
fixed seed and the file is written deterministically, so a rebuild gives the same bytes (a
test checks the committed file). Needs the ``onnx`` package (a dev dependency); the server
does not. Run once after changing it::

    python -m node.models.build_demo [OUT_DIR]     # default: next to this file
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MODEL_NAME = "demo_policy.onnx"
SIDECAR_NAME = "demo_policy.affinity.json"
SEED = 20240611
OBS, HIDDEN, STEPS, ACTION = 8, 16, 4, 2
# onnx 1.23 writes IR 14 by default, newer than onnxruntime accepts.
IR_VERSION = 10
OPSET = 17


def make_model() -> onnx.ModelProto:
    """Return the demo policy graph with its seeded weights."""
    rng = np.random.default_rng(SEED)

    def weight(name: str, shape: tuple[int, ...], scale: float) -> TensorProto:
        values = (rng.standard_normal(shape) * scale).astype(np.float32)
        return numpy_helper.from_array(values, name)

    initializers = [
        weight("Wx", (OBS, HIDDEN), 1.0 / np.sqrt(OBS)),
        # Spectral radius near 0.9: the state remembers many steps without blowing up.
        weight("Wh", (HIDDEN, HIDDEN), 0.9 / np.sqrt(HIDDEN)),
        weight("b", (HIDDEN,), 0.1),
        weight("Wa", (HIDDEN, STEPS * ACTION), 1.0 / np.sqrt(HIDDEN)),
        weight("ba", (STEPS * ACTION,), 0.1),
        numpy_helper.from_array(np.array([1, STEPS, ACTION], dtype=np.int64), "actions_shape"),
    ]
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
    graph = helper.make_graph(
        nodes,
        "demo_policy",
        inputs=[
            helper.make_tensor_value_info("obs", TensorProto.FLOAT, [1, OBS]),
            helper.make_tensor_value_info("state_in.hidden", TensorProto.FLOAT, [1, HIDDEN]),
        ],
        outputs=[
            helper.make_tensor_value_info("actions", TensorProto.FLOAT, [1, STEPS, ACTION]),
            helper.make_tensor_value_info("state_out.hidden", TensorProto.FLOAT, [1, HIDDEN]),
        ],
        initializer=initializers,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="affinity node/models/build_demo.py",
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def build(out_dir: Path) -> tuple[Path, Path]:
    """Write the model and its sidecar into ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = out_dir / MODEL_NAME
    model_path.write_bytes(make_model().SerializeToString(deterministic=True))
    sidecar_path = out_dir / SIDECAR_NAME
    sidecar = {"state": {"state_in.hidden": "state_out.hidden"}}
    sidecar_path.write_text(json.dumps(sidecar, indent=2) + "\n", encoding="utf-8")
    return model_path, sidecar_path


def main() -> None:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    for path in build(out_dir):
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
