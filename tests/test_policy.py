"""Policy contract and sidecar, client input validation (JSON, binary arrays, openpi
observations), the two demo models and the reference rollout."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from onnx import TensorProto, helper, numpy_helper

from node.contract import PolicyContract, TensorSpec, load_contract, sidecar_path
from node.errors import InvalidInput
from node.inputs import from_arrays, from_json, from_observation, outputs_unbatched
from node.models import (
    ALOHA_DEMO_MODEL,
    DEMO_MODEL,
    DROID_DEMO_MODEL,
    PACKAGED_MODELS,
    RTC_DEMO_MODEL,
    VLA_DEMO_MODEL,
    build_demo,
    build_rtc,
    build_vla,
    resolve_model,
)
from tests.rollout import reference_rollout

Tensor = tuple[str, int, list[int | str]]


def save_model(
    path: Path, inputs: list[Tensor], outputs: list[Tensor], nodes: list[onnx.NodeProto]
) -> Path:
    graph = helper.make_graph(
        nodes,
        "test",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, str(path))
    return path


def identity(src: str, dst: str) -> onnx.NodeProto:
    return helper.make_node("Identity", [src], [dst])


def recurrent_model(path: Path, state_out: str = "state_out.h") -> Path:
    """Input x [1, 2] and state ``state_in.h`` [1, 3]; ``state_out`` = the state, y = x."""
    return save_model(
        path,
        [("x", TensorProto.FLOAT, [1, 2]), ("state_in.h", TensorProto.FLOAT, [1, 3])],
        [("y", TensorProto.FLOAT, [1, 2]), (state_out, TensorProto.FLOAT, [1, 3])],
        [identity("x", "y"), identity("state_in.h", state_out)],
    )


@pytest.fixture(scope="module")
def typed_contract(tmp_path_factory: pytest.TempPathFactory) -> PolicyContract:
    """A stateless model with one input of each interesting dtype, one with symbolic dims."""
    inputs: list[Tensor] = [
        ("count", TensorProto.INT64, [2]),
        ("small", TensorProto.INT8, [2]),
        ("flag", TensorProto.BOOL, [1]),
        ("half", TensorProto.FLOAT16, [1]),
        ("batch", TensorProto.FLOAT, ["n", "k"]),
    ]
    outputs = [(f"{name}_out", kind, shape) for name, kind, shape in inputs]
    nodes = [identity(name, f"{name}_out") for name, _, _ in inputs]
    path = tmp_path_factory.mktemp("typed") / "typed.onnx"
    return load_contract(save_model(path, inputs, outputs, nodes))


VALID_TYPED: dict[str, Any] = {
    "count": [1, -(2**63)],
    "small": [127, -128.0],
    "flag": [True],
    "half": [65504.0],
    "batch": [[1.5, 2], [3, 4]],
}


# --- the contract -------------------------------------------------------------------------


def test_demo_contract() -> None:
    contract = load_contract(DEMO_MODEL)
    assert contract.inputs == (
        TensorSpec("obs", ("batch", 8), "float32"),
        TensorSpec("state_in.hidden", ("batch", 16), "float32"),
    )
    assert contract.outputs == (
        TensorSpec("actions", ("batch", 4, 2), "float32"),
        TensorSpec("state_out.hidden", ("batch", 16), "float32"),
    )
    assert dict(contract.state) == {"state_in.hidden": "state_out.hidden"}
    assert contract.observation_inputs == (TensorSpec("obs", ("batch", 8), "float32"),)
    assert contract.returned_outputs == (TensorSpec("actions", ("batch", 4, 2), "float32"),)
    assert (contract.batch_axis, contract.batchable, contract.batch_blocker) == (True, True, None)
    assert (contract.chunk, contract.chunk_shape) == ("actions", (4, 2))
    assert contract.observation_map == {"obs": "obs"}
    assert dict(contract.metadata) == {"policy": "demo", "action_horizon": 4, "action_dim": 2}
    [(name, zeros)] = contract.initial_state().items()
    assert name == "state_in.hidden"
    assert (zeros.shape, zeros.dtype.name, bool(zeros.any())) == ((1, 16), "float32", False)


def test_demo_to_json_is_json() -> None:
    doc = load_contract(DEMO_MODEL).to_json()
    assert json.loads(json.dumps(doc)) == {
        "inputs": [{"name": "obs", "shape": [1, 8], "dtype": "float32"}],
        "outputs": [{"name": "actions", "shape": [1, 4, 2], "dtype": "float32"}],
        "state": {"state_in.hidden": "state_out.hidden"},
        "batch_axis": True,
        "chunk": "actions",
        "observations": {"obs": "obs"},
        "metadata": {"policy": "demo", "action_horizon": 4, "action_dim": 2},
    }


def test_vla_contract() -> None:
    contract = load_contract(VLA_DEMO_MODEL)
    camera = ("batch", 224, 224, 3)
    assert contract.observation_inputs == (
        TensorSpec("image", camera, "uint8"),
        TensorSpec("wrist_image", camera, "uint8"),
        TensorSpec("state", ("batch", 8), "float32"),
    )
    assert contract.returned_outputs == (TensorSpec("actions", ("batch", 10, 7), "float32"),)
    assert dict(contract.state) == {"state_in.hidden": "state_out.hidden"}
    assert contract.initial_state()["state_in.hidden"].shape == (1, 128)
    assert (contract.batchable, contract.chunk, contract.chunk_shape) == (True, "actions", (10, 7))
    assert contract.observation_map == {
        "observation/image": "image",
        "observation/wrist_image": "wrist_image",
        "observation/state": "state",
    }
    doc = json.loads(json.dumps(contract.to_json()))
    assert doc["inputs"][0] == {"name": "image", "shape": [1, 224, 224, 3], "dtype": "uint8"}
    assert doc["outputs"] == [{"name": "actions", "shape": [1, 10, 7], "dtype": "float32"}]
    assert doc["metadata"] == {"policy": "vla-demo", "action_horizon": 10, "action_dim": 7}


def test_symbolic_dims_in_json_and_initial_state(tmp_path: Path) -> None:
    path = save_model(
        tmp_path / "sym.onnx",
        [("state_in.h", TensorProto.FLOAT, ["batch", 4])],
        [("state_out.h", TensorProto.FLOAT, ["batch", 4])],
        [identity("state_in.h", "state_out.h")],
    )
    contract = load_contract(path)
    assert contract.inputs[0].to_json() == {
        "name": "state_in.h",
        "shape": ["batch", 4],
        "dtype": "float32",
    }
    assert contract.initial_state()["state_in.h"].shape == (1, 4)
    assert contract.observation_inputs == ()


def test_naming_convention_without_sidecar(tmp_path: Path) -> None:
    path = recurrent_model(tmp_path / "conv.onnx")
    assert not sidecar_path(path).exists()
    assert dict(load_contract(path).state) == {"state_in.h": "state_out.h"}


def test_sidecar_replaces_convention(tmp_path: Path) -> None:
    path = recurrent_model(tmp_path / "side.onnx", state_out="h_next")
    with pytest.raises(ValueError, match=r"'state_out\.h', which is not a model output"):
        load_contract(path)  # the convention alone cannot find the output
    sidecar_path(path).write_text(json.dumps({"state": {"state_in.h": "h_next"}}))
    assert dict(load_contract(path).state) == {"state_in.h": "h_next"}


def test_sidecar_can_declare_a_model_stateless(tmp_path: Path) -> None:
    path = recurrent_model(tmp_path / "stateless.onnx")
    sidecar_path(path).write_text('{"state": {}}')
    contract = load_contract(path)
    assert dict(contract.state) == {}
    assert [s.name for s in contract.observation_inputs] == ["x", "state_in.h"]


def test_sidecar_name() -> None:
    assert sidecar_path(Path("/m/policy.v2.onnx")) == Path("/m/policy.v2.affinity.json")
    assert sidecar_path(DEMO_MODEL).is_file()


@pytest.mark.parametrize(
    ("sidecar", "problem"),
    [
        ({"state": {"state_in.nope": "state_out.h"}}, "'state_in.nope' is not a model input"),
        ({"state": {"state_in.h": "nope"}}, "'nope', which is not a model output"),
        ({"state": {"state_in.h": "y"}}, r"is float32 \[1, 3\] but output 'y'"),
        ({"state": {"state_in.h": 3}}, '"state" must map each state input name to an output'),
        ({"state": ["state_in.h"]}, '"state" must map each state input name to an output'),
        ({"state": {"": "y"}}, '"state" must map each state input name to an output'),
        ({"state": {}, "extra": 1}, "unknown key 'extra'; known keys: state, chunk, batch"),
        ([], "must be a JSON object with keys among state, chunk, batch"),
        ({"chunk": "nope"}, "\"chunk\" is 'nope', not an output returned to clients \\(y\\)"),
        ({"chunk": "state_out.h"}, "\"chunk\" is 'state_out.h', not an output returned"),
        ({"chunk": 3}, '"chunk" is a number, not an output'),
        ({"chunk": "y"}, r'"chunk" \'y\' is float32 \[1, 2\]; an action chunk is a float \[batch'),
        ({"batch": "yes"}, '"batch" must be true or false, got a string'),
        ({"batch": 1}, '"batch" must be true or false, got a number'),
        ({"observations": {"cam": "nope"}}, "maps 'cam' to 'nope', which is not an observation"),
        ({"observations": {"h": "state_in.h"}}, "'state_in.h', which is not an observation"),
        ({"observations": {"a": "x", "b": "x"}}, "maps both 'a' and 'b' to 'x'"),
        ({"observations": {"x": 1}}, '"observations" must map each observation key to an input'),
        ({"observations": ["x"]}, '"observations" must map each observation key to an input'),
        ({"metadata": []}, '"metadata" must be a JSON object, got a list'),
        ({"metadata": "pose"}, '"metadata" must be a JSON object, got a string'),
    ],
)
def test_bad_sidecar(tmp_path: Path, sidecar: object, problem: str) -> None:
    path = recurrent_model(tmp_path / "bad.onnx")
    sidecar_path(path).write_text(json.dumps(sidecar))
    with pytest.raises(ValueError, match=problem) as raised:
        load_contract(path)
    assert str(raised.value).startswith(f"{sidecar_path(path)}: ")


def test_sidecar_not_json(tmp_path: Path) -> None:
    path = recurrent_model(tmp_path / "bad.onnx")
    sidecar_path(path).write_text("{state: }")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_contract(path)


def test_state_dtype_mismatch(tmp_path: Path) -> None:
    path = save_model(
        tmp_path / "cast.onnx",
        [("state_in.h", TensorProto.FLOAT, [1, 3])],
        [("state_out.h", TensorProto.DOUBLE, [1, 3])],
        [helper.make_node("Cast", ["state_in.h"], ["state_out.h"], to=TensorProto.DOUBLE)],
    )
    with pytest.raises(ValueError, match=r"float32 \[1, 3\] but output 'state_out.h'"):
        load_contract(path)


def test_unusable_tensor_type(tmp_path: Path) -> None:
    path = save_model(
        tmp_path / "half.onnx",
        [("words", TensorProto.BFLOAT16, [1])],
        [("same", TensorProto.BFLOAT16, [1])],
        [identity("words", "same")],
    )
    with pytest.raises(ValueError, match=r"'words' has type tensor\(bfloat16\)"):
        load_contract(path)


def test_string_tensors_are_object_arrays_of_str(tmp_path: Path) -> None:
    """A model with string inputs and outputs loads (KServe's BYTES); strings pass the input
    rule as str, never numbers, and numbers never as strings."""
    path = save_model(
        tmp_path / "text.onnx",
        [("words", TensorProto.STRING, [1])],
        [("same", TensorProto.STRING, [1])],
        [identity("words", "same")],
    )
    contract = load_contract(path)
    (spec,) = contract.observation_inputs
    assert spec.dtype == "object" and spec.zeros().tolist() == [""]
    words = np.array(["pick"], dtype=object)
    assert from_arrays(contract, {"words": words})["words"].tolist() == ["pick"]
    assert from_arrays(contract, {"words": np.array(["pick"])})["words"].dtype == object
    assert from_json(contract, {"words": ["pick"]})["words"].tolist() == ["pick"]
    for bad in (np.array([1.0]), np.array([b"x"], dtype=object)):
        with pytest.raises(InvalidInput, match="strings only"):
            from_arrays(contract, {"words": bad})
    with pytest.raises(InvalidInput, match="must be a string"):
        from_json(contract, {"words": [3]})


def test_sidecar_with_state_only_still_loads(tmp_path: Path) -> None:
    """Round 1's sidecars (``{"state": ...}`` alone) mean what they meant."""
    path = recurrent_model(tmp_path / "old.onnx", state_out="h_next")
    sidecar_path(path).write_text(json.dumps({"state": {"state_in.h": "h_next"}}))
    contract = load_contract(path)
    assert dict(contract.state) == {"state_in.h": "h_next"}
    assert (contract.chunk, dict(contract.observations), dict(contract.metadata)) == (None, {}, {})


def test_sidecar_without_state_keeps_the_convention(tmp_path: Path) -> None:
    path = recurrent_model(tmp_path / "meta.onnx")
    sidecar_path(path).write_text(json.dumps({"metadata": {"reset_pose": [0.5, 1]}}))
    contract = load_contract(path)
    assert dict(contract.state) == {"state_in.h": "state_out.h"}
    assert contract.metadata["reset_pose"] == [0.5, 1]
    assert contract.to_json()["metadata"] == {"reset_pose": [0.5, 1]}


def batch_model(path: Path, first: int | str, *, chunk_dims: tuple[int, ...] = (4, 2)) -> Path:
    """x [first, 3] -> y [first, 3] and a chunk-shaped c [first, *chunk_dims] (float)."""
    return save_model(
        path,
        [("x", TensorProto.FLOAT, [first, 3]), ("c_in", TensorProto.FLOAT, [first, *chunk_dims])],
        [("y", TensorProto.FLOAT, [first, 3]), ("c", TensorProto.FLOAT, [first, *chunk_dims])],
        [identity("x", "y"), identity("c_in", "c")],
    )


@pytest.mark.parametrize(
    ("first", "axis", "blocker"),
    [
        ("batch", True, None),
        ("n", True, None),
        (1, True, r"x is float32 \[1, 3\]: its batch axis is fixed"),
        (2, False, "the model has no batch axis"),
    ],
)
def test_batch_axis_by_convention(
    tmp_path: Path, first: int | str, axis: bool, blocker: str | None
) -> None:
    contract = load_contract(batch_model(tmp_path / "b.onnx", first))
    assert contract.batch_axis is axis
    assert contract.batchable is (blocker is None)
    if blocker is None:
        assert contract.batch_blocker is None
    else:
        assert re.search(blocker, contract.batch_blocker or "")


def test_batch_axis_needs_every_tensor(tmp_path: Path) -> None:
    """One tensor without a batch-like first dimension: no batch axis by default, and a
    sidecar that declares one is refused, naming the tensor."""
    path = save_model(
        tmp_path / "mixed.onnx",
        [("x", TensorProto.FLOAT, ["batch", 3]), ("gain", TensorProto.FLOAT, [3])],
        [("y", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_node("Mul", ["x", "gain"], ["y"])],
    )
    assert load_contract(path).batch_axis is False
    sidecar_path(path).write_text('{"batch": true}')
    with pytest.raises(ValueError, match=r'"batch" is true but gain is float32 \[3\]'):
        load_contract(path)


def test_sidecar_turns_the_batch_axis_off(tmp_path: Path) -> None:
    path = batch_model(tmp_path / "off.onnx", "batch")
    sidecar_path(path).write_text('{"batch": false}')
    contract = load_contract(path)
    assert (contract.batch_axis, contract.batchable) == (False, False)
    # without a batch axis a symbolic first dimension takes any size, as any other
    parsed = from_json(contract, {"x": [[1.0, 2, 3]] * 2, "c_in": [[[0.0] * 2] * 4] * 2})
    assert parsed["x"].shape == (2, 3)
    assert contract.to_json()["inputs"][0]["shape"] == ["batch", 3]


def test_chunk_found_by_shape_or_named(tmp_path: Path) -> None:
    path = batch_model(tmp_path / "chunk.onnx", "batch")
    contract = load_contract(path)
    assert (contract.chunk, contract.chunk_shape) == ("c", (4, 2))
    sidecar_path(path).write_text('{"chunk": null}')
    assert load_contract(path).chunk is None
    # two candidates: none is guessed, the sidecar names one
    two = save_model(
        tmp_path / "two.onnx",
        [("x", TensorProto.FLOAT, ["b", 2, 3])],
        [("u", TensorProto.FLOAT, ["b", 2, 3]), ("v", TensorProto.FLOAT, ["b", 2, 3])],
        [identity("x", "u"), identity("x", "v")],
    )
    assert load_contract(two).chunk is None
    sidecar_path(two).write_text('{"chunk": "v"}')
    assert (load_contract(two).chunk, load_contract(two).chunk_shape) == ("v", (2, 3))


def test_chunk_must_be_a_float_chunk(tmp_path: Path) -> None:
    path = save_model(
        tmp_path / "int.onnx",
        [("x", TensorProto.INT32, ["b", 4, 2]), ("z", TensorProto.FLOAT, ["b", "h", 2])],
        [("steps", TensorProto.INT32, ["b", 4, 2]), ("free", TensorProto.FLOAT, ["b", "h", 2])],
        [identity("x", "steps"), identity("z", "free")],
    )
    assert load_contract(path).chunk is None  # an int chunk and a symbolic horizon: not chunks
    for name, shown in (("steps", r"int32 \[b, 4, 2\]"), ("free", r"float32 \[b, h, 2\]")):
        sidecar_path(path).write_text(json.dumps({"chunk": name}))
        with pytest.raises(ValueError, match=rf"'{name}' is {shown}; an action chunk is a float"):
            load_contract(path)


def test_chunk_without_batch_axis_is_two_dimensional(tmp_path: Path) -> None:
    path = save_model(
        tmp_path / "flat.onnx",
        [("x", TensorProto.FLOAT, [5, 3])],
        [("plan", TensorProto.FLOAT, [5, 3])],
        [identity("x", "plan")],
    )
    contract = load_contract(path)
    assert (contract.batch_axis, contract.chunk, contract.chunk_shape) == (False, "plan", (5, 3))


def test_observation_map(tmp_path: Path) -> None:
    path = batch_model(tmp_path / "obs.onnx", "batch")
    sidecar_path(path).write_text(json.dumps({"observations": {"observation/x": "x"}}))
    contract = load_contract(path)
    assert contract.observation_map == {"observation/x": "x", "c_in": "c_in"}
    assert contract.to_json()["observations"] == {"observation/x": "x", "c_in": "c_in"}
    # a key named like another input that nothing maps would feed that input twice
    sidecar_path(path).write_text(json.dumps({"observations": {"c_in": "x"}}))
    with pytest.raises(ValueError, match="'c_in' is also the name of input 'c_in'"):
        load_contract(path)
    # ... unless that input is mapped too: a swap is fine
    sidecar_path(path).write_text(json.dumps({"observations": {"c_in": "x", "x": "c_in"}}))
    assert load_contract(path).observation_map == {"c_in": "x", "x": "c_in"}


def test_resolve_model(tmp_path: Path) -> None:
    assert resolve_model("demo") == DEMO_MODEL
    assert resolve_model("vla-demo") == VLA_DEMO_MODEL
    assert resolve_model("droid-demo") == DROID_DEMO_MODEL
    assert resolve_model("aloha-demo") == ALOHA_DEMO_MODEL
    assert resolve_model("rtc-demo") == RTC_DEMO_MODEL
    assert set(PACKAGED_MODELS) == {"demo", "vla-demo", "droid-demo", "aloha-demo", "rtc-demo"}
    assert all(path.is_file() for path in PACKAGED_MODELS.values())
    mine = recurrent_model(tmp_path / "mine.onnx")
    assert resolve_model(str(mine)) == mine
    assert resolve_model(mine) == mine
    with pytest.raises(
        ValueError,
        match=r"'nope\.onnx': not a packaged model \(demo, vla-demo, droid-demo, aloha-demo, "
        r"rtc-demo\)",
    ):
        resolve_model("nope.onnx")
    with pytest.raises(ValueError, match="nor an existing file"):
        resolve_model(tmp_path)  # a directory


# --- from_json -----------------------------------------------------------------------


def test_parse_demo_inputs() -> None:
    contract = load_contract(DEMO_MODEL)
    parsed = from_json(contract, {"obs": [[0.5, 1, -2, 0, 0, 0, 0, 3e-3]]})
    assert list(parsed) == ["obs"]
    assert parsed["obs"].dtype == np.float32
    np.testing.assert_array_equal(
        parsed["obs"], np.array([[0.5, 1, -2, 0, 0, 0, 0, 3e-3]], np.float32)
    )


def test_parse_every_dtype(typed_contract: PolicyContract) -> None:
    parsed = from_json(typed_contract, VALID_TYPED)
    assert {name: (a.dtype.name, a.shape) for name, a in parsed.items()} == {
        "count": ("int64", (2,)),
        "small": ("int8", (2,)),
        "flag": ("bool", (1,)),
        "half": ("float16", (1,)),
        "batch": ("float32", (2, 2)),
    }
    assert parsed["count"].tolist() == [1, -(2**63)]
    assert parsed["small"].tolist() == [127, -128]


@pytest.mark.parametrize(
    ("raw", "field", "problem"),
    [
        ([[0.0] * 8], "", "must be an object"),
        (None, "", "got null"),
        ({}, "obs", "missing; expected float32 [1, 8]"),
        ({"obs": [[0.0] * 8], "extra": 1}, "extra", "unknown input; expected: obs"),
        ({"obs": [[0.0] * 8], "state_in.hidden": [[0.0] * 16]}, "state_in.hidden", "state"),
        ({"obs": [[0.0] * 7]}, "obs", "[0] has 7 elements, dimension 1 of float32 [1, 8] needs 8"),
        ({"obs": [0.0] * 8}, "obs", "value has 8 elements; dimension 0 of float32 [1, 8] is"),
        ({"obs": [[0.0] * 8] * 3}, "obs", "3 elements; dimension 0 of float32 [1, 8] is the batch"),
        ({"obs": [[[0.0]] * 8]}, "obs", "[0][0] must be a number, got a list"),
        ({"obs": [[0.0] * 7 + ["1"]]}, "obs", "[0][7] must be a number, got a string"),
        ({"obs": [[0.0] * 7 + [None]]}, "obs", "[0][7] must be a number, got null"),
        ({"obs": [[0.0] * 7 + [{}]]}, "obs", "[0][7] must be a number, got an object"),
        ({"obs": [[0.0] * 7 + [True]]}, "obs", "[0][7] must be a number, got a boolean"),
        ({"obs": [[math.nan] + [0.0] * 7]}, "obs", "[0][0] is nan; must be finite"),
        ({"obs": [[0.0, -math.inf] + [0.0] * 6]}, "obs", "[0][1] is -inf; must be finite"),
        ({"obs": [[1e39] + [0.0] * 7]}, "obs", "[0][0] is out of range for float32"),
        ({"obs": [[10**400] + [0.0] * 7]}, "obs", "[0][0] is out of range for float32"),
        ({"obs": "0"}, "obs", "value must be a list (expected float32 [1, 8]), got a string"),
    ],
)
def test_parse_rejects_demo_inputs(raw: object, field: str, problem: str) -> None:
    with pytest.raises(InvalidInput) as raised:
        from_json(load_contract(DEMO_MODEL), raw)
    assert raised.value.field == field
    assert problem in raised.value.problem
    assert (
        str(raised.value) == (f"inputs.{field}: " if field else "inputs: ") + raised.value.problem
    )


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("count", [1, 2**63], "[1] is out of range for int64"),
        ("count", [1, -(2**63) - 1], "[1] is out of range for int64"),
        ("count", [1, 10**400], "[1] is out of range for int64"),
        ("count", [1, 2.5], "[1] must be an integer for int64"),
        ("count", [1, math.nan], "[1] is nan; must be finite"),
        ("small", [128, 0], "[0] is out of range for int8"),
        ("count", [True, 1], "[0] must be a number, got a boolean"),
        ("flag", [1], "[0] must be true or false"),
        ("half", [65536.0], "[0] is out of range for float16"),
        ("batch", [], "value is empty; dimension 0 needs at least 1"),
        ("batch", [[]], "[0] is empty; dimension 1 needs at least 1"),
        ("batch", [[1.0, 2.0], [3.0]], "[1] has 1 elements but its siblings have 2 (ragged)"),
        ("batch", [[1.0], [2.0, 3.0]], "[1] has 2 elements but its siblings have 1 (ragged)"),
    ],
)
def test_parse_rejects_typed_inputs(
    typed_contract: PolicyContract, field: str, value: object, problem: str
) -> None:
    with pytest.raises(InvalidInput) as raised:
        from_json(typed_contract, {**VALID_TYPED, field: value})
    assert (raised.value.field, raised.value.problem) == (field, problem)


