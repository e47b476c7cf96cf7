"""Monitoring as shipped in ``docker/``: the alert rules (``promtool check rules`` and the
``promtool test rules`` unit tests), the Prometheus configuration, and the Grafana
dashboard, whose every PromQL expression must name only metrics, labels and label values
that a running node exports (read from the ``/metrics`` of two real nodes) and must be
accepted by a real Prometheus scraping them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from node.metrics import LABELS as NODE_LABELS
from node.shadow import SHADOW_LABELS
from tests.procs import ROOT, Node, RedisServer, wait_until
from tests.stack.prometheus import Prometheus, node_targets, query, scraped_nodes

PROMETHEUS_DIR = ROOT / "docker" / "prometheus"
ALERTS = PROMETHEUS_DIR / "alerts.yml"
ALERT_TESTS = PROMETHEUS_DIR / "alerts.test.yml"
PROMETHEUS_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
DASHBOARD = ROOT / "docker" / "grafana" / "affinity.json"
DATASOURCES = ROOT / "docker" / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
# labels Prometheus puts on every scraped series (`node` from prometheus.yml's targets)
TARGET_LABELS = {"job", "instance", "node"}
LABELS = {**NODE_LABELS, **SHADOW_LABELS}  # every series a node exports, documented
# Grafana's variables, as a Prometheus query would see them after Grafana's substitution
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$node": ".*"}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("promtool") is None:
        pytest.fail("promtool is not installed (bash .ci/run installs prometheus)", pytrace=False)
    return subprocess.run(
        ["promtool", *args], capture_output=True, text=True, timeout=120, cwd=PROMETHEUS_DIR
    )


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    return [r for group in doc["groups"] for r in group["rules"]]


def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return doc


def dashboard_exprs() -> list[str]:
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]
    for var in dashboard()["templating"]["list"]:
        q = var["query"]
        exprs.append(q["query"] if isinstance(q, dict) else q)
    return exprs


# -- alert rules ------------------------------------------------------------------------


def test_promtool_checks_the_rules() -> None:
    done = promtool("check", "rules", ALERTS.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    done = promtool("test", "rules", ALERT_TESTS.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_checks_the_prometheus_config() -> None:
    done = promtool("check", "config", PROMETHEUS_CONFIG.name)
    assert done.returncode == 0, done.stdout + done.stderr


# The alerts the issue asks for: (metric, an equality matcher its expression must have)
REQUIRED = {
    "a fenced node": ("affinity_fenced", None),
    "a device down": ("affinity_device_state", ("state", "down")),
    "claims answered full": ("affinity_routing_total", ("result", "full")),
    "forwards unreachable": ("affinity_forwarded_total", ("result", "unreachable")),
    "failed lease renewals": ("affinity_lease_renewals_total", ("result", "failed")),
}


def test_every_alert_the_issue_names_exists_and_says_what_to_do() -> None:
    all_rules = rules()
    for what, (metric, matcher) in REQUIRED.items():
        hits = [
            r
            for r in all_rules
            if any(
                ref.metric == metric and (matcher is None or matcher in ref.equal)
                for ref in references(r["expr"])
            )
        ]
        assert hits, f"no alert for {what}"
    tested = yaml.safe_load(ALERT_TESTS.read_text(encoding="utf-8"))
    cases = [c for t in tested["tests"] for c in t["alert_rule_test"]]
    for r in all_rules:
        name = r["alert"]
        assert re.fullmatch(r"\d+[smh]", r.get("for", "")), f"{name}: a for: duration"
        assert r["labels"]["severity"] in ("page", "warning"), name
        notes = r["annotations"]
        assert notes["summary"] and "$" in notes["description"], f"{name}: which, how much"
        assert len(notes["description"]) > 200, f"{name}: tell on-call what to check"
        # each alert is unit-tested firing and not firing
        mine = [c for c in cases if c["alertname"] == name]
        assert any(c["exp_alerts"] for c in mine), f"{name}: no promtool case where it fires"
        assert any(not c["exp_alerts"] for c in mine), f"{name}: no case where it stays quiet"


# -- PromQL references ------------------------------------------------------------------

KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "inf", "nan",
}  # fmt: skip
IDENT = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
GROUPING = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"


@dataclass
class Ref:
    """One metric a PromQL expression reads, and the labels it reads it by."""

    metric: str
    matchers: list[tuple[str, str, str]] = field(default_factory=list)  # (label, op, value)
    grouping: set[str] = field(default_factory=set)  # by/without/on/ignoring of the expr

    @property
    def equal(self) -> set[tuple[str, str]]:
        return {(label, value) for label, op, value in self.matchers if op == "="}


def references(expr: str) -> list[Ref]:
    """The metrics of ``expr`` with their label matchers, and the expression's grouping
    labels. Enough PromQL for what a dashboard and alert rules use: selectors, range
    selectors, functions, aggregations with by/without, vector matching, label_values()."""
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    values = re.match(rf"^label_values\(\s*({IDENT})\s*,\s*({IDENT})\s*\)$", expr.strip())
    if values:
        return [Ref(values[1], grouping={values[2]})]
    grouping: set[str] = set()
    for clause in re.finditer(
        r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr
    ):
        grouping |= {g.strip() for g in clause[1].split(",") if g.strip()}
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # range selectors
    refs = []
    for m in re.finditer(rf"({IDENT})?\s*(\{{[^}}]*\}})|({IDENT})(\s*\()?", expr):
        name = m[1] or m[3]
        if m[3] and (m[4] or m[3] in KEYWORDS):  # a function, an aggregation, a keyword
            continue
        if m[3] and re.fullmatch(r"\d.*", m[3]):
            continue
        matchers = [
            (label, op, value)
            for label, op, value in re.findall(rf'({IDENT})\s*(=~|!~|!=|=)\s*"([^"]*)"', m[2] or "")
        ]
        refs.append(Ref(name or "", matchers, grouping))
    return refs


def exported_samples(text: str) -> dict[str, str]:
    """Sample name -> metric family, from the ``# TYPE`` lines of a /metrics page (they
    are there even for a labelled series that has no child yet)."""
    out = {}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        if name.endswith("_created"):  # prometheus-client's creation times: not for panels
            continue
        if kind == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                out[name + suffix] = name
        else:
            out[name] = name
    return out


def problems(exprs: list[str], samples: dict[str, str]) -> list[str]:
    """Every reference in ``exprs`` to a series, a label or a label value a node does not
    export (``up`` is Prometheus' own series of each target)."""
    found = []
    for expr in exprs:
        refs = references(expr)
        if not refs:
            found.append(f"{expr}: reads no metric")
        allowed_grouping = set(TARGET_LABELS)
        for ref in refs:
            if ref.metric == "up":
                labels: dict[str, Any] = {}
            elif ref.metric not in samples:
                found.append(f"{expr}: {ref.metric or '(no name)'} is not exported")
                continue
            else:
                labels = dict(LABELS[samples[ref.metric]])
                if ref.metric.endswith("_bucket"):
                    labels["le"] = "le"
            allowed_grouping |= set(labels)
            for label, op, value in ref.matchers:
                if label not in labels and label not in TARGET_LABELS:
                    found.append(f"{expr}: {ref.metric} has no label {label!r}")
                elif (
                    op == "="
                    and isinstance(labels.get(label), tuple)
                    and value not in labels[label]
                ):
                    found.append(f"{expr}: {ref.metric}{{{label}}} is never {value!r}")
        for label in refs[0].grouping if refs else ():
            if label not in allowed_grouping:
                found.append(f"{expr}: groups by {label!r}, which no series of it has")
    return found


def test_the_reference_check_finds_wrong_names_labels_and_values() -> None:
    samples = {
        "affinity_routing_total": "affinity_routing_total",
        "affinity_fenced": "affinity_fenced",
    }
    assert (
        problems(["sum(rate(affinity_routing_total[5m]))", "affinity_fenced == 1"], samples) == []
    )
    bad = [
        "sum(rate(affinity_routed_total[5m]))",
        'affinity_routing_total{outcome="hit"}',
        'affinity_routing_total{result="missed"}',
        "sum by (device) (affinity_fenced)",
        "vector(1)",
    ]
    found = problems(bad, samples)
    assert len(found) == len(bad), found


# -- against real nodes -----------------------------------------------------------------


@dataclass
class Nodes:
    redis: RedisServer
    nodes: list[Node]
    metrics: str  # both nodes' /metrics pages


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    """node-a and node-b (the ids prometheus.yml scrapes) after some traffic: claims and
    hits, forwards, a bad request, a degraded one."""
    tmp: Path = tmp_path_factory.mktemp("monitoring")
    server = RedisServer(tmp)
    started = [
        Node(tmp, node_id, server.url, devices="cpu:2", env={"AFFINITY_CLUSTER_SECRET": "m"})
        for node_id in ("node-a", "node-b")
    ]
    try:
        server.start()
        for n in started:
            n.proc.start()
        for n in started:
            wait_until(n.ready, 90, f"node {n.node_id} ready")
        obs = {"obs": [[0.3] * 8]}
        with httpx.Client(timeout=30) as c:
            for i in range(8):
                for n in started:
                    r = c.post(n.url + "/act", json={"episode_id": f"m-{i}", "inputs": obs})
                    assert r.status_code == 200, r.text
            assert c.post(started[0].url + "/act", json={"inputs": {}}).status_code == 422
            r = c.post(started[0].url + "/act", json={"session_id": "s", "inputs": obs})
            assert r.status_code == 200
            pages = [c.get(n.url + "/metrics").text for n in started]
        yield Nodes(server, started, "\n".join(pages))
    finally:
        for n in started:
            n.stop()
        server.stop()


def test_dashboard_and_rules_read_only_what_nodes_export(nodes: Nodes) -> None:
    samples = exported_samples(nodes.metrics)
    own = {family for family in samples.values() if not family.startswith("process_")}
    assert own == set(LABELS), "the node exports its documented metrics"
    assert "process_resident_memory_bytes" in samples  # and prometheus-client's process series
    exprs = dashboard_exprs() + [r["expr"] for r in rules()]
    assert problems(exprs, samples) == []


def test_prometheus_evaluates_every_dashboard_query(
    nodes: Nodes, tmp_path_factory: pytest.TempPathFactory
) -> None:
    targets = {n.node_id: urlsplit(n.url).netloc for n in nodes.nodes}
    assert set(targets) == set(node_targets(yaml.safe_load(PROMETHEUS_CONFIG.read_text())))
    server = Prometheus(tmp_path_factory.mktemp("prometheus"), targets).start()
    try:
        wait_until(
            lambda: scraped_nodes(server.url) == dict.fromkeys(targets, 1.0),
            60,
            "Prometheus scraping both nodes",
            interval=0.5,
        )
        panels = {p["title"]: p for p in dashboard()["panels"]}
        for panel in panels.values():
            for target in panel["targets"]:
                expr = target["expr"]
                for var, value in GRAFANA_VARIABLES.items():
                    expr = expr.replace(var, value)
                query(server.url, expr)  # raises on any error Prometheus reports
        # the panels for what the traffic above produced show data
        for title in (
            "Routing results /s",
            "/act latency p50 and p99 by path",
            "Live episodes per device",
            "Device states",
            "Forward results /s",
            "Fenced nodes",
            "Lease renewals /s",
            "Fleet saturation per model version",
            "Step time p50 and p99 against the control period, by model",
        ):
            expr = panels[title]["targets"][0]["expr"]
            for var, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(var, value)
            wait_until(lambda e=expr: query(server.url, e), 60, f"data for {title!r}", 0.5)
        states = query(server.url, 'max by (device) (affinity_device_state{state="active"})')
        assert {s["metric"]["device"] for s in states} == {
            f"{n}/{i}" for n in targets for i in range(2)
        }
    finally:
        server.stop()


# -- the dashboard's shape --------------------------------------------------------------


def test_dashboard_shows_what_the_issue_asks_on_one_grid() -> None:
    doc = dashboard()
    assert doc["uid"] == "affinity" and doc["title"] == "affinity"
    datasource = yaml.safe_load(DATASOURCES.read_text(encoding="utf-8"))["datasources"][0]
    panels = doc["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in panels:
        assert p["title"] and p["description"], p["id"]
        assert p["datasource"]["uid"] == datasource["uid"]
        assert all(t["datasource"]["uid"] == datasource["uid"] for t in p["targets"])
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(g["x"] + dx, g["y"] + dy) for dx in range(g["w"]) for dy in range(g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for needed in (
        "affinity_routing_total",
        "histogram_quantile(0.5, sum by (le, path) (rate(affinity_act_seconds_bucket",
        "histogram_quantile(0.99, sum by (le, path) (rate(affinity_act_seconds_bucket",
        "affinity_live_episodes",
        "affinity_device_state",
        "affinity_crash_transitions_total",
        "affinity_forwarded_total",
        "affinity_fenced",
        "affinity_lease_renewals_total",
        # the autoscaling signals and the steps against their control period (issue 37)
        "max by (model) (affinity_fleet_saturation)",
        "affinity_admission_waiting",
        "histogram_quantile(0.99, sum by (le, model) (rate(affinity_step_seconds_bucket",
        "affinity_control_period_seconds",
        "affinity_deadline_miss_total",
        "affinity_step_part_seconds_bucket",
    ):
        assert needed in exprs, needed
