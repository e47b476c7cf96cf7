"""Test-only ONNX policies, built with the same helpers as the packaged demos."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from node.models._build import Weights, model, tensor, write


def slow_policy(out_dir: Path, repeats: int = 72, width: int = 256) -> Path:
    """A recurrent policy shaped like the demo (``obs [batch,8]`` -> ``actions [batch,4,2]``,
    a 16-wide hidden state fed back) that spends ``repeats`` ``width``x``width`` matrix
    products per run: tens of milliseconds on one CPU core, so steps are in flight when a
    test needs them to be."""
    w = Weights(seed=7)
    nodes = [
        helper.make_node("MatMul", ["obs", w.normal("up", (8, width * width), 0.3)], ["flat"]),
        helper.make_node(
            "Reshape", ["flat", w.constant("square", np.array([-1, width, width]))], ["x0"]
        ),
        helper.make_node("Concat", ["obs", "state_in.hidden"], ["oh"], axis=1),
        helper.make_node("MatMul", ["oh", w.normal("wh", (24, 16), 0.3)], ["h_pre"]),
    ]
    square = w.normal("sq", (width, width), 1.0 / width**0.5)
    for i in range(repeats):
        nodes.append(helper.make_node("MatMul", [f"x{i}", square], [f"m{i}"]))
        nodes.append(helper.make_node("Tanh", [f"m{i}"], [f"x{i + 1}"]))
    nodes += [
        helper.make_node("ReduceMean", [f"x{repeats}"], ["r"], axes=[1], keepdims=0),
        helper.make_node("MatMul", ["r", w.normal("down", (width, 16), 0.01)], ["d"]),
        helper.make_node("Add", ["h_pre", "d"], ["h_sum"]),
        helper.make_node("Tanh", ["h_sum"], ["state_out.hidden"]),
        helper.make_node("MatMul", ["state_out.hidden", w.normal("act", (16, 8), 0.3)], ["a"]),
        helper.make_node(
            "Reshape", ["a", w.constant("shape", np.array([-1, 4, 2]))],
            ["actions"],
        ),
    ]  # fmt: skip
    built = model(
        "slow_policy",
        nodes,
        [tensor("obs", TensorProto.FLOAT, 8), tensor("state_in.hidden", TensorProto.FLOAT, 16)],
        [
            tensor("actions", TensorProto.FLOAT, 4, 2),
            tensor("state_out.hidden", TensorProto.FLOAT, 16),
        ],
        w,
        "affinity-tests",
    )
    path, _ = write(
        out_dir, "slow_policy.onnx", built, {"state": {"state_in.hidden": "state_out.hidden"}}
    )
    return path


def counter_policy(out_dir: Path, repeats: int = 0, width: int = 128, wide: int = 0) -> Path:
    """A probe policy whose recurrent state counts exactly the steps its episode has seen:
    ``obs [batch,8]`` and ``state_in.count [batch,1]`` in, ``count = state_in.count + 1``
    out (fed back as ``state_out.count``). ``repeats`` ``width``x``width`` matrix products
    per run (their result multiplied by zero) make a run take longer without changing it.
    ``wide`` (a multiple of 8) adds the output ``wide [batch, wide]``, ``obs`` repeated: a
    reply of ``4 * wide`` bytes."""
    w = Weights(seed=11)
    nodes = [
        helper.make_node(
            "Add", ["state_in.count", w.constant("one", np.ones((1, 1), np.float32))], ["next"]
        )
    ]
    if repeats:
        nodes += [
            helper.make_node("MatMul", ["obs", w.normal("up", (8, width * width), 0.3)], ["flat"]),
            helper.make_node(
                "Reshape", ["flat", w.constant("square", np.array([-1, width, width]))], ["x0"]
            ),
        ]
        square = w.normal("sq", (width, width), 1.0 / width**0.5)
        for i in range(repeats):
            nodes.append(helper.make_node("MatMul", [f"x{i}", square], [f"m{i}"]))
            nodes.append(helper.make_node("Tanh", [f"m{i}"], [f"x{i + 1}"]))
        nodes += [
            helper.make_node("ReduceMean", [f"x{repeats}"], ["r"], axes=[1, 2], keepdims=0),
            helper.make_node("Unsqueeze", ["r", w.constant("axis", np.array([1]))], ["r1"]),
            helper.make_node(
                "Mul", ["r1", w.constant("zero", np.zeros((1, 1), np.float32))], ["nil"]
            ),
            helper.make_node("Add", ["next", "nil"], ["state_out.count"]),
        ]
    else:
        nodes.append(helper.make_node("Identity", ["next"], ["state_out.count"]))
    nodes.append(helper.make_node("Identity", ["state_out.count"], ["count"]))
    outputs = [
        tensor("count", TensorProto.FLOAT, 1),
        tensor("state_out.count", TensorProto.FLOAT, 1),
    ]
    if wide:
        times = w.constant("times", np.array([1, wide // 8]))
        nodes.append(helper.make_node("Tile", ["obs", times], ["wide"]))
        outputs.append(tensor("wide", TensorProto.FLOAT, wide))
    built = model(
        "counter_policy",
        nodes,
        [tensor("obs", TensorProto.FLOAT, 8), tensor("state_in.count", TensorProto.FLOAT, 1)],
        outputs,
        w,
        "affinity-tests",
    )
    name = f"counter_policy_{repeats}{f'_{wide}' if wide else ''}.onnx"
    path, _ = write(out_dir, name, built, {"state": {"state_in.count": "state_out.count"}})
    return path


def string_adder(out_dir: Path) -> Path:
    """Triton's ``simple_string`` example as an ONNX policy: ``INPUT0`` and ``INPUT1`` are
    strings of 16 integers each (``[batch, 16]`` BYTES), cast to INT32; ``OUTPUT0`` is
    their sum and ``OUTPUT1`` their difference, cast back to strings. Strings that do not
    hold integers (an empty string included) fail ONNX Runtime's ``Cast``, as they make
    Triton's own model fail: only real inputs can warm it up."""
    w = Weights(seed=3)
    nodes = [
        helper.make_node("Cast", ["INPUT0"], ["a"], to=TensorProto.INT32),
        helper.make_node("Cast", ["INPUT1"], ["b"], to=TensorProto.INT32),
        helper.make_node("Add", ["a", "b"], ["sum"]),
        helper.make_node("Sub", ["a", "b"], ["difference"]),
        helper.make_node("Cast", ["sum"], ["OUTPUT0"], to=TensorProto.STRING),
        helper.make_node("Cast", ["difference"], ["OUTPUT1"], to=TensorProto.STRING),
    ]
    built = model(
        "simple_string",
        nodes,
        [tensor("INPUT0", TensorProto.STRING, 16), tensor("INPUT1", TensorProto.STRING, 16)],
        [tensor("OUTPUT0", TensorProto.STRING, 16), tensor("OUTPUT1", TensorProto.STRING, 16)],
        w,
        "affinity-tests",
    )
    path, _ = write(out_dir, "simple_string.onnx", built, {"state": {}})
    return path


