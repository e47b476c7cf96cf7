"""Policy I/O: the model's tensor contract, client input validation, and a reference rollout.

A policy is an ONNX model. Its inputs are of two kinds:

* observation inputs, which the client sends with every step;
* state inputs, which the server keeps per episode: each is fed, on the next step, from one
  output of the previous step, and starts as zeros;
* control inputs, Triton's sequence-batcher controls, named ``control.start``,
  ``control.end``, ``control.ready`` and ``control.corrid``: filled by the node on every
  step (``node/control.py``), hidden from clients like state. Any other ``control.*`` name
  is refused at load.

**The sidecar.** A JSON object next to the model, named ``<model stem>.affinity.json``
(``demo_policy.onnx`` -> ``demo_policy.affinity.json``); every key is optional, no other key
is allowed, and a model without a sidecar gets every default::

    {
      "state": {"state_in.hidden": "state_out.hidden"},
      "chunk": "actions",
      "batch": true,
      "observations": {"observation/image": "image"},
      "metadata": {"reset_pose": [0, 0, 0]}
    }

* ``state``: each state input -> the output fed back into it (``{}`` declares a stateless
  model). Default, the naming convention: every input named ``state_in.X`` is state, fed from
  the output ``state_out.X``. Either way each state input and its output must exist with the
  same dtype and compatible shapes.
* ``chunk``: the output that is an action chunk (``[batch, H, D]``, or ``[H, D]`` without a
  batch axis; fixed ``H`` and ``D``, a float dtype), or ``null`` for none. Default: the one
  returned output of that shape, if exactly one has it.
* ``batch``: whether the first dimension of every input and output is the batch axis. It must
  then be symbolic, unknown or 1 on every tensor. Default: true exactly when that holds. A
  client always sends one sample per step, so the batch axis takes size 1 from clients (a
  client sending 3 samples gets :class:`InvalidInput`); the server stacks the steps of several
  episodes along it when every first dimension is dynamic (:attr:`PolicyContract.batchable`).
* ``observations``: openpi observation key -> observation input, for clients that send
  observations under their own names (``"observation/image"``); an input no key maps to is
  looked up under its own name.
* ``metadata``: any JSON object, handed to openpi clients when they connect.

**Shapes** are ONNX Runtime's: a dimension is an ``int``, a symbolic name (``str``) or
``None`` (unknown). A symbolic or unknown dimension other than the batch axis accepts any size
>= 1 from a client; every one is 1 in the initial state.

**Dtypes.** Binary arrays (msgpack ``/act``, openpi, KServe) are converted to the model's
dtype by one rule (:func:`inputs_from_arrays`, :func:`inputs_from_observation`): the same
dtype passes as is; a float input takes floats and integers (``float64`` state -> ``float32``),
finite and within the input's range; an integer input takes integers within its range (a
``uint8`` image stays ``uint8``; ``int64`` values 0-255 become ``uint8``) and never floats,
since a float image's scale (0-1 or 0-255) is not known; a bool input takes bools only, and
bools are not numbers. Anything else is :class:`InvalidInput`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from node.contract import (
    CONTROL_INPUTS,
    CONTROL_PREFIX,
    RTC_DELAY,
    RTC_INPUTS,
    RTC_PREFIX,
    RTC_PREFIX_LEN,
    RTC_PREFIX_NAME,
    SIDECAR_KEYS,
    STATE_IN_PREFIX,
    STATE_OUT_PREFIX,
    Array,
    Dim,
    PolicyContract,
    TensorSpec,
    _cpu_session,
    load_contract,
    sidecar_path,
)
from node.inputs import (
    MAX_OBSERVATION_DEPTH,
    InvalidInput,
    ObservationInputs,
    outputs_unbatched,
)
from node.inputs import from_arrays as inputs_from_arrays
from node.inputs import from_json as parse_inputs
from node.inputs import from_observation as inputs_from_observation
from node.models import (
    ALOHA_DEMO_MODEL,
    DEMO_MODEL,
    DROID_DEMO_MODEL,
    MODELS_DIR,
    PACKAGED_MODELS,
    RTC_DEMO_MODEL,
    VLA_DEMO_MODEL,
    resolve_model,
)

__all__ = [
    "ALOHA_DEMO_MODEL",
    "CONTROL_INPUTS",
    "CONTROL_PREFIX",
    "DEMO_MODEL",
    "DROID_DEMO_MODEL",
    "MAX_OBSERVATION_DEPTH",
    "MODELS_DIR",
    "PACKAGED_MODELS",
    "RTC_DELAY",
    "RTC_DEMO_MODEL",
    "RTC_INPUTS",
    "RTC_PREFIX",
    "RTC_PREFIX_LEN",
    "RTC_PREFIX_NAME",
    "SIDECAR_KEYS",
    "STATE_IN_PREFIX",
    "STATE_OUT_PREFIX",
    "VLA_DEMO_MODEL",
    "Array",
    "Dim",
    "InvalidInput",
    "ObservationInputs",
    "PolicyContract",
    "TensorSpec",
    "inputs_from_arrays",
    "inputs_from_observation",
    "load_contract",
    "outputs_unbatched",
    "parse_inputs",
    "reference_rollout",
    "resolve_model",
    "sidecar_path",
]


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
    session = _cpu_session(model_path)
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
