"""BoundSession (the I/O-binding path CUDA graphs need), exercised on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

from node.binding import BoundSession
from node.devices import discover
from node.policy import DEMO_MODEL, PolicyContract, TensorSpec, load_contract, reference_rollout
from node.providers import ProviderSettings, build_session


def test_bound_runs_match_reference() -> None:
    contract = load_contract(DEMO_MODEL)
    spec = discover("cpu:1")[0]
    bound = BoundSession(
        build_session(DEMO_MODEL, spec, ProviderSettings()).session, contract, "cpu", 0
    )
    rng = np.random.default_rng(7)
    obs = [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(20)]
    ref = reference_rollout(DEMO_MODEL, obs)
    state = contract.initial_state()
    names = [o.name for o in contract.outputs]
    for o, want in zip(obs, ref, strict=True):
        out = dict(zip(names, bound.run(names, {"obs": o, **state}), strict=True))
        np.testing.assert_allclose(out["actions"], want["actions"], rtol=1e-6)
        state = {"state_in.hidden": out["state_out.hidden"]}
    # outputs are copies: a later run does not change an earlier result
    first = bound.run(names, {"obs": obs[0], **contract.initial_state()})[0]
    kept = first.copy()
    bound.run(names, {"obs": obs[1], **contract.initial_state()})
    np.testing.assert_array_equal(first, kept)


def test_symbolic_shapes_are_refused() -> None:
    contract = PolicyContract(
        inputs=(TensorSpec("obs", ("batch", 8), "float32"),),
        outputs=(TensorSpec("actions", (1, 2), "float32"),),
        state={},
    )
    spec = discover("cpu:1")[0]
    session = build_session(DEMO_MODEL, spec, ProviderSettings()).session
    with pytest.raises(ValueError, match=r"fixed shapes.*obs"):
        BoundSession(session, contract, "cpu", 0)
