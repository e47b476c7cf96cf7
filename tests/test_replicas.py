"""WAIT-acknowledged writes (``--redis-replicas``, issue 22's lossy failover), in-process.

On a real ``redis-server`` with one real replica (``--replicaof``), and on this session's
server, which has none (every ``WAIT 1`` there times out: a replica that missed the write).
fakeredis does not implement ``WAIT`` and the embedded store refuses replicas, so only the
settings and the N = 0 path run on it. The failover with real nodes is in
``tests/test_replicas_procs.py``."""

from __future__ import annotations

import shutil
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis as sync_redis
import redis.asyncio

from affinity import (
    Claims,
    InvalidArgument,
    Keys,
    NotReplicated,
    Registry,
    ResolveRequest,
    Settings,
    close,
    connect,
)
from affinity.registry import HeldEpisode
from node.cli import parse_args
from node.config import NodeConfig
from node.dispatcher import Arrivals
from node.episodes import Episode, EpisodeTable
from node.flusher import Flusher
from node.metrics import Metrics
from node.owner import Owner
from tests.conftest import cpu_devices, new_fleet
from tests.inproc import claim_of, cluster, config
from tests.procs import Proc, RedisServer, free_port, wait_until

KEYS = Keys()
OBS = np.zeros((1, 8), np.float32).tolist()
SYNC = ["--repl-diskless-sync-delay", "0"]  # a new replica syncs at once


def replica_of(tmp: Path, primary: RedisServer) -> RedisServer:
    """A real replica of ``primary``, started and in sync."""
    replica = RedisServer(tmp, extra=[*SYNC, "--replicaof", primary.host, str(primary.port)])
    replica.start(new_fleet=False)
    wait_until(lambda: online(primary, replica), 30, f"replica {replica.port} in sync")
    return replica


def online(primary: RedisServer, replica: RedisServer) -> bool:
    """The primary sends to the replica and the replica has loaded what it got."""
    with primary.client() as p, replica.client() as r:
        sending = p.info("replication")
        if not sending.get("connected_slaves") or sending["slave0"]["state"] != "online":
            return False
        link = r.info("replication")["master_link_status"] == "up"
        return link and not int(r.info("persistence")["loading"])


def calls(r: sync_redis.Redis, command: str) -> int:
    return int(r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[RedisServer, RedisServer]]:
    primary = RedisServer(tmp_path, extra=SYNC)
    replica: RedisServer | None = None
    try:
        primary.start()
        replica = replica_of(tmp_path, primary)
        yield primary, replica
    finally:
        if replica is not None:
            replica.stop()  # (SIGCONT after the kill: a stopped one dies too)
        primary.stop()


def waited(url: str | None, wait_s: float = 2.0) -> Settings:
    """WAIT for one replica: up to 2 s by default, so a busy machine's replica always
    acknowledges in time (a stopped one never does: the tests that expect that pass a
    short ``wait_s``, which only makes them quicker)."""
    return Settings(
        redis_url=url,
        redis_replicas=1,
        redis_wait_s=wait_s,
        redis_timeout_s=max(0.5, 2 * wait_s),
        redis_deadline_s=max(2.0, 4 * wait_s),
        lease_ttl_s=10,
        episode_ttl_s=60,
    )


# ---- settings ------------------------------------------------------------------------


def test_replicas_are_validated_with_messages_that_name_what_to_change() -> None:
    assert Settings().redis_replicas == 0  # no WAIT unless asked
    assert (
        Settings.from_env({"AFFINITY_REDIS_REPLICAS": "2"}, redis_url="redis://h").redis_replicas
        == 2
    )
    with pytest.raises(InvalidArgument, match="Redis replicas -1: must be an integer 0-64"):
        Settings(redis_url="redis://h", redis_replicas=-1)
    with pytest.raises(InvalidArgument, match="must be a number"):
        Settings.from_env({"AFFINITY_REDIS_REPLICAS": "one"})
    with pytest.raises(InvalidArgument, match="embedded store has no replicas"):
        Settings(redis_replicas=1)
    with pytest.raises(InvalidArgument, match="not supported on Redis Cluster"):
        Settings(redis_url="redis+cluster://h:7000", redis_replicas=1)
    with pytest.raises(InvalidArgument, match="half the Redis timeout"):
        Settings(redis_url="redis://h", redis_replicas=1, redis_wait_s=0.3)
    ok = Settings(redis_url="redis+sentinel://h:26379/m", redis_replicas=1, redis_wait_s=0.25)
    assert ok.redis_wait_ms == 250