def test_symbolic_dims_accept_any_size(typed_contract: PolicyContract) -> None:
    parsed = from_json(typed_contract, {**VALID_TYPED, "batch": [[1.0, 2.0, 3.0]] * 5})
    assert parsed["batch"].shape == (5, 3)


def test_long_unknown_name_is_shortened_in_message() -> None:
    with pytest.raises(InvalidInput) as raised:
        from_json(load_contract(DEMO_MODEL), {"x" * 10_000: 1})
    assert raised.value.field == "x" * 10_000
    assert len(str(raised.value)) < 200


JSON = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
)
DEMO_CONTRACT = load_contract(DEMO_MODEL)
TYPED_NAMES = ["count", "small", "flag", "half", "batch"]


@given(JSON)
def test_parse_raises_only_invalid_input_for_any_json(raw: object) -> None:
    with contextlib.suppress(InvalidInput):
        from_json(DEMO_CONTRACT, raw)


SMALL_JSON = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=3),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(), children),
    max_leaves=10,
)
# Nearly an observation: rows of 7 to 9 numbers (or booleans), one or two rows.
NEAR_OBS = st.lists(
    st.lists(st.floats() | st.integers() | st.booleans(), min_size=7, max_size=9),
    min_size=1,
    max_size=2,
)


@given(
    st.dictionaries(
        st.sampled_from(["obs", "state_in.hidden"]) | st.text(max_size=3),
        NEAR_OBS | SMALL_JSON,
        max_size=3,
    )
)
def test_parse_raises_only_invalid_input_near_the_contract(raw: dict[str, object]) -> None:
    with contextlib.suppress(InvalidInput):
        from_json(DEMO_CONTRACT, raw)


