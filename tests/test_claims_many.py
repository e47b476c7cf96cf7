"""Several episodes claimed in one round trip to Redis (``Claims.resolve_many``, issue 44's
rows), on fakeredis and a real Redis (same bodies): one round trip for K new episodes,
each claim what ``resolve`` would make, and a row refused or failed alone."""

from __future__ import annotations

from dataclasses import replace

import pytest

from affinity import Assignment, InvalidArgument, NoCapacity, ResolveRequest, UnknownEpisode
from tests.conftest import Env, RoundTrips

pytestmark = pytest.mark.anyio


async def test_k_new_episodes_are_claimed_in_one_round_trip(
    env: Env, round_trips: RoundTrips
) -> None:
    await env.node("a", 2)
    # the connection made (its handshake is not a claim's), the script known (else NOSCRIPT,
    # SCRIPT LOAD and the calls again: three round trips, once per Redis start)
    await env.redis.script_load(env.claims.scripts.resolve.text)
    episodes = [f"ep-{i}" for i in range(16)]
    round_trips.writes.clear()
    got = await env.claims.resolve_many([ResolveRequest(e) for e in episodes])
    assert len(round_trips.writes) == 1
    assert all(isinstance(a, Assignment) and a.status == "claimed" for a in got), got
    claimed = [a for a in got if isinstance(a, Assignment)]
    assert [a.episode for a in claimed] == episodes
    assert len({a.token for a in claimed}) == 16  # each its own fencing token
    assert {a.device for a in claimed} == {"a/0", "a/1"}  # round-robin, as one by one
    for a in claimed:  # each claim is what resolve finds afterwards
        again = await env.claims.resolve(a.episode)
        assert (again.status, again.device, again.token, again.claim) == (
            "hit", a.device, a.token, a.claim,
        )  # fmt: skip
    round_trips.writes.clear()
    hits = await env.claims.resolve_many([ResolveRequest(e) for e in episodes])
    assert len(round_trips.writes) == 1
    assert [a.status for a in hits if isinstance(a, Assignment)] == ["hit"] * 16


async def test_a_refused_or_bad_row_answers_alone(env: Env, round_trips: RoundTrips) -> None:
    """A bad id (never sent), a row that may not claim, a row the fleet has no room for:
    each gets its own error; the rows beside them are claimed, still in one round trip."""
    await env.node("a", 1, capacity=2)
    held = await env.claims.resolve("held")
    round_trips.writes.clear()
    got = await env.claims.resolve_many(
        [
            ResolveRequest("held"),
            ResolveRequest(""),
            ResolveRequest("new-1"),
            ResolveRequest("ghost", claim=False),
            ResolveRequest("new-2"),
        ]
    )
    assert round_trips.carrying(env.claims.scripts.resolve.sha) == 1
    assert len(round_trips.writes) == 1
    assert isinstance(got[0], Assignment) and (got[0].status, got[0].token) == ("hit", held.token)
    assert isinstance(got[1], InvalidArgument)
    assert isinstance(got[2], Assignment) and got[2].status == "claimed"
    assert isinstance(got[3], UnknownEpisode)
    assert isinstance(got[4], NoCapacity) and got[4].reason == "at_capacity"  # 2 of 2 taken
    assert await env.claims.lookup("ghost") is None
    assert await env.claims.lookup("new-2") is None


async def test_claims_in_one_round_trip_survive_a_flushed_script_cache(env: Env) -> None:
    await env.node("a", 1)
    await env.redis.script_flush()
    got = await env.claims.resolve_many([ResolveRequest(f"ep-{i}") for i in range(3)])
    assert [a.status for a in got if isinstance(a, Assignment)] == ["claimed"] * 3
    await env.redis.script_flush()
    got = await env.claims.resolve_many([ResolveRequest(f"ep-{i}") for i in range(3)])
    assert [a.status for a in got if isinstance(a, Assignment)] == ["hit"] * 3