def test_the_node_flags_refuse_a_bad_replica_count(capsys: pytest.CaptureFixture[str]) -> None:
    config = parse_args(
        ["--redis", "redis://h", "--redis-replicas", "1"], env={"AFFINITY_CLUSTER_SECRET": "s"}
    )
    assert (config.settings.redis_replicas, config.settings.redis_wait_s) == (1, 0.1)
    for argv, said in (
        (["--redis", "redis://h", "--redis-replicas", "-1"], "--redis-replicas -1: must be 0-64"),
        (["--redis-replicas", "1"], "--redis-replicas 1: needs a Redis server"),
        (["--redis", "redis://h", "--redis-replicas", "1", "--redis-wait", "2"], "--redis-wait 2"),
    ):
        with pytest.raises(SystemExit) as exit:
            parse_args(argv, env={})
        assert exit.value.code == 2
        assert said in capsys.readouterr().err


# ---- no replica acknowledges (this session's server has none) ---------------------------


@pytest.fixture
async def lone(real_redis_url: str) -> AsyncIterator[tuple[Any, Claims, Claims, Registry]]:
    """A client of the session's server (no replica), Claims with and without WAIT, and a
    waiting Registry, with node ``a`` (2 devices) registered."""
    client = redis.asyncio.Redis.from_url(real_redis_url, decode_responses=True)
    settings = waited(real_redis_url, wait_s=0.02)  # nothing acknowledges here
    plain = Settings(redis_url=real_redis_url, lease_ttl_s=10, episode_ttl_s=60)
    registry = Registry(client, settings)
    await registry.register("a", "http://a.test", cpu_devices(2, capacity=1), instance="i")
    yield client, Claims(client, settings), Claims(client, plain), registry
    await client.aclose()


@pytest.mark.anyio
async def test_a_claim_no_replica_acknowledged_raises_and_is_released(lone: Any) -> None:
    client, claims, plain, _ = lone
    with pytest.raises(NotReplicated) as caught:
        await claims.resolve("ep")
    assert (caught.value.what, caught.value.acked, caught.value.wanted) == ("claim", 0, 1)
    assert "episode 'ep'" in str(caught.value)
    # released again, token-checked: no assignment, no load, the event says why
    assert await client.get(KEYS.episode("ep")) is None
    assert [await client.zcard(KEYS.load(f"a/{i}")) for i in range(2)] == [0, 0]
    events = [f for _, f in await client.xrange(KEYS.events)]
    assert [e["type"] for e in events[-2:]] == ["claim", "release"]
    assert events[-1]["reason"] == "not_replicated"
    # the retry is a clean claim (here without WAIT: nothing of the first one is left)
    again = await plain.resolve("ep")
    assert again.status == "claimed" and again.token > int(events[-2]["token"])


@pytest.mark.anyio
async def test_a_hit_no_replica_acknowledged_raises_and_keeps_the_assignment(lone: Any) -> None:
    client, claims, plain, _ = lone
    first = await plain.resolve("ep")
    value = await client.get(KEYS.episode("ep"))
    with pytest.raises(NotReplicated):
        await claims.resolve("ep")  # a hit: its owner may serve it; nothing is released
    assert await client.get(KEYS.episode("ep")) == value
    assert (await plain.resolve("ep")).token == first.token


@pytest.mark.anyio
async def test_rows_claimed_together_no_replica_acknowledged_fail_each_alone(lone: Any) -> None:
    """``resolve_many`` (a message's rows, one round trip, one ``WAIT`` after them all):
    every row is NotReplicated; a new claim is released again, a hit keeps its claim."""
    client, claims, plain, _ = lone
    first = await plain.resolve("held")
    got = await claims.resolve_many([ResolveRequest("held"), ResolveRequest("new")])
    assert [type(g) for g in got] == [NotReplicated, NotReplicated]
    assert await client.get(KEYS.episode("new")) is None
    assert (await plain.resolve("held")).token == first.token


