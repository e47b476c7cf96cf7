"""Deprecated: the old home of policy I/O, kept for one release so that imports of
``node.policy`` go on working; it is deleted in the release after.

It re-exports the old names from their new modules: the contract from
:mod:`node.contract`, the input rule from :mod:`node.inputs` (``parse_inputs``,
``inputs_from_arrays`` and ``inputs_from_observation`` are ``from_json``, ``from_arrays``
and ``from_observation`` there), the packaged models from :mod:`node.models`.
``reference_rollout``, a test oracle, is now ``tests/rollout.py``.
"""

from __future__ import annotations

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
    "resolve_model",
    "sidecar_path",
]