def big_state_policy(out_dir: Path, elements: int = 1 << 20) -> Path:
    """A policy whose recurrent state is ``elements`` float32s (4 MiB by default): each
    step adds one to every element (``state_in.big`` -> ``state_out.big``), and ``steps``
    [batch,1] is their mean, so the step count shows whether the whole state was kept."""
    w = Weights(seed=13)
    nodes = [
        helper.make_node(
            "Add",
            ["state_in.big", w.constant("one", np.ones((1, 1), np.float32))],
            ["state_out.big"],
        ),
        helper.make_node("ReduceMean", ["state_out.big"], ["steps"], axes=[1], keepdims=1),
        helper.make_node("Identity", ["obs"], ["seen"]),
    ]
    built = model(
        "big_state_policy",
        nodes,
        [tensor("obs", TensorProto.FLOAT, 8), tensor("state_in.big", TensorProto.FLOAT, elements)],
        [
            tensor("steps", TensorProto.FLOAT, 1),
            tensor("seen", TensorProto.FLOAT, 8),
            tensor("state_out.big", TensorProto.FLOAT, elements),
        ],
        w,
        "affinity-tests",
    )
    path, _ = write(
        out_dir, "big_state_policy.onnx", built, {"state": {"state_in.big": "state_out.big"}}
    )
    return path


def string_corrid_sequence(out_dir: Path) -> Path:
    """Triton's ``simple_string_dyna_sequence`` as an ONNX policy: a sequence model whose
    correlation id is a STRING (``control.corrid``, ``[batch, 1]``) that the model casts to
    a number, as Triton's example does. ``INPUT`` (int32 ``[batch, 1]``) is added to the
    episode's running sum (``state_in.acc`` -> ``state_out.acc``); ``OUTPUT`` is that sum
    plus the correlation id. An empty string fails ONNX Runtime's ``Cast``."""
    nodes = [
        helper.make_node("Cast", ["control.corrid"], ["corrid"], to=TensorProto.INT32),
        helper.make_node("Add", ["state_in.acc", "INPUT"], ["state_out.acc"]),
        helper.make_node("Add", ["state_out.acc", "corrid"], ["OUTPUT"]),
    ]
    built = model(
        "simple_string_dyna_sequence",
        nodes,
        [
            tensor("INPUT", TensorProto.INT32, 1),
            tensor("control.corrid", TensorProto.STRING, 1),
            tensor("state_in.acc", TensorProto.INT32, 1),
        ],
        [tensor("OUTPUT", TensorProto.INT32, 1), tensor("state_out.acc", TensorProto.INT32, 1)],
        Weights(seed=4),
        "affinity-tests",
    )
    path, _ = write(out_dir, "simple_string_dyna_sequence.onnx", built, {})
    return path


def unknown_control(path: Path) -> Path:
    """A model at ``path``, without a sidecar, with an input ``control.bogus`` (no control
    input the node fills): its contract check names the model file."""
    nodes = [helper.make_node("Identity", ["control.bogus"], ["out"])]
    built = model(
        "unknown_control",
        nodes,
        [tensor("control.bogus", TensorProto.FLOAT, 1)],
        [tensor("out", TensorProto.FLOAT, 1)],
        Weights(seed=5),
        "affinity-tests",
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(built.SerializeToString(deterministic=True))
    return path