@pytest.mark.anyio
async def test_renewals_reasserts_and_slides_no_replica_acknowledged_are_not_done(
    lone: Any,
) -> None:
    client, _, plain, registry = lone
    a = await plain.resolve("ep")
    held = HeldEpisode("ep", a.device, a.token, a.claim, a.model)
    with pytest.raises(NotReplicated, match="renewal of node a"):
        await registry.renew("a", "i")
    with pytest.raises(NotReplicated, match="registration of node a"):
        await registry.register(
            "a", "http://a.test", cpu_devices(2, capacity=1), instance="i", episodes=[held]
        )
    # a registration that re-asserts nothing is not waited for (nothing is served on it)
    done = await registry.register("a", "http://a.test", cpu_devices(2, capacity=1), instance="i")
    assert done.lost == []
    flushed = await registry.flush("a", "i", [held], [])
    assert flushed is not None and not flushed.replicated and flushed.lost == []
    released = await registry.flush("a", "i", [], [("ep", a.token)])  # releases only
    assert released is not None and released.replicated
    assert await client.get(KEYS.episode("ep")) is None


def lone_owner(registry: Registry, held: HeldEpisode, clock: Any) -> Owner:
    """An owner holding one record, with no lease loop, devices or router behind it."""
    from types import SimpleNamespace

    table = EpisodeTable(clock)
    record = Episode(held.device, held.token, held.claim, {}, 1.0, 1, None, model=held.model)
    with table.lock:
        assert table.keep_locked(held.episode, None, 0, record)
    settings = Settings(lease_ttl_s=10, episode_ttl_s=377)  # a backstop of 400 s
    config = NodeConfig(node_id="a", advertise_url="http://a.test", settings=settings)
    dispatcher = SimpleNamespace(model="", arrivals=Arrivals(), contract=None)
    health = SimpleNamespace(devices=[held.device], down=lambda device: False)
    lease = SimpleNamespace(registered=True, instance="i")
    claims = SimpleNamespace(redis=None)  # no lookups, ends or hand-overs here
    metrics = Metrics([held.device], 1)
    flusher = Flusher("a", table, registry, metrics, settings, clock)
    return Owner(
        config, table, {"m": dispatcher}, lease, health, claims, claims, flusher,  # type: ignore[arg-type]
        metrics, pool=None, clock=clock,  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.mark.anyio
async def test_the_owner_counts_on_no_slide_a_replica_did_not_acknowledge(lone: Any) -> None:
    """The owner's authority to serve from memory (``Flusher.current``) runs from its last
    flush whose slides the replicas acknowledged: an unacknowledged one leaves it where it
    was, and the slide is sent again at the next flush."""
    client, _, plain, registry = lone
    a = await plain.resolve("ep")
    now = [100.0]
    owner = lone_owner(registry, HeldEpisode("ep", a.device, a.token, a.claim), lambda: now[0])
    flusher = owner.flusher
    await owner.flush()
    assert flusher.flushed_at == float("-inf") and not flusher.current()
    assert flusher._slid == {}  # due again at the next flush
    flusher.registry = Registry(client, plain.settings)  # no WAIT asked: the flush is done
    now[0] = 101.0
    await owner.flush()
    assert flusher.flushed_at == 101.0 and flusher._slid == {"ep": 101.0}


# ---- a real replica --------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.anyio
async def test_with_a_replica_each_claim_is_one_wait_on_its_own_connection(pair: Any) -> None:
    primary, replica = pair
    r = primary.client()
    client = redis.asyncio.Redis.from_url(primary.url, decode_responses=True)
    try:
        settings = waited(primary.url)
        registry, claims = Registry(client, settings), Claims(client, settings)
        await registry.register("a", "http://a.test", cpu_devices(2), instance="i")
        await claims.resolve("warm")  # (loads the script: NOSCRIPT, then both again)
        before = (calls(r, "evalsha"), calls(r, "wait"))
        placed = [await claims.resolve(f"ep{i}") for i in range(5)]
        assert {a.status for a in placed} == {"claimed"}
        hits = [await claims.resolve(f"ep{i}") for i in range(5)]
        assert {a.status for a in hits} == {"hit"}
        assert (calls(r, "evalsha") - before[0], calls(r, "wait") - before[1]) == (10, 10)
        assert replica.client().get(KEYS.episode("ep4")) == r.get(KEYS.episode("ep4"))
        assert await registry.renew("a", "i")
        r.script_flush()  # the pipeline's NOSCRIPT path loads the script and sends both again
        assert (await claims.resolve("after-flush")).status == "claimed"
        # a message's rows: their claims in one round trip, one WAIT after them all
        before = (calls(r, "evalsha"), calls(r, "wait"))
        rows = await claims.resolve_many([ResolveRequest(f"row{i}") for i in range(4)])
        assert [getattr(a, "status", a) for a in rows] == ["claimed"] * 4
        assert (calls(r, "evalsha") - before[0], calls(r, "wait") - before[1]) == (4, 1)
        r.script_flush()  # NOSCRIPT: loaded, sent again; the second WAIT's count is the one
        rows = await claims.resolve_many([ResolveRequest(f"row{i}") for i in range(4, 8)])
        assert [getattr(a, "status", a) for a in rows] == ["claimed"] * 4
        # the replica stops reading: its acknowledgement never comes
        replica.proc.send(signal.SIGSTOP)
        try:
            with pytest.raises(NotReplicated):
                await Claims(client, waited(primary.url, 0.05)).resolve("while-stopped")
            assert r.get(KEYS.episode("while-stopped")) is None
        finally:
            replica.proc.send(signal.SIGCONT)

        async def claimed() -> bool:
            try:
                return (await claims.resolve("while-stopped")).status == "claimed"
            except NotReplicated:
                return False

        for _ in range(200):  # the replica catches up within a moment
            if await claimed():
                break
        else:
            raise AssertionError("the replica never acknowledged again")
        assert replica.client().get(KEYS.episode("while-stopped")) is not None
    finally:
        await client.aclose()


@pytest.mark.integration
@pytest.mark.anyio
async def test_a_node_answers_503_not_replicated_and_serves_nothing_unacknowledged(
    pair: Any,
) -> None:
    """Through the HTTP path of an in-process node with ``redis_replicas=1``: a claim the
    replica does not acknowledge is 503 ``not_replicated`` with Retry-After, leaves no
    record at the node and no assignment in Redis; the retry once it acknowledges is a
    clean claim. An episode claimed before goes on from memory meanwhile."""
    primary, replica = pair
    client = redis.asyncio.Redis.from_url(primary.url, decode_responses=True)
    await new_fleet(client)
    try:
        settings = waited(primary.url, 0.5)  # (each 503 below waits this long)
        async with cluster(client, [config("a", settings=settings)]) as ([a], _):
            first = (await a.act(episode_id="old", inputs={"obs": OBS})).json()
            assert first["routing"] == "claimed"
            replica.proc.send(signal.SIGSTOP)
            try:
                r = await a.act(episode_id="new", inputs={"obs": OBS})
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "not_replicated"
                assert int(r.headers["retry-after"]) >= 1
                assert claim_of(a.service, "new") is None
                assert await client.get(KEYS.episode("new")) is None
                old = (await a.act(episode_id="old", inputs={"obs": OBS})).json()
                assert (old["routing"], old["seq"], old["state_reset"]) == ("hit", 2, False)
            finally:
                replica.proc.send(signal.SIGCONT)
            for _ in range(200):
                r = await a.act(episode_id="new", inputs={"obs": OBS})
                if r.status_code == 200:
                    break
                assert r.json()["error"]["code"] == "not_replicated", r.text
            doc = r.json()
            assert (doc["routing"], doc["seq"], doc["state_reset"]) == ("claimed", 1, False)
    finally:
        await client.aclose()


@pytest.mark.integration
@pytest.mark.anyio
async def test_behind_sentinel_a_claim_waits_on_the_masters_connection(
    pair: Any, tmp_path: Path
) -> None:
    """``redis+sentinel://`` (the deployment with replicas): the pipeline goes to the
    master Sentinel names, and its WAIT counts that master's replica."""
    primary, replica = pair
    port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\nsentinel monitor m 127.0.0.1 {primary.port} 1\n")
    proc = Proc([shutil.which("redis-server") or "redis-server", str(conf), "--sentinel"],
                None, tmp_path / "sentinel.log")  # fmt: skip
    proc.start()
    try:

        def watching() -> bool:
            with sync_redis.Redis(port=port) as r:
                return bool(r.sentinel_get_master_addr_by_name("m"))

        wait_until(watching, 20, "sentinel")
        settings = waited(f"redis+sentinel://127.0.0.1:{port}/m")
        client = connect(settings)
        try:
            await Registry(client, settings).register("a", "http://a.test", cpu_devices(2))
            claims = Claims(client, settings)
            assert (await claims.resolve("ep")).status == "claimed"
            assert replica.client().get(KEYS.episode("ep")) is not None
            replica.proc.send(signal.SIGSTOP)
            try:
                with pytest.raises(NotReplicated):
                    await Claims(client, waited(settings.redis_url, 0.05)).resolve("stopped")
            finally:
                replica.proc.send(signal.SIGCONT)
        finally:
            await close(client)
    finally:
        proc.stop()