async def test_no_rows_ask_nothing(env: Env, round_trips: RoundTrips) -> None:
    await env.redis.ping()
    round_trips.writes.clear()
    assert await env.claims.resolve_many([]) == []
    assert await env.claims.resolve_many([ResolveRequest("\x00")]) != []
    assert round_trips.writes == []


async def test_k_lookups_are_one_round_trip_and_equal_each_lookup(
    env: Env, round_trips: RoundTrips
) -> None:
    """``Claims.lookup_many`` (a node's records of a device back up, checked against Redis:
    ``Owner.recheck``): each answer is what ``lookup`` says of that episode, a missing one
    None, in one round trip; a bad id is refused before anything is sent."""
    await env.node("a", 2)
    claimed = [await env.claims.resolve(f"ep-{i}") for i in range(5)]
    await env.redis.script_load(env.claims.scripts.lookup.text)
    episodes = ["ep-3", "nobody", "ep-0", "ep-4", "ep-1", "ep-2"]
    round_trips.writes.clear()
    got = await env.claims.lookup_many(episodes)
    assert len(round_trips.writes) == 1
    assert got[1] is None
    assert [(i.device, i.token) for i in got if i is not None] == [
        (claimed[k].device, claimed[k].token) for k in (3, 0, 4, 1, 2)
    ]
    for episode, info in zip(episodes, got, strict=True):  # (the TTL counts down meanwhile)
        alone = await env.claims.lookup(episode)
        assert (info and replace(info, ttl_ms=0)) == (alone and replace(alone, ttl_ms=0))
    round_trips.writes.clear()
    with pytest.raises(InvalidArgument):
        await env.claims.lookup_many(["ep-0", ""])
    assert await env.claims.lookup_many([]) == []
    assert round_trips.writes == []
    await env.redis.script_flush()  # NOSCRIPT: loaded, asked again
    assert [i is not None for i in await env.claims.lookup_many(["ep-0", "x"])] == [True, False]


class _Pipe:
    """A pipeline that answers from a script of rounds: each ``execute`` the next."""

    def __init__(self, rounds: list[list[object]]) -> None:
        self.rounds = rounds

    def execute_command(self, *args: object) -> None:
        pass

    async def execute(self, raise_on_error: bool = True) -> list[object]:
        return self.rounds.pop(0)


class _Redis:
    def __init__(self, rounds: list[list[object]]) -> None:
        self.pipe = _Pipe(rounds)
        self.loaded = 0

    def pipeline(self, transaction: bool = True) -> _Pipe:
        return self.pipe

    async def script_load(self, text: str) -> None:
        self.loaded += 1


@pytest.mark.parametrize(
    ("first", "second", "want"),
    [
        (1, 0, 0),  # the second round (maybe another connection) wrote nothing: its 1 of
        (0, 1, 0),  # no use for the first round's write, which 0 replicas acknowledged
        (1, 1, 1),
    ],
)
async def test_a_partial_noscript_round_counts_the_lower_wait(
    first: int, second: int, want: int
) -> None:
    """After a NOSCRIPT for some calls only, the replicas' count is the lower of the two
    rounds' WAITs: a call of the first round ran, and the second round's WAIT need not
    cover its write (review finding)."""
    from redis.exceptions import NoScriptError

    from affinity.scripts import Script, evalsha_many

    script = Script("t", "return 1", "0" * 40)
    rounds: list[list[object]] = [["ok", NoScriptError("NOSCRIPT"), first], ["ok", second]]
    redis = _Redis(rounds)
    replies, acked = await evalsha_many(redis, script, [("k1", ()), ("k2", ())], (1, 100))
    assert replies == ["ok", "ok"] and acked == want and redis.loaded == 1


async def test_an_all_noscript_first_round_counts_the_second_wait() -> None:
    from redis.exceptions import NoScriptError

    from affinity.scripts import Script, evalsha_many

    rounds: list[list[object]] = [[NoScriptError("NOSCRIPT"), 0], ["ok", 1]]
    replies, acked = await evalsha_many(
        _Redis(rounds), Script("t", "return 1", "0" * 40), [("k", ())], (1, 100)
    )
    assert replies == ["ok"] and acked == 1