@given(data=st.data())
def test_parse_raises_only_invalid_input_for_every_dtype(
    typed_contract: PolicyContract, data: st.DataObject
) -> None:
    field = data.draw(st.sampled_from(TYPED_NAMES))
    raw = {**VALID_TYPED, field: data.draw(JSON)}
    try:
        parsed = from_json(typed_contract, raw)
    except InvalidInput as exc:
        assert exc.field == field
    else:
        assert parsed[field].dtype.name == {s.name: s.dtype for s in typed_contract.inputs}[field]


@given(
    hnp.arrays(
        np.float32, (1, 8), elements=st.floats(width=32, allow_nan=False, allow_infinity=False)
    )
)
def test_parse_round_trips_valid_observations(observation: np.ndarray[Any, Any]) -> None:
    parsed = from_json(DEMO_CONTRACT, {"obs": observation.tolist()})
    np.testing.assert_array_equal(parsed["obs"], observation)


# --- binary arrays (msgpack /act, KServe) ---------------------------------------------------


def test_arrays_in_the_model_shape() -> None:
    obs = np.arange(8, dtype=np.float32).reshape(1, 8)
    inputs = from_arrays(DEMO_CONTRACT, {"obs": obs})
    assert inputs["obs"] is obs  # nothing to convert: no copy
    converted = from_arrays(DEMO_CONTRACT, {"obs": obs.astype(np.float64)})["obs"]
    assert (converted.dtype, converted.shape) == (np.float32, (1, 8))
    np.testing.assert_array_equal(converted, obs)
    # big-endian, strided and read-only arrays are made native and contiguous
    swapped = obs.astype(">f4")
    np.testing.assert_array_equal(from_arrays(DEMO_CONTRACT, {"obs": swapped})["obs"], obs)
    strided = np.zeros((1, 16), np.float32)[:, ::2]
    assert from_arrays(DEMO_CONTRACT, {"obs": strided})["obs"].flags.c_contiguous
    # nested lists still parse as in JSON
    listed = from_arrays(DEMO_CONTRACT, {"obs": obs.tolist()})["obs"]
    np.testing.assert_array_equal(listed, obs)


