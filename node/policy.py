"""Deprecated: the old home of policy I/O, kept for one release so that imports of
``node.policy`` go on working; it is deleted in the release after.

It re-exports the old names from their new modules. The contract comes from
:mod:`node.contract` and the packaged models from :mod:`node.models`. The input rule comes
from :mod:`node.inputs`: ``parse_inputs``, ``inputs_from_arrays`` and
``inputs_from_observation`` are ``from_json``, ``from_arrays`` and ``from_observation``
there.
``reference_rollout``, a test oracle, is now ``tests/rollout.py``.
"""

from __future__ import annotations

from node import contract, models
from node.contract import *  # noqa: F403
from node.inputs import MAX_OBSERVATION_DEPTH, ObservationInputs, outputs_unbatched
from node.inputs import from_arrays as inputs_from_arrays
from node.inputs import from_json as parse_inputs
from node.inputs import from_observation as inputs_from_observation
from node.models import *  # noqa: F403

__all__ = [
    "MAX_OBSERVATION_DEPTH",
    "ObservationInputs",
    "inputs_from_arrays",
    "inputs_from_observation",
    "outputs_unbatched",
    "parse_inputs",
]
__all__ += contract.__all__
__all__ += models.__all__
