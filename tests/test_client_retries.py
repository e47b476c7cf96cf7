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
