"""Model-based test of the claim protocol (hypothesis RuleBasedStateMachine), on fakeredis
and a real Redis: random resolves, releases, lease lapses, re-registrations, drains,
downs and expiries; the invariants are checked after every step."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from affinity import Claims, DeviceRegistration, NoCapacity, Registry, Settings, StaleToken
from tests.conftest import Env, make_client

NODES = ("n0", "n1", "n2")
EPISODES = [f"ep{i}" for i in range(8)]
CAPACITY = 2


class ClaimProtocol(RuleBasedStateMachine):
    backend = "fake"

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        client = self.run(make_client(self.backend))
        s = Settings(episode_ttl_s=60, lease_ttl_s=60)
        self.env = Env(client, s, Claims(client, s), Registry(client, s))
        self.alive: set[str] = set()
        self.states: dict[str, str] = {}
        self.tokens: dict[str, int] = {}  # last token seen per episode
        self.max_token = 0

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        if self.backend == "real":
            self.run(self.env.redis.flushdb())
        self.run(self.env.redis.aclose())
        self.loop.close()

    async def _register(self, node: str) -> None:
        devs = [
            DeviceRegistration(i, "cpu", "c", f"{node}{i}", "cpu", 0, capacity=CAPACITY)
            for i in range(2)
        ]
        await self.env.registry.register(node, f"http://{node}", devs)
        self.alive.add(node)
        for i in range(2):
            d = f"{node}/{i}"
            if self.states.get(d) != "draining":
                self.states[d] = "active"

    @initialize()
    def start(self) -> None:
        for node in NODES:
            self.run(self._register(node))

    @rule(ep=st.sampled_from(EPISODES))
    def resolve(self, ep: str) -> None:
        before = self.run(self.env.snapshot())
        try:
            a = self.run(self.env.claims.resolve(ep))
        except NoCapacity:
            assert self.run(self.env.snapshot()) == before, "full wrote something"
            return
        node = a.device.split("/")[0]
        if a.status in ("claimed", "reassigned"):
            assert self.states[a.device] == "active", f"claim on {self.states[a.device]} device"
            assert node in self.alive, "claim on a dead node"
            assert a.token > self.max_token, "tokens go backwards"
            self.max_token = a.token
        else:
            assert a.token == self.tokens[ep]
            assert node in self.alive and self.states[a.device] != "down"
        self.tokens[ep] = a.token

    @rule(ep=st.sampled_from(EPISODES), stale=st.booleans())
    def release(self, ep: str, stale: bool) -> None:
        value = self.run(self.env.redis.get(self.env.keys.episode(ep)))
        if value is None:
            return
        token = int(value.split()[1])
        if stale:
            before = self.run(self.env.snapshot())
            with pytest.raises(StaleToken):
                self.run(self.env.claims.release(ep, token - 1))
            assert self.run(self.env.snapshot()) == before
        else:
            self.run(self.env.claims.release(ep, token))

    @rule(node=st.sampled_from(NODES))
    def lapse(self, node: str) -> None:
        self.run(self.env.lapse(node))
        self.alive.discard(node)

    @rule(node=st.sampled_from(NODES))
    def reregister(self, node: str) -> None:
        self.run(self._register(node))

    @rule(
        node=st.sampled_from(NODES),
        i=st.integers(0, 1),
        state=st.sampled_from(["active", "draining", "down"]),
    )
    def set_state(self, node: str, i: int, state: str) -> None:
        device = f"{node}/{i}"
        change = self.run(self.env.registry.set_state(device, state))
        # the model of the transitions: a down device asked to drain stays down
        if self.states[device] == "down" and state == "draining":
            assert change.state == "down"
        elif self.states[device] != "down" or state != "active":
            assert change.state == state
        self.states[device] = change.state

    @rule(ep=st.sampled_from(EPISODES))
    def expire(self, ep: str) -> None:
        if self.run(self.env.redis.get(self.env.keys.episode(ep))) is not None:
            self.run(self.env.expire(ep))

    @invariant()
    def one_owner_and_capacity(self) -> None:
        async def check() -> None:
            k = self.env.keys
            now = await self.env.redis.time()
            now_ms = now[0] * 1000 + now[1] // 1000
            owners: dict[str, str] = {}
            for node in NODES:
                for i in range(2):
                    d = f"{node}/{i}"
                    live = await self.env.redis.zrangebyscore(k.load(d), f"({now_ms}", "+inf")
                    assert len(live) <= CAPACITY, f"{d} holds {len(live)} > {CAPACITY}"
                    for ep in live:
                        assert ep not in owners, f"{ep} in the load sets of {owners[ep]} and {d}"
                        owners[ep] = d
            for ep in EPISODES:
                value = await self.env.redis.get(k.episode(ep))
                if value is not None:
                    assert owners.get(ep) == value.split()[0], (ep, value, owners.get(ep))

        self.run(check())


class RealRedisProtocol(ClaimProtocol):
    backend = "real"


MODEL = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestClaimProtocolFake = ClaimProtocol.TestCase
TestClaimProtocolFake.settings = MODEL
TestClaimProtocolReal = RealRedisProtocol.TestCase
TestClaimProtocolReal.settings = MODEL
