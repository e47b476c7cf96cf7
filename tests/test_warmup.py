"""node/warmup.py: what a model is fed before any client (issue 36 item 7): the operator's
samples, else zeros for numeric inputs, never made-up strings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from node import warmup
from node.contract import load_contract
from node.dispatcher import BatchSettings, MultiGpuDispatcher
from node.models import DEMO_MODEL
from tests.models import string_adder


class Recording:
    """A session that records every feed it runs."""

    def __init__(self) -> None:
        self.feeds: list[dict[str, np.ndarray]] = []

    def run(self, names: object, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.feeds.append(feed)
        return [np.array(["0"] * 16, dtype=object).reshape(1, 16)] * 2


def test_a_numeric_model_is_fed_zeros_and_its_initial_state() -> None:
    contract = load_contract(DEMO_MODEL)
    one = warmup.feed(contract)
    assert one is not None and set(one) == {s.name for s in contract.inputs}
    assert all(not v.any() for v in one.values())
    three = warmup.feed(contract, 3)
    assert three is not None and three["obs"].shape == (3, 8)
    assert warmup.unfed(contract) == [] and warmup.made_up(contract) == ["obs"]


def test_a_string_input_without_a_sample_is_never_made_up(tmp_path: Path) -> None:
    contract = warmup.with_samples(path := string_adder(tmp_path), load_contract(path))
    assert warmup.unfed(contract) == ["INPUT0", "INPUT1"]
    assert warmup.feed(contract) is None


def test_samples_beside_the_model_are_checked_and_fed(tmp_path: Path) -> None:
    path = string_adder(tmp_path)
    assert warmup.samples_path(path) == tmp_path / "simple_string.warmup.npz"
    np.savez(
        warmup.samples_path(path), INPUT0=np.array([["1"] * 16]), INPUT1=np.array([["2"] * 16])
    )
    contract = warmup.with_samples(path, load_contract(path))
    assert warmup.unfed(contract) == [] and warmup.made_up(contract) == []
    fed = warmup.feed(contract, 2)
    assert fed is not None and fed["INPUT0"].shape == (2, 16) and fed["INPUT0"].dtype == object
    assert fed["INPUT1"][1, 3] == "2"


def test_samples_that_do_not_fit_name_the_file_and_the_input(tmp_path: Path) -> None:
    path = string_adder(tmp_path)
    samples = warmup.samples_path(path)
    np.savez(samples, INPUT0=np.array([["1"] * 16]), INPUT1=np.zeros((1, 16), np.float32))
    with pytest.raises(ValueError, match=f"{samples}: inputs.INPUT1: is float32"):
        warmup.with_samples(path, load_contract(path))
    samples.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match=f"{samples}: not a .npz file"):
        warmup.with_samples(path, load_contract(path))


@pytest.mark.anyio
async def test_the_dispatcher_warms_up_with_the_samples_or_not_at_all(tmp_path: Path) -> None:
    path = string_adder(tmp_path)
    sessions: dict[str, Recording] = {}

    def session(device: str) -> Recording:
        return sessions.setdefault(device, Recording())

    bare = MultiGpuDispatcher(
        ["n/0"], session, load_contract(path), batching=BatchSettings(max_batch=1)
    )
    try:
        await bare.warm_up()
        assert sessions["n/0"].feeds == [], "made-up strings were fed"
    finally:
        bare.close()
    np.savez(
        warmup.samples_path(path), INPUT0=np.array([["7"] * 16]), INPUT1=np.array([["1"] * 16])
    )
    sessions.clear()
    fed = MultiGpuDispatcher(
        ["n/0"],
        session,
        warmup.with_samples(path, load_contract(path)),
        batching=BatchSettings(max_batch=1),
    )
    try:
        await fed.warm_up()
        (feed,) = sessions["n/0"].feeds
        assert feed["INPUT0"].tolist() == [["7"] * 16]
    finally:
        fed.close()
