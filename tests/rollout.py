"""The test oracle for served episodes: a plain CPU run of the model with its state fed
back, step by step, that a served episode must reproduce exactly. Tests only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnxruntime

from node.contract import Array, load_contract

__all__ = ["reference_rollout"]


def reference_rollout(
    model_path: Path, observations: Sequence[Array | Mapping[str, Array]]
) -> list[dict[str, Array]]:
    """Run the model on the CPU over ``observations``, feeding state back; one dict per step.

    ``observations[t]`` holds the observation inputs at step ``t`` by name, in the model's
    shape (cast to its dtypes), or is the value of the only observation input of a model that
    has one. State starts from :meth:`PolicyContract.initial_state`. Each dict maps every
    output name to its array. This is what a served episode must reproduce.
    """
    contract = load_contract(model_path)
    observed = {spec.name: spec.dtype for spec in contract.observation_inputs}
    session = _session(model_path)
    names = [spec.name for spec in contract.outputs]
    state = contract.initial_state()
    steps: list[dict[str, Array]] = []
    for observation in observations:
        if not isinstance(observation, Mapping):
            if len(observed) != 1:
                raise ValueError(
                    f"{model_path}: takes {list(observed)}; give each step as a map of them"
                )
            observation = {next(iter(observed)): observation}
        if set(observation) != set(observed):
            raise ValueError(f"{model_path}: takes {list(observed)}, got {list(observation)}")
        feeds = {name: np.asarray(observation[name], dtype=dt) for name, dt in observed.items()}
        outputs = dict(zip(names, session.run(names, {**feeds, **state}), strict=True))
        steps.append(outputs)
        state = {name: outputs[output] for name, output in contract.state.items()}
    return steps


def _session(model_path: Path) -> onnxruntime.InferenceSession:
    """The model on ONNX Runtime's CPU provider, one thread, as ``load_contract`` reads it."""
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    return onnxruntime.InferenceSession(
        str(model_path), options, providers=["CPUExecutionProvider"]
    )