def test_read_only_buffers_run_through_the_model() -> None:
    """What ``affinity/wire.py`` hands over: arrays over the received bytes (read only)."""
    obs = np.linspace(-1, 1, 8, dtype=np.float32).reshape(1, 8)
    received = np.frombuffer(obs.tobytes(), dtype="<f4").reshape(1, 8)
    assert not received.flags.writeable
    inputs = from_arrays(DEMO_CONTRACT, {"obs": received})
    [want] = reference_rollout(DEMO_MODEL, [obs])
    [got] = reference_rollout(DEMO_MODEL, [inputs])
    np.testing.assert_array_equal(got["actions"], want["actions"])


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (
            np.zeros((3, 8), np.float32),
            "has shape [3, 8]; expected float32 [1, 8]: dimension 0 "
            "is the batch axis, send exactly one sample per step",
        ),
        (np.zeros(8, np.float32), "has shape [8]; expected float32 [1, 8]"),
        (np.zeros((1, 7), np.float32), "has shape [1, 7]; expected float32 [1, 8]"),
        (np.zeros((1, 1, 8), np.float32), "has shape [1, 1, 8]; expected float32 [1, 8]"),
        (np.zeros((1, 8), bool), "is bool; obs takes float32"),
        (np.zeros((1, 8), np.complex64), "is complex64; obs takes float32"),
        (np.zeros((1, 8), "U1"), "is <U1; obs takes float32"),
        (np.zeros((1, 8), object), "is object; obs takes float32"),
        (np.array([[0.0] * 7 + [np.nan]]), "[0][7] is nan; must be finite"),
        (np.array([[0.0, -np.inf] + [0.0] * 6], np.float16), "[0][1] is -inf; must be finite"),
        (np.full((1, 8), 1e39), "is float64 with values beyond the range of float32"),
        (np.float32(1.0), "has shape []; expected float32 [1, 8]"),
        ("0", "value must be a list (expected float32 [1, 8]), got a string"),
        (b"\x00" * 32, "value must be a list (expected float32 [1, 8]), got bytes"),
        (
            [[0.0] * 8] * 2,
            "value has 2 elements; dimension 0 of float32 [1, 8] is the batch axis, "
            "send exactly one sample per step",
        ),
    ],
)
def test_arrays_rejected(value: object, problem: str) -> None:
    with pytest.raises(InvalidInput) as raised:
        from_arrays(DEMO_CONTRACT, {"obs": value})
    assert (raised.value.field, raised.value.problem) == ("obs", problem)
    assert str(raised.value) == f"inputs.obs: {problem}"


