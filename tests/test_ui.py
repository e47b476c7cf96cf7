"""The fleet page and the event stream.

A real headless Chromium (Debian's ``chromium`` driven through ``chromium-driver`` by
selenium; nothing is downloaded) opens ``/ui`` of one of two real ``affinity-node``
processes on loopback and must show what Redis holds, live: both nodes and every device,
an operator's ``affinity drain`` within seconds and without a reload, a claim in the
event list, an episode's device in the lookup box, drain/undrain buttons only with the
admin token, and a fleet of 8 nodes x 8 GPUs on one laptop screen (the screenshot lands
in ``tests/artifacts/``). The page must log no console error.

``/events/stream`` is tested over plain HTTP: a client that disconnects and reconnects
with ``Last-Event-ID`` misses nothing; heartbeats and shutdown are tested on the stream
itself.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import signal
import struct
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import fakeredis
import httpx
import pytest
import redis
import redis.asyncio

from affinity import Claims, DeviceRegistration, Keys, Registry, Settings
from affinity.events import EVENT_NUMBERS, EventStream
from affinity.registry import NodeProcess, NodeProcesses
from node import VERSION
from node.fleet import RETRY_MS, Fleet
from tests.procs import ROOT, Node, RedisServer, wait_until
from tests.test_cluster import running

pytestmark = pytest.mark.integration

ADMIN = "ui-admin-token"
DEVICES_PER_NODE = 8
ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
LAPTOP = (1440, 900)  # CSS pixels
WAIT_S = 20  # bound of every wait on the page (the page polls every 2 s, events at once)
KEYS = Keys()
OBS = {"obs": [[0.1] * 8]}


@dataclass
class Stack:
    redis: RedisServer
    nodes: list[Node]

    def act(self, via: int, episode: str) -> dict[str, Any]:
        r = httpx.post(
            self.nodes[via].url + "/act", json={"episode_id": episode, "inputs": OBS}, timeout=30
        )
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    def device_states(self) -> dict[str, str]:
        listed = httpx.get(self.nodes[0].url + "/devices", timeout=10).json()["devices"]
        return {d["device"]: d["state"] for d in listed}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("ui")
    server = RedisServer(tmp)
    nodes = [
        Node(
            tmp,
            node_id,
            server.url,
            devices=f"cpu:{DEVICES_PER_NODE}",
            env={"AFFINITY_ADMIN_TOKEN": ADMIN, "AFFINITY_CLUSTER_SECRET": "ui-secret"},
        )
        for node_id in ("node-a", "node-b")
    ]
    with running(server, nodes) as cluster:
        yield Stack(cluster.redis, cluster.nodes)


# -- the browser ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    for binary, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if shutil.which(binary) is None:
            pytest.fail(f"{binary} is missing (bash .ci/run installs {package})", pytrace=False)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        # offline, as on an air-gapped cluster: every host but loopback fails to resolve
        "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
        f"--window-size={LAPTOP[0]},{LAPTOP[1]}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: selenium then never looks for (or fetches) a driver itself.
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        width, height = LAPTOP
        driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        yield driver
    finally:
        driver.quit()


def console_errors(driver: Any, allowed: list[str]) -> list[str]:
    """SEVERE entries of the browser log (read once: reading empties it), less those
    matching an ``allowed`` pattern (a refusal the test provoked on purpose)."""
    return [
        e["message"]
        for e in driver.get_log("browser")
        if e["level"] == "SEVERE" and not any(re.search(p, e["message"]) for p in allowed)
    ]


@dataclass
class Page:
    driver: Any
    url: str
    allowed_errors: list[str] = field(default_factory=list)

    def wait(self, condition: Any, what: str, timeout: float = WAIT_S) -> Any:
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(self.driver, timeout, poll_frequency=0.1).until(
            lambda d: condition(d), message=f"page never showed {what} within {timeout}s"
        )

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def cells(self, within: str = "") -> list[dict[str, str]]:
        """Every device cell (under ``within``): its data attributes and visible text."""
        return self.js(  # type: ignore[no-any-return]
            "return [...document.querySelectorAll(arguments[0] + ' .device')].map(c => ({"
            "device: c.dataset.device, state: c.dataset.state, text: c.innerText,"
            "crash: c.querySelector('.crash').textContent}))",
            within,
        )

    def cell_state(self, device: str) -> str | None:
        states = {c["device"]: c["state"] for c in self.cells()}
        return states.get(device)

    def text(self, css: str) -> str | None:
        return self.js(  # type: ignore[no-any-return]
            "const e = document.querySelector(arguments[0]); return e ? e.textContent : null;",
            css,
        )

    def find(self, css: str) -> Any:
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.CSS_SELECTOR, css)


@pytest.fixture
def page(browser: Any, stack: Stack) -> Iterator[Page]:
    """``/ui`` of node-a, loaded and showing devices; no console error by the end."""
    browser.get_log("browser")  # start from an empty log
    p = Page(browser, stack.nodes[0].url + "/ui")
    browser.get(p.url)
    p.wait(lambda d: p.js("return document.querySelectorAll('.device').length") > 0, "devices")
    yield p
    errors = console_errors(browser, p.allowed_errors)
    assert errors == [], f"console errors on {p.url}: {errors}"


def cli(stack: Stack, *argv: str) -> str:
    """The operator's ``affinity`` command, installed next to this interpreter."""
    import subprocess

    script = Path(sys.executable).parent / "affinity"
    assert script.exists(), f"{script} is not installed (pip install -e .)"
    done = subprocess.run(
        [str(script), "--redis", stack.redis.url, *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


# -- page tests -------------------------------------------------------------------------


def test_page_lists_both_nodes_and_every_device(page: Page, stack: Stack) -> None:
    listed = httpx.get(stack.nodes[1].url + "/devices", timeout=10).json()["devices"]
    expected = {d["device"] for d in listed}
    assert len(expected) == 2 * DEVICES_PER_NODE
    page.wait(
        lambda d: {c["device"] for c in page.cells()} == expected, "every device of both nodes"
    )
    for node in stack.nodes:
        row = f".node-row[data-node='{node.node_id}']"
        card = page.find(f"{row} .node-card").text
        assert node.node_id in card and node.url in card and f"v{VERSION}" in card, card
        assert "demo_policy@" in card, card  # the models the node serves
        assert "alive · lease" in card
        assert page.find(row).get_attribute("data-alive") == "yes"
        # its processes (issue 43), published at registration: the node's own, its real
        # pid; with fronts or device workers (AFFINITY_TEST_SHAPE), the core's first
        assert node.proc.popen is not None
        pids = page.find(row).get_attribute("data-pids")
        if node.front_doors == 1 and not node.device_workers:
            assert "1 process" in card, card
            assert pids == f"core:{node.proc.popen.pid}", pids
        else:
            assert "core+" in card, card
            assert pids.startswith(f"core:{node.proc.popen.pid},"), pids
        cells = page.cells(row)
        assert len(cells) == DEVICES_PER_NODE
        for c in cells:
            assert c["state"] == "active", c
            assert "CPU" in c["text"] and re.search(r"\b\d+/64\b", c["text"]), c
    # crash-tracker facts only for the serving node's own devices; "this node" on its card
    for c in page.cells():
        assert (c["crash"] == "⚑0") == c["device"].startswith("node-a/"), c
    assert page.find(".node-row[data-node='node-a'] .tag").is_displayed()
    assert not page.find(".node-row[data-node='node-b'] .tag").is_displayed()
    assert page.find("#served-by").text == "served by node-a"
    page.wait(lambda d: page.find("#live").text == "live", "the event stream connected")


def test_cli_drain_turns_the_cell_draining_without_a_reload(page: Page, stack: Stack) -> None:
    device = "node-b/1"
    page.wait(lambda d: page.cell_state(device) == "active", f"{device} active")
    mark = uuid.uuid4().hex
    page.js("window.affinityTestMark = arguments[0];", mark)

    assert "active -> draining" in cli(stack, "drain", device, "--reason", "ui test")
    page.wait(lambda d: page.cell_state(device) == "draining", f"{device} draining")
    assert page.js("return window.affinityTestMark") == mark, "the page was reloaded"
    cell = page.find(f".device[data-device='{device}']")
    assert "draining" in cell.text and "ui test" in cell.get_attribute("title")
    drain = "#event-list li[data-type='drain']"
    page.wait(lambda d: device in (page.text(drain) or ""), "the drain event")

    assert "draining -> active" in cli(stack, "undrain", device)
    page.wait(lambda d: page.cell_state(device) == "active", f"{device} active again")
    assert page.js("return window.affinityTestMark") == mark


def test_claim_appears_in_events_and_lookup_shows_its_device(page: Page, stack: Stack) -> None:
    episode = f"ui-{uuid.uuid4().hex[:10]}"
    reply = stack.act(1, episode)
    assert reply["routing"] == "claimed"
    claim = f"#event-list li[data-type='claim']:has(.ep[data-episode='{episode}'])"
    page.wait(lambda d: page.text(claim) is not None, f"the claim of {episode}")
    assert f"{episode} → {reply['device']}" in (page.text(claim) or "")

    box = page.find("#lookup-input")
    box.clear()
    box.send_keys(episode)
    page.find("#lookup-form button").click()
    page.wait(
        lambda d: page.text("#lookup-result [data-field='device']") == reply["device"],
        f"the lookup of {episode}",
    )
    shown = page.js(
        "return Object.fromEntries([...document.querySelectorAll('#lookup-result dd')]"
        ".map(dd => [dd.dataset.field, dd.textContent]))"
    )
    assert shown["episode"] == episode
    assert shown["node"] == reply["node"]
    assert shown["token"] == str(reply["token"])
    assert re.fullmatch(r"\d+(\.\d)?s|\d+m\d\ds", shown["ttl"]), shown["ttl"]


def test_admin_buttons_only_with_the_token(page: Page, stack: Stack) -> None:
    device = "node-a/2"
    page.wait(lambda d: page.cell_state(device) == "active", f"{device} active")
    button = page.find(f".device[data-device='{device}'] button")
    assert not button.is_displayed(), "no admin button before a token is typed in"

    # A wrong token: the node refuses, the page says so and hides the buttons again.
    page.allowed_errors.append(r"devices/node-a/2/drain.* 401")
    page.find("#admin-token").send_keys("wrong-token")
    page.find("#admin-unlock").click()
    page.wait(lambda d: button.is_displayed(), "the admin buttons")
    button.click()
    page.wait(lambda d: "admin token refused" in page.find("#banner").text, "the refusal")
    assert not button.is_displayed()
    assert stack.device_states()[device] == "active"

    page.find("#admin-token").send_keys(ADMIN)
    page.find("#admin-unlock").click()
    assert page.find("#admin-token").get_attribute("value") == "", "the token stays in memory"
    page.wait(lambda d: button.is_displayed() and button.text == "drain", "the drain button")
    riding = next(  # an episode on the device: the drain button moves it, with its state
        ep for ep in (f"ui-ride-{i}" for i in range(64)) if stack.act(0, ep)["device"] == device
    )
    button.click()
    page.wait(lambda d: page.cell_state(device) == "draining", f"{device} draining")
    assert stack.device_states()[device] == "draining"
    where = stack.nodes[0].url + "/episodes/" + riding
    wait_until(lambda: httpx.get(where, timeout=10).json()["device"] != device, 30, "the move")
    after = stack.act(1, riding)
    assert (after["seq"], after["state_reset"]) == (2, False), after
    page.wait(lambda d: button.text == "undrain", "the undrain button")
    button.click()
    page.wait(lambda d: page.cell_state(device) == "active", f"{device} active")
    assert stack.device_states()[device] == "active"
    page.find("#admin-lock").click()
    assert not button.is_displayed()


def test_with_an_api_key_the_page_asks_for_it_and_then_shows_the_fleet_live(
    browser: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    key = "ui-api-key"
    tmp: Path = tmp_path_factory.mktemp("ui-keyed")
    server = RedisServer(tmp)
    keyed = Node(tmp, "keyed", server.url, devices="cpu:2", extra=["--api-key", key])
    with running(server, [keyed]):
        browser.get_log("browser")
        p = Page(browser, keyed.url + "/ui", allowed_errors=[r" 401 "])
        browser.get(p.url)
        p.wait(lambda d: p.find("#api-key").is_displayed(), "the API key box")
        assert "wants its API key" in p.find("#banner").text
        assert p.js("return document.querySelectorAll('.device').length") == 0
        p.find("#api-key").send_keys(key)
        p.find("#api-key-set").click()
        assert p.find("#api-key").get_attribute("value") == "", "the key stays in memory"
        p.wait(lambda d: len(p.cells()) == 2, "both devices of the keyed node")
        p.wait(lambda d: p.find("#live").text == "live", "the event stream connected")
        assert not p.find("#api-key").is_displayed()
        episode = f"ui-{uuid.uuid4().hex[:10]}"
        r = httpx.post(keyed.url + "/act", json={"episode_id": episode, "inputs": OBS},
                       headers={"Authorization": f"Api-Key {key}"}, timeout=30)  # fmt: skip
        assert r.status_code == 200, r.text
        claim = f"#event-list li[data-type='claim']:has(.ep[data-episode='{episode}'])"
        p.wait(lambda d: p.text(claim) is not None, f"the claim of {episode}, live")
        urls = p.js("return performance.getEntriesByType('resource').map(e => e.name)")
        assert not [u for u in urls if key in u], "the key never goes into a URL"
        assert console_errors(browser, p.allowed_errors) == []


FAKE_NODES = [f"gpu-{c}" for c in "cdefgh"]
FAKE_SETTINGS = Settings(lease_ttl_s=600)


def h200s(node: str, count: int) -> list[DeviceRegistration]:
    """``count`` H200s of ``node``, four episodes each."""
    return [
        DeviceRegistration(
            index=i,
            kind="cuda",
            name="NVIDIA H200",
            uuid=f"GPU-{node}-{i}",
            arch="sm_90",
            memory_mb=143_771,
            capacity=4,
            provider="CUDAExecutionProvider",
        )
        for i in range(count)
    ]


async def register_gpu_nodes(url: str) -> None:
    """Six more nodes of eight H200s each (leases long enough for the test), some load,
    one GPU down and one draining."""
    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    try:
        registry = Registry(client, FAKE_SETTINGS)
        for node in FAKE_NODES:
            gpus = h200s(node, 8)
            await registry.register(node, f"http://{node}:8000", gpus, "0.1.0", instance=node,
                                    processes=eight_fronts(node))  # fmt: skip
        await registry.set_state("gpu-d/3", "down", "3 consecutive model failures")
        await registry.drain("gpu-e/5", "fan failure")
        claims = Claims(client, FAKE_SETTINGS)
        for i in range(120):
            await claims.resolve(f"load-{i}")
    finally:
        await client.aclose()


def eight_fronts(node: str) -> NodeProcesses:
    """A core and 8 fronts (issue 43); gpu-c's front 5 restarted twice and its front 7 is
    not running (waiting for its restart), the loop of its front 2 lags past 2.5 s. gpu-h
    also runs a worker process per GPU (``--device-workers process``): its worker 3
    restarted once and its worker 6 is not running. Each has its fronts' fork server, a
    helper; gpu-c's restarted once."""
    since = 1_795_983_840_000
    rows = [NodeProcess("core", 100, since, 0, 1.0)]
    for k in range(8):
        if node == "gpu-c" and k == 7:
            continue
        restarts = 2 if node == "gpu-c" and k == 5 else 0
        lag = math.inf if node == "gpu-c" and k == 2 else 2.5
        rows.append(NodeProcess(str(k), 101 + k, since, restarts, lag))
    forks = (NodeProcess("forksrv", 99, since, 1 if node == "gpu-c" else 0),)
    if node != "gpu-h":
        return NodeProcesses(8, tuple(rows), helpers=forks)
    for k in range(8):
        if k != 6:
            rows.append(NodeProcess(f"dev{k}", 201 + k, since, 1 if k == 3 else 0))
    return NodeProcesses(8, tuple(rows), 8, forks)


async def deregister_gpu_nodes(url: str) -> None:
    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    try:
        registry = Registry(client, FAKE_SETTINGS)
        for node in FAKE_NODES:
            await registry.deregister(node, node)
            await registry.forget(node)  # a departed node stays listed ("left") until then
    finally:
        await client.aclose()


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


async def register_dying_node(url: str, node: str) -> None:
    """A node of two GPUs holding live episodes whose lease lapses within a second (it
    never renews, as a killed node would not)."""
    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    try:
        settings = Settings(lease_ttl_s=1.0)
        gpus = h200s(node, 2)
        registry = Registry(client, settings)
        await registry.register(node, f"http://{node}:8000", gpus, "0.1.0", instance=node)
        claims = Claims(client, settings)
        for i in range(8):  # it registers no model: its episodes go to its own GPUs
            claim = await claims.resolve(f"{node}-load-{i}")
            assert claim.node == node, claim
    finally:
        await client.aclose()


def test_a_dead_node_shows_no_load_and_counts_not_active(page: Page, stack: Stack) -> None:
    node = f"gpu-dying-{uuid.uuid4().hex[:6]}"
    asyncio.run(register_dying_node(stack.redis.url, node))
    try:
        # the load sets still hold its episodes (read in Redis: the CLI already shows a node
        # whose one-second lease lapsed as dead, however fast this machine got here)
        r = redis.Redis.from_url(stack.redis.url, decode_responses=True)
        try:
            held = sum(r.zcard(Keys().load(f"{node}/{i}")) for i in range(2))
        finally:
            r.close()
        assert held == 8, held
        row = f".node-row[data-node='{node}']"
        page.wait(
            lambda d: (
                page.js("return document.querySelector(arguments[0])", row) is not None
                and page.find(row).get_attribute("data-alive") == "no"
            ),
            "the node dead",
        )
        for c in page.cells(row):
            assert "node dead" in c["text"] and re.search("\u2013/4\\b", c["text"]), c
            assert not re.search(r"\b[1-4]/4\b", c["text"]), c  # no stale load
        summary = page.find("#summary").text
        assert ", 2 on dead nodes · " in summary, summary
        active = int(re.search(r"devices: (\d+) active", summary).group(1))  # type: ignore[union-attr]
        assert active == 2 * DEVICES_PER_NODE, summary
        # a healthy device's zero failure count is not drawn in the failure colour
        colours = page.js(
            "return [...document.querySelectorAll('.device .crash')]"
            ".filter(e => e.textContent === '⚑0')"
            ".map(e => [e.className, getComputedStyle(e).color])"
        )
        muted = page.js(
            "const probe = document.createElement('span'); probe.style.color = 'var(--muted)';"
            "document.body.append(probe); const colour = getComputedStyle(probe).color;"
            "probe.remove(); return colour;"
        )
        assert colours and all(colour == muted for _, colour in colours), (muted, colours)
    finally:
        cli(stack, "forget", node)


async def stop_gracefully(url: str, node: str) -> None:
    """A node that registers, then stops gracefully (leave, deregister): the events a
    SIGTERM writes."""
    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    try:
        registry = Registry(client, Settings())
        await registry.register(node, f"http://{node}:8000", h200s(node, 1), "0.1.0", node)
        await registry.leave(node, node)
        await registry.deregister(node, node)
    finally:
        await client.aclose()


def test_a_graceful_stop_and_moves_read_as_what_they_are(page: Page, stack: Stack) -> None:
    """Issue 42 item 11: a graceful stop showed as a red ``node-down`` (a crash's colour)
    and ``moved`` events as raw key=value text. A node that deregistered is ``node-left``
    in a neutral colour, a lapsed lease stays a red ``node-down``, a move reads
    from → to with its outcome, and an owner's move that nothing could take (``move-kept``)
    says the episode stayed."""
    left, dying = (f"{p}-{uuid.uuid4().hex[:6]}" for p in ("gpu-leaving", "gpu-crashing"))
    episode = f"ui-moved-{uuid.uuid4().hex[:6]}"
    asyncio.run(stop_gracefully(stack.redis.url, left))
    asyncio.run(register_dying_node(stack.redis.url, dying))
    r = redis.Redis.from_url(stack.redis.url, decode_responses=True)
    try:  # as transfer.lua writes them (a real move is tests/test_handover_procs.py's)
        r.xadd(KEYS.events, {"type": "moved", "episode": episode, "from": "node-a/0",
                             "to": "node-b/3", "token": "17", "bytes": "2048",
                             "reason": "drain", "model": "demo_policy@v1"})  # fmt: skip
        r.xadd(KEYS.events, {"type": "move-kept", "episode": episode, "device": "node-b/3",
                             "reason": "move"})  # fmt: skip
    finally:
        r.close()

    def row(kind: str, node_or_episode: str) -> dict[str, str] | None:
        return page.js(  # type: ignore[no-any-return]
            "const li = [...document.querySelectorAll('#event-list li')].find(li =>"
            " li.dataset.kind === arguments[0] && li.textContent.includes(arguments[1]));"
            "if (!li) return null; const ty = li.querySelector('.ty');"
            "return {type: li.dataset.type, label: ty.textContent, text: li.querySelector('.f')"
            ".textContent, colour: getComputedStyle(ty).color};",
            kind,
            node_or_episode,
        )

    page.wait(lambda d: row("node-left", left) is not None, "the graceful stop")
    graceful = row("node-left", left)
    assert graceful is not None and graceful["type"] == "node-down", graceful
    assert graceful["label"] == "node-left"
    assert (
        graceful["text"]
        == f"{left} stopped gracefully, 0 episode(s) handed over without their state"
    )
    assert row("node-leave", left) is not None  # its start: no new episodes
    # the node-down of a lapsed lease is written by the next renewal or claim that notices
    page.wait(lambda d: row("node-down", dying) is not None, "the lapsed lease")
    crash = row("node-down", dying)
    assert crash is not None and crash["text"] == f"{dying} down: lease lapsed", crash
    assert graceful["colour"] != crash["colour"], (graceful, crash)  # not a crash's red

    page.wait(lambda d: row("moved", episode) is not None, "the move")
    moved = row("moved", episode)
    assert moved is not None
    assert moved["text"] == f"{episode} node-a/0 → node-b/3: moved with its state (drain), 2.0 KiB"
    kept = row("move-kept", episode)
    assert kept is not None
    assert kept["text"] == (
        f"{episode} stayed on node-b/3: nothing could take it, kept with its state (move)"
    )
    cli(stack, "forget", dying)
    cli(stack, "forget", left)


def cli_devices(stack: Stack) -> list[dict[str, Any]]:
    return json.loads(cli(stack, "devices", "--json"))  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("path", "rendered"),
    [
        # Swagger UI drew an operation block per endpoint, /act among them
        ("/docs", "return [...document.querySelectorAll('.opblock-summary-path')]"
                  ".some(e => e.textContent.trim() === '/act')"),
        # ReDoc drew its menu with the operator endpoints and the operation of /act
        ("/redoc", "return document.querySelector('.menu-content') !== null && "
                   "document.body.innerText.includes('/events/stream')"),
    ],
)  # fmt: skip
def test_api_docs_render_offline_from_the_nodes_own_files(
    browser: Any, stack: Stack, path: str, rendered: str
) -> None:
    browser.get_log("browser")
    p = Page(browser, stack.nodes[0].url + path)
    browser.get(p.url)
    p.wait(lambda d: p.js(rendered), f"{path} rendered")
    scripts = p.js(
        "return [...document.querySelectorAll('script[src], link[href]')].map(e => e.src || e.href)"
    )
    assert scripts and all(s.startswith(stack.nodes[0].url + "/") for s in scripts), scripts
    # the one request elsewhere: ReDoc's decorative logo beside "API docs by Redocly", which
    # hides itself when it cannot load (as here, offline); nothing the page needs
    logo = "https://cdn.redoc.ly/redoc/logo-mini.svg"
    loaded = p.js("return performance.getEntriesByType('resource').map(e => e.name)")
    outside = [u for u in loaded if not u.startswith(stack.nodes[0].url + "/")]
    assert outside in ([], [logo]), loaded
    assert f"{stack.nodes[0].url}/openapi.json" in loaded
    errors = console_errors(browser, [re.escape(logo)])
    assert errors == [], errors


def test_eight_nodes_of_eight_gpus_fit_one_laptop_screen(page: Page, stack: Stack) -> None:
    asyncio.run(register_gpu_nodes(stack.redis.url))
    try:
        page.wait(
            lambda d: (
                len(page.cells()) == 64
                and (page.cell_state("gpu-d/3"), page.cell_state("gpu-e/5")) == ("down", "draining")
            ),
            "64 devices",
        )
        layout = page.js(
            """
            const fleet = document.getElementById('fleet');
            const cells = [...document.querySelectorAll('.device')]
              .map(c => c.getBoundingClientRect());
            return {
              w: window.innerWidth, h: window.innerHeight,
              scrollH: fleet.scrollHeight, clientH: fleet.clientHeight,
              scrollW: fleet.scrollWidth, clientW: fleet.clientWidth,
              bottom: Math.max(...cells.map(r => r.bottom)),
              right: Math.max(...cells.map(r => r.right)),
              minWidth: Math.min(...cells.map(r => r.width)),
              font: parseFloat(getComputedStyle(document.querySelector('.device')).fontSize),
              rows: new Set(cells.map(r => Math.round(r.top))).size,
            };
            """
        )
        assert (layout["w"], layout["h"]) == LAPTOP
        # the whole fleet on one screen: no scrolling, one row of eight per node
        assert layout["scrollH"] <= layout["clientH"] and layout["scrollW"] <= layout["clientW"]
        assert layout["bottom"] <= LAPTOP[1] and layout["right"] <= LAPTOP[0], layout
        assert layout["rows"] == 8, layout
        assert layout["minWidth"] >= 90 and layout["font"] >= 11, layout
        summary = page.find("#summary").text
        assert summary.startswith("8/8 nodes alive · 64 devices: 62 active, 1 draining, 1 down")
        # each node's processes on its card; what is wrong with them stands out
        procs = page.text(".node-row[data-node='gpu-c'] .procs")
        assert procs == "core+8 fronts, 1 down, 3 restarts · lag >2500ms", procs  # (+ forksrv)
        assert page.text(".node-row[data-node='gpu-d'] .procs") == "core+8 fronts · lag ≤2.5ms"
        assert page.js(
            "return document.querySelector(\"[data-node='gpu-c'] .procs\").classList"
            ".contains('restarted')"
        )
        title = page.js("return document.querySelector(\"[data-node='gpu-c'] .procs\").title")
        assert "front 5: pid 106 since 2026-11-29T20:24:00.000Z, 2 restart(s)" in title, title
        assert "front 2: pid 103" in title and "loop lag p99 >2500ms" in title, title
        assert title.endswith("\nfork server: pid 99 since 2026-11-29T20:24:00.000Z, 1 restart(s)")
        procs = page.text(".node-row[data-node='gpu-h'] .procs")
        assert procs == "core+8 fronts+8 device workers, 1 worker down, 1 restart · lag ≤2.5ms"
        title = page.js("return document.querySelector(\"[data-node='gpu-h'] .procs\").title")
        assert "\ndevice 3 worker: pid 204 since 2026-11-29T20:24:00.000Z, 1 restart(s)\n" in title
        assert "device 6 worker" not in title and title.count("worker") == 7, title
        # /nodes (what the page reads) carries the workers; a worker's row has no loop lag
        listed = httpx.get(stack.nodes[0].url + "/nodes", timeout=10).json()["nodes"]
        nodes = {n["node"]: n for n in listed}
        assert nodes["gpu-h"]["workers"] == 8 and "workers" not in nodes["gpu-d"]
        assert nodes["gpu-c"]["helpers"] == [
            {"role": "forksrv", "pid": 99, "since_ms": 1_795_983_840_000, "restarts": 1}
        ]  # fmt: skip
        assert nodes["gpu-h"]["processes"][9] == {
            "role": "dev0", "pid": 201, "since_ms": 1_795_983_840_000, "restarts": 0
        }  # fmt: skip

        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "ui-fleet-8x8.png"
        shot.unlink(missing_ok=True)
        assert page.driver.save_screenshot(str(shot))
        assert png_size(shot) == LAPTOP
    finally:
        asyncio.run(deregister_gpu_nodes(stack.redis.url))


# -- the page's files -------------------------------------------------------------------


def test_every_node_serves_the_page_and_nothing_points_elsewhere(stack: Stack) -> None:
    for node in stack.nodes:
        r = httpx.get(node.url + "/ui", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        csp = r.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "connect-src 'self'" in csp
        refs = re.findall(r'(?:src|href)="([^"]+)"', r.text)
        assert refs, "the page loads its script and style"
        for ref in refs:
            assert ref.startswith("ui/"), f"{ref}: only the node's own files"
            asset = httpx.get(f"{node.url}/{ref}", timeout=10)
            assert asset.status_code == 200, ref
        js = httpx.get(node.url + "/ui/app.js", timeout=10)
        assert js.headers["content-type"].startswith("text/javascript")
        assert not re.search(r"https?://", js.text), "no other origin in the script"
    assert httpx.get(stack.nodes[0].url + "/ui/missing.js", timeout=10).status_code == 404


def test_nodes_endpoint(stack: Stack) -> None:
    body = httpx.get(stack.nodes[1].url + "/nodes", timeout=10).json()
    assert body["node"] == "node-b" and len(body["instance"]) == 32
    nodes = {n["node"]: n for n in body["nodes"]}
    assert set(nodes) >= {"node-a", "node-b"}
    for node in stack.nodes:
        n = nodes[node.node_id]
        assert n["url"] == node.url and n["alive"] is True and n["lease_ms"] > 0
        assert n["devices"] == [f"{node.node_id}/{i}" for i in range(DEVICES_PER_NODE)]


def test_openapi_documents_the_operator_endpoints(stack: Stack) -> None:
    spec = httpx.get(stack.nodes[0].url + "/openapi.json", timeout=10).json()
    paths = spec["paths"]
    assert "/ui/app.js" not in paths
    assert "text/html" in paths["/ui"]["get"]["responses"]["200"]["content"]
    nodes = paths["/nodes"]["get"]["responses"]["200"]["content"]["application/json"]
    assert nodes["schema"]["$ref"].endswith("/NodesOut")
    schema = spec["components"]["schemas"]["NodesOut"]
    assert schema["examples"][0]["nodes"][0]["lease_ms"] > 0
    stream = paths["/events/stream"]["get"]
    assert "id: " in stream["responses"]["200"]["content"]["text/event-stream"]["example"]
    params = {p["name"]: p for p in stream["parameters"]}
    assert params["Last-Event-ID"]["in"] == "header" and params["backlog"]["in"] == "query"
    assert "Last-Event-ID" in stream["description"]


# -- the event stream -------------------------------------------------------------------


class Events:
    """An SSE reader over one streamed response: ``read(n)`` returns the next ``n``
    events (``id``, ``event``, ``data``), skipping comments and ``retry`` lines."""

    def __init__(self, response: httpx.Response) -> None:
        self.lines = response.iter_lines()

    def read(self, count: int) -> list[dict[str, str]]:
        events: list[dict[str, str]] = []
        current: dict[str, str] = {}
        for line in self.lines:
            if line == "":
                if "data" in current:
                    events.append(current)
                    if len(events) == count:
                        return events
                current = {}
            elif not line.startswith(":"):
                name, _, value = line.partition(":")
                current[name] = value.removeprefix(" ")
        raise AssertionError(f"stream ended after {len(events)} of {count} events")

    def drain(self) -> None:
        """Read until the server ends the stream."""
        for _ in self.lines:
            pass


def claim_directly(url: str, episodes: list[str]) -> None:
    async def run() -> None:
        client = redis.asyncio.Redis.from_url(url, decode_responses=True)
        try:
            claims = Claims(client, Settings())
            for ep in episodes:  # the stack's nodes serve the demo policy
                await claims.resolve(ep, model="demo_policy")
        finally:
            await client.aclose()

    asyncio.run(run())


def test_event_stream_reconnect_with_last_event_id_misses_nothing(stack: Stack) -> None:
    url = stack.nodes[0].url + "/events/stream"
    run = uuid.uuid4().hex[:8]
    before = [f"sse-{run}-{i}" for i in range(4)]
    during = [f"sse-{run}-away-{i}" for i in range(5)]
    timeout = httpx.Timeout(30.0)
    with httpx.Client(timeout=timeout) as client:
        with client.stream("GET", url, params={"backlog": 0}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            claim_directly(stack.redis.url, before)
            seen = Events(r).read(2)  # then hang up, two events unread
        assert [json.loads(e["data"])["episode"] for e in seen] == before[:2]
        last = seen[-1]["id"]
        assert json.loads(seen[-1]["data"])["id"] == last

        claim_directly(stack.redis.url, during)  # while nobody listens

        expected = stack.redis.client().xrange(KEYS.events, f"({last}", "+")
        mine = [i for i, f in expected if f.get("episode", "").startswith(f"sse-{run}")]
        assert len(mine) == 7
        with client.stream("GET", url, headers={"Last-Event-ID": last}) as r:
            assert r.status_code == 200
            resumed = Events(r).read(len(expected))
    assert [e["id"] for e in resumed] == [i for i, _ in expected], "in order, none missed"
    episodes = [json.loads(e["data"]).get("episode") for e in resumed]
    assert [ep for ep in episodes if ep and ep.startswith(f"sse-{run}")] == before[2:] + during
    for event, (_, fields) in zip(resumed, expected, strict=True):
        data = json.loads(event["data"])
        assert data.pop("id") == event["id"] and isinstance(data.get("token", 0), int)
        assert data == {k: int(v) if k in EVENT_NUMBERS else v for k, v in fields.items()}


def test_event_stream_backlog_and_bad_requests(stack: Stack) -> None:
    url = stack.nodes[1].url + "/events/stream"
    latest = stack.redis.client().xrevrange(KEYS.events, count=3)[::-1]
    with httpx.Client(timeout=30) as client:
        with client.stream("GET", url, params={"backlog": 3}) as r:
            first = Events(r).read(3)
        assert [e["id"] for e in first] == [i for i, _ in latest]
        # the query parameter does what the header does (for a fresh EventSource)
        with client.stream("GET", url, params={"last_event_id": latest[0][0]}) as r:
            resumed = Events(r).read(2)
        assert [e["id"] for e in resumed] == [i for i, _ in latest[1:]]
        for r in (
            client.get(url, headers={"Last-Event-ID": "yesterday"}),
            client.get(url, params={"last_event_id": "1"}),
        ):
            assert r.status_code == 400 and r.json()["error"]["code"] == "bad_input"
        for backlog in (5000, -1, "many"):
            r = client.get(url, params={"backlog": backlog})
            assert r.status_code == 422, r.text
            error = r.json()["error"]  # the project's shape, not FastAPI's {"detail": ...}
            assert (error["code"], error["field"]) == ("bad_input", "backlog")
            assert error["message"].startswith(f"backlog '{backlog}': ")


def test_event_stream_says_when_the_capped_stream_lost_events(stack: Stack) -> None:
    oldest = stack.redis.client().xrange(KEYS.events, "-", "+", count=1)[0][0]
    ms = oldest.partition("-")[0]
    before_oldest = f"{int(ms) - 1}-0"  # an id the stream has trimmed away, as it were
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "GET", stack.nodes[0].url + "/events/stream", headers={"Last-Event-ID": before_oldest}
        ) as r,
    ):
        gap, first = Events(r).read(2)
    assert gap["event"] == "gap" and "id" not in gap
    assert json.loads(gap["data"]) == {"after": before_oldest, "oldest": oldest}
    assert first["id"] == oldest


@pytest.mark.anyio
async def test_stream_heartbeats_when_quiet_and_ends_on_close() -> None:
    client = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    fleet = Fleet(heartbeat_s=0.05)
    stream = fleet.stream(EventStream(client, Settings()), "0-0")
    with anyio.fail_after(30):
        assert await anext(stream) == f"retry: {RETRY_MS}\n\n"
        assert await anext(stream) == ": keep-alive\n\n"  # nothing happened
        assert fleet.open == 1
        event_id = await client.xadd(KEYS.events, {"type": "drain", "device": "n/0"})
        chunk = await anext(stream)
        assert chunk.startswith(f"id: {event_id}\ndata: ") and chunk.endswith("\n\n")
        assert json.loads(chunk.splitlines()[1][6:]) == {
            "id": event_id,
            "type": "drain",
            "device": "n/0",
        }
        fleet.close()
        with pytest.raises(StopAsyncIteration):
            while True:  # at most one more heartbeat before the loop sees the close
                assert await anext(stream) == ": keep-alive\n\n"
    assert fleet.open == 0
    await client.aclose()


def test_sigterm_ends_open_streams_and_the_node_stops_gracefully(
    stack: Stack, tmp_path: Path
) -> None:
    node = Node(
        tmp_path,
        "node-stop",
        stack.redis.url,
        devices="cpu:1",
        env={"AFFINITY_CLUSTER_SECRET": "ui-secret"},  # the fleet's: another cannot join
    ).start(timeout=90)
    try:
        with (
            httpx.Client(timeout=httpx.Timeout(60.0)) as client,
            client.stream("GET", node.url + "/events/stream", params={"backlog": 1}) as r,
        ):
            assert r.status_code == 200
            events = Events(r)
            events.read(1)
            node.proc.send(signal.SIGTERM)
            events.drain()  # returns once the node ends the stream
        assert node.proc.popen is not None
        node.proc.popen.wait(60)
        log = node.proc.log()
        assert "deregistered" in log, log
        assert "graceful shutdown exceeded" not in log, log
    finally:
        node.stop()


@pytest.mark.anyio
async def test_stream_refused_when_too_many_are_open_or_the_node_stops() -> None:
    from tests.inproc import cluster, config

    client = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    async with cluster(client, [config("a")]) as (nodes, _):
        fleet: Fleet = nodes[0].app.state.fleet
        fleet.open = fleet.max_streams  # as if that many browsers were connected
        r = await nodes[0].client.get("/events/stream")
        assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_streams"
        fleet.open = 0
        fleet.close()
        r = await nodes[0].client.get("/events/stream")
        assert r.status_code == 503 and r.json()["error"]["code"] == "stopping"
        assert r.headers["retry-after"] == "1"
        r = await nodes[0].client.get("/nodes")
        assert r.status_code == 200 and [n["node"] for n in r.json()["nodes"]] == ["a"]
