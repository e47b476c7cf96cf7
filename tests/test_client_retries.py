"""affinity.Client and AsyncClient without a node: what they send and where they retry
(issue 21: seq on every step, retries after a timeout go elsewhere; issue 23 item 8: the
retry budget counts transport errors, falsy fields are sent)."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from affinity import AsyncClient, Client, ServiceUnavailable, wire

A, B = "http://a:8000", "http://b:8000"


def reply(request: httpx.Request, seq: int, url: str = A) -> httpx.Response:
    body = {
        "outputs": {"actions": [[0.0]]}, "episode_id": "ep", "device": "a/0", "node": "a",
        "token": 5, "routing": "hit", "state_reset": False, "degraded": False,
        "source": "model", "seq": seq, "replayed": False,
    }  # fmt: skip
    return httpx.Response(200, json=body, headers={"x-affinity-url": url})


def sent(request: httpx.Request) -> dict[str, object]:
    """The body a client sent, in either of its encodings."""
    if request.headers["content-type"] == "application/msgpack":
        body: dict[str, object] = wire.decode(request.content)
        return body
    return dict(json.loads(request.content))


class Recorder:
    """A mock transport: records (host, body) of every request, answers with ``answer``."""

    def __init__(self, answer: Callable[[httpx.Request, int], httpx.Response]) -> None:
        self.sent: list[tuple[str, dict[str, object]]] = []
        self.answer = answer

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.sent.append((f"http://{request.url.host}:8000", sent(request)))
        return self.answer(request, len(self.sent))


def test_every_step_sends_its_seq_and_falsy_fields() -> None:
    rec = Recorder(lambda r, n: reply(r, sent(r)["seq"]))
    with Client(A, transport=httpx.MockTransport(rec)) as client:
        for _ in range(3):
            client.act("ep", {"obs": [[0.0]]}, execute_steps=0)
    assert [body["seq"] for _, body in rec.sent] == [1, 2, 3]
    assert all(body["execute_steps"] == 0 for _, body in rec.sent), "execute_steps=0 was dropped"


def test_a_timeout_is_retried_with_the_same_seq_on_another_node() -> None:
    def answer(request: httpx.Request, n: int) -> httpx.Response:
        if n == 2:  # step 2's first attempt, at the owner a: times out
            raise httpx.ReadTimeout("timed out", request=request)
        return reply(request, sent(request)["seq"])

    rec = Recorder(answer)
    with Client([A, B], transport=httpx.MockTransport(rec)) as client:
        client.act("ep", {"obs": [[0.0]]})
        client.act("ep", {"obs": [[1.0]]})
    (_, first), (timed_out, second), (retried, again) = rec.sent
    assert (first["seq"], second["seq"], again["seq"]) == (1, 2, 2)
    assert timed_out == A and retried == B, "the retry went back to the node that timed out"


def test_transport_errors_count_against_the_retry_budget() -> None:
    def answer(request: httpx.Request, n: int) -> httpx.Response:
        raise httpx.ConnectTimeout("timed out", request=request)

    rec = Recorder(answer)
    transport = httpx.MockTransport(rec)
    client = Client([A, B], retries=5, retry_budget_s=0, transport=transport)
    with client, pytest.raises(ServiceUnavailable, match="ConnectTimeout"):
        client.act("ep", {"obs": [[0.0]]})
    assert len(rec.sent) == 1, "a spent budget still retried after a transport error"


@pytest.mark.anyio
async def test_the_async_client_shares_the_rules() -> None:
    def answer(request: httpx.Request, n: int) -> httpx.Response:
        if n == 1:
            raise httpx.ReadTimeout("timed out", request=request)
        return reply(request, sent(request)["seq"], B)

    rec = Recorder(answer)
    async with AsyncClient([A, B], transport=httpx.MockTransport(rec)) as client:
        step = await client.act("ep", {"obs": [[0.0]]}, execute_steps=0)
    assert step.seq == 1 and [host for host, _ in rec.sent] == [A, B]
    assert [body["seq"] for _, body in rec.sent] == [1, 1]


def unreachable_owner(request: httpx.Request, n: int) -> httpx.Response:
    """The fleet's answer while a crashed owner's lease runs: 503 owner_unreachable."""
    body = {"error": {"code": "owner_unreachable", "message": "owner c2: connection refused"}}
    return httpx.Response(503, json=body, headers={"retry-after": "0.1"})


def test_owner_unreachable_is_retried_for_the_time_budget_not_a_few_attempts() -> None:
    """Issue 36 item 9: a crashed owner answers owner_unreachable until its lease (10 s by
    default) lapses; the client used to give up after 5 retries (~5 s at Retry-After 1)
    with 25 s of its 30 s budget unused. Here 12 refusals, then the step is served."""

    def answer(request: httpx.Request, n: int) -> httpx.Response:
        return unreachable_owner(request, n) if n <= 12 else reply(request, sent(request)["seq"])

    rec = Recorder(answer)
    with Client([A, B], transport=httpx.MockTransport(rec)) as client:
        step = client.act("ep", {"obs": [[0.0]]})
    assert step.seq == 1 and len(rec.sent) == 13
    assert {body["seq"] for _, body in rec.sent} == {1}


def test_the_budget_still_bounds_the_retries_and_retries_caps_them_when_given() -> None:
    rec = Recorder(unreachable_owner)
    with (
        Client(A, retry_budget_s=0.35, transport=httpx.MockTransport(rec)) as client,
        pytest.raises(ServiceUnavailable, match="owner c2"),
    ):
        client.act("ep", {"obs": [[0.0]]})
    assert 2 <= len(rec.sent) <= 4, len(rec.sent)  # 0.1 s apart within 0.35 s
    rec = Recorder(unreachable_owner)
    with (
        Client(A, retries=2, transport=httpx.MockTransport(rec)) as client,
        pytest.raises(ServiceUnavailable),
    ):
        client.act("ep", {"obs": [[0.0]]})
    assert len(rec.sent) == 3


def test_a_fleet_that_cannot_be_reached_is_retried_with_waits_not_in_a_tight_loop() -> None:
    def answer(request: httpx.Request, n: int) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    rec = Recorder(answer)
    with (
        Client([A, B], retry_budget_s=0.5, transport=httpx.MockTransport(rec)) as client,
        pytest.raises(ServiceUnavailable, match="ConnectError"),
    ):
        client.act("ep", {"obs": [[0.0]]})
    hosts = [host for host, _ in rec.sent]
    # both nodes, then a wait of 0.1 s, both again, 0.2 s, both again; the next wait would
    # pass the budget (the waits, not the attempts, bound it). A wait never comes back
    # early, so there are at most 6; at least the first round and one attempt after a wait
    assert 3 <= len(hosts) <= 6 and hosts[:2] in ([A, B], [B, A]), hosts


@pytest.mark.parametrize("url", ["127.0.0.1:8004", "localhost:8004", "ftp://a:8000", "http://"])
def test_a_node_url_without_http_is_refused_when_the_client_is_made(url: str) -> None:
    """Issue 36 item 13: ``Client(["127.0.0.1:8004"])`` failed every step as a retryable
    ServiceUnavailable, so a robot loop retrying on it looped forever on a typo."""
    with pytest.raises(ValueError, match=f"node URL {url!r}: must be an http:// or https://"):
        Client([A, url])
    with pytest.raises(ValueError, match="node URL"):
        AsyncClient(url)


def test_the_reply_type_is_StepReply_and_Step_stays_its_alias_for_a_release() -> None:
    import affinity
    import affinity.client

    assert affinity.StepReply is affinity.client.StepReply
    assert affinity.Step is affinity.StepReply and "Step" in affinity.__all__
    assert "StepReply" in affinity.__all__ and "StepReply" in affinity.client.__all__
    assert not hasattr(affinity.client, "_Plan") and not hasattr(affinity.client, "_Episodes")
    rec = Recorder(lambda r, n: reply(r, sent(r)["seq"]))
    with Client(A, transport=httpx.MockTransport(rec)) as client:
        assert isinstance(client.act("ep", {"obs": [[0.0]]}), affinity.StepReply)


def test_an_unknown_step_option_is_a_type_error_and_sends_nothing() -> None:
    rec = Recorder(lambda r, n: reply(r, sent(r)["seq"]))
    with Client(A, transport=httpx.MockTransport(rec)) as client:
        with pytest.raises(TypeError, match="execute_step"):
            client.act("ep", {"obs": [[0.0]]}, execute_step=1)  # type: ignore[call-arg]
        client.act("ep", {"obs": [[0.0]]}, end=True)
    assert [body["end"] for _, body in rec.sent] == [True]