@pytest.mark.parametrize(
    ("raw", "field", "problem"),
    [
        ([np.zeros((1, 8), np.float32)], "", "must be an object of input name -> array"),
        ({}, "obs", "missing; expected float32 [1, 8]"),
        ({"obs": np.zeros((1, 8)), "x": np.zeros(1)}, "x", "unknown input; expected: obs"),
        (
            {"obs": np.zeros((1, 8)), "state_in.hidden": np.zeros((1, 16))},
            "state_in.hidden",
            "is recurrent state kept by the server; do not send it",
        ),
    ],
)
def test_array_maps_rejected(raw: object, field: str, problem: str) -> None:
    with pytest.raises(InvalidInput) as raised:
        from_arrays(DEMO_CONTRACT, raw)
    assert raised.value.field == field
    assert raised.value.problem.startswith(problem)


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("count", np.array([1, 2], np.uint64) << np.uint64(63), "is uint64 with values outside"),
        ("small", np.array([127, 128]), "is int64 with values outside -128..127 (int8)"),
        ("small", np.array([1.0, 2.0]), "is float64; small takes int8 (send 0-255 integers"),
        ("count", np.array([True, False]), "is bool; count takes int64"),
        ("flag", np.array([1], np.uint8), "is uint8; flag takes bool only"),
        ("half", np.array([65536.0]), "is float64 with values beyond the range of float16"),
        ("half", np.array([70000]), "is int64 with values beyond the range of float16"),
        ("batch", np.zeros((0, 2), np.float32), "dimension 0 needs at least 1"),
        ("batch", np.zeros((2, 0), np.float32), "dimension 1 needs at least 1"),
    ],
)
def test_typed_arrays_rejected(
    typed_contract: PolicyContract, field: str, value: np.ndarray[Any, Any], problem: str
) -> None:
    arrays = from_json(typed_contract, VALID_TYPED)
    same = from_arrays(typed_contract, arrays)
    assert all(same[name] is array for name, array in arrays.items())  # valid as they are
    with pytest.raises(InvalidInput) as raised:
        from_arrays(typed_contract, {**arrays, field: value})
    assert raised.value.field == field
    assert problem in raised.value.problem


def test_typed_arrays_convert_by_the_rule(typed_contract: PolicyContract) -> None:
    arrays = {
        "count": np.array([1, 2], np.uint8),  # unsigned into signed, in range
        "small": np.array([-128, 127], np.int64),  # wider into narrower, in range
        "flag": np.array([True]),
        "half": np.array([3], np.int32),  # integers into floats
        "batch": np.ones((5, 3), np.float64),  # symbolic dims: any size
    }
    inputs = from_arrays(typed_contract, arrays)
    assert {name: (a.dtype.name, a.shape) for name, a in inputs.items()} == {
        "count": ("int64", (2,)),
        "small": ("int8", (2,)),
        "flag": ("bool", (1,)),
        "half": ("float16", (1,)),
        "batch": ("float32", (5, 3)),
    }
    assert inputs["small"].tolist() == [-128, 127]


ANY_DTYPE = st.sampled_from(
    ["float16", "float32", ">f8", "int8", "uint8", "<i8", "uint64", "bool", "complex64", "U2"]
)


@given(hnp.arrays(ANY_DTYPE, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9)))
def test_arrays_raise_only_invalid_input(value: np.ndarray[Any, Any]) -> None:
    try:
        inputs = from_arrays(DEMO_CONTRACT, {"obs": value})
    except InvalidInput as exc:
        assert exc.field == "obs"
    else:
        assert (inputs["obs"].dtype, inputs["obs"].shape) == (np.float32, (1, 8))
        np.testing.assert_array_equal(inputs["obs"], value.astype(np.float32))


@given(
    hnp.arrays(
        np.float64, (1, 8), elements=st.floats(-3e38, 3e38, allow_nan=False, allow_infinity=False)
    )
)
def test_float64_arrays_match_the_json_path(observation: np.ndarray[Any, Any]) -> None:
    decoded = from_json(DEMO_CONTRACT, {"obs": observation.tolist()})["obs"]
    np.testing.assert_array_equal(from_arrays(DEMO_CONTRACT, {"obs": observation})["obs"], decoded)


