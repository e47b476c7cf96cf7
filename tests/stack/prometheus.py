"""A throwaway Prometheus (Debian's ``prometheus`` binary) running the compose stack's own
``docker/prometheus/prometheus.yml`` and ``alerts.yml``, with each node's target pointed
at a node on loopback and one-second scrape and evaluation intervals."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.procs import ROOT, Proc, free_port, wait_until

CONFIG_DIR = ROOT / "docker" / "prometheus"
CONFIG = CONFIG_DIR / "prometheus.yml"
JOB = "affinity"


def node_targets(config: dict[str, Any]) -> dict[str, str]:
    """node id -> target (``host:port``) of the ``affinity`` job, as the config has them."""
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == JOB]
    out = {}
    for static in job["static_configs"]:
        (target,) = static["targets"]
        out[static["labels"]["node"]] = target
    return out


class Prometheus:
    def __init__(self, tmp: Path, targets: dict[str, str]) -> None:
        """``targets``: node id -> ``host:port`` on loopback, for every node the config
        scrapes."""
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("prometheus is not installed (bash .ci/run installs it)", pytrace=False)
        config = yaml.safe_load(CONFIG.read_text(encoding="utf-8"))
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        (job,) = [j for j in config["scrape_configs"] if j["job_name"] == JOB]
        assert set(node_targets(config)) == set(targets), "the stack's node ids"
        for static in job["static_configs"]:
            static["targets"] = [targets[static["labels"]["node"]]]
        tmp.mkdir(parents=True, exist_ok=True)
        for rules in config.get("rule_files", []):
            shutil.copy(CONFIG_DIR / rules, tmp / rules)
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = Proc(
            [
                binary,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            None,
            tmp / "prometheus.log",
        )

    def start(self) -> Prometheus:
        self.proc.start()

        def ready() -> bool:
            assert self.proc.popen is not None
            if self.proc.popen.poll() is not None:
                raise AssertionError(f"prometheus exited:\n{self.proc.log()}")
            return httpx.get(self.url + "/-/ready", timeout=2).status_code == 200

        wait_until(ready, 60, "prometheus ready")
        return self

    def stop(self) -> None:
        self.proc.stop(signal.SIGKILL)


def query(url: str, expr: str) -> list[dict[str, Any]]:
    """An instant query; fails on any error Prometheus reports (syntax, types)."""
    r = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def scraped_nodes(url: str) -> dict[str, float]:
    """node -> value of ``up`` for the affinity job."""
    return {s["metric"]["node"]: float(s["value"][1]) for s in query(url, f'up{{job="{JOB}"}}')}
