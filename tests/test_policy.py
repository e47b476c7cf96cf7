"""Policy contract, client input validation, the demo model and the reference rollout."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from onnx import TensorProto, helper, numpy_helper

from node.models.build_demo import build
from node.policy import (
    DEMO_MODEL,
    InvalidInput,
    PolicyContract,
    TensorSpec,
    load_contract,
    parse_inputs,
    reference_rollout,
    sidecar_path,
)

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
        TensorSpec("obs", (1, 8), "float32"),
        TensorSpec("state_in.hidden", (1, 16), "float32"),
    )
    assert contract.outputs == (
        TensorSpec("actions", (1, 4, 2), "float32"),
        TensorSpec("state_out.hidden", (1, 16), "float32"),
    )
    assert dict(contract.state) == {"state_in.hidden": "state_out.hidden"}
    assert contract.observation_inputs == (TensorSpec("obs", (1, 8), "float32"),)
    assert contract.returned_outputs == (TensorSpec("actions", (1, 4, 2), "float32"),)
    [(name, zeros)] = contract.initial_state().items()
    assert name == "state_in.hidden"
    assert (zeros.shape, zeros.dtype.name, bool(zeros.any())) == ((1, 16), "float32", False)


def test_demo_to_json_is_json() -> None:
    doc = load_contract(DEMO_MODEL).to_json()
    assert json.loads(json.dumps(doc)) == {
        "inputs": [{"name": "obs", "shape": [1, 8], "dtype": "float32"}],
        "outputs": [{"name": "actions", "shape": [1, 4, 2], "dtype": "float32"}],
        "state": {"state_in.hidden": "state_out.hidden"},
    }


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
        ({"state": {"state_in.h": 3}}, "must map each state input name to an output name"),
        ({"state": ["state_in.h"]}, "must map each state input name to an output name"),
        ({"state": {}, "extra": 1}, 'exactly one key, "state"'),
        ([], 'exactly one key, "state"'),
    ],
)
def test_bad_sidecar(tmp_path: Path, sidecar: object, problem: str) -> None:
    path = recurrent_model(tmp_path / "bad.onnx")
    sidecar_path(path).write_text(json.dumps(sidecar))
    with pytest.raises(ValueError, match=problem) as raised:
        load_contract(path)
    assert str(sidecar_path(path)) in str(raised.value)


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
        tmp_path / "text.onnx",
        [("words", TensorProto.STRING, [1])],
        [("same", TensorProto.STRING, [1])],
        [identity("words", "same")],
    )
    with pytest.raises(ValueError, match=r"'words' has type tensor\(string\)"):
        load_contract(path)


# --- parse_inputs -----------------------------------------------------------------------


def test_parse_demo_inputs() -> None:
    contract = load_contract(DEMO_MODEL)
    parsed = parse_inputs(contract, {"obs": [[0.5, 1, -2, 0, 0, 0, 0, 3e-3]]})
    assert list(parsed) == ["obs"]
    assert parsed["obs"].dtype == np.float32
    np.testing.assert_array_equal(
        parsed["obs"], np.array([[0.5, 1, -2, 0, 0, 0, 0, 3e-3]], np.float32)
    )


def test_parse_every_dtype(typed_contract: PolicyContract) -> None:
    parsed = parse_inputs(typed_contract, VALID_TYPED)
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
        ({"obs": [0.0] * 8}, "obs", "has 8 elements, dimension 0"),
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
        parse_inputs(load_contract(DEMO_MODEL), raw)
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
        parse_inputs(typed_contract, {**VALID_TYPED, field: value})
    assert (raised.value.field, raised.value.problem) == (field, problem)


def test_symbolic_dims_accept_any_size(typed_contract: PolicyContract) -> None:
    parsed = parse_inputs(typed_contract, {**VALID_TYPED, "batch": [[1.0, 2.0, 3.0]] * 5})
    assert parsed["batch"].shape == (5, 3)


def test_long_unknown_name_is_shortened_in_message() -> None:
    with pytest.raises(InvalidInput) as raised:
        parse_inputs(load_contract(DEMO_MODEL), {"x" * 10_000: 1})
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
        parse_inputs(DEMO_CONTRACT, raw)


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
        parse_inputs(DEMO_CONTRACT, raw)


@given(data=st.data())
def test_parse_raises_only_invalid_input_for_every_dtype(
    typed_contract: PolicyContract, data: st.DataObject
) -> None:
    field = data.draw(st.sampled_from(TYPED_NAMES))
    raw = {**VALID_TYPED, field: data.draw(JSON)}
    try:
        parsed = parse_inputs(typed_contract, raw)
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
    parsed = parse_inputs(DEMO_CONTRACT, {"obs": observation.tolist()})
    np.testing.assert_array_equal(parsed["obs"], observation)


# --- the demo model and the reference rollout ----------------------------------------------


def test_demo_files_are_reproducible(tmp_path: Path) -> None:
    model, sidecar = build(tmp_path)
    assert model.read_bytes() == DEMO_MODEL.read_bytes()
    assert sidecar.read_bytes() == sidecar_path(DEMO_MODEL).read_bytes()
    assert model.stat().st_size < 8192
    loaded = onnx.load(str(DEMO_MODEL))
    assert loaded.ir_version == 10
    assert [(o.domain, o.version) for o in loaded.opset_import] == [("", 17)]


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


def test_reference_rollout_needs_one_observation_input(tmp_path: Path) -> None:
    path = save_model(
        tmp_path / "two.onnx",
        [("a", TensorProto.FLOAT, [1]), ("b", TensorProto.FLOAT, [1])],
        [("c", TensorProto.FLOAT, [1])],
        [helper.make_node("Add", ["a", "b"], ["c"])],
    )
    with pytest.raises(ValueError, match=r"exactly one observation input, has \['a', 'b'\]"):
        reference_rollout(path, [np.zeros(1, np.float32)])