# --- openpi observations -----------------------------------------------------------------


VLA_CONTRACT = load_contract(VLA_DEMO_MODEL)


def libero(seed: int) -> dict[str, Any]:
    """An observation as openpi's LIBERO client sends it (flat keys, unbatched, f64 state)."""
    rng = np.random.default_rng(seed)
    return {
        "observation/image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "observation/wrist_image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "observation/state": rng.uniform(-1, 1, 8),
        "prompt": "put the bowl on the plate",
    }


def test_openpi_observation_gets_the_batch_axis() -> None:
    observation = libero(1)
    inputs, ignored = from_observation(VLA_CONTRACT, observation)
    assert ignored == ("prompt",)
    assert {name: (a.dtype.name, a.shape) for name, a in inputs.items()} == {
        "image": ("uint8", (1, 224, 224, 3)),
        "wrist_image": ("uint8", (1, 224, 224, 3)),
        "state": ("float32", (1, 8)),
    }
    np.testing.assert_array_equal(inputs["image"][0], observation["observation/image"])
    assert np.shares_memory(inputs["image"], observation["observation/image"])  # no copy
    np.testing.assert_array_equal(
        inputs["state"][0], observation["observation/state"].astype(np.float32)
    )


def test_nested_observation_flattens_with_slashes() -> None:
    flat = libero(2)
    nested = {
        "observation": {
            "image": flat["observation/image"],
            "wrist_image": flat["observation/wrist_image"],
            "state": flat["observation/state"],
        },
        "prompt": flat["prompt"],
        "extra": {"depth": {"front": np.zeros(3)}, "n": 3},
    }
    inputs, ignored = from_observation(VLA_CONTRACT, nested)
    want, _ = from_observation(VLA_CONTRACT, flat)
    assert ignored == ("extra/depth/front", "extra/n", "prompt")
    for name in want:
        np.testing.assert_array_equal(inputs[name], want[name])


def test_ignored_values_are_never_touched() -> None:
    class Hostile:
        def __array__(self, *args: object, **kwargs: object) -> None:
            raise AssertionError("an ignored value was read")

    inputs, ignored = from_observation(
        VLA_CONTRACT, {**libero(3), "prompt": Hostile(), "tokens": [Hostile()] * 3}
    )
    assert ignored == ("prompt", "tokens")
    assert set(inputs) == {"image", "wrist_image", "state"}


def test_openpi_with_the_demo_policy_and_lists() -> None:
    inputs, ignored = from_observation(DEMO_CONTRACT, {"obs": [0.5] * 8})
    assert ignored == ()
    assert (inputs["obs"].dtype, inputs["obs"].shape) == (np.float32, (1, 8))
    scalar = from_observation(DEMO_CONTRACT, {"obs": np.arange(8)})  # ints -> float
    assert scalar.inputs["obs"].tolist() == [list(range(8))]


def without(observation: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in observation.items() if k != key}


@pytest.mark.parametrize(
    ("change", "field", "problem"),
    [
        (
            lambda o: without(o, "observation/image"),
            "observation/image",
            "missing; expected uint8 [224, 224, 3]",
        ),
        (
            lambda o: {**o, "observation/image": o["observation/image"][np.newaxis]},
            "observation/image",
            "has shape [1, 224, 224, 3]; expected uint8 [224, 224, 3]",
        ),
        (
            lambda o: {**o, "observation/image": o["observation/image"].transpose(2, 0, 1)},
            "observation/image",
            "has shape [3, 224, 224]; expected uint8 [224, 224, 3]",
        ),
        (
            lambda o: {**o, "observation/image": o["observation/image"] / 255.0},
            "observation/image",
            "is float64; image takes uint8 (send 0-255 integers, not floats)",
        ),
        (
            lambda o: {**o, "observation/wrist_image": o["observation/image"].astype(np.int16) - 1},
            "observation/wrist_image",
            "is int16 with values outside 0..255 (uint8)",
        ),
        (
            lambda o: {**o, "observation/state": np.zeros(7)},
            "observation/state",
            "has shape [7]; expected float32 [8]",
        ),
        (
            lambda o: {**o, "observation/state": np.full(8, np.nan)},
            "observation/state",
            "[0] is nan; must be finite",
        ),
        (
            lambda o: {**o, "observation/state": "zeros"},
            "observation/state",
            "value must be a list (expected float32 [8]), got a string",
        ),
        (
            lambda o: {**o, "observation/state": None},
            "observation/state",
            "value must be a list (expected float32 [8]), got null",
        ),
        (
            lambda o: {**o, "observation": {"state": o["observation/state"]}},
            "observation/state",
            "given twice (nested and flat)",
        ),
        (
            lambda o: {"prompt": o["prompt"]},
            "",
            "missing 3 keys: observation/image (uint8 [224, 224, 3]), observation/wrist_image "
            "(uint8 [224, 224, 3]), observation/state (float32 [8])",
        ),
        (lambda o: {**o, 3: 1}, "3", "keys must be strings"),
        (lambda o: {**o, "x": {b"k": 1}}, "x/b'k'", "keys must be strings"),
        (lambda o: [o], "", "must be a map of key -> value, got a list"),
        (lambda o: np.zeros(3), "", "must be a map of key -> value, got ndarray"),
    ],
)
def test_bad_openpi_observations(change: Any, field: str, problem: str) -> None:
    with pytest.raises(InvalidInput) as raised:
        from_observation(VLA_CONTRACT, change(libero(4)))
    assert (raised.value.field, raised.value.problem) == (field, problem)
    assert str(raised.value) == (f"observation.{field}: " if field else "observation: ") + problem


def test_observation_nesting_is_bounded() -> None:
    deep: dict[str, Any] = {"leaf": 1}
    for _ in range(8):
        deep = {"d": deep}
    with pytest.raises(InvalidInput, match="nested deeper than 8 maps") as raised:
        from_observation(VLA_CONTRACT, {**libero(5), **deep})
    assert raised.value.field == "/".join(["d"] * 8)


def test_openpi_without_a_batch_axis_takes_the_whole_shape(tmp_path: Path) -> None:
    path = batch_model(tmp_path / "fixed.onnx", 2)
    contract = load_contract(path)
    assert not contract.batch_axis
    inputs, _ = from_observation(contract, {"x": np.ones((2, 3)), "c_in": np.ones((2, 4, 2))})
    assert inputs["x"].shape == (2, 3)
    outputs = {"y": np.ones((2, 3), np.float32)}
    assert outputs_unbatched(contract, outputs)["y"].shape == (2, 3)


OBSERVATION_VALUES = (
    st.none()
    | st.text(max_size=3)
    | st.integers()
    | st.floats()
    | hnp.arrays(
        st.sampled_from(["uint8", "float64", "int64", "bool", "float32"]),
        st.sampled_from([(), (8,), (1, 8), (7,), (224, 224, 3), (3, 224, 224)]),
    )
)
OBSERVATION_KEYS = st.sampled_from(
    ["observation/image", "observation/wrist_image", "observation/state", "prompt", "observation"]
) | st.text(max_size=3)


