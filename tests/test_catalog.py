"""A node's models (issue 24): ``--model`` parsing, versions, contracts in Redis, the
fleet's catalog, several models per node in process (fakeredis), and what a model that
cannot be loaded beside the others does at start-up."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import fakeredis
import numpy as np
import pytest

from affinity import InvalidArgument, ModelId, UnknownModel
from node.catalog import (
    Catalog,
    ModelSpec,
    contract_from_record,
    contract_record,
    file_version,
    parse_model_arg,
)
from node.cli import parse_args
from node.contract import load_contract
from node.errors import AmbiguousModel
from node.forward import Forward
from node.models import DEMO_MODEL, VLA_DEMO_MODEL
from node.startup import StartupError, build_service
from node.step import Step
from tests.inproc import cluster, config
from tests.procs import ROOT

pytestmark = pytest.mark.anyio
OBS = [[0.1] * 8]


def test_a_model_argument_names_a_file_a_name_and_a_version(tmp_path: Path) -> None:
    assert parse_model_arg("demo") == ModelSpec(DEMO_MODEL, "demo_policy", None)
    assert parse_model_arg("demo@v2") == ModelSpec(DEMO_MODEL, "demo_policy", "v2")
    assert parse_model_arg("pick=vla-demo@2025-06") == ModelSpec(VLA_DEMO_MODEL, "pick", "2025-06")
    odd = tmp_path / "odd@name.onnx"
    odd.write_bytes(DEMO_MODEL.read_bytes())
    assert parse_model_arg(f"odd={odd}") == ModelSpec(odd, "odd", None)  # a file wins
    with pytest.raises(ValueError, match="model name"):  # its stem is no model name
        parse_model_arg(str(odd))
    assert ModelSpec(DEMO_MODEL, "d").identity() == ModelId("d", file_version(DEMO_MODEL))
    assert len(file_version(DEMO_MODEL)) == 12
    for bad in ("demo@", "demo@v 1", "bad name=demo", "nope"):
        with pytest.raises(ValueError):
            parse_model_arg(bad)


def test_the_flag_repeats_and_names_must_differ() -> None:
    cfg = parse_args(["--model", "demo", "--model", "vla-demo@v3"], env={})
    assert [(m.name, m.version) for m in cfg.served] == [("demo_policy", None), ("vla_demo", "v3")]
    assert cfg.model == DEMO_MODEL and cfg.model_name == "demo_policy"
    cfg = parse_args([], env={"AFFINITY_MODEL": "demo,vla-demo"})
    assert [m.name for m in cfg.served] == ["demo_policy", "vla_demo"]
    assert [m.name for m in parse_args([], env={}).served] == ["demo_policy"]
    for argv, words in (
        (["--model", "demo", "--model", "demo@v2"], "repeat"),
        (["--model", "demo", "--model", "vla-demo", "--model-name", "x"], "only with one"),
        (["--model", "demo@v/1"], "--model"),
    ):
        done = subprocess.run([sys.executable, "-m", "node.server", *argv], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 2 and words in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


def test_a_contract_record_round_trips() -> None:
    for path in (DEMO_MODEL, VLA_DEMO_MODEL):
        contract = load_contract(path)
        back = contract_from_record(contract_record(contract))
        assert back.to_json() == contract.to_json()
        assert back.batch_axis == contract.batch_axis and back.state == contract.state
    with pytest.raises(ValueError, match="malformed"):
        contract_from_record('{"inputs": 3}')


def test_a_forward_carries_the_model() -> None:
    fwd = Forward(Step("ep", {"obs": np.zeros((1, 8), np.float32)}, 0.0), 7, "a/0", "hit", 1.0,
                  model="demo_policy@v1")  # fmt: skip
    back = Forward.decode(fwd.encode())
    assert back.model == "demo_policy@v1" and back.step.model == "demo_policy"
    assert Forward.decode(replace(fwd, model="").encode()).step.model is None


async def test_the_catalog_chooses_a_model_or_says_why_not() -> None:
    demo = load_contract(DEMO_MODEL)
    catalog = Catalog({"demo_policy": (ModelId("demo_policy", "v1"), demo)}, None)
    assert await catalog.choose(None) == "demo_policy"  # the fleet's only model
    assert await catalog.contract("demo_policy") is demo
    with pytest.raises(UnknownModel, match=r"'pi0'.*demo_policy"):
        await catalog.choose("pi0")
    with pytest.raises(UnknownModel, match="demo_policy@v9"):
        await catalog.choose("demo_policy", "v9")
    with pytest.raises(InvalidArgument):
        await catalog.choose("bad name")
    catalog._fleet["vla_demo"] = ["v1"]  # as a refresh reads it when another node serves it
    with pytest.raises(AmbiguousModel, match="demo_policy, vla_demo"):
        await catalog.choose(None)


async def test_one_node_serves_two_models_each_on_every_device() -> None:
    redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    both = config("b", models=(parse_model_arg("demo"), parse_model_arg("vla-demo@v1")))
    one = config("a")
    async with cluster(redis, [one, both]) as (nodes, _):
        a, b = nodes
        assert set(b.service.dispatchers) == {"demo_policy", "vla_demo"}
        assert await redis.hget("{affinity}:node:b", "models") == (
            f"demo_policy@{file_version(DEMO_MODEL)},vla_demo@v1"
        )
        for i in range(6):  # a (demo only) routes vla_demo steps to b, checked on a
            r = await a.act(episode_id=f"v{i}", model="vla_demo", inputs={"obs": OBS})
            assert r.status_code == 422 and "image" in r.text, r.text
        listed = {n["node"]: n["models"] for n in (await a.client.get("/nodes")).json()["nodes"]}
        assert listed["b"][1] == "vla_demo@v1" and len(listed["a"]) == 1  # what /ui shows
        r = await a.client.get("/models/vla_demo")
        assert r.json()["version"] == "v1" and r.json()["inputs"][0]["name"] == "image"
        devices = set()
        for i in range(8):
            r = await a.act(episode_id=f"d{i}", model="demo_policy", inputs={"obs": OBS})
            assert r.status_code == 200, r.text
            devices.add(r.json()["device"])
        assert devices == {"a/0", "a/1", "b/0", "b/1"}
        r = await b.act(episode_id="x", inputs={"obs": OBS})
        assert r.status_code == 422 and r.json()["error"]["code"] == "model_required"
        assert {await redis.hget(f"{{affinity}}:device:{d}", "state") for d in devices} == {
            "active"
        }


async def test_a_model_that_cannot_get_a_session_stops_the_node_naming_it() -> None:
    calls = []

    def first_only(spec: object) -> tuple[object, str]:
        calls.append(spec)
        raise MemoryError("CUDA out of memory (as ORT says it)")

    redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    cfg = config("a", devices="cpu:1", models=(parse_model_arg("demo"),))
    with pytest.raises(StartupError, match=r"--model demo_policy: no session on device 0"):
        await build_service(cfg, redis=redis, session_factory=first_only)()  # type: ignore[arg-type]
    assert calls and not await redis.exists("{affinity}:node:a")  # nothing registered
