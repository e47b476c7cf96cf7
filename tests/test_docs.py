"""What the docs say about the node matches the node (issue 36 item 14: the docs said
``/docs`` needs a CDN, while the node serves Swagger UI and ReDoc from its own files)."""

from __future__ import annotations

import re
from pathlib import Path

import fakeredis
import pytest

from tests.inproc import cluster, config

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_no_page_says_the_api_docs_need_the_internet() -> None:
    for page in DOCS:
        for paragraph in re.split(r"\n\s*\n|\n- ", page.read_text(encoding="utf-8")):
            text = " ".join(paragraph.split()).replace("instead of a CDN", "")
            if "/docs" in text:
                assert not re.search(r"\bCDN\b|Internet access", text), (page.name, text)


@pytest.mark.anyio
async def test_the_api_docs_pages_load_only_the_nodes_own_files() -> None:
    redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    async with cluster(redis, [config("a", devices="cpu:1")]) as (nodes, _):
        for path in ("/docs", "/redoc"):
            page = await nodes[0].client.get(path)
            assert page.status_code == 200, path
            sources = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text)
            scripts = [s for s in sources if s.endswith((".js", ".css"))]
            assert scripts, (path, sources)
            assert all(s.startswith("/") for s in scripts), (path, scripts)
            for s in scripts:
                assert (await nodes[0].client.get(s)).status_code == 200, s


@pytest.mark.anyio
async def test_a_step_without_an_episode_is_flagged_stateless_where_the_docs_say() -> None:
    """Issue 36 item 14: a step without ``episode_id`` is served statelessly; the reply, its
    headers and the metric say so (docs/protocols.md), so a robot that left its id out can
    tell."""
    redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    async with cluster(redis, [config("a", devices="cpu:1")]) as (nodes, _):
        r = await nodes[0].act(inputs={"obs": [[0.0] * 8]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["routing"], body["episode_id"], body["token"], body["seq"]) == (
            "stateless",
            None,
            0,
            0,
        )
        assert r.headers["x-affinity-routing"] == "stateless"
        metrics = (await nodes[0].client.get("/metrics")).text
        assert 'affinity_routing_total{result="stateless"} 1.0' in metrics
    text = (ROOT / "docs" / "protocols.md").read_text(encoding="utf-8")
    assert '"routing": "stateless"' in text and 'result="stateless"' in text


@pytest.mark.anyio
async def test_a_brand_new_episode_in_the_doubt_window_is_told_state_reset_as_documented() -> None:
    """Issue 42 item 14: after Redis restarted empty, a brand-new episode's first step in
    the doubt window (one backstop after the grace period) says ``state_reset: true``;
    docs/protocols.md's ``state_reset`` says so."""
    redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    async with cluster(redis, [config("a", devices="cpu:1")]) as (nodes, _):
        fleet = config("a").settings.keys.fleet
        await redis.set(fleet, f"1 {10**15}")  # the grace period is over, the doubt is not
        r = await nodes[0].act(episode_id="brand-new", inputs={"obs": [[0.0] * 8]})
        assert r.status_code == 200, r.text
        assert (r.json()["routing"], r.json()["state_reset"]) == ("reassigned", True)
        await redis.set(fleet, "1 2")  # the doubt is over too
        r = await nodes[0].act(episode_id="brand-new-later", inputs={"obs": [[0.0] * 8]})
        assert (r.json()["routing"], r.json()["state_reset"]) == ("claimed", False)
    text = " ".join((ROOT / "docs" / "protocols.md").read_text(encoding="utf-8").split())
    said = re.search(r"`state_reset: true` says .*?\)", text)
    assert said, "docs/protocols.md describes state_reset: true"
    paragraph = text[said.start() : said.start() + 900]
    assert "doubt window" in paragraph and "brand-new episode" in paragraph, paragraph
    assert "`routing: reassigned`, `state_reset: true`" in paragraph, paragraph