@given(
    st.recursive(
        st.dictionaries(OBSERVATION_KEYS, OBSERVATION_VALUES, max_size=5),
        lambda children: st.dictionaries(
            OBSERVATION_KEYS, children | OBSERVATION_VALUES, max_size=3
        ),
        max_leaves=8,
    ),
    st.booleans(),
)
def test_observations_raise_only_invalid_input(observation: dict[str, Any], complete: bool) -> None:
    if complete:  # the valid ones first, so that what follows is what is under test
        observation = {**libero(6), **observation}
    try:
        inputs, ignored = from_observation(VLA_CONTRACT, observation)
    except InvalidInput as exc:
        assert str(exc).startswith("observation")
    else:
        assert {name: a.shape[0] for name, a in inputs.items()} == {
            "image": 1,
            "wrist_image": 1,
            "state": 1,
        }
        assert "observation/image" not in ignored


def test_outputs_unbatched() -> None:
    [step] = reference_rollout(DEMO_MODEL, [np.zeros((1, 8), np.float32)])
    returned = {"actions": step["actions"]}
    unbatched = outputs_unbatched(DEMO_CONTRACT, returned)
    assert unbatched["actions"].shape == (4, 2)
    np.testing.assert_array_equal(unbatched["actions"], step["actions"][0])
    with pytest.raises(ValueError, match=r"output 'actions' has shape \[2, 4, 2\]"):
        outputs_unbatched(DEMO_CONTRACT, {"actions": np.zeros((2, 4, 2))})
    with pytest.raises(ValueError, match=r"output 'x' has shape \[\]"):
        outputs_unbatched(DEMO_CONTRACT, {"x": np.float32(1)})


# --- the demo model and the reference rollout ----------------------------------------------


@pytest.mark.parametrize(
    ("build", "packaged", "limit"),
    [
        (build_demo.build, DEMO_MODEL, 8192),
        (build_vla.build, VLA_DEMO_MODEL, 2_000_000),
        (functools.partial(build_vla.build, robot=build_vla.DROID), DROID_DEMO_MODEL, 2_000_000),
        (functools.partial(build_vla.build, robot=build_vla.ALOHA), ALOHA_DEMO_MODEL, 2_000_000),
        (build_rtc.build, RTC_DEMO_MODEL, 200_000),
    ],
)
def test_packaged_models_are_reproducible(
    tmp_path: Path, build: Any, packaged: Path, limit: int
) -> None:
    model, sidecar = build(tmp_path)
    assert model.read_bytes() == packaged.read_bytes()
    assert sidecar.read_bytes() == sidecar_path(packaged).read_bytes()
    assert model.stat().st_size < limit
    loaded = onnx.load(str(packaged))
    assert loaded.ir_version == 10
    assert [(o.domain, o.version) for o in loaded.opset_import] == [("", 17)]
    first_dims = [
        value.type.tensor_type.shape.dim[0].dim_param
        for value in (*loaded.graph.input, *loaded.graph.output)
    ]
    assert first_dims == ["batch"] * len(first_dims)


def observations(steps: int) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(7)
    return [rng.uniform(-1, 1, (1, 8)).astype(np.float32) for _ in range(steps)]


def test_reference_rollout_matches_the_documented_equations() -> None:
    weights = {
        t.name: numpy_helper.to_array(t) for t in onnx.load(str(DEMO_MODEL)).graph.initializer
    }
    hidden = np.zeros((1, 16), np.float32)
    steps = reference_rollout(DEMO_MODEL, observations(5))
    for obs, step in zip(observations(5), steps, strict=True):
        hidden = np.tanh(obs @ weights["Wx"] + hidden @ weights["Wh"] + weights["b"])
        actions = np.tanh(hidden @ weights["Wa"] + weights["ba"]).reshape(1, 4, 2)
        np.testing.assert_allclose(step["state_out.hidden"], hidden, atol=1e-5)
        np.testing.assert_allclose(step["actions"], actions, atol=1e-5)
        hidden = step["state_out.hidden"]


def test_reference_rollout_depends_on_history() -> None:
    obs = observations(20)
    rollout = reference_rollout(DEMO_MODEL, obs)
    assert len(rollout) == 20
    assert all(step["actions"].shape == (1, 4, 2) for step in rollout)
    again = reference_rollout(DEMO_MODEL, obs)
    assert all(
        np.array_equal(a["actions"], b["actions"]) for a, b in zip(rollout, again, strict=True)
    )
    fresh = [reference_rollout(DEMO_MODEL, [o])[0] for o in obs]  # state reset every step
    np.testing.assert_array_equal(rollout[0]["actions"], fresh[0]["actions"])
    for step in range(1, 20):
        assert np.abs(rollout[step]["actions"] - fresh[step]["actions"]).max() > 1e-3


def test_reference_rollout_needs_each_observation_input(tmp_path: Path) -> None:
    path = save_model(
        tmp_path / "two.onnx",
        [("a", TensorProto.FLOAT, [1]), ("b", TensorProto.FLOAT, [1])],
        [("c", TensorProto.FLOAT, [1])],
        [helper.make_node("Add", ["a", "b"], ["c"])],
    )
    with pytest.raises(ValueError, match=r"takes \['a', 'b'\]; give each step as a map"):
        reference_rollout(path, [np.zeros(1, np.float32)])
    with pytest.raises(ValueError, match=r"takes \['a', 'b'\], got \['a'\]"):
        reference_rollout(path, [{"a": np.zeros(1, np.float32)}])
    [step] = reference_rollout(path, [{"a": np.ones(1), "b": np.full(1, 2.0)}])
    assert step["c"].tolist() == [3.0]


# --- the camera-sized demo policy ------------------------------------------------------------


def conv(
    x: np.ndarray[Any, Any], w: np.ndarray[Any, Any], b: np.ndarray[Any, Any], stride: int, pad: int
) -> np.ndarray[Any, Any]:
    """ONNX Conv (NCHW, no dilation, one group) in plain numpy."""
    padded = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    k = w.shape[-1]
    windows = np.lib.stride_tricks.sliding_window_view(padded, (k, k), axis=(2, 3))
    windows = windows[:, :, ::stride, ::stride]
    return np.einsum("bchwij,ocij->bohw", windows, w) + b[None, :, None, None]


