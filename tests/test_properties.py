"""Property tests (hypothesis) of the claim script, on fakeredis and a real Redis.

Leases and idle TTLs are ten days: nothing lapses or expires by the clock during an
example however slow the machine is (expiry is made explicitly with ``Env.expire``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from affinity import Claims, NoCapacity, Registry, Settings, StaleToken
from tests.conftest import BACKENDS, Env, cpu_devices, make_client

TEN_DAYS = 10 * 24 * 3600.0
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def run(backend: str, body: Callable[[Env], Awaitable[None]]) -> None:
    async def main() -> None:
        client = await make_client(backend)
        s = Settings(episode_ttl_s=TEN_DAYS, lease_ttl_s=TEN_DAYS)
        try:
            await body(Env(client, s, Claims(client, s), Registry(client, s)))
        finally:
            if backend == "real":
                await client.flushdb()
            await client.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(weights=st.lists(st.integers(1, 5), min_size=1, max_size=5), warm=st.integers(0, 7))
def test_weighted_round_robin_is_exact(backend: str, weights: list[int], warm: int) -> None:
    async def body(env: Env) -> None:
        await env.registry.register("n", "http://n", cpu_devices(weights=weights, capacity=10_000))
        for i in range(warm):
            await env.claims.resolve(f"warm-{i}")
        window = [(await env.claims.resolve(f"ep-{i}")).device for i in range(sum(weights))]
        assert Counter(window) == {f"n/{i}": w for i, w in enumerate(weights)}

    run(backend, body)


changes = st.lists(
    st.one_of(
        st.tuples(st.just("claim"), st.integers(1, 3)),
        st.tuples(st.just("drain"), st.integers(0, 7)),
        st.tuples(st.just("undrain"), st.integers(0, 7)),
        st.tuples(st.just("join"), st.integers(1, 5)),
    ),
    max_size=12,
)


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(weights=st.lists(st.integers(1, 5), min_size=1, max_size=4), steps=changes)
def test_round_robin_stays_exact_as_devices_come_and_go(
    backend: str, weights: list[int], steps: list[tuple[str, int]]
) -> None:
    """Whatever joined, left or came back before (draining, undraining, a node
    registering), the next sum-of-weights claims give each device exactly its weight."""

    async def body(env: Env) -> None:
        await env.registry.register("n", "http://n", cpu_devices(weights=weights, capacity=10_000))
        weight = {f"n/{i}": w for i, w in enumerate(weights)}
        claimed = 0

        async def claim(n: int) -> list[str]:
            nonlocal claimed
            picks = [(await env.claims.resolve(f"ep-{claimed + i}")).device for i in range(n)]
            claimed += n
            return picks

        for op, x in steps:
            devices = sorted(weight)
            if op == "claim" and any(d.state == "active" for d in await env.inventory.devices()):
                await claim(x)
            elif op == "drain":
                await env.registry.drain(devices[x % len(devices)])
            elif op == "undrain":
                await env.registry.undrain(devices[x % len(devices)])
            elif op == "join":
                node = f"m{len(weight)}"
                await env.registry.register(
                    node, f"http://{node}", cpu_devices(weights=[x], capacity=10_000)
                )
                weight[f"{node}/0"] = x
        active = {d.device for d in await env.inventory.devices() if d.state == "active"}
        if not active:
            await env.registry.undrain("n/0")
            active = {"n/0"}
        window = sum(weight[d] for d in active)
        assert Counter(await claim(window)) == {d: weight[d] for d in active}

    run(backend, body)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("resolve"), st.integers(0, 9)),
        st.tuples(st.just("release"), st.integers(0, 9)),
        st.tuples(st.just("stale_release"), st.integers(0, 9)),
        st.tuples(st.just("expire"), st.integers(0, 9)),
    ),
    max_size=40,
)


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(capacities=st.lists(st.integers(1, 3), min_size=1, max_size=3), steps=ops)
def test_live_load_never_exceeds_capacity(
    backend: str, capacities: list[int], steps: list[tuple[str, int]]
) -> None:
    async def body(env: Env) -> None:
        for i, cap in enumerate(capacities):
            await env.registry.register(f"n{i}", f"http://n{i}", cpu_devices(1, capacity=cap))
        tokens: dict[str, int] = {}
        for op, i in steps:
            ep = f"ep-{i}"
            if op == "resolve":
                with contextlib.suppress(NoCapacity):
                    tokens[ep] = (await env.claims.resolve(ep)).token
            elif op in ("release", "stale_release") and ep in tokens:
                if await env.redis.get(env.keys.episode(ep)) is None:
                    continue
                if op == "stale_release":
                    before = await env.snapshot()
                    with pytest.raises(StaleToken):
                        await env.claims.release(ep, tokens[ep] - 1)
                    assert await env.snapshot() == before
                else:
                    await env.claims.release(ep, tokens.pop(ep))
            elif op == "expire" and await env.redis.get(env.keys.episode(ep)):
                await env.expire(ep)
            await check_invariants(env, capacities)

    run(backend, body)


async def check_invariants(env: Env, capacities: list[int]) -> None:
    status = {d.device: d for d in await env.inventory.devices()}
    owners: dict[str, Any] = {}
    for i, cap in enumerate(capacities):
        d = status[f"n{i}/0"]
        assert d.load <= cap
        for row in await env.inventory.episodes(device=d.device):
            assert row.episode not in owners, "an episode in two load sets"
            owners[row.episode] = row.device
    for key in await env.redis.keys(env.keys.episode("*")):
        device = (await env.redis.get(key)).split(" ")[0]
        assert owners[key.split(":", 2)[2]] == device
