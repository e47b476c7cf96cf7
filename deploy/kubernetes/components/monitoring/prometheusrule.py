"""Write prometheusrule.yaml beside this file from docker/prometheus/alerts.yml.

The Prometheus Operator takes alert rules as a PrometheusRule object, and kustomize cannot
read a file outside its directory, so the rules the compose stack's Prometheus loads are
copied here: run ``python3 deploy/kubernetes/components/monitoring/prometheusrule.py``
after changing docker/prometheus/alerts.yml. tests/test_kubernetes.py fails while the two
differ.
"""

from __future__ import annotations

from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ALERTS = HERE.parents[3] / "docker" / "prometheus" / "alerts.yml"
TARGET = HERE / "prometheusrule.yaml"
HEADER = """\
# Generated from docker/prometheus/alerts.yml by prometheusrule.py beside this file: edit
# the alerts there and run `python3 deploy/kubernetes/components/monitoring/prometheusrule.py`
# (tests/test_kubernetes.py checks that both hold the same rules).
"""


def render(alerts: str) -> str:
    """The PrometheusRule manifest holding the rule groups of ``alerts`` (alerts.yml's text)."""
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "affinity",
            "labels": {"app.kubernetes.io/name": "affinity"},
        },
        "spec": {"groups": yaml.safe_load(alerts)["groups"]},
    }
    return HEADER + yaml.safe_dump(rule, sort_keys=False, width=100, allow_unicode=True)


if __name__ == "__main__":
    TARGET.write_text(render(ALERTS.read_text()))