def vla_step(
    weights: dict[str, np.ndarray[Any, Any]],
    obs: dict[str, np.ndarray[Any, Any]],
    hidden: np.ndarray[Any, Any],
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """build_vla.py's documented equations, in float64."""

    def relu(v: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return np.maximum(v, 0)

    features = []
    for camera in build_vla.CAMERAS:
        x = (obs[camera].astype(np.float64) * (2 / 255) - 1).transpose(0, 3, 1, 2)
        for name, _, _, _, stride, pad in build_vla.CONVS:
            x = relu(conv(x, weights[name], weights[name.lower()], stride, pad))
        features.append(relu(x.reshape(len(x), -1) @ weights["Wf"] + weights["bf"]))
    features.append(relu(obs["state"] @ weights["Ws"] + weights["bs"]))
    z = np.concatenate(features, axis=1)
    hidden = np.tanh(z @ weights["Wx"] + hidden @ weights["Wh"] + weights["b"])
    actions = np.tanh(hidden @ weights["Wa"] + weights["ba"]).reshape(-1, 10, 7)
    return actions, hidden


def vla_inputs(steps: int, seed: int = 11) -> list[dict[str, np.ndarray[Any, Any]]]:
    return [from_observation(VLA_CONTRACT, libero(seed + t)).inputs for t in range(steps)]


def test_vla_matches_the_documented_equations() -> None:
    weights = {
        t.name: numpy_helper.to_array(t).astype(np.float64)
        for t in onnx.load(str(VLA_DEMO_MODEL)).graph.initializer
    }
    hidden = np.zeros((1, 128))
    steps = vla_inputs(3)
    for obs, served in zip(steps, reference_rollout(VLA_DEMO_MODEL, steps), strict=True):
        actions, hidden = vla_step(weights, obs, hidden)
        np.testing.assert_allclose(served["actions"], actions, atol=1e-4)
        np.testing.assert_allclose(served["state_out.hidden"], hidden, atol=1e-4)
        hidden = served["state_out.hidden"].astype(np.float64)


def test_vla_rollout_equals_ort_step_by_step_with_state_fed_back() -> None:
    steps = vla_inputs(6)
    rollout = reference_rollout(VLA_DEMO_MODEL, steps)
    session = onnxruntime.InferenceSession(str(VLA_DEMO_MODEL), providers=["CPUExecutionProvider"])
    state = VLA_CONTRACT.initial_state()
    for obs, want in zip(steps, rollout, strict=True):
        actions, hidden = session.run(["actions", "state_out.hidden"], {**obs, **state})
        np.testing.assert_array_equal(actions, want["actions"])
        assert outputs_unbatched(VLA_CONTRACT, {"actions": actions})["actions"].shape == (10, 7)
        state = {"state_in.hidden": hidden}
    # the hidden state carries history: the last step differs from a fresh start
    fresh = reference_rollout(VLA_DEMO_MODEL, steps[-1:])[0]["actions"]
    assert np.abs(fresh - rollout[-1]["actions"]).max() > 1e-3


def test_vla_actions_depend_on_each_camera_and_the_state() -> None:
    [base] = vla_inputs(1)
    [reference] = reference_rollout(VLA_DEMO_MODEL, [base])
    for name, changed in (
        ("image", np.full_like(base["image"], 200)),
        ("wrist_image", np.zeros_like(base["wrist_image"])),
        ("state", base["state"] + 0.5),
    ):
        [step] = reference_rollout(VLA_DEMO_MODEL, [{**base, name: changed}])
        assert np.abs(step["actions"] - reference["actions"]).max() > 1e-3, name


def test_vla_batch_of_episodes_equals_each_run_alone() -> None:
    """What per-device batching relies on: samples along the batch axis do not mix."""
    episodes = [vla_inputs(1, seed=20 + i)[0] for i in range(3)]
    hidden = [
        np.random.default_rng(i).uniform(-1, 1, (1, 128)).astype(np.float32) for i in range(3)
    ]
    session = onnxruntime.InferenceSession(str(VLA_DEMO_MODEL), providers=["CPUExecutionProvider"])
    batch = {name: np.concatenate([e[name] for e in episodes]) for name in episodes[0]}
    actions, new_hidden = session.run(None, {**batch, "state_in.hidden": np.concatenate(hidden)})
    assert actions.shape == (3, 10, 7)
    for i, (obs, h) in enumerate(zip(episodes, hidden, strict=True)):
        alone, alone_hidden = session.run(None, {**obs, "state_in.hidden": h})
        np.testing.assert_allclose(actions[i : i + 1], alone, atol=1e-5)
        np.testing.assert_allclose(new_hidden[i : i + 1], alone_hidden, atol=1e-5)


def test_cost_measures_every_packaged_model(capsys: pytest.CaptureFixture[str]) -> None:
    from node.models import cost

    cost.main(["--runs", "2"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(row[0], row[1]) for row in rows] == [
        ("demo", "1"),
        ("demo", "8"),
        ("vla-demo", "1"),
        ("vla-demo", "8"),
        ("droid-demo", "1"),
        ("droid-demo", "8"),
        ("aloha-demo", "1"),
        ("aloha-demo", "8"),
        ("rtc-demo", "1"),
        ("rtc-demo", "8"),
    ]
    assert all(float(row[2]) > 0 for row in rows)


def _dtype_problem_as_written_first(spec: TensorSpec, array: np.ndarray) -> str | None:
    """``inputs._dtype_problem`` for numbers as first written (a finite check, then the
    range of every value): the oracle of the one-pass check that replaced it."""
    from node.inputs import _where

    source, target = array.dtype, np.dtype(spec.dtype)
    if source.kind not in ("iu" if target.kind in "iu" else "iuf"):
        return "kind"
    if source.kind == "f":
        finite = np.isfinite(array).reshape(-1)
        if not finite.all():
            at = int(np.argmin(finite))
            return f"{_where(array.shape, at)} is {array.reshape(-1)[at]}; must be finite"
    if array.size == 0 or source == target:
        return None
    low, high = array.min(), array.max()
    if target.kind == "f":
        limit = float(np.finfo(target).max)
        if float(low) < -limit or float(high) > limit:
            return f"is {source} with values beyond the range of {target.name}"
    else:
        info = np.iinfo(target)
        if int(low) < info.min or int(high) > info.max:
            return f"is {source} with values outside {info.min}..{info.max} ({target.name})"
    return None


_NUMBERS = ["float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "uint64"]


_EDGES = [
    np.array([[0.5, np.nan]]),
    np.array([[np.inf, 1.0]], dtype=np.float32),
    np.array([-np.inf], dtype=np.float16),
    np.array([[1e39, -2.0]]),
    np.array([70000.0], dtype=np.float32),
    np.array([[2**63 - 1, -(2**63)]], dtype=np.int64),
    np.array([2**64 - 1], dtype=np.uint64),
    np.array([[255, 0]], dtype=np.uint8),
    np.array([-129, 5], dtype=np.int16),
    np.zeros((0, 3)),
]


@pytest.mark.parametrize("array", _EDGES, ids=range(len(_EDGES)))
@pytest.mark.parametrize("target", _NUMBERS)
def test_the_one_pass_number_check_says_what_the_full_check_said_at_the_edges(
    target: str, array: np.ndarray
) -> None:
    test_the_one_pass_number_check_says_what_the_full_check_said.hypothesis.inner_test(  # type: ignore[attr-defined]
        target, array
    )


@given(
    st.sampled_from(_NUMBERS),
    hnp.arrays(
        st.sampled_from(_NUMBERS),
        hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=4),
        elements={"allow_subnormal": False},
    ),
)
def test_the_one_pass_number_check_says_what_the_full_check_said(
    target: str, array: np.ndarray
) -> None:
    """A float input's values are checked in one pass (the peak of their magnitudes: a NaN
    or an infinity makes it one) and an integer source that fits its target whatever its
    values is not scanned: each verdict and message is the full check's, for every pair
    of number types, values at the edges included."""
    from node.inputs import _dtype_problem

    spec = TensorSpec("x", (None,) * array.ndim, target)
    expected = _dtype_problem_as_written_first(spec, array)
    got = _dtype_problem(spec, array)
    if expected == "kind":
        assert got is not None and got.startswith(f"is {array.dtype}; x takes")
    else:
        assert got == expected
